// persistent.cu — the persistent decode step (docs/ARCHITECTURE.md, issue 16): one launch per token, a grid of
// co-resident blocks, each an interpreter over its list of tasks (cpp/gpu/persistent_schedule.h), one device
// function per task type, the order between blocks given by counters (sync.cuh), never by kernel boundaries.
//
// Numerics follow the graph path's kernels: the RMSNorm'd input staged as fp16 (gemv.cu), fp32 dot products of
// fp16 weights, RoPE'd keys rounded exactly as attention.cu writes them into the cache, split-K attention over
// chunks of `chunk` positions merged with log-sum-exp. What differs is the order of some fp32 sums.
//
// Data produced during the kernel (x, qkv, att, h, the attention partials) is read with sync::load_produced-style
// L2 loads (__ldcg), never through the read-only path; weights and the KV cache rows of earlier steps (written by
// earlier kernels) with ordinary loads.
//
// Epochs: every block reads `epoch` (steps completed) at its start; the last block to finish (counted on
// `finish`) writes epoch + 1 — after every block has read it, so all blocks of a step agree, and the next kernel
// (stream order) sees it. Counters never reset (sync.cuh). A wait that times out records the counter in `error`;
// the block stops its list, still counts as finished, and the host turns the error into an exception.
//
// The weight ring (CudaOptions::persistent_ring, docs/perf/persistent.md §7): each block streams the weight tiles
// of its GEMV tasks, in its task order (cpp/gpu/persistent_ring_plan.h), into a shared-memory ring with bulk
// copies, and issues them before every counter wait — the next tasks' weights land while the block waits for its
// input, so the stream no longer stops at task boundaries. The attention tasks likewise copy the keys and values
// of the positions before pos into shared memory before their wait (kv_stage). Without the ring a task reads its
// rows from global memory after its wait (its first bytes asked into L2 before it: `prefetch`).
//
// The schedule has an attention task for every chunk of the longest context; those past `pos` (known at the
// kernel's start) signal at once without waiting: they read and write nothing, and their consumers (the merge)
// still count every producer, so the host's check of the schedule holds as it is.
// The task bodies live in persistent_gemv.cuh and persistent_attn.cuh (what they share: persistent_common.cuh).
#include "persistent_attn.cuh"
#include "persistent_gemv.cuh"

