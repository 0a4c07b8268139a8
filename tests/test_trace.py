"""The scheduler's timeline recorder (tinyinfer.trace) over the real CPU engine, and bench/tools/serve_timeline.py
on what it records. Names and order only: nothing timed."""

from __future__ import annotations

import io
import json

import pytest

from conftest import load_script, make_chat_llama
from tinyinfer import Engine, InvalidRequestError, SamplingParams, Scheduler
from tinyinfer.trace import CORE_CALLS, Trace


def _tool():
    return load_script("bench/tools/serve_timeline.py")


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = make_chat_llama(tmp_path_factory.mktemp("trace") / "m", init_std=0.3)
    with Engine(d, device="cpu", max_seq_len=256, threads=2) as e:
        yield e


def _two_rounds(eng, trace: Trace, clients: int = 3, cancel: bool = True) -> list:
    """`clients` requests, then `clients` more once those ended (two rounds); then one cancelled while waiting."""
    sched = Scheduler(eng, trace=trace, max_batch=clients, prefix_cache=0)  # (every prompt prefilled in full)
    try:
        out = []
        for r in range(2):
            reqs = [sched.submit("GPUs are fast " * (1 + i), SamplingParams(max_tokens=3 + i, ignore_eos=True))
                    for i in range(clients)]
            sched.wait_idle()
            out += [q.result() for q in reqs]
        if not cancel:
            return out
        late = sched.submit("one more", SamplingParams(max_tokens=2))
        late.cancel()  # still waiting: ended without a step
        assert late.result().finish_reason == "cancelled"
        return out
    finally:
        sched.close()


def test_the_recorder_sees_every_core_call_and_request_event(eng):
    want = [eng.generate("GPUs are fast " * (1 + i), SamplingParams(max_tokens=3 + i, ignore_eos=True))
            for i in range(3)]
    trace = Trace()
    got = _two_rounds(eng, trace)
    assert [c.token_ids for c in got] == [w.token_ids for w in want] * 2  # nothing changed by recording
    names = {c[0] for c in trace.calls}
    assert {"seq_open", "seq_prefill_many", "seq_step", "seq_sample", "seq_close"} <= names <= set(CORE_CALLS)
    assert all(t0 <= t1 for _, t0, t1, _ in trace.calls)
    rows = [n for name, _, _, n in trace.calls if name == "seq_sample"]
    assert max(rows) == 3 and min(rows) >= 1
    prompt = [n for name, _, _, n in trace.calls if name == "seq_prefill_many"]
    by_id: dict = {}
    for kind, t, rid, a, b in trace.events:
        by_id.setdefault(rid, []).append((kind, a, b))
    assert len(by_id) == 7
    ends = []
    for rid, evs in by_id.items():
        kinds = [k for k, _, _ in evs]
        if kinds == ["submit", "end"]:  # the one cancelled while waiting
            assert evs[1][1:] == (0, "cancelled")
            continue
        assert kinds == ["submit", "admit", "prefilled", "first", "end"], kinds
        ends.append(evs[-1][1])
        assert evs[-1][2] == "length"
    assert sorted(ends) == sorted([3, 4, 5] * 2)
    submitted = sum(a for evs in by_id.values() for k, a, _ in evs if k == "submit")
    assert sum(prompt) + sum(n for name, _, _, n in trace.calls if name == "seq_prefill") == submitted - len("one more")


def test_a_bad_trace_is_refused(eng):
    with pytest.raises(InvalidRequestError, match="trace"):
        Scheduler(eng, trace=[])


def test_off_there_is_no_wrapper(eng):
    sched = Scheduler(eng)
    seen = []
    inner = sched._step_locked
    sched._step_locked = lambda core: (seen.append(core), inner(core))
    try:
        sched.submit("hi", SamplingParams(max_tokens=2, ignore_eos=True)).result()
    finally:
        sched.close()
    assert seen and all(c is eng._core for c in seen)


