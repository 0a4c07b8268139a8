// act8.cuh — the int8 input rule (CudaOptions::act8): a matrix product's input quantized per group of 32
// consecutive values, llama.cpp's Q8 rule: d = amax / 127, xq = round(x / d) (as x * (1 / d), half away from zero).
// The decode GEMV stages xq and meets it with dp4a (gemv.cu, gemv_dot.cuh); the batched step's fp16-input products
// (small-N GEMV, tensor-core small-N, cuBLASLt) take the same numbers as fp16(d xq) (act8_round below, in
// rmsnorm_rows, gemv_batch's prologue and act8_round_rows), so that a sequence meets the same inputs alone and in a
// batch, up to the fp16 rounding of d xq. Every kernel takes the rule from here: the same xq, bit for bit.
#pragma once
#include <cuda_fp16.h>

namespace ti::cuda {

constexpr int kAct8Group = 32;

// The group's d and 1 / d (0 for an all-zero group) from this lane's E values, the group held by LANES consecutive
// lanes (a power of two; every lane of the warp calls it: the shuffles).
template <int LANES, int E>
__device__ __forceinline__ float act8_scale(const float (&f)[E], float& id) {
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < E; j++) amax = fmaxf(amax, fabsf(f[j]));
#pragma unroll
  for (int o = 1; o < LANES; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float d = amax / 127.0f;
  id = d != 0.0f ? 1.0f / d : 0.0f;
  return d;
}
__device__ __forceinline__ int act8_q(float x, float id) { return (int)roundf(x * id); }

// f <- d xq, each group of 32 over LANES lanes of E values; the caller rounds it to fp16.
template <int LANES, int E>
__device__ __forceinline__ void act8_round(float (&f)[E]) {
  static_assert(LANES * E == kAct8Group, "a group is 32 values");
  float id;
  const float d = act8_scale<LANES>(f, id);
#pragma unroll
  for (int j = 0; j < E; j++) f[j] = d * (float)act8_q(f[j], id);
}

}  // namespace ti::cuda
