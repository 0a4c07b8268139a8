"""GGUF metadata -> ModelConfig: the real default model's config against transformers reading the same file,
and llama3 rope scaling recovered from a rope_freqs.weight tensor (small GGUFs written here)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import SMOLLM_GGUF_NAME
from gguf_writer import spm_vocab, tiny_llama, write_llama_gguf
from tinyinfer import _core
from tinyinfer.errors import ConfigError, UnsupportedModelError
from tinyinfer.loaders import load_model
from tinyinfer.loaders.gguf_config import config_from_gguf


def test_config_matches_transformers(smollm_gguf, smollm_dir):
    from transformers import AutoConfig

    m = load_model(smollm_gguf)
    c = m.config
    ref = AutoConfig.from_pretrained(smollm_dir, gguf_file=SMOLLM_GGUF_NAME)
    assert (c.hidden, c.intermediate, c.n_layers) == (ref.hidden_size, ref.intermediate_size, ref.num_hidden_layers)
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (ref.num_attention_heads, ref.num_key_value_heads, 64)
    assert c.vocab == ref.vocab_size == 49152
    assert c.rms_eps == pytest.approx(ref.rms_norm_eps)
    theta = ref.rope_parameters["rope_theta"] if getattr(ref, "rope_parameters", None) else ref.rope_theta
    assert c.rope_theta == pytest.approx(theta) and c.rope_scaling == "none"
    assert c.max_position_embeddings == ref.max_position_embeddings == 8192
    assert c.tie_word_embeddings is True and ref.tie_word_embeddings is True
    assert c.bos_token_id == ref.bos_token_id == 1
    assert list(c.eos_token_ids) == [ref.eos_token_id] == [2]
    assert set(m.gguf_types.values()) == {"F32", "Q4_1", "Q8_0"}
    assert m.gguf_types["model.embed_tokens.weight"] == "Q8_0"
    assert "Q4_1" in m.description
    tok = m.tokenizer
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.add_bos_token is False and tok.add_eos_token is False


def _llama3_rope_factors(head_dim, theta, factor, low, high, orig):
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors): the rope_freqs.weight divisors."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wavelen, high_wavelen = orig / low, orig / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_from_rope_freqs_tensor(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = tiny_llama(len(spm_vocab()[0]))
    factors = _llama3_rope_factors(64, 10000.0, 8.0, 1.0, 4.0, 8192)
    path = write_llama_gguf(tmp_path / "llama3.gguf", model, {}, extra_tensors={"rope_freqs.weight": factors})
    c = load_model(path).config
    assert c.rope_scaling == "llama3"
    assert (c.rope_factor, c.rope_low_freq_factor, c.rope_high_freq_factor, c.rope_original_max_pos) == (
        8.0, 1.0, 4.0, 8192)
    ref_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=131072,
                          rope_theta=10000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                                high_freq_factor=4.0,
                                                                original_max_position_embeddings=8192))
    ref_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](ref_cfg, "cpu")
    np.testing.assert_allclose(np.asarray(_core.ops.rope_inv_freq(c)), ref_inv.numpy(), rtol=1e-5)
    # factors that match no llama3 setting are refused, naming the tensor
    bad = write_llama_gguf(tmp_path / "odd.gguf", model, {},
                           extra_tensors={"rope_freqs.weight": np.linspace(1, 3, 32, dtype=np.float32)})
    with pytest.raises(UnsupportedModelError, match="rope_freqs.weight"):
        load_model(bad)


@pytest.mark.parametrize("changes,err,key", [
    ({"llama.attention.head_count_kv": 3}, ConfigError, "llama.attention.head_count_kv"),  # does not divide 4
    ({"llama.embedding_length": 192}, UnsupportedModelError, "llama.embedding_length / llama.attention.head_count"),
])
def test_config_the_core_refuses_names_the_file_and_key(changes, err, key):
    """What only the core's check refuses (GQA divisibility, head_dim 48) is named as the GGUF has it."""
    meta = {"general.architecture": "llama", "llama.embedding_length": 256, "llama.feed_forward_length": 512,
            "llama.block_count": 1, "llama.attention.head_count": 4, "llama.vocab_size": 100, **changes}
    with pytest.raises(err) as e:
        config_from_gguf(meta, {}, "/models/m.gguf")
    assert str(e.value).startswith("/models/m.gguf: ") and key in str(e.value), str(e.value)


@pytest.mark.parametrize("changes,key", [
    ({"llama.attention.layer_norm_rms_epsilon": float("inf")}, "llama.attention.layer_norm_rms_epsilon"),
    ({"llama.rope.freq_base": float("inf")}, "llama.rope.freq_base"),
    ({"llama.rope.freq_base": float("nan")}, "llama.rope.freq_base"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": float("inf")}, "llama.rope.scaling.factor"),
])
def test_config_number_that_is_not_finite_names_the_key(changes, key):
    """An infinite epsilon loaded and gave all-zero logits: every such number is refused, naming its key."""
    meta = {"general.architecture": "llama", "llama.embedding_length": 256, "llama.feed_forward_length": 512,
            "llama.block_count": 1, "llama.attention.head_count": 4, "llama.vocab_size": 100, **changes}
    with pytest.raises(ConfigError, match="finite") as e:
        config_from_gguf(meta, {}, "/models/m.gguf")
    assert key in str(e.value), str(e.value)
