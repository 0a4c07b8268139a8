"""A/B of CudaOptions on the graph-replayed decode step (random weights at a real shape).
    python3 bench/tools/ab_decode.py tinyllama-1.1b int4 16 "" "gemv_grid=2" "gemv_pins=qkv:2/2;down:1/2"
    python3 bench/tools/ab_decode.py tinyllama-1.1b fp16 16 "" "decode_path=persistent" \
        "decode_path=persistent,persistent_prefetch=0"          (the persistent step against the graph path)
    python3 bench/tools/ab_decode.py tinyllama-1.1b fp16 16 "decode_path=persistent" \
        "decode_path=persistent,persistent_ring=0"              (its weight ring on / off: docs/perf/persistent.md §7)
Each variant is one engine (its own load-time autotune); the variants' timings are interleaved over `--rounds`
rounds (default 3) so that drift hits all alike, and each row reports the best and the median round. `--same-plan`
gives every engine the first one's GEMV plan where their plan keys agree (env items and options outside the key). A round
times `--steps` consecutive steps (default 200) from the context on; `--max-seq=N` sizes the engines (default
max(context + 300, 512)). `--gemv`
also prints each variant's GEMV picks (R, grid) and their GB/s timed alone. `--sms=N` holds the whole process to N
of the GPU's SMs (a green context, `_core.ops.restrict_to_sms`; it prints the read bandwidth there): an H100 at 88 of
its 132 SMs asks each SM for an H200's bytes per second (docs/perf/persistent.md §49). A spec's `env.NAME=V` items are set in
the environment while that engine loads (its graphs are captured then): an experiment build's switches, side by side
in one process."""

import os
import statistics
import sys

from common import options
from tinyinfer import _core
from tinyinfer.bench import shape_config


def make(shape: str, max_seq: int, spec: str, dtype: str, plan_text: str = ""):
    """An engine for one spec; its `env.NAME=V` items are set in the environment while it loads (its graphs are
    captured then): an experiment build's switches, A/B'd in one process. plan_text: a GEMV plan to take instead
    of tuning where it was made for this spec's key (CudaOptions.plan_text)."""
    items = [kv for kv in spec.split(",") if kv]
    env = dict(kv[4:].split("=", 1) for kv in items if kv.startswith("env."))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        o = options(",".join(kv for kv in items if not kv.startswith("env.")), dtype)
        o.plan_text = plan_text
        return _core.CudaEngine.random(shape_config(shape), max_seq, 1, o)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    rounds = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--rounds=")), 3)
    steps = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--steps=")), 200)
    shape, dtype, ctx, specs = args[0], args[1], int(args[2]), args[3:] or [""]
    max_seq = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--max-seq=")), max(ctx + 300, 512))
    sms = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--sms=")), 0)
    if sms:
        part = _core.ops.restrict_to_sms(sms)
        bw = _core.ops.read_bandwidth()
        print(f"held to {part['sms']} of {part['device_sms']} SMs: read bandwidth {bw['gb_per_s']:,.0f} GB/s "
              f"({bw['gb_per_s'] / part['sms']:.1f} a SM), SM clock {bw['sm_mhz']:,.0f} MHz")
    engines = [make(shape, max_seq, specs[0], dtype)]
    # --same-plan: the first engine's GEMV plan for the others (where their options give the same plan key), so
    # that two tunings' differences (up to ~2% a step) do not hide an experiment's
    # (elsewhere — options inside the key, e.g. early_trigger — each role pinned to the first engine's pick)
    same = engines[0].plan_text if "--same-plan" in sys.argv else ""
    pins = "gemv_pins=" + ";".join(f"{g['name']}:{g['R']}/{g['blocks_per_sm']}" for g in engines[0].gemv_table())
    for s in specs[1:]:
        e = make(shape, max_seq, s, dtype, same)
        if same and not e.plan_from_cache:
            del e
            e = make(shape, max_seq, ",".join(filter(None, [s, pins])), dtype)
            print(f"  {s}: another plan key; pinned to the first engine's picks")
        engines.append(e)
    times = [[] for _ in specs]  # by position: a spec may be given twice (two engines, two tunings)
    for _ in range(rounds):
        for i, e in enumerate(engines):
            times[i].append(e.time_decode_step(ctx, steps) * 1e3)
    print(f"{shape} {dtype} ctx {ctx}..{ctx + steps - 1}, max_seq {max_seq}: µs per decode step over {rounds} rounds")
    base = min(times[0])
    for s, t in zip(specs, times):
        print(f"  {s or '(defaults)':40s} best {min(t):7.1f}  median {statistics.median(t):7.1f}  "
              f"{1e6 / min(t):7,.0f} tok/s  {100 * (min(t) / base - 1):+5.1f}%")
    if "--gemv" in sys.argv:
        for s, e in zip(specs, engines):
            print(f"  {s or '(defaults)'}: " + "  ".join(
                f"{g['name']} R{g['R']}/{g['blocks_per_sm']}{'a8' if g['act8'] else ''} {g['gb_per_s']:.0f}"
                for g in e.gemv_table()) + " GB/s"
                + "; long-context graph (from, qkv R, qkv per SM): " + str(e.decode_long)
                + f"; carveout {e.smem_carveout}, early triggers {int(e.early_trigger)}")


if __name__ == "__main__":
    main()
