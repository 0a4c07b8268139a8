"""Aggregate decode tok/s against batch size, one line per dtype, from `tinyinfer bench --batch ... --json`
files: python bench/tools/plot_batch.py OUT.png a.json b.json ... (matplotlib: pip install ".[bench]")."""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    title = ""
    for path in argv[1:]:
        with open(path) as f:
            r = json.load(f)
        xs = [b["batch"] for b in r["batches"]]
        ys = [b["tok_s"] for b in r["batches"]]
        ax.plot(xs, ys, marker="o", label=f"{r['dtype']} (batch 1 single path {r['single_tok_s']:,.0f} tok/s)")
        title = f"{r['model']} on {r.get('device_name', r['device'])}, prompt {r['prompt']} + {r['gen']} generated"
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences decoded together)")
    ax.set_ylabel("aggregate decode tok/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(argv[0], dpi=120)
    print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
