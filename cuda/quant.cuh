// quant.cuh — quantized weight matrices on the device: quantize at load (from fp16), dequantize to fp16 for
// the prefill's GEMMs (see quant.cu; the formats are defined in cpp/core/quant.h).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../cpp/core/quant.h"

namespace ti::cuda {

// One weight matrix as the kernels see it. F16: W (rows, ld) halves. I8: q (rows, ld = K padded to 32) bytes
// u = q + 128 and scales (rows, ld / 32) half: d per block of 32. I4: q (rows, ld = K / 2) bytes of packed
// nibbles and scales (rows, K / 32) half2 (scale, min).
struct QMat {
  WFormat fmt = WFormat::F16;
  const void* q = nullptr;
  const void* scales = nullptr;  // I8: __half*; I4: __half2*
  int rows = 0, K = 0, ld = 0;   // ld in elements for F16, in bytes for I8 / I4
};

// Quantize fp16 W (rows, ldw) into q / scales (the buffers of `out`, cast away const) exactly as the host
// reference ti::quantize does.
void quantize_matrix(const __half* W, int ldw, const QMat& out, cudaStream_t stream);
// fp16 (rows, ldo) = the numbers the quantized matrix stands for (columns K.. of each row: zero).
void dequantize_matrix(const QMat& m, __half* out, int ldo, cudaStream_t stream);

}  // namespace ti::cuda
