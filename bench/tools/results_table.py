"""The decode rows of bench/results/README.md from the bench's JSON files, and each row against issue 16's target.

    python3 bench/tools/results_table.py bench/results/h200-*.json      # after `tinyinfer bench ... --json F`

One markdown row per file (shape, format, tok/s and % of the roofline at contexts 16 / 1,024 / 4,096, prefill of
512 tokens, the file), then per file: the read bandwidth of its run, the load's timed choices (trigger level,
carveout), and the target's tok/s against the measured one. Files that are not single-sequence decode benches
(batch, serve, probes) are skipped."""

from __future__ import annotations

import json
import os
import sys

SHAPES = {"tinyllama-1.1b": "TinyLlama-1.1B", "llama2-7b": "Llama-2-7B", "smollm2-360m": "SmolLM2-360M",
          "smollm2-135m": "SmolLM2-135M"}
# Issue 16's targets (H200, tok/s): (shape, format, context) -> tok/s
TARGETS = {("tinyllama-1.1b", "fp16", 16): 1550, ("tinyllama-1.1b", "int8", 16): 2400,
           ("tinyllama-1.1b", "int4", 16): 3000, ("tinyllama-1.1b", "fp16", 4096): 1400,
           ("smollm2-360m", "fp16", 16): 2800, ("smollm2-135m", "fp16", 16): 3500,
           ("llama2-7b", "fp16", 16): 300, ("llama2-7b", "int8", 16): 550, ("llama2-7b", "int4", 16): 850}
TRIGGERS = {0: "none", 1: "GEMVs", 2: "GEMVs + attention"}


def decode_cell(d: dict, ctx: int) -> str:
    row = next((r for r in d.get("decode", []) if r["context"] == ctx), None)
    return "—" if row is None else f"{row['tok_s']:,.0f} ({row['pct_roofline']:.1f}%)"


def prefill_cell(d: dict, tokens: int = 512) -> str:
    row = next((r for r in d.get("prefill", []) if r["tokens"] == tokens), None)
    return "—" if row is None else f"{row['ms']:.2f} ms ({row['tok_s'] / 1e3:.0f}k tok/s)"


def rows(paths: list[str]) -> tuple[list[str], list[str]]:
    """(the markdown rows, the notes: bandwidth, choices and targets per file)."""
    table, notes = [], []
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        if "decode" not in d or "model" not in d:
            continue
        shape, fmt, name = d["model"], d["dtype"], os.path.basename(path)
        table.append(f"| {SHAPES.get(shape, shape)} | {fmt} | {decode_cell(d, 16)} | {decode_cell(d, 1024)} | "
                     f"{decode_cell(d, 4096)} | {prefill_cell(d)} | `{name}` |")
        trig = d.get("early_trigger")
        choices = ("early triggers not recorded" if trig is None
                   else f"early triggers {TRIGGERS.get(int(trig), trig)}")
        carve = d.get("smem_carveout")
        choices += f", carveout {'driver' if carve is None or carve < 0 else f'{carve}%'}"
        against = []
        for (s, fm, ctx), target in sorted(TARGETS.items()):
            row = next((r for r in d["decode"] if r["context"] == ctx), None)
            if (s, fm) == (shape, fmt) and row is not None:
                tok = row["tok_s"]
                share = "met" if tok >= target else f"{tok / target:.0%}"
                against.append(f"ctx {ctx}: {tok:,.0f} / {target:,} ({share})")
        notes.append(f"{name}: read bandwidth {d.get('read_bandwidth_gb_s', 0):,.0f} GB/s; {choices}"
                     + ("; target " + ", ".join(against) if against else ""))
    return table, notes


def main(paths: list[str]) -> None:
    table, notes = rows(paths)
    print("| shape | format | ctx 16 | ctx 1,024 | ctx 4,096 | prefill 512 tokens | file |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(table))
    print()
    print("\n".join(notes))


if __name__ == "__main__":
    main(sys.argv[1:])
