// batch_rows.cu — row moves of the batched decode step (see batch_rows.cuh). Plain copies, a block per row.
#include "batch_rows.cuh"
#include "common.cuh"

namespace ti::cuda {

__global__ void scatter_rows_kernel(const float* src, int ld_src, float* dst, int ld_dst, const int* idx,
                                    const int* keep, int cols) {
  const int r = blockIdx.x;
  if (keep[r] < 0) return;  // a padding row: its slot's logits stay as they are
  const float* s = src + (size_t)r * ld_src;
  float* d = dst + (size_t)idx[r] * ld_dst;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) d[i] = s[i];
}

__global__ void gather_rows_kernel(const float* src, int ld_src, float* dst, int ld_dst, const int* idx, int cols) {
  const int r = blockIdx.x;
  const float* s = src + (size_t)idx[r] * ld_src;
  float* d = dst + (size_t)r * ld_dst;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) d[i] = s[i];
}

__global__ void mark_tokens_kernel(unsigned char* seen, const int* tokens, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) seen[tokens[i]] = 1;
}

void scatter_rows(const float* src, int ld_src, float* dst, int ld_dst, const int* idx, const int* keep, int n_rows,
                  int cols, cudaStream_t s) {
  if (n_rows < 1) return;
  launch(scatter_rows_kernel, dim3(n_rows), dim3(256), 0, s, false, src, ld_src, dst, ld_dst, idx, keep, cols);
}

void gather_rows(const float* src, int ld_src, float* dst, int ld_dst, const int* idx, int n_rows, int cols,
                 cudaStream_t s) {
  if (n_rows < 1) return;
  launch(gather_rows_kernel, dim3(n_rows), dim3(256), 0, s, false, src, ld_src, dst, ld_dst, idx, cols);
}

void mark_tokens(unsigned char* seen, const int* tokens, int n, cudaStream_t s) {
  if (n < 1) return;
  launch(mark_tokens_kernel, dim3((n + 255) / 256), dim3(256), 0, s, false, seen, tokens, n);
}

}  // namespace ti::cuda
