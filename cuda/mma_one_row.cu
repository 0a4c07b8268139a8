// mma_one_row.cu — the decode step's GEMV on the tensor cores: y = W x for one input row (mma_one_row.cuh).
//
// Why its own kernel: mma_small_n_kernel at n = 1 (the first R = 16, 2026-12-04) spent its instructions on what n = 1
// does not need. At n = 1 only lanes 0-3 hold the input (the mma's B column 0), and its per-lane branch for the other
// 28 (a column past n: the per-element path) made every warp run both sides for every word; past that, the bounds
// checks of a row's last word in every chunk, the slots zeroed at every refill, the input's address rebuilt per
// chunk. SASS (sm_90, CUDA 13), main loop at fp16 on the normed input: 709 instructions for 4 chunks (two 16-byte
// words a lane each) with both sides of that branch on every word's path; here ~30-40 a chunk on a whole chunk's
// path, against ~65-90 for the CUDA-core GEMV's two words. docs/perf/persistent.md §27.
//
// The layout is mma_small_n's (its file comment): a block of 8 warps owns 16 rows and splits K over its warps in
// chunks of 4 words a row (lane t of group g: word t of rows g and g + 8); the k order inside a k-step permuted so
// that each lane reads E contiguous inputs per word. Different here:
//   - the input is staged once in shared memory, as fp16, zero at and past K up to the last chunk's end, so no
//     chunk checks an input's bounds; the lanes that hold B's input column read it (predicated loads: g == 0, int8
//     below g == t / 2), the others hold zeros; a normed row is staged as the decode GEMV stages it (its norm weight
//     fetched before the PDL wait, one barrier);
//   - only a row's last chunk (warp-uniform) checks the weights' bounds (gb_word_h2); a slot past the row's words
//     is left as it was, never zeroed, as that chunk zeroes such words at use;
//   - the epilogue sums column 0 only (lanes t == 0: rows g and g + 8).
//   - int8: the weights meet the mma as q = u - 128, exact, and each block's d scales its sum after the product in
//     fp32: a chunk's two blocks (words 4c, 4c + 1 and 4c + 2, 4c + 3) are kept apart in D's columns 0 and 1 (lanes
//     t = 0, 1 hold the input in B's column 0, lanes t = 2, 3 in column 1: at n = 1 the other columns are free), so a
//     word costs 2 operations a weight pair instead of 3 (SASS: ~41 instructions a word against the GEMV's 77-98).
//     No bounds anywhere: every byte is a finite q and the staged input is zero past K, so a weight past K (or a
//     stale slot past the row) adds q 0 = 0.
// fp16 and int4: the same values meet in the same mma order as in mma_small_n's register ring at n = 1, so the same
// bits; int8 differs from it by mma_small_n's fp16 rounding of d q (here d q x is summed in fp32, as the GEMV does).
#include "common.cuh"
#include "mma_frag.cuh"
#include "mma_one_row.cuh"
#include "mma_small_n.cuh"
#include "quant_words.cuh"

