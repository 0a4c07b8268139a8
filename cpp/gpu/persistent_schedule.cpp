// persistent_schedule.cpp — building and checking the persistent decode step's schedule (see the header).
#include "persistent_schedule.h"

#include <algorithm>

#include "../core/errors.h"

namespace ti {

const char* task_name(TaskType t) {
  switch (t) {
    case TaskType::Embed: return "embed";
    case TaskType::Qkv: return "qkv";
    case TaskType::AttnPartial: return "attn_partial";
    case TaskType::AttnMerge: return "attn_merge";
    case TaskType::O: return "o";
    case TaskType::GateUp: return "gate_up";
    case TaskType::Down: return "down";
    case TaskType::LmHead: return "lm_head";
  }
  return "?";
}

size_t PersistentSchedule::n_tasks() const {
  size_t n = 0;
  for (const auto& b : blocks) n += b.size();
  return n;
}

namespace {

// Builds the phases in order; each phase's tasks wait on the previous phase's counter.
class Builder {
 public:
  explicit Builder(int grid) { s_.grid = grid; s_.blocks.resize((size_t)grid); }

  // `units` outputs split into at most grid tasks of contiguous ranges (a multiple of `align` each but the last).
  void rows(TaskType t, int layer, int units, int align = 1) {
    const int n = std::min(s_.grid, (units + align - 1) / align);
    const int per = (units + n - 1) / n;
    const int step = (per + align - 1) / align * align;
    std::vector<PTask> ts;
    for (int a = 0; a < units; a += step) ts.push_back(task(t, layer, a, std::min(units, a + step)));
    phase(ts);
  }
  // One task per (i, j) of an n x m grid of units (attention: KV head x chunk), or per i (m = 0).
  void units(TaskType t, int layer, int n, int m) {
    std::vector<PTask> ts;
    for (int i = 0; i < n; i++)
      for (int j = 0; j < std::max(m, 1); j++) ts.push_back(task(t, layer, i, j));
    phase(ts);
  }
  PersistentSchedule finish() {
    s_.final_counter = prev_;
    return std::move(s_);
  }

 private:
  static PTask task(TaskType t, int layer, int a, int b) {
    PTask k;
    k.type = t;
    k.layer = layer;
    k.a = a;
    k.b = b;
    return k;
  }
  void phase(std::vector<PTask>& ts) {
    const int counter = s_.n_counters++;
    for (size_t i = 0; i < ts.size(); i++) {
      PTask& k = ts[i];
      k.wait = prev_;
      k.wait_count = prev_ < 0 ? 0 : prev_producers_;
      k.signal = counter;
      s_.blocks[(size_t)((start_ + (int)i) % s_.grid)].push_back(k);
    }
    start_ = (start_ + (int)ts.size()) % s_.grid;
    prev_ = counter;
    prev_producers_ = (int)ts.size();
  }
  PersistentSchedule s_;
  int prev_ = -1, prev_producers_ = 0, start_ = 0;
};

}  // namespace

PersistentSchedule build_persistent_schedule(const ScheduleShape& s) {
  if (s.grid < 1) fail(ErrorKind::Request, "persistent schedule: grid must be >= 1");
  if (s.hidden < 1 || s.n_layers < 1 || s.n_heads < 1 || s.n_kv_heads < 1 || s.vocab < 1 || s.max_chunks < 1 ||
      s.intermediate < 1 || s.n_heads % s.n_kv_heads)
    fail(ErrorKind::Request, "persistent schedule: bad model shape");
  Builder b(s.grid);
  b.rows(TaskType::Embed, 0, s.hidden, 8);
  for (int l = 0; l < s.n_layers; l++) {
    b.rows(TaskType::Qkv, l, s.q_dim + 2 * s.kv_dim, 8);
    b.units(TaskType::AttnPartial, l, s.n_kv_heads, s.max_chunks);
    if (!s.fused_merge) b.units(TaskType::AttnMerge, l, s.n_heads, 0);
    b.rows(TaskType::O, l, s.hidden, 8);
    b.rows(TaskType::GateUp, l, s.intermediate, 8);  // outputs of silu(gate) * up: rows 2i, 2i + 1 each
    b.rows(TaskType::Down, l, s.hidden, 8);
  }
  b.rows(TaskType::LmHead, 0, s.vocab, 8);
  return b.finish();
}

void check_persistent_schedule(const PersistentSchedule& s, int max_coresident) {
  auto bad = [](const std::string& m) { fail(ErrorKind::Device, "persistent schedule rejected: " + m); };
  if (s.grid < 1 || (int)s.blocks.size() != s.grid) bad("grid " + std::to_string(s.grid) + " != its block lists");
  if (s.grid > max_coresident)
    bad("grid " + std::to_string(s.grid) + " exceeds the " + std::to_string(max_coresident) +
        " co-resident blocks (the blocks would wait on blocks that never start)");
  std::vector<int> producers((size_t)s.n_counters, 0);
  for (int b = 0; b < s.grid; b++)
    for (const PTask& t : s.blocks[(size_t)b]) {
      if (t.signal >= s.n_counters || t.wait >= s.n_counters || t.signal < -1 || t.wait < -1)
        bad(std::string(task_name(t.type)) + " task of block " + std::to_string(b) + " names a counter out of range");
      if (t.signal >= 0) producers[(size_t)t.signal]++;
    }
  for (int b = 0; b < s.grid; b++)
    for (size_t i = 0; i < s.blocks[(size_t)b].size(); i++) {
      const PTask& t = s.blocks[(size_t)b][i];
      if (t.wait < 0) continue;
      const std::string who = std::string(task_name(t.type)) + " task " + std::to_string(i) + " of block " +
                              std::to_string(b) + " (layer " + std::to_string(t.layer) + ")";
      if (t.wait_count < 1) bad(who + " waits on counter " + std::to_string(t.wait) + " for no producer");
      if (producers[(size_t)t.wait] != t.wait_count)
        bad(who + " waits for " + std::to_string(t.wait_count) + " signals of counter " + std::to_string(t.wait) +
            ", which " + std::to_string(producers[(size_t)t.wait]) + " tasks signal per step");
      if (t.signal == t.wait) bad(who + " waits on the counter it signals itself");
    }
  // One step, simulated: a block runs its next task once its counter reached the target.
  std::vector<size_t> next((size_t)s.grid, 0);
  std::vector<int> value((size_t)s.n_counters, 0);
  size_t done = 0, total = s.n_tasks();
  while (done < total) {
    bool progress = false;
    for (int b = 0; b < s.grid; b++) {
      auto& list = s.blocks[(size_t)b];
      while (next[(size_t)b] < list.size()) {
        const PTask& t = list[next[(size_t)b]];
        if (t.wait >= 0 && value[(size_t)t.wait] < t.wait_count) break;
        if (t.signal >= 0) value[(size_t)t.signal]++;
        next[(size_t)b]++;
        done++;
        progress = true;
      }
    }
    if (!progress) {
      for (int b = 0; b < s.grid; b++) {
        if (next[(size_t)b] == s.blocks[(size_t)b].size()) continue;
        const PTask& t = s.blocks[(size_t)b][next[(size_t)b]];
        bad("deadlock: block " + std::to_string(b) + " task " + std::to_string(next[(size_t)b]) + " (" +
            task_name(t.type) + ", layer " + std::to_string(t.layer) + ") waits on counter " +
            std::to_string(t.wait) + " at " + std::to_string(value[(size_t)t.wait]) + " of " +
            std::to_string(t.wait_count));
      }
    }
  }
}

}  // namespace ti
