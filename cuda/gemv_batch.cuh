// gemv_batch.cuh — the small-N matrix product of the batched decode step (see gemv_batch.cu): Y = X @ W.T for
// n <= a few dozen rows of X, reading each weight once per column group and dequantizing it once (fp16 / I8 /
// I4, cpp/core/quant.h) for all the rows it meets.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "gemm.cuh"
#include "quant.cuh"

namespace ti::cuda {

// Y (n, ldy) = X (n, ldx) @ W.T, fp32 accumulation; out: F32 (fp32), AddF32 (fp32 added to Y: the residual),
// F16 (fp16). X fp16 with ldx a multiple of 8; columns K.. of X are never read.
void gemv_batch(const QMat& W, const __half* X, int ldx, void* Y, int ldy, int n, GemmOut out, cudaStream_t stream);
// Whether the batched step takes gemv_batch for W at n rows: quantized weights always (cuBLASLt would need them
// dequantized: 2 bytes written and read per weight per step); fp16 up to f16_max rows (CudaOptions).
inline bool gemv_batch_supported(const QMat& W, int n, int f16_max) {
  return n >= 1 && (W.fmt != WFormat::F16 || n <= f16_max);
}

}  // namespace ti::cuda
