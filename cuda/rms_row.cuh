// rms_row.cuh — the RMSNorm of a row a 256-thread block holds in registers (thread t: the float4s at columns
// 4 (t + 256 j), j < V; H <= 1,024 V, H % 4 == 0): its weight fetched (before a PDL wait: a weight never depends
// on the kernel before), and the normed row written as fp16. rmsnorm_rows' register kernel (prefill.cu) and the
// batched step's residual_norm_rows (batch_rows.cu) both end this way: one sum of squares in one order, the same
// bits from the same row.
#pragma once
#include <cuda_fp16.h>

#include "common.cuh"

namespace ti::cuda {

template <int V>
__device__ __forceinline__ void rms_row_weights(const float* w, int H, float4 (&g)[V]) {
#pragma unroll
  for (int j = 0; j < V; j++) {
    const int i = (threadIdx.x + j * 256) * 4;
    if (i < H) g[j] = __ldg(reinterpret_cast<const float4*>(w + i));
  }
}

// y = fp16(v * inv * g) with inv = rsqrt(mean(v^2) + eps); red: 33 floats of shared memory (block_sum).
template <int V>
__device__ __forceinline__ void rms_row_write(const float4 (&v)[V], const float4 (&g)[V], int H, float eps, float* red,
                                              __half* y) {
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < V; j++)
    if ((threadIdx.x + j * 256) * 4 < H)
      ss = fmaf(v[j].x, v[j].x, fmaf(v[j].y, v[j].y, fmaf(v[j].z, v[j].z, fmaf(v[j].w, v[j].w, ss))));
  const float inv = rsqrtf(block_sum(ss, red) / (float)H + eps);
#pragma unroll
  for (int j = 0; j < V; j++) {
    const int i = (threadIdx.x + j * 256) * 4;
    if (i >= H) continue;
    __align__(8) __half2 o[2] = {__floats2half2_rn(v[j].x * inv * g[j].x, v[j].y * inv * g[j].y),
                                 __floats2half2_rn(v[j].z * inv * g[j].z, v[j].w * inv * g[j].w)};
    *reinterpret_cast<uint2*>(y + i) = *reinterpret_cast<const uint2*>(o);
  }
}

}  // namespace ti::cuda
