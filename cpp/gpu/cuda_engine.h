// cuda_engine.h — the GPU engine: lifecycle, prefill, decode. Same contract as CpuEngine (one sequence;
// forward() runs prompt tokens at position(); decode() samples and runs tokens back to back) so the Python
// Engine drives either. The work lives in its parts, read in this order:
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

// One line per option; why the defaults are what they are: docs/perf/decode-options.md.
struct CudaOptions {
  bool pdl = true;                     // programmatic dependent launch where the GPU has it (sm_90+)
  // Which of the decode step's kernels let their successor launch at their start (PDL) rather than after their wait:
  // -1 timed at load (each level kept where whole steps are > 1% faster), 0 none, 1 the GEMVs but qkv, 2 those and
  // the attention.
  int early_trigger = -1;
  bool trace = false;                  // per-block timestamps of the decode kernels (-DTINYINFER_TRACE=ON build)
  bool graphs = true;                  // replay captured graphs (false: launch kernel by kernel, for debugging)
  int attn_chunk = 0;                  // positions per split-K attention block; 0: the kernel's choice
  int gemv_rows = 0;                   // 0: time R in {1, 2, 4, 8 = split-K} per shape at load; else only this R
  int gemv_grid = -1;                  // -1: time blocks_per_sm 0 / 1 / 2 per shape; else only this one
  double gemv_resident_margin = 0.05;  // prefer a 2-blocks-per-SM variant within this fraction of the fastest
  bool gemv_small_tiles = true;        // among those, the smallest tiles (qkv, before the attention: the largest)
  bool gemv_step_check = true;         // then whole steps decide, role by role, against the fastest alone
  // The tuner also times R = 16 (kGemvMmaOneRow: the tensor-core product on the one row) for every role where it
  // fits (sm_80+; normed inputs K <= 16,384); off until measured (docs/perf/persistent.md §26-27).
  bool gemv_mma = false;
  // int8 / int4 GEMVs of the graph path on the input quantized to int8 per group (dp4a; docs/perf/decode-options.md);
  // the batched step and the prefill then round those products' inputs to the same numbers (cuda/act8.cuh); the
  // persistent step does not, so it is not built where a role takes int8 inputs. 0 never (default: weights-only
  // quantization, docs/ARCHITECTURE.md); -1 int4 matrices wherever the kernel can, int8 ones never (their fp16-input
  // GEMV is as fast); -2 as -1 but down (its long input quantized again in every block, and its rounding a kernel a
  // layer in the batched step); 1 each quantized role timed with and without at load; 2 every quantized matrix
  // wherever the kernel can.
  int act8 = 0;
  std::vector<GemvPin> gemv_pins;      // variants forced after tuning (A/B runs: bench/tools/ab_decode.py)
  int64_t decode_long_from = -1;       // long-context decode graph: -1 tuned, 0 none, n > 0 from context n
  // The shared-memory carveout of the decode step's kernels (GemvPlan::carveout, cuda/common.cuh): -2 timed at load
  // (whole steps with the driver's choice per kernel against kStepCarveout for every kernel, each with its trigger
  // level and step check settled under it; the driver's choice
  // without graphs, below max_seq_len 89 or with a CUDA toolkit before 12.5); -1 the driver's choice; 0..100 this
  // percent of the SM's maximum shared memory for every kernel (docs/perf/persistent.md §23).
  int smem_carveout = -2;
  bool one_chunk_graph = true;         // steps at pos < attn_chunk: a decode graph without the merge kernel
  bool attn_tensor_cores = true;       // decode attention's chunk (head dim 64 / 128) on mma.sync
  bool batched_prefill = true;         // false: feed prompts one token at a time through the decode graph
  int prefill_chunk = 2048;            // tokens per prefill pass (activation buffers are sized for this at load)
  bool gemm_autotune = true;           // false: cuBLASLt's default algorithm for every GEMM
  bool gemm_tune_cold = true;          // the tuner times each GEMM with its weights out of the L2 (false: A/B runs)
  WFormat weights = WFormat::F16;      // the matrices' format on the device (cpp/core/quant.h), quantized at load
  // Sequence slots (seq_open ..., batch_step.h): the most sequences one seq_step runs; graphs are captured per
  // bucket 1, 2, 4, ... up to max_batch, on first use.
  int64_t max_batch = 64;
  // fp16 batched steps of <= this many rows take the small-N GEMV (6 launches per layer, each weight read once),
  // larger ones cuBLASLt (+ RMSNorm and SwiGLU kernels). 1: cuBLASLt from 2 rows on — on the H200 (TinyLlama,
  // 92e0bc3) cuBLASLt's step at 16 rows (1.43 ms) beat the small-N kernel's at 2 (1.56), see docs/perf/batch.md.
  int batch_gemv_f16_max = 1;
  // int8 / int4 batched steps of <= this many rows take the small-N GEMV; larger ones dequantize each matrix into
  // the fp16 staging (DeviceWeights::fp16_of, as the prefill does) and take cuBLASLt: the small-N kernel costs
  // ~linearly in the rows past 4 (int4 2.97 ms at 8, 5.83 at 32), dequantize + cuBLASLt ~flat (docs/perf/batch.md).
  int batch_gemv_quant_max = 4;
  // The batched step's own kernels (small-N GEMV, tensor-core kernel, attention, RMSNorm) launched with PDL
  // inside its graphs, as the decode graph's, where the engine uses PDL at all (CudaOptions::pdl, sm_90+, a
  // driver that captures it); false: plain launches, for A/B runs and debugging.
  bool batch_pdl = true;
  // int8 / int4 batched products of <= this many rows (at most 64) take the tensor-core small-N kernel
  // (cuda/mma_small_n.cu, RMSNorm as its own kernel) ahead of the choice above; batch_mma_f16_max likewise for
  // fp16 (0: off). Measured on the H200 (TinyLlama, e3a70ff, docs/perf/batch.md): int4 at 8 rows 1.12 ms per
  // step against 2.11 dequantize + cuBLASLt, but 2.07 against 2.24 at 32 and 3.70 against 2.57 at 64; fp16 slower
  // than cuBLASLt at every row count (8 rows: 1.57 against 1.44 ms).
  int batch_mma_max = 16;
  int batch_mma_f16_max = 0;
  // fp16 qkv and o products (the two beside the attention) of <= this many rows take that kernel while the others
  // stay on cuBLASLt: at few rows cuBLASLt streams the large gate/up and down well but splits qkv's K (a reduce
  // kernel) and gives o too few tiles, and after our qkv the attention starts early under PDL (docs/perf/batch.md).
  int batch_mma_f16_qkvo_max = 16;
  // fp16 down products of <= this many rows take that kernel too (0: cuBLASLt; for A/B runs: at TinyLlama's
  // shape the step was slower with it, even where its kernel beat cuBLASLt's split-K pair: docs/perf/batch.md).
  int batch_mma_f16_down_max = 0;
  // fp16 products on that kernel take their weights and inputs through a cp.async ring in shared memory (D chunks
  // a warp in flight, no registers held: cuda/mma_small_n.cu); false: the register ring (A/B runs).
  bool batch_mma_ring = true;
  // A down product on cuBLASLt of <= 16 rows (fp16 at 2-16 rows: where cuBLASLt splits K and reduces in a kernel
  // of its own) in this many K slices (2..8: one strided-batched launch), then one kernel of ours that adds the
  // slices into the residual and writes the next RMSNorm (cuda/batch_rows.cuh); 0 or 1: cuBLASLt's own choice.
  // 2, 4 or 8 (powers of two divide the K of the models we take; a K that S x 8 does not divide is not sliced).
  // 4 measured best on the H200 (TinyLlama fp16 batch 8: 1.023-1.028 ms against 1.045-1.052; docs/perf/batch.md).
  int batch_down_k_slices = 4;
  // Bucket 1 (a lone sequence) runs its products on the single-sequence decode GEMVs of the load-time plan
  // (batch_step.cu, record_one_row) instead of the small-N kernels, whose tiles are mostly dead columns at one row.
  // Its logits then differ from the same sequence's in a larger bucket by the kernels' rounding (not bit for bit);
  // false: bucket 1 on the batched products too (A/B runs; a row bit for bit a larger bucket's where both take the
  // same small-N kernel). On the H200 (TinyLlama) batch 1's step: int4 0.67 -> 0.50 ms, fp16 1.07 -> 0.73.
  // docs/perf/batch.md ("Bucket 1 on the decode plan").
  bool batch_one_row_plan = true;
  // With act8, o's input in the batched step written rounded to int8 numbers by the attention that produces it
  // rather than by act8_round_rows after it: the same bits, a kernel a layer fewer (batch_step.cu). false: the
  // rounding kernel (A/B runs and the tests' reference).
  bool batch_act8_fused = true;
  // 16-row tiles per block of that kernel: 0 (default) two for int4 products of 9..16 rows whose matrix still
  // gives every SM two blocks (each input fragment then meets two tiles' weights: docs/perf/batch.md), else one;
  // 1 or 2 force it (2: products of up to 16 rows) for A/B runs.
  int batch_mma_m_tiles = 0;
  // Positions per block of the batched step's attention (cuda/attention_rows.cu): 0 (default) 256 at head dim 64,
  // 128 up to 128, 64 above — a row that long is one block per KV head, no merge; 64 or 128: more, shorter blocks
  // and an in-kernel merge (smaller spans did not pay on the H200: docs/perf/batch.md).
  int batch_attn_span = 0;
  // Query heads per block of that attention: 1, 2, 4 or 8 (a KV head's group split into slices of that many, each
  // its own block re-reading the K / V tile from L2), 0 (default): the fewest (at least two from two rows) while
  // the busy blocks fit in one wave (cuda/attention_rows.cu). All 8 of a group in one block was latency-bound, one
  // a block lost to two at 2-8 rows (docs/perf/batch.md).
  int batch_attn_heads = 0;
  // The paged KV cache (kv_pages.h), shared by the single sequence and the slots:
  int kv_page_size = 64;               // positions per page: a power of two, >= 64 and >= attn_chunk
  // Pages in the pool. 0: enough for max_batch sequences of max_seq_len, but at most half the device memory
  // free once the weights are in (the other half: activations, cuBLASLt, other processes), and never fewer
  // than one max_seq_len sequence needs (a batch then shares the pool: pages are taken on demand and a slot
  // that cannot get one fails its call with a Request error). kv_cache_bytes() reports the choice.
  int64_t kv_pool_pages = 0;
  uint64_t kv_page_shuffle = 0;        // a seed shuffling the pool's free list (tests); 0: pages in order
  std::string plan_text;               // a saved GEMV plan (plan_cache.h) to take instead of tuning; "": tune
  // Which pass decode() replays: the graph of kernels (the reference), the persistent kernel (issue 16), or Auto
  // (persistent where it can run, else graph). Graph until the persistent step is measured correct and faster.
  DecodePath decode_path = DecodePath::Graph;
  bool persistent_prefetch = true;     // its tasks ask their first weights into L2 before their waits (A/B)
  bool persistent_fused_merge = true;  // no merge phase: a KV head's last attention task merges its chunks (A/B)
  int persistent_blocks_per_sm = 2;    // its grid: min(co-resident, this x SMs); 1 to 4 (A/B)
  int persistent_timeout_ms = 2000;    // a counter wait that has not succeeded by then ends the step with an error
  // The weight ring across task boundaries (persistent_ring_plan.h, docs/perf/persistent.md §7): each block copies
  // its next tasks' weight tiles into shared memory (cp.async.bulk, sm_90) before it waits on a counter. Off: on
  // the H200 it made the step slower (TinyLlama fp16 1,861 against 1,238 µs without it; §7.4).
  bool persistent_ring = false;
  int persistent_ring_slots = 4;       // slots per block: 2 to 8
  int persistent_ring_slot_kib = 32;   // slot size: 1 to 128 KiB (slots x size must fit the block's shared memory)
  bool persistent_kv_stage = true;     // attention tasks copy the earlier positions' keys / values before the wait
};

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
  void seq_close(int64_t slot);            // its pages back to the pool, its history cleared
  int64_t seq_length(int64_t slot) const;  // positions in its cache
  // Prompt tokens at seq_length(slot)..: the batched prefill through the slot's page table; the last token's
  // logits become the slot's; the tokens join its history as prompt. Request error, nothing changed, when the
  // pages run out or max_seq_len would be passed. Returns once launched (the next syncing call waits).
  void seq_prefill(int64_t slot, const int32_t* tokens, int64_t n);
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
  void run_decode_step(int64_t pos, DecodePath path = DecodePath::Auto);  // pos: the step's position (picks the graph)
  void allocate_batch();                   // the slots, their buffers and sampling state
  int64_t default_pool_pages() const;      // CudaOptions::kv_pool_pages = 0 (see there)
  void check_slot(int64_t slot) const;     // open and in range, else a Request error (engine_checks.h)
  void slot_reserve(int64_t slot, int64_t positions);     // KvSequence::grow + the changed table entries uploaded
  void prefill_by_token(int64_t slot, const int32_t* tokens, int64_t n);  // (no batched prefill)
  void mark_prompt(int64_t slot, const int32_t* tokens, int64_t n);       // the prompt into the penalty set
  // rows (token, position, slot) of one batched step, padded to the bucket; the bucket's graph (captured on
  // first use) or the launches.
  void run_rows(const int32_t* tokens, const int64_t* pos, const int64_t* slots, int64_t n);
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
  void upload_sampling(const cuda::DeviceSampling& s);
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
  struct Slot {
    bool open = false, has_logits = false;
    int64_t length = 0;
    int logits_row = -1;  // its latest logits: row of bbuf_.logits (a step row < max_batch, or its own row)
    std::unique_ptr<KvSequence> kv;
  };
  std::vector<Slot> slots_;
  unsigned char* seen_ = nullptr;               // (max_batch, vocab) prompt + generated tokens per slot
  int* counts_ = nullptr;                       // (max_batch, vocab) generated occurrences per slot
  float* sample_scratch_ = nullptr;             // (max_batch, vocab)
  void* d_sample_in_ = nullptr;                 // RowSampling (max_batch)
  void* h_sample_in_ = nullptr;                 // pinned, the same
  cudaEvent_t sample_in_read_ = nullptr;        // recorded once the sampler's rows left h_sample_in_
  cudaEvent_t sampled_ = nullptr;               // seq_sample_mixed: recorded once h_sample_out_ is written
  int* d_prompt_ = nullptr;                     // (max_seq) a prompt's tokens (its history marks)
  void* d_sample_out_ = nullptr;                // tokens | logprobs | top ids (max_batch, 20) | top lps
  void* h_sample_out_ = nullptr;                // pinned, the same

  std::vector<int32_t> tokens_;
  TokenHistory history_{0};  // tokens_ as the sampler's penalties see them: forward() prompt, decode() generated
  LoadTimes load_times_;
  bool has_logits_ = false, pending_ = false;
  double last_decode_ms_ = 0;
};

}  // namespace ti
