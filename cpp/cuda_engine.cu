#include "cuda_engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "../cuda/attention.cuh"
#include "../cuda/common.cuh"
#include "../cuda/embedding.cuh"
#include "../cuda/prefill_attention.cuh"
#include "engine_checks.h"
#include "errors.h"
#include "rope.h"

namespace ti {

using cuda::GemvIn;
using cuda::GemvOut;

// ---- setup ----

void CudaEngine::init_device() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    fail(ErrorKind::Device, std::string("no usable CUDA device: ") +
                                (err != cudaSuccess ? cudaGetErrorString(err) : "no device found"));
  }
  cudaDeviceProp prop{};
  TI_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major < 7 || (prop.major == 7 && prop.minor < 5))
    fail(ErrorKind::Device, std::string(prop.name) + " (sm_" + std::to_string(prop.major * 10 + prop.minor) +
                                ") is older than the supported sm_75");
  device_name_ = prop.name;
  pdl_ = opt_.pdl && prop.major >= 9;
  if (max_seq_ < 1) fail(ErrorKind::Request, "max_seq_len must be >= 1");
  if (opt_.attn_chunk == 0) opt_.attn_chunk = cuda::attn_chunk_for((int)cfg_.head_dim);
  if (opt_.attn_chunk < 8 || opt_.attn_chunk > 128) fail(ErrorKind::Request, "attn_chunk must be 8..128");
  const int P = opt_.kv_page_size;
  if (P < 64 || P > (1 << 20) || (P & (P - 1)))
    fail(ErrorKind::Request, "kv_page_size must be a power of two in 64..2^20, got " + std::to_string(P));
  if (P < opt_.attn_chunk)
    fail(ErrorKind::Request, "kv_page_size " + std::to_string(P) + " must be >= attn_chunk " +
                                 std::to_string(opt_.attn_chunk) + " (a split-K block reads at most two pages)");
  if (opt_.kv_pool_pages < 0)
    fail(ErrorKind::Request, "kv_pool_pages must be >= 0 (0: enough for max_seq_len), got " +
                                 std::to_string(opt_.kv_pool_pages));
  if (opt_.gemv_grid < -1 || opt_.gemv_grid > 2) fail(ErrorKind::Request, "gemv_grid must be -1 (tuned), 0, 1 or 2");
  if (!(opt_.gemv_resident_margin >= 0 && opt_.gemv_resident_margin <= 1))
    fail(ErrorKind::Request, "gemv_resident_margin must be in [0, 1]");
  gemv_force_ = parse_gemv_force(opt_.gemv_force);
  if (opt_.decode_long_from < -1) fail(ErrorKind::Request, "decode_long_from must be -1 (tuned), 0 (off) or a context");
  TI_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  TI_CUDA_CHECK(cudaEventCreate(&ev0_));
  TI_CUDA_CHECK(cudaEventCreate(&ev1_));
}

// CudaOptions::gemv_force: "name:R/bps;..." -> (name, R, bps) triples, checked (the output mode is checked
// against R once the shape is known, in autotune_gemv).
std::vector<CudaEngine::GemvForce> CudaEngine::parse_gemv_force(const std::string& spec) {
  std::vector<GemvForce> out;
  size_t i = 0;
  while (i < spec.size()) {
    size_t j = spec.find(';', i);
    if (j == std::string::npos) j = spec.size();
    const std::string item = spec.substr(i, j - i);
    i = j + 1;
    if (item.empty()) continue;
    GemvForce f;
    const size_t colon = item.find(':'), slash = item.find('/');
    char extra = 0;
    if (colon == std::string::npos || slash == std::string::npos || slash < colon ||
        std::sscanf(item.c_str() + colon + 1, "%d/%d%c", &f.R, &f.bps, &extra) != 2)
      fail(ErrorKind::Request, "gemv_force: '" + item + "' is not name:R/blocks_per_sm");
    f.name = item.substr(0, colon);
    if (f.name != "qkv" && f.name != "o" && f.name != "gate_up" && f.name != "down" && f.name != "lm_head")
      fail(ErrorKind::Request, "gemv_force: unknown matrix '" + f.name + "' (qkv, o, gate_up, down, lm_head)");
    if (f.R != 1 && f.R != 2 && f.R != 4 && f.R != cuda::kGemvSplitK)
      fail(ErrorKind::Request, "gemv_force: R must be 1, 2, 4 or 8 in '" + item + "'");
    if (f.bps < 0 || f.bps > 2) fail(ErrorKind::Request, "gemv_force: blocks_per_sm must be 0, 1 or 2 in '" + item + "'");
    out.push_back(f);
  }
  return out;
}

void* CudaEngine::dalloc(size_t bytes, bool scratch) {
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
  allocations_.push_back(p);
  if (scratch) scratch_bytes_ += bytes;
  return p;
}

// One (rows, K) matrix in the engine's format; its bytes count as weights.
cuda::QMat CudaEngine::alloc_matrix(int rows, int K, WFormat fmt) {
  cuda::QMat m;
  m.fmt = fmt;
  m.rows = rows;
  m.K = K;
  if (m.fmt == WFormat::F16) {
    m.ld = (int)cuda::pad8(K);
    m.q = dalloc((size_t)rows * m.ld * sizeof(__half), false);
  } else {
    m.ld = (int)(m.fmt == WFormat::I8 ? i8_ld(K) : i4_ld(K));
    m.q = dalloc((size_t)rows * m.ld, false);
    m.scales = dalloc(m.fmt == WFormat::I8 ? (size_t)rows * 4 : (size_t)rows * (K / kI4Group) * 4, false);
  }
  weight_bytes_ += (size_t)quant_bytes(m.fmt, rows, K);
  return m;
}

// Host fp16 rows (stride pad8(K)) into the matrix: uploaded as they are, or staged and quantized on the GPU.
void CudaEngine::store_matrix(const cuda::QMat& m, const std::vector<uint16_t>& host) {
  __half* dst = m.fmt == WFormat::F16 ? static_cast<__half*>(const_cast<void*>(m.q)) : wtmp_;
  TI_CUDA_CHECK(cudaMemcpyAsync(dst, host.data(), host.size() * 2, cudaMemcpyHostToDevice, stream_));
  if (m.fmt != WFormat::F16) cuda::quantize_matrix(wtmp_, (int)cuda::pad8(m.K), m, stream_);
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // `host` may be reused or freed after this
}

