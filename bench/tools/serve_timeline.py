"""Where a serving round's time goes, from a `tinyinfer serve --trace` timeline (src/tinyinfer/trace.py).

    python bench/serve_bench.py --shape tinyllama-1.1b --device cuda --concurrency 8,64 --trace-dir /tmp/t
    python bench/tools/serve_timeline.py /tmp/t/serve.json [--level 64] [--json out.json]

Levels: serve_bench's marks (levels.json beside the trace; one clock, perf_counter = CLOCK_MONOTONIC); without
it the whole trace is one level. A level's requests are those submitted inside its marks; its rounds are those
requests in submit order, `concurrency` at a time (each client sends its next request when its last ends).
Per round:
  wall        first submit -> last end (the scheduler's; tok/s: the tokens generated over it);
  prefill     the seq_prefill_many, seq_mixed (a decode step and prompts in one pass) and seq_prefill calls:
              count, prompt tokens, ms;
  decode      per seq_step or seq_mixed (one decode step): period = its start -> the next one's start (also
              by kind: plain steps and mixed ones, when there are), split
              into the launch (seq_step; a seq_mixed's whole pass), other core calls before its seq_sample (prefill, open, close), host Python
              between, the seq_sample (waits for the step's device work, samples), and the gap from that
              seq_sample's end to the next launch (host time on the critical path when nothing is launched ahead);
              A call ends when the scheduler's thread has the GIL back: a wait for it (the event loop holding
              it) shows as a long launch or sample, not as host time;
  no core call  time with no core call running (the device possibly idle), split by whether any request of
              the level was in flight (submitted, not ended) — the latter is what the scheduler could have used;
  TTFT        per request, p50 / p99: submit -> admit (queue), admit -> prefilled (the call with its prompt's last
              chunk returned: on the GPU once launched), prefilled -> first token sampled (with overlap, after the
              next step's launch: on the CPU that is the whole step); HTTP: handler start -> submit, and first
              token -> the event loop has it (http_first);
  turnaround  the last end of round r -> the first submit of round r+1; and per request, the k-th end of round
              r -> the k-th submit of round r+1 (a client's own turnaround: HTTP out, the client, HTTP in);
  client      where serve_bench's levels.json has its clients' stamps (every HTTP call's id, sent, stream done,
              and that client's time from its previous stream's end to this send): sent -> the handler's start
              (the request on the wire, uvicorn and FastAPI before the handler, and the event loop's queue), the
              last chunk written -> the client done with the stream, and the client's own turnaround.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np


def _stats(x) -> dict:
    x = np.asarray(x, float) * 1e3
    if not len(x):
        return {"n": 0, "mean": None, "p50": None, "p99": None}
    return {"n": len(x), "mean": float(x.mean()), "p50": float(np.percentile(x, 50)),
            "p99": float(np.percentile(x, 99))}


def _merge(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _overlap(segs: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in segs)


def _requests(events: list) -> dict[str, dict]:
    """Scheduler request id -> {kind: t, "prompt", "tokens", "finish", and the HTTP call's http_* times}."""
    reqs: dict[str, dict] = defaultdict(dict)
    http: dict[str, dict] = defaultdict(dict)
    for kind, t, rid, a, b in events:
        if kind.startswith("http_"):
            http[rid][kind] = t
            continue
        r = reqs[rid]
        r.setdefault(kind, t)
        if kind == "submit":
            r["prompt"] = a
        elif kind == "end":
            r["tokens"], r["finish"] = a, b
    for rid, r in reqs.items():
        r["call"] = rid.rpartition("-")[0]  # "<call id>-<k>"
        r.update(http.get(r["call"], {}))
    return {rid: r for rid, r in reqs.items() if "submit" in r}


def _decode(calls: list, lo: float, hi: float) -> dict:
    """The decode steps launched in [lo, hi): each seq_step (or seq_mixed) with the first seq_sample that starts
    after it."""
    steps = [c for c in calls if c[0] in ("seq_step", "seq_mixed") and lo <= c[1] < hi]
    samples = [c for c in calls if c[0] == "seq_sample"]
    starts = [c[1] for c in samples]
    others = [c for c in calls if c[0] not in ("seq_step", "seq_mixed", "seq_sample")]
    parts = defaultdict(list)
    for i, st in enumerate(steps):
        j = bisect.bisect_left(starts, st[2])
        if j == len(samples):
            continue
        sa = samples[j]
        other = sum(c[2] - c[1] for c in others if st[2] <= c[1] < sa[1])
        # each part also by kind (a seq_mixed's pass against a plain step: where a mixed step's time goes)
        kind = "mixed" if st[0] == "seq_mixed" else "plain"

        def add(k: str, v: float) -> None:
            parts[k].append(v)
            parts[f"{k}, {kind}"].append(v)

        add("launch", st[2] - st[1])
        add("other core", other)
        add("host", sa[1] - st[2] - other)
        add("sample", sa[2] - sa[1])
        if st[0] == "seq_step":
            parts["rows"].append(st[3] / 1e3)  # (_stats scales by 1e3)
        if i + 1 < len(steps):
            add("period", steps[i + 1][1] - st[1])
            add("gap", steps[i + 1][1] - sa[2])
    return {k: _stats(v) for k, v in parts.items()} | {"steps": len(steps)}


def analyze_window(calls: list, reqs: list[dict], in_flight: list, lo: float, hi: float) -> dict:
    """One round (or level): its requests, and the core calls that started in [lo, hi]."""
    inside = [c for c in calls if lo <= c[1] <= hi]
    prefill = {name: {"calls": len(cs), "tokens": sum(c[3] for c in cs), "ms": 1e3 * sum(c[2] - c[1] for c in cs)}
               for name in ("seq_prefill_many", "seq_mixed", "seq_prefill") if (cs := [c for c in inside if c[0] == name])}
    busy = _merge((max(c[1], lo), min(c[2], hi)) for c in inside)
    gaps, t = [], lo
    for s, e in busy:
        if s > t:
            gaps.append((t, s))
        t = max(t, e)
    if t < hi:
        gaps.append((t, hi))
    idle = sum(e - s for s, e in gaps)
    idle_flight = sum(_overlap(in_flight, s, e) for s, e in gaps)

    def span(a: str, b: str) -> dict:
        return _stats([r[b] - r[a] for r in reqs if a in r and b in r])

    tokens = sum(r.get("tokens", 0) for r in reqs)
    return {"requests": len(reqs), "wall_ms": 1e3 * (hi - lo), "tokens": tokens,
            "tok_s": tokens / (hi - lo) if hi > lo else None,
            "submit_spread_ms": 1e3 * (max(r["submit"] for r in reqs) - min(r["submit"] for r in reqs)),
            "prefill": prefill, "decode": _decode(calls, lo, hi),
            "no_core_call_ms": {"total": 1e3 * idle, "requests in flight": 1e3 * idle_flight,
                                "none in flight": 1e3 * (idle - idle_flight)},
            "ttft_ms": {"queue (submit->admit)": span("submit", "admit"),
                        "prefill (admit->prefilled)": span("admit", "prefilled"),
                        "sample (prefilled->first)": span("prefilled", "first"),
                        "total (submit->first)": span("submit", "first"),
                        "http (handler start->submit)": span("http_start", "submit"),
                        "loop (first->http_first)": span("first", "http_first"),
                        "http end (end->http_end)": span("end", "http_end")}}


def analyze(trace: dict, levels: Optional[list[dict]], only: Optional[int] = None) -> list[dict]:
    calls = sorted((tuple(c) for c in trace["calls"]), key=lambda c: c[1])
    reqs = _requests(trace["events"])
    every = sorted(reqs.values(), key=lambda r: r["submit"])
    if not levels:
        t0 = min([r["submit"] for r in every] + [c[1] for c in calls[:1]])
        t1 = max([r.get("end", t0) for r in every] + [c[2] for c in calls[-1:]])
        levels = [{"concurrency": None, "t_start": t0, "t_end": t1}]
    out = []
    for lv in levels:
        if only is not None and lv["concurrency"] != only:
            continue
        mine = [r for r in every if lv["t_start"] <= r["submit"] <= lv["t_end"] and "end" in r]
        if not mine:
            continue
        in_flight = _merge((r["submit"], r["end"]) for r in mine)
        per = lv["concurrency"] or len(mine)
        rounds = [mine[i:i + per] for i in range(0, len(mine), per)]
        res = []
        for rs in rounds:
            lo, hi = min(r["submit"] for r in rs), max(r["end"] for r in rs)
            res.append(analyze_window(calls, rs, in_flight, lo, hi))
        for i in range(len(rounds) - 1):
            ends = sorted(r["end"] for r in rounds[i])
            submits = sorted(r["submit"] for r in rounds[i + 1])
            res[i]["turnaround_ms"] = 1e3 * (submits[0] - ends[-1])
            # a client's own turnaround (its last token -> its next request queued), its clients unknown: the
            # k-th end with the k-th next submit
            res[i]["turnaround_each_ms"] = _stats([s - e for s, e in zip(submits, ends)])
        lo, hi = mine[0]["submit"], max(r["end"] for r in mine)
        level = analyze_window(calls, mine, in_flight, lo, hi)
        if lv.get("requests"):
            level["client_ms"] = _client_side(lv["requests"], {r["call"]: r for r in mine if "call" in r})
        out.append({"concurrency": lv["concurrency"], "level": level, "rounds": res})
    return out


def _client_side(stamps: list, by_call: dict[str, dict]) -> dict:
    """serve_bench's per-request client stamps (call id, sent, stream done, the client's own turnaround before
    this send) joined with the server's events of the same HTTP call: where a request's turnaround goes."""
    sent_to_handler, end_to_done, turn, sent_to_submit, last_to_done = [], [], [], [], []
    for rid, sent, done, before in stamps:
        r = by_call.get(rid)
        if r is None:
            continue
        # (these two need no HTTP events: they hold with --api-workers too, whose workers record none)
        sent_to_submit.append(r["submit"] - sent)
        last_to_done.append(done - r["end"])
        if "http_start" in r:
            sent_to_handler.append(r["http_start"] - sent)
        if "http_end" in r:
            end_to_done.append(done - r["http_end"])
        if before is not None:
            turn.append(before)
    return {"client sent -> submitted": _stats(sent_to_submit),
            "request ended -> client done": _stats(last_to_done),
            "client sent -> handler start": _stats(sent_to_handler),
            "last chunk written -> client done": _stats(end_to_done),
            "client done -> its next send": _stats(turn)}


def _f(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def report(levels: list[dict], file=sys.stdout) -> None:
    def p(*a):
        print(*a, file=file)

    for lv in levels:
        p(f"== level {lv['concurrency'] or 'all'}: {lv['level']['requests']} requests, "
          f"{len(lv['rounds'])} round(s) ==")
        for name, w in [(f"round {i}", r) for i, r in enumerate(lv["rounds"])] + [("level", lv["level"])]:
            p(f"{name}: {w['requests']} requests, wall {w['wall_ms']:.1f} ms (first submit -> last end), "
              f"{w['tokens']} tokens, {w['tok_s'] or 0:,.0f} tok/s; submits spread over {w['submit_spread_ms']:.1f} ms"
              + (f"; turnaround to the next round {w['turnaround_ms']:.1f} ms (k-th end -> k-th next submit p50 "
                 f"{_f(w['turnaround_each_ms']['p50'])}, p99 {_f(w['turnaround_each_ms']['p99'])})"
                 if "turnaround_ms" in w else ""))
            for k, v in w["prefill"].items():
                p(f"  {k:17s} {v['calls']:5d} calls {v['tokens']:7d} tokens {v['ms']:9.1f} ms")
            d = w["decode"]
            p(f"  decode steps {d['steps']} (rows p50 {_f(d.get('rows', {}).get('p50'))})    "
              f"{'mean':>7} {'p50':>7} {'p99':>7} ms")
            mixed = bool(d.get("period, mixed", {}).get("n"))  # (by kind only when there are mixed steps)
            for k in [f"{k}{kind}" for k in ("period", "launch", "other core", "host", "sample", "gap")
                      for kind in ("", ", plain", ", mixed")[:3 if mixed else 1]]:
                s = d.get(k)
                if s and s["n"]:
                    p(f"    {k:24s} {_f(s['mean']):>7} {_f(s['p50']):>7} {_f(s['p99']):>7}")
            n = w["no_core_call_ms"]
            p(f"  no core call running   {n['total']:8.1f} ms: requests in flight {n['requests in flight']:.1f}, "
              f"none in flight {n['none in flight']:.1f}")
            p(f"  per request            {'p50':>7} {'p99':>7} ms")
            for k, s in list(w["ttft_ms"].items()) + list(w.get("client_ms", {}).items()):
                if s["n"]:
                    p(f"    {k:33s} {_f(s['p50']):>7} {_f(s['p99']):>7}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="the JSON `tinyinfer serve --trace` wrote")
    ap.add_argument("--levels", default=None, help="serve_bench's level marks (default: levels.json beside the trace)")
    ap.add_argument("--level", type=int, default=None, help="only the level of this many clients")
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    trace = json.loads(Path(a.trace).read_text())
    marks = Path(a.levels) if a.levels else Path(a.trace).with_name("levels.json")
    levels = json.loads(marks.read_text())["levels"] if marks.exists() else None
    out = analyze(trace, levels, a.level)
    if not out:
        print("serve_timeline: no finished request in the trace" + (f" at level {a.level}" if a.level else ""),
              file=sys.stderr)
        return 1
    report(out)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
