// prefill_step.h — the batched prefill pass: a whole prompt per pass (chunks of up to CudaOptions::prefill_chunk
// tokens), or the prompts of many sequences at once (run_many), through cuBLASLt GEMMs and the tiled causal
// attention, as opposed to the decode step that feeds one token through a captured graph (decode_step.h).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../../cuda/gemm.cuh"
#include "../core/config.h"
#include "decode_step.h"
#include "device_weights.h"
#include "gemv_plan.h"

namespace ti {

// One chunk's activations (row strides are the padded widths).
struct PrefillBuffers {
  int rows = 0;        // tokens per chunk: min(prefill_chunk, max_seq)
  int logit_rows = 0;  // rows of all-position logits computed per slice
  int ld_qkv = 0, ld_gu = 0, ld_v = 0;
  int* tokens = nullptr;     // (rows)
  int* h_tokens = nullptr;   // pinned (rows)
  float* x = nullptr;        // (rows, ld_h) fp32 residual stream
  __half* xn = nullptr;      // (rows, ld_h) rmsnorm(x), the GEMMs' input
  float* qkv = nullptr;      // (rows, ld_qkv) q | k | v before RoPE
  __half* q = nullptr;       // (rows, q_dim) rope(q)
  __half* att = nullptr;     // (rows, ld_q) attention output
  __half* gu = nullptr;      // (rows, ld_gu) gate/up interleaved
  __half* h = nullptr;       // (rows, ld_i) silu(gate) * up
  float* logits = nullptr;   // (logit_rows, ld_v) logits of all positions (Engine.logits), a slice at a time
  // A many-sequence pass's layout (PrefillStep::run_many), in one int block uploaded once per pass, read by
  // every layer: per sequence an int4 (first row, tokens, pos0, table offset; first, so 16-byte aligned), per
  // attention block an int2 (cuda::prefill_attention_tiles), per token its position and page-table offset.
  // h_varlen: its pinned twin.
  int max_tiles = 0;
  int* varlen = nullptr;
  int* h_varlen = nullptr;
  int tiles_at() const { return 4 * rows; }
  int tok_pos_at() const { return tiles_at() + 2 * max_tiles; }
  int tok_table_at() const { return tok_pos_at() + rows; }
  int logit_src_at() const { return tok_table_at() + rows; }  // the gathered logits' source rows (run_many)
  int varlen_ints() const { return logit_src_at() + rows; }

  static PrefillBuffers allocate(const ModelConfig& c, const DeviceWeights& w, int rows, DeviceArena& arena);
};

// Where a chunk writes: the page table of the sequence it extends, and where the last row's residual and logits
// go (the single sequence: the decode buffers' table, x and logits; a batch slot: its own table and logits row).
struct PrefillTarget {
  const int* page_table = nullptr;
  float* x = nullptr;       // (hidden) the last row's residual
  float* logits = nullptr;  // (vocab) the last row's logits
};

// One sequence's part of a many-sequence pass (run_many): T tokens at positions pos0.. through the page table
// at tables + table_offset. x / logits: where its last row's residual and logits go (its own LM-head GEMV);
// null when the prompt goes on in a later pass (nothing is computed for it). logits_row >= 0 instead: its last
// row's logits are row logits_row of run_many's `gathered` (one LM-head GEMM for all such segments of the pass;
// their logits_rows ascend by one in segment order). token_src >= 0 (a one-token segment): its token is
// run_many's dev_tokens[token_src], on the device (a sampler's output the host has not seen yet), not tokens[0].
struct PrefillSegment {
  const int32_t* tokens = nullptr;  // (T) host
  int T = 0, pos0 = 0;
  int token_src = -1;
  int64_t table_offset = 0;
  float* x = nullptr;
  float* logits = nullptr;
  int logits_row = -1;
};

// How a pass's rows map onto sequences: one (T tokens at pos0 through page_table) or many (the varlen layout).
struct PrefillRows {
  int T = 0, pos0 = 0;
  const int* page_table = nullptr;
  const int* tok_pos = nullptr;     // varlen: per token (device)
  const int* tok_table = nullptr;
  const int4* seqs = nullptr;
  const int2* tiles = nullptr;
  int n_tiles = 0;
};

class PrefillStep {
 public:
  PrefillStep(const ModelConfig& c, DeviceWeights& w, const DecodeBuffers& d, const PrefillBuffers& b,
              const GemvPlan& plan, cuda::Gemm& gemm, cudaStream_t s);
  ~PrefillStep();
  PrefillStep(const PrefillStep&) = delete;
  PrefillStep& operator=(const PrefillStep&) = delete;
  int rows() const { return b_.rows; }
  // T <= rows() tokens at positions pos0..: fills the cache, leaves the last row's residual in the decode
  // buffers' x and its logits in their logits (what decode() samples from first). host_logits (may be null):
  // every row's logits as well, row r at host_logits row host_row0 + r (rows with host_row0 + r < 0 skipped).
  // Without host_logits it returns once launched (as run_many); the chunk's tokens stay in b.tokens.
  void run_chunk(const int32_t* tokens, int T, int pos0, float* host_logits, int64_t host_row0) {
    run_chunk(tokens, T, pos0, host_logits, host_row0, PrefillTarget{d_.page_table, d_.x, d_.logits});
  }
  // The same for any sequence: through `to`'s page table, the last row's residual and logits into `to`.
  void run_chunk(const int32_t* tokens, int T, int pos0, float* host_logits, int64_t host_row0,
                 const PrefillTarget& to);
  // Many sequences in one pass: segs[0..n) (distinct sequences, sum of T <= rows()) one after the other, the
  // products over all their rows at once (every weight read once), each token's RoPE at its own position, the
  // attention of each sequence over its own pages (varlen), the cache written through each one's table.
  // gathered (ld_v floats a row): where the segments with a logits_row put their logits (may be null if none).
  // Returns once launched: it waits only until the pinned staging's previous upload has run (not for the
  // stream, where a decode step launched ahead may still be running). The pass's tokens stay in b.tokens (row
  // order) until the next pass or chunk uploads its own. dev_tokens: where segments with a token_src read
  // their token (device memory, written ahead of the pass in stream order).
  void run_many(const PrefillSegment* segs, int n, const int* tables, float* gathered = nullptr,
                const int* dev_tokens = nullptr);

 private:
  void layer(const DeviceLayer& L, int64_t l, const PrefillRows& rows);
  void last_row_logits(int row, float* x, float* logits);
  void chunk_logits(int T, float* host_logits, int64_t host_row0);
  const ModelConfig& c_;
  DeviceWeights& w_;
  const DecodeBuffers& d_;
  const PrefillBuffers& b_;
  const GemvPlan& plan_;
  cuda::Gemm& gemm_;
  cudaStream_t s_;
  cudaEvent_t staged_ = nullptr;  // recorded after each upload from the pinned staging (b_.h_tokens, h_varlen)
};

// Every GEMM shape tuned so far, named by its role (qkv | o | gate_up | down | lm_head), by N.
std::vector<std::pair<std::string, cuda::GemmTuning>> named_gemm_table(const cuda::Gemm& gemm, const ModelConfig& c);

}  // namespace ti
