// cuda_engine.cu — the GPU engine's lifecycle, prefill and decode (see cuda_engine.h for the parts).
#include "cuda_engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "../../cuda/attention.cuh"
#include "../../cuda/bandwidth.cuh"
#include "../../cuda/batch_rows.cuh"
#include "../../cuda/common.cuh"
#include "../../cuda/mma_one_row.cuh"
#include "../../cuda/prefill_attention.cuh"
#include "../core/engine_checks.h"
#include "../core/errors.h"
#include "plan_cache.h"

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
  if (opt_.attn_chunk < 8 || opt_.attn_chunk > 128) fail(ErrorKind::Request, "attn_chunk must be 8..128");
  const int P = opt_.kv_page_size;
  if (P < 64 || P > (1 << 20) || (P & (P - 1)))
    fail(ErrorKind::Request, "kv_page_size must be a power of two in 64..2^20, got " + std::to_string(P));
  if (P < opt_.attn_chunk)  // (a split-K block then reads at most two pages)
    fail(ErrorKind::Request, "kv_page_size " + std::to_string(P) + " must be >= attn_chunk " + std::to_string(opt_.attn_chunk));
  if (opt_.kv_pool_pages < 0)
    fail(ErrorKind::Request, "kv_pool_pages must be >= 0 (0: enough for max_seq_len), got " +
                                 std::to_string(opt_.kv_pool_pages));
  check_max_batch(opt_.max_batch);
  if (opt_.batch_gemv_f16_max < 0) fail(ErrorKind::Request, "batch_gemv_f16_max must be >= 0");
  if (opt_.batch_gemv_quant_max < 0) fail(ErrorKind::Request, "batch_gemv_quant_max must be >= 0");
  if (opt_.batch_mma_max < 0 || opt_.batch_mma_max > 64)
    fail(ErrorKind::Request, "batch_mma_max must be in 0..64, got " + std::to_string(opt_.batch_mma_max));
  if (opt_.batch_mma_f16_max < 0 || opt_.batch_mma_f16_max > 64)
    fail(ErrorKind::Request, "batch_mma_f16_max must be in 0..64, got " + std::to_string(opt_.batch_mma_f16_max));
  if (opt_.batch_mma_f16_qkvo_max < 0 || opt_.batch_mma_f16_qkvo_max > 64)
    fail(ErrorKind::Request,
         "batch_mma_f16_qkvo_max must be in 0..64, got " + std::to_string(opt_.batch_mma_f16_qkvo_max));
  if (opt_.batch_mma_f16_down_max < 0 || opt_.batch_mma_f16_down_max > 64)
    fail(ErrorKind::Request,
         "batch_mma_f16_down_max must be in 0..64, got " + std::to_string(opt_.batch_mma_f16_down_max));
  if (opt_.batch_down_k_slices < 0 || opt_.batch_down_k_slices > 8 ||
      (opt_.batch_down_k_slices > 1 && (opt_.batch_down_k_slices & (opt_.batch_down_k_slices - 1)) != 0))
    fail(ErrorKind::Request,
         "batch_down_k_slices must be 0, 1, 2, 4 or 8, got " + std::to_string(opt_.batch_down_k_slices));
  if (opt_.batch_mma_m_tiles < 0 || opt_.batch_mma_m_tiles > 2)
    fail(ErrorKind::Request, "batch_mma_m_tiles must be 0 (auto), 1 or 2, got " + std::to_string(opt_.batch_mma_m_tiles));
  {
    cuda::DecodeAttnParams a;  // (a clear error for a span the head dim cannot take)
    a.head_dim = (int)cfg_.head_dim;
    a.rows_span = opt_.batch_attn_span;
    if (opt_.batch_attn_span != 0) cuda::attn_rows_span_of(a);
    a.rows_heads = opt_.batch_attn_heads;
    cuda::check_attn_rows_heads(a);
  }
  if (opt_.gemv_grid < -1 || opt_.gemv_grid > 2) fail(ErrorKind::Request, "gemv_grid must be -1 (tuned), 0, 1 or 2");
  if (opt_.act8 < -2 || opt_.act8 > 2)
    fail(ErrorKind::Request,
         "act8 must be -2 (int4 weights but down), -1 (int4 weights), 0 (off), 1 (tuned per role) or 2 (on)");
  if (!(opt_.gemv_resident_margin >= 0 && opt_.gemv_resident_margin <= 1))
    fail(ErrorKind::Request, "gemv_resident_margin must be in [0, 1]");
  for (const GemvPin& pin : opt_.gemv_pins) {
    check_pin(pin);
    if (pin.rows_per_warp == kGemvMmaOneRow && opt_.trace)
      fail(ErrorKind::Request,
           "gemv_pins: the tensor-core product (16) has no trace stamps: not with CudaOptions.trace");
  }
  if (opt_.persistent_timeout_ms < 1) fail(ErrorKind::Request, "persistent_timeout_ms must be >= 1");
  if (opt_.persistent_blocks_per_sm < 1 || opt_.persistent_blocks_per_sm > 4)
    fail(ErrorKind::Request, "persistent_blocks_per_sm must be 1 to 4");
  if (opt_.persistent_ring_slots < 2 || opt_.persistent_ring_slots > 8)
    fail(ErrorKind::Request, "persistent_ring_slots must be 2 to 8");
  if (opt_.persistent_ring_slot_kib < 1 || opt_.persistent_ring_slot_kib > 128)
    fail(ErrorKind::Request, "persistent_ring_slot_kib must be 1 to 128");
  if (opt_.decode_long_from < -1) fail(ErrorKind::Request, "decode_long_from must be -1 (tuned), 0 (off) or a context");
  if (opt_.early_trigger < -1 || opt_.early_trigger > 2)
    fail(ErrorKind::Request, "early_trigger must be -1 (timed), 0 (off), 1 (the GEMVs) or 2 (the GEMVs and the "
                             "attention), got " + std::to_string(opt_.early_trigger));
  if (opt_.smem_carveout < -2 || opt_.smem_carveout > 100)
    fail(ErrorKind::Request, "smem_carveout must be -2 (timed), -1 (the driver's choice) or a percent 0..100, got " +
                                 std::to_string(opt_.smem_carveout));
  if (opt_.smem_carveout >= 0 && !cuda::kLaunchCarveout)
    fail(ErrorKind::Request, "smem_carveout: this build's CUDA toolkit (before 12.5) cannot ask for a carveout");
