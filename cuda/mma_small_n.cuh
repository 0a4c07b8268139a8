// mma_small_n.cuh — the tensor-core small-N product of the batched decode step (see mma_small_n.cu): y = W x for
// n <= 64 fp16 input rows x at once, every weight read once from global memory and dequantized once (fp16 / I8 /
// I4) for all n; fp32 sums. The input is fp16 (the RMSNorm, where there is one, runs before as its own kernel;
// mma_one_row_normed: one fp32 row normed in the kernel itself).
#pragma once
#include <cuda_runtime.h>

#include "gemv_batch.cuh"

namespace ti::cuda {

constexpr int kMmaMaxN = 64;

// a.x: n fp16 rows (stride ldx, a multiple of 8; columns K.. never read); out: F32, AddF32 (the residual),
// Swiglu (W's rows interleaved gate/up: y_i = silu(g_i) u_i as fp16). a.norm_w / a.eps unused (see below).
void mma_small_n(const GemvBatchArgs& a, GemvOut out, cudaStream_t stream, bool pdl = false);
// Whether mma_small_n takes these arguments (n in 1..kMmaMaxN; I4: K % 32 == 0).
bool mma_small_n_fits(const QMat& W, int n);

// The same product for one fp32 input row a.x (n = 1) RMS-normed in the kernel's prologue, after its PDL wait, with
// a.norm_w and a.eps (fp16(x inv w), as the decode GEMV stages it): the decode step's normed roles (qkv, gate/up,
// the LM head) on the tensor cores without a kernel of their own for the norm (gemv_pins R = 16). out: F32 or Swiglu.
constexpr int kMmaNormMaxK = 16384;  // the normed row in shared memory
void mma_one_row_normed(const GemvBatchArgs& a, GemvOut out, cudaStream_t stream, bool pdl = false);
bool mma_one_row_normed_fits(const QMat& W);  // mma_small_n_fits(W, 1) and K <= kMmaNormMaxK

}  // namespace ti::cuda
