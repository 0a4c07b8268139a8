"""Prefill speed per real shape (random weights): ms and tok/s per prompt length, GEMMs tuned (the warm-up
inside time_prefill tunes each length's shapes first). Skipped without a GPU."""

from __future__ import annotations

import pytest

from tinyinfer import _core

if not _core.ops.device_status()["usable"] or not hasattr(_core, "CudaEngine"):
    pytest.skip("no usable CUDA device", allow_module_level=True)

from tinyinfer.bench import prefill_flops, shape_config  # noqa: E402


@pytest.fixture(scope="module", params=["tinyllama-1.1b", "llama2-7b"])
def engine(request):
    cfg = shape_config(request.param)
    return cfg, _core.CudaEngine.random(cfg, 2048, 1)


@pytest.mark.parametrize("n", [16, 256, 512, 2048])
def test_prefill(benchmark, engine, n):
    cfg, eng = engine
    ms = benchmark.pedantic(eng.time_prefill, args=(n, 5), rounds=3, iterations=1)
    benchmark.extra_info.update(tokens=n, ms=ms, tok_s=n / (ms * 1e-3),
                                tflop_s=prefill_flops(cfg, n) / (ms * 1e-3) / 1e12, device=eng.device_name)
