// prefill.cu — element-wise kernels of the batched prefill: a block (or grid-stride loop) per row of tokens.
// They are memory-bound and small next to the GEMMs (a few % of a prefill); each matches its decode twin's
// arithmetic (gemv.cu's fused RMSNorm and SwiGLU, attention.cu's fused RoPE) so both paths give the same numbers
// up to the fp16 rounding of the GEMM inputs.
#include "common.cuh"
#include "kv_layout.cuh"
#include "prefill.cuh"
#include "rms_row.cuh"

namespace ti::cuda {

__global__ void embed_rows_kernel(const __half* E, int ldE, int H, const int* tokens, float* x, int ldx) {
  const int t = blockIdx.y;
  const __half* row = E + (size_t)tokens[t] * ldE;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < H; i += gridDim.x * blockDim.x)
    x[(size_t)t * ldx + i] = __half2float(row[i]);
}

void embed_tokens(const __half* E, int ldE, int H, const int* tokens, int T, float* x, int ldx, cudaStream_t s) {
  embed_rows_kernel<<<dim3((H + 255) / 256, T), 256, 0, s>>>(E, ldE, H, tokens, x, ldx);
  TI_CUDA_CHECK(cudaGetLastError());
}

// A block of 256 threads per row: sum of squares in fp32, then y = x * inv * w rounded to fp16. Rows are read
// as float4 (H and the strides are multiples of 4 on this path; else scalar), written as 4 halves.
__global__ void __launch_bounds__(256) rmsnorm_rows_kernel(const float* x, int ldx, const float* w, float eps, int H,
                                                           __half* y, int ldy, const int* row_of) {
  __shared__ float red[33];
  const float* xr = x + (size_t)(row_of ? row_of[blockIdx.x] : (int)blockIdx.x) * ldx;
  __half* yr = y + (size_t)blockIdx.x * ldy;
  pdl_wait();  // (the batched step launches it with PDL; no-ops otherwise)
  pdl_launch_dependents();
  const bool vec = (H % 4 == 0) && (ldx % 4 == 0) && (ldy % 4 == 0);
  float ss = 0.0f;
  if (vec) {
    for (int i = threadIdx.x * 4; i < H; i += blockDim.x * 4) {
      const float4 v = *reinterpret_cast<const float4*>(xr + i);
      ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
    }
  } else {
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
  }
  const float inv = rsqrtf(block_sum(ss, red) / (float)H + eps);
  if (vec) {
    for (int i = threadIdx.x * 4; i < H; i += blockDim.x * 4) {
      const float4 v = *reinterpret_cast<const float4*>(xr + i);
      const float4 g = *reinterpret_cast<const float4*>(w + i);
      __align__(8) __half2 o[2] = {__floats2half2_rn(v.x * inv * g.x, v.y * inv * g.y),
                                   __floats2half2_rn(v.z * inv * g.z, v.w * inv * g.w)};
      *reinterpret_cast<uint2*>(yr + i) = *reinterpret_cast<const uint2*>(o);
    }
  } else {
    for (int i = threadIdx.x; i < H; i += blockDim.x) yr[i] = __float2half(xr[i] * inv * w[i]);
  }
}

// The same with a row held in registers (H <= 1,024 V, the vector path): the norm weight is fetched before the PDL
// wait (a weight never depends on the kernel before), so after the wait one round trip reads x and nothing reads
// memory again. For the batched decode step, whose 45 norms a step are each a dependent launch of a few rows
// (~3 us each at batch 8: two round trips to L2 after the wait before this). Same sums in the same order as
// rmsnorm_rows_kernel, so the same bits.
template <int V, bool A8>
__global__ void __launch_bounds__(256) rmsnorm_rows_reg_kernel(const float* x, int ldx, const float* w, float eps,
                                                               int H, __half* y, int ldy, const int* row_of) {
  __shared__ float red[33];
  float4 g[V], v[V];
  rms_row_weights<V>(w, H, g);
  pdl_wait();
  pdl_launch_dependents();
  const float* xr = x + (size_t)(row_of ? row_of[blockIdx.x] : (int)blockIdx.x) * ldx;
#pragma unroll
  for (int j = 0; j < V; j++) {
    const int i = (threadIdx.x + j * 256) * 4;
    if (i < H) v[j] = *reinterpret_cast<const float4*>(xr + i);
  }
  rms_row_write<V, A8>(v, g, H, eps, red, y + (size_t)blockIdx.x * ldy);
}

// The register kernel at V float4s a thread (V <= 8: H <= 8,192).
template <bool A8>
static void rmsnorm_rows_reg(int V, const float* x, int ldx, const float* w, float eps, int H, int T, __half* y,
                             int ldy, cudaStream_t s, bool pdl, const int* row_of) {
  auto go = [&](auto kernel) { launch(kernel, dim3(T), dim3(256), 0, s, pdl, x, ldx, w, eps, H, y, ldy, row_of); };
  if (V <= 1) return go(rmsnorm_rows_reg_kernel<1, A8>);
  if (V <= 2) return go(rmsnorm_rows_reg_kernel<2, A8>);
  if (V <= 4) return go(rmsnorm_rows_reg_kernel<4, A8>);
  go(rmsnorm_rows_reg_kernel<8, A8>);
}

