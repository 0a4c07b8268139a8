"""seq_prefill_many, the slot API's many-prompt prefill (docs/BATCH_CONTRACT.md part 2; cpp/cpu/cpu_sequences.cpp,
cpp/gpu/cuda_engine_slots.cu) and the scheduler's one prefill call per step. On the CPU engine many prompts at
once leave each slot exactly as seq_prefill one at a time does (lengths 1, 7 and 128, a chunk continuing a
prompt, a slot closed and opened again); every bad call is a Request error that changes nothing; the scheduler
puts a step's prompt chunks into one call and every request still generates what it generates alone. The GPU
side: tests/test_gpu_prefill_many.py."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_chat_llama
from test_cpu_batch import VOCAB, _store
from test_scheduler import P, _alone, _fake, _steps
from tinyinfer import Engine, InvalidRequestError, SamplingParams, Scheduler, _core
from tinyinfer.bench_batch import time_prefill

MAX_SEQ = 300
GREEDY = _core.SamplingConfig()


def _prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, VOCAB, n).tolist() for n in (1, 7, 128, 60, 9)]


def _setup(core):
    """Slots in the state the calls start from: slot c holds the first 40 tokens of a prompt (its chunk
    continues in the call), slot r was prefilled and closed (a cancelled request) and is open again, empty."""
    ps = _prompts()
    slots = [core.seq_open() for _ in range(4)]
    c = slots[3]
    core.seq_prefill(c, ps[3][:40])
    r = core.seq_open()
    core.seq_prefill(r, ps[4])
    core.seq_close(r)
    assert core.seq_open() == r
    return slots + [r], ps[:3] + [ps[3][40:], ps[4]]


def _greedy_run(core, slots, steps=4):
    """The slots' logits now, then `steps` greedy tokens of all of them stepped together."""
    logits = [core.seq_logits(s).copy() for s in slots]
    toks = []
    for i in range(steps):
        t, _, _, _ = core.seq_sample(slots, [GREEDY] * len(slots), [i] * len(slots), 0)
        toks.append(t.tolist())
        core.seq_step(slots, t.tolist())
    return logits, toks


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int4"])
def test_many_prompts_leave_each_slot_as_one_at_a_time(fmt):
    store = _store(fmt)
    one, many = (_core.CpuEngine(store, MAX_SEQ, 2, 8) for _ in range(2))
    slots, chunks = _setup(one)
    assert _setup(many) == (slots, chunks)
    for s, ch in zip(slots, chunks):
        one.seq_prefill(s, ch)
    many.seq_prefill_many(slots, chunks)
    assert_same_slots(one, many, slots, [1, 7, 128, 60, 9])


def assert_same_slots(want_core, got_core, slots, lengths):
    """Two engines' slots hold the same lengths, pages, logits (bit for bit) and greedy continuation."""
    assert [got_core.seq_length(s) for s in slots] == [want_core.seq_length(s) for s in slots] == lengths
    assert got_core.kv_pages_free == want_core.kv_pages_free
    want, got = _greedy_run(want_core, slots), _greedy_run(got_core, slots)
    for a, b in zip(want[0], got[0]):
        np.testing.assert_array_equal(a, b)
    assert got[1] == want[1]


def test_the_prompt_joins_each_slots_history():
    """A repetition penalty sees the prompt of a slot prefilled in a many-prompt call, as after seq_prefill."""
    store = _store("fp32")
    pen = _core.SamplingConfig()
    pen.repetition_penalty = 1.5
    out = []
    for many in (False, True):
        core = _core.CpuEngine(store, MAX_SEQ, 2, 4)
        slots = [core.seq_open() for _ in range(3)]
        ps = _prompts()[:3]
        if many:
            core.seq_prefill_many(slots, ps)
        else:
            for s, p in zip(slots, ps):
                core.seq_prefill(s, p)
        out.append([core.seq_sample(slots, [pen] * 3, [0] * 3, 3)[i].tolist() for i in (0, 2)])
    assert out[0] == out[1]


def _snapshot(core, slots):
    return ([core.seq_length(s) for s in slots], [core.seq_logits(s).copy() for s in slots], core.kv_pages_free)


