// persistent_gemv.cuh — the persistent step's GEMV tasks (cuda/persistent.cu's header comment: numerics, the
// weight ring): the input staged in shared memory as fp16 (RMSNorm'd or not), rows of dot products, the outputs
// (fp32, residual add, SwiGLU); from global memory after the task's wait, or fed by the weight ring.
#pragma once

#include "persistent_common.cuh"
#include "ring.cuh"
#include "sync.cuh"

namespace ti::cuda::persistent {

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
__device__ inline void stage_norm_vec(const QMat& m, const float* x, const float* w, float eps, __half* xs, float* red,
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

// The unnormed staging with 16-byte loads (K % 8 == 0, width % 8 == 0): 8 halves of x per load, up to 4 loads a
// thread issued before any is stored, so the input arrives in one round trip (a 2-byte load per element in a loop
// that stores each took several). 8 consecutive elements stay consecutive in every format's layout (xs_index).
template <WFormat WF>
__device__ inline void stage_copy_vec(const QMat& m, const __half* x, __half* xs) {
  constexpr int kU = 4;
  const int K = m.K, width = staged_width(m), nw = width / (8 * kXChunks<WF>), n8 = width / 8;
  const uint4* x8 = reinterpret_cast<const uint4*>(x);
  for (int v0 = threadIdx.x; v0 < n8; v0 += kU * kPersistentThreads) {
    uint4 val[kU];
#pragma unroll
    for (int u = 0; u < kU; u++) {
      const int v = v0 + u * kPersistentThreads;
      val[u] = v < n8 && 8 * v < K ? __ldcg(x8 + v) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kU; u++) {
      const int v = v0 + u * kPersistentThreads;
      if (v < n8) *reinterpret_cast<uint4*>(xs + xs_index<WF>(8 * v, nw)) = val[u];
    }
  }
  __syncthreads();
}

// xs = fp16 of rmsnorm(x) * w (NORM; x: K floats produced in this kernel) or of x (K halves produced in this
// kernel), in WF's layout, zero past K up to the matrix's width; I4: xsum[g] = the staged group sums.
template <WFormat WF, bool NORM>
__device__ inline void stage(const QMat& m, const void* x, const float* w, float eps, __half* xs, float* xsum, float* red,
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
  } else if (K % 8 == 0 && staged_width(m) % 8 == 0) {  // (uniform)
    stage_copy_vec<WF>(m, static_cast<const __half*>(x), xs);
    stage_sums<WF>(K, nw, xs, xsum);
    return;
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
__device__ inline void gemv_rows(const QMat& m, int r0, int r1, const __half* xs, const float* xsum, void* y) {
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

// ---- the GEMV tasks fed by the weight ring (CudaOptions::persistent_ring) ----
//
// The block's ring plan (persistent_ring_plan.h) lists its tiles in task order; `PlanRing` walks it with two
// cursors. fill() issues tiles while a slot is free — whatever task they belong to — and is called before every
// counter wait and before every tile it acquires, so the copies of the next tasks' weights run while the block
// waits for its input and while it computes: the stream stops only when the ring is full. Thread 0 issues; it
// keeps the next tile's descriptor loaded ahead in registers so that an issue does not wait on a global load.
constexpr uint32_t kRingErrorIndex = 0xFFFFFFFFu;  // the error record's "counter" of a ring copy that never landed

struct PlanRing {
  BulkRing ring;
  const PTileCopy* copies;
  int next, end;
  PTileCopy ahead;  // thread 0: copies[next]
  sync::WaitPolicy policy;
  uint32_t* error;

  // (ring_slots 0: an empty ring that fill() never issues to.) Contains a barrier.
  __device__ PlanRing(uint8_t* smem, const PersistentParams& p, const sync::WaitPolicy& pol)
      : ring(smem, (uint32_t)p.ring_slots, (uint32_t)p.ring_slot_bytes), copies(p.ring_copies),
        next(p.ring_slots > 0 ? p.ring_begin[blockIdx.x] : 0),
        end(p.ring_slots > 0 ? p.ring_begin[blockIdx.x + 1] : 0), policy(pol), error(p.error) {
    if (threadIdx.x == 0 && next < end) ahead = copies[next];
  }
  // Waits (bounded) for the oldest tile; returns its slot. A copy that has not landed after the waits' timeout
  // (or, `give_up`, once another wait recorded an error) records kWaitTimedOut with counter index
  // kRingErrorIndex and returns the slot as it is: the step's output is then invalid and the host reports the
  // error (PersistentDecode::check).
  __device__ const uint8_t* acquire(bool give_up = true) {
    unsigned long long t0 = 0;
    for (uint32_t i = 0; !ring.ready(); i++) {
      if ((i & 63) != 63) continue;
      if (t0 == 0) {
        t0 = sync::global_ns();
      } else if ((give_up && *reinterpret_cast<volatile uint32_t*>(error) != 0) ||
                 sync::global_ns() - t0 > policy.timeout_ns) {
        if (atomicCAS(error, 0u, sync::kWaitTimedOut) == 0u) {
          error[1] = kRingErrorIndex;
          error[2] = ring.consumed;
        }
        break;
      }
    }
    return ring.oldest();
  }
  // Every copy still in flight waited for, whatever error another wait recorded (a block must not exit with
  // copies into its shared memory pending).
  __device__ void drain() {
    while (ring.consumed != ring.issued) {
      acquire(false);
      ring.consumed++;
    }
  }
  __device__ __forceinline__ void fill() {
    while (next < end && ring.free_slots() > 0) {
      ring.issue(ahead.w, ahead.bytes, ahead.scales, ahead.scale_bytes);
      next++;
      if (threadIdx.x == 0 && next < end) ahead = copies[next];
    }
  }
};

// One tile of R rows (weights at `tile`, then their scales) of m against the staged input: rows row0 .. row0 + R
// of the matrix. A unit is a row (Swiglu: a gate/up pair, computed together); a warp per unit when there are at
// least kWarps units, else kWarps / units warps per unit, each over a share of the row's words, their sums added
// in shared memory (red: at most 2 x kWarps floats) in a fixed order.
//
// Out::Add: the residual's old values come from `old` (old[r - r_old]: loaded once per task, before its staging),
// not from a load per row here: that load's round trip would stall the block at every tile's release.
template <WFormat WF, Out O>
__device__ inline void tile_dot(const QMat& m, const uint8_t* tile, int row0, int R, const __half* xs, const float* xsum,
                         void* y, float* red, const float* old, int r_old) {
  constexpr int NR = O == Out::Swiglu ? 2 : 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nw = row_words<WF>(m), row_bytes = 16 * nw;
  const int units = R / NR, splits = units >= kWarps ? 1 : kWarps / units;
  const uint8_t* scl = tile + (size_t)R * row_bytes;
  auto write = [&](int unit, float a, float b) {
    const int r = row0 + unit * NR;
    if constexpr (O == Out::Swiglu) {
      static_cast<__half*>(y)[r / 2] = __float2half(a / (1.0f + __expf(-a)) * b);
    } else {
      float* yf = static_cast<float*>(y);
      yf[r] = O == Out::Add ? old[r - r_old] + a : a;
    }
  };
  for (int u = warp; u < units * splits; u += kWarps) {
    const int unit = u / splits, part = u % splits, lr = unit * NR;
    QCtx ca, cb;
    if constexpr (WF == WFormat::I8) {
      ca.d = cb.d = reinterpret_cast<const __half*>(scl);
      ca.drow = lr * (m.ld / kI8Block);
      cb.drow = ca.drow + m.ld / kI8Block;
    }
    if constexpr (WF == WFormat::I4) {
      ca.sm = reinterpret_cast<const __half2*>(scl) + (size_t)lr * (m.K / kI4Group);
      cb.sm = ca.sm + m.K / kI4Group;
      ca.xsum = cb.xsum = xsum;
    }
    const uint4* wa = reinterpret_cast<const uint4*>(tile + (size_t)lr * row_bytes);
    float sa = 0.0f, sb = 0.0f;
#pragma unroll 4
    for (int k = part * 32 + lane; k < nw; k += 32 * splits) {
      XFrag<WF> x;
      load_x<WF>(xs, nw, k, x);
      sa += dot_word<WF>(wa[k], load_scale<WF>(ca, k), x, ca, k);
      if constexpr (NR == 2) sb += dot_word<WF>(wa[nw + k], load_scale<WF>(cb, k), x, cb, k);
    }
    sa = warp_sum(sa);
    if constexpr (NR == 2) sb = warp_sum(sb);
    if (lane == 0) {
      if (splits == 1) {
        write(unit, sa, sb);
      } else {
        red[2 * u] = sa;
        red[2 * u + 1] = sb;
      }
    }
  }
  if (splits > 1) {  // (uniform)
    __syncthreads();
    if ((int)threadIdx.x < units) {
      float a = 0.0f, b = 0.0f;
      for (int q = 0; q < splits; q++) {
        a += red[2 * (threadIdx.x * splits + q)];
        b += red[2 * (threadIdx.x * splits + q) + 1];
      }
      write(threadIdx.x, a, b);
    }
  }
}

// Matrix rows [r0, r1) of m from the ring, in tiles of `per` rows (the plan's), after the staging.
template <WFormat WF, Out O>
__device__ inline void ring_rows(const QMat& m, int r0, int r1, int per, const __half* xs, const float* xsum, void* y,
                          float* red, const float* old, PlanRing& pr) {
  for (int r = r0; r < r1; r += per) {
    pr.fill();
    const uint8_t* tile = pr.acquire();
    tile_dot<WF, O>(m, tile, r, min(per, r1 - r), xs, xsum, y, red, old, r0);
    pr.ring.release();
  }
}

// A GEMV task in format WF: stage (RMSNorm'd when NORM), then rows [r0, r1) from the ring in tiles of `per`
// matrix rows (per > 0; Swiglu: outputs [r0, r1) are matrix rows 2 r0 .. 2 r1), else from global memory.
// Add from the ring: the residual rows' old values are loaded before the staging (in flight during it) and kept in
// `keep` (which an unnormed staging does not use) for tile_dot.
template <WFormat WF, bool NORM, Out O>
__device__ inline void gemv_task_fmt(const QMat& m, const void* x, const float* w, float eps, int r0, int r1, void* y,
                              const Smem& sm, int per, PlanRing* pr) {
  constexpr int f = O == Out::Swiglu ? 2 : 1;
  __half* xs = reinterpret_cast<__half*>(sm.work);
  const bool add_ring = O == Out::Add && per > 0;
  const int nr = r1 - r0;
  float o = 0.0f;
  if (add_ring && (int)threadIdx.x < nr) o = ldcg(static_cast<float*>(y) + r0 + threadIdx.x);
  stage<WF, NORM>(m, x, w, eps, xs, sm.xsum, sm.red, sm.keep);
  stamp_at(sm.staged);
  if (per <= 0) {
    gemv_rows<WF, O>(m, r0, r1, xs, sm.xsum, y);
    return;
  }
  float* old = reinterpret_cast<float*>(sm.keep);
  if (add_ring) {
    if ((int)threadIdx.x < nr) old[threadIdx.x] = o;
    for (int i = threadIdx.x + kPersistentThreads; i < nr; i += kPersistentThreads)
      old[i] = ldcg(static_cast<float*>(y) + r0 + i);
    __syncthreads();
  }
  ring_rows<WF, O>(m, f * r0, f * r1, per, xs, sm.xsum, y, sm.red, old, *pr);
}

template <bool NORM, Out O>
__device__ inline void gemv_task(const QMat& m, const void* x, const float* w, float eps, int r0, int r1, void* y,
                          const Smem& sm, int per, PlanRing* pr) {
  switch (m.fmt) {
    case WFormat::F16: gemv_task_fmt<WFormat::F16, NORM, O>(m, x, w, eps, r0, r1, y, sm, per, pr); break;
    case WFormat::I8: gemv_task_fmt<WFormat::I8, NORM, O>(m, x, w, eps, r0, r1, y, sm, per, pr); break;
    case WFormat::I4: gemv_task_fmt<WFormat::I4, NORM, O>(m, x, w, eps, r0, r1, y, sm, per, pr); break;
    case WFormat::I4A8:
    case WFormat::I8A8: break;  // GEMV kernels' names only (gemv_dot.cuh), never a matrix's format
  }
}

}  // namespace ti::cuda::persistent
