"""Random traffic on the scheduler's test doubles with pools small enough that decode steps run out of KV pages
and preempt (Scheduler(preempt=True)): each request's tokens, streamed and in its completion, equal a run on a pool
large enough that nothing is preempted (the samples of the `Counter` doubles depend on the step counter too, so a
resumed request sampling at a wrong counter changes them); every run drains and its pages add up. Every double
(FakeCore, PlainCore, CopyCore, SharedPagesCore; with seq_sample_mixed or not), overlap / mixed modes, the prefix
cache on and off, stop ids, logprobs, presence penalties (which end rather than preempt) and cancels."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from test_prefix_cache import CopyCore, SharedPagesCore, drain
from test_scheduler import FakeCore, PlainCore
from tinyinfer.engine import Engine
from tinyinfer.errors import KvCacheFullError, TinyInferError
from tinyinfer.request import merge_deltas
from tinyinfer.sampling import SamplingParams
from tinyinfer.scheduler import Scheduler


class Counter:
    """Samples depend on the step counter too (the seeded sampler's does): a wrong counter changes the token."""

    def seq_sample(self, slots, cfgs, steps, k):
        toks, lps, ids, tlps = super().seq_sample(slots, cfgs, steps, k)
        toks = np.array([(int(t) + 13 * int(c)) % self.vocab for t, c in zip(toks, steps)], np.int32)
        return toks, lps, ids, tlps


class MixedSample:
    """seq_sample_mixed as docs/BATCH_CONTRACT.md says: seq_sample, then seq_mixed of the go_on rows (their tokens,
    whatever they are) and the prompts; refused: nothing launched, the sample stands."""

    def seq_sample_mixed(self, slots, cfgs, steps, k, go_on, pslots, prompts):
        toks, lps, ids, tlps = self.seq_sample(slots, cfgs, steps, k)
        rows = [i for i in range(len(slots)) if go_on[i]]
        stepped = np.zeros(len(slots), np.uint8)
        ran = False
        try:
            self.seq_mixed([slots[i] for i in rows], [int(toks[i]) for i in rows], list(pslots), list(prompts))
            stepped[rows] = 1
            ran = True
        except TinyInferError:
            pass
        return toks, lps, ids, tlps, stepped, 0.0, ran


def _kind(base, counter, mixed_sample):
    bases = ((Counter,) if counter else ()) + ((MixedSample,) if mixed_sample else ()) + (base,)
    return type("C", bases, {})


def _traffic(seed):
    rng = np.random.default_rng(5000 + seed)
    pick = lambda xs: xs[int(rng.integers(0, len(xs)))]  # noqa: E731
    base = pick([FakeCore, PlainCore, CopyCore, SharedPagesCore])
    mb, pages, chunk = pick([2, 3, 4, 6]), pick([8, 10, 14, 20]), pick([4, 8, 16, 48])
    overlap, mixed = pick([(True, True), (True, False), (False, False)])
    counter, ms = bool(rng.integers(0, 2)), bool(rng.integers(0, 2))
    pc = pick([0, 1, 4]) if base in (CopyCore, SharedPagesCore) else None
    kind = _kind(base, counter, ms)

    def make(pages_):
        core = kind(max_batch=mb, page_size=4, pages=pages_, vocab=60)
        eng = Engine.from_core(core, SimpleNamespace(vocab=60, eos_token_ids=[]), max_seq_len=512)
        kw = {} if pc is None else {"prefix_cache": pc}
        return core, Scheduler(eng, overlap=overlap, mixed_steps=mixed, chunk_tokens=chunk, **kw)

    core, sched = make(pages)
    history, live = [rng.integers(0, 60, 40).tolist()], []
    for _ in range(150):
        if rng.random() < 0.3 and len(live) < 16:
            h = pick(history)
            p = h[:int(rng.integers(1, len(h) + 1))] + rng.integers(0, 60, int(rng.integers(0, 6))).tolist()
            p = p[:pages * 4 - 12]
            sp = SamplingParams(max_tokens=int(rng.integers(1, 30)), ignore_eos=True, seed=int(rng.integers(0, 9)),
                                temperature=0.7,
                                stop_token_ids=[int(rng.integers(0, 60))] if rng.random() < 0.3 else [],
                                logprobs=1 if rng.random() < 0.3 else None,
                                presence_penalty=0.5 if rng.random() < 0.15 else 0.0)
            live.append((sched.submit(p, sp), p, sp))
            history.append(p)
        elif rng.random() < 0.04 and live:
            pick(live)[0].cancel()
        sched.step()
    drain(sched, core)
    m = sched.metrics()
    ref_core, ref = make(400)
    desc = dict(base=base.__name__, mb=mb, pages=pages, chunk=chunk, overlap=overlap, mixed=mixed, counter=counter,
                ms=ms, pc=pc)
    for r, p, sp in live:
        items = r.pending()
        deltas = [d for d in items if not isinstance(d, BaseException)]
        try:
            got = r.result()
        except KvCacheFullError as e:
            got = e.completion
        streamed = merge_deltas(deltas).token_ids if deltas else []
        assert streamed == got.token_ids, (desc, p, streamed, got.token_ids)
        if got.logprobs is not None:
            assert len(got.logprobs) == len(got.token_ids)
        want = ref.submit(p, sp).result()
        if got.finish_reason == "cancelled" or isinstance(r._error, KvCacheFullError):
            assert got.token_ids == want.token_ids[:len(got.token_ids)], (desc, p, got.token_ids, want.token_ids)
        else:
            assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason, \
                (desc, p, got.token_ids, want.token_ids)
        assert got.stats.cached_tokens <= len(p) and got.stats.prefill_ms >= 0
    return m["preemptions"]


def test_traffic_that_preempts_gives_the_tokens_of_a_pool_that_does_not():
    preemptions = 0
    for seed in range(40):  # (600 seeds passed once; 40 here, ~1 s)
        preemptions += _traffic(seed)
    assert preemptions > 40  # (most seeds preempt: the pools are small)
