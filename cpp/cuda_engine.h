// cuda_engine.h — the GPU engine: fp16 weights on the device, one decode step captured as a CUDA graph.
//
// Same contract as CpuEngine (one sequence; forward() runs tokens at position(); decode() samples and runs
// tokens back to back) so the Python Engine drives either. A decode step is a flat list of kernel launches
// (record_forward below reads top to bottom, DESIGN.md §4); it is captured once into a graph whose token and
// position live in device memory (DecodeState), and decode() replays it back to back with no host work between
// steps. Prefill is a separate path (prefill_chunk): the whole prompt at once, chunk by chunk, through cuBLASLt
// GEMMs (cuda/gemm.cuh, tuned per shape) and the tiled causal attention (cuda/prefill_attention.cuh).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <string>
#include <tuple>
#include <vector>

#include "../cuda/attention.cuh"
#include "../cuda/gemm.cuh"
#include "../cuda/gemv.cuh"
#include "../cuda/quant.cuh"
#include "../cuda/sampling.cuh"
#include "config.h"
#include "kv_pages.h"
#include "sampling.h"
#include "weights.h"

namespace ti {

struct CudaOptions {
  bool pdl = true;          // programmatic dependent launch where the GPU has it (sm_90+)
  // PDL: GEMVs whose successor reads only weights let it launch at their start (its blocks then sit resident
  // and fetch their first weights early). Off by default: measured 1.3% slower on the H200 (TinyLlama int4 and
  // fp16, ctx 16: the queued kernels' prefetch slows the latency-bound attention more than it saves).
  bool early_trigger = false;
  bool trace = false;       // debug: per-block timestamps of every GEMV and attention kernel (trace_step);
                            // needs a -DTINYINFER_TRACE=ON build
  bool graphs = true;       // replay captured graphs (false: launch kernel by kernel, for debugging)
  int attn_chunk = 0;       // positions per split-K attention block; 0: the kernel's choice for head_dim
  int gemv_rows = 0;        // 0: time R in {1, 2, 4, 8 = split-K} per shape at load; else force this R
  int gemv_grid = -1;       // -1: time the grid (GemvParams::blocks_per_sm 0 / 1 / 2) per shape; else force it
  // Prefer the fastest 2-blocks-per-SM variant when it is within this fraction of the fastest variant's time
  // (0: off). Timed alone, the variants of a small matrix are often near-equal and the pick flips between
  // loads, while inside the step the resident looping grid does better (H200: TinyLlama int4 -3.4% per step at
  // 0.05, the other formats and Llama-2-7B within +-0.4%; at 0.15 7B fp16 lost 1.7%).
  double gemv_resident_margin = 0.05;
  // Among those 2-per-SM variants within the margin, take the one with the smallest tiles (8 rows: R = 1 or
  // split-K; the fastest of those), not simply the fastest: the most blocks — but for qkv, the GEMV before the
  // attention, the largest tiles (the fewest blocks: room for the attention's early start). Timed alone such
  // variants are within noise and the pick flipped between loads, while in the step the smaller tiles won (trace:
  // TinyLlama int4's down 1.4 us per layer faster with 256 blocks than with 128) and, at long contexts, a qkv with
  // more blocks lost (H200: TinyLlama int4 ctx 1024 with qkv at 160 blocks, 1,469 tok/s; at 80, 1,734).
  // Measurements: bench/results/QUANT-NOTES.md, fourth pass.
  bool gemv_small_tiles = true;
  // After tuning, force some shapes' variants: "name:R/blocks_per_sm;..." with names qkv, o, gate_up, down,
  // lm_head (A/B runs: bench/ab_decode.py). Empty: the tuner's picks.
  std::string gemv_force;
  // A second decode graph for long contexts, differing in qkv's variant (R, grid) only: qkv's block count decides
  // whether the attention's blocks find SMs free to start early and fetch the cached keys and values (H200,
  // TinyLlama ctx 1,024, pinned A/B: int8 -7.9% per step with qkv at 1 block per SM, fp16 -4.2%; but at ctx 16
  // +2.5% and +1.1%, and Llama-2-7B fp16 +8.1% at 1,024). At load, qkv's candidates are timed as whole decode
  // steps at a long context; one faster by > 2% gets its graph, used from the context where it wins. Measured:
  // TinyLlama int8 -7.4% at ctx 1,024 (the long graph from 256 on), the others kept one graph (fp16 too, though the
  // pinned A/B had it 4% faster: not understood). Only with graphs on. -1: tuned; 0: one graph; n > 0: the long
  // graph from context n on, qkv at 1 block per SM (tests).
  int64_t decode_long_from = -1;
  bool batched_prefill = true;  // false: feed prompts one token at a time through the decode graph
  int prefill_chunk = 2048;     // tokens per prefill pass (activation buffers are sized for this at load)
  bool gemm_autotune = true;    // false: cuBLASLt's default algorithm for every GEMM
  WFormat weights = WFormat::F16;  // the matrices' format on the device (cpp/quant.h): quantized at load
  // The paged KV cache (cpp/kv_pages.h, cuda/kv_layout.cuh): positions per page (a power of two, >= 64 and >=
  // attn_chunk); the pool's pages (0: enough for one sequence of max_seq_len; fewer: a sequence that outgrows the
  // pool gets a clear error); a seed shuffling the pool's free list (0: pages in order; tests scatter them).
  int kv_page_size = 64;
  int64_t kv_pool_pages = 0;
  uint64_t kv_page_shuffle = 0;
};

// One GEMV shape class of the model and the rows-per-warp the load-time autotuner chose for it.
struct GemvChoice {
  std::string name;           // qkv | o | gate_up | down | lm_head
  int rows = 0, K = 0, ld = 0, copies = 0;  // copies: one per layer (1 for the head)
  int R = 1;                  // rows per warp, or 8: the split-K variant (cuda/gemv.cuh)
  int blocks_per_sm = 0;      // grid: 0 = a block per tile, else blocks per SM looping over tiles
  std::vector<int> tried_R, tried_bps;  // the variants timed: (R, blocks_per_sm)
  std::vector<double> us;     // per variant: µs per matrix, L2-cold (cycling through the layers' copies), graph-replayed
  double gb_per_s = 0;        // of the chosen variant
};

class CudaEngine {
 public:
  // Uploads (fp16) the weights of a finished store; the store is not kept (its host memory can go).
  CudaEngine(const WeightStore& weights, int64_t max_seq_len, CudaOptions opt = {});
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
  void forward(const int32_t* tokens, int64_t n, bool all_logits, float* logits);
  std::vector<int32_t> decode(int64_t max_steps, const SamplingConfig& s, const std::vector<int32_t>& stop_ids,
                              uint64_t step0);

