// kv_cache.h — the KV cache of one sequence.
// Layout [layer][kv_head][pos][head_dim] (DESIGN.md §3 with one sequence): one head's keys are contiguous, so
// attention streams them. The CPU engine keeps fp32; the GPU cache will be fp16 in the same order.
#pragma once
#include <cstdint>
#include <vector>

namespace ti {

struct KVCache {
  int64_t n_layers = 0, n_kv_heads = 0, max_seq = 0, head_dim = 0;
  std::vector<float> k, v;

  KVCache() = default;
  KVCache(int64_t layers, int64_t kv_heads, int64_t max_seq_len, int64_t hd)
      : n_layers(layers), n_kv_heads(kv_heads), max_seq(max_seq_len), head_dim(hd),
        k((size_t)(layers * kv_heads * max_seq_len * hd)), v(k.size()) {}

  size_t offset(int64_t layer, int64_t head, int64_t pos) const {
    return (size_t)(((layer * n_kv_heads + head) * max_seq + pos) * head_dim);
  }
  float* key(int64_t layer, int64_t head, int64_t pos) { return &k[offset(layer, head, pos)]; }
  float* value(int64_t layer, int64_t head, int64_t pos) { return &v[offset(layer, head, pos)]; }
  size_t bytes() const { return (k.size() + v.size()) * sizeof(float); }
};

}  // namespace ti
