"""The CPU engine keeps weights in their stored precision (fp32 / fp16 / bf16, int8 / int4 blocks) and widens
them row by row inside its products: its logits are those of the plain fp32 engine on the same numbers, bit for
bit. Threads: a `threads` option whose value never changes a number, checked like every other option, and an
engine that still finishes under busy competitors (speed belongs in bench, not here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gguf_writer
from conftest import make_llama
from test_int8_blocks import _gguf_dequantized
from tinyinfer import Engine, _core
from tinyinfer.loading import load_cpu_store
from tinyinfer.errors import InvalidRequestError, TinyInferError
from tinyinfer.loaders import load_model

IDS = list(range(3, 40))


def _fp32_engine(cfg, tensors: dict, threads: int = 1):
    """The reference: every tensor given to the store as fp32 (held as fp32, read as it is)."""
    store = _core.WeightStore(cfg)
    for name, a in tensors.items():
        if not (cfg.tie_word_embeddings and name == "lm_head.weight"):
            store.add(name, np.ascontiguousarray(a, np.float32).reshape(store.expected_shape(name)), "fp32")
    store.finish()
    return _core.CpuEngine(store, 128, threads)


def _logits(core, ids=IDS):
    core.reset()
    return core.forward(ids, all_logits=True)


def _stepwise(core, ids=IDS[:12]):
    """Logits fed one token at a time: the decode step's one-row products (row_dot.cpp where the CPU has AVX2)."""
    core.reset()
    return np.concatenate([core.forward([t], all_logits=False) for t in ids])


def _chunked(core, size: int, ids=IDS[:14]):
    """Logits fed a few tokens a call: products of a few inputs (row_dot.cpp unpacks a row once for up to four)."""
    core.reset()
    return np.concatenate([core.forward(ids[i:i + size], all_logits=True) for i in range(0, len(ids), size)])


def _assert_same(got_core, want_core):
    np.testing.assert_array_equal(_logits(got_core), _logits(want_core))
    np.testing.assert_array_equal(_stepwise(got_core), _stepwise(want_core))
    for size in (2, 3, 4, 6):
        np.testing.assert_array_equal(_chunked(got_core, size), _chunked(want_core, size), err_msg=f"chunks of {size}")


@pytest.fixture(scope="module")
def all_types_gguf(tmp_path_factory):
    """F16 embedding, Q6_K head, Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / BF16 / F32 layer matrices."""
    return gguf_writer.write_tiny_ggufs(tmp_path_factory.mktemp("cpu_types")) / "tiny.gguf"


