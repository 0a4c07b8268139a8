"""Where the time of a persistent decode step goes (issue 16's "measured per-task breakdown"): per task of the
schedule, global-timer stamps at its start (before its L2 prefetch), after its counter wait, and after its signal
and after its input's staging (GEMV and attention tasks) (cuda/persistent.cu, task_stamp; a -DTINYINFER_TRACE=ON build), for one
step after three warm-up steps.
    python3 bench/tools/trace_persistent.py tinyllama-1.1b fp16 [context] [--opts=...] [--reps=3] [--out=FILE.json]
Per task type, summed over the layers and averaged over the traced steps (µs):
  tasks      tasks per step (idle: attention chunks past the context, which only signal)
  incr       the step's critical path spent in this phase type: the phase's last task end minus the previous
             phase's (sums to the step, from the embedding's end to the LM head's)
  handoff    previous phase's last end -> this phase's first task past its wait (the counter hand-off)
  work/task  mean and max of a task's end - its wait's end (max > mean: imbalance, the phase waits for it)
  stage      mean of a task's staging after its wait: GEMV, its input read (RMSNorm'd) into shared memory, the
             rest of work/task its dot products; attention, q rotated and the new key / value written, the rest
             its scores, softmax and P V
  tail       median task end -> last task end (stragglers)
  wait, work block-µs summed over the tasks: time blocks spent waiting on counters vs running tasks
and the step's span, the blocks' mean busy fraction, the share of the span where fewer than 10% of the blocks
work (serial phases), and one layer's phases as a timeline."""

import json
import sys
from collections import defaultdict

import numpy as np

from common import engine_from_argv
from tinyinfer import _core

TYPES = ["embed", "qkv", "attn_partial", "attn_merge", "o", "gate_up", "down", "lm_head"]
EMBED, LM_HEAD = 0, 7


def phases(rows: np.ndarray) -> list:
    """The step's phases in schedule order: [(type, layer, rows of its tasks)]."""
    n_layers = int(rows[:, 2].max()) + 1
    key = {}
    for i, (t, l) in enumerate(zip(rows[:, 1], rows[:, 2])):
        order = (-1 if t == EMBED else n_layers if t == LM_HEAD else int(l), int(t))
        key.setdefault(order, []).append(i)
    return [(k[1], k[0], rows[idx]) for k, idx in sorted(key.items())]


def analyse(rows: np.ndarray) -> dict:
    start, waited, end = (rows[:, 5 + j].astype(np.float64) for j in range(3))
    if (end == 0).any():
        raise SystemExit(f"{int((end == 0).sum())} tasks without an end stamp: a build without "
                         "-DTINYINFER_TRACE=ON, or a step that failed")
    t0 = start.min()
    st = defaultdict(lambda: defaultdict(float))
    prev_end = None
    for t, layer, r in phases(rows):
        s, w, e = ((r[:, 5 + j] - t0) / 1e3 for j in range(3))
        idle = (r[:, 1] == 2) & (w - s < 0.05) & (e - w < 0.05)  # attention chunks past pos: signal only
        busy = ~idle
        d = st[TYPES[t]]
        d["tasks"] += len(r)
        d["idle"] += int(idle.sum())
        d["wait"] += float((w - s)[busy].sum())
        d["work"] += float((e - w)[busy].sum())
        staged = r[:, 8] > 0
        if staged.any():
            d["stage_sum"] += float(((r[staged, 8] - t0) / 1e3 - w[staged]).mean())
        if busy.any():
            work = (e - w)[busy]
            d["work_max"] = max(d["work_max"], float(work.max()))
            d["work_max_sum"] += float(work.max())
            d["work_mean_sum"] += float(work.mean())
            d["tail"] += float(e[busy].max() - np.median(e[busy]))
            d["phases"] += 1
        if prev_end is not None:
            d["incr"] += float(e.max() - prev_end)
            d["handoff"] += float(w[busy].min() - prev_end) if busy.any() else 0.0
        prev_end = float(e.max())
    timeline = []  # layer 1 (or 0): per phase, µs from the step's start
    pick = 1 if int(rows[:, 2].max()) >= 1 else 0
    for t, layer, r in phases(rows):
        if layer == pick and t not in (EMBED, LM_HEAD):
            s, w, e = ((r[:, 5 + j] - t0) / 1e3 for j in range(3))
            real = ~((r[:, 1] == 2) & (e - s < 0.05))
            timeline.append((TYPES[t], int(real.sum()), float(w[real].min()), float(np.median(w[real])),
                             float(np.median(e[real])), float(e.max())))
    span = (end.max() - t0) / 1e3
    grid = int(rows[:, 0].max()) + 1
    work_all = float(((end - waited) / 1e3).sum())
    # how much of the span has fewer than 10% of the blocks working (serial phases): a 0.1 µs grid of the step
    ts = np.arange(0.0, span, 0.1)
    delta = np.zeros(len(ts) + 1)
    np.add.at(delta, np.searchsorted(ts, (waited - t0) / 1e3), 1)
    np.add.at(delta, np.searchsorted(ts, (end - t0) / 1e3), -1)
    active = np.cumsum(delta)[:-1]
    return {"span": span, "grid": grid, "busy": work_all / (grid * span), "serial": float((active < 0.1 * grid).mean()),
            "types": {k: dict(v) for k, v in st.items()}, "timeline": timeline}


