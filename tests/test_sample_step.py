"""seq_sample_step: seq_sample, then at once seq_step of the rows that go on (docs/BATCH_CONTRACT.md part 2;
cpp/core/sample_step.h, bound for both engines), and the scheduler's launch ahead through it. On the CPU engine the
call leaves every slot exactly as seq_sample then seq_step of the chosen rows do; a row is stepped only when its
go_on is set and its token is none of its stop ids; a step the engine refuses (here: a slot at max_seq_len)
launches nothing and the sample stands; bad arguments are a Request error that changes nothing. The scheduler uses
it for the launch ahead and every request generates what it does without overlap."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from test_cpu_batch import VOCAB, _store
from test_prefill_many import GREEDY, MAX_SEQ, _snapshot, assert_same_slots
from tinyinfer import Engine, InvalidRequestError, SamplingParams, Scheduler, _core
from tinyinfer.trace import Trace

SEEDED = _core.SamplingConfig()
SEEDED.temperature, SEEDED.seed = 0.9, 11


def _twins(n=4, fmt="fp32"):
    """Two engines holding the same n prefilled slots (prompts of different lengths): (a, b, slots)."""
    engines = [_core.CpuEngine(_store(fmt), MAX_SEQ, 2, n + 2) for _ in range(2)]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, 3 + 9 * i).tolist() for i in range(n)]
    for e in engines:
        slots = [e.seq_open() for _ in range(n)]
        e.seq_prefill_many(slots, prompts)
    return engines[0], engines[1], slots


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_sample_step_is_sample_then_step_of_the_rows_that_go_on(fmt):
    a, b, slots = _twins(fmt=fmt)
    cfgs = [GREEDY, SEEDED, GREEDY, SEEDED]
    for step in range(3):
        want = b.seq_sample(slots, cfgs, [step] * 4, 2)
        toks = want[0].tolist()
        # row 1 has no tokens left, row 2 samples one of its stop ids (found by the twin), rows 0 and 3 go on
        go_on, stops = [True, False, True, True], [[], [], [toks[2], VOCAB + 5], [toks[3] + 1]]
        got = a.seq_sample_step(slots, cfgs, [step] * 4, 2, go_on, stops)
        for w, g in zip(want, got[:4]):
            np.testing.assert_array_equal(g, w)
        assert got[4].tolist() == [1, 0, 0, 1]
        assert got[5] > 0  # (the launch's host seconds)
        b.seq_step([slots[0], slots[3]], [toks[0], toks[3]])
        assert [a.seq_length(s) for s in slots] == [b.seq_length(s) for s in slots]
        for i in (1, 2):  # not stepped: their next step is the caller's, with this token
            a.seq_step([slots[i]], [toks[i]])
            b.seq_step([slots[i]], [toks[i]])
    assert_same_slots(b, a, slots, [b.seq_length(s) for s in slots])


def test_nothing_goes_on_is_a_plain_sample():
    a, b, slots = _twins(2)
    got = a.seq_sample_step(slots, [GREEDY] * 2, [0, 0], 0, [False, False], [[], []])
    want = b.seq_sample(slots, [GREEDY] * 2, [0, 0], 0)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[4].tolist() == [0, 0] and got[5] == 0
    assert _snapshot(a, slots)[0] == _snapshot(b, slots)[0]


def test_a_refused_step_launches_nothing_and_the_sample_stands():
    a, b, slots = _twins(2)
    for e in (a, b):  # a third slot filled to max_seq_len: sampling it works, stepping it cannot
        full = e.seq_open()
        e.seq_prefill(full, [5] * MAX_SEQ)
    rows = slots + [full]
    before = _snapshot(a, rows)
    got = a.seq_sample_step(rows, [GREEDY] * 3, [0] * 3, 0, [True] * 3, [[], [], []])
    want = b.seq_sample(rows, [GREEDY] * 3, [0] * 3, 0)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[4].tolist() == [0, 0, 0] and got[5] == 0
    assert [a.seq_length(s) for s in rows] == before[0]
    a.seq_step(slots, got[0].tolist()[:2])  # the engine goes on
    b.seq_step(slots, want[0].tolist()[:2])
    assert_same_slots(b, a, slots, [b.seq_length(s) for s in slots])


def test_bad_arguments_are_a_request_error_that_changes_nothing():
    a, b, slots = _twins(2)
    before = _snapshot(a, slots)
    cases = [
        (lambda: a.seq_sample_step(slots, [GREEDY] * 2, [0, 0], 0, [True], [[], []]), "1 go_on"),
        (lambda: a.seq_sample_step(slots, [GREEDY] * 2, [0, 0], 0, [True, True], [[]]), "1 stop id lists"),
        (lambda: a.seq_sample_step(slots, [GREEDY], [0, 0], 0, [True, True], [[], []]), "1 configs"),
        (lambda: a.seq_sample_step(slots, [GREEDY] * 2, [0, 0], 21, [True, True], [[], []]), "top_logprobs"),
        (lambda: a.seq_sample_step([slots[0], slots[0]], [GREEDY] * 2, [0, 0], 0, [True, True], [[], []]),
         "listed twice"),
    ]
    for call, msg in cases:
        with pytest.raises(InvalidRequestError, match=msg):
            call()
        after = _snapshot(a, slots)
        assert after[0] == before[0] and after[2] == before[2]
    # nothing sampled either: the histories the penalties read are the twin's (which saw no bad call)
    pen = _core.SamplingConfig()
    pen.temperature, pen.seed, pen.repetition_penalty, pen.frequency_penalty = 1.0, 3, 1.8, 0.7
    got = a.seq_sample_step(slots, [pen] * 2, [0, 0], 2, [True, True], [[], []])
    want = b.seq_sample(slots, [pen] * 2, [0, 0], 2)
    for w, g in zip(want, got[:4]):
        np.testing.assert_array_equal(g, w)
    assert got[4].tolist() == [1, 1]


def test_a_stop_id_past_int32_matches_no_token():
    a, b, slots = _twins(1)
    want = b.seq_sample(slots, [GREEDY], [0], 0)[0].tolist()[0]
    got = a.seq_sample_step(slots, [GREEDY], [0], 0, [True], [[want + (1 << 32)]])
    assert got[0].tolist() == [want] and got[4].tolist() == [1]


def test_the_scheduler_launches_ahead_inside_the_sample_and_generates_the_same():
    """Overlap on: the launch ahead goes through seq_sample_step (its steps recorded as a seq_sample and a seq_step
    starting at its end), not with sample_launch=False or without overlap; every request's tokens are the same in
    all three (stop ids and max_tokens mixed)."""
    store = _store("fp32")
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, VOCAB, 4 + 5 * i).tolist() for i in range(5)]
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True,
                             stop_token_ids=list(range(i, VOCAB, 7)) if i in (1, 4) else [])
              for i in range(5)]
    outs = {}
    for overlap, inside in ((False, True), (True, False), (True, True)):
        core = _core.CpuEngine(store, MAX_SEQ, 2, 4)
        eng = Engine.from_core(core, SimpleNamespace(vocab=VOCAB, eos_token_ids=[]), max_seq_len=MAX_SEQ)
        trace = Trace()
        sched = Scheduler(eng, max_batch=4, overlap=overlap, sample_launch=inside, trace=trace)
        reqs = [sched.submit(p, sp) for p, sp in zip(prompts, params)]
        while not sched.idle:
            sched.step()
        outs[overlap, inside] = [r.result().token_ids for r in reqs]
        steps = [c for c in trace.calls if c[0] == "seq_step"]
        ends = {c[2] for c in trace.calls if c[0] == "seq_sample"}
        inside_steps = sum(c[1] in ends for c in steps)  # (recorded as a seq_step starting where its sample ends)
        assert inside_steps >= len(steps) // 2 > 0 if overlap and inside else inside_steps == 0
        sched.reset_prefix_cache()  # (the ended requests' kept caches: all that may still hold pages)
        assert core.kv_pages_free == core.kv_pages_total
    assert outs[True, True] == outs[True, False] == outs[False, True]
    lens = [len(t) for t in outs[True, True]]
    assert all(n <= p.max_tokens for n, p in zip(lens, params))
    assert lens[0] == params[0].max_tokens and any(n < p.max_tokens for n, p in zip(lens, params))  # a stop id bit


def test_a_cancel_before_the_sample_is_not_launched_ahead():
    """A cancel that lands inside a step, before its sample (here: while a new request is admitted), keeps that
    row out of the launch inside seq_sample_step; the next step closes its slot first; the others generate what
    they do alone and the pool ends empty (fake core, docs/BATCH_CONTRACT.md part 2)."""
    from test_scheduler import P, FakeCore, _alone, _engine

    class CancelOnOpen(FakeCore):
        victim = None

        def seq_open(self):
            if self.victim is not None:
                self.victim.cancel()
                self.victim = None
            return super().seq_open()

    core = CancelOnOpen(max_batch=4)
    sched = Scheduler(_engine(core))
    reqs = [sched.submit(p, SamplingParams(max_tokens=10)) for p in P[:2]]
    sched.step()
    sched.step()
    slot = next(s for s, c in core.cache.items() if c[:len(P[1])] == P[1])
    core.victim = reqs[1]
    reqs.append(sched.submit(P[2], SamplingParams(max_tokens=10)))
    core.log = []
    sched.step()  # admits P[2] (the cancel lands), prefills it, samples and launches ahead all but the victim
    i = core.log.index(next(c for c in core.log if c[0] == "sample"))
    assert core.log[i + 1][0] == "step" and slot not in core.log[i + 1][1]
    core.log = []
    sched.step()
    assert core.log[0] == ("close", slot)
    sched.wait_idle()
    assert reqs[1].result().finish_reason == "cancelled"
    for r, p in ((reqs[0], P[0]), (reqs[2], P[2])):
        assert r.result().token_ids == _alone(p, 10)
    assert core.cache == {}


def test_stop_ids_outside_int32_are_left_out_of_the_call():
    """A stop id past int32 (or negative) matches no token. A request's own is refused at submit, naming it; an
    EOS id of a config the core never checked (Engine.from_core) is left out of the call: the launch ahead still
    runs (the id would not even convert to the core's int64 ids), and the request generates what it does
    without it."""
    store = _store("fp32")
    outs = []
    for eos in ([], [2**64, 2**31, -3]):
        core = _core.CpuEngine(store, MAX_SEQ, 2, 2)
        eng = Engine.from_core(core, SimpleNamespace(vocab=VOCAB, eos_token_ids=eos), max_seq_len=MAX_SEQ)
        sched = Scheduler(eng, trace=(trace := Trace()))
        with pytest.raises(InvalidRequestError, match="stop token id 2147483648 is out of range"):
            sched.submit([3, 4, 5], SamplingParams(max_tokens=6, stop_token_ids=[2**31]))
        req = sched.submit([3, 4, 5], SamplingParams(max_tokens=6))
        while not sched.idle:
            sched.step()
        outs.append(req.result().token_ids)
        assert any(c[0] == "seq_step" for c in trace.calls)
    assert outs[0] == outs[1] and len(outs[0]) == 6


# ---- seq_sample_mixed: the launch ahead with the waiting prompts (mixed steps) ----


def _mixed_twins(n=3, fmt="fp32"):
    """_twins with two more slots open and empty: the prompts the launch carries."""
    a, b, slots = _twins(n, fmt)
    fresh = [[e.seq_open() for _ in range(2)] for e in (a, b)]
    assert fresh[0] == fresh[1]
    return a, b, slots, fresh[0]


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_sample_mixed_is_sample_then_mixed_of_the_rows_that_go_on(fmt):
    """Every row with go_on steps with its sampled token, whatever that token is (there are no stop ids: the
    launch may be queued before the tokens are known); the prompts ride in the same call."""
    a, b, slots, fresh = _mixed_twins(fmt=fmt)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, 7).tolist(), rng.integers(0, VOCAB, 19).tolist()]
    cfgs = [GREEDY, SEEDED, GREEDY]
    go_on = [True, False, True]
    got = a.seq_sample_mixed(slots, cfgs, [0] * 3, 2, go_on, fresh, prompts)
    want = b.seq_sample(slots, cfgs, [0] * 3, 2)
    for w, g in zip(want, got[:4]):
        np.testing.assert_array_equal(g, w)
    assert got[4].tolist() == [1, 0, 1] and got[5] > 0 and got[6] is True
    toks = want[0].tolist()
    b.seq_mixed([slots[0], slots[2]], [toks[0], toks[2]], fresh, prompts)
    a.seq_step([slots[1]], [toks[1]])  # the row that did not go on: its step is the caller's
    b.seq_step([slots[1]], [toks[1]])
    every = slots + fresh
    assert_same_slots(b, a, every, [b.seq_length(s) for s in every])


def test_a_refused_mixed_launch_runs_nothing_and_the_sample_stands():
    """A launch the engine refuses (a prompt token out of the vocabulary, a row at max_seq_len) launches
    nothing: no row stepped, the prompts not prefilled, the sample as seq_sample's; the engine goes on."""
    a, b, slots, fresh = _mixed_twins(2)
    for e in (a, b):
        e.seq_prefill(fresh[1], [5] * MAX_SEQ)  # full: sampling it works, stepping it cannot
    for step, (rows, go_on, prompt) in enumerate((
            (slots, [True, True], [VOCAB]),  # a bad prompt token
            (slots + [fresh[1]], [True, True, True], [1, 2]))):  # a row that cannot step
        before = _snapshot(a, slots + fresh)
        n = len(rows)
        got = a.seq_sample_mixed(rows, [GREEDY] * n, [step] * n, 0, go_on, [fresh[0]], [prompt])
        want = b.seq_sample(rows, [GREEDY] * n, [step] * n, 0)
        np.testing.assert_array_equal(got[0], want[0])
        assert got[4].tolist() == [0] * n and got[5] == 0 and got[6] is False
        after = _snapshot(a, slots + fresh)
        assert after[0] == before[0] and after[2] == before[2]
        toks = want[0].tolist()[:2]
        a.seq_step(slots, toks)  # the engine goes on: the caller steps them itself
        b.seq_step(slots, toks)
    assert_same_slots(b, a, slots, [b.seq_length(s) for s in slots])


def test_bad_mixed_arguments_are_a_request_error_that_changes_nothing():
    a, _, slots, fresh = _mixed_twins(2)
    before = _snapshot(a, slots + fresh)
    cases = [
        (lambda: a.seq_sample_mixed(slots, [GREEDY] * 2, [0, 0], 0, [True], [fresh[0]], [[1]]), "1 go_on"),
        (lambda: a.seq_sample_mixed(slots, [GREEDY] * 2, [0, 0], 0, [True] * 2, fresh, [[1]]), "2 prompt slots"),
        (lambda: a.seq_sample_mixed(slots, [GREEDY], [0, 0], 0, [True] * 2, [fresh[0]], [[1]]), "1 configs"),
        (lambda: a.seq_sample_mixed(slots, [GREEDY] * 2, [0, 0], 21, [True] * 2, [fresh[0]], [[1]]), "top_logprobs"),
        (lambda: a.seq_sample_mixed([slots[0]] * 2, [GREEDY] * 2, [0, 0], 0, [True] * 2, [fresh[0]], [[1]]),
         "listed twice"),
    ]
    for call, msg in cases:
        with pytest.raises(InvalidRequestError, match=msg):
            call()
        after = _snapshot(a, slots + fresh)
        assert after[0] == before[0] and after[2] == before[2]


def test_the_scheduler_carries_waiting_prompts_in_the_sample_and_a_stopped_row_ends():
    """Mixed steps on the real CPU engine: prompts that arrive while others decode ride in seq_sample_mixed
    (recorded as a seq_sample and a seq_mixed that starts at its end); a row that draws one of its stop ids in
    such a call was stepped for nothing and still ends there, with the tokens it has without mixed steps; the
    pool ends empty."""
    store = _store("fp32")
    rng = np.random.default_rng(21)
    prompts = [rng.integers(0, VOCAB, 5 + 7 * i).tolist() for i in range(6)]
    params = [SamplingParams(max_tokens=6 + i, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True,
                             stop_token_ids=list(range(i % 3, VOCAB, 5)) if i in (0, 3) else [])
              for i in range(6)]
    outs, traces = {}, {}
    for mixed in (False, True):
        core = _core.CpuEngine(store, MAX_SEQ, 2, 6)
        eng = Engine.from_core(core, SimpleNamespace(vocab=VOCAB, eos_token_ids=[]), max_seq_len=MAX_SEQ)
        sched = Scheduler(eng, max_batch=6, mixed_steps=mixed, trace=(trace := Trace()))
        reqs = [sched.submit(prompts[0], params[0])]
        sched.step()
        for p, sp in zip(prompts[1:], params[1:]):
            reqs.append(sched.submit(p, sp))
            sched.step()
        while not sched.idle:
            sched.step()
        outs[mixed], traces[mixed] = [r.result() for r in reqs], trace
        sched.reset_prefix_cache()
        assert core.kv_pages_free == core.kv_pages_total
    assert [c.token_ids for c in outs[True]] == [c.token_ids for c in outs[False]]
    assert [c.finish_reason for c in outs[True]] == [c.finish_reason for c in outs[False]]
    assert "stop" in [c.finish_reason for c in outs[True]]  # (a stop id bit)
    ends = {c[2] for c in traces[True].calls if c[0] == "seq_sample"}
    carried = [c for c in traces[True].calls if c[0] == "seq_mixed" and c[1] in ends]
    assert len(carried) >= 3 and not any(c[0] == "seq_mixed" for c in traces[False].calls)


def test_a_request_waiting_for_a_slot_does_not_take_the_launch_out_of_the_sample():
    """Mixed steps, every slot taken and a request waiting: no prompt can ride, so the running rows' next step
    is still launched inside the sampling call (seq_sample_step), not from Python after it."""
    store = _store("fp32")
    core = _core.CpuEngine(store, MAX_SEQ, 2, 2)
    eng = Engine.from_core(core, SimpleNamespace(vocab=VOCAB, eos_token_ids=[]), max_seq_len=MAX_SEQ)
    sched = Scheduler(eng, max_batch=2, mixed_steps=True, trace=(trace := Trace()))
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (8, 8, 3)]
    reqs = [sched.submit([3 + i, 4, 5], sp) for i, sp in enumerate(sps)]
    while not sched.idle:
        sched.step()
    assert [len(r.result().token_ids) for r in reqs] == [8, 8, 3]
    ends = {c[2] for c in trace.calls if c[0] == "seq_sample"}
    first_end = min(t for kind, t, *_ in trace.events if kind == "end")
    steps = [c for c in trace.calls if c[0] == "seq_step" and c[1] < first_end]  # while the third one waits
    assert len(steps) >= 5 and all(c[1] in ends for c in steps)
