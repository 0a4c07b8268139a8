"""Where the GPU waits: the device's idle time inside a window, from a torch.profiler (CUPTI) record of its kernels,
copies and memsets. Every gap between two device activities is charged to the activity that ends it (the one the
device was waiting to receive), so "before embed_rows_kernel" is the idle before each prefill / mixed pass began
and "before nvjet..." the idle inside a pass waiting for the host to issue the next product.

    from gpu_idle import record, report
    with record() as prof:
        ...                      # the workload (any thread; CUDA activity of the whole process is recorded)
    print(report(prof))

The profiler adds host time to every launch and copy: on the H200 a 64-client in-process level
(trace_scheduler.py) ran ~1.7x slower under it and the device idled 35-49% of it. So what it shows is where the
device waits when the host is slow — qualitative; the unprofiled periods (serve_timeline.py) are the figures.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager


@contextmanager
def record():
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield prof


def device_spans(prof) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every device activity, by start."""
    from torch.autograd import DeviceType

    out = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
           if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return sorted(out)


def idle_gaps(spans: list[tuple[float, float, str]]) -> list[tuple[float, str]]:
    """(idle µs, the name of the activity that ended it) for every gap between device activities."""
    gaps, busy_to = [], None
    for s, e, name in spans:
        if busy_to is not None and s > busy_to:
            gaps.append((s - busy_to, name))
        busy_to = e if busy_to is None else max(busy_to, e)
    return gaps


def report(prof, top: int = 12) -> str:
    spans = device_spans(prof)
    if not spans:
        return "gpu_idle: no device activity recorded"
    span = max(e for _, e, _ in spans) - spans[0][0]
    gaps = idle_gaps(spans)
    idle = sum(g for g, _ in gaps)
    lines = [f"device: {len(spans)} activities over {span / 1e3:.1f} ms: busy {(span - idle) / 1e3:.1f} ms, "
             f"idle {idle / 1e3:.1f} ms ({100 * idle / span:.1f}%) in {len(gaps)} gaps"]
    edges = (0, 5, 20, 100, 500, float("inf"))
    for lo, hi in zip(edges, edges[1:]):
        gs = [g for g, _ in gaps if lo <= g < hi]
        lines.append(f"  gaps {lo:>4}-{hi:<4} µs: {len(gs):7d}, {sum(gs) / 1e3:8.1f} ms")
    by = defaultdict(lambda: [0, 0.0])
    for g, name in gaps:
        by[name][0] += 1
        by[name][1] += g
    lines.append(f"  idle before ({top} largest):           gaps      ms   mean µs")
    for name, (n, s) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"    {name[:60]:60s} {n:7d} {s / 1e3:7.1f} {s / n:8.1f}")
    return "\n".join(lines)