  // ---- measurement ----
  double last_decode_ms() const { return last_decode_ms_; }  // GPU time of the last decode()'s steps
  const std::vector<GemvChoice>& gemv_table() const { return gemv_choices_; }
  // GPU ms per decode step at a context of `context` tokens (the cache content is whatever it holds; the decode
  // graph each step would use in decode(): CudaOptions::decode_long_from).
  double time_decode_step(int64_t context, int steps);
  // The long-context decode graph (CudaOptions::decode_long_from): the context it starts at (-1: none) and its
  // qkv variant (R, blocks_per_sm).
  std::tuple<int64_t, int, int> decode_long() const { return {long_from_, qkv_long_R_, qkv_long_bps_}; }
  // CudaOptions::trace: one decode step at `context`; per traced kernel in launch order its name and
  // kTraceBlocks x kTracePoints global-timer stamps (ns; 0: block absent or exited early). common.cuh, trace_point.
  std::pair<std::vector<std::string>, std::vector<uint64_t>> trace_step(int64_t context);
  // GPU µs of one layer's attention (chunks + merge) at `context`.
  double time_attention(int64_t context, int reps);
  // GPU ms of prefilling `n_tokens` (arbitrary ids) at position 0: mean of `reps` after a warm-up that tunes
  // the GEMMs of that length's bucket. The cache is reset afterwards.
  double time_prefill(int64_t n_tokens, int reps);
  // Every GEMM shape tuned so far, named (qkv | o | gate_up | down | lm_head).
  std::vector<std::pair<std::string, cuda::GemmTuning>> gemm_table() const;
  bool batched_prefill() const;  // prompts go through prefill_chunk (else one token at a time)
  // The GEMM tactics across runs (cuda::Gemm::save / load; the Python Engine keeps the file).
  std::string save_tactics() const { return gemm_ ? gemm_->save() : std::string(); }
  int load_tactics(const std::string& text) { return gemm_ ? gemm_->load(text) : 0; }
  int tuned_gemms() const { return gemm_ ? gemm_->tuned_count() : 0; }
  size_t weight_bytes() const { return weight_bytes_; }      // every matrix + norms as stored on the device
  size_t kv_cache_bytes() const { return kv_bytes_; }  // the page pool
  // The paged KV cache: (positions per page, pages in the pool, pages the sequence holds now).
  std::tuple<int, int64_t, int64_t> kv_pages() const {
    return {kv_pool_->page_size(), kv_pool_->n_pages(), kv_seq_->pages()};
  }
  size_t scratch_bytes() const { return scratch_bytes_; }    // device memory beyond weights and KV cache
  bool uses_pdl() const { return pdl_; }
  bool uses_graphs() const { return graphs_ok_; }
  std::string device_name() const { return device_name_; }

