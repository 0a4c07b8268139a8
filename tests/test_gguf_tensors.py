"""GGUF tensors: HF names, llama.cpp's Q/K permutation undone, and every supported tensor type (F32, F16, BF16,
Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) in small GGUFs written here, against transformers loading the same files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import hf_logits
from tinyinfer import Engine
from tinyinfer.loaders import load_model
from tinyinfer.loaders.gguf import hf_tensor_name, reverse_rope_permute


def test_tensor_names_and_permutation():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.17.attn_output.weight") == "model.layers.17.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.3.attn_q.bias") is None
    # reverse_rope_permute inverts llama.cpp's permute (convert_hf_to_gguf.py)
    w = np.arange(6 * 64 * 5, dtype=np.float32).reshape(6 * 64, 5)
    for n_head in (1, 2, 6):
        permuted = w.reshape(n_head, 2, w.shape[0] // n_head // 2, 5).swapaxes(1, 2).reshape(w.shape)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(reverse_rope_permute(permuted, n_head), w)


@pytest.mark.parametrize("name", ["tiny.gguf", "tiny_q6k_down.gguf"])
def test_tiny_gguf_matches_transformers(tiny_gguf_dir, name, record_property):
    from transformers import AutoModelForCausalLM

    path = tiny_gguf_dir / name
    eng = Engine(path, device="cpu")
    types = set(load_model(path).gguf_types.values())
    assert types >= ({"F16", "Q6_K", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "BF16", "F32"} if name == "tiny.gguf"
                     else {"Q6_K", "F16", "Q8_0"})
    assert eng.config.tie_word_embeddings is (name != "tiny.gguf")
    hf = AutoModelForCausalLM.from_pretrained(tiny_gguf_dir, gguf_file=name, dtype=torch.float32).eval()
    ids = np.random.default_rng(1).integers(3, eng.config.vocab, 64).tolist()
    ours = eng.logits(ids)
    ref = hf_logits(hf, ids)
    rel = float(np.abs(ours - ref).max() / np.abs(ref).max())
    record_property("max_rel_logit_error", rel)
    assert rel <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=16)
    ref_new = out[0, len(ids):].tolist()
    got = eng.generate(ids, max_tokens=16, temperature=0.0).token_ids
    assert got == ref_new
