// batch_rows.cuh — moving rows between the batched decode step's row order and the engine's slot order (see
// batch_rows.cu): the step computes rows 0..n-1 for the slots its row table names; each slot keeps its own
// logits and sampling history.
#pragma once
#include <cuda_runtime.h>

namespace ti::cuda {

// dst[idx[r]] = src[r] for r < n_rows where keep[r] >= 0 (scatter: row r of the step -> its slot's row);
// rows of `cols` floats, strides ld_src, ld_dst.
void scatter_rows(const float* src, int ld_src, float* dst, int ld_dst, const int* idx, const int* keep, int n_rows,
                  int cols, cudaStream_t stream);
// dst[r] = src[idx[r]] for r < n_rows (gather: the slots' rows into a dense block the sampler reads).
void gather_rows(const float* src, int ld_src, float* dst, int ld_dst, const int* idx, int n_rows, int cols,
                 cudaStream_t stream);
// seen[tokens[i]] = 1 for i < n (a prompt's tokens into a slot's repetition-penalty set).
void mark_tokens(unsigned char* seen, const int* tokens, int n, cudaStream_t stream);

}  // namespace ti::cuda
