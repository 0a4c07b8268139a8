// weights.h — WeightStore: named host tensors in, checked weights out, kept in their stored precision.
//
// The loaders hand tensors over one at a time by their HuggingFace name (GGUF names are mapped to these in
// Python), in the source dtype (fp32, fp16 or bf16), or as int8 / int4 blocks (GGUF Q8_0 / Q4_0 / Q4_1). Each
// one is checked against the shape the config implies and kept as it came: a 98 MB GGUF stays near 98 MB in
// memory. Readers widen a row at a time to fp32 (HostTensor::widen_row), which gives exactly the numbers a
// whole-tensor fp32 conversion would (bf16 -> fp32 is exact; blocks go through the reference dequantizer).
// Vectors (the norms) are kept as fp32. finish() checks that nothing is missing. The CPU engine reads
// LayerWeights views (the GPU engine streams its weights from the file: weight_stream.h).
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

// How a tensor is held: its source element type, or our int8 / int4 blocks (cpp/core/quant.h).
enum class Held { F32, F16, BF16, I8, I4 };
std::string to_string(Held h);

// One tensor, row-major, in exactly one of the representations below (the one `held` names).
struct HostTensor {
  std::vector<int64_t> shape;
  Held held = Held::F32;
  std::vector<float> f32;      // F32
  std::vector<uint16_t> bits;  // F16 / BF16
  QuantMatrix blocks;          // I8 / I4

  int64_t rows() const { return shape[0]; }
  int64_t cols() const { return shape.size() > 1 ? shape[1] : 1; }
  size_t bytes() const;  // memory held
  // Row r as fp32 into out[0..cols): the numbers the engines compute with.
  void widen_row(int64_t r, float* out) const;
  std::vector<float> widen() const;  // the whole tensor as fp32 (rows, cols)
};

// Views over one layer's weights; every tensor's shape is in its comment. Row-major [out, in].
struct LayerWeights {
  const float* attn_norm;     // (hidden)
  const HostTensor* wq;       // (q_dim, hidden)
  const HostTensor* wk;       // (kv_dim, hidden)
  const HostTensor* wv;       // (kv_dim, hidden)
  const HostTensor* wo;       // (hidden, q_dim)
  const float* mlp_norm;      // (hidden)
  const HostTensor* w_gate;   // (intermediate, hidden)
  const HostTensor* w_up;     // (intermediate, hidden)
  const HostTensor* w_down;   // (hidden, intermediate)
};

class WeightStore {
 public:
  explicit WeightStore(const ModelConfig& config);

  // Copies one tensor as it is (vectors as fp32). Throws ti::Error naming the tensor on an unknown name, a duplicate, or
  // a shape that does not match the config.
  void add(const std::string& name, DType dtype, const void* data, const std::vector<int64_t>& shape);
  // Throws naming the first missing tensor. After this the views below are valid.
  void finish();

  const ModelConfig& config() const { return config_; }
  bool finished() const { return finished_; }
  std::vector<std::string> names() const;
  const HostTensor& get(const std::string& name) const;  // "lm_head.weight" of a tied model: the embedding

  const HostTensor& embedding() const;  // (vocab, hidden)
  const float* final_norm() const;      // (hidden)
  const HostTensor& lm_head() const;    // (vocab, hidden); the embedding when tied
  LayerWeights layer(int64_t i) const;
  size_t bytes() const;  // memory held by all tensors

  // The CPU engine's quantized model: every matrix re-encoded as quantize(f, fp16(w)) (the blocks, not their
  // dequantized copy; one matrix widened at a time); the LM head in head_format(f) (int4 models: int8), untied
  // into its own copy when tied (the embedding lookup stays unquantized, as on the GPU). Matrices already in
  // that format (imported) are kept as they are; so is a tied embedding already in the head's format (it stays
  // both lookup and head: the same numbers, no copy).
  void quantize(WFormat f);
  WFormat format() const { return format_; }
  // An already-quantized matrix in our int4 layout (a GGUF Q4_0 / Q4_1 tensor converted block for block: no
  // second rounding). It replaces the tensor of that name (or stands for it: add() of the name afterwards is
  // refused as a duplicate), so its numbers are exactly the dequantized values; quantize(I4) keeps it as it is
  // and the GPU engine uploads these bytes instead of quantizing. q: (rows, K/2) bytes; sm: (rows, K/32 * 2)
  // fp16 bits.
  void add_int4(const std::string& name, const uint8_t* q, const uint16_t* sm, int64_t rows, int64_t K);
  // The same for a GGUF Q8_0 tensor into I8 (kept by quantize(I8), and as the int8 LM head of quantize(I4)):
  // q (rows, K) signed, d (rows, K/32) fp16 bits. Also the embedding's blocks: they become the head's when tied
  // (the embedding lookup widens its rows: the same numbers).
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
  std::unordered_map<std::string, WFormat> imported_;  // names given by add_int4 / add_int8
  bool finished_ = false;
  WFormat format_ = WFormat::F16;
};

}  // namespace ti
