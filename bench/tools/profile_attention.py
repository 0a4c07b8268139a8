"""Run the decode attention kernel of a random TinyLlama-shape engine at one context, for a profiler (ncu):
    ncu --clock-control none -k regex:decode_attn -s 30 -c 1 python3 bench/tools/profile_attention.py 4096"""

import sys

from tinyinfer import _core
from tinyinfer.bench import shape_config

ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
shape = sys.argv[2] if len(sys.argv) > 2 else "tinyllama-1.1b"
eng = _core.CudaEngine.random(shape_config(shape), ctx + 64, 1)
print(f"{shape} attention at {ctx}: {eng.time_attention(ctx, 2):.2f} µs/layer")
