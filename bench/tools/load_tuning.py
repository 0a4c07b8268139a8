"""Where a GPU load's time goes in the tuning step (docs/perf/load.md, "## Tuning"): an engine of random weights
at a model's shape is built twice, tuning and then from the first one's saved plan, and each prints its
constructor's wall time, tune_seconds in parts, and the GEMV picks (which must agree).

    python bench/tools/load_tuning.py tinyllama-1.1b fp16 [MAX_SEQ] [--opts=k=v,...]
"""

import sys
import time

from tinyinfer import _core
from tinyinfer.bench import shape_config

from common import options


def build(config, max_seq: int, opts) -> tuple:
    t0 = time.perf_counter()
    eng = _core.CudaEngine.random(config, max_seq, 1, opts)
    return eng, time.perf_counter() - t0


def picks(eng) -> list:
    return [(g["name"], g["R"], g["blocks_per_sm"]) for g in eng.gemv_table()] + [eng.decode_long]


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--opts=")]
    spec = next((a[len("--opts="):] for a in sys.argv[1:] if a.startswith("--opts=")), "")
    if len(args) < 2:
        raise SystemExit(__doc__)
    config, max_seq = shape_config(args[0]), int(args[2]) if len(args) > 2 else 4096
    build(config, 256, options(spec, args[1]))  # the process's first engine pays for CUDA's and cuBLAS's start
    tuned, t_tuned = build(config, max_seq, options(spec, args[1]))
    opts = options(spec, args[1])
    opts.plan_text = tuned.plan_text
    cached, t_cached = build(config, max_seq, opts)
    for name, eng, t in (("tuned", tuned, t_tuned), ("from plan", cached, t_cached)):
        parts = ", ".join(f"{k} {v:.3f}" for k, v in eng.tune_parts.items())
        print(f"{name:>9}: constructor {t:.3f} s, tuning {eng.tune_seconds:.3f} s ({parts})")
    n = sum(len(g["us"]) for g in tuned.gemv_table())
    print(f"variants timed: {n}; picks {picks(tuned)}")
    if not cached.plan_from_cache or picks(cached) != picks(tuned):
        raise SystemExit(f"the plan was not taken as saved: {cached.plan_problem!r} {picks(cached)}")


if __name__ == "__main__":
    main()
