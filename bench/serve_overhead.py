"""The HTTP server's own overhead, measurable anywhere (no GPU, no model): the real app (server/app.py) and the
real Scheduler over a fake core whose calls only sleep, driven by serve_bench's streaming clients.

    python bench/serve_overhead.py                                  # 64 clients, 128-token prompts, 128 out
    python bench/serve_overhead.py --concurrency 8,64 --step-ms 1.0 --json out.json
    python bench/serve_overhead.py --profile /tmp/serve.prof        # cProfile of the server's event loop thread
    python bench/serve_overhead.py --api-workers 4                  # the HTTP side in 4 processes of its own

The fake core (SleepCore) implements the slot API of the CPU / CUDA engines (seq_open / close / length /
prefill / step / sample, kv_pages_*, max_batch) and models the device's time as the CUDA engine spends it, GIL
released as the real cores do: --step-ms per seq_step (whatever the batch: a batched decode step on the GPU costs
about the same for 1..64 rows), --prefill-ms per 128 prompt tokens, --sample-ms per seq_sample. As on the GPU,
seq_step only launches: it waits for the device to be free (the engine's sync at its start), books the step on the
device's timeline and returns; seq_sample and the prefills wait for the device, then sleep their own time (they
sync at their end). So the scheduler's Python between a launch and the next sync is hidden, as on the GPU.
Defaults model TinyLlama-1.1B fp16 on an H200 (bench --batch 64: 1.81 ms per seq_step + seq_sample). It returns
fixed tokens (no EOS: every request runs to max_tokens).

The ceiling is the same scheduler driven in-process with no HTTP (every request submitted at once, steps until
idle); beside it, the fake device's busy time and the scheduler's overhead per decode step (the device idle, ms per
seq_sample: what `tinyinfer bench --batch B`'s raw loop does not pay). The server runs in a subprocess (its event loop and scheduler
thread do not share a GIL with the clients); `server / ceiling` is the figure of issue 18's target (>= 80%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import serve_bench  # noqa: E402  (bench/ is not a package)


class SleepCore:
    """The core's slot API with fixed sleeps instead of work; page accounting as the real pools do it. It has a
    device_name, so Engine.from_core takes it for a GPU core (the scheduler's GPU defaults apply)."""

    device_name = "sleep (fake GPU core)"

    def __init__(self, max_batch: int = 64, step_ms: float = 1.5, prefill_ms: float = 0.3, sample_ms: float = 0.3,
                 page_size: int = 16, pages: int = 8192, vocab: int = 32000, max_seq_len: int = 2048):
        self.max_batch, self.kv_page_size, self.kv_pages_total = max_batch, page_size, pages
        self.vocab, self.max_seq_len = vocab, max_seq_len
        self.step_s, self.prefill_s, self.sample_s = step_ms / 1e3, prefill_ms / 1e3, sample_ms / 1e3
        self.position = 0
        self._len: dict[int, int] = {}
        self.calls = {"seq_step": 0, "seq_prefill": 0, "seq_sample": 0}
        self.trace: list[tuple[float, float, str, int]] = []  # (start, end, call, rows): --trace
        self.free_at = 0.0  # perf_counter() when the device has run all that was launched
        self.busy_s = 0.0  # the device's time in all

    def _wait(self) -> float:
        """The host waits for the device (a stream sync); returns now."""
        t = time.perf_counter()
        if self.free_at > t:
            time.sleep(self.free_at - t)
            t = time.perf_counter()
        return t

    def _launch(self, name: str, s: float, rows: int) -> None:
        """Work queued on the device: it runs from when the device is free; the host goes on."""
        self.calls[name] += 1
        t = max(time.perf_counter(), self.free_at)
        self.free_at = t + s
        self.busy_s += s
        self.trace.append((t, self.free_at, name, rows))

    def _sleep(self, name: str, s: float, rows: int) -> None:
        """Work the host waits for (launched, then synced)."""
        self._launch(name, s, rows)
        self._wait()

    @property
    def kv_pages_free(self) -> int:
        ps = self.kv_page_size
        return self.kv_pages_total - sum(-(-n // ps) for n in self._len.values())

    def reset(self) -> None:
        self.position = 0

    def seq_open(self) -> int:
        slot = next(i for i in range(self.max_batch) if i not in self._len)
        self._len[slot] = 0
        return slot

    def seq_close(self, slot: int) -> None:
        del self._len[slot]

    def seq_length(self, slot: int) -> int:
        return self._len[slot]

    def seq_prefill(self, slot: int, tokens: list[int]) -> None:
        self._sleep("seq_prefill", self.prefill_s * len(tokens) / 128, 1)
        self._len[slot] += len(tokens)

    def seq_prefill_many(self, slots: list[int], prompts: list[list[int]]) -> None:
        n = sum(len(p) for p in prompts)  # one batched pass: the same cost per token as one prompt's
        self._sleep("seq_prefill", self.prefill_s * n / 128, len(slots))
        for s, p in zip(slots, prompts):
            self._len[s] += len(p)

    def seq_mixed(self, step_slots: list[int], step_tokens: list[int], slots: list[int],
                  prompts: list[list[int]]) -> None:
        # one pass for the decode rows and the prompts (the GPU's mixed step): the prompt tokens' cost only,
        # or the step's when that is more (the pass reads the weights once, as the step does)
        self._wait()
        n = sum(len(p) for p in prompts)
        self._sleep("seq_step", max(self.step_s, self.prefill_s * n / 128), len(slots))
        for s in step_slots:
            self._len[s] += 1
        for s, p in zip(slots, prompts):
            self._len[s] += len(p)

    def seq_step(self, slots: list[int], tokens: list[int]) -> None:
        self._wait()  # the CUDA engine syncs first (its pinned row buffer), launches, and returns
        self._launch("seq_step", self.step_s, len(slots))
        for s in slots:
            self._len[s] += 1

    def seq_sample(self, slots, cfgs, steps, k):
        self._sleep("seq_sample", self.sample_s, len(slots))
        n = len(slots)
        toks = (np.arange(n, dtype=np.int32) * 7 + np.asarray(steps, np.int32)) % 1000 + 100
        return toks, np.full(n, -1.0, np.float32), np.zeros((n, k), np.int32), np.full((n, k), -1.0, np.float32)


class CharTokenizer:
    """A tokenizer whose token t is one character (so streamed text exists and can be checked)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + (t % 2000)) if t % 5 else " " for t in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 1000 + 100 for c in text]

    def token_bytes(self, t: int) -> bytes:
        return self.decode([t]).encode()


def make_engine(a):
    from tinyinfer.engine import Engine

    core = SleepCore(max_batch=a.max_batch, step_ms=a.step_ms, prefill_ms=a.prefill_ms, sample_ms=a.sample_ms)
    cfg = SimpleNamespace(vocab=core.vocab, eos_token_ids=[])
    return Engine.from_core(core, cfg, max_seq_len=core.max_seq_len, tokenizer=CharTokenizer() if a.text else None,
                            name="sleep-core")


def make_scheduler(a, engine):
    from tinyinfer.scheduler import Scheduler

    kw = {} if a.prefill_tokens is None else {"chunk_tokens": a.prefill_tokens}
    if getattr(a, "no_overlap", False):
        kw["overlap"] = False
    return Scheduler(engine, max_batch=a.max_batch, max_waiting=100000, **kw)


def ceiling(a, clients: int) -> dict:
    """The scheduler alone over the same fake core: all requests at once, steps until idle."""
    from tinyinfer.sampling import SamplingParams

    eng = make_engine(a)
    sched = make_scheduler(a, eng)
    rng = np.random.default_rng(a.seed + clients)
    sp = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    t = time.perf_counter()
    reqs = [sched.submit(rng.integers(100, 1000, int(rng.choice(a.lens))).tolist(), sp) for _ in range(clients)]
    while sched.step():
        pass
    wall = time.perf_counter() - t
    sched.close()
    core = eng._core
    tokens = sum(len(r.result().token_ids) for r in reqs)
    steps = max(core.calls["seq_sample"], 1)
    return {"ceiling_tok_s": tokens / wall, "ceiling_s": wall, "core_calls": dict(core.calls),
            "device_tok_s": tokens / core.busy_s if core.busy_s else 0.0,
            "overhead_ms_per_step": max(wall - core.busy_s, 0.0) * 1e3 / steps}


def raw_loop(a, rows: int) -> float:
    """The device idle per step (ms) of the bare loop over the fake core, no scheduler (bench --batch's: seq_step
    + seq_sample, the tokens fed back): the fake core's own floor (its sleeps overshoot, the calls cost)."""
    core = SleepCore(max_batch=a.max_batch, step_ms=a.step_ms, prefill_ms=a.prefill_ms, sample_ms=a.sample_ms)
    slots = [core.seq_open() for _ in range(min(rows, a.max_batch))]
    core.seq_prefill_many(slots, [[1] * 8] * len(slots))
    t, busy = time.perf_counter(), core.busy_s
    toks = core.seq_sample(slots, [None] * len(slots), [0] * len(slots), 0)[0]
    for i in range(1, a.max_tokens):
        core.seq_step(slots, toks.tolist())
        toks = core.seq_sample(slots, [None] * len(slots), [i] * len(slots), 0)[0]
    return (time.perf_counter() - t - (core.busy_s - busy)) * 1e3 / a.max_tokens


def serve(a) -> int:
    """The server process: the real app over the fake core on 127.0.0.1:--port."""
    import logging

    import uvicorn

    from tinyinfer.server.app import create_app

    eng = make_engine(a)
    core = eng._core
    if a.api_workers > 1:  # the HTTP side in processes of its own, as `tinyinfer serve --api-workers N`
        from tinyinfer.server.workers import run_workers

        args = SimpleNamespace(host="127.0.0.1", port=a.port, api_workers=a.api_workers,
                               stream_interval=a.stream_interval, log_level="warning")
        try:
            return run_workers(args, eng, make_scheduler(a, eng), model_name="bench", api_key=None)
        finally:
            if a.trace:
                Path(a.trace).write_text(json.dumps(core.trace))
    kw = {} if a.stream_interval is None else {"stream_interval": a.stream_interval}
    app = create_app(eng, make_scheduler(a, eng), model_name="bench", **kw)
    logging.getLogger("tinyinfer.server").setLevel(logging.WARNING)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=a.port, log_level="warning",
                                           access_log=False, http=a.http, loop=a.loop))
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        server.run()
    except KeyboardInterrupt:  # the bench's Ctrl-C: uvicorn raises it again once it has shut down
        pass
    finally:
        if prof is not None:
            prof.disable()
            prof.dump_stats(a.profile)
        if a.trace:
            Path(a.trace).write_text(json.dumps(core.trace))
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process and its live children (the API workers) have used (Linux /proc; 0.0
    elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children = set()
    for f in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children.update(int(c) for c in f.read_text().split())
        except OSError:
            pass
    return own + sum(cpu_seconds(c) for c in children)


def start(a, argv: list[str]) -> tuple[subprocess.Popen, str]:
    port = serve_bench._free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(port), *argv])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve_overhead: the server exited ({proc.returncode})")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("serve_overhead: the server did not come up in 60 s")


