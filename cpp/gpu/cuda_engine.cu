// cuda_engine.cu — the GPU engine's lifecycle, prefill and decode (see cuda_engine.h for the parts).
#include "cuda_engine.h"

#include <algorithm>
#include <chrono>

#include "../../cuda/attention.cuh"
#include "../../cuda/batch_rows.cuh"
#include "../../cuda/common.cuh"
#include "../../cuda/prefill_attention.cuh"
#include "../core/draft.h"
#include "../core/engine_checks.h"
#include "../core/errors.h"

namespace ti {

// ---- lifecycle ----

CudaEngine::CudaEngine(const ModelConfig& config, int64_t max_seq_len, CudaOptions opt,
                       const std::function<void(WeightStream&)>& load)
    : cfg_(config), max_seq_(max_seq_len), opt_(std::move(opt)) {
  cfg_.validate();
  build([&] {
    WeightStream s(*weights_, cfg_, stream_);
    load(s);
    s.finish();
  });
}

CudaEngine::CudaEngine(const ModelConfig& config, int64_t max_seq_len, uint64_t seed, CudaOptions opt)
    : cfg_(config), max_seq_(max_seq_len), opt_(std::move(opt)) {
  cfg_.validate();
  build([&] { weights_->randomize(seed); });
}

// Load: device, memory, weights, the GEMV plan, the decode graphs. A constructor that throws never runs the
// destructor: free what was taken so far, so that a failed load (out of memory, say) leaves the GPU as it found
// it and the next, smaller load can succeed.
void CudaEngine::build(const std::function<void()>& fill_weights) {
  try {
    init_device();
    allocate();
    using Clock = std::chrono::steady_clock;
    auto since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
    Clock::time_point t0 = Clock::now();
    fill_weights();
    load_times_.weights_s = since(t0);
    tune();
    load_times_.tune_s = tune_s_[0] + tune_s_[2];  // the GEMV plan + the long-context graph decision
    load_times_.graphs_s = tune_s_[1];
  } catch (...) {
    release();
    throw;
  }
}

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
  check_options(opt_, cfg_);
  TI_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  clock_ = std::make_unique<StreamClock>(stream_, opt_.graphs);
}

void CudaEngine::allocate() {
  weights_ = std::make_unique<DeviceWeights>(cfg_, opt_.weights, arena_, stream_);
  const int P = opt_.kv_page_size;
  pool_ = std::make_unique<KvPagePool>(opt_.kv_pool_pages ? opt_.kv_pool_pages : default_pool_pages(), P,
                                       opt_.kv_page_shuffle);
  seq_ = std::make_unique<KvSequence>(*pool_, max_seq_);
  dbuf_ = DecodeBuffers::allocate(cfg_, *weights_, max_seq_, opt_.attn_chunk, *pool_, opt_.trace, arena_, stream_);
  step_ = std::make_unique<DecodeStep>(cfg_, *weights_, dbuf_, plan_, opt_.attn_tensor_cores);
  h_state_ = arena_.alloc_pinned_n<cuda::DecodeState>(1);
  h_sampling_ = arena_.alloc_pinned_n<cuda::DeviceSampling>(1);
  h_bias_ = arena_.alloc_pinned_n<cuda::LogitBias>((size_t)kMaxLogitBias);
  h_mask_ = arena_.alloc_pinned_n<uint32_t>((size_t)mask_words(cfg_.vocab));
  h_out_ = arena_.alloc_pinned_n<int>((size_t)max_seq_);
  history_ = TokenHistory(cfg_.vocab);
  *h_state_ = cuda::DecodeState{};
  *h_sampling_ = cuda::DeviceSampling{};
  TI_CUDA_CHECK(cudaMemcpyAsync(dbuf_.state, h_state_, sizeof(*h_state_), cudaMemcpyHostToDevice, stream_));
  TI_CUDA_CHECK(cudaMemcpyAsync(dbuf_.sampling, h_sampling_, sizeof(*h_sampling_), cudaMemcpyHostToDevice, stream_));

  // cuBLASLt: the batched prefill's products and the batched decode step's large fp16 ones.
  constexpr size_t kWorkspace = 32u << 20;
  gemm_ = std::make_unique<cuda::Gemm>(kWorkspace);
  gemm_->autotune = opt_.gemm_autotune;
  gemm_->tune_cold = opt_.gemm_tune_cold;
  arena_.count(DeviceArena::Kind::Scratch, kWorkspace);
  allocate_batch();

  // The batched prefill's activations, sized for one chunk of min(prefill_chunk, max_seq) tokens (else prompts
  // go token by token through the decode pass).
  if (!opt_.batched_prefill || !cuda::prefill_attention_supported((int)cfg_.head_dim)) return;
  if (opt_.prefill_chunk < 1) fail(ErrorKind::Request, "prefill_chunk must be >= 1");
  pbuf_ = PrefillBuffers::allocate(cfg_, *weights_, (int)std::min<int64_t>(opt_.prefill_chunk, max_seq_), arena_);
  prefill_ = std::make_unique<PrefillStep>(cfg_, *weights_, dbuf_, pbuf_, plan_, *gemm_, stream_);
}

