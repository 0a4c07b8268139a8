"""bench/serve_overhead.py's fake core (SleepCore) keeps the slot API the scheduler drives: its in-process
ceiling runs to the end with every request's tokens (a scheduler change that calls a new core method must
give the fake core that method too, or the overhead benchmark breaks unnoticed)."""

from types import SimpleNamespace

from conftest import load_script


def _serve_overhead():
    return load_script("bench/serve_overhead.py")


def test_ceiling_runs_every_request_to_its_max_tokens():
    so = _serve_overhead()
    a = SimpleNamespace(max_batch=8, step_ms=0.0, prefill_ms=0.0, sample_ms=0.0, text=True, prefill_tokens=None,
                        seed=0, max_tokens=9, lens=[5, 40])
    r = so.ceiling(a, 6)
    assert r["ceiling_s"] > 0
    calls = r["core_calls"]
    assert calls["seq_step"] >= 8 and calls["seq_sample"] >= 9  # 9 tokens each: a prefill sample + 8 steps
    assert calls["seq_prefill"] >= 1
    assert abs(r["ceiling_tok_s"] * r["ceiling_s"] - 6 * 9) < 1e-6  # every request got its 9 tokens


def test_the_server_with_api_workers_serves_every_request(tmp_path):
    """--api-workers 2: the fake core behind two worker processes (tinyinfer serve's split) answers every request
    of every client to its max_tokens (main returns 1 when any failed)."""
    import json

    import pytest

    pytest.importorskip("fastapi")
    so = _serve_overhead()
    out = tmp_path / "o.json"
    rc = so.main(["--api-workers", "2", "--concurrency", "4", "--rounds", "2", "--max-tokens", "5", "--repeat", "1",
                  "--step-ms", "0.2", "--sample-ms", "0.05", "--prefill-ms", "0.05", "--json", str(out)])
    assert rc == 0
    (level,) = json.loads(out.read_text())["levels"]
    assert level["failed"] == 0 and level["completion_tokens"] == 4 * 2 * 5
    # (server_cpu_s itself is not asserted: /proc counts clock ticks of 10 ms, and this level's 40 tokens can take
    # less than one; test_cpu_seconds_counts_live_children checks the sum over the workers)


def test_cpu_seconds_counts_live_children():
    """serve_overhead's server CPU time sums the process and its live children (the API workers): a child that has
    burnt 0.3 s of CPU shows in its parent's count (to within /proc's clock ticks)."""
    import os
    import subprocess
    import sys
    import time

    so = _serve_overhead()
    before = so.cpu_seconds(os.getpid())
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        deadline = time.monotonic() + 60  # (a generous bound on a busy machine, not a measurement)
        while so.cpu_seconds(child.pid) < 0.27 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert so.cpu_seconds(child.pid) >= 0.27
        assert so.cpu_seconds(os.getpid()) - before >= 0.27
    finally:
        child.kill()
        child.wait()
