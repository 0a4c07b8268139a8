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
//
// The schedule has an attention task for every chunk of the longest context; those past `pos` (known at the
// kernel's start) signal at once without waiting: they read and write nothing, and their consumers (the merge)
// still count every producer, so the host's check of the schedule holds as it is.
#include <cfloat>

#include "common.cuh"
#include "gemv_dot.cuh"
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
  float* xsum;          // I4: the staged input's group sums (after the widest staged input)
  float4* keep;         // the RMSNorm's input as read by its first pass (hidden floats, after xsum)
};

// Bytes of the GEMV tasks' area before `keep`: the widest staged input, then (I4) its group sums; 16-aligned.
__host__ __device__ inline size_t gemv_stage_bytes(int stage_max) {
  const size_t b = (size_t)stage_max * sizeof(__half) + (size_t)(stage_max / kI4Group + 1) * sizeof(float);
  return (b + 15) / 16 * 16;
}

__device__ __forceinline__ float ldcg(const float* p) { return __ldcg(p); }

// ---- the GEMV tasks: stage the input in shared memory as fp16 (gemv_dot.cuh's layout for the matrix's format),
//      then a warp per output row, the dot product of gemv_dot.cuh's format ----

// The staged input's width in halves (the weight words' span): F16 / I8 ld (elements = bytes for I8), I4 2 ld.
__device__ __forceinline__ int staged_width(const QMat& m) { return m.fmt == WFormat::I4 ? 2 * m.ld : m.ld; }

// I4: xsum[g] = the sum of the staged group g (after the staging's barrier); a barrier after. Else nothing.
template <WFormat WF>
__device__ __forceinline__ void stage_sums(int K, int nw, const __half* xs, float* xsum) {
  if constexpr (WF == WFormat::I4) {
    for (int g = threadIdx.x; g < K / kI4Group; g += kPersistentThreads) {
      float sum = 0.0f;
      for (int e = g * kI4Group; e < (g + 1) * kI4Group; e++) sum += __half2float(xs[xs_index<WF>(e, nw)]);
      xsum[g] = sum;
    }
    __syncthreads();
  }
}

