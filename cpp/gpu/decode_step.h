// decode_step.h — THE decode pass: one token through the model on the GPU, as a flat list of launches
// (decode_step.cu reads top to bottom, docs/ARCHITECTURE.md). Token, position and step live in device memory
// (DecodeBuffers::state), so the recorded launches are captured once into a CUDA graph and replayed with no
// host work between steps.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../../cuda/attention.cuh"
#include "../../cuda/sampling.cuh"
#include "../core/config.h"
#include "device_weights.h"
#include "gemv_plan.h"
#include "kv_pages.h"

namespace ti {

// One token's activations, the KV cache and the decode loop's device state.
struct DecodeBuffers {
  float* x = nullptr;         // (hidden) residual stream
  float* qkv = nullptr;       // (q_dim + 2 kv_dim)
  __half* att = nullptr;      // (ld_q) attention output
  __half* h = nullptr;        // (ld_i) silu(gate) * up
  float* logits = nullptr;    // (vocab)
  float* part_o = nullptr;    // (n_heads, max_chunks, head_dim) split-K attention partials
  float* part_ml = nullptr;   // (n_heads, max_chunks, 2)
  float* rope_cos = nullptr;  // (max_seq, head_dim / 2)
  float* rope_sin = nullptr;
  // The paged KV cache (kv_pages.h, cuda/kv_layout.cuh): pages [layer][page][kv_head][page_size][head_dim] fp16
  // and the device copy of the sequence's page table, (ceil(max_seq / page_size)) page ids (-1: unassigned).
  __half* k_pages = nullptr;
  __half* v_pages = nullptr;
  size_t kv_layer_elems = 0;  // one layer's pages
  int* page_table = nullptr;
  int page_shift = 6;         // log2(page_size)
  cuda::DecodeState* state = nullptr;        // token, pos, step
  cuda::DeviceSampling* sampling = nullptr;  // the sampling parameters
  cuda::LogitBias* bias = nullptr;           // (kMaxLogitBias) their logit bias (sampling->n_bias entries)
  unsigned* mask = nullptr;                  // (mask_words(vocab)) their allowed tokens (read if sampling->has_mask)
  unsigned char* seen = nullptr;             // (vocab) the repetition penalty's set
  int* counts = nullptr;                     // (vocab) generated counts (presence / frequency penalties)
  float* probs = nullptr;                    // (vocab) sampler scratch
  int* out = nullptr;                        // (max_seq) sampled tokens of one decode() call
  unsigned long long* trace = nullptr;       // CudaOptions::trace: kTraceBlocks x kTraceWords per traced kernel
  int64_t max_seq = 0;
  int attn_chunk = 0;                        // positions per split-K attention block
  size_t trace_words = 0;                    // the length of trace (0: tracing off)

  static DecodeBuffers allocate(const ModelConfig& c, const DeviceWeights& w, int64_t max_seq, int attn_chunk,
                                const KvPagePool& pages, bool trace, DeviceArena& arena, cudaStream_t s);
};

class DecodeStep {
 public:
  DecodeStep(const ModelConfig& c, const DeviceWeights& w, const DecodeBuffers& b, const GemvPlan& plan,
             bool attn_tensor_cores)
      : c_(c), w_(w), b_(b), plan_(plan), attn_tensor_cores_(attn_tensor_cores) {}
  // state.token at state.pos -> logits (the cache gets the token's keys and values). one_chunk: for steps at
  // pos < attn_chunk only, without the attention's merge kernel (nothing to merge there).
  void record_token_logits(cudaStream_t s, bool pdl, bool one_chunk = false);
  // record_token_logits, then sample the next token into state.token and out[state.step].
  void record(cudaStream_t s, bool pdl, bool one_chunk = false);
  // One layer's attention parameters (also timed alone: CudaEngine::time_attention).
  cuda::DecodeAttnParams attn_params(int64_t layer) const;
  const std::vector<std::string>& trace_names() const { return trace_names_; }

 private:
  unsigned long long* next_trace(const char* name);  // the next kernel's stamps (nullptr: tracing off)
  const ModelConfig& c_;
  const DeviceWeights& w_;
  const DecodeBuffers& b_;
  const GemvPlan& plan_;
  bool attn_tensor_cores_;  // CudaOptions::attn_tensor_cores
  std::vector<std::string> trace_names_;  // the traced kernels, in launch order
};

}  // namespace ti
