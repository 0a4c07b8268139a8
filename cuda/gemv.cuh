// gemv.cuh — launchers of the fp16 matrix-vector kernels (see gemv.cu).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../cpp/core/quant.h"

namespace ti::cuda {

enum class GemvIn { F16, F32Norm };          // input: an fp16 vector, or the fp32 residual stream RMS-normed
enum class GemvOut { F32, AddF32, Swiglu };  // output: fp32, fp32 added in place (residual), silu(g)*u as fp16

struct GemvParams {
  const __half* W = nullptr;  // (rows, ld) row-major fp16; columns K..ld-1 are zero padding
  int rows = 0, K = 0, ld = 0;  // ld: a multiple of 8 (16-byte rows), >= K
  // Quantized weights (cpp/core/quant.h) instead of W: fmt I8 / I4, q (rows, ldq bytes), scales (I8: (rows, ldq / 32)
  // half, d per block of 32; I4: (rows, K / 32) half2 (scale, min)). ld stays the width the input vector is
  // staged at (elements).
  WFormat fmt = WFormat::F16;
  const uint8_t* q = nullptr;
  const void* scales = nullptr;
  int ldq = 0;
  // I8 / I4: the input quantized to int8 per group of 32, dot products by dp4a (gemv_dot.cuh, kI8A8 / kI4A8);
  // needs gemv_act8_ok.
  bool act8 = false;
  const void* x = nullptr;    // F16: half[K]; F32Norm: float[K]
  const float* norm_w = nullptr;  // F32Norm: the RMSNorm weight, float[K]
  float eps = 1e-5f;
  void* y = nullptr;          // F32 / AddF32: float[rows]; Swiglu: half[rows / 2] (rows interleaved g0,u0,g1,u1..)
  // PDL: let the next kernel launch at this kernel's start instead of after its dependency wait. Only where the
  // next kernel reads nothing but weights before its own wait (common.cuh: the two-back rule).
  bool early_trigger = false;
  // Grid: 0 = one block per tile (8 warps x R rows); n > 0 = at most n blocks per SM, each looping over tiles
  // (as many tiles each); n < 0 = exactly -n blocks (tests: blocks loop over uneven numbers of tiles).
  int blocks_per_sm = 0;
  unsigned long long* trace = nullptr;  // debug timestamps (common.cuh, trace_point); nullptr: off
};

// The variant: R = 1, 2, 4 rows per warp (Swiglu: 2 or 4), or R = kGemvSplitK: 8 rows per block with K split
// over the block's 8 warps. pdl: launch with programmatic dependent launch (sm_90+).
constexpr int kGemvSplitK = 8;
// Quantized weights: the (in, out) pairs a decode step uses — (F32Norm, F32), (F16, AddF32), (F32Norm, Swiglu).
void gemv(const GemvParams& p, int R, GemvIn in, GemvOut out, cudaStream_t stream, bool pdl);
bool gemv_variant_ok(int R, GemvOut out);
// Whether a quantized GEMV of width K with input mode `in` can take its input as int8 (GemvParams::act8): K a
// multiple of the group of 32, and the normed staging's registers hold the row (K <= 8192).
bool gemv_act8_ok(int K, GemvIn in);
// Rows per tile of variant R (a block's work unit): 8R, or 8 for split-K.
constexpr int gemv_tile_rows(int R) { return R == kGemvSplitK ? 8 : 8 * R; }

}  // namespace ti::cuda