namespace ti::cuda {

namespace {

using namespace persistent;

// ---- weights ahead of the dependency ----

// The first kPrefetchBytes of what a task streams, asked into L2 before the task's wait: the hand-off latency
// then overlaps the weight stream (docs/perf/persistent.md: ring ahead >= BW x latency / SMs ~ 48 KiB per SM).
// L2 prefetches hold no registers and no shared memory; a ring in shared memory (ring.cuh) is the next step.
constexpr size_t kPrefetchBytes = 48 << 10;

__device__ __forceinline__ void prefetch_l2(const void* base, size_t bytes) {
  if (bytes > kPrefetchBytes) bytes = kPrefetchBytes;
  const char* b = static_cast<const char*>(base);
  for (size_t o = (size_t)threadIdx.x * 128; o < bytes; o += (size_t)kPersistentThreads * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(b + o));
}

// The bytes of rows [r0, r1) of m (scales aside: 1/16 of an I8 row, 1/8 of an I4 one).
__device__ __forceinline__ void prefetch_rows(const QMat& m, size_t r0, size_t r1) {
  const size_t row = m.fmt == WFormat::F16 ? (size_t)m.ld * 2 : (size_t)m.ld;
  prefetch_l2(static_cast<const uint8_t*>(m.q) + r0 * row, (r1 - r0) * row);
}

__device__ void prefetch_task(const PersistentParams& p, const PTask& t, int pos) {
  const PLayer* L = p.layers + t.layer;
  switch (t.type) {
    case TaskType::Qkv: prefetch_rows(L->qkv, t.a, t.b); break;
    case TaskType::O: prefetch_rows(L->o, t.a, t.b); break;
    case TaskType::GateUp: prefetch_rows(L->gate_up, 2 * (size_t)t.a, 2 * (size_t)t.b); break;
    case TaskType::Down: prefetch_rows(L->down, t.a, t.b); break;
    case TaskType::LmHead: prefetch_rows(p.lm_head, t.a, t.b); break;
    case TaskType::AttnPartial: {  // the chunk's cached keys and values (the page of its first position)
      const int c0 = t.b * p.chunk, n = min(p.chunk, pos - c0);  // positions < pos: written by earlier steps
      if (n <= 0) break;
      const int page_size = 1 << p.page_shift, in_page = min(n, page_size - (c0 & (page_size - 1)));
      const size_t at = kv_row(p.page_table, c0, t.a, p.n_kv_heads, p.page_shift, p.head_dim);
      const size_t bytes = (size_t)in_page * p.head_dim * 2, layer = (size_t)t.layer * p.kv_layer_elems;
      prefetch_l2(p.k_pages + layer + at, bytes);
      prefetch_l2(p.v_pages + layer + at, bytes);
      break;
    }
    default: break;
  }
}

// ---- the interpreter ----

// Thread 0 stamps the global timer for task `i` at `point` (TI_TRACE builds with a trace buffer; else nothing).
__device__ __forceinline__ void task_stamp(unsigned long long* trace, int i, int point) {
  stamp_at(trace != nullptr ? trace + (size_t)i * kTaskStamps + point : nullptr);
}

// Task t (index i of the flattened schedule); per: its ring tiles' rows (0: its weights from global memory).
// Forced inline: when nvcc outlined it, the call copied the kernel's parameters (~0.5 KB) to the stack and every
// task read them from there, a much slower step (docs/perf/persistent.md §8.4).
__device__ __forceinline__ void run_task(const PersistentParams& p, const PTask& t, int token, int pos, const Smem& sm,
                                         int per, PlanRing* pr) {
  const PLayer* L = p.layers + t.layer;
  switch (t.type) {
    case TaskType::Embed:
      for (int i = t.a + threadIdx.x; i < t.b; i += kPersistentThreads)
        p.x[i] = __half2float(p.embedding[(size_t)token * p.ld_h + i]);
      break;
    case TaskType::Qkv:
      gemv_task<true, Out::Store>(L->qkv, p.x, L->attn_norm, p.eps, t.a, t.b, p.qkv, sm, per, pr);
      break;
    case TaskType::AttnPartial:
      attn_partial(p, t.layer, t.a, t.b, pos, sm.work, sm.staged);
      break;
    case TaskType::AttnMerge:
      attn_merge(p, t.a, pos);
      break;
    case TaskType::O:
      gemv_task<false, Out::Add>(L->o, p.att, nullptr, p.eps, t.a, t.b, p.x, sm, per, pr);
      break;
    case TaskType::GateUp:
      gemv_task<true, Out::Swiglu>(L->gate_up, p.x, L->mlp_norm, p.eps, t.a, t.b, p.h, sm, per, pr);
      break;
    case TaskType::Down:
      gemv_task<false, Out::Add>(L->down, p.h, nullptr, p.eps, t.a, t.b, p.x, sm, per, pr);
      break;
    case TaskType::LmHead:
      gemv_task<true, Out::Store>(p.lm_head, p.x, p.final_norm, p.eps, t.a, t.b, p.logits, sm, per, pr);
      break;
  }
}

// A trace build asks for 2 blocks per SM explicitly: left to itself, ptxas gave it 80 registers and spills (the
// stamps would then time a different kernel). The default build's 128 registers are ptxas's own choice.
#ifdef TI_TRACE
#define TI_PERSISTENT_BOUNDS __launch_bounds__(kPersistentThreads, 2)
#else
#define TI_PERSISTENT_BOUNDS __launch_bounds__(kPersistentThreads)
#endif
__global__ void TI_PERSISTENT_BOUNDS persistent_kernel(const __grid_constant__ PersistentParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* work = smem_raw + kRedFloats * sizeof(float);
  const Smem sm{reinterpret_cast<float*>(smem_raw), work,
                reinterpret_cast<float*>(work + (size_t)p.stage_max * sizeof(__half)),
                reinterpret_cast<float4*>(work + gemv_stage_bytes(p.stage_max))};
  __shared__ uint32_t epoch_s;
  if (threadIdx.x == 0) epoch_s = *reinterpret_cast<volatile uint32_t*>(p.epoch) + 1;
  __syncthreads();
  const uint32_t epoch = epoch_s;
  const int token = p.state->token, pos = p.state->pos;
  sync::WaitPolicy policy;
  policy.max_sleep_ns = p.max_sleep_ns;
  policy.timeout_ns = p.timeout_ns;
  // The ring (off: ring_slots 0). Its first tiles are issued at once: the first tasks' weights stream while the
  // block waits for the embedding and the first hand-off.
  const bool ringed = p.ring_slots > 0;
  PlanRing ring(smem_raw + p.ring_offset, p, policy);
  PlanRing* pr = &ring;
  for (int i = p.begin[blockIdx.x]; i < p.begin[blockIdx.x + 1]; i++) {
    const PTask t = p.tasks[i];
    const int per = ringed ? p.task_tile_rows[i] : 0;
    uint32_t* signal = t.signal >= 0 ? p.counters + (size_t)t.signal * sync::kCounterStride : nullptr;
    task_stamp(p.trace, i, 0);
    if (t.type == TaskType::AttnPartial && t.b * p.chunk > pos) {  // a chunk past pos: nothing to wait for or do
      if (signal) sync::block_signal(signal);                     // (its consumers count it all the same)
      task_stamp(p.trace, i, 1);
      task_stamp(p.trace, i, 2);
      continue;
    }
    if (ringed) pr->fill();  // before the wait: this task's and the next tasks' tiles, as far as slots are free
    if (t.type == TaskType::AttnPartial) attn_preload(p, t.layer, t.a, t.b, pos, sm.work);
    if (p.prefetch && per == 0 && !(t.type == TaskType::AttnPartial && p.kv_stage)) prefetch_task(p, t, pos);
    if (t.wait >= 0 &&
        !sync::block_wait(p.counters + (size_t)t.wait * sync::kCounterStride,
                          sync::epoch_target(epoch, (uint32_t)t.wait_count), policy, p.error, (uint32_t)t.wait))
      break;  // timed out (or another block did): the host reports it
    task_stamp(p.trace, i, 1);
#ifdef TI_TRACE
    Smem smt = sm;
    if (p.trace != nullptr) smt.staged = p.trace + (size_t)i * kTaskStamps + 3;
    run_task(p, t, token, pos, smt, per, pr);
#else
    run_task(p, t, token, pos, sm, per, pr);
#endif
    if (signal) sync::block_signal(signal);
    else __syncthreads();  // the next task reuses the shared memory
    task_stamp(p.trace, i, 2);
  }
  if (ringed) pr->drain();  // (after a timeout tiles may still be in flight)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");  // (likewise attn_preload's copies)
#endif
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's read of epoch (and its outputs) before its count
    const uint32_t done = atomicAdd(p.finish, 1u) + 1u;
    if (done == epoch * gridDim.x) *reinterpret_cast<volatile uint32_t*>(p.epoch) = epoch;
  }
}

}  // namespace

