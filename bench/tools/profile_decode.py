"""Where a graph-replayed decode step spends its time, kernel by kernel (torch's CUPTI profiler sees the kernels
inside a CUDA graph). With PDL, kernels overlap, so a kernel's own duration includes its wait for the previous
one; the table therefore charges each kernel its *critical-path increment*: how far its end moves the step's
end past every earlier kernel's end. The increments of one step sum to the step's GPU time.
    python3 bench/tools/profile_decode.py tinyllama-1.1b int4 [context] [--opts=act8=1,early_trigger=2]
(--opts: CudaOptions, as bench/tools/ab_decode.py takes them; early_trigger, the PDL trigger points, is timed at
load unless given)"""

import re
from collections import defaultdict

from common import engine_from_argv


def short(name: str) -> str:
    name = re.sub(r"\(anonymous namespace\)::|ti::cuda::|void ", "", name)
    name = re.sub(r"\(ti::WFormat\)", "WF", name)
    name = re.sub(r"\(ti::cuda::Gemv(In|Out)\)", "", name)
    name = re.sub(r"\(ti::cuda::DecodeAttnParams\)|\(ti::cuda::GemvParams\)", "", name)
    return name[:90]


def main() -> None:
    eng, shape, dtype, ctx, spec = engine_from_argv()
    steps = 20
    ms = eng.time_decode_step(ctx, 200)
    print(f"{shape} {dtype} ctx {ctx} (early triggers {eng.early_trigger}) {spec}: {ms * 1e3:.1f} us/step = {1e3 / ms:,.0f} tok/s (graph replay, CUDA events)")
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.time_decode_step(ctx, steps)
    ev = [e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
          and "memset" not in e.name.lower()]
    ev.sort(key=lambda e: e.time_range.start)
    # the last `steps` decode steps: cut at the embedding kernel
    starts = [i for i, e in enumerate(ev) if "embed" in e.name]
    if len(starts) < 4:
        print("profiler saw no per-kernel records inside the graph:", len(ev), "events")
        return
    body = ev[starts[3]:starts[-1]]  # skip the warm-up steps; whole steps only
    nsteps = sum(1 for e in body if "embed" in e.name)
    incr, dur, cnt = defaultdict(float), defaultdict(float), defaultdict(int)
    end = body[0].time_range.start
    for e in body:
        n = short(e.name)
        incr[n] += max(0.0, e.time_range.end - end)
        dur[n] += e.time_range.end - e.time_range.start
        cnt[n] += 1
        end = max(end, e.time_range.end)
    span = body[-1].time_range.end - body[0].time_range.start
    print(f"{nsteps} steps, {span / nsteps:.1f} us/step under the profiler; per step:")
    print(f"{'kernel':90s} {'n':>4s} {'incr us':>8s} {'incr/n':>7s} {'dur/n':>7s}")
    for n in sorted(incr, key=lambda k: -incr[k]):
        print(f"{n:90s} {cnt[n] / nsteps:4.0f} {incr[n] / nsteps:8.1f} {incr[n] / cnt[n]:7.2f} {dur[n] / cnt[n]:7.2f}")
    # one layer of one step, as a timeline
    s0 = body[0].time_range.start
    print("timeline of the first 14 kernels of one step (start, end relative to the step's start, us):")
    for e in body[:14]:
        print(f"  {e.time_range.start - s0:8.2f} {e.time_range.end - s0:8.2f}  {short(e.name)}")


if __name__ == "__main__":
    main()
