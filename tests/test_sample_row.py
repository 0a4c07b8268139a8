"""The reference sampler of one row (cpp/core/sampling.cpp sample_row, through _core.ops.sample_row): the chosen
token's log-probability and the top entries (log_softmax of the RAW logits), the presence / frequency penalties
over generated tokens, their validation, and the CPU engine's decode applying them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import make_llama
from tinyinfer import Engine, InvalidRequestError, _core

sample_row = _core.ops.sample_row


def cfg(**kw) -> _core.SamplingConfig:
    s = _core.SamplingConfig()
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def log_softmax(x: np.ndarray) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(x.astype(np.float64)), dim=0).numpy()


ARANGE = np.arange(10, dtype=np.float32)  # greedy: 9, then 8, ...


# ---- log-probabilities ----

@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_log_softmax_of_raw_logits(temperature):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(1000) * 4).astype(np.float32)
    ref = log_softmax(logits)
    # penalties and temperature change the choice, never the reported numbers
    s = cfg(temperature=temperature, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, seed=3)
    tok, lp, top_ids, top_lp = sample_row(logits, s, 0, [int(np.argmax(logits))], [5, 5, 7], 20)
    assert top_ids.dtype == np.int32 and top_lp.dtype == np.float32 and top_ids.shape == top_lp.shape == (20,)
    assert abs(lp - ref[tok]) < 1e-5
    want = np.argsort(-ref, kind="stable")[:20]
    np.testing.assert_array_equal(top_ids, want)
    np.testing.assert_allclose(top_lp, ref[want], atol=1e-5)


def test_greedy_logprob_of_arange():
    tok, lp, top_ids, top_lp = sample_row(ARANGE, cfg(), 0, [], [], 3)
    ref = log_softmax(ARANGE)
    assert tok == 9 and abs(lp - ref[9]) < 1e-6
    assert list(top_ids) == [9, 8, 7]
    np.testing.assert_allclose(top_lp, ref[[9, 8, 7]], atol=1e-6)


def test_top_entries_ties_go_to_the_lower_id():
    logits = np.array([1, 3, 3, 0, 3, 2, 3], dtype=np.float32)
    _, _, top_ids, top_lp = sample_row(logits, cfg(), 0, [], [], 5)
    assert list(top_ids) == [1, 2, 4, 6, 5]
    assert top_lp[0] == top_lp[1] == top_lp[2] == top_lp[3] > top_lp[4]


def test_top_logprobs_zero_and_more_than_vocab():
    tok, _, top_ids, top_lp = sample_row(ARANGE, cfg(), 0, [], [], 0)
    assert tok == 9 and top_ids.shape == (0,) and top_lp.shape == (0,)
    small = np.array([0.5, 2.0, -1.0], dtype=np.float32)
    _, _, top_ids, top_lp = sample_row(small, cfg(), 0, [], [], 20)  # clipped to the vocabulary
    assert list(top_ids) == [1, 0, 2]
    np.testing.assert_allclose(np.exp(top_lp).sum(), 1.0, rtol=1e-6)


def test_logprob_of_a_masked_token_stays_finite():
    logits = np.array([0.0, -np.inf, 5.0, -np.inf], dtype=np.float32)
    tok, lp, top_ids, top_lp = sample_row(logits, cfg(), 0, [], [], 4)
    ref = log_softmax(logits)
    assert tok == 2 and abs(lp - ref[2]) < 1e-6
    assert list(top_ids) == [2, 0, 1, 3] and np.isneginf(top_lp[2:]).all()


# ---- penalties (greedy, on named inputs) ----

@pytest.mark.parametrize(
    "kw, prompt, generated, want",
    [
        (dict(), [], [9], 9),                                      # no penalty: argmax
        (dict(presence_penalty=1.5), [], [9], 8),                  # 9 - 1.5 = 7.5 < 8
        (dict(presence_penalty=1.5), [9], [], 9),                  # presence: generated tokens only
        (dict(presence_penalty=0.5), [], [9, 9, 9], 9),            # once, whatever the count: 8.5 > 8
        (dict(frequency_penalty=0.6), [], [9], 9),                 # 9 - 0.6 = 8.4 > 8
        (dict(frequency_penalty=0.6), [], [9, 9], 8),              # 9 - 1.2 = 7.8 < 8
        (dict(frequency_penalty=0.6), [9, 9, 9], [], 9),           # frequency: generated tokens only
        (dict(frequency_penalty=-2.0), [], [3, 3, 3, 3], 3),       # negative: encourages (3 + 8 = 11 > 9)
        (dict(presence_penalty=-2.0), [], [8], 8),                 # 8 + 2 = 10 > 9
        (dict(repetition_penalty=2.0), [9], [], 8),                # repetition: prompt too (9 / 2 = 4.5)
        (dict(repetition_penalty=1.125), [9], [], 8),              # 9 / 1.125 = 8 exactly: tie, lower id
        (dict(presence_penalty=0.5, frequency_penalty=0.75), [], [9, 9, 8], 7),  # 9-2=7, 8-1.25=6.75: tie 7
    ],
)
def test_penalties_change_the_greedy_choice(kw, prompt, generated, want):
    tok, lp, _, _ = sample_row(ARANGE, cfg(**kw), 0, prompt, generated, 0)
    assert tok == want
    assert abs(lp - log_softmax(ARANGE)[want]) < 1e-6  # reported from the raw logits


def test_repetition_penalty_applies_before_presence():
    """Token 0 (logit 9, generated once) against token 1 (logit 4.1): repetition 2 then presence 0.5 gives
    9 / 2 - 0.5 = 4.0 < 4.1; the other order would give (9 - 0.5) / 2 = 4.25 > 4.1."""
    logits = np.array([9.0, 4.1, 0.0], dtype=np.float32)
    s = cfg(repetition_penalty=2.0, presence_penalty=0.5)
    assert sample_row(logits, s, 0, [], [0], 0)[0] == 1
    assert sample_row(logits, cfg(repetition_penalty=2.0), 0, [], [0], 0)[0] == 0  # 4.5 > 4.1


def test_penalties_apply_before_top_k():
    """top_k=1 keeps the best PENALISED token, so sampling at any seed is the penalised greedy choice."""
    s = cfg(temperature=1.0, top_k=1, frequency_penalty=2.0)
    assert {sample_row(ARANGE, s, step, [], [9], 0)[0] for step in range(20)} == {8}


# ---- validation ----

@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("bad", [2.5, -2.01, math.inf, -math.inf, math.nan])
def test_penalty_out_of_range_is_refused(field, bad):
    s = cfg(**{field: bad})
    with pytest.raises(InvalidRequestError, match=field):
        s.validate()
    with pytest.raises(InvalidRequestError, match=field):
        sample_row(ARANGE, s, 0, [], [], 0)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_penalty_range_ends_are_accepted(field):
    for v in (-2.0, 2.0, 0.0):
        cfg(**{field: v}).validate()


@pytest.mark.parametrize("bad", [-1, 21, 100])
def test_top_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        sample_row(ARANGE, cfg(), 0, [], [], bad)


@pytest.mark.parametrize("where", ["prompt", "generated"])
@pytest.mark.parametrize("bad", [-1, 10])
def test_history_ids_out_of_range_are_refused(where, bad):
    hist = {"prompt": [], "generated": []}
    hist[where] = [bad]
    with pytest.raises(InvalidRequestError, match=f"token id {bad}"):
        sample_row(ARANGE, cfg(), 0, hist["prompt"], hist["generated"], 0)


def test_penalty_fields_round_trip():
    s = cfg(presence_penalty=0.5, frequency_penalty=-1.25)
    assert s.presence_penalty == 0.5 and s.frequency_penalty == -1.25
    assert _core.SamplingConfig().presence_penalty == 0.0 == _core.SamplingConfig().frequency_penalty


# ---- seeded sampling ----

def test_seeded_sampling_is_a_function_of_seed_and_step():
    logits = np.zeros(1000, dtype=np.float32)  # uniform: every draw lands somewhere else
    s = cfg(temperature=1.0, seed=1234)
    a = [sample_row(logits, s, step, [], [], 0)[0] for step in range(40)]
    assert a == [sample_row(logits, s, step, [], [], 0)[0] for step in range(40)]
    assert len(set(a)) > 30
    b = [sample_row(logits, cfg(temperature=1.0, seed=99), step, [], [], 0)[0] for step in range(40)]
    assert a != b


def test_draw_follows_the_penalised_distribution():
    """Temperature 1 over logits [0, 0, 0] with token 0 generated twice at frequency 1: p = [e^-2, 1, 1] / Z."""
    logits = np.zeros(3, dtype=np.float32)
    n = 3000
    draws = [sample_row(logits, cfg(temperature=1.0, frequency_penalty=1.0, seed=seed), 0, [], [0, 0], 0)[0]
             for seed in range(n)]
    counts = np.bincount(draws, minlength=3)
    p = np.array([math.exp(-2), 1, 1]) / (math.exp(-2) + 2)
    sigma = np.sqrt(n * p * (1 - p))
    assert (np.abs(counts - n * p) <= 4.5 * sigma).all(), counts


# ---- the CPU engine's decode ----

@pytest.fixture(scope="module")
def core(tmp_path_factory):
    d = make_llama(tmp_path_factory.mktemp("samprow"), layers=1, heads=2, kv_heads=2, hidden=128, vocab=256,
                   init_std=0.3)
    return Engine(d, device="cpu", max_seq_len=256)._core


PROMPT = [3, 14, 15, 92, 65]


def _decode(core, s, n):
    core.reset()
    core.forward(PROMPT, all_logits=False)
    return list(core.decode(n, s, [], 0))


def _step_by_step(core, s, n):
    """The same generation driven from Python: sample_row over the history, forward() to feed each token."""
    core.reset()
    logits = core.forward(PROMPT, all_logits=False)[-1]
    gen = []
    for step in range(n):
        tok = sample_row(logits, s, step, PROMPT, gen, 0)[0]
        gen.append(tok)
        logits = core.forward([tok], all_logits=False)[-1]
    return gen


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(frequency_penalty=2.0), dict(presence_penalty=2.0, repetition_penalty=1.3),
     dict(temperature=0.9, presence_penalty=1.0, frequency_penalty=0.5, seed=11)],
)
def test_cpu_decode_applies_the_penalties_over_its_history(core, kw):
    s = cfg(**kw)
    assert _decode(core, s, 24) == _step_by_step(core, s, 24)


def test_frequency_penalty_changes_a_cpu_generation(core):
    plain = _decode(core, cfg(), 24)
    pen = _decode(core, cfg(frequency_penalty=2.0), 24)
    # identical up to plain's first repeated token, which the penalty then avoids
    i = next(i for i, t in enumerate(plain) if t in plain[:i])
    assert pen[:i] == plain[:i] and pen[i] != plain[i]
    # a negative penalty rewards repeating: the first generated token wins again and again
    for kw in (dict(frequency_penalty=-2.0), dict(presence_penalty=-2.0)):
        assert _decode(core, cfg(**kw), 12) == [plain[0]] * 12


def test_cpu_decode_forgets_the_history_on_reset(core):
    s = cfg(frequency_penalty=2.0, presence_penalty=2.0)
    first = _decode(core, s, 16)
    assert _decode(core, s, 16) == first  # reset() cleared the counts of the first run


# ---- the draw against a full sort of the candidates ----

def _full_sort_draw(x: np.ndarray, s: _core.SamplingConfig, step: int) -> int:
    """The draw as sampling.h defines it, sorting every candidate (larger logit first, lower id first on ties):
    temperature -> top-k -> top-p (smallest prefix reaching it) -> min-p -> no p of 0 -> the seed's walk. The
    candidates' mass is added in token-id order; the walk's is that mass where nothing was cut, else the kept
    prefix's in the order."""
    order = np.lexsort((np.arange(len(x)), -x.astype(np.float64)))
    k = s.top_k if 0 < s.top_k < len(x) else len(x)
    ids = order[:k]
    p = np.exp((x[ids].astype(np.float64) - float(x[ids[0]])) * (1.0 / s.temperature))
    by_id = np.zeros(len(x))
    by_id[ids] = p
    total = np.cumsum(by_id)[-1]  # sequential sums, as the sampler adds
    nonzero = int((p > 0).sum())
    n = k
    if s.top_p < 1.0:
        reached = np.nonzero(np.cumsum(p / total) >= np.float32(s.top_p))[0]
        n = int(reached[0]) + 1 if len(reached) else k
    if s.min_p > 0.0:
        m = 1
        while m < n and p[m] >= np.float32(s.min_p) * p[0]:
            m += 1
        n = m
    n = max(1, min(n, nonzero))
    acc = np.cumsum(p[:n])
    u = _core.ops.uniform_from_counter(s.seed, step) * (acc[-1] if n < nonzero else total)
    above = np.nonzero(u < acc)[0]
    return int(ids[above[0]] if len(above) else ids[n - 1])