def test_every_bad_call_changes_nothing_and_the_engine_goes_on():
    core = _core.CpuEngine(_store("fp32"), MAX_SEQ, 2, 6)
    a, b, closed, full = (core.seq_open() for _ in range(4))
    core.seq_close(closed)
    core.seq_prefill(a, [1, 2, 3])
    core.seq_prefill(full, [5] * MAX_SEQ)
    cases = [
        (lambda: core.seq_prefill_many([a, b], [[1]]), "2 slots but 1 prompts"),
        (lambda: core.seq_prefill_many([], []), "no slots"),
        (lambda: core.seq_prefill_many([a, a], [[1], [2]]), "listed twice"),
        (lambda: core.seq_prefill_many([a, closed], [[1], [2]]), "not open"),
        (lambda: core.seq_prefill_many([a, 99], [[1], [2]]), "does not exist"),
        (lambda: core.seq_prefill_many([-1, a], [[1], [2]]), "does not exist"),
        (lambda: core.seq_prefill_many([a, b], [[1], []]), "empty"),
        (lambda: core.seq_prefill_many([a, b], [[1], [2, VOCAB]]), "out of range"),
        (lambda: core.seq_prefill_many([a, b], [[1], [-1]]), "out of range"),
        (lambda: core.seq_prefill_many([a, b], [[1], [2 ** 40]]), "out of range"),
        (lambda: core.seq_prefill_many([b, a], [[1], [1] * (MAX_SEQ - 2)]), "max_seq_len"),
        (lambda: core.seq_prefill_many([a, full], [[1], [1]]), "max_seq_len"),
    ]
    before = _snapshot(core, [a, b, full])
    for call, msg in cases:
        with pytest.raises(InvalidRequestError, match=msg):
            call()
        after = _snapshot(core, [a, b, full])
        assert after[0] == before[0] and after[2] == before[2], msg
        for x, y in zip(after[1], before[1]):
            np.testing.assert_array_equal(x, y)
    core.seq_prefill_many([a, b], [[4, 5], [6]])
    assert (core.seq_length(a), core.seq_length(b)) == (5, 1)


def test_bench_times_prefill_each_and_all_at_once():
    core = _core.CpuEngine(_store("fp32"), MAX_SEQ, 2, 4)
    r = time_prefill(core, 3, 20, VOCAB, reps=1)
    assert set(r) == {"prefill_each_ms", "prefill_many_ms", "prefill_x"} and min(r.values()) > 0
    assert core.kv_pages_free == core.kv_pages_total  # its slots closed again


# ---- the scheduler: one call per step (a pure-Python fake of the core: test_scheduler.FakeCore) ----


def test_a_steps_prompts_go_in_one_call_and_each_request_generates_what_it_does_alone():
    core, eng = _fake(max_batch=4)
    sched = Scheduler(eng)
    reqs = [sched.submit(p, SamplingParams(max_tokens=m)) for p, m in zip(P, (3, 6, 4))]
    steps = _steps(sched, core)
    assert ("many", 3) in steps[0]
    assert sum(1 for calls in steps for c in calls if c[0] == "prefill") == 3  # every prompt prefilled once
    for r, p, m in zip(reqs, P, (3, 6, 4)):
        assert r.result().token_ids == _alone(p, m)


def test_the_budget_cuts_chunks_across_one_call_per_step():
    core, eng = _fake(max_batch=4)
    sched = Scheduler(eng, chunk_tokens=12, mixed_steps=False)  # (the chunks in mixed calls: test_mixed_step.py)
    reqs = [sched.submit(p, SamplingParams(max_tokens=3)) for p in P]  # 10, 3, 17 tokens
    steps = _steps(sched, core)
    prefills = [[(c[1], c[2]) for c in calls if c[0] == "prefill"] for calls in steps]
    assert [[n for _, n in step] for step in prefills[:3]] == [[10, 2], [1, 11], [6]]
    assert [sum(1 for c in calls if c[0] == "many") for calls in steps[:3]] == [1, 1, 0]  # one prompt: seq_prefill
    for r, p in zip(reqs, P):
        assert r.result().token_ids == _alone(p, 3)


