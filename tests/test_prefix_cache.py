"""The scheduler's prefix cache (scheduler.py, "Prefix cache"): an ended request's slot is kept with the tokens its
cache holds, and a later prompt that starts with some of them is admitted into it, rewound to the common prefix
(seq_rewind), and prefilled from there. On the CPU engine its tokens, logprobs and penalties are bit for bit those
of a scheduler without the cache; kept slots give their slots and pages back before anything else is done for want
of them; the choice between kept slots and a fresh one; off when asked."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from conftest import make_chat_llama, near_tie
from test_cpu_batch import MAX_SEQ, VOCAB, _store
from test_scheduler import FakeCore
from tinyinfer import _core
from tinyinfer.engine import Engine
from tinyinfer.errors import InvalidRequestError
from tinyinfer.sampling import SamplingParams
from tinyinfer.scheduler import Scheduler, _common_prefix


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(100 + seed).integers(0, VOCAB, n)]


@pytest.fixture(scope="module")
def store():
    return _store("fp32")


def _sched(store, max_batch: int = 8, **kw) -> Scheduler:
    core = _core.CpuEngine(store, MAX_SEQ, 2, max_batch)
    return Scheduler(Engine.from_core(core, SimpleNamespace(vocab=VOCAB, eos_token_ids=[]), max_seq_len=MAX_SEQ),
                     **kw)


def _run(sched: Scheduler, prompts, sps) -> list:
    reqs = [sched.submit(p, sp) for p, sp in zip(prompts, sps)]
    sched.wait_idle()
    return [r.result() for r in reqs]


def _same(got, want) -> None:
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    if want.logprobs is not None:
        assert [(g.token_id, g.logprob, g.top) for g in got.logprobs] == \
               [(w.token_id, w.logprob, w.top) for w in want.logprobs]


def test_common_prefix_against_a_plain_loop():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        a = rng.integers(0, 3, int(rng.integers(0, 700))).tolist()
        b = a[:int(rng.integers(0, len(a) + 1))] + rng.integers(0, 3, int(rng.integers(0, 700))).tolist()
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert _common_prefix(a, b) == _common_prefix(b, a) == _common_prefix(a, b, chunk=3) == want


HOT = SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.9, top_k=40, seed=5, repetition_penalty=1.3,
                     presence_penalty=0.7, frequency_penalty=0.4, logprobs=2)


@pytest.mark.parametrize("sp", [SamplingParams(max_tokens=9, ignore_eos=True, logprobs=2), HOT],
                         ids=["greedy", "penalties"])
@pytest.mark.parametrize("overlap, mixed", [(True, True), (True, False), (False, False)])
def test_next_turns_reuse_their_own_slots_and_equal_a_fresh_prefill(store, sp, overlap, mixed):
    """Three conversations, then their next turns all at once (each extends its own prompt and answer): each is
    admitted into its own kept slot, prefills only its new tokens, and samples what it samples without the cache
    (penalties too: its history restarts as the prefix, as prompt, so the earlier answer is not counted as
    generated)."""
    firsts = [_ids(i, n) for i, n in enumerate((5, 40, 70))]
    sched = _sched(store, overlap=overlap, mixed_steps=mixed)
    ref = _sched(store, overlap=overlap, mixed_steps=mixed, prefix_cache=0)
    a = _run(sched, firsts, [sp] * 3)
    for g, w in zip(a, _run(ref, firsts, [sp] * 3)):
        _same(g, w)
    assert sched.stats()["cached_sequences"] == 3 and sched.stats()["kv_pages_used"] == 0
    assert ref.stats()["cached_sequences"] == 0 and ref._engine._core.kv_pages_free == ref.kv_pages_total
    turns = [p + c.token_ids + _ids(10 + i, 6) for i, (p, c) in enumerate(zip(firsts, a))]
    got = _run(sched, turns, [sp] * 3)
    for g, w, p in zip(got, _run(ref, turns, [sp] * 3), firsts):
        _same(g, w)
        assert g.stats.cached_tokens == len(p) + sp.max_tokens - 1  # (its last token was sampled, never run)
        assert w.stats.cached_tokens == 0
    sched.reset_prefix_cache()
    assert sched.stats()["cached_sequences"] == 0 and sched._engine._core.kv_pages_free == sched.kv_pages_total


def test_the_same_prompt_again_prefills_its_last_token_only(store):
    sched = _sched(store)
    sp = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1)
    p = _ids(1, 30)
    first, again = _run(sched, [p], [sp]), _run(sched, [p], [sp])
    _same(again[0], first[0])
    assert (first[0].stats.cached_tokens, again[0].stats.cached_tokens) == (0, 29)


def test_a_stopped_or_cancelled_request_leaves_what_ran(store):
    """A stop id ends a request before its token runs; a cancel at any point: the cache holds what ran, and a
    prompt that extends the request's visible tokens reuses it (the CPU engine checks the rewound tokens)."""
    sched = _sched(store)
    ref = _sched(store, prefix_cache=0)
    p = _ids(2, 20)
    free_run = _run(sched, [p], [SamplingParams(max_tokens=8, ignore_eos=True)])[0]
    stop = SamplingParams(max_tokens=8, stop_token_ids=[free_run.token_ids[4]])
    first = _run(sched, [p], [stop])[0]
    assert first.finish_reason == "stop" and first.token_ids[-1] == free_run.token_ids[4]
    nxt = p + first.token_ids + _ids(3, 4)
    got = _run(sched, [nxt], [SamplingParams(max_tokens=4, ignore_eos=True)])[0]
    _same(got, _run(ref, [nxt], [SamplingParams(max_tokens=4, ignore_eos=True)])[0])
    assert got.stats.cached_tokens == len(p) + len(first.token_ids) - 1
    req = sched.submit(_ids(4, 12), SamplingParams(max_tokens=100, ignore_eos=True))
    it = iter(req)
    next(it)
    req.cancel()
    cancelled = req.result()
    assert cancelled.finish_reason == "cancelled"
    nxt = cancelled.prompt_token_ids + cancelled.token_ids + [7]
    got = _run(sched, [nxt], [SamplingParams(max_tokens=3, ignore_eos=True)])[0]
    _same(got, _run(ref, [nxt], [SamplingParams(max_tokens=3, ignore_eos=True)])[0])
    assert got.stats.cached_tokens >= 12


