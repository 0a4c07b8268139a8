"""GGUF metadata -> ModelConfig: the llama.* keys read the way loaders/hf.py reads config.json, and llama3 rope
scaling recovered from a `rope_freqs.weight` tensor. Reading tensors is loaders/gguf.py's job; this module
sees only metadata values and, for the rope factors, one small array.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .. import _core
from ..errors import ConfigError, ModelFormatError, TinyInferError, UnsupportedModelError


def _field_value(field) -> Any:
    """A metadata value as plain Python (str, int, float, bool, or a list of those)."""
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == gguf.GGUFValueType.ARRAY:
            return None  # nested arrays: nothing we read is one
        return list(field.contents())
    return field.contents()


def read_metadata(reader, path: Path) -> dict[str, Any]:
    """Every metadata key of an open gguf.GGUFReader as plain Python values (the reader's own GGUF.* keys left
    out); a value that cannot be decoded raises ModelFormatError naming the file and key."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = _field_value(field)
        except (KeyboardInterrupt, MemoryError):
            raise
        except Exception as e:
            raise ModelFormatError(f"{path}: corrupt GGUF metadata '{key}': {type(e).__name__}: {e}") from e
    return meta


_CONFIG_FIELDS = ("hidden", "intermediate", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab", "rms_eps",
                  "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                  "rope_original_max_pos", "tie_word_embeddings", "max_position_embeddings", "bos_token_id",
                  "eos_token_ids")


def clone_config(c: "_core.ModelConfig", **changes) -> "_core.ModelConfig":
    """A copy of `c` with `changes` applied (the bound ModelConfig has no copy of its own)."""
    out = _core.ModelConfig()
    for f in _CONFIG_FIELDS:
        setattr(out, f, changes[f] if f in changes else getattr(c, f))
    return out


def rope_freqs_as_llama3(c: "_core.ModelConfig", factors: np.ndarray, where: str) -> None:
    """Llama 3.1+ GGUFs carry their rope scaling as a `rope_freqs.weight` tensor (a divisor per frequency) instead
    of parameters. Find the llama3 parameters that give those divisors, or refuse."""
    base = clone_config(c, rope_scaling="none")
    base.validate()
    inv = np.asarray(_core.ops.rope_inv_freq(base), dtype=np.float64)
    if factors.shape != inv.shape:
        raise ModelFormatError(f"{where}: rope_freqs.weight has shape {list(factors.shape)}, expected "
                               f"[{inv.shape[0]}] (head_dim / 2)")
    target = inv / factors.astype(np.float64)
    if np.allclose(factors, 1.0):
        return
    for factor in (8.0, 16.0, 32.0, 4.0, 2.0, 64.0):
        for low, high in ((1.0, 4.0),):
            for orig in (8192, 4096, 2048, 16384, 32768):
                cand = clone_config(c, rope_scaling="llama3", rope_factor=factor, rope_low_freq_factor=low,
                                     rope_high_freq_factor=high, rope_original_max_pos=orig)
                try:
                    cand.validate()
                except TinyInferError:
                    continue
                got = np.asarray(_core.ops.rope_inv_freq(cand), dtype=np.float64)
                if np.allclose(got, target, rtol=1e-4, atol=0):
                    c.rope_scaling = "llama3"
                    c.rope_factor = factor
                    c.rope_low_freq_factor = low
                    c.rope_high_freq_factor = high
                    c.rope_original_max_pos = orig
                    return
    raise UnsupportedModelError(f"{where}: tensor 'rope_freqs.weight' holds rope frequency factors that match no "
                                f"llama3 rope scaling this engine knows")


# The core's config check names a field by its config.json name; a GGUF holds it under this key.
_GGUF_KEYS = {
    "hidden_size": "llama.embedding_length", "intermediate_size": "llama.feed_forward_length",
    "num_hidden_layers": "llama.block_count", "num_attention_heads": "llama.attention.head_count",
    "num_key_value_heads": "llama.attention.head_count_kv",
    "head_dim": "llama.attention.key_length (else llama.embedding_length / llama.attention.head_count)",
    "vocab_size": "token_embd.weight's rows (else llama.vocab_size)",
    "rms_norm_eps": "llama.attention.layer_norm_rms_epsilon",
    "rope_theta": "llama.rope.freq_base", "max_position_embeddings": "llama.context_length",
    "rope_scaling.factor": "llama.rope.scaling.factor", "eos_token_id": "tokenizer.ggml.eos_token_id",
}


def validate_config(c: "_core.ModelConfig", where: str) -> None:
    """c.validate(), its refusal naming the file and the GGUF key (as loaders/hf.py names config.json)."""
    try:
        c.validate()
    except (UnsupportedModelError, ModelFormatError) as e:
        m = re.search(r"config: ([\w.]+)", str(e))
        key = _GGUF_KEYS.get(m.group(1)) if m else None
        msg = f"{where}: {e}" + (f" (GGUF: {key})" if key else "")
        raise (UnsupportedModelError(msg) if isinstance(e, UnsupportedModelError) else ConfigError(msg)) from None


