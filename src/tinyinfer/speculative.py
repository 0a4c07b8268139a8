"""Speculative decoding by n-gram lookup (vLLM's `speculative_config={"method": "ngram", ...}`, llama.cpp's
prompt lookup): the tokens that followed the last occurrence of the answer's latest n tokens are guessed to follow
again, and the engine checks the guess in one pass (the cores' decode_draft, docs/perf/speculative.md).

Where an answer repeats its context (a summary quoting its source, code edited in place, a list continued, JSON
echoing field names), several tokens come out of one pass; where nothing matches, nothing is drafted and the step
is an ordinary one. The answer is the same either way: the tokens are drawn as without speculation, at the same
RNG counters (greedy and seeded answers are unchanged)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from .errors import InvalidRequestError

MAX_SPECULATIVE_TOKENS = 64  # a draft's length at most (each drafted token is a row of the checking pass)
MAX_LOOKUP = 32  # the longest n-gram looked up


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config for its "ngram" method: drafts of up to num_speculative_tokens tokens, found by
    the answer's last n tokens (prompt_lookup_max >= n >= prompt_lookup_min, the longest first) in the prompt
    and the answer so far, the most recent occurrence first. The lookup bounds as vLLM resolves them: neither
    given, both 5; one given, the other equal to it. (num_speculative_tokens, which vLLM requires, is 5 unless
    given.)"""

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_max: Optional[int] = None
    prompt_lookup_min: Optional[int] = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "[ngram]"):  # (vLLM's older spelling too)
            raise InvalidRequestError(f"speculative_config.method must be 'ngram' (the one method this engine has), "
                                      f"got {self.method!r:.40}")
        for name, top in (("num_speculative_tokens", MAX_SPECULATIVE_TOKENS), ("prompt_lookup_max", MAX_LOOKUP),
                          ("prompt_lookup_min", MAX_LOOKUP)):
            v = getattr(self, name)
            if v is None and name != "num_speculative_tokens":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
                raise InvalidRequestError(f"speculative_config.{name} must be an integer in 1..{top}, got {v!r:.40}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        resolved = {"method": "ngram", "prompt_lookup_min": lo if lo is not None else hi if hi is not None else 5,
                    "prompt_lookup_max": hi if hi is not None else lo if lo is not None else 5}
        for name, v in resolved.items():
            object.__setattr__(self, name, v)  # (frozen: the resolved values, once)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequestError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not "
                                      f"exceed prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def of(cls, v: Union[None, "SpeculativeConfig", Mapping[str, Any]]) -> Optional["SpeculativeConfig"]:
        """The config from what a caller gives: None (off), a SpeculativeConfig, or its fields as a dict (vLLM's
        JSON form; an unknown key is refused by name)."""
        if v is None or isinstance(v, SpeculativeConfig):
            return v
        if not isinstance(v, Mapping):
            raise InvalidRequestError(f"speculative_config must be an object of its fields (a dict), got "
                                      f"{type(v).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in v if k not in known)
        if unknown:
            raise InvalidRequestError(f"speculative_config: unknown field(s) {', '.join(map(repr, unknown))} "
                                      f"(known: {', '.join(sorted(known))})")
        return cls(**v)


_MIX = np.uint64(0x9E3779B97F4A7C15)  # (an odd 64-bit multiplier: the n-grams' hash)


def _hashes(t: np.ndarray, n: int) -> np.ndarray:
    """The hash of every n-gram of t (len(t) - n + 1 of them, in order): h = (h * MIX + token) mod 2^64."""
    h = np.zeros(len(t) - n + 1, np.uint64)
    for j in range(n):
        h = h * _MIX + t[j:len(t) - n + 1 + j]
    return h


def _hash(tokens: Sequence[int]) -> int:
    h = 0
    for x in tokens:
        h = (h * int(_MIX) + x) & 0xFFFFFFFFFFFFFFFF
    return h


class NgramDrafter:
    """One answer's drafts. The context (the prompt, then each token the answer gains: extend()) is indexed as it
    grows: for every n in prompt_lookup_min..max, the hash of the n-gram ending at each position -> the position
    after it (the most recent occurrence's), so a draft costs a few dict lookups, not a scan of the context; a long
    prompt is indexed with numpy. A hash collision can only make a poor draft (which the check rejects), never a
    wrong answer."""

    def __init__(self, config: SpeculativeConfig, context: Sequence[int]):
        self.config = config
        self.tokens: list[int] = [int(x) for x in context]
        self._ns = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)  # longest first
        self._index: dict[int, dict[int, int]] = {n: {} for n in self._ns}
        self._indexed = 0  # the n-grams followed by a token before this position are in the index

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(x) for x in tokens)

    def _catch_up(self) -> None:
        # every n-gram followed by a token: the one ending at the last token is what is looked up, and its own
        # occurrence must not be found (nothing follows it)
        end = len(self.tokens) - 1  # the n-grams ending before t[end] are indexed (t[i - n:i] -> i, i <= end)
        if end <= self._indexed:
            return
        lo = self._indexed + 1  # positions lo..end are new
        if end - lo < 32:  # (a step's few tokens: numpy's calls would cost more than they save)
            t = self.tokens
            for n in self._ns:
                index = self._index[n]
                for i in range(max(lo, n), end + 1):
                    index[_hash(t[i - n:i])] = i
            self._indexed = end
            return
        t = np.asarray(self.tokens[max(0, lo - self.config.prompt_lookup_max):end], np.uint64)
        base = max(0, lo - self.config.prompt_lookup_max)
        for n in self._ns:
            first = max(lo, n)  # the first new position i with an n-gram t[i - n:i] before it
            if first > end:
                continue
            h = _hashes(t[first - n - base:], n)  # the n-grams ending at first - 1 .. end - 1
            self._index[n].update(zip(h.tolist(), range(first, end + 1)))  # (later ones overwrite: most recent)
        self._indexed = end

    def draft(self, k: int) -> list[int]:
        """Up to k tokens guessed to follow the context ([] where its last n tokens occur nowhere before). Where
        the occurrence found runs into the context's end, the repeat goes on: the tokens since it, again."""
        if k < 1:
            return []
        self._catch_up()
        t = self.tokens
        for n in self._ns:
            if len(t) > n:
                at = self._index[n].get(_hash(t[len(t) - n:]))
                if at is not None:
                    period = len(t) - at
                    return [t[at + i % period] for i in range(k)]
        return []