def test_the_least_recently_used_go_past_the_limit(store):
    sched = _sched(store, prefix_cache=2)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    ps = [[i] + _ids(20 + i, 15) for i in range(3)]  # (no common prefix)
    for p in ps:
        _run(sched, [p], [sp])
    assert sched.stats()["cached_sequences"] == 2
    assert _run(sched, [ps[0]], [sp])[0].stats.cached_tokens == 0  # gone
    assert _run(sched, [ps[2]], [sp])[0].stats.cached_tokens == 15


def test_off_closes_every_slot(store):
    sched = _sched(store, prefix_cache=0)
    p = _ids(5, 10)
    assert [_run(sched, [p], [SamplingParams(max_tokens=2)])[0].stats.cached_tokens for _ in range(2)] == [0, 0]
    assert sched._engine._core.kv_pages_free == sched.kv_pages_total and sched.stats()["cached_sequences"] == 0
    with pytest.raises(InvalidRequestError, match="prefix_cache must be an integer >= 0"):
        _sched(store, prefix_cache=-1)


def test_warm_up_close_and_a_closed_engine_give_the_slots_back(store):
    sched = _sched(store)
    core = sched._engine._core
    _run(sched, [_ids(6, 70), _ids(7, 5)], [SamplingParams(max_tokens=2)] * 2)
    assert sched.kv_pages_cached == 3 and core.kv_pages_free + 3 == core.kv_pages_total
    sched.warm_up(prompt_tokens=16, max_batch=2)
    assert sched.stats()["cached_sequences"] == 0 and core.kv_pages_free == core.kv_pages_total
    _run(sched, [_ids(6, 70)], [SamplingParams(max_tokens=2)])
    sched.close()
    assert core.kv_pages_free == core.kv_pages_total
    eng, p = sched._engine, _ids(8, 20)
    sched = Scheduler(eng)
    _run(sched, [p], [SamplingParams(max_tokens=2)])
    with eng._exclusive():  # (an unfinished stream in this thread: close() cannot take the engine)
        sched.close()
    assert core.kv_pages_free < core.kv_pages_total
    sched = Scheduler(eng)  # the next scheduler takes the slot over
    assert sched.stats()["cached_sequences"] == 1
    assert _run(sched, [p], [SamplingParams(max_tokens=2)])[0].stats.cached_tokens == 19
    eng.close()
    sched.reset_prefix_cache()
    assert sched.stats()["cached_sequences"] == 0 and sched.kv_pages_cached == 0


# ---- the slots and pages kept slots give back (a FakeCore with seq_rewind: its pool can run short) ----


