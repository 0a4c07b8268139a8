"""int8 as blocks of 32 with an fp16 scale (cpp/core/quant.h: GGUF Q8_0's layout): the reference packer against
llama.cpp's numbers (gguf.quants), and GGUF Q8_0 / Q4_0 / Q4_1 tensors imported bit for bit (against
gguf.quants.dequantize), down to the CPU engine's logits. The GPU side is in test_gpu_quant.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from tinyinfer import Engine, InvalidRequestError, ModelFormatError, _core
from tinyinfer.loaders import load_model
from tinyinfer.loaders.gguf import reverse_rope_permute

import gguf_writer
from gguf_writer import MIXED


def f16(a):
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def llama_cpp_q8_0(W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's Q8_0 of W (rows, K), via gguf's bit-exact port of quantize_row_q8_0: (q int8, d fp16 bits)."""
    rows, K = W.shape
    raw = np.asarray(gguf.quants.quantize(W.astype(np.float32), Q.Q8_0)).reshape(rows, K // 32, 34)
    return raw[..., 2:].copy().view(np.int8).reshape(rows, K), raw[..., :2].copy().view(np.uint16)[..., 0]


def ref_blocks(W: np.ndarray):
    p = _core.ops.quantize_ref(W, "int8")
    return p["q"].astype(np.int64) - 128, p["scales"]


# ---- the reference packer ----

@pytest.mark.parametrize("rows,K", [(1, 32), (7, 96), (33, 512), (3, 4096)])
def test_int8_packer_gives_llama_cpps_q8_0(rows, K):
    rng = np.random.default_rng(rows * K)
    W = rng.standard_normal((rows, K)) * 0.05
    W[0, :32] = np.arange(32) - 15.5    # amax 15.5: d = 15.5 / 127, not a round number
    if rows > 1:
        W[1, :32] = 0.0                 # a zero block: d = 0, q = 0
        W[1, 32:64] = np.linspace(-127, 127, 32)
    W = f16(W)  # fp16 weights: the packer rounds its input to fp16 first, llama.cpp takes it as it is
    q, d = ref_blocks(W)
    want_q, want_d = llama_cpp_q8_0(W)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(d, want_d)


def test_int8_rounds_half_away_from_zero_like_roundf():
    W = np.zeros((1, 32), np.float32)
    W[0, :6] = [127.0, 0.5, -0.5, 2.5, -2.5, 1.5]  # amax 127: d = 1, q = roundf(w)
    q, d = ref_blocks(W)
    assert d[0, 0] == np.float16(1.0).view(np.uint16)
    np.testing.assert_array_equal(q[0, :6], [127, 1, -1, 3, -3, 2])  # rint would give 0, -0, 2, -2, 2


@pytest.mark.parametrize("rows,K", [(1, 16), (7, 333), (64, 500), (3, 4096)])
def test_int8_layout_and_round_trip(rows, K):
    rng = np.random.default_rng(K)
    W = rng.standard_normal((rows, K)).astype(np.float32)
    W[0, :5] = [3.0, -3.0, 0.0, 1e-3, -7.5]  # named values in the first block: its max |w| is 7.5
    p = _core.ops.quantize_ref(W, "int8")
    ld = (K + 31) // 32 * 32
    assert p["q"].shape == (rows, ld) and p["scales"].shape == (rows, ld // 32)
    assert (p["q"][:, K:] == 128).all()  # the padding of a partial last block is q = 0
    q, d = p["q"].astype(np.int64) - 128, p["scales"].view(np.float16).astype(np.float32)
    assert np.abs(q).max() <= 127
    assert q[0, 4] == -127 and q[0, 2] == 0 and d[0, 0] == np.float16(7.5 / 127)
    blocks = np.zeros((rows, ld), np.float32)
    blocks[:, :K] = f16(W)
    np.testing.assert_array_equal(d, f16(np.abs(blocks.reshape(rows, -1, 32)).max(-1) / 127))
    deq = _core.ops.dequantize_ref(W, "int8")
    want = (q.reshape(rows, -1, 32) * d[..., None]).reshape(rows, ld)[:, :K]
    np.testing.assert_array_equal(deq, want.astype(np.float32))
    # half a step of the fp32 d, plus the fp16 rounding of d (2^-11 relative) over up to 127 steps
    step = np.repeat(np.abs(blocks.reshape(rows, -1, 32)).max(-1) / 127, 32, axis=1)[:, :K]
    assert (np.abs(deq - f16(W)) <= step * (0.5 + 127 * 2**-11) + 1e-7).all()


def test_int8_zero_block_is_exact():
    W = np.zeros((2, 64), np.float32)
    W[1, 32:] = 1.0
    p = _core.ops.quantize_ref(W, "int8")
    assert (p["scales"][0] == 0).all() and (p["q"][0] == 128).all()
    d = _core.ops.dequantize_ref(W, "int8")
    np.testing.assert_array_equal(d[:, :32], 0.0)
    np.testing.assert_array_equal(d[1, 32:], np.float32(np.float16(1 / 127)) * 127)  # d is stored as fp16


# ---- import into the WeightStore ----

def _store(path, dtype):
    """The WeightStore Engine(path, dtype=dtype) builds (before quantize())."""
    model = load_model(path)
    store = _core.WeightStore(model.config)
    for name, arr, src in model.tensors():
        if not (model.config.tie_word_embeddings and name == "lm_head.weight"):
            store.add(name, arr, src)
    if dtype == "int4":
        for name, q, sm in model.int4_blocks():
            store.add_int4(name, q, sm)
    for name, q, d in model.int8_blocks(layers=dtype == "int8"):
        store.add_int8(name, q, d)
    store.finish()
    return model, store


def _gguf_dequantized(path) -> dict:
    """gguf's own dequantization of every matrix, in HuggingFace names and row order."""
    from tinyinfer.loaders.gguf import hf_tensor_name

    reader, cfg = gguf.GGUFReader(str(path)), load_model(path).config
    out = {}
    for t in reader.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        a = a.reshape([int(x) for x in reversed([int(d) for d in t.shape])])
        if t.name.endswith("attn_q.weight"):
            a = reverse_rope_permute(a, cfg.n_heads)
        elif t.name.endswith("attn_k.weight"):
            a = reverse_rope_permute(a, cfg.n_kv_heads)
        out[hf_tensor_name(t.name)] = (t.tensor_type.name, a)
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def mixed_gguf(request, tmp_path_factory):
    w = gguf_writer
    model = w.tiny_llama(len(w.spm_vocab()[0]), tie=request.param)
    return w.write_llama_gguf(tmp_path_factory.mktemp("mix") / "mixed.gguf", model, MIXED)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_gguf_blocks_import_bit_exactly(mixed_gguf, dtype):
    """Every Q8_0 (int8) and Q4_0 / Q4_1 (int4) tensor stands in the store for exactly gguf's dequantized values,
    before and after quantize(): none is rounded a second time. The rest is re-quantized."""
    model, store = _store(mixed_gguf, dtype)
    ref = _gguf_dequantized(mixed_gguf)
    tied = model.config.tie_word_embeddings
    body_types = {"int8": ("Q8_0",), "int4": ("Q4_0", "Q4_1")}[dtype]

    def imported(name, ty):  # layer matrices in the engine's format; the head (int8 for both; tied: the embedding)
        if ".layers." in name:
            return ty in body_types
        return ty == "Q8_0" and name == ("model.embed_tokens.weight" if tied else "lm_head.weight")

    n_imported = 0
    for name, (ty, want) in ref.items():
        if want.ndim == 2 and imported(name, ty):
            assert store.is_imported(name, "int4" if ty.startswith("Q4") else "int8"), name
            n_imported += 1
        np.testing.assert_array_equal(store.tensor(name), want.reshape(store.tensor(name).shape), err_msg=name)
    assert n_imported == {"int8": 4 * 2 + 1, "int4": 3 * 2 + 1}[dtype]
    store.quantize(dtype)
    for name, (ty, want) in ref.items():
        if want.ndim != 2 or name == "model.embed_tokens.weight":
            continue  # the lookup table is never quantized
        fmt = dtype if ".layers." in name else "int8"
        expect = want if imported(name, ty) else _core.ops.dequantize_ref(np.ascontiguousarray(want), fmt)
        np.testing.assert_array_equal(store.tensor(name), expect, err_msg=name)
    if tied:  # the head took the embedding's Q8_0 blocks as they are
        np.testing.assert_array_equal(store.tensor("lm_head.weight"), ref["model.embed_tokens.weight"][1])
        np.testing.assert_array_equal(store.tensor("model.embed_tokens.weight"), ref["model.embed_tokens.weight"][1])


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def q8_gguf(request, tmp_path_factory):
    w = gguf_writer
    model = w.tiny_llama(len(w.spm_vocab()[0]), tie=request.param, seed=3)
    types = {k: Q.Q8_0 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                                  "token_embd", "output")}
    return w.write_llama_gguf(tmp_path_factory.mktemp("q8") / "q8.gguf", model, types)


def test_int8_logits_on_a_q8_0_file_equal_the_fp32_engine(q8_gguf):
    """Engine(dtype="int8") on an all-Q8_0 file computes with exactly gguf's dequantized weights: its logits are
    the fp32 engine's on those values, bit for bit (the head: the output / tied embedding blocks as they are)."""
    ref = _gguf_dequantized(q8_gguf)
    cfg = load_model(q8_gguf).config
    store = _core.WeightStore(cfg)
    for name, (_, a) in ref.items():
        if not (cfg.tie_word_embeddings and name == "lm_head.weight"):
            store.add(name, np.ascontiguousarray(a.reshape(store.expected_shape(name))), "fp32")
    store.finish()
    ids = list(range(3, 60))
    want = _core.CpuEngine(store, 128).forward(ids, all_logits=True)
    eng = Engine(q8_gguf, device="cpu", dtype="int8", max_seq_len=128)
    got = eng.logits(ids)
    np.testing.assert_array_equal(got, want)
    fp32 = Engine(q8_gguf, device="cpu", dtype="fp32", max_seq_len=128).logits(ids)
    np.testing.assert_array_equal(got, fp32)  # the fp32 engine on the same file: nothing was rounded again
    assert eng.generate(ids[:5], max_tokens=4, ignore_eos=True).token_ids


def _patch_q8_0(path, tensor: str, block: int, q: list[int]):
    """Overwrite the first len(q) quants of one Q8_0 block of a GGUF file in place (e.g. with -128, which
    llama.cpp's quantizer never writes but a file may hold)."""
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == tensor)
    assert t.tensor_type == Q.Q8_0
    with open(path, "r+b") as f:
        f.seek(int(t.data_offset) + block * 34 + 2)
        f.write(np.asarray(q, np.int8).tobytes())


