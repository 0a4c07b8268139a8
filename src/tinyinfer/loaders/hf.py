"""HuggingFace model directories: config.json + model.safetensors (or a sharded model.safetensors.index.json).

Tensors are read through the `safetensors` package, which checks each file's header against its size; the data
are numpy views over the memory-mapped file (no copy in Python), handed to the core one at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
import warnings
from typing import Any, Iterator, Optional

import numpy as np

from .. import _core
from ..errors import ConfigError, ModelFormatError, ModelNotFoundError, UnsupportedModelError
from ..sampling import DEFAULTABLE
from ..tokenizer import Tokenizer
from .base import LoadedModel, StreamItem, TensorItem, rows_items

# safetensors dtype -> (numpy dtype of the raw bits, core dtype)
_DTYPES = {"F32": ("<f4", "fp32"), "F16": ("<f2", "fp16"), "BF16": ("<u2", "bf16")}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelNotFoundError(f"missing file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


_INT64 = 2**63  # the core's integer fields are int64
_KINDS = {"an integer": int, "a number": (int, float), "true or false": bool}


def _field(d: dict, key: str, kind: str, default: Any, where: str, *, within: str = "",
           null_is_default: bool = False) -> Any:
    """d[key] if it is of `kind` (a JSON true is no number, "false" no boolean, 1.7 no integer, null none of them
    unless null_is_default); `default` when the key is absent. Else a ConfigError naming the field."""
    v = d.get(key)
    if key not in d or (v is None and null_is_default):
        return default
    if not isinstance(v, _KINDS[kind]) or isinstance(v, bool) != (kind == "true or false"):
        raise ConfigError(f"{where}: '{within + '.' if within else ''}{key}' must be {kind}, got {v!r}")
    if kind == "an integer" and not -_INT64 <= v < _INT64:
        raise ConfigError(f"{where}: '{within + '.' if within else ''}{key}' is out of range, got {v!r:.40}")
    return v


def _eos_id(v: Any, where: str) -> int:
    """An EOS id of the config: an integer in the 64-bit range (the vocabulary is checked by the core); a JSON
    true is no id."""
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _INT64:
        raise ConfigError(f"{where}: 'eos_token_id' must be a token id (an integer >= 0) or a list of them, got "
                          f"{v!r:.60}")
    return v


def _eos_ids(v: Any, where: str) -> list[int]:
    """'eos_token_id' as a list: absent / null none, an id, or a list of ids."""
    if v is None:
        return []
    return [_eos_id(e, where) for e in v] if isinstance(v, list) else [_eos_id(v, where)]


# generation_config.json's sampling fields that vLLM's server takes as its defaults (sampling.DEFAULTABLE), each
# with transformers' own default: a value equal to it is left out, as vLLM reads the file (to_diff_dict)
_TRANSFORMERS_DEFAULTS = dict(zip(DEFAULTABLE, (1.0, 1.0, 50, None, 1.0)))


def _sampling_defaults(gen: dict[str, Any]) -> dict[str, Any]:
    """The file's values as given, but those equal to transformers' defaults (a JSON true is no 1.0: it stays, for
    its user to refuse)."""
    return {k: gen[k] for k, default in _TRANSFORMERS_DEFAULTS.items()
            if gen.get(k) is not None and (isinstance(gen[k], bool) or gen[k] != default)}


def _read_generation_config(path: Path) -> Optional[tuple[str, dict[str, Any]]]:
    """generation_config.json as (its path, its object); None when there is none. A file that is no JSON object is
    ignored with a warning, as transformers and vLLM do: it is advice beside the model, not the model."""
    if not path.is_file():
        return None
    try:
        return str(path), _read_json(path)
    except ModelFormatError as e:
        warnings.warn(f"{e}; the file is ignored", stacklevel=3)
        return None


def _rope_settings(cfg: dict, where: str) -> dict:
    """rope_theta and scaling from either transformers 5's `rope_parameters` or the older `rope_theta` +
    `rope_scaling`. Returns {"theta", "type", "factor", ...}."""
    params, field = cfg.get("rope_parameters"), "rope_parameters"
    if params is None:
        params, field = cfg.get("rope_scaling"), "rope_scaling"
        if params is None:
            params = {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: '{field}' must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        rope_type = "none"
    if rope_type not in ("none", "linear", "llama3"):
        raise UnsupportedModelError(
            f"{where}: {field}.rope_type = {rope_type!r} is not supported (supported: default, linear, llama3)"
        )
    theta = (_field(params, "rope_theta", "a number", None, where, within=field) if "rope_theta" in params
             else _field(cfg, "rope_theta", "a number", 10000.0, where))
    out = {"theta": float(theta), "type": rope_type}
    if rope_type != "none":
        if "factor" not in params:
            raise ConfigError(f"{where}: {field}.factor is missing for rope_type {rope_type!r}")
        out["factor"] = float(_field(params, "factor", "a number", None, where, within=field))
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise ConfigError(f"{where}: {field}.{key} is missing for rope_type 'llama3'")
        out["low"] = float(_field(params, "low_freq_factor", "a number", None, where, within=field))
        out["high"] = float(_field(params, "high_freq_factor", "a number", None, where, within=field))
        out["original_max_pos"] = _field(params, "original_max_position_embeddings", "an integer", None, where,
                                         within=field)
    return out


def config_from_hf(cfg: dict[str, Any], where: str = "config.json",
                   generation: Optional[tuple[str, dict[str, Any]]] = None) -> _core.ModelConfig:
    """A validated ModelConfig from a parsed config.json (and generation_config.json: (its path, its object), whose
    EOS ids are added); refuses what the engine can't honour, naming the field."""
    model_type = cfg.get("model_type")
    if model_type != "llama":
        raise UnsupportedModelError(f"{where}: model_type = {model_type!r} is not supported (only 'llama')")
    archs = cfg.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ConfigError(f"{where}: 'architectures' must be a list of names, got {archs!r}")
    if archs is not None and "LlamaForCausalLM" not in archs:
        raise UnsupportedModelError(f"{where}: architectures = {archs!r} (only LlamaForCausalLM is supported)")
    refused = {
        "attention_bias": lambda v: bool(v),
        "mlp_bias": lambda v: bool(v),
        "hidden_act": lambda v: v not in ("silu", "swish"),
        "quantization_config": lambda v: v is not None,
        "sliding_window": lambda v: v is not None,
    }
    for key, bad in refused.items():
        if key in cfg and bad(cfg[key]):
            raise UnsupportedModelError(f"{where}: {key} = {cfg[key]!r} is not supported by this engine")

    def need(key: str) -> int:
        if cfg.get(key) is None:
            raise ConfigError(f"{where}: required field '{key}' is missing")
        return _field(cfg, key, "an integer", None, where)

    c = _core.ModelConfig()
    c.hidden = need("hidden_size")
    c.intermediate = need("intermediate_size")
    c.n_layers = need("num_hidden_layers")
    c.n_heads = need("num_attention_heads")
    c.vocab = need("vocab_size")
    # (null: the default, as transformers' LlamaConfig has it for these two)
    c.n_kv_heads = _field(cfg, "num_key_value_heads", "an integer", c.n_heads, where, null_is_default=True)
    c.head_dim = _field(cfg, "head_dim", "an integer", c.hidden // max(c.n_heads, 1), where, null_is_default=True)
    c.rms_eps = float(_field(cfg, "rms_norm_eps", "a number", 1e-6, where))
    rope = _rope_settings(cfg, where)
    c.rope_theta = rope["theta"]
    c.rope_scaling = rope["type"]
    if "factor" in rope:
        c.rope_factor = rope["factor"]
    if rope["type"] == "llama3":
        c.rope_low_freq_factor = rope["low"]
        c.rope_high_freq_factor = rope["high"]
        c.rope_original_max_pos = rope["original_max_pos"]
    c.tie_word_embeddings = _field(cfg, "tie_word_embeddings", "true or false", False, where)
    c.max_position_embeddings = _field(cfg, "max_position_embeddings", "an integer", 2048, where)
    bos = cfg.get("bos_token_id")
    # (the engine itself never reads it: anything but an id in the 64-bit range is none, -1)
    c.bos_token_id = bos if isinstance(bos, int) and not isinstance(bos, bool) and 0 <= bos < _INT64 else -1
    c.eos_token_ids = _eos_ids(cfg.get("eos_token_id"), where)
    if generation is not None:
        # transformers' generate() and vLLM stop at the generation config's EOS ids too (Llama-3's instruct
        # models: end of text and end of turn there, only one of them in config.json)
        gen_where, gen = generation
        try:
            extra = _eos_ids(gen.get("eos_token_id"), gen_where)
            bad = [t for t in extra if t >= c.vocab]
            if bad:
                raise ConfigError(f"{gen_where}: 'eos_token_id' {bad[0]} is out of range for a vocabulary of "
                                  f"{c.vocab}")
        except ConfigError as e:  # (advice beside the model, as its sampling fields: see _read_generation_config)
            warnings.warn(f"{e}; its EOS ids are ignored", stacklevel=3)
            extra = []
        c.eos_token_ids = list(dict.fromkeys(c.eos_token_ids + extra))
    try:  # the core checks ranges (head_dim 64..256, GQA divisibility, ...) and names the field
        c.validate()
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{where}: {e}") from None
    except ModelFormatError as e:
        raise ConfigError(f"{where}: {e}") from None
    return c


def _safetensors_files(d: Path) -> list[Path]:
    single = d / "model.safetensors"
    index = d / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFormatError(f"{index}: no 'weight_map' object")
        if not all(isinstance(f, str) for f in weight_map.values()):
            bad = next(f for f in weight_map.values() if not isinstance(f, str))
            raise ModelFormatError(f"{index}: 'weight_map' values must be file names, got {bad!r:.60}")
        files = [d / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelNotFoundError(f"missing shard {f} (listed in {index.name})")
        return files
    raise ModelNotFoundError(f"{d}: no model.safetensors or model.safetensors.index.json")


def _iter_safetensors(path: Path) -> Iterator[TensorItem]:
    """(name, view, dtype) for each tensor of one file. safe_open validates the header and file size; the data
    are views over one read-only memory map of the file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception as e:  # SafetensorError and friends: truncated, corrupt header, ...
        raise ModelFormatError(f"{path}: not a valid safetensors file: {e}") from e
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    header_len = int(raw[:8].view("<u8")[0])
    header = json.loads(bytes(raw[8 : 8 + header_len]))
    base = 8 + header_len
    for name, (dtype, shape) in meta.items():
        if dtype not in _DTYPES:
            raise UnsupportedModelError(f"{path}: tensor '{name}' has dtype {dtype} (supported: F32, F16, BF16)")
        np_dtype, core_dtype = _DTYPES[dtype]
        start, end = header[name]["data_offsets"]
        view = raw[base + start : base + end].view(np_dtype).reshape(shape)
        yield name, view, core_dtype


def _apply_tokenizer_config(tok: Tokenizer, path: Path) -> None:
    """Special-token strings and the chat template from tokenizer_config.json (as transformers reads them)."""
    if not path.is_file():
        return
    cfg = _read_json(path)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = cfg.get(name)
        if isinstance(v, dict):  # an AddedToken serialised as {"content": ...}
            v = v.get("content")
        if isinstance(v, str):
            setattr(tok, name, v)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if isinstance(template, str) and template:
        tok.chat_template = template


def _apply_chat_template_file(tok: Tokenizer, path: Path) -> None:
    """Newer transformers save the template as chat_template.jinja beside tokenizer_config.json."""
    if path.is_file():
        try:
            tok.chat_template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFormatError(f"{path}: cannot read the chat template: {e}") from e


def load_hf_dir(d: Path) -> LoadedModel:
    config_path = d / "config.json"
    generation = _read_generation_config(d / "generation_config.json")
    config = config_from_hf(_read_json(config_path), where=str(config_path), generation=generation)
    files = _safetensors_files(d)

    def tensors() -> Iterator[TensorItem]:
        for f in files:
            for name, view, dtype in _iter_safetensors(f):
                if name.endswith("rotary_emb.inv_freq"):  # a buffer older checkpoints saved; recomputed
                    continue
                yield name, view, dtype

    def stream(fmt: str) -> Iterator[StreamItem]:  # safetensors are stored as floats: every tensor as rows
        for name, view, dtype in tensors():
            yield from rows_items(name, view, dtype)

    tokenizer = None
    tok_path = d / "tokenizer.json"
    if tok_path.is_file():
        tokenizer = Tokenizer.from_file(tok_path)
        _apply_tokenizer_config(tokenizer, d / "tokenizer_config.json")
        _apply_chat_template_file(tokenizer, d / "chat_template.jinja")
    return LoadedModel(config=config, tensors=tensors, tokenizer=tokenizer, path=d,
                       sampling_defaults=_sampling_defaults(generation[1]) if generation else {},
                       description=f"HF safetensors ({len(files)} file{'s' if len(files) > 1 else ''})",
                       stream=stream, stream_bytes=sum(f.stat().st_size for f in files))
