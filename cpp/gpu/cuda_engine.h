// cuda_engine.h — the GPU engine: lifecycle, prefill, decode. Same contract as CpuEngine (one sequence;
// forward() runs prompt tokens at position(); decode() samples and runs tokens back to back) so the Python
// Engine drives either. Its options: cuda_options.h; its tuning step at load: cuda_engine_tune.cu; its sequence
// slots: cuda_engine_slots.cu. The work lives in its parts, read in this order:
//   decode_step.*     THE decode pass (one token, a flat list of launches), captured once into CUDA graphs
//   batch_step.*      THE batched decode pass (one token for each of many sequence slots), a graph per bucket
//   decode_persistent.*  the same pass as one persistent kernel (CudaOptions::decode_path), captured with the sampler
//   prefill_step.*    the batched prefill pass (cuBLASLt GEMMs + tiled causal attention), chunk by chunk
//   device_weights.*  the weights on the device (allocation, quantization); weight_stream.* the load
//   gemv_plan.*       the load-time GEMV tuner's result (plain data) and the tuner
//   measure.*         GPU timing and graph capture; the measurement entry points below
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../../cuda/gemm.cuh"
#include "../core/batch_sample.h"
#include "../core/config.h"
#include "../core/sample_step.h"
#include "../core/sampling.h"
#include "../core/weights.h"
#include "cuda_options.h"
#include "decode_persistent.h"
#include "batch_step.h"
#include "decode_step.h"
#include "device_weights.h"
#include "gemv_plan.h"
#include "kv_pages.h"
#include "measure.h"
#include "prefill_step.h"
#include "weight_stream.h"

namespace ti {

class CudaEngine {
 public:
  // The weights streamed from the file: load(s) hands every tensor to s in its stored form (weight_stream.h);
  // an exception from it (or a missing tensor) frees everything taken so far and propagates.
  CudaEngine(const ModelConfig& config, int64_t max_seq_len, CudaOptions opt,
             const std::function<void(WeightStream&)>& load);
  // Random weights at the config's shape, generated on the device (benchmarks: speed does not depend on values).
  CudaEngine(const ModelConfig& config, int64_t max_seq_len, uint64_t seed, CudaOptions opt = {});
  ~CudaEngine();
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;

  const ModelConfig& config() const { return cfg_; }
  int64_t max_seq_len() const { return max_seq_; }
  int64_t position() const { return (int64_t)tokens_.size(); }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  void reset();
  // Prompt tokens at position(): the batched prefill (or token by token); logits of the last (or every) token.
  void forward(const int32_t* tokens, int64_t n, bool all_logits, float* logits);
  std::vector<int32_t> decode(int64_t max_steps, const SamplingConfig& s, const std::vector<int32_t>& stop_ids,
                              uint64_t step0);
  // Speculative decoding, as CpuEngine::decode_draft: the pending token and the draft through the prefill pass or,
  // with CudaOptions::draft_pass 1, the batched step's (every row's logits to the host), the tokens drawn there by
  // the reference sampler (core/draft.h).
  std::vector<int32_t> decode_draft(const int32_t* draft, int64_t k, const SamplingConfig& s,
                                    const std::vector<int32_t>& stop_ids, uint64_t step0);
  void rewind(int64_t n);  // as CpuEngine::rewind (the pages past n stay the sequence's)

  // The logits of the last pass (a prefill's last row, a prompt token, or decode()'s last step): (vocab).
  std::vector<float> last_logits();

