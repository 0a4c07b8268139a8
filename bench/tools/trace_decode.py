"""Where the time of a decode step goes inside each kernel: per-block global-timer stamps (CudaOptions.trace;
common.cuh, trace_point) at a kernel's start, after its PDL wait, after its prologue (GEMV: input staged;
attention: new token read and written), and at its end, for one graph-replayed step.
    python3 bench/tools/trace_decode.py tinyllama-1.1b int4 [context] [--opts=...] [--timeline]
Per kernel kind (averaged over the layers), in µs:
  gap      previous kernel's last block end -> this kernel's median block passing its wait (the boundary)
  prologue median wait -> median prologue end
  body     median prologue end -> median block end
  tail     median block end -> last block end (load imbalance / stragglers)
  incr     last block end - previous kernel's last block end (the step's critical path; sums to the step)"""

import sys
from collections import defaultdict

import numpy as np

from common import engine_from_argv


def main() -> None:
    eng, shape, dtype, ctx, spec = engine_from_argv(trace=True)
    reps = [eng.trace_step(ctx) for _ in range(5)]
    stats = defaultdict(lambda: defaultdict(list))
    for trace in reps:
        kernels = []
        for name, flat in trace:
            a = np.array(flat, dtype=np.float64).reshape(-1, 4)
            a = a[(a[:, 0] > 0) & (a[:, 3] > 0)]  # blocks that ran to the end (early exits leave zeros)
            kernels.append((name, a))
        t0 = min(a[:, 0].min() for _, a in kernels)
        prev_end = None
        timeline = []
        for name, a in kernels:
            s = (a - t0) / 1e3  # µs from the step's first traced block
            med = np.median(s, axis=0)
            end = s[:, 3].max()
            if prev_end is not None:
                st = stats[name]
                st["gap"].append(med[1] - prev_end)
                st["prologue"].append(med[2] - med[1])
                st["body"].append(med[3] - med[2])
                st["tail"].append(end - med[3])
                st["incr"].append(end - prev_end)
                st["blocks"].append(len(a))
                st["wait_spread"].append(s[:, 1].max() - s[:, 1].min())
            timeline.append((name, s[:, 0].min(), med[1], med[2], med[3], end, len(a)))
            prev_end = end
    print(f"{shape} {dtype} ctx {ctx} {spec}: per kernel kind, mean over layers and {len(reps)} traced steps (µs)")
    print(f"{'kernel':>10} {'n':>3} {'blocks':>6} {'gap':>6} {'prologue':>8} {'body':>6} {'tail':>6} {'incr':>6} "
          f"{'wait spread':>11}")
    total = 0.0
    for name, st in stats.items():
        n = len(st["incr"]) // len(reps)
        total += np.mean(st["incr"]) * n
        print(f"{name:>10} {n:>3} {np.mean(st['blocks']):>6.0f} {np.mean(st['gap']):>6.2f} {np.mean(st['prologue']):>8.2f} "
              f"{np.mean(st['body']):>6.2f} {np.mean(st['tail']):>6.2f} {np.mean(st['incr']):>6.2f} "
              f"{np.mean(st['wait_spread']):>11.2f}")
    print(f"sum of increments (first kernel excluded): {total:.1f} µs")
    if "--timeline" in sys.argv:
        print("timeline of the last traced step, first 12 kernels (µs): first start, median wait, median prologue end, "
              "median end, last end, blocks")
        for row in timeline[:12]:
            print(f"  {row[0]:>10} " + " ".join(f"{v:8.2f}" for v in row[1:6]) + f" {row[6]:6d}")


if __name__ == "__main__":
    main()