// The RMSNorm staging with 16-byte loads (K % 4 == 0): the sum of squares, then x scaled. The first pass keeps
// what it read in shared memory (`keep`), and each thread reads back its own words: one L2 round trip on the
// phase's critical path instead of two. (x held in registers between the passes cost ~130 more registers in the
// interpreter kernel: spills.) The same values as reading x twice: the same bits.
template <WFormat WF>
__device__ void stage_norm_vec(const QMat& m, const float* x, const float* w, float eps, __half* xs, float* red,
                               float4* keep) {
  const int K = m.K, width = staged_width(m), nw = width / (8 * kXChunks<WF>), nv = K / 4;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float ss = 0.0f;
  for (int i = threadIdx.x; i < nv; i += kPersistentThreads) {
    const float4 v = __ldcg(x4 + i);
    keep[i] = v;
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  ss = block_sum(ss, red);
  const float inv = rsqrtf(ss / (float)K + eps);
  for (int i = threadIdx.x; i < nv; i += kPersistentThreads) {
    const float4 v = keep[i], wv = reinterpret_cast<const float4*>(w)[i];
    xs[xs_index<WF>(4 * i, nw)] = __float2half(wv.x * (v.x * inv));
    xs[xs_index<WF>(4 * i + 1, nw)] = __float2half(wv.y * (v.y * inv));
    xs[xs_index<WF>(4 * i + 2, nw)] = __float2half(wv.z * (v.z * inv));
    xs[xs_index<WF>(4 * i + 3, nw)] = __float2half(wv.w * (v.w * inv));
  }
  for (int i = K + threadIdx.x; i < width; i += kPersistentThreads) xs[xs_index<WF>(i, nw)] = __float2half(0.0f);
  __syncthreads();
}

// xs = fp16 of rmsnorm(x) * w (NORM; x: K floats produced in this kernel) or of x (K halves produced in this
// kernel), in WF's layout, zero past K up to the matrix's width; I4: xsum[g] = the staged group sums.
template <WFormat WF, bool NORM>
__device__ void stage(const QMat& m, const void* x, const float* w, float eps, __half* xs, float* xsum, float* red,
                      float4* keep) {
  const int K = m.K, width = staged_width(m), nw = width / (8 * kXChunks<WF>);
  float inv = 1.0f;
  if constexpr (NORM) {
    if (K % 4 == 0) {  // (uniform)
      stage_norm_vec<WF>(m, static_cast<const float*>(x), w, eps, xs, red, keep);
      stage_sums<WF>(K, nw, xs, xsum);
      return;
    }
    const float* xf = static_cast<const float*>(x);
    float ss = 0.0f;
    for (int i = threadIdx.x; i < K; i += kPersistentThreads) {
      const float v = ldcg(xf + i);
      ss += v * v;
    }
    ss = block_sum(ss, red);
    inv = rsqrtf(ss / (float)K + eps);
  }
  for (int i = threadIdx.x; i < width; i += kPersistentThreads) {
    __half v = __float2half(0.0f);
    if (i < K) {
      if constexpr (NORM) v = __float2half(w[i] * (ldcg(static_cast<const float*>(x) + i) * inv));
      else v = __ushort_as_half(__ldcg(static_cast<const unsigned short*>(x) + i));
    }
    xs[xs_index<WF>(i, nw)] = v;
  }
  __syncthreads();
  stage_sums<WF>(K, nw, xs, xsum);
}

// Row `row` of m: its 16-byte words and its scales' context (gemv_dot.cuh).
template <WFormat WF>
__device__ __forceinline__ const uint4* row_ptr(const QMat& m, int row, const float* xsum, QCtx& c) {
  if constexpr (WF == WFormat::I8) {
    c.d = static_cast<const __half*>(m.scales);
    c.drow = row * (m.ld / kI8Block);
  }
  if constexpr (WF == WFormat::I4) {
    c.sm = static_cast<const __half2*>(m.scales) + (size_t)row * (m.K / kI4Group);
    c.xsum = xsum;
  }
  return WF == WFormat::F16
             ? reinterpret_cast<const uint4*>(static_cast<const __half*>(m.q) + (size_t)row * m.ld)
             : reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(m.q) + (size_t)row * m.ld);
}

// 16-byte words per row of m.
template <WFormat WF>
__device__ __forceinline__ int row_words(const QMat& m) { return WF == WFormat::F16 ? m.ld / 8 : m.ld / 16; }

// One row of m against the staged input; the warp's sum, in every lane.
template <WFormat WF>
__device__ __forceinline__ float row_dot(const QMat& m, int row, const __half* xs, const float* xsum) {
  const int nw = row_words<WF>(m);
  QCtx c;
  const uint4* w = row_ptr<WF>(m, row, xsum, c);
  float s = 0.0f;
#pragma unroll 4
  for (int k = threadIdx.x & 31; k < nw; k += 32) {
    XFrag<WF> x;
    load_x<WF>(xs, nw, k, x);
    s += dot_word<WF>(load_stream(w + k), load_scale<WF>(c, k), x, c, k);
  }
  return warp_sum(s);
}

// Two rows at once (their loads in flight together: a warp's rows are latency-bound one at a time); the warp's
// two sums, in every lane. Each sum in the order row_dot adds it: the same bits.
template <WFormat WF>
__device__ __forceinline__ float2 row_dot2(const QMat& m, int ra, int rb, const __half* xs, const float* xsum) {
  const int nw = row_words<WF>(m);
  QCtx ca, cb;
  const uint4* wa = row_ptr<WF>(m, ra, xsum, ca);
  const uint4* wb = row_ptr<WF>(m, rb, xsum, cb);
  float sa = 0.0f, sb = 0.0f;
#pragma unroll 4
  for (int k = threadIdx.x & 31; k < nw; k += 32) {
    XFrag<WF> x;
    load_x<WF>(xs, nw, k, x);
    const uint4 a = load_stream(wa + k), b = load_stream(wb + k);
    sa += dot_word<WF>(a, load_scale<WF>(ca, k), x, ca, k);
    sb += dot_word<WF>(b, load_scale<WF>(cb, k), x, cb, k);
  }
  return make_float2(warp_sum(sa), warp_sum(sb));
}

