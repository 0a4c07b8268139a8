"""bench/tools/pm_timeline.py's analysis of a PM-sampling dump (the DRAM read series of one decode step), on a
synthetic step whose layers, idle time and LM head are known. The GPU side (ncu) is not exercised here."""

from __future__ import annotations

import json

import numpy as np

from conftest import load_script


def _tool():
    return load_script("bench/tools/pm_timeline.py")


def _step(layers: int = 22, period: float = 10.0, busy: float = 6.0, head: float = 36.0, dt: float = 0.5) -> dict:
    """A dump entry: idle lead-in, `layers` layers of `busy` µs at the stream's rate then idle, a head at full rate.
    Timestamps in ns from an arbitrary epoch, the first sample without one (as ncu writes them)."""
    mod = _tool()
    t = np.arange(0.0, 3.0 + layers * period + head + 2.0, dt)
    x = t - 3.0
    v = np.where((x >= 0) & (x < layers * period) & ((x % period) < busy), mod.STREAM_PCT, 0.0)
    v = np.where((x >= layers * period) & (x < layers * period + head), mod.STREAM_PCT, v)
    corr = [0.0] + list(1.7e18 + t[1:] * 1e3)
    return {"name": "graph", "scalars": {},
            "series": {"FBSP.TriageCompute.dramc__read_throughput.avg.pct_of_peak_sustained_elapsed":
                       {"values": v.tolist(), "corr": corr}}}


def test_analyze_finds_the_layer_period_and_the_idle_time():
    a = _tool().analyze(_step(), layers=22, head_us=36.0)
    assert abs(a["period_us"] - 10.0) < 0.1
    # 22 layers x 4 µs idle (the last layer's idle tail runs into the head's window: 3 of its 4 µs are outside)
    assert 80.0 < a["idle_us"] < 92.0
    assert a["head_mean_pct"] > 90.0
    fold = np.array(a["fold"])
    assert (fold > 90).sum() in (13, 14, 15) and (fold < 10).sum() >= 8  # 6 of 10 µs busy in 24 bins


def test_show_prints_each_entry_and_skips_one_without_a_dram_series(tmp_path, capsys, monkeypatch):
    mod = _tool()
    path = tmp_path / "step.json"
    path.write_text(json.dumps([_step(), {"name": "other", "scalars": {}, "series": {}}]))
    monkeypatch.setattr("sys.argv", ["pm_timeline.py", "show", str(path), "--layers=22"])
    mod.show(str(path))
    out = capsys.readouterr().out
    assert "period 10.0" in out and "DRAM idle-equivalent" in out
    assert "== other: no DRAM series" in out