class PassCosts:
    """What a pass of the engine costs, by its rows (1: a plain decode step; k + 1: a draft of k after the pending
    token), as measured around the calls: an exponential moving average of the seconds each, the first pass of
    each row count left out (it may hold one-time work: a GEMM's tuning, a graph's capture). Shared by an engine's
    requests. A row count not yet measured is priced from its measured neighbours, or past the largest one at
    PRIOR_ROW_COST of a step a row more: optimistic, so that longer drafts get tried and measured."""

    PRIOR_ROW_COST = 0.1  # a memory-bound pass: a row more costs little beside the weights (the measurements decide)
    EMA = 0.2

    def __init__(self) -> None:
        self._s: dict[int, float] = {}
        self._seen: set[int] = set()

    def observe(self, rows: int, seconds: float) -> None:
        if rows not in self._seen:
            self._seen.add(rows)
            return
        old = self._s.get(rows)
        self._s[rows] = seconds if old is None else old + self.EMA * (seconds - old)

    def ratio(self, rows: int) -> float:
        """A pass of `rows` rows over a plain step."""
        one = self._s.get(1)
        if rows == 1 or one is None or one <= 0:
            return 1.0 + self.PRIOR_ROW_COST * (rows - 1)
        pts = sorted(self._s.items())
        lo = max((p for p in pts if p[0] <= rows), default=pts[0])
        hi = min((p for p in pts if p[0] >= rows), default=None)
        if hi is None:  # past the largest measured pass
            return (lo[1] + self.PRIOR_ROW_COST * one * (rows - lo[0])) / one
        if hi[0] == lo[0]:
            return hi[1] / one
        return (lo[1] + (hi[1] - lo[1]) * (rows - lo[0]) / (hi[0] - lo[0])) / one