def test_serve_timeline_reports_levels_and_rounds(eng, tmp_path):
    trace = Trace()
    _two_rounds(eng, trace, cancel=False)
    path = tmp_path / "serve.json"
    trace.save(path)
    data = json.loads(path.read_text())
    assert "CLOCK_MONOTONIC" in data["clock"] or data["clock"].startswith("time.perf_counter")
    t0 = min(c[1] for c in data["calls"])
    (tmp_path / "levels.json").write_text(json.dumps({"levels": [
        {"concurrency": 3, "rounds": 2, "t_start": t0 - 1, "t_end": t0 + 3600}]}))
    tool = _tool()
    out = io.StringIO()
    levels = tool.analyze(data, json.loads((tmp_path / "levels.json").read_text())["levels"])
    tool.report(levels, out)
    text = out.getvalue()
    for want in ("== level 3", "round 0:", "round 1:", "turnaround", "seq_prefill_many", "decode steps",
                 "period", "no core call running", "queue (submit->admit)"):
        assert want in text, (want, text)
    assert [r["requests"] for r in levels[0]["rounds"]] == [3, 3]
    assert levels[0]["level"]["tokens"] == 2 * (3 + 4 + 5)
    assert tool.main([str(path), "--level", "3", "--json", str(tmp_path / "t.json")]) == 0
    assert json.loads((tmp_path / "t.json").read_text())[0]["concurrency"] == 3
    assert tool.main([str(path), "--level", "64"]) == 1  # no such level: said, not a traceback


def test_serve_timeline_tells_mixed_steps_from_plain_ones(eng, tmp_path):
    """A request joining a running one with mixed steps on: the trace holds its seq_mixed, and the timeline
    counts it as a prefill call and a decode step, with the periods of mixed and plain steps apart."""
    trace = Trace()
    sched = Scheduler(eng, trace=trace, mixed_steps=True)
    try:
        first = sched.submit("GPUs are fast", SamplingParams(max_tokens=8, ignore_eos=True))
        sched.step()
        sched.step()
        later = sched.submit("GPUs are fast " * 3, SamplingParams(max_tokens=4, ignore_eos=True))
        sched.wait_idle()
        assert len(first.result().token_ids) == 8 and len(later.result().token_ids) == 4
    finally:
        sched.close()
    mixed = [c for c in trace.calls if c[0] == "seq_mixed"]
    assert len(mixed) == 1 and mixed[0][3] > 0  # n: the prompt tokens it carried
    path = tmp_path / "serve.json"
    trace.save(path)
    tool = _tool()
    out = io.StringIO()
    tool.report(tool.analyze(json.loads(path.read_text()), None), out)
    text = out.getvalue()
    for want in ("seq_mixed", "period, mixed", "period, plain"):
        assert want in text, (want, text)


def test_serve_timeline_joins_the_clients_stamps(tmp_path):
    """serve_bench's per-request client stamps in levels.json (call id, sent, stream done, the client's own
    turnaround before the send) are joined with the server's events of the same HTTP call."""
    events = []
    for i, (sent, done) in enumerate([(10.000, 10.050), (10.060, 10.110)]):
        call = f"cmpl-{i}"
        events += [("http_start", sent + 0.003, call, None, None), ("submit", sent + 0.004, f"{call}-0", 8, None),
                   ("admit", sent + 0.005, f"{call}-0", None, None), ("first", sent + 0.010, f"{call}-0", None, None),
                   ("end", done - 0.004, f"{call}-0", 4, "length"), ("http_end", done - 0.001, call, 4, "length")]
    trace = {"clock": "time.perf_counter", "calls": [], "events": [list(e) for e in events]}
    levels = [{"concurrency": 1, "rounds": 2, "t_start": 9.0, "t_end": 11.0,
               "requests": [["cmpl-0", 10.000, 10.050, None], ["cmpl-1", 10.060, 10.110, 0.010]]}]
    tool = _tool()
    client = tool.analyze(trace, levels)[0]["level"]["client_ms"]
    assert client["client sent -> handler start"]["p50"] == pytest.approx(3.0)
    assert client["last chunk written -> client done"]["p50"] == pytest.approx(1.0)
    assert client["client done -> its next send"]["p50"] == pytest.approx(10.0)
    out = io.StringIO()
    tool.report(tool.analyze(trace, levels), out)
    assert "client sent -> handler start" in out.getvalue()
