"""Where a batched decode step spends its time, kernel by kernel (torch's CUPTI profiler sees the kernels inside
the bucket's CUDA graph), as bench/tools/profile_decode.py does for the single-sequence step: each kernel is
charged its critical-path increment (how far its end moves the step's end), so the increments of a step sum to
its GPU time; the gap between the GPU's step and the wall clock's is the host (seq_step + seq_sample round trip).
    python3 bench/tools/profile_batch.py tinyllama-1.1b fp16 32 [--opts=batch_mma_max=0]"""

import sys
import time
from collections import defaultdict

import numpy as np
from common import options
from profile_decode import short

from tinyinfer import _core
from tinyinfer.bench import shape_config


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    shape, dtype, batch = args[0], args[1], int(args[2])
    spec = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--opts=")), "")
    cfg = shape_config(shape)
    opts = options(spec, dtype)
    opts.max_batch = max(opts.max_batch, batch)
    eng = _core.CudaEngine.random(cfg, 512, 1, opts)
    rng = np.random.default_rng(0)
    slots = [eng.seq_open() for _ in range(batch)]
    greedy = [_core.SamplingConfig()] * batch
    for s in slots:
        eng.seq_prefill(s, rng.integers(0, cfg.vocab, 128).tolist())
    toks, *_ = eng.seq_sample(slots, greedy, [0] * batch, 0)

    def steps(n: int, first: int) -> float:
        nonlocal toks
        t = time.perf_counter()
        for i in range(n):
            eng.seq_step(slots, [int(x) for x in toks])
            toks, *_ = eng.seq_sample(slots, greedy, [first + i] * batch, 0)
        return (time.perf_counter() - t) / n

    steps(8, 1)  # the bucket's graph, tactics
    wall = steps(50, 9)
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    n_prof = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps(n_prof, 59)
    ev = [e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
          and "memset" not in e.name.lower()]
    ev.sort(key=lambda e: e.time_range.start)
    incr, cnt, dur = defaultdict(float), defaultdict(float), defaultdict(float)
    gpu = 0.0
    end = ev[0].time_range.start
    for e in ev:
        n = short(e.name)
        if e.time_range.start > end:  # the GPU idle between steps: the host's part
            end = e.time_range.start
        d = max(0.0, e.time_range.end - end)
        incr[n] += d
        gpu += d
        cnt[n] += 1
        dur[n] += e.time_range.end - e.time_range.start
        end = max(end, e.time_range.end)
    print(f"{shape} {dtype} batch {batch} {spec}: {wall * 1e3:.3f} ms per step (wall, seq_step + seq_sample); "
          f"GPU busy {gpu / n_prof / 1e3:.3f} ms per step under the profiler; host / idle the rest")
    # incr: how far the kernel moves the step's end; dur: its own duration (start to end, overlaps included)
    print(f"{'kernel':90s} {'n/step':>6s} {'incr us/step':>12s} {'dur us/step':>11s} {'share':>6s}")
    for n in sorted(incr, key=lambda k: -incr[k])[:25]:
        print(f"{n:90s} {cnt[n] / n_prof:6.0f} {incr[n] / n_prof:12.1f} {dur[n] / n_prof:11.1f} "
              f"{100 * incr[n] / gpu:5.1f}%")
    # the tuner's picks for the step's cuBLASLt products (timed alone at the bucket's N: tuned against default)
    for g in eng.gemm_table():
        print(f"gemm {g['name']:>8} {g['M']}x{g['N']}x{g['K']} {g['out']:>6}: default {g['default_us']:.1f} µs, "
              f"tuned {g['tuned_us']:.1f} µs, pick {g['chosen']} of {g['candidates']}: {g['algo']}")


if __name__ == "__main__":
    main()
