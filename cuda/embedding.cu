// embedding.cu — the first kernel of a decode step: the fed token's embedding row into the fp32 residual
// stream; plus fills for random-weight benchmark models.
#include "../cpp/core/rng.h"
#include "common.cuh"
#include "embedding.cuh"

namespace ti::cuda {

__global__ void embed_kernel(const __half* E, int ld, int H, const DecodeState* st, float* x) {
  pdl_wait();
  pdl_launch_dependents();
  const __half* row = E + (size_t)st->token * ld;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < H; i += gridDim.x * blockDim.x)
    x[i] = __half2float(row[i]);
}

void embed_token(const __half* E, int ld, int H, const DecodeState* st, float* x, cudaStream_t s, bool pdl) {
  launch(embed_kernel, dim3((H + 255) / 256), dim3(256), 0, s, pdl, E, ld, H, st, x);
}

__global__ void fill_random_kernel(__half* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = __float2half((2.0f * uniform_from_counter(seed, i) - 1.0f) * scale);
}

__global__ void fill_f32_kernel(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = v;
}

void fill_random_f16(__half* p, size_t n, uint64_t seed, float scale, cudaStream_t s) {
  fill_random_kernel<<<1024, 256, 0, s>>>(p, n, seed, scale);
  TI_CUDA_CHECK(cudaGetLastError());
}

void fill_f32(float* p, size_t n, float value, cudaStream_t s) {
  fill_f32_kernel<<<256, 256, 0, s>>>(p, n, value);
  TI_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ti::cuda