class DraftPolicy:
    """One answer's draft lengths: the one that gives the most tokens a second (best_draft_length) at the answer's
    recent acceptance rate (over the draft positions checked: a draft of k of which j were kept checked j + 1
    positions, k where all were; each draft's counts weigh DECAY of the one after it, from a prior of one kept and
    one not) and the engine's measured pass costs. Where no draft pays, a short one is still tried after
    `probe_every` plain steps (8, doubled after a probe that kept nothing, up to 64): an answer that starts quoting
    its context is noticed within a few probes, one that never does costs little. Lookups that find nothing
    (missed()) let the plain steps between them run in longer calls (plain_steps: 1, then up to MISS_RUN_MAX
    after a few misses in a row), so an answer with nothing to quote keeps the GPU's multi-token calls."""

    PROBE_LENGTH, PROBE_FIRST, PROBE_MAX = 3, 8, 64
    DECAY = 0.8  # (about the last 5 drafts decide: a stretch of free text ends, a quote begins)
    MISS_FREE, MISS_RUN_MAX = 3, 16  # misses in a row before the runs lengthen (doubling), the longest run

    def __init__(self, costs: PassCosts):
        self.costs = costs
        self.kept, self.checked = 1.0, 2.0
        self.idle = 0  # plain steps since the last draft
        self.probe_every = self.PROBE_FIRST
        self._probe = False
        self._paying = False  # the last length(): some draft pays at this rate (only a match was missing)
        self.misses = 0  # lookups in a row that found no match

    @property
    def rate(self) -> float:
        return self.kept / self.checked

    def length(self, k_max: int) -> int:
        """How many tokens to draft now (0: a plain step), at most k_max."""
        k = best_draft_length(self.rate, k_max, self.costs)
        self._paying = k > 0
        self._probe = k == 0 and self.idle >= self.probe_every
        return min(k_max, self.PROBE_LENGTH) if self._probe else k

    def missed(self) -> None:
        """length() asked for a draft and the lookup found none. A probe that found none counts as made (the next
        one after probe_every more plain steps), not as failed."""
        self.misses += 1
        if self._probe:
            self.idle = 0

    def plain_steps(self) -> int:
        """After length() drafted nothing: how many plain steps may run in one call before a draft could be chosen,
        which the GPU's single path decodes in one call rather than one call a token: where a draft pays, 1 while a
        match may come with the next token (the first MISS_FREE misses in a row), then runs doubling up to
        MISS_RUN_MAX; else up to the next probe, or as long a run if the lookups keep missing."""
        run = min(self.MISS_RUN_MAX, 1 << max(0, self.misses - self.MISS_FREE))
        return run if self._paying else max(run, self.probe_every - self.idle)

    def drafted(self, drafted: int, kept: int, rows: int, seconds: float) -> None:
        """A draft of `drafted` tokens ran in a pass of `rows` rows taking `seconds`; `kept` of them were kept."""
        self.kept = self.DECAY * self.kept + kept
        self.checked = self.DECAY * self.checked + kept + (kept < drafted)
        self.costs.observe(rows, seconds)
        if self._probe:
            self.probe_every = min(self.PROBE_MAX, self.probe_every * 2) if kept == 0 else self.PROBE_FIRST
        self.idle = self.misses = 0

    def stepped(self, tokens: int, passes: int, seconds: float) -> None:
        """Plain steps gave `tokens` tokens in `seconds` from `passes` passes (the first token of an answer is drawn
        from the prompt's pass: none of its own)."""
        self.idle += tokens
        if passes > 0:
            self.costs.observe(1, seconds / passes)


def best_draft_length(rate: float, k_max: int, costs: PassCosts) -> int:
    """The draft length (0..k_max) that gives the most tokens a second: a draft of k after the pending token yields
    1 + a + ... + a^k tokens on average (a: the acceptance rate; the bonus token included) for a pass of k + 1
    rows, against 1 token for a plain step. 0: no draft pays."""
    best, best_k, expected = 1.0, 0, 1.0
    for k in range(1, k_max + 1):
        expected += rate ** k
        v = expected / costs.ratio(k + 1)
        if v > best:
            best, best_k = v, k
    return best_k


def leading_matches(drawn: Sequence[int], draft: Sequence[int]) -> int:
    """How many of a draft's tokens were accepted: the drawn tokens that equal it from the start."""
    n = 0
    while n < min(len(drawn), len(draft)) and drawn[n] == draft[n]:
        n += 1
    return n


__all__ = ["SpeculativeConfig", "NgramDrafter", "PassCosts", "DraftPolicy", "best_draft_length", "leading_matches",
           "MAX_SPECULATIVE_TOKENS"]
