"""The GPU engine's seq_prefill_many (cpp/gpu/cuda_engine_slots.cu; PrefillStep::run_many: one pass over the
concatenated prompts, RoPE and the cache write per token, the varlen attention of cuda/prefill_attention.cu):
each slot's logits within the batched path's tolerance of seq_prefill one at a time and the same greedy tokens
after it, on head_dim 64 / 128 and GQA groups 1 / 4; prompts spanning two passes (a small prefill_chunk);
a chunk continuing a prompt; a pool too small is a Request error that changes nothing. Skipped without a
usable CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu_batch import LOGIT_TOL, MAX_SEQ, VOCAB, gpu_engine, greedy, options
from test_gpu_batch import drop_engines, model  # noqa: F401 (fixtures)
from tinyinfer import Engine, InvalidRequestError, _core

pytestmark = pytest.mark.gpu


def _chunks(seed=0):
    """Prompts of 1, 7, 128, 64 and 200 tokens, and a prompt's second chunk (90 tokens after 50)."""
    rng = np.random.default_rng(seed)
    ps = [rng.integers(3, VOCAB, n).tolist() for n in (1, 7, 128, 64, 200, 140)]
    return ps[:5], ps[5][:50], ps[5][50:]


def _run(core, many: bool, steps=6):
    """Slots prefilled one at a time or in one call; their logits, then `steps` greedy tokens of all of them
    stepped together. The slots are closed again."""
    ps, head, rest = _chunks()
    slots = [core.seq_open() for _ in range(len(ps) + 1)]
    core.seq_prefill(slots[-1], head)
    if many:
        core.seq_prefill_many(slots, ps + [rest])
    else:
        for s, p in zip(slots, ps + [rest]):
            core.seq_prefill(s, p)
    assert [core.seq_length(s) for s in slots] == [len(p) for p in ps] + [len(head) + len(rest)]
    logits = [core.seq_logits(s).copy() for s in slots]
    toks = []
    for i in range(steps):
        t, _, _, _ = core.seq_sample(slots, [greedy()] * len(slots), [i] * len(slots), 0)
        toks.append(t.tolist())
        core.seq_step(slots, t.tolist())
    for s in slots:
        core.seq_close(s)
    return logits, toks


def _check(want, got, fmt):
    for i, (a, b) in enumerate(zip(want[0], got[0])):
        scale = float(np.abs(a).max())
        np.testing.assert_allclose(b, a, rtol=0, atol=LOGIT_TOL[fmt] * scale, err_msg=f"slot {i}")
    assert got[1] == want[1]


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_many_prompts_match_one_at_a_time(model, fmt):
    core = gpu_engine(model, fmt)._core
    free = core.kv_pages_free
    _check(_run(core, many=False), _run(core, many=True), fmt)
    assert core.kv_pages_free == free


@pytest.mark.parametrize("chunk", [100, 333])
def test_prompts_spanning_passes(model, chunk):
    """prefill_chunk 100 / 333: the prompts' tokens (590 in all) take several passes, prompts cut between them
    at arbitrary rows (a continuation starting mid-page), a pass holding the ends and starts of several."""
    core = gpu_engine(model, "fp16", prefill_chunk=chunk)._core
    _check(_run(core, many=False), _run(core, many=True), "fp16")


