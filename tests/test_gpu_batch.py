"""The GPU engine's sequence slots (docs/BATCH_CONTRACT.md §2; cpp/gpu/cuda_engine_slots.cu, batch_step.*): many
sequences of different lengths stepped together through one batched decode pass (a graph per batch-size bucket,
padded rows inert) give what each sequence gives alone; logits against the CPU engine; pages on demand and given
back; a pool too small is a clear error that leaves the engine usable. Skipped without a usable CUDA device."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from conftest import make_llama
from tinyinfer import Engine, InvalidRequestError, _core

pytestmark = pytest.mark.gpu

# head_dim 64 / 128, GQA group 1 / 4. fp16 weights in the file: the CPU engine (fp32 arithmetic) and the GPU
# engine then hold the very same weights, so their logits differ by the GPU's fp16 activations only.
CONFIGS = {
    "gqa1_hd64": dict(hidden=256, heads=4, kv_heads=4, head_dim=64, intermediate=512, layers=2),
    "gqa4_hd64": dict(hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=768, layers=2),
    "gqa4_hd128": dict(hidden=512, heads=8, kv_heads=2, head_dim=128, intermediate=640, layers=3),
}
FORMATS = ["fp16", "int8", "int4"]
# Logits of the batched step against another path, relative to the largest: fp16 rounding of the activations
# (fp16); the batched int8 / int4 products also round the dequantized weights to fp16 and sum each 16-byte
# word's products in fp16 (cuda/gemv_batch.cu), as the single path's int4 GEMV sums its groups.
LOGIT_TOL = {"fp16": 3e-3, "int8": 1e-2, "int4": 1e-2}
# With int8 inputs (act8): two paths whose inputs differ by an fp16 rounding can land a value a whole int8 step
# (amax / 127 of its group) apart, which the logits carry; measured (H100) up to 2.3% of the largest logit between a
# decode step and the prefill, ~1.4% between the batched step and the mixed pass, on these models.
ACT8_LOGIT_TOL = 3e-2
VOCAB, MAX_SEQ = 1000, 400


def options(**kw):
    """Fixed GEMV variants and cuBLASLt's default GEMMs (fast loads, the same arithmetic in every engine)."""
    o = _core.CudaOptions()
    o.gemv_rows, o.gemv_grid, o.gemm_autotune, o.decode_long_from = 2, 0, False, 0
    for k, v in kw.items():
        if k == "gemv_pins":  # ((role, R, blocks_per_sm), ...): hashable, for gpu_engine's key
            v = [_core.GemvPin(getattr(_core.MatrixRole, role), R, bps) for role, R, bps in v]
        setattr(o, k, v)
    return o


def rms_ref(X, w, eps=1e-5):
    """RMSNorm in float64: the reference the fp16 norms are held to."""
    return X / np.sqrt((X.astype(np.float64) ** 2).mean(1, keepdims=True) + eps) * w


def greedy():
    return _core.SamplingConfig()  # temperature 0


