"""Where a serving round goes inside the process, without HTTP: C client threads each submit R requests in turn
(P-token prompts, G tokens out, greedy) to one Scheduler driven by its own thread, as serve_bench's clients do
through the server. The core is wrapped so that every call is timed; the report splits the wall time into the
core's calls (seq_step launches the step's graph, seq_sample waits for it and samples; prefill), the scheduler's
own Python (a step's time outside core calls) and idle (no step running: waiting for requests). The core calls
are recorded by the scheduler's own Trace (src/tinyinfer/trace.py); --trace FILE writes it for
bench/tools/serve_timeline.py (one level: the measured rounds); --gpu-idle records the rounds' device activity
(torch.profiler) and reports where the device waited (gpu_idle.py).
    python3 bench/tools/trace_scheduler.py tinyllama-1.1b fp16 --clients 64 --rounds 2 [--opts=...] [--sched k=v]
        [--gpu-idle]
"""

import argparse
import contextlib
import json
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import gpu_idle
from common import options

from tinyinfer import _core
from tinyinfer.bench import shape_config
from tinyinfer.engine import Engine
from tinyinfer.sampling import SamplingParams
from tinyinfer.scheduler import Scheduler
from tinyinfer.trace import Trace


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
    ap.add_argument("--sched", default="", help="Scheduler keyword arguments, k=v,... (ints; bools as true / false)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval (tinyinfer serve sets 0.2; Python's default is 5)")
    ap.add_argument("--trace", default=None, help="write the measured rounds' timeline here (serve_timeline.py)")
    ap.add_argument("--gpu-idle", action="store_true",
                    help="record the measured rounds' device activity (torch.profiler) and report where it idles")
    a = ap.parse_args()
    if a.switch_interval_ms is not None:
        sys.setswitchinterval(a.switch_interval_ms / 1e3)
    cfg = shape_config(a.shape)
    o = options(a.opts, a.dtype)
    o.max_batch = max(o.max_batch, a.clients)
    core = _core.CudaEngine.random(cfg, a.max_seq_len, 1, o)
    kw = {k: (v.lower() == "true" if v.lower() in ("true", "false") else int(v))
          for k, v in (kv.split("=", 1) for kv in filter(None, a.sched.split(",")))}
    eng = Engine.from_core(core, cfg, max_seq_len=a.max_seq_len, name=a.shape)
    trace = Trace()
    sched = Scheduler(eng, max_batch=a.clients, trace=trace, **kw)
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
    trace.calls.clear(), trace.events.clear(), steps.clear()
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

    prof = None
    with (gpu_idle.record() if a.gpu_idle else contextlib.nullcontext()) as prof:
        sched.start()
        t0 = time.perf_counter()
        th = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        t1 = time.perf_counter()
    wall = t1 - t0
    sched.close()
    spent, calls = defaultdict(float), defaultdict(int)
    for name, s, e, _ in trace.calls:
        spent[name] += e - s
        calls[name] += 1
    if a.trace:
        trace.save(a.trace)
        marks = {"levels": [{"concurrency": a.clients, "rounds": a.rounds, "t_start": t0, "t_end": t1}]}
        Path(a.trace).with_name("levels.json").write_text(json.dumps(marks))  # (serve_timeline reads it)
    in_steps = sum(e - s for s, e in steps)
    core_s = sum(spent.values())
    toks = a.clients * a.rounds * a.gen
    print(f"{a.shape} {a.dtype} {a.clients} clients x {a.rounds} rounds, {a.prompt} + {a.gen}, sched {kw}, "
          f"opts '{a.opts}', switch interval {sys.getswitchinterval() * 1e3:g} ms: {wall:.3f} s, {toks / wall:,.0f} tok/s out, {len(steps)} steps, "
          f"TTFT p50 {1e3 * float(np.median(ttft)):.1f} ms")
    print(f"  in steps {in_steps:.3f} s (core calls {core_s:.3f}, scheduler Python {in_steps - core_s:.3f}); "
          f"idle between steps {wall - in_steps:.3f} s")
    for k in sorted(spent, key=lambda k: -spent[k]):
        print(f"  {k:18s} {calls[k]:6d} calls {spent[k]:8.3f} s  {1e3 * spent[k] / calls[k]:8.3f} ms")
    if prof is not None:
        print(gpu_idle.report(prof))


if __name__ == "__main__":
    main()
