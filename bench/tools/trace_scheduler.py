"""Where a serving round goes inside the process, without HTTP: C client threads each submit R requests in turn
(P-token prompts, G tokens out, greedy) to one Scheduler driven by its own thread, as serve_bench's clients do
through the server. The core is wrapped so that every call is timed; the report splits the wall time into the
core's calls (seq_step launches the step's graph, seq_sample waits for it and samples; prefill), the scheduler's
own Python (a step's time outside core calls) and idle (no step running: waiting for requests).
    python3 bench/tools/trace_scheduler.py tinyllama-1.1b fp16 --clients 64 --rounds 2 [--opts=...] [--sched k=v]
"""

import argparse
import sys
import threading
import time
from collections import defaultdict

import numpy as np
from common import options

from tinyinfer import _core
from tinyinfer.bench import shape_config
from tinyinfer.engine import Engine
from tinyinfer.sampling import SamplingParams
from tinyinfer.scheduler import Scheduler

TIMED = ("seq_step", "seq_sample", "seq_prefill_many", "seq_prefill", "seq_open", "seq_close")


class TimedCore:
    """Forwards everything to the core; the calls in TIMED add their wall time and count to `spent`."""

    def __init__(self, core):
        self._core, self.spent, self.calls = core, defaultdict(float), defaultdict(int)

    def __getattr__(self, name):
        f = getattr(self._core, name)
        if name not in TIMED:
            return f

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.spent[name] += time.perf_counter() - t
                self.calls[name] += 1
        return timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape")
    ap.add_argument("dtype")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--opts", default="")
    ap.add_argument("--sched", default="", help="Scheduler keyword arguments, k=v,... (ints / bools)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval (tinyinfer serve sets 0.2; Python's default is 5)")
    a = ap.parse_args()
    if a.switch_interval_ms is not None:
        sys.setswitchinterval(a.switch_interval_ms / 1e3)
    cfg = shape_config(a.shape)
    o = options(a.opts, a.dtype)
    o.max_batch = max(o.max_batch, a.clients)
    core = TimedCore(_core.CudaEngine.random(cfg, a.max_seq_len, 1, o))
    kw = {k: (v.lower() == "true" if v.lower() in ("true", "false") else int(v))
          for k, v in (kv.split("=", 1) for kv in filter(None, a.sched.split(",")))}
    eng = Engine.from_core(core, cfg, max_seq_len=a.max_seq_len, name=a.shape)
    sched = Scheduler(eng, max_batch=a.clients, **kw)
    steps, busy = [], [0.0]
    inner = sched._step_locked

    def step_locked(c):
        t = time.perf_counter()
        try:
            return inner(c)
        finally:
            steps.append((t, time.perf_counter()))
    sched._step_locked = step_locked
    sp = SamplingParams(max_tokens=a.gen, ignore_eos=True)
    rng = np.random.default_rng(0)
    prompts = [[rng.integers(0, cfg.vocab, a.prompt).tolist() for _ in range(a.rounds + 1)] for _ in range(a.clients)]
    sched.warm_up()  # every prefill token bucket's GEMM tactics and batch bucket's graph, as tinyinfer serve does
    for r in [sched.submit(p[-1], SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts]:
        r.result()
    sched.wait_idle()
    core.spent.clear(), core.calls.clear(), steps.clear()
    ttft = []

    def client(i: int) -> None:
        for r in range(a.rounds):
            t = time.perf_counter()
            req = sched.submit(prompts[i][r], sp)
            first = True
            for _ in req:
                if first:
                    ttft.append(time.perf_counter() - t)
                    first = False

    sched.start()
    t0 = time.perf_counter()
    th = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.perf_counter() - t0
    sched.close()
    in_steps = sum(e - s for s, e in steps)
    core_s = sum(core.spent.values())
    toks = a.clients * a.rounds * a.gen
    print(f"{a.shape} {a.dtype} {a.clients} clients x {a.rounds} rounds, {a.prompt} + {a.gen}, sched {kw}, "
          f"opts '{a.opts}', switch interval {sys.getswitchinterval() * 1e3:g} ms: {wall:.3f} s, {toks / wall:,.0f} tok/s out, {len(steps)} steps, "
          f"TTFT p50 {1e3 * float(np.median(ttft)):.1f} ms")
    print(f"  in steps {in_steps:.3f} s (core calls {core_s:.3f}, scheduler Python {in_steps - core_s:.3f}); "
          f"idle between steps {wall - in_steps:.3f} s")
    for k in sorted(core.spent, key=lambda k: -core.spent[k]):
        print(f"  {k:18s} {core.calls[k]:6d} calls {core.spent[k]:8.3f} s  {1e3 * core.spent[k] / core.calls[k]:8.3f} ms")


if __name__ == "__main__":
    main()
