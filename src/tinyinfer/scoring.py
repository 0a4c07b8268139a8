"""Log-probabilities of given tokens from rows of logits (vLLM's prompt_logprobs, what scoring a text reads): row i
is the distribution of the token after position i, read at next_ids[i], with its `top` most likely tokens."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .request import TokenLogprob

BLOCK_ROWS = 64  # rows converted to float64 at once (a block of a 128k vocabulary: 64 MB)


def rows_logprobs(rows: np.ndarray, next_ids: Sequence[int], top: int = 0) -> list[TokenLogprob]:
    """One TokenLogprob per next id, from the first len(next_ids) rows of `rows` ((n, vocab) logits): log_softmax of
    the row at its next id, in float64, and the top entries, value descending, ties to the lower id (the samplers'
    order)."""
    out: list[TokenLogprob] = []
    n = len(next_ids)
    for b in range(0, n, BLOCK_ROWS):
        x = rows[b:min(b + BLOCK_ROWS, n)].astype(np.float64)
        m = x.max(axis=1, keepdims=True)
        lp = x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))
        for r, row in enumerate(lp):
            t = int(next_ids[b + r])
            entries: list[tuple[int, float]] = []
            if top:
                k = min(top, row.size)
                kth = np.partition(row, row.size - k)[row.size - k]
                cand = np.nonzero(row >= kth)[0]  # (every tie at the k-th value: the lower ids win below)
                cand = cand[np.lexsort((cand, -row[cand]))][:k]
                entries = [(int(i), float(row[i])) for i in cand]
            out.append(TokenLogprob(t, float(row[t]), entries))
    return out
