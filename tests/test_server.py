"""`tinyinfer serve` end to end: the real server process on a loopback port, the real default model (SmolLM2-135M
GGUF) on the CPU engine, driven with the official openai client (sync, async, streaming) and httpx. Answers are
compared with the in-process Engine on the same inputs; errors with OpenAI's status codes and shape."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "test-key"
NAME = "smol"
CHAT = [{"role": "user", "content": "Name three colors."}]
MAX_SEQ = 512
STARTUP_S = 180  # loading on a busy 2-core machine; a deadline for a wait, not a timed assertion


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `tinyinfer serve` process; its stderr goes to a file (the per-request log lines are read from it)."""

    def __init__(self, model: Path, tmp: Path, *extra: str, device: str = "cpu", session: bool = False):
        """session: in a process group of its own (a test may signal the whole group)."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"serve-{self.port}.log"
        cmd = [sys.executable, "-m", "tinyinfer", "serve", "--model", str(model), "--device", device,
               "--port", str(self.port), "--served-model-name", NAME, "--max-seq-len", str(MAX_SEQ), *extra]
        env = {**os.environ, "TINYINFER_API_KEY": KEY, "PYTHONUNBUFFERED": "1"}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=session)
        deadline = time.monotonic() + STARTUP_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the server did not answer /health in {STARTUP_S} s:\n{self.log()}")
            time.sleep(0.3)

    def log(self) -> str:
        return self.log_path.read_text()

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_idle(self, timeout: float = 60) -> dict:
        """/health once nothing runs or waits (a deadline for the wait; the caller asserts on the state)."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() > deadline:
                return h
            time.sleep(0.1)

    def stop(self, sig=signal.SIGINT, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# the HTTP app in the engine's process, or in two API worker processes of its own
WORKERS = {"in-process": ("--api-workers", "1"), "2-workers": ("--api-workers", "2")}


@pytest.fixture(scope="module", params=list(WORKERS))
def server(request, smollm_gguf, tmp_path_factory):
    """Every test on the module's server runs against both: the app in the engine's process, and two API worker
    processes linked to it (server/workers.py)."""
    srv = Server(smollm_gguf, tmp_path_factory.mktemp("serve"), *WORKERS[request.param])
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def ref(smollm_gguf):
    """The in-process reference engine (its own CPU engine over the same file)."""
    from tinyinfer import Engine

    with Engine(smollm_gguf, device="cpu", max_seq_len=MAX_SEQ, progress=False) as eng:
        yield eng


def _log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    m = row.max()
    return row - m - np.log(np.exp(row - m).sum())


# ---- answers equal the engine's ----


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    h = server.health()
    assert h["status"] == "ok" and h["kv_pages_total"] > 0
    assert {"running", "waiting", "kv_pages_used"} <= set(h)


def _metrics(server) -> dict:
    """GET /metrics parsed with prometheus_client's own parser: {(sample name, labels without the model's): value}."""
    parser = pytest.importorskip("prometheus_client.parser")  # (the test extra's; a bare GPU host may lack it)
    text_string_to_metric_families = parser.text_string_to_metric_families

    r = httpx.get(f"{server.url}/metrics", timeout=10)  # (open, as /health: no API key)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:200]
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for smp in fam.samples:
            assert smp.labels.pop("model_name") == NAME
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def test_metrics_count_what_was_served(client, server):
    """GET /metrics (Prometheus): the gauges of /health, and counters and histograms that grow by exactly what one
    request served (its finish reason, tokens in, cached and out, one time to first token, one request time)."""
    server.wait_idle()
    before = _metrics(server)
    r = client.completions.create(model=NAME, prompt="Counting: one, two,", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    server.wait_idle()
    after = _metrics(server)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
    assert delta[("tinyinfer_requests_total", (("finished_reason", "length"),))] == 1
    assert sum(v for (name, _), v in delta.items() if name == "tinyinfer_requests_total") == 1
    assert delta[("tinyinfer_prompt_tokens_total", ())] == r.usage.prompt_tokens
    assert delta[("tinyinfer_prompt_tokens_cached_total", ())] == cached
    assert delta[("tinyinfer_generation_tokens_total", ())] == r.usage.completion_tokens == 5
    assert delta[("tinyinfer_num_preemptions_total", ())] == 0  # (the CPU's pages never run out)
    for h in ("tinyinfer_time_to_first_token_seconds", "tinyinfer_e2e_request_latency_seconds"):
        assert delta[(h + "_count", ())] == 1 and delta[(h + "_sum", ())] > 0
        assert delta[(h + "_bucket", (("le", "+Inf"),))] == 1
    assert after[("tinyinfer_requests_running", ())] == 0 and after[("tinyinfer_kv_pages_capacity", ())] > 0


def test_a_chats_next_turn_is_prefilled_from_the_cache(client, ref, server):
    """The prefix cache: the next turn's prompt starts with the last one and its answer, so only the rest is
    prefilled (usage.prompt_tokens_details.cached_tokens, as OpenAI reports it), and the answer is the engine's."""
    first = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0)
    turn2 = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "And after that?"}]
    r = client.chat.completions.create(model=NAME, messages=turn2, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == ref.chat(turn2, max_tokens=12).text
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < r.usage.prompt_tokens
    deadline = time.monotonic() + 10  # (the log line: its cached tokens too)
    while f"{r.usage.prompt_tokens} tokens in ({cached} cached)" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"{r.usage.prompt_tokens} tokens in ({cached} cached), {r.usage.completion_tokens} out" in server.log()


def test_chat_greedy_equals_engine_chat(client, ref, server):
    want = ref.chat(CHAT, max_tokens=12)
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.object == "chat.completion" and r.model == NAME
    assert r.usage.prompt_tokens == len(ref.apply_chat_template(CHAT)) == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the per-request log line: id, tokens in / out, time to first token, tok/s
    deadline = time.monotonic() + 10
    while r.id not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(x for x in server.log().splitlines() if r.id in x)
    # (" (N cached)" where the prefix cache held part of the prompt: an earlier test's chat shares its start)
    cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
    assert re.search(rf"\b{r.usage.prompt_tokens} tokens in{f' [(]{cached} cached[)]' if cached else ''}, "
                     rf"{r.usage.completion_tokens} out", line), (line, cached)
    assert "ttft" in line and "tok/s" in line


def test_max_completion_tokens_is_max_tokens(client, ref):
    want = ref.chat(CHAT, max_tokens=5)
    r = client.chat.completions.create(model=NAME, temperature=0, messages=CHAT, max_completion_tokens=5)
    assert r.choices[0].message.content == want.text and r.usage.completion_tokens == len(want.token_ids)


def test_completion_greedy_equals_engine_generate(client, ref):
    prompt = "The capital of France is"
    want = ref.generate(prompt, max_tokens=10)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(ref.tokenize(prompt)) and r.usage.completion_tokens == len(want.token_ids)
    ids = ref.tokenize("Once upon a time")  # a prompt given as token ids
    r = client.completions.create(model=NAME, temperature=0, prompt=ids, max_tokens=6)
    assert r.choices[0].text == ref.generate(ids, max_tokens=6).text and r.usage.prompt_tokens == len(ids)


def test_completion_default_max_tokens_is_16(client, ref):
    r = client.completions.create(model=NAME, prompt="One, two, three,", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_several_prompts_each_their_choice(client, ref):
    prompts = ["The sky is", "Water is"]
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=4, n=2, seed=3, temperature=0.9)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        want = ref.generate(prompts[c.index // 2], max_tokens=4, seed=3 + c.index % 2, temperature=0.9)
        assert c.text == want.text
    assert r.usage.prompt_tokens == sum(len(ref.tokenize(p)) for p in prompts)  # each prompt counted once


def test_stream_joins_to_the_text(client, ref):
    want = ref.chat(CHAT, max_tokens=12)
    chunks = list(client.chat.completions.create(model=NAME, temperature=0, messages=CHAT, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    # completions: pieces join to the non-streamed text
    prompt = "The capital of France is"
    pieces = [c.choices[0].text for c in client.completions.create(model=NAME, temperature=0, prompt=prompt,
                                                                   max_tokens=10, stream=True) if c.choices]
    assert "".join(pieces) == ref.generate(prompt, max_tokens=10).text


def test_stop_strings(client, ref):
    full = ref.chat(CHAT, max_tokens=16).text
    word = full.split()[2]  # a word in the middle of the greedy answer
    want = ref.chat(CHAT, max_tokens=16, stop=[word])
    assert want.finish_reason == "stop" and word not in want.text
    r = client.chat.completions.create(model=NAME, temperature=0, messages=CHAT, max_tokens=16, stop=word)
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == word == want.stop_reason  # vLLM's field: the string that ended it
    chunks = list(client.chat.completions.create(model=NAME, temperature=0, messages=CHAT, max_tokens=16,
                                                 stop=[word, "zzz"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    last = [c.choices[0] for c in chunks if c.choices][-1]
    assert last.finish_reason == "stop" and last.stop_reason == word
    r = client.chat.completions.create(model=NAME, temperature=0, messages=CHAT, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.choices[0].stop_reason is None


def test_n_with_seed_gives_seed_plus_i(client, ref):
    kw = dict(max_tokens=8, temperature=0.9, top_p=0.95)
    r = client.chat.completions.create(model=NAME, messages=CHAT, n=2, seed=11, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.message.content == ref.chat(CHAT, seed=11 + c.index, **kw).text
    again = client.chat.completions.create(model=NAME, messages=CHAT, n=2, seed=11, **kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    # streamed: each choice's pieces join to its text
    texts = {0: "", 1: ""}
    for ch in client.chat.completions.create(model=NAME, messages=CHAT, n=2, seed=11, stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in r.choices]


def test_unset_temperature_is_openais_and_seeds_are_signed(client, ref):
    """A request without a temperature samples at OpenAI's default (1), not greedily; a negative seed (OpenAI's
    seed is a signed 64-bit integer) is its two's complement, choice i its seed + i."""
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, n=2, seed=7)
    assert [c.message.content for c in r.choices] == [ref.chat(CHAT, max_tokens=8, seed=7 + i, temperature=1.0).text
                                                       for i in range(2)]
    r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8, seed=-1, n=2,
                                  temperature=0.9)
    assert [c.text for c in r.choices] == [ref.generate("Once upon a time", max_tokens=8, temperature=0.9,
                                                        seed=s).text for s in (2**64 - 1, 0)]


def test_extension_parameters_reach_the_sampler(client, ref):
    kw = dict(max_tokens=8, temperature=0.7, seed=5)
    ext = dict(top_k=20, min_p=0.05, repetition_penalty=1.3)
    r = client.chat.completions.create(model=NAME, messages=CHAT, extra_body=ext, **kw)
    assert r.choices[0].message.content == ref.chat(CHAT, **ext, **kw).text
    # skip_special_tokens false: the EOS forced under ignore_eos shows in the text
    eos = ref.config.eos_token_ids[0]
    want = ref.generate("Hi", max_tokens=2, ignore_eos=True, logit_bias={eos: 100}, skip_special_tokens=False)
    assert want.text == ref.tokenizer.decode([eos] * 2, skip_special_tokens=False) != ""
    r = client.completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0, logit_bias={str(eos): 100},
                                  extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert r.choices[0].text == want.text


def test_stop_token_ids_end_the_answer(client, ref):
    """vLLM's stop_token_ids: the answer ends where one is sampled (finish_reason "stop"), as the engine's does."""
    prompt = "The capital of France is"
    free = ref.generate(prompt, max_tokens=8, ignore_eos=True)
    stop = free.token_ids[3]
    want = ref.generate(prompt, max_tokens=8, ignore_eos=True, stop_token_ids=[stop])
    assert want.finish_reason == "stop" and len(want.token_ids) <= 4
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want.text
    assert r.choices[0].stop_reason == stop  # vLLM's field: the id that ended it
    assert r.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True, n=2,
                                            extra_body={"ignore_eos": True, "stop_token_ids": [stop]}))
    for i in range(2):  # (streamed, each of n choices: the same text, ended by the stop id)
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == want.text and mine[-1].finish_reason == "stop"
        assert mine[-1].stop_reason == stop


def test_logit_bias_and_min_tokens_as_the_engine(client, ref):
    """OpenAI's logit_bias (ids as strings), vLLM's min_tokens and bad_words give the engine's answer to the same
    parameters;
    +100 on one token makes a greedy answer that token again and again, min_tokens holds off a stop id."""
    prompt = "The capital of France is"
    free = ref.generate(prompt, max_tokens=8, ignore_eos=True)
    t = free.token_ids[2]
    forced = ref.generate(prompt, max_tokens=6, ignore_eos=True, logit_bias={t: 100})
    assert forced.token_ids == [t] * 6
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logit_bias={str(t): 100},
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == forced.text and r.usage.completion_tokens == 6
    stop = free.token_ids[0]  # the first token: a stop id that ends the answer at once, unless min_tokens
    kw = dict(max_tokens=8, ignore_eos=True, stop_token_ids=[stop])
    assert len(ref.generate(prompt, **kw).token_ids) == 1
    want = ref.generate(prompt, min_tokens=4, **kw)
    assert len(want.token_ids) >= 4 and stop not in want.token_ids[:4]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop], "min_tokens": 4})
    assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids)
    words = ref.generate(prompt, max_tokens=8, ignore_eos=True, bad_words=[free.text.split()[1]])
    assert free.text.split()[1] not in words.text.split()
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "bad_words": [free.text.split()[1]]})
    assert r.choices[0].text == words.text
    with pytest.raises(openai.BadRequestError) as e:  # above the completions' default max_tokens (16)
        client.completions.create(model=NAME, prompt=prompt, extra_body={"min_tokens": 17})
    assert _error_of(e)["param"] == "min_tokens" and "the default here" in _error_of(e)["message"]


def test_structured_outputs_as_the_engine(client, ref):
    """OpenAI's response_format (json_schema, as the openai client's parse() sends it, and json_object), vLLM's
    structured_outputs and its older guided_choice give the engine's answer to the same constraint; the JSON
    parses and holds to the schema."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Name a city, as JSON."}]
    want = ref.chat(msgs, max_tokens=40, structured_outputs={"json": schema})
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
    assert set(json.loads(want.text)) == {"city"}
    obj = ref.chat(msgs, max_tokens=40, structured_outputs={"json_object": True})
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content == obj.text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    pick = ref.generate("The sky is", max_tokens=8, structured_outputs={"choice": ["blue", "green"]})
    assert pick.text in ("blue", "green")
    for extra in ({"structured_outputs": {"choice": ["blue", "green"]}}, {"guided_choice": ["blue", "green"]}):
        r = client.completions.create(model=NAME, prompt="The sky is", max_tokens=8, temperature=0, extra_body=extra)
        assert r.choices[0].text == pick.text and r.choices[0].finish_reason == "stop"
    # streamed: the chunks join to the same text
    chunks = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, temperature=0, stream=True,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "c", "schema": schema}})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text


def test_chat_logprobs_agree_with_engine_logits(client, ref):
    want = ref.chat(CHAT, max_tokens=6)
    r = client.chat.completions.create(model=NAME, temperature=0, messages=CHAT, max_tokens=6, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.token_ids)
    logits = ref.logits(want.prompt_token_ids + want.token_ids)
    n = len(want.prompt_token_ids)
    for i, (tid, item) in enumerate(zip(want.token_ids, content)):
        row = _log_softmax(logits[n - 1 + i])
        assert item.logprob == pytest.approx(row[tid], abs=1e-3)
        assert bytes(item.bytes) == ref.tokenizer.token_bytes(tid)
        assert item.token == bytes(item.bytes).decode("utf-8", errors="replace")
        top = np.sort(row)[::-1][:3]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(list(top), abs=1e-3)
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)  # greedy: the argmax
    # streamed logprobs: the same entries, in order
    streamed = []
    for ch in client.chat.completions.create(model=NAME, temperature=0, messages=CHAT, max_tokens=6, logprobs=True,
                                             top_logprobs=3, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in content]


def test_completion_echo_with_the_prompts_logprobs(client, ref):
    """echo (lm-eval's loglikelihood request: echo, logprobs, max_tokens 1): the text is the prompt's and the
    answer's; the logprobs are the prompt tokens' (the first null) then the answer's, the prompt's those of the
    engine's prompt_logprobs (log_softmax of logits() at the token before each). Streamed: the same text and
    entries, the prompt's first."""
    prompt = "The capital of France is"
    ids = ref.tokenize(prompt)
    want = ref.generate(prompt, max_tokens=1)
    plp = ref.prompt_logprobs(ids, 1)
    r = client.completions.create(model=NAME, temperature=0, prompt=prompt, max_tokens=1, logprobs=1, echo=True)
    c = r.choices[0]
    assert c.text == prompt + want.text and r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([x.logprob for x in plp[1:]], abs=1e-4)
    logits = ref.logits(ids)
    assert lp.token_logprobs[2] == pytest.approx(_log_softmax(logits[1])[ids[2]], abs=1e-4)
    for i in range(1, len(ids)):  # (the most likely token, and the prompt's own where it is another: OpenAI's)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(plp[i].top[0][1], abs=1e-4)
        assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i] and len(lp.top_logprobs[i]) <= 2
    assert lp.text_offset == sorted(lp.text_offset)
    pieces = list(client.completions.create(model=NAME, temperature=0, prompt=prompt, max_tokens=1, logprobs=1,
                                            echo=True, stream=True))
    chunks = [p.choices[0] for p in pieces if p.choices]
    assert chunks[0].text == prompt and "".join(ch.text for ch in chunks) == c.text
    joined = [t for ch in chunks if ch.logprobs for t in ch.logprobs.token_logprobs]
    assert joined[0] is None and joined[1:] == lp.token_logprobs[1:]
    # max_tokens 0 (older scorers): the prompt alone with its logprobs, no answer token counted
    only = client.completions.create(model=NAME, temperature=0, prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    o = only.choices[0]
    assert o.text == prompt and o.finish_reason == "length" and only.usage.completion_tokens == 0
    assert o.logprobs.token_logprobs == lp.token_logprobs[:len(ids)] and len(o.logprobs.tokens) == len(ids)
    pieces = [p.choices[0] for p in client.completions.create(model=NAME, temperature=0, prompt=prompt, max_tokens=0,
                                                              logprobs=1, echo=True, stream=True) if p.choices]
    assert "".join(ch.text for ch in pieces) == prompt and pieces[-1].finish_reason == "length"
    assert [t for ch in pieces if ch.logprobs for t in ch.logprobs.token_logprobs] == o.logprobs.token_logprobs
    plain = client.completions.create(model=NAME, temperature=0, prompt=ids, max_tokens=2, echo=True)
    assert plain.choices[0].text == ref.detokenize(ids) + ref.generate(ids, max_tokens=2).text
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_legacy_format(client, ref):
    prompt = "The capital of France is"
    want = ref.generate(prompt, max_tokens=5)
    r = client.completions.create(model=NAME, temperature=0, prompt=prompt, max_tokens=5, logprobs=2)
    lp = r.choices[0].logprobs
    ids = ref.tokenize(prompt)
    logits = ref.logits(ids + want.token_ids)
    assert lp.tokens == [ref.tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in want.token_ids]
    for i, tid in enumerate(want.token_ids):
        row = _log_softmax(logits[len(ids) - 1 + i])
        assert lp.token_logprobs[i] == pytest.approx(row[tid], abs=1e-3)
        assert len(lp.top_logprobs[i]) <= 3 and max(lp.top_logprobs[i].values()) == pytest.approx(row.max(), abs=1e-3)
        assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]  # (the chosen one's too: OpenAI's rule)
    zero = client.completions.create(model=NAME, temperature=0, prompt=prompt, max_tokens=3, logprobs=0).choices[0]
    assert [list(d) for d in zero.logprobs.top_logprobs] == [[t] for t in zero.logprobs.tokens]
    text = r.choices[0].text
    assert [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens


def test_text_offsets_count_a_split_character_once():
    """The legacy text_offset is where a token's first byte's character starts in the text: "é" in two byte
    tokens is one character (their texts are one U+FFFD each), so the token after it starts one character on."""
    from tinyinfer.server import protocol as P

    class Bytes:  # token i is byte i
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    offsets = P.TextOffsets(Bytes())
    ids = list(" héllo日!".encode())
    assert [offsets.next(i) for i in ids] == [0, 1, 2, 2, 3, 4, 5, 6, 6, 6, 7]


# ---- concurrency and cancellation ----


def test_concurrent_streams_equal_their_solo_text(server, ref):
    prompts = [f"Tell me about the number {i}." if i % 3 else f"Count from {i} to {i + 20}:" + " go" * (i % 7)
               for i in range(16)]
    want = [ref.generate(p, max_tokens=6).text for p in prompts]

    async def one(c, p):
        out = ""
        async for ch in await c.completions.create(model=NAME, temperature=0, prompt=p, max_tokens=6, stream=True):
            if ch.choices:
                out += ch.choices[0].text
        return out

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=600) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(main()) == want
    h = server.wait_idle()
    assert h["kv_pages_used"] == 0 and h["running"] == 0


def test_dropped_stream_frees_its_pages(server):
    body = {"model": NAME, "messages": CHAT, "max_tokens": MAX_SEQ - 64, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        with c.stream("POST", f"{server.url}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept: a dropped line iterator closes the connection (httpx)
            data = [x for x in (next(lines) for _ in range(8)) if x.startswith("data: ")]
            assert len(data) >= 3  # the role chunk and tokens: it is generating and holds pages now
            h = server.health()
            assert h["kv_pages_used"] > 0 and h["running"] == 1
            rid = json.loads(data[0][6:])["id"]
        # leaving the block closes the connection mid-stream
    h = server.wait_idle()
    assert h["running"] == 0 and h["kv_pages_used"] == 0
    assert [x for x in server.log().splitlines() if rid in x][-1].endswith("client gone")


def test_dropped_plain_request_is_cancelled(server):
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": MAX_SEQ - 64, "ignore_eos": True}
    gone = server.log().count("client gone")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(10, read=2))
    h = server.wait_idle()
    assert h["running"] == 0 and h["kv_pages_used"] == 0
    assert server.log().count("client gone") == gone + 1  # cancelled, not run to its end


# ---- errors: OpenAI's status and shape, and the server keeps serving ----


def _post(server, path: str, body, key: str = KEY) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=60,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def test_tokenize_and_detokenize(server, ref):
    """vLLM's /tokenize and /detokenize: a prompt's ids as a completion submits them (special tokens on or off), a
    chat's as a chat request renders it (with or without the assistant's turn opened), and the text of ids back."""
    text = "Name three colors."
    r = _post(server, "/tokenize", {"model": NAME, "prompt": text})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(ref.tokenize(text)), "max_model_len": MAX_SEQ, "tokens": ref.tokenize(text),
                        "token_strs": None}
    strs = _post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert strs == [ref.tokenizer.id_to_token(t) for t in ref.tokenize(text)] and "".join(strs[-2:]).endswith(".")
    plain = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert plain == ref.tokenize(text, add_special_tokens=False)
    chat = _post(server, "/tokenize", {"messages": CHAT}).json()
    assert chat["tokens"] == ref.apply_chat_template(CHAT) and chat["count"] == len(chat["tokens"])
    assert _post(server, "/tokenize", {"messages": CHAT, "add_special_tokens": False}).json() == chat  # (vLLM's)
    open_turn = _post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert open_turn == ref.apply_chat_template(CHAT, add_generation_prompt=False) != chat["tokens"]
    back = _post(server, "/detokenize", {"model": NAME, "tokens": chat["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": ref.detokenize(chat["tokens"],
                                                                                skip_special_tokens=False)}
    assert _post(server, "/detokenize", {"tokens": plain}).json()["prompt"] == text
    assert _post(server, "/detokenize", {"tokens": []}).json()["prompt"] == ""


BAD_TOKENIZE = [  # (path, body, status, param, a piece of the message)
    ("/tokenize", {}, 400, "prompt", "either 'prompt'"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt", "either 'prompt'"),
    ("/tokenize", {"prompt": ["a"]}, 400, "prompt", "must be a string"),
    ("/tokenize", {"prompt": "a\ud800"}, 400, "prompt", "not valid Unicode"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt", "applies to"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, 400, "add_special_tokens", "applies to"),
    ("/tokenize", {"prompt": "a", "return_token_strs": 1}, 400, "return_token_strs", "boolean"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens", "boolean"),
    ("/tokenize", {"messages": []}, 400, "messages", "non-empty list"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages", ""),
    ("/tokenize", {"prompt": "a", "continue_final_message": True}, 400, "continue_final_message",
     "unknown parameter"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404, "model", "does not exist"),
    ("/tokenize", "[1]", 400, None, "must be a JSON object"),
    ("/detokenize", {}, 400, "tokens", "'tokens' is required"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "list of token ids"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens", "list of token ids"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens", "out of range"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "out of range"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4o"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize("path,body,status,param,needle", BAD_TOKENIZE,
                         ids=[f"{p[1:]}-{i}" for i, (p, *_) in enumerate(BAD_TOKENIZE)])
def test_bad_tokenize_body_is_4xx_naming_it(server, path, body, status, param, needle):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and needle in err["message"]


def test_tokenize_needs_the_key(server):
    assert _post(server, "/tokenize", {"prompt": "a"}, key="wrong").status_code == 401
    assert _post(server, "/detokenize", {"tokens": [1]}, key="wrong").status_code == 401


def _error_of(exc) -> dict:
    body = exc.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


BAD_CHAT = [  # (extra arguments, param named)
    # (tools without tool_choice: "auto", which this server, started without a tool-call parser, refuses)
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "tools"),
    (dict(tool_choice="auto"), "tool_choice"),  # (without tools)
    (dict(functions=[{"name": "f"}]), "functions"),
    (dict(extra_body={"echo": True}), "echo"),  # (completions only)
    (dict(parallel_tool_calls="yes"), "parallel_tool_calls"),
    (dict(response_format={"type": "grammar"}), "response_format"),
    (dict(response_format={"type": "json_schema"}), "response_format"),  # no json_schema object
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format"),  # (compiled by llguidance: refused at submission)
    (dict(response_format={"type": "json_object", "strict": True}), "response_format"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex"),  # two ways
    (dict(extra_body={"structured_outputs": {"regex": "(["}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"jsn": {}}}), "structured_outputs"),
    (dict(extra_body={"guided_choice": []}), "guided_choice"),
    (dict(logit_bias=[42, 5]), "logit_bias"),
    (dict(logit_bias={"a": 5}), "logit_bias"),
    (dict(logit_bias={"-3": 5}), "logit_bias"),
    (dict(logit_bias={"42": 100.5}), "logit_bias"),
    (dict(logit_bias={"42": True}), "logit_bias"),
    (dict(logit_bias={"42": "5"}), "logit_bias"),
    (dict(logit_bias={"7": 1, "07": 2}), "logit_bias"),
    (dict(logit_bias={"1000000": 5}), "logit_bias"),  # past the vocabulary
    (dict(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
    (dict(extra_body={"min_tokens": -1}), "min_tokens"),
    (dict(extra_body={"bad_words": "x"}), "bad_words"),
    (dict(extra_body={"bad_words": ["ok", ""]}), "bad_words"),
    (dict(extra_body={"bad_words": ["w"] * 513}), "bad_words"),
    # (each within its limit, together past the core's 1,024 entries: refused by the engine, the field named)
    (dict(logit_bias={str(i): 1 for i in range(20000, 21024)}, extra_body={"bad_words": ["the", "and"]}),
     "logit_bias"),
    (dict(extra_body={"min_tokens": 1.5}), "min_tokens"),
    (dict(max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens"),
    (dict(extra_body={"no_such_field": 1}), "no_such_field"),
    (dict(temperature=3.5), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(extra_body={"top_k": -2}), "top_k"),
    (dict(extra_body={"min_p": 1.5}), "min_p"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"repetition_penalty": 1e300}), "repetition_penalty"),  # infinite as the core's float32
    (dict(extra_body={"repetition_penalty": 1e-50}), "repetition_penalty"),  # 0 as a float32
    (dict(extra_body={"repetition_penalty": 10**400}), "repetition_penalty"),  # beyond a double
    (dict(n=0), "n"),
    (dict(n=129), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=5, max_completion_tokens=6), "max_completion_tokens"),  # they disagree
    (dict(top_logprobs=3), "top_logprobs"),  # without logprobs=true
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(stop=["x" * 1025]), "stop"),  # longer than a stop string may be
    (dict(seed=-2**63 - 1), "seed"),  # beyond OpenAI's signed 64 bits
    (dict(seed=2**63), "seed"),
    (dict(extra_body={"top_k": 2**63}), "top_k"),  # beyond the core's int64
    (dict(stream_options={"include_usage": True}), "stream_options"),  # without stream
    (dict(stream=True, stream_options={"include_usage": True, "chunk": 1}), "stream_options"),  # an extra key
    (dict(extra_body={"stream": "yes"}), "stream"),
    (dict(extra_body={"ignore_eos": 1}), "ignore_eos"),
    (dict(extra_body={"skip_special_tokens": "no"}), "skip_special_tokens"),
    (dict(extra_body={"model": 5}), "model"),
    (dict(extra_body={"stop_token_ids": 5}), "stop_token_ids"),
    (dict(extra_body={"stop_token_ids": [1, True]}), "stop_token_ids"),
    (dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids"),
    (dict(extra_body={"stop_token_ids": [10**9]}), "stop_token_ids"),  # past the vocabulary
    (dict(store=True), "store"),
    (dict(max_tokens=MAX_SEQ), "max_tokens"),  # prompt + max_tokens beyond the context
]


@pytest.mark.parametrize("extra,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_parameter_is_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=CHAT, **extra)
    err = _error_of(e)
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == param


BAD_COMPLETION = [
    (dict(best_of=2), "best_of"),
    (dict(suffix="end"), "suffix"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt=[1, "a"]), "prompt"),
    (dict(prompt=[10 ** 6]), "prompt"),  # a token id outside the vocabulary
    (dict(logprobs=21), "logprobs"),
    (dict(max_tokens=0), "max_tokens"),  # (0 only with echo)
    (dict(prompt="x " * 600), "prompt"),  # the prompt alone is longer than the context
]


@pytest.mark.parametrize("extra,param", BAD_COMPLETION, ids=[f"{p}{i}" for i, (_, p) in enumerate(BAD_COMPLETION)])
def test_bad_completion_parameter_is_400_naming_it(client, extra, param):
    kw = {"prompt": "hi", "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, **kw)
    assert _error_of(e)["param"] == param


def test_context_overflow_has_openai_code(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hello", max_tokens=MAX_SEQ)
    assert _error_of(e)["code"] == "context_length_exceeded"


def test_bad_messages_are_400(client):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    for msgs in ([], [{"role": "wizard", "content": "hi"}], [{"role": "user"}],
                 [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2)
        assert _error_of(e)["param"] == "messages"


def _nested(depth: int) -> list:
    x: list = []
    for _ in range(depth - 1):
        x = [x]
    return x


# Bodies the openai client does not send (a lone surrogate, which it cannot encode; no messages or prompt; not an
# object; nesting past a recursive parser), posted as JSON text: json.dumps writes a lone surrogate as the escape
# "\ud800", which the server's JSON parser turns back into one.
RAW_BAD = [  # (endpoint, body: a dict or the JSON text, status, param, a piece of the message)
    ("completions", {"prompt": "a\ud800"}, 400, "prompt", "not valid Unicode"),
    ("completions", {"prompt": "a", "stop": ["\ud800"]}, 400, "stop", "not valid Unicode"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, 400, "messages",
     "not valid Unicode"),
    ("chat/completions", {"messages": CHAT, "model": "\ud800"}, 404, "model", "the model '\\ud800' does not exist"),
    ("chat/completions", {"messages": CHAT, "\ud800": 1}, 400, "\\ud800", "unknown parameter(s): '\\ud800'"),
    ("chat/completions", {}, 400, "messages", "'messages' is required"),
    ("completions", {}, 400, "prompt", "'prompt' is required"),
    ("chat/completions", "[1, 2]", 400, None, "must be a JSON object"),
    ("completions", '"hello"', 400, None, "must be a JSON object"),
    # nested deeper than a recursive parser or walk can follow
    ("chat/completions", '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, None, "nested too deeply"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "x": _nested(600)}]}, 400, "messages",
     "nested too deeply"),
]


@pytest.mark.parametrize("endpoint,body,status,param,needle", RAW_BAD,
                         ids=[f"{e}-{i}" for i, (e, *_) in enumerate(RAW_BAD)])
def test_bad_raw_body_is_4xx_in_openai_shape(server, endpoint, body, status, param, needle):
    if isinstance(body, dict):
        body = json.dumps({"model": NAME, "max_tokens": 2, **body})
    r = httpx.post(f"{server.url}/v1/{endpoint}", content=body,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and needle in err["message"]


def test_api_key_is_required(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.models.list()
        assert e.value.status_code == 401 and _error_of(e)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": "hi"}, timeout=30)  # no key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200  # open for load balancers


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert _error_of(e)["code"] == "model_not_found" and _error_of(e)["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_body_over_the_limit_is_413(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    big = json.dumps({"model": NAME, "prompt": "x" * (5 << 20), "max_tokens": 1})
    r = httpx.post(f"{server.url}/v1/completions", content=big, headers=auth, timeout=60)
    assert r.status_code == 413 and set(r.json()["error"]) == {"message", "type", "param", "code"}

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(5):
            yield b" " * (1 << 20)

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=auth, timeout=60)
    assert r.status_code == 413


def test_malformed_json_is_400(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_still_serving_after_errors(client, ref, server):
    """Runs after the error rows (file order): the same answer as at the start, nothing left in the pool."""
    r = client.chat.completions.create(model=NAME, temperature=0, messages=CHAT, max_tokens=4)
    assert r.choices[0].message.content == ref.chat(CHAT, max_tokens=4).text
    h = server.wait_idle()
    assert h["kv_pages_used"] == 0 and server.proc.poll() is None


# ---- more servers: sampling defaults, the queue full, and Ctrl-C ----


def test_sampling_defaults_are_checked_and_a_request_overrides_them():
    from tinyinfer.server import protocol as P

    ok, dropped = P.checked_defaults({"temperature": 0.6, "top_p": 0.0, "top_k": "x", "min_p": 0.05, "seed": 1,
                                      "repetition_penalty": 1.2})
    assert ok == {"temperature": 0.6, "min_p": 0.05, "repetition_penalty": 1.2}
    assert [d.split("=")[0] for d in dropped] == ["top_p", "top_k", "seed"]
    body = {"messages": CHAT}
    assert P.parse_chat(body).params.temperature == 1.0  # none: OpenAI's
    sp = P.parse_chat(body, ok).params
    assert (sp.temperature, sp.min_p, sp.repetition_penalty, sp.top_p) == (0.6, 0.05, 1.2, 1.0)
    sp = P.parse_completion({"prompt": "a", "temperature": 0, "min_p": 0.2}, ok).params
    assert (sp.temperature, sp.min_p, sp.repetition_penalty) == (0.0, 0.2, 1.2)
    from tinyinfer import InvalidRequestError
    from tinyinfer.server.app import create_app

    with pytest.raises(InvalidRequestError, match=r"sampling_defaults: temperature=5"):  # (before engine is used)
        create_app(None, None, model_name=NAME, sampling_defaults={"temperature": 5})


@pytest.mark.parametrize("workers", list(WORKERS))
def test_generation_config_gives_the_servers_sampling_defaults(tmp_path, workers):
    """--generation-config auto (the default), as vLLM's server: a request's left-out sampling fields come from
    the model's generation_config.json (its valid ones; a value equal to transformers' own default is none);
    openai: OpenAI's defaults."""
    from conftest import make_chat_llama
    from tinyinfer import Engine

    d = make_chat_llama(tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "do_sample": True, "temperature": 0.5, "top_k": 50, "top_p": 0.0,
         "repetition_penalty": 1.3}))
    kw = dict(max_tokens=8, seed=3, ignore_eos=True)
    with Engine(d, device="cpu", max_seq_len=MAX_SEQ, progress=False) as ref:
        assert ref.sampling_defaults == {"temperature": 0.5, "top_p": 0.0, "repetition_penalty": 1.3}
        want = ref.chat(CHAT, temperature=0.5, repetition_penalty=1.3, **kw).text
        want_greedy = ref.chat(CHAT, temperature=0, repetition_penalty=1.3, **kw).text
        want_openai = ref.chat(CHAT, temperature=1.0, **kw).text
    for extra, expect in (((), want), (("--generation-config", "openai"), want_openai)):
        srv = Server(d, tmp_path, *WORKERS[workers], *extra)
        try:
            with openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0) as c:
                r = c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, seed=3,
                                              extra_body={"ignore_eos": True})
                assert r.choices[0].message.content == expect
                if not extra:  # the request's own temperature wins; the file's other defaults stay
                    r = c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=8, seed=3, temperature=0,
                                                  extra_body={"ignore_eos": True})
                    assert r.choices[0].message.content == want_greedy
        finally:
            assert srv.stop() == 0, srv.log()
        log = srv.log()
        said = "sampling defaults from the model's generation_config.json: temperature=0.5, repetition_penalty=1.3"
        assert (said in log and "top_p=0.0" in log) == (not extra), log


@pytest.mark.parametrize("workers", list(WORKERS))
def test_queue_full_is_503(smollm_gguf, tmp_path, workers):
    srv = Server(smollm_gguf, tmp_path, "--max-waiting", "0", *WORKERS[workers])
    try:
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as e:
                c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2)
            assert e.value.status_code == 503 and e.value.response.headers.get("retry-after")
            assert _error_of(e)["code"] == "queue_full"
            # more choices than the queue holds at once: never queued, however long the client retries (400)
            with pytest.raises(openai.BadRequestError, match="asks for 2 completions") as e:
                c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2, n=2)
            assert _error_of(e)["param"] == "n"
            with pytest.raises(openai.BadRequestError, match=r"2 prompt\(s\) x n=1") as e:
                c.completions.create(model=NAME, prompt=["a", "b"], max_tokens=2)
            assert _error_of(e)["param"] == "prompt"
        assert srv.health()["status"] == "ok"
    finally:
        assert srv.stop(signal.SIGINT) == 0, srv.log()


@pytest.mark.parametrize("workers", list(WORKERS))
def test_ctrl_c_ends_open_streams_and_exits_cleanly(smollm_gguf, tmp_path, workers):
    srv = Server(smollm_gguf, tmp_path, *WORKERS[workers])
    try:
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0) as c:
            stream = c.completions.create(model=NAME, prompt="Once", max_tokens=MAX_SEQ - 8, stream=True,
                                          extra_body={"ignore_eos": True})
            next(stream), next(stream)  # generating
            srv.proc.send_signal(signal.SIGINT)
            with pytest.raises(openai.APIError, match="shutting down"):
                for _ in stream:
                    pass
        srv.proc.wait(60)  # one Ctrl-C is enough (a second one would force quit)
    finally:
        rc = srv.stop(signal.SIGINT)
    assert rc == 0, srv.log()
    assert "Traceback" not in srv.log() and "server shutdown" in srv.log()


def test_sigterm_to_the_process_group_shuts_the_workers_down_cleanly(smollm_gguf, tmp_path):
    """A service manager stops a service with SIGTERM to its whole process group: the API workers ignore it and
    the engine process stops them, so an open stream still gets the shutdown error and everything exits 0."""
    srv = Server(smollm_gguf, tmp_path, *WORKERS["2-workers"], session=True)
    try:
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0) as c:
            stream = c.completions.create(model=NAME, prompt="Once", max_tokens=MAX_SEQ - 8, stream=True,
                                          extra_body={"ignore_eos": True})
            next(stream), next(stream)  # generating
            os.killpg(srv.proc.pid, signal.SIGTERM)
            with pytest.raises(openai.APIError, match="shutting down"):
                for _ in stream:
                    pass
        srv.proc.wait(60)
    finally:
        rc = srv.stop(signal.SIGINT)
    assert rc == 0, srv.log()
    assert "Traceback" not in srv.log() and "server shutdown" in srv.log()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_a_clear_error_before_loading(workers):
    """Refused before the model is even looked for (it does not exist here), and never "serving ... at" first."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "tinyinfer", "serve", "--model", "/nonexistent", "--device",
                            "cpu", "--port", str(port), "--api-workers", workers],
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in p.stderr, p.stderr
    assert "nonexistent" not in p.stderr and "serving" not in p.stderr


def test_trace_is_written_at_shutdown(smollm_gguf, tmp_path):
    """--trace FILE: after SIGTERM the file holds the core calls and each request's scheduler and HTTP events;
    serve_timeline.py reads it."""
    path = tmp_path / "serve.json"
    srv = Server(smollm_gguf, tmp_path, "--trace", str(path))
    try:
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0) as c:
            for n in (3, 5):
                text = "".join(ch.choices[0].text for ch in c.completions.create(
                    model=NAME, prompt=[1, 2, 3, 4], max_tokens=n, stream=True, extra_body={"ignore_eos": True}))
                assert text
    finally:
        srv.stop(signal.SIGTERM)  # (uvicorn raises it again once shut down: the exit status is -SIGTERM)
    assert "wrote the trace" in srv.log() and "Traceback" not in srv.log(), srv.log()
    trace = json.loads(path.read_text())
    # (the first request's cache parked by the prefix cache; the second, the same prompt, copied from it)
    assert {"seq_open", "seq_step", "seq_sample", "seq_park", "seq_copy"} <= {c[0] for c in trace["calls"]}
    kinds: dict = {}
    for kind, _, rid, *_ in trace["events"]:
        kinds.setdefault(rid, []).append(kind)
    calls = [k for k in kinds if k.startswith("cmpl-") and not k[-2:] == "-0"]
    assert len(calls) == 2 and all(kinds[k] == ["http_start", "http_first", "http_end"] for k in calls)
    assert all(kinds[f"{k}-0"] == ["submit", "admit", "prefilled", "first", "end"] for k in calls)
    tool = Path(__file__).resolve().parents[1] / "bench" / "tools" / "serve_timeline.py"
    out = subprocess.run([sys.executable, str(tool), str(path)], capture_output=True, text=True)
    assert out.returncode == 0 and "decode steps" in out.stdout, out.stderr


@pytest.mark.gpu
def test_gpu_server_batches_32_streams(smollm_gguf, tmp_path):
    """The CUDA engine behind the server: 32 concurrent streams each get exactly their tokens (each prompt's greedy
    tokens alone on a GPU engine, up to a near-tie where the batched step may round the other way), the greedy
    answer alone equals Engine.chat's on the GPU, and the pool is empty afterwards."""
    from conftest import near_tie
    from tinyinfer import Engine

    srv = Server(smollm_gguf, tmp_path, device="cuda")
    try:
        async def one(c, i):
            n, text, tokens = 0, "", []  # (logprobs=0: each token's text, to find where a stream parts)
            async for ch in await c.completions.create(model=NAME, prompt=f"Story number {i}:", max_tokens=32,
                                                       temperature=0, stream=True, logprobs=0,
                                                       stream_options={"include_usage": True},
                                                       extra_body={"ignore_eos": True}):
                if ch.choices:
                    text += ch.choices[0].text
                    tokens += ch.choices[0].logprobs.tokens if ch.choices[0].logprobs else []
                elif ch.usage:
                    n = ch.usage.completion_tokens
            return n, text, tokens

        async def main():
            async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=600) as c:
                return await asyncio.gather(*(one(c, i) for i in range(32)))

        got = asyncio.run(main())
        assert [n for n, _, _ in got] == [32] * 32 and all(t for _, t, _ in got)
        h = srv.wait_idle()
        assert h["running"] == 0 and h["kv_pages_used"] == 0
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0) as c:
            r = c.chat.completions.create(model=NAME, messages=CHAT, max_tokens=16, temperature=0)
        with Engine(smollm_gguf, device="cuda", max_seq_len=MAX_SEQ, progress=False) as eng:
            assert r.choices[0].message.content == eng.chat(CHAT, max_tokens=16).text
            for i, (_, text, tokens) in enumerate(got):
                prompt = eng.tokenize(f"Story number {i}:")
                alone = eng.generate(prompt, max_tokens=32, ignore_eos=True)
                want = [eng.tokenizer.decode([t], skip_special_tokens=False) for t in alone.token_ids]
                assert len(tokens) == 32, (i, text, tokens)
                j = next((k for k in range(32) if tokens[k] != want[k]), 32)
                assert j == 32 or near_tie(eng, prompt + alone.token_ids[:j]), (i, j, text, alone.text)
    finally:
        assert srv.stop(signal.SIGINT) == 0, srv.log()


def test_serve_without_fastapi_says_how_to_install():
    code = ("import sys; sys.modules['fastapi'] = None; from tinyinfer.cli import main; "
            "sys.exit(main(['serve', '--device', 'cpu']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == ("tinyinfer: error: tinyinfer serve needs fastapi and uvicorn: "
                                                 "pip install 'tinyinfer[serve]'")


@pytest.mark.parametrize("args,msg", [(["--port", "70000"], "--port"), (["--max-batch", "0"], "--max-batch"),
                                      (["--served-model-name", " "], "--served-model-name"),
                                      (["--chunk-tokens", "0"], "--chunk-tokens"),
                                      (["--stream-interval", "0"], "--stream-interval"),
                                      (["--switch-interval-ms", "0"], "--switch-interval-ms"),
                                      (["--api-workers", "0"], "--api-workers"),
                                      (["--api-workers", "65"], "--api-workers"),
                                      (["--enable-auto-tool-choice"], "needs --tool-call-parser")])
def test_serve_bad_arguments_refused_before_loading(args, msg):
    p = subprocess.run([sys.executable, "-m", "tinyinfer", "serve", "--model", "/nonexistent", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and msg in p.stderr and "nonexistent" not in p.stderr


def test_serve_flags_of_the_scheduler():
    """`tinyinfer serve --no-overlap / --no-batched-prefill / --no-preempt`: the A/B references; all on by
    default."""
    import argparse

    from tinyinfer.server.main import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args([])
    assert (a.overlap, a.batched_prefill, a.preempt) == (True, True, True)
    a = p.parse_args(["--no-overlap", "--no-batched-prefill", "--no-preempt"])
    assert (a.overlap, a.batched_prefill, a.preempt) == (False, False, False)
