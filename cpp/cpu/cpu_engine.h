// cpu_engine.h — the reference engine: the whole Llama forward pass in plain fp32 C++.
//
// It is the oracle every GPU kernel is checked against and the device="cpu" backend, so it is written to be
// obviously correct rather than fast: one loop nest per operation, threads (thread_pool.h) only across
// independent output rows / heads, so the thread count never changes a number. The weights stay in their stored
// precision (weights.h); each matrix row is widened to fp32 inside the matrix product. One sequence; tokens go
// in at position() and the KV cache grows with them.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "../core/config.h"
#include "kv_cache.h"
#include "thread_pool.h"
#include "../core/rope.h"
#include "../core/sampling.h"
#include "../core/weights.h"

namespace ti {

constexpr int64_t kMaxThreads = 1024;
int default_threads();  // std::thread::hardware_concurrency(), at least 1

class CpuEngine {
 public:
  // threads: 0 = the cores available (default_threads()), else 1..kMaxThreads (else ti::Error naming it).
  CpuEngine(std::shared_ptr<const WeightStore> weights, int64_t max_seq_len, int64_t threads = 0);
  int threads() const { return pool_->threads(); }
  size_t weight_bytes() const { return w_->bytes(); }  // host memory of the weights, as held

  const ModelConfig& config() const { return cfg_; }
  int64_t max_seq_len() const { return max_seq_; }
  // Tokens in the KV cache (a sampled token not yet fed counts: it is in the sequence).
  int64_t position() const { return (int64_t)tokens_.size(); }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  void reset();

  // Runs n tokens through the model at positions position()..position()+n-1 (the prefill path; n may be 1).
  // logits: (n, vocab) if all_logits, else (1, vocab) for the last token. Throws before touching any state
  // when a token id is out of range or the cache would overflow.
  void forward(const int32_t* tokens, int64_t n, bool all_logits, float* logits);

  // Decodes up to max_steps tokens back to back from the last logits: sample, append, run the model.
  // Stops after a token in stop_ids (included in the result). step0 is the sampler's counter for the first
  // token, so chunks of one generation continue one random stream.
  std::vector<int32_t> decode(int64_t max_steps, const SamplingConfig& s, const std::vector<int32_t>& stop_ids,
                              uint64_t step0);

 private:
  // The forward pass over m tokens at pos0.. ; logits of rows first_logit_row.. land in logits_buf_ (and the last
  // row in last_logits_); copied to `logits` too when it is not null.
  void run(const int32_t* tokens, int64_t m, int64_t pos0, int64_t first_logit_row, float* logits);
  void run_layer(int64_t layer, int64_t n, int64_t pos0);
  void attend(int64_t layer, int64_t t, int64_t head, int64_t pos0);

  std::shared_ptr<const WeightStore> w_;
  std::unique_ptr<ThreadPool> pool_;
  ModelConfig cfg_;
  int64_t max_seq_;
  KVCache kv_;
  RopeTable rope_;
  std::vector<int32_t> tokens_;
  TokenHistory history_{0};    // tokens_ as the penalties see them: forward() adds prompt, decode() generated
  bool has_last_ = false;      // last_logits_ holds the logits after tokens_ (minus pending_)
  bool pending_ = false;       // tokens_.back() was sampled but not yet run through the model
  std::vector<float> last_logits_;

  // Activations for a chunk of n tokens (RunState in llama2.c terms); resized on demand.
  std::vector<float> x_;    // (n, hidden) residual stream
  std::vector<float> xn_;   // (n, hidden) normed input of a block
  std::vector<float> q_;    // (n, q_dim)
  std::vector<float> k_;    // (n, kv_dim)
  std::vector<float> v_;    // (n, kv_dim)
  std::vector<float> att_;  // (n, q_dim) attention output
  std::vector<float> gate_; // (n, intermediate)
  std::vector<float> up_;   // (n, intermediate)
  std::vector<float> tmp_;  // (n, hidden) projection output before the residual add
  std::vector<float> logits_buf_;  // (rows, vocab)
  std::vector<float> scratch_;
  std::vector<int32_t> scratch_ids_;
};

// ---- the operations, exposed for the kernel tests (each GPU kernel's CPU twin) ----
// y (n, rows) = x (n, cols) @ W^T, W (rows, cols) row-major.
void matmul(float* y, const float* x, const float* W, int64_t n, int64_t rows, int64_t cols);
// y = x / sqrt(mean(x^2) + eps) * weight, for n rows of width d.
void rmsnorm(float* y, const float* x, const float* weight, int64_t n, int64_t d, float eps);
// gate = silu(gate) * up, elementwise.
void swiglu(float* gate, const float* up, int64_t count);

}  // namespace ti
