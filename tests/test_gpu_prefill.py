"""The batched prefill on the GPU: the cuBLASLt GEMM wrapper and the tiled causal attention against numpy twins
on awkward shapes, then the engine's prefill against the CPU reference engine at every position, chunked and
unchunked, after earlier context, and generation after a long prompt. Skipped without a usable CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import from_pages, make_llama, to_pages, unused_pages
from tinyinfer import Engine, InvalidRequestError, _core

pytestmark = pytest.mark.gpu


def f16_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.astype(np.float16)).view(np.uint16)


def gemm_out(name: str):
    """The ops.GemmOut enum for this file's short output names."""
    return {"f32": _core.ops.GemmOut.F32, "add": _core.ops.GemmOut.AddF32, "f16": _core.ops.GemmOut.F16}[name]


def close(got, ref, atol, rtol):
    err = np.abs(got - ref) - (atol + rtol * np.abs(ref))
    assert np.isfinite(got).all(), "non-finite output"
    assert err.max() <= 0, f"worst excess {err.max():.3e} at {np.unravel_index(err.argmax(), err.shape)}"


# ---- GEMM (cuda/gemm.cu) ----

@pytest.mark.parametrize("M,N,K", [(111, 17, 333), (64, 1, 64), (500, 1000, 96), (2560, 128, 2048), (8, 3, 8),
                                   (333, 257, 500)])
@pytest.mark.parametrize("out", ["f32", "add", "f16"])
@pytest.mark.parametrize("autotune", [True, False])
def test_gemm_matches_numpy(M, N, K, out, autotune):
    rng = np.random.default_rng(M * 7 + N * 3 + K)
    W = rng.standard_normal((M, K)).astype(np.float16)
    X = rng.standard_normal((N, K)).astype(np.float16)  # (the driver rounds X to fp16: exact here)
    y0 = rng.standard_normal((N, M)).astype(np.float32)
    ref = X.astype(np.float64) @ W.astype(np.float64).T + (y0 if out == "add" else 0)
    got = _core.ops.gemm(f16_bits(W), X.astype(np.float32), y0, gemm_out(out), autotune)
    assert got.shape == (N, M)
    if out == "f16":
        close(got, ref, atol=2e-2, rtol=2e-3)
    else:
        close(got, ref, atol=1e-3 * np.sqrt(K), rtol=1e-4)


def test_gemm_named_inputs():
    """ones and arange: every output element is a readable number."""
    K, M, N = 40, 24, 5
    W = np.ones((M, K), np.float16)
    X = np.tile(np.arange(K, dtype=np.float32) / K, (N, 1))
    got = _core.ops.gemm(f16_bits(W), X, np.zeros((N, M), np.float32), gemm_out("f32"))
    np.testing.assert_allclose(got, np.full((N, M), (K - 1) / 2), rtol=1e-3)


def test_gemm_bad_shapes_are_clear_errors():
    W = f16_bits(np.ones((4, 8)))
    with pytest.raises(InvalidRequestError, match="X.shape"):
        _core.ops.gemm(W, np.ones((2, 9), np.float32), np.zeros((2, 4), np.float32), gemm_out("f32"))
    with pytest.raises(InvalidRequestError, match="y_init"):
        _core.ops.gemm(W, np.ones((2, 8), np.float32), np.zeros((3, 4), np.float32), gemm_out("add"))


# ---- prefill attention (cuda/prefill_attention.cu) ----

def attention_ref(q, kc, vc, pos0, n_heads):
    """float64 causal attention of T queries at pos0.. over the caches (the kernel's CPU twin)."""
    T = q.shape[0]
    n_kv, _, hd = kc.shape
    group = n_heads // n_kv
    K = kc.view(np.float16).astype(np.float64)
    V = vc.view(np.float16).astype(np.float64)
    Q = q.astype(np.float16).astype(np.float64).reshape(T, n_heads, hd)
    out = np.zeros((T, n_heads, hd))
    for h in range(n_heads):
        kvh = h // group
        n = pos0 + T
        s = Q[:, h, :] @ K[kvh, :n].T / np.sqrt(hd)  # (T, n)
        mask = np.arange(n)[None, :] > (pos0 + np.arange(T))[:, None]
        s[mask] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h, :] = (p / p.sum(-1, keepdims=True)) @ V[kvh, :n]
    return out.reshape(T, n_heads * hd)


