// device_weights.cu — see device_weights.h.
#include "device_weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../../cuda/common.cuh"
#include "../../cuda/embedding.cuh"
#include "../core/errors.h"

namespace ti {

void* DeviceArena::alloc(size_t bytes, Kind kind) {
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 16));
  if (err != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    fail(ErrorKind::Device, "out of GPU memory: allocating " + std::to_string(bytes >> 20) + " MiB with " +
                                std::to_string(free_b >> 20) + " MiB free of " + std::to_string(total_b >> 20) +
                                " MiB (weights " + std::to_string(weight_bytes_ >> 20) + " MiB, KV cache " +
                                std::to_string(kv_bytes_ >> 20) + " MiB so far; try a smaller max_seq_len)");
  }
  blocks_.push_back(p);
  count(kind, bytes);
  return p;
}

void DeviceArena::count(Kind kind, size_t bytes) {
  (kind == Kind::Weights ? weight_bytes_ : kind == Kind::KvCache ? kv_bytes_ : scratch_bytes_) += bytes;
}

void* DeviceArena::alloc_pinned(size_t bytes) {
  void* p = nullptr;
  TI_CUDA_CHECK(cudaMallocHost(&p, bytes));
  pinned_.push_back(p);
  return p;
}

void DeviceArena::release() {
  for (void* p : blocks_) cudaFree(p);
  for (void* p : pinned_) cudaFreeHost(p);
  blocks_.clear();
  pinned_.clear();
}

DeviceWeights::DeviceWeights(const ModelConfig& c, WFormat fmt, DeviceArena& arena, cudaStream_t stream)
    : format(fmt), cfg_(c), arena_(arena), stream_(stream) {
  using Kind = DeviceArena::Kind;
  ld_h = (int)cuda::pad8(c.hidden);
  ld_q = (int)cuda::pad8(c.q_dim);
  ld_i = (int)cuda::pad8(c.intermediate);
  if (format == WFormat::I4) require_int4_widths(c.hidden, c.q_dim, c.intermediate);  // before any allocation
  layers.resize((size_t)c.n_layers);
  for (DeviceLayer& L : layers) {
    L.qkv = alloc_matrix((int)(c.q_dim + 2 * c.kv_dim), (int)c.hidden, format);
    L.o = alloc_matrix((int)c.hidden, (int)c.q_dim, format);
    L.gate_up = alloc_matrix((int)(2 * c.intermediate), (int)c.hidden, format);
    L.down = alloc_matrix((int)c.hidden, (int)c.intermediate, format);
    L.attn_norm = arena_.alloc_n<float>((size_t)c.hidden, Kind::Weights);
    L.mlp_norm = arena_.alloc_n<float>((size_t)c.hidden, Kind::Weights);
  }
  embedding = arena_.alloc_n<__half>((size_t)c.vocab * ld_h, Kind::Weights);
  if (c.tie_word_embeddings && format == WFormat::F16) {
    lm_head = cuda::QMat{WFormat::F16, embedding, nullptr, (int)c.vocab, (int)c.hidden, ld_h};
  } else {
    lm_head = alloc_matrix((int)c.vocab, (int)c.hidden, head_format(format));
  }
  final_norm = arena_.alloc_n<float>((size_t)c.hidden, Kind::Weights);
  if (format != WFormat::F16) {  // staging: the largest matrix as fp16 rows
    const size_t elems = (size_t)std::max<int64_t>({(c.q_dim + 2 * c.kv_dim) * ld_h, c.hidden * ld_q,
                                                    2 * c.intermediate * ld_h, c.hidden * ld_i, c.vocab * ld_h});
    staging_ = arena_.alloc_n<__half>(elems, Kind::Scratch);
  }
}

// One (rows, K) matrix in a format; its bytes count as weights.
cuda::QMat DeviceWeights::alloc_matrix(int rows, int K, WFormat fmt) {
  using Kind = DeviceArena::Kind;
  cuda::QMat m;
  m.fmt = fmt;
  m.rows = rows;
  m.K = K;
  if (m.fmt == WFormat::F16) {
    m.ld = (int)cuda::pad8(K);
    m.q = arena_.alloc((size_t)rows * m.ld * sizeof(__half), Kind::Weights);
  } else {
    m.ld = (int)quant_ld(m.fmt, K);
    m.q = arena_.alloc((size_t)rows * m.ld, Kind::Weights);
    m.scales = arena_.alloc((size_t)(rows * scale_halves(m.fmt, K)) * 2, Kind::Weights);
  }
  return m;
}