 private:
  // Each matrix in the engine's format (QMat: fp16 rows padded to 8, or I8 / I4 with their scales).
  struct Layer {
    cuda::QMat qkv;      // (q_dim + 2 kv_dim, hidden): q | k | v rows
    cuda::QMat o;        // (hidden, q_dim)
    cuda::QMat gate_up;  // (2 intermediate, hidden): rows interleaved gate_0, up_0, gate_1, ...
    cuda::QMat down;     // (hidden, intermediate)
    float* attn_norm = nullptr;  // (hidden)
    float* mlp_norm = nullptr;   // (hidden)
  };

  template <typename F>
  void guarded(F&& build);
  void release();
  void init_device();
  void allocate();
  void allocate_prefill();
  void upload(const WeightStore& w);
  void randomize(uint64_t seed);
  void autotune_gemv();
  struct GemvForce {
    std::string name;
    int R = 0, bps = 0;
  };
  static std::vector<GemvForce> parse_gemv_force(const std::string& spec);
  void build_graphs();
  void record_forward(cudaStream_t s);
  void record_decode_step(cudaStream_t s);
  void run_forward(cudaStream_t s);
  void prefill_chunk(const int32_t* tokens, int T, int pos0, float* host_logits, int64_t host_row0);
  void prefill_layer(const Layer& L, int64_t layer, int T, int pos0);
  void chunk_logits(int T, float* host_logits, int64_t host_row0);
  void run_decode_step(cudaStream_t s, int64_t pos);  // pos: the step's position (picks the graph)
  void tune_decode_long();
  double time_steps(int64_t context, int steps, const std::function<void(int64_t)>& launch);
  double time_graph_step(cudaGraphExec_t g, int64_t context, int steps);
  void set_state(int token, int pos, int step);
  void kv_reserve(int64_t positions);  // pages for positions [0, positions), their table entries on the device
  float gpu_ms(const std::function<void()>& enqueue);
  float replay_ms(const std::function<void()>& enqueue);
  cudaError_t capture_graph(const std::function<void()>& record, cudaGraphExec_t* out);
  cuda::DecodeAttnParams attn_params(int64_t layer) const;
  cuda::GemvParams gemv_params(const cuda::QMat& m, const void* x, void* y, const float* norm_w,
                               bool early_trigger = false) const;
  cuda::QMat alloc_matrix(int rows, int K, WFormat fmt);
  void store_matrix(const cuda::QMat& m, const std::vector<uint16_t>& fp16_rows);
  void overlay_imported(const cuda::QMat& m, const WeightStore& w, const std::vector<std::string>& parts,
                        const std::function<int64_t(size_t, int64_t)>& row_of);
  void random_matrix(const cuda::QMat& m, uint64_t seed, float scale);
  const __half* fp16_of(const cuda::QMat& m);  // the matrix as fp16 rows (quantized: dequantized into wtmp_)
  const GemvChoice* find_choice(const char* name) const;  // the tuned entry of shape `name`, or nullptr
  int choice(const char* name) const;
  cuda::GemvParams tuned(const char* name, cuda::GemvParams p) const;  // p with the tuned grid of shape `name`
  void* dalloc(size_t bytes, bool scratch);

  ModelConfig cfg_;
  int64_t max_seq_;
  CudaOptions opt_;
  bool pdl_ = false, graphs_ok_ = false;
  std::string device_name_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ev0_ = nullptr, ev1_ = nullptr;
  cudaGraphExec_t g_forward_ = nullptr, g_decode_ = nullptr;
  cudaGraphExec_t g_decode_long_ = nullptr;  // contexts >= long_from_ (CudaOptions::decode_long_from)
  int64_t long_from_ = -1;
  int qkv_long_R_ = 0, qkv_long_bps_ = 0;
  std::vector<void*> allocations_;
  size_t weight_bytes_ = 0, kv_bytes_ = 0, scratch_bytes_ = 0;
  int ld_h_ = 0, ld_q_ = 0, ld_i_ = 0;

