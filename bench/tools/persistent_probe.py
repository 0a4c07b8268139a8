"""The persistent decode step's micro-benchmarks (issue 16; cuda/persistent_probe.cu, docs/perf/persistent.md):
    python3 bench/tools/persistent_probe.py [--json=PATH] [--quick] [--only=handoff,ring,stream,cluster]
prints five tables (--only: those named) and writes every number (and the device) to PATH as JSON:
  1. hand-off latency: ns per hand-off of a chain across a persistent grid, all-to-all (every block reads the
     whole activation vector: the input of a GEMV), per KV head (4 groups) and one producer per consumer, for
     2,048 and 5,632 words, 1 and 2 blocks per SM, and the wait backoff ceiling; beside it the kernel boundary
     of a graph with PDL (cuda/bandwidth.cu's kernel chain) — what a hand-off replaces;
  2. the weight ring's steady-state bandwidth per copy variant, stages S and slot size B, against
     cuda/bandwidth.cu's read bandwidth;
  3. the stream with hand-offs every N bytes (the persistent step): GB/s with and without them, and the ns per
     hand-off the stream did not hide;
  4. the numbers docs/perf/persistent.md's time model takes (with 1-3);
  5. the hand-off inside a thread-block cluster (sm_90; cuda/cluster_probe.cu): ns per hand-off of a chain whose
     producers and consumers are one cluster's 2-16 blocks, the vector in distributed shared memory (between
     cluster barriers, or sent one way onto each receiver's mbarrier) or in global memory, against 1.'s kernel
     boundary and counter hand-off (docs/perf/persistent.md §22, §42).
Every kernel checks its result against the host (column `ok`); a configuration that cannot run on this GPU is
listed with the reason, and the run goes on."""

from __future__ import annotations

import json
import sys
import time

from tinyinfer import TinyInferError, _core

ops = _core.ops
QUICK = "--quick" in sys.argv
ONLY = set(next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--only=")),
                "handoff,ring,stream,cluster").split(","))
REPS = 3 if QUICK else 10


def _try(fn, *args):
    """fn(*args), or {'error': message} for a configuration this GPU refuses (the table says why)."""
    try:
        return fn(*args)
    except TinyInferError as e:
        return {"error": str(e)}


def handoffs(out: dict) -> None:
    print("\n1. hand-off latency (chain of hand-offs across a persistent grid; ns per hand-off)")
    print(f"{'words':>6} {'pattern':>16} {'blocks':>6} {'sleep':>6} {'ns/hand-off':>12} {'wait ns':>8} {'ok':>3}")
    rows = out["handoff"] = []
    stages = 64 if QUICK else 256
    for n_words in (2048, 5632):
        for bps in (1, 2):
            base = _try(ops.handoff_latency, n_words, 1, stages, bps, 0, REPS)
            blocks = base.get("blocks", 0)
            cases = [("all-to-all", 1, base), ("4 groups (kv)", 4, None)]
            if blocks:
                cases.append(("1 producer each", blocks, None))
            for name, groups, r in cases:
                r = r or _try(ops.handoff_latency, n_words, groups, stages, bps, 0, REPS)
                rows.append(dict(r, n_words=n_words, pattern=name, groups=groups, blocks_per_sm=bps, max_sleep_ns=0))
                _print_handoff(rows[-1])
    for sleep in (32, 128, 512):  # the backoff ceiling: latency against polling traffic
        r = _try(ops.handoff_latency, 2048, 1, stages, 1, sleep, REPS)
        rows.append(dict(r, n_words=2048, pattern="all-to-all", groups=1, blocks_per_sm=1, max_sleep_ns=sleep))
        _print_handoff(rows[-1])
    out["kernel_boundary_us"] = {str(b): ops.kernel_chain_us(200, b, True, False) for b in (132, 264)}
    print("kernel boundary in a graph with PDL (for comparison): " +
          ", ".join(f"{b} blocks {us * 1e3:.0f} ns" for b, us in out["kernel_boundary_us"].items()))


def _print_handoff(r: dict) -> None:
    if "error" in r:
        print(f"{r['n_words']:>6} {r['pattern']:>16}  -- {r['error']}")
        return
    print(f"{r['n_words']:>6} {r['pattern']:>16} {r['blocks']:>6} {r['max_sleep_ns']:>6} {r['ns_per_handoff']:>12.0f} "
          f"{r['wait_ns']:>8.0f} {'yes' if r['checksum_ok'] else 'NO':>3}")


