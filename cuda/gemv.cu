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
    if (p.K % 8 == 0) {  // then K == ld
      for (int i = threadIdx.x; i < p.K / 8; i += kGemvThreads)
        reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(x)[i];
    } else {
      for (int i = threadIdx.x; i < p.ld; i += kGemvThreads) xs[i] = i < p.K ? x[i] : __float2half(0.0f);
    }
  }
}

template <int R, GemvIn IN, GemvOut OUT>
__global__ void __launch_bounds__(kGemvThreads) gemv_kernel(GemvParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  __shared__ float red[33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kGemvWarps + warp) * R;
  const uint4* wrow[R];
#pragma unroll
  for (int r = 0; r < R; r++) {
    const int row = min(row0 + r, p.rows - 1);  // rows past the end re-read the last row; never stored
    wrow[r] = reinterpret_cast<const uint4*>(p.W + (size_t)row * p.ld);
  }
  const int ld8 = p.ld / 8;  // 16-byte words per row
  constexpr int P = 8 / R;   // words per row loaded before the dependency wait: 8 per lane in flight
  uint4 pre[P][R];
#pragma unroll
  for (int u = 0; u < P; u++)
#pragma unroll
    for (int r = 0; r < R; r++)
      pre[u][r] = lane + u * 32 < ld8 ? load_stream(wrow[r] + lane + u * 32) : make_uint4(0, 0, 0, 0);

  pdl_wait();
  pdl_launch_dependents();

  stage_x<IN>(p, xs, red);
  __syncthreads();
  if (row0 >= p.rows) return;

  const uint4* xv = reinterpret_cast<const uint4*>(xs);
  float acc[R];
  float xf[8];
#pragma unroll
  for (int r = 0; r < R; r++) acc[r] = 0.0f;
#pragma unroll
  for (int u = 0; u < P; u++) {
    if (lane + u * 32 < ld8) {
      unpack8(xv[lane + u * 32], xf);
#pragma unroll
      for (int r = 0; r < R; r++) acc[r] += dot8(pre[u][r], xf);
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
      unpack8(xv[k + u * 32], xf);
#pragma unroll
      for (int r = 0; r < R; r++) acc[r] += dot8(w[u][r], xf);
    }
  }
  for (; k < ld8; k += 32) {
    unpack8(xv[k], xf);
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] += dot8(load_stream(wrow[r] + k), xf);
  }