namespace ti::cuda {

namespace {

constexpr int kOrWarps = 8, kOrThreads = kOrWarps * 32, kOrRows = 16;
static_assert(kOrWarps == 8, "block_sum_once (common.cuh) sums 8 warps");
// Chunks in flight per warp (register slots of 2 words a lane): as mma_small_n's ring, deeper where the grid is
// one wave of one block per SM (there nothing else on the SM hides a round trip to DRAM).
template <WFormat WF> constexpr int kOrUnroll = WF == WFormat::I4 ? 2 : 4;
template <WFormat WF> constexpr int kOrUnrollDeep = WF == WFormat::I4 ? 6 : 8;

__host__ __device__ constexpr int or_padded(int K, int E) { return (K + 4 * E - 1) / (4 * E) * (4 * E); }

// xs[0, P) = the fp16 row, zero at and past K (P: a multiple of 8).
__device__ void stage_f16(const __half* x, int K, int P, __half* xs) {
  for (int i = threadIdx.x; i < P / 8; i += kOrThreads) {
    uint4 v;
    if ((i + 1) * 8 <= K) {
      v = reinterpret_cast<const uint4*>(x)[i];
    } else {
      __align__(16) __half h[8];
#pragma unroll
      for (int e = 0; e < 8; e++) h[e] = i * 8 + e < K ? x[i * 8 + e] : __float2half(0.0f);
      v = *reinterpret_cast<const uint4*>(h);
    }
    reinterpret_cast<uint4*>(xs)[i] = v;
  }
}

// xs[0, P) = fp16(x inv w), zero at and past K; inv = rsqrt(mean(x^2) + eps), the sum of squares in rmsnorm_rows'
// order where K % 4 == 0 (the fp32 row is 16-byte aligned there): the batched step's two kernels' bits. The general
// path (K % 4 != 0, or K past the fast path's registers); stage_normed_fast below otherwise.
__device__ void stage_normed(const float* x, const float* w, float eps, int K, int P, __half* xs) {
  __shared__ float nred[33];
  float ss = 0.0f;
  if (K % 4 == 0) {
    for (int i = threadIdx.x * 4; i < K; i += kOrThreads * 4) {
      const float4 v = *reinterpret_cast<const float4*>(x + i);
      ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
    }
  } else {
    for (int i = threadIdx.x; i < K; i += kOrThreads) ss = fmaf(x[i], x[i], ss);
  }
  const float inv = rsqrtf(block_sum(ss, nred) / (float)K + eps);
  for (int i = threadIdx.x; i < P; i += kOrThreads)
    xs[i] = i < K ? __float2half(x[i] * inv * w[i]) : __float2half(0.0f);
}

// The normed row's fast path, staged as the decode GEMV stages it (gemv_stage.cuh) and with stage_normed's bits: the RMSNorm
// weight, itself a weight, copied before the PDL wait into shared memory (cp.async: no register and no stall; each
// thread the float4s it reads later, so no barrier); after the wait the row's NV float4s a thread held in registers
// from the sum of squares (stage_normed's order) to the write, and the block's sum with one barrier (block_sum_once).
// stage_normed spends two round trips to L2 after the wait (the row, then the weight after the sum) and three
// barriers in the sum, on the normed roles' critical path (qkv, gate/up, the LM head), where the GEMV it stands in for
// spends one and one. NV = 2 up to K = 2,048 (TinyLlama, SmolLM2: 8 registers), else 8 (K <= 8,192: 32 registers).
__host__ __device__ constexpr bool or_norm_fast(int K, int NV) { return K % 4 == 0 && K <= NV * 4 * kOrThreads; }
__host__ __device__ constexpr int or_norm_vec(int K) { return K <= 2 * 4 * kOrThreads ? 2 : 8; }

template <int NV>
__device__ __forceinline__ void prefetch_norm_w(const float* w, int K, float* nws) {
#pragma unroll
  for (int u = 0; u < NV; u++) {
    const int i = threadIdx.x + u * kOrThreads;
    if (i < K / 4) cp_async16(nws + 4 * i, w + 4 * i);
  }
  cp_async_commit();
}

template <int NV>
__device__ __forceinline__ void stage_normed_fast(const float* x, const float* nws, float eps, int K, int P,
                                                  __half* xs) {
  __shared__ __align__(16) float nred[kOrWarps];
  const int nv = K / 4;
  float4 xr[NV];
  float ss = 0.0f;
#pragma unroll
  for (int u = 0; u < NV; u++) {
    const int i = threadIdx.x + u * kOrThreads;
    xr[u] = i < nv ? reinterpret_cast<const float4*>(x)[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (i < nv) ss = fmaf(xr[u].x, xr[u].x, fmaf(xr[u].y, xr[u].y, fmaf(xr[u].z, xr[u].z, fmaf(xr[u].w, xr[u].w, ss))));
  }
  const float inv = rsqrtf(block_sum_once(ss, nred) / (float)K + eps);
  cp_async_wait<0>();  // this thread's copies of the norm weight (prefetch_norm_w)
#pragma unroll
  for (int u = 0; u < NV; u++) {
    const int i = threadIdx.x + u * kOrThreads;
    if (i < nv) {
      const float4 w = reinterpret_cast<const float4*>(nws)[i];  // (this thread's own prefetch)
      __half2* dst = reinterpret_cast<__half2*>(xs + 4 * i);
      dst[0] = __floats2half2_rn(xr[u].x * inv * w.x, xr[u].y * inv * w.y);
      dst[1] = __floats2half2_rn(xr[u].z * inv * w.z, xr[u].w * inv * w.w);
    }
  }
  for (int i = K + threadIdx.x; i < P; i += kOrThreads) xs[i] = __float2half(0.0f);
}

// p, as a value the compiler cannot recompute from what made it (so it keeps it in registers instead).
template <typename T>
__device__ __forceinline__ const T* or_opaque(const T* p) {
  asm("mov.b64 %0, %0;" : "+l"(p));
  return p;
}


// NV: F32Norm's fast-path float4s a thread (or_norm_vec; 0 for F16 inputs).
template <WFormat WF, GemvIn IN, GemvOut OUT, int U, int NV>
__global__ void __launch_bounds__(kOrThreads) mma_one_row_kernel(GemvBatchArgs a) {
  constexpr int E = kWordElems<WF>, XW = E / 8;
  // (kOrWarps, kOrRows) the warps' sums; then the staged input (P halves); then, F32Norm's fast path, the norm weight
  extern __shared__ __align__(16) float red[];
  __half* xs = reinterpret_cast<__half*>(red + kOrWarps * kOrRows);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const QMat& W = a.W;
  const int K = W.K, row0 = blockIdx.x * kOrRows;
  const int words = gb_words(W, E), chunks = (words + 3) / 4, full_chunks = K / (4 * E), P = or_padded(K, E);
  float* nws = reinterpret_cast<float*>(xs + P);
  const int ra = min(row0 + g, W.rows - 1), rb = min(row0 + g + 8, W.rows - 1);  // past the end: stored nowhere
  // The lane's word of chunk c: wa + 4 c. Held (or_opaque): left to itself the compiler rebuilt both row pointers
  // from ra / rb at every refill at U = 4 (~18 instructions a chunk).
  const uint4* wa = or_opaque(gb_row<WF>(W, ra) + t);
  const uint4* wb = or_opaque(gb_row<WF>(W, rb) + t);

  // I8 (kBlocks): the chunk's two blocks' d of rows g and g + 8 (every lane of the quad the same pair), for after the
  // product; I4: the word's (s, m); fp16 nothing.
  constexpr bool kBlocks = WF == WFormat::I8;
  const int nb = W.ld / kI8Block;  // I8: blocks per row
  const __half* da = nullptr;
  const __half* db = nullptr;
  if constexpr (kBlocks) {
    da = or_opaque(static_cast<const __half*>(W.scales) + (size_t)ra * nb);
    db = or_opaque(static_cast<const __half*>(W.scales) + (size_t)rb * nb);
  }
  uint4 va[U], vb[U];  // (zeroed once, so that no slot is ever read undefined; never again: see above)
  float2 sa[U], sb[U];
  __half2 ha[kBlocks ? U : 1], hb[kBlocks ? U : 1];  // I8: (d of block 2c, of 2c + 1), rows g / g + 8: a register
#pragma unroll
  for (int u = 0; u < U; u++) va[u] = vb[u] = make_uint4(0, 0, 0, 0), sa[u] = sb[u] = make_float2(0.0f, 0.0f);
#pragma unroll
  for (int u = 0; u < (kBlocks ? U : 1); u++) ha[u] = hb[u] = __float2half2_rn(0.0f);
  auto load = [&](int u, int c) {  // chunk c (of this warp) into slot u
    const int k = 4 * c + t;
    if (c < chunks && k < words) {
      va[u] = load_stream(wa + 4 * c);
      vb[u] = load_stream(wb + 4 * c);
      if constexpr (!kBlocks) {
        sa[u] = gb_scale<WF>(W, ra, k);
        sb[u] = gb_scale<WF>(W, rb, k);
      }
    }
    if constexpr (kBlocks) {
      if (c < chunks) {  // (block 2c exists wherever chunk c does; 2c + 1 not past the row's last block)
        const bool two = 2 * c + 1 < nb;
        const __half z = __float2half(0.0f);
        ha[u] = __halves2half2(da[2 * c], two ? da[2 * c + 1] : z);
        hb[u] = __halves2half2(db[2 * c], two ? db[2 * c + 1] : z);
      }
    }
  };
  // PDL (common.cuh): the first chunks' weights before the wait, the input after it; the trigger follows it.
#pragma unroll
  for (int u = 0; u < U; u++) load(u, warp + u * kOrWarps);
  if constexpr (IN == GemvIn::F32Norm)
    if (or_norm_fast(K, NV)) prefetch_norm_w<NV>(a.norm_w, K, nws);
  pdl_wait();
  pdl_launch_dependents();
  if constexpr (IN == GemvIn::F32Norm) {
    if (or_norm_fast(K, NV)) stage_normed_fast<NV>(static_cast<const float*>(a.x), nws, a.eps, K, P, xs);
    else stage_normed(static_cast<const float*>(a.x), a.norm_w, a.eps, K, P, xs);
  } else {
    stage_f16(static_cast<const __half*>(a.x), K, P, xs);
  }
  __syncthreads();

  const uint4* xl = reinterpret_cast<const uint4*>(xs) + t * XW;  // the lane's inputs of chunk c: xl + 4 XW c
  // The lanes that hold the input in B: column 0 (g == 0); I8: column 0 the first block of the chunk (lanes t = 0, 1:
  // words 4c, 4c + 1), column 1 the second (t = 2, 3), so that D's columns 0 and 1 are the two blocks' sums apart.
  const bool feed = kBlocks ? g == (t >> 1) : g == 0;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int c0 = warp; c0 < chunks; c0 += kOrWarps * U) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + u * kOrWarps;
      if (c >= chunks) break;
      __half2 x2[E / 2];
#pragma unroll
      for (int q = 0; q < XW; q++) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (feed) v = xl[4 * XW * c + q];
        x2[4 * q] = gb_h2(v.x), x2[4 * q + 1] = gb_h2(v.y), x2[4 * q + 2] = gb_h2(v.z), x2[4 * q + 3] = gb_h2(v.w);
      }
      __half2 wa2[E / 2], wb2[E / 2];
      if constexpr (kBlocks) {  // q exact (no bounds: see the file comment); d after the product
        gb_word_q8_h2<false>(va[u], 0, K, true, wa2);
        gb_word_q8_h2<false>(vb[u], 0, K, true, wb2);
      } else if (c < full_chunks) {  // (warp-uniform) every word wholly below K
        gb_word_h2<WF, false>(va[u], sa[u], 0, K, true, wa2);
        gb_word_h2<WF, false>(vb[u], sb[u], 0, K, true, wb2);
      } else {
        const int k = 4 * c + t;
        gb_word_h2<WF>(va[u], sa[u], k, K, k < words, wa2);
        gb_word_h2<WF>(vb[u], sb[u], k, K, k < words, wb2);
      }
      float dq[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // I8: the chunk's sums of q x, (row g, block 2c / 2c + 1), (g + 8, ...)
      float* d = kBlocks ? dq : acc;
#pragma unroll
      for (int s = 0; s < E / 4; s++) {  // mma_small_n's k-steps (mm_word), in its order
        const uint32_t af[4] = {gb_u32(wa2[2 * s]), gb_u32(wb2[2 * s]), gb_u32(wa2[2 * s + 1]), gb_u32(wb2[2 * s + 1])};
        mma_16816(d, af, gb_u32(x2[2 * s]), gb_u32(x2[2 * s + 1]));
      }
      if constexpr (kBlocks) {  // (lanes t != 0 hold columns 2-7: zeros; their acc is never read)
        const float2 fa = __half22float2(ha[u]), fb = __half22float2(hb[u]);
        acc[0] = fmaf(fa.y, dq[1], fmaf(fa.x, dq[0], acc[0]));
        acc[2] = fmaf(fb.y, dq[3], fmaf(fb.x, dq[2], acc[2]));
      }
      load(u, c + kOrWarps * U);  // the slot's next chunk (none past the warp's last)
    }
  }