void CudaEngine::release() {
  if (stream_) cudaStreamSynchronize(stream_);
  for (cudaGraphExec_t g : {g_prompt_token_, g_decode_, g_decode_long_, g_decode_one_, persistent_graph_})
    if (g) cudaGraphExecDestroy(g);
  g_prompt_token_ = g_decode_ = g_decode_long_ = g_decode_one_ = persistent_graph_ = nullptr;
  persistent_.reset();
  for (std::vector<cudaGraphExec_t>* gs : {&g_batch_, &g_draft_}) {
    for (cudaGraphExec_t& g : *gs)
      if (g) cudaGraphExecDestroy(g);
    gs->clear();
  }
  batch_.reset();
  slots_.clear();
  parked_.clear();
  h_sample_in_ = h_sample_out_ = nullptr;
  for (cudaEvent_t* e : {&sample_in_read_, &sampled_}) {
    if (*e) cudaEventDestroy(*e);
    *e = nullptr;
  }
  prefill_.reset();
  step_.reset();
  weights_.reset();
  gemm_.reset();
  arena_.release();
  h_state_ = nullptr;
  h_sampling_ = nullptr;
  h_bias_ = nullptr;
  h_mask_ = nullptr;
  h_out_ = nullptr;
  clock_.reset();
  if (stream_) cudaStreamDestroy(stream_);
  stream_ = nullptr;
  cudaGetLastError();  // leave no sticky error behind
}

CudaEngine::~CudaEngine() { release(); }

std::pair<std::vector<uint8_t>, std::vector<uint8_t>> CudaEngine::matrix_bytes(int64_t layer, MatrixRole role) const {
  if (role != MatrixRole::LmHead && (layer < 0 || layer >= cfg_.n_layers))
    fail(ErrorKind::Request, "matrix_bytes: layer " + std::to_string(layer) + " out of range");
  const cuda::QMat& m = role_matrix(*weights_, role, layer);
  const size_t row_q = m.fmt == WFormat::F16 ? (size_t)m.ld * 2 : (size_t)m.ld;
  std::vector<uint8_t> q((size_t)m.rows * row_q), sc((size_t)(m.rows * WeightStream::scale_row_bytes(m.fmt, m.K)));
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  TI_CUDA_CHECK(cudaMemcpy(q.data(), m.q, q.size(), cudaMemcpyDeviceToHost));
  if (!sc.empty()) TI_CUDA_CHECK(cudaMemcpy(sc.data(), m.scales, sc.size(), cudaMemcpyDeviceToHost));
  return {q, sc};
}

// ---- running tokens ----

void CudaEngine::debug_skew_persistent_epoch(int by) {
  if (!persistent_) fail(ErrorKind::Request, "debug_skew_persistent_epoch: no persistent decode step");
  persistent_->skew_epoch(by, stream_);
}

