"""Prefill of one prompt length on a random-weight shape, for a profiler (nsys / ncu) to look at:
    nsys profile -o prefill python3 bench/profile_prefill.py tinyllama-1.1b 2048"""

import sys

from tinyinfer import _core
from tinyinfer.bench import shape_config

shape, n = (sys.argv[1] if len(sys.argv) > 1 else "tinyllama-1.1b"), int(sys.argv[2]) if len(sys.argv) > 2 else 2048
eng = _core.CudaEngine.random(shape_config(shape), max(n, 16), 1)
print(f"{shape} prefill {n}: {eng.time_prefill(n, 3):.3f} ms")
