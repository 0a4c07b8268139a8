"""One API worker of `tinyinfer serve --api-workers N` (N > 1): the HTTP app in a process of its own.

    python -m tinyinfer.server.frontend --socket-fd S --link-fd L [--log-level info] [--name api-0]

Started by server/workers.py, never by hand: S is the listening socket the engine process bound (every worker
accepts on it), L its end of a duplex pipe to the engine process. The first message on L is the setup (a
TextSide, the model's name, the API key, the stream interval, the body limit, the scheduler's max_waiting, the
sampling defaults); then the app serves through a RemoteScheduler (server/remote.py). SIGINT and SIGTERM are
ignored: the engine process decides when the workers stop (a "shutdown" message: stop taking connections, give
open streams a few seconds), and a worker whose link ends (the engine process gone) stops too.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
from multiprocessing.connection import Connection

import uvicorn

from .app import create_app
from .main import request_log
from .remote import RemoteScheduler


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tinyinfer.server.frontend")
    ap.add_argument("--socket-fd", type=int, required=True)
    ap.add_argument("--link-fd", type=int, required=True)
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--name", default="api")
    args = ap.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):  # (a terminal's Ctrl-C, a service manager's SIGTERM: the whole
        signal.signal(sig, signal.SIG_IGN)         # process group; the engine process handles them)
    conn = Connection(args.link_fd)
    setup = conn.recv()
    sock = socket.socket(fileno=args.socket_fd)
    server = None

    def end() -> None:
        if server is not None:
            app.state.begin_shutdown()
            server.should_exit = True

    remote = RemoteScheduler(conn, on_end=end, max_waiting=setup["max_waiting"])
    app = create_app(setup["text"], remote, model_name=setup["model_name"], api_key=setup["api_key"],
                     stream_interval=setup["stream_interval"], max_body_bytes=setup["max_body_bytes"],
                     sampling_defaults=setup["sampling_defaults"], tool_parser=setup["tool_parser"])
    request_log(args.log_level, args.name)

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # signals are the engine process's to handle
            yield

    server = Server(uvicorn.Config(app, log_level=args.log_level, access_log=False, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
