// gemv_plan.h — the load-time GEMV tuner's result as plain typed data, and the tuner.
//
// The decode step runs five GEMV shapes (MatrixRole). For each, a variant of cuda/gemv.cu — rows per warp R
// (1, 2, 4, or the split-K kernel), the grid (blocks per SM) and, for quantized weights with CudaOptions::act8,
// whether the input is quantized to int8 — is timed at load and the pick is kept here;
// the decode step only reads the plan. The plan is plain data (enums and numbers, no pointers) so that it can
// be stored and restored as it is. Why the picking rules look the way they do: docs/perf/decode-options.md.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "../../cuda/gemv.cuh"
#include "../../cuda/quant.cuh"

namespace ti {

class DeviceWeights;
struct DecodeBuffers;
class StreamClock;
struct ModelConfig;

enum class MatrixRole { Qkv, O, GateUp, Down, LmHead };
const char* role_name(MatrixRole r);  // "qkv" | "o" | "gate_up" | "down" | "lm_head"
cuda::GemvOut role_out(MatrixRole r);  // the output mode the decode step runs the role with
cuda::GemvIn role_in(MatrixRole r);    // and its input: the normed fp32 row (qkv, gate/up, LM head) or fp16
// The role's matrix of `layer` (the LM head: layer ignored); layer in range.
const cuda::QMat& role_matrix(const DeviceWeights& w, MatrixRole r, int64_t layer);

// R of the variant that runs the one-row tensor-core product (cuda/mma_one_row.cuh) instead of a GEMV, every role
// and weight format (the normed roles' RMSNorm in its prologue). Timed by the tuner only with CudaOptions::gemv_mma
// (off until measured), else forced through gemv_pins: whether mma.sync's fewer instructions a weight shorten the
// decode GEMVs (docs/perf/persistent.md §26-27: at fp16 and int8; not at int4, whose unpacking dominates).
constexpr int kGemvMmaOneRow = 16;
// Whether the decode step can run variant R for `role` (cuda::gemv_variant_ok, or kGemvMmaOneRow).
bool plan_variant_ok(int R, MatrixRole role);

struct GemvVariant {
  int rows_per_warp = 2;  // R: 1, 2, 4, cuda::kGemvSplitK (8 rows per block, K split over its warps) or kGemvMmaOneRow
  int blocks_per_sm = 0;  // grid: 0 = a block per tile; 1 or 2 = that many blocks per SM looping over tiles
  bool act8 = false;      // the input quantized to int8 per group (GemvParams::act8; only where act8_applies)
  bool operator==(const GemvVariant& o) const {
    return rows_per_warp == o.rows_per_warp && blocks_per_sm == o.blocks_per_sm && act8 == o.act8;
  }
};

struct GemvTrial {
  GemvVariant variant;
  double us = 0;  // µs per matrix, L2-cold (cycling through the layers' copies), graph-replayed
};

// One role's shape and what the tuner found for it.
struct GemvShapePlan {
  MatrixRole role = MatrixRole::Qkv;
  int rows = 0, K = 0, ld = 0;  // ld: pad8(K)
  int copies = 0;               // one per layer (1 for the LM head)
  GemvVariant chosen;
  std::vector<GemvTrial> tried;
  double gb_per_s = 0;          // of the chosen variant (0: pinned to a variant that was not timed)
  double bytes = 0;             // one matrix as stored, scales included (gb_per_s = bytes / us)
};

// A variant forced for one role after tuning (CudaOptions::gemv_pins, A/B runs); the role keeps its tuned act8.
struct GemvPin {
  MatrixRole role = MatrixRole::Qkv;
  int rows_per_warp = 2;
  int blocks_per_sm = 0;
};
void check_pin(const GemvPin& pin);  // throws ti::Error(Request) naming the bad value
// Forces pin's variant on g (g.role == pin.role); throws ti::Error(Request) where the role has no such variant.
void apply_pin(GemvShapePlan& g, const GemvPin& pin);

struct GemvPlan {
  std::vector<GemvShapePlan> shapes;  // in MatrixRole order
  // The long-context decode graph: from this context on, qkv runs at qkv_long (-1: one graph for all contexts).
  int64_t long_from = -1;
  GemvVariant qkv_long{0, 0};
  // The shared-memory carveout every kernel of the decode step asks for (cuda::launch_carveout, percent); -1: none,
  // the driver's choice per kernel. Timed at load (CudaOptions::smem_carveout).
  int carveout = -1;
  // Which kernels trigger their successor at their start (PDL) rather than after their wait: 0 none, 1 the GEMVs
  // other than qkv, 2 those and the attention's chunk kernel. Timed at load (CudaOptions::early_trigger).
  int early_trigger = 0;
  const GemvShapePlan* find(MatrixRole r) const;
  GemvShapePlan* find(MatrixRole r);
  GemvVariant variant(MatrixRole r) const;  // the chosen variant; {2, 0} for a role not tuned
};

struct GemvTuneOptions {
  int rows = 0;                  // 0: time every R; else only this R (where the output mode has it)
  int grid = -1;                 // -1: time blocks_per_sm 0, 1, 2; else only this one
  double resident_margin = 0.05;
  bool small_tiles = true;
  std::vector<GemvPin> pins;
  int act8 = 0;                  // quantized roles where act8_applies: 0 fp16 inputs, 1 timed both ways, 2 int8,
                                 // -1 int8 for int4 matrices and fp16 for int8 ones, -2 as -1 but down
  bool mma = false;              // also time kGemvMmaOneRow where it fits, unless rows / grid narrow the search or
                                 // act8 = 2 puts the role on int8 inputs
};

// One role as the tuner sees it.
struct GemvShapeSpec {
  MatrixRole role;
  int rows, K, copies;
  double bytes;          // one matrix as stored, scales included
  cuda::GemvOut out;     // which R the kernel offers depends on it
  bool before_attention; // the decode attention follows it (qkv)
  int act8_lo = 0, act8_hi = 0;  // the act8 values timed with every (R, grid): 0..0, 0..1 or 1..1
  bool mma_fits = false;         // kGemvMmaOneRow takes this role's matrix on this GPU (cuda::mma_one_row_fits)
};

// Times every allowed variant (us_per_matrix) and picks one by the options' rules; pins applied last.
GemvShapePlan tune_gemv_shape(const GemvShapeSpec& s, const GemvTuneOptions& o,
                              const std::function<double(GemvVariant)>& us_per_matrix);

// The whole plan at load (never inside a capture): every role timed over its layers' copies with the decode
// step's buffers (their contents are overwritten). o.pins are applied to each role's pick.
GemvPlan tune_gemv_plan(const ModelConfig& c, const DeviceWeights& w, const DecodeBuffers& b, const GemvTuneOptions& o,
                        bool early_trigger, bool pdl, StreamClock& clock);

// The picking rules (resident margin, tile sizes) are judged one matrix at a time; how a variant's grid meets its
// neighbours under PDL is not (why: docs/perf/decode-options.md, gemv_step_check). So at load each role's pick is
// judged by whole steps (step_us(plan): µs per decode step with the plan's variants) against up to three others:
// its fastest variant alone, and the fastest of each other kernel (rows per warp, split-K, the tensor-core product
// where timed: the split-K gate/up of Llama-2-7B int8 with int8 inputs, fastest alone, made the step 6.5% slower).
// One role at a time; a flip is kept where the step is faster by more than `gain`. Returns the roles flipped.
int tune_plan_by_steps(GemvPlan& plan, const std::function<double(const GemvPlan&)>& step_us, double gain = 0.01);

// The long-context decision. capture(v): a decode-step graph with qkv at v; step_ms(g, ctx): GPU ms per step
// of graph g at context ctx (mean of `steps`). forced_from > 0: qkv at 1 block per SM from that context (tests); else timed.
// Returns the long graph (nullptr: none) and records the decision in plan.long_from / plan.qkv_long.
struct DecodeGraphProbe {
  std::function<cudaGraphExec_t(GemvVariant qkv)> capture;
  std::function<double(cudaGraphExec_t, int64_t context, int steps)> step_ms;
};
cudaGraphExec_t tune_decode_long(GemvPlan& plan, cudaGraphExec_t short_graph, int64_t max_seq, int64_t forced_from,
                                 const DecodeGraphProbe& probe);

// The kernel's parameters for matrix m (x, y, norm_w as GemvParams documents them).
cuda::GemvParams gemv_args(const cuda::QMat& m, const void* x, void* y, const float* norm_w, float eps,
                           bool early_trigger);
// Whether GemvPlan::act8 takes this GEMV's input as int8: quantized weights and cuda::gemv_act8_ok (K % 32 == 0;
// normed inputs up to K = 8192). Elsewhere the GEMV keeps its fp16 input.
bool act8_applies(const cuda::GemvParams& p, cuda::GemvIn in);
// Whether the plan's GEMV of `role` takes matrix W's input as int8 (its act8, where act8_applies). Every other path
// of that product (the batched step's kernels, the prefill's GEMMs) then takes its input rounded to the same numbers,
// fp16(d xq) (cuda/act8.cuh), so that a token meets the same inputs whichever path computes it.
bool plan_act8(const GemvPlan& plan, MatrixRole role, const cuda::QMat& W);
// One GEMV of `role` with the plan's variant.
void launch_gemv(const GemvPlan& plan, MatrixRole role, cuda::GemvParams p, cuda::GemvIn in, cuda::GemvOut out,
                 cudaStream_t s, bool pdl);

}  // namespace ti