#ifndef TI_TRACE
  if (opt_.trace)
    fail(ErrorKind::Request, "CudaOptions.trace: this build has no tracing (rebuild with CMAKE_ARGS=-DTINYINFER_TRACE=ON)");
#endif
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

// The graphs of the decode pass: a prompt token (logits only), a decode step (+ sampling), and (one_chunk_graph)
// the decode step of contexts below one attention chunk, without the merge kernel.
void CudaEngine::build_graphs() {
  if (!opt_.graphs) return;
  auto capture = [&](bool sample, bool one_chunk, cudaGraphExec_t* out) {
    TI_CUDA_CHECK(capture_graph(stream_, [&] {
      sample ? step_->record(stream_, pdl_, one_chunk) : step_->record_token_logits(stream_, pdl_);
    }, out));
  };
  auto capture_all = [&] {
    capture(false, false, &g_prompt_token_);
    if (opt_.one_chunk_graph) capture(true, true, &g_decode_one_);
    capture(true, false, &g_decode_);
  };
  try {
    capture_all();
  } catch (const Error&) {
    if (!pdl_) throw;
    // A driver that cannot capture programmatic launches: capture plain ones instead.
    cudaGetLastError();
    for (cudaGraphExec_t* g : {&g_prompt_token_, &g_decode_one_}) {
      if (*g) cudaGraphExecDestroy(*g);
      *g = nullptr;
    }
    pdl_ = false;
    plan_.early_trigger = 0;  // (nothing triggers without PDL: the plan says so)
    capture_all();
  }
  graphs_ok_ = true;
}

