"""The engine side of a frontend process's link (`tinyinfer serve --api-workers N`, N > 1).

With several API workers the HTTP side (parsing, templates, tokenizing, JSON, SSE, sockets) runs in processes of
its own and the engine process keeps the scheduler and nothing else that wants the GIL. Each frontend process
talks to the engine over one duplex pipe (multiprocessing.connection, pickled tuples):

    frontend -> engine   ("submit", call_id, request_id, prompt_ids, SamplingParams)
                         ("watch", request_id, every)        # Request.batches(every) of the consumer
                         ("cancel", request_id)
                         ("stats", call_id)                  # /health
    engine -> frontend   ("reply", call_id, error or None, value)
                         ("items", [(request_id, [Delta..., maybe the exception that failed it]), ...])
                         ("shutdown",)                       # the scheduler has closed: stop serving

The scheduler's step wakes a request's consumer through its "loop" (request.wake: call_soon_threadsafe): here
that loop is the link, which only notes the request as ready, so the step's thread never touches the pipe. A
sender thread then ships everything the step made for this frontend in one message; a reader thread submits,
watches, cancels and answers. When the frontend goes away (EOF), its requests are cancelled and their KV pages
return to the pool at the next step.
"""

from __future__ import annotations

import pickle
import threading
from typing import Optional

from ..errors import TinyInferError


def portable(e: BaseException) -> BaseException:
    """e if it survives pickling, else a TinyInferError saying what it was (the frontend must get something)."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 (any pickling failure)
        return TinyInferError(f"{type(e).__name__}: {e}")


def _final(item) -> bool:
    return isinstance(item, BaseException) or item.completion is not None


class _Mark:
    """The 'asyncio.Event' a request's producer sets: notes the request as ready on its link."""

    __slots__ = ("link", "req")

    def __init__(self, link: "EngineLink", req):
        self.link, self.req = link, req

    def set(self) -> None:
        self.link._ready.append(self.req)  # (under the link's lock: call_soon_threadsafe holds it)


class EngineLink:
    """One frontend process's pipe, engine side: its requests on the scheduler, their items shipped back."""

    def __init__(self, scheduler, conn, name: str = "frontend"):
        self._sched = scheduler
        self._conn = conn
        self.name = name
        self._send_lock = threading.Lock()
        self._cv = threading.Condition()
        self._ready: list = []  # requests with new items (guarded by _cv)
        self._live: dict = {}  # request id -> Request, until its last item is shipped (guarded by _cv)
        self._closed = False
        self._threads = [threading.Thread(target=self._read, name=f"tinyinfer-{name}-in", daemon=True),
                         threading.Thread(target=self._ship, name=f"tinyinfer-{name}-out", daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout: Optional[float] = None) -> None:
        for t in self._threads:
            t.join(timeout)

    @property
    def live(self) -> int:
        with self._cv:
            return len(self._live)

    # ---- the scheduler's step (its thread): the link is the "event loop" of this frontend's requests ----

    def call_soon_threadsafe(self, callback, *args) -> None:
        with self._cv:
            callback(*args)  # request._set_all(marks): each _Mark.set() notes its request
            self._cv.notify()

    # ---- the sender thread ----

    def _ship(self) -> None:
        while True:
            with self._cv:
                while not self._ready and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                ready, self._ready = self._ready, []
            out, seen = [], set()
            for req in ready:
                if req.id in seen:
                    continue
                seen.add(req.id)
                items = req.pending()
                if not items:
                    continue
                if isinstance(items[-1], BaseException):
                    items[-1] = portable(items[-1])
                if _final(items[-1]):
                    with self._cv:
                        self._live.pop(req.id, None)
                out.append((req.id, items))
            if out and not self._send(("items", out)):
                return

    def _send(self, msg) -> bool:
        try:
            with self._send_lock:
                self._conn.send(msg)
            return True
        except (OSError, EOFError, ValueError):  # the frontend is gone (ValueError: the pipe is closed)
            self._lost()
            return False

    # ---- the reader thread ----

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError, TypeError, ValueError):  # (TypeError: closed under the read in this process)
                break
            kind = msg[0]
            if kind == "submit":
                self._submit(*msg[1:])
            elif kind == "watch":
                with self._cv:
                    req = self._live.get(msg[1])
                if req is not None:
                    self._attach(req, msg[2])
            elif kind == "cancel":
                self._sched.cancel(msg[1])
            elif kind == "stats":
                self._send(("reply", msg[1], None, self._sched.stats()))
        self._lost()

    def _submit(self, call_id: int, request_id: str, prompt_ids: list, params) -> None:
        try:
            req = self._sched.submit(prompt_ids, params, request_id=request_id)
        except Exception as e:  # noqa: BLE001 (refused: the frontend raises it in the handler)
            self._send(("reply", call_id, portable(e), None))
            return
        with self._cv:
            self._live[request_id] = req
        self._attach(req, 1)
        self._send(("reply", call_id, None, None))

    def _attach(self, req, every: Optional[int]) -> None:
        req.attach(self, _Mark(self, req), every)
        with self._cv:  # what it queued before: shipped now
            self._ready.append(req)
            self._cv.notify()

    def _lost(self) -> None:
        """The frontend is gone (or the link closes): its requests end, their pages free at the next step."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            live, self._live = list(self._live), {}
            self._cv.notify_all()
        for rid in live:
            self._sched.cancel(rid)

    def shutdown(self) -> None:
        """Tell the frontend to stop serving, once what the closed scheduler ended has been shipped."""
        with self._cv:
            while self._ready and not self._closed:
                self._cv.wait(0.05)
        self._send(("shutdown",))

    def close(self) -> None:
        self._lost()
        try:
            self._conn.close()
        except OSError:
            pass