// Host fp16 rows (stride pad8(K)) into the matrix: uploaded as they are, or staged and quantized on the GPU.
void DeviceWeights::store_matrix(const cuda::QMat& m, const std::vector<uint16_t>& host) {
  __half* dst = m.fmt == WFormat::F16 ? static_cast<__half*>(const_cast<void*>(m.q)) : staging_;
  TI_CUDA_CHECK(cudaMemcpyAsync(dst, host.data(), host.size() * 2, cudaMemcpyHostToDevice, stream_));
  if (m.fmt != WFormat::F16) cuda::quantize_matrix(staging_, (int)cuda::pad8(m.K), m, stream_);
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // `host` may be reused or freed after this
}

// After store_matrix: the rows of parts the store holds already in the matrix's format (GGUF Q4_0 / Q4_1 as
// int4, Q8_0 as int8, converted block for block) are replaced by those exact bytes, row i of part p sitting at
// row_of(p, i) of the fused matrix. Rows are independent, so a fused matrix may mix imported and quantized parts
// (q | k | v of different types).
void DeviceWeights::overlay_imported(const cuda::QMat& m, const WeightStore& w, const std::vector<std::string>& parts,
                                  const std::function<int64_t(size_t, int64_t)>& row_of) {
  if (m.fmt == WFormat::F16) return;
  bool any = false;
  for (const std::string& name : parts) any = any || w.imported(name, m.fmt) != nullptr;
  if (!any) return;
  const int64_t halves = scale_halves(m.fmt, m.K);
  std::vector<uint8_t> q((size_t)m.rows * m.ld);
  std::vector<uint16_t> sm((size_t)(m.rows * halves));
  TI_CUDA_CHECK(cudaMemcpy(q.data(), m.q, q.size(), cudaMemcpyDeviceToHost));
  TI_CUDA_CHECK(cudaMemcpy(sm.data(), m.scales, sm.size() * 2, cudaMemcpyDeviceToHost));
  for (size_t p = 0; p < parts.size(); p++) {
    const QuantMatrix* src = w.imported(parts[p], m.fmt);
    if (!src) continue;
    if (src->K != m.K || src->ld != m.ld)
      fail(ErrorKind::ModelFormat, to_string(m.fmt) + " tensor '" + parts[p] + "': bad width");
    for (int64_t i = 0; i < src->rows; i++) {
      const int64_t r = row_of(p, i);
      std::memcpy(&q[(size_t)(r * m.ld)], &src->q[(size_t)(i * src->ld)], (size_t)src->ld);
      std::memcpy(&sm[(size_t)(r * halves)], &src->sm[(size_t)(i * halves)], (size_t)halves * 2);
    }
  }
  TI_CUDA_CHECK(cudaMemcpy(const_cast<void*>(m.q), q.data(), q.size(), cudaMemcpyHostToDevice));
  TI_CUDA_CHECK(cudaMemcpy(const_cast<void*>(m.scales), sm.data(), sm.size() * 2, cudaMemcpyHostToDevice));
}

void DeviceWeights::random_matrix(const cuda::QMat& m, uint64_t seed, float scale) {
  const int ldh = (int)cuda::pad8(m.K);
  __half* dst = m.fmt == WFormat::F16 ? static_cast<__half*>(const_cast<void*>(m.q)) : staging_;
  cuda::fill_random_f16(dst, (size_t)m.rows * ldh, seed, scale, stream_);
  if (m.fmt != WFormat::F16) cuda::quantize_matrix(staging_, ldh, m, stream_);
}

const __half* DeviceWeights::fp16_of(const cuda::QMat& m) {
  if (m.fmt == WFormat::F16) return static_cast<const __half*>(m.q);
  cuda::dequantize_matrix(m, staging_, (int)cuda::pad8(m.K), stream_);
  return staging_;
}

// Host fp32 (rows, K) -> fp16 rows of `host` (row-major, stride ld, zero padded); source row i lands at row
// row_of(i). The caller sizes `host` for all destination rows.
template <typename RowOf>
static void pack_rows(std::vector<uint16_t>& host, const float* src, int64_t rows, int64_t K, int64_t ld,
                      RowOf row_of) {
  for (int64_t i = 0; i < rows; i++) {
    const size_t at = (size_t)(row_of(i) * ld);
    if (at + (size_t)ld > host.size()) fail(ErrorKind::Request, "pack_rows: destination row out of range");
    uint16_t* out = &host[at];
    for (int64_t k = 0; k < K; k++) out[k] = float_to_half(src[i * K + k]);
  }
}