void rmsnorm_rows(const float* x, int ldx, const float* w, float eps, int H, int T, __half* y, int ldy,
                  cudaStream_t s, bool pdl, const int* row_of, bool in_registers, bool act8) {
  // (x, y and w 16-byte aligned, as both kernels' vector paths assume: arena and cudaMalloc pointers)
  const bool vec = in_registers && H % 4 == 0 && ldx % 4 == 0 && ldy % 4 == 0;
  const int V = (H + 1023) / 1024;
  if (act8) {  // (the register kernel only: the engine asks for it where the GEMV's act8 applies, K <= 8,192)
    if (!vec || V > 8 || H % kAct8Group != 0)
      fail(ErrorKind::Request, "rmsnorm_rows: act8 needs H % 32 == 0, H <= 8192 and 16-byte rows");
    return rmsnorm_rows_reg<true>(V, x, ldx, w, eps, H, T, y, ldy, s, pdl, row_of);
  }
  if (vec && V <= 8) return rmsnorm_rows_reg<false>(V, x, ldx, w, eps, H, T, y, ldy, s, pdl, row_of);
  launch(rmsnorm_rows_kernel, dim3(T), dim3(256), 0, s, pdl, x, ldx, w, eps, H, y, ldy, row_of);
}

// A block per token (the first version, a block per (token, head) of 64 threads, spent 46 µs per layer on a
// 2,048-token TinyLlama chunk for ~31 MB of traffic: 82k tiny blocks). Threads walk the token's rotation pairs
// (i, i + head_dim/2) of every query and key head — consecutive threads, consecutive i: coalesced — then copy
// the value heads.
__global__ void __launch_bounds__(256) rope_rows_kernel(RopeRowsParams p) {
  const int t = blockIdx.x, hd = p.head_dim, half_d = hd / 2;
  const int pos = p.tok_pos ? p.tok_pos[t] : p.pos0 + t;
  const int* table = p.tok_table ? p.page_table + p.tok_table[t] : p.page_table;
  const int q_dim = p.n_heads * hd, kv_dim = p.n_kv_heads * hd;
  const float* row = p.qkv + (size_t)t * p.ldqkv;
  const float* cs = p.cos + (size_t)pos * half_d;
  const float* sn = p.sin + (size_t)pos * half_d;
  const size_t kv_at = kv_row(table, pos, 0, p.n_kv_heads, p.page_shift, hd);  // head 0's row; head h: + h P hd
  const size_t head_stride = (size_t)hd << p.page_shift;
  const int pairs = (p.n_heads + p.n_kv_heads) * half_d;
  for (int j = threadIdx.x; j < pairs; j += blockDim.x) {
    const int head = j / half_d, i = j - head * half_d;
    const float x1 = row[head * hd + i], x2 = row[head * hd + i + half_d];
    const __half r1 = __float2half(x1 * cs[i] - x2 * sn[i]), r2 = __float2half(x2 * cs[i] + x1 * sn[i]);
    __half* out;
    if (head < p.n_heads) {
      out = p.q + (size_t)t * q_dim + (size_t)head * hd;
    } else {
      out = p.k_pages + kv_at + (size_t)(head - p.n_heads) * head_stride;
    }
    out[i] = r1;
    out[i + half_d] = r2;
  }
  const float* v = row + q_dim + kv_dim;
  for (int j = threadIdx.x; j < kv_dim; j += blockDim.x) {
    const int h = j / hd, d = j - h * hd;
    p.v_pages[kv_at + (size_t)h * head_stride + d] = __float2half(v[j]);
  }
}

void rope_rows(const RopeRowsParams& p, cudaStream_t s) {
  if (p.page_shift < 0 || p.page_shift > 20) fail(ErrorKind::Request, "rope_rows: page_shift must be 0..20");
  if (p.T < 1) return;
  rope_rows_kernel<<<p.T, 256, 0, s>>>(p);
  TI_CUDA_CHECK(cudaGetLastError());
}

// 8 outputs per thread: two 16-byte loads (8 gate/up pairs), one 16-byte store (the first version, one half2
// per thread, took 42 µs per layer on a 2,048-token TinyLlama chunk where ~70 MB of traffic needs ~16). Rows whose width I is not a multiple of 8 take
// the scalar tail.
__global__ void swiglu_rows_kernel(const __half* gu, int ldgu, int I, __half* h, int ldh) {
  const int t = blockIdx.y;
  const __half2* in = reinterpret_cast<const __half2*>(gu + (size_t)t * ldgu);  // (gate_i, up_i) pairs
  __half* out = h + (size_t)t * ldh;
  const int i8 = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (i8 + 8 <= I) {
    const uint4 a = *reinterpret_cast<const uint4*>(in + i8), b = *reinterpret_cast<const uint4*>(in + i8 + 4);
    const __half2* pa = reinterpret_cast<const __half2*>(&a);
    const __half2* pb = reinterpret_cast<const __half2*>(&b);
    __align__(16) __half r[8];
#pragma unroll
    for (int k = 0; k < 8; k++) {
      const float2 f = __half22float2(k < 4 ? pa[k] : pb[k - 4]);
      r[k] = __float2half(f.x / (1.0f + __expf(-f.x)) * f.y);
    }
    *reinterpret_cast<uint4*>(out + i8) = *reinterpret_cast<const uint4*>(r);
  } else {
    for (int i = i8; i < I; i++) {
      const float2 f = __half22float2(in[i]);
      out[i] = __float2half(f.x / (1.0f + __expf(-f.x)) * f.y);
    }
  }
}

void swiglu_rows(const __half* gu, int ldgu, int I, int T, __half* h, int ldh, cudaStream_t s) {
  if (ldgu % 8 || ldh % 8) fail(ErrorKind::Request, "swiglu_rows: row strides must be multiples of 8");
  const int threads = 128, per_block = threads * 8;
  swiglu_rows_kernel<<<dim3((I + per_block - 1) / per_block, T), threads, 0, s>>>(gu, ldgu, I, h, ldh);
  TI_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ti::cuda