// ---- the tuning step: the GEMV plan, the decode graphs, the long-context graph ----

std::string CudaEngine::plan_key(const ModelConfig& c, int64_t max_seq_len, const CudaOptions& o) {
  int dev = 0;
  cudaDeviceProp prop{};
  TI_CUDA_CHECK(cudaGetDevice(&dev));
  TI_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  const int chunk = o.attn_chunk ? o.attn_chunk : cuda::attn_chunk_for((int)c.head_dim);
  // The long-context decision is timed up to the longest context the KV pool holds (decode_long_graph).
  const int64_t longest = o.kv_pool_pages > 0 ? std::min<int64_t>(max_seq_len, o.kv_pool_pages * o.kv_page_size)
                                              : max_seq_len;
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                " | model h%lld i%lld l%lld q%lld kv%lld d%lld v%lld tie%d %s | rows %d grid %d margin %.4g small %d "
                "steps %d act8 %d long %lld ctx %lld pdl %d graphs %d early %d chunk %d page %d trace %d carveout %d "
                "mma %d",
                (long long)c.hidden, (long long)c.intermediate, (long long)c.n_layers, (long long)c.n_heads,
                (long long)c.n_kv_heads, (long long)c.head_dim, (long long)c.vocab, (int)c.tie_word_embeddings,
                to_string(o.weights).c_str(), o.gemv_rows, o.gemv_grid, o.gemv_resident_margin, (int)o.gemv_small_tiles,
                (int)(o.gemv_step_check && o.graphs), o.weights != WFormat::F16 ? o.act8 : 0,
                (long long)o.decode_long_from, (long long)std::min<int64_t>(1024, longest - 64),
                (int)(o.pdl && prop.major >= 9), (int)o.graphs, (int)o.early_trigger, chunk, o.kv_page_size,
                (int)o.trace, o.smem_carveout, (int)o.gemv_mma);
  return plan_device_id() + " | " + plan_build_id() + buf;
}

std::string CudaEngine::plan_text() const {
  return opt_.gemv_pins.empty() ? gemv_plan_to_text(plan_, plan_key_) : std::string();
}

// The memory kept busy before a load times anything (docs/perf/persistent.md §45: ~1 s of streaming reads was
// enough, an SM-only spin was not), unless this process finished timing another load a moment ago (the loads that
// followed another one's tuning had not needed it; nor do the tests' back-to-back engines).
namespace {
constexpr double kTuneWarmupMs = 1000;
constexpr std::chrono::seconds kStillWarm{5};
std::atomic<int64_t> g_last_timed_end{0};  // steady_clock ticks: when a load of this process last finished tuning
}  // namespace