enum class Out { Store, Add, Swiglu };

// Rows [r0, r1) of m @ xs into y: stored, added (the residual), or (Swiglu) outputs [r0, r1) of silu(gate) * up
// from rows 2i, 2i + 1 into y as fp16.
template <WFormat WF, Out O>
__device__ void gemv_rows(const QMat& m, int r0, int r1, const __half* xs, const float* xsum, void* y) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if constexpr (O == Out::Swiglu) {  // gate and up rows together
    for (int r = r0 + warp; r < r1; r += kWarps) {
      const float2 gu = row_dot2<WF>(m, 2 * r, 2 * r + 1, xs, xsum);
      if (lane == 0) static_cast<__half*>(y)[r] = __float2half(gu.x / (1.0f + __expf(-gu.x)) * gu.y);
    }
  } else {
    float* yf = static_cast<float*>(y);
    int r = r0 + warp;
    if constexpr (WF == WFormat::F16) {  // rows r, r + kWarps together (I8 / I4: the registers spill)
      for (; r + kWarps < r1; r += 2 * kWarps) {
        const float2 s = row_dot2<WF>(m, r, r + kWarps, xs, xsum);
        if (lane == 0) {
          yf[r] = O == Out::Add ? ldcg(yf + r) + s.x : s.x;
          yf[r + kWarps] = O == Out::Add ? ldcg(yf + r + kWarps) + s.y : s.y;
        }
      }
    }
    for (; r < r1; r += kWarps) {
      const float s = row_dot<WF>(m, r, xs, xsum);
      if (lane == 0) yf[r] = O == Out::Add ? ldcg(yf + r) + s : s;
    }
  }
}

// A GEMV task: stage (RMSNorm'd when NORM), then rows [r0, r1), in the matrix's format.
template <bool NORM, Out O>
__device__ void gemv_task(const QMat& m, const void* x, const float* w, float eps, int r0, int r1, void* y,
                          const Smem& sm) {
  __half* xs = reinterpret_cast<__half*>(sm.work);
  float* xsum = sm.xsum;
  switch (m.fmt) {
    case WFormat::F16:
      stage<WFormat::F16, NORM>(m, x, w, eps, xs, xsum, sm.red, sm.keep);
      gemv_rows<WFormat::F16, O>(m, r0, r1, xs, xsum, y);
      break;
    case WFormat::I8:
      stage<WFormat::I8, NORM>(m, x, w, eps, xs, xsum, sm.red, sm.keep);
      gemv_rows<WFormat::I8, O>(m, r0, r1, xs, xsum, y);
      break;
    case WFormat::I4:
      stage<WFormat::I4, NORM>(m, x, w, eps, xs, xsum, sm.red, sm.keep);
      gemv_rows<WFormat::I4, O>(m, r0, r1, xs, xsum, y);
      break;
  }
}

// ---- the attention tasks ----

// Query head hq, dimension d: the chunks' partials merged with log-sum-exp into att (fp16).
__device__ __forceinline__ void merge_dim(const PersistentParams& p, int hq, int d, int n_chunks) {
  const int hd = p.head_dim;
  const float* ml = p.part_ml + (size_t)hq * p.max_chunks * 2;
  float M = -FLT_MAX;
  for (int c = 0; c < n_chunks; c++) M = fmaxf(M, ldcg(ml + 2 * c));
  float L = 0.0f;
  for (int c = 0; c < n_chunks; c++) L += ldcg(ml + 2 * c + 1) * __expf(ldcg(ml + 2 * c) - M);
  float o = 0.0f;
  for (int c = 0; c < n_chunks; c++)
    o += ldcg(p.part_o + ((size_t)hq * p.max_chunks + c) * hd + d) * __expf(ldcg(ml + 2 * c) - M);
  p.att[(size_t)hq * hd + d] = __float2half(o / L);
}