class RewindCore(FakeCore):
    fail_rewind = False
    fail_step = False  # seq_step fails (an engine error)

    def seq_rewind(self, slot: int, tokens: list[int]) -> None:
        if self.fail_rewind or self.cache[slot][:len(tokens)] != list(tokens) or len(tokens) > len(self.cache[slot]):
            raise InvalidRequestError("seq_rewind: not those tokens")
        self.cache[slot] = list(tokens)
        self.log.append(("rewind", slot, len(tokens)))

    def seq_step(self, slots: list[int], tokens: list[int]) -> None:
        if self.fail_step:
            raise InvalidRequestError("seq_step: failed")
        super().seq_step(slots, tokens)


def _fake_sched(overlap: bool = True, **kw) -> tuple[RewindCore, Scheduler]:
    core = RewindCore(**kw)
    eng = Engine.from_core(core, SimpleNamespace(vocab=core.vocab, eos_token_ids=[]), max_seq_len=512)
    return core, Scheduler(eng, prefix_cache=8, overlap=overlap)


def test_a_reused_slot_needs_only_the_pages_past_what_it_holds():
    core, sched = _fake_sched(max_batch=4, page_size=4, pages=8)
    a = _run(sched, [list(range(20))], [SamplingParams(max_tokens=4, ignore_eos=True)])[0]  # keeps 23: 6 pages
    assert core.kv_pages_free == 2
    nxt = list(range(20)) + a.token_ids[:3] + [40, 41, 42, 43, 44, 45, 46, 47]  # 31 tokens + 1: all 8 pages
    got = _run(sched, [nxt], [SamplingParams(max_tokens=1, ignore_eos=True)])[0]
    assert got.finish_reason == "length" and got.stats.cached_tokens == 23


def test_an_error_closes_the_slot_and_a_failed_rewind_is_a_fresh_slot():
    core, sched = _fake_sched(max_batch=4, page_size=4, pages=64)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    _run(sched, [list(range(10))], [sp])
    core.fail_rewind = True
    r = sched.submit(list(range(10)) + [11, 12], sp)
    other = sched.submit([30, 31, 32], sp)
    sched.wait_idle()
    assert r.result().stats.cached_tokens == 0 and other.result().finish_reason == "length"
    assert ("close", 0) in core.log  # the slot it could not rewind
    core.fail_rewind, core.fail_step = False, True
    with pytest.raises(InvalidRequestError, match="seq_step: failed"):
        sched.submit([40, 41], SamplingParams(max_tokens=5, ignore_eos=True)).result()
    # (its cache is in an unknown state: closed, not kept; the two before it are)
    assert sched.stats()["cached_sequences"] == 2 and len(core.cache) == 2
    assert sched.kv_pages_cached + core.kv_pages_free == core.kv_pages_total


def test_a_kept_slot_gives_its_pages_to_an_admission():
    core, sched = _fake_sched(max_batch=4, page_size=4, pages=8)
    _run(sched, [list(range(10))], [SamplingParams(max_tokens=3, ignore_eos=True)])  # keeps 12 tokens: 3 pages
    assert core.kv_pages_free == 5 and sched.stats()["kv_pages_cached"] == 3
    got = _run(sched, [[20 + i for i in range(20)]], [SamplingParams(max_tokens=1, ignore_eos=True)])[0]  # 6 pages
    assert got.finish_reason == "length" and ("close", 0) in core.log
    assert sched.stats()["cached_sequences"] == 1  # (the new one's)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_kept_slot_gives_its_pages_to_a_decode_step(overlap):
    """A running sequence that needs a page gets a kept slot's before any request is requeued or ended (in the
    launch ahead, and in the step itself)."""
    core, sched = _fake_sched(overlap=overlap, max_batch=4, page_size=4, pages=8)
    _run(sched, [list(range(7))], [SamplingParams(max_tokens=2, ignore_eos=True)])  # keeps 8 tokens: 2 pages
    got = _run(sched, [[30 + i for i in range(16)]], [SamplingParams(max_tokens=12, ignore_eos=True)])[0]
    assert got.finish_reason == "length" and len(got.token_ids) == 12  # 27 positions: 7 pages of the 8
    assert ("close", 0) in core.log


def test_a_kept_slot_gives_its_slot_and_the_choice_of_slot():
    """All slots taken (running or kept): the least recently used kept one closes for a fresh prompt. A kept slot
    that would lose more than half of what it holds is taken only when no slot is free; of those sharing the
    most, the one holding the fewest tokens."""
    core, sched = _fake_sched(max_batch=2, page_size=4, pages=64)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    a = list(range(1, 41))
    _run(sched, [a], [sp])  # slot 0 holds 41
    b = _run(sched, [a[:5] + [45, 46, 47]], [sp])[0]  # shares 5 of 41: a fresh slot (1)
    assert b.stats.cached_tokens == 0 and ("open", 1) in core.log
    c = _run(sched, [a[:5] + [48, 49]], [sp])[0]  # no slot free: shares 5 with both; slot 1 holds fewer
    assert c.stats.cached_tokens == 5 and core.log[-1] != ("close", 0) and ("rewind", 1, 5) in core.log
    assert sorted(core.cache) == [0, 1]
    d = _run(sched, [[49] * 6], [sp])[0]  # shares nothing: the least recently used (slot 0) closes
    assert d.stats.cached_tokens == 0 and ("close", 0) in core.log and sched.stats()["cached_sequences"] == 2


