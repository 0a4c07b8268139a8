"""Where the time of a decode step goes inside each kernel: per-block global-timer stamps (CudaOptions.trace;
common.cuh, trace_point) at a kernel's start, after its PDL wait, after its prologue (GEMV: input staged;
attention: new token read and written), and at its end, for one graph-replayed step.
    python3 bench/tools/trace_decode.py tinyllama-1.1b int4 [context] [--opts=...] [--timeline] [--sm]
Per kernel kind (averaged over the layers), in µs:
  gap      previous kernel's last block end -> this kernel's median block passing its wait (the boundary)
  prologue median wait -> median prologue end
  body     median prologue end -> median block end
  tail     median block end -> last block end (load imbalance / stragglers)
  incr     last block end - previous kernel's last block end (the step's critical path; sums to the step)
  first    GEMVs: median prologue end -> median end of the first tile's first dot products (thread 0's: how long
           after its input was staged a block still waited for the weights it had asked for first)
--sm: where the late blocks ran. Per kernel kind, each block's lateness (its end - the kernel's median end), by the
SM it ran on (the trace's fifth word), over the layers and traced steps: whether the same SMs end late every time
(a place: SMs that share their GPC or TPC with more blocks) or the late ones move (the DRAM's spread), and whether
blocks sharing an SM with another of the same kernel end later than those alone."""

import sys
from collections import defaultdict

import numpy as np

from common import engine_from_argv


