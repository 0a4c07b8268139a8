// common.cuh — helpers shared by the kernel files: error checks, vector loads, warp reductions.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "../cpp/errors.h"

namespace ti::cuda {

// Throws ti::Error(Device) naming the call, the file and the line.
#define TI_CUDA_CHECK(expr)                                                                                  \
  do {                                                                                                       \
    cudaError_t err_ = (expr);                                                                               \
    if (err_ != cudaSuccess)                                                                                 \
      ::ti::fail(::ti::ErrorKind::Device, std::string("CUDA error: ") + cudaGetErrorString(err_) + " in " + \
                                              #expr + " at " + __FILE__ + ":" + std::to_string(__LINE__));   \
  } while (0)

// 16-byte load that skips L1 (streamed data is read once).
__device__ __forceinline__ uint4 load_stream(const uint4* p) { return __ldcs(p); }

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace ti::cuda
