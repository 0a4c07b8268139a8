// persistent_ring_plan.cpp — building and checking the persistent step's ring plan (see the header).
#include "persistent_ring_plan.h"

#include <algorithm>
#include <numeric>

#include "../core/errors.h"

namespace ti {

namespace {

constexpr size_t kRingPlanHeader = 128;  // cuda/ring.cuh's kRingHeader (static_assert in cuda/persistent.cu)

bool streams(TaskType t) {
  return t == TaskType::Qkv || t == TaskType::O || t == TaskType::GateUp || t == TaskType::Down ||
         t == TaskType::LmHead;
}

// A task's matrix rows [r0, r1) (GateUp: gate/up rows 2a .. 2b).
void task_rows(const PTask& t, int& r0, int& r1) {
  const int f = t.type == TaskType::GateUp ? 2 : 1;
  r0 = f * t.a;
  r1 = f * t.b;
}

int round16(int b) { return (b + 15) / 16 * 16; }

// Rows per tile for a matrix kind (0: cannot be tiled). `unit`: the rows that must stay together (2 for GateUp).
int tile_rows(const RingMatrix& m, int slot_bytes, int unit) {
  if (m.row_bytes <= 0 || m.row_bytes % 16) return 0;
  const int per_row = m.row_bytes + m.scale_row_bytes;
  int r = (slot_bytes - 16) / per_row;  // (16: a scale copy rounded up)
  if (r >= 8) return r / 8 * 8;
  // fewer than 8: a multiple of what keeps every scale copy's source 16-byte aligned, and of `unit`
  int m16 = 1;
  while (m.scale_row_bytes && (m16 * m.scale_row_bytes) % 16) m16++;
  const int step = std::lcm(m16, unit);
  r = r / step * step;
  return r;
}

}  // namespace

size_t RingPlan::n_tiles() const {
  size_t n = 0;
  for (const auto& b : blocks) n += b.size();
  return n;
}

size_t ring_plan_smem(int slots, int slot_bytes) { return kRingPlanHeader + (size_t)slots * (size_t)slot_bytes; }

std::string ring_smem_problem(int slots, int slot_bytes, size_t need, size_t max_smem) {
  return std::to_string(slots) + " slots of " + std::to_string(slot_bytes / 1024) + " KiB need " +
         std::to_string(need) + " bytes of shared memory per block with the rest of the kernel's, over the " +
         std::to_string(max_smem) + " a block may have (fewer or smaller slots)";
}

RingPlan build_ring_plan(const PersistentSchedule& s, const RingPlanShape& shape) {
  if (shape.slots < 2 || shape.slots > 8)
    fail(ErrorKind::Request, "persistent_ring_slots must be 2 to 8, got " + std::to_string(shape.slots));
  if (shape.slot_bytes < 1024 || shape.slot_bytes > (128 << 10) || shape.slot_bytes % 1024)
    fail(ErrorKind::Request, "persistent ring slot size must be 1 to 128 KiB, got " +
                                 std::to_string(shape.slot_bytes) + " bytes");
  RingPlan plan;
  plan.slots = shape.slots;
  plan.slot_bytes = shape.slot_bytes;
  plan.blocks.resize(s.blocks.size());
  plan.task_tiles.resize(s.blocks.size());
  for (size_t b = 0; b < s.blocks.size(); b++) {
    const auto& list = s.blocks[b];
    plan.task_tiles[b].assign(list.size(), 0);
    for (size_t i = 0; i < list.size(); i++) {
      const PTask& t = list[i];
      if (!streams(t.type)) continue;
      const RingMatrix& m = shape.mats[(int)t.type];
      const int per = tile_rows(m, shape.slot_bytes, t.type == TaskType::GateUp ? 2 : 1);
      if (per < 1) continue;
      int r0 = 0, r1 = 0;
      task_rows(t, r0, r1);
      std::vector<RingTile> ts;
      bool fits = true;
      for (int r = r0; r < r1; r += per) {
        RingTile k;
        k.task = (int32_t)i;
        k.type = (int32_t)t.type;
        k.layer = t.layer;
        k.row0 = r;
        k.rows = std::min(per, r1 - r);
        k.bytes = k.rows * m.row_bytes;
        k.scale_bytes = m.scale_row_bytes ? round16(k.rows * m.scale_row_bytes) : 0;
        // a scale copy rounded up past the end of the array: this task reads from global memory instead
        if (m.scale_row_bytes && (long long)k.row0 * m.scale_row_bytes + k.scale_bytes > m.scale_alloc) fits = false;
        ts.push_back(k);
      }
      if (!fits) continue;
      plan.blocks[b].insert(plan.blocks[b].end(), ts.begin(), ts.end());
      plan.task_tiles[b][i] = (int32_t)ts.size();
    }
  }
  return plan;
}

void check_ring_plan(const RingPlan& plan, const PersistentSchedule& s, const RingPlanShape& shape,
                     size_t other_smem, size_t max_smem) {
  auto bad = [](const std::string& m) { fail(ErrorKind::Device, "persistent ring plan rejected: " + m); };
  if (plan.slots < 2 || plan.slots > 8) bad("slots " + std::to_string(plan.slots) + " not within 2..8");
  if (plan.slot_bytes < 16 || plan.slot_bytes % 16) bad("slot bytes " + std::to_string(plan.slot_bytes));
  const size_t need = ring_plan_smem(plan.slots, plan.slot_bytes) + other_smem;
  if (need > max_smem) bad(ring_smem_problem(plan.slots, plan.slot_bytes, need, max_smem));
  if (plan.blocks.size() != s.blocks.size() || plan.task_tiles.size() != s.blocks.size())
    bad("its block lists do not match the schedule's grid");
  // covered[type][layer]: the rows of ringed tasks, each to be covered exactly once
  std::vector<std::vector<std::vector<int>>> cover(8);
  auto rows_of = [&](int type, int layer) -> std::vector<int>& {
    auto& byl = cover[(size_t)type];
    if ((int)byl.size() <= layer) byl.resize((size_t)layer + 1);
    auto& v = byl[(size_t)layer];
    if (v.empty()) v.assign((size_t)std::max(shape.mats[type].rows, 0), 0);
    return v;
  };
  for (size_t b = 0; b < plan.blocks.size(); b++) {
    const auto& tiles = plan.blocks[b];
    const auto& list = s.blocks[b];
    if (plan.task_tiles[b].size() != list.size()) bad("block " + std::to_string(b) + ": task_tiles size");
    std::vector<int32_t> count(list.size(), 0);
    int last_task = -1;
    for (size_t j = 0; j < tiles.size(); j++) {
      const RingTile& k = tiles[j];
      const std::string who = "block " + std::to_string(b) + " tile " + std::to_string(j);
      if (k.task < 0 || k.task >= (int)list.size()) bad(who + " names a task out of its block's list");
      if (k.task < last_task) bad(who + " is consumed before the tile issued ahead of it (out of task order)");
      if (k.task != last_task && last_task >= 0 && count[(size_t)k.task] != 0)
        bad(who + ": its task's tiles are not consecutive");
      last_task = k.task;
      count[(size_t)k.task]++;
      const PTask& t = list[(size_t)k.task];
      if (!streams(t.type) || (int)t.type != k.type || t.layer != k.layer)
        bad(who + " does not belong to its task (" + task_name(t.type) + ")");
      const RingMatrix& m = shape.mats[k.type];
      int r0 = 0, r1 = 0;
      task_rows(t, r0, r1);
      if (k.rows < 1 || k.row0 < r0 || k.row0 + k.rows > r1) bad(who + " lies outside its task's rows");
      if (t.type == TaskType::GateUp && (k.row0 % 2 || k.rows % 2)) bad(who + " splits a gate/up pair");
      if (k.bytes != k.rows * m.row_bytes || k.bytes % 16 || m.row_bytes % 16) bad(who + ": weight bytes");
      if ((long long)k.row0 * m.row_bytes % 16) bad(who + ": weight source not 16-byte aligned");
      if (m.scale_row_bytes) {
        const long long off = (long long)k.row0 * m.scale_row_bytes;
        if (off % 16 || k.scale_bytes % 16 || k.scale_bytes < k.rows * m.scale_row_bytes)
          bad(who + ": scale copy not 16-byte aligned or short");
        if (off + k.scale_bytes > m.scale_alloc) bad(who + ": scale copy past the scale array");
      } else if (k.scale_bytes) {
        bad(who + ": scales for an fp16 matrix");
      }
      if (k.bytes + k.scale_bytes > plan.slot_bytes) bad(who + " does not fit a slot");
      auto& rows = rows_of(k.type, k.layer);
      if ((int)rows.size() < k.row0 + k.rows) bad(who + " lies past its matrix's rows");
      for (int r = k.row0; r < k.row0 + k.rows; r++)
        if (rows[(size_t)r]++) bad(who + " covers row " + std::to_string(r) + " a second time");
    }
    for (size_t i = 0; i < list.size(); i++) {
      if (count[i] != plan.task_tiles[b][i]) bad("block " + std::to_string(b) + " task " + std::to_string(i) +
                                                 ": task_tiles says " + std::to_string(plan.task_tiles[b][i]) +
                                                 " tiles, the list has " + std::to_string(count[i]));
      if (count[i] == 0) continue;
      int r0 = 0, r1 = 0;
      task_rows(list[i], r0, r1);
      const auto& rows = rows_of((int)list[i].type, list[i].layer);
      for (int r = r0; r < r1; r++)
        if (rows[(size_t)r] != 1)
          bad("block " + std::to_string(b) + " task " + std::to_string(i) + " (" + task_name(list[i].type) +
              "): row " + std::to_string(r) + " not in any of its tiles");
    }
  }
}

}  // namespace ti