def main() -> None:
    eng, shape, dtype, ctx, spec = engine_from_argv(trace=True)
    reps = [eng.trace_step(ctx) for _ in range(5)]
    stats = defaultdict(lambda: defaultdict(list))
    for trace in reps:
        kernels = []
        for name, flat in trace:
            a = np.array(flat, dtype=np.float64).reshape(-1, 6)  # 5 stamps (ns), then the block's SM
            ran = (a[:, 0] > 0) & (a[:, 3] > 0)  # blocks that ran to the end (early exits leave zeros)
            kernels.append((name, a[ran, :5], a[ran, 5].astype(int), np.flatnonzero(ran)))
        t0 = min(a[:, 0].min() for _, a, _, _ in kernels)
        prev_end = None
        timeline = []
        for i, (name, a, sm, block) in enumerate(kernels):
            s = (a - t0) / 1e3  # µs from the step's first traced block
            med = np.median(s, axis=0)
            end = s[:, 3].max()
            if prev_end is not None:
                st = stats[name]
                st["gap"].append(med[1] - prev_end)
                st["prologue"].append(med[2] - med[1])
                st["body"].append(med[3] - med[2])
                st["tail"].append(end - med[3])
                st["incr"].append(end - prev_end)
                st["blocks"].append(len(a))
                st["wait_spread"].append(s[:, 1].max() - s[:, 1].min())
                if (a[:, 4] > 0).all():  # GEMVs: the first tile's first dot products (its first weights there)
                    st["first"].append(np.median(s[:, 4] - s[:, 2]))
                    early = s[:, 0] < prev_end  # resident before the previous kernel ended: asked for weights early
                    st["first_split"].append((early.mean(), s[early, 4] - s[early, 2], s[~early, 4] - s[~early, 2]))
            timeline.append((name, s[:, 0].min(), med[1], med[2], med[3], end, len(a)))
            late = s[:, 3] - med[3]
            shared = np.bincount(sm)[sm] > 1  # another block of this kernel on the same SM
            stats[name]["by_sm"].append((sm, late, shared))
            stats[name]["by_start"].append((s[:, 0] - med[1], s[:, 1] - med[1], late))
            stats[name]["launches"].append((block, sm, shared, s - med[1], late))
            if i + 1 < len(kernels):  # the next kernel's blocks already on this block's SM before it ended (PDL)
                _, a2, sm2, _ = kernels[i + 1]
                early = np.array([np.sum((sm2 == sm[j]) & (a2[:, 0] < a[j, 3])) for j in range(len(a))])
                stats[name]["next_on_sm"].append((early, late))
            prev_end = end
    print(f"{shape} {dtype} ctx {ctx} {spec}: per kernel kind, mean over layers and {len(reps)} traced steps (µs)")
    print(f"{'kernel':>10} {'n':>3} {'blocks':>6} {'gap':>6} {'prologue':>8} {'body':>6} {'tail':>6} {'incr':>6} "
          f"{'wait spread':>11} {'first':>6}")
    total = 0.0
    for name, st in stats.items():
        n = len(st["incr"]) // len(reps)
        total += np.mean(st["incr"]) * n
        print(f"{name:>10} {n:>3} {np.mean(st['blocks']):>6.0f} {np.mean(st['gap']):>6.2f} {np.mean(st['prologue']):>8.2f} "
              f"{np.mean(st['body']):>6.2f} {np.mean(st['tail']):>6.2f} {np.mean(st['incr']):>6.2f} "
              f"{np.mean(st['wait_spread']):>11.2f} " + (f"{np.mean(st['first']):>6.2f}" if st["first"] else f"{'-':>6}"))
    print(f"sum of increments (first kernel excluded): {total:.1f} µs")
    print("first, by when the block started (median µs; early = before the previous kernel's last block ended):")
    for name, st in stats.items():
        if st["first_split"]:
            frac = np.mean([f for f, _, _ in st["first_split"]])
            e = np.concatenate([x for _, x, _ in st["first_split"]])
            lt = np.concatenate([x for _, _, x in st["first_split"]])
            print(f"{name:>10}: {100 * frac:3.0f}% early, first {np.median(e) if len(e) else float('nan'):.2f}; "
                  f"late {np.median(lt) if len(lt) else float('nan'):.2f}")
    print("GEMV picks (rows a warp / blocks a SM, 0 = a block per tile; GB/s as tuned alone): " + "  ".join(
        f"{g['name']} R{g['R']}/{g['blocks_per_sm']} {g['gb_per_s']:.0f}" for g in eng.gemv_table()))
    if "--sm" in sys.argv:
        print_by_sm(stats)
    if "--late" in sys.argv:
        print_late(stats)
    if "--timeline" in sys.argv:
        print("timeline of the last traced step, first 12 kernels (µs): first start, median wait, median prologue end, "
              "median end, last end, blocks")
        for row in timeline[:12]:
            print(f"  {row[0]:>10} " + " ".join(f"{v:8.2f}" for v in row[1:6]) + f" {row[6]:6d}")


def _per_sm_mean(launches: list, n_sm: int) -> np.ndarray:
    """Mean lateness per SM over `launches` [(sm, late, shared), ...]; NaN where no block ran."""
    total, count = np.zeros(n_sm), np.zeros(n_sm)
    for sm, late, _ in launches:
        np.add.at(total, sm, late)
        np.add.at(count, sm, 1)
    return np.divide(total, count, out=np.full(n_sm, np.nan), where=count > 0)


