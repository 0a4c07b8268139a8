// persistent.cu — the persistent decode step (DESIGN.md §4, issue 16): one launch per token, a grid of
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
#include <cfloat>

#include "common.cuh"
#include "kv_layout.cuh"
#include "persistent.cuh"
#include "sync.cuh"

namespace ti::cuda {

namespace {

constexpr int kWarps = kPersistentThreads / 32;
constexpr int kRedFloats = 64;  // block_sum's 33 floats, padded to 256 bytes

struct Smem {
  float* red;
  unsigned char* work;  // the task's own area (the staged input, or the attention's tiles)
};

__device__ __forceinline__ float ldcg(const float* p) { return __ldcg(p); }

// ---- the GEMV tasks: stage the input in shared memory as fp16, then a warp per output ----

// xs[0, ld) = fp16 of rmsnorm(x) * w (K floats of x, produced in this kernel), zero past K.
__device__ void stage_norm(const float* x, const float* w, int K, int ld, float eps, __half* xs, float* red) {
  float ss = 0.0f;
  for (int i = threadIdx.x; i < K; i += kPersistentThreads) {
    const float v = ldcg(x + i);
    ss += v * v;
  }
  ss = block_sum(ss, red);
  const float inv = rsqrtf(ss / (float)K + eps);
  for (int i = threadIdx.x; i < ld; i += kPersistentThreads)
    xs[i] = i < K ? __float2half(w[i] * (ldcg(x + i) * inv)) : __float2half(0.0f);
  __syncthreads();
}

// xs[0, ld) = x (fp16, K of them, produced in this kernel), zero past K.
__device__ void stage_f16(const __half* x, int K, int ld, __half* xs) {
  const unsigned short* xu = reinterpret_cast<const unsigned short*>(x);
  for (int i = threadIdx.x; i < ld; i += kPersistentThreads)
    xs[i] = i < K ? __ushort_as_half(__ldcg(xu + i)) : __float2half(0.0f);
  __syncthreads();
}

// One row of W (ld halves, 16-byte words) against the staged input; the warp's sum, in every lane.
__device__ __forceinline__ float row_dot(const __half* W, int ld, int row, const __half* xs) {
  const uint4* w = reinterpret_cast<const uint4*>(W + (size_t)row * ld);
  const uint4* xv = reinterpret_cast<const uint4*>(xs);
  float s = 0.0f;
#pragma unroll 4
  for (int k = threadIdx.x & 31; k < ld / 8; k += 32) {
    float xf[8];
    unpack8(xv[k], xf);
    s += dot8(load_stream(w + k), xf);
  }
  return warp_sum(s);
}

enum class Out { Store, Add };

// rows [r0, r1) of W @ xs into y (stored or added: the residual).
template <Out O>
__device__ void gemv_rows(const __half* W, int ld, int r0, int r1, const __half* xs, float* y) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = r0 + warp; r < r1; r += kWarps) {
    const float s = row_dot(W, ld, r, xs);
    if (lane == 0) {
      if constexpr (O == Out::Add) y[r] = ldcg(y + r) + s;
      else y[r] = s;
    }
  }
}

// outputs [i0, i1) of silu(gate) * up (rows 2i, 2i + 1 of the interleaved matrix) into h (fp16).
__device__ void swiglu_rows(const __half* W, int ld, int i0, int i1, const __half* xs, __half* h) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = i0 + warp; i < i1; i += kWarps) {
    const float g = row_dot(W, ld, 2 * i, xs), u = row_dot(W, ld, 2 * i + 1, xs);
    if (lane == 0) h[i] = __float2half(g / (1.0f + __expf(-g)) * u);
  }
}

// ---- the attention tasks ----

