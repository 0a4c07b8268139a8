"""Streams whose chunks carry several tokens (the server merges the Deltas ready at once, and at a stream interval
wakes a stream once per that many tokens): the pieces must still join to the whole text, the logprobs entries
come in order and the legacy text_offset counts on. The real app in-process (httpx's ASGI transport) over the
scheduler tests' pure-Python fake core, with a one-character-per-token tokenizer and a logprob per position, so
text and logprobs are exact and any loss or reordering shows. Also: the adaptive interval's growth with the
batch, and the scheduler's prompt-token budget by device."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest

from test_scheduler import FakeCore
from tinyinfer import Engine, InvalidRequestError, SamplingParams, Scheduler
from tinyinfer.scheduler import Delta, TokenLogprob, merge_deltas

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tinyinfer.server.app import create_app  # noqa: E402

MAX_TOKENS = 23


class LogprobCore(FakeCore):
    """FakeCore whose chosen token's logprob is -(cache length) / 100: each position's own value."""

    def seq_sample(self, slots, cfgs, steps, k):
        toks, _, ids, lps = super().seq_sample(slots, cfgs, steps, k)
        return toks, np.array([-len(self.cache[s]) / 100 for s in slots], np.float32), ids, lps


class CharTokenizer:
    """Token t is one letter (every 5th a space): text has exactly one character per generated token."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(" " if t % 5 == 0 else chr(ord("a") + t % 26) for t in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 50 for c in text]

    def token_bytes(self, t: int) -> bytes:
        return self.decode([t]).encode()

    chat_template = "each message's content, concatenated"

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))


def _app(stream_interval):
    core = LogprobCore(max_batch=8, page_size=4, pages=512)
    eng = Engine.from_core(core, SimpleNamespace(vocab=core.vocab, eos_token_ids=[]), max_seq_len=512,
                           tokenizer=CharTokenizer())
    sched = Scheduler(eng)
    return create_app(eng, sched, model_name="fake", stream_interval=stream_interval), sched


