// gemv_batch.cuh — the small-N matrix product of the batched decode step (see gemv_batch.cu): y = W x for
// n <= a few dozen vectors x at once, each weight read once per group of up to 8 vectors and dequantized once
// (fp16 / I8 / I4, cpp/core/quant.h) for all of them; the decode GEMV's fusions (gemv.cuh's in/out modes).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "gemv.cuh"
#include "quant.cuh"

namespace ti::cuda {

struct GemvBatchArgs {
  QMat W;                          // (rows, K) in its format
  const void* x = nullptr;         // n rows: F16 half (n, ldx) (columns K.. never read); F32Norm float (n, ldx)
  int ldx = 0;                     // a multiple of 8
  const float* norm_w = nullptr;   // F32Norm: the RMSNorm weight (K)
  float eps = 1e-5f;
  void* y = nullptr;               // n rows, stride ldy: F32 / AddF32 float (rows); Swiglu half (rows / 2)
  int ldy = 0;
  int n = 0;
  int m_tiles = 0;  // mma_small_n only: 16-row tiles per block, 0 (auto), 1 or 2 (n <= 16)
  bool smem_ring = true;  // mma_small_n only, fp16: words through the shared-memory ring (false: registers)
  // gemv_batch only, F32Norm: the normed inputs rounded to fp16(d xq) per group of 32 (cuda/act8.cuh: the decode
  // GEMV's int8 inputs; K % 32 == 0). An F16 input the caller rounds beforehand (act8_round_rows).
  bool act8 = false;
};

// in: F16 (fp16 rows) or F32Norm (fp32 rows RMS-normed in the prologue, as the decode GEMV does); out: F32,
// AddF32 (added in place: the residual), Swiglu (W's rows interleaved gate/up: y_i = silu(g_i) u_i as fp16).
// pdl: launched with programmatic dependent launch (common.cuh; the kernel waits before it reads anything).
void gemv_batch(const GemvBatchArgs& a, GemvIn in, GemvOut out, cudaStream_t stream, bool pdl = false);
// Whether gemv_batch takes these arguments (F32Norm stages the normed inputs in shared memory: K bounded by it).
bool gemv_batch_fits(const QMat& W, int n, GemvIn in);

}  // namespace ti::cuda
