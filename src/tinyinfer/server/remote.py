"""The frontend side of the link to the engine process (`tinyinfer serve --api-workers N`, N > 1).

A frontend process runs the same app (server/app.py) over two stand-ins: TextSide for the Engine (the tokenizer,
the chat template and the limits the handlers check: no weights) and RemoteScheduler for the Scheduler (submit,
cancel, stats; each submitted prompt a RemoteRequest whose batches() the handlers await as they would a
Request's). The protocol is in server/engine_link.py. A reader thread hands each message from the engine to the
event loop (one call_soon_threadsafe a message: a step's items for all of this process's streams at once).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from typing import AsyncIterator, Optional, Sequence

from ..errors import DeviceError, InvalidRequestError, TokenizerError
from ..request import Delta, drain
from ..tools import with_tools


class TextSide:
    """What the HTTP handlers need of an Engine, without the model: picklable, made from one."""

    def __init__(self, tokenizer, vocab: int, max_seq_len: int, path: str):
        self.tokenizer = tokenizer
        self.config = type("Config", (), {"vocab": vocab})()
        self.max_seq_len = max_seq_len
        self.path = path

    @classmethod
    def of(cls, engine) -> "TextSide":
        return cls(engine.tokenizer, engine.config.vocab, engine.max_seq_len, str(engine.path))

    def __reduce__(self):
        return TextSide, (self.tokenizer, self.config.vocab, self.max_seq_len, self.path)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise TokenizerError(f"{self.path}: the model has no tokenizer (tokenizer.json); pass token ids")
        return self.tokenizer

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._need_tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._need_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None) -> list[int]:
        tok = self._need_tokenizer()
        if not getattr(tok, "chat_template", None):
            raise TokenizerError(f"{self.path}: the model has no chat template")
        msgs, extra = with_tools(messages, tools)
        return tok.encode_chat(msgs, add_generation_prompt=add_generation_prompt, **extra)


def _final(item) -> bool:
    return isinstance(item, BaseException) or item.completion is not None


class RemoteRequest:
    """A prompt submitted to the engine process: batches() and cancel(), as a Request's (one consumer)."""

    def __init__(self, owner: "RemoteScheduler", request_id: str, prompt_token_ids: list[int]):
        self.id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._owner = owner
        self._items: collections.deque = collections.deque()
        self._event = asyncio.Event()
        self.finished = False

    def _feed(self, items: list) -> None:
        self._items.extend(items)
        self.finished = self.finished or _final(items[-1])
        self._event.set()

    async def batches(self, every: Optional[int] = 1) -> AsyncIterator[list[Delta]]:
        """Request.batches: the engine wakes this consumer once per `every` Deltas (None: adaptive)."""
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise InvalidRequestError(f"every must be an integer >= 1 or None (got {every!r})")
        if every != 1 and not self.finished:  # (submitted with 1)
            self._owner._send(("watch", self.id, every))
        async for batch in drain(self._take, self._event):
            yield batch

    def _take(self) -> list:
        out = list(self._items)
        self._items.clear()
        return out

    def cancel(self) -> None:
        if not self.finished:
            self._owner._send(("cancel", self.id))


class RemoteScheduler:
    """The engine process's Scheduler as the app uses it (submit / cancel / stats / start / close)."""

    trace = None  # (the engine process records the core calls; see `tinyinfer serve --trace`)

    def __init__(self, conn, on_end=None, max_waiting: Optional[int] = None):
        """on_end(): called in the event loop when the engine process says to stop, or is gone. max_waiting: the
        engine's Scheduler's (the app refuses a request of more choices than that at once; None: unchecked)."""
        self.max_waiting = max_waiting
        self._conn = conn
        self._on_end = on_end
        self._send_lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._requests: dict[str, RemoteRequest] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._closed = False
        self._gone: Optional[BaseException] = None

    def start(self) -> None:
        """Called in the event loop (the app's lifespan): start the reader thread."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            threading.Thread(target=self._read, name="tinyinfer-engine-in", daemon=True).start()

    def close(self) -> None:
        """Refuse new submits (the engine process ends the requests in flight; any thread)."""
        self._closed = True

    async def submit(self, prompt_ids: list[int], params, *, request_id: str) -> RemoteRequest:
        """Scheduler.submit in the engine process: its refusal (InvalidRequestError, QueueFullError) raised here."""
        if self._closed:
            raise InvalidRequestError("the scheduler is closed")
        req = RemoteRequest(self, request_id, prompt_ids)
        self._requests[request_id] = req  # (before the message: the first items may come before the reply)
        try:
            await self._call("submit", request_id, prompt_ids, params)
        except asyncio.CancelledError:  # (the handler was cancelled: the engine may have queued it already)
            self._requests.pop(request_id, None)
            self._send(("cancel", request_id))
            raise
        except BaseException:
            self._requests.pop(request_id, None)
            raise
        return req

    def cancel(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            req.cancel()

    async def stats(self) -> dict:
        return await self._call("stats")

    async def metrics(self) -> dict:
        return await self._call("metrics")

    async def _call(self, kind: str, *args):
        if self._gone is not None:
            raise self._gone
        cid = next(self._ids)
        fut = self._loop.create_future()
        self._calls[cid] = fut
        try:
            self._send((kind, cid, *args))
            return await fut
        finally:
            self._calls.pop(cid, None)

    def _send(self, msg) -> None:
        if self._gone is not None:
            return
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError):
            self._lost()

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError, TypeError, ValueError):  # (TypeError: closed under the read in this process)
                break
            try:
                self._loop.call_soon_threadsafe(self._dispatch, msg)
            except RuntimeError:  # the loop is closed: the process is ending
                return
        try:
            self._loop.call_soon_threadsafe(self._lost)
        except RuntimeError:
            pass

    def _dispatch(self, msg) -> None:
        if msg[0] == "items":
            for rid, items in msg[1]:
                req = self._requests.get(rid)
                if req is None:
                    continue
                req._feed(items)
                if req.finished:
                    del self._requests[rid]
        elif msg[0] == "shutdown":  # the engine process is stopping: new requests 503, stop once the streams end
            self._closed = True
            if self._on_end is not None:
                self._on_end()
        elif msg[0] == "reply":
            _, cid, error, value = msg
            fut = self._calls.get(cid)
            if fut is not None and not fut.done():
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(value)

    def _lost(self) -> None:
        """The engine process is gone: every request in flight and every call fails with that."""
        if self._gone is not None:
            return
        self._gone = DeviceError("the engine process has ended")
        for req in list(self._requests.values()):
            req._feed([self._gone])
        self._requests.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(self._gone)
        if self._on_end is not None:
            self._on_end()
