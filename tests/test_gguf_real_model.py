"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file: logits,
greedy tokens and perplexity on tests/data/eval.txt, both in fp32.

Reference: transformers' own GGUF support (`from_pretrained(dir, gguf_file=...)`), which dequantizes with the same
`gguf` package and undoes the same Q/K permutation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import EVAL_TEXT, SMOLLM_GGUF_NAME, hf_logits


def chat_messages():
    return [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "Write a short story about a robot who learns to paint."},
    ]


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


def test_logits_match_transformers(smol_engine, hf_smollm_model, chat_ids, record_property):
    ours = smol_engine.logits(chat_ids)
    ref = hf_logits(hf_smollm_model, chat_ids)
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
        ref = hf_logits(hf_smollm_model, chunk)
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