// (KV head kvh, chunk c) of layer l: RoPE of the group's queries; the chunk holding pos also rotates the new key
// and writes key and value into the cache; scores, softmax and P V over the chunk's positions; the unnormalised
// output and (max, sum) into the partial buffers (the merge task combines the chunks).
__device__ void attn_partial(const PersistentParams& p, int l, int kvh, int c, int pos, unsigned char* work) {
  const int hd = p.head_dim, half_d = hd / 2, CH = p.chunk, c0 = c * CH;
  if (c0 > pos) return;
  const int n = min(CH, pos + 1 - c0), g = p.n_heads / p.n_kv_heads, hq0 = kvh * g;
  float* q_s = reinterpret_cast<float*>(work);  // (g, hd)
  float* s_s = q_s + g * hd;                    // (g, CH) scores, then probabilities
  float* kn = s_s + g * CH;                     // (hd) the new key, rotated and rounded to fp16
  float* vn = kn + hd;                          // (hd) the new value, rounded
  float* cs = vn + hd;                          // (half_d) RoPE row of pos
  float* sn = cs + half_d;
  __half* kp = p.k_pages + (size_t)l * p.kv_layer_elems;
  __half* vp = p.v_pages + (size_t)l * p.kv_layer_elems;
  for (int i = threadIdx.x; i < half_d; i += kPersistentThreads) {
    cs[i] = p.rope_cos[(size_t)pos * half_d + i];
    sn[i] = p.rope_sin[(size_t)pos * half_d + i];
  }
  __syncthreads();
  const bool owner = pos < c0 + CH;
  for (int t = threadIdx.x; t < g * half_d; t += kPersistentThreads) {
    const int hh = t / half_d, i = t % half_d;
    const float* q = p.qkv + (size_t)(hq0 + hh) * hd;
    const float x1 = ldcg(q + i), x2 = ldcg(q + i + half_d);
    q_s[hh * hd + i] = (x1 * cs[i] - x2 * sn[i]) * p.scale;
    q_s[hh * hd + i + half_d] = (x2 * cs[i] + x1 * sn[i]) * p.scale;
  }
  if (owner) {
    const size_t at = kv_row(p.page_table, pos, kvh, p.n_kv_heads, p.page_shift, hd);
    const float* k = p.qkv + p.q_dim + (size_t)kvh * hd;
    const float* v = p.qkv + p.q_dim + p.kv_dim + (size_t)kvh * hd;
    for (int i = threadIdx.x; i < half_d; i += kPersistentThreads) {
      const float k1 = ldcg(k + i), k2 = ldcg(k + i + half_d);
      // rounded products, no FMA contraction: exactly what attention.cu (and the CPU engine) write
      const __half r1 = __float2half(__fsub_rn(__fmul_rn(k1, cs[i]), __fmul_rn(k2, sn[i])));
      const __half r2 = __float2half(__fadd_rn(__fmul_rn(k2, cs[i]), __fmul_rn(k1, sn[i])));
      const __half v1 = __float2half(ldcg(v + i)), v2 = __float2half(ldcg(v + i + half_d));
      kp[at + i] = r1;
      kp[at + i + half_d] = r2;
      vp[at + i] = v1;
      vp[at + i + half_d] = v2;
      kn[i] = __half2float(r1);
      kn[i + half_d] = __half2float(r2);
      vn[i] = __half2float(v1);
      vn[i + half_d] = __half2float(v2);
    }
  }
  __syncthreads();
  // scores: a warp per (head, position), lanes over the dims
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int e = warp; e < g * n; e += kWarps) {
    const int hh = e / n, t = e % n, at_pos = c0 + t;
    float s = 0.0f;
    if (at_pos == pos) {
      for (int d = lane; d < hd; d += 32) s += q_s[hh * hd + d] * kn[d];
    } else {
      const __half* kr = kp + kv_row(p.page_table, at_pos, kvh, p.n_kv_heads, p.page_shift, hd);
      for (int d = lane; d < hd; d += 32) s += q_s[hh * hd + d] * __half2float(kr[d]);
    }
    s = warp_sum(s);
    if (lane == 0) s_s[hh * CH + t] = s;
  }
  __syncthreads();
  // softmax per head (a warp per head): probabilities in place, (max, sum) to the partial buffer
  for (int hh = warp; hh < g; hh += kWarps) {
    float m = -FLT_MAX, sum = 0.0f;
    for (int t = lane; t < n; t += 32) m = fmaxf(m, s_s[hh * CH + t]);
    m = warp_max(m);
    for (int t = lane; t < n; t += 32) {
      const float e = __expf(s_s[hh * CH + t] - m);
      s_s[hh * CH + t] = e;
      sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      float* ml = p.part_ml + ((size_t)(hq0 + hh) * p.max_chunks + c) * 2;
      ml[0] = m;
      ml[1] = sum;
    }
  }
  __syncthreads();
  // O = P V: a thread per (head, dim)
  for (int e = threadIdx.x; e < g * hd; e += kPersistentThreads) {
    const int hh = e / hd, d = e % hd;
    float o = 0.0f;
    for (int t = 0; t < n; t++) {
      const int at_pos = c0 + t;
      const float v = at_pos == pos ? vn[d]
                                    : __half2float(vp[kv_row(p.page_table, at_pos, kvh, p.n_kv_heads, p.page_shift, hd) + d]);
      o = fmaf(s_s[hh * CH + t], v, o);
    }
    p.part_o[((size_t)(hq0 + hh) * p.max_chunks + c) * hd + d] = o;
  }
}

