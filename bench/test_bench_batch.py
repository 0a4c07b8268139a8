"""Batched decode throughput per batch size (TinyLlama-1.1B shape, random weights, fp16 and int4): aggregate
and per-sequence tok/s, prompt 128 + 128 generated, in extra_info. Skipped without a GPU."""

from __future__ import annotations

import pytest

from tinyinfer import _core

if not _core.ops.device_status()["usable"] or not hasattr(_core, "CudaEngine"):
    pytest.skip("no usable CUDA device", allow_module_level=True)

from tinyinfer.bench_batch import open_engine, time_batch, time_single  # noqa: E402

BATCHES = (1, 8, 32, 64)


@pytest.fixture(scope="module", params=["fp16", "int4"])
def engine(request):
    core, cfg, _ = open_engine("cuda", "tinyllama-1.1b", None, request.param, 128 + 128 + 16, max(BATCHES))
    time_batch(core, 1, 8, 4, cfg.vocab)  # warm-up
    return core, cfg, request.param, time_single(core, 128, 128, cfg.vocab)


@pytest.mark.parametrize("batch", BATCHES)
def test_batch_decode(benchmark, engine, batch):
    core, cfg, dtype, single = engine
    time_batch(core, batch, 128, 4, cfg.vocab)  # this bucket's graph before timing
    row = benchmark.pedantic(time_batch, args=(core, batch, 128, 128, cfg.vocab), rounds=2, iterations=1)
    benchmark.extra_info.update(dtype=dtype, tok_s=row["tok_s"], per_seq_tok_s=row["per_seq_tok_s"],
                                x_single=row["tok_s"] / single, single_tok_s=single,
                                kv_pages_used=row["kv_pages_used"], device=core.device_name)
