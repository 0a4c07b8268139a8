// device_weights.cu — see device_weights.h.
#include "device_weights.h"

#include <algorithm>
#include <cmath>

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
