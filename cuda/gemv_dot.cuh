// gemv_dot.cuh — the weight formats as the GEMV kernels (gemv.cu) see them: a 16-byte word of each, the scales
// it needs, the staged input it meets, and their dot product. Internal to the kernels (gemv.cu, persistent.cu).
//
// The quantized words are dequantized in registers without int->float conversions:
//   I8: a word is half a block of 32 (16 weights). A byte u = q + 128 is permuted into the low mantissa byte of
//       2^23 (__byte_perm with 0x4B000000): the float 2^23 + u; one subtract of 2^23 + 128 gives q exactly (the
//       whole -128..127 range); fp32 FMAs with x into two partial sums; the block's d (fp16, widened once per
//       word) scales the word's sum. ~3 instructions per weight, against a budget of ~7 at full bandwidth on
//       the H200; d costs 2 bytes per 32 weights (+6% bytes) and per word a shuffle, a widening and an FFMA
//       (ScaleRun: the d are loaded per 4 steps of the warp and shuffled to the lanes that need them).
//   I4: a word is one group of 32. (w >> 4j) & 0x000F000F | 0x64006400 is the fp16 pair (1024 + q, 1024 + q')
//       (the packer's nibble order makes the pair consecutive weights); one HSUB2 of 1032 gives q - 8 exactly
//       (centred: smaller partial sums), one HFMA2 multiplies-accumulates with the fp16 input pair. For odd j
//       the nibbles are masked in place instead (1024 + 16q; an HFMA2 by 1/16 minus 72 gives q - 8, exactly),
//       so a 32-bit word costs one shift, and each pair one LOP3 (inline PTX: the compiler splits and-or with
//       two immediates into two) + HSUB2/HFMA2 + HFMA2. The group's 16 pair-sums are widened to fp32 once:
//       dot = s * sum((q - 8) x) + (m + 8 s) * sum(x), with sum(x) per group computed once per block while the
//       input is staged (group_sum). SASS: 13 instructions per 8 weights before the widening (19 before the
//       LOP3 and odd-nibble changes; ncu had shown the two-LOP3 split).
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "common.cuh"
#include "gemv.cuh"

