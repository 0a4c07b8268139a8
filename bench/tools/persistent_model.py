"""The persistent decode step's time model (docs/perf/persistent.md) as code: predicted tok/s per shape, format and
schedule, from the hand-off latency and ring bandwidth — the throwaway probe's numbers by default (persistent.md
§1), the micro-benchmark's own with --probe.
    python3 bench/tools/persistent_model.py [--probe=persistent_probe.json] [--ring=S,KiB,blocks_per_sm]
A phase i of a layer streams b_i bytes and can start computing only after a dependency bubble d_i (hand-off
latency + prologue / attention compute). During the bubble each block's ring holds up to H of stream time of the
phase's weights (H = (S-1) B G / BW), so
    t_i = b_i / BW + max(0, d_i - min(H, b_i / BW))
    t_step = L * sum_i t_i + LM-head phase + sampling + step launch."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace

from tinyinfer.bench import SHAPES, bytes_per_token, matrix_bytes, shape_config


@dataclass(frozen=True)
class Inputs:
    """Every latency in µs. Defaults: the throwaway probe (docs/perf/persistent.md §1) and the decode traces
    (docs/perf/*) — placeholders, to be replaced by bench/tools/persistent_probe.py's numbers (--probe)."""
    read_bw_gb_s: float = 4620.0      # cuda/bandwidth.cu on the H200
    ring_efficiency: float = 0.92     # ring GB/s / read GB/s (placeholder: the best GEMVs' 90-92%)
    handoff_2048: float = 1.26        # all-to-all hand-off, 2,048 floats, 16-byte loads
    handoff_5632: float = 1.70        # the same, 5,632 floats
    barrier: float = 0.93             # a bare all-to-all counter barrier: the floor of any hand-off
    handoff_head: float = 0.93        # one producer group per consumer (placeholder: the barrier's number)
    prologue: float = 0.5             # RMSNorm statistics + staging the input in shared memory, after the data
    attention: float = 1.5            # attention compute on the critical path at short context (trace: 2.3 body)
    sampling: float = 1.0             # argmax / sampling compute after the head's partial maxima
    step_launch: float = 2.0          # from one step's end to the next step's first task (a launch, or a loop)
    ring_stages: int = 4
    ring_slot_kib: int = 16
    ring_blocks: int = 132            # blocks streaming, a ring each (1 per SM)

    @property
    def bw(self) -> float:  # bytes per µs
        return self.read_bw_gb_s * self.ring_efficiency * 1e3

    @property
    def hide(self) -> float:  # µs of stream a ring holds ahead
        return (self.ring_stages - 1) * self.ring_slot_kib * 1024 * self.ring_blocks / self.bw

    def handoff(self, words: int) -> float:
        """All-to-all hand-off of a vector of `words` floats: linear in the words read (two measured sizes),
        never below the bare barrier."""
        slope = (self.handoff_5632 - self.handoff_2048) / (5632 - 2048)
        return max(self.barrier, self.handoff_2048 + slope * (words - 2048))


def from_probe(path: str, base: Inputs) -> Inputs:
    m = json.load(open(path))["model_inputs"]
    ring = m.get("ring_config") or {}
    fields = dict(read_bw_gb_s=m["read_bandwidth_gb_s"])
    if m.get("ring_gb_s"):
        fields["ring_efficiency"] = m["ring_gb_s"] / m["read_bandwidth_gb_s"]
    for k, key in (("handoff_2048", "handoff_ns_all_to_all_2048"), ("handoff_5632", "handoff_ns_all_to_all_5632"),
                   ("handoff_head", "handoff_ns_one_producer_2048")):
        if m.get(key):
            fields[k] = m[key] / 1e3
    if "handoff_2048" in fields:  # the bare barrier's floor cannot sit above a measured hand-off
        fields["barrier"] = min(base.barrier, fields["handoff_2048"])
    if ring.get("stages"):
        fields.update(ring_stages=ring["stages"], ring_slot_kib=ring["slot_kib"], ring_blocks=ring["blocks"])
    return replace(base, **fields)


def phases(shape: str, fmt: str, ctx: int, schedule: str, x: Inputs) -> list:
    """[(name, bytes, bubble µs)] of one layer."""
    c = shape_config(shape)
    mb = lambda rows, K: matrix_bytes(fmt, rows, K)
    qkv, o = mb(c.q_dim + 2 * c.kv_dim, c.hidden), mb(c.hidden, c.q_dim)
    gu, down = mb(2 * c.intermediate, c.hidden), mb(c.hidden, c.intermediate)
    kv = 2 * c.kv_dim * 2 * ctx
    attn_bubble = x.handoff_head + x.attention + (x.handoff_head if ctx > 256 else 0)  # + the merge's hand-off
    to_norm = x.handoff(c.hidden) + x.prologue  # the residual, complete, into an RMSNorm
    if schedule == "A":  # today's kernels as tasks: 4 all-to-all hand-offs and one per head
        return [("qkv", qkv, to_norm), ("attention", kv, attn_bubble),
                ("o", o, x.handoff(c.q_dim) + x.prologue), ("gate_up", gu, to_norm),
                ("down", down, x.handoff(c.intermediate) + x.prologue)]
    # B: attention + O and gate_up + down fused as split-K partial sums into the fp32 residual
    return [("qkv", qkv, to_norm), ("attention+o", kv + o, attn_bubble), ("gate_up+down", gu + down, to_norm)]


def phase_us(b: float, d: float, x: Inputs, hide: bool) -> float:
    stream = b / x.bw
    return stream + max(0.0, d - (min(x.hide, stream) if hide else 0.0))


def step_us(shape: str, fmt: str, ctx: int, schedule: str, x: Inputs, hide: bool = True) -> float:
    c = shape_config(shape)
    layer = sum(phase_us(b, d, x, hide) for _, b, d in phases(shape, fmt, ctx, schedule, x))
    head = matrix_bytes("int8" if fmt == "int4" else fmt, c.vocab, c.hidden)
    tail = phase_us(head, x.handoff(c.hidden) + x.prologue, x, hide) + x.handoff_head + x.sampling + x.step_launch
    return c.n_layers * layer + tail


TARGETS = [("tinyllama-1.1b", "fp16", 16, 1550), ("tinyllama-1.1b", "int8", 16, 2400),
           ("tinyllama-1.1b", "int4", 16, 3000), ("tinyllama-1.1b", "fp16", 4096, 1400),
           ("smollm2-360m", "fp16", 16, 2800), ("smollm2-135m", "fp16", 16, 3500),
           ("llama2-7b", "fp16", 16, 300), ("llama2-7b", "int8", 16, 550), ("llama2-7b", "int4", 16, 850)]
EXTRA = [("smollm2-135m", "int8", 16, None), ("smollm2-135m", "int4", 16, None), ("smollm2-360m", "int8", 16, None),
         ("smollm2-360m", "int4", 16, None)]


def table(x: Inputs, out=print) -> list:
    rows = []
    out(f"inputs: {x}\n  ring bandwidth {x.bw / 1e3:.0f} GB/s, ring hides {x.hide:.2f} µs; all-to-all hand-off "
        f"576/960/2048/4096/5632/11008 words: " + " / ".join(f"{x.handoff(w):.2f}" for w in (576, 960, 2048, 4096, 5632, 11008)) + " µs")
    out("\n| shape | format | ctx | bytes/token | stream µs | budget µs/layer | exposed µs/layer A / B | A: 5 phases | "
        "A, no overlap | B: 3 phases | B, no overlap | target | in reach (with overlap) |")
    out("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, fmt, ctx, target in TARGETS + EXTRA:
        c = shape_config(shape)
        total = bytes_per_token(c, ctx, fmt)["total"]
        stream = total / x.bw
        t = {(s, h): step_us(shape, fmt, ctx, s, x, h) for s in "AB" for h in (True, False)}
        tok = {k: 1e6 / v for k, v in t.items()}
        exposed = {s: sum(phase_us(b, d, x, True) - b / x.bw for _, b, d in phases(shape, fmt, ctx, s, x)) for s in "AB"}
        # X of QUANT-NOTES.md: what a layer may spend beyond streaming its bytes for the step to reach the target
        # (the tail's latencies counted in full)
        tail = x.handoff(c.hidden) + x.prologue + x.handoff_head + x.sampling + x.step_launch
        budget = (1e6 / target - stream - tail) / c.n_layers if target else None
        reach = "" if not target else ("A and B" if tok[("A", True)] >= target else "B only" if tok[("B", True)] >= target else "no")
        rows.append(dict(shape=shape, fmt=fmt, ctx=ctx, bytes=total, stream_us=stream, budget_us_per_layer=budget,
                         exposed_us_per_layer=exposed,
                         tok_s={f"{s}{'' if h else '_no_overlap'}": v for (s, h), v in tok.items()}, target=target))
        out(f"| {shape} | {fmt} | {ctx} | {total / 1e6:.0f} MB | {stream:.0f} | "
            f"{'' if budget is None else f'{budget:.1f}'} | {exposed['A']:.1f} / {exposed['B']:.1f} | {tok[('A', True)]:,.0f} | {tok[('A', False)]:,.0f} | "
            f"{tok[('B', True)]:,.0f} | {tok[('B', False)]:,.0f} | {'' if not target else f'{target:,}'} | {reach} |")
    return rows


def _scaled(x: Inputs, f: float) -> Inputs:
    return replace(x, handoff_2048=x.handoff_2048 * f, handoff_5632=x.handoff_5632 * f, barrier=x.barrier * f,
                   handoff_head=x.handoff_head * f)


def margins(x: Inputs, out=print) -> None:
    """Per target and schedule: the lowest ring efficiency (ring GB/s / read GB/s) that still reaches it, and how
    many times the placeholder hand-off latencies may grow before it is missed (0.05 steps)."""
    out("\n| shape | format | ctx | target | min ring efficiency A / B | max hand-off latency factor A / B |")
    out("|---|---|---|---|---|---|")
    for shape, fmt, ctx, target in TARGETS:
        eff, lat = {}, {}
        for s in "AB":
            ok = lambda y: 1e6 / step_us(shape, fmt, ctx, s, y) >= target
            eff[s] = next((f"{e / 100:.2f}" for e in range(50, 101) if ok(replace(x, ring_efficiency=e / 100))), "> 1")
            lat[s] = next((f"{(f - 1) / 20:.2f}" for f in range(1, 200) if not ok(_scaled(x, f / 20))), "> 10")
        out(f"| {shape} | {fmt} | {ctx} | {target:,} | {eff['A']} / {eff['B']} | {lat['A']} / {lat['B']} |")


def main() -> None:
    x = Inputs()
    probe = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--probe=")), None)
    if probe:
        x = from_probe(probe, x)
    ring = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--ring=")), None)
    if ring:
        S, kib, bps = (int(v) for v in ring.split(","))
        x = replace(x, ring_stages=S, ring_slot_kib=kib, ring_blocks=132 * bps)
    table(x)
    margins(x)


if __name__ == "__main__":
    main()
