// kv_cache.h — the KV cache of one sequence, grown a page at a time.
// A page holds kCpuKvPageSize positions in the layout [layer][kv_head][pos][head_dim] (cuda/kv_layout.cuh with one
// sequence): within a page one head's keys are contiguous, so attention streams them. Pages are allocated as
// the sequence grows (reserve) rather than max_seq_len up front, so many sequences (the engine's slots) cost
// only the positions they hold. The CPU engine keeps fp32; the GPU cache is fp16 in the same order.
#pragma once
#include <cstdint>
#include <vector>

namespace ti {

constexpr int64_t kCpuKvPageSize = 64;  // positions per page (the GPU engine's default page size too)

struct KVCache {
  int64_t n_layers = 0, n_kv_heads = 0, head_dim = 0;
  std::vector<std::vector<float>> k_pages, v_pages;  // each (n_layers, n_kv_heads, kCpuKvPageSize, head_dim)

  KVCache() = default;
  KVCache(int64_t layers, int64_t kv_heads, int64_t hd) : n_layers(layers), n_kv_heads(kv_heads), head_dim(hd) {}

  static int64_t pages_for(int64_t positions) { return (positions + kCpuKvPageSize - 1) / kCpuKvPageSize; }
  int64_t pages() const { return (int64_t)k_pages.size(); }
  int64_t capacity() const { return pages() * kCpuKvPageSize; }

  // Covers positions [0, positions) with pages; returns how many pages it added.
  int64_t reserve(int64_t positions) {
    const int64_t before = pages(), need = pages_for(positions);
    const size_t page_floats = (size_t)(n_layers * n_kv_heads * kCpuKvPageSize * head_dim);
    for (int64_t p = before; p < need; p++) {
      k_pages.emplace_back(page_floats);
      v_pages.emplace_back(page_floats);
    }
    return need > before ? need - before : 0;
  }

  float* key(int64_t layer, int64_t head, int64_t pos) { return &k_pages[page(pos)][in_page(layer, head, pos)]; }
  float* value(int64_t layer, int64_t head, int64_t pos) { return &v_pages[page(pos)][in_page(layer, head, pos)]; }
  size_t bytes() const { return (size_t)pages() * 2 * n_layers * n_kv_heads * kCpuKvPageSize * head_dim * sizeof(float); }

 private:
  static size_t page(int64_t pos) { return (size_t)(pos / kCpuKvPageSize); }
  size_t in_page(int64_t layer, int64_t head, int64_t pos) const {
    return (size_t)(((layer * n_kv_heads + head) * kCpuKvPageSize + pos % kCpuKvPageSize) * head_dim);
  }
};

}  // namespace ti
