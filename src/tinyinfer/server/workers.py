"""`tinyinfer serve --api-workers N` (N > 1): the engine process and N API worker processes.

The engine process (this one) binds the listening socket, starts N processes of server/frontend.py that accept
on it and run the HTTP app, and links each to the scheduler through a pipe (server/engine_link.py: one EngineHub
for all). It then only schedules: a wave of requests ending in one step is parsed, tokenized and answered by N
event loops at once, and none of that waits for the scheduler's GIL or makes the scheduler wait for it
(docs/perf/serve.md: vLLM's API server / engine core split).

Shutdown (SIGINT or SIGTERM here, or any worker exiting): each worker is told to stop through its link (new
requests get 503; uvicorn's graceful shutdown waits for the open streams), then the scheduler closes (what is in
flight ends with a shutdown error), then the links close. The workers ignore SIGINT and SIGTERM: a Ctrl-C in a
terminal or a service manager's SIGTERM reaches the whole process group, and is handled here once.
"""

from __future__ import annotations

import multiprocessing
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from .app import MAX_BODY_BYTES
from .engine_link import EngineHub
from .remote import TextSide

WORKER_EXIT_S = 10.0  # a worker's graceful shutdown is 5 s (uvicorn's timeout_graceful_shutdown)
SETUP_S = 120.0  # a worker's imports before it reads its setup


def _send_setup(conns: list, setup: dict, stopping: list) -> Optional[int]:
    """The setup to every worker at once (its tokenizer is ~1.5 MB, more than a pipe holds: each send waits for
    its worker to have imported everything and read it). The first worker that did not take it, or None; -1 when
    a signal came meanwhile."""
    errors: list = [None] * len(conns)

    def send(i: int) -> None:
        try:
            conns[i].send(setup)
        except Exception as e:  # noqa: BLE001 (the worker died before reading it; or the pipe closed under the send)
            errors[i] = e

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(conns))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + SETUP_S
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline and not stopping:
        time.sleep(0.05)
    if stopping:
        return -1
    for i, t in enumerate(threads):
        if t.is_alive() or errors[i] is not None:
            return i
    return None


def run_workers(args, engine, scheduler, *, model_name: str, api_key, sampling_defaults: Optional[dict] = None,
                on_stopped=None, tool_parser: Optional[str] = None) -> int:
    """Serve until SIGINT / SIGTERM with args.api_workers frontend processes (sampling_defaults: create_app's).
    on_stopped(): after the workers ended (the trace is written there). 1 when a worker failed to start or exited
    on its own."""
    try:
        sock = socket.create_server((args.host, args.port), backlog=4096)
    except OSError as e:
        print(f"tinyinfer: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr, flush=True)
        return 1
    sock.set_inheritable(True)
    setup = {"text": TextSide.of(engine), "model_name": model_name, "api_key": api_key,
             "stream_interval": args.stream_interval, "max_body_bytes": MAX_BODY_BYTES,
             "max_waiting": scheduler.max_waiting, "sampling_defaults": sampling_defaults or {},
             "tool_parser": tool_parser}
    procs: list[subprocess.Popen] = []
    conns: list = []
    hub: Optional[EngineHub] = None
    stopping: list = []  # one entry per SIGINT / SIGTERM (a list append: no lock taken in the handler)
    signals = (signal.SIGINT, signal.SIGTERM)
    # the workers are started with both signals ignored (kept across exec), so that one reaching the process group
    # while they import is not their death; they never take them back (the engine process handles them)
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    failed = False
    try:
        try:
            for i in range(args.api_workers):
                mine, theirs = multiprocessing.Pipe(duplex=True)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tinyinfer.server.frontend", "--socket-fd", str(sock.fileno()),
                     "--link-fd", str(theirs.fileno()), "--log-level", args.log_level, "--name", f"api-{i}"],
                    pass_fds=(sock.fileno(), theirs.fileno())))
                theirs.close()
                conns.append(mine)
        finally:
            for s in signals:
                signal.signal(s, lambda *_: stopping.append(True))
        sock.close()  # (the workers hold it)
        bad = _send_setup(conns, setup, stopping)
        if bad == -1:
            pass  # stopped while the workers started
        elif bad is not None:
            failed = True
            rc = procs[bad].poll()
            print(f"tinyinfer: error: API worker {bad} did not start "
                  f"({'exit status ' + str(rc) if rc is not None else f'no answer in {SETUP_S:.0f} s'})",
                  file=sys.stderr, flush=True)
        else:
            hub = EngineHub(scheduler, conns)
            hub.start()
            scheduler.start()
        while not failed and not stopping:
            time.sleep(0.25)
            ended = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
            if ended:
                failed = True
                print(f"tinyinfer: API worker {ended[0][0]} exited (rc {ended[0][1]}); shutting down",
                      file=sys.stderr, flush=True)
    finally:
        # the workers first (new requests get 503 from then on; hub.shutdown returns at once, whatever a worker
        # does), then the scheduler (what is in flight ends with a shutdown error, shipped by the hub meanwhile)
        if hub is not None:
            hub.shutdown()
        else:
            for c in conns:  # (EOF: a worker that got its setup stops)
                c.close()
        scheduler.close()
        # the workers' graceful shutdown, up to WORKER_EXIT_S in all; a second signal: at once
        seen, deadline = len(stopping), time.monotonic() + WORKER_EXIT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline and len(stopping) <= max(seen, 1):
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if hub is not None:
            hub.close()
        sock.close()
        if on_stopped is not None:
            on_stopped()
        for s, h in previous.items():  # last: until here a signal is counted (a second one ends the wait above)
            signal.signal(s, h)
    return 1 if failed or any(p.returncode != 0 for p in procs) else 0
