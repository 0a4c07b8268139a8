// gemv.cu — fp16 matrix-vector products for batch-1 decode: y = W x, fp32 accumulation.
//
// Layout: W row-major (rows, ld) fp16, ld a multiple of 8 so every row starts 16-byte aligned; columns past K
// are zero. A block of 8 warps; each warp owns R consecutive rows (R = 1, 2, 4: more rows per warp = more
// independent 16-byte loads in flight per lane but fewer warps; timed per shape at load). Each lane reads 16
// bytes (8 weights) per row per step, 4 steps unrolled, so 4R loads are in flight per lane; the input vector is
// staged once per block in shared memory as fp16 (16-byte reads, a warp reads 512 contiguous bytes: no bank
// conflicts), then each row's dot is reduced across the warp with shuffles.
//
// Fusions (chosen by the launcher's in/out modes, never in the forward pass):
//   in  F32Norm: RMSNorm of the fp32 residual stream in the prologue (every block recomputes the sum of
//                squares: H floats from L2, cheaper than a kernel launch)
//   out AddF32:  y += W x (the residual add of the O and down projections)
//   out Swiglu:  rows interleaved gate/up at load (row 2i = gate_i, 2i+1 = up_i): y_i = silu(g_i) * u_i
// PDL: the first 8/R 16-byte words of each of the warp's rows (8 per lane) are loaded before pdl_wait()
// (weights do not depend on the previous kernel), so the memory pipe is busy while the previous kernel drains.
//
// Quantized weights (cpp/quant.h; template parameter WF): the same kernels, a 16-byte word now holding 16
// (I8) or 32 (I4) weights, dequantized in registers without int->float conversions:
//   I8: a byte u = q + 128 is permuted into the low mantissa byte of 2^23 (__byte_perm with 0x4B000000): the
//       float 2^23 + u; one subtract of 2^23 + 128 gives q exactly; fp32 FMAs with x; the row's scale is applied
//       once in the epilogue. 3 instructions per weight, against a budget of ~7 at full bandwidth on the H200.
//   I4: a word is one group of 32. (w >> 4j) & 0x000F000F | 0x64006400 is the fp16 pair (1024 + q, 1024 + q')
//       (the packer's nibble order makes the pair consecutive weights); one HSUB2 of 1032 gives q - 8 exactly
//       (centred: smaller partial sums), one HFMA2 multiplies-accumulates with the fp16 input pair. The group's
//       16 pair-sums are widened to fp32 once: dot = s * sum((q - 8) x) + (m + 8 s) * sum(x), with sum(x) per
//       group computed once per block in shared memory. ~1.6 instructions per weight against a budget of ~3.6.
#include "common.cuh"
#include "gemv.cuh"