def config_from_gguf(meta: dict[str, Any], tensor_rows: dict[str, int], where: str) -> "_core.ModelConfig":
    """A validated ModelConfig from GGUF metadata; `tensor_rows` maps tensor names to their first (row) dimension.
    Refuses what the engine can't honour, naming the key."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"{where}: general.architecture = {arch!r} is not supported (only 'llama')")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"llama.{key}", default)

    def need(key: str) -> int:
        v = get(key)
        if v is None:
            raise ConfigError(f"{where}: required metadata 'llama.{key}' is missing")
        if isinstance(v, list):  # per-layer values (some converters write lists): all must agree
            if not v or any(x != v[0] for x in v):
                raise UnsupportedModelError(f"{where}: llama.{key} differs between layers ({v[:8]}...)")
            v = v[0]
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{where}: metadata 'llama.{key}' must be a positive integer, got {v!r}")
        return v

    c = _core.ModelConfig()
    c.hidden = need("embedding_length")
    c.intermediate = need("feed_forward_length")
    c.n_layers = need("block_count")
    c.n_heads = need("attention.head_count")
    c.n_kv_heads = need("attention.head_count_kv") if get("attention.head_count_kv") is not None else c.n_heads
    key_len, value_len = get("attention.key_length"), get("attention.value_length")
    rope_dims = get("rope.dimension_count")
    if key_len is not None:
        c.head_dim = need("attention.key_length")
    elif rope_dims is not None:
        c.head_dim = need("rope.dimension_count")
    else:
        c.head_dim = c.hidden // c.n_heads
    if value_len is not None and value_len != c.head_dim:
        raise UnsupportedModelError(f"{where}: llama.attention.value_length = {value_len} differs from the key "
                                    f"length {c.head_dim}")
    if rope_dims is not None and rope_dims != c.head_dim:
        raise UnsupportedModelError(f"{where}: llama.rope.dimension_count = {rope_dims} (partial rotary) differs "
                                    f"from head_dim {c.head_dim}")
    eps = get("attention.layer_norm_rms_epsilon", 1e-5)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < math.inf:
        raise ConfigError(f"{where}: llama.attention.layer_norm_rms_epsilon must be a finite number > 0, got "
                          f"{eps!r}")
    c.rms_eps = float(eps)
    theta = get("rope.freq_base", 10000.0)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not 0 < theta < math.inf:
        raise ConfigError(f"{where}: llama.rope.freq_base must be a finite number > 0, got {theta!r}")
    c.rope_theta = float(theta)

    scaling = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    if scaling in (None, "none") or (scaling == "linear" and factor in (None, 1.0)):
        c.rope_scaling = "none"
    elif scaling == "linear":
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor < math.inf:
            raise ConfigError(f"{where}: llama.rope.scaling.factor must be a finite number > 0, got {factor!r}")
        c.rope_scaling = "linear"
        c.rope_factor = float(factor)
    else:
        raise UnsupportedModelError(f"{where}: llama.rope.scaling.type = {scaling!r} is not supported "
                                    f"(supported: none, linear; llama3 via rope_freqs.weight)")

    ctx = get("context_length")
    c.max_position_embeddings = need("context_length") if ctx is not None else 2048

    embd_rows = tensor_rows.get("token_embd.weight")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size")
    if embd_rows is not None:
        c.vocab = int(embd_rows)
    elif isinstance(vocab, int) and vocab > 0:
        c.vocab = vocab
    elif isinstance(tokens, list) and tokens:
        c.vocab = len(tokens)
    else:
        raise ConfigError(f"{where}: cannot tell the vocabulary size (no token_embd.weight, llama.vocab_size or "
                          f"tokenizer.ggml.tokens)")
    if isinstance(tokens, list) and len(tokens) > c.vocab:
        raise ModelFormatError(f"{where}: tokenizer.ggml.tokens has {len(tokens)} tokens but token_embd.weight "
                               f"has {c.vocab} rows")
    # llama.cpp writes the output projection only when it is not the embedding matrix
    c.tie_word_embeddings = "output.weight" not in tensor_rows

    def token_id(key: str) -> Optional[int]:
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < c.vocab:
            raise ConfigError(f"{where}: tokenizer.ggml.{key} = {v!r} is not a token id (vocab {c.vocab})")
        return v

    bos = token_id("bos_token_id")
    c.bos_token_id = bos if bos is not None else -1
    # EOS, then llama.cpp's other end-of-generation ids (end of turn / end of message) where the file has them
    eos = [t for t in (token_id("eos_token_id"), token_id("eot_token_id"), token_id("eom_token_id")) if t is not None]
    c.eos_token_ids = list(dict.fromkeys(eos))
    validate_config(c, where)  # head_dim 64..256, GQA divisibility, ...
    return c


__all__ = ["read_metadata", "config_from_gguf", "clone_config", "rope_freqs_as_llama3", "validate_config"]