def test_draw_sums_the_mass_in_id_order():
    """Ten tokens of p ~1e-16 before two tied tops: the mass added in token-id order is 2 + ~1e-15 (in the order of
    the logits the small ones vanish, 2 exactly), so top_p 0.5 keeps both tops, and draws take each."""
    x = np.full(12, np.float32(np.log(1e-16)), dtype=np.float32)
    x[10] = x[11] = 0
    s = cfg(temperature=1.0, top_p=0.5, seed=3)
    draws = {sample_row(x, s, step, [], [], 0)[0] for step in range(64)}
    assert draws == {10, 11}
    assert all(sample_row(x, s, step, [], [], 0)[0] == _full_sort_draw(x, s, step) for step in range(64))


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
                                dict(temperature=1.0, top_k=5)])
def test_nan_and_inf_logits_draw_a_real_token(kw):
    """A broken model's row: a NaN logit is never drawn, a +inf one always (the lowest id of them), a row of NaN
    gives argmax's token 0 — never an id outside the vocabulary."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(100).astype(np.float32)
    x[[0, 5, 50]] = np.nan
    got = {sample_row(x, cfg(seed=1, **kw), step, [], [], 0)[0] for step in range(200)}
    assert got and not got & {0, 5, 50} and all(0 <= t < 100 for t in got)
    x[[7, 9]] = np.inf
    assert {sample_row(x, cfg(seed=1, **kw), step, [], [], 0)[0] for step in range(20)} == {7}
    assert sample_row(np.full(100, np.nan, np.float32), cfg(seed=1, **kw), 0, [], [], 0)[0] == 0


def _tail_logits(rng) -> np.ndarray:
    """One token on top and 4,095 others each with p ~5e-10 of it (below both of the sampler's head thresholds),
    together 2e-6 of the mass: a top-p of 1 - 6e-8 or a min-p of 1e-12 reaches into them."""
    x = np.full(4096, -21.4, dtype=np.float32) + rng.normal(0, 0.05, 4096).astype(np.float32)
    x[rng.integers(4096)] = 0.0
    return x


@pytest.mark.parametrize("case", [
    dict(logits="peaked", temperature=1.0),
    dict(logits="peaked", temperature=0.6, top_p=0.9),
    dict(logits="peaked", temperature=1.3, min_p=0.05),
    dict(logits="peaked", temperature=1.0, top_k=40, top_p=0.95),
    dict(logits="peaked", temperature=2.0, top_k=3000),
    dict(logits="wide", temperature=1.0),            # draws land past p = 1e-4 of the top: the second head
    dict(logits="wide", temperature=1.0, top_p=0.999),
    dict(logits="flat", temperature=1.0, top_p=0.5),  # every p 1: ties in id order
    dict(logits="banned", temperature=0.8),           # -inf tokens: p 0, never drawn
    dict(logits="banned", temperature=1.0, top_p=0.9999999),
    dict(logits="tail", temperature=1.0, top_p=0.99999994),  # the cut needs every token
    dict(logits="tail", temperature=1.0, min_p=1e-12),
])
def test_draw_is_the_full_sorts_walk(case):
    """The sampler sorts only the head of the order that the cut-offs and the walk reach (cpp/core/sampling.cpp
    draw); the token is the one a sort of every candidate gives, for every seed and step."""
    case = dict(case)
    kind = case.pop("logits")
    rng = np.random.default_rng(len(kind) * 7 + len(case))
    for trial in range(6):
        if kind == "peaked":  # a trained model's row: a few tokens stand out
            x = (rng.standard_normal(5000) * 3).astype(np.float32)
        elif kind == "wide":  # mass spread over thousands of tokens below the first head's 1e-4
            x = np.concatenate([np.zeros(3), np.full(20000, -9.5) + rng.normal(0, 0.3, 20000)]).astype(np.float32)
        elif kind == "flat":
            x = np.zeros(3000, dtype=np.float32)
        elif kind == "banned":
            x = rng.standard_normal(3000).astype(np.float32)
            x[rng.choice(3000, 2990, replace=False)] = -np.inf
        else:
            x = _tail_logits(rng)
        s = cfg(seed=int(rng.integers(1 << 31)), **case)
        for step in range(40):
            assert sample_row(x, s, step, [], [], 0)[0] == _full_sort_draw(x, s, step), (trial, step)
