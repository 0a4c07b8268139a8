// mma_one_row.cuh — the decode step's GEMV on the tensor cores (cpp/gpu/gemv_plan.h, R = 16): y = W x for one input
// row, the batched step's product (mma_small_n.cuh: mma.sync m16n8k16, fp16 in, fp32 sums) reduced to n = 1 and
// rid of what n = 1 does not need. The input is fp16 (F16: o, down) or an fp32 row RMS-normed in the kernel's
// prologue (F32Norm: qkv, gate/up, the LM head; fp16(x inv w), as the decode GEMV stages it).
#pragma once
#include <cuda_runtime.h>

#include "gemv_batch.cuh"

namespace ti::cuda {

constexpr int kMmaOneRowMaxK = 16384;  // a normed row staged in shared memory (fp16: 32 KB)

// a.n must be 1; a.x (16-byte aligned): the fp16 row (F16) or the fp32 row (F32Norm, with a.norm_w, 16-byte aligned,
// and a.eps); columns K.. never read. out: F32 or AddF32 (F16 input), F32 or Swiglu (F32Norm input; W's rows
// interleaved gate/up). fp16 / int4: bitwise what mma_small_n gives for the same row on its register ring (F32Norm:
// after rmsnorm_rows with 16-byte row strides, which then sums the squares in this kernel's order); int8: the block
// scales applied after the product (mma_one_row.cu). An F16 row longer than kMmaOneRowMaxK runs mma_small_n itself;
// a.m_tiles and a.smem_ring are not used.
void mma_one_row(const GemvBatchArgs& a, GemvIn in, GemvOut out, cudaStream_t stream, bool pdl = false);
// Whether mma_one_row takes W with this input: sm_80+, int4: K % 32 == 0; F32Norm: K <= kMmaOneRowMaxK.
bool mma_one_row_fits(const QMat& W, GemvIn in);

}  // namespace ti::cuda