def test_gguf_tensors_held_compact_with_the_fp32_engines_logits(all_types_gguf):
    ref = _gguf_dequantized(all_types_gguf)
    model = load_model(all_types_gguf)
    store = load_cpu_store(model, model.config, "fp32")
    held = {"F16": "fp16", "BF16": "bf16", "F32": "fp32", "Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8",
            "Q4_K": "fp32", "Q5_K": "fp32", "Q6_K": "fp32"}  # K-quants: widened to fp32 at load
    for name, (ty, a) in ref.items():
        if a.ndim == 2:
            assert store.held(name) == held[ty], (name, ty)
        np.testing.assert_array_equal(store.tensor(name), a.reshape(store.tensor(name).shape), err_msg=name)
    fp32 = _fp32_engine(model.config, {n: a for n, (_, a) in ref.items()})
    _assert_same(_core.CpuEngine(store, 128, 2), fp32)
    eng = Engine(all_types_gguf, device="cpu", max_seq_len=128)
    np.testing.assert_array_equal(eng.logits(IDS), _logits(fp32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_safetensors_held_as_stored_with_the_fp32_engines_logits(tmp_path, dtype):
    d = make_llama(tmp_path / dtype, hidden=128, intermediate=256, heads=2, kv_heads=1, vocab=300, dtype=dtype)
    model = load_model(d)
    store = load_cpu_store(model, model.config, "fp32")
    held = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[dtype]
    assert store.held("model.layers.0.mlp.down_proj.weight") == held
    assert store.held("model.embed_tokens.weight") == held
    assert store.held("model.norm.weight") == "fp32"  # vectors are widened once
    per_weight = {"fp16": 2, "bf16": 2, "fp32": 4}[held]
    n_weights = sum(int(np.prod(store.expected_shape(n))) for n in store.required_names())
    assert store.bytes <= per_weight * n_weights + 4 * 128 * 5  # (+ the fp32 norms)
    _assert_same(_core.CpuEngine(store, 128, 3),
                 _fp32_engine(model.config, {n: store.tensor(n) for n in store.required_names()}))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_at_load_into_blocks_with_the_old_numbers(tmp_path, dtype):
    """dtype int8 / int4 keeps the blocks (not their dequantized copy); the logits are the fp32 engine's on
    dequantize(quantize(fp16(w))) (the head: int8 for int4 models; the embedding lookup unquantized)."""
    d = make_llama(tmp_path / "m", hidden=128, intermediate=256, heads=2, kv_heads=1, vocab=300, tie=True)
    model = load_model(d)
    src = {n: a.astype(np.float32) for n, a, _ in model.tensors()}
    store = load_cpu_store(model, model.config, dtype)
    head = "int8" if dtype == "int4" else dtype
    assert store.held("model.layers.1.self_attn.q_proj.weight") == dtype
    assert store.held("lm_head.weight") == head
    assert store.held("model.embed_tokens.weight") == "fp32"
    ref = {}
    for name, a in src.items():
        ref[name] = _core.ops.dequantize_ref(a, dtype) if a.ndim == 2 and ".layers." in name else a
    ref["lm_head.weight"] = _core.ops.dequantize_ref(src["model.embed_tokens.weight"], head)
    cfg = model.config
    cfg.tie_word_embeddings = False  # the reference holds the quantized head beside the fp32 lookup table
    _assert_same(_core.CpuEngine(store, 128, 2), _fp32_engine(cfg, ref))


def test_thread_count_never_changes_a_number(all_types_gguf):
    model = load_model(all_types_gguf)
    store = load_cpu_store(model, model.config, "int4")
    engines = [_core.CpuEngine(store, 128, t) for t in (1, 2, 3, 7)]
    assert [e.threads for e in engines] == [1, 2, 3, 7]
    logits = [_logits(e) for e in engines]
    for got in logits[1:]:
        np.testing.assert_array_equal(got, logits[0])
    greedy = _core.SamplingConfig()
    toks = [e.decode(12, greedy, [], 0) for e in engines]
    assert all(t == toks[0] for t in toks) and len(toks[0]) == 12
    assert _core.CpuEngine(store, 16).threads == max(1, os.cpu_count() or 1)  # 0: the cores there are


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", 100000])
def test_threads_refused_with_the_value(all_types_gguf, bad):
    with pytest.raises(InvalidRequestError, match="threads") as e:
        Engine(all_types_gguf, device="cpu", threads=bad)
    assert repr(bad) in str(e.value)


def test_core_threads_refused(all_types_gguf):
    model = load_model(all_types_gguf)
    store = load_cpu_store(model, model.config, "fp32")
    for bad in (-1, 1025):
        with pytest.raises(TinyInferError, match=f"threads must be in 1..1024.*got {bad}"):
            _core.CpuEngine(store, 16, bad)
    assert _core.CpuEngine(store, 16, 2).forward([3, 4], all_logits=False).shape == (1, model.config.vocab)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tinyinfer", *args], capture_output=True, text=True, timeout=600)


def test_cli_threads(all_types_gguf):
    base = ["run", "-m", str(all_types_gguf), "--device", "cpu", "-n", "3", "--raw", "--ignore-eos"]
    one, two = _cli(*base, "--threads", "1", "abc"), _cli(*base, "--threads", "2", "abc")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert one.stdout == two.stdout and one.stdout.strip()
    bad = _cli(*base, "--threads", "0", "abc")
    assert bad.returncode != 0 and "--threads must be >= 1 (got 0)" in bad.stderr
    for sub in (["perplexity", "-m", str(all_types_gguf), "--device", "cpu", "x.txt"],
                ["bench", "--device", "cpu", "--steps", "1"], ["chat", "-m", str(all_types_gguf)]):
        r = _cli(*sub, "--threads", "-2")
        assert r.returncode != 0 and "--threads must be >= 1 (got -2)" in r.stderr, (sub, r.stderr)


def test_finishes_under_busy_competitors(all_types_gguf):
    """Two processes spinning on the cores: a threaded engine still finishes (the old OpenMP barriers spun
    behind a descheduled thread; here nothing waits for a thread that is not running)."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        eng = Engine(all_types_gguf, device="cpu", max_seq_len=128, threads=2)
        out = eng.generate(IDS[:5], max_tokens=16, ignore_eos=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert len(out.token_ids) == 16


_RSS_SCRIPT = """
import sys
def rss():
    return int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]) * 1024
from tinyinfer import Engine
before = rss()
eng = Engine(sys.argv[1], device='cpu', max_seq_len=256)
print(before, rss(), eng._core.weight_bytes)
"""


def test_default_model_stays_near_its_file_size():
    """SmolLM2-135M Q4_1 GGUF (98 MB): held in about its file size, and loading it grows the process by well
    under the 540 MB its fp32 copy would take (the fp32 engine took ~620 MB after import)."""
    from tinyinfer.models import default_model_path

    try:
        path = Path(default_model_path())
    except Exception as e:  # noqa: BLE001 - no network and no cached copy
        pytest.skip(f"default model unavailable: {e}")
    r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    before, after, weights = (int(x) for x in r.stdout.split())
    assert weights <= 1.02 * path.stat().st_size
    assert after - before < 250e6, (before, after)
    assert after < 420e6, after  # the whole process, the CUDA build's libraries included
