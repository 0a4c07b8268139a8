"""The engine side of the API workers' links (`tinyinfer serve --api-workers N`, N > 1).

With several API workers the HTTP side (parsing, templates, tokenizing, JSON, SSE, sockets) runs in processes of
its own and the engine process keeps the scheduler and nothing else that wants the GIL. Each worker talks to the
engine over one duplex pipe (multiprocessing.connection, pickled tuples):

    worker -> engine   ("submit", call_id, request_id, prompt_ids, SamplingParams)
                       ("watch", request_id, every)        # Request.batches(every) of the consumer
                       ("cancel", request_id)
                       ("stats", call_id)                  # /health
                       ("metrics", call_id)                # /metrics
    engine -> worker   ("reply", call_id, error or None, value)
                       ("items", [(request_id, [Delta..., maybe the exception that failed it]), ...])
                       ("shutdown",)                       # stopping: new requests 503, stop when streams end

The scheduler's step wakes a request's consumer through its "loop" (request.wake: call_soon_threadsafe): here a
worker's link, which only notes the request as ready, so the step's thread never touches a pipe. Two threads
serve all the links, however many workers there are (each thread more is one more taker of the GIL the
scheduler's thread needs after every device call): a sender that ships what a step made, one message per worker,
and a reader that submits, watches, cancels and answers. When a worker goes away (EOF) its requests are
cancelled and their KV pages return to the pool at the next step.
"""

from __future__ import annotations

import logging
import pickle
import threading
from multiprocessing.connection import wait
from typing import Optional

from ..errors import TinyInferError

log = logging.getLogger("tinyinfer.server")


def portable(e: BaseException) -> BaseException:
    """e if it survives pickling, else a TinyInferError saying what it was (the worker must get something)."""
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

    def __init__(self, link: "Link", req):
        self.link, self.req = link, req

    def set(self) -> None:
        self.link.hub._ready.append((self.link, self.req))  # (under the hub's lock: call_soon_threadsafe holds it)


class Link:
    """One worker's pipe: its live requests. The scheduler's step sees it as the event loop of those requests."""

    def __init__(self, hub: "EngineHub", conn, name: str):
        self.hub, self.conn, self.name = hub, conn, name
        self.live: dict = {}  # request id -> Request, until its last item is shipped (guarded by hub._cv)
        self.closed = False
        self._send_lock = threading.Lock()

    def call_soon_threadsafe(self, callback, *args) -> None:
        with self.hub._cv:
            callback(*args)  # request._set_all(marks): each _Mark.set() notes its request
            self.hub._cv.notify()

    def send(self, msg) -> bool:
        try:
            with self._send_lock:
                self.conn.send(msg)
            return True
        except (OSError, EOFError, ValueError):  # the worker is gone (ValueError: the pipe is closed)
            self.hub._lost(self)
            return False


