"""The GPU engine on its paged KV cache (cpp/gpu/kv_pages.h, cuda/kv_layout.cuh): scattered pages change no number,
pages are taken on demand and given back, a pool too small is a clear error that leaves the engine usable, and
the options are checked. (The kernels' addressing through scattered pages: test_gpu_kernels.py and
test_gpu_prefill.py.) Skipped without a usable CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_llama
from tinyinfer import Engine, InvalidRequestError, _core

pytestmark = pytest.mark.gpu

CONFIGS = {
    "gqa3_hd64": dict(hidden=384, heads=6, kv_heads=2, head_dim=64, intermediate=1000, layers=3),
    "gqa4_hd128": dict(hidden=512, heads=8, kv_heads=2, head_dim=128, layers=2),
    "gqa7_hd256": dict(hidden=448, heads=7, kv_heads=1, head_dim=256, layers=2),
}


def options(**kw):
    """Fixed GEMV variants and cuBLASLt's default GEMMs: two engines then run the same arithmetic, bit for bit."""
    o = _core.CudaOptions()
    o.gemv_rows, o.gemv_grid, o.gemm_autotune, o.decode_long_from = 2, 0, False, 0
    for k, v in kw.items():
        setattr(o, k, v)
    return o


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp(request.param), vocab=1000, **CONFIGS[request.param])


@pytest.mark.parametrize("page_size, shuffle, batched, prefill_chunk", [
    (64, 7, True, 2048),   # scattered pages of 64
    (64, 9, True, 100),    # prefill chunks that start inside a page (pos0 = 100, 200)
    (128, 3, True, 2048),  # larger pages
    (64, 5, False, 2048),  # the prompt fed through the decode graph
])
def test_scattered_pages_change_no_number(model, page_size, shuffle, batched, prefill_chunk):
    """Against an engine with the same options but pages of 64 in order: the same kernels on the same numbers,
    only the addresses differ, so logits and tokens are identical, bit for bit."""
    same = dict(batched_prefill=batched, prefill_chunk=prefill_chunk)
    ref = Engine(model, device="cuda", max_seq_len=400, cuda_options=options(**same))
    eng = Engine(model, device="cuda", max_seq_len=400,
                 cuda_options=options(kv_page_size=page_size, kv_page_shuffle=shuffle, **same))
    assert eng._core.kv_pages == (page_size, eng._core.max_batch * -(-400 // page_size), 0)  # the default pool
    ids = np.random.default_rng(1).integers(3, 1000, 230).tolist()  # crosses pages 64, 128, 192
    np.testing.assert_array_equal(eng.logits(ids), ref.logits(ids))
    for kw in (dict(), dict(temperature=0.9, seed=4)):  # 150 + 120 positions: the decode crosses pages too
        want = ref.generate(ids[:150], max_tokens=120, ignore_eos=True, **kw).token_ids
        assert eng.generate(ids[:150], max_tokens=120, ignore_eos=True, **kw).token_ids == want
    assert eng._core.kv_pages[2] == -(-269 // page_size)  # 150 + 119 fed positions


def test_pages_on_demand_and_a_pool_too_small(model):
    eng = Engine(model, device="cuda", max_seq_len=400, cuda_options=options(kv_pool_pages=3, kv_page_shuffle=2))
    core = eng._core
    c = eng.config
    assert core.kv_pages == (64, 3, 0)
    assert core.kv_cache_bytes == 2 * c.n_layers * 3 * c.n_kv_heads * 64 * c.head_dim * 2
    want = eng.generate([5, 6, 7], max_tokens=20, ignore_eos=True).token_ids
    assert core.kv_pages[2] == 1  # 23 positions: one page
    eng.generate(list(range(3, 103)), max_tokens=60, ignore_eos=True)
    assert core.kv_pages[2] == 3  # 160 positions
    with pytest.raises(InvalidRequestError, match="pool exhausted.*pool has 0 free of 3.*kv_pool_pages"):
        eng.generate(list(range(3, 153)), max_tokens=100, ignore_eos=True)  # 250 positions > 192
    with pytest.raises(InvalidRequestError, match="pool exhausted"):
        eng.logits(list(range(3, 203)))  # a prompt alone too long for the pool
    assert eng.generate([5, 6, 7], max_tokens=20, ignore_eos=True).token_ids == want  # still usable
    core.reset()
    assert core.kv_pages[2] == 0
    with pytest.raises(InvalidRequestError, match="pool exhausted"):
        core.time_decode_step(300, 4)
    assert core.time_decode_step(16, 4) > 0


def test_small_pool_loads_and_matches_the_full_pool(model):
    """A pool smaller than max_seq_len: the load-time tuning of the long-context graph times its steps inside the
    pool; short sequences give the same tokens as with the full pool."""
    full = Engine(model, device="cuda", max_seq_len=2048, cuda_options=options(kv_pool_pages=32))  # one sequence
    o = options(kv_pool_pages=8)
    o.decode_long_from = -1
    small = Engine(model, device="cuda", max_seq_len=2048, cuda_options=o)
    assert small._core.kv_pages == (64, 8, 0)
    assert small._core.kv_cache_bytes * 4 == full._core.kv_cache_bytes
    ids = [5, 17, 400, 23, 99, 7]
    assert small.generate(ids, max_tokens=100, ignore_eos=True).token_ids == \
        full.generate(ids, max_tokens=100, ignore_eos=True).token_ids


@pytest.mark.parametrize("field, value, match", [
    ("kv_page_size", 48, "kv_page_size must be a power of two in 64..2\\^20, got 48"),
    ("kv_page_size", 32, "got 32"),
    ("kv_pool_pages", -1, "kv_pool_pages must be >= 0"),
    ("attn_chunk", 128, "kv_page_size 64 must be >= attn_chunk 128"),
])
def test_bad_page_options_are_clear_errors(field, value, match):
    from tinyinfer.bench import shape_config

    o = _core.CudaOptions()
    setattr(o, field, value)
    with pytest.raises(InvalidRequestError, match=match):
        _core.CudaEngine.random(shape_config("smollm2-135m"), 256, 1, o)


def test_chunks_of_128_need_pages_of_128():
    from tinyinfer.bench import shape_config

    o = _core.CudaOptions()
    o.attn_chunk, o.kv_page_size = 128, 128
    o.max_batch = 1  # the default pool holds max_batch sequences of max_seq_len: one sequence, 256 / 128 pages
    eng = _core.CudaEngine.random(shape_config("smollm2-135m"), 256, 1, o)
    assert eng.kv_pages == (128, 2, 0) and eng.time_decode_step(200, 4) > 0
