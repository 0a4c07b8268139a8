// batch_rows.cuh — per-slot row work of the batched decode path (see batch_rows.cu). (The step's logits stay in
// its row order: the sampler and seq_logits read a slot's row through its logits row, cuda_engine_slots.cu.)
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace ti::cuda {

// seen[tokens[i]] = 1 for i < n (a prompt's tokens into a slot's repetition-penalty set).
void mark_tokens(unsigned char* seen, const int* tokens, int n, cudaStream_t stream);
// seen[t] = 1 and counts[t] += 1 for each t of tokens[0..n) (generated tokens into a slot's history: the presence /
// frequency penalties' counts, as the sampler adds each token it draws; repeated ids count each time).
void count_tokens(unsigned char* seen, int* counts, const int* tokens, int n, cudaStream_t stream);

// For each of T rows r: x[r] += (parts[0][r] + parts[1][r] + ...) — the slices of a K-sliced product
// (GemmArgs::k_slices), slice s row r at parts + s * slice_stride + r * ldp — then y[r] = fp16(rmsnorm(x[r]) * w)
// as rmsnorm_rows computes it: a split-K product's reduce, the residual add and the next RMSNorm in one kernel, a
// block per row (the row in registers; w read before the PDL wait). Needs residual_norm_rows_fits.
void residual_norm_rows(const float* parts, int slices, int64_t slice_stride, int ldp, float* x, int ldx,
                        const float* w, float eps, int H, int T, __half* y, int ldy, cudaStream_t stream, bool pdl);
// 1 <= slices <= 8, H % 4 == 0 and H <= 8,192 (the row in registers), ldp / ldx / ldy / slice_stride multiples of 4.
bool residual_norm_rows_fits(int H, int slices, int64_t slice_stride, int ldp, int ldx, int ldy);

// x[r][0..K) = fp16(d xq) of its values per group of 32 (cuda/act8.cuh), in place, for r < T: the batched step's
// fp16 input (attention output, SwiGLU output) to a product whose decode GEMV takes int8 inputs. K % 32 == 0,
// ldx % 8 == 0 (else throws ti::Error(Request)). pdl: waits before it reads.
void act8_round_rows(__half* x, int ldx, int K, int T, cudaStream_t stream, bool pdl);

}  // namespace ti::cuda
