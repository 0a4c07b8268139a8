"""Shared fixtures: small random Llama models built with transformers and saved with save_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _has_cuda() -> bool:
    try:
        from tinyinfer import _core

        return bool(_core.ops.device_status()["usable"])
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="no usable CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def make_llama(
    out: Path,
    *,
    hidden=256,
    intermediate=512,
    layers=2,
    heads=4,
    kv_heads=4,
    head_dim=64,
    vocab=512,
    tie=False,
    rope_scaling=None,
    rope_theta=10000.0,
    max_pos=2048,
    dtype="float32",
    shard_size=None,
    seed=0,
    init_std=0.05,
) -> Path:
    """A random LlamaForCausalLM saved at `out` (safetensors + config.json). Returns `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        initializer_range=init_std,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms at 1 would make every layer alike: give them some spread
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model = model.to(getattr(torch, dtype))
    kw = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(out, **kw)
    return out


def hf_model(path: Path):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def edit_config(path: Path, **changes) -> None:
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    cfg_path.write_text(json.dumps(cfg))
