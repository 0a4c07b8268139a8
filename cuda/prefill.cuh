// prefill.cuh — the prefill's element-wise kernels, a row per token (see prefill.cu). The matrix products are
// in gemm.cuh, the attention in prefill_attention.cuh.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace ti::cuda {

// x[t][0..H) = float(E[tokens[t]][0..H)) for t < T. E: (vocab, ldE) fp16; x: (T, ldx) fp32.
void embed_tokens(const __half* E, int ldE, int H, const int* tokens, int T, float* x, int ldx, cudaStream_t stream);

// y[t] = fp16(x[t] / rms(x[t]) * w) for t < T. x: (T, H) fp32 row stride ldx; y: (T, ldy) fp16. pdl: launched
// with programmatic dependent launch (common.cuh; the kernel waits before it reads). row_of (device, T ints;
// may be null): y[t] normalizes x row row_of[t] instead (a gather: the mixed step's logits rows). in_registers:
// false takes the grid-stride kernel even where the register one (H <= 8,192, 16-byte rows) would (tests: same bits).
// act8: y = fp16(d xq) of those values per group of 32 (cuda/act8.cuh: the batched step's input to a product whose
// decode GEMV takes int8 inputs); needs the register kernel and H % 32 == 0, else throws ti::Error(Request).
void rmsnorm_rows(const float* x, int ldx, const float* w, float eps, int H, int T, __half* y, int ldy,
                  cudaStream_t stream, bool pdl = false, const int* row_of = nullptr, bool in_registers = true,
                  bool act8 = false);

// RoPE for T tokens at positions pos0..pos0+T-1 (or each at its own, tok_pos). qkv: (T, ldqkv) fp32 rows q | k | v, before RoPE. Writes rope(q)
// to q (T, q_dim) fp16, rope(k) and v into this layer's pages of the paged cache (cuda/kv_layout.cuh; the pages
// of those positions assigned in page_table) at their positions. cos/sin: (max_seq, head_dim / 2).
struct RopeRowsParams {
  const float* qkv = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
  __half* q = nullptr;
  __half* k_pages = nullptr;
  __half* v_pages = nullptr;
  const int* page_table = nullptr;
  int page_shift = 6;
  int ldqkv = 0;
  int T = 0, pos0 = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  // Many sequences in one pass (null: token t at pos0 + t through page_table): token t at position tok_pos[t]
  // through page_table + tok_table[t] (its sequence's table). Device memory, T entries each.
  const int* tok_pos = nullptr;
  const int* tok_table = nullptr;
};
void rope_rows(const RopeRowsParams& p, cudaStream_t stream);

// h[t][i] = fp16(silu(gu[t][2i]) * gu[t][2i+1]) for i < I (gate and up interleaved, as the weights' rows).
// gu: (T, 2 I) fp16, row stride ldgu; h: (T, ldh) fp16.
void swiglu_rows(const __half* gu, int ldgu, int I, int T, __half* h, int ldh, cudaStream_t stream);

}  // namespace ti::cuda
