#include "weights.h"

#include <cstring>

#include "errors.h"

namespace ti {

DType dtype_from_string(const std::string& s) {
  if (s == "fp32") return DType::F32;
  if (s == "fp16") return DType::F16;
  if (s == "bf16") return DType::BF16;
  fail(ErrorKind::Unsupported, "unsupported tensor dtype '" + s + "' (expected fp32, fp16 or bf16)");
}

std::string to_string(DType t) { return t == DType::F32 ? "fp32" : t == DType::F16 ? "fp16" : "bf16"; }

size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }

float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; exp--; }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
  uint32_t man = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));  // inf / nan
  if (exp >= 31) return (uint16_t)(sign | 0x7c00);                                        // overflow
  if (exp <= 0) {                                                                         // subnormal / zero
    if (exp < -10) return (uint16_t)sign;
    man |= 0x800000;
    uint32_t shift = (uint32_t)(14 - exp);
    uint32_t half_man = man >> shift, rem = man & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_man & 1))) half_man++;
    return (uint16_t)(sign | half_man);
  }
  uint32_t h = sign | ((uint32_t)exp << 10) | (man >> 13), rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;  // may carry into the exponent: correct
  return (uint16_t)h;
}

float bf16_to_float(uint16_t b) {
  uint32_t bits = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::string to_string(Held h) {
  switch (h) {
    case Held::F32: return "fp32";
    case Held::F16: return "fp16";
    case Held::BF16: return "bf16";
    case Held::I8: return "int8";
    case Held::I4: return "int4";
  }
  return "?";
}

// fp16 bits -> fp32 for all 65,536 patterns, built once from half_to_float (so exactly its numbers): a row of
// fp16 weights widens at a table lookup per element.
static const float* half_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t h = 0; h < 65536; h++) t[h] = half_to_float((uint16_t)h);
    return t;
  }();
  return table.data();
}

size_t HostTensor::bytes() const {
  return f32.size() * 4 + bits.size() * 2 + blocks.q.size() + blocks.sm.size() * 2;
}

void HostTensor::widen_row(int64_t r, float* out) const {
  const int64_t n = cols();
  switch (held) {
    case Held::F32:
      std::memcpy(out, &f32[(size_t)(r * n)], (size_t)n * 4);
      break;
    case Held::F16: {
      const float* table = half_table();
      const uint16_t* b = &bits[(size_t)(r * n)];
      for (int64_t i = 0; i < n; i++) out[i] = table[b[i]];
      break;
    }
    case Held::BF16: {
      const uint16_t* b = &bits[(size_t)(r * n)];
      for (int64_t i = 0; i < n; i++) {
        const uint32_t u = (uint32_t)b[i] << 16;
        std::memcpy(&out[i], &u, 4);
      }
      break;
    }
    case Held::I8:
    case Held::I4:
      dequantize_row(blocks, r, out);
      break;
  }
}

std::vector<float> HostTensor::widen() const {
  std::vector<float> w((size_t)(rows() * cols()));
  for (int64_t r = 0; r < rows(); r++) widen_row(r, &w[(size_t)(r * cols())]);
  return w;
}

static std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); i++) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

static std::string layer_name(int64_t i, const char* leaf) {
  return "model.layers." + std::to_string(i) + "." + leaf;
}

std::string WeightStore::layer_tensor(int64_t layer, const char* leaf) { return layer_name(layer, leaf); }

// Checks an imported matrix's name and shape (a layer matrix; for int8 also the head or the embedding) and
// keeps it as the tensor of that name.
void WeightStore::add_imported(const std::string& name, QuantMatrix m) {
  if (finished_) fail(ErrorKind::Request, "WeightStore: imported tensor '" + name + "' after finish()");
  const std::vector<int64_t> want = expected_shape(name);
  const bool matrix = want.size() == 2 && name.find(".layers.") != std::string::npos;
  const bool head = name == "model.embed_tokens.weight" || name == "lm_head.weight";
  if (!(matrix || (head && m.format == WFormat::I8)) || want[0] != m.rows || want[1] != m.K)
    fail(ErrorKind::ModelFormat, to_string(m.format) + " tensor '" + name + "' of shape " +
                                     shape_str({m.rows, m.K}) + ": not a matrix of shape " + shape_str(want));
  HostTensor t;
  t.shape = {m.rows, m.K};
  t.held = m.format == WFormat::I8 ? Held::I8 : Held::I4;
  imported_[name] = m.format;
  t.blocks = std::move(m);
  tensors_[name] = std::move(t);
}

