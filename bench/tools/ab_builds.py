"""A/B of two builds of the engine on the graph-replayed decode step, with one GEMV plan for both.
    python3 bench/tools/ab_builds.py DIR_A DIR_B SHAPE DTYPE [CONTEXT] [SPEC] [--rounds=2] [--steps=200] [--reps=3]
DIR_A / DIR_B: where each build is installed (`pip install --target DIR .`), put first on PYTHONPATH of its own
processes. A change to a kernel's code cannot be switched inside one process as ab_decode.py switches options, so
each round runs one process per build, A then B, and the rounds interleave them so that drift hits both alike. The
first process tunes and leaves its GEMV plan (CudaEngine.plan_text) in a temporary file; every later one takes it
(CudaOptions.plan_text), so that two tunings' differences (up to ~2% a step) do not hide the change's. A plan's key
names the build (plan_build_id), so the other build cannot take the plan itself: it is given the first process's
picks instead (each role's GEMV variant, the early triggers and the carveout), as ab_decode.py's --same-plan does
for another key. Each process times `--reps` runs of `--steps` consecutive steps from CONTEXT on (default 16) and
reports its best; the table gives each build's best and median over rounds.
SPEC: CudaOptions as ab_decode.py takes them (e.g. "act8=-1")."""

import json
import os
import statistics
import subprocess
import sys
import tempfile


HOW = {"tuned": "tuned its plan", "plan": "took that plan", "picks": "took that plan's picks (another build)"}


def worker(shape: str, dtype: str, ctx: int, spec: str, plan_file: str, steps: int, reps: int) -> None:
    from ab_decode import make

    first = json.load(open(plan_file)) if os.path.getsize(plan_file) else None
    max_seq = max(ctx + steps + 64, 512)
    e = make(shape, max_seq, spec, dtype, first["plan"] if first else "")
    how = "tuned"
    if first is None:
        pins = ";".join(f"{g['name']}:{g['R']}/{g['blocks_per_sm']}" for g in e.gemv_table())
        with open(plan_file, "w") as f:
            json.dump({"plan": e.plan_text, "picks": f"gemv_pins={pins},early_trigger={int(e.early_trigger)},"
                                                      f"smem_carveout={e.smem_carveout}"}, f)
    elif e.plan_from_cache:
        how = "plan"
    else:
        del e
        e = make(shape, max_seq, ",".join(filter(None, [spec, first["picks"]])), dtype)
        how = "picks"
    best = min(e.time_decode_step(ctx, steps) for _ in range(reps)) * 1e3
    print(f"RESULT {best:.3f} {how}")


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        shape, dtype, ctx, spec, plan_file, steps, reps = sys.argv[2:9]
        return worker(shape, dtype, int(ctx), spec, plan_file, int(steps), int(reps))
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opt = {a[2:].split("=")[0]: int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--")}
    dirs, shape, dtype = args[0:2], args[2], args[3]
    ctx = int(args[4]) if len(args) > 4 else 16
    spec = args[5] if len(args) > 5 else ""
    rounds, steps, reps = opt.get("rounds", 2), opt.get("steps", 200), opt.get("reps", 3)
    here = os.path.dirname(os.path.abspath(__file__))
    times = [[], []]
    with tempfile.NamedTemporaryFile("w", suffix=".plan", delete=False) as f:
        plan_file = f.name
    try:
        for r in range(rounds):
            for i, d in enumerate(dirs):
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [d, os.environ.get("PYTHONPATH")])))
                out = subprocess.run([sys.executable, os.path.join(here, "ab_builds.py"), "--worker", shape, dtype,
                                      str(ctx), spec, plan_file, str(steps), str(reps)],
                                     env=env, cwd=here, capture_output=True, text=True)
                line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
                if line is None:
                    sys.exit(f"build {d} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
                us, how = float(line.split()[1]), line.split()[2]
                if r == 0:
                    print(f"  {d}: {HOW[how]}")
                times[i].append(us)
    finally:
        os.unlink(plan_file)
    print(f"{shape} {dtype} {spec or '(defaults)'} ctx {ctx}..{ctx + steps - 1}: µs per decode step, {rounds} rounds")
    base = min(times[0])
    for d, t in zip(dirs, times):
        print(f"  {d:24s} best {min(t):7.1f}  median {statistics.median(t):7.1f}  {1e6 / min(t):7,.0f} tok/s  "
              f"{100 * (min(t) / base - 1):+5.1f}%   (rounds: {', '.join(f'{x:.1f}' for x in t)})")


if __name__ == "__main__":
    main()