namespace ti::cuda {

// kI4A8: the int4 weights (WFormat::I4's words and scales) met by the input quantized to int8 per group of 32
// (a pseudo-format for the GEMV kernels' template parameter; never a weight format). Per group g: d_g = amax /
// 127, xq = round(x / d_g) (llama.cpp's Q8 rounding), staged with the group's d_g and sum(xq); a word's dot is
// d_g (s sum(q xq) + m sum(xq)), sum(q xq) by dp4a (u8 x s8) straight from the nibbles: v & 0x0F0F0F0F holds
// weights 0, 4, 1, 5 of the word's 8 as bytes, v & 0xF0F0F0F0 16 times 2, 6, 3, 7 (i4_nibble_pos), so the
// input is staged in that order and a 32-bit word costs two LOP3 and two IDP4A (the fp16 path: 13 instructions).
constexpr WFormat kI4A8 = WFormat::I4A8;
template <WFormat WF> constexpr bool kIsI4 = WF == WFormat::I4 || WF == kI4A8;
// kI8A8: the int8 weights (WFormat::I8's words and block d) met by the input quantized the same way, staged in
// natural order (a word's 16 weights meet 16 bytes of xq: half a group) with each group's (d, sum(xq)). A byte u
// = q + 128 becomes the signed q by one xor with 0x80, so a word's dot is d_w d_x sum(q xq): four LOP3 and four
// IDP4A (the fp16-input path: ~50 instructions a word). Needs K % 32 == 0 (no padded block: the launcher checks).
constexpr WFormat kI8A8 = WFormat::I8A8;
template <WFormat WF> constexpr bool kIsI8 = WF == WFormat::I8 || WF == kI8A8;
template <WFormat WF> constexpr bool kIsA8 = WF == kI4A8 || WF == kI8A8;

// The staged input's layout (shared by gemv.cu and the persistent step, persistent.cu). A 16-byte weight word
// meets C = 1 (F16), 2 (I8) or 4 (I4) 16-byte chunks of the fp16 input. Stored in natural order, the chunks lane
// l reads (its word k = l + 32u) would be C x 16 bytes apart from lane l+1's: C-way bank conflicts (ncu: 73%
// excess shared wavefronts at I4). So chunk i of word k lives at chunk slot i * nw + k (nw: words per row): for
// each i, a warp reads 32 consecutive 16-byte chunks.
template <WFormat WF>
constexpr int kXChunks = WF == WFormat::F16 || WF == kI8A8 ? 1 : WF == WFormat::I8 || WF == kI4A8 ? 2 : 4;
template <WFormat WF>
__device__ __forceinline__ int xs_index(int e, int nw) {  // element e of the input -> its half in xs
  constexpr int C = kXChunks<WF>;
  if constexpr (C == 1) return e;
  const int k = e / (8 * C), i = (e / 8) % C;
  return (i * nw + k) * 8 + e % 8;
}

template <WFormat WF> struct XFrag;  // the staged input a 16-byte weight word meets
template <> struct XFrag<WFormat::F16> { float v[8]; };
template <> struct XFrag<WFormat::I8> { float v[16]; };
template <> struct XFrag<WFormat::I4> { __half2 v[16]; };
template <> struct XFrag<kI4A8> { uint32_t v[8]; };  // (xa, xb) per 32-bit weight word: the dp4a byte order
template <> struct XFrag<kI8A8> { uint32_t v[4]; };  // 16 xq in natural order

template <WFormat WF>
__device__ __forceinline__ void load_x(const __half* xs, int nw, int k, XFrag<WF>& x) {
  const uint4* xv = reinterpret_cast<const uint4*>(xs);
  if constexpr (WF == WFormat::F16) {
    unpack8(xv[k], x.v);
  } else if constexpr (WF == kI8A8) {
    *reinterpret_cast<uint4*>(&x.v[0]) = xv[k];
  } else if constexpr (WF == WFormat::I8) {
    unpack8(xv[k], x.v);
    unpack8(xv[nw + k], x.v + 8);
  } else if constexpr (WF == kI4A8) {
    *reinterpret_cast<uint4*>(&x.v[0]) = xv[k];
    *reinterpret_cast<uint4*>(&x.v[4]) = xv[nw + k];
  } else {
#pragma unroll
    for (int i = 0; i < 4; i++) *reinterpret_cast<uint4*>(&x.v[4 * i]) = xv[i * nw + k];
  }
}

// Row-wise context of the quantized formats: the row's block scales (I8: d per block of 32; I4: (scale, min)
// per group) and, for I4, the per-group input sums.
struct QCtx {
  const __half* d = nullptr;    // I8: all rows' d (one pointer for all rows: fewer registers than one per row)
  int drow = 0;                 // I8: this row's first d in d (rows x blocks per row < 2^31)
  const __half2* sm = nullptr;  // I4: this row's (scale, min) pairs
  const float* xsum = nullptr;  // I4: per-group sums of the staged input (kI4A8, kI8A8: (d, sum(xq)) pairs)
};
// What a 16-byte weight word k needs besides the input: I8 its block's d (word k is half of block k / 2), I4 its
// group's (scale, min); nothing for F16. Loaded together with the word (and, for the prefetched words, before
// the dependency wait: scales are weights too) — one at a time by load_scale (split-K, the last steps of a row),
// for runs of steps by ScaleRun below.
template <WFormat WF> struct WScale {};
template <> struct WScale<WFormat::I8> { __half d; };
template <> struct WScale<WFormat::I4> { __half2 sm; };
template <> struct WScale<kI4A8> { __half2 sm; };
template <> struct WScale<kI8A8> { __half d; };
template <WFormat WF>
__device__ __forceinline__ WScale<WF> load_scale(const QCtx& c, int k) {
  WScale<WF> s;
  if constexpr (kIsI8<WF>) s.d = c.d[c.drow + (k >> 1)];
  // kI4A8 streams its scales past L1 like the words (__ldcs): the configuration measured (persistent.md §18)
  if constexpr (WF == kI4A8) s.sm = __ldcs(c.sm + k);
  else if constexpr (kIsI4<WF>) s.sm = c.sm[k];
  return s;
}

// The scales of N consecutive steps of one row (a step: the warp's 32 consecutive words, lane l's word kb + l +
// 32 u at step u), loaded together with the steps' words. I4: one (scale, min) per word. I8: a warp's 4 steps
// span 64 blocks, so lane l holds the d of blocks kb / 2 + l and kb / 2 + 32 + l (one register and two
// coalesced 2-byte loads per row per 4 steps, instead of a load and a register per word: per-word scales had
// cost R=1 ~20 registers, 3 -> 2 blocks per SM, and spilled at R=4 — docs/perf/QUANT-NOTES.md, "Q8_0 GEMV");
// the d of step u's word (block kb / 2 + (l >> 1) + 16 u) is then one shuffle away, at lane (l >> 1) +
// 16 (u & 1), half u >> 1. The shuffles need the whole warp: I8's runs are used in warp-uniform code only.
template <WFormat WF, int N> struct ScaleRun {};
template <int N> struct ScaleRun<WFormat::I8, N> { __half2 d[(N + 3) / 4]; };
template <int N> struct ScaleRun<kI8A8, N> { __half2 d[(N + 3) / 4]; };
template <int N> struct ScaleRun<WFormat::I4, N> { WScale<WFormat::I4> s[N]; };
template <int N> struct ScaleRun<kI4A8, N> { WScale<kI4A8> s[N]; };
// Loads what step u of a run starting at word kb (uniform, a multiple of 32) needs, for a lane word k = kb +
// lane + 32 u (called for u = 0..N-1 in order, each with that step's word; a caller may stop early if it reads
// no later step's scale either — gemv.cu's load_chunk / dot_chunk). GUARD: words at or past nw (words per row)
// read scale 0 / word 0's instead; without GUARD the caller knows the run is inside the row.
template <WFormat WF, int N, bool GUARD>
__device__ __forceinline__ void load_run_step(const QCtx& c, int kb, int u, int nw, ScaleRun<WF, N>& run) {
  if constexpr (kIsI8<WF>) {
    if (u % 4 == 0) {
      const __half zero = __ushort_as_half(0);
      const int b = kb / 2 + 16 * u + (threadIdx.x & 31);  // and b + 32 (only where the run has step u + 2)
      const bool hi = u + 2 < N;
      run.d[u / 4] = __halves2half2(!GUARD || 2 * b < nw ? c.d[c.drow + b] : zero,
                                    hi && (!GUARD || 2 * (b + 32) < nw) ? c.d[c.drow + b + 32] : zero);
    }
  } else if constexpr (kIsI4<WF>) {
    const int k = kb + (threadIdx.x & 31) + 32 * u;
    run.s[u] = load_scale<WF>(c, !GUARD || k < nw ? k : 0);
  }
}
template <WFormat WF, int N>
__device__ __forceinline__ WScale<WF> run_scale(const ScaleRun<WF, N>& run, int u) {
  WScale<WF> s;
  if constexpr (kIsI8<WF>) {
    const int lane = threadIdx.x & 31;
    const __half2 v = __shfl_sync(0xffffffffu, run.d[u / 4], (lane >> 1) + 16 * (u & 1));
    s.d = u & 2 ? __high2half(v) : __low2half(v);
  } else if constexpr (kIsI4<WF>) {
    s = run.s[u];
  }
  return s;
}

// (a & b) | c in one LOP3 (written as two ops, the compiler emits two: two 32-bit immediates do not fit one).
__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ __half2 as_half2(uint32_t u) { return *reinterpret_cast<const __half2*>(&u); }

template <WFormat WF>
__device__ __forceinline__ float dot_word(const uint4& w, const WScale<WF>& sc, const XFrag<WF>& x, const QCtx& c,
                                          int k) {
  if constexpr (WF == WFormat::F16) {
    return dot8(w, x.v);
  } else if constexpr (WF == WFormat::I8) {
    const uint32_t v[4] = {w.x, w.y, w.z, w.w};
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
      for (int b = 0; b < 4; b += 2) {
        const float q0 = __int_as_float((int)__byte_perm(v[i], 0x4B000000u, 0x7650u + b)) - 8388736.0f;
        const float q1 = __int_as_float((int)__byte_perm(v[i], 0x4B000000u, 0x7651u + b)) - 8388736.0f;
        s0 = fmaf(q0, x.v[4 * i + b], s0);
        s1 = fmaf(q1, x.v[4 * i + b + 1], s1);
      }
    }
    return __half2float(sc.d) * (s0 + s1);
  } else if constexpr (WF == kI8A8) {
    int acc = 0;
    acc = __dp4a((int)(w.x ^ 0x80808080u), (int)x.v[0], acc);
    acc = __dp4a((int)(w.y ^ 0x80808080u), (int)x.v[1], acc);
    acc = __dp4a((int)(w.z ^ 0x80808080u), (int)x.v[2], acc);
    acc = __dp4a((int)(w.w ^ 0x80808080u), (int)x.v[3], acc);
    const float dx = reinterpret_cast<const float2*>(c.xsum)[k >> 1].x;  // word k is half of group k / 2
    return __half2float(sc.d) * dx * (float)acc;
  } else if constexpr (WF == kI4A8) {
    const uint32_t v[4] = {w.x, w.y, w.z, w.w};
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
      asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(lo) : "r"(v[i] & 0x0F0F0F0Fu), "r"(x.v[2 * i]));
      asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(hi) : "r"(v[i] & 0xF0F0F0F0u), "r"(x.v[2 * i + 1]));
    }
    const float2 sm = __half22float2(sc.sm), dq = reinterpret_cast<const float2*>(c.xsum)[k];  // (d, sum xq)
    return dq.x * fmaf(sm.x, (float)(lo + (hi >> 4)), sm.y * dq.y);  // hi: 16 sum(q xq) exactly
  } else {
    const uint32_t v[4] = {w.x, w.y, w.z, w.w};
    const __half2 off = __float2half2_rn(1032.0f), sixteenth = __float2half2_rn(0.0625f),
                  off16 = __float2half2_rn(-72.0f);
    __half2 acc = __float2half2_rn(0.0f);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      // nibble pairs (j, j + 4) of v: j = 0, 2 in place as 1024 + q (minus 1032: q - 8); j = 1, 3 as 1024 + 16q
      // (times 1/16, minus 72: q - 8, exact, as 1024 + 16q is); j = 2, 3 from v >> 8. One LOP3 each.
      const uint32_t lo = v[i], hi = v[i] >> 8;
      const uint32_t t0 = lop3_and_or(lo, 0x000F000Fu, 0x64006400u), t1 = lop3_and_or(lo, 0x00F000F0u, 0x64006400u);
      const uint32_t t2 = lop3_and_or(hi, 0x000F000Fu, 0x64006400u), t3 = lop3_and_or(hi, 0x00F000F0u, 0x64006400u);
      acc = __hfma2(__hsub2(as_half2(t0), off), x.v[4 * i], acc);
      acc = __hfma2(__hfma2(as_half2(t1), sixteenth, off16), x.v[4 * i + 1], acc);
      acc = __hfma2(__hsub2(as_half2(t2), off), x.v[4 * i + 2], acc);
      acc = __hfma2(__hfma2(as_half2(t3), sixteenth, off16), x.v[4 * i + 3], acc);
    }
    const float2 a = __half22float2(acc), sm = __half22float2(sc.sm);
    return sm.x * (a.x + a.y) + fmaf(8.0f, sm.x, sm.y) * c.xsum[k];
  }
}

template <WFormat WF>
__device__ __forceinline__ const uint4* row_words(const GemvParams& p, int row) {
  if constexpr (WF == WFormat::F16) return reinterpret_cast<const uint4*>(p.W + (size_t)row * p.ld);
  else return reinterpret_cast<const uint4*>(p.q + (size_t)row * p.ldq);
}
template <WFormat WF>
__device__ __forceinline__ int words_per_row(const GemvParams& p) {
  return WF == WFormat::F16 ? p.ld / 8 : p.ldq / 16;
}
template <WFormat WF>
__device__ __forceinline__ QCtx row_ctx(const GemvParams& p, int row, const float* xsum) {
  QCtx c;
  if constexpr (kIsI8<WF>) {
    c.d = static_cast<const __half*>(p.scales);
    c.drow = row * (p.ldq / kI8Block);
  }
  if constexpr (WF == kI8A8) c.xsum = xsum;
  if constexpr (kIsI4<WF>) {
    c.sm = static_cast<const __half2*>(p.scales) + (size_t)row * (p.K / kI4Group);
    c.xsum = xsum;
  }
  return c;
}

}  // namespace ti::cuda
