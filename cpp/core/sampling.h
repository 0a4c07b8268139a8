// sampling.h — choosing the next token from a row of logits: the reference sampler.
// Order (as vLLM): allowed-token mask (structured outputs: the others' logits are -inf) -> logit bias ->
// repetition penalty (prompt + generated) -> presence / frequency penalties (generated only) -> temperature ->
// top-k -> top-p -> min-p -> draw. temperature == 0 is greedy (argmax of the penalised logits, lowest id on ties).
// The draw walks the kept tokens in order of logit (lower id first on ties); the candidates' mass, top-p's
// denominator, is added in token-id order. A NaN logit is never drawn, a +inf one always.
// The random draw uses a counter-based generator, uniform(seed, step), so a GPU sampler can reproduce the same
// stream without carrying state. The penalties themselves are penalty.h's penalise_logit, shared with the GPU
// sampler (cuda/sampling.cu).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "rng.h"  // uniform_from_counter(seed, step)

namespace ti {

struct SamplingConfig {
  float temperature = 0.0f;        // 0: greedy
  int64_t top_k = 0;               // 0: off
  float top_p = 1.0f;              // 1: off
  float min_p = 0.0f;              // 0: off
  float repetition_penalty = 1.0f; // 1: off; >1 discourages tokens already in the sequence
  uint64_t seed = 0;
  float presence_penalty = 0.0f;   // OpenAI/vLLM: logit -= presence * (count > 0), over GENERATED tokens only
  float frequency_penalty = 0.0f;  // logit -= frequency * count, over GENERATED tokens only
  // OpenAI's logit_bias: logit[bias_ids[j]] += bias_values[j] before the penalties. Distinct ids; a value of
  // -inf bans the token (the min_tokens of a request: its stop ids, while it is too short to stop).
  std::vector<int32_t> bias_ids;
  std::vector<float> bias_values;
  // Structured outputs: the tokens this step may take, one bit a token (bit t % 32 of word t / 32; the grammar's
  // mask); the others' logits are -inf before everything else. Empty: every token. Else exactly
  // mask_words(vocab) words with at least one token of the vocabulary allowed.
  std::vector<uint32_t> allowed;
};

// The words of an allowed-token mask over a vocabulary.
constexpr int64_t mask_words(int64_t vocab) { return (vocab + 31) / 32; }

// Whether token t is allowed (an empty mask allows every token).
inline bool token_allowed(const std::vector<uint32_t>& allowed, int64_t t) {
  return allowed.empty() || ((allowed[static_cast<std::size_t>(t >> 5)] >> (t & 31)) & 1u);
}

// The most logit-bias entries a SamplingConfig takes (the GPU sampler gives each one thread of its block).
constexpr int kMaxLogitBias = 1024;

// The most top-logprob entries a sampler returns per token (OpenAI's limit).
constexpr int kMaxTopLogprobs = 20;

// Throws ti::Error(Request) naming the bad field. With a vocab, also the logit bias's ids (in [0, vocab),
// distinct) and the allowed-token mask (mask_words(vocab) words, at least one token of the vocabulary allowed).
void validate(const SamplingConfig& s);
void validate(const SamplingConfig& s, int64_t vocab);

// The penalty state of one sequence.
struct TokenHistory {
  explicit TokenHistory(int64_t vocab);
  void add_prompt(int32_t t);     // the repetition penalty's set only
  void add_generated(int32_t t);  // the repetition set + counts
  void clear();
  void restart(const std::vector<int32_t>& prompt);  // clear(), then prompt's tokens as prompt
  std::vector<uint8_t> seen;      // (vocab) in the prompt or generated
  std::vector<int32_t> counts;    // (vocab) generated occurrences
};

struct SampleResult {
  int32_t token = 0;
  float logprob = 0.0f;               // log_softmax(RAW logits)[token] (before penalties / temperature)
  std::vector<int32_t> top_ids;       // top_logprobs entries of log_softmax(raw logits), descending, ties: lower id
  std::vector<float> top_logprobs;
};

int32_t argmax(const float* logits, int64_t vocab);

// The reference sampler of one row. h: the sequence's history (sized vocab; not changed here: the caller adds
// the token as generated). top_logprobs: 0..kMaxTopLogprobs, else a Request error. s is not validated here
// (validate(s, vocab) once per request: the logit bias's ids are used unchecked). scratch / scratch_ids are reused
// between calls to avoid allocation.
SampleResult sample_row(const float* logits, int64_t vocab, const SamplingConfig& s, uint64_t step,
                        const TokenHistory& h, int top_logprobs, std::vector<float>& scratch,
                        std::vector<int32_t>& scratch_ids);

// sample_row's token alone (no log-probabilities: a full pass over the row fewer); speculative decoding's draws.
int32_t sample_row_token(const float* logits, int64_t vocab, const SamplingConfig& s, uint64_t step,
                         const TokenHistory& h, std::vector<float>& scratch, std::vector<int32_t>& scratch_ids);

// The single-sequence form: history = token ids the repetition penalty applies to (prompt + generated so far);
// no presence / frequency penalty (it cannot tell generated tokens from the prompt). Same token as sample_row.
int32_t sample_token(const float* logits, int64_t vocab, const SamplingConfig& s, uint64_t step,
                     const std::vector<int32_t>& history, std::vector<float>& scratch,
                     std::vector<int32_t>& scratch_ids);

}  // namespace ti
