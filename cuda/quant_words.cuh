// quant_words.cuh — 16-byte words of a weight row (8 fp16, 16 I8 or 32 I4 weights, cpp/core/quant.h) and their
// dequantization to fp16 pairs in registers: what the small-N products (gemv_batch.cu, mma_small_n.cu, mma_one_row.cu)
// share.
// I8: byte u = q + 128 as the fp16 1024 + u, minus 1152, times d (no int->float conversion); I4: gemv_dot.cuh's
// LOP3 trick, (q - 8) s + (m + 8 s). The weights are then the fp16 numbers the prefill's dequantization makes.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "quant.cuh"

namespace ti::cuda {

template <WFormat WF> constexpr int kWordElems = WF == WFormat::F16 ? 8 : WF == WFormat::I8 ? 16 : 32;

__host__ __device__ inline int gb_words(const QMat& W, int E) { return (W.K + E - 1) / E; }  // words with columns < K

template <WFormat WF>
__device__ __forceinline__ const uint4* gb_row(const QMat& W, int row) {
  if constexpr (WF == WFormat::F16) return reinterpret_cast<const uint4*>(static_cast<const __half*>(W.q) + (size_t)row * W.ld);
  else return reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(W.q) + (size_t)row * W.ld);
}
// The word's scales: I8 (d, -); I4 (s, m); F16 none.
template <WFormat WF>
__device__ __forceinline__ float2 gb_scale(const QMat& W, int row, int k) {
  if constexpr (WF == WFormat::I8)
    return make_float2(__half2float(static_cast<const __half*>(W.scales)[(size_t)row * (W.ld / kI8Block) + (k >> 1)]), 0.0f);
  else if constexpr (WF == WFormat::I4)
    return __half22float2(static_cast<const __half2*>(W.scales)[(size_t)row * (W.K / kI4Group) + k]);
  else return make_float2(0.0f, 0.0f);
}
__device__ __forceinline__ __half2 gb_h2(uint32_t u) { return *reinterpret_cast<const __half2*>(&u); }
__device__ __forceinline__ uint32_t gb_u32(__half2 h) { return *reinterpret_cast<const uint32_t*>(&h); }
__device__ __forceinline__ uint32_t gb_lop3(uint32_t a, uint32_t b, uint32_t c) {  // (a & b) | c
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
// I8 / I4: the word as fp16 pairs of consecutive weights (I8: 8 pairs, I4: 16), w[i] = (weight 2i, weight 2i+1).
template <WFormat WF>
__device__ __forceinline__ void gb_dequant_h2(const uint4& v, float2 sc, __half2* w) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
  if constexpr (WF == WFormat::I8) {
    const __half2 d = __float2half2_rn(sc.x), off = __float2half2_rn(1152.0f);
#pragma unroll
    for (int i = 0; i < 4; i++) {  // bytes (0, 1) and (2, 3) of u[i] into the low bytes of two fp16 1024 + u
      w[2 * i] = __hmul2(__hsub2(gb_h2(__byte_perm(u[i], 0x64646464u, 0x4140u)), off), d);
      w[2 * i + 1] = __hmul2(__hsub2(gb_h2(__byte_perm(u[i], 0x64646464u, 0x4342u)), off), d);
    }
  } else if constexpr (WF == WFormat::I4) {
    const __half2 s2 = __float2half2_rn(sc.x), c2 = __float2half2_rn(fmaf(8.0f, sc.x, sc.y));
    const __half2 off = __float2half2_rn(1032.0f), sixteenth = __float2half2_rn(0.0625f), off16 = __float2half2_rn(-72.0f);
#pragma unroll
    for (int i = 0; i < 4; i++) {  // elements 8i + (0,1), (2,3), (4,5), (6,7): gemv_dot.cuh's nibble pairs
      const uint32_t lo = u[i], hi = u[i] >> 8;
      const __half2 q0 = __hsub2(gb_h2(gb_lop3(lo, 0x000F000Fu, 0x64006400u)), off);
      const __half2 q1 = __hfma2(gb_h2(gb_lop3(lo, 0x00F000F0u, 0x64006400u)), sixteenth, off16);
      const __half2 q2 = __hsub2(gb_h2(gb_lop3(hi, 0x000F000Fu, 0x64006400u)), off);
      const __half2 q3 = __hfma2(gb_h2(gb_lop3(hi, 0x00F000F0u, 0x64006400u)), sixteenth, off16);
      w[4 * i] = __hfma2(q0, s2, c2);  // (q - 8) s + (m + 8 s) = s q + m
      w[4 * i + 1] = __hfma2(q1, s2, c2);
      w[4 * i + 2] = __hfma2(q2, s2, c2);
      w[4 * i + 3] = __hfma2(q3, s2, c2);
    }
  }
}

// Zero the pairs of word k (E weights) at or past column K, all of them where !valid (a word past the row's last).
template <int E>
__device__ __forceinline__ void gb_zero_past(int k, int K, bool valid, __half2* w) {
  const __half z = __float2half(0.0f);
#pragma unroll
  for (int i = 0; i < E / 2; i++) {
    const int c = k * E + 2 * i;
    if (!valid || c >= K) w[i] = __halves2half2(z, z);
    else if (c + 1 >= K) w[i] = __halves2half2(__low2half(w[i]), z);
  }
}

// The word k (16 bytes) of one row as E / 2 fp16 pairs (gb_dequant_h2; fp16 as is), its columns at or past K
// zeroed, all of it where !valid (a word past the row's last): the tensor-core products' A fragments. CHECK false:
// the caller knows the word valid and wholly below K.
template <WFormat WF, bool CHECK = true>
__device__ __forceinline__ void gb_word_h2(const uint4& v, float2 sc, int k, int K, bool valid, __half2* w) {
  constexpr int E = kWordElems<WF>;
  if constexpr (WF == WFormat::F16) {
    w[0] = gb_h2(v.x), w[1] = gb_h2(v.y), w[2] = gb_h2(v.z), w[3] = gb_h2(v.w);
  } else {
    gb_dequant_h2<WF>(v, sc, w);
  }
  if (CHECK && (!valid || (k + 1) * E > K)) gb_zero_past<E>(k, K, valid, w);
}

// An I8 word's 16 weights as fp16 pairs of q = u - 128, exact (1024 + u, minus 1152), the block's d left for after the
// product (cuda/mma_one_row.cu scales each block's sum in fp32); zeroed past K as gb_word_h2.
template <bool CHECK = true>
__device__ __forceinline__ void gb_word_q8_h2(const uint4& v, int k, int K, bool valid, __half2* w) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
  const __half2 off = __float2half2_rn(1152.0f);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    w[2 * i] = __hsub2(gb_h2(__byte_perm(u[i], 0x64646464u, 0x4140u)), off);
    w[2 * i + 1] = __hsub2(gb_h2(__byte_perm(u[i], 0x64646464u, 0x4342u)), off);
  }
  if (CHECK && (!valid || (k + 1) * 16 > K)) gb_zero_past<16>(k, K, valid, w);
}

}  // namespace ti::cuda