// The plan from opt_.plan_text where it is whole and made for this key (else tuned); pins on top; the graphs.
void CudaEngine::tune() {
  using clock = std::chrono::steady_clock;
  auto secs = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  const clock::time_point t0 = clock::now();
  plan_key_ = plan_key(cfg_, max_seq_, opt_);
  if (!opt_.plan_text.empty()) {
    PlanRead r = gemv_plan_from_text(opt_.plan_text, plan_key_);
    plan_cached_ = r.plan.has_value();
    if (plan_cached_) plan_ = std::move(*r.plan);
    else plan_problem_ = r.problem;
  }
  if (!plan_cached_) {
    // A plan tuned right after the GPU's idle is the one every later run replays from the cache (plan_cache.h).
    const int64_t last = g_last_timed_end.load();
    if (last == 0 || clock::now() - clock::time_point(clock::duration(last)) > kStillWarm)
      cuda::warm_memory(kTuneWarmupMs);
    GemvTuneOptions t{opt_.gemv_rows, opt_.gemv_grid, opt_.gemv_resident_margin, opt_.gemv_small_tiles, {}};
    t.act8 = opt_.act8;
    t.mma = opt_.gemv_mma && !opt_.trace;  // (the tensor-core product has no trace stamps)
    plan_ = tune_gemv_plan(cfg_, *weights_, dbuf_, t, opt_.early_trigger >= 1, pdl_, *clock_);
    // set before the carveout is timed (no PDL: never early)
    plan_.early_trigger = opt_.early_trigger >= 1 && pdl_ ? opt_.early_trigger : 0;
    choose_carveout();  // the early trigger and the step check inside, under each carveout tried
  }
  for (const GemvPin& pin : opt_.gemv_pins)
    if (GemvShapePlan* g = plan_.find(pin.role)) apply_pin(*g, pin);
  // R = 16 (pinned, or from a saved plan) checked here, not where the graphs are captured, so that the error names
  // its cause
  for (const GemvShapePlan& g : plan_.shapes) {
    if (g.chosen.rows_per_warp != kGemvMmaOneRow || weights_->layers.empty()) continue;
    if (!cuda::mma_one_row_fits(role_matrix(*weights_, g.role, 0), role_in(g.role)))
      fail(ErrorKind::Unsupported, std::string("the tensor-core product (R = 16) for ") + role_name(g.role) +
                                       " needs sm_80 or newer, (normed inputs) K <= " +
                                       std::to_string(cuda::kMmaOneRowMaxK) + " and (int4) K % 32 == 0");
  }
  const clock::time_point t1 = clock::now();
  if (!plan_cached_) g_last_timed_end.store(t1.time_since_epoch().count());
  build_graphs();
  const clock::time_point t2 = clock::now();
  decode_long_graph();
  persistent_graph();
  tune_s_[0] = secs(t0, t1);
  tune_s_[1] = secs(t1, t2);
  tune_s_[2] = secs(t2, clock::now());
}

// Whole decode steps (the graph of one step, at contexts 64-87: the merge kernel runs), where the sequence can hold
// them (can_time_steps). The caller resets the cache (it holds benchmark tokens).
constexpr int64_t kStepContext = 64;
constexpr int kTimedSteps = 24;
bool CudaEngine::can_time_steps() const {
  return std::min<int64_t>(max_seq_, pool_->n_pages() * pool_->page_size()) >= kStepContext + kTimedSteps + 1;
}

namespace {
struct StepGraphs {  // graphs of the decode step, destroyed with the holder
  std::vector<cudaGraphExec_t> g;
  ~StepGraphs() {
    for (cudaGraphExec_t x : g) cudaGraphExecDestroy(x);
  }
};
}  // namespace

// The decode step's graph with plan_ as it is.
cudaGraphExec_t CudaEngine::capture_step() {
  cudaGraphExec_t g = nullptr;
  TI_CUDA_CHECK(capture_graph(stream_, [&] { step_->record(stream_, pdl_); }, &g));
  return g;
}

// Each graph's step, timed in `rounds` interleaved rounds (the best round of each kept), so that a slower moment
// hits every candidate alike rather than whichever was timed then: the trigger levels differ by 1-3% a step, and
// timed one after another they were picked differently from load to load (docs/perf/persistent.md §40). Not for
// candidates that leave the SMs in another state (the carveout: choose_carveout).
std::vector<double> CudaEngine::time_step_graphs(const std::vector<cudaGraphExec_t>& graphs, int rounds) {
  std::vector<double> us(graphs.size(), 1e30);
  for (int r = 0; r < rounds; r++)
    for (size_t i = 0; i < graphs.size(); i++) {
      auto launch = [&](int64_t) { TI_CUDA_CHECK(cudaGraphLaunch(graphs[i], stream_)); };
      us[i] = std::min(us[i], 1e3 * time_steps(kStepContext, kTimedSteps, launch));
    }
  return us;
}