def _events(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    assert text.rstrip().endswith("data: [DONE]")
    return out


async def _answers(app, bodies: list[dict]) -> list:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        async def one(body):
            r = await client.post(f"/v1/{'chat/completions' if 'messages' in body else 'completions'}", json=body)
            assert r.status_code == 200, r.text
            return _events(r.text) if body.get("stream") else r.json()

        return await asyncio.gather(*(one(b) for b in bodies))


def _run(interval, bodies):
    app, sched = _app(interval)
    try:
        return asyncio.run(_answers(app, bodies))
    finally:
        sched.close()


def _completion_bodies(stream: bool) -> list[dict]:
    return [{"prompt": list(range(1 + i, 9 + 2 * i)), "max_tokens": MAX_TOKENS, "logprobs": 2, "stream": stream,
             "stop": ["zz"]} for i in range(4)]


@pytest.mark.parametrize("interval", [1, 3, 7, None])
def test_completion_stream_chunks_join_to_the_whole_answer(interval):
    whole = _run(1, _completion_bodies(stream=False))
    streams = _run(interval, _completion_bodies(stream=True))
    for ref, events in zip(whole, streams):
        ref_choice = ref["choices"][0]
        pieces = [e["choices"][0] for e in events]
        lps = [p["logprobs"] for p in pieces if p["logprobs"]]
        assert "".join(p["text"] for p in pieces) == ref_choice["text"]
        assert [t for lp in lps for t in lp["tokens"]] == ref_choice["logprobs"]["tokens"]
        assert [x for lp in lps for x in lp["token_logprobs"]] == ref_choice["logprobs"]["token_logprobs"]
        assert [x for lp in lps for x in lp["text_offset"]] == ref_choice["logprobs"]["text_offset"]
        assert pieces[-1]["finish_reason"] == ref_choice["finish_reason"] == "length"
        text_chunks = [p for p in pieces if p["finish_reason"] is None]
        if interval is not None and interval > 1:  # the merging path was taken: fewer chunks than tokens
            assert len(text_chunks) <= MAX_TOKENS // interval + 2


@pytest.mark.parametrize("interval", [1, 4])
def test_chat_stream_logprobs_in_order(interval):
    bodies = [{"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS, "logprobs": True,
               "top_logprobs": 1, "stream": stream, "n": 2, "seed": 3} for stream in (False, True)]
    app_whole, app_stream = _run(1, bodies[:1])[0], _run(interval, bodies[1:])[0]
    for ref in app_whole["choices"]:
        i = ref["index"]
        pieces = [c for e in app_stream for c in e["choices"] if c["index"] == i]
        assert pieces[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(p["delta"].get("content", "") for p in pieces) == ref["message"]["content"]
        got = [x for p in pieces if p["logprobs"] for x in p["logprobs"]["content"]]
        assert got == ref["logprobs"]["content"]
        assert [x["logprob"] for x in got] == sorted(x["logprob"] for x in got)[::-1]  # one per position, in order


def test_merge_deltas_keeps_order():
    lp = [TokenLogprob(i, -i / 10) for i in range(4)]
    ds = [Delta("ab", [0], [lp[0]]), Delta("", [1], [lp[1]]), Delta("c", [2, 3], lp[2:])]
    m = merge_deltas(ds)
    assert (m.text, m.token_ids, [x.token_id for x in m.logprobs], m.completion) == ("abc", [0, 1, 2, 3],
                                                                                   [0, 1, 2, 3], None)
    assert merge_deltas([Delta("x", [5], None), Delta("y", [6], None)]).logprobs is None


def test_bad_stream_interval_is_refused():
    core = FakeCore()
    eng = Engine.from_core(core, SimpleNamespace(vocab=core.vocab, eos_token_ids=[]), max_seq_len=512)
    sched = Scheduler(eng)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidRequestError, match="stream_interval"):
            create_app(eng, sched, model_name="fake", stream_interval=bad)
    req = sched.submit([1, 2, 3])

    async def consume(every):
        async for _ in req.batches(every):
            pass

    for bad in (0, 2.0, False):
        with pytest.raises(InvalidRequestError, match="every"):
            asyncio.run(consume(bad))
    sched.close()


def test_adaptive_interval_grows_with_the_batch():
    core = FakeCore(max_batch=64, pages=1024)
    sched = Scheduler(Engine.from_core(core, SimpleNamespace(vocab=core.vocab, eos_token_ids=[]), max_seq_len=512))
    assert sched.adaptive_interval() == 1
    seen = []
    for n in (16, 1, 47):  # running: 16, 17, 64
        for _ in range(n):
            sched.submit([1, 2, 3], SamplingParams(max_tokens=100))
        sched.step()
        seen.append((sched.running, sched.adaptive_interval()))
    assert seen == [(16, 1), (17, 2), (64, 4)]
    sched.close()


def test_chunk_tokens_default_by_device():
    class GpuCore(FakeCore):
        device_name = "fake GPU"

    for core, want in ((FakeCore(), 512), (GpuCore(), 2048)):
        eng = Engine.from_core(core, SimpleNamespace(vocab=core.vocab, eos_token_ids=[]), max_seq_len=512)
        assert Scheduler(eng).chunk_tokens == want
        eng.close()
    assert Scheduler(Engine.from_core(FakeCore(), SimpleNamespace(vocab=50, eos_token_ids=[]), max_seq_len=512),
                     chunk_tokens=7).chunk_tokens == 7


def test_metrics_without_prometheus_client_is_a_501(monkeypatch):
    """GET /metrics needs the serve extra's prometheus_client; without it the route answers 501 naming it, and the
    rest of the server serves on."""
    import importlib.util

    app, sched = _app(None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prometheus_client"
                        else real(name, *a))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            r = await client.get("/metrics")
            assert r.status_code == 501 and "prometheus_client" in r.json()["error"]["message"], r.text
            assert (await client.get("/health")).status_code == 200

    try:
        asyncio.run(go())
    finally:
        sched.close()
