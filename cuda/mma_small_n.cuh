// mma_small_n.cuh — the tensor-core small-N product of the batched decode step (see mma_small_n.cu): y = W x for
// n <= 64 fp16 input rows x at once, every weight read once from global memory and dequantized once (fp16 / I8 /
// I4) for all n; fp32 sums. The input is fp16 (the RMSNorm, where there is one, runs before as its own kernel).
#pragma once
#include <cuda_runtime.h>

#include "gemv_batch.cuh"

namespace ti::cuda {

constexpr int kMmaMaxN = 64;

// a.x: n fp16 rows (stride ldx, a multiple of 8; columns K.. never read); out: F32, AddF32 (the residual),
// Swiglu (W's rows interleaved gate/up: y_i = silu(g_i) u_i as fp16). a.norm_w / a.eps unused.
void mma_small_n(const GemvBatchArgs& a, GemvOut out, cudaStream_t stream, bool pdl = false);
// Whether mma_small_n takes these arguments (n in 1..kMmaMaxN; I4: K % 32 == 0).
bool mma_small_n_fits(const QMat& W, int n);

}  // namespace ti::cuda
