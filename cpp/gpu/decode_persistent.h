// decode_persistent.h — the persistent decode step on the host (issue 16, docs/ARCHITECTURE.md): the schedule built
// from the config and the weights' format at load (persistent_schedule.h), checked against the co-residency the
// occupancy API reports, uploaded with the kernel's parameters; then one launch per token (cuda/persistent.cu),
// captured by the engine into a graph with the sampler. The graph path (decode_step.h) stays the reference and the
// fallback.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../../cuda/persistent.cuh"
#include "../core/config.h"
#include "decode_step.h"
#include "device_weights.h"
#include "persistent_ring_plan.h"
#include "persistent_schedule.h"

namespace ti {

// Which decode pass CudaEngine::decode() replays (CudaOptions::decode_path).
enum class DecodePath { Graph, Persistent, Auto };  // Auto: persistent where it can run, else graph
const char* decode_path_name(DecodePath p);         // "graph" | "persistent" | "auto"

// CudaOptions' persistent_* fields, as the step takes them.
struct PersistentOptions {
  bool prefetch = true;     // tasks ask their first weights into L2 before their waits
  bool fused_merge = true;  // ScheduleShape::fused_merge
  int blocks_per_sm = 2;    // the grid: min(co-resident, blocks_per_sm x SMs)
  int timeout_ms = 2000;    // a wait's bound
  bool ring = true;         // the weight ring across task boundaries (persistent_ring_plan.h)
  int ring_slots = 4;       // its slots per block (2..8)
  int ring_slot_kib = 32;   // its slot size (1..128 KiB)
  bool kv_stage = true;     // attention tasks copy their chunk's earlier keys / values before their wait
};

class PersistentDecode {
 public:
  // Why the persistent step cannot run for this model / device ("": it can). Checked before construction so that
  // DecodePath::Auto falls back quietly and DecodePath::Persistent fails with this sentence.
  static std::string unsupported(const ModelConfig& c, const DeviceWeights& w, const DecodeBuffers& b);
  // Builds, checks (throws ti::Error(Device) on a schedule that could hang) and uploads the schedule.
  PersistentDecode(const ModelConfig& c, const DeviceWeights& w, const DecodeBuffers& b,
                   const PersistentOptions& o, DeviceArena& arena, cudaStream_t s);
  // One step (state.token at state.pos -> logits): one launch. Graph-capturable.
  void record(cudaStream_t s) const;
  // Throws ti::Error(Device) if a wait of an earlier launch timed out (call after a stream synchronise); the
  // counters are then zeroed so that the next step starts a fresh epoch.
  void check(cudaStream_t s) const;
  void skew_epoch(int by, cudaStream_t s) const;  // tests: the next step's waits can never succeed
  // Tracing (DecodeBuffers::trace set, a TINYINFER_TRACE build): the stamps zeroed; then, after steps, per task
  // of the schedule (blocks in order, each block's list in order) kTraceColumns values: block, task type, layer,
  // a, b, and the global-timer ns at its start, after its wait, at its end, after its input's staging (GEMV and
  // attention tasks; 0: not reached, or another task).
  static constexpr int kTraceColumns = 9;
  bool traced() const { return p_.trace != nullptr; }
  void clear_trace(cudaStream_t s) const;
  std::vector<int64_t> read_trace(cudaStream_t s) const;
  int grid() const { return sched_.grid; }
  int max_coresident() const { return max_coresident_; }
  const PersistentSchedule& schedule() const { return sched_; }
  const RingPlan& ring_plan() const { return ring_; }  // (slots 0: the ring is off)
  bool kv_stage() const { return p_.kv_stage; }

 private:
  static std::string ring_unsupported(const DeviceWeights& w);
  void upload_ring(const DeviceWeights& w, const std::vector<cuda::PLayer>& layers, DeviceArena& arena);
  PersistentSchedule sched_;
  RingPlan ring_;
  cuda::PersistentParams p_;
  int max_coresident_ = 0;
  size_t sync_words_ = 0;  // counters + epoch + finish + error, zeroed together
  uint32_t* sync_base_ = nullptr;
};

}  // namespace ti
