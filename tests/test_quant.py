"""Weight-only int8 / int4 formats (cpp/core/quant.h): the reference packer's invariants on named and random inputs,
and the CPU engine computing with the dequantized weights. The GPU quantizer, kernels and engine are checked
against these in test_gpu_quant.py."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_llama
from tinyinfer import Engine, InvalidRequestError, UnsupportedModelError, _core

POS = [0, 16, 4, 20, 8, 24, 12, 28]  # nibble offsets of weights 0..7 inside a 32-bit word


def f16(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def unpack_i4(q: np.ndarray, K: int) -> np.ndarray:
    words = q.view(np.uint32).reshape(q.shape[0], K // 8)
    out = np.zeros((q.shape[0], K), np.int64)
    for i, p in enumerate(POS):
        out[:, i::8] = (words >> p) & 0xF
    return out


# int8's layout (blocks of 32, GGUF Q8_0's numbers) is checked in test_int8_blocks.py.


@pytest.mark.parametrize("rows,K", [(1, 32), (5, 96), (33, 512), (2, 4096)])
def test_int4_round_trip_and_nibble_order(rows, K):
    rng = np.random.default_rng(rows + K)
    W = rng.standard_normal((rows, K)).astype(np.float32)
    W[0, :32] = np.arange(32) % 16  # a group holding 0..15 twice: scale 1, min 0, q = the values
    p = _core.ops.quantize_ref(W, "int4")
    assert p["q"].shape == (rows, K // 2)
    q = unpack_i4(p["q"], K)
    np.testing.assert_array_equal(q[0, :32], np.arange(32) % 16)
    sm = p["scales"].view(np.float16).astype(np.float32).reshape(rows, K // 32, 2)
    assert sm[0, 0, 0] == 1.0 and sm[0, 0, 1] == 0.0
    d = _core.ops.dequantize_ref(W, "int4")
    want = sm[:, :, :1] * q.reshape(rows, K // 32, 32) + sm[:, :, 1:]
    np.testing.assert_allclose(d, want.reshape(rows, K), rtol=1e-6, atol=1e-7)
    g = f16(W).reshape(rows, K // 32, 32)
    step = (g.max(-1) - g.min(-1)) / 15
    err = np.abs(d.reshape(rows, K // 32, 32) - g)
    assert (err <= step[..., None] * 0.5 + np.abs(g).max() * 2e-3).all()  # half a step, plus fp16 scale/min rounding


def test_int4_needs_multiples_of_32():
    with pytest.raises(UnsupportedModelError, match="multiple of 32"):
        _core.ops.quantize_ref(np.ones((2, 40), np.float32), "int4")
    with pytest.raises(InvalidRequestError, match="fp16 \\| int8 \\| int4"):
        _core.ops.quantize_ref(np.ones((2, 32), np.float32), "int3")


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("q"), hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2,
                      head_dim=64, vocab=512)


MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_cpu_engine_computes_with_the_dequantized_weights(small_model, dtype):
    """Engine(dtype=...) on the CPU == an fp32 engine built from dequantize_ref(W) for every matrix."""
    from tinyinfer.loaders import load_model

    model = load_model(small_model)
    store = _core.WeightStore(model.config)
    for name, arr, src in model.tensors():
        arr = np.ascontiguousarray(arr, np.float32)
        if arr.ndim == 2 and any(m in name for m in MATRICES):
            head = name == "lm_head.weight"
            arr = _core.ops.dequantize_ref(arr, "int8" if head and dtype == "int4" else dtype)  # int4: int8 head
        store.add(name, arr, "fp32")
    store.finish()
    ids = np.random.default_rng(1).integers(3, 512, 40).tolist()
    want = _core.CpuEngine(store, 64).forward(ids, all_logits=True)
    eng = Engine(small_model, device="cpu", dtype=dtype)
    assert eng.dtype == dtype
    got = eng.logits(ids)
    np.testing.assert_array_equal(got, want)
    ref = Engine(small_model, device="cpu").logits(ids)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"{dtype}: random-weight model, max rel logit change vs fp32 {rel:.3e}")
    assert rel > 0  # the weights did change
    assert eng.generate(ids[:5], max_tokens=4, ignore_eos=True).token_ids  # usable


def test_int4_refuses_widths_that_are_not_multiples_of_32(tmp_path):
    d = make_llama(tmp_path / "m", hidden=256, intermediate=333, layers=1, vocab=300)
    with pytest.raises(UnsupportedModelError, match="multiples of 32.*333"):
        Engine(d, device="cpu", dtype="int4")
    assert Engine(d, device="cpu", dtype="int8").generate([1, 2], max_tokens=2, ignore_eos=True).token_ids


def int4_dequant(q: np.ndarray, sm: np.ndarray) -> np.ndarray:
    rows, K = q.shape[0], q.shape[1] * 2
    qv = unpack_i4(q, K).astype(np.float32).reshape(rows, K // 32, 32)
    s = sm.view(np.float16).astype(np.float32).reshape(rows, K // 32, 2)
    return (s[..., :1] * qv + s[..., 1:]).reshape(rows, K)


def test_gguf_q4_blocks_are_imported_without_a_second_rounding(tmp_path):
    from gguf_writer import q4_gguf
    from tinyinfer.loaders import load_model

    path = q4_gguf(tmp_path)
    model = load_model(path)
    blocks = {n: (q, sm) for n, q, sm in model.int4_blocks()}
    assert len(blocks) == 2 * 6 and not any("v_proj" in n for n in blocks)  # Q8_0 v is not int4
    fp = {n: a for n, a, _ in model.tensors()}
    for n, (q, sm) in blocks.items():  # the converted blocks stand for exactly gguf's dequantized values
        np.testing.assert_array_equal(int4_dequant(q, sm), fp[n], err_msg=n)

    # The int4 CPU engine computes with exactly those values (and int4-quantized v, an int8 head).
    store = _core.WeightStore(model.config)
    for n, a in fp.items():
        a = np.ascontiguousarray(a, np.float32)
        if "v_proj" in n:
            a = _core.ops.dequantize_ref(a, "int4")
        elif n == "lm_head.weight":
            a = _core.ops.dequantize_ref(a, "int8")
        store.add(n, a, "fp32")
    store.finish()
    ids = list(range(3, 40))
    want = _core.CpuEngine(store, 64).forward(ids, all_logits=True)
    got = Engine(path, device="cpu", dtype="int4", max_seq_len=64).logits(ids)
    np.testing.assert_array_equal(got, want)


def act8_np(x):
    """act8's rule in numpy (cpp/core/quant.h act8_round, the GPU's cuda/act8.cuh): per group of 32 of the
    fp16-rounded values d = amax / 127 (fp32), xq = round half away from zero of x * (1 / d) (the fp32 product);
    d xq in fp32."""
    g = f16(x).reshape(-1, 32)
    d = (np.abs(g).max(1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    v = (g * inv).astype(np.float64)  # (the fp32 product, exactly)
    q = np.trunc(v + np.copysign(0.5, v)).astype(np.float32)
    return (d * q).astype(np.float32).reshape(np.shape(x))


def test_act8_rounding_is_the_rule():
    """The CPU engine's int8-input rounding, bit for bit: an all-zero group (d = 0), a group dominated by one value,
    exact halves (d = 1: ties away from zero), values off the fp16 grid (rounded to fp16 first); a partial last
    group stays as it is."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((4, 256)).astype(np.float32) * np.float32(3.3)
    X[1, :32] = 0
    X[2, 40] = 1e3
    X[3, 64:96] = np.r_[127, 0.5, 1.5, -2.5, -0.5, np.arange(27) - 13.5].astype(np.float32)
    got = _core.ops.act8_ref(X)
    np.testing.assert_array_equal(got, act8_np(X))
    assert list(got[3, 64:69]) == [127, 1, 2, -3, -1]
    Y = rng.standard_normal((2, 40)).astype(np.float32)
    got = _core.ops.act8_ref(Y)
    np.testing.assert_array_equal(got[:, :32], act8_np(Y[:, :32]))
    np.testing.assert_array_equal(got[:, 32:], Y[:, 32:])


