"""Writes small llama GGUF files for the tests (a helper module, not a test module): a transformers
LlamaForCausalLM stored the way llama.cpp's convert_hf_to_gguf.py stores one (Q/K rows permuted, each matrix in
the GGUF type asked for), with a small SentencePiece-style vocabulary. Test modules import it as
`from gguf_writer import ...` (pytest puts tests/ on sys.path, as for conftest)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

SPM_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "is", "a", "test",
             "of", "and", "to", "in", "it", "that", "on"]


def spm_vocab():
    """A small SentencePiece-style vocabulary: unk/bos/eos, 256 byte tokens, pieces with scores, a user token."""
    toks = [("<unk>", 2), ("<s>", 3), ("</s>", 3)] + [(f"<0x{b:02X}>", 6) for b in range(256)]
    pieces: list[str] = []
    for p in ["\u2581", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-"]:
        if p not in pieces:
            pieces.append(p)
    for w in SPM_WORDS:
        for i in range(1, len(w) + 1):
            for p in ("\u2581" + w[:i], w[:i]):
                if p not in pieces and len(p) > 1:
                    pieces.append(p)
    toks += [(p, 1) for p in pieces] + [("<tool>", 4)]
    scores = [-float(i) if ty == 1 else 0.0 for i, (_, ty) in enumerate(toks)]
    return [t for t, _ in toks], [ty for _, ty in toks], scores


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _kquant_bytes(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Valid K-quant blocks (gguf can dequantize but not quantize these): random bits, sane fp16 scales."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q2_K):  # d, dmin first
        raw[:, :, 0:4] = np.array([4e-4, 2e-4], dtype=np.float16).view(np.uint8)
    elif qtype == Q.Q6_K:  # d last
        raw[:, :, type_size - 2:] = np.array([3e-5], dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def write_llama_gguf(path: Path, model, types: dict, *, arch="llama", tokenizer=True, extra_kv=None,
                     extra_tensors=None) -> Path:
    """Write a transformers LlamaForCausalLM as a llama.cpp-style GGUF (Q/K rows permuted), each matrix in the
    type `types` gives for its GGUF kind ("attn_q", "token_embd", ...; F32 by default)."""
    cfg = model.config
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("synthetic llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        toks, token_types, scores = spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(toks)
        w.add_token_scores(scores)
        w.add_token_types(token_types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_chat_template("{% for m in messages %}{{ bos_token }}[{{ m['role'] }}] {{ m['content'] }}"
                            "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    for key, (kind, value) in (extra_kv or {}).items():
        getattr(w, f"add_{kind}")(key, value)
    for hf, t in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for a tied head
        arr = t.detach().float().numpy()
        parts = hf.split(".")
        if hf == "model.embed_tokens.weight":
            name, kind = "token_embd.weight", "token_embd"
        elif hf == "model.norm.weight":
            name, kind = "output_norm.weight", "output_norm"
        elif hf == "lm_head.weight":
            name, kind = "output.weight", "output"
        else:
            kind = _HF_TO_GGUF[".".join(parts[3:-1])]
            name = f"blk.{parts[2]}.{kind}.weight"
        if kind == "attn_q":
            arr = _llama_cpp_permute(arr, cfg.num_attention_heads)
        elif kind == "attn_k":
            arr = _llama_cpp_permute(arr, cfg.num_key_value_heads)
        qt = types.get(kind, Q.F32) if arr.ndim == 2 else Q.F32
        if qt == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        elif qt == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        elif qt in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K):
            raw = _kquant_bytes(qt, *arr.shape, rng)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)
        else:
            raw = gguf.quants.quantize(arr.astype(np.float32), qt)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_llama(vocab: int, *, tie=False, seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=vocab, tie_word_embeddings=tie,
                      max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.05, bos_token_id=1,
                      eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


# every supported tensor type, one per matrix kind (F16 embedding, K-quants from valid random blocks)
ALL_TYPES = {"token_embd": Q.F16, "output": Q.Q6_K, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0,
             "attn_output": Q.Q4_K, "ffn_gate": Q.Q5_K, "ffn_up": Q.BF16, "ffn_down": Q.F32}


def write_tiny_ggufs(d: Path) -> Path:
    """tiny.gguf (ALL_TYPES, untied head) and tiny_q6k_down.gguf (tied head) in `d`; returns `d`."""
    vocab = len(spm_vocab()[0])
    write_llama_gguf(d / "tiny.gguf", tiny_llama(vocab), ALL_TYPES)
    write_llama_gguf(d / "tiny_q6k_down.gguf", tiny_llama(vocab, tie=True, seed=1),
                     {"ffn_down": Q.Q6_K, "attn_q": Q.F16, "attn_k": Q.Q8_0})
    return d


def q4_gguf(tmp_path: Path) -> Path:
    """A tiny llama whose layer matrices are Q4_0 / Q4_1 (v: Q8_0), for the int4 block import."""
    types = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q4_1, "ffn_gate": Q.Q4_0,
             "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_1}
    return write_llama_gguf(tmp_path / "q4.gguf", tiny_llama(len(spm_vocab()[0])), types)


# A model whose matrices mix the block types the engine imports as they are (Q8_0 -> int8, Q4_0 / Q4_1 -> int4).
MIXED = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0, "ffn_gate": Q.Q8_0,
         "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0, "output": Q.Q8_0}
