"""The link between an API worker process and the engine process (`tinyinfer serve --api-workers N`):
server/engine_link.py (engine side) and server/remote.py (the worker's RemoteScheduler), run here over a real
pipe in one process, on the real CPU engine. The server tests run the whole thing as processes."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import socket
import time

import pytest

pytest.importorskip("fastapi")  # (server/__init__ imports nothing, but the serve extra is what uses the link)

from conftest import hold_steps, make_chat_llama, sched_cancels_pending
from tinyinfer import Engine, InvalidRequestError, QueueFullError, SamplingParams, Scheduler
from tinyinfer.errors import DeviceError, TinyInferError
from tinyinfer.server.engine_link import EngineHub, portable
from tinyinfer.server.remote import RemoteScheduler, TextSide


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = make_chat_llama(tmp_path_factory.mktemp("link") / "m", init_std=0.3)
    with Engine(d, device="cpu", max_seq_len=256, threads=2) as e:
        yield e


def _pair(sched):
    mine, theirs = multiprocessing.Pipe(duplex=True)
    hub = EngineHub(sched, [mine])
    hub.start()
    return hub, theirs


@contextlib.contextmanager
def _linked(sched):
    """(hub, the worker's end of its link) for sched; on the way out the scheduler closes first, then the hub."""
    hub, conn = _pair(sched)
    try:
        yield hub, conn
    finally:
        sched.close()
        hub.close()


def _started(conn) -> "RemoteScheduler":
    remote = RemoteScheduler(conn)
    remote.start()
    return remote


def _hang_up(conn) -> None:
    """As a worker process's exit: EOF at the other end now (a close() alone waits for a read blocked on it)."""
    s = socket.socket(fileno=os.dup(conn.fileno()))
    s.shutdown(socket.SHUT_RDWR)
    s.close()
    conn.close()


def _idle(sched, eng, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not sched.idle and time.monotonic() < deadline:
        time.sleep(0.01)
    if sched.idle:
        sched.reset_prefix_cache()  # (the ended requests' kept caches: all that may still hold pages)
    return sched.idle and eng._core.kv_pages_free == eng._core.kv_pages_total


async def _collect(req, every=1):
    text, ids, n = "", [], 0
    async for batch in req.batches(every):
        n += 1
        for d in batch:
            text += d.text
            ids += d.token_ids
    return text, ids, batch[-1].completion, n


def test_remote_requests_equal_local_ones(eng):
    prompts = ["Once upon a time", "The", "abc abc abc"]
    sps = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=1) for n in (7, 19, 12)]
    want = [eng.generate(p, SamplingParams(max_tokens=sp.max_tokens, ignore_eos=True)) for p, sp in zip(prompts, sps)]
    sched = Scheduler(eng)
    with _linked(sched) as (hub, conn):
        async def main():
            remote = _started(conn)
            reqs = [await remote.submit(eng.tokenize(p), sp, request_id=f"r{i}")
                    for i, (p, sp) in enumerate(zip(prompts, sps))]
            got = await asyncio.gather(*(_collect(r, every) for r, every in zip(reqs, (1, 4, None))))
            return got, await remote.stats()

        got, stats = asyncio.run(main())
        assert got[1][3] <= 9  # every=4: a wake-up per 4 tokens of 19 (and its first, its last), not one per token
        for (text, ids, done, _), w in zip(got, want):
            assert (text, ids, done.token_ids, done.finish_reason) == (w.text, w.token_ids, w.token_ids, "length")
            assert len(done.logprobs) == len(ids)
        # (the three ended requests' caches kept: one page each)
        assert stats == {"running": 0, "waiting": 0, "kv_pages_used": 0, "kv_pages_total": sched.kv_pages_total,
                         "kv_pages_cached": 3, "cached_sequences": 3}
    assert _idle(sched, eng)


