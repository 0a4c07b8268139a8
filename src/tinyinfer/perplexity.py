"""Perplexity of a model on a text (what llama.cpp users reach for with `llama-perplexity` to judge a
quantization): exp of the mean negative log-likelihood of every token given the ones before it.

The text's tokens are cut into windows of at most `window` tokens, each scored from an empty cache in one
prefill (Engine.logits); a window's first token has no context and is not scored. With one window this is the
number bench/tools/quant_quality.py reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .errors import InvalidRequestError


def token_nll(logits: np.ndarray, ids: Sequence[int]) -> np.ndarray:
    """-log p(ids[i+1] | ids[:i+1]) for every position but the last: float64 (len(ids) - 1,)."""
    lg = np.asarray(logits[:-1], dtype=np.float64)
    m = lg.max(-1, keepdims=True)
    logp = lg - m - np.log(np.exp(lg - m).sum(-1, keepdims=True))
    return -logp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def perplexity_from_logits(logits: np.ndarray, ids: Sequence[int]) -> float:
    return float(np.exp(token_nll(logits, ids).mean()))


@dataclass
class PerplexityResult:
    perplexity: float
    scored_tokens: int  # tokens predicted (each window's first token is not)
    windows: int
    window: int


def perplexity(engine, ids: Sequence[int], window: Optional[int] = None) -> PerplexityResult:
    """Perplexity of `engine` on the token ids `ids`, in windows of `window` tokens (default: the engine's
    max_seq_len). A trailing window of a single token has nothing to score and is dropped."""
    ids = list(ids)
    window = window or engine.max_seq_len
    if window < 2 or window > engine.max_seq_len:
        raise InvalidRequestError(f"perplexity window must be in 2..max_seq_len={engine.max_seq_len} (got {window})")
    if len(ids) < 2:
        raise InvalidRequestError(f"perplexity needs at least 2 tokens of text (got {len(ids)})")
    nll: list[np.ndarray] = []
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        nll.append(token_nll(engine.logits(chunk), chunk))
    all_nll = np.concatenate(nll)
    return PerplexityResult(float(np.exp(all_nll.mean())), int(all_nll.size), len(nll), window)


__all__ = ["PerplexityResult", "perplexity", "perplexity_from_logits", "token_nll"]