def test_batched_prefill_off_is_one_call_each():
    core, eng = _fake(max_batch=4)
    sched = Scheduler(eng, batched_prefill=False)
    reqs = [sched.submit(p, SamplingParams(max_tokens=2)) for p in P]
    steps = _steps(sched, core)
    assert not any(c[0] == "many" for calls in steps for c in calls)
    assert [c[0] for c in steps[0] if c[0] == "prefill"] == ["prefill"] * 3
    for r, p in zip(reqs, P):
        assert r.result().token_ids == _alone(p, 2)
    with pytest.raises(InvalidRequestError, match="batched_prefill must be a bool"):
        Scheduler(eng, batched_prefill="yes")


def test_a_refused_many_call_falls_back_to_one_call_each():
    """A Request error from the batched call (which changed nothing) is retried one call each, so it ends only
    the request it belongs to (here: the middle one's call fails again), as without the batched call."""
    core, eng = _fake(max_batch=4)
    sched = Scheduler(eng)
    reqs = [sched.submit(p, SamplingParams(max_tokens=3)) for p in P]
    real = core.seq_prefill

    def many(slots, prompts):
        raise InvalidRequestError("refused")

    def one(slot, tokens):
        if list(tokens) == P[1]:
            raise InvalidRequestError("this one")
        real(slot, tokens)

    core.seq_prefill_many, core.seq_prefill = many, one
    sched.wait_idle()
    with pytest.raises(InvalidRequestError, match="this one"):
        reqs[1].result()
    for i in (0, 2):
        assert reqs[i].result().token_ids == _alone(P[i], 3)
    assert core.cache == {}


def test_an_interrupted_many_call_fails_its_requests_and_is_reraised():
    core, eng = _fake(max_batch=4)
    sched = Scheduler(eng, mixed_steps=False)  # (an interrupted mixed call: test_mixed_step.py)
    first = sched.submit(P[1], SamplingParams(max_tokens=6))
    sched.step()
    reqs = [sched.submit(p, SamplingParams(max_tokens=3)) for p in (P[0], P[2])]

    def many(slots, prompts):
        raise KeyboardInterrupt

    core.seq_prefill_many = many
    with pytest.raises(KeyboardInterrupt):
        sched.step()
    for r in reqs:
        with pytest.raises(KeyboardInterrupt):
            r.result()
    assert first.result().token_ids == _alone(P[1], 6)  # decoding, not in the call: untouched
    assert core.cache == {}


# ---- the real CPU engine ----


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = make_chat_llama(tmp_path_factory.mktemp("many") / "m", init_std=0.3)
    with Engine(d, device="cpu", max_seq_len=512, threads=2) as e:
        yield e


def test_many_simultaneous_submissions_generate_what_each_does_alone(eng):
    """16 requests (prompts of 1 .. ~100 characters) submitted at once, one cancelled before the first step:
    the first step prefills the rest in one call (chunk_tokens large enough), and each request's tokens are
    those it gets alone."""
    texts = [("GPUs are fast " * 8)[:1 + (13 * i) % 100] for i in range(16)]
    sps = [SamplingParams(max_tokens=4 + i % 5, ignore_eos=True) for i in range(16)]
    want = [eng.generate(t, sp) for t, sp in zip(texts, sps)]  # the single-sequence path, one by one
    sps[3] = SamplingParams(max_tokens=4 + 3, ignore_eos=True, logprobs=2)
    sched = Scheduler(eng, chunk_tokens=4096)
    try:
        reqs = [sched.submit(t, sp) for t, sp in zip(texts, sps)]
        reqs[5].cancel()
        sched.wait_idle()
        assert reqs[5].result().finish_reason == "cancelled" and reqs[5].result().token_ids == []
        for i, (r, w) in enumerate(zip(reqs, want)):
            if i == 5:
                continue
            out = r.result()
            assert (out.token_ids, out.text) == (w.token_ids, w.text), i
        lps = reqs[3].result().logprobs
        assert [lp.token_id for lp in lps] == reqs[3].result().token_ids and all(lp.logprob <= 0 for lp in lps)
        sched.reset_prefix_cache()  # (the ended requests' kept caches: all that may still hold pages)
        assert eng._core.kv_pages_free == eng._core.kv_pages_total
    finally:
        sched.close()
