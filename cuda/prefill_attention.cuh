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
  // Many sequences in one pass (varlen; null: the one sequence above). Sequence s owns rows seqs[s].x ..
  // seqs[s].x + seqs[s].y - 1 of q and out, its tokens sit at positions seqs[s].z .. and it reads its keys
  // through page_table + seqs[s].w; T and pos0 above are then unused. tiles[b]: block b's sequence (x) and
  // first packed row within it (y), n_tiles blocks (prefill_attention_tiles builds them). Device memory.
  const int4* seqs = nullptr;
  const int2* tiles = nullptr;
  int n_tiles = 0;
};

// The blocks of a varlen pass: ceil(T_s * group / 64) per sequence, heaviest (most keys) first. seq_T and
// seq_pos0: per sequence (host). Appends to `out` (x: sequence, y: first packed row).
void prefill_attention_tiles(const int* seq_T, const int* seq_pos0, int n_seqs, int group, int2* out, int* n_out);
// An upper bound of prefill_attention_tiles' count for n_seqs sequences of total_T tokens.
int prefill_attention_max_tiles(int total_T, int n_seqs, int group);

// head_dim a multiple of 16 in 16..256 (the tensor-core tile); n_heads a multiple of n_kv_heads; pages of >= 64
// positions (a key tile, <= 64 rows at a multiple of its size, then never straddles two pages).
bool prefill_attention_supported(int head_dim);
void prefill_attention(const PrefillAttnParams& p, cudaStream_t stream);

}  // namespace ti::cuda
