// quant.cu — quantize fp16 weights into the I8 / I4 formats of cpp/quant.h on the device (load time: a 7B
// model in well under a second of GPU time), and dequantize them back to fp16 rows for the prefill's GEMMs.
// The arithmetic is the host reference's, operation for operation (IEEE division, rint, fp16 rounding of the
// I4 scale and min), so the GPU's quantized numbers are the CPU engine's.
#include "common.cuh"
#include "quant.cuh"

namespace ti::cuda {

// I8: a block per row. max|w| over the row, s = amax / 127, u = clamp(rint(w / s), -127, 127) + 128.
__global__ void quantize_i8_kernel(const __half* W, int ldw, int K, uint8_t* q, int ldq, float* scale) {
  __shared__ float red[33];
  const __half* w = W + (size_t)blockIdx.x * ldw;
  float amax = 0.0f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) amax = fmaxf(amax, fabsf(__half2float(w[k])));
  amax = warp_max(amax);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.0f;
    v = warp_max(v);
    if (threadIdx.x == 0) red[32] = v;
  }
  __syncthreads();
  amax = red[32];
  const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
  if (threadIdx.x == 0) scale[blockIdx.x] = s;
  uint8_t* out = q + (size_t)blockIdx.x * ldq;
  for (int k = threadIdx.x; k < ldq; k += blockDim.x) {
    const float v = k < K ? fminf(127.0f, fmaxf(-127.0f, rintf(__half2float(w[k]) / s))) : 0.0f;
    out[k] = (uint8_t)((int)v + 128);
  }
}

// I4: a thread per (row, group of 32).
__global__ void quantize_i4_kernel(const __half* W, int ldw, int rows, int K, uint8_t* q, __half2* sm) {
  const int groups = K / kI4Group;
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (int64_t)rows * groups) return;
  const int r = (int)(t / groups), g = (int)(t % groups);
  const __half* w = W + (size_t)r * ldw + (size_t)g * kI4Group;
  float v[kI4Group], lo = INFINITY, hi = -INFINITY;
#pragma unroll
  for (int i = 0; i < kI4Group; i++) {
    v[i] = __half2float(w[i]);
    lo = fminf(lo, v[i]);
    hi = fmaxf(hi, v[i]);
  }
  const __half sh = __float2half_rn((hi - lo) / 15.0f), mh = __float2half_rn(lo);
  const float s = __half2float(sh), mn = __half2float(mh);
  sm[(size_t)r * groups + g] = __halves2half2(sh, mh);
  uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < kI4Group; i++) {
    const float qf = s > 0.0f ? fminf(15.0f, fmaxf(0.0f, rintf((v[i] - mn) / s))) : 0.0f;
    words[i / 8] |= (uint32_t)qf << i4_nibble_pos(i % 8);
  }
  *reinterpret_cast<uint4*>(q + (size_t)r * (K / 2) + (size_t)g * (kI4Group / 2)) =
      make_uint4(words[0], words[1], words[2], words[3]);
}

void quantize_matrix(const __half* W, int ldw, const QMat& m, cudaStream_t s) {
  if (m.fmt == WFormat::I8) {
    quantize_i8_kernel<<<m.rows, 256, 0, s>>>(W, ldw, m.K, (uint8_t*)m.q, m.ld, (float*)m.scales);
  } else if (m.fmt == WFormat::I4) {
    if (m.K % kI4Group != 0) fail(ErrorKind::Unsupported, "int4: K must be a multiple of 32");
    const int64_t n = (int64_t)m.rows * (m.K / kI4Group);
    quantize_i4_kernel<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(W, ldw, m.rows, m.K, (uint8_t*)m.q,
                                                                     (__half2*)m.scales);
  } else {
    fail(ErrorKind::Request, "quantize_matrix: fp16 is not a quantized format");
  }
  TI_CUDA_CHECK(cudaGetLastError());
}

// A thread per 8 output halves (one 16-byte store).
__global__ void dequantize_kernel(QMat m, __half* out, int ldo) {
  const int per_row = ldo / 8;
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (int64_t)m.rows * per_row) return;
  const int r = (int)(t / per_row), k0 = (int)(t % per_row) * 8;
  __align__(16) __half o[8];
  if (m.fmt == WFormat::I8) {
    const uint8_t* q = static_cast<const uint8_t*>(m.q) + (size_t)r * m.ld;
    const float s = static_cast<const float*>(m.scales)[r];
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = __float2half(k0 + i < m.K ? (float)((int)q[k0 + i] - 128) * s : 0.0f);
  } else {
    const int groups = m.K / kI4Group;
    if (k0 < m.K) {  // 8 weights = one 32-bit word of the row (K % 32 == 0 and k0 % 8 == 0: never straddles)
      const uint32_t word = *reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(m.q) + (size_t)r * m.ld +
                                                               k0 / 2);
      const float2 smf = __half22float2(static_cast<const __half2*>(m.scales)[(size_t)r * groups + k0 / kI4Group]);
#pragma unroll
      for (int i = 0; i < 8; i++) o[i] = __float2half(smf.x * (float)((word >> i4_nibble_pos(i)) & 0xF) + smf.y);
    } else {
#pragma unroll
      for (int i = 0; i < 8; i++) o[i] = __float2half(0.0f);
    }
  }
  *reinterpret_cast<uint4*>(out + (size_t)r * ldo + k0) = *reinterpret_cast<const uint4*>(o);
}

void dequantize_matrix(const QMat& m, __half* out, int ldo, cudaStream_t s) {
  if (m.fmt == WFormat::F16) fail(ErrorKind::Request, "dequantize_matrix: not a quantized matrix");
  if (ldo % 8 || ldo < m.K) fail(ErrorKind::Request, "dequantize_matrix: bad output stride");
  const int64_t n = (int64_t)m.rows * (ldo / 8);
  dequantize_kernel<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(m, out, ldo);
  TI_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ti::cuda