// The merge task (ScheduleShape::fused_merge off): query head hq.
__device__ void attn_merge(const PersistentParams& p, int hq, int pos) {
  for (int d = threadIdx.x; d < p.head_dim; d += kPersistentThreads) merge_dim(p, hq, d, pos / p.chunk + 1);
}

// Fused merge: after its partials, each attention task of KV head kvh counts itself on the head's arrival word;
// the last of the context's chunks to arrive (they all run in this step) merges the group's heads and zeroes the
// word for the next step. The classic last-block pattern: every block's partial writes, its barrier, a fence,
// then its count; the last block's fence after the count orders its reads of the others' partials (ld.cg).
__device__ void merge_if_last(const PersistentParams& p, int l, int kvh, int pos) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    uint32_t* arrived = p.arrivals + (size_t)l * p.n_kv_heads + kvh;
    last = atomicAdd(arrived, 1u) + 1u == (uint32_t)(pos / p.chunk + 1);
    if (last) {
      atomicExch(arrived, 0u);
      __threadfence();
    }
  }
  __syncthreads();
  if (!last) return;
  const int g = p.n_heads / p.n_kv_heads, hd = p.head_dim;
  for (int e = threadIdx.x; e < g * hd; e += kPersistentThreads)
    merge_dim(p, kvh * g + e / hd, e % hd, pos / p.chunk + 1);
}

