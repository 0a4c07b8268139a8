"""The DRAM's activity across one graph-replayed decode step: Nsight Compute's PM sampling (a hardware-counter time
series over the whole graph, kernel boundaries and PDL overlap included), folded over the layers. The trace build
(trace_decode.py) says when each kernel's blocks ran; this says whether the DRAM streamed meanwhile.
    ncu --clock-control none --graph-profiling graph --profile-from-start off -c 1 --section PmSampling \\
        --pm-sampling-interval 1000 -f -o /tmp/step python3 bench/tools/pm_timeline.py run tinyllama-1.1b fp16 16
    ncu --clock-control none --profile-from-start off -c 1 --section PmSampling --pm-sampling-interval 1000 \\
        -f -o /tmp/bw python3 bench/tools/pm_timeline.py bandwidth          # the reference: a pure stream
    python3 bench/tools/pm_timeline.py dump /tmp/step.ncu-rep > step.json  # needs ncu's extras/python
    python3 bench/tools/pm_timeline.py show step.json [--layers=22] [--head-us=36]
`run` and `bandwidth` do their work between cudaProfilerStart and cudaProfilerStop, so that ncu sees only it."""

import glob
import json
import os
import shutil
import sys

import numpy as np


def _profiler(on: bool) -> None:
    import torch  # its cudart (the engine shares the primary context), as profile_decode.py uses its profiler

    torch.cuda.init()
    torch.cuda.synchronize()
    (torch.cuda.profiler.start if on else torch.cuda.profiler.stop)()


def run() -> None:
    from common import engine_from_argv

    eng, shape, dtype, ctx, spec = engine_from_argv()
    ms = eng.time_decode_step(ctx, 50)  # (warm: the graph captured, the clocks up)
    print(f"{shape} {dtype} ctx {ctx} {spec}: {ms * 1e3:.1f} us/step before profiling", file=sys.stderr)
    _profiler(True)
    eng.time_decode_step(ctx, 2)
    _profiler(False)


def bandwidth() -> None:
    from tinyinfer import _core

    _core.ops.read_bandwidth(1 << 30, 2)  # warm
    _profiler(True)
    _core.ops.read_bandwidth(1 << 30, 1)
    _profiler(False)


def _ncu_report():
    ncu = shutil.which("ncu")
    roots = [os.path.dirname(os.path.realpath(ncu))] if ncu else []
    roots += sorted(glob.glob("/opt/nvidia/nsight-compute/*"))
    for r in roots:
        p = os.path.join(r, "extras", "python")
        if os.path.exists(os.path.join(p, "ncu_report.py")):
            sys.path.insert(0, p)
            import ncu_report

            return ncu_report
    raise SystemExit("ncu_report (Nsight Compute's extras/python) not found")


def _values(m, n: int) -> list:
    out = []
    for i in range(n):
        try:
            out.append(m.as_double(i))
        except Exception:  # (a string-valued instance)
            out.append(None)
    return out


def dump(path: str) -> None:
    """Every metric of every profiled workload: scalars as numbers, instanced ones (the PM series) as lists with
    their correlation ids (the samples' timestamps)."""
    rep = _ncu_report().load_report(path)
    res = []
    for r in range(rep.num_ranges()):
        rng = rep.range_by_idx(r)
        for a in range(rng.num_actions()):
            act = rng.action_by_idx(a)
            entry = {"name": act.name(), "scalars": {}, "series": {}}
            for name in act.metric_names():
                m = act.metric_by_name(name)
                n = m.num_instances()
                if n <= 1:
                    try:
                        entry["scalars"][name] = m.as_double()
                    except Exception:
                        entry["scalars"][name] = str(m.as_string()) if hasattr(m, "as_string") else None
                    continue
                s = {"values": _values(m, n)}
                if m.has_correlation_ids():
                    c = m.correlation_ids()
                    s["corr"] = _values(c, c.num_instances())
                entry["series"][name] = s
            res.append(entry)
    json.dump(res, sys.stdout)


def _series(entry: dict, want: str):
    """(name, µs from the first sample, values) of the first series whose name holds `want`."""
    for name, s in entry["series"].items():
        if want in name and "corr" in s and any(v is not None for v in s["values"]):
            v = np.array([x if x is not None else np.nan for x in s["values"]], dtype=np.float64)
            t = np.array(s["corr"], dtype=np.float64)
            keep = t > 0  # (the first sample carries no timestamp)
            return name, (t[keep] - t[keep][0]) / 1e3, np.nan_to_num(v[keep])
    return None, None, None