  // ---- measurement (measure.cu) ----
  double last_decode_ms() const { return last_decode_ms_; }  // GPU time of the last decode()'s steps
  const GemvPlan& gemv_plan() const { return plan_; }
  // ---- the GEMV plan across runs (plan_cache.h; the Python Engine keeps the file) ----
  // What a saved plan must have been made for: GPU, driver, build, model shape, weight format, and the options
  // that change what the tuners time or pick (device 0 is queried; pins are not part of it: they apply after).
  static std::string plan_key(const ModelConfig& c, int64_t max_seq_len, const CudaOptions& o);
  std::string plan_text() const;  // the plan to save; "" where pins changed it (then it is not this key's plan)
  bool plan_from_cache() const { return plan_cached_; }          // CudaOptions::plan_text was taken
  const std::string& plan_problem() const { return plan_problem_; }  // why plan_text was refused ("": it was not)
  // Seconds spent at load on the GEMV plan (tuned or read), the decode graphs, and the long-context decision.
  double tune_seconds() const { return tune_s_[0] + tune_s_[1] + tune_s_[2]; }
  const double* tune_parts() const { return tune_s_; }  // {plan, graphs, long-context}
  // ---- sequence slots (docs/BATCH_CONTRACT.md §2): many sequences, one decode step for all of them ----
  int64_t max_batch() const { return opt_.max_batch; }
  int64_t seq_open();                      // a free, empty slot; Request error when all are taken
  void seq_close(int64_t slot);            // its pages back to the pool, its history cleared (or a parked one's)
  int64_t seq_length(int64_t slot) const;  // positions in its cache (a slot's or a parked sequence's)
  // Keeps the slot's first n positions, which hold tokens[0..n) (the caller's word: the device does not keep the
  // tokens; the CPU engine checks them), and forgets the rest: the pages past them back to the pool (those no
  // other slot shares), its logits (a prefill must follow), and its history, which restarts as those tokens, as
  // prompt. Cut inside a page another slot shares, that page is copied into one of its own first. Request error,
  // nothing changed, when n is not in 0..seq_length(slot), a token is out of range or that copy finds no page free.
  void seq_rewind(int64_t slot, const int32_t* tokens, int64_t n);
  // What seq_rewind(slot, n) would change the free pages by: the pages it gives back, less the one a shared
  // page's copy takes. Request error as seq_rewind for a bad slot or n. The scheduler's page accounting.
  int64_t seq_rewind_frees(int64_t slot, int64_t n) const;
  // dst (open, another slot) drops what it held and takes the first n positions of src (an open slot or a parked
  // sequence), which hold tokens[0..n) (the caller's word, as seq_rewind): the pages wholly below n shared with
  // src (KvSequence::share: nothing copied; neither writes below its length), the last, partly filled one copied
  // into a page of its own on the
  // stream (src may have work in flight: stream order); no logits (a prefill must follow), its history those
  // tokens as prompt. Request error, nothing changed, when dst == src, n is not in 0..seq_length(src), a token is
  // out of range or that page finds none free. A request sharing a prefix with one still running or kept (the
  // scheduler's prefix cache).
  void seq_copy(int64_t dst, int64_t src, const int32_t* tokens, int64_t n);
  // The pages only these slots or parked sequences hold (closing them all would free them): the prefix cache's
  // share of the pool. Request error for an id that is neither.
  int64_t kv_pages_held_by(const int64_t* slots, int64_t n) const;
  // The slot's cache kept without its slot, as a parked sequence (the id returned, max_batch and up): its
  // KvSequence (pages, length) moves out of the slot, which closes (seq_open gives it out again) with an empty
  // one. seq_copy copies from the id, seq_length and kv_pages_held_by take it, seq_close drops it; nothing runs in
  // it (no device table, no history). The scheduler's prefix cache: ended requests' caches take pages, not slots.
  int64_t seq_park(int64_t slot);
  // tokens[0..n) join the slot's history as generated (the presence / frequency penalties count them; each as the
  // sampler adds a token it draws): a preempted request's answer so far, prefilled again as prompt. Request error,
  // nothing changed, for a bad slot, a token out of range or more than max_seq_len tokens.
  void seq_mark_generated(int64_t slot, const int32_t* tokens, int64_t n);
  // Prompt tokens at seq_length(slot)..: the batched prefill through the slot's page table; the last token's
  // logits become the slot's; the tokens join its history as prompt. Request error, nothing changed, when the
  // pages run out or max_seq_len would be passed. Returns once launched (the next syncing call waits), unless
  // all_logits (may be null): every token's logits too, (n, vocab) on the host, there when it returns (prompt
  // logprobs).
  void seq_prefill(int64_t slot, const int32_t* tokens, int64_t n, float* all_logits = nullptr);
  // seq_prefill of n sequences at once: tokens[i] (lens[i] of them) in slots[i] (distinct, open). Their tokens
  // share batched passes (PrefillStep::run_many: one weight read per pass of up to prefill_chunk tokens; a
  // prompt may span two passes). The same checks as seq_prefill for the whole call before anything runs
  // (pages: the sum of what every slot needs). Returns once launched (the next syncing call waits).
  void seq_prefill_many(const int64_t* slots, const int32_t* const* tokens, const int64_t* lens, int64_t n);
  // tokens[i] at seq_length(slots[i]) in slots[i] (distinct, open), all in one batched step (a graph of the
  // bucket of n, padded); each slot's logits become the new ones.
  void seq_step(const int64_t* slots, const int32_t* tokens, int64_t n);
  // seq_step of step_slots and seq_prefill_many of slots in ONE pass (the scheduler's mixed step): the decode
  // rows first, then the prompts' tokens, their products over all the pass's rows (every weight read once for
  // both) and every row's logits from one LM-head GEMM over the gathered last rows (row i for step_slots[i],
  // n_step + i for slots[i]). Each slot ends as those two calls would leave it; the decode rows' arithmetic is
  // the prefill pass's (cuBLASLt at the pass's rows, the varlen attention), not the bucket graph's. All slots
  // distinct; everything checked first (an error changes nothing). Returns once launched, as seq_step (the
  // next syncing call waits). Without the batched prefill: seq_step, then seq_prefill_many.
  void seq_mixed(const int64_t* step_slots, const int32_t* step_tokens, int64_t n_step, const int64_t* slots,
                 const int32_t* const* tokens, const int64_t* lens, int64_t n);
  // The next token of each slot from its logits (adds it to the slot's history as generated); steps[i]: the
  // RNG counter. k: top logprobs per row, 0..20.
  BatchSample seq_sample(const int64_t* slots, const SamplingConfig* cfgs, const uint64_t* steps, int64_t n, int k);
  // seq_sample, then seq_mixed of the rows with go_on[i] (their sampled tokens) and the prompts p_*, that pass
  // queued behind the sampler before the tokens reach the host (cpp/core/sample_step.h, seq_sample_mixed).
  SampleStep seq_sample_mixed(const int64_t* slots, const SamplingConfig* cfgs, const uint64_t* steps, int64_t n,
                              int k, const uint8_t* go_on, const int64_t* p_slots, const int32_t* const* p_tokens,
                              const int64_t* p_lens, int64_t n_p);
  int64_t kv_pages_free() const { return pool_->free_pages(); }
  int64_t kv_pages_total() const { return pool_->n_pages(); }
  int64_t kv_page_size() const { return pool_->page_size(); }
  // A slot's latest logits (tests: the batched step against other paths).
  std::vector<float> seq_logits(int64_t slot) const;

