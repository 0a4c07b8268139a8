// prefill_attention.cuh — causal attention of T new tokens over the KV cache (see prefill_attention.cu).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace ti::cuda {

struct PrefillAttnParams {
  const __half* q = nullptr;        // (T, n_heads * head_dim) fp16, RoPE applied, not scaled
  // The paged KV cache (cuda/kv_layout.cuh): this layer's pages (n_kv_heads, page_size, head_dim) fp16, positions
  // 0..pos0+T-1 written and their pages assigned in page_table; page_size = 1 << page_shift >= 64.
  const __half* k_pages = nullptr;
  const __half* v_pages = nullptr;
  const int* page_table = nullptr;
  int page_shift = 6;
  __half* out = nullptr;            // (T, ldo) fp16: head h of token t at columns h * head_dim ...
  int ldo = 0;
  int T = 0, pos0 = 0;              // token t sits at position pos0 + t and attends to positions 0..pos0 + t
  int n_heads = 0, n_kv_heads = 0, head_dim = 0, max_seq = 0;
  float scale = 1.0f;               // 1 / sqrt(head_dim)
  int stages = 0;                   // 0: the launcher's choice; 1 or 2: force that variant (tests)
};

// head_dim a multiple of 16 in 16..256 (the tensor-core tile); n_heads a multiple of n_kv_heads; pages of >= 64
// positions (a key tile, <= 64 rows at a multiple of its size, then never straddles two pages).
bool prefill_attention_supported(int head_dim);
void prefill_attention(const PrefillAttnParams& p, cudaStream_t stream);

}  // namespace ti::cuda
