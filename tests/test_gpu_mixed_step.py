"""The GPU engine's seq_mixed (cpp/gpu/cuda_engine_slots.cu; PrefillStep::run_many with the decode rows as
one-token segments and every row's logits from one LM-head GEMM over the gathered last rows): each slot's logits
within the batched path's tolerance of seq_step then seq_prefill_many, and the same greedy tokens after it, on
head_dim 64 / 128 and GQA groups 1 / 4; prompts spanning passes (a small prefill_chunk); logits left in the
step's rows survive a later step of other slots, and other slots' logits survive a seq_mixed; every bad call
is a Request error that changes nothing; the scheduler's tokens with mixed steps on and off. Skipped without a
usable CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu_batch import (ACT8_LOGIT_TOL, MAX_SEQ, VOCAB, drop_engines, gpu_engine, greedy, model,  # noqa: F401
                            options)
from test_gpu_prefill_many import _check, _chunks
from tinyinfer import Engine, InvalidRequestError

pytestmark = pytest.mark.gpu


def _run(core, mixed: bool, steps=6):
    """Three decoding slots (prefilled, sampled) and the prompts of _chunks (one continuing a prompt): their
    step and prefill as one seq_mixed or as seq_step then seq_prefill_many; every slot's logits, then `steps`
    greedy tokens of all of them stepped together. The slots are closed again."""
    ps, head, rest = _chunks()
    rng = np.random.default_rng(11)
    run = [core.seq_open() for _ in range(3)]
    core.seq_prefill_many(run, [rng.integers(3, VOCAB, n).tolist() for n in (5, 70, 130)])
    toks, *_ = core.seq_sample(run, [greedy()] * 3, [0] * 3, 0)
    slots = [core.seq_open() for _ in range(len(ps) + 1)]
    core.seq_prefill(slots[-1], head)
    if mixed:
        core.seq_mixed(run, toks.tolist(), slots, ps + [rest])
    else:
        core.seq_step(run, toks.tolist())
        core.seq_prefill_many(slots, ps + [rest])
    every = run + slots
    assert [core.seq_length(s) for s in every] == [6, 71, 131] + [len(p) for p in ps] + [len(head) + len(rest)]
    logits = [core.seq_logits(s).copy() for s in every]
    out = []
    for i in range(steps):
        t, _, _, _ = core.seq_sample(every, [greedy()] * len(every), [i + 1] * len(every), 0)
        out.append(t.tolist())
        core.seq_step(every, t.tolist())
    for s in every:
        core.seq_close(s)
    return logits, out


@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4"])
def test_mixed_matches_step_then_prefill_many(model, fmt):
    core = gpu_engine(model, fmt)._core
    free = core.kv_pages_free
    _check(_run(core, mixed=False), _run(core, mixed=True), fmt)
    assert core.kv_pages_free == free


def test_mixed_matches_step_then_prefill_many_on_act8_inputs(model):
    """int4 with act8 = 2: the mixed pass (the prefill's layers, PrefillStep::layer) and seq_step then
    seq_prefill_many agree on every slot's logits within ACT8_LOGIT_TOL, the int8 steps carrying the two passes'
    other differences. That the pass rounds at all is shown by test_act8_prefill_rounds_as_the_decode_step (the same
    layers; this bound alone would not tell). The greedy tokens after it are not compared: at this bound a near-tie
    may part them."""
    core = gpu_engine(model, "int4", act8=2)._core
    want, got = _run(core, mixed=False), _run(core, mixed=True)
    for i, (a, b) in enumerate(zip(want[0], got[0])):
        np.testing.assert_allclose(b, a, rtol=0, atol=ACT8_LOGIT_TOL * float(np.abs(a).max()), err_msg=f"slot {i}")


@pytest.mark.parametrize("chunk", [100, 333])
def test_mixed_spanning_passes(model, chunk):
    """prefill_chunk 100 / 333: the decode rows and the prompts' 590 tokens take several passes, the gathered
    logits rows of each pass a different run."""
    core = gpu_engine(model, "fp16", prefill_chunk=chunk)._core
    _check(_run(core, mixed=False), _run(core, mixed=True), "fp16")


def test_logits_in_the_step_rows_survive_a_step_of_other_slots(model):
    """After seq_mixed the slots' logits lie in the step's rows 0..n-1; a seq_step of other slots (which writes
    rows 0..bucket-1) first moves them to their own rows: they read the same after it."""
    core = gpu_engine(model, "fp16")._core
    ps, _, _ = _chunks(seed=4)
    run = [core.seq_open() for _ in range(2)]
    core.seq_prefill_many(run, ps[2:4])
    toks, *_ = core.seq_sample(run, [greedy()] * 2, [0] * 2, 0)
    new = [core.seq_open() for _ in range(2)]
    core.seq_mixed(run, toks.tolist(), new, ps[:2])
    before = [core.seq_logits(s).copy() for s in run + new]
    t2, *_ = core.seq_sample(new, [greedy()] * 2, [0] * 2, 0)
    core.seq_step(new, t2.tolist())  # rows 0..1: run[0]'s and run[1]'s logits lie there
    for s, b in zip(run, before):
        np.testing.assert_array_equal(core.seq_logits(s), b)
    for s in run + new:
        core.seq_close(s)
    assert core.kv_pages_free == core.kv_pages_total


def test_seq_mixed_moves_other_slots_logits_out_of_its_rows(model):
    """a and b stepped (their logits in the step's rows 0 and 1), then a seq_mixed of two other slots (rows 0
    and 1 again): a's and b's logits read the same after it."""
    core = gpu_engine(model, "fp16")._core
    ps, _, _ = _chunks(seed=6)
    a, b, c = (core.seq_open() for _ in range(3))
    core.seq_prefill_many([a, b, c], ps[1:4])
    t, *_ = core.seq_sample([a, b, c], [greedy()] * 3, [0] * 3, 0)
    core.seq_step([a, b], t[:2].tolist())
    before = [core.seq_logits(s).copy() for s in (a, b)]
    d = core.seq_open()
    core.seq_mixed([c], [int(t[2])], [d], [ps[0]])
    for s, x in zip((a, b), before):
        np.testing.assert_array_equal(core.seq_logits(s), x)
    for s in (a, b, c, d):
        core.seq_close(s)
    assert core.kv_pages_free == core.kv_pages_total


def test_bad_mixed_calls_change_nothing(model):
    eng = Engine(model[1], device="cuda", max_seq_len=MAX_SEQ, cuda_options=options(kv_pool_pages=4, max_batch=4))
    core = eng._core
    ps, _, _ = _chunks(seed=2)
    a, b, c = core.seq_open(), core.seq_open(), core.seq_open()
    core.seq_prefill(a, ps[1])
    t, *_ = core.seq_sample([a], [greedy()], [0], 0)
    ta = int(t[0])
    snap = lambda: ([core.seq_length(s) for s in (a, b, c)], core.kv_pages_free, core.seq_logits(a).copy())
    before = snap()
    for call, msg in [
        (lambda: core.seq_mixed([a], [ta], [b, c], [ps[4], ps[2]]), "pool exhausted"),  # 1 + 4 + 2 pages
        (lambda: core.seq_mixed([a], [ta], [a], [[1]]), "both stepped and prefilled"),
        (lambda: core.seq_mixed([a, b], [ta, 1], [c], [[1]]), "no logits yet"),
        (lambda: core.seq_mixed([a], [VOCAB], [b], [[1]]), "out of range"),
        (lambda: core.seq_mixed([a], [ta], [b], [[]]), "empty"),
        (lambda: core.seq_mixed([a], [ta], [b], [[1] * (MAX_SEQ + 1)]), "max_seq_len"),
        (lambda: core.seq_mixed([a], [ta], [b, 7], [[1], [2]]), "does not exist"),
    ]:
        with pytest.raises(InvalidRequestError, match=msg):
            call()
        after = snap()
        assert after[:2] == before[:2], msg
        np.testing.assert_array_equal(after[2], before[2])
    core.seq_mixed([a], [ta], [b], [ps[0]])
    assert [core.seq_length(s) for s in (a, b)] == [len(ps[1]) + 1, len(ps[0])]
    eng.close()


def test_scheduler_mixed_steps_match_separate_calls(model):
    """The same greedy tokens through the scheduler with mixed steps and with a step's decode and prefill as two
    calls, requests joining while others decode; the pool empty after either."""
    from tinyinfer import SamplingParams, Scheduler

    ps, _, _ = _chunks(seed=5)
    out = []
    for mixed in (False, True):
        eng = Engine(model[1], device="cuda", max_seq_len=MAX_SEQ, cuda_options=options())
        sched = Scheduler(eng, mixed_steps=mixed, chunk_tokens=96)
        reqs = []
        for p in ps:
            reqs.append(sched.submit(p, SamplingParams(max_tokens=10, ignore_eos=True)))
            sched.step()
            sched.step()
        sched.wait_idle()
        out.append([r.result().token_ids for r in reqs])
        sched.reset_prefix_cache()  # (the ended requests' kept caches: all that may still hold pages)
        assert eng._core.kv_pages_free == eng._core.kv_pages_total
        sched.close()
        eng.close()
    assert out[0] == out[1]
