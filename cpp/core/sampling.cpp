#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "errors.h"
#include "penalty.h"
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
  // (the comparisons are false for NaN; +-inf fall outside the range)
  if (!(s.presence_penalty >= -2.0f && s.presence_penalty <= 2.0f))
    bad("presence_penalty must be a finite number in [-2, 2] (got " + std::to_string(s.presence_penalty) + ")");
  if (!(s.frequency_penalty >= -2.0f && s.frequency_penalty <= 2.0f))
    bad("frequency_penalty must be a finite number in [-2, 2] (got " + std::to_string(s.frequency_penalty) + ")");
  if (s.bias_ids.size() != s.bias_values.size())
    bad("logit bias: " + std::to_string(s.bias_ids.size()) + " ids but " + std::to_string(s.bias_values.size()) +
        " values");
  if (s.bias_ids.size() > (size_t)kMaxLogitBias)
    bad("logit bias: at most " + std::to_string(kMaxLogitBias) + " entries (got " + std::to_string(s.bias_ids.size()) +
        ")");
  for (float v : s.bias_values)  // -inf bans a token; NaN and +inf have no meaning here
    if (std::isnan(v) || v == INFINITY) bad("logit bias values must be finite or -inf (got " + std::to_string(v) + ")");
}

void validate(const SamplingConfig& s, int64_t vocab) {
  validate(s);
  // (checked for every row of every batched sample: ids sorted already, as Python's configs hold them, cost no copy)
  std::vector<int32_t> sorted;
  if (!s.allowed.empty()) {
    if ((int64_t)s.allowed.size() != mask_words(vocab))
      fail(ErrorKind::Request, "invalid sampling parameter: the allowed-token mask has " +
                                   std::to_string(s.allowed.size()) + " words; a vocab of " + std::to_string(vocab) +
                                   " needs " + std::to_string(mask_words(vocab)));
    bool any = false;  // (bits past the vocabulary in the last word do not count)
    for (int64_t w = 0; w < mask_words(vocab) && !any; w++) {
      const int64_t in_vocab = std::min<int64_t>(32, vocab - 32 * w);
      const uint32_t live = in_vocab == 32 ? 0xffffffffu : ((1u << in_vocab) - 1u);
      any = (s.allowed[(size_t)w] & live) != 0;
    }
    if (!any) fail(ErrorKind::Request, "invalid sampling parameter: the allowed-token mask allows no token");
  }
  const bool in_order = std::is_sorted(s.bias_ids.begin(), s.bias_ids.end());
  if (!in_order) {
    sorted = s.bias_ids;
    std::sort(sorted.begin(), sorted.end());
  }
  const std::vector<int32_t>& ids = in_order ? s.bias_ids : sorted;
  for (size_t j = 0; j < ids.size(); j++) {
    if (ids[j] < 0 || ids[j] >= vocab)
      fail(ErrorKind::Request, "invalid sampling parameter: logit bias token id " + std::to_string(ids[j]) +
                                   " is out of range for vocab " + std::to_string(vocab));
    if (j > 0 && ids[j] == ids[j - 1])
      fail(ErrorKind::Request, "invalid sampling parameter: logit bias token id " + std::to_string(ids[j]) +
                                   " appears twice");
  }
}

TokenHistory::TokenHistory(int64_t vocab) : seen((size_t)vocab, 0), counts((size_t)vocab, 0) {}

static void check_id(int32_t t, size_t vocab) {
  if (t < 0 || (size_t)t >= vocab)
    fail(ErrorKind::Request, "token id " + std::to_string(t) + " is out of range for vocab " + std::to_string(vocab));
}

void TokenHistory::add_prompt(int32_t t) {
  check_id(t, seen.size());
  seen[(size_t)t] = 1;
}

void TokenHistory::add_generated(int32_t t) {
  check_id(t, seen.size());
  seen[(size_t)t] = 1;
  counts[(size_t)t] += 1;
}

void TokenHistory::clear() {
  std::fill(seen.begin(), seen.end(), 0);
  std::fill(counts.begin(), counts.end(), 0);
}

void TokenHistory::restart(const std::vector<int32_t>& prompt) {
  clear();
  for (int32_t t : prompt) add_prompt(t);
}

int32_t argmax(const float* logits, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; i++)
    if (logits[i] > logits[best]) best = i;
  return (int32_t)best;
}

