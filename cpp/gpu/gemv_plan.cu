// gemv_plan.cu — see gemv_plan.h. The picking rules and their measurements: docs/perf/decode-options.md.
#include "gemv_plan.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "../../cuda/common.cuh"
#include "../../cuda/mma_one_row.cuh"
#include "../core/config.h"
#include "../core/errors.h"
#include "decode_step.h"
#include "device_weights.h"
#include "measure.h"

namespace ti {

const char* role_name(MatrixRole r) {
  switch (r) {
    case MatrixRole::Qkv: return "qkv";
    case MatrixRole::O: return "o";
    case MatrixRole::GateUp: return "gate_up";
    case MatrixRole::Down: return "down";
    case MatrixRole::LmHead: return "lm_head";
  }
  return "?";
}

cuda::GemvOut role_out(MatrixRole r) {
  switch (r) {
    case MatrixRole::Qkv: case MatrixRole::LmHead: return cuda::GemvOut::F32;
    case MatrixRole::O: case MatrixRole::Down: return cuda::GemvOut::AddF32;
    case MatrixRole::GateUp: return cuda::GemvOut::Swiglu;
  }
  return cuda::GemvOut::F32;
}

cuda::GemvIn role_in(MatrixRole r) {
  return r == MatrixRole::O || r == MatrixRole::Down ? cuda::GemvIn::F16 : cuda::GemvIn::F32Norm;
}

const cuda::QMat& role_matrix(const DeviceWeights& w, MatrixRole r, int64_t layer) {
  if (r == MatrixRole::LmHead) return w.lm_head;
  const DeviceLayer& L = w.layers[(size_t)layer];
  return r == MatrixRole::Qkv ? L.qkv : r == MatrixRole::O ? L.o : r == MatrixRole::GateUp ? L.gate_up : L.down;
}

bool plan_variant_ok(int R, MatrixRole role) {
  return R == kGemvMmaOneRow || cuda::gemv_variant_ok(R, role_out(role));
}

void check_pin(const GemvPin& f) {  // (whether R = 16 fits the GPU and matrix: CudaEngine::tune)
  const std::string where = std::string("gemv_pins: ") + role_name(f.role) + ": ";
  const int R = f.rows_per_warp;
  if (R != 1 && R != 2 && R != 4 && R != cuda::kGemvSplitK && R != kGemvMmaOneRow)
    fail(ErrorKind::Request, where + "rows_per_warp must be 1, 2, 4, 8 (split-K) or 16 (tensor cores), not " +
                                 std::to_string(R));
  if (f.blocks_per_sm < 0 || f.blocks_per_sm > 2)
    fail(ErrorKind::Request, where + "blocks_per_sm must be 0, 1 or 2, not " + std::to_string(f.blocks_per_sm));
  if (R == kGemvMmaOneRow && f.blocks_per_sm != 0)
    fail(ErrorKind::Request, where + "the tensor-core product (16) sizes its own grid: blocks_per_sm must be 0");
}

const GemvShapePlan* GemvPlan::find(MatrixRole r) const {
  for (const GemvShapePlan& g : shapes)
    if (g.role == r) return &g;
  return nullptr;
}

GemvShapePlan* GemvPlan::find(MatrixRole r) { return const_cast<GemvShapePlan*>(std::as_const(*this).find(r)); }

GemvVariant GemvPlan::variant(MatrixRole r) const {
  const GemvShapePlan* g = find(r);
  return g ? g->chosen : GemvVariant{};
}

cuda::GemvParams gemv_args(const cuda::QMat& m, const void* x, void* y, const float* norm_w, float eps,
                           bool early_trigger) {
  cuda::GemvParams p;
  p.early_trigger = early_trigger;
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
  p.eps = eps;
  return p;
}

bool act8_applies(const cuda::GemvParams& p, cuda::GemvIn in) {
  return p.fmt != WFormat::F16 && cuda::gemv_act8_ok(p.K, in);
}

bool plan_act8(const GemvPlan& plan, MatrixRole role, const cuda::QMat& W) {
  return W.fmt != WFormat::F16 && plan.variant(role).act8 && cuda::gemv_act8_ok(W.K, role_in(role));
}

// kGemvMmaOneRow: the GEMV's arguments as the one-row tensor-core product's (cuda/mma_one_row.cuh; its trigger
// follows its wait: the plan's early triggers do not apply). Its shared memory (the staged row; a normed one with its
// norm weight, <= ~50 KB) fits two blocks per SM under the step's one carveout (persistent.md §23).
static void launch_mma_one_row(const cuda::GemvParams& p, cuda::GemvIn in, cuda::GemvOut out, cudaStream_t s,
                               bool pdl) {
  cuda::GemvBatchArgs a;
  a.W = cuda::QMat{p.fmt, p.fmt == WFormat::F16 ? static_cast<const void*>(p.W) : p.q, p.scales, p.rows, p.K,
                   p.fmt == WFormat::F16 ? p.ld : p.ldq};
  a.x = p.x;
  a.ldx = (int)cuda::pad8(p.K);
  a.norm_w = p.norm_w;
  a.eps = p.eps;
  a.y = p.y;
  a.ldy = out == cuda::GemvOut::Swiglu ? p.rows / 2 : p.rows;
  a.n = 1;
  cuda::mma_one_row(a, in, out, s, pdl);
}

// Variant v of one GEMV (the decode step's launch and the tuner's timing).
static void run_variant(cuda::GemvParams p, const GemvVariant& v, cuda::GemvIn in, cuda::GemvOut out, cudaStream_t s,
                        bool pdl) {
  if (v.rows_per_warp == kGemvMmaOneRow) return launch_mma_one_row(p, in, out, s, pdl);
  p.blocks_per_sm = v.blocks_per_sm;
  p.act8 = v.act8 && act8_applies(p, in);
  cuda::gemv(p, v.rows_per_warp, in, out, s, pdl);
}

void launch_gemv(const GemvPlan& plan, MatrixRole role, cuda::GemvParams p, cuda::GemvIn in, cuda::GemvOut out,
                 cudaStream_t s, bool pdl) {
  run_variant(p, plan.variant(role), in, out, s, pdl);
}

void apply_pin(GemvShapePlan& g, const GemvPin& f) {
  if (!plan_variant_ok(f.rows_per_warp, g.role))
    fail(ErrorKind::Request, "gemv_pins: no variant rows_per_warp=" + std::to_string(f.rows_per_warp) + " for " +
                                 role_name(f.role));
  // (the tensor-core product takes the fp16 input: no act8)
  g.chosen = GemvVariant{f.rows_per_warp, f.blocks_per_sm, f.rows_per_warp != kGemvMmaOneRow && g.chosen.act8};
  g.gb_per_s = 0;
  for (const GemvTrial& t : g.tried)
    if (t.variant == g.chosen) g.gb_per_s = g.bytes / (t.us * 1e-6) / 1e9;
}

// ---- the tuner ----

GemvShapePlan tune_gemv_shape(const GemvShapeSpec& s, const GemvTuneOptions& o,
                              const std::function<double(GemvVariant)>& us_per_matrix) {
  GemvShapePlan g;
  g.role = s.role;
  g.rows = s.rows;
  g.K = s.K;
  g.ld = (int)cuda::pad8(s.K);
  g.copies = s.copies;
  g.bytes = s.bytes;
  g.chosen = GemvVariant{1, 0};
  auto gb_per_s = [&](double us) { return s.bytes / (us * 1e-6) / 1e9; };
  double best = 1e30;
  auto time = [&](const GemvVariant& v) {
    const double us = us_per_matrix(v);
    g.tried.push_back({v, us});
    if (us < best) {
      best = us;
      g.chosen = v;
      g.gb_per_s = gb_per_s(us);
    }
  };
  for (int R : {1, 2, 4, cuda::kGemvSplitK}) {
    if (o.rows && R != o.rows && cuda::gemv_variant_ok(o.rows, s.out)) continue;
    if (!cuda::gemv_variant_ok(R, s.out)) continue;
    for (int bps : {0, 1, 2}) {  // grid: a block per tile, or 1 / 2 blocks per SM looping over tiles
      if (o.grid >= 0 && bps != o.grid) continue;
      for (int a8 = s.act8_lo; a8 <= s.act8_hi; a8++) time(GemvVariant{R, bps, a8 == 1});
    }
  }
  // The tensor-core product on the one row (its own grid, fp16 inputs): where it fits and nothing narrows the search.
  if (o.mma && s.mma_fits && o.rows == 0 && o.grid < 0 && s.act8_lo == 0) time(GemvVariant{kGemvMmaOneRow, 0, false});
  if (o.resident_margin > 0) {
    // Among the 2-blocks-per-SM variants within the margin of the fastest: the smallest tiles (the most blocks),
    // except before the attention: there the largest (the fewest blocks), which leaves SMs free for the
    // attention's blocks to start early (PDL) and fetch the cached keys and values before their wait.
    auto better = [&](size_t i, int pick) {
      if (pick < 0) return true;
      const int ti = cuda::gemv_tile_rows(g.tried[i].variant.rows_per_warp);
      const int tp = cuda::gemv_tile_rows(g.tried[(size_t)pick].variant.rows_per_warp);
      if (o.small_tiles && ti != tp) return s.before_attention ? ti > tp : ti < tp;
      return g.tried[i].us < g.tried[(size_t)pick].us;
    };
    int pick = -1;
    for (size_t i = 0; i < g.tried.size(); i++)
      if (g.tried[i].variant.blocks_per_sm == 2 && g.tried[i].us <= best * (1 + o.resident_margin) && better(i, pick))
        pick = (int)i;
    if (pick >= 0) {
      g.chosen = g.tried[(size_t)pick].variant;
      g.gb_per_s = gb_per_s(g.tried[(size_t)pick].us);
    }
  }
  for (const GemvPin& f : o.pins)
    if (f.role == g.role) apply_pin(g, f);
  return g;
}

GemvPlan tune_gemv_plan(const ModelConfig& c, const DeviceWeights& w, const DecodeBuffers& b, const GemvTuneOptions& o,
                        bool early_trigger, bool pdl, StreamClock& clock) {
  using cuda::GemvIn;
  using cuda::GemvOut;
  struct Shape {
    GemvShapeSpec spec;
    GemvIn in;
    std::vector<cuda::QMat> copies;
    const void* x;
    void* y;
    const float* norm;
    bool early;  // PDL trigger at the start, as in the decode step
  };
  const int rows_qkv = (int)(c.q_dim + 2 * c.kv_dim), H = (int)c.hidden, I = (int)c.intermediate;
  std::vector<Shape> shapes = {
      {{MatrixRole::Qkv, rows_qkv, H, 0, 0, GemvOut::F32, true}, GemvIn::F32Norm, {}, b.x, b.qkv, w.final_norm, false},
      {{MatrixRole::O, H, (int)c.q_dim, 0, 0, GemvOut::AddF32, false}, GemvIn::F16, {}, b.att, b.x, nullptr, true},
      {{MatrixRole::GateUp, 2 * I, H, 0, 0, GemvOut::Swiglu, false}, GemvIn::F32Norm, {}, b.x, b.h, w.final_norm, true},
      {{MatrixRole::Down, H, I, 0, 0, GemvOut::AddF32, false}, GemvIn::F16, {}, b.h, b.x, nullptr, true},
      {{MatrixRole::LmHead, (int)c.vocab, H, 0, 0, GemvOut::F32, false}, GemvIn::F32Norm, {w.lm_head}, b.x, b.logits,
       w.final_norm, true},
  };
  for (const DeviceLayer& L : w.layers) {
    shapes[0].copies.push_back(L.qkv);
    shapes[1].copies.push_back(L.o);
    shapes[2].copies.push_back(L.gate_up);
    shapes[3].copies.push_back(L.down);
  }
  cudaStream_t s = clock.stream();
  TI_CUDA_CHECK(cudaMemsetAsync(b.x, 0, c.hidden * sizeof(float), s));
  TI_CUDA_CHECK(cudaMemsetAsync(b.att, 0, w.ld_q * sizeof(__half), s));
  TI_CUDA_CHECK(cudaMemsetAsync(b.h, 0, w.ld_i * sizeof(__half), s));
  GemvPlan plan;
  for (Shape& sh : shapes) {
    sh.spec.copies = (int)sh.copies.size();
    const WFormat fmt = sh.copies[0].fmt;
    // -1 / -2: int8 inputs for the int4 matrices, fp16 for the others (-2: and for down's)
    const bool int4_on = fmt == WFormat::I4 && !(o.act8 == -2 && sh.spec.role == MatrixRole::Down);
    const int a8 = o.act8 >= 0 ? o.act8 : int4_on ? 2 : 0;
    if (a8 > 0 && fmt != WFormat::F16 && cuda::gemv_act8_ok(sh.spec.K, sh.in))
      sh.spec.act8_lo = a8 == 2, sh.spec.act8_hi = 1;
    sh.spec.bytes = (double)quant_bytes(sh.copies[0].fmt, sh.spec.rows, sh.spec.K);  // as stored, scales included
    sh.spec.mma_fits = o.mma && cuda::mma_one_row_fits(sh.copies[0], sh.in);
    // Cycle through every layer's copy (and at least ~256 MB of weights, several times the L2) so that the
    // timing is of memory, not of the cache. One pass where the copies already hold that much (a pass of 22
    // gate_up copies of TinyLlama is 1 GB: a second one only doubled the time spent; docs/perf/load.md).
    const int passes = std::max(1, (int)std::ceil(256e6 / (sh.spec.bytes * sh.spec.copies)));
    plan.shapes.push_back(tune_gemv_shape(sh.spec, o, [&](GemvVariant v) {
      const float ms = clock.replay_ms([&] {
        for (int i = 0; i < passes; i++)
          for (const cuda::QMat& W : sh.copies) {
            run_variant(gemv_args(W, sh.x, sh.y, sh.norm, (float)c.rms_eps, sh.early && early_trigger), v, sh.in,
                        sh.spec.out, s, pdl);
          }
      });
      return ms * 1e3 / (passes * sh.spec.copies);
    }));
  }
  return plan;
}

// Role by role, against the plan's own step time (gemv_plan.h).
int tune_plan_by_steps(GemvPlan& plan, const std::function<double(const GemvPlan&)>& step_us, double gain) {
  int flipped = 0;
  double t_plan = -1;
  // the kernel a variant runs: rows per warp, split-K, the tensor-core product
  auto kernel = [](const GemvVariant& v) {
    return v.rows_per_warp == cuda::kGemvSplitK ? 1 : v.rows_per_warp == kGemvMmaOneRow ? 2 : 0;
  };
  for (GemvShapePlan& g : plan.shapes) {
    const GemvTrial* fastest = nullptr;
    const GemvTrial* other[3] = {nullptr, nullptr, nullptr};  // the fastest of each kernel g.chosen is not
    for (const GemvTrial& t : g.tried) {
      if (!fastest || t.us < fastest->us) fastest = &t;
      const int k = kernel(t.variant);
      if (k != kernel(g.chosen) && (!other[k] || t.us < other[k]->us)) other[k] = &t;
    }
    const GemvVariant keep = g.chosen;
    const double keep_gb = g.gb_per_s;
    const GemvTrial* best = nullptr;
    double t_best = 0;
    const GemvTrial* cands[4] = {fastest, other[0], other[1], other[2]};
    for (int i = 0; i < 4; i++) {
      const GemvTrial* c = cands[i];
      if (!c || c->variant == keep || std::find(cands, cands + i, c) != cands + i) continue;  // (each timed once)
      if (t_plan < 0) t_plan = step_us(plan);
      g.chosen = c->variant;
      const double t = step_us(plan);
      if (t < (1 - gain) * t_plan && (!best || t < t_best)) best = c, t_best = t;
    }
    if (best) {
      g.chosen = best->variant;
      g.gb_per_s = g.bytes / (best->us * 1e-6) / 1e9;
      t_plan = t_best;
      flipped++;
    } else {
      g.chosen = keep;
      g.gb_per_s = keep_gb;
    }
  }
  return flipped;
}

// qkv's candidates for long contexts: the short graph's R at 1 block per SM, and the largest tiles among the
// 2-per-SM variants within 25% of the fastest alone. Each is timed as whole decode steps at a long context
// (min(1,024, max_seq_len - 64)); a candidate faster than the short graph by > 2% gets a graph, used from the
// first context in {64, 128, 256, 512} where it is faster by > 1% (bisected; else from the long context itself).
// The long graph differs from the short one in qkv's grid or tile height only.
cudaGraphExec_t tune_decode_long(GemvPlan& plan, cudaGraphExec_t short_graph, int64_t max_seq, int64_t forced_from,
                                 const DecodeGraphProbe& probe) {
  const GemvShapePlan* q = plan.find(MatrixRole::Qkv);
  const int64_t ctx_long = std::min<int64_t>(1024, max_seq - 64);
  if (!q || (forced_from < 0 && ctx_long < 256)) return nullptr;
  if (q->chosen.rows_per_warp == kGemvMmaOneRow) {  // (on the tensor-core product, pinned or picked: one graph)
    plan.long_from = -1;
    return nullptr;
  }
  const GemvVariant v0 = q->chosen;
  if (forced_from > 0) {  // forced (tests): qkv at 1 block per SM from that context on
    plan.qkv_long = GemvVariant{v0.rows_per_warp, 1, v0.act8};
    plan.long_from = forced_from;
    return probe.capture(plan.qkv_long);
  }
  std::vector<GemvVariant> cands;
  if (v0.blocks_per_sm != 1) cands.push_back({v0.rows_per_warp, 1, v0.act8});
  double best = 1e30;
  for (const GemvTrial& t : q->tried) best = std::min(best, t.us);
  int big = 0;
  for (const GemvTrial& t : q->tried) {
    const int R = t.variant.rows_per_warp;
    if (t.variant.blocks_per_sm == 2 && t.variant.act8 == v0.act8 && t.us <= 1.25 * best &&
        (!big || cuda::gemv_tile_rows(R) > cuda::gemv_tile_rows(big)))
      big = R;
  }
  if (big && !(big == v0.rows_per_warp && v0.blocks_per_sm == 2)) cands.push_back({big, 2, v0.act8});
  const int steps = 30;
  const double t_short = probe.step_ms(short_graph, ctx_long, steps);
  double t_best = t_short;
  cudaGraphExec_t long_graph = nullptr;
  for (const GemvVariant& v : cands) {
    cudaGraphExec_t g = probe.capture(v);
    const double t = probe.step_ms(g, ctx_long, steps);
    if (t < 0.98 * t_best) {
      if (long_graph) cudaGraphExecDestroy(long_graph);
      long_graph = g;
      t_best = t;
      plan.qkv_long = v;
    } else {
      cudaGraphExecDestroy(g);
    }
  }
  if (long_graph) {
    // The first context where the long graph leads by > 1%, found by bisection rather than context by context:
    // its lead grows with the context (the attention's share of the step does), so 2 probes of 60 steps each
    // decide what up to 4 did (docs/perf/load.md).
    std::vector<int64_t> at;
    for (int64_t c : {64, 128, 256, 512})
      if (c < ctx_long) at.push_back(c);
    size_t lo = 0, hi = at.size();  // the answer is in at[lo..hi), hi = at.size(): none (ctx_long)
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (probe.step_ms(long_graph, at[mid], steps) < 0.99 * probe.step_ms(short_graph, at[mid], steps)) hi = mid;
      else lo = mid + 1;
    }
    plan.long_from = lo < at.size() ? at[lo] : ctx_long;
  }
  return long_graph;
}

}  // namespace ti