def write_json(a, rows: list[dict]) -> None:
    if a.json:
        Path(a.json).write_text(json.dumps({"args": {k: v for k, v in vars(a).items() if k != "serve"},
                                            "levels": rows}, indent=1))


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="64", help="comma-separated client counts (default 64)")
    ap.add_argument("--rounds", type=int, default=1, help="requests each client sends in turn (default 1)")
    ap.add_argument("--prompt-lens", default="128", help="prompt lengths drawn per request (default 128)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=1.5, help="sleep per seq_step (default 1.5)")
    ap.add_argument("--sample-ms", type=float, default=0.3, help="sleep per seq_sample (default 0.3)")
    ap.add_argument("--prefill-ms", type=float, default=0.3, help="sleep per 128 prompt tokens (default 0.3)")
    ap.add_argument("--prefill-tokens", type=int, default=None,
                    help="the scheduler's prompt tokens per step (default: the Scheduler's for cuda)")
    ap.add_argument("--stream-interval", type=int, default=None,
                    help="tokens per streamed chunk (default: the server's adaptive interval)")
    ap.add_argument("--http", default="auto", choices=("auto", "h11", "httptools"),
                    help="uvicorn's HTTP implementation (auto: httptools when installed, as tinyinfer serve)")
    ap.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                    help="uvicorn's event loop (auto: uvloop when installed, as tinyinfer serve)")
    ap.add_argument("--text", action="store_true", help="give the engine a one-character-per-token tokenizer")
    ap.add_argument("--api-workers", type=int, default=1,
                    help="the server's HTTP side in N processes of its own (tinyinfer serve --api-workers N; the "
                         "server CPU column then sums them); not with --text or --profile")
    ap.add_argument("--no-overlap", action="store_true",
                    help="Scheduler(overlap=False): no decode step launched before a step's per-token work (A/B)")
    ap.add_argument("--ceiling-only", action="store_true",
                    help="only the in-process ceiling (no server, no HTTP): the scheduler's overhead per step")
    ap.add_argument("--repeat", type=int, default=3, help="runs per level; the best is reported (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, help="cProfile the server's main thread into this file")
    ap.add_argument("--trace", default=None, help="the server's core calls (start, end, call, rows) as JSON here")
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.lens = serve_bench._ints(a.prompt_lens, "--prompt-lens")
    if a.api_workers > 1 and (a.text or a.profile):  # (the workers could not unpickle this script's tokenizer)
        raise SystemExit("serve_overhead: --api-workers > 1 works without --text and --profile")
    if a.api_workers < 1:
        raise SystemExit("serve_overhead: --api-workers must be >= 1")
    if a.serve:
        return serve(a)
    levels = serve_bench._ints(a.concurrency, "--concurrency")
    rows = []
    if a.ceiling_only:
        print(f"serve_overhead: fake core {a.step_ms} ms/step + {a.sample_ms} ms/sample; prompts {a.lens}, "
              f"{a.max_tokens} out{', no overlap' if a.no_overlap else ''}")
        print(f"{'requests':>8} {'tok/s':>9} {'device':>9} {'ratio':>6} {'overhead ms/step':>17} "
              f"{'bare loop':>9}")
        for c in levels:
            r = max((ceiling(a, c * a.rounds) for _ in range(a.repeat)), key=lambda r: r["ceiling_tok_s"])
            r["raw_overhead_ms_per_step"] = min(raw_loop(a, c * a.rounds) for _ in range(a.repeat))
            rows.append(r)
            print(f"{c * a.rounds:>8} {r['ceiling_tok_s']:>9.0f} {r['device_tok_s']:>9.0f} "
                  f"{r['ceiling_tok_s'] / r['device_tok_s']:>6.2f} {r['overhead_ms_per_step']:>17.3f} "
                  f"{r['raw_overhead_ms_per_step']:>9.3f}")
        write_json(a, rows)
        return 0
    proc, url = start(a, argv)  # the server ignores the client-side flags
    try:
        for c in sorted({1, *levels}):  # warm-up as serve_bench's
            asyncio.run(serve_bench.run_level(url, "bench", c, 1, a.lens, 4, a.seed - 1))
        print(f"serve_overhead: fake core {a.step_ms} ms/step + {a.sample_ms} ms/sample, prefill {a.prefill_ms} ms "
              f"per 128 tokens; prompts {a.lens}, {a.max_tokens} out, {a.rounds} per client")
        print(f"{'clients':>7} {'tok/s':>9} {'ceiling':>9} {'ratio':>6} {'/device':>7} {'wall s':>7} {'cpu us/tok':>10} "
              f"{'tok/chunk':>9} {'client cpu':>10} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8}  (ms)")
        for c in levels:
            best = None
            for _ in range(a.repeat):
                cpu = cpu_seconds(proc.pid)
                r = asyncio.run(serve_bench.run_level(url, "bench", c, a.rounds, a.lens, a.max_tokens, a.seed))
                r.pop("_stamps", None)  # (the per-request client stamps: serve_bench's --trace-dir only)
                r["server_cpu_s"] = cpu_seconds(proc.pid) - cpu
                r["server_cpu_us_per_token"] = r["server_cpu_s"] * 1e6 / max(r["completion_tokens"], 1)
                if best is None or r["output_tok_s"] > best["output_tok_s"]:
                    best = r
            r = best
            r.update(ceiling(a, c * a.rounds))
            r["ratio"] = r["output_tok_s"] / r["ceiling_tok_s"]
            rows.append(r)
            print(f"{c:>7} {r['output_tok_s']:>9.0f} {r['ceiling_tok_s']:>9.0f} {r['ratio']:>6.2f} "
                  f"{r['output_tok_s'] / r['device_tok_s']:>7.2f} {r['wall_s']:>7.3f} {r['server_cpu_us_per_token']:>10.1f} {r['tokens_per_chunk']:>9.2f} {r['client_cpu']:>9.0%} "
                  f"{r['ttft_ms']['p50']:>9.1f} {r['ttft_ms']['p99']:>8.1f} "
                  f"{r['itl_ms']['p50']:>8.2f} {r['itl_ms']['p99']:>8.2f}"
                  + (f"  {r['failed']} failed: {r['errors'][0]}" if r["failed"] else ""))
    finally:
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    write_json(a, rows)
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
