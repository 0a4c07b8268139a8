// weights.h — WeightStore: named host tensors in, checked fp32 weights out.
//
// The loaders hand tensors over one at a time by their HuggingFace name (GGUF names are mapped to these in
// Python), in the source dtype (fp32, fp16 or bf16). Each one is checked against the shape the config implies,
// converted to fp32 and kept; finish() checks that nothing is missing. The CPU engine reads LayerWeights views;
// the GPU engine will pack/fuse/upload from the same store.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "config.h"
#include "quant.h"

namespace ti {

enum class DType { F32, F16, BF16 };
DType dtype_from_string(const std::string& s);  // "fp32" | "fp16" | "bf16" (the weight formats' spelling)
std::string to_string(DType t);
size_t dtype_size(DType t);

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);  // round to nearest even
float bf16_to_float(uint16_t b);

struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;  // row-major
};

// Views over one layer's weights; every pointer's shape is in its comment. Row-major [out, in].
struct LayerWeights {
  const float* attn_norm;  // (hidden)
  const float* wq;         // (q_dim, hidden)
  const float* wk;         // (kv_dim, hidden)
  const float* wv;         // (kv_dim, hidden)
  const float* wo;         // (hidden, q_dim)
  const float* mlp_norm;   // (hidden)
  const float* w_gate;     // (intermediate, hidden)
  const float* w_up;       // (intermediate, hidden)
  const float* w_down;     // (hidden, intermediate)
};

class WeightStore {
 public:
  explicit WeightStore(const ModelConfig& config);

  // Copies (and converts) one tensor. Throws ti::Error naming the tensor on an unknown name, a duplicate, or
  // a shape that does not match the config.
  void add(const std::string& name, DType dtype, const void* data, const std::vector<int64_t>& shape);
  // Throws naming the first missing tensor. After this the views below are valid.
  void finish();

  const ModelConfig& config() const { return config_; }
  bool finished() const { return finished_; }
  std::vector<std::string> names() const;
  const HostTensor& get(const std::string& name) const;

  const float* embedding() const;  // (vocab, hidden)
  const float* final_norm() const; // (hidden)
  const float* lm_head() const;    // (vocab, hidden); the embedding when tied
  LayerWeights layer(int64_t i) const;

  // The CPU engine's view of a quantized model: every matrix replaced by dequantize(quantize(fp16(w))); the LM
  // head in head_format(f) (int4 models: int8), untied into its own copy when tied (the embedding lookup stays
  // unquantized, as on the GPU).
  void quantize(WFormat f);
  WFormat format() const { return format_; }
  // An already-quantized matrix in our int4 layout (a GGUF Q4_0 / Q4_1 tensor converted block for block: no
  // second rounding). Its fp32 data become exactly the dequantized values; quantize(I4) keeps it as it is and
  // the GPU engine uploads these bytes instead of quantizing. q: (rows, K/2) bytes; sm: (rows, K/32 * 2) fp16 bits.
  void add_int4(const std::string& name, const uint8_t* q, const uint16_t* sm, int64_t rows, int64_t K);
  // The same for a GGUF Q8_0 tensor into I8 (kept by quantize(I8), and as the int8 LM head of quantize(I4)):
  // q (rows, K) signed, d (rows, K/32) fp16 bits. Also the embedding's blocks: they become the head's when tied
  // (the embedding lookup itself keeps its fp32 values, which are the same numbers).
  void add_int8(const std::string& name, const int8_t* q, const uint16_t* d, int64_t rows, int64_t K);
  // The imported matrix under a name, if add_int4 / add_int8 gave one in format f ("lm_head.weight" of a tied
  // model: the embedding's); else nullptr.
  const QuantMatrix* imported(const std::string& name, WFormat f) const;
  static std::string layer_tensor(int64_t layer, const char* leaf);  // "model.layers.{layer}.{leaf}"

  // The shape the config implies for a tensor name, or an empty vector if the name is not one of ours.
  std::vector<int64_t> expected_shape(const std::string& name) const;
  std::vector<std::string> required_names() const;

 private:
  void add_imported(const std::string& name, QuantMatrix m);

  ModelConfig config_;
  std::unordered_map<std::string, HostTensor> tensors_;
  std::unordered_map<std::string, QuantMatrix> imported_;
  bool finished_ = false;
  WFormat format_ = WFormat::F16;
};

}  // namespace ti
