"""The OpenAI-compatible HTTP app over a Scheduler: GET /v1/models, POST /v1/chat/completions, POST /v1/completions,
GET /health, GET /metrics (Prometheus).

    app = create_app(engine, scheduler, model_name="SmolLM2-135M-Instruct", api_key=None)
    uvicorn.run(app, host="127.0.0.1", port=8000)

Each choice of each prompt is its own scheduler Request (choice i of a seeded request gets seed + i); the app
awaits their Deltas (Request.__aiter__: no thread is held per HTTP request) and cancels them when the client goes
away, streaming or not, so their KV pages return to the pool at the scheduler's next step. The app's lifespan
starts the scheduler's thread and closes it (uvicorn: Ctrl-C).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import inspect
import json
import logging
import secrets
import threading
import time
import uuid
from types import MappingProxyType
from typing import Any, AsyncIterator, Mapping, Optional

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import (ChatTemplateError, DeviceError, InvalidRequestError, KvCacheFullError, QueueFullError,
                      TokenizerError)
from ..sampling import CONTEXT_TOKENS
from ..scheduler import Delta, merge_deltas
from ..tools import ToolAnswer, parser
from . import protocol as P
from .metrics import render as render_metrics

log = logging.getLogger("tinyinfer.server")

MAX_BODY_BYTES = 4 << 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the rest of the context
NO_STREAM_EVERY = 1 << 30  # a whole answer needs waking for its end only (and its first token, for the log line)


class ClientGone(Exception):
    """The client disconnected before its answer was complete (its requests are cancelled)."""


class DisconnectAwareStream(StreamingResponse):
    """A StreamingResponse that always listens for the client's disconnect while streaming (Starlette only does
    so for ASGI < 2.4; otherwise it notices at the next write), so a client that leaves while its request waits
    or prefills has the body iterator cancelled at once, and the iterator's `finally` cancels the requests."""

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            async def stream() -> None:
                with contextlib.suppress(OSError):  # the socket went away mid-write
                    await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


def _error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _read_json(request: Request, limit: int):
    """The body as JSON, refusing (413) more than `limit` bytes whether or not a Content-Length says so."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise P.APIError(413, f"the request body is {declared} bytes; the limit is {limit}",
                         code="request_too_large")
    data, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise P.APIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")
        data.append(chunk)
    try:
        return json.loads(b"".join(data))
    except (ValueError, UnicodeDecodeError) as e:
        raise P.bad(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # the parser recurses per level of arrays / objects
        raise P.bad("the request body is nested too deeply") from None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Choice:
    """One scheduler Request answering one choice (index) of an HTTP request."""

    def __init__(self, index: int, req, prompt_tokens: int):
        self.index = index
        self.req = req
        self.prompt_tokens = prompt_tokens
        self.completion: Any = None  # the final Completion, once its last Delta arrived
        self.tokens = 0  # generated so far (the log line of a request cut short)
        self.offsets: Optional[P.TextOffsets] = None  # the legacy text_offset, over the tokens whose logprobs were sent
        self.tools: Optional[ToolAnswer] = None  # a streamed chat choice's tool calls (tools, tool_choice not none)
        self.echo: Optional[str] = None  # completions' echo: the prompt's text, before the answer's
        self.prompt_ids: list[int] = []


async def _deltas(c: _Choice, every: Optional[int] = 1) -> AsyncIterator[Delta]:
    """The Deltas of one choice, those ready at once merged into one: a client served slower than the steps come
    gets multi-token chunks (OpenAI clients accept them) and catches up, rather than falling further behind one
    chunk per token. A request the KV pool could not give its next page (KvCacheFullError) ends as its length ran
    out: what it generated, finish_reason "length" (the client sees a short answer, no error)."""
    sent = 0
    try:
        async for batch in c.req.batches(every):
            d = merge_deltas(batch)
            sent += len(d.text)
            yield d
    except KvCacheFullError as e:
        log.warning("%s: %s", c.req.id, e)
        yield Delta(e.completion.text[sent:], [], None, e.completion)


async def _ready(choices: list[_Choice], every: Optional[int]) -> AsyncIterator[list[tuple[_Choice, Any]]]:
    """What the choices have ready, as (choice, merged Delta or the exception that failed it) in order, all that
    is ready in one list (one write to the client). One choice: its Deltas directly; several: a task each.
    every: Request.batches' (Deltas per wake-up)."""
    if len(choices) == 1:
        c = choices[0]
        try:
            async for d in _deltas(c, every):
                yield [(c, d)]
        except Exception as e:  # the scheduler failed this request: the client is told in the stream
            yield [(c, e)]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice) -> None:
        try:
            async for d in _deltas(c, every):
                queue.put_nowait((c, d))
        except Exception as e:
            queue.put_nowait((c, e))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        while True:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            yield items
    finally:
        for t in tasks:
            t.cancel()


