"""Serving benchmark: start `tinyinfer serve` (a subprocess), drive C concurrent streaming clients per level
(default 1, 8, 32, 64), report output throughput, time to first token and inter-token latency (p50 / p99).

    python bench/serve_bench.py                                     # the default model, device auto
    python bench/serve_bench.py --shape tinyllama-1.1b --device cuda --json bench/results/h200-serve.json
    python bench/serve_bench.py --model path/to/model --concurrency 1,8 --max-tokens 64
    python bench/serve_bench.py --url http://127.0.0.1:8000          # a server already running

Prompts are synthetic token ids (so any model works, tokenizer or not) of mixed lengths (--prompt-lens, drawn
per request from a seeded RNG; --shared-prefix N puts the same N tokens before each prompt of a level: a system
prompt the server has not seen before that level, the prefix cache's case; --follow-ups N makes each client's
later prompts its previous one + N tokens, a session over one document); every request asks for exactly
--max-tokens tokens (ignore_eos), streamed from /v1/completions with the usage chunk. Each client sends --rounds requests one after another. TTFT: request sent
-> first streamed chunk; ITL: the gaps between a request's later chunks (a chunk holds the tokens of one step, or
of several when the server streams at an interval: `tok/chunk`); throughput: all completion tokens / the level's
wall time (from the first request sent, the server already up and warm, to the last stream's end). The clients
of a level run in --client-procs processes (default one per 16 clients, so that at 64 clients the clients' own
Python does not set the pace); client cpu: the busiest client process's CPU time / wall (near 100%: the clients,
not the server, set the pace); turn: a client's own time from one stream's end to its next request's send (p50;
the rest of the gap between a request's last token and the next one's arrival is the server's). --shape writes
a random-weight HF model at a real shape first (bench/tools/make_random_model.py, needs torch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(a, model: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "tinyinfer", "serve", "--model", model, "--device", a.device, "--dtype", a.dtype,
           "--port", str(port), "--served-model-name", "bench", "--max-waiting", "100000", "--log-level", "warning"]
    if a.max_batch:
        cmd += ["--max-batch", str(a.max_batch)]
    if a.max_seq_len:
        cmd += ["--max-seq-len", str(a.max_seq_len)]
    if a.trace_dir:
        cmd += ["--trace", str(Path(a.trace_dir) / "serve.json")]
    cmd += shlex.split(a.serve_args)
    env = {k: v for k, v in os.environ.items() if k != "TINYINFER_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + a.startup_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve_bench: the server exited ({proc.returncode}):\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"serve_bench: no /health answer in {a.startup_s} s:\n{log_path.read_text()}")


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens, cached, rid = 0, 0, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = rid or chunk.get("id")
            if chunk.get("choices"):
                if chunk["choices"][0].get("finish_reason") is None:
                    stamps.append(time.perf_counter())
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if not stamps:
        return {"error": "no token chunks"}
    return {"ttft": stamps[0] - t0, "itl": list(np.diff(stamps)), "tokens": tokens, "prompt": len(prompt),
            "cached": cached, "chunks": len(stamps), "id": rid, "t_sent": t0, "t_done": time.perf_counter()}


def _prompts(concurrency: int, rounds: int, lens: list[int], seed: int, shared: int = 0,
             follow_ups: int = 0) -> list[list[int]]:
    """Each prompt: the `shared` tokens every prompt of the level starts with (a system prompt new to the server at
    each level: the warm-up's and every other level's differ), then its own, of a length drawn from `lens`; with
    `follow_ups`, a client's prompts after its first are its previous one + that many new tokens instead. Client w
    sends prompts[w * rounds: (w + 1) * rounds]."""
    prefix = np.random.default_rng([seed & 0xFFFFFFFF, concurrency, 7]).integers(100, 1000, shared).tolist()
    rng = np.random.default_rng(seed + concurrency)
    out: list[list[int]] = []
    for i in range(concurrency * rounds):
        if follow_ups and i % rounds:
            out.append(out[-1] + rng.integers(100, 1000, follow_ups).tolist())
        else:
            out.append(prefix + rng.integers(100, 1000, int(rng.choice(lens))).tolist())
    return out


async def _drive(url: str, model: str, prompts: list[list[int]], rounds: int, max_tokens: int,
                 start_at: Optional[float] = None) -> tuple[list[dict], float, float, float]:
    """len(prompts) // rounds clients, each sending its `rounds` prompts in turn; -> (results, t_start, t_end,
    cpu seconds). Times are time.time() so that client processes' windows can be joined."""
    clients = len(prompts) // rounds
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=60), limits=limits) as client:
        async def worker(w: int) -> list[dict]:
            out = [await one_request(client, url, model, prompts[w * rounds + i], max_tokens) for i in range(rounds)]
            for prev, nxt in zip(out, out[1:]):  # this client's own time between a stream's end and its next send
                if "t_done" in prev and "t_sent" in nxt:
                    nxt["turnaround"] = nxt["t_sent"] - prev["t_done"]
            return out

        # Every client's connection opened before the timed window (one concurrent GET /health each: the pool
        # keeps them alive for the requests), so that a level measures serving, not TCP and HTTP connection
        # setup (which, 64 clients at once, spread the first round's submits over ~40 ms on the H200).
        await asyncio.gather(*(client.get(f"{url}/health") for _ in range(clients)))
        if start_at is not None:  # every client process starts together
            await asyncio.sleep(max(0.0, start_at - time.time()))
        t0, cpu0 = time.time(), time.process_time()
        results = [r for rs in await asyncio.gather(*(worker(w) for w in range(clients))) for r in rs]
        return results, t0, time.time(), time.process_time() - cpu0