// After store_matrix: the rows of parts the store holds already in int4 (GGUF Q4_0 / Q4_1, converted block for
// block) are replaced by those exact bytes, row i of part p sitting at row_of(p, i) of the fused matrix. Rows
// are independent, so a fused matrix may mix imported and quantized parts (q | k | v of different types).
void CudaEngine::overlay_imported(const cuda::QMat& m, const WeightStore& w, const std::vector<std::string>& parts,
                                  const std::function<int64_t(size_t, int64_t)>& row_of) {
  if (m.fmt != WFormat::I4) return;
  bool any = false;
  for (const std::string& name : parts) any = any || w.imported(name) != nullptr;
  if (!any) return;
  const int64_t groups = m.K / kI4Group;
  std::vector<uint8_t> q((size_t)m.rows * m.ld);
  std::vector<uint16_t> sm((size_t)(m.rows * groups * 2));
  TI_CUDA_CHECK(cudaMemcpy(q.data(), m.q, q.size(), cudaMemcpyDeviceToHost));
  TI_CUDA_CHECK(cudaMemcpy(sm.data(), m.scales, sm.size() * 2, cudaMemcpyDeviceToHost));
  for (size_t p = 0; p < parts.size(); p++) {
    const QuantMatrix* src = w.imported(parts[p]);
    if (!src) continue;
    if (src->K != m.K || src->ld != m.ld) fail(ErrorKind::ModelFormat, "int4 tensor '" + parts[p] + "': bad width");
    for (int64_t i = 0; i < src->rows; i++) {
      const int64_t r = row_of(p, i);
      std::memcpy(&q[(size_t)(r * m.ld)], &src->q[(size_t)(i * src->ld)], (size_t)src->ld);
      std::memcpy(&sm[(size_t)(r * groups * 2)], &src->sm[(size_t)(i * groups * 2)], (size_t)groups * 4);
    }
  }
  TI_CUDA_CHECK(cudaMemcpy(const_cast<void*>(m.q), q.data(), q.size(), cudaMemcpyHostToDevice));
  TI_CUDA_CHECK(cudaMemcpy(const_cast<void*>(m.scales), sm.data(), sm.size() * 2, cudaMemcpyHostToDevice));
}

void CudaEngine::random_matrix(const cuda::QMat& m, uint64_t seed, float scale) {
  const int ldh = (int)cuda::pad8(m.K);
  __half* dst = m.fmt == WFormat::F16 ? static_cast<__half*>(const_cast<void*>(m.q)) : wtmp_;
  cuda::fill_random_f16(dst, (size_t)m.rows * ldh, seed, scale, stream_);
  if (m.fmt != WFormat::F16) cuda::quantize_matrix(wtmp_, ldh, m, stream_);
}

const __half* CudaEngine::fp16_of(const cuda::QMat& m) {
  if (m.fmt == WFormat::F16) return static_cast<const __half*>(m.q);
  cuda::dequantize_matrix(m, wtmp_, (int)cuda::pad8(m.K), stream_);
  return wtmp_;
}

void CudaEngine::allocate() {
  const ModelConfig& c = cfg_;
  ld_h_ = (int)cuda::pad8(c.hidden);
  ld_q_ = (int)cuda::pad8(c.q_dim);
  ld_i_ = (int)cuda::pad8(c.intermediate);
  auto weights = [&](size_t n) {
    weight_bytes_ += n * sizeof(__half);
    return static_cast<__half*>(dalloc(n * sizeof(__half), false));
  };
  // refused before any allocation
  if (opt_.weights == WFormat::I4) require_int4_widths(c.hidden, c.q_dim, c.intermediate);
  auto norm = [&](size_t n) {
    weight_bytes_ += n * sizeof(float);
    return static_cast<float*>(dalloc(n * sizeof(float), false));
  };
  layers_.resize((size_t)c.n_layers);
  for (Layer& L : layers_) {
    L.qkv = alloc_matrix((int)(c.q_dim + 2 * c.kv_dim), (int)c.hidden, opt_.weights);
    L.o = alloc_matrix((int)c.hidden, (int)c.q_dim, opt_.weights);
    L.gate_up = alloc_matrix((int)(2 * c.intermediate), (int)c.hidden, opt_.weights);
    L.down = alloc_matrix((int)c.hidden, (int)c.intermediate, opt_.weights);
    L.attn_norm = norm((size_t)c.hidden);
    L.mlp_norm = norm((size_t)c.hidden);
  }
  embedding_ = weights((size_t)c.vocab * ld_h_);
  if (c.tie_word_embeddings && opt_.weights == WFormat::F16) {
    lm_head_ = cuda::QMat{WFormat::F16, embedding_, nullptr, (int)c.vocab, (int)c.hidden, ld_h_};
  } else {
    lm_head_ = alloc_matrix((int)c.vocab, (int)c.hidden, head_format(opt_.weights));
  }
  final_norm_ = norm((size_t)c.hidden);
  if (opt_.weights != WFormat::F16) {  // staging: the largest matrix as fp16 rows
    wtmp_elems_ = (size_t)std::max<int64_t>({(c.q_dim + 2 * c.kv_dim) * ld_h_, c.hidden * ld_q_,
                                             2 * c.intermediate * ld_h_, c.hidden * ld_i_, c.vocab * ld_h_});
    wtmp_ = static_cast<__half*>(dalloc(wtmp_elems_ * sizeof(__half), true));
  }

  // The paged KV cache: one pool of pages for keys and one for values, [layer][page][kv_head][page_size][head_dim];
  // pages are assigned to the sequence on demand (kv_reserve), the table's device copy read by the kernels.
  const int P = opt_.kv_page_size;
  kv_pool_ = std::make_unique<KvPagePool>(opt_.kv_pool_pages ? opt_.kv_pool_pages : (max_seq_ + P - 1) / P, P,
                                          opt_.kv_page_shuffle);
  kv_seq_ = std::make_unique<KvSequence>(*kv_pool_, max_seq_);
  kv_layer_elems_ = (size_t)kv_pool_->n_pages() * c.n_kv_heads * P * c.head_dim;
  const size_t kv = (size_t)c.n_layers * kv_layer_elems_;
  kv_bytes_ = 2 * kv * sizeof(__half);
  k_pages_ = static_cast<__half*>(dalloc(kv * sizeof(__half), false));
  v_pages_ = static_cast<__half*>(dalloc(kv * sizeof(__half), false));
  TI_CUDA_CHECK(cudaMemsetAsync(k_pages_, 0, kv * sizeof(__half), stream_));
  TI_CUDA_CHECK(cudaMemsetAsync(v_pages_, 0, kv * sizeof(__half), stream_));
  d_page_table_ = static_cast<int*>(dalloc((size_t)kv_seq_->max_pages() * sizeof(int), true));
  TI_CUDA_CHECK(cudaMemsetAsync(d_page_table_, 0xFF, (size_t)kv_seq_->max_pages() * sizeof(int), stream_));  // -1

  const int64_t max_chunks = (max_seq_ + opt_.attn_chunk - 1) / opt_.attn_chunk;
  x_ = static_cast<float*>(dalloc(c.hidden * sizeof(float), true));
  qkv_ = static_cast<float*>(dalloc((c.q_dim + 2 * c.kv_dim) * sizeof(float), true));
  att_ = static_cast<__half*>(dalloc(ld_q_ * sizeof(__half), true));
  h_ = static_cast<__half*>(dalloc(ld_i_ * sizeof(__half), true));
  logits_ = static_cast<float*>(dalloc(c.vocab * sizeof(float), true));
  part_o_ = static_cast<float*>(dalloc(c.n_heads * max_chunks * c.head_dim * sizeof(float), true));
  part_ml_ = static_cast<float*>(dalloc(c.n_heads * max_chunks * 2 * sizeof(float), true));
  const size_t rope_n = (size_t)max_seq_ * (c.head_dim / 2);
  rope_cos_ = static_cast<float*>(dalloc(rope_n * sizeof(float), true));
  rope_sin_ = static_cast<float*>(dalloc(rope_n * sizeof(float), true));
  RopeTable rt = rope_table(c, max_seq_);  // the CPU engine's own table: identical angles
  TI_CUDA_CHECK(cudaMemcpy(rope_cos_, rt.cos.data(), rope_n * sizeof(float), cudaMemcpyHostToDevice));
  TI_CUDA_CHECK(cudaMemcpy(rope_sin_, rt.sin.data(), rope_n * sizeof(float), cudaMemcpyHostToDevice));

  d_sampling_ = static_cast<cuda::DeviceSampling*>(dalloc(sizeof(cuda::DeviceSampling), true));
  d_state_ = static_cast<cuda::DecodeState*>(dalloc(sizeof(cuda::DecodeState), true));
  d_seen_ = static_cast<unsigned char*>(dalloc(c.vocab, true));
  d_probs_ = static_cast<float*>(dalloc(c.vocab * sizeof(float), true));
  d_out_ = static_cast<int*>(dalloc(max_seq_ * sizeof(int), true));
#ifndef TI_TRACE
  if (opt_.trace)
    fail(ErrorKind::Request, "CudaOptions.trace: this build has no tracing (rebuild with CMAKE_ARGS=-DTINYINFER_TRACE=ON)");
#endif
  if (opt_.trace)  // 5 kernels per layer + the head
    d_trace_ = static_cast<unsigned long long*>(
        dalloc((size_t)(5 * c.n_layers + 1) * cuda::kTraceBlocks * cuda::kTracePoints * 8, true));
  TI_CUDA_CHECK(cudaMemsetAsync(d_seen_, 0, c.vocab, stream_));
  TI_CUDA_CHECK(cudaMallocHost(&h_state_, sizeof(cuda::DecodeState)));
  TI_CUDA_CHECK(cudaMallocHost(&h_sampling_, sizeof(cuda::DeviceSampling)));
  TI_CUDA_CHECK(cudaMallocHost(&h_out_, max_seq_ * sizeof(int)));
  *h_state_ = cuda::DecodeState{};
  *h_sampling_ = cuda::DeviceSampling{};
  TI_CUDA_CHECK(cudaMemcpyAsync(d_state_, h_state_, sizeof(*h_state_), cudaMemcpyHostToDevice, stream_));
  TI_CUDA_CHECK(cudaMemcpyAsync(d_sampling_, h_sampling_, sizeof(*h_sampling_), cudaMemcpyHostToDevice, stream_));
  allocate_prefill();
}