def test_a_refused_submit_raises_in_the_worker(eng):
    sched = Scheduler(eng, max_waiting=0)
    with _linked(sched) as (hub, conn):
        async def main():
            remote = _started(conn)
            with pytest.raises(QueueFullError, match="max_waiting=0"):
                await remote.submit([5, 6, 7], SamplingParams(max_tokens=2), request_id="a")
            with pytest.raises(InvalidRequestError, match="max_seq_len"):
                await remote.submit([5, 6, 7], SamplingParams(max_tokens=1000), request_id="b")
            with pytest.raises(InvalidRequestError, match="logit_bias token id") as e:  # (its field crosses too)
                await remote.submit([5, 6, 7], SamplingParams(max_tokens=2, logit_bias={10**6: 1}), request_id="c")
            assert e.value.param == "logit_bias"
            return await remote.stats()  # still answering

        assert asyncio.run(main())["running"] == 0


def test_a_worker_that_goes_away_frees_its_requests_pages(eng):
    sched = Scheduler(eng)
    go = hold_steps(sched, 2)  # 2 tokens of 200 at most before the hang-up: the request cannot end on its own
    try:
        with _linked(sched) as (hub, conn):
            async def main():
                remote = _started(conn)
                req = await remote.submit([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True),
                                          request_id="x")
                async for _ in req.batches():
                    break  # generating: it holds pages now
                return await remote.stats()

            assert asyncio.run(main())["kv_pages_used"] > 0
            theirs = sched._live["x"].request  # (the engine side's Request)
            _hang_up(conn)  # the worker process is gone: EOF at the hub
            deadline = time.monotonic() + 30
            while hub.live and time.monotonic() < deadline:
                time.sleep(0.01)
            assert hub.live == 0 and not theirs.finished
            go.set()
            assert theirs.result(timeout=30).finish_reason == "cancelled"
            assert _idle(sched, eng)
    finally:
        go.set()


class _Clock:
    """workers.time's stand-in: monotonic() reads a clock that only sleep() moves (by what it was asked), counting
    the polls; each poll still yields 10 ms of real time, so the sending threads run meanwhile."""

    def __init__(self):
        self.now, self.polls = 0.0, 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.polls += 1
        time.sleep(0.01)


def test_a_worker_that_dies_before_its_setup_is_named(monkeypatch):
    """run_workers' setup send: a worker gone before reading it (an import error, say) is found, not waited on;
    one that never reads is given up at SETUP_S. On a stand-in clock: no wall-clock bound is asserted."""
    import subprocess
    import sys

    import tinyinfer.server.workers as w
    from tinyinfer.server.workers import _send_setup

    conns, procs = [], []
    for code in ("import sys; sys.stdin.read()", "raise SystemExit(3)"):  # the first reads nothing until killed
        mine, theirs = multiprocessing.Pipe(duplex=True)
        procs.append(subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                                      stdin=subprocess.PIPE))
        theirs.close()
        conns.append(mine)
    try:
        procs[1].wait(30)

        def send(setup_s, who):  # the first worker that did not take the setup, and the stand-in clock
            clock = _Clock()
            monkeypatch.setattr(w, "SETUP_S", setup_s)
            monkeypatch.setattr(w, "time", clock)
            return _send_setup(who, {"blob": b"x" * (4 << 20)}, []), clock

        bad, clock = send(3.0, conns)  # worker 0 never reads: given up at the deadline, not before
        assert bad == 0 and 3.0 <= clock.now < 3.05 and clock.polls == round(clock.now / 0.05)  # polls of 50 ms
        bad, clock = send(60.0, conns[1:])  # worker 1 died: found when its send failed (60: 12 s real at most)
        assert bad == 0 and clock.now < 60.0, "the dead worker was only given up at the deadline"
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for c in conns:
            c.close()


