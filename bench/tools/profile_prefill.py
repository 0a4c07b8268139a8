"""Prefill of one prompt length on a random-weight shape, for a profiler to look at, or (--kernels) a per-kernel
GPU-time table from torch's CUPTI profiler (it sees every kernel in the process, ours and cuBLASLt's):
    python3 bench/tools/profile_prefill.py tinyllama-1.1b 2048 --kernels
    ncu --clock-control none -k regex:prefill_attn -s 200 -c 1 python3 bench/tools/profile_prefill.py tinyllama-1.1b 2048"""

import sys

from tinyinfer import _core
from tinyinfer.bench import shape_config

args = [a for a in sys.argv[1:] if not a.startswith("--")]
shape, n = (args[0] if args else "tinyllama-1.1b"), int(args[1]) if len(args) > 1 else 2048
eng = _core.CudaEngine.random(shape_config(shape), max(n, 16), 1)
print(f"{shape} prefill {n}: {eng.time_prefill(n, 3):.3f} ms")  # (its warm-up tunes the GEMMs)
if "--kernels" in sys.argv:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.time_prefill(n, 1)  # warm-up + 1 timed: 2 prefills
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