// The batched prefill's activations, sized for one chunk of min(prefill_chunk, max_seq) tokens.
void CudaEngine::allocate_prefill() {
  const ModelConfig& c = cfg_;
  if (!opt_.batched_prefill || !cuda::prefill_attention_supported((int)c.head_dim)) return;  // token by token
  if (opt_.prefill_chunk < 1) fail(ErrorKind::Request, "prefill_chunk must be >= 1");
  const int T = (int)std::min<int64_t>(opt_.prefill_chunk, max_seq_);
  ld_qkv_ = (int)cuda::pad8(c.q_dim + 2 * c.kv_dim);
  ld_gu_ = (int)cuda::pad8(2 * c.intermediate);
  ld_v_ = (int)cuda::pad8(c.vocab);
  // Engine.logits over a long prompt: the LM head's output a slice of rows at a time (<= 64 MB; the rows go
  // to host memory anyway, so a bigger slice buys nothing).
  logit_rows_ = (int)std::clamp<int64_t>((64 << 20) / ((int64_t)ld_v_ * 4), 1, T);
  auto f32 = [&](size_t n) { return static_cast<float*>(dalloc(n * sizeof(float), true)); };
  auto f16 = [&](size_t n) { return static_cast<__half*>(dalloc(n * sizeof(__half), true)); };
  d_tokens_ = static_cast<int*>(dalloc((size_t)T * sizeof(int), true));
  TI_CUDA_CHECK(cudaMallocHost(&h_tokens_, (size_t)T * sizeof(int)));
  px_ = f32((size_t)T * ld_h_);
  pxn_ = f16((size_t)T * ld_h_);
  pqkv_ = f32((size_t)T * ld_qkv_);
  pq_ = f16((size_t)T * c.q_dim);
  patt_ = f16((size_t)T * ld_q_);
  pgu_ = f16((size_t)T * ld_gu_);
  ph_ = f16((size_t)T * ld_i_);
  plogits_ = f32((size_t)logit_rows_ * ld_v_);
  constexpr size_t kWorkspace = 32u << 20;
  gemm_ = std::make_unique<cuda::Gemm>(kWorkspace);
  gemm_->autotune = opt_.gemm_autotune;
  scratch_bytes_ += kWorkspace;
  prefill_rows_ = T;
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

void CudaEngine::upload(const WeightStore& w) {
  const ModelConfig& c = cfg_;
  auto same = [](int64_t i) { return i; };
  std::vector<uint16_t> host;
  auto fresh = [&](int64_t rows, int64_t ld) { host.assign((size_t)(rows * ld), 0); };
  for (int64_t l = 0; l < c.n_layers; l++) {
    const LayerWeights L = w.layer(l);
    Layer& D = layers_[(size_t)l];
    auto name = [&](const char* leaf) { return WeightStore::layer_tensor(l, leaf); };
    fresh(c.q_dim + 2 * c.kv_dim, ld_h_);  // q | k | v
    pack_rows(host, L.wq, c.q_dim, c.hidden, ld_h_, same);
    pack_rows(host, L.wk, c.kv_dim, c.hidden, ld_h_, [&](int64_t i) { return c.q_dim + i; });
    pack_rows(host, L.wv, c.kv_dim, c.hidden, ld_h_, [&](int64_t i) { return c.q_dim + c.kv_dim + i; });
    store_matrix(D.qkv, host);
    overlay_imported(D.qkv, w, {name("self_attn.q_proj.weight"), name("self_attn.k_proj.weight"),
                                name("self_attn.v_proj.weight")},
                     [&](size_t p, int64_t i) { return p == 0 ? i : p == 1 ? c.q_dim + i : c.q_dim + c.kv_dim + i; });
    fresh(c.hidden, ld_q_);
    pack_rows(host, L.wo, c.hidden, c.q_dim, ld_q_, same);
    store_matrix(D.o, host);
    overlay_imported(D.o, w, {name("self_attn.o_proj.weight")}, [](size_t, int64_t i) { return i; });
    fresh(2 * c.intermediate, ld_h_);  // gate_0, up_0, gate_1, up_1, ...
    pack_rows(host, L.w_gate, c.intermediate, c.hidden, ld_h_, [](int64_t i) { return 2 * i; });
    pack_rows(host, L.w_up, c.intermediate, c.hidden, ld_h_, [](int64_t i) { return 2 * i + 1; });
    store_matrix(D.gate_up, host);
    overlay_imported(D.gate_up, w, {name("mlp.gate_proj.weight"), name("mlp.up_proj.weight")},
                     [](size_t p, int64_t i) { return 2 * i + (int64_t)p; });
    fresh(c.hidden, ld_i_);
    pack_rows(host, L.w_down, c.hidden, c.intermediate, ld_i_, same);
    store_matrix(D.down, host);
    overlay_imported(D.down, w, {name("mlp.down_proj.weight")}, [](size_t, int64_t i) { return i; });
    TI_CUDA_CHECK(cudaMemcpy(D.attn_norm, L.attn_norm, c.hidden * sizeof(float), cudaMemcpyHostToDevice));
    TI_CUDA_CHECK(cudaMemcpy(D.mlp_norm, L.mlp_norm, c.hidden * sizeof(float), cudaMemcpyHostToDevice));
  }
  fresh(c.vocab, ld_h_);
  pack_rows(host, w.embedding(), c.vocab, c.hidden, ld_h_, same);
  TI_CUDA_CHECK(cudaMemcpy(embedding_, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  if (lm_head_.q != embedding_) {  // untied, or tied but quantized: the head's own copy
    fresh(c.vocab, ld_h_);
    pack_rows(host, w.lm_head(), c.vocab, c.hidden, ld_h_, same);
    store_matrix(lm_head_, host);
  }
  TI_CUDA_CHECK(cudaMemcpy(final_norm_, w.final_norm(), c.hidden * sizeof(float), cudaMemcpyHostToDevice));
}

void CudaEngine::randomize(uint64_t seed) {
  const ModelConfig& c = cfg_;
  uint64_t s = seed;
  auto fill = [&](const cuda::QMat& m) {
    random_matrix(m, ++s * 0x9e3779b97f4a7c15ull, 1.0f / std::sqrt((float)m.K));
  };
  for (Layer& L : layers_) {
    fill(L.qkv);
    fill(L.o);
    fill(L.gate_up);
    fill(L.down);
    cuda::fill_f32(L.attn_norm, c.hidden, 1.0f, stream_);
    cuda::fill_f32(L.mlp_norm, c.hidden, 1.0f, stream_);
  }
  cuda::fill_random_f16(embedding_, (size_t)c.vocab * ld_h_, ++s * 0x9e3779b97f4a7c15ull, 1.0f, stream_);
  if (lm_head_.q != embedding_) fill(lm_head_);
  cuda::fill_f32(final_norm_, c.hidden, 1.0f, stream_);
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  // (fp16: the padding columns hold random values too; the inputs' padding is zero, so they add nothing)
}

CudaEngine::CudaEngine(const WeightStore& weights, int64_t max_seq_len, CudaOptions opt)
    : cfg_(weights.config()), max_seq_(max_seq_len), opt_(opt) {
  if (!weights.finished()) fail(ErrorKind::Request, "CudaEngine: the WeightStore is not finished");
  guarded([&] {
    init_device();
    allocate();
    upload(weights);
    autotune_gemv();
    build_graphs();
    tune_decode_long();
  });
}

CudaEngine::CudaEngine(const ModelConfig& config, int64_t max_seq_len, uint64_t seed, CudaOptions opt)
    : cfg_(config), max_seq_(max_seq_len), opt_(opt) {
  cfg_.validate();
  guarded([&] {
    init_device();
    allocate();
    randomize(seed);
    autotune_gemv();
    build_graphs();
    tune_decode_long();
  });
}

// A constructor that throws never runs the destructor: free what was taken so far, so that a failed load (out
// of memory, say) leaves the GPU as it found it and the next, smaller load can succeed.
template <typename F>
void CudaEngine::guarded(F&& build) {
  try {
    build();
  } catch (...) {
    release();
    throw;
  }
}

void CudaEngine::release() {
  if (stream_) cudaStreamSynchronize(stream_);
  if (g_forward_) cudaGraphExecDestroy(g_forward_);
  if (g_decode_) cudaGraphExecDestroy(g_decode_);
  if (g_decode_long_) cudaGraphExecDestroy(g_decode_long_);
  for (void* p : allocations_) cudaFree(p);
  if (h_state_) cudaFreeHost(h_state_);
  if (h_sampling_) cudaFreeHost(h_sampling_);
  if (h_out_) cudaFreeHost(h_out_);
  if (h_tokens_) cudaFreeHost(h_tokens_);
  gemm_.reset();
  prefill_rows_ = 0;
  if (ev0_) cudaEventDestroy(ev0_);
  if (ev1_) cudaEventDestroy(ev1_);
  if (stream_) cudaStreamDestroy(stream_);
  g_forward_ = g_decode_ = g_decode_long_ = nullptr;
  allocations_.clear();
  h_state_ = nullptr;
  h_sampling_ = nullptr;
  h_out_ = nullptr;
  h_tokens_ = nullptr;
  ev0_ = ev1_ = nullptr;
  stream_ = nullptr;
  cudaGetLastError();  // leave no sticky error behind
}

CudaEngine::~CudaEngine() { release(); }

// ---- the decode step, top to bottom ----

cuda::GemvParams CudaEngine::gemv_params(const cuda::QMat& m, const void* x, void* y, const float* norm_w,
                                         bool early_trigger) const {
  cuda::GemvParams p;
  p.early_trigger = early_trigger && opt_.early_trigger;
  p.rows = m.rows;
  p.K = m.K;
  p.fmt = m.fmt;
  if (m.fmt == WFormat::F16) {
    p.W = static_cast<const __half*>(m.q);
    p.ld = m.ld;
  } else {
    p.q = static_cast<const uint8_t*>(m.q);
    p.scales = m.scales;
    p.ldq = m.ld;
    p.ld = m.fmt == WFormat::I8 ? m.ld : m.K;  // the width the input is staged at
  }
  p.x = x;
  p.y = y;
  p.norm_w = norm_w;
  p.eps = (float)cfg_.rms_eps;
  return p;
}

cuda::DecodeAttnParams CudaEngine::attn_params(int64_t layer) const {
  const ModelConfig& c = cfg_;
  cuda::DecodeAttnParams a;
  a.qkv = qkv_;
  a.k_pages = k_pages_ + layer * kv_layer_elems_;
  a.v_pages = v_pages_ + layer * kv_layer_elems_;
  a.page_table = d_page_table_;
  a.page_shift = kv_pool_->page_shift();
  a.rope_cos = rope_cos_;
  a.rope_sin = rope_sin_;
  a.pos = &d_state_->pos;
  a.part_o = part_o_;
  a.part_ml = part_ml_;
  a.out = att_;
  a.n_heads = (int)c.n_heads;
  a.n_kv_heads = (int)c.n_kv_heads;
  a.head_dim = (int)c.head_dim;
  a.max_seq = (int)max_seq_;
  a.chunk = opt_.attn_chunk;
  a.scale = 1.0f / std::sqrt((float)c.head_dim);
  return a;
}

const GemvChoice* CudaEngine::find_choice(const char* name) const {
  for (const GemvChoice& g : gemv_choices_)
    if (g.name == name) return &g;
  return nullptr;
}

int CudaEngine::choice(const char* name) const {
  const GemvChoice* g = find_choice(name);
  return g ? g->R : 2;
}

cuda::GemvParams CudaEngine::tuned(const char* name, cuda::GemvParams p) const {
  if (const GemvChoice* g = find_choice(name)) p.blocks_per_sm = g->blocks_per_sm;
  return p;
}

unsigned long long* CudaEngine::next_trace(const std::string& name) {
  if (!d_trace_) return nullptr;
  trace_names_.push_back(name);
  return d_trace_ + (trace_names_.size() - 1) * cuda::kTraceBlocks * cuda::kTracePoints;
}

void CudaEngine::record_forward(cudaStream_t s) {
  const ModelConfig& c = cfg_;
  const int H = (int)c.hidden;
  trace_names_.clear();
  // One GEMV of the step: the tuned variant (R, grid) of shape `name`, traced under that name (CudaOptions::trace).
  auto gemv = [&](const char* name, cuda::GemvParams p, GemvIn in, GemvOut out) {
    p = tuned(name, p);
    p.trace = next_trace(name);
    cuda::gemv(p, choice(name), in, out, s, pdl_);
  };
  cuda::embed_token(embedding_, ld_h_, H, d_state_, x_, s, pdl_);  // x = embed[token]
  for (int64_t l = 0; l < c.n_layers; l++) {
    const Layer& L = layers_[(size_t)l];
    // qkv = [Wq; Wk; Wv] @ rmsnorm(x). It always triggers late (after its wait): the attention after it reads
    // pos and the cache before its own wait (common.cuh, the two-back rule). The other GEMVs may trigger at their
    // start (CudaOptions::early_trigger, off by default: measured slower).
    gemv("qkv", gemv_params(L.qkv, x_, qkv_, L.attn_norm), GemvIn::F32Norm, GemvOut::F32);
    // att = softmax(rope(q) rope(K)^T / sqrt(d)) V, writing rope(k), v at pos into the cache
    cuda::DecodeAttnParams a = attn_params(l);
    a.trace = next_trace("attention");
    cuda::decode_attention(a, s, pdl_);
    // x += Wo @ att
    gemv("o", gemv_params(L.o, att_, x_, nullptr, true), GemvIn::F16, GemvOut::AddF32);
    // h = silu(Wg @ rmsnorm(x)) * (Wu @ rmsnorm(x))
    gemv("gate_up", gemv_params(L.gate_up, x_, h_, L.mlp_norm, true), GemvIn::F32Norm, GemvOut::Swiglu);
    // x += Wd @ h
    gemv("down", gemv_params(L.down, h_, x_, nullptr, true), GemvIn::F16, GemvOut::AddF32);
  }
  // logits = lm_head @ rmsnorm(x)
  gemv("lm_head", gemv_params(lm_head_, x_, logits_, final_norm_, true), GemvIn::F32Norm, GemvOut::F32);
}

void CudaEngine::record_decode_step(cudaStream_t s) {
  record_forward(s);  // feeds state.token at state.pos
  cuda::sample_token(logits_, (int)cfg_.vocab, d_sampling_, d_seen_, d_probs_, d_state_, d_out_, s, pdl_);
}

void CudaEngine::run_forward(cudaStream_t s) {
  if (graphs_ok_) TI_CUDA_CHECK(cudaGraphLaunch(g_forward_, s));
  else record_forward(s);
}

void CudaEngine::run_decode_step(cudaStream_t s, int64_t pos) {
  if (graphs_ok_)
    TI_CUDA_CHECK(cudaGraphLaunch(g_decode_long_ && pos >= long_from_ ? g_decode_long_ : g_decode_, s));
  else record_decode_step(s);
}

// Captures what `record` launches on the stream into an instantiated graph. A throw from `record` ends the
// capture (discarding it) and propagates; a CUDA failure is returned, leaving no sticky error behind.
cudaError_t CudaEngine::capture_graph(const std::function<void()>& record, cudaGraphExec_t* out) {
  cudaGraph_t graph = nullptr;
  cudaError_t err = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return err;
  }
  try {
    record();
  } catch (...) {
    cudaStreamEndCapture(stream_, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  err = cudaStreamEndCapture(stream_, &graph);
  if (err == cudaSuccess) err = cudaGraphInstantiate(out, graph, 0);
  if (graph) cudaGraphDestroy(graph);
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

void CudaEngine::build_graphs() {
  if (!opt_.graphs) return;
  auto capture = [&](bool decode, cudaGraphExec_t* out) {
    TI_CUDA_CHECK(capture_graph([&] { decode ? record_decode_step(stream_) : record_forward(stream_); }, out));
  };
  try {
    capture(false, &g_forward_);
    capture(true, &g_decode_);
  } catch (const Error&) {
    if (!pdl_) throw;
    // A driver that cannot capture programmatic launches: capture plain ones instead.
    cudaGetLastError();
    if (g_forward_) cudaGraphExecDestroy(g_forward_);
    g_forward_ = nullptr;
    pdl_ = false;
    capture(false, &g_forward_);
    capture(true, &g_decode_);
  }
  graphs_ok_ = true;
}

// ---- the long-context decode graph (CudaOptions::decode_long_from) ----

// GPU ms per decode step, `launch(pos)` enqueueing the step at pos, from `context` on (greedy sampling; 3 steps of
// warm-up). The cache is left holding benchmark tokens.
double CudaEngine::time_steps(int64_t context, int steps, const std::function<void(int64_t)>& launch) {
  if (context < 0 || context + std::max(steps, 3) > max_seq_)
    fail(ErrorKind::Request, "timing decode steps: context + max(steps, 3) must be <= max_seq_len");
  kv_reserve(context + std::max(steps, 3));
  *h_sampling_ = cuda::DeviceSampling{};
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  TI_CUDA_CHECK(cudaMemcpyAsync(d_sampling_, h_sampling_, sizeof(*h_sampling_), cudaMemcpyHostToDevice, stream_));
  set_state(1, (int)context, 0);
  for (int i = 0; i < 3; i++) launch(context + i);
  set_state(1, (int)context, 0);
  const float ms = gpu_ms([&] {
    for (int i = 0; i < steps; i++) launch(context + i);
  });
  return ms / steps;
}

double CudaEngine::time_graph_step(cudaGraphExec_t g, int64_t context, int steps) {
  return time_steps(context, steps, [&](int64_t) { TI_CUDA_CHECK(cudaGraphLaunch(g, stream_)); });
}

// qkv's candidates for long contexts: the short graph's R at 1 block per SM, and the largest tiles among the
// 2-per-SM variants within 25% of the fastest alone. Each is timed as whole decode steps at a long context
// (min(1,024, max_seq_len - 64)); a candidate faster than the short graph by > 2% gets a graph, used from the
// first context in {64, 128, 256, 512} where it is faster by > 1% (else from the long context itself). The long
// graph differs from the short one in qkv's grid or tile height only.
void CudaEngine::tune_decode_long() {
  if (!graphs_ok_ || opt_.decode_long_from == 0) return;
  GemvChoice* q = const_cast<GemvChoice*>(find_choice("qkv"));  // swapped while capturing the candidates
  const int64_t ctx_long = std::min<int64_t>({1024, max_seq_ - 64, kv_pool_->n_pages() * kv_pool_->page_size() - 64});
  if (!q || (opt_.decode_long_from < 0 && ctx_long < 256)) return;
  const int R0 = q->R, bps0 = q->blocks_per_sm;
  auto capture_with = [&](int R, int bps) {
    q->R = R;
    q->blocks_per_sm = bps;
    cudaGraphExec_t g = nullptr;
    const cudaError_t err = capture_graph([&] { record_decode_step(stream_); }, &g);
    q->R = R0;
    q->blocks_per_sm = bps0;
    TI_CUDA_CHECK(err);
    return g;
  };
  if (opt_.decode_long_from > 0) {  // forced (tests): qkv at 1 block per SM from that context on
    g_decode_long_ = capture_with(R0, 1);
    long_from_ = opt_.decode_long_from;
    qkv_long_R_ = R0;
    qkv_long_bps_ = 1;
    return;
  }
  std::vector<std::pair<int, int>> cands;
  if (bps0 != 1) cands.push_back({R0, 1});
  const double best = *std::min_element(q->us.begin(), q->us.end());
  int big = 0;
  for (size_t i = 0; i < q->us.size(); i++) {
    const int R = q->tried_R[i];
    if (q->tried_bps[i] == 2 && q->us[i] <= 1.25 * best && (!big || cuda::gemv_tile_rows(R) > cuda::gemv_tile_rows(big)))
      big = R;
  }
  if (big && !(big == R0 && bps0 == 2)) cands.push_back({big, 2});
  const int steps = 30;
  const double t_short = time_graph_step(g_decode_, ctx_long, steps);
  double t_best = t_short;
  for (const auto& [R, bps] : cands) {
    cudaGraphExec_t g = capture_with(R, bps);
    const double t = time_graph_step(g, ctx_long, steps);
    if (t < 0.98 * t_best) {
      if (g_decode_long_) cudaGraphExecDestroy(g_decode_long_);
      g_decode_long_ = g;
      t_best = t;
      qkv_long_R_ = R;
      qkv_long_bps_ = bps;
    } else {
      cudaGraphExecDestroy(g);
    }
  }
  if (g_decode_long_) {
    long_from_ = ctx_long;
    for (int64_t c : {64, 128, 256, 512}) {
      if (c >= ctx_long) break;
      if (time_graph_step(g_decode_long_, c, steps) < 0.99 * time_graph_step(g_decode_, c, steps)) {
        long_from_ = c;
        break;
      }
    }
  }
  reset();  // the cache now holds benchmark tokens
}

// GPU milliseconds of the work `enqueue` puts on the engine's stream (CUDA events around it; waits for it).
float CudaEngine::gpu_ms(const std::function<void()>& enqueue) {
  TI_CUDA_CHECK(cudaEventRecord(ev0_, stream_));
  enqueue();
  TI_CUDA_CHECK(cudaEventRecord(ev1_, stream_));
  TI_CUDA_CHECK(cudaEventSynchronize(ev1_));
  float ms = 0;
  TI_CUDA_CHECK(cudaEventElapsedTime(&ms, ev0_, ev1_));
  return ms;
}

// GPU time of what `enqueue` launches, replayed from a CUDA graph where graphs are on (as the decode step runs:
// stream launches from the host take ~3 us each, longer than a small GEMV, and would time the host instead);
// timed from the stream where capture is off or fails.
float CudaEngine::replay_ms(const std::function<void()>& enqueue) {
  cudaGraphExec_t exec = nullptr;
  if (opt_.graphs && capture_graph(enqueue, &exec) == cudaSuccess) {
    TI_CUDA_CHECK(cudaGraphLaunch(exec, stream_));  // warm-up
    const float ms = gpu_ms([&] { TI_CUDA_CHECK(cudaGraphLaunch(exec, stream_)); });
    cudaGraphExecDestroy(exec);
    return ms;
  }
  enqueue();  // warm-up
  return gpu_ms(enqueue);
}

// ---- the rows-per-warp autotuner (at load; never inside a capture) ----

void CudaEngine::autotune_gemv() {
  const ModelConfig& c = cfg_;
  struct Shape {
    const char* name;
    int rows, K;
    GemvIn in;
    GemvOut out;
    std::vector<cuda::QMat> copies;
    const void* x;
    void* y;
    const float* norm;
    bool early;  // PDL trigger at the start, as in record_forward
    bool before_attention = false;  // the decode attention follows it
  };
  std::vector<Shape> shapes = {
      {"qkv", (int)(c.q_dim + 2 * c.kv_dim), (int)c.hidden, GemvIn::F32Norm, GemvOut::F32, {}, x_, qkv_, final_norm_,
       false, true},
      {"o", (int)c.hidden, (int)c.q_dim, GemvIn::F16, GemvOut::AddF32, {}, att_, x_, nullptr, true},
      {"gate_up", (int)(2 * c.intermediate), (int)c.hidden, GemvIn::F32Norm, GemvOut::Swiglu, {}, x_, h_, final_norm_,
       true},
      {"down", (int)c.hidden, (int)c.intermediate, GemvIn::F16, GemvOut::AddF32, {}, h_, x_, nullptr, true},
      {"lm_head", (int)c.vocab, (int)c.hidden, GemvIn::F32Norm, GemvOut::F32, {lm_head_}, x_, logits_, final_norm_,
       true},
  };
  for (const Layer& L : layers_) {
    shapes[0].copies.push_back(L.qkv);
    shapes[1].copies.push_back(L.o);
    shapes[2].copies.push_back(L.gate_up);
    shapes[3].copies.push_back(L.down);
  }
  TI_CUDA_CHECK(cudaMemsetAsync(x_, 0, c.hidden * sizeof(float), stream_));
  TI_CUDA_CHECK(cudaMemsetAsync(att_, 0, ld_q_ * sizeof(__half), stream_));
  TI_CUDA_CHECK(cudaMemsetAsync(h_, 0, ld_i_ * sizeof(__half), stream_));
  gemv_choices_.clear();
  for (const Shape& sh : shapes) {
    GemvChoice g;
    g.name = sh.name;
    g.rows = sh.rows;
    g.K = sh.K;
    g.ld = (int)cuda::pad8(sh.K);
    g.copies = (int)sh.copies.size();
    const double bytes = (double)quant_bytes(sh.copies[0].fmt, g.rows, g.K);  // as stored, scales included
    // Cycle through every layer's copy (and at least ~256 MB of weights, several times the L2) so that the
    // timing is of memory, not of the cache.
    const int passes = std::max(2, (int)std::ceil(256e6 / (bytes * g.copies)));
    double best = 1e30;
    for (int R : {1, 2, 4, cuda::kGemvSplitK}) {
      if (opt_.gemv_rows && R != opt_.gemv_rows && cuda::gemv_variant_ok(opt_.gemv_rows, sh.out)) continue;
      if (!cuda::gemv_variant_ok(R, sh.out)) continue;
      for (int bps : {0, 1, 2}) {  // grid: a block per tile, or 1 / 2 blocks per SM looping over tiles
        if (opt_.gemv_grid >= 0 && bps != opt_.gemv_grid) continue;
        const float ms = replay_ms([&] {
          for (int i = 0; i < passes; i++)
            for (const cuda::QMat& W : sh.copies) {
              cuda::GemvParams p = gemv_params(W, sh.x, sh.y, sh.norm, sh.early);
              p.blocks_per_sm = bps;
              cuda::gemv(p, R, sh.in, sh.out, stream_, pdl_);
            }
        });
        const double us = ms * 1e3 / (passes * g.copies);
        g.tried_R.push_back(R);
        g.tried_bps.push_back(bps);
        g.us.push_back(us);
        if (us < best) {
          best = us;
          g.R = R;
          g.blocks_per_sm = bps;
          g.gb_per_s = bytes / (us * 1e-6) / 1e9;
        }
      }
    }
    if (opt_.gemv_resident_margin > 0) {
      // CudaOptions::gemv_small_tiles: the smallest tiles (the most blocks), except before the attention: there the
      // largest (the fewest blocks), which leaves SMs free for the attention's blocks to start early (PDL) and fetch
      // the cached keys and values before their wait — at long contexts most of their work.
      auto better = [&](size_t i, int pick) {
        if (pick < 0) return true;
        const int ti = cuda::gemv_tile_rows(g.tried_R[i]), tp = cuda::gemv_tile_rows(g.tried_R[pick]);
        if (opt_.gemv_small_tiles && ti != tp) return sh.before_attention ? ti > tp : ti < tp;
        return g.us[i] < g.us[pick];
      };
      int pick = -1;
      for (size_t i = 0; i < g.us.size(); i++)
        if (g.tried_bps[i] == 2 && g.us[i] <= best * (1 + opt_.gemv_resident_margin) && better(i, pick))
          pick = (int)i;
      if (pick >= 0) {
        g.R = g.tried_R[pick];
        g.blocks_per_sm = 2;
        g.gb_per_s = bytes / (g.us[pick] * 1e-6) / 1e9;
      }
    }
    for (const GemvForce& f : gemv_force_) {
      if (f.name != g.name) continue;
      if (!cuda::gemv_variant_ok(f.R, sh.out))
        fail(ErrorKind::Request, "gemv_force: no variant R=" + std::to_string(f.R) + " for " + f.name);
      g.R = f.R;
      g.blocks_per_sm = f.bps;
      g.gb_per_s = 0;
      for (size_t i = 0; i < g.us.size(); i++)
        if (g.tried_R[i] == f.R && g.tried_bps[i] == f.bps) g.gb_per_s = bytes / (g.us[i] * 1e-6) / 1e9;
    }
    gemv_choices_.push_back(g);
  }
}

// ---- running tokens ----

void CudaEngine::set_state(int token, int pos, int step) {
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // h_state_ may still be read by an earlier copy
  *h_state_ = cuda::DecodeState{token, pos, step, step};
  TI_CUDA_CHECK(cudaMemcpyAsync(d_state_, h_state_, sizeof(*h_state_), cudaMemcpyHostToDevice, stream_));
}

// Pages for positions [0, positions) of the sequence, taken from the pool as it grows, and the table's new entries
// copied to the device ahead of the work that addresses through them (stream order; a captured decode step reads
// the table when it runs). All or nothing: a pool too small throws a Request error and changes nothing.
void CudaEngine::kv_reserve(int64_t positions) {
  const int64_t first = kv_seq_->grow(*kv_pool_, positions), n = kv_seq_->pages() - first;
  if (n > 0)
    TI_CUDA_CHECK(cudaMemcpyAsync(d_page_table_ + first, kv_seq_->table().data() + first, (size_t)n * sizeof(int),
                                  cudaMemcpyHostToDevice, stream_));  // (pageable: staged before it returns)
}

void CudaEngine::reset() {
  kv_seq_->release(*kv_pool_);  // (the device table keeps stale entries: only positions < pos are ever read)
  tokens_.clear();
  has_logits_ = pending_ = false;
}

void CudaEngine::forward(const int32_t* tokens, int64_t n, bool all_logits, float* logits) {
  check_tokens(tokens, n, cfg_.vocab);
  check_room(position(), n, max_seq_);
  kv_reserve(position() + n);
  std::vector<int32_t> seq;
  if (pending_) seq.push_back(tokens_.back());
  seq.insert(seq.end(), tokens, tokens + n);
  const int64_t pos0 = position() - (pending_ ? 1 : 0), first = (int64_t)seq.size() - n;
  const int64_t V = cfg_.vocab;
  float* rows_out = logits && all_logits ? logits : nullptr;  // row i - first of seq[i]'s logits
  if (batched_prefill()) {
    for (int64_t c0 = 0; c0 < (int64_t)seq.size(); c0 += prefill_rows_) {
      const int T = (int)std::min<int64_t>(prefill_rows_, (int64_t)seq.size() - c0);
      prefill_chunk(seq.data() + c0, T, (int)(pos0 + c0), rows_out, c0 - first);
    }
  } else {
    for (size_t i = 0; i < seq.size(); i++) {  // one token at a time through the decode graph
      set_state(seq[i], (int)(pos0 + (int64_t)i), 0);
      run_forward(stream_);
      const int64_t row = (int64_t)i - first;
      if (rows_out && row >= 0)
        TI_CUDA_CHECK(cudaMemcpyAsync(rows_out + row * V, logits_, V * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    }
  }
  if (logits && !all_logits)
    TI_CUDA_CHECK(cudaMemcpyAsync(logits, logits_, V * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  tokens_.insert(tokens_.end(), tokens, tokens + n);
  pending_ = false;
  has_logits_ = true;
}

std::vector<int32_t> CudaEngine::decode(int64_t max_steps, const SamplingConfig& s,
                                        const std::vector<int32_t>& stop_ids, uint64_t step0) {
  validate(s);
  if (!has_logits_) fail(ErrorKind::Request, "decode: run a prompt through forward() first");
  if (max_steps < 1) return {};
  const int64_t room = max_seq_ - position();
  if (room < 1) fail(ErrorKind::Request, "the sequence reached max_seq_len=" + std::to_string(max_seq_));
  const int64_t n = std::min(max_steps, room);
  kv_reserve(position() + n);  // the steps write positions up to position() + n - 2

  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  *h_sampling_ = cuda::DeviceSampling{s.temperature, (int)std::min<int64_t>(s.top_k, INT32_MAX), s.top_p, s.min_p,
                                      s.repetition_penalty, (unsigned long long)s.seed};
  TI_CUDA_CHECK(cudaMemcpyAsync(d_sampling_, h_sampling_, sizeof(*h_sampling_), cudaMemcpyHostToDevice, stream_));
  if (s.repetition_penalty != 1.0f) {  // the penalty's "seen" set: the sequence so far (the kernel adds to it)
    std::vector<unsigned char> seen((size_t)cfg_.vocab, 0);
    for (int32_t t : tokens_) seen[(size_t)t] = 1;
    TI_CUDA_CHECK(cudaMemcpyAsync(d_seen_, seen.data(), seen.size(), cudaMemcpyHostToDevice, stream_));
    TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  } else {
    TI_CUDA_CHECK(cudaMemsetAsync(d_seen_, 0, cfg_.vocab, stream_));
  }

  int64_t replays = n;
  if (pending_) {  // feed the pending token, sample the next: n full steps
    set_state(tokens_.back(), (int)(position() - 1), (int)step0);
  } else {  // sample from the prefill's logits first (its token was fed at position()-1)
    set_state(tokens_.back(), (int)(position() - 1), (int)step0);
    cuda::sample_token(logits_, (int)cfg_.vocab, d_sampling_, d_seen_, d_probs_, d_state_, d_out_, stream_, false);
    replays = n - 1;
  }
  last_decode_ms_ = gpu_ms([&] {
    for (int64_t i = 0; i < replays; i++) run_decode_step(stream_, position() + i);
  });
  TI_CUDA_CHECK(cudaMemcpyAsync(h_out_, d_out_, n * sizeof(int), cudaMemcpyDeviceToHost, stream_));
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));

  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; i++) {
    out.push_back(h_out_[i]);
    if (std::find(stop_ids.begin(), stop_ids.end(), h_out_[i]) != stop_ids.end()) break;
  }
  // The device ran past a stop token (at most one chunk of wasted work); the host state ends at the stop.
  // The last sampled token has not been fed: it is pending, as in the CPU engine.
  tokens_.insert(tokens_.end(), out.begin(), out.end());
  pending_ = true;
  return out;
}

// ---- measurement ----

double CudaEngine::time_decode_step(int64_t context, int steps) {
  if (context < 0 || context + steps >= max_seq_)
    fail(ErrorKind::Request, "time_decode_step: context + steps must be < max_seq_len");
  const double ms = time_steps(context, steps, [&](int64_t pos) { run_decode_step(stream_, pos); });
  reset();  // the cache now holds benchmark tokens
  return ms;
}

std::pair<std::vector<std::string>, std::vector<uint64_t>> CudaEngine::trace_step(int64_t context) {
  if (!d_trace_) fail(ErrorKind::Request, "trace_step: build the engine with CudaOptions.trace = True");
  if (context < 0 || context + 3 > max_seq_) fail(ErrorKind::Request, "trace_step: context must be <= max_seq_len - 3");
  kv_reserve(context + 3);  // (three warm-up steps from context on)
  *h_sampling_ = cuda::DeviceSampling{};
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  TI_CUDA_CHECK(cudaMemcpyAsync(d_sampling_, h_sampling_, sizeof(*h_sampling_), cudaMemcpyHostToDevice, stream_));
  set_state(1, (int)context, 0);
  for (int i = 0; i < 3; i++) run_decode_step(stream_, context + i);  // warm-up: the traced step follows others
  set_state(1, (int)context, 0);
  const size_t n = (size_t)(5 * cfg_.n_layers + 1) * cuda::kTraceBlocks * cuda::kTracePoints;
  TI_CUDA_CHECK(cudaMemsetAsync(d_trace_, 0, n * 8, stream_));
  run_decode_step(stream_, context);
  run_decode_step(stream_, context + 1);  // the traced step: the second, so that the one before overlaps as usual
  std::vector<uint64_t> t(n);
  TI_CUDA_CHECK(cudaMemcpyAsync(t.data(), d_trace_, n * 8, cudaMemcpyDeviceToHost, stream_));
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  reset();
  return {trace_names_, t};
}

double CudaEngine::time_attention(int64_t context, int reps) {
  if (context < 0 || context >= max_seq_) fail(ErrorKind::Request, "time_attention: context must be < max_seq_len");
  kv_reserve(context + 1);
  const ModelConfig& c = cfg_;
  set_state(1, (int)context, 0);
  auto run = [&] {
    for (int64_t l = 0; l < c.n_layers; l++)  // every layer's cache: L2-cold like the real step
      cuda::decode_attention(attn_params(l), stream_, pdl_);
  };
  const float ms = replay_ms([&] {
    for (int i = 0; i < reps; i++) run();
  });
  reset();
  return ms * 1e3 / (reps * c.n_layers);
}

}  // namespace ti
