"""Decode speed per real shape (random weights), batch 1, greedy, 256 steps: tok/s, % of the measured roofline,
effective GB/s in extra_info. Skipped without a GPU."""

from __future__ import annotations

import pytest

from tinyinfer import _core

if not _core.ops.device_status()["usable"] or not hasattr(_core, "CudaEngine"):
    pytest.skip("no usable CUDA device", allow_module_level=True)

from tinyinfer.bench import SHAPES, bytes_per_token, shape_config  # noqa: E402


@pytest.fixture(scope="module")
def bandwidth():
    return _core.ops.read_bandwidth(1 << 31, 20)["gb_per_s"]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode(benchmark, shape, bandwidth):
    cfg = shape_config(shape)
    eng = _core.CudaEngine.random(cfg, 1024, 1)
    ms = benchmark.pedantic(eng.time_decode_step, args=(16, 256), rounds=3, iterations=1)
    ms = eng.time_decode_step(16, 256)
    b = bytes_per_token(cfg, 16)["total"]
    roof = bandwidth * 1e9 / b
    benchmark.extra_info.update(tok_s=1e3 / ms, pct_roofline=100 * 1e3 / ms / roof,
                                gb_per_s=b / (ms * 1e-3) / 1e9, read_bandwidth_gb_s=bandwidth,
                                device=eng.device_name, pdl=eng.uses_pdl)