std::vector<float> CudaEngine::last_logits() {
  std::vector<float> out((size_t)cfg_.vocab);
  TI_CUDA_CHECK(cudaMemcpyAsync(out.data(), dbuf_.logits, out.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return out;
}

void CudaEngine::set_state(int token, int pos, int step) {
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // h_state_ may still be read by an earlier copy
  *h_state_ = cuda::DecodeState{token, pos, step, step};
  TI_CUDA_CHECK(cudaMemcpyAsync(dbuf_.state, h_state_, sizeof(*h_state_), cudaMemcpyHostToDevice, stream_));
}

void CudaEngine::upload_sampling(const SamplingConfig& s) {
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // h_sampling_ / h_bias_ / h_mask_ may still be read by a copy
  *h_sampling_ = device_sampling(s);
  TI_CUDA_CHECK(cudaMemcpyAsync(dbuf_.sampling, h_sampling_, sizeof(*h_sampling_), cudaMemcpyHostToDevice, stream_));
  if (!s.bias_ids.empty()) {
    device_bias(s, h_bias_);
    TI_CUDA_CHECK(cudaMemcpyAsync(dbuf_.bias, h_bias_, s.bias_ids.size() * sizeof(cuda::LogitBias),
                                  cudaMemcpyHostToDevice, stream_));
  }
  if (!s.allowed.empty()) {  // (validated: mask_words(vocab) words)
    std::copy(s.allowed.begin(), s.allowed.end(), h_mask_);
    TI_CUDA_CHECK(cudaMemcpyAsync(dbuf_.mask, h_mask_, s.allowed.size() * sizeof(uint32_t), cudaMemcpyHostToDevice,
                                  stream_));
  }
}

void CudaEngine::run_prompt_token() {
  if (graphs_ok_) TI_CUDA_CHECK(cudaGraphLaunch(g_prompt_token_, stream_));
  else step_->record_token_logits(stream_, pdl_);
}

void CudaEngine::run_decode_step(int64_t pos, DecodePath path) {
  const bool one_chunk = opt_.one_chunk_graph && pos < dbuf_.attn_chunk;
  if (persistent_graph_ && path != DecodePath::Graph) TI_CUDA_CHECK(cudaGraphLaunch(persistent_graph_, stream_));
  else if (!graphs_ok_) step_->record(stream_, pdl_, one_chunk);
  else if (one_chunk) TI_CUDA_CHECK(cudaGraphLaunch(g_decode_one_, stream_));
  else TI_CUDA_CHECK(cudaGraphLaunch(g_decode_long_ && pos >= plan_.long_from ? g_decode_long_ : g_decode_, stream_));
}

// Pages for positions [0, positions) from the pool, their table entries copied ahead of the work that reads them
// (stream order). All or nothing: a pool too small throws a Request error and changes nothing.
void CudaEngine::kv_reserve(int64_t positions) {
  const int64_t first = seq_->grow(*pool_, positions), n = seq_->pages() - first;
  if (n > 0)  // (from pageable memory: staged before the call returns)
    TI_CUDA_CHECK(cudaMemcpyAsync(dbuf_.page_table + first, seq_->table().data() + first, (size_t)n * sizeof(int),
                                  cudaMemcpyHostToDevice, stream_));
}

void CudaEngine::reset() {
  seq_->release(*pool_);  // (the device table keeps stale entries: no kernel reads past its position)
  tokens_.clear();
  history_.clear();
  has_logits_ = pending_ = false;
}

void CudaEngine::run_pass(const int32_t* seq, int64_t m, int64_t pos0, int64_t first, float* host_rows) {
  const int64_t V = cfg_.vocab;
  if (prefill_) {
    for (int64_t c0 = 0; c0 < m; c0 += prefill_->rows()) {
      const int T = (int)std::min<int64_t>(prefill_->rows(), m - c0);
      prefill_->run_chunk(seq + c0, T, (int)(pos0 + c0), host_rows, c0 - first);
    }
    return;
  }
  for (int64_t i = 0; i < m; i++) {  // one token at a time through the decode pass
    set_state(seq[i], (int)(pos0 + i), 0);
    run_prompt_token();
    if (host_rows && i >= first)
      TI_CUDA_CHECK(cudaMemcpyAsync(host_rows + (i - first) * V, dbuf_.logits, V * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream_));
  }
}

void CudaEngine::forward(const int32_t* tokens, int64_t n, bool all_logits, float* logits) {
  check_tokens(tokens, n, cfg_.vocab);
  check_room(position(), n, max_seq_);
  kv_reserve(position() + n);
  std::vector<int32_t> seq;
  if (pending_) seq.push_back(tokens_.back());
  seq.insert(seq.end(), tokens, tokens + n);
  const int64_t pos0 = position() - (pending_ ? 1 : 0), first = (int64_t)seq.size() - n;
  run_pass(seq.data(), (int64_t)seq.size(), pos0, first, logits && all_logits ? logits : nullptr);
  if (logits && !all_logits)
    TI_CUDA_CHECK(cudaMemcpyAsync(logits, dbuf_.logits, cfg_.vocab * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  tokens_.insert(tokens_.end(), tokens, tokens + n);
  for (int64_t i = 0; i < n; i++) history_.add_prompt(tokens[i]);
  pending_ = false;
  has_logits_ = true;
}

std::vector<int32_t> CudaEngine::decode(int64_t max_steps, const SamplingConfig& s,
                                        const std::vector<int32_t>& stop_ids, uint64_t step0) {
  validate(s, cfg_.vocab);
  if (!has_logits_) fail(ErrorKind::Request, "decode: run a prompt through forward() first");
  if (max_steps < 1) return {};
  const int64_t room = max_seq_ - position();
  if (room < 1) fail(ErrorKind::Request, "the sequence reached max_seq_len=" + std::to_string(max_seq_));
  const int64_t n = std::min(max_steps, room);
  kv_reserve(position() + n);  // the steps write positions up to position() + n - 2

  upload_sampling(s);
  // The penalties' history: the sequence so far (the kernel adds each token it samples). Read by the kernel only
  // when a penalty is on, so uploaded only then.
  if (s.repetition_penalty != 1.0f || s.presence_penalty != 0.0f || s.frequency_penalty != 0.0f) {
    TI_CUDA_CHECK(cudaMemcpyAsync(dbuf_.seen, history_.seen.data(), history_.seen.size(), cudaMemcpyHostToDevice,
                                  stream_));
    TI_CUDA_CHECK(cudaMemcpyAsync(dbuf_.counts, history_.counts.data(), history_.counts.size() * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, stream_));
    TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  int64_t replays = n;
  set_state(tokens_.back(), (int)(position() - 1), (int)step0);
  if (!pending_) {  // sample from the prefill's logits first (its token was fed at position()-1)
    cuda::sample_token(dbuf_.logits, (int)cfg_.vocab, dbuf_.sampling, dbuf_.bias, dbuf_.mask, dbuf_.seen, dbuf_.counts,
                       dbuf_.probs, dbuf_.state, dbuf_.out, stream_, false);
    replays = n - 1;
  }  // else: feed the pending token, sample the next: n full steps
  last_decode_ms_ = clock_->gpu_ms([&] {
    for (int64_t i = 0; i < replays; i++) run_decode_step(position() + i);
  });
  TI_CUDA_CHECK(cudaMemcpyAsync(h_out_, dbuf_.out, n * sizeof(int), cudaMemcpyDeviceToHost, stream_));
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (persistent_) persistent_->check(stream_);  // a timed-out wait: an error, not silently wrong tokens

  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; i++) {
    out.push_back(h_out_[i]);
    if (std::find(stop_ids.begin(), stop_ids.end(), h_out_[i]) != stop_ids.end()) break;
  }
  // The device ran past a stop token (at most one chunk of wasted work); the host state ends at the stop.
  // The last sampled token has not been fed: it is pending, as in the CPU engine.
  tokens_.insert(tokens_.end(), out.begin(), out.end());
  for (int32_t t : out) history_.add_generated(t);
  pending_ = true;
  return out;
}

// The draft's pass: the prefill's (cuBLASLt GEMMs over its rows; ~2 decode steps for up to 16 rows on an H200's
// TinyLlama) or, with CudaOptions::draft_pass 1, the batched decode step's over one slot's consecutive positions
// (predicted ~1.4 steps at 8 rows; docs/perf/speculative.md). Its tokens are drawn on the host by the reference
// sampler.
std::vector<int32_t> CudaEngine::decode_draft(const int32_t* draft, int64_t k, const SamplingConfig& s,
                                              const std::vector<int32_t>& stop_ids, uint64_t step0) {
  check_draft(s, cfg_.vocab, has_logits_, draft, k, position(), max_seq_);
  const int64_t V = cfg_.vocab, pos0 = position() - (pending_ ? 1 : 0);
  kv_reserve(position() + k);  // the pass writes positions up to position() + k - 1
  const std::vector<int32_t> seq = draft_pass_tokens(tokens_, pending_, draft, k);
  // row 0: the logits before the pass (read without a pending token), then the pass's rows
  std::vector<float> logits((size_t)(seq.size() + 1) * V);
  TI_CUDA_CHECK(cudaMemcpyAsync(logits.data(), dbuf_.logits, V * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  const int64_t m = (int64_t)seq.size();
  if (opt_.draft_pass == 1 && m <= bbuf_.max_rows) draft_pass_rows(seq.data(), m, pos0, logits.data() + V);
  else run_pass(seq.data(), m, pos0, 0, logits.data() + V);
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const std::vector<const float*> rows = draft_rows(logits.data(), V, k, pending_);
  std::vector<int32_t> out =
      accept_draft(rows.data(), V, s, draft, k, stop_ids, step0, history_, draft_scratch_, draft_scratch_ids_);
  // dbuf_.logits: those the pending token was drawn from, as decode() leaves them (last_logits())
  TI_CUDA_CHECK(cudaMemcpyAsync(dbuf_.logits, rows[out.size() - 1], V * sizeof(float), cudaMemcpyHostToDevice,
                                stream_));
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // (from pageable memory that is freed on return)
  tokens_.insert(tokens_.end(), out.begin(), out.end());
  pending_ = true;
  return out;
}

void CudaEngine::rewind(int64_t n) {
  check_single_rewind(n, position());
  if (n == position()) return;
  tokens_.resize((size_t)n);  // (the last kept one was run: only the last of all could be pending)
  history_.restart(tokens_);
  has_logits_ = pending_ = false;
}

}  // namespace ti
