// convert.cu — see convert.cuh. Memory-bound copies with a row remap; one block row per source row, threads
// along the columns, so reads and writes stay coalesced whatever the map does with the rows.
#include <algorithm>

#include "common.cuh"
#include "convert.cuh"

namespace ti::cuda {

namespace {

__device__ __forceinline__ int64_t dev_map_row(const RowMap& m, int64_t i) {
  if (m.rope_heads > 0) {
    const int64_t hd = m.rows / m.rope_heads, r = i % hd;
    i = (i - r) + (r & 1) * (hd / 2) + (r >> 1);
  }
  return m.offset + m.step * i;
}

template <DType T>
__device__ __forceinline__ __half load_as_half(const void* src, size_t at) {
  if constexpr (T == DType::F32) {
    return __float2half_rn(static_cast<const float*>(src)[at]);
  } else if constexpr (T == DType::F16) {
    return __ushort_as_half(static_cast<const uint16_t*>(src)[at]);
  } else {  // bf16: the upper half of an fp32
    return __float2half_rn(__uint_as_float((uint32_t)static_cast<const uint16_t*>(src)[at] << 16));
  }
}

template <DType T>
__global__ void convert_rows_kernel(const void* src, int K, int64_t row0, __half* dst, int ld, RowMap map) {
  const int64_t i = blockIdx.y;
  __half* out = dst + (size_t)dev_map_row(map, row0 + i) * ld;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < ld; j += gridDim.x * blockDim.x)
    out[j] = j < K ? load_as_half<T>(src, (size_t)i * K + j) : __float2half(0.0f);
}

__global__ void scatter_rows_kernel(const uint8_t* src, int row_bytes, int64_t row0, uint8_t* dst, RowMap map) {
  const int64_t i = blockIdx.y;
  uint8_t* out = dst + (size_t)dev_map_row(map, row0 + i) * row_bytes;
  const uint8_t* in = src + (size_t)i * row_bytes;
  if (row_bytes % 4 == 0) {  // every layout's rows but odd-width scale rows: words
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < row_bytes / 4; j += gridDim.x * blockDim.x)
      reinterpret_cast<uint32_t*>(out)[j] = reinterpret_cast<const uint32_t*>(in)[j];
  } else {
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < row_bytes; j += gridDim.x * blockDim.x) out[j] = in[j];
  }
}

// One thread per block of 32 weights.
__global__ void q4_blocks_kernel(const uint8_t* blocks, bool q4_1, int64_t n, int K, int64_t row0, uint8_t* q,
                                 __half2* sm, RowMap map) {
  const int groups = K / kI4Group, bsize = q4_1 ? 20 : 18;
  const int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= n * groups) return;
  const int64_t i = b / groups;
  const int g = (int)(b % groups);
  const uint8_t* in = blocks + (size_t)b * bsize;
  const __half d = __ushort_as_half((uint16_t)(in[0] | in[1] << 8));
  const __half m = q4_1 ? __ushort_as_half((uint16_t)(in[2] | in[3] << 8)) : __float2half_rn(-8.0f * __half2float(d));
  const uint8_t* qs = in + (q4_1 ? 4 : 2);  // byte j: weight j (low nibble), weight j + 16 (high nibble)
  const int64_t r = dev_map_row(map, row0 + i);
  uint32_t* out = reinterpret_cast<uint32_t*>(q + (size_t)r * (K / 2) + (size_t)g * 16);
  for (int w = 0; w < 4; w++) {
    uint32_t word = 0;
    for (int k = 0; k < 8; k++) {
      const int idx = 8 * w + k;
      const uint32_t v = idx < 16 ? qs[idx] & 0xF : qs[idx - 16] >> 4;
      word |= v << i4_nibble_pos(k);
    }
    out[w] = word;
  }
  sm[(size_t)r * groups + g] = __halves2half2(d, m);
}

// Grid: (column blocks, rows); gridDim.y is limited to 65535, so callers' row counts are split.
constexpr int kThreads = 256;
constexpr int64_t kMaxGridY = 65535;

}  // namespace

void convert_rows(const void* src, DType src_type, int64_t n, int K, int64_t row0, __half* dst, int ld,
                  const RowMap& map, cudaStream_t stream) {
  const size_t esize = dtype_size(src_type);
  for (int64_t done = 0; done < n; done += kMaxGridY) {
    const int64_t rows = std::min<int64_t>(kMaxGridY, n - done);
    const dim3 grid((unsigned)std::min<int64_t>((ld + kThreads - 1) / kThreads, 64), (unsigned)rows);
    const void* s = static_cast<const uint8_t*>(src) + (size_t)done * K * esize;
    const int64_t r = row0 + done;
    switch (src_type) {
      case DType::F32: convert_rows_kernel<DType::F32><<<grid, kThreads, 0, stream>>>(s, K, r, dst, ld, map); break;
      case DType::F16: convert_rows_kernel<DType::F16><<<grid, kThreads, 0, stream>>>(s, K, r, dst, ld, map); break;
      case DType::BF16: convert_rows_kernel<DType::BF16><<<grid, kThreads, 0, stream>>>(s, K, r, dst, ld, map); break;
    }
    TI_CUDA_CHECK(cudaGetLastError());
  }
}

void scatter_rows(const uint8_t* src, int64_t n, int row_bytes, int64_t row0, uint8_t* dst, const RowMap& map,
                  cudaStream_t stream) {
  for (int64_t done = 0; done < n; done += kMaxGridY) {
    const int64_t rows = std::min<int64_t>(kMaxGridY, n - done);
    const int units = row_bytes % 4 == 0 ? row_bytes / 4 : row_bytes;
    const dim3 grid((unsigned)std::min<int64_t>((units + kThreads - 1) / kThreads, 64), (unsigned)rows);
    const uint8_t* from = src + (size_t)done * row_bytes;
    scatter_rows_kernel<<<grid, kThreads, 0, stream>>>(from, row_bytes, row0 + done, dst, map);
    TI_CUDA_CHECK(cudaGetLastError());
  }
}

void q4_blocks_to_i4(const uint8_t* blocks, bool q4_1, int64_t n, int K, int64_t row0, uint8_t* q, __half2* sm,
                     const RowMap& map, cudaStream_t stream) {
  const int64_t total = n * (K / kI4Group);
  if (total == 0) return;
  q4_blocks_kernel<<<(unsigned)((total + kThreads - 1) / kThreads), kThreads, 0, stream>>>(blocks, q4_1, n, K, row0,
                                                                                          q, sm, map);
  TI_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ti::cuda
