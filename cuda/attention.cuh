// attention.cuh — launchers of the decode attention kernels (see attention.cu).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace ti::cuda {

struct DecodeAttnParams {
  const float* qkv = nullptr;   // (q_dim + 2 kv_dim) fp32: q | k | v of the current token, before RoPE
  // The paged KV cache (cpp/gpu/kv_pages.h): this layer's pages of keys and values, each page
  // (n_kv_heads, page_size, head_dim) fp16; position t of the sequence lives in page page_table[t >> page_shift]
  // at row t & (page_size - 1). page_size = 1 << page_shift >= chunk; entries up to pos must be assigned.
  __half* k_pages = nullptr;
  __half* v_pages = nullptr;
  const int* page_table = nullptr;  // (ceil(max_seq / page_size)) int32 page ids
  int page_shift = 6;
  const float* rope_cos = nullptr;  // (max_seq, head_dim / 2)
  const float* rope_sin = nullptr;
  const int* pos = nullptr;     // device: the current token's position; it attends to 0..pos
  float* part_o = nullptr;      // (n_heads, max_chunks, head_dim) unnormalised partial outputs
  float* part_ml = nullptr;     // (n_heads, max_chunks, 2): running max and sum of each chunk
  __half* out = nullptr;        // (n_heads * head_dim) fp16
  int n_heads = 0, n_kv_heads = 0, head_dim = 0, max_seq = 0, chunk = 64;  // max_seq: sizes the grid
  float scale = 1.0f;           // 1 / sqrt(head_dim)
  unsigned long long* trace = nullptr;  // debug timestamps of the chunk kernel (common.cuh, trace_point)
  // Many rows (decode_attention_rows, the batched decode step): row r reads its q | k | v at qkv + r * ld_qkv,
  // attends at position row_pos[r] (< 0: an inert padding row, which reads and writes nothing) through the page
  // table page_table + row_slot[r] * table_stride, writes out + r * ld_out; its partials follow row by row.
  // (pos is unused then.)
  const int* row_pos = nullptr;
  const int* row_slot = nullptr;
  int table_stride = 0, ld_qkv = 0, ld_out = 0;
};

inline int attn_max_chunks(const DecodeAttnParams& p) { return (p.max_seq + p.chunk - 1) / p.chunk; }

// The chunk size the kernel wants for a head dim (shared memory: K and V tiles of chunk x head_dim fp16).
inline int attn_chunk_for(int head_dim) { return head_dim > 128 ? 32 : 64; }
size_t decode_attention_smem(const DecodeAttnParams& p);

// RoPE + KV-cache write + split-K attention over chunks of `chunk` positions, then the log-sum-exp merge.
void decode_attention(const DecodeAttnParams& p, cudaStream_t stream, bool pdl);
// The same over n_rows rows, each at its own position through its own page table (the row fields above); the
// partial buffers hold n_rows * n_heads * attn_max_chunks(p) chunks. One launch pair for all rows.
void decode_attention_rows(const DecodeAttnParams& p, int n_rows, cudaStream_t stream, bool pdl);

}  // namespace ti::cuda