def ring(out: dict, bw: float) -> dict:
    print(f"\n2. weight ring, steady state ({out['ring_bytes'] / 1e9:.1f} GB per pass; read bandwidth {bw:.0f} GB/s)")
    print(f"{'copy':>8} {'S':>3} {'B KiB':>6} {'blocks':>6} {'/SM':>4} {'GB/s':>8} {'% read':>7} {'ok':>3}")
    print("(one ring per block; the persistent kernel's grid: 1 or 2 blocks per SM)")
    rows = out["ring"] = []
    best = None
    copies = [("CpAsync", ops.RingCopy.CpAsync), ("Bulk", ops.RingCopy.Bulk)]
    sweep = [(name, copy, S, kib, 1) for name, copy in copies for S in (2, 3, 4, 6, 8) for kib in (8, 16, 32)]
    sweep += [(name, copy, S, 16, 2) for name, copy in copies for S in (2, 3, 4, 6)]  # two rings per SM
    for name, copy, S, kib, bps in sweep:
        r = _try(ops.ring_bandwidth, copy, S, kib, out["ring_bytes"], REPS, bps)
        rows.append(dict(r, copy=name, stages=S, slot_kib=kib, blocks_per_sm_asked=bps))
        if "error" in r:
            print(f"{name:>8} {S:>3} {kib:>6} {'':>6} {bps:>4}  -- {r['error'].split(': ', 1)[-1]}")
            continue
        print(f"{name:>8} {S:>3} {kib:>6} {r['blocks']:>6} {r['blocks_per_sm']:>4} {r['gb_per_s']:>8.0f} "
              f"{100 * r['gb_per_s'] / bw:>6.1f}% {'yes' if r['checksum_ok'] else 'NO':>3}")
        if r["checksum_ok"] and (best is None or r["gb_per_s"] > best["gb_per_s"]):
            best = rows[-1]
    return best


