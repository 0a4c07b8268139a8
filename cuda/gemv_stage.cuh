// gemv_stage.cuh — the GEMV kernels' prologue and epilogue (gemv.cu; internal to it): the input vector staged in
// shared memory once per block after the dependency wait (RMS-normed for F32Norm; for I4 its group sums; for the
// int8-input forms quantized per group of 32 with each group's (d, sum)), the old y read for AddF32, and a warp's
// rows written (Swiglu pairs, or fp32 stored or added). The layouts they stage into: gemv_dot.cuh.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "act8.cuh"
#include "common.cuh"
#include "gemv.cuh"
#include "gemv_dot.cuh"

namespace ti::cuda {

constexpr int kGemvWarps = 8, kGemvThreads = kGemvWarps * 32;
static_assert(kGemvWarps == 8, "block_sum_once (common.cuh) sums 8 warps");

// The staged input's layout (kXChunks, xs_index): gemv_dot.cuh.

// Stages the input vector in shared memory as fp16 (layout above), zero padded to ld (RMS-normed first for
// F32Norm), with 16-byte loads where the width allows. Called by every thread of the block after pdl_wait().
constexpr int kMaxVec = 8;  // F32Norm: float4s of the input per thread kept in registers: K <= 8192 on the fast path
__device__ __forceinline__ bool norm_fast_path(const GemvParams& p) {
  return p.K % 4 == 0 && p.K <= kMaxVec * 4 * kGemvThreads;
}
// F32Norm, before the PDL wait: the RMSNorm weight (a weight: final) into shared memory, each thread the float4s
// it will use in stage_x (so no barrier is needed) — one global round trip fewer after the wait.
template <GemvIn IN>
__device__ __forceinline__ void prefetch_norm(const GemvParams& p, float* nws) {
  if constexpr (IN == GemvIn::F32Norm) {
    if (norm_fast_path(p)) {
#pragma unroll
      for (int u = 0; u < kMaxVec; u++) {
        const int i = threadIdx.x + u * kGemvThreads;
        if (i < p.K / 4) reinterpret_cast<float4*>(nws)[i] = reinterpret_cast<const float4*>(p.norm_w)[i];
      }
    }
  }
}

// I4 (the fast paths below): the group sums of the staged input come out of the staging itself, as the staged
// (fp16-rounded) values summed over the lanes that hold one group of 32 (8 lanes of 4, or 4 lanes of 8,
// reduced by shuffles) — no second pass over shared memory and no extra barrier. `part` is this thread's sum of
// its staged values, LANES how many consecutive lanes share a group; called by every lane of the warp.
template <int LANES>
__device__ __forceinline__ void group_sum(float part, int i, bool in, float* xsum) {
#pragma unroll
  for (int o = 1; o < LANES; o <<= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
  if (in && i % LANES == 0) xsum[i / LANES] = part;
}
__device__ __forceinline__ float sum4(__half2 a, __half2 b) {
  const float2 fa = __half22float2(a), fb = __half22float2(b);
  return (fa.x + fa.y) + (fb.x + fb.y);
}

// F32Norm's fast path: this thread's float4s of the residual stream into xr, and the block's 1 / rms.
__device__ __forceinline__ float load_rms(const GemvParams& p, float4 (&xr)[kMaxVec], float* red) {
  const float* x = static_cast<const float*>(p.x);
  const int nv = p.K / 4;
  float ss = 0.0f;
#pragma unroll
  for (int u = 0; u < kMaxVec; u++) {
    const int i = threadIdx.x + u * kGemvThreads;
    xr[u] = i < nv ? reinterpret_cast<const float4*>(x)[i] : make_float4(0, 0, 0, 0);
    ss += xr[u].x * xr[u].x + xr[u].y * xr[u].y + xr[u].z * xr[u].z + xr[u].w * xr[u].w;
  }
  ss = block_sum_once(ss, red);
  return rsqrtf(ss / (float)p.K + p.eps);
}

// kI4A8, kI8A8 (gemv_dot.cuh): the input quantized to int8 per group of 32 while it is staged — from the
// fp16-rounded value the fp16 paths stage — each group's (d, sum(xq)) beside it; kI4A8 in dp4a's byte order for
// the nibbles (NATURAL false), kI8A8 in natural order. LANES consecutive lanes hold one group, E = 32 / LANES
// consecutive elements each (F32Norm: 8 lanes of 4; F16: 4 lanes of 8). A group past the input (in == false for
// all its lanes) joins the shuffles and stores nothing.
__device__ __forceinline__ uint32_t pack4(const int* q) {
  return (uint32_t)(q[0] & 0xff) | (uint32_t)(q[1] & 0xff) << 8 | (uint32_t)(q[2] & 0xff) << 16 | (uint32_t)q[3] << 24;
}
template <int LANES, bool NATURAL>
__device__ __forceinline__ void quantize_group(const float (&f)[32 / LANES], int i, bool in, int nw, uint32_t* xs32,
                                               float2* dq) {
  constexpr int E = 32 / LANES;
  float id;
  const float d = act8_scale<LANES>(f, id);
  int q[E], sum = 0;
#pragma unroll
  for (int j = 0; j < E; j++) sum += q[j] = act8_q(f[j], id);
#pragma unroll
  for (int o = 1; o < LANES; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const int g = i / LANES, e0 = (i % LANES) * E;  // the group, and this lane's first element in it
  const int s = e0 / 8;                            // its 8-element sub-word (one 32-bit weight word)
  uint32_t* dst = xs32 + ((s / 2) * nw + g) * 4 + (s % 2) * 2;  // chunk s / 2 of the group, words (xa, xb)
  if constexpr (NATURAL) {
    uint32_t* nat = xs32 + (g * 32 + e0) / 4;
    if constexpr (E == 8) {
      if (in) *reinterpret_cast<uint2*>(nat) = make_uint2(pack4(q), pack4(q + 4));
    } else {
      if (in) *nat = pack4(q);
    }
  } else if constexpr (E == 8) {  // the whole sub-word: xa = (x0, x4, x1, x5), xb = (x2, x6, x3, x7)
    const int a[4] = {q[0], q[4], q[1], q[5]}, b[4] = {q[2], q[6], q[3], q[7]};
    if (in) *reinterpret_cast<uint2*>(dst) = make_uint2(pack4(a), pack4(b));
  } else {  // half a sub-word (E == 4): the other half from the neighbouring lane
    const uint32_t mine = pack4(q), theirs = __shfl_xor_sync(0xffffffffu, mine, 1);
    const bool first = e0 % 8 == 0;  // x0..x3 (writes xa) or x4..x7 (writes xb)
    if (in) dst[first ? 0 : 1] = first ? __byte_perm(mine, theirs, 0x5140) : __byte_perm(mine, theirs, 0x3726);
  }
  if (in && i % LANES == 0) dq[g] = make_float2(d, (float)sum);
}

template <bool NATURAL, GemvIn IN>
__device__ __forceinline__ void stage_x_a8(const GemvParams& p, int nw, const float* nws, unsigned char* xs, float* red,
                                           float* xsum) {
  uint32_t* xs32 = reinterpret_cast<uint32_t*>(xs);
  float2* dq = reinterpret_cast<float2*>(xsum);
  if constexpr (IN == GemvIn::F32Norm) {  // the fast path only (the launcher checks K)
    const int nv = p.K / 4;
    float4 xr[kMaxVec];
    const float inv = load_rms(p, xr, red);
#pragma unroll
    for (int u = 0; u < kMaxVec; u++) {
      if (u * kGemvThreads >= nv) break;  // uniform
      const int i = threadIdx.x + u * kGemvThreads;
      float f[4] = {0, 0, 0, 0};
      if (i < nv) {
        const float4 w = reinterpret_cast<const float4*>(nws)[i];
        const float2 a = __half22float2(__floats2half2_rn(w.x * (xr[u].x * inv), w.y * (xr[u].y * inv)));
        const float2 b = __half22float2(__floats2half2_rn(w.z * (xr[u].z * inv), w.w * (xr[u].w * inv)));
        f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
      }
      quantize_group<8, NATURAL>(f, i, i < nv, nw, xs32, dq);
    }
  } else {
    const __half* x = static_cast<const __half*>(p.x);
    for (int i0 = 0; i0 < p.K / 8; i0 += kGemvThreads) {  // uniform trip count (the shuffles)
      const int i = i0 + threadIdx.x;
      const bool in = i < p.K / 8;
      const uint4 v = in ? reinterpret_cast<const uint4*>(x)[i] : make_uint4(0, 0, 0, 0);
      float f[8];
      unpack8(v, f);
      quantize_group<4, NATURAL>(f, i, in, nw, xs32, dq);
    }
  }
}

// Returns whether the I4 group sums were computed along (else stage_xsum does it).
template <WFormat WF, GemvIn IN>
__device__ __forceinline__ bool stage_x(const GemvParams& p, int nw, const float* nws, __half* xs, float* red,
                                        float* xsum) {
  constexpr bool kSums = WF == WFormat::I4;
  if constexpr (kIsA8<WF>) {
    stage_x_a8<WF == kI8A8, IN>(p, nw, nws, reinterpret_cast<unsigned char*>(xs), red, xsum);
    return true;
  } else if constexpr (IN == GemvIn::F32Norm) {
    const float* x = static_cast<const float*>(p.x);
    if (norm_fast_path(p)) {
      const int nv = p.K / 4;
      float4 xr[kMaxVec];
      const float inv = load_rms(p, xr, red);
#pragma unroll
      for (int u = 0; u < kMaxVec; u++) {
        if (u * kGemvThreads >= nv) break;  // uniform: the group sums' shuffles need every lane
        const int i = threadIdx.x + u * kGemvThreads;
        __half2 h0 = __float2half2_rn(0.0f), h1 = h0;
        if (i < nv) {
          const float4 w = reinterpret_cast<const float4*>(nws)[i];  // this thread's own copy (prefetch_norm)
          __half2* dst = reinterpret_cast<__half2*>(xs + xs_index<WF>(4 * i, nw));  // 4 | 8: one chunk
          h0 = dst[0] = __floats2half2_rn(w.x * (xr[u].x * inv), w.y * (xr[u].y * inv));
          h1 = dst[1] = __floats2half2_rn(w.z * (xr[u].z * inv), w.w * (xr[u].w * inv));
        }
        if constexpr (kSums) group_sum<8>(sum4(h0, h1), i, i < nv, xsum);  // 8 float4s = one group
      }
      for (int i = p.K + threadIdx.x; i < p.ld; i += kGemvThreads) xs[xs_index<WF>(i, nw)] = __float2half(0.0f);
      return kSums;
    } else {
      float ss = 0.0f;
      for (int i = threadIdx.x; i < p.K; i += kGemvThreads) ss += x[i] * x[i];
      ss = block_sum(ss, red);
      const float inv = rsqrtf(ss / (float)p.K + p.eps);
      for (int i = threadIdx.x; i < p.ld; i += kGemvThreads)
        xs[xs_index<WF>(i, nw)] = i < p.K ? __float2half(p.norm_w[i] * (x[i] * inv)) : __float2half(0.0f);
      return false;
    }
  } else {
    const __half* x = static_cast<const __half*>(p.x);
    if (p.K % 8 == 0) {
      for (int i0 = 0; i0 < p.K / 8; i0 += kGemvThreads) {  // uniform trip count: see group_sum
        const int i = i0 + threadIdx.x;
        const bool in = i < p.K / 8;
        const uint4 v = in ? reinterpret_cast<const uint4*>(x)[i] : make_uint4(0, 0, 0, 0);
        if (in) reinterpret_cast<uint4*>(xs + xs_index<WF>(8 * i, nw))[0] = v;
        if constexpr (kSums) {
          const __half2* h = reinterpret_cast<const __half2*>(&v);
          group_sum<4>(sum4(h[0], h[1]) + sum4(h[2], h[3]), i, in, xsum);  // 4 words of 8 = one group
        }
      }
      for (int i = p.K + threadIdx.x; i < p.ld; i += kGemvThreads)  // int8: ld = K padded to 32
        xs[xs_index<WF>(i, nw)] = __float2half(0.0f);
      return kSums;
    } else {
      for (int i = threadIdx.x; i < p.ld; i += kGemvThreads)
        xs[xs_index<WF>(i, nw)] = i < p.K ? x[i] : __float2half(0.0f);
      return false;
    }
  }
}

// I4: the per-group sums of the staged input (after stage_x and a barrier).
template <WFormat WF>
__device__ __forceinline__ void stage_xsum(const GemvParams& p, int nw, const __half* xs, float* xsum) {
  if constexpr (WF == WFormat::I4) {
    for (int g = threadIdx.x; g < p.K / kI4Group; g += blockDim.x) {  // group g = word g: chunks i * nw + g
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const uint4 c = reinterpret_cast<const uint4*>(xs)[i * nw + g];
        const __half2* h = reinterpret_cast<const __half2*>(&c);
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const float2 f = __half22float2(h[j]);
          sum += f.x + f.y;
        }
      }
      xsum[g] = sum;
    }
  }
}
// The block's prologue after pdl_wait(): the input staged (and, for I4, its group sums), visible to all.
template <WFormat WF, GemvIn IN>
__device__ __forceinline__ void stage_input(const GemvParams& p, int nw, const float* nws, __half* xs, float* xsum,
                                            float* red) {
  const bool sums_done = stage_x<WF, IN>(p, nw, nws, xs, red, xsum);
  __syncthreads();
  if constexpr (WF == WFormat::I4) {
    if (!sums_done) {  // (uniform)
      stage_xsum<WF>(p, nw, xs, xsum);
      __syncthreads();
    }
  }
}

// AddF32, after the PDL wait: the rows' current y (each row is read and written by one warp only).
template <GemvOut OUT, int R>
__device__ __forceinline__ void load_y(const GemvParams& p, int row0, float* yold) {
#pragma unroll
  for (int r = 0; r < R; r++)
    yold[r] = OUT == GemvOut::AddF32 ? static_cast<const float*>(p.y)[min(row0 + r, p.rows - 1)] : 0.0f;
}

// The epilogue of a warp's R rows (lane 0, the sums reduced): Swiglu pairs (g, u) -> silu(g) u as fp16, else
// fp32 stored or added to the old y (yo).
template <GemvOut OUT, int R>
__device__ __forceinline__ void store_rows(const GemvParams& p, int row0, const float* acc, const float* yo) {
  if constexpr (OUT == GemvOut::Swiglu) {
#pragma unroll
    for (int r = 0; r + 1 < R; r += 2) {
      const int i = (row0 + r) / 2;
      if (row0 + r + 1 < p.rows) {
        const float g = acc[r], u = acc[r + 1];
        static_cast<__half*>(p.y)[i] = __float2half(g / (1.0f + __expf(-g)) * u);
      }
    }
  } else {
    float* y = static_cast<float*>(p.y);
#pragma unroll
    for (int r = 0; r < R; r++) {
      if (row0 + r >= p.rows) break;
      y[row0 + r] = OUT == GemvOut::AddF32 ? yo[r] + acc[r] : acc[r];
    }
  }
}

}  // namespace ti::cuda
