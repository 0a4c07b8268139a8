"""The GPU engine's streaming load (cpp/gpu/weight_stream.*, cuda/convert.*): every source format through
CudaEngine.load against the CPU engine; the device bytes of converted and imported matrices against the host's
conversion; bad tensors refused with nothing left behind; host memory stays flat. Skipped without a GPU."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from conftest import GPU_MEMORY_SLACK, gpu_free_bytes, make_llama
from tinyinfer import Engine, ModelFormatError, UnsupportedModelError, _core

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, layers=2)


def _compare(path, fmt, n=40):
    ids = np.random.default_rng(1).integers(3, 200, n).tolist()
    g = Engine(path, device="cuda", dtype=fmt, max_seq_len=128, progress=False).logits(ids)
    c = Engine(path, device="cpu", dtype={"fp16": "fp32"}.get(fmt, fmt), max_seq_len=128).logits(ids)
    rel = np.abs(g - c).max() / np.abs(c).max()
    agree = (g.argmax(-1) == c.argmax(-1)).mean()
    print(f"{path.name} {fmt}: max rel logit error {rel:.2e}, top-1 agreement {agree:.3f}")
    assert np.isfinite(g).all() and rel < 2e-2 and agree >= 0.95


@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("src", ["float32", "float16", "bfloat16", "sharded", "tied"])
def test_streamed_safetensors_match_cpu(tmp_path, src, fmt):
    kw = dict(dtype=src) if src.startswith(("float", "bfloat")) else {}
    if src == "sharded":
        kw = dict(shard_size="300KB")
    d = make_llama(tmp_path / src, vocab=300, tie=src == "tied", **kw, **SHAPE)
    if src == "sharded":
        assert len(list(d.glob("*.safetensors"))) > 2
    _compare(d, fmt)


@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("which", ["all_types", "q4", "tied_q8k"])
def test_streamed_gguf_matches_cpu(tmp_path, which, fmt):
    from gguf_writer import q4_gguf, write_tiny_ggufs

    if which == "q4":
        path = q4_gguf(tmp_path)
    else:  # F16 / BF16 / F32 / Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K; a tied one with Q8_0 K and Q6_K down
        write_tiny_ggufs(tmp_path)
        path = tmp_path / ("tiny.gguf" if which == "all_types" else "tiny_q6k_down.gguf")
    _compare(path, fmt)


def _fp16_rows(a: np.ndarray, ld: int) -> np.ndarray:
    out = np.zeros((a.shape[0], ld), np.float16)
    out[:, :a.shape[1]] = a.astype(np.float32).astype(np.float16)
    return out


def _read_safetensors(d):
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_fp16_device_rows_are_the_host_conversion(tmp_path):
    """bf16 tensors -> fp16 on the device, fused (q | k | v; gate / up interleaved), padded: byte for byte the
    host's bf16 -> fp32 -> fp16 (round to nearest even)."""
    d = make_llama(tmp_path / "m", vocab=300, dtype="bfloat16", hidden=192, heads=4, kv_heads=4, head_dim=96,
                   intermediate=300, layers=1)
    t = {k: (v.astype(np.uint32) << 16).view(np.float32) for k, v in _read_safetensors_raw(d).items()}
    eng = Engine(d, device="cuda", max_seq_len=64, progress=False)._core
    p = "model.layers.0."
    qkv = np.concatenate([t[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    gu = np.empty((600, 192), np.float32)
    gu[0::2], gu[1::2] = t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]
    for role, want, ld in [(_core.MatrixRole.Qkv, qkv, 192), (_core.MatrixRole.GateUp, gu, 192),
                           (_core.MatrixRole.Down, t[p + "mlp.down_proj.weight"], 304),  # pad8(300): zeros
                           (_core.MatrixRole.LmHead, t["lm_head.weight"], 192)]:
        q, sc = eng.matrix_bytes(0, role)
        got = np.frombuffer(q, np.uint16).reshape(want.shape[0], -1)
        assert sc == b"" and got.shape[1] == ld, role
        np.testing.assert_array_equal(got, _fp16_rows(want, ld).view(np.uint16), err_msg=str(role))


def _read_safetensors_raw(d):
    """Every tensor's raw 16-bit words (bf16 has no numpy dtype)."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], np.uint16).reshape(info["shape"])
    return out


def test_imported_q4_blocks_are_on_the_device_as_converted(tmp_path):
    """GGUF Q4_0 / Q4_1 layer matrices land in the int4 matrices byte for byte as q4_blocks_to_int4 converts them
    (Q / K rows un-permuted on the device, gate / up interleaved); a Q8_0 part of the same fused matrix (v) is
    quantized around them."""
    import gguf

    from gguf_writer import q4_gguf
    from tinyinfer.loaders.gguf import q4_blocks_to_int4, reverse_rope_permute

    path = q4_gguf(tmp_path)
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: (t.tensor_type.name, np.asarray(t.data), int(t.shape[-1]), int(t.shape[0])) for t in reader.tensors}

    def host(name, heads=0):
        type_name, data, rows, K = raw[name]
        q, sm = q4_blocks_to_int4(data, type_name, rows, K)
        if heads:
            q, sm = reverse_rope_permute(q, heads), reverse_rope_permute(sm, heads)
        return q, sm.view(np.uint8)

    eng = Engine(path, device="cuda", dtype="int4", max_seq_len=64, progress=False)
    c = eng.config
    dev_q, dev_s = eng._core.matrix_bytes(1, _core.MatrixRole.Qkv)
    rows = c.q_dim + 2 * c.kv_dim
    dev_q = np.frombuffer(dev_q, np.uint8).reshape(rows, -1)
    dev_s = np.frombuffer(dev_s, np.uint8).reshape(rows, -1)
    for name, heads, lo, hi in [("blk.1.attn_q.weight", c.n_heads, 0, c.q_dim),
                                ("blk.1.attn_k.weight", c.n_kv_heads, c.q_dim, c.q_dim + c.kv_dim)]:
        q, s = host(name, heads)
        np.testing.assert_array_equal(dev_q[lo:hi], q, err_msg=name)
        np.testing.assert_array_equal(dev_s[lo:hi], s, err_msg=name)
    assert np.abs(dev_s[c.q_dim + c.kv_dim:].view(np.float16).astype(np.float32)).max() > 0  # v: quantized
    gq, gs = eng._core.matrix_bytes(0, _core.MatrixRole.GateUp)
    gq = np.frombuffer(gq, np.uint8).reshape(2 * c.intermediate, -1)
    gs = np.frombuffer(gs, np.uint8).reshape(2 * c.intermediate, -1)
    for name, p in [("blk.0.ffn_gate.weight", 0), ("blk.0.ffn_up.weight", 1)]:
        q, s = host(name)
        np.testing.assert_array_equal(gq[p::2], q, err_msg=name)
        np.testing.assert_array_equal(gs[p::2], s, err_msg=name)
    dq, ds = eng._core.matrix_bytes(0, _core.MatrixRole.Down)
    q, s = host("blk.0.ffn_down.weight")
    assert dq == q.tobytes() and ds == s.tobytes()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_imported_q8_0_blocks_are_on_the_device_as_stored(tmp_path, fmt):
    """GGUF Q8_0 matrices land in the int8 matrices byte for byte (u = q + 128, d as stored; K rows un-permuted
    on the device): the layer matrices of an int8 engine, and the LM head (here: a tied one, from the Q8_0
    embedding) of int8 and int4 engines."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from gguf_writer import spm_vocab, tiny_llama, write_llama_gguf
    from tinyinfer.loaders.gguf import q8_0_blocks, reverse_rope_permute

    path = write_llama_gguf(tmp_path / "q8.gguf", tiny_llama(len(spm_vocab()[0]), tie=True),
                            {"token_embd": Q.Q8_0, "attn_k": Q.Q8_0, "ffn_up": Q.Q8_0, "attn_q": Q.Q4_1})
    raw = {t.name: (np.asarray(t.data), int(t.shape[-1]), int(t.shape[0])) for t in gguf.GGUFReader(str(path)).tensors}

    def host(name, heads=0):
        q, d = q8_0_blocks(*raw[name])
        u = q.view(np.uint8) ^ np.uint8(0x80)
        if heads:
            u, d = reverse_rope_permute(u, heads), reverse_rope_permute(d, heads)
        return u, d.view(np.uint8)

    eng = Engine(path, device="cuda", dtype=fmt, max_seq_len=64, progress=False)
    c = eng.config
    hq, hs = eng._core.matrix_bytes(0, _core.MatrixRole.LmHead)
    u, d = host("token_embd.weight")
    assert hq == u.tobytes() and hs == d.tobytes()
    if fmt == "int8":
        rows = c.q_dim + 2 * c.kv_dim
        q, s = eng._core.matrix_bytes(1, _core.MatrixRole.Qkv)
        q = np.frombuffer(q, np.uint8).reshape(rows, -1)[c.q_dim:c.q_dim + c.kv_dim]
        s = np.frombuffer(s, np.uint8).reshape(rows, -1)[c.q_dim:c.q_dim + c.kv_dim]
        u, d = host("blk.1.attn_k.weight", c.n_kv_heads)
        np.testing.assert_array_equal(q, u)
        np.testing.assert_array_equal(s, d)
        q, s = eng._core.matrix_bytes(0, _core.MatrixRole.GateUp)
        u, d = host("blk.0.ffn_up.weight")
        np.testing.assert_array_equal(np.frombuffer(q, np.uint8).reshape(2 * c.intermediate, -1)[1::2], u)
        np.testing.assert_array_equal(np.frombuffer(s, np.uint8).reshape(2 * c.intermediate, -1)[1::2], d)
    _compare(path, fmt)


def _drop_tensor(d, name, duplicate_in=None):
    """Rewrite model.safetensors without `name` (or, with duplicate_in, copy it into a second shard too)."""
    from safetensors.numpy import save_file

    t = _read_safetensors(d)
    if duplicate_in is None:
        del t[name]
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        return
    (d / "model.safetensors").unlink()
    save_file(t, str(d / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file({name: t[name]}, str(d / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    files = {k: "model-00001-of-00002.safetensors" for k in t}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files | {
        "x": "model-00002-of-00002.safetensors"}}))


@pytest.mark.parametrize("case", ["missing", "duplicate", "wrong_shape"])
def test_bad_tensors_are_refused_and_leave_nothing_behind(tmp_path, case):
    """Each refused load gives back what it took: the weights (all allocated before the stream: 33 MiB here, the
    32,000-row embedding and head making a leak of them show past GPU_MEMORY_SLACK), the KV cache and the staging
    buffers; device free memory stays where it was."""
    from safetensors.numpy import save_file

    d = make_llama(tmp_path / "m", vocab=32000, **SHAPE)
    name = "model.layers.1.self_attn.k_proj.weight"
    if case == "missing":
        _drop_tensor(d, name)
        match = f"missing tensor '{name}'"
    elif case == "duplicate":
        _drop_tensor(d, name, duplicate_in=True)
        match = f"tensor '{name}' given twice"
    else:
        t = _read_safetensors(d)
        t[name] = t[name][:-1]
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        match = rf"tensor '{name}' has shape \(127, 256\), expected \(128, 256\)"
    good = make_llama(tmp_path / "good", vocab=32000, **SHAPE)
    gpu_free_bytes()  # (torch's CUDA context in first)
    with Engine(good, device="cuda", max_seq_len=64, progress=False) as eng:  # kernels and libraries loaded
        eng.generate([1, 2], max_tokens=2, ignore_eos=True)
    base = gpu_free_bytes()
    for _ in range(3):  # each failed load frees what it took: the engine object is never made
        with pytest.raises(ModelFormatError, match=match):
            Engine(d, device="cuda", max_seq_len=64, progress=False)
        held = base - gpu_free_bytes()
        assert held < GPU_MEMORY_SLACK, f"{held / 2**20:.1f} MiB still held after a refused load"
    with Engine(good, device="cuda", max_seq_len=64, progress=False) as eng:
        assert eng.generate([1, 2], max_tokens=2, ignore_eos=True).token_ids
        assert base - gpu_free_bytes() > 32 << 20  # the measurement sees a loaded engine (its weights) at all


def test_unexpected_tensor_is_refused(tmp_path):
    from safetensors.numpy import save_file

    d = make_llama(tmp_path / "m", vocab=300, **SHAPE)
    t = _read_safetensors(d)
    t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(256, np.float32)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        Engine(d, device="cuda", max_seq_len=64, progress=False)


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("no RssAnon")


def test_gpu_load_keeps_host_memory_flat(tmp_path):
    """A ~300 MB fp16 model loads with the host's anonymous memory growing by far less than the file (the
    WeightStore path held an fp32 copy: twice the file)."""
    d = make_llama(tmp_path / "big", vocab=32000, hidden=1024, heads=16, kv_heads=4, head_dim=64,
                   intermediate=2816, layers=8, dtype="float16")
    size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    assert size > 150 << 20
    Engine(make_llama(tmp_path / "small", vocab=300, **SHAPE), device="cuda", max_seq_len=64, progress=False)
    base = _rss_anon_kib()  # the CUDA context and libraries are in
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_anon_kib())
            time.sleep(0.002)

    th = threading.Thread(target=sample)
    th.start()
    try:
        eng = Engine(d, device="cuda", max_seq_len=256, progress=False)
    finally:
        stop.set()
        th.join()
    grew = (peak[0] - base) * 1024
    print(f"file {size >> 20} MiB, RssAnon grew {grew >> 20} MiB during the load; {eng.load_report}")
    assert grew < size // 4 + (96 << 20)
