"""Bad GGUF files (empty, truncated, corrupt, unsupported types, architectures, rope scalings, tokenizers) raise
a clear TinyInferError naming the file, and a loaded engine keeps working; load_model's dispatch by magic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from conftest import link_or_copy
from gguf_writer import spm_vocab, tiny_llama, write_llama_gguf
from tinyinfer import Engine
from tinyinfer.errors import ModelFormatError, ModelNotFoundError, TinyInferError, UnsupportedModelError
from tinyinfer.loaders import load_model


def _bad_files(tmp: Path, good: Path, vocab: int) -> dict:
    """name -> (path, expected error type, a string the message must contain)."""
    data = good.read_bytes()
    rng = np.random.default_rng(0)
    cases = {}

    def put(name, content: bytes, err, needle):
        p = tmp / f"{name}.gguf"
        p.write_bytes(content)
        cases[name] = (p, err, needle)

    put("empty", b"", ModelFormatError, "not a GGUF file")
    put("truncated_header", data[:20], ModelFormatError, "truncated")
    put("truncated_metadata", data[:100_000], ModelFormatError, "truncated GGUF file (100,000 bytes; an interrupted")
    put("truncated_tensor_data", data[:10_000_000], ModelFormatError, "truncated")
    put("truncated_last_byte", data[:-1], ModelFormatError, "truncated")
    put("random_bytes", rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), ModelFormatError, "not a GGUF file")
    put("magic_then_garbage", b"GGUF" + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), ModelFormatError,
        "corrupt")
    garbled = bytearray(data)
    garbled[5000:5100] = rng.integers(0, 256, 100, dtype=np.uint8).tobytes()
    put("garbled_metadata", bytes(garbled), ModelFormatError, "corrupt")

    model = tiny_llama(vocab)
    p = tmp / "q2k.gguf"
    write_llama_gguf(p, model, {"ffn_up": Q.Q2_K})
    cases["unsupported_type_q2k"] = (p, UnsupportedModelError, "'blk.0.ffn_up.weight' has type Q2_K")
    p = tmp / "mistral.gguf"
    write_llama_gguf(p, model, {}, arch="mistral")
    cases["architecture_mistral"] = (p, UnsupportedModelError, "general.architecture = 'mistral'")
    p = tmp / "bias.gguf"
    write_llama_gguf(p, model, {}, extra_tensors={"blk.0.attn_q.bias": np.zeros(256, np.float32)})
    cases["attention_bias"] = (p, UnsupportedModelError, "'blk.0.attn_q.bias'")
    p = tmp / "yarn.gguf"
    write_llama_gguf(p, model, {}, extra_kv={"llama.rope.scaling.type": ("string", "yarn")})
    cases["rope_yarn"] = (p, UnsupportedModelError, "llama.rope.scaling.type = 'yarn'")
    p = tmp / "bert_tokenizer.gguf"
    write_llama_gguf(p, model, {}, tokenizer=False,
                     extra_kv={"tokenizer.ggml.model": ("string", "bert"),
                               "tokenizer.ggml.tokens": ("array", ["a", "b"])})
    cases["tokenizer_bert"] = (p, UnsupportedModelError, "tokenizer.ggml.model = 'bert'")
    p = tmp / "head_dim.gguf"
    write_llama_gguf(p, model, {}, extra_kv={"llama.attention.key_length": ("uint32", 48)})
    cases["key_length_mismatch"] = (p, UnsupportedModelError, "rope.dimension_count")
    return cases


def test_bad_files_raise_clear_errors(tmp_path, smollm_gguf, smol_engine, record_property):
    """Each bad file raises the matching TinyInferError naming the file (or the tensor/key); the loaded engine keeps
    working after each, and a fresh load of the good model afterwards works."""
    probe = [1, 9690, 198, 2683, 359, 253]
    before = smol_engine.logits(probe)
    cases = _bad_files(tmp_path, smollm_gguf, len(spm_vocab()[0]))
    for name, (path, err, needle) in cases.items():
        with pytest.raises(err) as info:
            Engine(path, device="cpu")
        assert isinstance(info.value, TinyInferError)
        msg = str(info.value)
        assert needle in msg, (name, msg)
        assert str(path) in msg, (name, msg)
        np.testing.assert_array_equal(smol_engine.logits(probe), before)
    record_property("bad_files_checked", len(cases))
    fresh = Engine(smollm_gguf, device="cpu")
    np.testing.assert_array_equal(fresh.logits(probe), before)


def test_load_model_dispatch(tmp_path, smollm_gguf):
    # a GGUF without the .gguf suffix is recognised by its magic; other files are refused
    renamed = tmp_path / "model.bin"
    link_or_copy(smollm_gguf, renamed)
    assert load_model(renamed).config.hidden == 576
    other = tmp_path / "weights.bin"
    other.write_bytes(b"not a model")
    with pytest.raises(UnsupportedModelError, match="not a model directory or GGUF file"):
        load_model(other)
    with pytest.raises(ModelNotFoundError):
        load_model(tmp_path / "missing.gguf")
