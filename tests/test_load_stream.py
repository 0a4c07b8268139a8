"""The loaders' stream for the GPU engine's load (LoadedModel.stream): views over the mapped file, GGUF Q / K
rows left for the device to un-permute, Q4 blocks as the int4 import converts them, quantized tensors
dequantized a bounded chunk at a time; and the host's anonymous memory stays flat while a model streams by."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tinyinfer.loaders import load_model
from tinyinfer.loaders.gguf import q4_blocks_to_int4, reverse_rope_permute


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    pytest.skip("no RssAnon in /proc/self/status")


def _write_safetensors(path, tensors: dict[str, tuple[str, tuple[int, ...]]], rng) -> None:
    """A safetensors file of random data written a tensor at a time (no whole-file array in memory)."""
    header, offset = {}, 0
    for name, (dt, shape) in tensors.items():
        n = int(np.prod(shape)) * (4 if dt == "F32" else 2)
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, (dt, shape) in tensors.items():
            f.write((rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(
                np.float32 if dt == "F32" else np.float16).tobytes())


def _big_llama_dir(d, layers=6, hidden=1024, inter=4096, vocab=16000):
    d.mkdir()
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden, intermediate_size=inter,
               num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, vocab_size=vocab,
               max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
               torch_dtype="float16")
    (d / "config.json").write_text(json.dumps(cfg))
    t = {"model.embed_tokens.weight": ("F16", (vocab, hidden)), "model.norm.weight": ("F16", (hidden,)),
         "lm_head.weight": ("F16", (vocab, hidden))}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {"input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
                  "self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (256, hidden),
                  "self_attn.v_proj": (256, hidden), "self_attn.o_proj": (hidden, hidden),
                  "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
        t |= {f"{p}{leaf}.weight": ("F16", shape) for leaf, shape in shapes.items()}
    _write_safetensors(d / "model.safetensors", t, np.random.default_rng(0))
    return d


def test_streaming_a_model_keeps_anonymous_memory_flat(tmp_path):
    """Every byte of a ~250 MB safetensors model read through the stream's views: RssAnon moves by < 64 MiB
    (the pages are the file's, in the page cache, not copies)."""
    d = _big_llama_dir(tmp_path / "m")
    size = (d / "model.safetensors").stat().st_size
    assert size > 200 << 20
    model = load_model(d)
    assert model.stream_bytes == size
    base = peak = _rss_anon_kib()
    seen, checksum = 0, 0
    for item in model.stream("fp16"):
        assert item.kind == "rows" and item.row0 == 0 and item.rope_heads == 0 and item.scales is None
        assert not item.data.flags.owndata  # a view, not a copy
        checksum ^= int(np.bitwise_xor.reduce(item.data.view(np.uint16), axis=None))  # touches every page
        seen += item.nbytes
        peak = max(peak, _rss_anon_kib())
    assert (peak - base) * 1024 < 64 << 20, f"RssAnon grew {(peak - base) >> 10} MiB"
    # the views held the file's tensor bytes, all of them: the data past the header, XORed here from the file
    data = np.memmap(d / "model.safetensors", np.uint8, "r")
    start = 8 + int.from_bytes(data[:8].tobytes(), "little")
    assert seen == size - start
    assert checksum == int(np.bitwise_xor.reduce(data[start:].view(np.uint16)))


def test_stream_shapes_and_dtypes_follow_the_file(tmp_path):
    from conftest import make_llama

    d = make_llama(tmp_path / "m", hidden=128, intermediate=128, layers=1, heads=2, kv_heads=1, head_dim=64,
                   vocab=50, dtype="bfloat16")
    model = load_model(d)
    items = {it.name: it for it in model.stream("int4")}
    assert set(items) == {n for n, _, _ in model.tensors()}
    q = items["model.layers.0.self_attn.k_proj.weight"]
    assert q.dtype == "bf16" and q.shape == (64, 128) and q.data.shape == (64, 128)
    assert items["model.norm.weight"].shape == (1, 128)


def _as_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":  # uint16 bits: the upper half of an fp32
        return (np.asarray(a).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(a, np.float32)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    from gguf_writer import q4_gguf, write_tiny_ggufs

    d = tmp_path_factory.mktemp("gguf")
    write_tiny_ggufs(d)
    q4_gguf(d)
    return d


@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("file", ["tiny.gguf", "tiny_q6k_down.gguf", "q4.gguf"])
def test_gguf_stream_is_the_tensors_in_file_order(ggufs, file, fmt, monkeypatch):
    """Reassembled (rows chunks joined, Q / K rows un-permuted as the device does), every "rows" item equals the
    CPU engine's tensor; raw Q4 block items appear exactly for Q4_0 / Q4_1 layer matrices of an int4 engine and,
    converted, equal the CPU path's imported blocks."""
    import tinyinfer.loaders.gguf as g

    monkeypatch.setattr(g, "_DEQUANT_CHUNK_BYTES", 5000)  # several chunks per dequantized tensor
    model = load_model(ggufs / file)
    want = {n: _as_f32(a, dt) for n, a, dt in model.tensors()}
    blocks = {b.name: b for b in model.int4_blocks()} if fmt == "int4" else {}
    blocks8 = {b.name: b for b in model.int8_blocks(layers=fmt == "int8")} if fmt != "fp16" else {}
    c = model.config
    got, seen_int4, seen8 = {}, set(), set()
    for it in model.stream(fmt):
        heads = {"q_proj": c.n_heads, "k_proj": c.n_kv_heads}.get(it.name.split(".")[-2], 0)
        assert it.rope_heads == heads, it.name
        if it.kind in ("q4_0", "q4_1"):  # raw blocks; the device converts them as q4_blocks_to_int4 does
            seen_int4.add(it.name)
            q, sm = q4_blocks_to_int4(it.data, it.kind.upper(), *it.shape)
            np.testing.assert_array_equal(reverse_rope_permute(q, heads) if heads else q, blocks[it.name].q)
            np.testing.assert_array_equal(reverse_rope_permute(sm, heads) if heads else sm, blocks[it.name].scales)
            continue
        if it.kind == "int8":  # Q8_0 as stored; u = q + 128 as the int8 layout keeps it
            src = "model.embed_tokens.weight" if c.tie_word_embeddings and it.name == "lm_head.weight" else it.name
            seen8.add(src)
            q = (it.data ^ np.uint8(0x80)).view(np.int8)
            np.testing.assert_array_equal(reverse_rope_permute(q, heads) if heads else q, blocks8[src].q)
            np.testing.assert_array_equal(reverse_rope_permute(it.scales, heads) if heads else it.scales,
                                          blocks8[src].scales)
            continue
        rows = got.setdefault(it.name, np.zeros(it.shape, np.float32))
        data = _as_f32(it.data, it.dtype)
        rows[it.row0:it.row0 + (data.shape[0] if data.ndim == 2 else 1)] = data.reshape(-1, it.shape[1])
    assert seen_int4 == set(blocks) and seen8 == set(blocks8)
    for name, a in got.items():
        heads = {"q_proj": c.n_heads, "k_proj": c.n_kv_heads}.get(name.split(".")[-2], 0)
        np.testing.assert_array_equal(reverse_rope_permute(a, heads) if heads else a, want[name].reshape(a.shape),
                                      err_msg=name)
    assert set(got) | seen_int4 | seen8 == set(want)
