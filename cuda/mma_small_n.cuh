// mma_small_n.cuh — the tensor-core small-N product of the batched decode step (see mma_small_n.cu): y = W x for
// n <= 64 fp16 input rows x at once, every weight read once from global memory and dequantized once (fp16 / I8 /
// I4) for all n; fp32 sums. The input is fp16 (the RMSNorm, where there is one, runs before as its own kernel).
#pragma once
#include <cuda_runtime.h>

#include "gemv_batch.cuh"

namespace ti::cuda {

constexpr int kMmaMaxN = 64;

// a.x: n fp16 rows (stride ldx, a multiple of 8; columns K.. never read); out: F32, AddF32 (the residual),
// Swiglu (W's rows interleaved gate/up: y_i = silu(g_i) u_i as fp16). a.norm_w / a.eps: only with a.xn (AddF32:
// the RMSNorm of the updated rows as well).
void mma_small_n(const GemvBatchArgs& a, GemvOut out, cudaStream_t stream, bool pdl = false);
// Whether mma_small_n takes these arguments (n in 1..kMmaMaxN; I4: K % 32 == 0).
bool mma_small_n_fits(const QMat& W, int n);
// Whether it can also produce the next RMSNorm (GemvBatchArgs::xn): its blocks (16-row tiles, 32 with m_tiles 2)
// fit one wave of one block per SM, so all of them reach its grid barrier.
bool mma_small_n_norm_fits(const QMat& W, int n, int m_tiles);

}  // namespace ti::cuda