def paged(kc, vc, page_size, seed):
    """Both caches in scattered pages of one table (conftest.to_pages)."""
    kp, table = to_pages(kc, page_size, seed)
    vp, _ = to_pages(vc, page_size, seed)
    return kp, vp, table


@pytest.mark.parametrize("n_heads,n_kv,hd,T,pos0", [
    (4, 4, 64, 1, 0),      # one token, one key
    (8, 2, 64, 17, 0),     # group 4, a partial tile
    (6, 2, 96, 33, 5),     # head_dim 96 in the 128 variant, after context
    (4, 1, 128, 100, 27),  # group 4 over one KV head, crossing tiles
    (7, 1, 256, 70, 3),    # head_dim 256, group 7 (packed rows straddle tokens)
    (32, 4, 64, 130, 0),   # the TinyLlama head layout
    (2, 2, 16, 65, 64),    # the smallest head_dim; starting exactly at a tile edge
    (3, 3, 48, 200, 111),  # head_dim 48, long
    (4, 2, 64, 1, 300),    # one new token after a long context
    # the paged cache: contexts crossing page edges (pages of 64), continuing a cache (pos0 > 0), GQA 1/3/4/8
    (2, 2, 64, 63, 0), (6, 2, 128, 64, 1), (8, 2, 64, 65, 63), (16, 2, 128, 200, 64), (3, 1, 64, 136, 864),
    (8, 1, 256, 65, 135), (4, 1, 96, 999, 1),
])
@pytest.mark.parametrize("stages", [0, 1])  # 0: the launcher's choice (two stages on sm_80+); 1: the sm_75 path
@pytest.mark.parametrize("page_size", [64, 128])
def test_prefill_attention_matches_reference(n_heads, n_kv, hd, T, pos0, stages, page_size):
    rng = np.random.default_rng(n_heads * 1000 + hd + T)
    max_seq = pos0 + T + 37
    kc = rng.standard_normal((n_kv, max_seq, hd)).astype(np.float16).view(np.uint16)
    vc = rng.standard_normal((n_kv, max_seq, hd)).astype(np.float16).view(np.uint16)
    kc[:, pos0 + T:] = 0x7E00  # NaN past the last position: the kernel must never read it
    vc[:, pos0 + T:] = 0x7E00
    q = (rng.standard_normal((T, n_heads * hd)) * 2).astype(np.float32)
    kp, vp, table = paged(kc, vc, page_size, seed=T + pos0)  # unused pages: NaN as well
    got = _core.ops.prefill_attention(q, kp, vp, table, pos0, n_heads, stages)
    ref = attention_ref(q, kc, vc, pos0, n_heads)
    close(got, ref, atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("n_heads,n_kv,hd", [(4, 4, 64), (8, 2, 64), (8, 2, 128), (6, 2, 96), (7, 1, 256)])
@pytest.mark.parametrize("stages", [0, 1])
def test_prefill_attention_varlen_matches_reference(n_heads, n_kv, hd, stages):
    """Many sequences in one launch (seq_prefill_many's attention): each sequence's rows equal the reference
    over its own cache only (one pool, a table row each; a NaN anywhere another sequence owns would show):
    one token, a partial tile, crossing pages, continuing a cache (pos0 > 0), a long one."""
    rng = np.random.default_rng(n_heads * 100 + hd)
    shapes = [(1, 0), (17, 5), (130, 64), (64, 0), (70, 135), (3, 200)]
    page, pools, tables, qs, refs, n_pages = 64, [], [], [], [], 0
    for i, (T, pos0) in enumerate(shapes):
        kc = rng.standard_normal((n_kv, pos0 + T, hd)).astype(np.float16).view(np.uint16)
        vc = rng.standard_normal((n_kv, pos0 + T, hd)).astype(np.float16).view(np.uint16)
        q = (rng.standard_normal((T, n_heads * hd)) * 2).astype(np.float32)
        kp, vp, table = paged(kc, vc, page, seed=i)
        pools.append((kp, vp))
        tables.append(table + n_pages)
        n_pages += len(kp)
        qs.append(q)
        refs.append(attention_ref(q, kc, vc, pos0, n_heads))
    row = max(len(t) for t in tables)
    tab = np.full((len(shapes), row), -1, np.int32)
    for i, t in enumerate(tables):
        tab[i, :len(t)] = t
    kp = np.concatenate([p[0] for p in pools])
    vp = np.concatenate([p[1] for p in pools])
    got = _core.ops.prefill_attention_varlen(np.concatenate(qs), kp, vp, tab, [T for T, _ in shapes],
                                             [p for _, p in shapes], n_heads, stages)
    close(got, np.concatenate(refs), atol=4e-3, rtol=1e-2)


def test_prefill_attention_varlen_bad_inputs():
    kc = np.zeros((2, 1, 64, 64), np.uint16)
    tab = np.array([[0], [1]], np.int32)
    op = _core.ops.prefill_attention_varlen
    with pytest.raises(InvalidRequestError, match="one T, pos0 and table row per sequence"):
        op(np.zeros((3, 64), np.float32), kc, kc.copy(), tab, [3], [0], 1)
    with pytest.raises(InvalidRequestError, match="T >= 1"):
        op(np.zeros((3, 64), np.float32), kc, kc.copy(), tab, [3, 0], [0, 0], 1)
    with pytest.raises(InvalidRequestError, match="sum of T"):
        op(np.zeros((3, 64), np.float32), kc, kc.copy(), tab, [2, 2], [0, 0], 1)
    with pytest.raises(InvalidRequestError, match="out of range"):
        op(np.zeros((3, 64), np.float32), kc, kc.copy(), tab, [2, 1], [0, 64], 1)
    with pytest.raises(InvalidRequestError, match="is not a page"):
        op(np.zeros((3, 64), np.float32), kc, kc.copy(), tab - 1, [2, 1], [0, 0], 1)


def test_prefill_attention_named_inputs():
    """Constant V rows: the output is that constant whatever the scores; V = position: a causal average."""
    n_heads, hd, T = 2, 64, 40
    kc = np.zeros((1, T, hd), np.float16)
    vc = np.tile(np.arange(T, dtype=np.float16)[None, :, None], (1, 1, hd))
    q = np.zeros((T, n_heads * hd), np.float32)  # zero scores: uniform weights over positions 0..t
    kp, vp, table = paged(kc.view(np.uint16), vc.view(np.uint16), 64, seed=1)
    got = _core.ops.prefill_attention(q, kp, vp, table, 0, n_heads)
    want = np.repeat((np.arange(T) / 2.0)[:, None], n_heads * hd, axis=1)  # mean of 0..t
    np.testing.assert_allclose(got, want, atol=2e-2)


def test_prefill_attention_refuses_unsupported_head_dim():
    kc = np.zeros((1, 1, 64, 40), np.uint16)
    one = np.zeros(1, np.int32)  # a table of one entry: page 0
    with pytest.raises(InvalidRequestError, match="head_dim must be a multiple of 16"):
        _core.ops.prefill_attention(np.zeros((2, 40), np.float32), kc, kc.copy(), one, 0, 1)
    kc = np.zeros((1, 1, 64, 64), np.uint16)
    with pytest.raises(InvalidRequestError, match="out of range"):
        _core.ops.prefill_attention(np.zeros((60, 64), np.float32), kc, kc.copy(), one, 6, 1)
    small = np.zeros((4, 1, 32, 64), np.uint16)
    with pytest.raises(InvalidRequestError, match="page size must be a power of two >= 64"):
        _core.ops.prefill_attention(np.zeros((4, 64), np.float32), small, small.copy(), np.arange(4, dtype=np.int32),
                                    0, 1)
    with pytest.raises(InvalidRequestError, match=r"page_table\[0\] = -1 is not a page"):
        _core.ops.prefill_attention(np.zeros((4, 64), np.float32), kc, kc.copy(), one - 1, 0, 1)


# ---- the prefill's RoPE + cache write (cuda/prefill.cu, rope_rows) ----

@pytest.mark.parametrize("n_heads,n_kv,hd,T,pos0,page_size", [
    (4, 4, 64, 1, 0, 64), (6, 2, 64, 65, 0, 64), (8, 2, 128, 130, 63, 64), (3, 1, 96, 200, 800, 64),
    (8, 1, 256, 70, 1, 128), (4, 2, 64, 17, 60, 16),
])
def test_rope_rows_writes_the_paged_cache(n_heads, n_kv, hd, T, pos0, page_size):
    from test_gpu_kernels import _rope_tables, _rot

    rng = np.random.default_rng(T * 7 + pos0)
    max_seq = pos0 + T + 20
    qkv = rng.standard_normal((T, (n_heads + 2 * n_kv) * hd)).astype(np.float32)
    kc = rng.standard_normal((n_kv, max_seq, hd)).astype(np.float16).view(np.uint16)  # earlier content
    vc = rng.standard_normal((n_kv, max_seq, hd)).astype(np.float16).view(np.uint16)
    kp, vp, table = paged(kc, vc, page_size, seed=T)
    spare_k = unused_pages(kp, table).copy()
    cos, sin = _rope_tables(max_seq, hd)
    q = _core.ops.rope_rows(qkv, kp, vp, table, cos, sin, pos0, n_heads)

    c, s = cos[pos0:pos0 + T, None, :], sin[pos0:pos0 + T, None, :]
    x = qkv.astype(np.float64)
    q_ref = _rot(x[:, :n_heads * hd].reshape(T, n_heads, hd), c, s).reshape(T, -1)
    k_ref = _rot(x[:, n_heads * hd:(n_heads + n_kv) * hd].reshape(T, n_kv, hd), c, s).transpose(1, 0, 2)
    v_ref = qkv[:, (n_heads + n_kv) * hd:].reshape(T, n_kv, hd).transpose(1, 0, 2).astype(np.float16)
    close(q, q_ref, atol=2e-3, rtol=1e-3)
    kb, vb = from_pages(kp, table, max_seq), from_pages(vp, table, max_seq)
    close(kb[:, pos0:pos0 + T].view(np.float16).astype(np.float64), k_ref, atol=2e-3, rtol=1e-3)
    np.testing.assert_array_equal(vb[:, pos0:pos0 + T].view(np.float16), v_ref)
    # nothing else written: the positions before and after, and the pages outside the table
    np.testing.assert_array_equal(kb[:, :pos0], kc[:, :pos0])
    np.testing.assert_array_equal(vb[:, pos0 + T:], vc[:, pos0 + T:])
    np.testing.assert_array_equal(unused_pages(kp, table), spare_k)


# ---- the engine's prefill ----

CONFIGS = {
    "gqa3_hd64_i333": dict(hidden=384, heads=6, kv_heads=2, head_dim=64, intermediate=333, layers=2),
    "gqa1_hd128_tied": dict(hidden=256, heads=2, kv_heads=2, head_dim=128, tie=True, layers=2),
    "gqa8_hd64": dict(hidden=512, heads=16, kv_heads=2, head_dim=64, layers=2),
    "gqa5_hd96": dict(hidden=480, heads=5, kv_heads=1, head_dim=96, layers=2, intermediate=700),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, tmp_path_factory):
    d = make_llama(tmp_path_factory.mktemp(request.param), vocab=800, **CONFIGS[request.param])
    gpu = Engine(d, device="cuda", max_seq_len=1100)
    assert gpu._core.batched_prefill
    return request.param, d, gpu, Engine(d, device="cpu", max_seq_len=1100)


@pytest.mark.parametrize("n", [1, 17, 128, 1000])
def test_prefill_logits_match_cpu_at_every_position(model, n):
    name, _, gpu, cpu = model
    ids = np.random.default_rng(n).integers(3, 800, n).tolist()
    g, c = gpu.logits(ids), cpu.logits(ids)
    rel = np.abs(g - c).max(-1) / np.abs(c).max(-1)
    agree = (g.argmax(-1) == c.argmax(-1)).mean()
    print(f"{name} n={n}: worst rel logit error {rel.max():.2e}, top-1 agreement {agree:.3f}")
    assert g.shape == c.shape and np.isfinite(g).all()
    assert rel.max() < 2e-2
    assert agree >= 0.95


def test_chunked_prefill_and_token_by_token_agree(model):
    """Chunks of 64 (attention over earlier chunks' cache) and the old one-token path give the batched result."""
    name, d, gpu, _ = model
    ids = np.random.default_rng(5).integers(3, 800, 300).tolist()
    whole = gpu.logits(ids)
    chunked = _core.CudaOptions()
    chunked.prefill_chunk = 64
    one = _core.CudaOptions()
    one.batched_prefill = False
    scale = np.abs(whole).max()
    for opts in (chunked, one):
        other = Engine(d, device="cuda", max_seq_len=400, cuda_options=opts)
        got = other.logits(ids)
        assert np.abs(got - whole).max() / scale < 1e-2, name
        assert (got.argmax(-1) == whole.argmax(-1)).mean() >= 0.97


def test_generation_after_long_prompt_matches_cpu(model):
    name, _, gpu, cpu = model
    ids = np.random.default_rng(9).integers(3, 800, 700).tolist()
    out = gpu.generate(ids, max_tokens=24, ignore_eos=True).token_ids
    ref = cpu.logits(ids + out[:-1])[len(ids) - 1:]
    scale = np.abs(ref).max()
    picked = ref[np.arange(24), out]
    assert np.all(picked >= ref.max(-1) - 2e-2 * scale), name  # each pick is the CPU's argmax up to fp16 noise
    same = int(np.argmax(np.r_[np.array(out) != ref.argmax(-1), True]))
    print(f"{name}: greedy after 700 tokens identical to CPU argmax for {same}/24")


def test_multi_turn_prefill_continues_the_cache(model):
    """A second prompt after a generation is prefilled at the right positions (the pending token first)."""
    _, _, gpu, cpu = model
    a = [5, 9, 40, 33]
    b = np.random.default_rng(2).integers(3, 800, 90).tolist()
    gpu._core.reset()
    gpu._core.forward(a, all_logits=False)
    toks = list(gpu._core.decode(6, _core.SamplingConfig(), [], 0))  # the last one is pending, not yet fed
    g = gpu._core.forward(b, all_logits=True)
    cpu._core.reset()
    cpu._core.forward(a + toks, all_logits=False)
    c = cpu._core.forward(b, all_logits=True)
    assert g.shape == c.shape == (len(b), 800)
    assert np.abs(g - c).max() / np.abs(c).max() < 2e-2
    assert (g.argmax(-1) == c.argmax(-1)).mean() >= 0.95


def test_prefill_timing_and_gemm_table(model):
    _, _, gpu, _ = model
    ms = gpu._core.time_prefill(100, 2)
    assert ms > 0
    table = gpu._core.gemm_table()
    names = {t["name"] for t in table}
    assert {"qkv", "o", "gate_up", "down"} <= names
    for t in table:
        # timed: the heuristic's offers and up to 4 x 4 split-K variants of them (gemm.cu add_split_k); the pick is
        # the fastest, the default (candidate 0) timed first and kept unless another is strictly faster, so a kept
        # default's time is the default's (tuned <= default holds by construction: not asserted)
        assert t["N"] >= 16 and 1 <= t["candidates"] <= t["offered"] + 16, t
        assert 0 <= t["chosen"] < t["offered"] + 16, t
        assert t["chosen"] != 0 or t["tuned_us"] == t["default_us"], t
    with pytest.raises(InvalidRequestError, match="time_prefill: n_tokens must be in 1..max_seq_len=1100"):
        gpu._core.time_prefill(5000, 1)


def test_bad_prefill_chunk_is_a_clear_error(tmp_path):
    d = make_llama(tmp_path / "m", vocab=300, layers=1)
    opts = _core.CudaOptions()
    opts.prefill_chunk = 0
    with pytest.raises(InvalidRequestError, match="prefill_chunk"):
        Engine(d, device="cuda", max_seq_len=64, cuda_options=opts)
    assert Engine(d, device="cuda", max_seq_len=64).generate([1, 2, 3], max_tokens=3, ignore_eos=True).token_ids


# ---- GEMM tactics across runs ----

def _small_config():
    c = _core.ModelConfig()
    c.hidden, c.intermediate, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab = 256, 600, 2, 4, 2, 64, 500
    c.max_position_embeddings = 1024
    c.validate()
    return c


def test_tactics_save_and_load_round_trip():
    a = _core.CudaEngine.random(_small_config(), 512, 1)
    a.time_prefill(100, 1)
    n = a.tuned_gemms
    assert n >= 4 and not any(t["from_file"] for t in a.gemm_table())
    text = a.save_tactics()
    b = _core.CudaEngine.random(_small_config(), 512, 2)
    assert b.load_tactics(text) == n
    assert all(t["from_file"] for t in b.gemm_table())
    b.time_prefill(100, 1)  # the same bucket: nothing is tuned again
    assert b.tuned_gemms == n
    # damaged or foreign lines are skipped, not fatal
    assert b.load_tactics("# header\ngarbage\n1 2 3\n64 16 64 0 1 1 0 1.0 1.0 zz\n") == 0
    fields = text.splitlines()[1].split(" ")
    damaged = " ".join(fields[:-2] + ["0" * len(fields[-2]), fields[-1]])
    assert b.load_tactics(damaged + "\n") == 0  # the checksum no longer matches: never parsed


def test_tactics_of_a_warm_l2_tuner_are_neither_saved_nor_loaded():
    """gemm_tune_cold=False (A/B runs) times with the weights in the L2: its tactics do not belong in the file
    whose fingerprint says "timed from DRAM", and it takes none from there."""
    a = _core.CudaEngine.random(_small_config(), 512, 1)
    a.time_prefill(100, 1)
    text = a.save_tactics()
    assert "timed from DRAM" in text.splitlines()[0]
    opts = _core.CudaOptions()
    opts.gemm_tune_cold = False
    warm = _core.CudaEngine.random(_small_config(), 512, 2, opts)
    assert warm.load_tactics(text) == 0
    warm.time_prefill(100, 1)
    assert warm.tuned_gemms >= 4 and warm.save_tactics() == ""


def test_engine_keeps_tactics_in_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYINFER_CACHE", str(tmp_path / "cache"))
    d = make_llama(tmp_path / "m", vocab=300, layers=1)
    Engine(d, device="cuda", max_seq_len=256).generate(list(range(3, 40)), max_tokens=2, ignore_eos=True)
    files = list((tmp_path / "cache" / "tactics").glob("*.txt"))
    assert len(files) == 1 and "cublasLt" in files[0].name
    again = Engine(d, device="cuda", max_seq_len=256)
    assert again._core.tuned_gemms >= 4 and all(t["from_file"] for t in again._core.gemm_table())
    monkeypatch.setenv("TINYINFER_TACTICS", "0")
    assert Engine(d, device="cuda", max_seq_len=256)._core.tuned_gemms == 0


@pytest.mark.parametrize("n, bucket", [(100, 128), (129, 192), (200, 256), (700, 768), (769, 1024)])
def test_gemms_are_tuned_per_half_octave_past_128_rows(n, bucket):
    """cuda::Gemm::bucket: a prompt of n tokens runs its GEMMs with the algorithm tuned at `bucket` rows (powers of
    two, and past 128 the half octaves between them), and the scheduler's warm-up prefills exactly those."""
    from tinyinfer.scheduler import _token_buckets

    a = _core.CudaEngine.random(_small_config(), 1024, 1)
    a.time_prefill(n, 1)
    assert {t["N"] for t in a.gemm_table()} == {bucket}
    assert bucket in list(_token_buckets(1024))
