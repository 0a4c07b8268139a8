"""Write a HuggingFace Llama directory (config.json + sharded model.safetensors) with random fp16 weights at a
real shape, for load-time benchmarks (speed of loading does not depend on the values).
    python bench/tools/make_random_model.py tinyllama-1.1b /tmp/tinyllama [--dtype bf16]
Uses torch (on the GPU when there is one) to draw the numbers quickly; shards of <= 4 GB like HF's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tinyinfer.bench import SHAPES


def tensors_of(s: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, hd = s["hidden"], s["intermediate"], s["head_dim"]
    q, kv = s["n_heads"] * hd, s["n_kv_heads"] * hd
    out = [("model.embed_tokens.weight", (s["vocab"], h))]
    for l in range(s["n_layers"]):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    out.append(("model.norm.weight", (h,)))
    if not s["tie"]:
        out.append(("lm_head.weight", (s["vocab"], h)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--shard-gb", type=float, default=4.0)
    a = ap.parse_args()
    s = SHAPES[a.shape]
    dt = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a.out.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=s["hidden"],
               intermediate_size=s["intermediate"], num_hidden_layers=s["n_layers"],
               num_attention_heads=s["n_heads"], num_key_value_heads=s["n_kv_heads"], head_dim=s["head_dim"],
               vocab_size=s["vocab"], rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
               tie_word_embeddings=s["tie"], torch_dtype="float16" if a.dtype == "fp16" else "bfloat16",
               bos_token_id=1, eos_token_id=2, hidden_act="silu")
    (a.out / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator(device=dev).manual_seed(0)
    shards, cur, cur_bytes = [], {}, 0
    for name, shape in tensors_of(s):
        t = (torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * (1.0 if len(shape) == 1 else 0.02))
        t = t.to(dt).cpu()
        if cur and cur_bytes + t.numel() * 2 > a.shard_gb * 1e9:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur[name] = t
        cur_bytes += t.numel() * 2
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], str(a.out / "model.safetensors"), metadata={"format": "pt"})
    else:
        index = {"metadata": {}, "weight_map": {}}
        for k, sh in enumerate(shards):
            fn = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(sh, str(a.out / fn), metadata={"format": "pt"})
            index["weight_map"].update({n: fn for n in sh})
        (a.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    print(f"{a.out}: {a.shape} {a.dtype}, {len(shards)} shard(s)")


if __name__ == "__main__":
    main()
