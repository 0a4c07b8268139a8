// sampling.h — choosing the next token from a row of logits: the reference sampler.
// Order (as vLLM and transformers): repetition penalty -> temperature -> top-k -> top-p -> min-p -> draw.
// temperature == 0 is greedy (argmax, lowest id on ties). The random draw uses a counter-based generator,
// uniform(seed, step), so a GPU sampler can reproduce the same stream without carrying state.
#pragma once
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
};

// Throws ti::Error(Request) naming the bad field.
void validate(const SamplingConfig& s);

int32_t argmax(const float* logits, int64_t vocab);

// history: token ids the repetition penalty applies to (prompt + generated so far).
// scratch is reused between calls to avoid allocation on the hot path.
int32_t sample_token(const float* logits, int64_t vocab, const SamplingConfig& s, uint64_t step,
                     const std::vector<int32_t>& history, std::vector<float>& scratch,
                     std::vector<int32_t>& scratch_ids);

}  // namespace ti