  // GPU ms per decode step at a context of `context` tokens (with the graph decode() would use there). path:
  // Auto = the pass decode() replays; Graph / Persistent = that pass (Persistent: a Request error where it was
  // not built), so that one engine loaded with DecodePath::Auto times both (tinyinfer bench).
  double time_decode_step(int64_t context, int steps, DecodePath path = DecodePath::Auto);
  // CudaOptions::trace: one decode step at `context`; per traced kernel in launch order its name and
  // kTraceBlocks x kTraceWords: kTracePoints global-timer stamps (ns; 0: block absent or exited early), then the
  // block's SM. common.cuh, trace_point.
  std::pair<std::vector<std::string>, std::vector<uint64_t>> trace_step(int64_t context);
  // CudaOptions::trace with the persistent step built: one persistent step at `context` (after 3 warm-up steps);
  // PersistentDecode::kTraceColumns values per task (PersistentDecode::read_trace). The graph path: trace_step.
  std::vector<int64_t> persistent_trace_step(int64_t context);
  double time_attention(int64_t context, int reps);  // GPU µs of one layer's attention (chunks + merge)
  // GPU ms of prefilling `n_tokens` (arbitrary ids) at position 0: mean of `reps` after a warm-up that tunes
  // the GEMMs of that length's bucket. The cache is reset afterwards.
  double time_prefill(int64_t n_tokens, int reps);
  std::vector<std::pair<std::string, cuda::GemmTuning>> gemm_table() const;  // every GEMM shape tuned so far
  bool batched_prefill() const { return prefill_ != nullptr; }  // else prompts run one token at a time
  // The GEMM tactics across runs (cuda::Gemm::save / load; the Python Engine keeps the file).
  // (an engine tuning with a warm L2, gemm_tune_cold false, neither takes nor gives the saved tactics, which the
  // file's fingerprint says were timed from DRAM: "" / 0)
  std::string save_tactics() const { return gemm_ && opt_.gemm_tune_cold ? gemm_->save() : std::string(); }
  int load_tactics(const std::string& text) { return gemm_ && opt_.gemm_tune_cold ? gemm_->load(text) : 0; }
  int tuned_gemms() const { return gemm_ ? gemm_->tuned_count() : 0; }
  size_t weight_bytes() const { return arena_.weight_bytes(); }  // every matrix + norms as stored on the device
  size_t kv_cache_bytes() const { return arena_.kv_bytes(); }  // the page pool
  // The paged KV cache: (positions per page, pages in the pool, pages the sequence holds now).
  std::tuple<int, int64_t, int64_t> kv_pages() const { return {pool_->page_size(), pool_->n_pages(), seq_->pages()}; }
  size_t scratch_bytes() const { return arena_.scratch_bytes(); }  // device memory beyond weights and KV cache
  bool uses_pdl() const { return pdl_; }
  // The pass decode() replays (Graph or Persistent; never Auto), and why the persistent one was not taken under
  // DecodePath::Auto ("": it was, or was not asked for).
  DecodePath decode_path() const { return persistent_graph_ ? DecodePath::Persistent : DecodePath::Graph; }
  const std::string& persistent_problem() const { return persistent_problem_; }
  // The persistent kernel's grid and the co-resident blocks the occupancy API allows (0, 0: not built).
  // Tests: moves the persistent step's epoch `by` steps ahead of its counters, so that the next step's waits can
  // never succeed: it must end with a DeviceError after persistent_timeout_ms (and the engine recover).
  void debug_skew_persistent_epoch(int by);
  std::pair<int, int> persistent_grid() const {
    return persistent_ ? std::pair<int, int>{persistent_->grid(), persistent_->max_coresident()} : std::pair<int, int>{0, 0};
  }
  bool uses_graphs() const { return graphs_ok_; }
  std::string device_name() const { return device_name_; }
  // Wall seconds of the load's parts: the weights (read + upload + conversion), GEMV tuning (decode-long
  // included), graph capture.
  struct LoadTimes {
    double weights_s = 0, tune_s = 0, graphs_s = 0;
  };
  const LoadTimes& load_times() const { return load_times_; }
  // A weight matrix's device bytes as stored (tests: the load's conversions against the host's): q (rows x ld
  // halves or bytes) and scales (empty for fp16). layer is ignored for the LM head.
  std::pair<std::vector<uint8_t>, std::vector<uint8_t>> matrix_bytes(int64_t layer, MatrixRole role) const;