void DeviceWeights::upload(const WeightStore& w) {
  const ModelConfig& c = cfg_;
  auto same = [](int64_t i) { return i; };
  std::vector<uint16_t> host;
  auto fresh = [&](int64_t rows, int64_t ld) { host.assign((size_t)(rows * ld), 0); };
  for (int64_t l = 0; l < c.n_layers; l++) {
    const LayerWeights L = w.layer(l);
    DeviceLayer& D = layers[(size_t)l];
    auto name = [&](const char* leaf) { return WeightStore::layer_tensor(l, leaf); };
    fresh(c.q_dim + 2 * c.kv_dim, ld_h);  // q | k | v
    pack_rows(host, L.wq->widen().data(), c.q_dim, c.hidden, ld_h, same);
    pack_rows(host, L.wk->widen().data(), c.kv_dim, c.hidden, ld_h, [&](int64_t i) { return c.q_dim + i; });
    pack_rows(host, L.wv->widen().data(), c.kv_dim, c.hidden, ld_h, [&](int64_t i) { return c.q_dim + c.kv_dim + i; });
    store_matrix(D.qkv, host);
    overlay_imported(D.qkv, w, {name("self_attn.q_proj.weight"), name("self_attn.k_proj.weight"),
                                name("self_attn.v_proj.weight")},
                     [&](size_t p, int64_t i) { return p == 0 ? i : p == 1 ? c.q_dim + i : c.q_dim + c.kv_dim + i; });
    fresh(c.hidden, ld_q);
    pack_rows(host, L.wo->widen().data(), c.hidden, c.q_dim, ld_q, same);
    store_matrix(D.o, host);
    overlay_imported(D.o, w, {name("self_attn.o_proj.weight")}, [](size_t, int64_t i) { return i; });
    fresh(2 * c.intermediate, ld_h);  // gate_0, up_0, gate_1, up_1, ...
    pack_rows(host, L.w_gate->widen().data(), c.intermediate, c.hidden, ld_h, [](int64_t i) { return 2 * i; });
    pack_rows(host, L.w_up->widen().data(), c.intermediate, c.hidden, ld_h, [](int64_t i) { return 2 * i + 1; });
    store_matrix(D.gate_up, host);
    overlay_imported(D.gate_up, w, {name("mlp.gate_proj.weight"), name("mlp.up_proj.weight")},
                     [](size_t p, int64_t i) { return 2 * i + (int64_t)p; });
    fresh(c.hidden, ld_i);
    pack_rows(host, L.w_down->widen().data(), c.hidden, c.intermediate, ld_i, same);
    store_matrix(D.down, host);
    overlay_imported(D.down, w, {name("mlp.down_proj.weight")}, [](size_t, int64_t i) { return i; });
    TI_CUDA_CHECK(cudaMemcpy(D.attn_norm, L.attn_norm, c.hidden * sizeof(float), cudaMemcpyHostToDevice));
    TI_CUDA_CHECK(cudaMemcpy(D.mlp_norm, L.mlp_norm, c.hidden * sizeof(float), cudaMemcpyHostToDevice));
  }
  fresh(c.vocab, ld_h);
  pack_rows(host, w.embedding().widen().data(), c.vocab, c.hidden, ld_h, same);
  TI_CUDA_CHECK(cudaMemcpy(embedding, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  if (lm_head.q != embedding) {  // untied, or tied but quantized: the head's own copy
    fresh(c.vocab, ld_h);
    pack_rows(host, w.lm_head().widen().data(), c.vocab, c.hidden, ld_h, same);
    store_matrix(lm_head, host);
    overlay_imported(lm_head, w, {"lm_head.weight"}, [](size_t, int64_t i) { return i; });
  }
  TI_CUDA_CHECK(cudaMemcpy(final_norm, w.final_norm(), c.hidden * sizeof(float), cudaMemcpyHostToDevice));
}

void DeviceWeights::randomize(uint64_t seed) {
  const ModelConfig& c = cfg_;
  uint64_t s = seed;
  auto fill = [&](const cuda::QMat& m) {
    random_matrix(m, ++s * 0x9e3779b97f4a7c15ull, 1.0f / std::sqrt((float)m.K));
  };
  for (DeviceLayer& L : layers) {
    fill(L.qkv);
    fill(L.o);
    fill(L.gate_up);
    fill(L.down);
    cuda::fill_f32(L.attn_norm, c.hidden, 1.0f, stream_);
    cuda::fill_f32(L.mlp_norm, c.hidden, 1.0f, stream_);
  }
  cuda::fill_random_f16(embedding, (size_t)c.vocab * ld_h, ++s * 0x9e3779b97f4a7c15ull, 1.0f, stream_);
  if (lm_head.q != embedding) fill(lm_head);
  cuda::fill_f32(final_norm, c.hidden, 1.0f, stream_);
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  // (fp16: the padding columns hold random values too; the inputs' padding is zero, so they add nothing)
}

}  // namespace ti
