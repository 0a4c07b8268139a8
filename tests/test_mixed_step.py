"""seq_mixed, a decode step and prompt chunks in one call (docs/BATCH_CONTRACT.md part 2; cpp/cpu/cpu_sequences.cpp,
cpp/gpu/cuda_engine_slots.cu), and the scheduler's mixed steps. The CPU engine's seq_mixed leaves every slot
exactly as seq_step then seq_prefill_many do (decode rows beside fresh prompts, a chunk continuing a prompt, a
slot closed and opened again); every bad call is a Request error that changes nothing; the scheduler puts the
waiting prompts into the launch ahead (or, without overlap, makes a step that has both decode rows and prompt
chunks one call), leaves the pass's rows to the decode rows out of the prompt budget, falls back to the separate
calls when the core refuses, and every request generates what it does alone (fake core and real CPU engine).
The GPU side: tests/test_gpu_mixed_step.py."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_chat_llama
from test_cpu_batch import VOCAB, _store
from test_prefill_many import GREEDY, MAX_SEQ, _setup, _snapshot, assert_same_slots
from test_scheduler import P, PlainCore, _alone, _engine, _fake, _steps
from tinyinfer import Engine, InvalidRequestError, SamplingParams, Scheduler, _core
from tinyinfer.trace import Trace


def _decoding(core, n=2):
    """n slots prefilled and sampled once (as the scheduler's running sequences are): (slots, their tokens)."""
    rng = np.random.default_rng(7)
    slots = [core.seq_open() for _ in range(n)]
    core.seq_prefill_many(slots, [rng.integers(0, VOCAB, 5 + 11 * i).tolist() for i in range(n)])
    toks, *_ = core.seq_sample(slots, [GREEDY] * n, [0] * n, 0)
    return slots, toks.tolist()


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int4"])
def test_mixed_leaves_each_slot_as_step_then_prefill_many(fmt):
    store = _store(fmt)
    sep, mixed = (_core.CpuEngine(store, MAX_SEQ, 2, 8) for _ in range(2))
    state = [(_setup(e), _decoding(e)) for e in (sep, mixed)]
    assert state[0] == state[1]
    (slots, chunks), (run, toks) = state[0]
    sep.seq_step(run, toks)
    sep.seq_prefill_many(slots, chunks)
    mixed.seq_mixed(run, toks, slots, chunks)
    assert_same_slots(sep, mixed, run + slots, [6, 17, 1, 7, 128, 60, 9])


def test_every_bad_mixed_call_changes_nothing_and_the_engine_goes_on():
    core = _core.CpuEngine(_store("fp32"), MAX_SEQ, 2, 6)
    (a, b), (ta, tb) = _decoding(core)
    c, fresh, full = core.seq_open(), core.seq_open(), core.seq_open()
    core.seq_prefill(full, [5] * MAX_SEQ)
    cases = [
        (lambda: core.seq_mixed([a, b], [ta], [c], [[1]]), "2 step slots, 1 tokens"),
        (lambda: core.seq_mixed([a], [ta], [c], [[1], [2]]), "1 prompt slots and 2 prompts"),
        (lambda: core.seq_mixed([], [], [c], [[1]]), "no slots"),
        (lambda: core.seq_mixed([a], [ta], [], []), "no slots"),
        (lambda: core.seq_mixed([a, a], [ta, ta], [c], [[1]]), "listed twice"),
        (lambda: core.seq_mixed([a, b], [ta, tb], [c, c], [[1], [2]]), "listed twice"),
        (lambda: core.seq_mixed([a, b], [ta, tb], [b], [[1]]), "both stepped and prefilled"),
        (lambda: core.seq_mixed([a, fresh], [ta, 1], [c], [[1]]), "no logits yet"),
        (lambda: core.seq_mixed([a], [VOCAB], [c], [[1]]), "out of range"),
        (lambda: core.seq_mixed([a], [ta], [c], [[-1]]), "out of range"),
        (lambda: core.seq_mixed([a], [ta], [c], [[]]), "empty"),
        (lambda: core.seq_mixed([a], [ta], [c], [[1] * MAX_SEQ + [1]]), "max_seq_len"),
        (lambda: core.seq_mixed([full], [1], [c], [[1]]), "max_seq_len"),
        (lambda: core.seq_mixed([a], [ta], [99], [[1]]), "does not exist"),
    ]
    before = _snapshot(core, [a, b, c, full])
    for call, msg in cases:
        with pytest.raises(InvalidRequestError, match=msg):
            call()
        after = _snapshot(core, [a, b, c, full])
        assert after[0] == before[0] and after[2] == before[2], msg
        for x, y in zip(after[1], before[1]):
            np.testing.assert_array_equal(x, y)
    core.seq_mixed([a, b], [ta, tb], [c], [[4, 5, 6]])
    assert [core.seq_length(s) for s in (a, b, c)] == [before[0][0] + 1, before[0][1] + 1, 3]


# ---- the scheduler (a pure-Python fake of the core: test_scheduler.FakeCore) ----


def _joining(mixed: bool, **kw):
    """P[1] running; two more requests submitted after its first step: (requests, each step's core calls)."""
    core, eng = _fake(max_batch=4, pages=40)
    sched = Scheduler(eng, chunk_tokens=kw.pop("chunk_tokens", 64), mixed_steps=mixed, **kw)
    first = sched.submit(P[1], SamplingParams(max_tokens=12))
    sched.step()
    later = [sched.submit(p, SamplingParams(max_tokens=m)) for p, m in ((P[2], 6), (P[0], 9))]
    return core, [first] + later, _steps(sched, core)


def test_a_step_with_decode_rows_and_prompts_is_one_mixed_call():
    core, reqs, steps = _joining(True)
    # the step after the submissions: the running request's next step was launched ahead before they came, so
    # its 4 prefills nothing; it samples that step, and the launch ahead is one call for its row and both prompts
    calls = [c for c in steps[0] if c[0] in ("mixed", "step", "many", "prefill", "sample")]
    assert calls[:4] == [("sample", (0,)), ("mixed", 1, 2), ("step", (0,)), ("many", 2)]
    assert [c[0] for c in calls[4:]] == ["prefill", "prefill"]
    # then the sample of all three, and (no prompt left) the next step of all three launched ahead
    assert [c[0] for c in steps[1] if c[0] in ("step", "sample")] == ["sample", "step"]
    assert len([c for c in steps[1] if c[0] == "step"][-1][1]) == 3
    assert not any(c[0] == "mixed" for calls in steps[1:] for c in calls)  # no prompt left: plain steps
    for r, (p, m) in zip(reqs, ((P[1], 12), (P[2], 6), (P[0], 9))):
        assert r.result().token_ids == _alone(p, m)
    assert core.cache == {}


def test_waiting_prompts_ride_in_the_launch_ahead():
    """With mixed steps, a step whose sample finds a request waiting (a slot free, pages enough) admits it and
    launches its prompt with the running rows' next step in one seq_mixed; without them, the step prefills it
    in a call of its own (behind the running rows' step in flight) and launches the rows ahead alone."""
    for mixed in (True, False):
        core, eng = _fake(max_batch=4, pages=40)
        sched = Scheduler(eng, mixed_steps=mixed)
        a = sched.submit(P[1], SamplingParams(max_tokens=12))
        sched.step()
        sched.step()
        core.log = []
        b = sched.submit(P[0], SamplingParams(max_tokens=3))
        sched.step()
        kinds = [c[0] for c in core.log if c[0] in ("sample", "step", "mixed", "prefill")]
        assert kinds == (["sample", "mixed", "step", "prefill"] if mixed else ["prefill", "sample", "step"])
        sched.wait_idle()
        assert a.result().token_ids == _alone(P[1], 12) and b.result().token_ids == _alone(P[0], 3)
        assert core.cache == {}


def test_without_overlap_a_step_with_rows_and_prompts_is_one_call():
    """overlap=False: no launch ahead, so step 3 and 4 themselves make the mixed call."""
    core, reqs, steps = _joining(True, overlap=False)
    mixed = [c for calls in steps for c in calls if c[0] == "mixed"]
    assert mixed == [("mixed", 1, 2)]
    assert not any(c[0] == "prefill" for calls in steps for c in calls if ("mixed", 1, 2) not in calls)
    for r, (p, m) in zip(reqs, ((P[1], 12), (P[2], 6), (P[0], 9))):
        assert r.result().token_ids == _alone(p, m)
    assert core.cache == {}


def test_the_decode_rows_come_out_of_the_prompt_budget():
    """chunk_tokens 8: a mixed call with r decode rows carries 8 - r prompt tokens (one pass of 8 rows), never
    less than half the budget (4)."""
    core, reqs, steps = _joining(True, chunk_tokens=8)
    calls = [(c, sum(x[2] for x in st if x[0] == "prefill")) for st in steps for c in st if c[0] == "mixed"]
    assert [(c[1], n) for c, n in calls[:4]] == [(1, 7), (1, 7), (1, 7), (2, 6)]  # P[2]'s 17 tokens and P[0]'s 10
    assert all(n <= max(8 - c[1], 4) for c, n in calls)
    for r, (p, m) in zip(reqs, ((P[1], 12), (P[2], 6), (P[0], 9))):
        assert r.result().token_ids == _alone(p, m)
    assert core.cache == {}


def test_a_request_waiting_for_pages_does_not_stop_the_launch_ahead():
    """A prompt that cannot be admitted (the pool too small for it until the running request ends) is no reason
    to hold back the running one's next step."""
    core, eng = _fake(max_batch=4, pages=9)
    sched = Scheduler(eng, mixed_steps=True)
    a = sched.submit(P[0], SamplingParams(max_tokens=8))
    sched.step()
    b = sched.submit(list(range(1, 26)), SamplingParams(max_tokens=3))  # 7 pages: waits until `a` ends
    core.log = []
    sched.step()
    sched.step()
    samples = [i for i, c in enumerate(core.log) if c[0] == "sample"]
    assert core.log[samples[-1] + 1][0] == "step"  # launched ahead as usual
    sched.wait_idle()
    assert a.result().token_ids == _alone(P[0], 8) and b.result().token_ids == _alone(list(range(1, 26)), 3)


def test_mixed_steps_off_or_refused_give_the_separate_calls_and_the_same_tokens():
    _, off_reqs, off = _joining(False)
    assert not any(c[0] == "mixed" for calls in off for c in calls)
    core, eng = _fake(max_batch=4, pages=40)

    def refused(*args):
        raise InvalidRequestError("refused")

    core.seq_mixed = refused  # (checked before it ran anything: the separate calls then pin any error)
    sched = Scheduler(eng, chunk_tokens=64, mixed_steps=True)
    first = sched.submit(P[1], SamplingParams(max_tokens=12))
    sched.step()
    later = [sched.submit(p, SamplingParams(max_tokens=m)) for p, m in ((P[2], 6), (P[0], 9))]
    sched.wait_idle()
    for reqs in (off_reqs, [first] + later):
        for r, (p, m) in zip(reqs, ((P[1], 12), (P[2], 6), (P[0], 9))):
            assert r.result().token_ids == _alone(p, m)
    assert core.cache == {}
    with pytest.raises(InvalidRequestError, match="mixed_steps must be a bool"):
        Scheduler(eng, mixed_steps=1)


def test_an_interrupted_mixed_call_fails_its_requests_and_is_reraised():
    core, eng = _fake(max_batch=4, pages=40)
    sched = Scheduler(eng, chunk_tokens=64, mixed_steps=True)
    first = sched.submit(P[1], SamplingParams(max_tokens=12))
    sched.step()
    later = sched.submit(P[0], SamplingParams(max_tokens=3))

    def interrupted(*args):
        raise KeyboardInterrupt

    core.seq_mixed = interrupted
    with pytest.raises(KeyboardInterrupt):  # (the launch ahead after the sample: `first`'s row and `later`)
        sched.step()
    for r in (first, later):
        with pytest.raises(KeyboardInterrupt):
            r.result()
    assert core.cache == {} and sched.idle


# ---- the real CPU engine ----


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = make_chat_llama(tmp_path_factory.mktemp("mixed") / "m", init_std=0.3)
    with Engine(d, device="cpu", max_seq_len=512, threads=2) as e:
        yield e


def test_requests_joining_running_ones_generate_what_each_does_alone(eng):
    """Requests submitted while others decode (so their prompts ride in mixed steps; a small chunk budget
    spreads a long prompt over several), greedy and seeded: the same tokens with mixed steps on and off, and
    the greedy ones those of the single-sequence path."""
    texts = [("GPUs are fast " * 8)[:1 + (29 * i) % 100] for i in range(8)]
    sps = [SamplingParams(max_tokens=6 + i % 3, ignore_eos=True,
                          **({"temperature": 0.8, "seed": i} if i % 2 else {})) for i in range(8)]
    out, trace = {}, Trace()
    for mixed in (True, False):
        sched = Scheduler(eng, chunk_tokens=24, mixed_steps=mixed, trace=trace if mixed else None)
        try:
            reqs = [sched.submit(texts[0], sps[0])]
            sched.step()
            for t, sp in zip(texts[1:], sps[1:]):
                reqs.append(sched.submit(t, sp))
                sched.step()
            sched.wait_idle()
            out[mixed] = [(r.result().token_ids, r.result().text) for r in reqs]
            sched.reset_prefix_cache()  # (the ended requests' kept caches: all that may still hold pages)
            assert eng._core.kv_pages_free == eng._core.kv_pages_total
        finally:
            sched.close()
    assert out[True] == out[False]
    assert sum(c[0] == "seq_mixed" for c in trace.calls) >= 3  # (the prompts did ride in mixed calls)
    for i in range(0, 8, 2):
        w = eng.generate(texts[i], sps[i])
        assert out[True][i] == (w.token_ids, w.text), i


def test_an_interrupted_admission_in_the_launch_ahead_loses_no_token():
    """A request arrives while a step computes; the launch ahead admits it and seq_open is interrupted: nothing
    is launched, the step's sampled tokens are still taken (the running request goes on, its tokens as alone),
    the newcomer stays queued, and step() re-raises. (A core without seq_sample_step: with it, a request that
    arrives during the sample waits for the next step's admission, outside the launch.)"""
    core = PlainCore(max_batch=4, pages=40)
    eng = _engine(core)
    sched = Scheduler(eng, chunk_tokens=64, mixed_steps=True)
    first = sched.submit(P[1], SamplingParams(max_tokens=12))
    sched.step()
    real_sample, real_open, later = core.seq_sample, core.seq_open, []

    def sample_while_one_arrives(*args):
        if not later:
            later.append(sched.submit(P[0], SamplingParams(max_tokens=3)))
        return real_sample(*args)

    def interrupted():
        raise KeyboardInterrupt

    core.seq_sample, core.seq_open = sample_while_one_arrives, interrupted
    with pytest.raises(KeyboardInterrupt):
        sched.step()
    core.seq_sample, core.seq_open = real_sample, real_open
    assert sched.waiting == 1 and sched.running == 1
    assert sched.wait_idle(timeout=10)
    assert first.result().token_ids == _alone(P[1], 12)
    assert later[0].result().token_ids == _alone(P[0], 3)
    assert core.cache == {}
