"""The request side of continuous batching: what a caller holds and what it receives.

    req = sched.submit("Once upon a time", SamplingParams(max_tokens=64))
    for delta in req:                               # or `async for delta in req`, or req.result()
        print(delta.text, end="")

A Request is a handle on one submitted prompt: the scheduler's step (another thread, or the waiting caller
itself) pushes its Deltas into a thread-safe queue, and any thread may wait on it, iterate it (one consumer),
iterate it from asyncio (woken by call_soon_threadsafe, blocking no thread) or cancel it. The scheduler that
produces the Deltas lives in scheduler.py; this module knows it only through the few calls a consumer makes
(step when nobody drives, start, cancel, adaptive_interval).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Iterator, Optional, Sequence, Union

from .engine import Completion
from .errors import InvalidRequestError, TinyInferError

if TYPE_CHECKING:
    from .scheduler import Scheduler

@dataclass
class TokenLogprob:
    token_id: int
    logprob: float  # log_softmax of the raw logits (before penalties and temperature) at token_id
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), descending


@dataclass
class Delta:
    """What one step produced for one request."""

    text: str  # newly safe text ("" possible: a held-back stop-string prefix, half a UTF-8 character)
    token_ids: list[int]  # new generated ids (a stop / EOS id that ended it included, as in Completion.token_ids)
    logprobs: Optional[list[TokenLogprob]]  # one per id when the request asked for logprobs, else None
    completion: Optional[Completion] = None  # on the request's last Delta only
    # SamplingParams.prompt_logprobs: on the request's first Delta (None for the prompt's first token)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None


def merge_deltas(deltas: Sequence[Delta]) -> Delta:
    """Consecutive Deltas of one request as one (text joined, ids and logprobs in order, the last completion)."""
    if len(deltas) == 1:
        return deltas[0]
    text, ids, lps = [], [], None
    for d in deltas:
        text.append(d.text)
        ids += d.token_ids
        if d.logprobs is not None:
            lps = (lps or []) + d.logprobs
    prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    return Delta("".join(text), ids, lps, deltas[-1].completion, prompt)


def wake(loop: asyncio.AbstractEventLoop, events: list) -> None:
    """Set asyncio Events from another thread: one hand-off to their loop for all of them."""
    try:
        loop.call_soon_threadsafe(_set_all, events)
    except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
        pass


async def drain(take, event: asyncio.Event) -> AsyncIterator[list[Delta]]:
    """One consumer's batches of a request's items: take() returns every item queued now (Deltas, then possibly
    the exception that failed the request), event is set when more come. Ends after the Delta holding the
    completion; raises the exception after the Deltas before it. (Request.batches, and an API worker's
    RemoteRequest.batches in server/remote.py.)"""
    while True:
        batch = take()
        if not batch:
            await event.wait()
            event.clear()  # then look again: a set that came before the clear left its item queued
            continue
        error = batch.pop() if isinstance(batch[-1], BaseException) else None  # nothing comes after it
        if batch:
            yield batch
        if error is not None:
            raise error
        if batch[-1].completion is not None:
            return


def _set_all(events: list) -> None:
    for e in events:
        e.set()


class Request:
    """A submitted request: a handle that any thread may wait on, iterate (one consumer) or cancel."""

    def __init__(self, scheduler: "Scheduler", request_id: str, prompt_token_ids: list[int]):
        self.id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._sched = scheduler
        self._items: queue.SimpleQueue = queue.SimpleQueue()  # Deltas, then (on failure) the exception
        self._done = threading.Event()
        self._completion: Optional[Completion] = None
        self._error: Optional[BaseException] = None
        self._waker_lock = threading.Lock()
        self._waker: Optional[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = None
        self._every: Optional[int] = 1  # batches(every): wake the consumer once per this many Deltas
        self._unwoken = 0  # Deltas queued since the consumer was last woken
        self._seen_token = False

    def __repr__(self) -> str:
        state = "finished" if self.finished else "live"
        return f"Request(id={self.id!r}, prompt_tokens={len(self.prompt_token_ids)}, {state})"

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    # ---- the producer side (the scheduler) ----

    def _put(self, item: Union[Delta, BaseException], wakes: Optional[dict] = None) -> None:
        """Queue an item and wake an asyncio consumer: at once, or (wakes given: the scheduler's step collects
        them) by one call_soon_threadsafe per event loop when the step ends, not one per request."""
        if isinstance(item, BaseException):
            self._error = item
        elif item.completion is not None:
            self._completion = item.completion
        self._items.put(item)
        if isinstance(item, BaseException) or item.completion is not None:
            self._done.set()
        with self._waker_lock:
            waker = self._waker
        if waker is None:
            return
        if isinstance(item, Delta) and item.completion is None:
            # a consumer asking for coarser wake-ups is woken for its first token (time to first token), then
            # once per `every` Deltas; always for the last one and for an error
            self._unwoken += 1
            first = not self._seen_token and bool(item.token_ids)
            self._seen_token = self._seen_token or first
            every = self._every if self._every is not None else self._sched.adaptive_interval()
            if not first and self._unwoken < every:
                return
        self._unwoken = 0
        loop, event = waker
        if wakes is not None:
            wakes.setdefault(loop, []).append(event)
        else:
            wake(loop, [event])

    # ---- the consumer side ----

    def _next_item(self) -> Union[Delta, BaseException]:
        while True:
            try:
                return self._items.get_nowait()
            except queue.Empty:
                pass
            if self._sched._has_driver():
                return self._items.get()
            if not self._sched.step() and self._items.empty():
                raise TinyInferError(f"request {self.id!r} is neither queued nor running")  # a bug, not a hang

    def __iter__(self) -> Iterator[Delta]:
        """Deltas as they are produced; ends after the one holding the completion. A failed request raises its
        error (after the Deltas it produced)."""
        while True:
            item = self._next_item()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.completion is not None:
                return

    async def __aiter__(self) -> AsyncIterator[Delta]:
        """As __iter__, for asyncio: waits on an asyncio.Event the scheduler's thread sets, blocking no thread."""
        async for batch in self.batches():
            for d in batch:
                yield d

    async def batches(self, every: Optional[int] = 1) -> AsyncIterator[list[Delta]]:
        """As __aiter__, but every Delta queued by the time the consumer looks comes at once, in order (never an
        empty list): a consumer slower than the steps (a server streaming to many clients) catches up in one go
        instead of handling one Delta per wake-up. A failed request raises after the Deltas it produced.
        every: wake this consumer (after its first token) once per `every` Deltas, not at each one; None: the
        scheduler's adaptive_interval(), coarser as more sequences run (each wake-up costs the event loop a
        task switch and a write; at 64 streams they would hold the GIL longer than the core's step)."""
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise InvalidRequestError(f"every must be an integer >= 1 or None (got {every!r})")
        event = asyncio.Event()
        self.attach(asyncio.get_running_loop(), event, every)
        try:
            async for batch in drain(self.pending, event):
                yield batch
        finally:
            with self._waker_lock:
                self._waker = None

    def attach(self, loop, event, every: Optional[int] = 1) -> None:
        """Have the scheduler's steps wake this consumer: event.set() run through loop.call_soon_threadsafe once
        per `every` Deltas (see batches). loop: an asyncio loop, or any object with that method (the engine
        side of a server's frontend process: server/engine_link.py). Items queued before the call are not
        signalled: the consumer looks at the queue after attaching. Starts the scheduler's thread."""
        with self._waker_lock:
            self._every = every
            self._waker = (loop, event)
        self._sched.start()

    def pending(self) -> list:
        """Every item queued now (Deltas, then possibly the exception that failed the request), without waiting."""
        out: list = []
        try:
            while True:
                out.append(self._items.get_nowait())
        except queue.Empty:
            return out

    def result(self, timeout: Optional[float] = None) -> Completion:
        """The Completion (waits for it; TimeoutError after `timeout` seconds); a failed request raises its error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"request {self.id!r} did not finish within {timeout} s")
            if self._sched._has_driver():
                self._done.wait(left)
            elif not self._sched.step() and not self._done.is_set():
                raise TinyInferError(f"request {self.id!r} is neither queued nor running")
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion

    def cancel(self) -> None:
        """End the request: finish_reason "cancelled"; its KV pages are freed at the next step. No-op once ended."""
        self._sched.cancel(self.id)


__all__ = ["Request", "Delta", "TokenLogprob", "merge_deltas", "wake", "drain"]
