"""Engine.generate / chat of a list (issue 17): each prompt of a batch gets exactly what it gets alone on the
single-sequence path (greedy and seeded sampling, stop strings, max_tokens, penalties), logprobs are
log_softmax(Engine.logits) at the chosen tokens, stream() joins a running batch, a KeyboardInterrupt cancels the
batch and leaves the engine usable, and the KV pool is empty after every test."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import hold_steps, make_chat_llama, near_tie, sched_cancels_pending
from tinyinfer import Engine, InvalidRequestError, SamplingParams, Scheduler
from tinyinfer.scheduler import Request


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = make_chat_llama(tmp_path_factory.mktemp("batch") / "m", init_std=0.3)
    with Engine(d, device="cpu", max_seq_len=1024, threads=2) as e:
        yield e


@pytest.fixture(autouse=True)
def pool_empty_after(eng):
    yield
    assert eng.scheduler.idle
    assert eng._core.kv_pages_free + eng.scheduler.kv_pages_cached == eng._core.kv_pages_total
    eng.scheduler.reset_prefix_cache()  # (the ended requests' kept caches: all that may still hold pages)
    assert eng._core.kv_pages_free == eng._core.kv_pages_total


TEXTS = ["Once upon a time", "A", "The GPU has many cores and a wide memory bus, so it is fast at matrix products.",
         "abc abc abc abc", "Hello, world! " * 45]  # the last: 630 tokens, more than one prefill chunk (512)


def _alone(eng, prompt, sp):
    assert eng.scheduler.idle  # so this runs on the single-sequence path
    return eng.generate(prompt, sp)


def _same(a, b):
    assert (a.text, a.token_ids, a.finish_reason, a.prompt_token_ids) == \
           (b.text, b.token_ids, b.finish_reason, b.prompt_token_ids)


def test_greedy_batch_equals_each_prompt_alone(eng):
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [_alone(eng, t, sp) for t in TEXTS]
    got = eng.generate(TEXTS, sp)
    assert len(got) == len(TEXTS)
    for g, w in zip(got, want):
        _same(g, w)
    assert len(set(tuple(g.token_ids) for g in got)) > 1  # the prompts lead to different outputs


def test_mixed_params_in_one_batch(eng):
    sps = [SamplingParams(max_tokens=30, stop=["R"], ignore_eos=True),
           SamplingParams(max_tokens=7, ignore_eos=True),
           SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
           SamplingParams(max_tokens=25, temperature=1.2, top_k=20, min_p=0.02, seed=3, stop=["% p", "zz"]),
           SamplingParams(max_tokens=20, temperature=0.7, repetition_penalty=1.3, presence_penalty=0.8,
                          frequency_penalty=0.5, seed=5, ignore_eos=True),
           SamplingParams(max_tokens=16, stop_token_ids=[48], ignore_eos=True)]
    prompts = TEXTS + [TEXTS[0] + "!"]
    want = [_alone(eng, p, sp) for p, sp in zip(prompts, sps)]
    got = eng.generate(prompts, sps)
    for g, w in zip(got, want):
        _same(g, w)
    assert got[1].finish_reason == "length" and len(got[1].token_ids) == 7
    assert [g.finish_reason for g in got] == ["stop", "length", "length", "stop", "length", "stop"]
    assert got[5].token_ids[-1] == 48 and "R" not in got[0].text and "% p" not in got[3].text


def test_seeded_sampling_alone_and_batched(eng):
    sp = SamplingParams(max_tokens=32, temperature=1.0, seed=1234, ignore_eos=True)
    want = _alone(eng, TEXTS[0], sp)
    batch = eng.generate([TEXTS[1], TEXTS[0], TEXTS[2], TEXTS[0]], sp)
    _same(batch[1], want)
    _same(batch[3], want)  # the same seed in two slots: the same stream
    other = eng.generate([TEXTS[0]], SamplingParams(max_tokens=32, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert other.token_ids != want.token_ids  # 32 draws at temperature 1: equal streams would mean the seed is ignored


def test_logprobs_are_log_softmax_of_the_logits(eng):
    sp = SamplingParams(max_tokens=10, temperature=0.8, seed=2, ignore_eos=True, logprobs=5)
    outs = eng.generate(TEXTS[:3], sp)
    for out in outs:
        assert len(out.logprobs) == len(out.token_ids)
        logits = eng.logits(out.prompt_token_ids + out.token_ids[:-1])[len(out.prompt_token_ids) - 1:]
        ls = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
        ls -= np.log(np.exp(ls).sum(axis=1, keepdims=True))
        for row, tok, lp in zip(ls, out.token_ids, out.logprobs):
            assert lp.token_id == tok
            assert lp.logprob == pytest.approx(row[tok], abs=1e-4)
            top = np.argsort(-row, kind="stable")[:5]
            assert [t for t, _ in lp.top] == top.tolist()
            np.testing.assert_allclose([v for _, v in lp.top], row[top], atol=1e-4)
    # the same tokens as without logprobs (the single path); 0 gives the chosen token's only
    _same(outs[0], _alone(eng, TEXTS[0], SamplingParams(max_tokens=10, temperature=0.8, seed=2, ignore_eos=True)))
    one = eng.generate(TEXTS[0], max_tokens=3, logprobs=0)
    assert [lp.top for lp in one.logprobs] == [[], [], []]
    assert eng.generate(TEXTS[0], max_tokens=3).logprobs is None


def test_stream_with_logprobs_goes_through_the_scheduler(eng):
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    want = _alone(eng, TEXTS[2], sp)
    pieces = list(eng.stream(TEXTS[2], sp, logprobs=1))
    assert "".join(pieces) == want.text
    assert eng.last_completion.token_ids == want.token_ids and len(eng.last_completion.logprobs) == 12


def test_chunked_prefill_and_a_small_batch_limit(eng):
    """A scheduler of 2 slots and 7-token chunks: the long prompt is prefilled over many steps while the
    others decode; every output is still what it is alone."""
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [_alone(eng, t, sp) for t in TEXTS]
    eng.scheduler.close()
    Scheduler(eng, max_batch=2, chunk_tokens=7)
    try:
        for g, w in zip(eng.generate(TEXTS, sp), want):
            _same(g, w)
    finally:
        eng.scheduler.close()  # the next use makes a default one again


def test_chat_of_a_list_of_conversations(eng):
    convs = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a GPU?"}]]
    got = eng.chat(convs, max_tokens=10, ignore_eos=True)
    for g, c in zip(got, convs):
        _same(g, _alone(eng, eng.apply_chat_template(c), SamplingParams(max_tokens=10, ignore_eos=True)))


def test_cancel_mid_batch_frees_its_pages_and_leaves_the_others_unchanged(eng):
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [_alone(eng, t, sp) for t in TEXTS[:3]]
    eng.scheduler.close()
    sched = Scheduler(eng)  # no driver thread: the steps run in this thread's next() and result(), so the cancel
    try:  # comes after exactly 2 of reqs[1]'s tokens, however slowly this thread runs
        reqs = [sched.submit(t, sp) for t in TEXTS[:3]]
        it = iter(reqs[1])
        next(it)
        next(it)
        reqs[1].cancel()
        rest = list(it)
        out = rest[-1].completion
        assert out.finish_reason == "cancelled" and len(out.token_ids) == 2
        assert out.token_ids == want[1].token_ids[:2]
        _same(reqs[0].result(), want[0])
        _same(reqs[2].result(), want[2])
    finally:
        sched.close()  # the next use makes a default one again


def test_abandoned_scheduled_stream_is_cancelled(eng, monkeypatch):
    sched = eng.scheduler
    # busy's first step, then none until s has joined: busy cannot end first, so s surely joins a busy scheduler
    go = hold_steps(sched, 1, monkeypatch=monkeypatch, until=lambda: len(sched._live) > 1)

    def single_path(*a):
        raise AssertionError("stream() took the single path while the scheduler had work")

    monkeypatch.setattr(eng, "_generate_single", single_path)
    try:
        busy = sched.submit(TEXTS[0], SamplingParams(max_tokens=60, ignore_eos=True))
        s = eng.stream(TEXTS[1], max_tokens=200, ignore_eos=True)  # the scheduler is busy: s joins its batch
        next(s)
        s.close()
    finally:
        go.set()  # (also on a failure: the module's engine goes on)
    assert busy.result().finish_reason == "length"
    assert eng.scheduler.wait_idle()


def test_stream_from_one_thread_while_a_batch_runs_in_another(eng, monkeypatch):
    """The batch's steps are held back until the stream has joined (so the scheduler surely has work when
    stream() starts): the stream must go through the scheduler, and every output is what it is alone."""
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    want_batch = [_alone(eng, t, sp) for t in TEXTS[:3]]
    want_stream = _alone(eng, TEXTS[3], sp)
    submitted, gate = threading.Event(), threading.Event()
    real_submit, real_step = Scheduler._submit_many, Scheduler.step

    def submit(self, *a):
        reqs = real_submit(self, *a)
        (gate if submitted.is_set() else submitted).set()
        return reqs

    def step(self):
        gate.wait()
        return real_step(self)

    def single_path(*a):
        raise AssertionError("stream() took the single path while the scheduler had work")

    monkeypatch.setattr(Scheduler, "_submit_many", submit)
    monkeypatch.setattr(Scheduler, "step", step)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("batch", eng.generate(TEXTS[:3], sp)))
    t.start()
    submitted.wait()
    assert not eng.scheduler.idle
    monkeypatch.setattr(eng, "_generate_single", single_path)
    text = "".join(eng.stream(TEXTS[3], sp))
    t.join()
    assert text == want_stream.text and eng.last_completion.token_ids == want_stream.token_ids
    for g, w in zip(got["batch"], want_batch):
        _same(g, w)


def test_concurrent_generate_calls_from_threads(eng):
    sps = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.5 * (i % 3), seed=i, ignore_eos=True)
           for i in range(6)]
    want = [_alone(eng, TEXTS[i % 5], sps[i]) for i in range(6)]
    got = [None] * 6
    barrier = threading.Barrier(6)

    def worker(i):
        barrier.wait()
        got[i] = eng.generate([TEXTS[i % 5]], sps[i])[0] if i % 2 else eng.generate(TEXTS[i % 5], sps[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        _same(g, w)


@pytest.mark.parametrize("sample_launch", [True, False])  # the launch ahead inside seq_sample_step, or seq_step
def test_keyboard_interrupt_inside_a_step_cancels_the_batch(eng, monkeypatch, sample_launch):
    monkeypatch.setattr(eng.scheduler, "sample_launch", sample_launch)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    want = [_alone(eng, t, sp) for t in TEXTS[:3]]
    real, real_sample_step = type(eng._core).seq_step, type(eng._core).seq_sample_step
    calls = {"n": 0}

    class Interrupting:
        def __init__(self, core):
            self._c = core

        def __getattr__(self, k):
            return getattr(self._c, k)

        def seq_step(self, *a):
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt
            return real(self._c, *a)

        def seq_sample_step(self, *a):  # (the launch ahead: a step inside the sampling call)
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt
            return real_sample_step(self._c, *a)

    core = eng._core
    monkeypatch.setattr(eng, "_core", Interrupting(core))
    with pytest.raises(KeyboardInterrupt):
        eng.generate(TEXTS[:3], sp)
    monkeypatch.setattr(eng, "_core", core)
    assert calls["n"] == 3
    eng.scheduler.reset_prefix_cache()
    assert eng.scheduler.idle and core.kv_pages_free == core.kv_pages_total
    for g, w in zip(eng.generate(TEXTS[:3], sp), want):
        _same(g, w)


def test_keyboard_interrupt_while_waiting_cancels_the_batch(eng, monkeypatch):
    sp = SamplingParams(max_tokens=300, ignore_eos=True)
    real = Request.result
    calls = {"n": 0}

    def interrupted_wait(self, timeout=None):
        calls["n"] += 1
        if calls["n"] == 1:  # as Ctrl-C in the waiting thread: the requests are still running
            next(iter(self))
            raise KeyboardInterrupt
        return real(self, timeout)

    monkeypatch.setattr(Request, "result", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(TEXTS[:3], sp)
    monkeypatch.setattr(Request, "result", real)
    assert eng.scheduler.idle  # the batch ended "cancelled" before generate() raised: no pages held
    _same(eng.generate([TEXTS[0]], max_tokens=5)[0], _alone(eng, TEXTS[0], SamplingParams(max_tokens=5)))


@pytest.mark.parametrize("call, msg", [
    (lambda e: e.generate([]), "empty prompt"),
    (lambda e: e.generate([[]]), "empty prompt"),
    (lambda e: e.generate(["a", ""]), "empty prompt"),
    (lambda e: e.generate(["a", [1, 2]], [SamplingParams()]), "1 SamplingParams for 2 prompts"),
    (lambda e: e.generate("a", [SamplingParams()]), "needs a list of prompts"),
    (lambda e: e.generate(["a", 5]), "only prompts"),
    (lambda e: e.generate(["a", "b"], "greedy"), "SamplingParams"),
    (lambda e: e.generate(["a", "b"], logprobs=21), "logprobs"),
    (lambda e: e.generate(["a"], logprobs=-1), "logprobs"),
    (lambda e: e.generate(["a"], logprobs=True), "logprobs"),
    (lambda e: e.generate(["a"], logprobs=2.0), "logprobs"),
    (lambda e: e.generate("a", logprobs=30), "logprobs"),
    (lambda e: e.generate(["a"], presence_penalty=2.5), "presence_penalty"),
    (lambda e: e.generate(["a"], frequency_penalty=float("nan")), "frequency_penalty"),
    (lambda e: e.generate(["a", "b" * 1000], max_tokens=100), "max_seq_len"),
    (lambda e: e.generate([[1, 2], [5000]]), "out of range"),
    (lambda e: e.chat([[{"role": "user", "content": "hi"}], [{"role": "nobody", "content": "x"}]]), "role"),
    (lambda e: list(e.stream(["a", "b"])), "one prompt"),
])
def test_bad_batch_input(eng, call, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        call(eng)
    assert eng.scheduler.waiting == 0  # refused before any of the batch was queued


def test_close_ends_requests_in_flight(tmp_path):
    d = make_chat_llama(tmp_path / "m")
    e = Engine(d, device="cpu", max_seq_len=256)
    sched = e.scheduler
    hold_steps(sched, 1, until=sched_cancels_pending(sched))  # it ends by the close, not by its length
    req = sched.submit("Hello", SamplingParams(max_tokens=200, ignore_eos=True))
    it = iter(req)
    next(it)
    e.close()
    assert [d.completion for d in it][-1].finish_reason == "cancelled"
    with pytest.raises(InvalidRequestError, match="closed"):
        e.generate(["a", "b"])
    with pytest.raises(InvalidRequestError, match="closed"):
        e.scheduler.submit("a")


@pytest.mark.gpu
def test_gpu_batch_through_the_scheduler(tmp_path):
    """On the GPU the batched step (small-N products) and the single path (tuned GEMV) may round differently:
    each sequence must pick the single path's tokens up to a near-tie of its logits; logprobs are
    log_softmax(Engine.logits) within fp16 rounding; the slots' pages all come back."""
    d = make_chat_llama(tmp_path / "m", hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, layers=2,
                        init_std=0.3, dtype="float16")
    with Engine(d, device="cuda", max_seq_len=1024) as e:
        free = e._core.kv_pages_free
        sp = SamplingParams(max_tokens=24, ignore_eos=True)
        prompts = TEXTS + [t[::-1] for t in TEXTS[:3]]
        got = e.generate(prompts, sp)
        e.scheduler.reset_prefix_cache()
        assert e.scheduler.idle and e._core.kv_pages_free == free
        for g in got:
            alone = e.generate(g.prompt_token_ids, sp).token_ids
            j = next((i for i in range(24) if g.token_ids[i] != alone[i]), 24)
            assert j == 24 or near_tie(e, g.prompt_token_ids + alone[:j]), (j, g.token_ids, alone)
        outs = e.generate(prompts[:3], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3))
        for o in outs:
            logits = e.logits(o.prompt_token_ids + o.token_ids[:-1])[len(o.prompt_token_ids) - 1:].astype(np.float64)
            ls = logits - logits.max(axis=1, keepdims=True)
            ls -= np.log(np.exp(ls).sum(axis=1, keepdims=True))
            for row, raw, lp in zip(ls, logits, o.logprobs):
                assert abs(lp.logprob - row[lp.token_id]) <= 3e-3 * np.abs(raw).max() + 1e-3
        e.scheduler.close()
        sched = Scheduler(e)  # no driver thread: the steps run in this thread's next() and result(), so reqs[2]
        try:  # is surely running when it is cancelled (a driver could end its 200 tokens first on a fast GPU)
            reqs = [sched.submit(p, SamplingParams(max_tokens=200, ignore_eos=True)) for p in prompts]
            next(iter(reqs[2]))
            reqs[2].cancel()
            assert reqs[2].result().finish_reason == "cancelled"
            assert all(r.result().finish_reason == "length" for i, r in enumerate(reqs) if i != 2)
        finally:
            sched.close()
        assert e._core.kv_pages_free == free