def test_q8_0_minus_128_imports_exactly(tmp_path):
    w = gguf_writer
    model = w.tiny_llama(len(w.spm_vocab()[0]), tie=False, seed=5)
    path = w.write_llama_gguf(tmp_path / "m.gguf", model, {"ffn_down": Q.Q8_0, "output": Q.Q8_0})
    _patch_q8_0(path, "blk.0.ffn_down.weight", 3, [-128, 127, -128])
    _patch_q8_0(path, "output.weight", 0, [-128] * 32)
    ref = _gguf_dequantized(path)
    _, store = _store(path, "int8")
    for name in ("model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
        np.testing.assert_array_equal(store.tensor(name), ref[name][1], err_msg=name)
    down = store.tensor("model.layers.0.mlp.down_proj.weight")
    assert down[0, 96] == down[0, 98] and down[0, 96] * down[0, 97] < 0
    np.testing.assert_allclose(down[0, 96] / down[0, 97], -128 / 127, rtol=1e-6)
    store.quantize("int8")
    np.testing.assert_array_equal(store.tensor("lm_head.weight")[0, :32], ref["lm_head.weight"][1][0, :32])


# ---- bad input ----

def test_add_int8_refuses_bad_tensors():
    c = _core.ModelConfig()
    c.hidden, c.intermediate, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab = 128, 96, 1, 2, 1, 64, 100
    c.validate()
    store = _core.WeightStore(c)
    q, d = np.zeros((96, 128), np.int8), np.zeros((96, 4), np.uint16)
    with pytest.raises(ModelFormatError, match="int8 tensor 'model.layers.0.mlp.down_proj.weight'.*\\[128, 96\\]"):
        store.add_int8("model.layers.0.mlp.down_proj.weight", q, d)  # (96, 128) where (128, 96) is expected
    with pytest.raises(ModelFormatError, match="'model.layers.5.mlp.up_proj.weight'"):
        store.add_int8("model.layers.5.mlp.up_proj.weight", q, d)  # no layer 5
    with pytest.raises(ModelFormatError, match="not whole blocks of 32"):
        store.add_int8("model.layers.0.mlp.up_proj.weight", np.zeros((96, 80), np.int8), np.zeros((96, 3), np.uint16))
    with pytest.raises(InvalidRequestError, match="d must be \\(rows, K / 32\\)"):
        store.add_int8("model.layers.0.mlp.up_proj.weight", q, d[:, :1])
    with pytest.raises(ModelFormatError, match="int4 tensor 'lm_head.weight'"):
        store.add_int4("lm_head.weight", np.zeros((100, 64), np.uint8), np.zeros((100, 8), np.uint16))
    store.add_int8("model.layers.0.mlp.up_proj.weight", q, d)  # the store stays usable
    assert store.is_imported("model.layers.0.mlp.up_proj.weight", "int8")
    assert not store.is_imported("model.layers.0.mlp.up_proj.weight", "int4")