def print_by_sm(stats) -> None:
    print("where the late blocks ran (lateness = block end - the kernel's median end, µs; over layers and steps)")
    print(f"{'kernel':>10} {'p90 late':>8} {'max':>6} {'same SMs late':>13} {'shared SM / alone':>18} "
          f"{'late~start':>10} {'late~wait':>9} {'started late / in time':>22}  latest SMs (mean)")
    for name, st in stats.items():
        launches = st["by_sm"]
        sm = np.concatenate([x[0] for x in launches])
        late = np.concatenate([x[1] for x in launches])
        shared = np.concatenate([x[2] for x in launches])
        n_sm = int(sm.max()) + 1
        mean = _per_sm_mean(launches, n_sm)
        # the correlation of each SM's mean lateness in the even launches with that in the odd ones: near 1, the
        # same SMs end late every time (a place); near 0, the late ones move (the DRAM's spread)
        even, odd = _per_sm_mean(launches[0::2], n_sm), _per_sm_mean(launches[1::2], n_sm)
        ok = ~np.isnan(even) & ~np.isnan(odd)
        repeat = np.corrcoef(even[ok], odd[ok])[0, 1] if ok.sum() > 2 else float("nan")
        sh = f"{late[shared].mean():.2f} / {late[~shared].mean():.2f}" if shared.any() and (~shared).any() else "-"
        # whether a late end is a late start: blocks made resident only as the previous kernel's blocks left
        start = np.concatenate([x[0] for x in st["by_start"]])
        wait = np.concatenate([x[1] for x in st["by_start"]])
        c_start = np.corrcoef(start, late)[0, 1] if start.std() > 0 else float("nan")
        c_wait = np.corrcoef(wait, late)[0, 1] if wait.std() > 0 else float("nan")
        after = start > 0  # started after the median block passed its wait
        sl = f"{late[after].mean():.2f} / {late[~after].mean():.2f}" if after.any() and (~after).any() else "-"
        top = np.argsort(np.nan_to_num(mean, nan=-np.inf))[::-1][:6]
        print(f"{name:>10} {np.percentile(late, 90):>8.2f} {late.max():>6.2f} {repeat:>13.2f} {sh:>18} "
              f"{c_start:>10.2f} {c_wait:>9.2f} {sl:>22}  "
              + " ".join(f"{i}:{mean[i]:.1f}" for i in top))

def print_late(stats) -> None:
    """Who the stragglers are: per kernel kind, the lateness of each launch's 1st, 2nd, 5th and 10th latest block
    (one straggler or many), and the latest blocks of the first launches: block index, SM, whether another block
    of the kernel shares its SM, and its stamps (start, wait, prologue end, end) from the median wait."""
    print("the stragglers (µs; stamps from the kernel's median wait)")
    for name, st in stats.items():
        ranks = np.array([np.sort(x[4])[::-1][[0, 1, 4, 9]] for x in st["launches"] if len(x[4]) >= 10])
        if not len(ranks):
            continue
        print(f"{name:>10}: latest 1st / 2nd / 5th / 10th, mean over launches: "
              + " / ".join(f"{v:.2f}" for v in ranks.mean(axis=0)))
        # how many of the kernel's blocks each SM held, and how late the blocks were by that count
        hist, by_n = defaultdict(list), defaultdict(list)
        for block, sm, shared, rel, late in st["launches"]:
            n_on = np.bincount(sm)[sm]
            for n in range(1, n_on.max() + 1):
                hist[n].append((np.bincount(sm) == n).sum())
                by_n[n].extend(late[n_on == n])
        print("            SMs holding n blocks (mean a launch) and their blocks' mean lateness: " + "  ".join(
            f"n={n}: {np.mean(hist[n]):.1f} SMs {np.mean(by_n[n]) if by_n[n] else float('nan'):+.2f}" for n in sorted(hist)))
        if st["next_on_sm"]:
            early = np.concatenate([x[0] for x in st["next_on_sm"]])
            late = np.concatenate([x[1] for x in st["next_on_sm"]])
            print("            by the next kernel's blocks resident on the SM before the block ended: " + "  ".join(
                f"{n}: {np.mean(early == n) * 100:.0f}% of blocks, late {late[early == n].mean():+.2f}"
                for n in range(early.max() + 1) if (early == n).any()))
        for block, sm, shared, rel, late in st["launches"][1:4]:
            top = np.argsort(late)[::-1][:3]
            n_on = np.bincount(sm)[sm]
            print("            " + "   ".join(
                f"b{block[i]} sm{sm[i]}x{n_on[i]} late {late[i]:.2f} [" +
                " ".join(f"{v:.2f}" for v in rel[i][:4]) + "]" for i in top))


if __name__ == "__main__":
    main()
