// sampling.cuh — on-device token choice (see sampling.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace ti::cuda {

// The sampler settings, in device memory so one captured graph serves every setting.
struct DeviceSampling {
  float temperature = 0.0f;  // 0: greedy
  int top_k = 0;             // 0: off
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  unsigned long long seed = 0;
};

// The decode loop's state, in device memory: the graph reads and advances it, the host sets it between calls.
struct DecodeState {
  int token = 0;      // the token the next forward pass feeds
  int pos = 0;        // its position
  int step = 0;       // sampler counter (the RNG's step) of the next sampled token
  int step_base = 0;  // out_tokens[step - step_base] receives each sampled token
};

// Chooses the next token from logits[vocab] (fp32), writes it to st->token and out_tokens, advances
// st->pos and st->step, marks it in seen[] (for the repetition penalty). scratch: float[vocab].
void sample_token(const float* logits, int vocab, const DeviceSampling* sp, unsigned char* seen, float* scratch,
                  DecodeState* st, int* out_tokens, cudaStream_t stream, bool pdl);

}  // namespace ti::cuda
