// kv_layout.cuh — where a cached key or value lives in the paged KV cache: the one address formula that the
// decode attention, the prefill attention and both cache writes share (the host side, which pages a sequence
// owns, is cpp/gpu/kv_pages.h).
//
// Layout. One pool per engine for keys and one for values, each [layer][page][kv_head][page_size][head_dim]
// fp16; a sequence owns a page table of int32 page ids, entry j holding positions j * page_size ..
// (j + 1) * page_size - 1 of every layer and KV head. Position t of KV head h in layer l:
//   pool + l * layer_stride + ((page_table[t >> page_shift] * n_kv_heads + h) * page_size + (t & (page_size - 1))) * head_dim
// Why this shape:
//   - One head's page_size rows are contiguous: a split-K block (one KV head, one chunk of <= page_size positions)
//     reads at most two runs of whole 16-byte words, as it read one run of the contiguous cache before; a prefill
//     tile of BC <= 64 rows (BC and page_size powers of two) reads one run.
//   - page_size a power of two: the address is a shift, a mask and one table load, which the decode kernel does
//     once per block before its PDL wait (the table is final before a decode chunk launches, like `pos`).
//   - One table for all layers (the layer is outermost in the pool, a plain pointer offset): the host assigns a
//     page once per page_size positions of a sequence, not once per layer; a later batched step passes one table
//     pointer per sequence.
//   - Page granularity of (all KV heads x page_size positions) keeps the table short (max_seq / page_size ints)
//     and a page large enough (64 positions x 4 heads x 64 dims x 2 bytes = 32 KiB per layer for TinyLlama) that
//     on-demand allocation is rare host work.
#pragma once
#include <cstddef>

namespace ti::cuda {

// Element offset, within one layer's pool, of row 0 of KV head `kvh` in page `page`.
__host__ __device__ __forceinline__ size_t kv_page_base(int page, int kvh, int n_kv_heads, int page_shift, int hd) {
  return (((size_t)page * n_kv_heads + kvh) << page_shift) * hd;
}

// Element offset, within one layer's pool, of position t of KV head `kvh` (t's page assigned in `table`).
__host__ __device__ __forceinline__ size_t kv_row(const int* table, int t, int kvh, int n_kv_heads, int page_shift,
                                                  int hd) {
  return kv_page_base(table[t >> page_shift], kvh, n_kv_heads, page_shift, hd) +
         (size_t)(t & ((1 << page_shift) - 1)) * hd;
}

}  // namespace ti::cuda
