"""Time Engine(path, device="cuda") twice (the first load, then a second with the files in the page cache) and
print each load's split line and the peak growth of the process's anonymous memory (RssAnon) during it.
    python bench/tools/make_random_model.py llama2-7b /tmp/llama2-7b
    python bench/tools/load_time.py /tmp/llama2-7b [--dtype fp16|int8|int4] [--runs 2]
docs/perf/load.md has the time model these numbers are compared with."""

from __future__ import annotations

import argparse
import gc
import threading
import time

from tinyinfer import Engine


def rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def timed_load(path: str, dtype: str) -> tuple[float, float, str]:
    """(wall seconds of Engine(...), RssAnon peak growth in MiB, the engine's load line)."""
    base = peak = rss_anon_mib()
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_anon_mib())
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    try:
        eng = Engine(path, device="cuda", dtype=dtype, max_seq_len=4096, progress=False)
    finally:
        wall = time.perf_counter() - t0
        stop.set()
        th.join()
    line = eng.load_report
    eng.close()
    del eng
    gc.collect()
    return wall, peak - base, line


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "int8", "int4"))
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    for run in range(a.runs):
        wall, grew, line = timed_load(a.path, a.dtype)
        print(f"load {run + 1}: {wall:.2f} s wall, RssAnon peak +{grew:.0f} MiB | {line}", flush=True)


if __name__ == "__main__":
    main()
