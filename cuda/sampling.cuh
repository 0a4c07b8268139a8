// sampling.cuh — on-device token choice (see sampling.cu).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../cpp/core/sampling.h"

namespace ti::cuda {

// The sampler settings, in device memory so one captured graph serves every setting.
struct DeviceSampling {
  float temperature = 0.0f;  // 0: greedy
  int top_k = 0;             // 0: off
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  unsigned long long seed = 0;
  float presence_penalty = 0.0f;   // over generated tokens (counts > 0)
  float frequency_penalty = 0.0f;  // times the generated count
  int n_bias = 0;                  // logit-bias entries (LogitBias) the launch's bias array holds for this row
  int has_mask = 0;                // 1: the launch's allowed-token mask holds this row's (structured outputs)
};

// One logit-bias entry: logits[id] += value (-inf: banned) before the penalties. A row's ids are distinct.
struct LogitBias {
  int id;
  float value;
};


// The decode loop's state, in device memory: the graph reads and advances it, the host sets it between calls.
struct DecodeState {
  int token = 0;      // the token the next forward pass feeds
  int pos = 0;        // its position
  int step = 0;       // sampler counter (the RNG's step) of the next sampled token
  int step_base = 0;  // out_tokens[step - step_base] receives each sampled token
};

// Chooses the next token from logits[vocab] (fp32), writes it to st->token and out_tokens, advances
// st->pos and st->step, marks it in seen[] (the repetition penalty) and counts it in counts[] (presence /
// frequency). seen: (vocab) u8, counts: (vocab) int32 — the sequence's history; scratch: float[vocab];
// bias: sp->n_bias entries (ids checked on the host). The bias is added to the logits in place and taken off
// again before the kernel ends: the logits are as they came after it. mask: mask_words(vocab) words, read when
// sp->has_mask (a token whose bit is 0 is never chosen: its logit reads as -inf).
void sample_token(float* logits, int vocab, const DeviceSampling* sp, const LogitBias* bias, const unsigned* mask,
                  unsigned char* seen, int* counts, float* scratch, DecodeState* st, int* out_tokens,
                  cudaStream_t stream, bool pdl);

// The most top-logprob entries per row (sample_rows' top_k).
constexpr int kMaxTopK = kMaxTopLogprobs;

struct RowSampling {             // device memory, one per row
  DeviceSampling s;
  unsigned long long step;       // RNG counter of the token being sampled
  int slot;                      // which history row (counts / seen) this row uses
  int logits_row;                // which row of `logits` (sample_rows) holds this row's logits
  int bias_off;                  // the row's s.n_bias logit-bias entries start at bias + bias_off (sample_rows)
  int mask_off;                  // with s.has_mask, the row's allowed-token mask starts at masks + mask_off (words)
};

// One block per row, the same per-row algorithm as sample_token (the same logits and history give the same
// token alone and in a batch). logits: row r's at logits + rows[r].logits_row * ld (the batched engine samples
// a slot where its logits lie, no gather). seen: (slots, vocab) u8; counts: (slots, vocab)
// int32 — the sampler marks seen and increments counts[slot][token] for the token it picks (so the rows of one
// launch must use distinct slots). scratch: n_rows * vocab floats. out_tokens[r]; out_logprob[r] (null: not
// computed): log_softmax(raw logits)[token]; top_ids / top_lp: (n_rows, top_k) when top_k > 0 (else may be
// null): the top_k largest raw-logit log-probabilities, descending, ties to the lower id (entries past the vocab:
// id -1, -inf). top_k: 0..kMaxTopK. bias: the rows' logit-bias entries (as sample_token: added in place, taken
// off before the log-probabilities, which are of the raw logits); masks: the rows' allowed-token masks (as
// sample_token's; the log-probabilities ignore them too).
void sample_rows(float* logits, int64_t ld, int n_rows, int vocab, const RowSampling* rows, const LogitBias* bias,
                 const unsigned* masks, unsigned char* seen, int* counts, float* scratch, int top_k, int* out_tokens,
                 float* out_logprob, int* top_ids, float* top_lp, cudaStream_t stream, bool pdl = false);

}  // namespace ti::cuda

namespace ti {

// The device form of a (validated) SamplingConfig: every field, the penalties included. (In namespace ti, beside
// the engines that call it: one definition for the single-sequence and the batched paths.)
// The logit-bias entries and the allowed-token mask live apart (n_bias says how many entries, has_mask whether a
// mask).
inline cuda::DeviceSampling device_sampling(const SamplingConfig& s) {
  return cuda::DeviceSampling{s.temperature, (int)std::min<int64_t>(s.top_k, INT32_MAX), s.top_p, s.min_p,
                              s.repetition_penalty, (unsigned long long)s.seed, s.presence_penalty,
                              s.frequency_penalty, (int)s.bias_ids.size(), s.allowed.empty() ? 0 : 1};
}

// s's logit-bias entries into out[0 .. s.bias_ids.size()).
inline void device_bias(const SamplingConfig& s, cuda::LogitBias* out) {
  for (size_t j = 0; j < s.bias_ids.size(); j++) out[j] = cuda::LogitBias{s.bias_ids[j], s.bias_values[j]};
}

}  // namespace ti