namespace ti::cuda {

constexpr int kGemvWarps = 8, kGemvThreads = kGemvWarps * 32;

// Stages the input vector in shared memory as fp16, zero padded to ld (RMS-normed first for F32Norm), with
// 16-byte loads where the width allows. Called by every thread of the block after pdl_wait().
template <GemvIn IN>
__device__ __forceinline__ void stage_x(const GemvParams& p, __half* xs, float* red) {
  if constexpr (IN == GemvIn::F32Norm) {
    const float* x = static_cast<const float*>(p.x);
    constexpr int kMaxVec = 8;  // float4s per thread kept in registers: K <= 8192 on the fast path
    if (p.K % 4 == 0 && p.K <= kMaxVec * 4 * kGemvThreads) {
      const int nv = p.K / 4;
      float4 xr[kMaxVec];
      float ss = 0.0f;
#pragma unroll
      for (int u = 0; u < kMaxVec; u++) {
        const int i = threadIdx.x + u * kGemvThreads;
        xr[u] = i < nv ? reinterpret_cast<const float4*>(x)[i] : make_float4(0, 0, 0, 0);
        ss += xr[u].x * xr[u].x + xr[u].y * xr[u].y + xr[u].z * xr[u].z + xr[u].w * xr[u].w;
      }
      ss = block_sum(ss, red);
      const float inv = rsqrtf(ss / (float)p.K + p.eps);
#pragma unroll
      for (int u = 0; u < kMaxVec; u++) {
        const int i = threadIdx.x + u * kGemvThreads;
        if (i < nv) {
          const float4 w = reinterpret_cast<const float4*>(p.norm_w)[i];
          __half2* dst = reinterpret_cast<__half2*>(xs + 4 * i);
          dst[0] = __floats2half2_rn(w.x * (xr[u].x * inv), w.y * (xr[u].y * inv));
          dst[1] = __floats2half2_rn(w.z * (xr[u].z * inv), w.w * (xr[u].w * inv));
        }
      }
      for (int i = p.K + threadIdx.x; i < p.ld; i += kGemvThreads) xs[i] = __float2half(0.0f);
    } else {
      float ss = 0.0f;
      for (int i = threadIdx.x; i < p.K; i += kGemvThreads) ss += x[i] * x[i];
      ss = block_sum(ss, red);
      const float inv = rsqrtf(ss / (float)p.K + p.eps);
      for (int i = threadIdx.x; i < p.ld; i += kGemvThreads)
        xs[i] = i < p.K ? __float2half(p.norm_w[i] * (x[i] * inv)) : __float2half(0.0f);
    }
  } else {
    const __half* x = static_cast<const __half*>(p.x);
    if (p.K % 8 == 0) {
      for (int i = threadIdx.x; i < p.K / 8; i += kGemvThreads)
        reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(x)[i];
      for (int i = p.K + threadIdx.x; i < p.ld; i += kGemvThreads) xs[i] = __float2half(0.0f);  // int8: ld = pad16
    } else {
      for (int i = threadIdx.x; i < p.ld; i += kGemvThreads) xs[i] = i < p.K ? x[i] : __float2half(0.0f);
    }
  }
}

// ---- weight formats: a 16-byte word of each, the input it meets, their dot product ----

template <WFormat WF> struct XFrag;  // the staged input a 16-byte weight word meets
template <> struct XFrag<WFormat::F16> { float v[8]; };
template <> struct XFrag<WFormat::I8> { float v[16]; };
template <> struct XFrag<WFormat::I4> { __half2 v[16]; };

template <WFormat WF>
__device__ __forceinline__ void load_x(const __half* xs, int k, XFrag<WF>& x) {
  const uint4* xv = reinterpret_cast<const uint4*>(xs);
  if constexpr (WF == WFormat::F16) {
    unpack8(xv[k], x.v);
  } else if constexpr (WF == WFormat::I8) {
    unpack8(xv[2 * k], x.v);
    unpack8(xv[2 * k + 1], x.v + 8);
  } else {
#pragma unroll
    for (int i = 0; i < 4; i++) *reinterpret_cast<uint4*>(&x.v[4 * i]) = xv[4 * k + i];
  }
}

// Row-wise context of the quantized formats: I4's (scale, min) per group and the per-group input sums.
struct QCtx {
  const __half2* sm = nullptr;  // this row's (scale, min) pairs
  const float* xsum = nullptr;  // per-group sums of the staged input
};

template <WFormat WF>
__device__ __forceinline__ float dot_word(const uint4& w, const XFrag<WF>& x, const QCtx& c, int k) {
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
    return s0 + s1;  // unscaled: the epilogue applies the row's scale
  } else {
    const uint32_t v[4] = {w.x, w.y, w.z, w.w};
    const __half2 off = __float2half2_rn(1032.0f);
    __half2 acc = __float2half2_rn(0.0f);
#pragma unroll
    for (int i = 0; i < 4; i++) {
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const uint32_t t = ((v[i] >> (4 * j)) & 0x000F000Fu) | 0x64006400u;
        acc = __hfma2(__hsub2(*reinterpret_cast<const __half2*>(&t), off), x.v[4 * i + j], acc);
      }
    }
    const float2 a = __half22float2(acc), sm = __half22float2(c.sm[k]);
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
  if constexpr (WF == WFormat::I4) {
    c.sm = static_cast<const __half2*>(p.scales) + (size_t)row * (p.K / kI4Group);
    c.xsum = xsum;
  }
  return c;
}
// I4: the per-group sums of the staged input (after stage_x and a barrier); I8: the row's scale.
template <WFormat WF>
__device__ __forceinline__ void stage_xsum(const GemvParams& p, const __half* xs, float* xsum) {
  if constexpr (WF == WFormat::I4) {
    for (int g = threadIdx.x; g < p.K / kI4Group; g += blockDim.x) {
      const __half2* x2 = reinterpret_cast<const __half2*>(xs + g * kI4Group);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kI4Group / 2; i++) {
        const float2 f = __half22float2(x2[i]);
        sum += f.x + f.y;
      }
      xsum[g] = sum;
    }
  }
}
// The block's prologue after pdl_wait(): the input staged (and, for I4, its group sums), visible to all.
template <WFormat WF, GemvIn IN>
__device__ __forceinline__ void stage_input(const GemvParams& p, __half* xs, float* xsum, float* red) {
  stage_x<IN>(p, xs, red);
  __syncthreads();
  if constexpr (WF == WFormat::I4) {
    stage_xsum<WF>(p, xs, xsum);
    __syncthreads();
  }
}

