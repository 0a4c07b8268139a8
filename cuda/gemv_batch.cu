// gemv_batch.cu — y = W x for a few vectors x at once (the batched decode step), see gemv_batch.cuh.
//
// A block of 8 warps serves one group of NB <= 8 input rows (the grid's x) and walks tiles of 8 x R weight rows,
// R rows per warp (the grid's y: about two blocks per SM, each looping over tiles; the groups of one tile run
// side by side, so a second group's weights come from L2). A lane streams its rows in 16-byte words (8 fp16,
// 16 I8 or 32 I4 weights), 8 words in flight, dequantizes each word once and meets it with the same K-slice of
// each of the NB inputs (each input fragment read once for the R rows); the R x NB sums are reduced over the
// warp by shuffles.
//   fp16: fp32 FMAs (memory-bound: ~13 instructions per weight pair for 8 inputs).
//   I8 / I4: at 8 inputs, fp32 dequantization and FMAs cost ~2-4x what the memory system delivers, so the word is
//   dequantized to fp16 pairs without int->float conversions (I8: byte u = q + 128 as the fp16 1024 + u, minus
//   1152, times d; I4: gemv_dot.cuh's LOP3 trick, (q - 8) s + (m + 8 s)) and each input meets it with HFMA2s,
//   fp16 sums over one word (16 or 32 products, as the decode GEMV's I4 group sums), widened to fp32 per word.
//   The weights are then the fp16 numbers the prefill's dequantization makes (quant.cu).
// Inputs: F16 rows are read from global memory (small next to the weights: L1 / L2 hits after the first tile);
// F32Norm rows are RMS-normed once per block into shared memory as fp16 (the decode GEMV's rounding:
// fp16(w * (x * inv))), zero-padded to whole words; with act8 then rounded to fp16(d xq) (cuda/act8.cuh).
// Swiglu: the gate and up rows of a pair are adjacent warps; their sums meet in shared memory.
#include <algorithm>

#include "act8.cuh"
#include "common.cuh"
#include "gemv_batch.cuh"
#include "quant_words.cuh"

