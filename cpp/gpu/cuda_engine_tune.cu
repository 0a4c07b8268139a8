// cuda_engine_tune.cu — CudaEngine's tuning step at load (cuda_engine.h): the GEMV plan (from the saved text or
// timed), the carveout, the early trigger and the step check settled by whole decode steps, the decode graphs, the
// long-context graph and the persistent step's graph. Why each is timed the way it is: docs/perf/decode-options.md.
#include "cuda_engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>

#include "../../cuda/attention.cuh"
#include "../../cuda/bandwidth.cuh"
#include "../../cuda/common.cuh"
#include "../../cuda/mma_one_row.cuh"
#include "../../cuda/sampling.cuh"
#include "../core/errors.h"
#include "plan_cache.h"

namespace ti {

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
    cuda::sample_token(dbuf_.logits, (int)cfg_.vocab, dbuf_.sampling, dbuf_.bias, dbuf_.mask, dbuf_.seen, dbuf_.counts,
                       dbuf_.probs, dbuf_.state, dbuf_.out, stream_, false);
  }, &persistent_graph_));
}

}  // namespace ti