template <WFormat WF>
__device__ __forceinline__ float row_scale(const GemvParams& p, int row) {
  if constexpr (WF == WFormat::I8) return static_cast<const float*>(p.scales)[row];
  else return 1.0f;
}

template <WFormat WF, int R, GemvIn IN, GemvOut OUT>
__global__ void __launch_bounds__(kGemvThreads) gemv_kernel(GemvParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  float* xsum = reinterpret_cast<float*>(xs + p.ld);  // I4 only: (K / 32)
  __shared__ float red[33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kGemvWarps + warp) * R;
  const uint4* wrow[R];
#pragma unroll
  for (int r = 0; r < R; r++) {
    const int row = min(row0 + r, p.rows - 1);  // rows past the end re-read the last row; never stored
    wrow[r] = row_words<WF>(p, row);
  }
  const int ld8 = words_per_row<WF>(p);  // 16-byte words per row
  constexpr int P = 8 / R;   // words per row loaded before the dependency wait: 8 per lane in flight
  uint4 pre[P][R];
#pragma unroll
  for (int u = 0; u < P; u++)
#pragma unroll
    for (int r = 0; r < R; r++)
      pre[u][r] = lane + u * 32 < ld8 ? load_stream(wrow[r] + lane + u * 32) : make_uint4(0, 0, 0, 0);

  pdl_wait();
  pdl_launch_dependents();

  stage_input<WF, IN>(p, xs, xsum, red);
  if (row0 >= p.rows) return;

  QCtx ctx[R];
#pragma unroll
  for (int r = 0; r < R; r++) ctx[r] = row_ctx<WF>(p, min(row0 + r, p.rows - 1), xsum);
  float acc[R];
  XFrag<WF> xf;
#pragma unroll
  for (int r = 0; r < R; r++) acc[r] = 0.0f;
#pragma unroll
  for (int u = 0; u < P; u++) {
    if (lane + u * 32 < ld8) {
      load_x<WF>(xs, lane + u * 32, xf);
#pragma unroll
      for (int r = 0; r < R; r++) acc[r] += dot_word<WF>(pre[u][r], xf, ctx[r], lane + u * 32);
    }
  }
  int k = lane + P * 32;  // in 16-byte words
  for (; k + 3 * 32 < ld8; k += 4 * 32) {
    uint4 w[4][R];
#pragma unroll
    for (int u = 0; u < 4; u++)
#pragma unroll
      for (int r = 0; r < R; r++) w[u][r] = load_stream(wrow[r] + k + u * 32);
#pragma unroll
    for (int u = 0; u < 4; u++) {
      load_x<WF>(xs, k + u * 32, xf);
#pragma unroll
      for (int r = 0; r < R; r++) acc[r] += dot_word<WF>(w[u][r], xf, ctx[r], k + u * 32);
    }
  }
  for (; k < ld8; k += 32) {
    load_x<WF>(xs, k, xf);
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] += dot_word<WF>(load_stream(wrow[r] + k), xf, ctx[r], k);
  }
#pragma unroll
  for (int r = 0; r < R; r++) acc[r] = warp_sum(acc[r]) * row_scale<WF>(p, min(row0 + r, p.rows - 1));
  if (lane != 0) return;

  // ---- epilogue ----
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
      if constexpr (OUT == GemvOut::AddF32) y[row0 + r] += acc[r];
      else y[row0 + r] = acc[r];
    }
  }
}