# ---- the GPU engine ----


@pytest.mark.gpu
def test_gpu_next_turns_from_the_cache(tmp_path):
    """On the GPU the cached positions were computed by other passes than a fresh prefill's: each turn picks the
    fresh prefill's tokens up to a near-tie of its logits. A small pool: kept slots give their pages back; the
    single path takes the whole pool back."""
    d = make_chat_llama(tmp_path / "m", hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, layers=2,
                        init_std=0.3, dtype="float16")
    opts = _core.CudaOptions()
    opts.kv_pool_pages = 12  # 768 positions
    with Engine(d, device="cuda", max_seq_len=512, cuda_options=opts) as e:
        sched = e.scheduler
        sp = SamplingParams(max_tokens=16, ignore_eos=True)
        firsts = [e.tokenize("Once upon a time " * n) for n in (1, 8, 20)]
        a = e.generate(firsts, sp)
        assert sched.stats()["cached_sequences"] == 3
        turns = [p + c.token_ids + e.tokenize(" and then") for p, c in zip(firsts, a)]
        got = e.generate(turns, sp)
        assert [g.stats.cached_tokens for g in got] == [len(p) + 15 for p in firsts]
        for g in got:
            alone = e.generate(g.prompt_token_ids, sp).token_ids  # (the single path: the kept slots closed)
            assert sched.stats()["cached_sequences"] == 0
            j = next((i for i in range(16) if g.token_ids[i] != alone[i]), 16)
            assert j == 16 or near_tie(e, g.prompt_token_ids + alone[:j]), (j, g.token_ids, alone)
        e.generate(firsts, sp)  # kept again: 1 + 3 + 6 pages of the 12
        assert sched.stats()["kv_pages_cached"] == 10
        long = e.generate([e.tokenize("x" * 250)] * 2, SamplingParams(max_tokens=100, ignore_eos=True))
        assert [len(c.token_ids) for c in long] == [100, 100]  # (6 pages each: all 12, the kept ones' given back)
        sched.reset_prefix_cache()
        assert e._core.kv_pages_free == e._core.kv_pages_total


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_equals_no_cache(store, seed):
    """Requests whose prompts share prefixes with earlier ones (extending their answers, cutting them short,
    diverging), stop ids, cancels and a few slots, under each scheduling mode: the greedy tokens are those without
    the cache, and every page is accounted for (kept + free = total) before the kept ones are given back."""
    rng = np.random.default_rng(seed)
    overlap, mixed = [(True, True), (True, False), (False, False), (True, True)][seed]
    scheds = [_sched(store, max_batch=3, overlap=overlap, mixed_steps=mixed, chunk_tokens=24, prefix_cache=pc)
              for pc in (3, 0)]
    history: list[list[int]] = [_ids(40 + seed, 12)]
    cached = 0
    for wave in range(4):
        prompts, sps = [], []
        for _ in range(int(rng.integers(1, 5))):
            base = history[int(rng.integers(0, len(history)))]
            cut = int(rng.integers(1, len(base) + 1))
            prompts.append((base[:cut] + _ids(int(rng.integers(0, 10**6)), int(rng.integers(0, 12))))[:100] or [1])
            sps.append(SamplingParams(max_tokens=int(rng.integers(1, 12)), ignore_eos=True,
                                      stop_token_ids=[int(rng.integers(0, VOCAB))]))
        outs = []
        for sched in scheds:
            reqs = [sched.submit(p, sp) for p, sp in zip(prompts, sps)]
            if wave == 2:
                next(iter(reqs[0]))
                reqs[0].cancel()
            sched.wait_idle()
            outs.append([r.result() for r in reqs])
            core = sched._engine._core
            assert core.kv_pages_free + sched.kv_pages_cached == core.kv_pages_total
        for i, (g, w) in enumerate(zip(*outs)):
            if not (wave == 2 and i == 0):  # (a cancel lands after a number of tokens that depends on timing)
                assert g.token_ids == w.token_ids, (wave, i)
            history.append(g.prompt_token_ids + g.token_ids)
            cached += g.stats.cached_tokens
    assert cached > 0 and scheds[0].stats()["cached_sequences"] <= 3
