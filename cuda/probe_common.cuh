// probe_common.cuh — what the micro-benchmarks (persistent_probe.cu, cluster_probe.cu) share: the 256-thread
// block, the 32-bit mix their chains write (host and device: the host replicas recompute it), the slices of a
// vector, a block's XOR, and the host's device buffer and event timer.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common.cuh"

namespace ti::cuda::probe {

constexpr int kThreads = 256;

__host__ __device__ inline uint32_t mix(uint32_t x, uint32_t i, uint32_t k, uint32_t epoch) {
  uint32_t h = x ^ (i * 0x9E3779B1u) ^ (k * 0x85EBCA77u) ^ (epoch * 0xC2B2AE3Du);
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  h ^= h >> 16;
  return h;
}
// Part p of n items split into `parts`: [span(p), span(p + 1)).
__host__ __device__ inline int span(int p, int n, int parts) { return (int)((int64_t)p * n / parts); }

// XOR over the block; every thread gets it. red: kThreads / 32 words.
__device__ __forceinline__ uint32_t block_xor(uint32_t v, uint32_t* red) {
  for (int o = 16; o > 0; o >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // red may still be read by a previous call
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  uint32_t r = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; w++) r ^= red[w];
  return r;
}

template <typename T>
struct DeviceArray {
  T* p = nullptr;
  explicit DeviceArray(size_t n, int fill_byte = 0) {
    TI_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    const cudaError_t err = cudaMemset(p, fill_byte, std::max<size_t>(n, 1) * sizeof(T));
    if (err != cudaSuccess) {
      cudaFree(p);
      TI_CUDA_CHECK(err);
    }
  }
  ~DeviceArray() { cudaFree(p); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

struct Events {
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  Events() {
    TI_CUDA_CHECK(cudaEventCreate(&e0));
    const cudaError_t err = cudaEventCreate(&e1);
    if (err != cudaSuccess) {
      cudaEventDestroy(e0);
      TI_CUDA_CHECK(err);
    }
  }
  ~Events() {
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
  template <typename F>
  float ms(F&& launch) {
    TI_CUDA_CHECK(cudaEventRecord(e0, 0));
    launch();
    TI_CUDA_CHECK(cudaEventRecord(e1, 0));
    TI_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    TI_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    return t;
  }
};

// ns a stage of a chain, as the difference of two runs of `stages` and 2 x `stages` stages (one.run(), two.run():
// each launches its chain), so that the launch and the ramp-up cancel out: both warmed up once, then the best of
// `reps` of each, interleaved.
template <typename One, typename Two>
double ns_per_stage(One& one, Two& two, int stages, int reps) {
  Events ev;
  one.run();
  two.run();
  float best1 = 1e30f, best2 = 1e30f;
  for (int r = 0; r < std::max(reps, 1); r++) {
    best1 = std::min(best1, ev.ms([&] { one.run(); }));
    best2 = std::min(best2, ev.ms([&] { two.run(); }));
  }
  return (double)(best2 - best1) * 1e6 / stages;
}

}  // namespace ti::cuda::probe
