// penalty.h — the logit penalties of one token, identical on the host and the device, so the CPU reference and
// the GPU sampler pick the same greedy token from the same logits and history. Bit-exact on both sides: the
// frequency term is one explicit fused multiply-add (a compiler may or may not contract a plain x - f * c).
#pragma once
#include <cmath>
#include <cstdint>

#include "rng.h"  // TI_HD

namespace ti {

// The penalised logit of a token:
//   repetition (transformers / vLLM): a token in the prompt or generated so far (seen): positive logits divided
//   by rep, negative ones multiplied;
//   presence / frequency (OpenAI / vLLM), over the generated tokens only (count): l - presence * (count > 0)
//   - frequency * count.
TI_HD float penalise_logit(float l, bool seen, int32_t count, float rep, float presence, float frequency) {
#if defined(__CUDA_ARCH__)  // the _rn intrinsics: never contracted with their neighbours
  if (seen && rep != 1.0f) l = l > 0.0f ? __fdiv_rn(l, rep) : __fmul_rn(l, rep);
  if (count > 0) l = __fmaf_rn(-frequency, (float)count, __fsub_rn(l, presence));
#else  // (x86-64 without -march: no FMA instructions to contract into)
  if (seen && rep != 1.0f) l = l > 0.0f ? l / rep : l * rep;
  if (count > 0) l = std::fma(-frequency, (float)count, l - presence);
#endif
  return l;
}

}  // namespace ti