// Query head hq: the chunks' partials merged with log-sum-exp into att (fp16).
__device__ void attn_merge(const PersistentParams& p, int hq, int pos) {
  const int hd = p.head_dim, n_chunks = pos / p.chunk + 1;
  const float* ml = p.part_ml + (size_t)hq * p.max_chunks * 2;
  float M = -FLT_MAX;
  for (int c = 0; c < n_chunks; c++) M = fmaxf(M, ldcg(ml + 2 * c));
  float L = 0.0f;
  for (int c = 0; c < n_chunks; c++) L += ldcg(ml + 2 * c + 1) * __expf(ldcg(ml + 2 * c) - M);
  for (int d = threadIdx.x; d < hd; d += kPersistentThreads) {
    float o = 0.0f;
    for (int c = 0; c < n_chunks; c++)
      o += ldcg(p.part_o + ((size_t)hq * p.max_chunks + c) * hd + d) * __expf(ldcg(ml + 2 * c) - M);
    p.att[(size_t)hq * hd + d] = __float2half(o / L);
  }
}

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

__device__ void prefetch_task(const PersistentParams& p, const PTask& t, int pos) {
  const PLayer* L = p.layers + t.layer;
  const size_t rows = (size_t)(t.b - t.a);
  switch (t.type) {
    case TaskType::Qkv: prefetch_l2(L->qkv + (size_t)t.a * p.ld_h, rows * p.ld_h * 2); break;
    case TaskType::O: prefetch_l2(L->o + (size_t)t.a * p.ld_q, rows * p.ld_q * 2); break;
    case TaskType::GateUp: prefetch_l2(L->gate_up + (size_t)2 * t.a * p.ld_h, 2 * rows * p.ld_h * 2); break;
    case TaskType::Down: prefetch_l2(L->down + (size_t)t.a * p.ld_i, rows * p.ld_i * 2); break;
    case TaskType::LmHead: prefetch_l2(p.lm_head + (size_t)t.a * p.ld_h, rows * p.ld_h * 2); break;
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

__device__ void run_task(const PersistentParams& p, const PTask& t, int token, int pos, const Smem& sm) {
  __half* xs = reinterpret_cast<__half*>(sm.work);
  const PLayer* L = p.layers + t.layer;
  switch (t.type) {
    case TaskType::Embed:
      for (int i = t.a + threadIdx.x; i < t.b; i += kPersistentThreads)
        p.x[i] = __half2float(p.embedding[(size_t)token * p.ld_h + i]);
      break;
    case TaskType::Qkv:
      stage_norm(p.x, L->attn_norm, p.hidden, p.ld_h, p.eps, xs, sm.red);
      gemv_rows<Out::Store>(L->qkv, p.ld_h, t.a, t.b, xs, p.qkv);
      break;
    case TaskType::AttnPartial:
      attn_partial(p, t.layer, t.a, t.b, pos, sm.work);
      break;
    case TaskType::AttnMerge:
      attn_merge(p, t.a, pos);
      break;
    case TaskType::O:
      stage_f16(p.att, p.q_dim, p.ld_q, xs);
      gemv_rows<Out::Add>(L->o, p.ld_q, t.a, t.b, xs, p.x);
      break;
    case TaskType::GateUp:
      stage_norm(p.x, L->mlp_norm, p.hidden, p.ld_h, p.eps, xs, sm.red);
      swiglu_rows(L->gate_up, p.ld_h, t.a, t.b, xs, p.h);
      break;
    case TaskType::Down:
      stage_f16(p.h, p.intermediate, p.ld_i, xs);
      gemv_rows<Out::Add>(L->down, p.ld_i, t.a, t.b, xs, p.x);
      break;
    case TaskType::LmHead:
      stage_norm(p.x, p.final_norm, p.hidden, p.ld_h, p.eps, xs, sm.red);
      gemv_rows<Out::Store>(p.lm_head, p.ld_h, t.a, t.b, xs, p.logits);
      break;
  }
}

__global__ void __launch_bounds__(kPersistentThreads) persistent_kernel(PersistentParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Smem sm{reinterpret_cast<float*>(smem_raw), smem_raw + kRedFloats * sizeof(float)};
  __shared__ uint32_t epoch_s;
  if (threadIdx.x == 0) epoch_s = *reinterpret_cast<volatile uint32_t*>(p.epoch) + 1;
  __syncthreads();
  const uint32_t epoch = epoch_s;
  const int token = p.state->token, pos = p.state->pos;
  sync::WaitPolicy policy;
  policy.max_sleep_ns = p.max_sleep_ns;
  policy.timeout_ns = p.timeout_ns;
  for (int i = p.begin[blockIdx.x]; i < p.begin[blockIdx.x + 1]; i++) {
    const PTask t = p.tasks[i];
    if (p.prefetch) prefetch_task(p, t, pos);
    if (t.wait >= 0 &&
        !sync::block_wait(p.counters + (size_t)t.wait * sync::kCounterStride,
                          sync::epoch_target(epoch, (uint32_t)t.wait_count), policy, p.error, (uint32_t)t.wait))
      break;  // timed out (or another block did): the host reports it
    run_task(p, t, token, pos, sm);
    if (t.signal >= 0) sync::block_signal(p.counters + (size_t)t.signal * sync::kCounterStride);
    else __syncthreads();  // the next task reuses the shared memory
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's read of epoch (and its outputs) before its count
    const uint32_t done = atomicAdd(p.finish, 1u) + 1u;
    if (done == epoch * gridDim.x) *reinterpret_cast<volatile uint32_t*>(p.epoch) = epoch;
  }
}

}  // namespace

size_t persistent_smem(const PersistentParams& p) {
  const int ld = max(p.ld_h, max(p.ld_q, p.ld_i));
  const int g = p.n_heads / max(1, p.n_kv_heads);
  const size_t gemv = (size_t)ld * sizeof(__half);
  const size_t attn = (size_t)(g * p.head_dim + g * p.chunk + 3 * p.head_dim) * sizeof(float);
  return kRedFloats * sizeof(float) + (gemv > attn ? gemv : attn);
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
  const size_t smem = persistent_smem(p);
  persistent_kernel<<<grid, kPersistentThreads, smem, stream>>>(p);
  TI_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ti::cuda