namespace {

// The draw, over the candidates in the order larger logit first, lower id first on ties: the cut-offs count and
// the seed's uniform walks in that order. p: exp((x - max) / T) by token id (the top token's is 1; 0 for a token
// that is not a candidate); sum: the candidates' mass, added in token-id order; nonzero: how many have p > 0 (they
// come first in the order: p does not rise as the logit falls). ids[0, h): the head of the order over k
// candidates, sorted (h == k: all of them). The walk's mass is sum where nothing was cut, else the kept prefix's,
// added in the order. The token, or -1 where the cut-offs or the walk reach past the head.
int32_t draw_in_head(const int32_t* ids, int64_t h, int64_t k, const double* p, double sum, int64_t nonzero,
                     const SamplingConfig& s, uint64_t step) {
  int64_t n = k;
  if (s.top_p < 1.0f) {  // smallest prefix whose mass reaches top_p
    double acc = 0;
    int64_t i = 0;
    while (i < h && (acc += p[ids[i]] / sum) < s.top_p) i++;
    if (i == h && h < k) return -1;
    n = std::min(i + 1, k);
  }
  if (s.min_p > 0.0f) {  // drop tokens below min_p * p(top)
    int64_t m = 1;
    while (m < n && m < h && p[ids[m]] >= s.min_p * p[ids[0]]) m++;
    if (m < n && m == h) return -1;
    n = m;
  }
  n = std::max<int64_t>(1, std::min(n, nonzero));  // a banned token (-inf: p 0) is never drawn
  double mass = sum;
  if (n < nonzero) {  // cut: the kept prefix (within the head, where the cut was found)
    mass = 0;
    for (int64_t i = 0; i < n; i++) mass += p[ids[i]];
  }
  const double u = uniform_from_counter(s.seed, step) * mass;
  double acc = 0;
  for (int64_t i = 0; i < std::min(n, h); i++) {
    acc += p[ids[i]];
    if (u < acc) return ids[i];
  }
  return n <= h ? ids[n - 1] : -1;
}

// The sampled draw from penalised logits x: temperature -> top-k -> top-p -> min-p -> the walk. A NaN logit
// (a broken model's) is never drawn; a +inf one always is (the lowest id of them); a row of NaN gives argmax's 0.
int32_t draw(const float* x, int64_t vocab, const SamplingConfig& s, uint64_t step, std::vector<int32_t>& ids) {
  // p by token id (doubles, 8 bytes a token: the callers' scratch is floats); one a thread, kept between calls.
  thread_local std::vector<double> p;
  p.assign((size_t)vocab, 0.0);
  float top = -INFINITY;
  int64_t top_id = -1;
  for (int64_t i = 0; i < vocab; i++)
    if (x[i] > top || (top_id < 0 && x[i] == top)) top = x[(size_t)(top_id = i)];
  if (top_id < 0) return argmax(x, vocab);          // every logit NaN
  if (top == INFINITY || top == -INFINITY) return (int32_t)top_id;  // (-inf: every token banned)
  const double inv_t = 1.0 / s.temperature;
  auto key = [&](int32_t a) { return std::isnan(x[a]) ? -INFINITY : x[a]; };
  auto by_logit = [&](int32_t a, int32_t b) { return key(a) > key(b) || (key(a) == key(b) && a < b); };
  auto weight = [&](int64_t i) { return std::isnan(x[i]) ? 0.0 : std::exp((x[i] - (double)top) * inv_t); };
  double sum = 0;
  int64_t nonzero = 0;
  if (s.top_k > 0 && s.top_k < vocab) {  // the k candidates sorted: top-k bounds the work already
    const int64_t k = s.top_k;
    ids.resize((size_t)vocab);
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), by_logit);
    for (int64_t i = 0; i < k; i++) p[(size_t)ids[i]] = weight(ids[i]);
    for (int64_t i = 0; i < vocab; i++) {  // (the others' p is 0: the candidates' sum in id order)
      sum += p[(size_t)i];
      nonzero += p[(size_t)i] > 0.0;
    }
    return draw_in_head(ids.data(), k, k, p.data(), sum, nonzero, s, step);
  }
  // Every token a candidate. Sorting the vocabulary (3.8 ms at 49,152 tokens) would cost more than the model's
  // step on a small model; the cut-offs and the walk almost always end within the few tokens near the top. So only
  // a head of the order is sorted: the tokens with p >= tau (a prefix of the order), tau falling to 0 (all) where
  // that head is not enough. Which token comes out does not depend on tau.
  for (int64_t i = 0; i < vocab; i++) {
    sum += (p[(size_t)i] = weight(i));
    nonzero += p[(size_t)i] > 0.0;
  }
  auto head = [&](double tau) {  // the tokens with p >= tau, in the order
    ids.clear();
    for (int64_t i = 0; i < vocab; i++)
      if (p[(size_t)i] >= tau) ids.push_back((int32_t)i);
    std::sort(ids.begin(), ids.end(), by_logit);
    return draw_in_head(ids.data(), (int64_t)ids.size(), vocab, p.data(), sum, nonzero, s, step);
  };
  for (double tau : {1e-4, 1e-9})
    if (const int32_t t = head(tau); t >= 0) return t;
  return head(0.0);  // every token (top is finite, so the head is not empty): never -1
}

