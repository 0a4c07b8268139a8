// batch_rows.cuh — per-slot row work of the batched decode path (see batch_rows.cu). (The step's logits stay in
// its row order: the sampler and seq_logits read a slot's row through its logits row, cuda_engine_slots.cu.)
#pragma once
#include <cuda_runtime.h>

namespace ti::cuda {

// seen[tokens[i]] = 1 for i < n (a prompt's tokens into a slot's repetition-penalty set).
void mark_tokens(unsigned char* seen, const int* tokens, int n, cudaStream_t stream);

}  // namespace ti::cuda