 private:
  void build(const std::function<void()>& fill_weights);
  void init_device();
  void allocate();
  void tune();
  void build_graphs();
  cudaGraphExec_t capture_decode(GemvVariant qkv);  // a decode-step graph with qkv at that variant
  void check_plan_by_steps();  // CudaOptions::gemv_step_check (tune_plan_by_steps)
  void choose_carveout();      // CudaOptions::smem_carveout -> plan_.carveout, each tried with settle_plan
  void settle_plan();          // choose_early_trigger, then check_plan_by_steps (gemv_step_check)
  void choose_early_trigger(); // CudaOptions::early_trigger -> plan_.early_trigger
  bool can_time_steps() const;  // the sequence holds plan_step_us's steps
  double plan_step_us();         // µs per decode step with plan_ as it is (graph-replayed)
  cudaGraphExec_t capture_step();  // the decode step's graph with plan_ as it is
  std::vector<double> time_step_graphs(const std::vector<cudaGraphExec_t>& graphs, int rounds);  // interleaved
  void decode_long_graph();
  void persistent_graph();  // CudaOptions::decode_path: the persistent step and its graph
  void release();
  void set_state(int token, int pos, int step);
  void kv_reserve(int64_t positions);      // pages for positions [0, positions), their table entries on the device
  void run_prompt_token();                 // one prompt token through the decode pass (no sampling)
  // seq[0..m) at positions pos0.. through the prefill pass (or token by token); the logits of rows first.. to
  // host_rows ((m - first, vocab); null: none) and the last row in dbuf_.logits. Queued only: the caller syncs.
  void run_pass(const int32_t* seq, int64_t m, int64_t pos0, int64_t first, float* host_rows);
  // The same (first = 0) as rows of a draft pass of the batched step (CudaOptions::draft_pass 1, m <= max_batch),
  // the single sequence's page table as their slot's; dbuf_.logits not written. Queued only.
  void draft_pass_rows(const int32_t* seq, int64_t m, int64_t pos0, float* host_rows);
  void run_decode_step(int64_t pos, DecodePath path = DecodePath::Auto);  // pos: the step's position (picks the graph)
  void allocate_batch();                   // the slots, their buffers and sampling state
  int64_t default_pool_pages() const;      // CudaOptions::kv_pool_pages = 0 (see there)
  void check_slot(int64_t slot) const;     // open and in range, else a Request error (engine_checks.h)
  void slot_reserve(int64_t slot, int64_t positions);     // KvSequence::grow + the changed table entries uploaded
  void upload_table(int64_t slot, int64_t first);         // the slot's table entries first.. to its device row
  void copy_page(int32_t from, int32_t to);               // a KV page's keys and values, every layer, on the stream
  void restart(int64_t slot, const int32_t* tokens, int64_t n);  // history = tokens as prompt, no logits, length n
  // (no batched prefill)
  void prefill_by_token(int64_t slot, const int32_t* tokens, int64_t n, float* all_logits = nullptr);
  void mark_prompt(int64_t slot, const int32_t* tokens, int64_t n);       // the prompt into the penalty set
  // rows (token, position, slot) of one batched step, padded to the bucket; the bucket's graph (captured on
  // first use) or the launches. draft: a draft pass's rows (BatchStep::record's draft; their own graphs).
  void run_rows(const int32_t* tokens, const int64_t* pos, const int64_t* slots, int64_t n, bool draft = false);
  // bbuf_.rows from the host: n rows (token, position, slot), then padding to the bucket (n = 0: padding only).
  void upload_rows(int bucket, const int32_t* tokens, const int64_t* pos, const int64_t* slots, int64_t n);
  // Slots other than slots[0..n) whose logits lie in bbuf_.logits rows 0..rows-1: copied to their own rows
  // (work about to write those rows).
  void move_logits_out(int rows, const int64_t* slots, int64_t n);
  void check_mixed(const int64_t* step_slots, const int32_t* step_tokens, int64_t n_step, const int64_t* slots,
                   const int32_t* const* tokens, const int64_t* lens, int64_t n) const;
  void launch_mixed(const int64_t* step_slots, const int32_t* step_tokens, const int* dev_tokens, const int* dev_src,
                    int64_t n_step, const int64_t* slots, const int32_t* const* tokens, const int64_t* lens,
                    int64_t n);
  void check_sample(const int64_t* slots, const SamplingConfig* cfgs, int64_t n, int k) const;
  void queue_sample(const int64_t* slots, const SamplingConfig* cfgs, const uint64_t* steps, int64_t n, int k);
  BatchSample read_sample(int64_t n, int k) const;
  int64_t step_pages(const int64_t* slots, int64_t n) const;  // (check_room each)
  int64_t prompt_pages(const int64_t* slots, const int64_t* lens, int64_t n) const;
  void require_pages(int64_t need, const char* what) const;  // "KV cache pool exhausted: ..." when short
  void upload_sampling(const SamplingConfig& s);  // the single-sequence sampler's settings, logit bias and mask
  double time_steps(int64_t context, int steps, const std::function<void(int64_t)>& launch);