def test_pool_too_small_changes_nothing(model):
    """A pool of 4 pages of 64: prompts that need more in all are refused before anything runs (no slot
    grows), and the engine then prefills what fits, the same as one at a time."""
    eng = Engine(model[1], device="cuda", max_seq_len=MAX_SEQ, cuda_options=options(kv_pool_pages=4, max_batch=4))
    core = eng._core
    ps, _, _ = _chunks(seed=2)
    a, b, c = core.seq_open(), core.seq_open(), core.seq_open()
    with pytest.raises(InvalidRequestError, match="pool exhausted"):
        core.seq_prefill_many([a, b, c], [ps[2], ps[4], ps[0]])  # 2 + 4 + 1 pages
    assert [core.seq_length(s) for s in (a, b, c)] == [0, 0, 0] and core.kv_pages_free == 4
    for call, msg in [
        (lambda: core.seq_prefill_many([a, a], [[1], [2]]), "listed twice"),
        (lambda: core.seq_prefill_many([a, b], [[1]]), "2 slots but 1 prompts"),
        (lambda: core.seq_prefill_many([a, b], [[1], []]), "empty"),
        (lambda: core.seq_prefill_many([a, b], [[1], [VOCAB]]), "out of range"),
        (lambda: core.seq_prefill_many([a, 7], [[1], [2]]), "does not exist"),
        (lambda: core.seq_prefill_many([a, b], [[1], [1] * (MAX_SEQ + 1)]), "max_seq_len"),
    ]:
        with pytest.raises(InvalidRequestError, match=msg):
            call()
        assert core.kv_pages_free == 4
    core.seq_prefill_many([a, c], [ps[2], ps[0]])
    many = [core.seq_logits(s).copy() for s in (a, c)]
    core.seq_close(a)
    core.seq_close(c)
    for p, m in zip((ps[2], ps[0]), many):  # each alone in a fresh slot
        s = core.seq_open()
        core.seq_prefill(s, p)
        np.testing.assert_allclose(m, core.seq_logits(s), rtol=0, atol=LOGIT_TOL["fp16"] * float(np.abs(m).max()))
    eng.close()


def test_scheduler_batched_prefill_matches_one_call_each(model):
    """The same greedy tokens through the scheduler with its prompts in one call per step and one call each."""
    from tinyinfer import SamplingParams, Scheduler

    ps, _, _ = _chunks(seed=5)
    out = []
    for batched in (False, True):
        eng = Engine(model[1], device="cuda", max_seq_len=MAX_SEQ, cuda_options=options())
        sched = Scheduler(eng, batched_prefill=batched, chunk_tokens=256)
        reqs = [sched.submit(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in ps]
        out.append([r.result().token_ids for r in reqs])
        sched.close()
        eng.close()
    assert out[0] == out[1]


@pytest.mark.parametrize("call", ["seq_prefill", "seq_prefill_many", "seq_mixed"])
@pytest.mark.parametrize("chunk", [0, 100])
def test_prompt_tokens_join_the_penalty_history(model, call, chunk):
    """The prompt's tokens are in the repetition-penalty history however it was prefilled (one call or many, one
    pass or several: prefill_chunk 100 cuts these 300-token prompts into passes): with a penalty of 1e6 greedy
    never picks a prompt token (nor one picked before). The prompts cover ~25% of the vocabulary, so 12 picks
    that ignored the prompt would land in it with probability 1 - 0.75^12 ~ 97% each."""
    core = gpu_engine(model, "fp16", **({"prefill_chunk": chunk} if chunk else {}))._core
    rng = np.random.default_rng(21)
    ps = [rng.integers(3, VOCAB, 300).tolist() for _ in range(2)]
    slots = [core.seq_open() for _ in ps]
    other = core.seq_open()
    core.seq_prefill(other, ps[0][:7])
    if call == "seq_prefill":
        for s, p in zip(slots, ps):
            core.seq_prefill(s, p)
    elif call == "seq_prefill_many":
        core.seq_prefill_many(slots, ps)
    else:
        core.seq_mixed([other], [5], slots, ps)
    pen = _core.SamplingConfig()
    pen.repetition_penalty = 1e6
    seen = [set(p) for p in ps]
    for k in range(12):
        toks, _, _, _ = core.seq_sample(slots, [pen] * len(slots), [k] * len(slots), 0)
        for i, t in enumerate(toks.tolist()):
            assert t not in seen[i], f"step {k}: slot {i} picked {t}, a token of its history"
            seen[i].add(t)
        core.seq_step(slots, toks.tolist())
    for s in slots + [other]:
        core.seq_close(s)
