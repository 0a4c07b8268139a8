"""Print the short table of a pytest-benchmark JSON (the extra_info each benchmark records)."""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    print(f"{'benchmark':48s} {'median':>12s}  extra")
    for b in data.get("benchmarks", []):
        extra = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in b["extra_info"].items())
        print(f"{b['name']:48s} {b['stats']['median'] * 1e3:9.3f} ms  {extra}")


if __name__ == "__main__":
    main(sys.argv[1])