void WeightStore::add_int4(const std::string& name, const uint8_t* q, const uint16_t* sm, int64_t rows, int64_t K) {
  if (K % kI4Group != 0) fail(ErrorKind::Unsupported, "int4 tensor '" + name + "': K must be a multiple of 32");
  QuantMatrix m;
  m.format = WFormat::I4;
  m.rows = rows;
  m.K = K;
  m.ld = i4_ld(K);
  m.q.assign(q, q + rows * m.ld);
  m.sm.assign(sm, sm + rows * scale_halves(WFormat::I4, K));
  add_imported(name, std::move(m));
}

void WeightStore::add_int8(const std::string& name, const int8_t* q, const uint16_t* d, int64_t rows, int64_t K) {
  add_imported(name, i8_from_q8_0(q, d, rows, K, name));
}

const QuantMatrix* WeightStore::imported(const std::string& name, WFormat f) const {
  std::string n = name;
  if (!imported_.count(n) && name == "lm_head.weight" && config_.tie_word_embeddings) n = "model.embed_tokens.weight";
  auto it = imported_.find(n);
  return it == imported_.end() || it->second != f ? nullptr : &get(n).blocks;
}

WeightStore::WeightStore(const ModelConfig& config) : config_(config) { config_.validate(); }

std::vector<std::string> WeightStore::required_names() const {
  std::vector<std::string> names = {"model.embed_tokens.weight", "model.norm.weight"};
  if (!config_.tie_word_embeddings) names.push_back("lm_head.weight");
  static const char* leaves[] = {"input_layernorm.weight",         "self_attn.q_proj.weight",
                                 "self_attn.k_proj.weight",        "self_attn.v_proj.weight",
                                 "self_attn.o_proj.weight",        "post_attention_layernorm.weight",
                                 "mlp.gate_proj.weight",           "mlp.up_proj.weight",
                                 "mlp.down_proj.weight"};
  for (int64_t i = 0; i < config_.n_layers; i++)
    for (const char* leaf : leaves) names.push_back(layer_name(i, leaf));
  return names;
}

std::vector<int64_t> WeightStore::expected_shape(const std::string& name) const {
  const ModelConfig& c = config_;
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return {c.vocab, c.hidden};
  if (name == "model.norm.weight") return {c.hidden};
  const std::string prefix = "model.layers.";
  if (name.compare(0, prefix.size(), prefix) != 0) return {};
  size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos) return {};
  std::string idx = name.substr(prefix.size(), dot - prefix.size());
  if (idx.empty() || idx.find_first_not_of("0123456789") != std::string::npos || idx.size() > 6) return {};
  if (std::stoll(idx) >= c.n_layers) return {};
  std::string leaf = name.substr(dot + 1);
  if (leaf == "input_layernorm.weight" || leaf == "post_attention_layernorm.weight") return {c.hidden};
  if (leaf == "self_attn.q_proj.weight") return {c.q_dim, c.hidden};
  if (leaf == "self_attn.k_proj.weight" || leaf == "self_attn.v_proj.weight") return {c.kv_dim, c.hidden};
  if (leaf == "self_attn.o_proj.weight") return {c.hidden, c.q_dim};
  if (leaf == "mlp.gate_proj.weight" || leaf == "mlp.up_proj.weight") return {c.intermediate, c.hidden};
  if (leaf == "mlp.down_proj.weight") return {c.hidden, c.intermediate};
  return {};
}

void WeightStore::add(const std::string& name, DType dtype, const void* data, const std::vector<int64_t>& shape) {
  if (finished_) fail(ErrorKind::Request, "WeightStore.add('" + name + "') after finish()");
  std::vector<int64_t> want = expected_shape(name);
  if (want.empty())
    fail(ErrorKind::Unsupported, "unexpected tensor '" + name + "' (not a weight of a " +
                                     std::to_string(config_.n_layers) + "-layer Llama model without biases)");
  if (shape != want)
    fail(ErrorKind::ModelFormat, "tensor '" + name + "' has shape " + shape_str(shape) + ", expected " +
                                     shape_str(want) + " from the model config");
  if (tensors_.count(name)) fail(ErrorKind::ModelFormat, "tensor '" + name + "' given twice");
  size_t n = 1;
  for (int64_t d : shape) n *= (size_t)d;
  HostTensor t;
  t.shape = shape;
  if (dtype == DType::F32 || shape.size() == 1) {  // vectors (the norms) as fp32: small, read whole
    t.held = Held::F32;
    t.f32.resize(n);
    if (dtype == DType::F32) {
      std::memcpy(t.f32.data(), data, n * 4);
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(data);
      for (size_t i = 0; i < n; i++) t.f32[i] = dtype == DType::F16 ? half_to_float(src[i]) : bf16_to_float(src[i]);
    }
  } else {
    t.held = dtype == DType::F16 ? Held::F16 : Held::BF16;
    const uint16_t* src = static_cast<const uint16_t*>(data);
    t.bits.assign(src, src + n);
  }
  tensors_.emplace(name, std::move(t));
}

