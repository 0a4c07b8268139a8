// attention.cuh — launchers of the decode attention kernels: the single sequence's (attention.cu) and the
// batched step's, many rows at their own positions (attention_rows.cu).
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
  bool tensor_cores = true;     // decode_attention: a chunk's scores and P V on mma.sync (head dim 64 / 128, chunk 64)
  // decode_attention: the chunk kernel triggers its successor (the merge, or the O GEMV) at its start rather than
  // after its wait; both read only weights and data three or more kernels back (pos) before their own wait.
  bool early_trigger = false;
  unsigned long long* trace = nullptr;  // debug timestamps of the chunk kernel (common.cuh, trace_point)
  // Many rows (decode_attention_rows, the batched decode step): row r reads its q | k | v at qkv + r * ld_qkv,
  // attends at position row_pos[r] (< 0: an inert padding row, which reads and writes nothing) through the page
  // table page_table + row_slot[r] * table_stride, writes out + r * ld_out. Its partials (split-K over splits of
  // rows_span positions, long rows only): part_o (n_rows, n_heads, attn_rows_max_splits, head_dim), part_ml
  // (..., 2); tickets: attn_rows_tickets(...) counters, zero before the first launch, which every launch leaves
  // zero again (graph replays). (pos and chunk are unused then.)
  const int* row_pos = nullptr;
  const int* row_slot = nullptr;
  unsigned* tickets = nullptr;
  int table_stride = 0, ld_qkv = 0, ld_out = 0;
  int grid_x = 0;  // the rows grid's x (blocks per row and head, each looping over splits); 0: sized for n_rows
  int rows_span = 0;  // positions per block: 64, 128 or 256, at most attn_rows_span(head_dim); 0: that
  int rows_heads = 0;  // query heads per block: 1, 2, 4 or 8 (a KV head's group in slices of that); 0: by n_rows
  // decode_attention_rows: the output written as the o product's int8 inputs, fp16(d xq) per group of 32
  // (cuda/act8.cuh), where the batched step's o takes them (CudaOptions::act8): the same bits as act8_round_rows
  // after it, one kernel fewer. Needs head_dim % 32 == 0 (a group is 32 dims of one head).
  bool act8_out = false;
  // decode_attention_rows: every row's key and value are in the cache already (append_kv_rows ran before, without
  // PDL): the rows may then share a slot at consecutive positions (speculative decoding's draft pass, where a row
  // reads the keys of the rows before it). The kernel writes nothing to the cache and must be launched without
  // PDL (it reads the cache before its wait).
  bool appended = false;
};

inline int attn_max_chunks(const DecodeAttnParams& p) { return (p.max_seq + p.chunk - 1) / p.chunk; }

// The chunk size the kernel wants for a head dim (shared memory: K and V tiles of chunk x head_dim fp16).
inline int attn_chunk_for(int head_dim) { return head_dim > 128 ? 32 : 64; }
size_t decode_attention_smem(const DecodeAttnParams& p);

// RoPE + KV-cache write + split-K attention over chunks of `chunk` positions, then the log-sum-exp merge.
// merge = false: no merge kernel, for launches at pos < chunk only (one chunk: the chunk kernel writes the output).
void decode_attention(const DecodeAttnParams& p, cudaStream_t stream, bool pdl, bool merge = true);

// The batched form: positions per block (a split; a row no longer than this is one block, no merge), by
// default and at most: a block's work (span x head_dim multiply-adds per query head) the same at every head dim,
// its K and V tiles ~70 KB of shared memory. Smaller spans (64, 128: CudaOptions::batch_attn_span) trade less
// serial work per block for more blocks and a merge.
__host__ __device__ constexpr int attn_rows_span(int head_dim) {
  return head_dim <= 64 ? 256 : head_dim <= 128 ? 128 : 64;
}
// Splits per row the partial buffers are laid out for (the smallest span, 64, whatever the launch's).
__host__ __device__ constexpr int attn_rows_max_splits(int max_seq) { return (max_seq + 63) / 64; }
// A counter per (row, KV head, slice of heads), laid out for the smallest slice (1 head): any launch's fits.
inline int attn_rows_tickets(int n_rows, int n_heads, int /*n_kv_heads*/) { return n_rows * n_heads; }
// n_rows rows, each at its own position through its own page table (the row fields above): RoPE + KV-cache
// write + attention in ONE launch (attention_rows.cu).
void decode_attention_rows(const DecodeAttnParams& p, int n_rows, cudaStream_t stream, bool pdl);
// rope(k) and v of each row (qkv + r * ld_qkv, at row_pos[r], through page_table + row_slot[r] * table_stride; a row
// at a position < 0 is skipped) into the cache, the same bits decode_attention_rows writes: before a launch of it
// with p.appended (the draft pass). A plain launch.
void append_kv_rows(const DecodeAttnParams& p, int n_rows, cudaStream_t stream);
// The span a launch with p uses (p.rows_span or the head dim's default); a Request error for one it cannot take.
int attn_rows_span_of(const DecodeAttnParams& p);
// A Request error for a p.rows_heads the kernel does not take (0: auto, 1, 2, 4, 8).
void check_attn_rows_heads(const DecodeAttnParams& p);
// The checks both share (clear errors for shapes the kernels do not take).
void check_decode_attn(const DecodeAttnParams& p);

}  // namespace ti::cuda
