// config.h — ModelConfig: the shape of a Llama-family model, one plain struct.
// Filled by the Python loaders (from config.json or GGUF metadata), checked once by validate(), which also
// computes the derived fields. Nothing here is guessed from names or tensor shapes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ti {

enum class RopeScaling { None, Linear, Llama3 };

struct ModelConfig {
  // ---- from the model's config ----
  int64_t hidden = 0;              // d_model
  int64_t intermediate = 0;        // MLP width
  int64_t n_layers = 0;
  int64_t n_heads = 0;             // query heads
  int64_t n_kv_heads = 0;          // key/value heads (GQA when < n_heads)
  int64_t head_dim = 0;            // 64..256, multiple of 8; not assumed hidden / n_heads
  int64_t vocab = 0;
  double rms_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling = RopeScaling::None;
  double rope_factor = 1.0;              // linear and llama3
  double rope_low_freq_factor = 1.0;     // llama3
  double rope_high_freq_factor = 4.0;    // llama3
  int64_t rope_original_max_pos = 8192;  // llama3: original_max_position_embeddings
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 2048;
  int64_t bos_token_id = -1;             // -1: none
  std::vector<int64_t> eos_token_ids;    // any of these ends generation

  // ---- derived by validate() ----
  int64_t q_dim = 0;    // n_heads * head_dim
  int64_t kv_dim = 0;   // n_kv_heads * head_dim
  int64_t group = 0;    // n_heads / n_kv_heads: query heads per KV head

  // Checks every field (naming the bad one in a ti::Error) and computes the derived fields.
  void validate();
  std::string to_string() const;
};

const char* rope_scaling_name(RopeScaling s);

}  // namespace ti