def _drive_in_process(args: tuple) -> tuple[list[dict], float, float, float]:
    return asyncio.run(_drive(*args))


def _summary(concurrency: int, results: list[dict], wall: float, client_cpu: float) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft = np.array([r["ttft"] for r in ok]) * 1e3
    turn = np.array([r["turnaround"] for r in ok if "turnaround" in r]) * 1e3
    itl = np.array([x for r in ok for x in r["itl"]]) * 1e3
    tokens = sum(r["tokens"] for r in ok)

    def pct(x: np.ndarray) -> dict:
        if not len(x):
            return {"p50": None, "p99": None, "mean": None}
        return {"p50": float(np.percentile(x, 50)), "p99": float(np.percentile(x, 99)), "mean": float(x.mean())}

    return {"concurrency": concurrency, "requests": len(results), "errors": [r["error"] for r in results
                                                                           if "error" in r][:5],
            "failed": len(results) - len(ok), "wall_s": wall, "completion_tokens": tokens,
            "prompt_tokens": sum(r["prompt"] for r in ok), "cached_tokens": sum(r["cached"] for r in ok),
            "output_tok_s": tokens / wall,
            "requests_s": len(ok) / wall, "ttft_ms": pct(ttft), "itl_ms": pct(itl),
            "tokens_per_chunk": tokens / max(sum(r["chunks"] for r in ok), 1),
            "client_turnaround_ms": pct(turn),  # a client's own time from a stream's end to its next send
            # (popped by main: into levels.json with --trace-dir, where serve_timeline joins them with the server's)
            "_stamps": [[r["id"], r["t_sent"], r["t_done"], r.get("turnaround")] for r in ok],
            "client_cpu": client_cpu}  # near 1.0: the (busiest) client process, not the server, set the pace


async def run_level(url: str, model: str, concurrency: int, rounds: int, lens: list[int], max_tokens: int,
                    seed: int, shared: int = 0, follow_ups: int = 0) -> dict:
    """One level driven from this process (its event loop)."""
    results, t0, t1, cpu = await _drive(url, model, _prompts(concurrency, rounds, lens, seed, shared, follow_ups),
                                        rounds, max_tokens)
    return _summary(concurrency, results, t1 - t0, cpu / (t1 - t0))


