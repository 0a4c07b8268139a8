// batch_rows.cu — per-slot row work of the batched decode path (see batch_rows.cuh).
#include "batch_rows.cuh"
#include "common.cuh"

namespace ti::cuda {

__global__ void mark_tokens_kernel(unsigned char* seen, const int* tokens, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) seen[tokens[i]] = 1;
}

void mark_tokens(unsigned char* seen, const int* tokens, int n, cudaStream_t s) {
  if (n < 1) return;
  launch(mark_tokens_kernel, dim3((n + 255) / 256), dim3(256), 0, s, false, seen, tokens, n);
}

}  // namespace ti::cuda