def stream_with_handoffs(out: dict, configs: list, bw: float) -> None:
    print("\n3. the stream with an all-to-all hand-off (2,048 words) every N bytes")
    print(f"{'copy':>8} {'S':>3} {'B KiB':>6} {'MB/hand-off':>11} {'hand-offs':>9} {'GB/s alone':>10} "
          f"{'GB/s with':>9} {'% read':>7} {'ns lost':>8} {'wait ns':>8} {'ok':>3}")
    rows = out["stream_handoff"] = []
    for name, S, kib, bps in configs:
        copy = getattr(ops.RingCopy, name)
        seen = set()  # a hand-off moves >= one slot per block: small sizes asked may round up to the same run
        for mb in (0.25, 0.5, 1, 2, 4, 8, 16):
            r = _try(ops.stream_handoff, copy, S, kib, out["ring_bytes"], mb * 1e6, 2048, 0, max(REPS // 2, 2), bps)
            if "error" not in r:
                if r["bytes_per_handoff"] in seen:
                    continue
                seen.add(r["bytes_per_handoff"])
            rows.append(dict(r, copy=name, stages=S, slot_kib=kib, blocks_per_sm=bps, mb_per_handoff_asked=mb))
            if "error" in r:
                print(f"{name:>8} {S:>3} {kib:>6} {mb:>11}  -- {r['error']}")
                continue
            print(f"{name:>8} {S:>3} {kib:>6} {r['bytes_per_handoff'] / 1e6:>11.2f} {r['handoffs']:>9} "
                  f"{r['gb_per_s_alone']:>10.0f} {r['gb_per_s_with']:>9.0f} {100 * r['gb_per_s_with'] / bw:>6.1f}% "
                  f"{r['ns_lost_per_handoff']:>8.0f} {r['wait_ns']:>8.0f} {'yes' if r['checksum_ok'] else 'NO':>3}")


def clusters(out: dict) -> None:
    print("\n5. hand-off inside a thread-block cluster (ns per hand-off; every block reads the whole vector)")
    print(f"{'words':>6} {'where':>7} {'cluster':>7} {'grid':>5} {'clusters':>8} {'ns/hand-off':>12} {'ok':>3}")
    rows = out["cluster_handoff"] = []
    stages = 64 if QUICK else 256
    # (words, where): the barrier alone with its release / acquire and with a relaxed arrive, then the vector in
    # distributed shared memory or in global memory, between barriers, or one way (st.async onto each receiver's
    # mbarrier, no barrier)
    cases = [(0, "barrier"), (0, "relaxed")] + [(n, w) for n in (64, 576, 2048, 5632)
                                                 for w in ("one-way", "dsmem", "global")]
    sms = ops.sm_count()
    for n_words, where in cases:
        for size in (2, 4, 8, 16):
            # as many clusters as fit (several blocks a SM), then about one block a SM (the latency alone)
            for most in (0, sms // size):
                r = _try(ops.cluster_handoff_latency, n_words, size, where != "global", stages, REPS,
                         where == "relaxed", where == "one-way", most)
                rows.append(dict(r, n_words=n_words, where=where, cluster=size, max_clusters=most))
                grid = "1/SM" if most else "fit"
                if "error" in r:
                    print(f"{n_words:>6} {where:>7} {size:>7} {grid:>5}  -- {r['error'].split(': ', 1)[-1]}")
                    continue
                print(f"{n_words:>6} {where:>7} {size:>7} {grid:>5} {r['clusters']:>8} {r['ns_per_handoff']:>12.0f} "
                      f"{'yes' if r['checksum_ok'] else 'NO':>3}")


def model_inputs(out: dict, bw: float) -> None:
    """The numbers docs/perf/persistent.md's time model takes, picked from the tables above."""
    h = [r for r in out["handoff"] if "error" not in r and r["max_sleep_ns"] == 0 and r["blocks_per_sm"] == 1]
    pick = lambda words, pattern: next((r["ns_per_handoff"] for r in h if r["n_words"] == words and r["pattern"] == pattern), None)
    best = out.get("ring_best") or {}
    s = [r for r in out["stream_handoff"] if "error" not in r and r["checksum_ok"]]
    m = {
        "read_bandwidth_gb_s": bw,
        "ring_gb_s": best.get("gb_per_s"),
        "ring_config": {k: best.get(k) for k in ("copy", "stages", "slot_kib", "blocks")},
        "handoff_ns_all_to_all_2048": pick(2048, "all-to-all"),
        "handoff_ns_all_to_all_5632": pick(5632, "all-to-all"),
        "handoff_ns_per_group_2048": pick(2048, "4 groups (kv)"),
        "handoff_ns_one_producer_2048": pick(2048, "1 producer each"),
        "ns_lost_per_handoff_by_mb": {f"{r['bytes_per_handoff'] / 1e6:.2f}": r["ns_lost_per_handoff"] for r in s
                                      if (r["copy"], r["stages"], r["slot_kib"], r["blocks_per_sm"]) ==
                                      (best.get("copy"), best.get("stages"), best.get("slot_kib"), best.get("blocks_per_sm_asked"))},
    }
    out["model_inputs"] = m
    print("\n4. time-model inputs (docs/perf/persistent.md)")
    for k, v in m.items():
        print(f"  {k}: {json.dumps(v) if isinstance(v, dict) else (f'{v:.0f}' if isinstance(v, float) else v)}")


def main() -> None:
    path = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--json=")), "persistent_probe.json")
    status = ops.device_status()
    if not status.get("usable"):
        raise SystemExit(f"persistent_probe needs a usable GPU: {status.get('reason')}")
    out = {"device": status, "quick": QUICK, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "ring_bytes": (1 << 30) if QUICK else (1 << 31)}
    bw = ops.read_bandwidth(1 << 31, 20)["gb_per_s"]
    out["read_bandwidth_gb_s"] = bw
    print(f"{status['name']} (sm_{status['compute_capability'].replace('.', '')}): read bandwidth {bw:.0f} GB/s")
    try:
        if "handoff" in ONLY:
            handoffs(out)
        if "ring" in ONLY:
            out["ring_best"] = ring(out, bw)
        if "stream" in ONLY:
            # the default ring, its cp.async twin, and small slots (a hand-off moves >= one slot per block: 2 KiB
            # slots reach the SmolLM2 phases' 0.3-1 MB)
            configs = [("Bulk", 4, 16, 1), ("CpAsync", 4, 16, 1), ("Bulk", 8, 2, 1)]
            best = out.get("ring_best")
            if best:
                b = (best["copy"], best["stages"], best["slot_kib"], best["blocks_per_sm_asked"])
                configs = [b] + [c for c in configs if c != b]
            stream_with_handoffs(out, configs, bw)
        if {"handoff", "ring", "stream"} <= ONLY:
            model_inputs(out, bw)
        if "cluster" in ONLY:
            clusters(out)
    finally:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