size_t persistent_smem(const PersistentParams& p) {
  const int g = p.n_heads / max(1, p.n_kv_heads);
  // the widest staged input, then (I4) its group sums, then the RMSNorm's kept input (hidden floats; the normed
  // matrices all take the residual); or the attention's tiles
  const size_t gemv = gemv_stage_bytes(p.stage_max) + (size_t)p.hidden * sizeof(float);
  const size_t attn = AttnSmem::bytes(g, p.head_dim, p.chunk, p.kv_stage);
  return kRedFloats * sizeof(float) + (gemv > attn ? gemv : attn);
}

static_assert(kRingHeader == 128, "cpp/gpu/persistent_ring_plan.cpp's kRingPlanHeader");
static_assert(sizeof(PTileCopy) == 24, "PTileCopy is uploaded as it is");

size_t persistent_ring_offset(const PersistentParams& p) { return (persistent_smem(p) + 127) / 128 * 128; }

size_t persistent_total_smem(const PersistentParams& p) {
  if (p.ring_slots <= 0) return persistent_smem(p);
  return persistent_ring_offset(p) + ring_smem_bytes(p.ring_slots, (size_t)p.ring_slot_bytes);
}

size_t persistent_max_block_smem() {
  int dev = 0, optin = 0;
  TI_CUDA_CHECK(cudaGetDevice(&dev));
  TI_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return (size_t)optin;
}

int persistent_max_coresident(size_t smem) {
  int dev = 0, sms = 0, per_sm = 0;
  TI_CUDA_CHECK(cudaGetDevice(&dev));
  TI_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  TI_CUDA_CHECK(cudaFuncSetAttribute(persistent_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  TI_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent_kernel, kPersistentThreads, smem));
  return per_sm * sms;
}

void persistent_step(const PersistentParams& p, int grid, cudaStream_t stream) {
  const size_t smem = persistent_total_smem(p);
  persistent_kernel<<<grid, kPersistentThreads, smem, stream>>>(p);
  TI_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ti::cuda