def main() -> None:
    reps = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--reps=")), 3)
    out = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--out=")), None)
    eng, shape, dtype, ctx, spec = engine_from_argv(trace=True, decode_path=_core.DecodePath.Persistent)
    grid, coresident = eng.persistent_grid
    results = [analyse(np.asarray(eng.persistent_trace_step(ctx))) for _ in range(reps)]
    mean = lambda f: float(np.mean([f(r) for r in results]))  # noqa: E731
    print(f"{shape} {dtype} ctx {ctx} {spec}: persistent step, grid {grid} of {coresident} co-resident, "
          f"{reps} traced steps")
    print(f"span {mean(lambda r: r['span']):.1f} µs; blocks busy {100 * mean(lambda r: r['busy']):.0f}% of it; "
          f"< 10% of blocks working {100 * mean(lambda r: r['serial']):.0f}% of it")
    print(f"{'type':>12} {'tasks':>6} {'idle':>5} {'incr':>8} {'handoff':>8} {'work/task':>9} {'max':>7} "
          f"{'stage':>6} {'tail':>7} {'wait blk-µs':>11} {'work blk-µs':>11}")
    table = {}
    for name in TYPES:
        if name not in results[0]["types"]:
            continue
        g = lambda k: mean(lambda r: r["types"][name].get(k, 0.0))  # noqa: E731
        n_ph = max(g("phases"), 1.0)
        row = {k: g(k) for k in ("tasks", "idle", "incr", "handoff", "tail", "wait", "work", "work_max")}
        row["work_per_task"] = g("work_mean_sum") / n_ph
        row["work_max_mean"] = g("work_max_sum") / n_ph
        row["stage_per_task"] = g("stage_sum") / n_ph
        table[name] = row
        print(f"{name:>12} {row['tasks']:>6.0f} {row['idle']:>5.0f} {row['incr']:>8.1f} {row['handoff']:>8.1f} "
              f"{row['work_per_task']:>9.2f} {row['work_max_mean']:>7.2f} {row['stage_per_task']:>6.2f} "
              f"{row['tail']:>7.1f} {row['wait']:>11.0f} "
              f"{row['work']:>11.0f}")
    print("(incr, handoff, tail: µs summed over the layers; work/task, max, stage: µs per task, mean over the "
          "layers)")
    print("one layer of the last traced step (µs from the step's start): tasks working, first past its wait, "
          "median past its wait, median end, last end")
    for name, n, w0, wm, em, e1 in results[-1]["timeline"]:
        print(f"  {name:>12} {n:>5d} {w0:9.2f} {wm:9.2f} {em:9.2f} {e1:9.2f}")
    if out:
        with open(out, "w") as f:
            json.dump({"shape": shape, "dtype": dtype, "context": ctx, "opts": spec, "grid": grid,
                       "coresident": coresident, "span_us": mean(lambda r: r["span"]),
                       "busy": mean(lambda r: r["busy"]), "serial": mean(lambda r: r["serial"]), "types": table},
                      f, indent=1)


if __name__ == "__main__":
    main()
