#include "config.h"

#include <cmath>
#include <sstream>

#include "errors.h"

namespace ti {

const char* rope_scaling_name(RopeScaling s) {
  switch (s) {
    case RopeScaling::None: return "none";
    case RopeScaling::Linear: return "linear";
    case RopeScaling::Llama3: return "llama3";
  }
  return "?";
}

static void require(bool ok, const std::string& field, const std::string& why) {
  if (!ok) fail(ErrorKind::ModelFormat, "invalid model config: " + field + " " + why);
}

void ModelConfig::validate() {
  require(hidden > 0, "hidden_size", "must be > 0 (got " + std::to_string(hidden) + ")");
  require(intermediate > 0, "intermediate_size", "must be > 0 (got " + std::to_string(intermediate) + ")");
  require(n_layers > 0, "num_hidden_layers", "must be > 0 (got " + std::to_string(n_layers) + ")");
  require(n_heads > 0, "num_attention_heads", "must be > 0 (got " + std::to_string(n_heads) + ")");
  require(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "num_key_value_heads",
          "must be > 0 and divide num_attention_heads=" + std::to_string(n_heads) + " (got " +
              std::to_string(n_kv_heads) + ")");
  if (head_dim < 64 || head_dim > 256 || head_dim % 8 != 0)
    fail(ErrorKind::Unsupported, "unsupported model config: head_dim=" + std::to_string(head_dim) +
                                     " (the engine runs head dims 64..256 that are multiples of 8)");
  require(vocab > 0, "vocab_size", "must be > 0 (got " + std::to_string(vocab) + ")");
  // (isfinite: an infinite epsilon loads and gives all-zero logits; NaN fails every comparison anyway)
  require(std::isfinite(rms_eps) && rms_eps > 0, "rms_norm_eps", "must be a finite number > 0");
  require(std::isfinite(rope_theta) && rope_theta > 0, "rope_theta", "must be a finite number > 0");
  require(max_position_embeddings > 0, "max_position_embeddings", "must be > 0");
  if (rope_scaling != RopeScaling::None)
    require(std::isfinite(rope_factor) && rope_factor > 0, "rope_scaling.factor", "must be a finite number > 0");
  if (rope_scaling == RopeScaling::Llama3) {
    require(std::isfinite(rope_low_freq_factor) && std::isfinite(rope_high_freq_factor),
            "rope_scaling.low_freq_factor / high_freq_factor", "must be finite numbers");
    require(rope_high_freq_factor > rope_low_freq_factor, "rope_scaling.high_freq_factor",
            "must be > low_freq_factor");
    require(rope_original_max_pos > 0, "rope_scaling.original_max_position_embeddings", "must be > 0");
  }
  for (int64_t id : eos_token_ids)
    require(id >= 0 && id < vocab, "eos_token_id", "out of range: " + std::to_string(id));
  q_dim = n_heads * head_dim;
  kv_dim = n_kv_heads * head_dim;
  group = n_heads / n_kv_heads;
}

std::string ModelConfig::to_string() const {
  std::ostringstream s;
  s << "ModelConfig(hidden=" << hidden << ", intermediate=" << intermediate << ", n_layers=" << n_layers
    << ", n_heads=" << n_heads << ", n_kv_heads=" << n_kv_heads << ", head_dim=" << head_dim
    << ", vocab=" << vocab << ", rms_eps=" << rms_eps << ", rope_theta=" << rope_theta
    << ", rope_scaling=" << rope_scaling_name(rope_scaling);
  if (rope_scaling != RopeScaling::None) s << "(factor=" << rope_factor << ")";
  s << ", tie_word_embeddings=" << (tie_word_embeddings ? "True" : "False")
    << ", max_position_embeddings=" << max_position_embeddings << ")";
  return s.str();
}

}  // namespace ti
