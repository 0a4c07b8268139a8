"""The measured roofline: streaming-read bandwidth of this GPU (cuda/bandwidth.cu), skipped without a GPU."""

from __future__ import annotations

import pytest

from tinyinfer import _core

if not _core.ops.device_status()["usable"]:
    pytest.skip("no usable CUDA device", allow_module_level=True)


@pytest.mark.parametrize("mib", [64, 512, 2048])
def test_read_bandwidth(benchmark, mib):
    nbytes = mib << 20
    r = benchmark.pedantic(_core.ops.read_bandwidth, args=(nbytes, 10), rounds=3, iterations=1)
    benchmark.extra_info.update(gb_per_s=r["gb_per_s"], bytes=r["bytes"], best_ms=r["best_ms"],
                                blocks=r["blocks"], device=_core.ops.device_status()["name"])
