// persistent.cuh — the persistent decode step's kernel (see persistent.cu): its parameters and its launcher.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../cpp/gpu/persistent_schedule.h"
#include "quant.cuh"
#include "sampling.cuh"

namespace ti::cuda {

constexpr int kPersistentThreads = 256;
// per task in a trace: start, after the wait, end, and (GEMV and attention tasks) after the input's staging
// (bench/tools/trace_persistent.py)
constexpr int kTaskStamps = 4;

struct PLayer {  // one layer's matrices (quant.cuh: fp16, or I8 / I4 with their scales)
  QMat qkv;      // (q_dim + 2 kv_dim, hidden)
  QMat o;        // (hidden, q_dim)
  QMat gate_up;  // (2 intermediate, hidden), rows interleaved gate_0, up_0, ...
  QMat down;     // (hidden, intermediate)
  const float* attn_norm = nullptr;
  const float* mlp_norm = nullptr;
};

// One tile of a block's ring plan (cpp/gpu/persistent_ring_plan.h) as the kernel copies it: the plan's rows
// resolved to addresses at load (weights, then the same rows' scales; scale_bytes 0 for fp16).
struct PTileCopy {
  const void* w = nullptr;
  const void* scales = nullptr;
  uint32_t bytes = 0, scale_bytes = 0;
};

struct PersistentParams {
  // the schedule (device copies): block b runs tasks[begin[b] .. begin[b + 1])
  const PTask* tasks = nullptr;
  const int* begin = nullptr;
  // synchronisation (sync.cuh, device code only: not included here, the bindings see this header): counters
  // sync::kCounterStride words apart; epoch = steps completed (written by the last block to finish a step);
  // finish counts blocks done (grid per step); error: 3 words. The waits' policy (sync::WaitPolicy's fields).
  uint32_t* counters = nullptr;
  uint32_t* epoch = nullptr;
  uint32_t* finish = nullptr;
  uint32_t* error = nullptr;
  uint32_t max_sleep_ns = 0;
  unsigned long long timeout_ns = 2000000000ull;
  bool prefetch = true;  // each task's first weights (or KV rows) asked into L2 before its wait
  // TINYINFER_TRACE builds (common.cuh): kTaskStamps global-timer ns per task of the flattened schedule (task i
  // at trace[kTaskStamps * i]): its start (before its prefetch), after its wait, after its signal, and after its
  // input is staged (GEMV: in shared memory; attention: q rotated, the new key / value written; else 0). nullptr: off.
  unsigned long long* trace = nullptr;
  // ScheduleShape::fused_merge: no merge tasks; arrivals (n_layers x n_kv_heads words, zero between steps) count a
  // KV head's finished attention chunks, and the last one merges them.
  bool fused_merge = false;
  uint32_t* arrivals = nullptr;
  // The weight ring (CudaOptions::persistent_ring; ring_slots 0: off): block b streams copies[ring_begin[b] ..
  // ring_begin[b + 1]) in order through ring_slots slots of ring_slot_bytes; the GEMV task i of the flattened
  // schedule consumes its rows from the ring in tiles of task_tile_rows[i] rows (0: from global memory).
  const PTileCopy* ring_copies = nullptr;
  const int* ring_begin = nullptr;
  const int* task_tile_rows = nullptr;
  int ring_slots = 0, ring_slot_bytes = 0;
  uint32_t ring_offset = 0;  // bytes into the dynamic shared memory (persistent_ring_offset)
  // Attention tasks copy their chunk's cached keys and values (positions before pos: final) into shared memory
  // before their wait (cp.async); only the new token's q / k / v is read after it.
  bool kv_stage = false;
  // the model
  const PLayer* layers = nullptr;
  const __half* embedding = nullptr;  // (vocab, ld_h)
  QMat lm_head;                       // (vocab, hidden)
  const float* final_norm = nullptr;
  int hidden = 0, q_dim = 0, kv_dim = 0, intermediate = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, vocab = 0;
  int ld_h = 0;      // the embedding's row stride
  int stage_max = 0;  // the widest staged input of any matrix (halves): the shared memory it needs
  float eps = 1e-5f, scale = 1.0f;
  // the step's buffers (decode_step.h, DecodeBuffers)
  float* x = nullptr;
  float* qkv = nullptr;
  __half* att = nullptr;
  __half* h = nullptr;
  float* logits = nullptr;
  float* part_o = nullptr;
  float* part_ml = nullptr;
  const float* rope_cos = nullptr;
  const float* rope_sin = nullptr;
  __half* k_pages = nullptr;
  __half* v_pages = nullptr;
  size_t kv_layer_elems = 0;
  const int* page_table = nullptr;
  int page_shift = 6, chunk = 64, max_chunks = 1;
  const DecodeState* state = nullptr;  // token and pos of this step (the sampler after the kernel advances them)
};

// Dynamic shared memory the kernel needs for these shapes, without the ring (its ring, if any, comes after:
// persistent_ring_offset(p) bytes in, ring_smem_bytes(slots, slot bytes) long). kv_stage adds the attention's
// key and value tiles.
size_t persistent_smem(const PersistentParams& p);
size_t persistent_ring_offset(const PersistentParams& p);
// The kernel's dynamic shared memory: the above plus the ring (p.ring_slots, p.ring_slot_bytes).
size_t persistent_total_smem(const PersistentParams& p);
// The largest dynamic shared memory one block may have on device 0 (the opt-in limit).
size_t persistent_max_block_smem();
// The most blocks of the kernel that can be co-resident on device 0 at that shared memory (the occupancy API).
int persistent_max_coresident(size_t smem);
// One decode step (state.token at state.pos -> logits) on `grid` blocks; no sampling.
void persistent_step(const PersistentParams& p, int grid, cudaStream_t stream);

}  // namespace ti::cuda
