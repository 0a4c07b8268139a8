// gemv_batch.cu — Y = X @ W.T for a few rows of X (the batched decode step), see gemv_batch.cuh.
//
// A block of 8 warps owns 8 consecutive rows of W (a warp per row) and a group of NB <= 8 rows of X (the
// grid's x: the column groups of one row tile are neighbours in launch order, so the second group's weights
// come from L2). A lane walks its row in 16-byte words (8 fp16, 16 I8 or 32 I4 weights), dequantizes the word
// once into fp32 registers (I8: d (q); I4: s q + m, the nibble order of quant.h's i4_nibble_pos), and meets
// it with the same K-slice of each of the NB input rows (read from global memory through L1: the inputs are
// small next to the weights), fp32 FMAs into NB sums; the warp then reduces each sum by shuffles.
#include <algorithm>

#include "common.cuh"
#include "gemv_batch.cuh"

namespace ti::cuda {

constexpr int kGbWarps = 8;

template <WFormat WF> constexpr int kWordElems = WF == WFormat::F16 ? 8 : WF == WFormat::I8 ? 16 : 32;

// Word k of `row` as kWordElems<WF> fp32 weights.
template <WFormat WF>
__device__ __forceinline__ void dequant_word(const QMat& W, int row, int k, float* w) {
  if constexpr (WF == WFormat::F16) {
    const uint4 v = load_stream(reinterpret_cast<const uint4*>(static_cast<const __half*>(W.q) + (size_t)row * W.ld) + k);
    unpack8(v, w);
  } else if constexpr (WF == WFormat::I8) {
    const uint4 v = load_stream(reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(W.q) + (size_t)row * W.ld) + k);
    const float d = __half2float(static_cast<const __half*>(W.scales)[(size_t)row * (W.ld / kI8Block) + (k >> 1)]);
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 16; i++) w[i] = d * (float)((int)((u[i >> 2] >> (8 * (i & 3))) & 0xFF) - 128);
  } else {
    const uint4 v = load_stream(reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(W.q) + (size_t)row * W.ld) + k);
    const float2 sm = __half22float2(static_cast<const __half2*>(W.scales)[(size_t)row * (W.K / kI4Group) + k]);
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 32; i++) {  // element 8 j + e of the group: 32-bit word j, nibble at (e & 1) * 16 + (e >> 1) * 4
      const int j = i >> 3, e = i & 7;
      w[i] = fmaf(sm.x, (float)((u[j] >> ((e & 1) * 16 + (e >> 1) * 4)) & 0xF), sm.y);
    }
  }
}

template <WFormat WF, int NB, GemmOut OUT>
__global__ void __launch_bounds__(kGbWarps * 32) gemv_batch_kernel(QMat W, const __half* X, int ldx, void* Y, int ldy,
                                                                   int n) {
  constexpr int E = kWordElems<WF>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.y * kGbWarps + warp, col0 = blockIdx.x * NB;
  if (row >= W.rows) return;  // (no block barrier below)
  const int words = (W.K + E - 1) / E;  // words holding columns < K (the rest of the row is padding)
  float acc[NB];
#pragma unroll
  for (int j = 0; j < NB; j++) acc[j] = 0.0f;
  for (int k = lane; k < words; k += 32) {
    float w[E];
    dequant_word<WF>(W, row, k, w);
    const bool whole = (k + 1) * E <= W.K;  // (uniform but for the last word)
#pragma unroll
    for (int j = 0; j < NB; j++) {
      if (col0 + j >= n) break;
      const __half* x = X + (size_t)(col0 + j) * ldx + (size_t)k * E;
      float s = 0.0f;
      if (whole) {
#pragma unroll
        for (int c = 0; c < E / 8; c++) {
          float xf[8];
          unpack8(__ldg(reinterpret_cast<const uint4*>(x) + c), xf);
#pragma unroll
          for (int e = 0; e < 8; e++) s = fmaf(w[8 * c + e], xf[e], s);
        }
      } else {
#pragma unroll
        for (int e = 0; e < E; e++)
          if (k * E + e < W.K) s = fmaf(w[e], __half2float(x[e]), s);
      }
      acc[j] += s;
    }
  }
#pragma unroll
  for (int j = 0; j < NB; j++) acc[j] = warp_sum(acc[j]);
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < NB; j++) {
      const int col = col0 + j;
      if (col >= n) break;
      if constexpr (OUT == GemmOut::F16) {
        static_cast<__half*>(Y)[(size_t)col * ldy + row] = __float2half(acc[j]);
      } else {
        float* y = static_cast<float*>(Y) + (size_t)col * ldy + row;
        *y = OUT == GemmOut::AddF32 ? *y + acc[j] : acc[j];
      }
    }
  }
}

template <WFormat WF, int NB>
static void launch_nb(const QMat& W, const __half* X, int ldx, void* Y, int ldy, int n, GemmOut out, cudaStream_t s) {
  const dim3 grid((n + NB - 1) / NB, (W.rows + kGbWarps - 1) / kGbWarps), block(kGbWarps * 32);
  if (out == GemmOut::F32) launch(gemv_batch_kernel<WF, NB, GemmOut::F32>, grid, block, 0, s, false, W, X, ldx, Y, ldy, n);
  else if (out == GemmOut::AddF32)
    launch(gemv_batch_kernel<WF, NB, GemmOut::AddF32>, grid, block, 0, s, false, W, X, ldx, Y, ldy, n);
  else launch(gemv_batch_kernel<WF, NB, GemmOut::F16>, grid, block, 0, s, false, W, X, ldx, Y, ldy, n);
}

template <WFormat WF>
static void launch_fmt(const QMat& W, const __half* X, int ldx, void* Y, int ldy, int n, GemmOut out, cudaStream_t s) {
  if (n <= 1) launch_nb<WF, 1>(W, X, ldx, Y, ldy, n, out, s);
  else if (n <= 2) launch_nb<WF, 2>(W, X, ldx, Y, ldy, n, out, s);
  else if (n <= 4) launch_nb<WF, 4>(W, X, ldx, Y, ldy, n, out, s);
  else launch_nb<WF, 8>(W, X, ldx, Y, ldy, n, out, s);
}

void gemv_batch(const QMat& W, const __half* X, int ldx, void* Y, int ldy, int n, GemmOut out, cudaStream_t s) {
  if (n < 1 || ldx % 8 != 0 || ldx < W.K || ldy < W.rows || W.rows < 1 || W.K < 1)
    fail(ErrorKind::Request, "gemv_batch: bad shape n=" + std::to_string(n) + " K=" + std::to_string(W.K) +
                                 " ldx=" + std::to_string(ldx) + " rows=" + std::to_string(W.rows) +
                                 " ldy=" + std::to_string(ldy));
  if (W.fmt == WFormat::F16) launch_fmt<WFormat::F16>(W, X, ldx, Y, ldy, n, out, s);
  else if (W.fmt == WFormat::I8) launch_fmt<WFormat::I8>(W, X, ldx, Y, ldy, n, out, s);
  else {
    if (W.K % kI4Group != 0) fail(ErrorKind::Request, "gemv_batch: int4 weights need K % 32 == 0");
    launch_fmt<WFormat::I4>(W, X, ldx, Y, ldy, n, out, s);
  }
}

}  // namespace ti::cuda