// The split-K variant (R == kGemvSplitK): a block owns 8 rows and each warp one eighth of K for all 8 of them,
// so a lane has one 16-byte load per row in flight per step (8 per step) and a long row is streamed by 8 warps
// at once; the 8 partial sums of each row meet in shared memory. Wins where rows are few and K is long.
template <WFormat WF, GemvIn IN, GemvOut OUT>
__global__ void __launch_bounds__(kGemvThreads) gemv_splitk_kernel(GemvParams p) {
  constexpr int RB = 8;  // rows per block
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  float* xsum = reinterpret_cast<float*>(xs + p.ld);  // I4 only
  __shared__ float red[33];
  __shared__ float part[kGemvWarps][RB];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = blockIdx.x * RB;
  const int ld8 = words_per_row<WF>(p), span = (ld8 + kGemvWarps - 1) / kGemvWarps;
  const int k_begin = warp * span, k_end = min(ld8, k_begin + span);
  const uint4* wrow[RB];
#pragma unroll
  for (int r = 0; r < RB; r++) wrow[r] = row_words<WF>(p, min(row0 + r, p.rows - 1));
  uint4 pre[RB];
  const bool has_first = k_begin + lane < k_end;
#pragma unroll
  for (int r = 0; r < RB; r++) pre[r] = has_first ? load_stream(wrow[r] + k_begin + lane) : make_uint4(0, 0, 0, 0);

  pdl_wait();
  pdl_launch_dependents();
  stage_input<WF, IN>(p, xs, xsum, red);

  QCtx ctx[RB];
#pragma unroll
  for (int r = 0; r < RB; r++) ctx[r] = row_ctx<WF>(p, min(row0 + r, p.rows - 1), xsum);
  float acc[RB];
  XFrag<WF> xf;
#pragma unroll
  for (int r = 0; r < RB; r++) acc[r] = 0.0f;
  if (has_first) {
    load_x<WF>(xs, k_begin + lane, xf);
#pragma unroll
    for (int r = 0; r < RB; r++) acc[r] += dot_word<WF>(pre[r], xf, ctx[r], k_begin + lane);
  }
  for (int k = k_begin + lane + 32; k < k_end; k += 32) {
    uint4 w[RB];
#pragma unroll
    for (int r = 0; r < RB; r++) w[r] = load_stream(wrow[r] + k);
    load_x<WF>(xs, k, xf);
#pragma unroll
    for (int r = 0; r < RB; r++) acc[r] += dot_word<WF>(w[r], xf, ctx[r], k);
  }
#pragma unroll
  for (int r = 0; r < RB; r++) {
    const float v = warp_sum(acc[r]) * row_scale<WF>(p, min(row0 + r, p.rows - 1));
    if (lane == 0) part[warp][r] = v;
  }
  __syncthreads();
  if (threadIdx.x >= RB) return;
  const int r = threadIdx.x, row = row0 + r;
  float v = 0.0f;
#pragma unroll
  for (int w = 0; w < kGemvWarps; w++) v += part[w][r];
  if (row >= p.rows) return;
  if constexpr (OUT == GemvOut::Swiglu) {
    if (r % 2 == 0 && row + 1 < p.rows) {
      float u = 0.0f;
#pragma unroll
      for (int w = 0; w < kGemvWarps; w++) u += part[w][r + 1];
      static_cast<__half*>(p.y)[row / 2] = __float2half(v / (1.0f + __expf(-v)) * u);
    }
  } else if constexpr (OUT == GemvOut::AddF32) {
    static_cast<float*>(p.y)[row] += v;
  } else {
    static_cast<float*>(p.y)[row] = v;
  }
}

bool gemv_variant_ok(int R, GemvOut out) {
  if (R == kGemvSplitK) return true;
  if (R != 1 && R != 2 && R != 4) return false;
  return out != GemvOut::Swiglu || R >= 2;
}

// Shared memory: the staged input (ld halves) and, for I4, its per-group sums.
static size_t gemv_smem(const GemvParams& p) {
  return (size_t)p.ld * sizeof(__half) + (p.fmt == WFormat::I4 ? (size_t)(p.K / kI4Group) * sizeof(float) : 0);
}

template <typename Kernel>
static void raise_smem(Kernel kernel, size_t smem) {
  if (smem > 48 * 1024) {  // idempotent, so no once-flag (a once-flag with the first size was a bug elsewhere)
    TI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  }
}

template <WFormat WF, int R, GemvIn IN, GemvOut OUT>
static void launch_gemv(const GemvParams& p, cudaStream_t stream, bool pdl) {
  const size_t smem = gemv_smem(p);
  raise_smem(gemv_kernel<WF, R, IN, OUT>, smem);
  const int rows_per_block = kGemvWarps * R;
  launch(gemv_kernel<WF, R, IN, OUT>, dim3((p.rows + rows_per_block - 1) / rows_per_block), dim3(kGemvThreads),
         smem, stream, pdl, p);
}