def test_cancel_and_shutdown_reach_the_worker(eng):
    sched = Scheduler(eng)
    hold_steps(sched, 2, until=sched_cancels_pending(sched))  # a and b end only by their cancels, not by length
    hub, conn = _pair(sched)
    ended = []
    try:
        async def main():
            remote = RemoteScheduler(conn, on_end=lambda: ended.append(True))
            remote.start()
            a = await remote.submit([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), request_id="a")
            b = await remote.submit([8, 9], SamplingParams(max_tokens=200, ignore_eos=True), request_id="b")
            async for _ in a.batches():
                break
            a.cancel()
            text_a, ids_a, done_a, _ = await _collect(a)
            await asyncio.to_thread(hub.shutdown)  # the engine process shuts down: the workers are told first,
            await asyncio.to_thread(sched.close)  # then b ends "cancelled" (its end still reaches the worker)
            _, _, done_b, _ = await _collect(b)
            for _ in range(100):
                if ended:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(InvalidRequestError, match="closed"):
                await remote.submit([1], SamplingParams(max_tokens=1), request_id="c")
            return done_a, done_b

        done_a, done_b = asyncio.run(main())
        assert done_a.finish_reason == done_b.finish_reason == "cancelled" and ended == [True]
    finally:
        hub.close()
    assert _idle(sched, eng)


def test_a_submit_refused_as_the_engine_stops_comes_after_the_shutdown_message(eng):
    """A submit read after shutdown() began and refused by the closing scheduler: the worker has the "shutdown"
    message first (its app then answers 503, not the refusal's 400)."""
    sched = Scheduler(eng)
    mine, theirs = multiprocessing.Pipe(duplex=True)
    hub = EngineHub(sched, [mine])
    hub.start()
    seen = []
    try:
        async def main():
            remote = RemoteScheduler(theirs, on_end=lambda: seen.append("shutdown"))
            remote.start()
            hub._stopping = True  # (shutdown() began; its message not sent yet: the race the order guards)
            sched.close()
            try:
                await remote.submit([1, 2], SamplingParams(max_tokens=1), request_id="late")
            except InvalidRequestError:
                seen.append("refused")

        asyncio.run(main())
        assert seen == ["shutdown", "refused"]
    finally:
        hub.close()


def test_a_failure_in_the_reader_after_a_submit_cancels_it(eng, monkeypatch):
    sched = Scheduler(eng)
    with _linked(sched) as (hub, conn):
        def broken(link, req, every):
            raise RuntimeError("boom")

        monkeypatch.setattr(hub, "_attach", broken)

        async def main():
            remote = _started(conn)
            with pytest.raises(TinyInferError, match="RuntimeError: boom"):
                await remote.submit([5, 6], SamplingParams(max_tokens=200, ignore_eos=True), request_id="z")

        asyncio.run(main())
        assert _idle(sched, eng) and hub.live == 0  # queued by the scheduler, then cancelled: nobody reads it


def test_the_engine_process_gone_fails_what_is_in_flight(eng):
    sched = Scheduler(eng)
    mine, theirs = multiprocessing.Pipe(duplex=True)
    ended = []
    try:
        async def main():
            remote = RemoteScheduler(theirs, on_end=lambda: ended.append(True))
            remote.start()
            mine.close()  # (no link answers: the engine process died)
            with pytest.raises(DeviceError, match="engine process"):
                await remote.submit([1, 2], SamplingParams(max_tokens=1), request_id="a")
            with pytest.raises(DeviceError):
                await remote.stats()

        asyncio.run(main())
        assert ended == [True]
    finally:
        sched.close()


def test_text_side_tokenizes_as_the_engine_and_pickles(eng):
    side = pickle.loads(pickle.dumps(TextSide.of(eng)))
    msgs = [{"role": "user", "content": "hi there"}]
    assert side.tokenize("Once upon a time") == eng.tokenize("Once upon a time")
    assert side.apply_chat_template(msgs) == eng.apply_chat_template(msgs)
    assert (side.config.vocab, side.max_seq_len) == (eng.config.vocab, eng.max_seq_len)


def test_an_exception_that_does_not_pickle_arrives_as_its_text():
    class Odd(Exception):
        def __init__(self, a, b):  # (pickling calls Odd(msg): too few arguments)
            super().__init__(f"{a}/{b}")

    e = portable(Odd(1, 2))
    assert type(e) is TinyInferError and str(e) == "Odd: 1/2"
    q = portable(QueueFullError("full"))
    assert type(q) is QueueFullError and str(q) == "full"
