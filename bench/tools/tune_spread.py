"""How much a decode step depends on the load that tuned it (docs/perf/persistent.md §39): N engines of random
weights at a model's shape, each tuned by its own load (no saved plan), then every engine's step timed again in
interleaved rounds, so that a slower engine is told apart from a slower moment. Prints per load its choices (GEMV
picks, carveout, early-trigger level) and its best step time, then the spread.

    python bench/tools/tune_spread.py llama2-7b fp16 [N=4] [--ctx=16] [--steps=64] [--rounds=3] [--opts=k=v,...]

N engines live at once (Llama-2-7B fp16: ~13.5 GB each with a 1,024-position cache).
"""

import sys

from tinyinfer import _core
from tinyinfer.bench import shape_config

from common import options


def flag(name: str, default: int) -> int:
    return next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith(f"--{name}=")), default)


def choices(eng) -> str:
    picks = " ".join(f"{g['name']}:{g['R']}/{g['blocks_per_sm']}" for g in eng.gemv_table())
    carve = "driver" if eng.smem_carveout < 0 else f"{eng.smem_carveout}%"
    return f"{picks} | carveout {carve} | early {int(eng.early_trigger)}"


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) < 2:
        raise SystemExit(__doc__)
    shape, dtype = args[0], args[1]
    n = int(args[2]) if len(args) > 2 else 4
    ctx, steps, rounds = flag("ctx", 16), flag("steps", 64), flag("rounds", 3)
    spec = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--opts=")), "")
    cfg = shape_config(shape)
    max_seq = max(1024, ctx + steps + 64)
    opt = options(spec, dtype)
    if "max_batch=" not in spec:
        opt.max_batch = 1  # the default's KV pool takes up to half the free memory: N engines would not fit
    engines = [_core.CudaEngine.random(cfg, max_seq, 1, opt) for _ in range(n)]
    best = [float("inf")] * n
    for _ in range(rounds):
        for i, eng in enumerate(engines):
            best[i] = min(best[i], 1e3 * eng.time_decode_step(ctx, steps))
    for i, eng in enumerate(engines):
        print(f"load {i}: {best[i]:9.1f} µs a step (tuned in {eng.tune_seconds:.2f} s) {choices(eng)}")
    lo, hi = min(best), max(best)
    print(f"{shape} {dtype}, context {ctx}: {lo:.1f} .. {hi:.1f} µs a step over {n} loads "
          f"(+{100 * (hi / lo - 1):.1f}% between the fastest and the slowest load)")


if __name__ == "__main__":
    main()