void WeightStore::finish() {
  if (config_.tie_word_embeddings) {  // tied: the embedding is the head
    tensors_.erase("lm_head.weight");
    imported_.erase("lm_head.weight");
  }
  for (const std::string& name : required_names())
    if (!tensors_.count(name))
      fail(ErrorKind::ModelFormat, "missing tensor '" + name + "' (expected shape " +
                                       shape_str(expected_shape(name)) + ")");
  finished_ = true;
}

std::vector<std::string> WeightStore::names() const {
  std::vector<std::string> r;
  for (const auto& kv : tensors_) r.push_back(kv.first);
  return r;
}

const HostTensor& WeightStore::get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end() && name == "lm_head.weight" && finished_ && config_.tie_word_embeddings)
    it = tensors_.find("model.embed_tokens.weight");  // tied: the embedding is the head
  if (it == tensors_.end()) fail(ErrorKind::Request, "no tensor '" + name + "' in the store");
  return it->second;
}

const HostTensor& WeightStore::embedding() const { return get("model.embed_tokens.weight"); }
const float* WeightStore::final_norm() const { return get("model.norm.weight").f32.data(); }
const HostTensor& WeightStore::lm_head() const {
  auto it = tensors_.find("lm_head.weight");  // present when untied, or when quantize() untied it
  return it != tensors_.end() ? it->second : embedding();
}

size_t WeightStore::bytes() const {
  size_t b = 0;
  for (const auto& kv : tensors_) b += kv.second.bytes();
  return b;
}

void WeightStore::quantize(WFormat f) {
  if (!finished_) fail(ErrorKind::Request, "quantize: finish() the store first");
  if (f == WFormat::F16) return;
  const ModelConfig& c = config_;
  // Check every width first: a model int4 cannot take is refused before anything changes.
  if (f == WFormat::I4) require_int4_widths(c.hidden, c.q_dim, c.intermediate);
  // Re-encodes one matrix in format g unless it is held so already (imported block for block: exact). The
  // fp32 copy lives for one matrix only.
  auto q = [&](const std::string& name, const HostTensor& src, WFormat g) {
    const Held want = g == WFormat::I8 ? Held::I8 : Held::I4;
    if (src.held == want) return;  // (tied, embedding in the head's format: it stays the head, no copy)
    HostTensor t;
    t.shape = src.shape;
    t.held = want;
    t.blocks = ti::quantize(g, src.widen().data(), src.rows(), src.cols());
    tensors_[name] = std::move(t);
    imported_.erase(name);
  };
  for (int64_t i = 0; i < c.n_layers; i++)
    for (const char* leaf : {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                             "mlp.down_proj.weight"}) {
      const std::string name = layer_name(i, leaf);
      q(name, tensors_.at(name), f);
    }
  q("lm_head.weight", lm_head(), head_format(f));  // tied: the head is quantized (untied), the lookup is not
  format_ = f;
}

LayerWeights WeightStore::layer(int64_t i) const {
  auto m = [&](const char* leaf) { return &get(layer_name(i, leaf)); };
  auto v = [&](const char* leaf) { return get(layer_name(i, leaf)).f32.data(); };
  return LayerWeights{v("input_layernorm.weight"),  m("self_attn.q_proj.weight"),
                      m("self_attn.k_proj.weight"), m("self_attn.v_proj.weight"),
                      m("self_attn.o_proj.weight"), v("post_attention_layernorm.weight"),
                      m("mlp.gate_proj.weight"),    m("mlp.up_proj.weight"),
                      m("mlp.down_proj.weight")};
}

}  // namespace ti