// The token choice of one row. seen / counts: the history (null: none); x / ids: scratch.
int32_t choose(const float* logits, int64_t vocab, const SamplingConfig& s, uint64_t step, const uint8_t* seen,
               const int32_t* counts, std::vector<float>& x, std::vector<int32_t>& ids) {
  const bool rep = s.repetition_penalty != 1.0f && seen;
  const bool pf = (s.presence_penalty != 0.0f || s.frequency_penalty != 0.0f) && counts;
  if (s.temperature == 0.0f && !rep && !pf && s.bias_ids.empty() && s.allowed.empty()) return argmax(logits, vocab);
  x.assign(logits, logits + vocab);
  if (!s.allowed.empty())  // (validated: mask_words(vocab) words)
    for (int64_t i = 0; i < vocab; i++)
      if (!token_allowed(s.allowed, i)) x[i] = -INFINITY;
  for (size_t j = 0; j < s.bias_ids.size(); j++) x[(size_t)s.bias_ids[j]] += s.bias_values[j];  // (checked ids)
  if (rep || pf)
    for (int64_t i = 0; i < vocab; i++)
      x[i] = penalise_logit(x[i], rep && seen[i], pf ? counts[i] : 0, s.repetition_penalty, s.presence_penalty,
                            s.frequency_penalty);
  if (s.temperature == 0.0f) return argmax(x.data(), vocab);
  return draw(x.data(), vocab, s, step, ids);
}

}  // namespace

SampleResult sample_row(const float* logits, int64_t vocab, const SamplingConfig& s, uint64_t step,
                        const TokenHistory& h, int top_logprobs, std::vector<float>& x, std::vector<int32_t>& ids) {
  if (top_logprobs < 0 || top_logprobs > kMaxTopLogprobs)
    fail(ErrorKind::Request, "top_logprobs must be in 0.." + std::to_string(kMaxTopLogprobs) + " (got " +
                                 std::to_string(top_logprobs) + ")");
  if ((int64_t)h.seen.size() != vocab || (int64_t)h.counts.size() != vocab)
    fail(ErrorKind::Request, "sample_row: the history's vocab (" + std::to_string(h.seen.size()) +
                                 ") differs from the logits' (" + std::to_string(vocab) + ")");
  SampleResult r;
  r.token = choose(logits, vocab, s, step, h.seen.data(), h.counts.data(), x, ids);

  // log_softmax of the raw logits: l - (max + log sum exp(l - max)), in double.
  const float mx = logits[argmax(logits, vocab)];
  double sum = 0;
  for (int64_t i = 0; i < vocab; i++) sum += std::exp((double)logits[i] - mx);
  const double lse = mx + std::log(sum);
  r.logprob = (float)(logits[r.token] - lse);
  const int64_t k = std::min<int64_t>(top_logprobs, vocab);
  if (k > 0) {
    ids.resize((size_t)vocab);
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int64_t i = 0; i < k; i++) {
      r.top_ids.push_back(ids[i]);
      r.top_logprobs.push_back((float)(logits[ids[i]] - lse));
    }
  }
  return r;
}

int32_t sample_row_token(const float* logits, int64_t vocab, const SamplingConfig& s, uint64_t step,
                         const TokenHistory& h, std::vector<float>& x, std::vector<int32_t>& ids) {
  if ((int64_t)h.seen.size() != vocab || (int64_t)h.counts.size() != vocab)
    fail(ErrorKind::Request, "sample_row: the history's vocab (" + std::to_string(h.seen.size()) +
                                 ") differs from the logits' (" + std::to_string(vocab) + ")");
  return choose(logits, vocab, s, step, h.seen.data(), h.counts.data(), x, ids);
}

int32_t sample_token(const float* logits, int64_t vocab, const SamplingConfig& s, uint64_t step,
                     const std::vector<int32_t>& history, std::vector<float>& x, std::vector<int32_t>& ids) {
  std::vector<uint8_t> seen;
  if (s.repetition_penalty != 1.0f && !history.empty()) {
    seen.assign((size_t)vocab, 0);
    for (int32_t t : history)
      if (t >= 0 && t < vocab) seen[(size_t)t] = 1;
  }
  return choose(logits, vocab, s, step, seen.empty() ? nullptr : seen.data(), nullptr, x, ids);
}

}  // namespace ti