  // Column 0 of D: lanes t == 0 hold rows g (acc[0]) and g + 8 (acc[2]); the warps' sums meet in warp order.
  if (t == 0) red[warp * kOrRows + g] = acc[0], red[warp * kOrRows + g + 8] = acc[2];
  __syncthreads();
  auto total = [&](int r) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kOrWarps; w++) s += red[w * kOrRows + r];
    return s;
  };
  if constexpr (OUT == GemvOut::Swiglu) {  // rows 2i (gate), 2i + 1 (up)
    const int p = threadIdx.x, row = row0 + 2 * p;
    if (p < kOrRows / 2 && row + 1 < W.rows) {
      const float gt = total(2 * p), up = total(2 * p + 1);
      static_cast<__half*>(a.y)[row / 2] = __float2half(gt / (1.0f + __expf(-gt)) * up);
    }
  } else {
    const int r = threadIdx.x, row = row0 + r;
    if (r < kOrRows && row < W.rows) {
      float* y = static_cast<float*>(a.y) + row;
      const float v = total(r);
      *y = OUT == GemvOut::AddF32 ? *y + v : v;
    }
  }
}

template <WFormat WF, GemvIn IN, GemvOut OUT, int U, int NV = 0>
void launch_one_row(const GemvBatchArgs& a, cudaStream_t s, bool pdl) {
  const int K = a.W.K;
  const size_t smem = (size_t)kOrWarps * kOrRows * sizeof(float) + (size_t)or_padded(K, kWordElems<WF>) * 2 +
                      (IN == GemvIn::F32Norm && or_norm_fast(K, NV) ? (size_t)K * sizeof(float) : 0);
  auto kernel = mma_one_row_kernel<WF, IN, OUT, U, NV>;
  allow_dynamic_smem(kernel, smem);  // (F32Norm's fast path past K ~ 8,050)
  launch(kernel, dim3((a.W.rows + kOrRows - 1) / kOrRows), dim3(kOrThreads), smem, s, pdl, a);
}