  ModelConfig cfg_;
  int64_t max_seq_;
  CudaOptions opt_;
  bool pdl_ = false, graphs_ok_ = false;
  bool batch_pdl_ok_ = true;  // false once a batch graph failed to capture with PDL (run_rows)
  std::string device_name_;
  cudaStream_t stream_ = nullptr;
  DeviceArena arena_;
  std::unique_ptr<KvPagePool> pool_;       // the KV cache's pages
  std::unique_ptr<KvSequence> seq_;        // the sequence's page table (one sequence today)
  std::unique_ptr<StreamClock> clock_;
  std::unique_ptr<DeviceWeights> weights_;
  DecodeBuffers dbuf_;
  GemvPlan plan_;
  std::string plan_key_, plan_problem_;
  bool plan_cached_ = false;
  double tune_s_[3] = {0, 0, 0};
  std::unique_ptr<DecodeStep> step_;
  cudaGraphExec_t g_prompt_token_ = nullptr, g_decode_ = nullptr;
  cudaGraphExec_t g_decode_long_ = nullptr;  // contexts >= plan_.long_from
  cudaGraphExec_t g_decode_one_ = nullptr;   // contexts < attn_chunk (CudaOptions::one_chunk_graph)
  std::unique_ptr<PersistentDecode> persistent_;
  cudaGraphExec_t persistent_graph_ = nullptr;  // the persistent step + the sampler: decode()'s graph when set
  std::string persistent_problem_;
  cuda::DecodeState* h_state_ = nullptr;        // pinned
  cuda::DeviceSampling* h_sampling_ = nullptr;  // pinned
  cuda::LogitBias* h_bias_ = nullptr;           // pinned (kMaxLogitBias)
  uint32_t* h_mask_ = nullptr;                  // pinned (mask_words(vocab)): the allowed-token mask
  int* h_out_ = nullptr;                        // pinned (max_seq)
  std::unique_ptr<cuda::Gemm> gemm_;
  PrefillBuffers pbuf_;
  std::unique_ptr<PrefillStep> prefill_;