def prompts(n, seed=0):
    """n prompts of different lengths (1 .. ~130: some cross a 64-position page, one is a single token)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, 1 + (37 * i) % 131).tolist() for i in range(n)]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, tmp_path_factory):
    return request.param, make_llama(tmp_path_factory.mktemp(request.param), vocab=VOCAB, dtype="float16",
                                     **CONFIGS[request.param])


_engines = {}


def gpu_engine(model, fmt, **kw):
    """One engine per (model, format, options), kept for the module (loads are the slow part)."""
    name, path = model
    key = (name, fmt, tuple(sorted(kw.items())))
    if key not in _engines:
        _engines[key] = Engine(path, device="cuda", dtype=fmt, max_seq_len=MAX_SEQ, cuda_options=options(**kw))
    return _engines[key]


@pytest.fixture(scope="module", autouse=True)
def drop_engines():
    """gpu_engine's engines dropped at the end of each module that uses it (import this fixture with it): their
    GPU memory back before the next module, and none left alive at the interpreter's exit, where nanobind reports
    every instance still alive as a leak."""
    yield
    _engines.clear()
    gc.collect()


def generate_batch(core, batch, steps):
    """Greedy: every prompt in its own slot, prefilled one by one, then `steps` tokens each, all slots sampled
    and stepped together. Returns the tokens per prompt; the slots are closed again."""
    slots = [core.seq_open() for _ in batch]
    for s, p in zip(slots, batch):
        core.seq_prefill(s, p)
    out = [[] for _ in batch]
    for i in range(steps):
        toks, _, _, _ = core.seq_sample(slots, [greedy()] * len(slots), [i] * len(slots), 0)
        for o, t in zip(out, toks):
            o.append(int(t))
        if i + 1 < steps:
            core.seq_step(slots, toks.tolist())
    for s in slots:
        core.seq_close(s)
    return out


@pytest.mark.parametrize("fmt, K", [("fp16", 100), ("int8", 100), ("int4", 160)])  # 100: a partial last word
@pytest.mark.parametrize("mode", ["f32norm-f32", "f32norm-swiglu", "f16-add"])
@pytest.mark.parametrize("n", [1, 3, 8, 13])  # 13: two groups of the kernel's 8 inputs, the second partial
def test_small_n_gemv_kernel(fmt, K, mode, n):
    """cuda/gemv_batch.cu alone against numpy on the weights as the CPU engine dequantizes them: every input row
    (NaN past K in its padding: never read), every output (NaN-poisoned before the launch: all written)."""
    check_small_n_product(False, fmt, K, 70, mode, n)  # 70 rows: not a whole number of 8-row tiles


# Awkward shapes for the tensor-core kernel: rows not a multiple of its 16-row tile (333; swiglu needs an even
# count: 334), K not a multiple of its 4-word chunk (fp16 1000: 125 words, a partial last chunk; fp16 1004: also
# a partial last word; int8 1000: a partial word reaching past ldx; int4 992: 31 groups, a partial chunk), n over
# every tile count (1, 7 | 8, 9 | 16, 17 | 32, 33 | 64).
@pytest.mark.parametrize("fmt, K", [("fp16", 1000), ("fp16", 1004), ("int8", 1000), ("int4", 992)])
@pytest.mark.parametrize("mode", ["f32norm-f32", "f32norm-swiglu", "f16-add", "f16-f32"])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 17, 32, 33, 64])
def test_mma_small_n_kernel(fmt, K, mode, n):
    """cuda/mma_small_n.cu alone, as test_small_n_gemv_kernel (f32norm: rmsnorm_rows first, as the step)."""
    check_small_n_product(True, fmt, K, 334 if mode.endswith("swiglu") else 333, mode, n)


@pytest.mark.parametrize("fmt, K", [("fp16", 1004), ("int8", 1000), ("int4", 992)])
@pytest.mark.parametrize("mode", ["f32norm-f32", "f32norm-swiglu", "f16-add"])
@pytest.mark.parametrize("n", [1, 8, 9, 16])
def test_mma_small_n_two_tiles_a_block(fmt, K, mode, n):
    """The tensor-core kernel with two 16-row tiles a block (each input fragment meeting both tiles' weights): 333
    / 334 rows make 11 blocks of 32, the last one partial."""
    check_small_n_product(True, fmt, K, 334 if mode.endswith("swiglu") else 333, mode, n, m_tiles=2)


# A residual (add) product of up to 16 rows whose 16-row tiles fit one wave (one per SM) asks for up to 6 (int4) / 8
# chunks a warp at once (mma_small_n.cu's deep unroll); past one wave it keeps the shallow unroll. Widths where a
# warp's chunks take more than one pass of the deep unroll (fp16 5,632: down's, 3 passes; fp16 6,196: a partial
# word and chunk in the last pass; int8 5,632: 2 passes; int4 6,272: 49 chunks against 48 a pass) and below one.
@pytest.mark.parametrize("fmt, K", [("fp16", 5632), ("fp16", 6196), ("int8", 5632), ("int4", 6272), ("int4", 992)])
@pytest.mark.parametrize("n", [1, 9, 16])
def test_mma_small_n_residual_deep_unroll(fmt, K, n):
    check_small_n_product(True, fmt, K, 333, "f16-add", n)


@pytest.mark.parametrize("fmt, K", [("fp16", 1004), ("fp16", 5632), ("int8", 1000), ("int4", 6272)])
@pytest.mark.parametrize("n", [1, 9])
def test_mma_small_n_residual_past_one_wave(fmt, K, n):
    """Past one wave (six 16-row tiles more than the device's SMs, the last one partial) the shallow unroll."""
    check_small_n_product(True, fmt, K, (_core.ops.sm_count() + 6) * 16 - 5, "f16-add", n)



# The decode step's one-row tensor-core kernel (cuda/mma_one_row.cu, gemv_pins R = 16): against numpy, and at fp16 /
# int4 bit for bit what the batched step's kernel gives for the same row on its register ring (mma_small_n at n = 1;
# f32norm after rmsnorm_rows), so neither the norm in its prologue nor its staged, zero-padded input changes a bit
# (int8 scales each block's sum after the product instead: nearer numpy's exact product than the batched kernel). K: a
# partial word or chunk (fp16 1,004; 1,001, not a multiple of 4: the scalar sum of squares; int8 1,000; int4 992), a
# partial last chunk refilled into a used register slot (65 chunks a row against 64 in flight: fp16 2,052, int8 4,104;
# int4 6,176: 49 against 48), fewer chunks than warps (fp16 40), down-sized and long rows (5,632; int4 6,272; fp16
# 16,384, the most a normed row takes; fp16 16,392, an f16 row past it: the batched kernel runs it). A normed row's
# staging: up to 2,048 (1,004) and up to 8,192 (2,052; 8,096, where its shared memory passes the default limit only
# with the static arrays counted; 8,192) held in registers, the general path past that and where K % 4 != 0 (1,001).
# Rows: a partial 16-row tile within one wave of blocks, and for the residual product (whose ring is deep in one wave)
# past one wave.
@pytest.mark.parametrize("fmt, K", [("fp16", 1004), ("fp16", 1001), ("fp16", 2052), ("fp16", 40), ("fp16", 5632),
                                    ("fp16", 8096), ("fp16", 8192), ("fp16", 16384), ("fp16", 16392), ("int8", 1000),
                                    ("int8", 4104), ("int8", 5632), ("int4", 992), ("int4", 6176), ("int4", 6272)])
@pytest.mark.parametrize("mode, wave", [("f32norm-f32", "one"), ("f32norm-swiglu", "one"), ("f16-f32", "one"),
                                        ("f16-add", "one"), ("f16-add", "past")])
def test_mma_one_row_matches_numpy_and_the_batched_kernel(fmt, K, mode, wave):
    ops = _core.ops
    rows = 333 if wave == "one" else (ops.sm_count() + 6) * 16 - 5
    rows += rows % 2 if mode.endswith("swiglu") else 0  # (swiglu: gate / up pairs)
    if not (mode.startswith("f32norm") and K > 16384):
        check_small_n_product(True, fmt, K, rows, mode, 1, one_row=True)
    rng = np.random.default_rng(K + rows)
    W = rng.standard_normal((rows, K), dtype=np.float32) * 0.1
    X = rng.standard_normal((1, K), dtype=np.float32)
    norm_w = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    Y0 = rng.standard_normal((1, rows), dtype=np.float32)
    inp, out = mode.split("-")
    gin = {"f16": ops.GemvIn.F16, "f32norm": ops.GemvIn.F32Norm}[inp]
    gout = {"f32": ops.GemvOut.F32, "add": ops.GemvOut.AddF32, "swiglu": ops.GemvOut.Swiglu}[out]
    args = (W, fmt, X, norm_w, 1e-5, Y0, gin, gout)
    if inp == "f32norm" and K > 16384:
        with pytest.raises(InvalidRequestError, match=r"\(f32norm\) K <= 16384"):
            ops.gemv_batch(*args, mma=True, one_row=True)
        return
    one = ops.gemv_batch(*args, mma=True, one_row=True)
    batched = ops.gemv_batch(*args, mma=True, smem_ring=False)
    if fmt == "int8":  # d applied after the product, to exact q: nearer the exact product than fp16(d q) weights
        if out != "swiglu":  # (whose fp16 outputs round the difference away)
            y = small_n_reference(W, fmt, X, norm_w, Y0, mode)[2]
            assert np.abs(one - y).max() < np.abs(batched - y).max()
    else:
        np.testing.assert_array_equal(one, batched)


def test_mma_one_row_refuses_what_it_does_not_run():
    W, X = np.zeros((32, 64), np.float32), np.zeros((2, 64), np.float32)
    ops = _core.ops
    norm, y = np.ones(64, np.float32), np.zeros((1, 32), np.float32)
    with pytest.raises(InvalidRequestError, match="one input row"):
        ops.gemv_batch(W, "fp16", X, norm, 1e-5, np.zeros((2, 32), np.float32), ops.GemvIn.F32Norm,
                       ops.GemvOut.F32, mma=True, one_row=True)
    with pytest.raises(InvalidRequestError, match="an f16 input's out must be f32 or add"):
        ops.gemv_batch(W, "fp16", X[:1], norm, 1e-5, y, ops.GemvIn.F16, ops.GemvOut.Swiglu, mma=True, one_row=True)
    with pytest.raises(InvalidRequestError, match="a normed input's out must be f32 or swiglu"):
        ops.gemv_batch(W, "fp16", X[:1], norm, 1e-5, y, ops.GemvIn.F32Norm, ops.GemvOut.AddF32, mma=True,
                       one_row=True)
    with pytest.raises(InvalidRequestError, match="one_row is a tensor-core kernel"):
        ops.gemv_batch(W, "fp16", X[:1], norm, 1e-5, y, ops.GemvIn.F16, ops.GemvOut.F32, one_row=True)
    with pytest.raises(InvalidRequestError, match="one_row takes no m_tiles"):
        ops.gemv_batch(W, "fp16", X[:1], norm, 1e-5, y, ops.GemvIn.F16, ops.GemvOut.F32, mma=True, m_tiles=2,
                       one_row=True)


# fp16 on the tensor-core kernel goes through its shared-memory ring (cp.async) unless told not to: the same
# arithmetic in the same order as the register ring, so the same bits, at partial words and chunks (1000, 1004), a
# deep one-wave ring over several passes (5,632, 6,196 at 333 rows: 21 tiles) and the multi-wave ring (past one
# wave of tiles), every column-tile count and both tile counts a block.
@pytest.mark.parametrize("K, rows", [(1000, 333), (1004, 333), (5632, 333), (6196, 333), (1004, None)])
@pytest.mark.parametrize("mode", ["f32norm-f32", "f32norm-swiglu", "f16-add"])
@pytest.mark.parametrize("n, m_tiles", [(1, 0), (7, 0), (9, 0), (16, 2), (17, 0), (33, 0), (64, 0)])
def test_mma_small_n_ring_matches_register_ring(K, rows, mode, n, m_tiles):
    ops = _core.ops
    rows = rows or (ops.sm_count() + 6) * 16 - 5  # past one wave
    rows += rows % 2 if mode.endswith("swiglu") else 0  # (swiglu: gate / up pairs)
    rng = np.random.default_rng(n + K)
    W = rng.standard_normal((rows, K), dtype=np.float32) * 0.1
    X = rng.standard_normal((n, K), dtype=np.float32)
    norm_w = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    Y0 = rng.standard_normal((n, rows), dtype=np.float32)
    inp, out = mode.split("-")
    gin = {"f16": ops.GemvIn.F16, "f32norm": ops.GemvIn.F32Norm}[inp]
    gout = {"f32": ops.GemvOut.F32, "add": ops.GemvOut.AddF32, "swiglu": ops.GemvOut.Swiglu}[out]
    ring = ops.gemv_batch(W, "fp16", X, norm_w, 1e-5, Y0, gin, gout, mma=True, m_tiles=m_tiles)
    regs = ops.gemv_batch(W, "fp16", X, norm_w, 1e-5, Y0, gin, gout, mma=True, m_tiles=m_tiles, smem_ring=False)
    assert np.isfinite(ring).all()
    np.testing.assert_array_equal(ring, regs)


# The down product in K slices (one strided-batched cuBLASLt launch, GemmArgs::k_slices) and the kernel that adds
# the slices into the residual and writes the next RMSNorm (batch_rows.cuh residual_norm_rows): against numpy in
# float64, and bit for bit against rmsnorm_rows on the same x (both end in rms_row.cuh). Widths: TinyLlama's down
# (2,048 x 5,632), rows that need one (1,000), four (3,000) and eight (8,192) float4s a thread; every slice count
# the option takes; rows 1..16 (the option's range). The driver fails if anything past a row's width was written.
@pytest.mark.parametrize("M, K", [(2048, 5632), (1000, 512), (3000, 256), (8192, 256)])
@pytest.mark.parametrize("slices", [2, 4, 8])
@pytest.mark.parametrize("N", [1, 5, 16])
@pytest.mark.parametrize("autotune", [True, False])
def test_down_in_k_slices_with_the_next_norm(M, K, slices, N, autotune):
    ops = _core.ops
    rng = np.random.default_rng(M + K + slices + N)
    W = (rng.standard_normal((M, K)) * 0.05).astype(np.float16)
    X = rng.standard_normal((N, K)).astype(np.float16)
    x0 = rng.standard_normal((N, M)).astype(np.float32) * 3
    norm_w = (1 + 0.2 * rng.standard_normal(M)).astype(np.float32)
    x, xn = ops.sliced_residual_norm(W.view(np.uint16), X.astype(np.float32), x0, norm_w, 1e-5, slices, autotune)
    want = x0 + X.astype(np.float64) @ W.astype(np.float64).T
    np.testing.assert_allclose(x, want, rtol=1e-4, atol=1e-3 * np.sqrt(K) * 0.05)
    assert np.isfinite(xn).all()
    np.testing.assert_array_equal(xn, ops.rmsnorm_rows(x, norm_w, 1e-5))
    np.testing.assert_allclose(xn, rms_ref(x, norm_w), rtol=2e-3, atol=1e-3)


def test_down_in_k_slices_refuses_a_k_it_cannot_cut():
    ops = _core.ops
    W, X = np.zeros((64, 100), np.float16), np.zeros((2, 100), np.float32)
    with pytest.raises(InvalidRequestError, match="k_slices 2 needs"):
        ops.sliced_residual_norm(W.view(np.uint16), X, np.zeros((2, 64), np.float32), np.ones(64, np.float32),
                                 1e-5, 2)


@pytest.mark.parametrize("H", [62, 1000, 1024, 2048, 3000, 4096, 8192, 8200])
def test_rmsnorm_rows_registers_match_the_grid_stride_kernel(H):
    """The norm that holds a row in registers (H <= 8,192, 16-byte rows; its weight read before the PDL wait) gives
    the grid-stride kernel's bits (same sums in the same order) and numpy's norm up to the fp16 rounding; 62 (not a
    multiple of 4) and 8,200 (past 8,192) take the grid-stride kernel either way."""
    ops = _core.ops
    rng = np.random.default_rng(H)
    X = rng.standard_normal((3, H), dtype=np.float32) * 4
    w = (1 + 0.2 * rng.standard_normal(H)).astype(np.float32)
    got = ops.rmsnorm_rows(X, w, 1e-5)
    np.testing.assert_array_equal(got, ops.rmsnorm_rows(X, w, 1e-5, in_registers=False))
    np.testing.assert_allclose(got, rms_ref(X, w), rtol=2e-3, atol=1e-3)


def test_mma_small_n_refuses_two_tiles_past_16_rows():
    ops = _core.ops
    W, X = np.zeros((64, 64), np.float32), np.zeros((17, 64), np.float32)
    with pytest.raises(InvalidRequestError, match="m_tiles 2 must be 0"):
        ops.gemv_batch(W, "fp16", X, np.ones(64, np.float32), 1e-5, np.zeros((17, 64), np.float32),
                       ops.GemvIn.F16, ops.GemvOut.F32, mma=True, m_tiles=2)


def test_mma_small_n_refuses_more_than_64_rows():
    ops = _core.ops
    W, X = np.zeros((16, 64), np.float32), np.zeros((65, 64), np.float32)
    with pytest.raises(InvalidRequestError, match="mma_small_n: bad shape n=65"):
        ops.gemv_batch(W, "fp16", X, np.ones(64, np.float32), 1e-5, np.zeros((65, 16), np.float32),
                       ops.GemvIn.F16, ops.GemvOut.F32, mma=True)


def act8_rule(x):
    """cuda/act8.cuh in numpy, in fp32 as the kernels compute it: per group of 32 d = amax / 127, xq = round half
    away from zero of x * (1 / d); the batched products' input fp16(d xq), widened to float32."""
    g = np.asarray(x, np.float32).reshape(-1, 32)
    d = (np.abs(g).max(1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    v = (g * inv).astype(np.float64)  # (the fp32 product, exactly)
    q = np.trunc(v + np.copysign(0.5, v)).astype(np.float32)
    return (d * q).astype(np.float16).astype(np.float32).reshape(np.shape(x))


def small_n_reference(W, fmt, X, norm_w, Y0, mode, act8=False):
    """The product in float64 from the dequantized weights and the fp16-rounded (normed) inputs, with act8 those
    rounded by act8_rule: (Wq, xin, y)."""
    inp, out = mode.split("-")
    Wq = (W.astype(np.float16) if fmt == "fp16" else _core.ops.dequantize_ref(W, fmt)).astype(np.float64)
    if inp == "f16":
        xin = X.astype(np.float16).astype(np.float64)
    else:  # the decode GEMV's rounding: fp16(w * (x * inv))
        inv = 1.0 / np.sqrt((X.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5)
        xin = (norm_w * (X * inv)).astype(np.float16).astype(np.float64)
    if act8:
        xin = act8_rule(xin).astype(np.float64)
    y = xin @ Wq.T
    if out == "add":
        y = y + Y0
    elif out == "swiglu":
        g, u = y[:, 0::2], y[:, 1::2]
        y = g / (1 + np.exp(-g)) * u
    return Wq, xin, y


def check_small_n_product(mma, fmt, K, rows, mode, n, m_tiles=0, one_row=False, act8=False):
    rng = np.random.default_rng(n * 7 + K + rows)
    W = rng.standard_normal((rows, K), dtype=np.float32) * 0.1
    X = rng.standard_normal((n, K), dtype=np.float32)
    norm_w = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32)
    Y0 = rng.standard_normal((n, rows), dtype=np.float32)
    ops = _core.ops
    inp, out = mode.split("-")
    gin = {"f16": ops.GemvIn.F16, "f32norm": ops.GemvIn.F32Norm}[inp]
    gout = {"f32": ops.GemvOut.F32, "add": ops.GemvOut.AddF32, "swiglu": ops.GemvOut.Swiglu}[out]
    got = ops.gemv_batch(W, fmt, X, norm_w, 1e-5, Y0, gin, gout, mma=mma, m_tiles=m_tiles, one_row=one_row,
                         act8=act8)

    Wq, xin, y = small_n_reference(W, fmt, X, norm_w, Y0, mode, act8)
    if act8 and fmt == "fp16":  # (fp32 sums: the rounding's effect stands out of the kernel's own error)
        plain = small_n_reference(W, fmt, X, norm_w, Y0, mode)[2]
        assert np.abs(got - y).max() < 0.25 * np.abs(plain - y).max()
    assert got.shape == y.shape and np.isfinite(got).all()
    # Tolerance, on the scale of a dot product (as test_gpu_quant.py): fp16 sums in fp32 (f32norm: an input may
    # round to the other fp16 neighbour, the rsqrt differing in its last bits); int8 / int4 dequantize to fp16
    # weights and sum a word's products in fp16 before widening; swiglu: relative to the largest output.
    tol = {"fp16": 5e-4, "int8": 4e-3, "int4": 1e-2}[fmt]
    scale = np.abs(Wq).max() * np.abs(xin).max() * np.sqrt(K)
    atol = (tol + 3e-3) * np.abs(y).max() if out == "swiglu" else tol * scale
    np.testing.assert_allclose(got, y, rtol=0, atol=atol)


# act8: the batched step's inputs of a product whose decode GEMV takes int8 inputs, rounded to fp16(d xq) per group
# of 32 (cuda/act8.cuh) — by gemv_batch's prologue (f32norm), by rmsnorm_rows before the tensor-core kernel, by
# act8_round_rows before either (f16) — on both kernels, K whole groups (int4 992: a partial chunk).
@pytest.mark.parametrize("mma", [False, True])
@pytest.mark.parametrize("fmt, K", [("fp16", 96), ("int8", 1056), ("int4", 992)])
@pytest.mark.parametrize("mode", ["f32norm-f32", "f32norm-swiglu", "f16-add"])
@pytest.mark.parametrize("n", [1, 3, 9])
def test_small_n_products_on_act8_inputs(mma, fmt, K, mode, n):
    check_small_n_product(mma, fmt, K, 70, mode, n, act8=True)


# The rounding itself, bit for bit against the rule: rmsnorm_rows' register kernel (H a whole number of warps' 128
# columns or not: 2080 leaves lanes of a warp past H in the group shuffles) and act8_round_rows (which must leave
# the row's columns past K alone: checked by its driver); an all-zero group (d = 0) and one dominated by a value.
@pytest.mark.parametrize("H", [32, 96, 2048, 2080, 5632])
def test_act8_rounding_is_the_rule_bit_for_bit(H):
    ops = _core.ops
    rng = np.random.default_rng(H)
    X = rng.standard_normal((5, H), dtype=np.float32) * 3
    X[1, :32] = 0
    X[2, 5] = 300
    w = (1 + 0.3 * rng.standard_normal(H)).astype(np.float32)
    np.testing.assert_array_equal(ops.rmsnorm_rows(X, w, 1e-5, act8=True), act8_rule(ops.rmsnorm_rows(X, w, 1e-5)))
    np.testing.assert_array_equal(ops.act8_round_rows(X), act8_rule(X.astype(np.float16)))


def test_act8_rounding_refuses_what_it_cannot_round():
    ops = _core.ops
    with pytest.raises(InvalidRequestError, match="K % 32 == 0"):
        ops.act8_round_rows(np.zeros((2, 40), np.float32))
    with pytest.raises(InvalidRequestError, match="act8 needs H % 32 == 0"):
        ops.rmsnorm_rows(np.zeros((2, 40), np.float32), np.ones(40, np.float32), 1e-5, act8=True)
    with pytest.raises(InvalidRequestError, match="act8 needs"):  # (the register kernel only)
        ops.rmsnorm_rows(np.zeros((2, 64), np.float32), np.ones(64, np.float32), 1e-5, in_registers=False, act8=True)
    W, X = np.zeros((32, 40), np.float32), np.zeros((2, 40), np.float32)
    norm, y = np.ones(40, np.float32), np.zeros((2, 32), np.float32)
    with pytest.raises(InvalidRequestError, match="act8 rounds an f32norm input with K % 32 == 0"):
        ops.gemv_batch(W, "fp16", X, norm, 1e-5, y, ops.GemvIn.F32Norm, ops.GemvOut.F32, act8=True)
    with pytest.raises(InvalidRequestError, match="K % 32 == 0"):
        ops.gemv_batch(W, "fp16", X, norm, 1e-5, y, ops.GemvIn.F16, ops.GemvOut.AddF32, act8=True)
    with pytest.raises(InvalidRequestError, match="not one_row's"):
        ops.gemv_batch(np.zeros((32, 32), np.float32), "fp16", np.zeros((1, 32), np.float32), np.ones(32, np.float32),
                       1e-5, np.zeros((1, 32), np.float32), ops.GemvIn.F16, ops.GemvOut.F32, mma=True, one_row=True,
                       act8=True)
    check_small_n_product(False, "int4", 992, 70, "f16-add", 3, act8=True)  # and the kernels still run


@pytest.mark.parametrize("fmt,act8", [("int8", 2), ("int4", 2), ("int4", -2)])
def test_act8_prefill_rounds_as_the_decode_step(model, fmt, act8):
    """With act8 = 2 (int4: also -2, down's input left in fp16) the prefill's GEMMs take their inputs rounded as the
    decode GEMVs quantize theirs: a prompt's last logits from Engine.logits (one prefill) and from a decode step over
    the same tokens agree within ACT8_LOGIT_TOL, and closer than act8 = 0's prefill does (the rounding is what brings
    them together)."""
    on, off = gpu_engine(model, fmt, act8=act8), gpu_engine(model, fmt)
    p = prompts(3, seed=5)[2]  # (75 tokens)
    core = on._core
    s = core.seq_open()
    core.seq_prefill(s, p[:-1])
    core.seq_step([s], [p[-1]])  # (bucket 1: the decode plan's GEMVs, on int8 inputs)
    got = core.seq_logits(s).copy()
    core.seq_close(s)

    def rel(a, b):
        return float(np.abs(a - b).max() / np.abs(b).max())

    rounded, plain = rel(got, on.logits(p)[-1]), rel(got, off.logits(p)[-1])
    print(f"{model[0]} {fmt}: decode vs prefill {rounded:.2e} (rounded), {plain:.2e} (fp16 inputs)")
    assert rounded < ACT8_LOGIT_TOL and rounded < plain


# act8 (every quantized product on int8 inputs, CudaOptions.act8 = 2): the single path's GEMVs quantize their inputs,
# the batched products take them rounded to the same numbers (cuda/act8.cuh), on the default products and with every
# product on the tensor-core small-N kernel, on the CUDA-core one or on cuBLASLt (PATHS' mma, small_n, cublaslt);
# act8_nodown: int4's products but down's (act8 = -2; int4 only, elsewhere it is the default path).
NO_MMA = dict(batch_mma_max=0, batch_mma_f16_qkvo_max=0, batch_mma_f16_down_max=0)
ACT8_PATHS = {"act8": dict(act8=2), "act8_nodown": dict(act8=-2),
              "act8_mma": dict(batch_mma_max=64, batch_mma_f16_max=64, act8=2),
              "act8_small_n": dict(NO_MMA, batch_gemv_f16_max=64, batch_gemv_quant_max=64, act8=2),
              "act8_cublaslt": dict(NO_MMA, batch_gemv_f16_max=1, batch_gemv_quant_max=1, act8=2)}


@pytest.mark.parametrize("path", ["default", "mma", "span64", *ACT8_PATHS])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, 3, 8, 17])
def test_batch_greedy_equals_each_prompt_alone(model, fmt, n, path):
    """Each sequence of a batch picks the tokens it picks alone on the single-sequence path, up to the first
    step where the two paths' arithmetic (batched products vs the tuned GEMV) may legitimately differ: a near-tie
    of the top two logits. A divergence anywhere else fails. Default options (fp16: small-N at 1 row, cuBLASLt
    above; int8 / int4: small-N up to 4 rows, dequantize + cuBLASLt above) and the tensor-core kernel."""
    if path == "act8_nodown" and fmt != "int4":
        pytest.skip("act8 = -2 rounds int4's products only")
    eng = gpu_engine(model, fmt, **{**PATHS, **ACT8_PATHS}.get(path, {}))
    # A near-tie: within the two paths' rounding (with int8 inputs: ACT8_LOGIT_TOL's).
    tie = 2 * (ACT8_LOGIT_TOL if path in ACT8_PATHS and fmt != "fp16" else LOGIT_TOL[fmt])
    steps = 24
    batch = prompts(n, seed=n)
    got = generate_batch(eng._core, batch, steps)
    for p, g in zip(batch, got):
        alone = eng.generate(p, max_tokens=steps, ignore_eos=True).token_ids
        j = next((i for i in range(steps) if g[i] != alone[i]), steps)
        if j < steps:  # only at a near-tie of the single path's own logits at that step
            ref = eng.logits(p + alone[:j])[-1]
            top2 = np.sort(ref)[-2:]
            assert top2[1] - top2[0] <= tie * np.abs(ref).max(), (
                f"{model[0]} {fmt} batch {n}: prompt of {len(p)} diverges at step {j}: {g[:j + 1]} vs {alone[:j + 1]}")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("path", ["act8", "act8_mma"])
def test_act8_fused_rounding_changes_no_bit(model, fmt, path):
    """CudaOptions.batch_act8_fused: o's int8-rounded input written by the attention, or by act8_round_rows after it
    — the same numbers, so every slot's logits are bitwise equal both ways (5 and 20 rows: the tensor-core and, by
    default at 20, the cuBLASLt products). At head dim 128 the longest prompts cross the attention's span: its
    in-kernel merge writes the output."""
    kw = ACT8_PATHS[path]
    runs = {}
    for fused in (True, False):
        core = gpu_engine(model, fmt, **kw, batch_act8_fused=fused)._core
        for n in (5, 20):
            batch = prompts(n, seed=40 + n)
            slots = [core.seq_open() for _ in batch]
            for sl, pr in zip(slots, batch):
                core.seq_prefill(sl, pr)
            got = []
            toks = [7 + 3 * i for i in range(n)]
            for _ in range(3):
                core.seq_step(slots, toks)
                got.append(np.stack([core.seq_logits(sl).copy() for sl in slots]))
                toks = [int(v) for v in got[-1].argmax(-1)]
            for sl in slots:
                core.seq_close(sl)
            runs[(fused, n)] = got
    for n in (5, 20):
        for a, b in zip(runs[(True, n)], runs[(False, n)]):
            np.testing.assert_array_equal(a, b)


# The batched products' paths (BatchStep::mma, small_n): every product on the small-N GEMV; every product of two
# rows or more on cuBLASLt (int8 / int4: dequantized into the fp16 staging first); the defaults (fp16: qkv and o
# on the tensor-core kernel up to 16 rows, the others on cuBLASLt); down on that kernel too; every product on the
# tensor-core small-N kernel (mma_two_tiles: two 16-row tiles a block up to 16 rows; mma_register_ring: fp16 through
# its register ring rather than its shared-memory ring); fp16 down on cuBLASLt with its own split-K and the RMSNorm
# kernel after it (down_unsliced: the default slices K in 4, one kernel of ours adding the slices, the residual and
# the next norm); every product on cuBLASLt with down in 8 K slices (every format, int8 / int4 dequantized first);
# the default products with
# the attention in blocks of 64 positions (rows past 64 split and merged in the kernel).
PATHS = {"small_n": dict(NO_MMA, batch_gemv_f16_max=64, batch_gemv_quant_max=64),
         "cublaslt": dict(NO_MMA, batch_gemv_f16_max=1, batch_gemv_quant_max=1),
         "default": {},
         "mma_down": dict(batch_mma_f16_down_max=16),
         "mma": dict(batch_mma_max=64, batch_mma_f16_max=64),
         "mma_two_tiles": dict(batch_mma_max=64, batch_mma_f16_max=64, batch_mma_m_tiles=2),
         "mma_register_ring": dict(batch_mma_max=64, batch_mma_f16_max=64, batch_mma_ring=False),
         "down_unsliced": dict(batch_down_k_slices=0),
         "down_k_slices_cublaslt": dict(NO_MMA, batch_gemv_f16_max=1, batch_gemv_quant_max=1, batch_down_k_slices=8),
         "span64": dict(batch_attn_span=64),
         "heads8": dict(batch_attn_heads=8)}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_step_logits_match_cpu_engine(model, fmt, path):
    """The logits a batched step leaves in each slot, against the CPU engine (same weights, same quantization,
    fp32 arithmetic) on the same tokens, and against the GPU's own single-sequence path; on both product paths
    (5 rows: bucket 8)."""
    eng = gpu_engine(model, fmt, **PATHS[path])
    cpu = Engine(model[1], device="cpu", dtype=fmt if fmt != "fp16" else "fp32", max_seq_len=MAX_SEQ)
    core = eng._core
    batch = prompts(5, seed=11)
    nxt = [7 + 13 * i for i in range(len(batch))]
    slots = [core.seq_open() for _ in batch]
    for s, p in zip(slots, batch):
        core.seq_prefill(s, p)
    core.seq_step(slots, nxt)
    for s, p, t in zip(slots, batch, nxt):
        assert core.seq_length(s) == len(p) + 1
        got = core.seq_logits(s)
        want = cpu.logits(p + [t])[-1]
        single = eng.logits(p + [t])[-1]
        rel_cpu = np.abs(got - want).max() / np.abs(want).max()
        rel_single = np.abs(got - single).max() / np.abs(single).max()
        print(f"{model[0]} {fmt} {path} prompt {len(p)}: rel err vs CPU {rel_cpu:.2e}, "
              f"vs the single path {rel_single:.2e}")
        assert np.isfinite(got).all()
        assert rel_cpu < LOGIT_TOL[fmt]
        assert rel_single < LOGIT_TOL[fmt]
    if fmt == "fp16" and path == "default":  # (5 rows: down on cuBLASLt in 4 K slices, tuned at bucket 16)
        assert any(g["out"] == "f32/4k" for g in core.gemm_table()), core.gemm_table()
    for s in slots:
        core.seq_close(s)


# Bucket 1 on the decode plan's GEMVs (CudaOptions::batch_one_row_plan, batch_step.cu's record_one_row): the fixed
# R = 2 of these tests' engines, split-K, and the one-row tensor-core product pinned on every role.
ONE_ROW_PLANS = {"R2": {}, "split_k": dict(gemv_rows=8),
                 "mma_one_row": dict(gemv_pins=tuple((r, 16, 0) for r in ("Qkv", "O", "GateUp", "Down", "LmHead")))}


@pytest.mark.parametrize("plan", sorted(ONE_ROW_PLANS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_row_bucket_on_the_decode_plan(model, fmt, plan):
    """A lone slot's steps (bucket 1) on the decode GEMVs: each step's logits against the CPU engine and the single
    path on the same tokens, over steps that cross a page; and not the small-N kernels' bits (the same engine with
    batch_one_row_plan off), so the option does switch the products."""
    kw = ONE_ROW_PLANS[plan]
    eng = gpu_engine(model, fmt, **kw)
    off = gpu_engine(model, fmt, **kw, batch_one_row_plan=False)
    cpu = Engine(model[1], device="cpu", dtype=fmt if fmt != "fp16" else "fp32", max_seq_len=MAX_SEQ)
    p = prompts(3, seed=21)[2][:60]  # 60 tokens: the steps below cross the first 64-position page
    toks = [11 + 17 * k for k in range(8)]
    runs = {}
    for name, e in (("plan", eng), ("small_n", off)):
        core = e._core
        free = core.kv_pages_free  # (the single sequence may hold pages from another test's logits())
        s = core.seq_open()
        core.seq_prefill(s, p)
        runs[name] = []
        for t in toks:
            core.seq_step([s], [t])
            runs[name].append(core.seq_logits(s).copy())
        core.seq_close(s)
        assert core.kv_pages_free == free
    for k in (0, 3, 4, 7):
        seq = p + toks[:k + 1]
        want, single = cpu.logits(seq)[-1], eng.logits(seq)[-1]
        for name, got in runs.items():
            rel_cpu = np.abs(got[k] - want).max() / np.abs(want).max()
            rel_single = np.abs(got[k] - single).max() / np.abs(single).max()
            print(f"{model[0]} {fmt} {plan} {name} step {k}: rel err vs CPU {rel_cpu:.2e}, single {rel_single:.2e}")
            assert np.isfinite(got[k]).all() and rel_cpu < LOGIT_TOL[fmt] and rel_single < LOGIT_TOL[fmt]
    # (int4 with R = 16 pinned: its products are bitwise the small-N kernel's at one row, but the int8 LM head's are
    # not: mma_one_row scales int8 blocks after the product)
    assert any(not np.array_equal(a, b) for a, b in zip(runs["plan"], runs["small_n"]))


@pytest.mark.parametrize("path", ["small_n", "mma"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_padded_bucket_is_exact(model, fmt, path):
    """3 sequences run in bucket 4 with one padding row; the same 3 with a real 4th sequence in that row; each of
    the 3 alone (bucket 1, here on the small-N kernels too: batch_one_row_plan off). The small-N kernels (CUDA-core
    or tensor-core, every format) compute every row the same way whatever its neighbours, so all three give the same
    logits bit for bit: the padding row writes no KV page (else the next steps would differ), reads nothing that
    leaks into a real row, and scatters no logits."""
    eng = gpu_engine(model, fmt, **PATHS[path], batch_one_row_plan=False)
    core = eng._core
    batch = prompts(4, seed=5)

    def run(members, steps=6):
        slots = [core.seq_open() for _ in members]
        for s, i in zip(slots, members):
            core.seq_prefill(s, batch[i])
        rows = {i: [] for i in members}
        tokens = [3 + i for i in members]
        for k in range(steps):
            core.seq_step(slots, tokens)
            for s, i in zip(slots, members):
                rows[i].append(core.seq_logits(s))
            tokens = [int(np.argmax(rows[i][-1])) for i in members]
        for s in slots:
            core.seq_close(s)
        return rows

    three, four = run([0, 1, 2]), run([0, 1, 2, 3])
    for i in range(3):
        alone = run([i])[i]
        for k in range(6):
            np.testing.assert_array_equal(three[i][k], four[i][k])
            np.testing.assert_array_equal(three[i][k], alone[k])


def test_pages_taken_on_demand_and_given_back(model):
    eng = gpu_engine(model, "fp16")
    core = eng._core
    core.reset()  # the single sequence gives back what earlier tests' generate() left it (it shares the pool)
    total, P = core.kv_pages_total, core.kv_page_size
    assert core.kv_pages_free == total and core.max_batch == 64
    assert total == 64 * -(-MAX_SEQ // P)  # the default pool: max_batch sequences of max_seq_len (small model)
    batch = prompts(6, seed=2)
    slots = [core.seq_open() for _ in batch]
    for s, p in zip(slots, batch):
        core.seq_prefill(s, p)
    assert core.kv_pages_free == total - sum(-(-len(p) // P) for p in batch)
    core.seq_step(slots, [1] * len(slots))
    assert core.kv_pages_free == total - sum(-(-(len(p) + 1) // P) for p in batch)
    for s in slots:
        core.seq_close(s)
    assert core.kv_pages_free == total
    assert [core.seq_open() for _ in range(3)] == [0, 1, 2]  # closed slots are free again
    for s in range(3):
        core.seq_close(s)


def test_pool_exhausted_is_a_request_error_and_engine_stays_usable(model):
    """A pool of 4 pages of 64: a prefill or a step that needs a page the pool lacks fails with
    InvalidRequestError, changes nothing, and the engine then gives the same numbers as a fresh one."""
    eng = Engine(model[1], device="cuda", max_seq_len=MAX_SEQ, cuda_options=options(kv_pool_pages=4))
    core = eng._core
    assert (core.kv_pages_total, core.kv_page_size) == (4, 64)
    ids = np.random.default_rng(9).integers(3, VOCAB, 255).tolist()
    a, b = core.seq_open(), core.seq_open()
    core.seq_prefill(a, ids)  # 255 positions, 4 pages: the whole pool
    assert core.kv_pages_free == 0
    with pytest.raises(InvalidRequestError, match="pool exhausted"):
        core.seq_prefill(b, [5, 6, 7])
    assert core.seq_length(b) == 0 and core.kv_pages_free == 0
    core.seq_step([a], [9])  # position 255: still in page 4
    with pytest.raises(InvalidRequestError, match="pool exhausted"):
        core.seq_step([a], [9])  # position 256 needs a 5th page
    assert core.seq_length(a) == 256
    with pytest.raises(InvalidRequestError, match="max_seq_len"):
        core.seq_prefill(b, [1] * (MAX_SEQ + 1))
    core.seq_close(a)
    assert core.kv_pages_free == 4
    core.seq_prefill(b, [5, 6, 7])
    core.seq_step([b], [8])
    fresh = Engine(model[1], device="cuda", max_seq_len=MAX_SEQ, cuda_options=options(kv_pool_pages=4))
    f = fresh._core.seq_open()
    fresh._core.seq_prefill(f, [5, 6, 7])
    fresh._core.seq_step([f], [8])
    np.testing.assert_array_equal(core.seq_logits(b), fresh._core.seq_logits(f))


def test_sample_logprobs_and_top_entries(model):
    """Greedy picks the argmax of the slot's logits; its logprob and the top entries are log_softmax of them
    (descending); the token joins the repetition-penalty history (a penalty then changes the pick)."""
    eng = gpu_engine(model, "fp16")
    core = eng._core
    s = core.seq_open()
    core.seq_prefill(s, prompts(1, seed=4)[0])
    z = core.seq_logits(s).astype(np.float64)
    lsm = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    toks, lp, top_ids, top_lp = core.seq_sample([s], [greedy()], [0], 5)
    assert toks.dtype == np.int32 and toks.shape == (1,) and top_ids.shape == (1, 5) and top_lp.shape == (1, 5)
    assert toks[0] == np.argmax(z)
    np.testing.assert_allclose(lp[0], lsm[toks[0]], atol=1e-4)
    np.testing.assert_array_equal(top_ids[0], np.argsort(-z, kind="stable")[:5])
    np.testing.assert_allclose(top_lp[0], lsm[top_ids[0]], atol=1e-4)
    pen = _core.SamplingConfig()
    pen.repetition_penalty = 1e6  # the token just picked (now in the history) is pushed below every other
    again, _, _, _ = core.seq_sample([s], [pen], [1], 0)
    assert again[0] != toks[0] and z[toks[0]] > 0
    core.seq_close(s)


def test_logits_of_a_slot_left_out_of_a_step(model):
    """A slot's logits stay in the step row that computed them (no copy to a per-slot buffer); a later step
    without that slot overwrites the row (a smaller bucket: row 0; padding rows too), so the engine moves them to
    the slot's own row first: seq_logits and seq_sample (with logprobs) still see them, in any order of steps."""
    eng = gpu_engine(model, "fp16")
    core = eng._core
    batch = prompts(3, seed=21)
    slots = [core.seq_open() for _ in batch]
    for s, p in zip(slots, batch):
        core.seq_prefill(s, p)
    core.seq_step(slots, [5, 6, 7])
    before = [core.seq_logits(s) for s in slots]
    core.seq_step([slots[2]], [9])  # bucket 1: row 0, slot 0's
    np.testing.assert_array_equal(core.seq_logits(slots[0]), before[0])
    np.testing.assert_array_equal(core.seq_logits(slots[1]), before[1])
    core.seq_step([slots[2], slots[1]], [3, 4])  # bucket 2: rows 0 and 1, slot 1 now in row 1
    np.testing.assert_array_equal(core.seq_logits(slots[0]), before[0])
    z = before[0].astype(np.float64)
    toks, lp, _, _ = core.seq_sample([slots[1], slots[0]], [greedy()] * 2, [0, 0], 0)
    assert toks[1] == np.argmax(z)
    np.testing.assert_allclose(lp[1], z[toks[1]] - (z.max() + np.log(np.exp(z - z.max()).sum())), atol=1e-4)
    assert toks[0] == np.argmax(core.seq_logits(slots[1]))
    for s in slots:
        core.seq_close(s)


def test_bad_slot_requests(model):
    eng = Engine(model[1], device="cuda", max_seq_len=MAX_SEQ, cuda_options=options(max_batch=2))
    core = eng._core
    assert core.max_batch == 2
    a, b = core.seq_open(), core.seq_open()
    with pytest.raises(InvalidRequestError, match="all 2 sequence slots are open"):
        core.seq_open()
    core.seq_prefill(a, [1, 2, 3])
    cases = [
        (lambda: core.seq_close(5), "slot 5 does not exist"),
        (lambda: core.seq_length(-1), "does not exist"),
        (lambda: core.seq_step([a, a], [1, 2]), "listed twice"),
        (lambda: core.seq_step([a], [1, 2]), "1 slots but 2 tokens"),
        (lambda: core.seq_step([a], [VOCAB]), "out of range"),
        (lambda: core.seq_step([], []), "no slots given"),
        (lambda: core.seq_prefill(a, []), "no tokens"),
        (lambda: core.seq_sample([b], [greedy()], [0], 0), "has no logits"),
        (lambda: core.seq_step([b], [1]), "has no logits"),
        (lambda: core.seq_sample([a], [greedy()], [0], 21), "0..20"),
    ]
    for call, msg in cases:
        with pytest.raises(InvalidRequestError, match=msg):
            call()
    core.seq_close(b)
    with pytest.raises(InvalidRequestError, match="not open"):
        core.seq_step([b], [1])
    assert core.seq_length(a) == 3  # nothing above changed the open slot
    core.seq_close(a)
    with pytest.raises(InvalidRequestError, match="not open"):
        core.seq_close(a)
    bad = _core.CudaOptions()
    bad.max_batch = 0
    with pytest.raises(InvalidRequestError, match="max_batch must be"):
        Engine(model[1], device="cuda", max_seq_len=MAX_SEQ, cuda_options=bad)


def test_single_sequence_is_independent_of_the_slots(model):
    """The single-sequence API (forward / decode) and the slots share only the page pool: slot work between a
    forward() and its decode() changes none of the single sequence's tokens, and the other way round."""
    eng = gpu_engine(model, "fp16")
    core = eng._core
    p, q = prompts(3, seed=8)[1:]
    core.reset()
    core.forward(p)
    want = core.decode(20, greedy(), [], 0)
    s = core.seq_open()
    core.seq_prefill(s, q)
    core.seq_step([s], [4])
    slot_want = core.seq_logits(s)
    core.seq_close(s)

    core.reset()
    core.forward(p)
    s = core.seq_open()
    core.seq_prefill(s, q)  # between forward() and decode()
    got = core.decode(20, greedy(), [], 0)
    core.reset()
    core.forward(q)  # between the slot's prefill and its step
    core.seq_step([s], [4])
    np.testing.assert_array_equal(core.seq_logits(s), slot_want)
    assert got == want
    core.seq_close(s)
    core.reset()


def test_sampling_a_slot_alone_or_in_a_batch(model):
    """seq_sample (cuda::sample_rows) with temperature, top-p and penalties: a slot's token depends on its own
    logits, config, step counter and history only, so three slots sampled together pick what each picks alone
    (alone on the same small-N products, batch_one_row_plan off: the logits the same bit for bit)."""
    eng = gpu_engine(model, "fp16", batch_one_row_plan=False)
    core = eng._core
    batch = prompts(4, seed=12)[1:]

    def cfg(i):
        c = _core.SamplingConfig()
        c.temperature, c.top_p, c.seed = 0.8, 0.9, 100 + i
        c.repetition_penalty, c.presence_penalty, c.frequency_penalty = 1.1, 0.3, 0.2
        return c

    def run(members, steps=5):
        slots = [core.seq_open() for _ in members]
        for s, i in zip(slots, members):
            core.seq_prefill(s, batch[i])
        out = {i: [] for i in members}
        for k in range(steps):
            toks, lp, _, _ = core.seq_sample(slots, [cfg(i) for i in members], [k] * len(members), 0)
            assert np.isfinite(lp).all() and (lp <= 0).all()
            for i, t in zip(members, toks):
                out[i].append(int(t))
            core.seq_step(slots, toks.tolist())
        for s in slots:
            core.seq_close(s)
        return out

    together = run([0, 1, 2])
    for i in range(3):
        assert run([i])[i] == together[i]


@pytest.mark.parametrize("field, value, match", [
    ("batch_gemv_f16_max", -1, "batch_gemv_f16_max must be >= 0"),
    ("batch_gemv_quant_max", -1, "batch_gemv_quant_max must be >= 0"),
    ("batch_mma_max", -1, "batch_mma_max must be in 0..64, got -1"),
    ("batch_mma_max", 65, "batch_mma_max must be in 0..64, got 65"),
    ("batch_mma_f16_qkvo_max", 65, "batch_mma_f16_qkvo_max must be in 0..64, got 65"),
    ("batch_mma_f16_max", 65, "batch_mma_f16_max must be in 0..64, got 65"),
    ("batch_mma_f16_down_max", -1, "batch_mma_f16_down_max must be in 0..64, got -1"),
    ("batch_down_k_slices", 9, "batch_down_k_slices must be 0, 1, 2, 4 or 8, got 9"),
    ("batch_down_k_slices", 3, "batch_down_k_slices must be 0, 1, 2, 4 or 8, got 3"),
    ("batch_mma_m_tiles", 3, r"batch_mma_m_tiles must be 0 \(auto\), 1 or 2, got 3"),
    ("batch_attn_span", 96, "batch_attn_span 96 must be 64, 128 or 256 and at most 256 at head dim 64"),
    ("batch_attn_span", 512, "batch_attn_span 512 must be"),
    ("batch_attn_heads", 3, "batch_attn_heads 3 must be 0"),
])
def test_bad_batch_path_options_are_clear_errors(field, value, match):
    from tinyinfer.bench import shape_config

    o = _core.CudaOptions()
    setattr(o, field, value)
    with pytest.raises(InvalidRequestError, match=match):
        _core.CudaEngine.random(shape_config("smollm2-135m"), 256, 1, o)



@pytest.mark.parametrize("fmt", ["fp16", "int4"])
def test_scheduler_overlap_gives_the_same_tokens(model, fmt):
    """The scheduler launching each next decode step before its per-token work (overlap) and not: the same tokens,
    greedy and seeded, with requests joining while others are stepped ahead and one cancelled while its launched
    step is in flight (its slot closed under it, then opened and prefilled for the next request); the pool empty
    after either."""
    from tinyinfer import SamplingParams, Scheduler

    eng = gpu_engine(model, fmt)
    ps = prompts(12, seed=3)
    sps = [SamplingParams(max_tokens=3 + 5 * (i % 4), temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True)
           for i in range(12)]
    out = {}
    for overlap in (True, False):
        if eng._scheduler is not None:
            eng._scheduler.close()
        sched = Scheduler(eng, overlap=overlap, mixed_steps=False, max_batch=min(8, int(eng._core.max_batch)),
                          chunk_tokens=256)
        reqs = [sched.submit(p, sp) for p, sp in zip(ps[:6], sps[:6])]
        for _ in range(3):
            sched.step()
        reqs[1].cancel()
        reqs += [sched.submit(p, sp) for p, sp in zip(ps[6:], sps[6:])]
        while sched.step():
            pass
        out[overlap] = [(r.result().token_ids, r.result().finish_reason) for r in reqs]
        sched.close()
        assert eng._core.kv_pages_free == eng._core.kv_pages_total
    assert out[True] == out[False]
    assert out[True][1][1] == "cancelled" and 0 < len(out[True][1][0]) < 8