template <WFormat WF, GemvOut OUT>
void launch_normed(const GemvBatchArgs& a, cudaStream_t s, bool pdl) {
  if (or_norm_vec(a.W.K) == 2) return launch_one_row<WF, GemvIn::F32Norm, OUT, kOrUnroll<WF>, 2>(a, s, pdl);
  launch_one_row<WF, GemvIn::F32Norm, OUT, kOrUnroll<WF>, 8>(a, s, pdl);
}

template <WFormat WF>
void one_row_modes(const GemvBatchArgs& a, GemvIn in, GemvOut out, cudaStream_t s, bool pdl) {
  if (in == GemvIn::F32Norm) {
    if (out == GemvOut::F32) return launch_normed<WF, GemvOut::F32>(a, s, pdl);
    return launch_normed<WF, GemvOut::Swiglu>(a, s, pdl);
  }
  if (out == GemvOut::F32) return launch_one_row<WF, GemvIn::F16, GemvOut::F32, kOrUnroll<WF>>(a, s, pdl);
  // the residual products (o, down): at a 2,048-wide model one wave of 16-row blocks
  if ((a.W.rows + kOrRows - 1) / kOrRows <= sm_count())
    return launch_one_row<WF, GemvIn::F16, GemvOut::AddF32, kOrUnrollDeep<WF>>(a, s, pdl);
  launch_one_row<WF, GemvIn::F16, GemvOut::AddF32, kOrUnroll<WF>>(a, s, pdl);
}

}  // namespace