#pragma unroll
  for (int r = 0; r < R; r++) acc[r] = warp_sum(acc[r]);
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
template <GemvIn IN, GemvOut OUT>
__global__ void __launch_bounds__(kGemvThreads) gemv_splitk_kernel(GemvParams p) {
  constexpr int RB = 8;  // rows per block
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  __shared__ float red[33];
  __shared__ float part[kGemvWarps][RB];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = blockIdx.x * RB;
  const int ld8 = p.ld / 8, span = (ld8 + kGemvWarps - 1) / kGemvWarps;
  const int k_begin = warp * span, k_end = min(ld8, k_begin + span);
  const uint4* wrow[RB];
#pragma unroll
  for (int r = 0; r < RB; r++)
    wrow[r] = reinterpret_cast<const uint4*>(p.W + (size_t)min(row0 + r, p.rows - 1) * p.ld);
  uint4 pre[RB];
  const bool has_first = k_begin + lane < k_end;
#pragma unroll
  for (int r = 0; r < RB; r++) pre[r] = has_first ? load_stream(wrow[r] + k_begin + lane) : make_uint4(0, 0, 0, 0);

  pdl_wait();
  pdl_launch_dependents();
  stage_x<IN>(p, xs, red);
  __syncthreads();

  const uint4* xv = reinterpret_cast<const uint4*>(xs);
  float acc[RB], xf[8];
#pragma unroll
  for (int r = 0; r < RB; r++) acc[r] = 0.0f;
  if (has_first) {
    unpack8(xv[k_begin + lane], xf);
#pragma unroll
    for (int r = 0; r < RB; r++) acc[r] += dot8(pre[r], xf);
  }
  for (int k = k_begin + lane + 32; k < k_end; k += 32) {
    uint4 w[RB];
#pragma unroll
    for (int r = 0; r < RB; r++) w[r] = load_stream(wrow[r] + k);
    unpack8(xv[k], xf);
#pragma unroll
    for (int r = 0; r < RB; r++) acc[r] += dot8(w[r], xf);
  }
#pragma unroll
  for (int r = 0; r < RB; r++) {
    const float v = warp_sum(acc[r]);
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

template <int R, GemvIn IN, GemvOut OUT>
static void launch_gemv(const GemvParams& p, cudaStream_t stream, bool pdl) {
  const size_t smem = (size_t)p.ld * sizeof(__half);
  static bool raised = false;  // the per-kernel attribute is process-wide state of the function, set once
  if (smem > 48 * 1024 && !raised) {
    TI_CUDA_CHECK(cudaFuncSetAttribute(gemv_kernel<R, IN, OUT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       200 * 1024));
    raised = true;
  }
  const int rows_per_block = kGemvWarps * R;
  launch(gemv_kernel<R, IN, OUT>, dim3((p.rows + rows_per_block - 1) / rows_per_block), dim3(kGemvThreads), smem,
         stream, pdl, p);
}

template <GemvIn IN, GemvOut OUT>
static void launch_splitk(const GemvParams& p, cudaStream_t stream, bool pdl) {
  const size_t smem = (size_t)p.ld * sizeof(__half);
  static bool raised = false;  // a property of the CUDA function (process-wide), set once
  if (smem > 48 * 1024 && !raised) {
    TI_CUDA_CHECK(cudaFuncSetAttribute(gemv_splitk_kernel<IN, OUT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       200 * 1024));
    raised = true;
  }
  launch(gemv_splitk_kernel<IN, OUT>, dim3((p.rows + 7) / 8), dim3(kGemvThreads), smem, stream, pdl, p);
}

template <GemvIn IN, GemvOut OUT>
static void dispatch_r(const GemvParams& p, int R, cudaStream_t s, bool pdl) {
  switch (R) {
    case kGemvSplitK: launch_splitk<IN, OUT>(p, s, pdl); return;
    case 1:
      if constexpr (OUT != GemvOut::Swiglu) { launch_gemv<1, IN, OUT>(p, s, pdl); return; }
      break;
    case 2: launch_gemv<2, IN, OUT>(p, s, pdl); return;
    case 4: launch_gemv<4, IN, OUT>(p, s, pdl); return;
  }
  fail(ErrorKind::Request, "gemv: no variant with R=" + std::to_string(R) + " for this output mode");
}

void gemv(const GemvParams& p, int R, GemvIn in, GemvOut out, cudaStream_t s, bool pdl) {
  if (p.ld % 8 != 0 || p.ld < p.K || p.rows < 1 || p.K < 1)
    fail(ErrorKind::Request, "gemv: bad shape rows=" + std::to_string(p.rows) + " K=" + std::to_string(p.K) +
                                 " ld=" + std::to_string(p.ld));
  if (out == GemvOut::Swiglu && p.rows % 2 != 0) fail(ErrorKind::Request, "gemv: Swiglu needs an even row count");
  if (in == GemvIn::F32Norm) {
    if (out == GemvOut::F32) dispatch_r<GemvIn::F32Norm, GemvOut::F32>(p, R, s, pdl);
    else if (out == GemvOut::AddF32) dispatch_r<GemvIn::F32Norm, GemvOut::AddF32>(p, R, s, pdl);
    else dispatch_r<GemvIn::F32Norm, GemvOut::Swiglu>(p, R, s, pdl);
  } else {
    if (out == GemvOut::F32) dispatch_r<GemvIn::F16, GemvOut::F32>(p, R, s, pdl);
    else if (out == GemvOut::AddF32) dispatch_r<GemvIn::F16, GemvOut::AddF32>(p, R, s, pdl);
    else dispatch_r<GemvIn::F16, GemvOut::Swiglu>(p, R, s, pdl);
  }
}

}  // namespace ti::cuda
