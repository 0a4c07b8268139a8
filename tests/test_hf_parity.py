"""The CPU reference engine against transformers (fp32) on small random Llama models.

Each config is loaded by tinyinfer from the directory transformers saved. Checked: the logits at every position
of a 64-token prompt (max |ours - hf| / max |hf| <= 1e-4), and 32 greedy tokens identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import hf_model, make_llama
from tinyinfer import Engine

CONFIGS = {
    # name: make_llama kwargs
    "gqa1_hd64_tied": dict(heads=4, kv_heads=4, head_dim=64, tie=True),
    "gqa3_hd128_untied_i300": dict(hidden=384, heads=6, kv_heads=2, head_dim=128, intermediate=300),
    "gqa4_hd64_llama3": dict(
        heads=8,
        kv_heads=2,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32),
    ),
    "gqa2_hd96_linear_bf16_sharded": dict(
        hidden=192, heads=4, kv_heads=2, head_dim=96, layers=3, intermediate=333,
        rope_scaling=dict(rope_type="linear", factor=2.0), dtype="bfloat16", shard_size="200KB",
    ),
    "gqa1_hd256_fp16": dict(hidden=256, heads=2, kv_heads=2, head_dim=256, dtype="float16", tie=True),
}

PROMPT_LEN = 64
N_GREEDY = 32


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_dir(request, tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp(request.param), **CONFIGS[request.param])


def _prompt(vocab: int) -> list[int]:
    return np.random.default_rng(1).integers(3, vocab, PROMPT_LEN).tolist()


def test_logits_match_transformers(model_dir, record_property):
    eng = Engine(model_dir, device="cpu")
    ids = _prompt(eng.config.vocab)
    ours = eng.logits(ids)
    with torch.no_grad():
        ref = hf_model(model_dir)(torch.tensor([ids])).logits[0].numpy()
    assert ours.shape == ref.shape == (PROMPT_LEN, eng.config.vocab)
    assert ours.dtype == np.float32
    rel = float(np.abs(ours - ref).max() / np.abs(ref).max())
    record_property("max_rel_logit_error", rel)
    print(f"{model_dir.name}: max rel logit error {rel:.2e}")
    assert rel <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_tokens_match_transformers(model_dir):
    eng = Engine(model_dir, device="cpu")
    ids = _prompt(eng.config.vocab)
    out = eng.generate(ids, max_tokens=N_GREEDY, temperature=0.0, ignore_eos=True)
    assert out.finish_reason == "length"
    model = hf_model(model_dir)
    ref = list(ids)
    with torch.no_grad():  # greedy by hand: full forward each step, no generate() EOS handling involved
        for _ in range(N_GREEDY):
            ref.append(int(model(torch.tensor([ref])).logits[0, -1].argmax()))
    assert out.token_ids == ref[len(ids):]


def test_decode_steps_match_one_prefill(model_dir):
    """KV-cache decode gives the same logits as prefill of the whole sequence (the cache is right)."""
    eng = Engine(model_dir, device="cpu")
    ids = _prompt(eng.config.vocab)[:20]
    gen = eng.generate(ids, max_tokens=8, ignore_eos=True).token_ids
    full = eng.logits(ids + gen)
    # greedy: each generated token is the argmax of the previous position's logits in one prefill
    assert full[len(ids) - 1 : -1].argmax(-1).tolist() == gen


def test_rope_inv_freq_matches_transformers(model_dir):
    """The scaled RoPE frequencies (none / linear / llama3) equal transformers' own."""
    from tinyinfer import _core

    eng = Engine(model_dir, device="cpu")
    ours = np.array(_core.ops.rope_inv_freq(eng.config))
    model = hf_model(model_dir)
    ref = model.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-6)


def test_sharded_checkpoint_was_sharded(tmp_path_factory):
    d = make_llama(tmp_path_factory.mktemp("shards"), **CONFIGS["gqa2_hd96_linear_bf16_sharded"])
    assert (d / "model.safetensors.index.json").is_file() and not (d / "model.safetensors").exists()
    assert len(list(d.glob("model-*.safetensors"))) > 1
