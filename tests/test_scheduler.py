"""The scheduler's own logic (tinyinfer.scheduler): admission by slots and KV pages, the prefill chunk budget,
cancellation order, decode out of pages, a failing core call, the queue limit; Request iteration (blocking and
asyncio), threads submitting at once. The logic tests run on a tiny pure-Python fake of the core's slot API
(whose next token is a function of the slot's cache alone, so a request gives the same tokens alone and in any
batch) because the CPU engine never runs out of pages; the rest run on the real CPU engine."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import hold_steps, make_chat_llama, sched_cancels_pending
from tinyinfer import Engine, InvalidRequestError, KvCacheFullError, QueueFullError, SamplingParams, Scheduler
from tinyinfer.errors import TinyInferError


def _pages(n: int, page: int) -> int:
    return -(-n // page)


class FakeCore:
    """The slot API of docs/BATCH_CONTRACT.md part 2 in plain Python. Pages: a pool of `pages`, a slot holding
    ceil(length / page_size); a call that cannot get its pages raises and changes nothing. `log` records every
    call, one list per step (new_step() starts one)."""

    def __init__(self, max_batch=4, page_size=4, pages=64, vocab=50):
        self.max_batch, self.kv_page_size, self.kv_pages_total, self.vocab = max_batch, page_size, pages, vocab
        self.cache: dict[int, list[int]] = {}
        self.log: list[tuple] = []
        self.single = 0  # pages the single-sequence path holds (the GPU engine's share the pool) until reset()
        self.held = 0  # pages something else holds

    @property
    def kv_pages_free(self) -> int:
        used = sum(_pages(len(c), self.kv_page_size) for c in self.cache.values())
        return self.kv_pages_total - used - self.single - self.held

    @property
    def position(self) -> int:
        return self.single * self.kv_page_size

    def reset(self) -> None:
        self.single = 0
        self.log.append(("reset",))

    def _grow(self, slots_tokens: list[tuple[int, list[int]]]) -> None:
        need = sum(_pages(len(self.cache[s]) + len(t), self.kv_page_size) - _pages(len(self.cache[s]), self.kv_page_size)
                   for s, t in slots_tokens)
        if need > self.kv_pages_free:
            raise InvalidRequestError("out of KV pages")
        for s, t in slots_tokens:
            self.cache[s] += t

    def seq_open(self) -> int:
        free = sorted(set(range(self.max_batch)) - set(self.cache))
        if not free:
            raise InvalidRequestError("all slots taken")
        self.cache[free[0]] = []
        self.log.append(("open", free[0]))
        return free[0]

    def seq_close(self, slot: int) -> None:
        if slot not in self.cache:
            raise InvalidRequestError(f"slot {slot} is not open")
        del self.cache[slot]
        self.log.append(("close", slot))

    def seq_length(self, slot: int) -> int:
        return len(self.cache[slot])

    def seq_prefill(self, slot: int, tokens: list[int]) -> None:
        self._grow([(slot, list(tokens))])
        self.log.append(("prefill", slot, len(tokens)))

    def seq_prefill_many(self, slots: list[int], prompts: list[list[int]]) -> None:
        """All or nothing, as the engines: logged as the one call ("many", n) and its prefills."""
        if len(set(slots)) != len(slots) or len(slots) != len(prompts):
            raise InvalidRequestError("seq_prefill_many: bad slots")
        self._grow([(s, list(t)) for s, t in zip(slots, prompts)])
        self.log.append(("many", len(slots)))
        self.log += [("prefill", s, len(t)) for s, t in zip(slots, prompts)]

    def seq_step(self, slots: list[int], tokens: list[int]) -> None:
        self._grow([(s, [t]) for s, t in zip(slots, tokens)])
        self.log.append(("step", tuple(slots)))

    def seq_mixed(self, step_slots, step_tokens, slots, prompts) -> None:
        """seq_step + seq_prefill_many in one call, all or nothing: logged as ("mixed", rows, prompts) and the
        entries of the two calls."""
        if set(step_slots) & set(slots) or len(set(slots)) != len(slots) or len(slots) != len(prompts):
            raise InvalidRequestError("seq_mixed: bad slots")
        self._grow([(s, [t]) for s, t in zip(step_slots, step_tokens)] + [(s, list(t)) for s, t in zip(slots, prompts)])
        self.log += [("mixed", len(step_slots), len(slots)), ("step", tuple(step_slots)), ("many", len(slots))]
        self.log += [("prefill", s, len(t)) for s, t in zip(slots, prompts)]

    def seq_sample(self, slots, cfgs, steps, k):
        toks = np.array([(sum(self.cache[s]) * 7 + len(self.cache[s])) % self.vocab for s in slots], np.int32)
        self.log.append(("sample", tuple(slots)))
        n, top = len(slots), min(k, 3)  # as the engines do past a small vocabulary: -1 / -inf rows
        ids, lps = np.full((n, k), -1, np.int32), np.full((n, k), -np.inf, np.float32)
        ids[:, :top], lps[:, :top] = np.arange(top), -np.arange(1, top + 1)
        return toks, np.full(n, -1.0, np.float32), ids, lps

    def seq_sample_step(self, slots, cfgs, steps, k, go_on, stop_ids):
        """seq_sample, then seq_step of the rows that go on (docs/BATCH_CONTRACT.md part 2): logged as the two
        calls; a step refused with a TinyInferError leaves every row un-stepped."""
        toks, lps, ids, tlps = self.seq_sample(slots, cfgs, steps, k)
        rows = [i for i, t in enumerate(toks.tolist()) if go_on[i] and t not in stop_ids[i]]
        stepped = np.zeros(len(slots), np.uint8)
        if rows:
            try:
                self.seq_step([slots[i] for i in rows], [int(toks[i]) for i in rows])
                stepped[rows] = 1
            except TinyInferError:
                pass
        return toks, lps, ids, tlps, stepped, 0.0


class PlainCore(FakeCore):
    """A core without seq_sample_step: the scheduler launches ahead from Python after the sample."""

    @property
    def seq_sample_step(self):
        raise AttributeError("seq_sample_step")  # (hasattr(core, "seq_sample_step") is False)


# The core _fake makes: FakeCore (the launch ahead inside seq_sample_step) or PlainCore (from Python after the
# sample); every test of this module runs with both (the fixture below).
_CORE = {"class": FakeCore}


@pytest.fixture(autouse=True, params=["sample_step", "plain"])
def _core_kind(request):
    _CORE["class"] = FakeCore if request.param == "sample_step" else PlainCore
    yield
    _CORE["class"] = FakeCore


def _fake(**kw) -> tuple[FakeCore, Engine]:
    core = _CORE["class"](**kw)
    return core, _engine(core)


def _engine(core: FakeCore) -> Engine:
    """The real Engine (locking, prompt checks, batched calls) around a FakeCore."""
    return Engine.from_core(core, SimpleNamespace(vocab=core.vocab, eos_token_ids=[]), max_seq_len=512)


def _alone(prompt: list[int], max_tokens: int, **kw) -> list[int]:
    """What a request generates with the whole fake engine to itself."""
    core, eng = _fake(**kw)
    sched = Scheduler(eng)
    return sched.submit(prompt, SamplingParams(max_tokens=max_tokens)).result().token_ids


def _steps(sched: Scheduler, core: FakeCore) -> list[list[tuple]]:
    """Run steps until idle; the core calls of each."""
    out = []
    while True:
        core.log = []
        if not sched.step():
            return out
        out.append(core.log)


P = [list(range(1, 11)), list(range(20, 23)), list(range(30, 47))]


def _launched_after_last_sample(log: list[tuple], slot: int) -> bool:
    """Whether the last step that sampled `slot` launched a decode step for it afterwards."""
    last = max(i for i, c in enumerate(log) if c[0] == "sample" and slot in c[1])
    return any(c[0] == "step" and slot in c[1] for c in log[last + 1:])


def test_slots_bound_the_batch_and_a_free_slot_admits_the_next():
    core, eng = _fake(max_batch=2)
    sched = Scheduler(eng)
    reqs = [sched.submit(p, SamplingParams(max_tokens=m)) for p, m in zip(P, (3, 6, 4))]
    assert (sched.running, sched.waiting) == (0, 3)  # admitted at the next step, not at submission
    sched.step()
    assert (sched.running, sched.waiting) == (2, 1)
    steps = _steps(sched, core)
    opened = [i for i, calls in enumerate(steps) if ("open", 0) in calls or ("open", 1) in calls]
    ended = next(i for i, calls in enumerate(steps) if any(c[0] == "close" for c in calls))
    assert opened == [ended + 1]  # the third request got the first slot freed, at the next step
    for r, p, m in zip(reqs, P, (3, 6, 4)):
        assert r.result().token_ids == _alone(p, m)
    assert core.cache == {} and sched.idle


def test_a_request_waits_for_pages_and_nothing_is_evicted():
    # 9 pages of 4: `a` (10 tokens + 8 generated) holds 3 pages, then up to 5; `b`'s 25-token prompt needs 7
    # and waits until `a` ends; `c` behind it (1 page) waits too: first come, first served
    long = list(range(1, 26))
    core, eng = _fake(max_batch=4, pages=9)
    sched = Scheduler(eng)
    a = sched.submit(P[0], SamplingParams(max_tokens=8))
    sched.step()
    b = sched.submit(long, SamplingParams(max_tokens=3))
    c = sched.submit(P[1], SamplingParams(max_tokens=3))
    while not a.finished:
        sched.step()
        assert (sched.running, sched.waiting) == ((1, 2) if not a.finished else (0, 2))
    sched.step()
    assert (sched.running, sched.waiting) == (2, 0)
    sched.wait_idle()
    assert a.result().token_ids == _alone(P[0], 8)
    assert b.result().token_ids == _alone(long, 3)
    assert c.result().token_ids == _alone(P[1], 3)
    assert core.cache == {}


def test_prefill_chunks_share_the_budget_and_interleave_with_decode():
    core, eng = _fake(max_batch=4)
    sched = Scheduler(eng, chunk_tokens=6)
    first = sched.submit(P[1], SamplingParams(max_tokens=12))  # 3 tokens: running after the first step
    sched.step()
    long_a = sched.submit(P[2], SamplingParams(max_tokens=2))  # 17 tokens
    long_b = sched.submit(P[0], SamplingParams(max_tokens=2))  # 10 tokens
    steps = _steps(sched, core)
    for calls in steps:
        assert sum(c[2] for c in calls if c[0] == "prefill") <= 6
    chunks = [(c[1], c[2]) for calls in steps for c in calls if c[0] == "prefill"]
    # oldest first: long_a's 17 as 6 + 6 + 5, the last step's spare 1 token to long_b, then its remaining 9
    assert [n for _, n in chunks] == [6, 6, 5, 1, 6, 3]
    # while the prompts were prefilled, the running request got a token at every step
    for calls in steps[:4]:
        assert any(c[0] == "sample" and 0 in c[1] for c in calls)
    for r, p, m in ((first, P[1], 12), (long_a, P[2], 2), (long_b, P[0], 2)):
        assert r.result().token_ids == _alone(p, m)


def test_cancel_closes_the_slot_first_at_the_next_step_and_leaves_the_others_alone():
    core, eng = _fake(max_batch=4)
    sched = Scheduler(eng)
    reqs = [sched.submit(p, SamplingParams(max_tokens=10)) for p in P]
    sched.step()
    sched.step()
    slot = next(s for s, c in core.cache.items() if c[:len(P[1])] == P[1])
    assert _launched_after_last_sample(core.log, slot)  # (overlap: its next step is in flight)
    reqs[1].cancel()
    assert sched.running == 3  # the pages go at the next step...
    core.log = []
    sched.step()
    assert core.log[0] == ("close", slot)  # ...before anything else runs
    assert all(slot not in c[1] for c in core.log[1:] if c[0] in ("step", "sample"))
    sched.wait_idle()
    out = reqs[1].result()
    assert out.finish_reason == "cancelled"
    assert out.token_ids == _alone(P[1], 10)[:len(out.token_ids)] and len(out.token_ids) == 2
    for i in (0, 2):
        assert reqs[i].result().token_ids == _alone(P[i], 10)
    reqs[0].cancel()  # ended already: nothing happens
    assert core.cache == {}


def test_cancel_of_a_waiting_request_ends_it_at_once():
    core, eng = _fake(max_batch=1)
    sched = Scheduler(eng)
    a = sched.submit(P[0], SamplingParams(max_tokens=4))
    b = sched.submit(P[1], SamplingParams(max_tokens=4))
    sched.cancel(b.id)
    assert b.finished and sched.waiting == 1
    deltas = list(b)
    assert len(deltas) == 1 and deltas[0].completion.finish_reason == "cancelled"
    assert deltas[0].completion.token_ids == []
    assert a.result().token_ids == _alone(P[0], 4)
    assert [c for c in core.log if c[0] == "open"] == [("open", 0)]  # b never got a slot


def test_decode_out_of_pages_preempts_the_youngest_and_recomputes_it():
    """7 pages of 4 positions: two 7-token prompts hold 2 pages each; at 8 positions each takes a third, at 12 only
    one page is left: the younger request is preempted (its slot closed, back to the head of the queue), the older
    one goes on; when it ends, the younger prefills its prompt and its 6 tokens and samples on: the tokens it
    samples alone, and its client saw one stream."""
    core, eng = _fake(max_batch=2, pages=7)
    sched = Scheduler(eng)
    old = sched.submit(list(range(1, 8)), SamplingParams(max_tokens=14))
    young = sched.submit(list(range(11, 18)), SamplingParams(max_tokens=14))
    steps = _steps(sched, core)
    assert young.result().token_ids == _alone(list(range(11, 18)), 14)
    assert old.result().token_ids == _alone(list(range(1, 8)), 14)
    calls = [c for s in steps for c in s]
    closed = calls.index(("close", 1))  # the preemption: slot 1 closed after 6 tokens (12 positions)
    # its prompt and its 6 tokens (the 6th not yet run) in one prefill, once the older one's slot is free
    assert [c for c in calls[closed:] if c[0] == "prefill"] == [("prefill", 0, 7 + 6)]
    assert core.cache == {}
    m = sched.metrics()
    assert m["preemptions"] == 1 and m["requests"] == {"stop": 0, "length": 2, "cancelled": 0, "error": 0}
    assert m["generated_tokens"] == 28
    st = young.result().stats
    assert st.prompt_tokens == 7 and st.decode_tokens == 14 and st.prefill_ms >= 0


class CounterCore(FakeCore):
    """FakeCore whose samples depend on the step counter too (as the seeded sampler's do): a request resumed at a
    wrong counter samples other tokens."""

    def seq_sample(self, slots, cfgs, steps, k):
        toks, lps, ids, tlps = super().seq_sample(slots, cfgs, steps, k)
        return np.array([(int(t) + 13 * int(c)) % self.vocab for t, c in zip(toks, steps)], np.int32), lps, ids, tlps


class MarkingCore(CounterCore):
    """CounterCore with seq_mark_generated (the engines'), logged."""

    def seq_mark_generated(self, slot: int, tokens: list[int]) -> None:
        if slot not in self.cache:
            raise InvalidRequestError(f"slot {slot} is not open")
        self.log.append(("mark", slot, tuple(tokens)))


def test_a_preempted_request_with_penalties_has_its_answer_marked_as_generated():
    """Presence / frequency penalties count the generated tokens apart from the prompt's: a preempted request with
    them, prefilled again with its answer as prompt, has that answer marked as generated (seq_mark_generated) in
    its new slot before it samples on; without the penalties no mark is needed."""
    for params, marked in ((SamplingParams(max_tokens=14, presence_penalty=0.5), True),
                           (SamplingParams(max_tokens=14, frequency_penalty=0.5), True),
                           (SamplingParams(max_tokens=14), False)):
        core = MarkingCore(max_batch=2, pages=7)
        sched = Scheduler(Engine.from_core(core, SimpleNamespace(vocab=core.vocab, eos_token_ids=[]), max_seq_len=512))
        old = sched.submit(list(range(1, 8)), SamplingParams(max_tokens=14))
        young = sched.submit(list(range(11, 18)), params)
        sched.wait_idle()
        got = young.result().token_ids
        assert len(got) == 14 and sched.metrics()["preemptions"] == 1 and len(old.result().token_ids) == 14
        marks = [c for c in core.log if c[0] == "mark"]
        if marked:
            i = core.log.index(marks[0])
            assert marks == [("mark", 0, tuple(got[:6]))] and core.log[i + 1] == ("prefill", 0, 7 + 6)
        else:
            assert marks == []


def test_a_preempted_request_samples_on_at_its_counter_and_one_with_penalties_ends():
    """A preempted request resumes at its step counter: its tokens are those of a pool where nothing is preempted
    (CounterCore). On a core without seq_mark_generated a request with presence / frequency penalties (which count
    generated tokens apart from the prompt's) ends with KvCacheFullError instead (preempt=False: every one does)."""
    hot = SamplingParams(max_tokens=14, temperature=0.9, seed=5)
    for params, ends in ((hot, False), (SamplingParams(max_tokens=14, presence_penalty=0.5), True),
                         (SamplingParams(max_tokens=14, frequency_penalty=0.5), True)):
        got = {}
        for pages in (7, 64):
            core = CounterCore(max_batch=2, pages=pages)
            sched = Scheduler(Engine.from_core(core, SimpleNamespace(vocab=core.vocab, eos_token_ids=[]),
                                               max_seq_len=512))
            old = sched.submit(list(range(1, 8)), SamplingParams(max_tokens=14))
            young = sched.submit(list(range(11, 18)), params)
            sched.wait_idle()
            assert sched.metrics()["preemptions"] == (1 if pages == 7 and not ends else 0)
            if ends and pages == 7:
                with pytest.raises(KvCacheFullError, match="ran out of KV pages"):
                    young.result()
            else:
                got[pages] = young.result().token_ids
            got.setdefault(("old", pages), old.result().token_ids)
            assert core.cache == {}
        assert got[("old", 7)] == got[("old", 64)]
        if not ends:
            assert got[7] == got[64] and len(got[7]) == 14


def test_preempted_requests_do_not_fill_the_waiting_queue():
    """max_waiting bounds the requests not yet admitted; a preempted one waits for pages, and a new submit is not
    refused for it."""
    core, eng = _fake(max_batch=2, pages=7)
    sched = Scheduler(eng, max_waiting=2)
    old = sched.submit(list(range(1, 8)), SamplingParams(max_tokens=14))
    young = sched.submit(list(range(11, 18)), SamplingParams(max_tokens=14))
    while not sched.metrics()["preemptions"]:
        assert sched.step()
    assert sched.waiting == 1
    later = [sched.submit([5, 6, 7], SamplingParams(max_tokens=2)) for _ in range(2)]  # (2 more: max_waiting)
    with pytest.raises(QueueFullError, match="2 requests already wait"):
        sched.submit([5, 6, 7], SamplingParams(max_tokens=2))
    sched.wait_idle()
    assert [len(r.result().token_ids) for r in (old, young, *later)] == [14, 14, 2, 2]


def test_a_cancel_that_lands_while_its_request_is_preempted_is_kept():
    """A cancel arriving during the step that preempts its request (the request back in the queue, the cancel for
    the next step) ends it as cancelled, with the tokens it generated; it is not re-admitted."""
    core, eng = _fake(max_batch=2, pages=7)
    sched = Scheduler(eng)
    old = sched.submit(list(range(1, 8)), SamplingParams(max_tokens=14))
    young = sched.submit(list(range(11, 18)), SamplingParams(max_tokens=14))
    real = core.seq_close

    def close(slot):
        real(slot)
        if slot == 1 and not young.finished:
            sched.cancel(young.id)  # (the client gave up during the pause)
    core.seq_close = close
    sched.wait_idle()
    assert old.result().finish_reason == "length"
    got = young.result()
    assert got.finish_reason == "cancelled" and got.token_ids == _alone(list(range(11, 18)), 14)[:6]
    assert core.cache == {} and sched.metrics()["requests"]["cancelled"] == 1


def test_decode_out_of_pages_ends_the_youngest_with_kv_cache_full():
    # preempt=False. 7 pages of 4 positions: two 7-token prompts hold 2 pages each; at 8 positions each takes a
    # third, at 12 only one page is left: the younger request ends there (6 tokens generated), the older one goes on
    core, eng = _fake(max_batch=2, pages=7)
    sched = Scheduler(eng, preempt=False)
    old = sched.submit(list(range(1, 8)), SamplingParams(max_tokens=14))
    young = sched.submit(list(range(11, 18)), SamplingParams(max_tokens=14))
    sched.wait_idle()
    with pytest.raises(KvCacheFullError, match="ran out of KV pages") as e:
        young.result()
    part = e.value.completion
    assert part.finish_reason == "length" and len(part.token_ids) == 6
    assert part.token_ids == _alone(list(range(11, 18)), 14)[:len(part.token_ids)]
    assert old.result().token_ids == _alone(list(range(1, 8)), 14)
    items = []
    with pytest.raises(KvCacheFullError):
        for d in young:  # iteration gives the Deltas it produced, then the error
            items.append(d)
    assert [t for d in items for t in d.token_ids] == part.token_ids
    assert core.cache == {}
    # out of pages is a "length" end (as its client is told), counted once; the tokens of both requests
    m = sched.metrics()
    assert m["requests"] == {"stop": 0, "length": 2, "cancelled": 0, "error": 0}
    assert m["generated_tokens"] == 14 + len(part.token_ids)


def test_a_prompt_in_prefill_goes_back_to_the_queue_when_decode_needs_its_pages():
    # 7 pages of 4: `a` (6 tokens, 2 pages) decodes; `b` (14 tokens: 4 pages, owed as it prefills 2 tokens a
    # step) is admitted into the last 5 - 1; when `a` opens its third page, b is put back (nothing shown yet)
    core, eng = _fake(max_batch=2, pages=7)
    sched = Scheduler(eng, chunk_tokens=2)
    a = sched.submit(list(range(1, 7)), SamplingParams(max_tokens=12))
    sched.step()
    b = sched.submit(list(range(20, 34)), SamplingParams(max_tokens=2))
    sched.wait_idle()
    assert a.result().token_ids == _alone(list(range(1, 7)), 12)
    assert b.result().token_ids == _alone(list(range(20, 34)), 2)
    # a opened; b opened, put back (closed) while a decodes; a ends; b admitted again
    assert [c[0] for c in core.log if c[0] in ("open", "close")] == ["open", "open", "close", "close", "open", "close"]
    assert core.cache == {}
    assert sched.metrics()["requests"]["length"] == 2  # (b's trip back to the queue is not an end)


@pytest.mark.parametrize("overlap", [True, False])  # interrupted in the launch ahead / in step 3's seq_step
def test_a_failing_core_call_fails_its_requests_only(overlap):
    core, eng = _fake(max_batch=4)
    sched = Scheduler(eng, chunk_tokens=4, overlap=overlap, mixed_steps=False)  # (mixed: test_mixed_step.py)
    a = sched.submit(P[1], SamplingParams(max_tokens=6))
    sched.step()
    b = sched.submit(P[2], SamplingParams(max_tokens=3))  # in prefill, 4 tokens a step
    real = core.seq_step

    def interrupted(*args):
        raise KeyboardInterrupt

    core.seq_step = interrupted
    with pytest.raises(KeyboardInterrupt):
        sched.step()
    core.seq_step = real
    with pytest.raises(KeyboardInterrupt):
        a.result()
    assert sched.running == 1  # b, whose state no failed call touched
    sched.wait_idle()
    assert b.result().token_ids == _alone(P[2], 3)
    assert core.cache == {}
    assert sched.metrics()["requests"] == {"stop": 0, "length": 1, "cancelled": 0, "error": 1}


def test_queue_limit_ids_and_arguments():
    core, eng = _fake(max_batch=1)
    sched = Scheduler(eng, max_waiting=2)
    sched.submit(P[0], SamplingParams(max_tokens=2), request_id="x")
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.submit(P[0], SamplingParams(max_tokens=2), request_id="x")
    sched.submit(P[1], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        sched.submit(P[2], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already has a scheduler"):
        Scheduler(eng)
    for bad, msg in ((dict(max_batch=0), "max_batch must be an integer >= 1 \\(got 0\\)"),
                     (dict(max_batch=5), "max_batch=5 exceeds the engine's 4 slots"),
                     (dict(chunk_tokens=0), "chunk_tokens must be an integer >= 1 \\(got 0\\)"),
                     (dict(max_waiting=-1), "max_waiting must be an integer >= 0 \\(got -1\\)"),
                     (dict(chunk_tokens=1.5), "chunk_tokens must be an integer >= 1 \\(got 1.5\\)")):
        with pytest.raises(InvalidRequestError, match=msg):
            Scheduler(_engine(FakeCore(max_batch=4)), **bad)
    for prompt, params, msg in (([], None, "empty prompt"), ([1] * 500, SamplingParams(max_tokens=20), "max_seq_len"),
                                ([1], "greedy", "SamplingParams"), ([99], None, "out of range")):
        with pytest.raises(InvalidRequestError, match=msg):
            sched.submit(prompt, params)
    with pytest.raises(InvalidRequestError, match="KV pages"):  # can never be admitted: refused at once
        Scheduler(_engine(FakeCore(pages=2))).submit(list(range(1, 10)), None)
    sched.close()
    with pytest.raises(InvalidRequestError, match="closed"):
        sched.submit(P[0], None)
    assert core.cache == {}


def test_pages_of_the_single_path_are_taken_back_and_a_hopeless_request_fails():
    core, eng = _fake(max_batch=2, pages=8)
    core.single = 6  # a finished single-path generation still holds its cache
    sched = Scheduler(eng)
    a = sched.submit(list(range(1, 20)), SamplingParams(max_tokens=2))  # 5 pages
    assert a.result().token_ids == _alone(list(range(1, 20)), 2)
    assert ("reset",) in core.log and core.single == 0
    core.held = 5  # pages no step will ever free
    b = sched.submit(list(range(1, 20)), SamplingParams(max_tokens=2))
    with pytest.raises(KvCacheFullError, match="needs 5 KV pages and only 3 are free with nothing running"):
        b.result()
    assert core.cache == {} and sched.idle


def test_logprobs_rows_take_the_requests_count_and_drop_padding():
    core, eng = _fake()
    sched = Scheduler(eng)
    a = sched.submit(P[0], SamplingParams(max_tokens=2, logprobs=5))
    b = sched.submit(P[1], SamplingParams(max_tokens=2, logprobs=1))
    c = sched.submit(P[2], SamplingParams(max_tokens=2))
    sched.wait_idle()
    assert [lp.top for lp in a.result().logprobs] == [[(0, -1.0), (1, -2.0), (2, -3.0)]] * 2
    assert [lp.top for lp in b.result().logprobs] == [[(0, -1.0)]] * 2
    assert c.result().logprobs is None


def test_close_cancels_everything_in_flight():
    core, eng = _fake(max_batch=1)
    sched = Scheduler(eng)
    a = sched.submit(P[0], SamplingParams(max_tokens=50))
    b = sched.submit(P[1], SamplingParams(max_tokens=50))
    sched.step()
    sched.close()
    assert a.result().finish_reason == "cancelled" and b.result().finish_reason == "cancelled"
    assert core.cache == {}


# ---- overlap: the next decode step launched before a step's per-token work ----


class LetterTokenizer:
    """Token t is the letter 'a' + t % 26: the fake engine's tokens make text (for stop strings)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t % 26) for t in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - 97 for c in text]


def _run(prompts, sps, overlap: bool, tokenizer=None, **kw):
    """Every request submitted at once, steps until idle: (completions, the core's log, the core)."""
    core = _CORE["class"](**kw)
    eng = Engine.from_core(core, SimpleNamespace(vocab=core.vocab, eos_token_ids=[]), max_seq_len=512,
                           tokenizer=tokenizer)
    sched = Scheduler(eng, overlap=overlap)
    reqs = [sched.submit(p, sp) for p, sp in zip(prompts, sps)]
    sched.wait_idle()
    return [r.result() for r in reqs], core.log, core


def test_overlap_launches_the_next_step_before_the_tokens_are_taken():
    outs, log, core = _run(P, [SamplingParams(max_tokens=6)] * 3, overlap=True)
    # after the first sample, every sample is followed by the launch of the next step of those going on
    samples = [i for i, c in enumerate(log) if c[0] == "sample"]
    for i in samples[:-1]:
        assert log[i + 1][0] == "step" and log[i + 1][1] == log[i][1]
    assert not any(c[0] == "step" for c in log[samples[-1] + 1:])  # max_tokens reached: nothing launched
    assert [o.token_ids for o in outs] == [_alone(p, 6) for p in P]
    assert core.cache == {}
    off = _run(P, [SamplingParams(max_tokens=6)] * 3, overlap=False)[1]
    assert sum(c[0] == "step" for c in log) == sum(c[0] == "step" for c in off)  # no step more or less


@pytest.mark.parametrize("overlap", [True, False])
def test_max_tokens_reached_exactly_and_stop_ids(overlap):
    # a request of max_tokens m runs m - 1 decode steps (its first token comes from its prompt's logits); one
    # whose token is a stop id gets no step after it
    alone = _alone(P[0], 12)
    stop = alone[4]
    sps = [SamplingParams(max_tokens=m) for m in (1, 2, 5)] + [SamplingParams(max_tokens=12, stop_token_ids=[stop])]
    outs, log, core = _run([P[0], P[1], P[2], P[0]], sps, overlap=overlap, max_batch=4)
    assert [len(o.token_ids) for o in outs[:3]] == [1, 2, 5]
    assert outs[3].token_ids == alone[:alone.index(stop) + 1] and outs[3].finish_reason == "stop"
    assert outs[3].stop_reason == stop and [o.stop_reason for o in outs[:3]] == [None] * 3
    slots = {}
    for c in log:
        if c[0] == "open":
            slots.setdefault(len(slots), c[1])
    steps = [sum(c[0] == "step" and slots[i] in c[1] for c in log) for i in range(4)]
    assert steps == [0, 1, 4, alone.index(stop)]
    assert core.cache == {}


def test_a_stop_string_ends_a_request_whose_next_step_is_launched():
    tok = LetterTokenizer()
    text = tok.decode(_alone(P[2], 20))
    stop = text[7:9]  # found only once the 9th token is taken: its next step is launched by then
    assert stop not in text[:8]
    sps = [SamplingParams(max_tokens=20, stop=[stop]), SamplingParams(max_tokens=20)]
    on, log, core = _run([P[2], P[0]], sps, overlap=True, tokenizer=tok)
    off = _run([P[2], P[0]], sps, overlap=False, tokenizer=tok)[0]
    assert [(o.text, o.token_ids, o.finish_reason) for o in on] == [(o.text, o.token_ids, o.finish_reason) for o in off]
    assert on[0].finish_reason == "stop" and on[0].text == text[:text.index(stop)] and on[0].stop_reason == stop
    slot = next(c[1] for c in log if c[0] == "open")
    closed = log.index(("close", slot))
    assert _launched_after_last_sample(log[:closed], slot)  # its step ran; nothing was sampled from it
    assert not any(c[0] == "sample" and slot in c[1] for c in log[closed:])
    assert core.cache == {} and core.kv_pages_free == core.kv_pages_total


def test_requests_join_while_others_are_stepped_ahead():
    """Without mixed steps (with them the prompts ride in the steps instead: test_mixed_step.py)."""
    core, eng = _fake(max_batch=4, pages=40)
    sched = Scheduler(eng, chunk_tokens=5, mixed_steps=False)
    first = sched.submit(P[1], SamplingParams(max_tokens=14))
    sched.step()
    sched.step()
    later = [sched.submit(p, SamplingParams(max_tokens=m)) for p, m in ((P[2], 6), (P[0], 9))]
    steps = _steps(sched, core)
    # the prompts were prefilled (5 tokens a step) while `first` went on stepped ahead: no step waited for them
    for calls in steps[:5]:
        assert [c[0] for c in calls if c[0] in ("step", "sample")][-2:] == ["sample", "step"]
    assert max(sum(c[0] == "step" for c in calls) for calls in steps) == 1  # one launch a step, never two
    for r, p, m in ((first, P[1], 14), (later[0], P[2], 6), (later[1], P[0], 9)):
        assert r.result().token_ids == _alone(p, m)
    assert core.cache == {}


def test_no_launch_ahead_without_pages_and_a_failed_launch_falls_back():
    # 7 pages of 4 (as test_decode_out_of_pages...; preempt=False): at 12 positions both need a 4th page and one is
    # free, so nothing is launched early and step 3 ends the younger one; a launch refused by the core (here a
    # TinyInferError once) launches nothing and the next step runs it the usual way
    core, eng = _fake(max_batch=2, pages=7)
    sched = Scheduler(eng, preempt=False)
    real, refused = core.seq_step, []

    def once(slots, tokens):
        if not refused:
            refused.append(tuple(slots))
            raise InvalidRequestError("refused")
        real(slots, tokens)

    core.seq_step = once
    old = sched.submit(list(range(1, 8)), SamplingParams(max_tokens=14))
    young = sched.submit(list(range(11, 18)), SamplingParams(max_tokens=14))
    steps = _steps(sched, core)
    assert refused and steps[1][0][0] == "step"  # refused after the first sample: the usual launch next step
    short = [i for i, calls in enumerate(steps) if i and calls[-1][0] == "sample"]  # sampled, nothing launched
    assert short and steps[short[0] + 1][:2] == [("close", 1), ("step", (0,))]  # the younger ends, the older steps
    with pytest.raises(KvCacheFullError):
        young.result()
    assert old.result().token_ids == _alone(list(range(1, 8)), 14)
    assert core.cache == {}


def test_warm_up_runs_every_prefill_and_batch_bucket_and_leaves_nothing_behind():
    """Scheduler.warm_up (tinyinfer serve calls it on the GPU): one prompt per token bucket 16, 32, ... up to
    prompt_tokens, then a prefill + step of every batch bucket up to max_batch (a last bucket that is not a power of
    two included) and a mixed call of each from 2 (the LM-head GEMM over that many rows), each in slots it
    closes again; afterwards a request runs as it would have."""
    core, eng = _fake(max_batch=3, pages=64)
    sched = Scheduler(eng, mixed_steps=True)
    sched.warm_up(prompt_tokens=100)  # (it returns the seconds it took: timing, not asserted)
    assert [e[2] for e in core.log if e[0] == "prefill" and e[2] > 1] == [16, 32, 64]
    assert [len(e[1]) for e in core.log if e[0] == "step"] == [1, 2, 1, 3, 2]  # (a mixed call logs a step)
    assert [e for e in core.log if e[0] == "mixed"] == [("mixed", 1, 1), ("mixed", 2, 1)]
    assert core.cache == {} and core.kv_pages_free == core.kv_pages_total
    assert sched.submit([1, 2, 3], SamplingParams(max_tokens=6)).result().token_ids == _alone([1, 2, 3], 6,
                                                                                            max_batch=3)
    core2, eng2 = _fake(max_batch=3, pages=5)  # a small pool: only what fits (prompts of 16, batches of 3)
    Scheduler(eng2).warm_up(prompt_tokens=64)
    assert [e[2] for e in core2.log if e[0] == "prefill" and e[2] > 1] == [16]
    assert core2.cache == {} and core2.kv_pages_free == core2.kv_pages_total
    req = sched.submit([1, 2, 3, 4, 5], SamplingParams(max_tokens=3))  # waiting: warm_up refuses
    with pytest.raises(InvalidRequestError, match="requests are running"):
        sched.warm_up()
    req.cancel()
    sched.wait_idle()


def test_warm_up_on_the_real_engine(eng):
    """On the CPU engine it only computes (nothing to tune or capture): the pool is as before and results are."""
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    before = _alone_real(eng, TEXTS[2], sp)
    eng.scheduler.warm_up(prompt_tokens=40, max_batch=3)
    assert eng._core.kv_pages_free == eng._core.kv_pages_total
    assert eng.scheduler.submit(TEXTS[2], sp).result().token_ids == before.token_ids


def test_overlap_must_be_a_bool():
    with pytest.raises(InvalidRequestError, match="overlap must be a bool"):
        Scheduler(_engine(FakeCore()), overlap=1)


# ---- the real CPU engine ----


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = make_chat_llama(tmp_path_factory.mktemp("sched") / "m", init_std=0.3)
    with Engine(d, device="cpu", max_seq_len=512, threads=2) as e:
        yield e


@pytest.fixture(autouse=True)
def pool_empty_after(request):
    yield
    if "eng" in request.fixturenames:
        e = request.getfixturevalue("eng")
        assert e.scheduler.idle
        assert e._core.kv_pages_free + e.scheduler.kv_pages_cached == e._core.kv_pages_total
        e.scheduler.reset_prefix_cache()  # (the ended requests' kept caches: all that may still hold pages)
        assert e._core.kv_pages_free == e._core.kv_pages_total


TEXTS = ["Once upon a time", "The", "GPUs are fast because they have many cores and wide memory.", "abc abc abc"]


def _alone_real(eng, prompt, sp):
    return eng.generate(prompt, sp)  # the single-sequence path (the scheduler idle)


def test_deltas_add_up_to_the_completion(eng):
    sp = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)
    req = eng.scheduler.submit(TEXTS[0], sp)
    deltas = list(req)
    out = deltas[-1].completion
    assert all(d.completion is None for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == out.text
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    assert [lp for d in deltas for lp in d.logprobs] == out.logprobs
    assert req.result() is out
    alone = _alone_real(eng, TEXTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    assert (out.text, out.token_ids, out.finish_reason) == (alone.text, alone.token_ids, alone.finish_reason)


def test_async_iteration(eng):
    sps = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 12, 9, 16)]
    want = [_alone_real(eng, t, sp) for t, sp in zip(TEXTS, sps)]

    async def one(t, sp):
        req = eng.scheduler.submit(t, sp)
        text = ""
        async for d in req:
            text += d.text
        return text, req.result().token_ids

    async def main():
        return await asyncio.gather(*(one(t, sp) for t, sp in zip(TEXTS, sps)))

    got = asyncio.run(main())
    assert got == [(w.text, w.token_ids) for w in want]


def test_threads_submitting_at_once(eng):
    prompts = [TEXTS[i % 4] + str(i) for i in range(12)]
    sps = [SamplingParams(max_tokens=6 + i, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True)
           for i in range(12)]
    want = [_alone_real(eng, p, sp).token_ids for p, sp in zip(prompts, sps)]
    got = [None] * 12
    start = threading.Barrier(12)

    def worker(i):
        start.wait()
        got[i] = eng.scheduler.submit(prompts[i], sps[i]).result().token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_result_timeout_and_cancel_from_another_thread(eng, monkeypatch):
    sched = eng.scheduler
    hold_steps(sched, 1, until=sched_cancels_pending(sched), monkeypatch=monkeypatch)  # running until the cancel
    req = sched.submit(TEXTS[1], SamplingParams(max_tokens=400, ignore_eos=True))
    it = iter(req)
    next(it)  # running
    assert sched.running == 1 and 0 < sched.kv_pages_used < sched.kv_pages_total == eng._core.kv_pages_total
    with pytest.raises(TimeoutError):
        req.result(timeout=0)
    threading.Thread(target=req.cancel).start()
    out = req.result(timeout=600)
    assert out.finish_reason == "cancelled" and 1 <= len(out.token_ids) <= 2  # (1 step, then 1 for the cancel)
    assert [d.completion for d in it][-1] is out
    assert sched.kv_pages_used == 0


@pytest.mark.parametrize("logprobs", [None, 3])
def test_overlap_on_and_off_give_the_same_tokens(eng, logprobs):
    prompts = [TEXTS[i % 4] + str(i) for i in range(10)]
    sps = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.9 if i % 2 else 0.0, seed=100 + i, ignore_eos=i < 5,
                          stop=[" "] if i % 3 == 0 else [], logprobs=logprobs) for i in range(10)]
    got = {}
    for overlap in (True, False):
        eng.scheduler.close()
        sched = Scheduler(eng, overlap=overlap)
        sched.start()
        reqs = [sched.submit(p, sp) for p, sp in zip(prompts, sps)]
        got[overlap] = [(o.text, o.token_ids, o.finish_reason, o.logprobs)
                        for o in (r.result(timeout=600) for r in reqs)]
        sched.close()
    assert got[True] == got[False]
    assert {f for _, _, f, _ in got[True]} == {"stop", "length"}  # stop strings found after launches ahead
    for (text, ids, finish, _), p, sp in zip(got[True], prompts, sps):
        if sp.temperature == 0.0 and logprobs is None:  # greedy: what the single path gives
            alone = _alone_real(eng, p, sp)
            assert (text, ids, finish) == (alone.text, alone.token_ids, alone.finish_reason)


def test_warm_up_token_buckets_follow_the_gemm_buckets():
    """The prompt lengths warm_up prefills: cuda::Gemm::bucket's values (powers of two from 16, and past 128 the
    half octaves between them), up to the limit."""
    from tinyinfer.scheduler import _token_buckets

    assert list(_token_buckets(100)) == [16, 32, 64]
    assert list(_token_buckets(800)) == [16, 32, 64, 128, 192, 256, 384, 512, 768]
    assert list(_token_buckets(2048)) == [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]


def test_warm_up_covers_the_half_octave_batch_sizes_past_128():
    """Past 128 rows the GEMM buckets fall between the batch buckets (192 between 128 and 256): warm_up prefills and
    steps those counts too, so the LM-head GEMM over that many finished prompts is tuned before serving."""
    core, eng = _fake(max_batch=200, pages=512)
    Scheduler(eng).warm_up(prompt_tokens=16)
    assert [len(e[1]) for e in core.log if e[0] == "step"] == [1, 2, 4, 8, 16, 32, 64, 128, 192, 200]
    assert core.cache == {} and core.kv_pages_free == core.kv_pages_total


def test_totals_histograms_put_each_value_in_its_bucket():
    """totals.py's histograms (GET /metrics): a value goes in the first bucket whose upper bound is >= it."""
    from tinyinfer.totals import Histogram, Totals

    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(v)
    assert h.snapshot() == {"bounds": [0.1, 1.0], "counts": [2, 2, 1], "sum": 8.65}
    t = Totals()
    t.add("stop", 10, 4, 3, 0.02, 0.5)
    t.add("error", 7, 0, 0, None, 0.01)
    snap = t.snapshot()
    assert snap["requests"] == {"stop": 1, "length": 0, "cancelled": 0, "error": 1}
    assert (snap["prompt_tokens"], snap["cached_tokens"], snap["generated_tokens"]) == (17, 4, 3)
    assert sum(snap["time_to_first_token"]["counts"]) == 1 and sum(snap["request_time"]["counts"]) == 2


def test_metrics_count_each_end_once():
    """Scheduler.metrics(): ended requests by finish reason (a cancel while queued included), their tokens."""
    core, eng = _fake(max_batch=1)
    sched = Scheduler(eng)
    a = sched.submit([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    b = sched.submit([4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    b.cancel()  # (still queued behind a: one slot)
    sched.wait_idle()
    m = sched.metrics()
    assert a.result().finish_reason == "length" and b.result().finish_reason == "cancelled"
    assert m["requests"] == {"stop": 0, "length": 1, "cancelled": 1, "error": 0}
    assert (m["prompt_tokens"], m["generated_tokens"]) == (5, 4)
    assert sum(m["time_to_first_token"]["counts"]) == 1 and sum(m["request_time"]["counts"]) == 2
    assert {"running", "waiting", "kv_pages_used", "kv_pages_total"} <= set(m)


def test_a_request_ends_once():
    """Two threads failing the same live requests (_fail_all from two step() callers of a closed engine) end each
    once: one error to its consumer, one count, its slot closed once."""
    core, eng = _fake(max_batch=2)
    sched = Scheduler(eng)
    r = sched.submit([1, 2, 3], SamplingParams(max_tokens=50))
    sched.step()
    seq = sched._live[r.id]
    err = InvalidRequestError("the engine went away")
    with eng._exclusive():
        sched._end(core, seq, "error", error=err)
        sched._end(core, seq, "error", error=err)
    assert sched.metrics()["requests"]["error"] == 1 and [c for c in core.log if c[0] == "close"] == [("close", 0)]
    with pytest.raises(InvalidRequestError, match="went away"):
        r.result()
    items = []
    while not r._items.empty():
        items.append(r._items.get_nowait())
    assert items.count(err) == 1
