"""`tinyinfer serve`: load the model, start the scheduler, serve the OpenAI-compatible app with uvicorn.

    tinyinfer serve                                  # the default model on http://127.0.0.1:8000/v1
    tinyinfer serve --model path/to/model --port 9000 --api-key secret --max-batch 32
    tinyinfer serve --api-workers 4                  # the HTTP side in 4 processes of its own (server/workers.py)
    tinyinfer serve --trace serve.json               # a timeline, written at shutdown (bench/tools/serve_timeline.py)

Binds 127.0.0.1 unless --host says otherwise. Ctrl-C: uvicorn stops taking connections, gives open streams a few
seconds, then the app's lifespan closes the scheduler (every request still in flight is cancelled).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Optional

from ..errors import InvalidRequestError
from ..tools import PARSERS

MISSING = "tinyinfer serve needs fastapi and uvicorn: pip install 'tinyinfer[serve]'"
# --api-workers' default: on the GPU, where the host has the cores, the HTTP side in 4 processes of its own (the
# measurements behind it: docs/perf/serve.md); a CPU engine needs the cores itself
AUTO_WORKERS, AUTO_WORKERS_MIN_CPUS = 4, 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TINYINFER_API_KEY; unset: open)")
    p.add_argument("--max-batch", type=int, default=None, help="sequences decoded together (default: the engine's)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="prompt tokens prefilled per scheduler step (default: 2048 on cuda, 512 on cpu)")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="tokens per streamed chunk (default: adaptive, 1 while at most 16 streams run, then one "
                        "more per 16)")
    p.add_argument("--no-batched-prefill", dest="batched_prefill", action="store_false",
                   help="prefill each admitted prompt in its own call (default: a step's prompts in one batched "
                        "pass; the A/B reference)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="run each scheduler step's per-token work before launching the next decode step (default: "
                        "launched first, so that work overlaps the device's; the A/B reference)")
    p.add_argument("--no-sample-launch", dest="sample_launch", action="store_false",
                   help="launch each next decode step from Python after its tokens are sampled (default: inside the "
                        "sampling call, seq_sample_step; the A/B reference)")
    p.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="carry waiting prompts in the running sequences' next step, one mixed pass launched with "
                        "the sample (every weight read once for both; default). --no-mixed-steps: a prefill pass "
                        "of their own (the A/B reference; a request's tokens then never depend on other arrivals)")
    p.add_argument("--no-preempt", dest="preempt", action="store_false",
                   help="end the youngest running requests with an out-of-KV-pages error when a decode step is short "
                        "of pages (default: preempt them, their tokens recomputed once pages free up: their clients "
                        "see a pause; the A/B reference)")
    p.add_argument("--prefix-cache", type=int, default=None, metavar="N",
                   help="ended requests whose KV caches are kept for later prompts that start with their tokens (a "
                        "chat's next turn, a shared system prompt: only the rest is prefilled; usage reports "
                        "prompt_tokens_details.cached_tokens); they hold KV pages, not slots, and give them back, least "
                        "recently used first, as requests need them (default: 4 per slot on cuda, 4 on cpu; 0: off)")
    p.add_argument("--api-workers", type=int, default=None,
                   help="processes running the HTTP side (parsing, templates, tokenizing, streaming), each linked "
                        f"to the one engine process by a pipe; 1: the HTTP app in the engine's process (default: "
                        f"{AUTO_WORKERS} on cuda with >= {AUTO_WORKERS_MIN_CPUS} CPUs, else 1; 1 with --trace)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests allowed to wait for a slot (every request waits first: 0 answers each one 503); "
                        "beyond it: 503 with Retry-After; a request of more choices (prompts x n): 400 (default "
                        "1024)")
    p.add_argument("--switch-interval-ms", type=float, default=0.2,
                   help="Python's thread switch interval (sys.setswitchinterval; default 0.2 ms, Python's own is 5): "
                        "how long the scheduler may wait for the GIL after a GPU call while the HTTP loop holds it")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice \"auto\" (OpenAI's default with tools): the model's tool calls read from its "
                        "text by --tool-call-parser (vLLM's flags); without it such a request is refused")
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen2.5, "
                        "SmolLM3), llama3_json (Llama 3.1-3.3's JSON calls)")
    p.add_argument("--generation-config", choices=("auto", "openai"), default="auto",
                   help="the sampling defaults of a request that leaves them out: auto (default) the model's "
                        "generation_config.json where it sets temperature, top_p, top_k, min_p or "
                        "repetition_penalty (as vLLM's server; not its max_new_tokens), else OpenAI's; openai: "
                        "OpenAI's (temperature 1)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: --model as given, or SmolLM2-135M-Instruct)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="record a timeline (every core call of the scheduler, every request's submit / first token / "
                        "end, each HTTP call's start and end; with --api-workers > 1 not the HTTP events) and "
                        "write it as JSON to FILE at shutdown; read it with bench/tools/serve_timeline.py")


def check_arguments(args) -> None:
    """What can be refused before the model loads."""
    if not 1 <= args.port <= 65535:
        raise InvalidRequestError(f"--port must be in 1..65535 (got {args.port})")
    if args.max_batch is not None and args.max_batch < 1:
        raise InvalidRequestError(f"--max-batch must be >= 1 (got {args.max_batch})")
    for flag, v in (("--chunk-tokens", args.chunk_tokens), ("--stream-interval", args.stream_interval)):
        if v is not None and v < 1:
            raise InvalidRequestError(f"{flag} must be >= 1 (got {v})")
    if not 0.01 <= args.switch_interval_ms <= 100:
        raise InvalidRequestError(f"--switch-interval-ms must be in 0.01..100 (got {args.switch_interval_ms})")
    if args.api_workers is not None and not 1 <= args.api_workers <= 64:
        raise InvalidRequestError(f"--api-workers must be in 1..64 (got {args.api_workers})")
    if (args.api_workers or 1) > 1 and os.name != "posix":
        raise InvalidRequestError("--api-workers > 1 needs a POSIX system (the workers inherit the socket)")
    if args.max_waiting < 0:
        raise InvalidRequestError(f"--max-waiting must be >= 0 (got {args.max_waiting})")
    if args.prefix_cache is not None and args.prefix_cache < 0:
        raise InvalidRequestError(f"--prefix-cache must be >= 0 (got {args.prefix_cache})")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise InvalidRequestError("--served-model-name is empty")
    if args.api_key is not None and not args.api_key:
        raise InvalidRequestError("--api-key is empty")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise InvalidRequestError("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format)")
    if args.trace is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.trace))):
        raise InvalidRequestError(f"--trace: the folder of {args.trace!r} does not exist")
    check_address(args.host, args.port)


def check_address(host: str, port: int) -> None:
    """Refuse, before the model's load, an address this process cannot listen on (the port in use, a host that is
    not this machine's): a trial bind, with the SO_REUSEADDR uvicorn binds with. (Another process may still take
    the port in between: uvicorn then says so.)"""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        raise InvalidRequestError(f"cannot listen on {host}:{port} (--host / --port): {e}") from None


def request_log(level: str, worker: Optional[str] = None) -> None:
    """One line per request on stderr, beside uvicorn's own log (the engine process, or API worker `worker`)."""
    logger = logging.getLogger("tinyinfer.server")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        who = f"tinyinfer[{worker}]" if worker else "tinyinfer"
        handler.setFormatter(logging.Formatter(f"%(asctime)s {who}: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def sampling_defaults(engine, source: str) -> dict:
    """The sampling defaults the server gives a request that leaves them out, said on stderr: the model's
    generation_config.json's valid ones with --generation-config auto (those left out named), else none (OpenAI's)."""
    from .protocol import checked_defaults

    if source == "openai" or not engine.sampling_defaults:
        return {}
    defaults, dropped = checked_defaults(engine.sampling_defaults)
    for d in dropped:
        print(f"tinyinfer: warning: generation_config.json's {d} is not a valid default: left out", file=sys.stderr)
    if defaults:
        print("tinyinfer: sampling defaults from the model's generation_config.json: "
              f"{', '.join(f'{k}={v}' for k, v in defaults.items())} (--generation-config openai: OpenAI's)",
              file=sys.stderr, flush=True)
    return defaults


def serve(args, engine_factory) -> int:
    """Run the server until Ctrl-C. engine_factory(args) loads the Engine (cli.py's, shared with `run`)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        print(f"tinyinfer: error: {MISSING}", file=sys.stderr)
        return 1
    check_arguments(args)
    from ..models import DEFAULT_MODEL
    from ..scheduler import Scheduler
    from ..trace import Trace
    from .app import create_app

    api_key = args.api_key if args.api_key is not None else (os.environ.get("TINYINFER_API_KEY") or None)
    name = args.served_model_name or args.model or DEFAULT_MODEL
    engine = engine_factory(args)
    # The scheduler's thread releases the GIL in every GPU call and must take it back to go on; with Python's 5
    # ms switch interval a busy event loop (64 streams) may hold it that long each time (docs/perf/serve.md).
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    trace = Trace() if args.trace else None
    scheduler = Scheduler(engine, max_batch=args.max_batch, chunk_tokens=args.chunk_tokens,
                          max_waiting=args.max_waiting, batched_prefill=args.batched_prefill,
                          overlap=args.overlap, sample_launch=args.sample_launch, mixed_steps=args.mixed_steps,
                          prefix_cache=args.prefix_cache, preempt=args.preempt, trace=trace)
    if engine.device == "cuda":  # (the CPU engine has no tactics or graphs to make on first use)
        print(f"tinyinfer: warmed up (prefill GEMMs, batch graphs) in {scheduler.warm_up():.2f} s",
              file=sys.stderr, flush=True)
    if args.api_workers is None and args.trace:  # (the HTTP events are recorded in the engine's process only)
        args.api_workers = 1
    if args.api_workers is None:
        many = engine.device == "cuda" and (os.cpu_count() or 1) >= AUTO_WORKERS_MIN_CPUS and os.name == "posix"
        args.api_workers = AUTO_WORKERS if many else 1
    request_log(args.log_level)
    defaults = sampling_defaults(engine, args.generation_config)
    tool_parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    workers = f", {args.api_workers} API workers" if args.api_workers > 1 else ""
    print(f"tinyinfer: serving {name} [{engine.device} {engine.dtype}, max_seq_len {engine.max_seq_len}{workers}] "
          f"at http://{args.host}:{args.port}/v1{' (API key required)' if api_key else ''}", file=sys.stderr,
          flush=True)

    def save_trace() -> None:
        if trace is not None:
            trace.save(args.trace)
            print(f"tinyinfer: wrote the trace to {args.trace} ({len(trace.calls)} core calls, "
                  f"{len(trace.events)} events)", file=sys.stderr, flush=True)

    if args.api_workers > 1:
        from .workers import run_workers

        try:
            return run_workers(args, engine, scheduler, model_name=name, api_key=api_key, sampling_defaults=defaults,
                               on_stopped=save_trace, tool_parser=tool_parser)
        finally:
            engine.close()
    app = create_app(engine, scheduler, model_name=name, api_key=api_key, stream_interval=args.stream_interval,
                     sampling_defaults=defaults, tool_parser=tool_parser)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # first stop generating (open streams end at once with a shutdown error, rather than after the
            # graceful timeout with a cut connection), then uvicorn's own shutdown
            app.state.begin_shutdown()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)  # (the app's lifespan has closed the scheduler: its thread has ended)
            save_trace()  # here, not after run(): uvicorn then raises a SIGTERM again, which kills

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                                   timeout_graceful_shutdown=5))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the signal it handled again once it has shut down
        pass
    finally:
        engine.close()
    return 0 if server.started else 1
