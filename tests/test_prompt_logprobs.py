"""vLLM's prompt_logprobs: Engine.prompt_logprobs (each prompt token's log-probability given the tokens before it,
the first None, and the top entries, ties to the lower id) against log_softmax of the engine's own logits(); the
same through SamplingParams(prompt_logprobs=k) on the first Delta and in the Completion, alone and in a batch."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_llama
from tinyinfer import Engine, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("plp") / "m", hidden=64, heads=2, kv_heads=2, layers=1, vocab=150,
                      init_std=0.3)


@pytest.fixture(scope="module")
def eng(model_dir):
    with Engine(model_dir, device="cpu", max_seq_len=512) as e:
        yield e


def log_softmax(row):
    x = row.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


PROMPT = list(range(3, 140))  # (more than one block of 64 rows)


def test_prompt_logprobs_are_log_softmax_of_the_logits(eng):
    out = eng.prompt_logprobs(PROMPT, 3)
    logits = eng.logits(PROMPT)
    assert len(out) == len(PROMPT) and out[0] is None
    for i in (1, 2, 64, 65, len(PROMPT) - 1):
        row = log_softmax(logits[i - 1])
        assert out[i].token_id == PROMPT[i] and out[i].logprob == pytest.approx(row[PROMPT[i]], abs=1e-9)
        order = np.lexsort((np.arange(row.size), -row))[:3]
        assert [t for t, _ in out[i].top] == order.tolist()
        assert [v for _, v in out[i].top] == pytest.approx(row[order].tolist(), abs=1e-9)
    assert all(not x.top for x in eng.prompt_logprobs(PROMPT[:5], 0)[1:])
    assert eng.prompt_logprobs([7], 2) == [None]


def test_ties_go_to_the_lower_id():
    from types import SimpleNamespace

    logits = np.zeros((2, 10), np.float32)
    logits[0, [2, 5, 7]] = 1.0
    fake = SimpleNamespace(_prompt_ids=lambda ids: list(ids), logits=lambda ids: logits)
    out = Engine.prompt_logprobs(fake, [0, 5], 2)
    assert [t for t, _ in out[1].top] == [2, 5]


def test_through_sampling_params_alone_and_in_a_batch(eng):
    want = eng.prompt_logprobs(PROMPT[:20], 2)
    sp = SamplingParams(max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    alone = eng.generate(PROMPT[:20], sp)
    batch = eng.generate([PROMPT[:20], PROMPT[:7]], sp)
    for c in (alone, batch[0]):
        assert c.prompt_logprobs[0] is None
        assert [(x.token_id, x.logprob, x.top) for x in c.prompt_logprobs[1:]] == [
            (x.token_id, x.logprob, x.top) for x in want[1:]]
    assert len(batch[1].prompt_logprobs) == 7
    req = eng.scheduler.submit(PROMPT[:20], sp)
    deltas = list(req)
    assert deltas[0].prompt_logprobs is not None and all(d.prompt_logprobs is None for d in deltas[1:])
    assert eng.generate(PROMPT[:20], SamplingParams(max_tokens=2)).prompt_logprobs is None
    one = eng.generate(PROMPT[:20], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert len(one.prompt_logprobs) == 20  # (max_tokens 1: the first Delta is the last)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be None or an integer in 0..20"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.parametrize("mixed", [False, True])
def test_scored_in_the_requests_own_prefill(model_dir, mixed):
    """The scheduler computes them from the request's own prefill (every row's logits, SCORE_ROWS a call, within
    chunk_tokens a step): a prompt over several calls and steps, beside a running request (mixed steps or not),
    after a request that left the same prefix in the prefix cache (not taken from it: the rows' logits are
    needed) — the same values as Engine.prompt_logprobs, and the answer the same as without them."""
    from tinyinfer import Scheduler
    from tinyinfer.scheduler import SCORE_ROWS

    prompt = [3 + (i * 7) % 140 for i in range(SCORE_ROWS + 150)]
    eng = Engine(model_dir, device="cpu", max_seq_len=512)
    want = eng.prompt_logprobs(prompt, 1)
    sched = Scheduler(eng, chunk_tokens=200, mixed_steps=mixed, prefix_cache=2)
    try:
        first = sched.submit(prompt, SamplingParams(max_tokens=2, ignore_eos=True)).result()  # (kept: its prefix)
        other = sched.submit(PROMPT[:30], SamplingParams(max_tokens=40, ignore_eos=True))
        scored = sched.submit(prompt, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1))
        got = scored.result()
        assert other.result().finish_reason == "length"
    finally:
        sched.close()
        eng.close()
    assert got.token_ids == first.token_ids and got.stats.cached_tokens == 0
    assert len(got.prompt_logprobs) == len(prompt) and got.prompt_logprobs[0] is None
    for g, w in zip(got.prompt_logprobs[1:], want[1:]):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]


def test_scored_under_a_trace_and_cut_short(model_dir):
    """A traced scheduler (Scheduler(trace=...)'s wrapped core) scores too, its seq_prefill calls in the trace; a
    request cancelled before its prompt is scored has no prompt_logprobs (rather than part of them)."""
    from tinyinfer import Scheduler
    from tinyinfer.trace import Trace

    prompt = list(range(3, 140)) * 3
    eng = Engine(model_dir, device="cpu", max_seq_len=512)
    trace = Trace()
    sched = Scheduler(eng, trace=trace, chunk_tokens=64)
    try:
        got = sched.submit(prompt, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=0)).result()
        assert len(got.prompt_logprobs) == len(prompt)
        assert sum(1 for c in trace.calls if c[0] == "seq_prefill") >= len(prompt) // 64
    finally:
        sched.close()
    sched = Scheduler(eng, chunk_tokens=64)  # (stepped here: no driver thread)
    try:
        req = sched.submit(prompt, SamplingParams(max_tokens=2, prompt_logprobs=0))
        sched.step()
        assert sched.running == 1 and 0 < len(sched._running[0].prompt_logprobs) < len(prompt)  # (part scored)
        req.cancel()
        sched.step()
        done = req.result(timeout=60)
        assert done.finish_reason == "cancelled" and done.prompt_logprobs is None
    finally:
        sched.close()
        eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [{}, {"prefill_chunk": 64}, {"batched_prefill": False}],
                         ids=["default", "chunks-of-64", "token-by-token"])
def test_scored_on_the_gpu(model_dir, eng, opts):
    """The GPU engine's seq_prefill(all_logits=True): the prefill chunks' LM-head GEMM over every row (one chunk a
    call, or several within a call: rows at their offsets), or without the batched prefill each token's logits
    row copied out — the CPU reference's prompt logprobs within fp16's tolerance, over several calls."""
    from tinyinfer import _core
    from tinyinfer.scheduler import SCORE_ROWS

    prompt = [3 + (i * 5) % 140 for i in range(SCORE_ROWS + 40)]
    want = eng.prompt_logprobs(prompt, 0)  # (the CPU engine, fp32)
    o = _core.CudaOptions()
    for k, v in opts.items():
        setattr(o, k, v)
    with Engine(model_dir, device="cuda", max_seq_len=512, cuda_options=o) as e:
        got = e.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=0))
    assert len(got.prompt_logprobs) == len(prompt) and got.prompt_logprobs[0] is None
    for g, w in zip(got.prompt_logprobs[1:], want[1:]):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=0.05)


def test_echo_without_a_tokenizer_is_refused(eng):
    """A model without a tokenizer has no text to echo: 400 naming echo (before anything runs); the server goes on."""
    import asyncio

    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from tinyinfer import Scheduler
    from tinyinfer.server.app import create_app

    assert eng.tokenizer is None
    if eng._scheduler is not None:
        eng._scheduler.close()
    sched = Scheduler(eng)
    app = create_app(eng, sched, model_name="m")

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
                bad = await h.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "echo": True})
                ok = await h.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
                return bad, ok

    try:
        bad, ok = asyncio.run(main())
    finally:
        sched.close()
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo"
    assert ok.status_code == 200
