// quant.cu — quantize fp16 weights into the I8 / I4 formats of cpp/core/quant.h on the device (load time: a 7B
// model in well under a second of GPU time), and dequantize them back to fp16 rows for the prefill's GEMMs.
// The arithmetic is the host reference's, operation for operation (IEEE division and reciprocal, roundf / rint,
// fp16 rounding of the scales), so the GPU's quantized bytes are the CPU engine's, bit for bit. A thread per
// block of 32 weights: 64 bytes read, 16 / 32 written (a 7B model: ~200M threads, a few ms).
#include "common.cuh"
#include "quant.cuh"

namespace ti::cuda {

// I8: a thread per (row, block of 32), llama.cpp's quantize_row_q8_0: d = amax / 127, q = roundf(w / d) via the
// fp32 reciprocal, u = q + 128; a partial last block as if padded with zeros (so is the row's padding).
__global__ void quantize_i8_kernel(const __half* W, int ldw, int rows, int K, uint8_t* q, int ldq, __half* d) {
  const int blocks = ldq / kI8Block;
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (int64_t)rows * blocks) return;
  const int r = (int)(t / blocks), b = (int)(t % blocks), n = min(kI8Block, K - b * kI8Block);
  const __half* w = W + (size_t)r * ldw + (size_t)b * kI8Block;
  float v[kI8Block], amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kI8Block; i++) {
    v[i] = i < n ? __half2float(w[i]) : 0.0f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
  const float dv = amax / 127.0f, id = dv != 0.0f ? 1.0f / dv : 0.0f;
  d[(size_t)r * blocks + b] = __float2half_rn(dv);
  uint32_t words[kI8Block / 4] = {};
#pragma unroll
  for (int i = 0; i < kI8Block; i++) words[i / 4] |= (uint32_t)((int)roundf(v[i] * id) + 128) << (8 * (i % 4));
  uint4* out = reinterpret_cast<uint4*>(q + (size_t)r * ldq + (size_t)b * kI8Block);
  out[0] = make_uint4(words[0], words[1], words[2], words[3]);
  out[1] = make_uint4(words[4], words[5], words[6], words[7]);
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
    if (m.ld != i8_ld(m.K)) fail(ErrorKind::Request, "quantize_matrix: int8 rows must be K padded to 32 bytes");
    const int64_t n = (int64_t)m.rows * (m.ld / kI8Block);
    quantize_i8_kernel<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(W, ldw, m.rows, m.K, (uint8_t*)m.q, m.ld,
                                                                     (__half*)m.scales);
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
#pragma unroll
  for (int i = 0; i < 8; i++) o[i] = __float2half(0.0f);
  const uint8_t* q = static_cast<const uint8_t*>(m.q) + (size_t)r * m.ld;
  if (k0 < m.K && m.fmt == WFormat::I8) {  // k0 + 8 <= pad8(K) <= ld: inside the row, one block of 32
    const __half* d = static_cast<const __half*>(m.scales) + (size_t)r * (m.ld / kI8Block);
    const float dv = __half2float(d[k0 / kI8Block]);
    const uint2 u = *reinterpret_cast<const uint2*>(q + k0);
#pragma unroll
    for (int i = 0; i < 8; i++)
      if (k0 + i < m.K) o[i] = __float2half(dv * (float)((int)((i < 4 ? u.x : u.y) >> (8 * (i % 4)) & 0xFF) - 128));
  } else if (k0 < m.K) {  // I4: 8 weights = one 32-bit word of the row (K % 32 == 0, k0 % 8 == 0: never straddles)
    const uint32_t word = *reinterpret_cast<const uint32_t*>(q + k0 / 2);
    const float2 smf = __half22float2(static_cast<const __half2*>(m.scales)[(size_t)r * (m.K / kI4Group) +
                                                                             k0 / kI4Group]);
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = __float2half(smf.x * (float)((word >> i4_nibble_pos(i)) & 0xF) + smf.y);
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
