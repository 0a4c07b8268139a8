// rms_row.cuh — the RMSNorm of a row a 256-thread block holds in registers (thread t: the float4s at columns
// 4 (t + 256 j), j < V; H <= 1,024 V, H % 4 == 0): its weight fetched (before a PDL wait: a weight never depends
// on the kernel before), and the normed row written as fp16. rmsnorm_rows' register kernel (prefill.cu) and the
// batched step's residual_norm_rows (batch_rows.cu) both end this way: one sum of squares in one order, the same
// bits from the same row.
#pragma once
#include <cuda_fp16.h>

#include "act8.cuh"
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
// A8: y = fp16(d xq) of those fp16 values instead, per group of 32 (act8.cuh; H % 32 == 0: a group is 8 lanes).
template <int V, bool A8 = false>
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
    if constexpr (A8) {  // every lane through the group's shuffles; those past H (whole groups) store nothing
      if (j * 1024 >= H) break;  // (uniform)
      float f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (i < H) {
        const float2 a = __half22float2(__floats2half2_rn(v[j].x * inv * g[j].x, v[j].y * inv * g[j].y));
        const float2 b = __half22float2(__floats2half2_rn(v[j].z * inv * g[j].z, v[j].w * inv * g[j].w));
        f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
      }
      act8_round<8>(f);
      __align__(8) __half2 o[2] = {__floats2half2_rn(f[0], f[1]), __floats2half2_rn(f[2], f[3])};
      if (i < H) *reinterpret_cast<uint2*>(y + i) = *reinterpret_cast<const uint2*>(o);
    } else {
      if (i >= H) continue;
      __align__(8) __half2 o[2] = {__floats2half2_rn(v[j].x * inv * g[j].x, v[j].y * inv * g[j].y),
                                   __floats2half2_rn(v[j].z * inv * g[j].z, v[j].w * inv * g[j].w)};
      *reinterpret_cast<uint2*>(y + i) = *reinterpret_cast<const uint2*>(o);
    }
  }
}

}  // namespace ti::cuda