def measure_level(url: str, model: str, concurrency: int, rounds: int, lens: list[int], max_tokens: int,
                  seed: int, procs: int = 0, shared: int = 0, follow_ups: int = 0) -> dict:
    """One level with the clients spread over `procs` processes (0: one per 16 clients), so that the clients'
    Python does not set the pace at high concurrency; the same prompts whatever `procs`. The wall is from the
    common start to the last stream's end; client_cpu is the busiest process's CPU time over it."""
    procs = max(1, min(concurrency, procs or -(-concurrency // 16)))
    if procs == 1:
        return asyncio.run(run_level(url, model, concurrency, rounds, lens, max_tokens, seed, shared, follow_ups))
    prompts = _prompts(concurrency, rounds, lens, seed, shared, follow_ups)
    share = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    start_at, parts, first = time.time() + 1.0 + 0.1 * procs, [], 0  # after every process has started
    for n in share:
        parts.append((url, model, prompts[first * rounds:(first + n) * rounds], rounds, max_tokens, start_at))
        first += n
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        out = pool.map(_drive_in_process, parts)
    t0, t1 = min(o[1] for o in out), max(o[2] for o in out)
    return _summary(concurrency, [r for o in out for r in o[0]], t1 - t0, max(o[3] for o in out) / (t1 - t0))


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"serve_bench: {flag} must be comma-separated integers (got {text!r})") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"serve_bench: {flag} values must be >= 1 (got {text!r})")
    return vals


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", "-m", default=None, help="HF dir, .gguf or hub name (default: the default model)")
    src.add_argument("--shape", default=None, help="random weights at a real shape (tinyinfer.bench.SHAPES)")
    src.add_argument("--url", default=None, help="bench a server already running (its first model)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--concurrency", default="1,8,32,64", help="comma-separated client counts (default 1,8,32,64)")
    ap.add_argument("--rounds", type=int, default=2, help="requests each client sends in turn (default 2)")
    ap.add_argument("--prompt-lens", default="32,128,512", help="prompt lengths drawn per request")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="tokens every prompt of a level starts with (a system prompt new to the server at that "
                         "level), before its own --prompt-lens ones: the prefix cache's case (A/B: --serve-args "
                         "'--prefix-cache 0')")
    ap.add_argument("--follow-ups", type=int, default=0, metavar="N",
                    help="each client's requests after its first send its previous prompt + N new tokens (follow-up "
                         "questions over one document, the answers not sent back): the prefix cache holds each "
                         "client's last prompt, with more clients than slots too")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-s", type=float, default=600, help="wait this long for the server to come up")
    ap.add_argument("--client-procs", type=int, default=0,
                    help="client processes per level (default 0: one per 16 clients)")
    ap.add_argument("--serve-args", default="",
                    help="more arguments for `tinyinfer serve` (A/B), e.g. '--no-batched-prefill --chunk-tokens 8192'")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--trace-dir", default=None,
                    help="the server records a timeline (`tinyinfer serve --trace DIR/serve.json`, written when it "
                         "stops) and each level's start and end go to DIR/levels.json: "
                         "bench/tools/serve_timeline.py DIR/serve.json")
    a = ap.parse_args(argv)
    if a.trace_dir and a.url:
        raise SystemExit("serve_bench: --trace-dir needs the server this script starts (not --url)")
    if a.trace_dir:
        Path(a.trace_dir).mkdir(parents=True, exist_ok=True)
    levels, lens = _ints(a.concurrency, "--concurrency"), _ints(a.prompt_lens, "--prompt-lens")

    proc, tmp = None, tempfile.TemporaryDirectory(prefix="serve_bench-")
    try:
        if a.url:
            url = a.url.rstrip("/")
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            label = model
        else:
            if a.shape:
                model_path = str(Path(tmp.name) / a.shape)
                subprocess.run([sys.executable, str(HERE / "tools" / "make_random_model.py"), a.shape, model_path],
                               check=True)
            else:
                model_path = a.model or str(__import__("tinyinfer.models", fromlist=["x"]).default_model_path())
            proc, url = start_server(a, model_path, Path(tmp.name) / "serve.log")
            model, label = "bench", a.shape or a.model or "default model"
        health = httpx.get(f"{url}/health", timeout=30).json()
        print(f"serve_bench: {label} at {url}; prompts {lens} tokens, {a.max_tokens} generated each, "
              f"{a.rounds} per client; KV pages {health.get('kv_pages_total')}")
        # warm-up, untimed: every prompt length at every level's concurrency (on the GPU each
        # batch bucket's decode graph is captured on its first use: a cold 64-client level would pay those)
        for c in sorted({1, *levels}):
            asyncio.run(run_level(url, model, c, 1, lens, 4, a.seed - 1, a.shared_prefix))
        print(f"{'clients':>7} {'reqs':>5} {'tok/s':>9} {'req/s':>7} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} "
              f"{'p99':>8} {'tok/chunk':>9} {'client cpu':>10} {'turn p50':>8} {'cached':>7}  (ms)")
        rows, marks = [], []
        for c in levels:
            # the server's trace is in time.perf_counter() = CLOCK_MONOTONIC on Linux, the same clock in every
            # process of the machine: these marks cut it into levels
            t0 = time.perf_counter()
            r = measure_level(url, model, c, a.rounds, lens, a.max_tokens, a.seed, a.client_procs, a.shared_prefix,
                              a.follow_ups)
            # each request as its client saw it: (HTTP call id, sent, stream done, the client's own turnaround)
            marks.append({"concurrency": c, "rounds": a.rounds, "t_start": t0, "t_end": time.perf_counter(),
                          "requests": r.pop("_stamps")})
            rows.append(r)
            f = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
            print(f"{c:>7} {r['requests']:>5} {r['output_tok_s']:>9.1f} {r['requests_s']:>7.2f} "
                  f"{f(r['ttft_ms']['p50']):>9} {f(r['ttft_ms']['p99']):>8} {f(r['itl_ms']['p50']):>8} "
                  f"{f(r['itl_ms']['p99']):>8} {r['tokens_per_chunk']:>9.2f} {r['client_cpu']:>9.0%} "
                  f"{f(r['client_turnaround_ms']['p50']):>8} {r['cached_tokens'] / max(r['prompt_tokens'], 1):>7.0%}"
                  + (f"  {r['failed']} failed: {r['errors'][0]}" if r["failed"] else ""))
        out = {"model": label, "device": a.device, "dtype": a.dtype, "max_batch": a.max_batch,
               "prompt_lens": lens, "shared_prefix": a.shared_prefix, "follow_ups": a.follow_ups, "max_tokens": a.max_tokens, "rounds": a.rounds,
               "client_procs": a.client_procs, "levels": rows}
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
            print(f"serve_bench: wrote {a.json}")
        if a.trace_dir:
            clock = time.get_clock_info("perf_counter").implementation
            Path(a.trace_dir, "levels.json").write_text(json.dumps({"clock": f"time.perf_counter ({clock})",
                                                                    "levels": marks}, indent=1))
        return 1 if any(r["failed"] for r in rows) else 0
    finally:
        if proc is not None:
            proc.send_signal(2)  # Ctrl-C: the server's clean shutdown
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            if a.trace_dir:
                trace = Path(a.trace_dir) / "serve.json"
                print(f"serve_bench: {'wrote' if trace.exists() else 'NO trace written to'} {trace} "
                      f"(server exit {proc.returncode})")
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