def test_act8_twin_on_the_cpu(tmp_path):
    """Engine(act8=...) on the CPU, the twin of the GPU's int8 inputs: -1 rounds the inputs of the int4 matrices'
    products only (an int8 model is as act8 = 0), -2 those but down's (with the down matrices zero it is -1), 2 every
    quantized matrix's (int4's int8 LM head too); an fp32 model never changes; the rounding moves the logits a
    little; values with no CPU twin are refused."""
    d = make_llama(tmp_path / "m", hidden=128, intermediate=256, heads=2, kv_heads=1, vocab=300)
    ids = list(range(3, 40))

    def logits(dtype, act8):
        return Engine(d, device="cpu", dtype=dtype, max_seq_len=64, act8=act8).logits(ids)

    np.testing.assert_array_equal(logits("fp32", 2), logits("fp32", 0))
    np.testing.assert_array_equal(logits("int8", -1), logits("int8", 0))
    np.testing.assert_array_equal(logits("int8", -2), logits("int8", 0))
    base4, auto4, nodown4, all4, base8, all8 = (logits("int4", 0), logits("int4", -1), logits("int4", -2),
                                                logits("int4", 2), logits("int8", 0), logits("int8", 2))
    for a, b in ((auto4, base4), (nodown4, base4), (auto4, nodown4), (all4, auto4), (all8, base8)):
        assert 0 < np.abs(a - b).max() / np.abs(b).max() < 0.1
    assert Engine(d, device="cpu", dtype="int4", max_seq_len=64, act8=-2)._core.act8 == -2
    # -2 leaves exactly down's input alone: with every down matrix zero, that input meets nothing, and -2 is -1
    from safetensors.numpy import load_file, save_file

    w = load_file(d / "model.safetensors")
    for k in w:
        if k.endswith("mlp.down_proj.weight"):
            w[k] = np.zeros_like(w[k])
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    np.testing.assert_array_equal(logits("int4", -2), logits("int4", -1))
    assert np.abs(logits("int4", -2) - logits("int4", 0)).max() > 0
    for bad in (1, 3, -3):
        with pytest.raises(InvalidRequestError, match="act8 must be 0 .off., -1 .int4 matrices., -2 .* or 2"):
            Engine(d, device="cpu", dtype="int4", max_seq_len=64, act8=bad)
