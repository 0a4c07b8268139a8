// rope.h — rotary position embedding tables, with the scalings the engine honours (none, linear, llama3).
// Matches transformers' LlamaRotaryEmbedding: inv_freq[i] = theta^(-2i/d) (then scaled), angle = pos * inv_freq,
// applied "rotate_half" style: pairs (i, i + d/2). Shared by the CPU engine and (uploaded) by the GPU engine.
#pragma once
#include <cstdint>
#include <vector>

#include "config.h"

namespace ti {

// (head_dim / 2) inverse frequencies after scaling.
std::vector<float> rope_inv_freq(const ModelConfig& c);

// cos/sin tables, each (max_pos, head_dim / 2).
struct RopeTable {
  int64_t half = 0;
  std::vector<float> cos, sin;
};
RopeTable rope_table(const ModelConfig& c, int64_t max_pos);

// x: (n_heads, head_dim) for one token at table row `pos`, rotated in place.
void rope_apply(float* x, int64_t n_heads, int64_t head_dim, const RopeTable& t, int64_t pos);

}  // namespace ti
