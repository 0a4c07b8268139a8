#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "errors.h"
#include "rng.h"

namespace ti {

void validate(const SamplingConfig& s) {
  auto bad = [](const std::string& what) { fail(ErrorKind::Request, "invalid sampling parameter: " + what); };
  if (!(s.temperature >= 0.0f) || !std::isfinite(s.temperature))
    bad("temperature must be >= 0 (got " + std::to_string(s.temperature) + ")");
  if (s.top_k < 0) bad("top_k must be >= 0, 0 meaning off (got " + std::to_string(s.top_k) + ")");
  if (!(s.top_p > 0.0f && s.top_p <= 1.0f)) bad("top_p must be in (0, 1] (got " + std::to_string(s.top_p) + ")");
  if (!(s.min_p >= 0.0f && s.min_p <= 1.0f)) bad("min_p must be in [0, 1] (got " + std::to_string(s.min_p) + ")");
  if (!(s.repetition_penalty > 0.0f) || !std::isfinite(s.repetition_penalty))
    bad("repetition_penalty must be > 0 (got " + std::to_string(s.repetition_penalty) + ")");
}

int32_t argmax(const float* logits, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; i++)
    if (logits[i] > logits[best]) best = i;
  return (int32_t)best;
}

int32_t sample_token(const float* logits, int64_t vocab, const SamplingConfig& s, uint64_t step,
                     const std::vector<int32_t>& history, std::vector<float>& x, std::vector<int32_t>& ids) {
  const bool penalise = s.repetition_penalty != 1.0f && !history.empty();
  if (s.temperature == 0.0f && !penalise) return argmax(logits, vocab);
  x.assign(logits, logits + vocab);
  if (penalise) {  // transformers / vLLM: divide positive logits, multiply negative ones; once per token id
    ids.assign((size_t)vocab, 0);  // used as a "seen" mark here
    for (int32_t t : history) {
      if (t < 0 || t >= vocab || ids[t]) continue;
      ids[t] = 1;
      x[t] = x[t] > 0 ? x[t] / s.repetition_penalty : x[t] * s.repetition_penalty;
    }
  }
  if (s.temperature == 0.0f) return argmax(x.data(), vocab);

  // Softmax over the candidates, sorted by logit (stable: lower id first on ties).
  ids.resize((size_t)vocab);
  std::iota(ids.begin(), ids.end(), 0);
  int64_t k = (s.top_k > 0 && s.top_k < vocab) ? s.top_k : vocab;
  auto by_logit = [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  if (k < vocab) {
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), by_logit);
  } else {
    std::sort(ids.begin(), ids.end(), by_logit);
  }
  const double inv_t = 1.0 / s.temperature, top = x[ids[0]];
  std::vector<double> p((size_t)k);
  double sum = 0;
  for (int64_t i = 0; i < k; i++) sum += (p[i] = std::exp((x[ids[i]] - top) * inv_t));
  int64_t n = k;
  if (s.top_p < 1.0f) {  // smallest prefix whose mass reaches top_p
    double acc = 0;
    for (int64_t i = 0; i < k; i++) {
      acc += p[i] / sum;
      if (acc >= s.top_p) { n = i + 1; break; }
    }
  }
  if (s.min_p > 0.0f) {  // drop tokens below min_p * p(top); p[0] is the top
    int64_t m = 1;
    while (m < n && p[m] >= s.min_p * p[0]) m++;
    n = m;
  }
  double mass = 0;
  for (int64_t i = 0; i < n; i++) mass += p[i];
  const double u = uniform_from_counter(s.seed, step) * mass;
  double acc = 0;
  for (int64_t i = 0; i < n; i++) {
    acc += p[i];
    if (u < acc) return ids[i];
  }
  return ids[n - 1];
}

}  // namespace ti
