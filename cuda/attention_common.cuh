// attention_common.cuh — what both decode attention kernels (attention.cu, attention_rows.cu) share: step 2,
// after the PDL wait: RoPE on the new token's query heads (into shared memory, pre-scaled) and, in the block that
// owns the token's position, on its key, with rope(k) and v written into the paged cache and into the block's
// K/V tile; and their launch with more than 48 KB of dynamic shared memory.
#pragma once
#include <cuda_fp16.h>

#include <cstddef>

#include "attention.cuh"
#include "common.cuh"

namespace ti::cuda {

// One (i, i + hd / 2) pair of a key rotated at a position (c, s: its RoPE row's entry i), as the cache holds it:
// rounded products, no FMA contraction, so the cache gets exactly what fp32 numpy / the CPU engine compute (the
// attention kernels' own write and append_kv_rows').
__device__ __forceinline__ void rope_key_pair(float k1, float k2, float c, float s, __half& r1, __half& r2) {
  r1 = __float2half(__fsub_rn(__fmul_rn(k1, c), __fmul_rn(k2, s)));
  r2 = __float2half(__fadd_rn(__fmul_rn(k2, c), __fmul_rn(k1, s)));
}

// qkv: this token's q | k | v (fp32, before RoPE). The g query heads hq0.. of KV head kvh go to q_s (g rows of
// q_ld >= hd floats), rotated and times `scale`; with `owner` the key and value of kvh go, rotated / as is, in fp16 to the cache at
// element offset `at` of k_cache / v_cache and to the tile rows kr / vr. cs / sn: the position's RoPE row
// (hd / 2) in shared memory. hd / 2 <= blockDim.x (a thread per (i, i + hd / 2) pair of the key). The new key
// and value are read first, so that their reads and the queries' are one round trip, not three.
template <int HD>
__device__ __forceinline__ void rope_new_token(const float* qkv, int n_heads, int n_kv_heads, int hd, int kvh,
                                               int hq0, int g, const float* cs, const float* sn, float scale,
                                               float* q_s, int q_ld, bool owner, __half* k_cache, __half* v_cache,
                                               size_t at, __half* kr, __half* vr) {
  if constexpr (HD != 0) hd = HD;
  const int half_d = hd / 2, q_dim = n_heads * hd, kv_dim = n_kv_heads * hd;
  float k1 = 0.0f, k2 = 0.0f, v1 = 0.0f, v2 = 0.0f;
  const int i_kv = threadIdx.x;
  if (owner && i_kv < half_d) {
    const float* k = qkv + q_dim + (size_t)kvh * hd;
    const float* v = qkv + q_dim + kv_dim + (size_t)kvh * hd;
    k1 = k[i_kv];
    k2 = k[i_kv + half_d];
    v1 = v[i_kv];
    v2 = v[i_kv + half_d];
  }
  for (int t = threadIdx.x; t < g * half_d; t += blockDim.x) {
    const int h = t / half_d, i = t % half_d;
    const float* q = qkv + (size_t)(hq0 + h) * hd;
    const float x1 = q[i], x2 = q[i + half_d];
    q_s[h * q_ld + i] = (x1 * cs[i] - x2 * sn[i]) * scale;
    q_s[h * q_ld + i + half_d] = (x2 * cs[i] + x1 * sn[i]) * scale;
  }
  if (owner && i_kv < half_d) {
    const int i = i_kv;
    __half r1, r2;
    rope_key_pair(k1, k2, cs[i], sn[i], r1, r2);
    k_cache[at + i] = kr[i] = r1;
    k_cache[at + i + half_d] = kr[i + half_d] = r2;
    v_cache[at + i] = vr[i] = __float2half(v1);
    v_cache[at + i + half_d] = vr[i + half_d] = __float2half(v2);
  }
}

// Launches Kernel (a decode attention kernel), first allowing it up to 96 KB of dynamic shared memory (a property
// of the CUDA function, process-wide: set once per kernel).
template <auto Kernel>
void launch_attention(const DecodeAttnParams& p, dim3 grid, dim3 block, size_t smem, cudaStream_t s, bool pdl) {
  if (smem > 48 * 1024) {
    static bool raised = false;
    if (!raised) {
      TI_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
      raised = true;
    }
  }
  launch(Kernel, grid, block, smem, s, pdl, p);
}

}  // namespace ti::cuda
