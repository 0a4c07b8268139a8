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
#include <cfloat>

#include "common.cuh"
#include "gemv_dot.cuh"
#include "kv_layout.cuh"
#include "persistent.cuh"
#include "ring.cuh"
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
__device__ void tile_dot(const QMat& m, const uint8_t* tile, int row0, int R, const __half* xs, const float* xsum,
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
__device__ void ring_rows(const QMat& m, int r0, int r1, int per, const __half* xs, const float* xsum, void* y,
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
__device__ void gemv_task_fmt(const QMat& m, const void* x, const float* w, float eps, int r0, int r1, void* y,
                              const Smem& sm, int per, PlanRing* pr) {
  constexpr int f = O == Out::Swiglu ? 2 : 1;
  __half* xs = reinterpret_cast<__half*>(sm.work);
  const bool add_ring = O == Out::Add && per > 0;
  const int nr = r1 - r0;
  float o = 0.0f;
  if (add_ring && (int)threadIdx.x < nr) o = ldcg(static_cast<float*>(y) + r0 + threadIdx.x);
  stage<WF, NORM>(m, x, w, eps, xs, sm.xsum, sm.red, sm.keep);
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
__device__ void gemv_task(const QMat& m, const void* x, const float* w, float eps, int r0, int r1, void* y,
                          const Smem& sm, int per, PlanRing* pr) {
  switch (m.fmt) {
    case WFormat::F16: gemv_task_fmt<WFormat::F16, NORM, O>(m, x, w, eps, r0, r1, y, sm, per, pr); break;
    case WFormat::I8: gemv_task_fmt<WFormat::I8, NORM, O>(m, x, w, eps, r0, r1, y, sm, per, pr); break;
    case WFormat::I4: gemv_task_fmt<WFormat::I4, NORM, O>(m, x, w, eps, r0, r1, y, sm, per, pr); break;
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
// The attention task's shared memory (`work`): the rotated queries, scores, the RoPE row, the chunk's cache rows,
// the softmax sums; with kv_stage the chunk's keys and values (CH x hd halves each) after them.
struct AttnSmem {
  float *q_s, *s_s, *cs, *sn, *lsum;
  int* rows;
  __half *ks, *vs;
  __host__ __device__ AttnSmem(unsigned char* work, int g, int hd, int CH) {
    q_s = reinterpret_cast<float*>(work);  // (g, hd)
    s_s = q_s + g * hd;                    // (g, CH) scores, then probabilities
    cs = s_s + g * CH;                     // (hd / 2) RoPE row of pos
    sn = cs + hd / 2;
    rows = reinterpret_cast<int*>(sn + hd / 2);  // (CH) the chunk's cache rows (elements from the layer's base)
    lsum = reinterpret_cast<float*>(rows + CH);  // (g) the softmax sums
    const size_t at = ((size_t)(reinterpret_cast<unsigned char*>(lsum + g) - work) + 15) / 16 * 16;
    ks = reinterpret_cast<__half*>(work + at);  // (CH, hd) kv_stage only
    vs = ks + (size_t)CH * hd;
  }
  // the bytes the layout above spans (the same arithmetic, from offset 0)
  static size_t bytes(int g, int hd, int CH, bool kv_stage) {
    const size_t head = ((size_t)(g * hd + g * CH + hd + CH + g) * sizeof(float) + 15) / 16 * 16;
    return head + (kv_stage ? 2 * (size_t)CH * hd * sizeof(__half) : 0);
  }
};

// Before the task's wait: the chunk's cache rows, and (kv_stage) the keys and values of its positions before pos
// — written by earlier steps, final — copied into shared memory with cp.async, so that after the wait only the
// new token's q / k / v are on the critical path. The copies complete in attn_partial (wait_all + a barrier).
__device__ void attn_preload(const PersistentParams& p, int l, int kvh, int c, int pos, unsigned char* work) {
  const int hd = p.head_dim, CH = p.chunk, c0 = c * CH, g = p.n_heads / p.n_kv_heads;
  const int n = min(CH, pos + 1 - c0);
  const AttnSmem a(work, g, hd, CH);
  for (int t = threadIdx.x; t < n; t += kPersistentThreads)
    a.rows[t] = (int)kv_row(p.page_table, c0 + t, kvh, p.n_kv_heads, p.page_shift, hd);
  if (!p.kv_stage) return;
  const int n_old = min(CH, pos - c0), pieces = hd / 8;  // 16-byte pieces per row
  const size_t layer = (size_t)l * p.kv_layer_elems;
  for (int e = threadIdx.x; e < n_old * pieces; e += kPersistentThreads) {
    const int t = e / pieces, j = e % pieces;
    const size_t at = layer + kv_row(p.page_table, c0 + t, kvh, p.n_kv_heads, p.page_shift, hd) + 8 * j;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(a.ks + t * hd + 8 * j)),
                 "l"(p.k_pages + at) : "memory");
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(a.vs + t * hd + 8 * j)),
                 "l"(p.v_pages + at) : "memory");
#endif
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

__device__ void attn_partial(const PersistentParams& p, int l, int kvh, int c, int pos, unsigned char* work) {
  const int hd = p.head_dim, half_d = hd / 2, CH = p.chunk, c0 = c * CH;
  if (c0 > pos) return;
  const int n = min(CH, pos + 1 - c0), g = p.n_heads / p.n_kv_heads, hq0 = kvh * g;
  const AttnSmem a(work, g, hd, CH);
  float *q_s = a.q_s, *s_s = a.s_s, *cs = a.cs, *sn = a.sn, *lsum = a.lsum;
  const int* rows = a.rows;  // (attn_preload)
  __half* kp = p.k_pages + (size_t)l * p.kv_layer_elems;
  __half* vp = p.v_pages + (size_t)l * p.kv_layer_elems;
  // where position t's key and value are read: the staged tiles (kv_stage) or the cache
  const bool st = p.kv_stage;
  const __half* kb = st ? a.ks : kp;
  const __half* vb = st ? a.vs : vp;
  auto off = [&](int t) { return st ? t * hd : rows[t]; };
  for (int i = threadIdx.x; i < half_d; i += kPersistentThreads) {
    cs[i] = p.rope_cos[(size_t)pos * half_d + i];
    sn[i] = p.rope_sin[(size_t)pos * half_d + i];
  }
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
      const __half r1 = __float2half(__fsub_rn(__fmul_rn(k1, cs[i]), __fmul_rn(k2, sn[i])));
      const __half r2 = __float2half(__fadd_rn(__fmul_rn(k2, cs[i]), __fmul_rn(k1, sn[i])));
      const __half v1 = __float2half(ldcg(v + i)), v2 = __float2half(ldcg(v + i + half_d));
      kp[at + i] = r1;
      kp[at + i + half_d] = r2;
      vp[at + i] = v1;
      vp[at + i + half_d] = v2;
      if (st) {  // the same values into the staged tiles
        __half* kt = a.ks + (pos - c0) * hd;
        __half* vt = a.vs + (pos - c0) * hd;
        kt[i] = r1;
        kt[i + half_d] = r2;
        vt[i] = v1;
        vt[i + half_d] = v2;
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (st) asm volatile("cp.async.wait_all;" ::: "memory");  // attn_preload's copies (this thread's)
#endif
  __syncthreads();
  // scores: a warp per position, all g heads; lane `lane` holds the key's dimension pairs 2 lane + 64 j
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int kPairs = 4;  // head_dim <= 256 (PersistentDecode::unsupported)
  for (int t = warp; t < n; t += kWarps) {
    const __half2* kr = reinterpret_cast<const __half2*>(kb + off(t));
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
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(vb + off(t) + d));
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

// Task t (index i of the flattened schedule); per: its ring tiles' rows (0: its weights from global memory).
__device__ void run_task(const PersistentParams& p, const PTask& t, int token, int pos, const Smem& sm, int per,
                         PlanRing* pr) {
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
      attn_partial(p, t.layer, t.a, t.b, pos, sm.work);
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

__global__ void __launch_bounds__(kPersistentThreads) persistent_kernel(PersistentParams p) {
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
    run_task(p, t, token, pos, sm, per, pr);
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