namespace ti::cuda {

constexpr int kGbWarps = 8, kGbThreads = kGbWarps * 32, kGbUnroll = 4;

// R rows per warp: each input fragment, read once from L1 / shared memory, meets the R rows' dequantized words
// (at 8 inputs a 16-byte I4 word meets 512 bytes of inputs: with R = 1 those reads, not the weights, would set
// the pace). Swiglu needs R even (gate and up rows of a pair in one warp).
template <int R, WFormat WF, int NB, GemvIn IN, GemvOut OUT>
__global__ void __launch_bounds__(kGbThreads) gemv_batch_kernel(GemvBatchArgs a) {
  static_assert(OUT != GemvOut::Swiglu || R % 2 == 0, "swiglu pairs rows within a warp");
  constexpr int E = kWordElems<WF>, U = R >= 4 ? 2 : 4;  // U: words per row in flight (R U per lane)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* xs = reinterpret_cast<__half*>(smem_raw);  // F32Norm: (NB, words * E) the normed inputs
  __shared__ float inv_s[NB];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int col0 = blockIdx.x * NB, words = gb_words(a.W, E), kw = words * E;
  const int n_cols = min(NB, a.n - col0);
  // PDL (common.cuh): nothing is read before the wait, and the trigger follows it, so a successor may read
  // what was written two kernels back before its own wait (the attention's cache tiles).
  pdl_wait();
  pdl_launch_dependents();

  if constexpr (IN == GemvIn::F32Norm) {  // ---- prologue: the group's inputs RMS-normed into shared memory ----
    if (warp < n_cols) {
      const float* x = static_cast<const float*>(a.x) + (size_t)(col0 + warp) * a.ldx;
      float ss = 0.0f;
      for (int i = lane; i < a.W.K; i += 32) ss = fmaf(x[i], x[i], ss);
      ss = warp_sum(ss);
      if (lane == 0) inv_s[warp] = rsqrtf(ss / (float)a.W.K + a.eps);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < NB * kw; i += kGbThreads) {
      const int j = i / kw, e = i - j * kw;
      float v = 0.0f;
      if (j < n_cols && e < a.W.K)
        v = a.norm_w[e] * (static_cast<const float*>(a.x)[(size_t)(col0 + j) * a.ldx + e] * inv_s[j]);
      xs[i] = __float2half(v);
    }
    __syncthreads();
    if (a.act8) {  // (uniform) a thread per 16-byte word of xs, 4 lanes a group; the trip count block-uniform
      uint4* xw = reinterpret_cast<uint4*>(xs);
      for (int i0 = 0; i0 < NB * kw / 8; i0 += kGbThreads) {
        const int i = i0 + threadIdx.x;
        const bool in = i < NB * kw / 8;
        float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (in) unpack8(xw[i], f);
        act8_round<4>(f);
        if (in) xw[i] = pack8(f);
      }
      __syncthreads();
    }
  }

  const int tiles = (a.W.rows + kGbWarps * R - 1) / (kGbWarps * R);
  for (int tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    const int row0 = (tile * kGbWarps + warp) * R;
    const uint4* wrow[R];
    int rr[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
      rr[r] = min(row0 + r, a.W.rows - 1);  // rows past the end compute on the last row and store nothing
      wrow[r] = gb_row<WF>(a.W, rr[r]);
    }
    float acc[R][NB];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
      for (int j = 0; j < NB; j++) acc[r][j] = 0.0f;
    for (int k0 = lane; k0 < words; k0 += 32 * U) {
      uint4 wv[U][R];
      float2 sc[U][R];
#pragma unroll
      for (int u = 0; u < U; u++)  // loads first: R U words in flight per lane
#pragma unroll
        for (int r = 0; r < R; r++) {
          const int k = k0 + 32 * u;
          wv[u][r] = k < words ? load_stream(wrow[r] + k) : make_uint4(0, 0, 0, 0);
          sc[u][r] = gb_scale<WF>(a.W, rr[r], k < words ? k : 0);
        }
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int k = k0 + 32 * u;
        if (k >= words) break;
        const bool whole = IN == GemvIn::F32Norm || (k + 1) * E <= a.W.K;
        if constexpr (WF == WFormat::F16) {
          float w[R][8];
#pragma unroll
          for (int r = 0; r < R; r++) unpack8(wv[u][r], w[r]);
#pragma unroll
          for (int j = 0; j < NB; j++) {
            if (j >= n_cols) break;
            const __half* x = IN == GemvIn::F32Norm ? xs + (size_t)j * kw + (size_t)k * E
                                                    : static_cast<const __half*>(a.x) + (size_t)(col0 + j) * a.ldx + (size_t)k * E;
            float xf[8];
            if (whole) {
              unpack8(IN == GemvIn::F32Norm ? *reinterpret_cast<const uint4*>(x) : __ldg(reinterpret_cast<const uint4*>(x)), xf);
            } else {  // the row's last word, part of it past K: those inputs are not read
#pragma unroll
              for (int e = 0; e < 8; e++) xf[e] = k * E + e < a.W.K ? __half2float(x[e]) : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
              float s = 0.0f;
#pragma unroll
              for (int e = 0; e < 8; e++) s = fmaf(w[r][e], xf[e], s);
              acc[r][j] += s;
            }
          }
        } else {
          __half2 w[R][E / 2];
#pragma unroll
          for (int r = 0; r < R; r++) gb_dequant_h2<WF>(wv[u][r], sc[u][r], w[r]);
#pragma unroll
          for (int j = 0; j < NB; j++) {
            if (j >= n_cols) break;
            const __half* x = IN == GemvIn::F32Norm ? xs + (size_t)j * kw + (size_t)k * E
                                                    : static_cast<const __half*>(a.x) + (size_t)(col0 + j) * a.ldx + (size_t)k * E;
            if (whole) {
              __half2 h[R];
#pragma unroll
              for (int r = 0; r < R; r++) h[r] = __float2half2_rn(0.0f);
#pragma unroll
              for (int c = 0; c < E / 8; c++) {
                const uint4 xv = IN == GemvIn::F32Norm ? reinterpret_cast<const uint4*>(x)[c]
                                                       : __ldg(reinterpret_cast<const uint4*>(x) + c);
#pragma unroll
                for (int r = 0; r < R; r++) {
                  h[r] = __hfma2(w[r][4 * c], gb_h2(xv.x), h[r]);
                  h[r] = __hfma2(w[r][4 * c + 1], gb_h2(xv.y), h[r]);
                  h[r] = __hfma2(w[r][4 * c + 2], gb_h2(xv.z), h[r]);
                  h[r] = __hfma2(w[r][4 * c + 3], gb_h2(xv.w), h[r]);
                }
              }
#pragma unroll
              for (int r = 0; r < R; r++) {
                const float2 f = __half22float2(h[r]);
                acc[r][j] += f.x + f.y;
              }
            } else {  // the row's last word, part of it past K: those inputs are not read
#pragma unroll
              for (int r = 0; r < R; r++) {
                float s = 0.0f;
#pragma unroll
                for (int e = 0; e < E; e++)
                  if (k * E + e < a.W.K)
                    s = fmaf(__half2float(e & 1 ? __high2half(w[r][e / 2]) : __low2half(w[r][e / 2])), __half2float(x[e]), s);
                acc[r][j] += s;
              }
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
      for (int j = 0; j < NB; j++) acc[r][j] = warp_sum(acc[r][j]);

    if (lane == 0) {  // ---- epilogue ----
#pragma unroll
      for (int j = 0; j < NB; j++) {
        if (j >= n_cols) break;
        if constexpr (OUT == GemvOut::Swiglu) {  // rows 2i (gate), 2i + 1 (up)
#pragma unroll
          for (int r = 0; r < R; r += 2) {
            if (row0 + r + 1 >= a.W.rows) break;
            const float g = acc[r][j], u = acc[r + 1][j];
            static_cast<__half*>(a.y)[(size_t)(col0 + j) * a.ldy + (row0 + r) / 2] = __float2half(g / (1.0f + __expf(-g)) * u);
          }
        } else {
          float* y = static_cast<float*>(a.y) + (size_t)(col0 + j) * a.ldy;
#pragma unroll
          for (int r = 0; r < R; r++) {
            if (row0 + r >= a.W.rows) break;
            y[row0 + r] = OUT == GemvOut::AddF32 ? y[row0 + r] + acc[r][j] : acc[r][j];
          }
        }
      }
    }
  }
}

static int gb_smem_limit() {
  static int limit = [] {
    int dev = 0, n = 0;
    TI_CUDA_CHECK(cudaGetDevice(&dev));
    TI_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return n - 4096;  // (the static shared arrays)
  }();
  return limit;
}
static int gb_nb(int n) { return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : 8; }
static size_t gb_smem(const QMat& W, int nb, GemvIn in) {
  const int E = W.fmt == WFormat::F16 ? 8 : W.fmt == WFormat::I8 ? 16 : 32;
  return in == GemvIn::F32Norm ? (size_t)nb * gb_words(W, E) * E * sizeof(__half) : 0;
}

bool gemv_batch_fits(const QMat& W, int n, GemvIn in) {
  return n >= 1 && gb_smem(W, gb_nb(n), in) <= (size_t)gb_smem_limit();
}

// R: 1 for a single input (no fragment to share; Swiglu: 2), else 4 for I4 (a word meets the most inputs),
// 2 for I8 and fp16.
template <WFormat WF, int NB, GemvOut OUT>
constexpr int gb_rows_per_warp() {
  return NB == 1 ? (OUT == GemvOut::Swiglu ? 2 : 1) : WF == WFormat::I4 ? 4 : 2;
}

template <WFormat WF, int NB, GemvIn IN, GemvOut OUT>
static void launch_gb(const GemvBatchArgs& a, cudaStream_t s, bool pdl) {
  constexpr int R = gb_rows_per_warp<WF, NB, OUT>();
  const size_t smem = gb_smem(a.W, NB, IN);
  allow_dynamic_smem(gemv_batch_kernel<R, WF, NB, IN, OUT>, smem);
  const int groups = (a.n + NB - 1) / NB, tiles = (a.W.rows + kGbWarps * R - 1) / (kGbWarps * R);
  const int per_group = std::max(1, (2 * sm_count() + groups - 1) / groups);  // ~2 blocks per SM in all
  launch(gemv_batch_kernel<R, WF, NB, IN, OUT>, dim3(groups, std::min(tiles, per_group)), dim3(kGbThreads), smem, s,
         pdl, a);
}

template <WFormat WF, int NB>
static void dispatch_modes(const GemvBatchArgs& a, GemvIn in, GemvOut out, cudaStream_t s, bool pdl) {
  if (in == GemvIn::F32Norm && out == GemvOut::F32) return launch_gb<WF, NB, GemvIn::F32Norm, GemvOut::F32>(a, s, pdl);
  if (in == GemvIn::F32Norm && out == GemvOut::Swiglu) return launch_gb<WF, NB, GemvIn::F32Norm, GemvOut::Swiglu>(a, s, pdl);
  if (in == GemvIn::F16 && out == GemvOut::AddF32) return launch_gb<WF, NB, GemvIn::F16, GemvOut::AddF32>(a, s, pdl);
  fail(ErrorKind::Request, "gemv_batch: modes are (f32norm, f32), (f32norm, swiglu) or (f16, add)");
}

template <WFormat WF>
static void dispatch_nb(const GemvBatchArgs& a, GemvIn in, GemvOut out, cudaStream_t s, bool pdl) {
  switch (gb_nb(a.n)) {
    case 1: return dispatch_modes<WF, 1>(a, in, out, s, pdl);
    case 2: return dispatch_modes<WF, 2>(a, in, out, s, pdl);
    case 4: return dispatch_modes<WF, 4>(a, in, out, s, pdl);
    default: return dispatch_modes<WF, 8>(a, in, out, s, pdl);
  }
}

void gemv_batch(const GemvBatchArgs& a, GemvIn in, GemvOut out, cudaStream_t s, bool pdl) {
  const QMat& W = a.W;
  if (a.n < 1 || a.ldx % 8 != 0 || a.ldx < W.K || W.rows < 1 || W.K < 1 ||
      a.ldy < (out == GemvOut::Swiglu ? W.rows / 2 : W.rows) || (out == GemvOut::Swiglu && W.rows % 2 != 0))
    fail(ErrorKind::Request, "gemv_batch: bad shape n=" + std::to_string(a.n) + " K=" + std::to_string(W.K) +
                                 " ldx=" + std::to_string(a.ldx) + " rows=" + std::to_string(W.rows) +
                                 " ldy=" + std::to_string(a.ldy));
  if (in == GemvIn::F32Norm && (!a.norm_w || !gemv_batch_fits(W, a.n, in)))
    fail(ErrorKind::Request, "gemv_batch: f32norm needs the norm weight and K within shared memory");
  if (a.act8 && (in != GemvIn::F32Norm || W.K % kAct8Group != 0))
    fail(ErrorKind::Request, "gemv_batch: act8 rounds an f32norm input with K % 32 == 0");
  if (W.fmt == WFormat::F16) dispatch_nb<WFormat::F16>(a, in, out, s, pdl);
  else if (W.fmt == WFormat::I8) dispatch_nb<WFormat::I8>(a, in, out, s, pdl);
  else {
    if (W.K % kI4Group != 0) fail(ErrorKind::Request, "gemv_batch: int4 weights need K % 32 == 0");
    dispatch_nb<WFormat::I4>(a, in, out, s, pdl);
  }
}

}  // namespace ti::cuda