bool mma_one_row_fits(const QMat& W, GemvIn in) {
  return mma_small_n_fits(W, 1) && (in == GemvIn::F16 || W.K <= kMmaOneRowMaxK);
}

void mma_one_row(const GemvBatchArgs& a, GemvIn in, GemvOut out, cudaStream_t s, bool pdl) {
  const QMat& W = a.W;
  const bool normed = in == GemvIn::F32Norm;
  if (normed ? out != GemvOut::F32 && out != GemvOut::Swiglu : out != GemvOut::F32 && out != GemvOut::AddF32)
    fail(ErrorKind::Request, normed ? "mma_one_row: a normed input's out must be f32 or swiglu"
                                    : "mma_one_row: an f16 input's out must be f32 or add");
  if (a.n != 1 || (normed && !a.norm_w) || W.rows < 1 || W.K < 1 ||
      a.ldy < (out == GemvOut::Swiglu ? W.rows / 2 : W.rows) || (out == GemvOut::Swiglu && W.rows % 2 != 0))
    fail(ErrorKind::Request, "mma_one_row: one input row (f32norm: and a norm weight) and an output row of the "
                             "matrix's rows (n=" + std::to_string(a.n) + " rows=" + std::to_string(W.rows) +
                                 " ldy=" + std::to_string(a.ldy) + ")");
  if (!mma_one_row_fits(W, in))
    fail(ErrorKind::Request, "mma_one_row: needs sm_80+, (f32norm) K <= " + std::to_string(kMmaOneRowMaxK) +
                                 " and (int4) K % 32 == 0");
  if (in == GemvIn::F16 && W.K > kMmaOneRowMaxK) {  // (past the staging: the batched kernel; int8: its fp16(d q))
    GemvBatchArgs b = a;
    b.m_tiles = 0;
    b.smem_ring = false;
    return mma_small_n(b, out, s, pdl);
  }
  if (W.fmt == WFormat::F16) one_row_modes<WFormat::F16>(a, in, out, s, pdl);
  else if (W.fmt == WFormat::I8) one_row_modes<WFormat::I8>(a, in, out, s, pdl);
  else one_row_modes<WFormat::I4>(a, in, out, s, pdl);
}

}  // namespace ti::cuda
