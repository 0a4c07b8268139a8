// kv_cache.h — the KV cache of one sequence, grown a page at a time.
// A page holds kCpuKvPageSize positions in the layout [layer][kv_head][pos][head_dim] (cuda/kv_layout.cuh with one
// sequence): within a page one head's keys are contiguous, so attention streams them. Pages are allocated as
// the sequence grows (reserve) rather than max_seq_len up front, so many sequences (the engine's slots) cost
// only the positions they hold. The CPU engine keeps fp32; the GPU cache is fp16 in the same order.
// Pages are shared pointers: a slot given another's prefix (seq_copy) holds the same pages as it, as the GPU's
// page tables do (cpp/gpu/kv_pages.h); a page shared is never written (cpu_sequences.cpp makes one its own first).
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace ti {

constexpr int64_t kCpuKvPageSize = 64;  // positions per page (the GPU engine's default page size too)

struct KVCache {
  int64_t n_layers = 0, n_kv_heads = 0, head_dim = 0;
  using Page = std::shared_ptr<std::vector<float>>;  // (n_layers, n_kv_heads, kCpuKvPageSize, head_dim)
  std::vector<Page> k_pages, v_pages;               // entry j of both: the same holders (one page pair)

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
      k_pages.push_back(std::make_shared<std::vector<float>>(page_floats));
      v_pages.push_back(std::make_shared<std::vector<float>>(page_floats));
    }
    return need > before ? need - before : 0;
  }
  bool shared(int64_t j) const { return k_pages[(size_t)j].use_count() > 1; }  // another cache holds entry j too
  // Of the entries from `from` on, those no other cache holds (what dropping them frees).
  int64_t owned(int64_t from = 0) const {
    int64_t n = 0;
    for (int64_t j = std::max<int64_t>(from, 0); j < pages(); j++) n += !shared(j);
    return n;
  }
  // Entry j made this cache's own (a copy of its keys and values) where another holds it too; returns whether
  // it copied.
  bool unshare(int64_t j) {
    if (!shared(j)) return false;
    k_pages[(size_t)j] = std::make_shared<std::vector<float>>(*k_pages[(size_t)j]);
    v_pages[(size_t)j] = std::make_shared<std::vector<float>>(*v_pages[(size_t)j]);
    return true;
  }

  float* key(int64_t layer, int64_t head, int64_t pos) { return &(*k_pages[page(pos)])[in_page(layer, head, pos)]; }
  float* value(int64_t layer, int64_t head, int64_t pos) { return &(*v_pages[page(pos)])[in_page(layer, head, pos)]; }
  size_t bytes() const { return (size_t)pages() * 2 * n_layers * n_kv_heads * kCpuKvPageSize * head_dim * sizeof(float); }

 private:
  static size_t page(int64_t pos) { return (size_t)(pos / kCpuKvPageSize); }
  size_t in_page(int64_t layer, int64_t head, int64_t pos) const {
    return (size_t)(((layer * n_kv_heads + head) * kCpuKvPageSize + pos % kCpuKvPageSize) * head_dim);
  }
};

}  // namespace ti