  // ---- weights ----
  std::vector<Layer> layers_;
  __half* embedding_ = nullptr;   // (vocab, ld_h) fp16 whatever the format (a token reads one row)
  cuda::QMat lm_head_;            // (vocab, hidden) in head_format(weights); fp16 and tied: the embedding itself
  __half* wtmp_ = nullptr;        // quantized formats: fp16 staging of one matrix (upload, prefill GEMMs)
  size_t wtmp_elems_ = 0;
  float* final_norm_ = nullptr;   // (hidden)
  // ---- KV cache: pages [layer][page][kv_head][page_size][head_dim] fp16 (cuda/kv_layout.cuh) ----
  __half* k_pages_ = nullptr;
  __half* v_pages_ = nullptr;
  size_t kv_layer_elems_ = 0;           // one layer's pages
  std::unique_ptr<KvPagePool> kv_pool_;
  std::unique_ptr<KvSequence> kv_seq_;  // the sequence's pages (one sequence today)
  int* d_page_table_ = nullptr;         // (kv_seq_->max_pages()) the device copy of kv_seq_'s table
  // ---- activations (one token) ----
  float* x_ = nullptr;        // (hidden) residual stream
  float* qkv_ = nullptr;      // (q_dim + 2 kv_dim)
  __half* att_ = nullptr;     // (q_dim) attention output
  __half* h_ = nullptr;       // (intermediate) silu(gate) * up
  float* logits_ = nullptr;   // (vocab)
  float* part_o_ = nullptr;   // (n_heads, max_chunks, head_dim)
  float* part_ml_ = nullptr;  // (n_heads, max_chunks, 2)
  float* rope_cos_ = nullptr; // (max_seq, head_dim / 2)
  float* rope_sin_ = nullptr;
  // ---- sampling / decode loop state ----
  cuda::DeviceSampling* d_sampling_ = nullptr;
  cuda::DecodeState* d_state_ = nullptr;
  unsigned char* d_seen_ = nullptr;  // (vocab)
  float* d_probs_ = nullptr;         // (vocab) sampler scratch
  unsigned long long* d_trace_ = nullptr;  // CudaOptions::trace: kTraceBlocks x kTracePoints per traced kernel
  std::vector<std::string> trace_names_;   // the traced kernels, in launch order (filled by record_forward)
  unsigned long long* next_trace(const std::string& name);  // the next kernel's slice (nullptr: tracing off)
  int* d_out_ = nullptr;             // (max_seq) sampled tokens of one decode() call
  cuda::DecodeState* h_state_ = nullptr;        // pinned
  cuda::DeviceSampling* h_sampling_ = nullptr;  // pinned
  int* h_out_ = nullptr;                        // pinned (max_seq)
  // ---- prefill (one chunk of up to prefill_rows_ tokens; row strides are the padded widths) ----
  std::unique_ptr<cuda::Gemm> gemm_;
  int prefill_rows_ = 0, logit_rows_ = 0, ld_qkv_ = 0, ld_gu_ = 0, ld_v_ = 0;
  int* d_tokens_ = nullptr;   // (prefill_rows)
  int* h_tokens_ = nullptr;   // pinned (prefill_rows)
  float* px_ = nullptr;       // (prefill_rows, ld_h) fp32 residual stream
  __half* pxn_ = nullptr;     // (prefill_rows, ld_h) rmsnorm(x), the GEMMs' input
  float* pqkv_ = nullptr;     // (prefill_rows, ld_qkv) q | k | v before RoPE
  __half* pq_ = nullptr;      // (prefill_rows, q_dim) rope(q)
  __half* patt_ = nullptr;    // (prefill_rows, ld_q) attention output
  __half* pgu_ = nullptr;     // (prefill_rows, ld_gu) gate/up interleaved
  __half* ph_ = nullptr;      // (prefill_rows, ld_i) silu(gate) * up
  float* plogits_ = nullptr;  // (logit_rows, ld_v) logits of all positions (Engine.logits), a slice at a time

  std::vector<GemvChoice> gemv_choices_;
  std::vector<GemvForce> gemv_force_;  // CudaOptions::gemv_force, parsed
  std::vector<int32_t> tokens_;
  bool has_logits_ = false, pending_ = false;
  double last_decode_ms_ = 0;
};

}  // namespace ti