template <WFormat WF, GemvIn IN, GemvOut OUT>
static void launch_splitk(const GemvParams& p, cudaStream_t stream, bool pdl) {
  const size_t smem = gemv_smem(p);
  raise_smem(gemv_splitk_kernel<WF, IN, OUT>, smem);
  launch(gemv_splitk_kernel<WF, IN, OUT>, dim3((p.rows + 7) / 8), dim3(kGemvThreads), smem, stream, pdl, p);
}

template <WFormat WF, GemvIn IN, GemvOut OUT>
static void dispatch_r(const GemvParams& p, int R, cudaStream_t s, bool pdl) {
  switch (R) {
    case kGemvSplitK: launch_splitk<WF, IN, OUT>(p, s, pdl); return;
    case 1:
      if constexpr (OUT != GemvOut::Swiglu) { launch_gemv<WF, 1, IN, OUT>(p, s, pdl); return; }
      break;
    case 2: launch_gemv<WF, 2, IN, OUT>(p, s, pdl); return;
    case 4: launch_gemv<WF, 4, IN, OUT>(p, s, pdl); return;
  }
  fail(ErrorKind::Request, "gemv: no variant with R=" + std::to_string(R) + " for this output mode");
}

// The quantized formats come in the three (in, out) pairs a decode step uses (fewer kernels to compile).
template <WFormat WF>
static void dispatch_quantized(const GemvParams& p, int R, GemvIn in, GemvOut out, cudaStream_t s, bool pdl) {
  if (in == GemvIn::F32Norm && out == GemvOut::F32) return dispatch_r<WF, GemvIn::F32Norm, GemvOut::F32>(p, R, s, pdl);
  if (in == GemvIn::F16 && out == GemvOut::AddF32) return dispatch_r<WF, GemvIn::F16, GemvOut::AddF32>(p, R, s, pdl);
  if (in == GemvIn::F32Norm && out == GemvOut::Swiglu)
    return dispatch_r<WF, GemvIn::F32Norm, GemvOut::Swiglu>(p, R, s, pdl);
  fail(ErrorKind::Request, "gemv: quantized weights come with (f32norm, f32), (f16, add) or (f32norm, swiglu)");
}

void gemv(const GemvParams& p, int R, GemvIn in, GemvOut out, cudaStream_t s, bool pdl) {
  if (p.ld % 8 != 0 || p.ld < p.K || p.rows < 1 || p.K < 1)
    fail(ErrorKind::Request, "gemv: bad shape rows=" + std::to_string(p.rows) + " K=" + std::to_string(p.K) +
                                 " ld=" + std::to_string(p.ld));
  if (out == GemvOut::Swiglu && p.rows % 2 != 0) fail(ErrorKind::Request, "gemv: Swiglu needs an even row count");
  if (p.fmt == WFormat::I8) {
    if (p.ldq != i8_ld(p.K) || p.ld != p.ldq || !p.q || !p.scales)
      fail(ErrorKind::Request, "gemv: int8 weights need ldq = ld = K rounded up to 16, q and scales");
    return dispatch_quantized<WFormat::I8>(p, R, in, out, s, pdl);
  }
  if (p.fmt == WFormat::I4) {
    if (p.K % kI4Group != 0 || p.ldq != i4_ld(p.K) || p.ld != p.K || !p.q || !p.scales)
      fail(ErrorKind::Request, "gemv: int4 weights need K % 32 == 0, ldq = K / 2, ld = K, q and scales");
    return dispatch_quantized<WFormat::I4>(p, R, in, out, s, pdl);
  }
  if (in == GemvIn::F32Norm) {
    if (out == GemvOut::F32) dispatch_r<WFormat::F16, GemvIn::F32Norm, GemvOut::F32>(p, R, s, pdl);
    else if (out == GemvOut::AddF32) dispatch_r<WFormat::F16, GemvIn::F32Norm, GemvOut::AddF32>(p, R, s, pdl);
    else dispatch_r<WFormat::F16, GemvIn::F32Norm, GemvOut::Swiglu>(p, R, s, pdl);
  } else {
    if (out == GemvOut::F32) dispatch_r<WFormat::F16, GemvIn::F16, GemvOut::F32>(p, R, s, pdl);
    else if (out == GemvOut::AddF32) dispatch_r<WFormat::F16, GemvIn::F16, GemvOut::AddF32>(p, R, s, pdl);
    else dispatch_r<WFormat::F16, GemvIn::F16, GemvOut::Swiglu>(p, R, s, pdl);
  }
}

}  // namespace ti::cuda
