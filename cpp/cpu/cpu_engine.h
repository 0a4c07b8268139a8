// cpu_engine.h — the reference engine: the whole Llama forward pass in plain fp32 C++.
//
// It is the oracle every GPU kernel is checked against and the device="cpu" backend, so it is written to be
// obviously correct rather than fast: one loop nest per operation, threads (thread_pool.h) only across
// independent output rows / heads, so the thread count never changes a number. The weights stay in their stored
// precision (weights.h); each matrix row is widened to fp32 inside the matrix product.
//
// Two independent kinds of sequence: the single one (reset / forward / decode: tokens go in at position() and
// its KV cache grows with them) and max_batch sequence slots (seq_*, docs/BATCH_CONTRACT.md part 2) for a
// scheduler. Both run through the same forward pass, run(), whose rows each name the sequence they belong to
// (a RowSlot), so a token gives bit for bit the same logits alone, in a prefill chunk or in a batched step:
// every product is the same dot() per (row, weight row), and attention reads only the row's own cache.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "../core/batch_sample.h"
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
  // threads: 0 = the cores available (default_threads()), else 1..kMaxThreads; max_batch: 1..kMaxBatch
  // (else ti::Error naming it). act8: the GPU engine's CudaOptions::act8, its reference — the input of a quantized
  // product rounded as the GPU quantizes it to int8 (fp16, then d xq per group of 32: cuda/act8.cuh): 0 never,
  // -1 for int4 matrices, -2 for int4 matrices but down, 2 for every quantized matrix (1, the GPU's timed choice
  // per role, has no twin here: a Request error like any other value).
  CpuEngine(std::shared_ptr<const WeightStore> weights, int64_t max_seq_len, int64_t threads = 0,
            int64_t max_batch = 64, int act8 = 0);
  int act8() const { return act8_; }
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
  // Speculative decoding (core/draft.h): runs the pending token and draft[0..k) in one pass, then draws tokens as
  // decode() would while each equals the draft's next (1 to k + 1 of them, after a stop id none). The cache keeps
  // the drawn tokens but the last, which is pending, as decode() leaves it. Request error, nothing changed, on a
  // bad draft or sampling config, or a draft with no room for the token after it (check_draft).
  std::vector<int32_t> decode_draft(const int32_t* draft, int64_t k, const SamplingConfig& s,
                                    const std::vector<int32_t>& stop_ids, uint64_t step0);
  // Keeps the sequence's first n tokens (n < position(): all of them run through the model) and forgets the rest:
  // the history restarts as those n tokens, as prompt (seq_rewind's rule), and a forward() must come before a
  // decode. An answer cut short by a stop string in the middle of a call's tokens, so that a prompt extending it
  // finds them in the cache. n == position(): nothing changes. Request error, nothing changed, for n outside
  // 0..position().
  void rewind(int64_t n);

  // ---- sequence slots (docs/BATCH_CONTRACT.md part 2; cpu_sequences.cpp) ----
  // Every call checks all its arguments first and throws ti::Error(Request), changing nothing, on a slot out of
  // 0..max_batch-1 or not open (a parked sequence where a call takes one: seq_park), a token id out of range,
  // positions beyond max_seq_len or the free pages, a slot listed twice, or a step / sample on a slot with no
  // logits yet (no prefill ran in it).
  int64_t max_batch() const { return (int64_t)slots_.size(); }
  int64_t seq_open();                      // the lowest free slot, empty; a Request error when all are taken
  void seq_close(int64_t slot);            // frees its KV pages, logits and history (or a parked sequence's)
  int64_t seq_length(int64_t slot) const;  // positions in its cache (a slot's or a parked sequence's)
  // Keeps the first n positions of the slot's cache, which must hold tokens[0..n) (else a Request error, nothing
  // changed), and forgets the rest: their pages, the logits (a prefill must follow before a step or a sample) and
  // the history, which restarts as those n tokens, as prompt (a new request reusing a cached prefix). Cut inside a
  // page another slot shares, the slot gets a copy of that page of its own first.
  void seq_rewind(int64_t slot, const int32_t* tokens, int64_t n);
  // What seq_rewind(slot, n) would change kv_pages_free by (the GPU engine's accounting, the same here).
  int64_t seq_rewind_frees(int64_t slot, int64_t n) const;
  // dst (open, another slot) drops what it held and takes the first n positions of src's cache, which must hold
  // tokens[0..n) (else a Request error, nothing changed): the pages wholly below n shared with src, the last,
  // partly filled one copied; no logits (a prefill must follow), its history those n tokens as prompt. A request
  // sharing a prefix with one still running (the scheduler's prefix cache; llama.cpp's seq_cp).
  void seq_copy(int64_t dst, int64_t src, const int32_t* tokens, int64_t n);
  // The pages only these slots or parked sequences hold (what closing them all would free): the prefix cache's share.
  int64_t kv_pages_held_by(const int64_t* slots, int64_t n) const;
  // The slot's cache kept without its slot, as a parked sequence (the id returned, max_batch and up): its pages,
  // positions and tokens stay where they are, the slot closes (seq_open gives it out again). seq_copy copies from
  // the id, seq_length and kv_pages_held_by take it, seq_close drops it; nothing runs in it. The scheduler's
  // prefix cache keeps ended requests' caches so: they take pages, not slots (llama.cpp's sequences outside the
  // batch, vLLM's cached blocks).
  int64_t seq_park(int64_t slot);
  // tokens[0..n) join the slot's history as generated (TokenHistory::add_generated each): a preempted request's
  // answer so far, prefilled again as prompt. Request error, nothing changed, for a bad slot or token.
  void seq_mark_generated(int64_t slot, const int32_t* tokens, int64_t n);
  // A prompt chunk at seq_length(slot)..: fills the cache, keeps the last token's logits as the slot's logits and
  // adds the tokens to its history as prompt. all_logits (may be null): every token's logits too, (n, vocab)
  // (prompt logprobs).
  void seq_prefill(int64_t slot, const int32_t* tokens, int64_t n, float* all_logits = nullptr);
  // seq_prefill of n sequences: tokens[i] (lens[i] of them) in slots[i] (distinct, open); everything checked
  // before any runs. The reference loops over them (so each slot's logits are exactly its seq_prefill's).
  void seq_prefill_many(const int64_t* slots, const int32_t* const* tokens, const int64_t* lens, int64_t n);
  // One decode step of n distinct slots in one forward pass: tokens[i] at seq_length(slots[i]) in slots[i]; each
  // slot's logits become the new ones (the token is not added to the history: seq_sample did that).
  void seq_step(const int64_t* slots, const int32_t* tokens, int64_t n);
  // seq_step of step_slots, then seq_prefill_many of slots (distinct from them), both checked before either
  // runs: the reference for the GPU engine's mixed pass (one pass for both there).
  void seq_mixed(const int64_t* step_slots, const int32_t* step_tokens, int64_t n_step, const int64_t* slots,
                 const int32_t* const* tokens, const int64_t* lens, int64_t n);
  // The next token of each slot from its logits (sample_row with cfgs[i] at RNG counter steps[i]), added to the
  // slot's history as generated; k = top_logprobs entries per row (0..kMaxTopLogprobs).
  BatchSample seq_sample(const int64_t* slots, const SamplingConfig* cfgs, const uint64_t* steps, int64_t n, int k);
  // The slot's logits after its last token (vocab floats; empty before its first prefill). The reference
  // engine's window for tests: the batched numbers checked bit for bit against the single sequence's.
  const std::vector<float>& seq_logits(int64_t slot) const { return open_slot(slot).logits; }
  // KV pages of kv_page_size() positions. A slot holds ceil(seq_length / page) of them, allocated as it grows
  // (those it shares with another slot, seq_copy's, counted once);
  // the total is what max_batch slots of max_seq_len would hold, max_batch * ceil(max_seq_len / page), so the
  // slots alone never run out before max_seq_len (the pages come from the heap, not a fixed pool). Parked
  // sequences' pages count too: a call that would take more than are free is refused (a Request error, nothing
  // changed), as the GPU's pool refuses it. The single sequence's cache is not counted.
  int64_t kv_page_size() const { return kCpuKvPageSize; }
  int64_t kv_pages_total() const { return max_batch() * KVCache::pages_for(max_seq_); }
  int64_t kv_pages_free() const { return kv_pages_total() - slot_pages_; }

 private:
  // One row of a forward pass: the cache it attends over (positions 0..pos) and writes its key/value into at pos.
  // The cache must already cover pos (KVCache::reserve).
  struct RowSlot {
    KVCache* kv;
    int64_t pos;
  };
  // The forward pass over m tokens, token t at rows[t]; logits of rows first_logit_row.. land in logits_buf_,
  // (m - first_logit_row, vocab), and are copied to `logits` too when it is not null.
  void run(const int32_t* tokens, const RowSlot* rows, int64_t m, int64_t first_logit_row, float* logits);
  void run_layer(int64_t layer, const RowSlot* rows, int64_t n);
  void attend(int64_t layer, int64_t t, int64_t head, const RowSlot& row);
  // x (n, K) rounded in place for a product with a matrix of format f (act8_ above; normed: an RMSNorm's output,
  // which the GPU takes as int8 only up to K = 8,192; down: the down projection's input, which -2 leaves alone).
  // Each buffer rounded here feeds matrices of one format only.
  void act8_inputs(float* x, int64_t n, int64_t K, WFormat f, bool normed, bool down = false) const;
  // The single sequence's tokens [pos0, pos0 + m) through run(); its last logits kept in last_logits_.
  void run_single(const int32_t* tokens, int64_t m, int64_t pos0, int64_t first_logit_row, float* logits);

  std::shared_ptr<const WeightStore> w_;
  std::unique_ptr<ThreadPool> pool_;
  ModelConfig cfg_;
  int64_t max_seq_;
  int act8_ = 0;
  KVCache kv_;                 // the single sequence's
  std::vector<RowSlot> rows_;  // run()'s row list, reused
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

  // One sequence slot's state; null in slots_ while the slot is free.
  struct Slot {
    explicit Slot(const ModelConfig& c) : kv(c.n_layers, c.n_kv_heads, c.head_dim), history(c.vocab) {}
    KVCache kv;
    std::vector<int32_t> tokens;  // the positions in kv
    std::vector<float> logits;    // (vocab) after tokens.back(); empty until the first prefill
    TokenHistory history;         // the penalties' state: prompt and generated tokens
  };
  bool is_open(int64_t slot) const { return slots_[(size_t)slot] != nullptr; }  // slot in range
  const Slot& open_slot(int64_t slot) const;  // checked: exists and is open
  Slot& open_slot(int64_t slot);
  bool is_parked(int64_t id) const {
    const int64_t i = id - max_batch();
    return i >= 0 && i < (int64_t)parked_.size() && parked_[(size_t)i] != nullptr;
  }
  const Slot& held(int64_t id) const;  // checked: an open slot or a parked sequence
  void check_batch(const char* what, const int64_t* slots, int64_t n) const;  // check_batch_slots over slots_
  void check_step(const char* what, const int64_t* slots, const int32_t* tokens, int64_t n) const;  // + ids, room
  // The new pages slots[i] growing by adds[i] positions take (of open slots; n_step of them by one position each,
  // then n by lens[i]), and a Request error when more than kv_pages_free() (the GPU's require_pages).
  void require_pages(const char* what, const int64_t* step_slots, int64_t n_step, const int64_t* slots,
                     const int64_t* lens, int64_t n) const;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<std::unique_ptr<Slot>> parked_;  // parked sequence max_batch + i at i; null while free
  int64_t slot_pages_ = 0;  // KV pages the slots and parked sequences hold (each shared one once)
};

// ---- the operations, exposed for the kernel tests (each GPU kernel's CPU twin) ----
// y (n, rows) = x (n, cols) @ W^T, W (rows, cols) row-major.
void matmul(float* y, const float* x, const float* W, int64_t n, int64_t rows, int64_t cols);
// y = x / sqrt(mean(x^2) + eps) * weight, for n rows of width d.
void rmsnorm(float* y, const float* x, const float* weight, int64_t n, int64_t d, float eps);
// gate = silu(gate) * up, elementwise.
void swiglu(float* gate, const float* up, int64_t count);

}  // namespace ti
