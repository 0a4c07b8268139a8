// persistent_schedule.h — the persistent decode step's schedule as plain data (docs/ARCHITECTURE.md, issue 16): per
// block of the persistent kernel an ordered list of tasks, built at load from the model's shape and checked on the
// host before the kernel may run it. Plain C++ (no CUDA): built everywhere, its checker tested without a GPU.
//
// A task is one unit of one phase of the step (embedding rows, QKV rows, one (KV head, context chunk) attention
// partial, one head's merge, O rows, gate/up rows, down rows, LM-head rows). It waits on at most one counter (the
// previous phase's, in global memory: cuda/sync.cuh) until that counter's producers have all signalled this step,
// and signals one counter when its output is written. Counters never reset: at step e (1, 2, ...) a counter that
// P tasks signal once per step holds e * P, so a task waits for epoch * wait_count.
//
// Why all-to-all per phase (every task of a phase waits for every task of the previous one) in this first
// version: it is the simplest order that is obviously deadlock-free and makes every read-after-write and
// write-after-read between phases safe (a phase's buffer is rewritten only two phases later, after every reader
// of it signalled). Finer counters (per KV head between QKV and attention) are a later step; the checker below
// does not assume all-to-all: it simulates the schedule.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ti {

enum class TaskType : int32_t { Embed, Qkv, AttnPartial, AttnMerge, O, GateUp, Down, LmHead };
const char* task_name(TaskType t);

// The device reads this struct as it is (cuda/persistent.cu): plain int32 fields only.
struct PTask {
  TaskType type = TaskType::Embed;
  int32_t layer = 0;
  int32_t a = 0, b = 0;        // rows / outputs [a, b); AttnPartial: (KV head a, chunk b); AttnMerge: query head a
  int32_t wait = -1;           // counter awaited (-1: none)
  int32_t wait_count = 0;      // its producers per step: the task waits for epoch * wait_count
  int32_t signal = -1;         // counter signalled once when done (-1: none)
};

// What the schedule is built from: the model's shape and the kernel's grid.
struct ScheduleShape {
  int hidden = 0, q_dim = 0, kv_dim = 0, intermediate = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, vocab = 0;
  int max_chunks = 0;  // attention chunks of the longest context (max_seq / chunk, rounded up)
  int grid = 0;        // blocks of the persistent kernel
  // No merge phase: the last attention task of a KV head to finish merges its chunks (cuda/persistent.cu), and
  // the O phase waits on the attention partials' counter. One hand-off and one phase fewer per layer.
  bool fused_merge = false;
};

struct PersistentSchedule {
  int grid = 0, n_counters = 0;
  std::vector<std::vector<PTask>> blocks;  // blocks[b]: block b's tasks in order
  int final_counter = -1;                  // signalled by the LM head's tasks: the logits are complete
  size_t n_tasks() const;
};

// The step's schedule: phases in order, each phase's units split into at most `grid` tasks, dealt to the blocks
// round-robin (starting one block further each phase so the small phases do not always load the same blocks).
// Throws ti::Error(Request) on a shape it cannot schedule.
PersistentSchedule build_persistent_schedule(const ScheduleShape& s);

// Throws ti::Error(Device) naming the first problem unless the schedule is safe to run on `max_coresident`
// co-resident blocks: grid <= max_coresident; every counter index in range; every awaited counter signalled by
// exactly wait_count tasks per step (fewer hangs; more lets a later step pass early); no task waits on the counter
// it signals itself; and a simulation of one step (each block running its list in order, a task starting when
// its counter reached its target) completes every task — which is what rules out cycles and a block waiting on
// its own later task.
void check_persistent_schedule(const PersistentSchedule& s, int max_coresident);

}  // namespace ti
