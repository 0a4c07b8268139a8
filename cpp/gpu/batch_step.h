// batch_step.h — THE batched decode pass: one token for each of n rows (n sequence slots) through the model in
// one pass that reads every weight once (batch_step.cu reads top to bottom, like decode_step.cu). Each row runs
// at its own position through its own slot's page table; the rows' inputs (token, position, slot) live in
// device memory, so one graph per batch-size bucket (1, 2, 4, ..., max_batch) is captured and replayed with the
// batch padded to its bucket. A padding row has position -1: the attention skips it (it reads and writes no KV
// page); its other rows of the activations, its logits row included, hold harmless numbers (token 0).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../../cuda/attention.cuh"
#include "../../cuda/gemm.cuh"
#include "../../cuda/gemv.cuh"
#include "../core/config.h"
#include "decode_step.h"
#include "device_weights.h"
#include "gemv_plan.h"
#include "kv_pages.h"

namespace ti {

// The activations of up to max_rows rows (row strides: the padded widths), the rows' inputs, every slot's page
// table, the logits.
struct BatchBuffers {
  int max_rows = 0;            // max_batch (the largest bucket)
  int ld_qkv = 0, ld_gu = 0, ld_v = 0;
  int* rows = nullptr;         // (3, max_rows) device: tokens | positions (-1: padding) | slots
  int* h_rows = nullptr;       // pinned staging of the same
  int* tokens = nullptr;       // = rows
  int* pos = nullptr;          // = rows + max_rows
  int* slot = nullptr;         // = rows + 2 max_rows
  float* x = nullptr;          // (max_rows, ld_h) fp32 residual stream
  __half* xn = nullptr;        // (max_rows, ld_h) rmsnorm(x), the cuBLASLt products' input
  float* qkv = nullptr;        // (max_rows, ld_qkv) q | k | v before RoPE
  __half* att = nullptr;       // (max_rows, ld_q) attention output
  __half* gu = nullptr;        // (max_rows, ld_gu) gate/up interleaved (the cuBLASLt path; else fused)
  __half* h = nullptr;         // (max_rows, ld_i) silu(gate) * up
  // (2 max_rows, ld_v): rows 0..max_rows-1 the step's logits in row order (the LM head writes them, the sampler
  // and seq_logits read them there: no scatter to slots, no gather back); row max_rows + s is slot s's own row
  // (the prefill's target, and where the engine moves a slot's step row before a step without it overwrites it).
  float* logits = nullptr;
  float* part_o = nullptr;     // (max_rows, n_heads, attn_rows_max_splits, head_dim) split-K attention partials
  float* part_ml = nullptr;    // (max_rows, n_heads, attn_rows_max_splits, 2)
  unsigned* attn_tickets = nullptr;  // attn_rows_tickets(max_rows, ...) zeroed: the attention's merge tickets
  // (kDownSlicesMax, kDownSlicesRows, ld_h) the K slices of a down product (down_k_slices)
  float* down_parts = nullptr;
  // (max_rows + 1, table_stride) every slot's page table (-1: unassigned); row max_rows: the single sequence's,
  // copied in for a draft pass (record(draft), CudaEngine::decode_draft), its rows' slot draft_slot()
  int* tables = nullptr;
  int table_stride = 0;        // pages_for(max_seq)
  float* slot_row(int64_t slot) const { return logits + (size_t)(max_rows + slot) * ld_v; }
  int draft_slot() const { return max_rows; }