// One plan (plan_): the best of two runs; the step check compares one role's flip with the last step it timed.
double CudaEngine::plan_step_us() {
  StepGraphs graphs;
  graphs.g.push_back(capture_step());
  return time_step_graphs(graphs.g, 2)[0];
}

// The carveout every kernel of the decode step asks for, with the early trigger and the step check settled under
// it (settle_plan). Timed: one preference for all of them (kStepCarveout) against the driver's choice per kernel,
// each settled on its own from the per-matrix picks, the faster whole step kept (kStepCarveout where faster by
// > 1%). Settled under each rather than chosen first on the per-matrix picks: the picks the step check makes depend
// on the carveout, and the best pair was missed that way (Llama-2-7B fp16: docs/perf/persistent.md §39). Timed
// rather than always on because it pays at large matrices and costs a little at small ones; why 50%:
// docs/perf/decode-options.md (smem_carveout).
void CudaEngine::choose_carveout() {
  constexpr int kStepCarveout = 50;
  constexpr double kGain = 0.01;
  plan_.carveout = opt_.smem_carveout == -2 ? -1 : opt_.smem_carveout;
  if (opt_.smem_carveout != -2 || !opt_.graphs || !cuda::kLaunchCarveout || !can_time_steps()) return settle_plan();
  const GemvPlan picks = plan_;
  settle_plan();
  const GemvPlan driver = plan_;
  try {
    // Each timed right after it was settled, not in interleaved rounds: an SM keeps its shared-memory configuration
    // from one kernel to the next where the next fits it, so the driver's choice per kernel, timed just after a
    // step of kStepCarveout, can run on the SMs that step configured and look as fast (docs/perf/persistent.md §40).
    const double t_driver = plan_step_us();
    plan_ = picks;
    plan_.carveout = kStepCarveout;
    settle_plan();
    const double t_one = plan_step_us();
    if (!(t_one < (1 - kGain) * t_driver)) plan_ = driver;
  } catch (const Error&) {
    cudaGetLastError();  // (a capture this driver refuses, say): the driver's choice
    plan_ = driver;
  }
  reset();  // the cache holds benchmark tokens
}

// The early trigger, then the step check, under plan_'s carveout.
void CudaEngine::settle_plan() {
  choose_early_trigger();
  if (opt_.gemv_step_check && opt_.graphs) check_plan_by_steps();
}

// Which of the decode step's kernels trigger their successor at their start (its blocks then become resident and
// ask for their first weights while this kernel runs) rather than after their dependency wait: none, the GEMVs but
// qkv, or those and the attention. Timed as whole steps, the three in interleaved rounds, a level kept where its
// step is faster than the best lower level's by > 0.3% (the rounds' spread; timed one after another with a 1%
// margin, level 0 stayed on about half the loads where a level was 1-3% faster: docs/perf/persistent.md §40). Early
// launches pay where the successor's loads fill the DRAM's idle time and cost where they slow a latency-bound
// neighbour, by model (docs/perf/decode-options.md, early_trigger). The GEMV picks were timed without.
void CudaEngine::choose_early_trigger() {
  constexpr double kGain = 0.003;  // (a forced setting is already in plan_: tune())
  if (opt_.early_trigger != -1 || !pdl_ || !opt_.graphs || !can_time_steps()) return;
  int pick = 0;
  try {
    StepGraphs levels;  // (the catch below leaves plan_ at the level kept so far)
    for (int level = 0; level <= 2; level++) {
      plan_.early_trigger = level;
      levels.g.push_back(capture_step());
    }
    const std::vector<double> t = time_step_graphs(levels.g, 3);
    double best = t[0];
    for (int level = 1; level <= 2; level++)
      if (t[(size_t)level] < (1 - kGain) * best) best = t[(size_t)level], pick = level;
    plan_.early_trigger = pick;
  } catch (const Error&) {
    cudaGetLastError();  // (a capture this driver refuses, say): the level kept so far
    plan_.early_trigger = pick;
  }
  reset();  // the cache holds benchmark tokens
}

