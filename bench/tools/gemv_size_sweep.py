"""GEMV time against matrix size, per weight format: each kernel's fixed cost and its streaming rate, apart.
Random-weight models at one hidden size with the intermediate size swept; the load-time tuner times gate/up
(2I x H: normed input, SwiGLU out) and down (H x I: fp16 input, residual add) over the layers' copies,
graph-replayed under PDL as in the decode step (gemv_plan.cu). Per (format, role) the fastest variant's µs
against the matrix's bytes (scales included) and a least-squares line t = fixed + bytes / rate. Why: the bench
tables fit ~1.2 µs fixed for fp16 and ~2.3 for int4 at Llama-2-7B's sizes (docs/perf/persistent.md §19), a
fixed cost paid by every GEMV of a step (4 a layer), which this measures on one kernel family at a time.
    python3 bench/tools/gemv_size_sweep.py [--hidden=2048] [--sizes=512,1024,2048,4096,8192,16384]
        [--dtypes=fp16,int8,int4] [--opts=act8=1,...] [--json=out.json]"""

from __future__ import annotations

import json
import sys

import numpy as np

from common import options
from tinyinfer import _core


def arg(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(f"--{name}=")), default)


def config(hidden: int, intermediate: int) -> _core.ModelConfig:
    c = _core.ModelConfig()
    c.hidden, c.intermediate, c.n_layers = hidden, intermediate, 4
    c.head_dim = 64
    c.n_heads, c.n_kv_heads = hidden // 64, max(1, hidden // 512)
    c.vocab, c.tie_word_embeddings = 4096, False
    c.max_position_embeddings, c.rms_eps = 8192, 1e-5
    c.validate()
    return c


def main() -> None:
    hidden = int(arg("hidden", "2048"))
    sizes = [int(s) for s in arg("sizes", "512,1024,2048,4096,8192,16384").split(",")]
    dtypes = arg("dtypes", "fp16,int8,int4").split(",")
    spec = arg("opts", "")
    rows = []
    for dtype in dtypes:
        for inter in sizes:
            eng = _core.CudaEngine.random(config(hidden, inter), 256, 1, options(spec, dtype))
            for g in eng.gemv_table():
                if g["name"] not in ("gate_up", "down"):
                    continue
                best = min(range(len(g["us"])), key=lambda i: g["us"][i])
                us = g["us"][best]
                # bytes from the chosen variant's rate (gb_per_s = bytes / its µs), as the bench tables
                chosen = [i for i in range(len(g["us"])) if (g["tried_R"][i], g["tried_blocks_per_sm"][i],
                          g["tried_act8"][i]) == (g["R"], g["blocks_per_sm"], int(g["act8"]))]
                mb = g["gb_per_s"] * g["us"][chosen[0]] * 1e-3 if chosen else float("nan")
                rows.append(dict(dtype=dtype, role=g["name"], intermediate=inter, rows=g["rows"], K=g["K"], mb=mb,
                                 us=us, R=g["tried_R"][best], blocks_per_sm=g["tried_blocks_per_sm"][best],
                                 act8=bool(g["tried_act8"][best])))
            del eng
    print(f"hidden {hidden}, options {spec or '(defaults)'}: µs per matrix (fastest variant alone, L2-cold, PDL)")
    print(f"{'format':>6} {'role':>8} {'rows x K':>13} {'MB':>7} {'µs':>7} {'GB/s':>6}  variant")
    for r in rows:
        v = f"R{r['R']}/{r['blocks_per_sm']}" + (" a8" if r["act8"] else "")
        print(f"{r['dtype']:>6} {r['role']:>8} {r['rows']:>6}x{r['K']:<6} {r['mb']:7.1f} {r['us']:7.2f} "
              f"{r['mb'] / r['us'] * 1e3:6.0f}  {v}")
    fits = {}
    print("\nleast squares t = fixed + MB / rate:")
    for dtype in dtypes:
        for role in ("gate_up", "down"):
            pts = [(r["mb"], r["us"]) for r in rows if r["dtype"] == dtype and r["role"] == role]
            if len(pts) < 2:
                continue
            x, y = np.array(pts).T
            slope, fixed = np.polyfit(x, y, 1)
            fits[f"{dtype}/{role}"] = dict(fixed_us=fixed, rate_gb_per_s=1e3 / slope)
            print(f"  {dtype:>6} {role:>8}: fixed {fixed:5.2f} µs, rate {1e3 / slope:6.0f} GB/s")
    path = arg("json", "")
    if path:
        with open(path, "w") as f:
            json.dump(dict(hidden=hidden, options=spec, rows=rows, fits=fits), f, indent=1)


if __name__ == "__main__":
    main()
