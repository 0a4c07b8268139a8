"""The scheduler's prefix cache (scheduler.py, "Prefix cache"; prefix_cache.py): an ended request's cache is kept
with the tokens it holds (parked by the engines, seq_park; a kept slot on the test doubles without it), and a
later prompt that starts with some of them is copied from it (seq_copy; a kept slot: rewound, seq_rewind) and
prefilled from there; a prefix shared with a running request is copied too. On the CPU engine its tokens,
logprobs and penalties are bit for bit those of a scheduler without the cache; kept caches give their pages (kept
slots their slots) back before anything else is done for want of them; the choice between kept caches, copies, a
wait and a fresh slot; off when asked; seq_park on both engines."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import make_chat_llama, near_tie
from test_cpu_batch import MAX_SEQ, VOCAB, _store
from test_scheduler import FakeCore
from tinyinfer import _core
from tinyinfer.engine import Engine
from tinyinfer.errors import InvalidRequestError, KvCacheFullError
from tinyinfer.sampling import SamplingParams
from tinyinfer.prefix_cache import COPY_WAIT_TOKENS, PrefixCache, common_prefix as _common_prefix, pages_for as _pages
from tinyinfer.scheduler import Scheduler


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
    free_run = _run(ref, [p], [SamplingParams(max_tokens=8, ignore_eos=True)])[0]  # (not cached: it would serve)
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


def test_kept_caches_take_pages_not_slots(store):
    """The engines park an ended request's cache (seq_park): with 3 slots, three conversations' caches stay while
    three other requests fill the batch, each next turn is copied from its own (bit for bit a fresh prefill's
    tokens), and a turn's cache replaces the one it extends: a conversation keeps one. (The CPU's pool is 9 pages
    here, 3 slots of MAX_SEQ: the 6 caches' one page each and the 3 turns' copied pages fill it.)"""
    sched = _sched(store, max_batch=3, prefix_cache=8)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    convs = [_ids(50 + i, 30) for i in range(3)]
    firsts = _run(sched, convs, [sp] * 3)
    assert sched.stats()["cached_sequences"] == 3
    _run(sched, [_ids(60 + i, 20) for i in range(3)], [sp] * 3)  # (every slot at once)
    assert sched.stats()["cached_sequences"] == 6
    nxt = [c + f.token_ids + _ids(70 + i, 6) for i, (c, f) in enumerate(zip(convs, firsts))]
    got = _run(sched, nxt, [sp] * 3)
    for g, w in zip(got, _run(_sched(store, max_batch=3, prefix_cache=0), nxt, [sp] * 3)):
        _same(g, w)
    assert [g.stats.cached_tokens for g in got] == [34] * 3  # (the answer's last token never ran)
    assert sorted(map(len, sched._cache.kept.values())) == [24, 24, 24, 45, 45, 45]
    core = sched._engine._core
    assert sched.kv_pages_cached == core.kv_pages_total - core.kv_pages_free == 6  # (one 64-position page each)
    sched.reset_prefix_cache()
    assert core.kv_pages_free == core.kv_pages_total


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
        e.generate(firsts, sp)  # kept again: 1 + 3 + 6 pages of the 12, less those their copies share
        held = e._core.kv_pages_total - e._core.kv_pages_free
        assert sched.stats()["kv_pages_cached"] == held and 3 <= held < 10
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


# ---- copies between slots (seq_copy): a prefix shared with a running request, or taken from a kept slot ----


def _copy_cases(core, make_tokens):
    """seq_copy on an engine's slots: a copied prefix then prefilled gives a fresh prefill's logits (`same`); bad
    calls change nothing and leave the engine usable. Returns the pairs of logits to compare."""
    prompt = make_tokens(140)  # (three 64-position pages, the last one partly)
    a, b, c = core.seq_open(), core.seq_open(), core.seq_open()
    core.seq_prefill(a, prompt[:130])
    core.seq_prefill(c, prompt)  # the reference: all of it at once
    core.seq_prefill(b, prompt[:5])  # something dst drops
    free = core.kv_pages_free
    for bad, match in [((b, b, prompt[:3]), "same slot"), ((b, a, prompt[:131]), "cannot copy 131"),
                       ((b, a, prompt[:2] + [10**7]), "token id|does not hold"),
                       ((b, 99, prompt[:3]), "slot 99"), ((99, a, prompt[:3]), "slot 99")]:
        with pytest.raises(InvalidRequestError, match=match):
            core.seq_copy(*bad)
        assert core.seq_length(b) == 5 and core.kv_pages_free == free
    core.seq_copy(b, a, prompt[:100])
    # b's page back; positions 0..63 shared with a, 64..99 copied into a page of its own
    assert core.seq_length(b) == 100 and core.kv_pages_free == free + 1 - 1
    assert core.kv_pages_held_by([a]) == 2 and core.kv_pages_held_by([b]) == 1 and core.kv_pages_held_by([a, b]) == 4
    assert core.kv_pages_held_by([a, a]) == 2 and core.kv_pages_held_by([b, a, b]) == 4  # (a slot listed twice: once)
    core.seq_close(a)  # (b still holds their shared page: two of a's three come back)
    assert core.kv_pages_free == free + 2 and core.kv_pages_held_by([b]) == 2
    core.seq_prefill(b, prompt[100:])
    pairs = [(core.seq_logits(b), core.seq_logits(c))]
    # the history: the copied prefix counts as prompt for the repetition penalty (a strong one moves the pick)
    cfg = _core.SamplingConfig()
    cfg.repetition_penalty, cfg.presence_penalty = 5.0, 1.0
    for step in range(3):
        toks = core.seq_sample([b, c], [cfg, cfg], [step, step], 0)[0]
        assert toks[0] == toks[1], step
        core.seq_step([b, c], [int(toks[0])] * 2)
    core.seq_copy(b, c, [])  # nothing copied: an empty slot, as seq_open's
    assert core.seq_length(b) == 0
    core.seq_prefill(b, prompt[:7])
    d = core.seq_open()
    core.seq_prefill(d, prompt[:7])
    pairs.append((core.seq_logits(b), core.seq_logits(d)))
    for s in (b, c, d):
        core.seq_close(s)
    assert core.kv_pages_free == core.kv_pages_total
    return pairs


def _park_cases(core, make_tokens):
    """seq_park: a slot's cache kept under an id past the slots, the slot free again at once; copied from, it gives
    a fresh prefill's logits (`same` pairs) and stays; the calls that would run in it refuse, changing nothing;
    kv_pages_held_by counts it; seq_rewind shortens it (its pages past the cut back, a page it shares kept shared
    where it is cut inside it) and a copy of what is left still gives a fresh prefill's logits; seq_close drops it
    (and its id is given out again)."""
    prompt = make_tokens(140)
    a, ref = core.seq_open(), core.seq_open()
    core.seq_prefill(a, prompt[:130])  # pages P0, P1 full, P2 partly
    core.seq_prefill(ref, prompt)
    free = core.kv_pages_free
    p = core.seq_park(a)
    assert p >= core.max_batch and core.seq_length(p) == 130 and core.kv_pages_free == free
    assert core.kv_pages_held_by([p]) == 3 and core.seq_open() == a  # (the slot, free again)
    for bad in (lambda: core.seq_prefill(p, [1]), lambda: core.seq_step([p], [1]), lambda: core.seq_park(p),
                lambda: core.seq_copy(p, a, []), lambda: core.seq_mark_generated(p, [1]), lambda: core.seq_logits(p)):
        with pytest.raises(InvalidRequestError, match=f"slot {p} does not exist"):
            bad()
    for bad in (lambda: core.seq_length(p + 1), lambda: core.seq_close(p + 1), lambda: core.kv_pages_held_by([p + 1]),
                lambda: core.seq_copy(a, p + 1, [])):
        with pytest.raises(InvalidRequestError, match=f"slot {p + 1} does not exist .* not a parked sequence"):
            bad()
    with pytest.raises(InvalidRequestError, match="cannot copy 131"):
        core.seq_copy(a, p, prompt[:131])
    assert core.seq_length(p) == 130 and core.seq_length(a) == 0 and core.kv_pages_free == free
    core.seq_copy(a, p, prompt[:130])  # P0, P1 shared; P2 copied into A2
    assert core.kv_pages_free == free - 1 and core.seq_length(p) == 130
    core.seq_prefill(a, prompt[130:])
    pairs = [(core.seq_logits(a), core.seq_logits(ref))]
    b = core.seq_open()
    core.seq_copy(b, p, prompt[:64])  # a page boundary: P0 shared, nothing copied
    core.seq_prefill(b, prompt[64:])  # B1, B2
    pairs.append((core.seq_logits(b), core.seq_logits(ref)))
    assert core.kv_pages_free == free - 3
    q = core.seq_park(b)
    with pytest.raises(InvalidRequestError, match=f"slot {b} is not open"):
        core.seq_park(b)  # (parked: closed)
    assert q != p and (core.kv_pages_held_by([p]), core.kv_pages_held_by([q])) == (1, 2)  # P2; B1, B2
    assert core.kv_pages_held_by([p, q]) == 3 and core.kv_pages_held_by([p, q, a, q]) == 6  # (+ P0, P1, A2)
    core.seq_close(p)  # P2 back
    assert core.kv_pages_free == free - 2
    with pytest.raises(InvalidRequestError, match=f"slot {p} does not exist .* not a parked sequence"):
        core.seq_close(p)
    assert core.seq_park(a) == p  # (the id, free again): P0 (q's too), P1, A2
    free = core.kv_pages_free
    with pytest.raises(InvalidRequestError, match="holds 140 positions; cannot keep 141"):
        core.seq_rewind(q, prompt + [1])
    assert (core.seq_rewind_frees(q, 100), core.seq_rewind_frees(q, 10), core.seq_rewind_frees(p, 10)) == (1, 2, 2)
    core.seq_rewind(q, prompt[:100])  # B2 back; B1, its own, cut inside
    assert core.seq_length(q) == 100 and core.kv_pages_free == free + 1 and core.kv_pages_held_by([q]) == 1
    core.seq_rewind(p, prompt[:10])  # P1, A2 back; P0, q's too, cut inside and not copied (nothing writes it)
    assert core.seq_length(p) == 10 and core.kv_pages_free == free + 3 and core.kv_pages_held_by([p]) == 0
    assert core.kv_pages_held_by([p, q]) == 2
    c = core.seq_open()
    for src, n in ((q, 100), (p, 10), (p, 0)):
        core.seq_copy(c, src, prompt[:n])
        core.seq_prefill(c, prompt[n:])
        pairs.append((core.seq_logits(c), core.seq_logits(ref)))
    core.seq_rewind(p, [])
    assert core.seq_length(p) == 0 and core.kv_pages_held_by([p, q]) == 2  # (P0 q's alone now)
    for s in (c, p, q, ref):
        core.seq_close(s)
    assert core.kv_pages_free == core.kv_pages_total
    return pairs


def _unshare_cases(core, make_tokens):
    """A slot cut back inside a page it shares (seq_copy's) and prefilled anew writes into a copy of that page of
    its own: the slot sharing it keeps its keys and values (`same` pairs of logits against fresh prefills), and
    seq_rewind_frees says what each rewind gives back."""
    prompt, other = make_tokens(140), make_tokens(160)[140:]
    a, b, ref, ref_a = core.seq_open(), core.seq_open(), core.seq_open(), core.seq_open()
    core.seq_prefill(a, prompt[:130])  # pages 0, 1 full, 2 partly
    core.seq_copy(b, a, prompt[:129])  # 0, 1 shared; 2 copied
    assert core.kv_pages_held_by([a, b]) == 4
    for n, frees in [(130, 0), (128, 1), (100, 0), (64, 1), (0, 1)]:  # (a's page 2 its own; 0 and 1 shared)
        assert core.seq_rewind_frees(a, n) == frees, n
    with pytest.raises(InvalidRequestError, match="cannot keep 131"):
        core.seq_rewind_frees(a, 131)
    free = core.kv_pages_free
    core.seq_rewind(a, prompt[:70])  # inside page 1: its own copy of it (page 2 back, one taken)
    assert core.kv_pages_free == free and core.kv_pages_held_by([a]) == 1 and core.kv_pages_held_by([b]) == 2
    core.seq_prefill(a, other)  # positions 70..89 of a's copy, not b's page
    core.seq_prefill(b, prompt[129:])
    core.seq_prefill(ref, prompt)
    core.seq_prefill(ref_a, prompt[:70] + other)
    pairs = [(core.seq_logits(b), core.seq_logits(ref)), (core.seq_logits(a), core.seq_logits(ref_a))]
    free = core.kv_pages_free
    core.seq_rewind(b, prompt[:64])  # a page boundary: nothing shared to copy; page 1 and 2 back
    assert core.kv_pages_free == free + 2
    core.seq_prefill(b, prompt[64:])
    pairs.append((core.seq_logits(b), core.seq_logits(ref)))
    for s in (a, b, ref, ref_a):
        core.seq_close(s)
    assert core.kv_pages_free == core.kv_pages_total
    return pairs


class CappedCore:
    """The CPU engine held to a pool of `cap` pages (its own pool never runs out): the pages in use are its (shared
    ones once), and a prefill or step that would take more than the cap allows is refused first, changing nothing,
    as the GPU engine refuses. The scheduler's plain calls only: no launch ahead, no mixed steps, no copies."""

    def __init__(self, core, cap: int) -> None:
        self._core, self.cap = core, cap

    def __getattr__(self, name):
        return getattr(self._core, name)

    @property
    def kv_pages_total(self) -> int:
        return self.cap

    @property
    def kv_pages_free(self) -> int:
        return self.cap - (self._core.kv_pages_total - self._core.kv_pages_free)

    def _room(self, grows) -> None:
        ps = self._core.kv_page_size
        need = sum(_pages(self._core.seq_length(s) + n, ps) - _pages(self._core.seq_length(s), ps) for s, n in grows)
        if need > self.kv_pages_free:
            raise InvalidRequestError(f"out of KV pages: {need} needed, {self.kv_pages_free} free")

    def seq_prefill(self, slot, tokens):
        self._room([(slot, len(tokens))])
        self._core.seq_prefill(slot, tokens)

    def seq_prefill_many(self, slots, prompts):
        self._room(list(zip(slots, map(len, prompts))))
        self._core.seq_prefill_many(slots, prompts)

    def seq_step(self, slots, tokens):
        self._room([(s, 1) for s in slots])
        self._core.seq_step(slots, tokens)


@pytest.mark.parametrize("sp", [SamplingParams(max_tokens=70, ignore_eos=True, logprobs=2),
                                dataclasses.replace(HOT, max_tokens=70)], ids=["greedy", "penalties"])
def test_cpu_preempted_requests_sample_what_they_sample_with_room(store, sp):
    """The CPU engine held to 4 pages of 64 positions: three requests growing to 2 pages each preempt one another,
    and each samples exactly its tokens and logprobs with room for all (the CPU's arithmetic does not depend on
    how positions were batched: a recomputed prefix is bit for bit the stepped one). With presence / frequency
    penalties this checks seq_mark_generated end to end."""
    prompts = [_ids(30 + i, 12 + 5 * i) for i in range(3)]
    sps = [dataclasses.replace(sp, seed=s) for s in range(3)]
    kw = dict(overlap=False, mixed_steps=False, prefix_cache=0)
    capped = Scheduler(Engine.from_core(CappedCore(_core.CpuEngine(store, MAX_SEQ, 2, 4), 4),
                                        SimpleNamespace(vocab=VOCAB, eos_token_ids=[]), max_seq_len=MAX_SEQ), **kw)
    got = _run(capped, prompts, sps)
    assert capped.metrics()["preemptions"] >= 1
    for g, w in zip(got, _run(_sched(store, **kw), prompts, sps)):
        _same(g, w)


def _marked_answer_cases(core, make_tokens, temperature: float = 1.0):
    """seq_mark_generated (a preempted request's answer, prefilled again as prompt): slot b, given prompt + answer
    as prompt and then the answer marked as generated, samples what slot a, which generated that answer, samples
    (presence / frequency penalties count the answer); slot c, unmarked, does not. Bad calls change nothing.
    Returns a's, b's and c's tokens over 10 more steps."""
    prompt = make_tokens(20)
    cfg = _core.SamplingConfig()
    cfg.temperature, cfg.seed, cfg.presence_penalty, cfg.frequency_penalty = temperature, 7, 2.0, 1.5
    a, b, c = core.seq_open(), core.seq_open(), core.seq_open()
    core.seq_prefill(a, prompt)
    answer = []
    for step in range(6):
        answer.append(int(core.seq_sample([a], [cfg], [step], 0)[0][0]))
        core.seq_step([a], [answer[-1]])
    for s in (b, c):
        core.seq_prefill(s, prompt + answer)
    for bad, match in [((b, [10**7]), "token id"), ((99, answer), "slot 99")]:
        with pytest.raises(InvalidRequestError, match=match):
            core.seq_mark_generated(*bad)
    core.seq_mark_generated(b, answer)
    toks = {a: [], b: [], c: []}
    for step in range(6, 16):
        got = core.seq_sample([a, b, c], [cfg] * 3, [step] * 3, 0)[0]
        for s, t in zip((a, b, c), got.tolist()):
            toks[s].append(t)
        core.seq_step([a, b, c], got.tolist())
    for s in (a, b, c):
        core.seq_close(s)
    return toks[a], toks[b], toks[c]


def test_cpu_a_marked_answer_samples_as_the_one_that_generated_it(store):
    core = _core.CpuEngine(store, MAX_SEQ, 2, 4)
    a, b, c = _marked_answer_cases(core, lambda n: _ids(9, n))
    assert a == b and a != c


def test_cpu_seq_copy_equals_a_fresh_prefill(store):
    core = _core.CpuEngine(store, MAX_SEQ, 2, 4)
    for got, want in (_copy_cases(core, lambda n: _ids(7, n)) + _unshare_cases(core, lambda n: _ids(8, n)) +
                      _park_cases(core, lambda n: _ids(10, n))):
        assert np.array_equal(got, want)
    a, b = core.seq_open(), core.seq_open()
    core.seq_prefill(a, [1, 2, 3])
    with pytest.raises(InvalidRequestError, match="does not hold those"):
        core.seq_copy(b, a, [1, 2, 4])  # (the CPU engine keeps its tokens: it checks them)
    assert core.seq_length(b) == 0


def test_cpu_parked_pages_count_against_the_pool(store):
    """The CPU engine's pages come from the heap, but parked sequences' count against kv_pages_total as on the GPU:
    a call that would take more than are free is refused, changing nothing (kv_pages_free never below zero)."""
    core = _core.CpuEngine(store, MAX_SEQ, 1, 1)  # one slot of MAX_SEQ: 3 pages
    s = core.seq_open()
    prompt = _ids(20, 139)
    core.seq_prefill(s, prompt)
    p = core.seq_park(s)
    s = core.seq_open()
    assert core.kv_pages_free == 0
    for bad, match in [(lambda: core.seq_prefill(s, [1]), "seq_prefill needs 1 more pages and 0 of 3 are free"),
                       (lambda: core.seq_prefill_many([s], [[1, 2]]), "seq_prefill_many needs 1"),
                       (lambda: core.seq_copy(s, p, prompt[:100]), "last page of 100 positions is copied")]:
        with pytest.raises(InvalidRequestError, match=match):
            bad()
        assert core.seq_length(s) == 0 and core.kv_pages_free == 0
    core.seq_copy(s, p, prompt[:128])  # (a page boundary: two pages shared, none taken)
    with pytest.raises(InvalidRequestError, match="seq_prefill needs 1 more pages"):
        core.seq_prefill(s, prompt[128:])
    core.seq_close(p)  # its third page back
    core.seq_prefill(s, prompt[128:])
    ref = _core.CpuEngine(store, MAX_SEQ, 1, 1)
    r = ref.seq_open()
    ref.seq_prefill(r, prompt)
    assert np.array_equal(core.seq_logits(s), ref.seq_logits(r))
    t = core.seq_park(s)
    s = core.seq_open()
    core.seq_copy(s, t, prompt[:128])  # (P0, P1 shared with t)
    with pytest.raises(InvalidRequestError, match="seq_rewind: position 100's KV page is shared"):
        core.seq_rewind(s, prompt[:100])  # inside P1: a copy of it, and no page is free
    assert core.seq_length(s) == 128 and core.kv_pages_free == 0
    core.seq_close(t)
    core.seq_rewind(s, prompt[:100])  # (P1 its own now: nothing to copy)
    assert core.kv_pages_free == 1
    u = core.seq_park(s)
    s = core.seq_open()
    core.seq_copy(s, u, prompt[:64])  # (P0 shared)
    core.seq_prefill(s, prompt[64:127])  # P1' (127 positions: the last one's step opens no page)
    core.seq_step([s], [prompt[127]])
    with pytest.raises(InvalidRequestError, match="seq_step needs 1 more pages and 0 of 3"):
        core.seq_step([s], [prompt[128]])  # position 128: a third page, and none is free
    assert core.seq_length(s) == 128 and core.kv_pages_free == 0


@pytest.mark.gpu
@pytest.mark.parametrize("shuffle", [0, 11], ids=["pages-in-order", "pages-scattered"])
def test_gpu_seq_copy_equals_a_fresh_prefill(tmp_path, shuffle):
    """The GPU's seq_copy: pages in order (a run of pages, one 2D copy) and scattered over the pool (a copy a
    page); a copy refused for want of pages changes nothing."""
    d = make_chat_llama(tmp_path / "m", hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, layers=3,
                        init_std=0.3, dtype="float16")
    opts = _core.CudaOptions()
    opts.kv_page_shuffle = shuffle
    opts.kv_pool_pages = 16
    opts.kv_page_size = 64
    opts.max_batch = 4
    with Engine(d, device="cuda", max_seq_len=1024, cuda_options=opts) as e:
        core = e._core
        e.scheduler.reset_prefix_cache()
        toks = lambda n: [int(t) for t in np.random.default_rng(3).integers(0, 300, n)]  # noqa: E731
        for got, want in (_copy_cases(core, toks) + _unshare_cases(core, lambda n: toks(n)[::-1]) +
                          _park_cases(core, lambda n: toks(n)[1:] + [1])):
            assert np.abs(got - want).max() <= 3e-3 * np.abs(want).max()
        a, big, b, c = core.seq_open(), core.seq_open(), core.seq_open(), core.seq_open()
        core.seq_prefill(a, list(range(1, 60)))  # one page
        core.seq_prefill(big, [7] * (64 * 14))  # 14 pages: one of the 16 left
        core.seq_copy(b, a, list(range(1, 60)))  # takes it
        with pytest.raises(InvalidRequestError, match="KV pages"):
            core.seq_copy(c, a, list(range(1, 60)))
        assert core.seq_length(c) == 0 and core.kv_pages_free == 0
        core.seq_prefill(b, [5])
        core.seq_close(a)  # (b holds a copy: a's page is free)
        core.seq_copy(c, b, list(range(1, 60)) + [5])
        assert core.seq_length(c) == 60 and core.kv_pages_free == 0
        for s in (big, b, c):
            core.seq_close(s)
        assert core.kv_pages_free == core.kv_pages_total


@pytest.mark.gpu
def test_gpu_a_shared_prefix_in_flight_is_prefilled_once(tmp_path):
    """On the GPU: a system prompt shared by requests submitted together, and one prompt three times (n choices),
    prefilled once and copied; each request's tokens are the single path's up to a near-tie of its logits."""
    d = make_chat_llama(tmp_path / "m", hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, layers=2,
                        init_std=0.3, dtype="float16")
    with Engine(d, device="cuda", max_seq_len=512) as e:
        sysp = e.tokenize("You are a helpful assistant. " * 6)
        prompts = [sysp + [40 + i, 41 + i] for i in range(3)] + [sysp + [99, 98]] * 3
        sp = SamplingParams(max_tokens=12, ignore_eos=True)
        got = e.generate(prompts, sp)
        assert [g.stats.cached_tokens for g in got] == [0] + [len(sysp)] * 5
        assert e._core.kv_pages_free + e.scheduler.kv_pages_cached == e._core.kv_pages_total
        for g in got:
            alone = e.generate(g.prompt_token_ids, sp).token_ids  # (the single path: the kept slots closed)
            j = next((i for i in range(12) if g.token_ids[i] != alone[i]), 12)
            assert j == 12 or near_tie(e, g.prompt_token_ids + alone[:j]), (j, g.token_ids, alone)


@pytest.mark.gpu
def test_gpu_a_marked_answer_samples_as_the_one_that_generated_it(tmp_path):
    """The GPU's seq_mark_generated end to end, greedily with the penalties: the marked slot picks the generating
    slot's tokens. (At temperature 1 the first draw, u = 0.97 of the sorted mass, falls among the tail's small
    probabilities, where a prefill's logits against a step's, ~1e-3 apart, move the pick one time in three: the
    CPU twin with that noise. The mark's own effect: test_gpu_a_mark_counts_for_the_penalties.)"""
    d = make_chat_llama(tmp_path / "m", hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, layers=2,
                        init_std=0.3, dtype="float16")
    with Engine(d, device="cuda", max_seq_len=512) as e:
        e.scheduler.reset_prefix_cache()
        toks = lambda n: [int(t) for t in np.random.default_rng(4).integers(0, 300, n)]  # noqa: E731
        a, b, _ = _marked_answer_cases(e._core, toks, temperature=0.0)
        assert a == b, (a, b)


def _mark_counts_cases(core, make_tokens):
    """seq_mark_generated counts its tokens for the penalties, directly (greedy, so no draw can hide it): two slots
    prefilled alike; marked ten times as generated in one, the other's greedy token g costs that one 22 logits
    (presence 2 + frequency 2 x 10), more than g leads by, so it picks another; the unmarked one still picks g.
    Returns (g, the marked slot's token, the unmarked slot's token, g's lead over the runner-up)."""
    prompt = make_tokens(20)
    b, c = core.seq_open(), core.seq_open()
    for s in (b, c):
        core.seq_prefill(s, prompt)
    logits = np.asarray(core.seq_logits(c), np.float64)
    g = int(np.argmax(logits))
    lead = float(logits[g] - np.partition(logits, -2)[-2])
    core.seq_mark_generated(b, [g] * 10)
    cfg = _core.SamplingConfig()
    cfg.presence_penalty, cfg.frequency_penalty = 2.0, 2.0
    got = core.seq_sample([b, c], [cfg, cfg], [0, 0], 0)[0].tolist()
    for s in (b, c):
        core.seq_close(s)
    return g, got[0], got[1], lead


def test_cpu_a_mark_counts_for_the_penalties(store):
    g, marked, unmarked, lead = _mark_counts_cases(_core.CpuEngine(store, MAX_SEQ, 2, 4), lambda n: _ids(11, n))
    assert lead < 22 and marked != g and unmarked == g


@pytest.mark.gpu
def test_gpu_a_mark_counts_for_the_penalties(tmp_path):
    d = make_chat_llama(tmp_path / "m", hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, layers=2,
                        init_std=0.3, dtype="float16")
    with Engine(d, device="cuda", max_seq_len=512) as e:
        e.scheduler.reset_prefix_cache()
        toks = lambda n: [int(t) for t in np.random.default_rng(5).integers(0, 300, n)]  # noqa: E731
        g, marked, unmarked, lead = _mark_counts_cases(e._core, toks)
        assert lead < 22 and marked != g and unmarked == g, (g, marked, unmarked, lead)


@pytest.mark.gpu
@pytest.mark.parametrize("penalties", [(0.0, 0.0), (0.8, 0.6)], ids=["greedy", "penalties"])
def test_gpu_decode_out_of_pages_preempts_and_recomputes(tmp_path, penalties):
    """A pool too small for three answers at once (6 pages of 64 positions; each request grows to 3): the youngest
    are preempted, their prompt and tokens prefilled again once pages free up; every request gets all its tokens,
    each the single path's up to a near-tie of its logits (the recomputed positions come from a prefill pass), with
    presence / frequency penalties too (the recomputed answer marked as generated again)."""
    d = make_chat_llama(tmp_path / "m", hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, layers=2,
                        init_std=0.3, dtype="float16")
    opts = _core.CudaOptions()
    opts.kv_pool_pages = 6
    opts.kv_page_size = 64
    with Engine(d, device="cuda", max_seq_len=512, cuda_options=opts) as e:
        prompts = [e.tokenize(f"Story number {i}: once upon a time") for i in range(3)]
        sp = SamplingParams(max_tokens=140, ignore_eos=True, presence_penalty=penalties[0],
                            frequency_penalty=penalties[1])
        got = e.generate(prompts, sp)
        assert [len(g.token_ids) for g in got] == [140] * 3
        assert e.scheduler.metrics()["preemptions"] >= 1
        for g in got:
            alone = e.generate(g.prompt_token_ids, sp).token_ids
            j = next((i for i in range(140) if g.token_ids[i] != alone[i]), 140)
            assert j == 140 or near_tie(e, g.prompt_token_ids + alone[:j], (*penalties, alone[:j])), \
                (j, g.token_ids, alone)


def _sys(n: int, seed: int = 0) -> list[int]:
    return _ids(200 + seed, n)


@pytest.mark.parametrize("overlap, mixed", [(True, True), (True, False), (False, False)])
def test_a_shared_prefix_in_flight_is_prefilled_once(store, overlap, mixed):
    """Requests that share a system prompt, submitted together (and the same prompt four times: a request's n
    choices): the first prefills it, the others wait for it and copy it (cached_tokens), and each samples what it
    samples without the cache, penalties and logprobs included."""
    sysp = _sys(90)
    prompts = [sysp + _ids(i, 3 + 4 * i) for i in range(4)] + [sysp + [5, 6]] * 4
    sps = [HOT] * 4 + [dataclasses.replace(HOT, seed=s) for s in range(4)]
    sched = _sched(store, overlap=overlap, mixed_steps=mixed, chunk_tokens=48)
    ref = _sched(store, overlap=overlap, mixed_steps=mixed, chunk_tokens=48, prefix_cache=0)
    got = _run(sched, prompts, sps)
    for g, w in zip(got, _run(ref, prompts, sps)):
        _same(g, w)
    assert [g.stats.cached_tokens for g in got] == [0] + [90] * 7  # (the n choices: 91 more, under COPY_WAIT_TOKENS)
    core = sched._engine._core
    assert core.kv_pages_free + sched.kv_pages_cached == core.kv_pages_total


def test_a_long_kept_slot_is_copied_from_not_cut_short(store):
    """A prompt sharing only the system prompt with a kept conversation copies that prefix into a fresh slot: the
    conversation stays kept whole, and its next turn still finds all of it."""
    sysp = _sys(20, 1)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    sched, ref = _sched(store), _sched(store, prefix_cache=0)
    conv = sysp + _ids(1, 60)
    a = _run(sched, [conv], [sp])[0]
    other = _run(sched, [sysp + [7, 8, 9]], [sp])[0]
    assert other.stats.cached_tokens == 20 and sched.stats()["cached_sequences"] == 2
    turn = conv + a.token_ids + [3, 4]
    nxt = _run(sched, [turn], [sp])[0]
    assert nxt.stats.cached_tokens == len(conv) + 5  # (the answer's last token never ran)
    for g, w in zip([other, nxt], _run(ref, [sysp + [7, 8, 9], turn], [sp, sp])):
        _same(g, w)


class CopyCore(RewindCore):
    fail_copy = False

    def seq_copy(self, dst: int, src: int, tokens: list[int]) -> None:
        if self.fail_copy or dst == src or self.cache[src][:len(tokens)] != list(tokens) or dst not in self.cache:
            raise InvalidRequestError("seq_copy: refused")
        need = _pages(len(tokens), self.kv_page_size) - _pages(len(self.cache[dst]), self.kv_page_size)
        if need > self.kv_pages_free:
            raise InvalidRequestError("seq_copy: out of KV pages")
        self.cache[dst] = list(tokens)
        self.log.append(("copy", dst, src, len(tokens)))


class SharedPagesCore(CopyCore):
    """CopyCore with the engines' pages (cpp/gpu/kv_pages.h): a pool of page ids, each held by one or more slots'
    tables. seq_copy shares the whole pages of the prefix and copies the last, partly filled one; seq_rewind cut
    inside a shared page copies it; a page is free once no table holds it (kv_pages_held_by, seq_rewind_frees)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.tables: dict[int, list[int]] = {}
        self.refs = [0] * self.kv_pages_total
        self.free_ids = list(range(self.kv_pages_total))[::-1]

    @property
    def kv_pages_free(self) -> int:
        return len(self.free_ids) - self.single - self.held

    def _take(self) -> int:
        if self.kv_pages_free < 1:
            raise InvalidRequestError("out of KV pages")
        p = self.free_ids.pop()
        self.refs[p] = 1
        return p

    def _drop(self, slot: int, keep: int) -> None:
        while len(self.tables[slot]) > keep:
            p = self.tables[slot].pop()
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_ids.append(p)

    def _grow(self, slots_tokens) -> None:
        ps = self.kv_page_size
        need = sum(_pages(len(self.cache[s]) + len(t), ps) - len(self.tables[s]) for s, t in slots_tokens)
        if need > self.kv_pages_free:
            raise InvalidRequestError("out of KV pages")
        for s, t in slots_tokens:
            assert len(self.cache[s]) % ps == 0 or self.refs[self.tables[s][-1]] == 1, "a write into a shared page"
            self.cache[s] += t
            while len(self.tables[s]) < _pages(len(self.cache[s]), ps):
                self.tables[s].append(self._take())

    def seq_open(self) -> int:
        slot = super().seq_open()
        self.tables[slot] = []
        return slot

    def seq_close(self, slot: int) -> None:
        super().seq_close(slot)
        self._drop(slot, 0)

    def _cut_frees(self, slot: int, n: int) -> tuple[int, bool]:
        ps, t = self.kv_page_size, self.tables[slot]
        return sum(self.refs[p] == 1 for p in t[_pages(n, ps):]), n % ps != 0 and self.refs[t[n // ps]] > 1

    def seq_rewind_frees(self, slot: int, n: int) -> int:
        if not 0 <= n <= len(self.cache[slot]):
            raise InvalidRequestError("seq_rewind_frees: bad n")
        frees, copies = self._cut_frees(slot, n)
        return frees - copies

    def seq_rewind(self, slot: int, tokens: list[int]) -> None:
        n = len(tokens)
        if not self.fail_rewind and self.cache[slot][:n] == list(tokens) and n <= len(self.cache[slot]):
            frees, copies = self._cut_frees(slot, n)
            if copies and self.kv_pages_free + frees < 1:
                raise InvalidRequestError("seq_rewind: out of KV pages")
        super().seq_rewind(slot, tokens)  # (its checks, the tokens)
        self._drop(slot, _pages(n, self.kv_page_size))
        j = n // self.kv_page_size
        if n % self.kv_page_size and self.refs[self.tables[slot][j]] > 1:
            self.refs[self.tables[slot][j]] -= 1
            self.tables[slot][j] = self._take()

    def seq_copy(self, dst: int, src: int, tokens: list[int]) -> None:
        n, ps = len(tokens), self.kv_page_size
        if self.fail_copy or dst == src or self.cache[src][:n] != list(tokens) or dst not in self.cache:
            raise InvalidRequestError("seq_copy: refused")
        owned = sum(self.refs[p] == 1 for p in self.tables[dst])
        if n % ps and self.kv_pages_free + owned < 1:
            raise InvalidRequestError("seq_copy: out of KV pages")
        self._drop(dst, 0)
        self.tables[dst] = list(self.tables[src][:n // ps])
        for p in self.tables[dst]:
            self.refs[p] += 1
        if n % ps:
            self.tables[dst].append(self._take())
        self.cache[dst] = list(tokens)
        self.log.append(("copy", dst, src, n))

    def kv_pages_held_by(self, slots: list[int]) -> int:
        held: dict[int, int] = {}
        for s in slots:
            for p in self.tables[s]:
                held[p] = held.get(p, 0) + 1
        return sum(c == self.refs[p] for p, c in held.items())


class ParkingCore(SharedPagesCore):
    """SharedPagesCore with the engines' seq_park: a slot's tokens and page table move to an id past the slots (the
    slot closes); seq_copy and seq_close take the id, nothing runs in it."""

    def seq_park(self, slot: int) -> int:
        if not 0 <= slot < self.max_batch or slot not in self.cache:
            raise InvalidRequestError(f"slot {slot} is not open")
        pid = next(i for i in range(self.max_batch, 10**6) if i not in self.cache)
        self.cache[pid], self.tables[pid] = self.cache.pop(slot), self.tables.pop(slot)
        self.log.append(("park", slot, pid))
        return pid

    def _grow(self, slots_tokens) -> None:
        assert all(s < self.max_batch for s, _ in slots_tokens), "a parked sequence run"
        super()._grow(slots_tokens)

    def seq_rewind(self, slot: int, tokens: list[int]) -> None:
        if slot < self.max_batch:
            return super().seq_rewind(slot, tokens)
        n = len(tokens)  # a parked sequence shortened: its pages past n back, a shared page cut inside kept shared
        if self.fail_rewind or slot not in self.cache or n > len(self.cache[slot]) or self.cache[slot][:n] != tokens:
            raise InvalidRequestError("seq_rewind: not those tokens")
        self.cache[slot] = list(tokens)
        self._drop(slot, _pages(n, self.kv_page_size))
        self.log.append(("rewind", slot, n))

    def seq_rewind_frees(self, slot: int, n: int) -> int:
        if slot < self.max_batch:
            return super().seq_rewind_frees(slot, n)
        if not 0 <= n <= len(self.cache[slot]):
            raise InvalidRequestError("seq_rewind_frees: bad n")
        return self._cut_frees(slot, n)[0]


@pytest.mark.parametrize("pc", [8, 0])
def test_a_prompt_that_fits_is_not_refused_for_the_cache_it_copies(pc):
    """The pages a prompt lacks are the parked cache it copies from: copied, then dropped (it had ended the request
    with a KvCacheFullError, "nothing running", although it fits the pool with the cache off)."""
    core = ParkingCore(max_batch=2, page_size=4, pages=10, vocab=60)
    sched = Scheduler(Engine.from_core(core, SimpleNamespace(vocab=60, eos_token_ids=[]), max_seq_len=512),
                      overlap=False, mixed_steps=False, prefix_cache=pc)
    a = list(range(1, 31))
    _run(sched, [a], [SamplingParams(max_tokens=2, ignore_eos=True)])  # 31 positions kept: 8 pages
    got = _run(sched, [a[:6] + list(range(31, 56))], [SamplingParams(max_tokens=1, ignore_eos=True)])[0]
    assert len(got.token_ids) == 1 and got.stats.cached_tokens == (6 if pc else 0)
    assert core.kv_pages_free + sched.kv_pages_cached == core.kv_pages_total


@pytest.mark.parametrize("pc", [4, 0])
def test_cpu_a_prompt_that_fits_is_not_refused_for_the_cache_it_copies(store, pc):
    core = _core.CpuEngine(store, MAX_SEQ, 1, 1)  # one slot: 3 pages
    sched = Scheduler(Engine.from_core(core, SimpleNamespace(vocab=VOCAB, eos_token_ids=[]), max_seq_len=MAX_SEQ),
                      prefix_cache=pc)
    a = _ids(30, 100)
    _run(sched, [a], [SamplingParams(max_tokens=5, ignore_eos=True)])
    got = _run(sched, [a[:52] + _ids(31, 90)], [SamplingParams(max_tokens=1, ignore_eos=True)])[0]
    assert len(got.token_ids) == 1
    assert core.kv_pages_free + sched.kv_pages_cached == core.kv_pages_total


def test_cpu_a_full_pool_copies_up_to_a_page_boundary(store):
    """The parked source fills the pool: the copy comes before the source is dropped, so the partly filled page it
    would copy has no room; the copy stops at the page boundary below instead (it had been refused, the source
    dropped and the whole prompt prefilled)."""
    core = _core.CpuEngine(store, MAX_SEQ, 1, 1)  # one slot: 3 pages
    sched = Scheduler(Engine.from_core(core, SimpleNamespace(vocab=VOCAB, eos_token_ids=[]), max_seq_len=MAX_SEQ),
                      prefix_cache=4)
    a = _ids(30, 140)
    _run(sched, [a], [SamplingParams(max_tokens=5, ignore_eos=True)])  # 144 positions parked: all 3 pages
    assert core.kv_pages_free == 0
    p = a[:100] + _ids(31, 40)
    got = _run(sched, [p], [SamplingParams(max_tokens=1, ignore_eos=True)])[0]
    assert got.stats.cached_tokens == 64
    _same(got, _run(_sched(store, max_batch=1, prefix_cache=0), [p], [SamplingParams(max_tokens=1)])[0])


@pytest.mark.parametrize("pc", [8, 0])
def test_eviction_gives_back_a_parked_cache_tail_first(pc):
    """Short of pages, the least recently used parked cache gives back only as many of its last pages as are asked
    for (vLLM's cached blocks: least recently used first, a sequence's tail first): its conversation's next turn
    still copies the prefix left (it had been dropped whole: nothing cached)."""
    core = ParkingCore(max_batch=2, page_size=4, pages=10, vocab=60)
    sched = Scheduler(Engine.from_core(core, SimpleNamespace(vocab=60, eos_token_ids=[]), max_seq_len=512),
                      overlap=False, mixed_steps=False, prefix_cache=pc)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    conv = list(range(1, 21))
    first = _run(sched, [conv], [sp])[0]  # 23 positions parked: 6 pages
    other = _run(sched, [list(range(30, 50))], [SamplingParams(max_tokens=2, ignore_eos=True)])[0]  # 6 pages
    if pc:
        a = next(k for k, v in sched._cache.kept.items() if v[0] == 1)
        assert ("rewind", a, 16) in core.log and sched._cache.kept[a] == conv[:16]  # 2 of its 6 pages
    turn = conv + first.token_ids + [51, 52, 53]
    nxt = _run(sched, [turn], [sp])[0]
    assert nxt.stats.cached_tokens == (16 if pc else 0)
    ref_core = ParkingCore(max_batch=2, page_size=4, pages=10, vocab=60)
    ref = Scheduler(Engine.from_core(ref_core, SimpleNamespace(vocab=60, eos_token_ids=[]), max_seq_len=512),
                    overlap=False, mixed_steps=False, prefix_cache=0)
    for g, w in zip([other, nxt], _run(ref, [list(range(30, 50)), turn], [SamplingParams(max_tokens=2,
                                                                                           ignore_eos=True), sp])):
        _same(g, w)
    assert core.kv_pages_free + sched.kv_pages_cached == core.kv_pages_total


def test_a_cut_that_another_cache_would_extend_drops_it():
    """A parked cache whose cut another kept cache extends (the longer one serves every prompt it would) is dropped
    instead of cut: two caches prefilled apart with the same first 20 tokens, the older cut by one page."""
    core = ParkingCore(max_batch=2, page_size=4, pages=20, vocab=60)
    cache = PrefixCache(8, 4, copies=True, shares=True, parks=True)
    x = list(range(1, 21))
    for tail in ([30, 31, 32, 33], [40, 41, 42, 43, 44]):
        s = core.seq_open()
        core.seq_prefill(s, x + tail)
        cache.keep(core, s, x + tail)
    older, newer = cache.kept
    assert core.kv_pages_free == 20 - 6 - 7
    assert cache.evict_lru(core, want=1) == 6 and list(cache.kept) == [newer]  # (cut to 20: the newer extends it)
    assert cache.evict_lru(core, want=1) == 1 and cache.kept[newer] == x + [40, 41, 42, 43]  # (cut to 24)


def test_cpu_eviction_gives_back_a_parked_cache_tail_first(store):
    """The CPU engine's parked caches cut page by page (seq_rewind of a parked sequence): the next turn copies the
    pages left and samples what it samples with the cache off."""
    sched = _sched(store, max_batch=2, prefix_cache=4)  # 6 pages of 64 positions
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    conv = _ids(40, 130)
    first = _run(sched, [conv], [sp])[0]  # 134 positions parked: 3 pages
    _run(sched, [_ids(41, 100)], [sp])  # 2 pages: 1 free
    _run(sched, [_ids(42, 100)], [SamplingParams(max_tokens=3, ignore_eos=True)])  # 2 pages: conv's last one given back
    assert sorted(map(len, sched._cache.kept.values())) == [102, 104, 128]
    turn = conv + first.token_ids + _ids(43, 5)
    nxt = _run(sched, [turn], [SamplingParams(max_tokens=3, ignore_eos=True)])[0]
    assert nxt.stats.cached_tokens == 128  # (the pages left; 100-position caches cut to 64 for its third page)
    want = _run(_sched(store, max_batch=1, prefix_cache=0), [turn], [SamplingParams(max_tokens=3, ignore_eos=True)])
    _same(nxt, want[0])
    assert sched._cache.kept and sched.kv_pages_cached == sched._engine._core.kv_pages_held_by(list(sched._cache.kept))


def test_a_source_short_of_pages_waits_with_the_cache_kept():
    """A prompt whose copy, even with its parked source dropped after, does not fit beside a running request waits
    for it with the source kept (dropping it first had thrown the cache away and fitted no better), then copies."""
    core = ParkingCore(max_batch=2, page_size=4, pages=10, vocab=60)
    sched = Scheduler(Engine.from_core(core, SimpleNamespace(vocab=60, eos_token_ids=[]), max_seq_len=512),
                      overlap=False, mixed_steps=False, prefix_cache=8)
    a = list(range(1, 31))
    _run(sched, [a], [SamplingParams(max_tokens=2, ignore_eos=True)])  # 31 positions parked: 8 pages
    r = sched.submit([50, 51, 52, 53, 54, 55], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.step()
    b = sched.submit(a[:6] + list(range(31, 59)), SamplingParams(max_tokens=1, ignore_eos=True))
    sched.step()
    assert sched.waiting == 1 and len(sched._cache) == 1
    sched.wait_idle()
    assert r.result().finish_reason == "length" and b.result().stats.cached_tokens == 6
    assert core.kv_pages_free + sched.kv_pages_cached == core.kv_pages_total


def _copy_sched(**kw) -> tuple[CopyCore, Scheduler]:
    core = CopyCore(**kw)
    eng = Engine.from_core(core, SimpleNamespace(vocab=core.vocab, eos_token_ids=[]), max_seq_len=512)
    return core, Scheduler(eng, prefix_cache=8)


def test_the_wait_for_a_prefix_in_flight():
    """A prompt sharing COPY_WAIT_TOKENS or more with one still in its prefill is admitted once that prefix ran,
    and copies it; one behind it sharing fewer is admitted meanwhile and prefills its own."""
    core, sched = _copy_sched(max_batch=4, page_size=4, pages=64, vocab=400)
    sched.chunk_tokens = 16
    p = list(range(1, 80))
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    assert COPY_WAIT_TOKENS == 32
    # the second waits while the first's prefill would give it 32 positions more than it could copy now: after
    # 48 of the 70 it shares (three chunks), it copies those and prefills the rest; the third, behind it, shares
    # 20 (under 32) with a prefill that has not begun, so it is admitted at once (slot 1) and prefills all of it
    got = _run(sched, [p, p[:70] + [90], p[:20] + [91]], [sp] * 3)
    assert [g.stats.cached_tokens for g in got] == [0, 48, 0]
    assert [e for e in core.log if e[0] == "copy"] == [("copy", 2, 0, 48)]
    assert core.log.index(("open", 1)) < core.log.index(("open", 2))
    short = p[:COPY_WAIT_TOKENS - 1] + [92]
    got = _run(sched, [[100 + t for t in p], [100 + t for t in short]], [sp] * 2)
    assert [g.stats.cached_tokens for g in got] == [0, 0]
    assert core.kv_pages_free + sched.kv_pages_cached == core.kv_pages_total


def test_a_copy_short_of_pages_rewinds_and_a_refused_copy_prefills():
    core, sched = _copy_sched(max_batch=4, page_size=4, pages=10, vocab=400)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    a = list(range(1, 30))
    _run(sched, [a], [sp])  # kept: 30 positions, 8 pages of the 10
    got = _run(sched, [a[:12] + [40, 41, 42]], [sp])[0]  # a copy needs 4 pages, 2 free: into the kept slot
    assert got.stats.cached_tokens == 12 and ("rewind", 0, 12) in core.log and not any(e[0] == "copy" for e in core.log)
    core, sched = _copy_sched(max_batch=4, page_size=4, pages=64, vocab=400)
    core.fail_copy = True  # refused (after the wait): the fresh slot prefills all of it
    reqs = [sched.submit([60 + i for i in range(40)], sp), sched.submit([60 + i for i in range(36)] + [1], sp)]
    sched.wait_idle()
    assert [r.result().stats.cached_tokens for r in reqs] == [0, 0] and len(reqs[1].result().token_ids) == 2
    assert core.kv_pages_free + sched.kv_pages_cached == core.kv_pages_total


def _plan_by_brute_force(sched, core, prompt):
    """PrefixCache.plan's rules, every candidate's common prefix computed in full (no O(1) filter)."""
    last, full = len(prompt) - 1, len(sched._running) + len(sched._cache) >= int(core.max_batch)
    plan, held_best = ("fresh", None, 0), 0
    for slot, held in sched._cache.kept.items():
        n = min(_common_prefix(held, prompt), last)
        if n > 0 and (2 * n >= len(held) or full):
            if n > plan[2] or (n == plan[2] and (plan[0] == "copy" or len(held) < held_best)):
                plan, held_best = ("rewind", slot, n), len(held)
        elif n > plan[2] and not full:
            plan = ("copy", slot, n)
    for seq in sched._running:
        n = min(_common_prefix((seq.prompt + seq.generated)[:seq.length], prompt), last)
        if n > plan[2]:
            plan = ("copy", seq.slot, n)
    ahead = max([min(_common_prefix(s.prompt, prompt), last) for s in sched._running if s.prefilling] + [0])
    return ("wait", None, 0) if ahead >= plan[2] + COPY_WAIT_TOKENS else plan


def test_the_plan_equals_its_brute_force():
    """PrefixCache.plan's O(1) test of each candidate changes nothing: random kept slots and running requests over a
    three-token alphabet (long common prefixes, ties), against every candidate's prefix computed in full."""
    core, sched = _copy_sched(max_batch=12, page_size=4, pages=4096)
    rng = np.random.default_rng(0)
    words = lambda n: rng.integers(0, 3, n).tolist()  # noqa: E731
    seen = set()
    for trial in range(3000):
        base = words(int(rng.integers(40, 90)))
        grow = lambda: base[:int(rng.integers(0, len(base) + 1))] + words(int(rng.integers(0, 40)))  # noqa: E731
        early = trial % 2  # (then the running prompts are early in their prefill, and fewer kept: waits)
        sched._cache.kept = OrderedDict((s, grow() or [1]) for s in range(int(rng.integers(0, 6 - 4 * early))))
        sched._running = []
        for s in range(6, 6 + int(rng.integers(0, 6))):
            prompt, gen = grow() or [2], [] if early else words(int(rng.integers(0, 8)))
            length = int(rng.integers(0, len(prompt) // (1 + 3 * early) + 1)) if not gen else \
                len(prompt) + int(rng.integers(0, len(gen)))
            sched._running.append(SimpleNamespace(slot=s, prompt=prompt, generated=gen, length=length,
                                                  prefilling=length < len(prompt) and not gen))
        prompt = grow() or [0]
        got = sched._cache.plan(prompt, sched._running, int(core.max_batch))
        assert got == _plan_by_brute_force(sched, core, prompt), trial
        seen.add(got[0])
    sched._cache.kept, sched._running = OrderedDict(), []
    assert seen == {"fresh", "rewind", "copy", "wait"}


def drain(sched: Scheduler, core) -> None:
    """Step until nothing is left (a fuzz's end): never stuck, and the pool's pages add up."""
    for _ in range(5000):
        if not sched.step():
            break
    else:
        raise AssertionError(f"stuck: running={sched.running} waiting={sched.waiting}")
    assert core.kv_pages_free + sched.kv_pages_cached == core.kv_pages_total


def _shared_sched(max_batch: int, pages: int, **kw) -> tuple[SharedPagesCore, Scheduler]:
    core = SharedPagesCore(max_batch=max_batch, page_size=4, pages=pages, vocab=60)
    eng = Engine.from_core(core, SimpleNamespace(vocab=60, eos_token_ids=[]), max_seq_len=512)
    return core, Scheduler(eng, overlap=False, mixed_steps=False, **kw)


def test_a_requeued_copy_gives_back_only_the_pages_it_held_alone():
    """Decode short of pages puts a request still in its prompt back in the queue; one admitted by a copy shares
    its first pages, so closing its slot frees fewer than its prompt's: the scheduler counts what the close freed
    (it had counted the prompt's pages, and the next step ran out of pages)."""
    core, sched = _shared_sched(4, 14, prefix_cache=1, chunk_tokens=4)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    reqs = [sched.submit(list(range(1, 17)), sp), sched.submit(list(range(20, 36)), sp)]
    for _ in range(11):
        sched.step()
    reqs += [sched.submit(list(range(1, 17)) + list(range(40, 45)), SamplingParams(max_tokens=1)),
             sched.submit(list(range(1, 17)) + [50], SamplingParams(max_tokens=1))]
    sched.wait_idle()
    for r in reqs:
        try:
            r.result()  # (an engine error here: a step the scheduler let run short of pages)
        except KvCacheFullError:
            pass
    assert core.kv_pages_free + sched.kv_pages_cached == core.kv_pages_total


def test_a_rewind_counts_the_pages_an_eviction_makes_its_own():
    """A kept slot to be rewound that shares pages with another kept slot: evicting the other makes those pages
    its own (the rewind frees more, copies nothing), so the need is asked again after each eviction (it had
    ended the request with a KvCacheFullError although the rewind fitted)."""
    core, sched = _shared_sched(2, 10, prefix_cache=2)
    x = list(range(1, 21))
    sched.submit(x, SamplingParams(max_tokens=5, ignore_eos=True))
    sched.step()
    sched.submit(x + list(range(30, 38)), SamplingParams(max_tokens=1, ignore_eos=True))  # copies 20: 5 pages shared
    sched.wait_idle()
    assert sorted(map(len, sched._cache.kept.values())) == [24, 28] and core.kv_pages_free == 2
    r3 = sched.submit(x[:13] + list(range(36, 58)), SamplingParams(max_tokens=1, ignore_eos=True))
    sched.wait_idle()
    assert r3.result().stats.cached_tokens == 13


@pytest.mark.parametrize("shared", [0, 1, 2], ids=["copied-pages", "shared-pages", "parked"])
@pytest.mark.parametrize("seed", range(24))
def test_traffic_with_copies_against_no_cache(seed, shared):
    """Random traffic on the test doubles with copies (CopyCore; SharedPagesCore, whose copies share pages as the
    engines' do; ParkingCore, whose kept caches are parked as the engines'): submits and cancels between steps, few slots and pages, every scheduling mode, copies refused in
    some runs. Every run drains (nothing waits forever), the pages add up, no write lands in a shared page, and
    each request that ran to its end sampled what it samples with the cache off (the double samples from what its
    cache holds, so a wrong copy or rewind changes the tokens)."""
    rng = np.random.default_rng(1000 + seed)
    pick = lambda xs: xs[int(rng.integers(0, len(xs)))]  # noqa: E731
    mb, pages, chunk, pc = pick([1, 2, 3, 4, 6]), pick([12, 20, 40, 200]), pick([4, 16, 48]), pick([1, 2, 8])
    overlap, mixed = pick([(True, True), (True, False), (False, False)])

    def make(prefix_cache):
        kind = [CopyCore, SharedPagesCore, ParkingCore][shared] if prefix_cache else CopyCore
        core = kind(max_batch=mb, page_size=4, pages=pages, vocab=60)
        eng = Engine.from_core(core, SimpleNamespace(vocab=60, eos_token_ids=[]), max_seq_len=512)
        return core, Scheduler(eng, prefix_cache=prefix_cache, overlap=overlap, mixed_steps=mixed, chunk_tokens=chunk)

    core, sched = make(pc)
    core.fail_copy = seed % 5 == 4
    history, live, seen = [rng.integers(0, 60, 100).tolist()], [], set()
    for _ in range(200):
        if rng.random() < 0.25 and len(live) < 12:
            h = pick(history)
            p = (h[:int(rng.integers(1, len(h) + 1))] + rng.integers(0, 60, int(rng.integers(0, 10))).tolist())
            p = p[:pages * 4 - 8]
            sp = SamplingParams(max_tokens=int(rng.integers(1, 8)), ignore_eos=True)
            live.append((sched.submit(p, sp), p, sp))
        elif rng.random() < 0.05 and live:
            pick(live)[0].cancel()
        sched.step()
        if shared == 2:  # the kept caches are exactly the core's parked sequences, and what only they hold is counted
            kept = list(sched._cache.kept)
            assert sorted(i for i in core.cache if i >= mb) == sorted(kept)
            assert all(core.cache[k] == sched._cache.kept[k] for k in kept)
            assert all(s.slot is None or s.slot < mb for s in sched._running)
            assert sched.kv_pages_cached == (core.kv_pages_held_by(kept) if kept else 0)
        for r, p, _ in live:  # (an answer that ran becomes a prefix a later prompt may extend)
            if r.finished and r._error is None and r.id not in seen:
                seen.add(r.id)
                history.append(p + r.result().token_ids)
    drain(sched, core)
    ref_core, ref = make(0)
    for r, p, sp in live:
        try:
            got = r.result()
        except KvCacheFullError as e:  # (refused with nothing running: so must it be without the cache)
            if "nothing running" in str(e):
                w = ref.submit(p, sp)
                ref.wait_idle()
                with pytest.raises(KvCacheFullError):
                    w.result()
            continue
        if got.finish_reason == "cancelled":
            continue
        w = ref.submit(p, sp)
        ref.wait_idle()
        try:
            want = w.result()
        except KvCacheFullError:
            continue
        assert got.token_ids == want.token_ids, (p, got.stats.cached_tokens)
    sched.reset_prefix_cache()
    assert core.kv_pages_free == core.kv_pages_total