// Whole decode steps (plan_step_us) judge the roles whose pick is not their fastest variant alone (gemv_plan.h).
// Skipped where the sequence is too short to time or a graph cannot be captured here (build_graphs then decides
// how the step is replayed).
void CudaEngine::check_plan_by_steps() {
  // step_us(p): p is plan_ itself (tune_plan_by_steps edits it in place), which step_ records from.
  auto step_us = [&](const GemvPlan&) { return plan_step_us(); };
  if (!can_time_steps()) return;
  const GemvPlan picks = plan_;
  try {
    tune_plan_by_steps(plan_, step_us);
  } catch (const Error&) {
    cudaGetLastError();  // (a capture this driver refuses, say): the per-matrix picks stand, none half-tried
    plan_ = picks;
  }
  reset();  // the cache holds benchmark tokens
}

cudaGraphExec_t CudaEngine::capture_decode(GemvVariant qkv) {
  GemvShapePlan* q = plan_.find(MatrixRole::Qkv);  // swapped while capturing
  const GemvVariant keep = q->chosen;
  q->chosen = qkv;
  cudaGraphExec_t g = nullptr;
  const cudaError_t err = capture_graph(stream_, [&] { step_->record(stream_, pdl_); }, &g);
  q->chosen = keep;
  TI_CUDA_CHECK(err);
  return g;
}

// A second decode graph for long contexts, differing in qkv's variant only (gemv_plan.h, tune_decode_long):
// the cached plan's decision where it has one and no pin changed qkv's pick; else timed.
void CudaEngine::decode_long_graph() {
  if (!graphs_ok_ || opt_.decode_long_from == 0) {
    plan_.long_from = -1;
    return;
  }
  if (plan_cached_ && opt_.gemv_pins.empty()) {
    if (plan_.long_from > 0) g_decode_long_ = capture_decode(plan_.qkv_long);
    return;
  }
  plan_.long_from = -1;
  DecodeGraphProbe probe;
  probe.capture = [&](GemvVariant v) { return capture_decode(v); };
  probe.step_ms = [&](cudaGraphExec_t g, int64_t context, int steps) {
    return time_steps(context, steps, [&](int64_t) { TI_CUDA_CHECK(cudaGraphLaunch(g, stream_)); });
  };
  // (timed at contexts the pool can hold: a pool smaller than max_seq_len must not fail the load)
  const int64_t longest = std::min<int64_t>(max_seq_, pool_->n_pages() * pool_->page_size());
  g_decode_long_ = ti::tune_decode_long(plan_, g_decode_, longest, opt_.decode_long_from, probe);
  reset();  // the cache may hold benchmark tokens
}

