"""seq_sample_step on the GPU engine (cpp/core/sample_step.h over CudaEngine's seq_sample, which queues its sampler
behind the step, and seq_step): the same tokens, logprobs and next logits as seq_sample then seq_step of the rows
that go on (greedy and seeded rows, a stop id, a row with nothing left), at fp16 / int8 / int4; a refused step
(a slot at max_seq_len) launches nothing and the sample stands; the pool is as before. Skipped without a usable
CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu_batch import MAX_SEQ, VOCAB, drop_engines, gpu_engine, greedy, model  # noqa: F401 (fixture)
from tinyinfer import _core

pytestmark = pytest.mark.gpu


def _seeded():
    c = _core.SamplingConfig()
    c.temperature, c.seed = 0.9, 5
    return c


def _run(core, fused: bool, stop_of=None):
    """Four slots prefilled, then 3 rounds: sample (top-3 logprobs) and step rows 0 and 3 (row 1 has nothing left,
    row 2 stops on its token when stop_of is given); returns every round's sample and the slots' final logits."""
    rng = np.random.default_rng(4)
    slots = [core.seq_open() for _ in range(4)]
    core.seq_prefill_many(slots, [rng.integers(3, VOCAB, n).tolist() for n in (3, 40, 65, 129)])
    cfgs = [greedy(), _seeded(), greedy(), _seeded()]
    out = []
    for r in range(3):
        if fused:
            stops = [[], [], [] if stop_of is None else [stop_of[r]], []]
            got = core.seq_sample_step(slots, cfgs, [r] * 4, 3, [True, False, True, True], stops)
            stepped = got[4].tolist()
        else:
            got = core.seq_sample(slots, cfgs, [r] * 4, 3)
            toks = got[0].tolist()
            stepped = [1, 0, int(stop_of is None or toks[2] != stop_of[r]), 1]
            core.seq_step([s for s, st in zip(slots, stepped) if st], [t for t, st in zip(toks, stepped) if st])
        out.append(([a.copy() for a in got[:4]], stepped))
        toks = got[0].tolist()
        rest = [i for i, st in enumerate(stepped) if not st]  # (stepped by hand: every slot has fresh logits)
        core.seq_step([slots[i] for i in rest], [toks[i] for i in rest])
    logits = [core.seq_logits(s).copy() for s in slots]
    lengths = [core.seq_length(s) for s in slots]
    for s in slots:
        core.seq_close(s)
    return out, logits, lengths


@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4"])
def test_sample_step_equals_sample_then_step(model, fmt):
    core = gpu_engine(model, fmt)._core
    free = core.kv_pages_free
    want = _run(core, fused=False)
    stop_of = [s[0][0].tolist()[2] for s in want[0]]  # row 2's tokens: as stop ids they end it every round
    want_stop, got, got_stop = _run(core, False, stop_of), _run(core, True), _run(core, True, stop_of)
    for w, g in ((want, got), (want_stop, got_stop)):
        for (wa, ws), (ga, gs) in zip(w[0], g[0]):
            assert gs == ws
            for x, y in zip(wa, ga):
                np.testing.assert_array_equal(y, x)
        for x, y in zip(w[1], g[1]):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)
        assert g[2] == w[2]
    assert got_stop[0][0][1] == [1, 0, 0, 1]  # (round 0's tokens come from the prefill alone: the stop bites)
    assert core.kv_pages_free == free


def test_a_refused_step_launches_nothing_on_the_gpu(model):
    core = gpu_engine(model, "fp16")._core
    free = core.kv_pages_free
    a, full = core.seq_open(), core.seq_open()
    core.seq_prefill(a, [5, 6, 7])
    core.seq_prefill(full, [9] * MAX_SEQ)
    got = core.seq_sample_step([a, full], [greedy()] * 2, [0, 0], 0, [True, True], [[], []])
    assert got[4].tolist() == [0, 0] and got[5] == 0
    assert [core.seq_length(a), core.seq_length(full)] == [3, MAX_SEQ]
    got = core.seq_sample_step([a], [greedy()], [1], 0, [True], [[]])  # the engine goes on
    assert got[4].tolist() == [1] and core.seq_length(a) == 4
    core.seq_close(a), core.seq_close(full)
    assert core.kv_pages_free == free


def _run_mixed(core, fused: bool):
    """Three slots decoding and two prompts (one longer than a serving prompt) that ride in the first round's
    launch ahead: seq_sample_mixed (rows 0 and 2 go on; their tokens read on the device), or seq_sample then
    seq_mixed of the same rows; two more rounds of plain sample + step. Returns every round's sample, the
    slots' final logits and lengths."""
    rng = np.random.default_rng(8)
    slots = [core.seq_open() for _ in range(3)]
    core.seq_prefill_many(slots, [rng.integers(3, VOCAB, n).tolist() for n in (5, 33, 70)])
    fresh = [core.seq_open() for _ in range(2)]
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (9, 200)]
    cfgs = [greedy(), _seeded(), _seeded()]
    out = []
    if fused:
        got = core.seq_sample_mixed(slots, cfgs, [0] * 3, 3, [True, False, True], fresh, prompts)
        assert got[4].tolist() == [1, 0, 1] and got[6] is True
    else:
        got = core.seq_sample(slots, cfgs, [0] * 3, 3)
        toks = got[0].tolist()
        core.seq_mixed([slots[0], slots[2]], [toks[0], toks[2]], fresh, prompts)
    out.append([a.copy() for a in got[:4]])
    core.seq_step([slots[1]], [got[0].tolist()[1]])
    every = slots + fresh
    for r in range(1, 3):
        got = core.seq_sample(every, cfgs + [greedy()] * 2, [r] * 5, 3)
        out.append([a.copy() for a in got[:4]])
        core.seq_step(every, got[0].tolist())
    logits = [core.seq_logits(s).copy() for s in every]
    lengths = [core.seq_length(s) for s in every]
    for s in every:
        core.seq_close(s)
    return out, logits, lengths


