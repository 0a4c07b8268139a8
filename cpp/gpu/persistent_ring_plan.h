// persistent_ring_plan.h — which weight tile each block of the persistent decode step streams into its
// shared-memory ring, in which order (issue 16, docs/perf/persistent.md §7). Plain C++ (no CUDA): built at load
// from the schedule, checked on the host, tested without a GPU.
//
// Why a plan: the ring must run across task boundaries. A block knows its whole task list ahead (the schedule),
// so before it waits on the counter of its current task it can already be copying the weights of that task and
// of the next ones into its ring (cuda/persistent.cu): the weight stream no longer stops at every hand-off.
// The order of the copies is fixed at load: per block, the tiles of its GEMV tasks in task order, each tile a
// run of whole rows of one matrix (and, for int8 / int4, the same rows' scales) that fits one slot. The kernel
// walks the list with two cursors (issued, consumed); a tile goes into slot (its index % slots).
//
// Deadlock freedom: a tile's copy waits on nothing but its slot being released, and slots are released in
// issue order by the tasks that consume them, which run in list order; a task consumes only tiles of its own
// (task index >= the task at which the tile was issued). So the ring adds no wait between blocks: the schedule's
// check (persistent_schedule.h) still decides whether a step completes. check_ring_plan asserts exactly those
// properties.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "persistent_schedule.h"

namespace ti {

// What one matrix kind's rows look like in the ring (the same for every layer). Indexed by TaskType: Qkv, O,
// GateUp, Down, LmHead; the other types stream nothing.
struct RingMatrix {
  int32_t rows = 0;            // rows of the matrix (GateUp: 2 x intermediate, gate/up interleaved)
  int32_t row_bytes = 0;       // bytes of one row of weights (a multiple of 16)
  int32_t scale_row_bytes = 0; // bytes of one row's scales (0: fp16), contiguous by rows after the row's weights
  int32_t scale_alloc = 0;     // bytes allocated for the whole scale array (a copy rounded up must stay inside)
};

// The device reads this struct as it is (cuda/persistent.cu): plain int32 fields only.
struct RingTile {
  int32_t task = 0;    // index of the consuming task in its block's list
  int32_t type = 0;    // TaskType of that task (the matrix kind)
  int32_t layer = 0;
  int32_t row0 = 0;    // first matrix row (GateUp: a physical row, even)
  int32_t rows = 0;    // rows in the tile (GateUp: even)
  int32_t bytes = 0;   // weight bytes copied: rows x row_bytes
  int32_t scale_bytes = 0;  // scale bytes copied (rows x scale_row_bytes rounded up to 16; 0: fp16), after the weights
};

struct RingPlanShape {
  int slots = 4;              // slots per block's ring (2..8)
  int slot_bytes = 32 << 10;  // bytes per slot (a multiple of 16)
  RingMatrix mats[8];         // by TaskType (only the GEMV types used)
};

struct RingPlan {
  int slots = 0, slot_bytes = 0;
  std::vector<std::vector<RingTile>> blocks;  // per block: its tiles in stream (= consumption) order
  // per block, per task of the schedule: how many tiles it consumes (0: the task reads its weights from global)
  std::vector<std::vector<int32_t>> task_tiles;
  size_t n_tiles() const;
};

// Shared memory of a ring: kRingHeader (its mbarriers, cuda/ring.cuh) + slots x slot_bytes.
size_t ring_plan_smem(int slots, int slot_bytes);
// The sentence naming a ring that does not fit (need: the kernel's whole dynamic shared memory with it).
std::string ring_smem_problem(int slots, int slot_bytes, size_t need, size_t max_smem);

// The plan for a schedule. Tiles hold the most rows that fit a slot (weights + scales), a multiple of 8 rows
// where that many fit (so that every int8 / int4 scale copy starts 16-byte aligned) and a multiple of the rows
// needed for 16-byte aligned scale copies otherwise; GateUp tiles hold whole gate/up pairs. A task whose rows
// cannot be tiled (a row wider than a slot) gets no tiles: it reads from global memory as without the ring.
// Throws ti::Error(Request) on slots / slot_bytes out of range.
RingPlan build_ring_plan(const PersistentSchedule& s, const RingPlanShape& shape);

// Throws ti::Error(Device) naming the first problem unless: slots within 2..8 and the ring's shared memory
// (ring_plan_smem) plus `other_smem` within `max_smem` (the block's dynamic shared memory limit); every tile
// within a slot, 16-byte aligned (sources and sizes), inside its matrix (scale copies inside the allocation);
// each block's tiles in non-decreasing task order, each task's tiles consecutive and counted in task_tiles,
// each tile consumed by a GEMV task of its own block whose rows contain it (a block never waits on a tile it
// would issue later: it issues in consumption order); and every row of every ringed task covered exactly once.
void check_ring_plan(const RingPlan& plan, const PersistentSchedule& s, const RingPlanShape& shape,
                     size_t other_smem, size_t max_smem);

}  // namespace ti
