"""`tinyinfer serve --api-workers N` (N > 1): the engine process and N API worker processes.

The engine process (this one) binds the listening socket, starts N processes of server/frontend.py that accept
on it and run the HTTP app, and links each to the scheduler through a pipe (server/engine_link.py: one EngineHub). It then only
schedules: a wave of requests ending in one step is parsed, tokenized and answered by N event loops at once, and
none of that waits for the scheduler's GIL or makes the scheduler wait for it (docs/perf/serve.md: vLLM's API
server / engine core split).

Shutdown (SIGINT or SIGTERM here, or any worker exiting): the scheduler closes first (open streams end with a
shutdown error, waiting requests with 503), then each worker is told to stop through its link (uvicorn's
graceful shutdown; the workers ignore SIGINT, so a Ctrl-C in the terminal, which reaches the whole process
group, is handled here once), then the links close.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import subprocess
import sys
import threading

from .app import MAX_BODY_BYTES
from .engine_link import EngineHub
from .remote import TextSide

log = logging.getLogger("tinyinfer.server")

WORKER_EXIT_S = 10.0  # a worker's graceful shutdown is 5 s (uvicorn's timeout_graceful_shutdown)


def run_workers(args, engine, scheduler, *, model_name: str, api_key, on_stopped=None) -> int:
    """Serve until SIGINT / SIGTERM with args.api_workers frontend processes. on_stopped(): after the workers
    ended (the trace is written there)."""
    try:
        sock = socket.create_server((args.host, args.port), backlog=4096)
    except OSError as e:
        print(f"tinyinfer: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr, flush=True)
        return 1
    sock.set_inheritable(True)
    setup = {"text": TextSide.of(engine), "model_name": model_name, "api_key": api_key,
             "stream_interval": args.stream_interval, "max_body_bytes": MAX_BODY_BYTES}
    procs: list[subprocess.Popen] = []
    hub = None
    scheduler.start()
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        conns = []
        for i in range(args.api_workers):
            mine, theirs = multiprocessing.Pipe(duplex=True)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tinyinfer.server.frontend", "--socket-fd", str(sock.fileno()),
                 "--link-fd", str(theirs.fileno()), "--log-level", args.log_level, "--name", f"api-{i}"],
                pass_fds=(sock.fileno(), theirs.fileno())))
            theirs.close()
            mine.send(setup)
            conns.append(mine)
        hub = EngineHub(scheduler, conns)
        hub.start()
        sock.close()  # (the workers hold it)
        while not stop.wait(0.25):
            ended = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
            if ended:
                print(f"tinyinfer: API worker {ended[0][0]} exited (rc {ended[0][1]}); shutting down",
                      file=sys.stderr, flush=True)
                break
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        scheduler.close()
        if hub is not None:
            hub.shutdown()
        for p in procs:
            try:
                p.wait(WORKER_EXIT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if hub is not None:
            hub.close()
        sock.close()
        if on_stopped is not None:
            on_stopped()
    return 0 if all(p.returncode == 0 for p in procs) else 1