  // The slots. Their page tables live in bbuf_.tables (slot s at row s), their logits in a row of bbuf_.logits
  // (Slot::logits_row: the step row that computed them, or the slot's own row, bbuf_.slot_row).
  BatchBuffers bbuf_;
  std::unique_ptr<BatchStep> batch_;
  std::vector<int> buckets_;                    // 1, 2, 4, ..., max_batch
  std::vector<cudaGraphExec_t> g_batch_;        // per bucket, captured on first use
  std::vector<cudaGraphExec_t> g_draft_;        // per bucket, the draft passes' (decode_draft), likewise
  struct Slot {
    bool open = false, has_logits = false;
    int64_t length = 0;
    int logits_row = -1;  // its latest logits: row of bbuf_.logits (a step row < max_batch, or its own row)
    std::unique_ptr<KvSequence> kv;
  };
  std::vector<Slot> slots_;
  struct Parked {
    int64_t length = 0;
    std::unique_ptr<KvSequence> kv;  // null while free
  };
  std::vector<Parked> parked_;  // parked sequence max_batch + i at i (seq_park)
  // An open slot's or a parked sequence's (checked) pages and length: what seq_copy reads from a source.
  std::pair<const KvSequence*, int64_t> held(int64_t id) const;
  unsigned char* seen_ = nullptr;               // (max_batch, vocab) prompt + generated tokens per slot
  int* counts_ = nullptr;                       // (max_batch, vocab) generated occurrences per slot
  float* sample_scratch_ = nullptr;             // (max_batch, vocab)
  void* d_sample_in_ = nullptr;                 // RowSampling (max_batch), their LogitBias entries, their masks
  void* h_sample_in_ = nullptr;                 // pinned, the same
  cudaEvent_t sample_in_read_ = nullptr;        // recorded once the sampler's rows left h_sample_in_
  cudaEvent_t sampled_ = nullptr;               // seq_sample_mixed: recorded once h_sample_out_ is written
  int* d_prompt_ = nullptr;                     // (max_seq) a prompt's tokens (its history marks)
  void* d_sample_out_ = nullptr;                // tokens | logprobs | top ids (max_batch, 20) | top lps
  void* h_sample_out_ = nullptr;                // pinned, the same

  std::vector<int32_t> tokens_;
  TokenHistory history_{0};  // tokens_ as the sampler's penalties see them: forward() prompt, decode() generated
  std::vector<float> draft_scratch_;      // decode_draft's host sampler
  std::vector<int32_t> draft_scratch_ids_;
  LoadTimes load_times_;
  bool has_logits_ = false, pending_ = false;
  double last_decode_ms_ = 0;
};

}  // namespace ti