// (KV head kvh, chunk c) of layer l: RoPE of the group's queries; the chunk holding pos also rotates the new key
// and writes key and value into the cache; scores, softmax and P V over the chunk's positions; the unnormalised
// output and (max, sum) into the partial buffers, merged by the merge task or (fused_merge) by the last of the
// head's chunks to finish (merge_if_last); a context of one chunk (fused_merge) writes att directly.
//
// Latency, not bandwidth, bounds this task (a chunk of TinyLlama's is 8 KiB of K and V; few blocks run it at short
// contexts while the rest wait): so no load waits on another. The chunk's row offsets are resolved through the
// page table once, into shared memory; a warp scores a position for all g heads of the group (one load of the key
// row, lanes over dimension pairs); P V has a thread per (head, dimension pair), its loop over positions unrolled
// so that its value loads are in flight together. The new key and value are read back from the cache after the
// barrier that follows their store (the block's own global writes are visible to it after __syncthreads): the
// same fp16 values attention.cu uses.
__device__ void attn_partial(const PersistentParams& p, int l, int kvh, int c, int pos, unsigned char* work) {
  const int hd = p.head_dim, half_d = hd / 2, CH = p.chunk, c0 = c * CH;
  if (c0 > pos) return;
  const int n = min(CH, pos + 1 - c0), g = p.n_heads / p.n_kv_heads, hq0 = kvh * g;
  float* q_s = reinterpret_cast<float*>(work);  // (g, hd)
  float* s_s = q_s + g * hd;                    // (g, CH) scores, then probabilities
  float* cs = s_s + g * CH;                     // (half_d) RoPE row of pos
  float* sn = cs + half_d;
  int* rows = reinterpret_cast<int*>(sn + half_d);  // (CH) the chunk's cache rows (elements from the layer's base)
  float* lsum = reinterpret_cast<float*>(rows + CH);  // (g) the softmax sums
  __half* kp = p.k_pages + (size_t)l * p.kv_layer_elems;
  __half* vp = p.v_pages + (size_t)l * p.kv_layer_elems;
  for (int i = threadIdx.x; i < half_d; i += kPersistentThreads) {
    cs[i] = p.rope_cos[(size_t)pos * half_d + i];
    sn[i] = p.rope_sin[(size_t)pos * half_d + i];
  }
  for (int t = threadIdx.x; t < n; t += kPersistentThreads)
    rows[t] = (int)kv_row(p.page_table, c0 + t, kvh, p.n_kv_heads, p.page_shift, hd);
  __syncthreads();
  for (int t = threadIdx.x; t < g * half_d; t += kPersistentThreads) {
    const int hh = t / half_d, i = t % half_d;
    const float* q = p.qkv + (size_t)(hq0 + hh) * hd;
    const float x1 = ldcg(q + i), x2 = ldcg(q + i + half_d);
    q_s[hh * hd + i] = (x1 * cs[i] - x2 * sn[i]) * p.scale;
    q_s[hh * hd + i + half_d] = (x2 * cs[i] + x1 * sn[i]) * p.scale;
  }
  if (pos < c0 + CH) {  // this chunk holds pos: the new key (rotated) and value into the cache
    const size_t at = rows[pos - c0];
    const float* k = p.qkv + p.q_dim + (size_t)kvh * hd;
    const float* v = p.qkv + p.q_dim + p.kv_dim + (size_t)kvh * hd;
    for (int i = threadIdx.x; i < half_d; i += kPersistentThreads) {
      const float k1 = ldcg(k + i), k2 = ldcg(k + i + half_d);
      // rounded products, no FMA contraction: exactly what attention.cu (and the CPU engine) write
      kp[at + i] = __float2half(__fsub_rn(__fmul_rn(k1, cs[i]), __fmul_rn(k2, sn[i])));
      kp[at + i + half_d] = __float2half(__fadd_rn(__fmul_rn(k2, cs[i]), __fmul_rn(k1, sn[i])));
      vp[at + i] = __float2half(ldcg(v + i));
      vp[at + i + half_d] = __float2half(ldcg(v + i + half_d));
    }
  }
  __syncthreads();
  // scores: a warp per position, all g heads; lane `lane` holds the key's dimension pairs 2 lane + 64 j
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int kPairs = 4;  // head_dim <= 256 (PersistentDecode::unsupported)
  for (int t = warp; t < n; t += kWarps) {
    const __half2* kr = reinterpret_cast<const __half2*>(kp + rows[t]);
    float2 kf[kPairs];
#pragma unroll
    for (int j = 0; j < kPairs; j++)
      kf[j] = 2 * lane + 64 * j < hd ? __half22float2(kr[lane + 32 * j]) : make_float2(0.0f, 0.0f);
    for (int hh = 0; hh < g; hh++) {
      const float* q = q_s + hh * hd;
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < kPairs; j++) {
        const int d = 2 * lane + 64 * j;
        if (d < hd) s += q[d] * kf[j].x + q[d + 1] * kf[j].y;
      }
      s = warp_sum(s);
      if (lane == 0) s_s[hh * CH + t] = s;
    }
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
      lsum[hh] = sum;
    }
  }
  __syncthreads();
  // O = P V: a thread per (head, dimension pair), the positions unrolled so their loads overlap. Fused merge with
  // one chunk in the context: att directly (the merge's o * 1 / (sum * 1), the same bits).
  const bool alone = p.fused_merge && pos < CH;
  for (int e = threadIdx.x; e < g * half_d; e += kPersistentThreads) {
    const int hh = e / half_d, d = 2 * (e % half_d);
    const float* pr = s_s + hh * CH;
    float o0 = 0.0f, o1 = 0.0f;
#pragma unroll 8
    for (int t = 0; t < n; t++) {
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(vp + rows[t] + d));
      o0 = fmaf(pr[t], v.x, o0);
      o1 = fmaf(pr[t], v.y, o1);
    }
    if (alone) {
      __half* a = p.att + (size_t)(hq0 + hh) * hd + d;
      a[0] = __float2half(o0 / lsum[hh]);
      a[1] = __float2half(o1 / lsum[hh]);
      continue;
    }
    float* out = p.part_o + ((size_t)(hq0 + hh) * p.max_chunks + c) * hd + d;
    out[0] = o0;
    out[1] = o1;
  }
  if (p.fused_merge && !alone) merge_if_last(p, l, kvh, pos);
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
#ifdef TI_TRACE
  if (trace != nullptr && threadIdx.x == 0) trace[(size_t)i * kTaskStamps + point] = sync::global_ns();