class _Call:
    """One HTTP generation request in flight: its choices, timing, and the one log line it ends with."""

    def __init__(self, rid: str, choices: list[_Choice], n: int, prompt_only: bool = False):
        self.id = rid
        self.choices = choices
        self.n = n  # choices per prompt
        self.prompt_only = prompt_only  # the answers' tokens left out (max_tokens 0 with echo): none counted
        self.t0 = time.perf_counter()
        self.t_first: Optional[float] = None
        self.trace = None  # the scheduler's Trace, if any: gets this call's "http_end"

    def saw(self, c: _Choice, d) -> None:
        """Bookkeeping of one Delta of choice c."""
        if d.token_ids and self.t_first is None:
            self.t_first = time.perf_counter()
            if self.trace is not None:  # the event loop has the first token (its chunk is written next)
                self.trace.event("http_first", self.id, t=self.t_first)
        c.tokens += len(d.token_ids)
        if d.completion is not None:
            c.completion = d.completion

    def cancel_unfinished(self) -> None:
        for c in self.choices:
            if c.completion is None:
                c.req.cancel()

    @property
    def prompt_tokens(self) -> int:  # OpenAI counts each prompt once, whatever n
        return sum(c.prompt_tokens for c in self.choices if c.index % self.n == 0)

    @property
    def completion_tokens(self) -> int:
        if self.prompt_only:
            return 0
        return sum(len(c.completion.token_ids) if c.completion is not None else c.tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:  # of prompt_tokens: held by the prefix cache, not prefilled (the same choices)
        return sum(c.completion.stats.cached_tokens for c in self.choices
                   if c.index % self.n == 0 and c.completion is not None)

    def usage(self) -> dict:
        return P.usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def finish_reasons(self) -> str:
        return ",".join(sorted({c.completion.finish_reason for c in self.choices}))

    def log(self, outcome: str) -> None:
        end = time.perf_counter()
        out = self.completion_tokens
        ttft = f"{(self.t_first - self.t0) * 1e3:.0f} ms" if self.t_first is not None else "-"
        after_first = max(out - len(self.choices), 0)  # each choice's first token comes from its prompt's pass
        rate = after_first / (end - self.t_first) if self.t_first is not None and end > self.t_first else 0.0
        cached = self.cached_tokens
        log.info("%s: %d tokens in%s, %d out, ttft %s, %.1f tok/s, %.2f s, %s", self.id, self.prompt_tokens,
                 f" ({cached} cached)" if cached else "", out, ttft, rate, end - self.t0, outcome)
        if self.trace is not None:  # (streaming: the last chunk has been handed to the server to write)
            self.trace.event("http_end", self.id, out, outcome, t=end)


class Service:
    """What the routes do: check, tokenize, submit one scheduler Request per choice, answer or stream."""

    def __init__(self, engine, scheduler, model_name: str, api_key: Optional[str], max_body_bytes: int,
                 stream_interval: Optional[int] = None, sampling_defaults: Mapping[str, Any] = MappingProxyType({}),
                 tool_parser: Optional[str] = None):
        self.engine = engine
        self.tool_parser = tool_parser
        self.sampling_defaults = sampling_defaults
        self.stream_interval = stream_interval
        self.scheduler = scheduler
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.token_text = P.TokenText(engine.tokenizer) if engine.tokenizer is not None else None
        self.created = int(time.time())
        self.stopping = threading.Event()

    def begin_shutdown(self) -> None:
        """Stop generating (signal-handler safe: the scheduler closes in its own thread): requests in flight end
        with a 503 / a stream error event, new ones get 503."""
        if not self.stopping.is_set():
            self.stopping.set()
            threading.Thread(target=self.scheduler.close, name="tinyinfer-close", daemon=True).start()

    @staticmethod
    def shutting_down() -> P.APIError:
        return P.APIError(503, "the server is shutting down", code="server_shutdown")

    # ---- checks ----

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise P.APIError(401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key")

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise P.APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                             param="model", code="model_not_found")

    def check_ids(self, ids, what: str, param: str) -> None:
        """Every id in the model's vocabulary, else a 400 naming `param`."""
        vocab = self.engine.config.vocab
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise P.bad(f"{what} {bad[0]} is out of range for a vocabulary of {vocab}", param)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tinyinfer",
                "max_model_len": self.engine.max_seq_len}

    async def health(self) -> dict:
        return {"status": "ok", "model": self.model_name, **await self._ask(self.scheduler.stats)}

    async def metrics(self) -> tuple[bytes, str]:
        """GET /metrics's body and content type (server/metrics.py)."""
        if importlib.util.find_spec("prometheus_client") is None:  # (the serve extra's: asked before the engine)
            raise P.APIError(501, "GET /metrics needs prometheus_client: pip install 'tinyinfer[serve]'")
        return render_metrics(await self._ask(self.scheduler.metrics), self.model_name)

    @staticmethod
    async def _ask(call) -> Any:
        """A scheduler call's answer: at once in the engine's process; from an API worker, the engine process's
        (a 503 where that process has ended)."""
        value = call()
        if inspect.isawaitable(value):
            try:
                value = await value
            except DeviceError as e:
                raise P.APIError(503, str(e), code="engine_gone") from None
        return value

    # ---- prompts -> scheduler requests ----

    def prompt_ids(self, g: P.GenerationRequest) -> list[list[int]]:
        """Token ids of each prompt (run in a worker thread: templates and long prompts take time)."""
        eng = self.engine
        param = "messages" if g.kind == "chat" else "prompt"
        if eng.tokenizer is None and (g.kind == "chat" or any(isinstance(p, str) for p in g.prompts)):
            raise P.bad("this model has no tokenizer: give the prompt as token ids", param)
        try:
            if g.kind == "chat":
                return [eng.apply_chat_template(g.messages, tools=g.tools)]
            out = []
            for p in g.prompts:
                ids = eng.tokenize(p) if isinstance(p, str) else list(p)
                self.check_ids(ids, "token id", param)
                if not ids:
                    raise P.bad("the prompt is empty", param)
                out.append(ids)
            return out
        except (InvalidRequestError, ChatTemplateError, TokenizerError) as e:
            raise P.bad(str(e), param) from None

    # ---- /tokenize, /detokenize ----

    async def tokenize(self, request: Request) -> dict:
        """vLLM's POST /tokenize: the token ids a completion's prompt or a chat's messages would be submitted as."""
        self.check_auth(request)
        t = P.parse_tokenize(await _read_json(request, self.max_body_bytes))
        self.check_model(t.model)
        ids = await run_in_threadpool(self._tokenize, t)
        strs = [self.engine.tokenizer.id_to_token(i) for i in ids] if t.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.engine.max_seq_len, "tokens": ids, "token_strs": strs}

    def _tokenize(self, t: P.TokenizeRequest) -> list[int]:
        eng = self.engine
        param = "messages" if t.messages is not None else "prompt"
        if eng.tokenizer is None:
            raise P.bad("this model has no tokenizer", param)
        try:
            if t.messages is not None:
                return eng.apply_chat_template(t.messages, add_generation_prompt=t.add_generation_prompt,
                                               tools=t.tools)
            return eng.tokenize(t.prompt, add_special_tokens=t.add_special_tokens)
        except (InvalidRequestError, ChatTemplateError, TokenizerError) as e:
            raise P.bad(str(e), param) from None

    async def detokenize(self, request: Request) -> dict:
        """vLLM's POST /detokenize: the text of token ids, special tokens included (the inverse of /tokenize)."""
        self.check_auth(request)
        model, ids = P.parse_detokenize(await _read_json(request, self.max_body_bytes))
        self.check_model(model)
        if self.engine.tokenizer is None:
            raise P.bad("this model has no tokenizer", "tokens")
        self.check_ids(ids, "token id", "tokens")
        text = await run_in_threadpool(self.engine.detokenize, ids, skip_special_tokens=False)
        return {"prompt": text}

    def max_tokens_for(self, g: P.GenerationRequest, n_prompt: int) -> int:
        limit = self.engine.max_seq_len
        room = limit - n_prompt
        want = g.max_tokens
        if want is None:
            want = max(room, 1) if g.kind == "chat" else COMPLETIONS_DEFAULT_MAX_TOKENS
        if n_prompt + want > limit:
            param = "max_tokens" if g.max_tokens and room > 0 else ("messages" if g.kind == "chat" else "prompt")
            raise P.bad(f"this model's context is {limit} tokens; the prompt has {n_prompt} and {want} more were "
                        f"asked (max_tokens)", param, "context_length_exceeded")
        if g.params.min_tokens > want:
            raise P.bad(f"'min_tokens' ({g.params.min_tokens}) must be at most max_tokens ({want}"
                        f"{'' if g.max_tokens else ', the default here'})", "min_tokens")
        return want

    async def submit(self, g: P.GenerationRequest, prompts: list[list[int]], rid: str) -> _Call:
        """One scheduler Request per (prompt, choice); all or none (a refusal cancels those already queued). The
        scheduler is the engine's, or in a frontend process a RemoteScheduler, whose submit is awaited."""
        # every choice waits in the scheduler's queue at first: a request of more choices than the queue holds
        # would be answered 503 ("busy, retry") even on an idle server, and every retry too (a lone choice keeps
        # the 503: --max-waiting 0 is a server that is always busy)
        cap = getattr(self.scheduler, "max_waiting", None)
        asked = len(prompts) * g.n
        if cap is not None and asked > max(cap, 1):
            raise P.bad(f"this request asks for {asked} completions ({len(prompts)} prompt(s) x n={g.n}); this "
                        f"server queues at most {cap} at once (--max-waiting)", "n" if g.n > 1 else "prompt")
        choices: list[_Choice] = []
        compile_grammar = getattr(self.engine, "compile_grammar", None)  # (an API worker: the engine process does it)
        if g.params.structured_outputs is not None and compile_grammar is not None:
            try:  # once for every choice, and off the event loop (~0.2 s for the first request: the tokenizer)
                await run_in_threadpool(compile_grammar, g.params.structured_outputs)
            except InvalidRequestError as e:
                raise P.bad(str(e), g.structured_from) from None
        try:
            for pi, ids in enumerate(prompts):
                base = dataclasses.replace(g.params, max_tokens=self.max_tokens_for(g, len(ids)),
                                           logprobs=g.logprobs)
                for j in range(g.n):
                    sp = base if base.seed is None else dataclasses.replace(base, seed=(base.seed + j) % 2**64)
                    k = pi * g.n + j
                    req = self.scheduler.submit(ids, sp, request_id=f"{rid}-{k}")
                    if inspect.isawaitable(req):
                        req = await req
                    choices.append(_Choice(k, req, len(ids)))
                    choices[-1].prompt_ids = ids
                    if g.echo:
                        p = g.prompts[pi]
                        choices[-1].echo = p if isinstance(p, str) else self.engine.detokenize(ids)
        except BaseException as e:
            for c in choices:
                c.req.cancel()
            if self.stopping.is_set():
                raise self.shutting_down() from None
            if isinstance(e, QueueFullError):
                raise P.APIError(503, f"the server is busy: {e}", code="queue_full",
                                 headers={"Retry-After": "1"}) from None
            if isinstance(e, InvalidRequestError):  # (the engine's checks, each naming its field where it knows it)
                param = g.structured_from if e.param == "structured_outputs" else e.param
                raise P.bad(str(e), param) from None
            raise
        return _Call(rid, choices, g.n, g.prompt_only)

    async def generate(self, request: Request, parse):
        t_start = time.perf_counter()
        self.check_auth(request)
        g = parse(await _read_json(request, self.max_body_bytes), self.sampling_defaults)
        self.check_model(g.model)
        if g.tool_choice == "auto" and self.tool_parser is None:  # (vLLM's rule and message)
            raise P.bad("\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set "
                        "(tools without a tool_choice mean \"auto\")", "tool_choice")
        if g.echo and self.engine.tokenizer is None:
            raise P.bad("'echo' needs the model's tokenizer (this model has none)", "echo")
        self.check_ids(g.params.stop_token_ids, "stop token id", "stop_token_ids")
        self.check_ids(g.params.logit_bias or (), "logit_bias token id", "logit_bias")
        if g.kind == "completion" and not any(isinstance(p, str) for p in g.prompts):
            prompts = self.prompt_ids(g)  # token ids: only checked, no worker-thread hop (~0.5 ms a request)
        else:
            prompts = await run_in_threadpool(self.prompt_ids, g)
        call = await self.submit(g, prompts, f"{'chatcmpl' if g.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}")
        trace = getattr(self.scheduler, "trace", None)
        if trace is not None:  # the handler's start; its scheduler requests are "<call.id>-<k>"
            trace.event("http_start", call.id, t=t_start)
            call.trace = trace
        if g.stream:
            return DisconnectAwareStream(self.events(g, call), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return await self.answer(request, g, call)
        except ClientGone:
            return JSONResponse({"error": None}, status_code=499)  # nobody reads it

    # ---- answers ----

    def logprobs_of(self, g: P.GenerationRequest, items, c: _Choice, prompt=None) -> Optional[dict]:
        """A choice's logprobs object of these items; prompt: an echoed prompt's prompt_logprobs (its first entry
        None), whose entries come first."""
        if g.logprobs is None or self.token_text is None or not (items or prompt):
            return None
        if g.kind == "chat":
            return P.chat_logprobs(items, self.token_text) if items else None
        if c.offsets is None:  # (an echoed prompt's tokens are counted through it; else the text follows them)
            c.offsets = P.TextOffsets(self.engine.tokenizer, () if prompt else c.prompt_ids[-CONTEXT_TOKENS:])
        if not prompt:
            return P.completion_logprobs(items, self.token_text, c.offsets)
        head = P.completion_logprobs(prompt[1:], self.token_text, c.offsets, first_id=c.prompt_ids[0])
        return P.joined_logprobs(head, P.completion_logprobs(items, self.token_text, c.offsets) if items else None)

    def tool_answer(self, g: P.GenerationRequest) -> Optional[ToolAnswer]:
        """A chat choice's reader of tool calls, where its request may make them (tools, tool_choice not none)."""
        if g.kind != "chat" or not g.tools or g.tool_choice == "none":
            return None
        return ToolAnswer(g.tool_choice, parser(self.tool_parser) if g.tool_choice == "auto" else None,
                          g.parallel_tool_calls)

    async def answer(self, request: Request, g: P.GenerationRequest, call: _Call) -> dict:
        """The whole answer; the client's disconnect (watched meanwhile) cancels the requests."""
        async def one(c: _Choice) -> None:
            async for d in _deltas(c, NO_STREAM_EVERY):
                call.saw(c, d)

        async def collect() -> None:
            try:
                await asyncio.gather(*(one(c) for c in call.choices))
            finally:
                call.cancel_unfinished()

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            left = not work.done()
            if left:  # the client left (or the server stops): collect's finally cancels the requests
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                call.log("client gone")
        if left:
            raise ClientGone()
        work.result()
        if any(c.completion.finish_reason == "cancelled" for c in call.choices):  # only close() cancels these
            call.log("server shutdown")
            raise self.shutting_down()
        choices = []
        for c in call.choices:
            text, finish, calls = c.completion.text, c.completion.finish_reason, []
            tools = self.tool_answer(g)
            if tools is not None:
                tools.add(text, final=True)
                text, calls, finish, _ = tools.end(finish)
            prompt_lps, items = None, c.completion.logprobs
            if c.echo is not None:
                text, prompt_lps = c.echo + text, c.completion.prompt_logprobs
            if g.prompt_only:
                text, items, finish = c.echo, [], "length"
            choices.append(P.final_choice(g.kind, c.index, text, self.logprobs_of(g, items, c, prompt_lps),
                                          finish, None if g.prompt_only else c.completion.stop_reason, calls))
        call.log(call.finish_reasons())
        return {"id": call.id, "object": "chat.completion" if g.kind == "chat" else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices, "usage": call.usage(),
                "system_fingerprint": None}

    async def events(self, g: P.GenerationRequest, call: _Call) -> AsyncIterator[str]:
        """SSE: chunks of each choice's new text (all that is ready: one token per chunk while the client keeps
        up, several when it lags), its finish chunk, the usage chunk when asked, `data: [DONE]`; what is ready
        at once goes out in one write. Cancelled (the client left) -> `finally` cancels the requests."""
        head: dict[str, Any] = {"id": call.id, "object": "chat.completion.chunk" if g.kind == "chat"
                                else "text_completion", "created": int(time.time()), "model": self.model_name}
        if g.kind == "chat":
            head["system_fingerprint"] = None
        fmt = P.ChunkFormat(head, g.kind, g.include_usage)
        for c in call.choices:
            c.tools = self.tool_answer(g)
        outcome = "client gone"
        try:
            if g.kind == "chat":
                yield "".join(fmt.chunk(P.stream_choice("chat", c.index, "", None, None, first=True))
                              for c in call.choices)
            left = len(call.choices)
            async with contextlib.aclosing(_ready(call.choices, self.stream_interval)) as ready:
                async for items in ready:
                    out: list[str] = []
                    for c, d in items:
                        if isinstance(d, Exception):
                            outcome = "failed"
                            out.append(P.sse(P.APIError(500, f"generation failed: {type(d).__name__}: {d}").body()))
                            yield "".join(out)
                            return
                        call.saw(c, d)
                        if c.echo is not None:  # the prompt first, in a chunk of its own (and its logprobs)
                            out.append(fmt.text(c.index, c.echo, self.logprobs_of(g, [], c, d.prompt_logprobs)))
                            c.echo = None
                        if g.prompt_only:  # (its one generated token left out)
                            d = dataclasses.replace(d, text="", token_ids=[], logprobs=None)
                        lp = self.logprobs_of(g, d.logprobs, c)
                        text = d.text
                        if c.tools is not None:  # content only; what may be a call is held back
                            text = c.tools.add(text, final=d.completion is not None)
                        if text or lp or (d.token_ids and c.tools is None):  # (held-back text: no empty chunk)
                            out.append(fmt.text(c.index, text, lp))
                        if d.completion is None:
                            continue
                        if d.completion.finish_reason == "cancelled":  # only close() cancels these
                            outcome = "server shutdown"
                            out.append(P.sse(self.shutting_down().body()))
                            yield "".join(out)
                            return
                        left -= 1
                        finish = "length" if g.prompt_only else d.completion.finish_reason
                        if c.tools is not None:
                            _, calls, finish, rest = c.tools.end(finish)
                            if rest:
                                out.append(fmt.text(c.index, rest, None))
                            if calls:
                                out.append(fmt.tool_calls(c.index, calls))
                        out.append(fmt.finish(c.index, finish, None if g.prompt_only else d.completion.stop_reason))
                    if not left:
                        if g.include_usage:
                            out.append(P.sse({**head, "choices": [], "usage": call.usage()}))
                        out.append("data: [DONE]\n\n")
                        outcome = call.finish_reasons()
                        yield "".join(out)
                        return
                    if out:
                        yield "".join(out)
        finally:
            call.cancel_unfinished()
            call.log(outcome)


def create_app(engine, scheduler, *, model_name: str, api_key: Optional[str] = None,
               max_body_bytes: int = MAX_BODY_BYTES, stream_interval: Optional[int] = None,
               sampling_defaults: Optional[dict] = None, tool_parser: Optional[str] = None) -> FastAPI:
    """The app serving `engine` through `scheduler` (started and closed by the app's lifespan) as `model_name`.
    api_key: when set, /v1/* needs `Authorization: Bearer <api_key>` (/health stays open for load balancers).
    stream_interval: a stream's chunk goes out once per this many tokens (its first token and its end at once);
    None: adaptive (Scheduler.adaptive_interval: 1 while few sequences run, every 4th token at 64).
    sampling_defaults: what a request leaves out of sampling.DEFAULTABLE (protocol.checked_defaults' valid ones;
    None: OpenAI's defaults)
    tool_parser: the model's tool-call format (tools.PARSERS) for tool_choice "auto"; None: such requests refused
    app.state.begin_shutdown(): stop generating now (tinyinfer serve calls it on Ctrl-C)."""
    if stream_interval is not None and (not isinstance(stream_interval, int) or isinstance(stream_interval, bool)
                                        or stream_interval < 1):
        raise InvalidRequestError(f"stream_interval must be an integer >= 1 or None (got {stream_interval!r})")
    defaults, dropped = P.checked_defaults(sampling_defaults or {})
    if dropped:  # (every request would be refused for the server's own setting)
        raise InvalidRequestError(f"sampling_defaults: {'; '.join(dropped)}")
    if tool_parser is not None:
        parser(tool_parser)  # (an unknown name: refused now)
    svc = Service(engine, scheduler, model_name, api_key, max_body_bytes, stream_interval,
                  MappingProxyType(defaults), tool_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.close()

    app = FastAPI(title="tinyinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.begin_shutdown = svc.begin_shutdown

    @app.exception_handler(P.APIError)
    async def _api_error(request, e: P.APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return _error_response(P.APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):  # the server keeps serving; the client gets OpenAI's shape
        log.exception("internal error on %s", request.url.path)
        return _error_response(P.APIError(500, f"internal error: {type(e).__name__}: {e}"))

    @app.get("/health")
    async def health():
        return await svc.health()

    @app.get("/metrics")
    async def prometheus_metrics():  # (open, as /health: what runs and what was served, no request's content)
        body, content_type = await svc.metrics()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        svc.check_auth(request)
        return {"object": "list", "data": [svc.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        svc.check_auth(request)
        svc.check_model(name)
        return svc.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await svc.generate(request, P.parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await svc.generate(request, P.parse_completion)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await svc.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await svc.detokenize(request)

    return app