// The persistent step (DecodePath::Persistent, or Auto where it can run) captured with the sampler: decode()
// then replays it instead of the graph of kernels (prompt tokens keep the graph path).
void CudaEngine::persistent_graph() {
  if (opt_.decode_path == DecodePath::Graph) return;
  const bool forced = opt_.decode_path == DecodePath::Persistent;
  std::string why = PersistentDecode::unsupported(cfg_, *weights_, dbuf_);
  if (why.empty() && !opt_.graphs) why = "the persistent decode step is replayed as a graph (CudaOptions.graphs)";
  // It stages fp16 inputs, where the prefill and the batched step round them as the plan's int8-input GEMVs take
  // them: a sequence's decode steps would compute another function than its prompt.
  for (const GemvShapePlan& g : plan_.shapes)
    if (why.empty() && !weights_->layers.empty() && plan_act8(plan_, g.role, role_matrix(*weights_, g.role, 0)))
      why = std::string("the persistent decode step takes fp16 inputs, and CudaOptions.act8 puts ") +
            role_name(g.role) + " on int8 inputs (act8 = 0 for both)";
  if (why.empty()) {
    try {
      PersistentOptions po;
      po.prefetch = opt_.persistent_prefetch;
      po.fused_merge = opt_.persistent_fused_merge;
      po.blocks_per_sm = opt_.persistent_blocks_per_sm;
      po.timeout_ms = opt_.persistent_timeout_ms;
      po.ring = opt_.persistent_ring;
      po.ring_slots = opt_.persistent_ring_slots;
      po.ring_slot_kib = opt_.persistent_ring_slot_kib;
      po.kv_stage = opt_.persistent_kv_stage;
      persistent_ = std::make_unique<PersistentDecode>(cfg_, *weights_, dbuf_, po, arena_, stream_);
    } catch (const Error& e) {
      if (forced || e.kind() != ErrorKind::Unsupported) throw;
      why = e.what();
    }
  }
  if (!why.empty()) {
    if (forced) fail(ErrorKind::Unsupported, "CudaOptions.decode_path = persistent: " + why);
    persistent_problem_ = why;
    return;
  }
  TI_CUDA_CHECK(capture_graph(stream_, [&] {
    persistent_->record(stream_);
    cuda::sample_token(dbuf_.logits, (int)cfg_.vocab, dbuf_.sampling, dbuf_.seen, dbuf_.counts, dbuf_.probs,
                       dbuf_.state, dbuf_.out, stream_, false);
  }, &persistent_graph_));
}

void CudaEngine::release() {
  if (stream_) cudaStreamSynchronize(stream_);
  for (cudaGraphExec_t g : {g_prompt_token_, g_decode_, g_decode_long_, g_decode_one_, persistent_graph_})
    if (g) cudaGraphExecDestroy(g);
  g_prompt_token_ = g_decode_ = g_decode_long_ = g_decode_one_ = persistent_graph_ = nullptr;
  persistent_.reset();
  for (cudaGraphExec_t& g : g_batch_)
    if (g) cudaGraphExecDestroy(g);
  g_batch_.clear();
  batch_.reset();
  slots_.clear();
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

void CudaEngine::upload_sampling(const cuda::DeviceSampling& s) {
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // h_sampling_ may still be read by an earlier copy
  *h_sampling_ = s;
  TI_CUDA_CHECK(cudaMemcpyAsync(dbuf_.sampling, h_sampling_, sizeof(*h_sampling_), cudaMemcpyHostToDevice, stream_));
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
  if (prefill_) {
    for (int64_t c0 = 0; c0 < (int64_t)seq.size(); c0 += prefill_->rows()) {
      const int T = (int)std::min<int64_t>(prefill_->rows(), (int64_t)seq.size() - c0);
      prefill_->run_chunk(seq.data() + c0, T, (int)(pos0 + c0), rows_out, c0 - first);
    }
  } else {
    for (size_t i = 0; i < seq.size(); i++) {  // one token at a time through the decode pass
      set_state(seq[i], (int)(pos0 + (int64_t)i), 0);
      run_prompt_token();
      const int64_t row = (int64_t)i - first;
      if (rows_out && row >= 0)
        TI_CUDA_CHECK(cudaMemcpyAsync(rows_out + row * V, dbuf_.logits, V * sizeof(float), cudaMemcpyDeviceToHost,
                                      stream_));
    }
  }
  if (logits && !all_logits)
    TI_CUDA_CHECK(cudaMemcpyAsync(logits, dbuf_.logits, V * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  tokens_.insert(tokens_.end(), tokens, tokens + n);
  for (int64_t i = 0; i < n; i++) history_.add_prompt(tokens[i]);
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

  upload_sampling(device_sampling(s));
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
    cuda::sample_token(dbuf_.logits, (int)cfg_.vocab, dbuf_.sampling, dbuf_.seen, dbuf_.counts, dbuf_.probs,
                       dbuf_.state, dbuf_.out, stream_, false);
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

}  // namespace ti
