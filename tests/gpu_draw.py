"""The GPU sampler's draw (cuda/sampling.cu `sample_block`) in numpy, without penalties: p = exp((l - max) / T),
the kept set by threshold (top-k: p >= the k-th largest p; top-p: the largest p whose kept mass reaches top_p x the
total; min-p: p >= min_p, the top p being 1), the kept masses summed in token-id order, and the token where that
prefix sum first exceeds u x the kept mass, u = uniform(seed, step) (cpp/core/rng.h).

The CPU sampler (cpp/core/sampling.cpp) sums the same masses in logit order, so the two draw different tokens from
one seed; this twin is what lets a GPU test ask where a draw fell: on a boundary of the cumulative distribution
that two nearly equal rows of logits put a little apart (both tokens legitimate), or well inside one token's
interval (a wrong token). tests/test_gpu_sampling.py checks it against the GPU's draws."""

from __future__ import annotations

import numpy as np

from tinyinfer import _core


def kept_masses(logits: np.ndarray, s) -> np.ndarray:
    """float64 masses in token-id order, 0 where the token is not kept (unnormalised: the top token's is 1)."""
    l = np.asarray(logits, np.float32)
    p = np.exp((l - l.max()) * np.float32(1.0 / s.temperature)).astype(np.float64)
    keep = np.ones(p.shape, bool)
    if 0 < s.top_k < p.size:
        keep &= p >= np.sort(p)[-s.top_k]
    if s.top_p < 1.0:
        desc = np.sort(p)[::-1]
        n = int(np.searchsorted(np.cumsum(desc), s.top_p * p.sum()))  # the first prefix reaching the target
        keep &= p >= desc[min(n, p.size - 1)]
    if s.min_p > 0.0:
        keep &= p >= s.min_p
    return np.where(keep, p, 0.0)


def draw(logits: np.ndarray, s, step: int) -> int:
    """The token the GPU's rule picks (up to fp32 rounding where u sits on a boundary: see `cdf_before`)."""
    m = kept_masses(logits, s)
    c = np.cumsum(m)
    u = _core.ops.uniform_from_counter(s.seed, step) * c[-1]
    return int(np.searchsorted(c, u, side="right"))


def cdf_through(logits: np.ndarray, s, token: int) -> float:
    """The kept mass of the ids <= token over the whole kept mass: the draw picks an id <= token iff u is below."""
    m = kept_masses(logits, s)
    return float(m[: token + 1].sum() / m.sum())