class EngineHub:
    """Every worker's link to one scheduler: a reader thread and a sender thread for all of them."""

    def __init__(self, scheduler, conns: list, names: Optional[list] = None):
        self._sched = scheduler
        self._cv = threading.Condition()
        self._ready: list = []  # (link, request) with new items (guarded by _cv)
        self.links = [Link(self, c, n) for c, n in zip(conns, names or [f"api-{i}" for i in range(len(conns))])]
        self._stopped = False
        self._stopping = False  # shutdown() began: a refused submit is preceded by ("shutdown",) on its link
        self._threads = [threading.Thread(target=self._read, name="tinyinfer-links-in", daemon=True),
                         threading.Thread(target=self._ship, name="tinyinfer-links-out", daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    @property
    def live(self) -> int:
        """Requests of the workers not yet ended and shipped."""
        with self._cv:
            return sum(len(link.live) for link in self.links)

    # ---- the sender thread ----

    def _ship(self) -> None:
        while True:
            try:
                if not self._ship_once():
                    return
            except Exception:  # noqa: BLE001 (a bug here must not stop every stream: logged, on to the next step)
                log.exception("the API workers' sender failed")

    def _ship_once(self) -> bool:
        """Ship what the steps made since the last time, one message per worker (False: the hub has stopped)."""
        with self._cv:
            while not self._ready and not self._stopped:
                self._cv.wait()
            if self._stopped:
                return False
            ready, self._ready = self._ready, []
        out: dict = {}
        seen = set()
        for link, req in ready:
            if req.id in seen or link.closed:
                continue
            seen.add(req.id)
            items = req.pending()
            if not items:
                continue
            if isinstance(items[-1], BaseException):
                items[-1] = portable(items[-1])
            if _final(items[-1]):
                with self._cv:
                    link.live.pop(req.id, None)
            out.setdefault(link, []).append((req.id, items))
        for link, batch in out.items():
            try:
                link.send(("items", batch))
            except Exception:  # noqa: BLE001 (not a closed pipe: something in the batch did not pickle)
                log.exception("the output of %d requests could not be sent to API worker %s", len(batch), link.name)
                failed = TinyInferError("the engine process could not send this request's output")
                link.send(("items", [(rid, [failed]) for rid, _ in batch]))
                with self._cv:
                    for rid, _ in batch:
                        link.live.pop(rid, None)
                for rid, _ in batch:
                    self._sched.cancel(rid)
        return True

    # ---- the reader thread ----

    def _read(self) -> None:
        by_conn = {link.conn: link for link in self.links}
        while by_conn and not self._stopped:
            try:
                ready = wait(list(by_conn), timeout=0.5)
            except (OSError, ValueError):  # a pipe closed under the wait (close())
                ready = [c for c in by_conn if by_conn[c].closed]
            for conn in ready:
                link = by_conn[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError, TypeError, ValueError):  # (TypeError: closed under the read)
                    del by_conn[conn]
                    self._lost(link)
                    continue
                try:
                    self._handle(link, msg)
                except Exception as e:  # noqa: BLE001 (a bug here must not stop every worker's submits)
                    log.exception("the API workers' reader failed on a %r message", msg[0] if msg else msg)
                    if msg and msg[0] == "submit":  # (it may have been queued: nobody would read it)
                        with self._cv:
                            link.live.pop(msg[2], None)
                        self._sched.cancel(msg[2])
                    if msg and msg[0] in ("submit", "stats", "metrics"):  # (the worker awaits an answer to these)
                        link.send(("reply", msg[1], portable(TinyInferError(f"{type(e).__name__}: {e}")), None))

    def _handle(self, link: Link, msg) -> None:
        kind = msg[0]
        if kind == "submit":
            self._submit(link, *msg[1:])
        elif kind == "watch":
            with self._cv:
                req = link.live.get(msg[1])
            if req is not None:
                self._attach(link, req, msg[2])
        elif kind == "cancel":
            self._sched.cancel(msg[1])
        elif kind == "stats":
            link.send(("reply", msg[1], None, self._sched.stats()))
        elif kind == "metrics":
            link.send(("reply", msg[1], None, self._sched.metrics()))

    def _submit(self, link: Link, call_id: int, request_id: str, prompt_ids: list, params) -> None:
        try:
            req = self._sched.submit(prompt_ids, params, request_id=request_id)
        except Exception as e:  # noqa: BLE001 (refused: the worker raises it in the handler)
            if self._stopping:  # (refused as the scheduler closes: the worker must know why first, to answer 503)
                link.send(("shutdown",))
            link.send(("reply", call_id, portable(e), None))
            return
        with self._cv:
            gone = link.closed
            if not gone:
                link.live[request_id] = req
        if gone:  # (the worker went away while this submit was read: nobody will read its answer)
            self._sched.cancel(request_id)
            return
        self._attach(link, req, 1)
        link.send(("reply", call_id, None, None))

    def _attach(self, link: Link, req, every: Optional[int]) -> None:
        req.attach(link, _Mark(link, req), every)
        with self._cv:  # what it queued before: shipped now
            self._ready.append((link, req))
            self._cv.notify()

    def _lost(self, link: Link) -> None:
        """A worker is gone: its requests end, their pages free at the next step."""
        with self._cv:
            if link.closed:
                return
            link.closed = True
            live, link.live = list(link.live), {}
        for rid in live:
            self._sched.cancel(rid)

    # ---- the engine process's shutdown ----

    def shutdown(self) -> None:
        """Tell every worker to stop serving (new requests: 503); the streams open then still get their ends.
        Returns at once: each message goes from a thread of its own (a worker that does not read must not delay
        the others). Call it before closing the scheduler: a submit it refuses is then preceded by the message."""
        self._stopping = True
        for link in self.links:
            if not link.closed:
                threading.Thread(target=link.send, args=(("shutdown",),), name=f"tinyinfer-stop-{link.name}",
                                 daemon=True).start()

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        for link in self.links:
            self._lost(link)
            try:
                link.conn.close()
            except OSError:
                pass
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(2.0)
