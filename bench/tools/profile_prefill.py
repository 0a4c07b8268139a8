"""Prefill on a random-weight shape, for a profiler to look at, or (--kernels) a per-kernel GPU-time table from
torch's CUPTI profiler (it sees every kernel in the process, ours and cuBLASLt's). One prompt of N tokens, or
(--many=B) B prompts of N tokens each in one seq_prefill_many (the serving scheduler's batched prefill):
    python3 bench/tools/profile_prefill.py tinyllama-1.1b 2048 --kernels
    python3 bench/tools/profile_prefill.py tinyllama-1.1b 128 --many=16 --kernels [--max-seq=2048]
(--mixed=R) the same call with R decoding sequences stepped in it (seq_mixed: the scheduler's mixed step), against
seq_step of those R then seq_prefill_many:
    python3 bench/tools/profile_prefill.py tinyllama-1.1b 128 --many=7 --mixed=57 --kernels
    ncu --clock-control none -k regex:prefill_attn -s 200 -c 1 python3 bench/tools/profile_prefill.py tinyllama-1.1b 2048"""

import sys
import time

import numpy as np

from tinyinfer import _core
from tinyinfer.bench import shape_config

args = [a for a in sys.argv[1:] if not a.startswith("--")]
shape, n = (args[0] if args else "tinyllama-1.1b"), int(args[1]) if len(args) > 1 else 2048
many = int(next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--many=")), "0"))
mixed = int(next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--mixed=")), "0"))
# the engine's max_seq_len (2048 by default, as a server's): a pass is min(prefill_chunk, max_seq_len) rows
max_seq = int(next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--max-seq=")), "2048"))
cfg = shape_config(shape)

if many:
    opts = _core.CudaOptions()
    opts.max_batch = max(opts.max_batch, many + mixed)
    eng = _core.CudaEngine.random(cfg, max(n + 16, max_seq), 1, opts)
    prompts = [np.random.default_rng(i).integers(0, cfg.vocab, n).tolist() for i in range(many)]
    running = [eng.seq_open() for _ in range(mixed)]
    if mixed:
        eng.seq_prefill_many(running, prompts[:1] * mixed)  # (contexts of n tokens, as the prompts')

    launched: list[float] = []  # when each mixed call returned (it returns once queued, as seq_step)

    def run(together: bool = True) -> float:
        slots = [eng.seq_open() for _ in range(many)]
        t = time.perf_counter()
        if mixed and together:
            eng.seq_mixed(running, [1] * mixed, slots, prompts)
            launched.append(time.perf_counter() - t)
        else:
            if mixed:
                eng.seq_step(running, [1] * mixed)
            eng.seq_prefill_many(slots, prompts)
        eng.seq_logits(slots[-1])  # (a copy to the host: waits for the queued passes; both calls return once launched)
        dt = time.perf_counter() - t
        for s in slots:
            eng.seq_close(s)
        return dt

    run(), run(False)  # GEMM tactics, graphs
    launched.clear()
    what = f"{many} x {n}" + (f" + {mixed} decode rows" if mixed else "")
    print(f"{shape} prefill {what} in one call: {min(run() for _ in range(3)) * 1e3:.3f} ms")
    if mixed:
        # a launch that takes as long as the pass means something in it waits for the GPU (no overlap to gain)
        print(f"{shape} seq_mixed returned after {min(launched) * 1e3:.3f} ms (host launch)")
        print(f"{shape} the same as seq_step + seq_prefill_many: {min(run(False) for _ in range(3)) * 1e3:.3f} ms")
else:
    eng = _core.CudaEngine.random(cfg, max(n, 16), 1)
    run = lambda: eng.time_prefill(n, 1)  # noqa: E731  (warm-up + 1 timed: 2 prefills)
    print(f"{shape} prefill {n}: {eng.time_prefill(n, 3):.3f} ms")  # (its warm-up tunes the GEMMs)
if "--kernels" in sys.argv:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
