// draft.h — speculative decoding's verification, the part both engines share (docs/perf/speculative.md).
//
// A caller guesses the next k tokens (a draft: an n-gram lookup in the prompt, a predicted output). The engine runs
// them through the model in one pass, which gives the logits after each of them; then the tokens are drawn exactly
// as decode() draws them, one per row, for as long as each drawn token equals the draft's next. With a draft that is
// one guess rather than a distribution, "draw from the target, keep going while it matches" is the rejection
// sampler of speculative decoding (accept draft token d with probability p(d); on a rejection the token drawn is
// distributed as p without d), so the answer is the one decode() gives: the same tokens at the same RNG counters,
// and greedy answers unchanged bit for bit where the logits are.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "engine_checks.h"
#include "sampling.h"

namespace ti {

// The checks of decode_draft(draft, k, ...) on a sequence of `position` tokens (a pending one counted)
// before it touches any state: decode()'s, the draft's ids, and room for the draft and the token after it.
inline void check_draft(const SamplingConfig& s, int64_t vocab, bool has_logits, const int32_t* draft, int64_t k,
                        int64_t position, int64_t max_seq) {
  validate(s, vocab);
  if (!has_logits) fail(ErrorKind::Request, "decode_draft: run a prompt through forward() first");
  if (k < 1) fail(ErrorKind::Request, "decode_draft: an empty draft (decode() draws without one)");
  check_tokens(draft, k, vocab);
  if (position + k + 1 > max_seq)
    fail(ErrorKind::Request, std::to_string(position) + " tokens in the sequence + a draft of " + std::to_string(k) +
                                 " + the token after it exceed max_seq_len=" + std::to_string(max_seq));
}

// The tokens of a draft's pass: the pending token (a sampled one not yet run: the sequence's last) and the draft.
inline std::vector<int32_t> draft_pass_tokens(const std::vector<int32_t>& tokens, bool pending, const int32_t* draft,
                                              int64_t k) {
  std::vector<int32_t> seq;
  if (pending) seq.push_back(tokens.back());
  seq.insert(seq.end(), draft, draft + k);
  return seq;
}

// accept_draft's rows from `logits` ((pass rows + 1) x vocab): row 0 the logits before the pass, then the pass's.
// Token i is drawn from the pass's row i with a pending token (row 0 ran it), else from the one before it.
inline std::vector<const float*> draft_rows(const float* logits, int64_t vocab, int64_t k, bool pending) {
  std::vector<const float*> rows((size_t)k + 1);
  for (int64_t i = 0; i <= k; i++) rows[(size_t)i] = logits + (pending ? i + 1 : i) * vocab;
  return rows;
}

// The tokens decode() would draw: rows[i] (vocab floats) is what token i is drawn from (i = 0: the logits before the
// draft; i > 0: those after draft[i - 1]), sample_row's token (sample_row_token) at counter step0 + i with
// `history` growing by each token drawn (as decode() adds it). Token i + 1 is drawn only while token i equals
// draft[i] and is not in stop_ids: 1 to k + 1 tokens, the (k + 1)-th (the "bonus") drawn from the logits after the
// whole draft.
inline std::vector<int32_t> accept_draft(const float* const* rows, int64_t vocab, const SamplingConfig& s,
                                         const int32_t* draft, int64_t k, const std::vector<int32_t>& stop_ids,
                                         uint64_t step0, TokenHistory& history,
                                         std::vector<float>& scratch, std::vector<int32_t>& scratch_ids) {
  std::vector<int32_t> out;
  for (int64_t i = 0; i <= k; i++) {
    const int32_t tok = sample_row_token(rows[i], vocab, s, step0 + (uint64_t)i, history, scratch, scratch_ids);
    history.add_generated(tok);
    out.push_back(tok);
    if (std::find(stop_ids.begin(), stop_ids.end(), tok) != stop_ids.end()) break;
    if (i < k && tok != draft[i]) break;
  }
  return out;
}

}  // namespace ti