def _fold(t: np.ndarray, v: np.ndarray, P: float, nb: int):
    """(each sample's phase bin, the mean of each of nb bins) with the series folded at period P."""
    bins = np.minimum(((t % P) / P * nb).astype(int), nb - 1)
    return bins, np.bincount(bins, v, nb) / np.maximum(np.bincount(bins, None, nb), 1)


def _period(t: np.ndarray, v: np.ndarray, guess: float) -> float:
    """The layer's period: the fold over candidate periods near `guess` with the least within-phase variance."""
    best = (np.inf, guess)
    for P in np.arange(0.6 * guess, 1.4 * guess, 0.01):
        bins, mean = _fold(t, v, P, 16)
        var = np.mean((v - mean[bins]) ** 2)
        if var < best[0]:
            best = (var, P)
    return best[1]


STREAM_PCT = 97.5  # what a pure stream (cuda/bandwidth.cu's kernel) reads as, in the same series, on the H200


def analyze(entry: dict, layers: int = 22, head_us: float = 36.0):
    """One profiled step's DRAM read series -> dict: samples, spacing and span (µs), mean %, the layers' part (all
    but the last head_us: the LM head and the sampler) as its mean % and its DRAM idle-equivalent (µs the DRAM
    would not have needed at STREAM_PCT), the layer period found by folding, and the folded layer (24 bins from
    its quietest one). None where the entry has no DRAM series."""
    name, t, v = _series(entry, "dramc__read_throughput")
    if name is None:
        return None
    act = np.nonzero(v > 2.0)[0]
    t, v = t[act[0]:act[-1] + 1] - t[act[0]], v[act[0]:act[-1] + 1]
    dt = float(np.median(np.diff(t)))
    span = float(t[-1] + dt)
    body = t < span - head_us
    P = _period(t[body], v[body], (span - head_us) / layers)
    _, fold = _fold(t[body], v[body], P, 24)
    return {
        "series": name, "samples": len(v), "spacing_us": dt, "span_us": span, "mean_pct": float(v.mean()),
        "layers_mean_pct": float(v[body].mean()), "head_mean_pct": float(v[~body].mean()) if (~body).any() else 0.0,
        "idle_us": float((1 - v[body] / STREAM_PCT).clip(0).sum() * dt), "period_us": float(P),
        "fold": np.roll(fold, -int(np.argmin(fold))).tolist(), "values": v,
    }


def show(path: str) -> None:
    """The step's DRAM read throughput (% of peak sustained), per profiled workload in the dump: --layers=N
    (default 22), --head-us=T (the LM head and the sampler at the end, default 36)."""
    layers = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--layers=")), "22"))
    head = float(next((a.split("=")[1] for a in sys.argv if a.startswith("--head-us=")), "36"))
    for e in json.load(open(path)):
        a = analyze(e, layers, head)
        if a is None:
            print(f"== {e['name']}: no DRAM series ({', '.join(sorted(e['series'])[:5])} ...)")
            continue
        v = a["values"]
        print(f"== {e['name']}: {a['series']}\n   {a['samples']} samples {a['spacing_us']:.2f} µs apart over "
              f"{a['span_us']:.0f} µs; mean {a['mean_pct']:.1f}%")
        print(f"   before the last {head:.0f} µs: mean {a['layers_mean_pct']:.1f}%, DRAM idle-equivalent "
              f"{a['idle_us']:.0f} µs ({a['idle_us'] / layers:.1f} a layer); the last {head:.0f} µs: mean "
              f"{a['head_mean_pct']:.1f}%")
        w = max(1, len(v) // 120)
        strip = "".join(" .:-=+*#%@"[min(9, int(np.mean(v[i:i + w]) / 10))] for i in range(0, len(v), w))
        print(f"   the step ({w} samples a character; ' .:-=+*#%@' = 0-100%):\n   {strip}")
        print(f"   one layer folded (period {a['period_us']:.2f} µs, 24 bins of {a['period_us'] / 24:.2f} µs): " +
              " ".join(f"{x:.0f}" for x in a["fold"]))


def main() -> None:
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "run":
        sys.argv = sys.argv[:1] + sys.argv[2:]
        run()
    elif cmd == "bandwidth":
        bandwidth()
    elif cmd == "dump":
        dump(sys.argv[2])
    elif cmd == "show":
        show(sys.argv[2])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