@pytest.mark.parametrize("fmt", ["fp16", "int4"])
def test_sample_mixed_equals_sample_then_mixed(model, fmt):
    """The pass queued before the tokens reach the host reads them from the sampler's output: the same
    tokens, logprobs, logits and lengths as the host's seq_mixed with those tokens."""
    core = gpu_engine(model, fmt)._core
    free = core.kv_pages_free
    want, got = _run_mixed(core, False), _run_mixed(core, True)
    for wa, ga in zip(want[0], got[0]):
        for x, y in zip(wa, ga):
            np.testing.assert_array_equal(y, x)
    for x, y in zip(want[1], got[1]):
        np.testing.assert_array_equal(y, x)
    assert got[2] == want[2] == [8, 36, 73, 11, 202]  # 5+1+2, 33+1+2, 70+1+2, 9+2, 200+2
    assert core.kv_pages_free == free


def test_a_refused_mixed_launch_runs_nothing_on_the_gpu(model):
    core = gpu_engine(model, "fp16")._core
    free = core.kv_pages_free
    a, full, fresh = core.seq_open(), core.seq_open(), core.seq_open()
    core.seq_prefill(a, [5, 6, 7])
    core.seq_prefill(full, [9] * MAX_SEQ)
    got = core.seq_sample_mixed([a, full], [greedy()] * 2, [0, 0], 0, [True, True], [fresh], [[4, 5]])
    assert got[4].tolist() == [0, 0] and got[6] is False
    assert [core.seq_length(a), core.seq_length(full), core.seq_length(fresh)] == [3, MAX_SEQ, 0]
    got = core.seq_sample_mixed([a], [greedy()], [1], 0, [True], [fresh], [[4, 5]])  # the engine goes on
    assert got[4].tolist() == [1] and got[6] is True
    assert [core.seq_length(a), core.seq_length(fresh)] == [4, 2]
    for s in (a, full, fresh):
        core.seq_close(s)
    assert core.kv_pages_free == free
