// prefill.cu — element-wise kernels of the batched prefill: a block (or grid-stride loop) per row of tokens.
// They are memory-bound and small next to the GEMMs (a few % of a prefill); each matches its decode twin's
// arithmetic (gemv.cu's fused RMSNorm and SwiGLU, attention.cu's fused RoPE) so both paths give the same numbers
// up to the fp16 rounding of the GEMM inputs.
#include "common.cuh"
#include "prefill.cuh"

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

// A block of 256 threads per row: sum of squares in fp32, then y = x * inv * w rounded to fp16.
__global__ void __launch_bounds__(256) rmsnorm_rows_kernel(const float* x, int ldx, const float* w, float eps, int H,
                                                           __half* y, int ldy) {
  __shared__ float red[33];
  const float* xr = x + (size_t)blockIdx.x * ldx;
  __half* yr = y + (size_t)blockIdx.x * ldy;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
  const float inv = rsqrtf(block_sum(ss, red) / (float)H + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) yr[i] = __float2half(xr[i] * inv * w[i]);
}

void rmsnorm_rows(const float* x, int ldx, const float* w, float eps, int H, int T, __half* y, int ldy,
                  cudaStream_t s) {
  rmsnorm_rows_kernel<<<T, 256, 0, s>>>(x, ldx, w, eps, H, y, ldy);
  TI_CUDA_CHECK(cudaGetLastError());
}

// Grid (T, n_heads + n_kv_heads): a block per (token, head). Query heads are rotated into q; key heads are
// rotated into the cache and the matching value head copied beside it.
__global__ void rope_rows_kernel(RopeRowsParams p) {
  const int t = blockIdx.x, head = blockIdx.y, hd = p.head_dim, half_d = hd / 2, pos = p.pos0 + t;
  const int q_dim = p.n_heads * hd, kv_dim = p.n_kv_heads * hd;
  const float* row = p.qkv + (size_t)t * p.ldqkv;
  const float* cs = p.cos + (size_t)pos * half_d;
  const float* sn = p.sin + (size_t)pos * half_d;
  if (head < p.n_heads) {
    const float* q = row + (size_t)head * hd;
    __half* out = p.q + (size_t)t * q_dim + (size_t)head * hd;
    for (int i = threadIdx.x; i < half_d; i += blockDim.x) {
      const float x1 = q[i], x2 = q[i + half_d];
      out[i] = __float2half(x1 * cs[i] - x2 * sn[i]);
      out[i + half_d] = __float2half(x2 * cs[i] + x1 * sn[i]);
    }
    return;
  }
  const int kvh = head - p.n_heads;
  const float* k = row + q_dim + (size_t)kvh * hd;
  const float* v = row + q_dim + kv_dim + (size_t)kvh * hd;
  __half* kc = p.k_cache + ((size_t)kvh * p.max_seq + pos) * hd;
  __half* vc = p.v_cache + ((size_t)kvh * p.max_seq + pos) * hd;
  for (int i = threadIdx.x; i < half_d; i += blockDim.x) {
    const float x1 = k[i], x2 = k[i + half_d];
    kc[i] = __float2half(x1 * cs[i] - x2 * sn[i]);
    kc[i + half_d] = __float2half(x2 * cs[i] + x1 * sn[i]);
  }
  for (int i = threadIdx.x; i < hd; i += blockDim.x) vc[i] = __float2half(v[i]);
}

void rope_rows(const RopeRowsParams& p, cudaStream_t s) {
  if (p.T < 1) return;
  rope_rows_kernel<<<dim3(p.T, p.n_heads + p.n_kv_heads), 64, 0, s>>>(p);
  TI_CUDA_CHECK(cudaGetLastError());
}

__global__ void swiglu_rows_kernel(const __half* gu, int ldgu, int I, __half* h, int ldh) {
  const int t = blockIdx.y;
  const __half2* in = reinterpret_cast<const __half2*>(gu + (size_t)t * ldgu);  // (gate_i, up_i) pairs
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < I; i += gridDim.x * blockDim.x) {
    const float2 f = __half22float2(in[i]);
    h[(size_t)t * ldh + i] = __float2half(f.x / (1.0f + __expf(-f.x)) * f.y);
  }
}

void swiglu_rows(const __half* gu, int ldgu, int I, int T, __half* h, int ldh, cudaStream_t s) {
  swiglu_rows_kernel<<<dim3((I + 255) / 256, T), 256, 0, s>>>(gu, ldgu, I, h, ldh);
  TI_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ti::cuda