#else
  (void)trace, (void)i, (void)point;
#endif
}

__device__ void run_task(const PersistentParams& p, const PTask& t, int token, int pos, const Smem& sm) {
  const PLayer* L = p.layers + t.layer;
  switch (t.type) {
    case TaskType::Embed:
      for (int i = t.a + threadIdx.x; i < t.b; i += kPersistentThreads)
        p.x[i] = __half2float(p.embedding[(size_t)token * p.ld_h + i]);
      break;
    case TaskType::Qkv:
      gemv_task<true, Out::Store>(L->qkv, p.x, L->attn_norm, p.eps, t.a, t.b, p.qkv, sm);
      break;
    case TaskType::AttnPartial:
      attn_partial(p, t.layer, t.a, t.b, pos, sm.work);
      break;
    case TaskType::AttnMerge:
      attn_merge(p, t.a, pos);
      break;
    case TaskType::O:
      gemv_task<false, Out::Add>(L->o, p.att, nullptr, p.eps, t.a, t.b, p.x, sm);
      break;
    case TaskType::GateUp:
      gemv_task<true, Out::Swiglu>(L->gate_up, p.x, L->mlp_norm, p.eps, t.a, t.b, p.h, sm);
      break;
    case TaskType::Down:
      gemv_task<false, Out::Add>(L->down, p.h, nullptr, p.eps, t.a, t.b, p.x, sm);
      break;
    case TaskType::LmHead:
      gemv_task<true, Out::Store>(p.lm_head, p.x, p.final_norm, p.eps, t.a, t.b, p.logits, sm);
      break;
  }
}

__global__ void __launch_bounds__(kPersistentThreads) persistent_kernel(PersistentParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
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
  for (int i = p.begin[blockIdx.x]; i < p.begin[blockIdx.x + 1]; i++) {
    const PTask t = p.tasks[i];
    uint32_t* signal = t.signal >= 0 ? p.counters + (size_t)t.signal * sync::kCounterStride : nullptr;
    task_stamp(p.trace, i, 0);
    if (t.type == TaskType::AttnPartial && t.b * p.chunk > pos) {  // a chunk past pos: nothing to wait for or do
      if (signal) sync::block_signal(signal);                     // (its consumers count it all the same)
      task_stamp(p.trace, i, 1);
      task_stamp(p.trace, i, 2);
      continue;
    }
    if (p.prefetch) prefetch_task(p, t, pos);
    if (t.wait >= 0 &&
        !sync::block_wait(p.counters + (size_t)t.wait * sync::kCounterStride,
                          sync::epoch_target(epoch, (uint32_t)t.wait_count), policy, p.error, (uint32_t)t.wait))
      break;  // timed out (or another block did): the host reports it
    task_stamp(p.trace, i, 1);
    run_task(p, t, token, pos, sm);
    if (signal) sync::block_signal(signal);
    else __syncthreads();  // the next task reuses the shared memory
    task_stamp(p.trace, i, 2);
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
  const int g = p.n_heads / max(1, p.n_kv_heads);
  // the widest staged input, then (I4) its group sums, then the RMSNorm's kept input (hidden floats; the normed
  // matrices all take the residual); or the attention's tiles
  const size_t gemv = gemv_stage_bytes(p.stage_max) + (size_t)p.hidden * sizeof(float);
  const size_t attn = (size_t)(g * p.head_dim + g * p.chunk + p.head_dim + p.chunk + g) * sizeof(float);
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