  static BatchBuffers allocate(const ModelConfig& c, const DeviceWeights& w, int max_rows, int64_t max_seq,
                               const KvPagePool& pages, DeviceArena& arena, cudaStream_t s);
};

// Which kernel takes the step's products (CudaOptions::batch_mma_max / _f16_max, batch_gemv_f16_max / _quant_max).
struct BatchStepOptions {
  int mma_max = 16;     // int8 / int4 products of up to this many rows (<= 64) take the tensor-core kernel first
  int mma_f16_max = 0;  // fp16 likewise
  int f16_max = 1;    // fp16 products of up to this many rows take the small-N GEMV, larger ones cuBLASLt
  int quant_max = 4;  // int8 / int4 likewise; larger: dequantized into the fp16 staging, then cuBLASLt
  int attn_span = 0;  // positions per attention block (CudaOptions::batch_attn_span; 0: the head dim's default)
  int attn_heads = 0;  // query heads per attention block (CudaOptions::batch_attn_heads; 0: by the bucket)
  int mma_m_tiles = 0;  // the tensor-core kernel's 16-row tiles per block (CudaOptions::batch_mma_m_tiles; 0: auto)
  int mma_f16_qkvo_max = 16;  // fp16 qkv and o products: mma_f16_max for those two (CudaOptions::batch_mma_f16_qkvo_max)
  int mma_f16_down_max = 0;  // fp16 down likewise (CudaOptions::batch_mma_f16_down_max)
  bool mma_ring = true;  // fp16 on that kernel: its shared-memory ring (CudaOptions::batch_mma_ring)
  int down_k_slices = 4;  // a down product on cuBLASLt of <= kDownSlicesRows rows: K slices (CudaOptions::batch_down_k_slices)
  bool one_row_plan = true;  // bucket 1 on the decode plan's GEMVs (CudaOptions::batch_one_row_plan)
  bool act8_fused = true;  // o's int8-rounded input written by the attention (CudaOptions::batch_act8_fused)
};

constexpr int kDownSlicesMax = 8, kDownSlicesRows = 16;

class BatchStep {
 public:
  // d: the decode buffers, for what the rows share with the single sequence (the KV pages, the RoPE table).
  // plan: the single sequence's GEMV plan (gemv_plan.h), which bucket 1 runs (one_row_plan).
  BatchStep(const ModelConfig& c, DeviceWeights& w, const DecodeBuffers& d, const BatchBuffers& b, cuda::Gemm& gemm,
            const GemvPlan& plan, BatchStepOptions o)
      : c_(c), w_(w), d_(d), b_(b), gemm_(gemm), plan_(plan), o_(o) {}
  // rows 0..n-1 of b.rows (n: a bucket, <= max_rows): each row's token at its position in its slot ->
  // logits row r (every row of the bucket, padding rows too, is written). Launches only (graph-capturable once
  // the GEMMs are tuned).
  // pdl: our kernels (small-N GEMV, tensor-core kernel, attention, RMSNorm) launched with PDL (common.cuh);
  // cuBLASLt's and the SwiGLU / dequantization / embedding kernels are plain launches.
  // draft: speculative decoding's draft pass, where the rows may be one slot's consecutive positions: each layer's
  // keys and values appended for every row first (append_kv_rows), then the attention, plainly launched, reading
  // them all from the cache (DecodeAttnParams::appended); bucket 1 too on these kernels.
  void record(int n, cudaStream_t s, bool pdl, bool draft = false);

 private:
  // Bucket 1 (one_row_plan): the products on the decode GEMVs of the plan, as decode_step.cu runs them.
  void record_one_row(cudaStream_t s);
  // The products over n rows, every weight read once per step (batch_step.cu): y = rmsnorm(x) @ W.T (or its
  // SwiGLU), x += X @ W.T; small_n: whether the small-N GEMV takes W (else cuBLASLt).
  // p: which product, by its decode role (at fp16 qkv, o and down may take the tensor-core kernel where the others
  // do not: mma_f16_qkvo_max, mma_f16_down_max).
  void normed(const cuda::QMat& W, const float* norm_w, void* y, int ldy, cuda::GemvOut out, int n, cudaStream_t s,
              MatrixRole p);
  // next_norm: the norm weight of the normed product after it (a down product in K slices writes that norm too).
  // X is rounded in place where act8(W, p), unless its producer wrote it rounded (rounded).
  void residual(const cuda::QMat& W, __half* X, int ldx, int n, cudaStream_t s, MatrixRole p,
                const float* next_norm, bool rounded = false);
  // Whether product p's matrix meets int8 inputs on the decode GEMVs (the plan's act8 for its role, where it
  // applies): then its input here is rounded to the same numbers on every path (cuda/act8.cuh), so that a sequence
  // meets the same inputs in a batch as alone.
  bool act8(const cuda::QMat& W, MatrixRole p) const;
  void gemm(const cuda::QMat& W, const __half* X, int ldx, void* Y, int ldy, int n, cuda::GemmOut out,
            cudaStream_t s);
  bool small_n(const cuda::QMat& W, int n, cuda::GemvIn in) const;
  bool mma(const cuda::QMat& W, int n, MatrixRole p) const;
  void mma_product(const cuda::QMat& W, const __half* X, int ldx, void* y, int ldy, cuda::GemvOut out, int n,
                   cudaStream_t s);
  cuda::GemmArgs gemm_args(const cuda::QMat& W, const __half* X, int ldx, void* Y, int ldy, int n,
                           cuda::GemmOut out) const;
  cuda::DecodeAttnParams attn_params(int64_t layer) const;
  const ModelConfig& c_;
  DeviceWeights& w_;
  const DecodeBuffers& d_;
  const BatchBuffers& b_;
  cuda::Gemm& gemm_;
  const GemvPlan& plan_;
  BatchStepOptions o_;
  bool pdl_ = false;  // (this record's)
  const float* xn_norm_ = nullptr;  // b_.xn already holds rmsnorm(x) with this norm weight (a sliced down wrote it)
};

}  // namespace ti
