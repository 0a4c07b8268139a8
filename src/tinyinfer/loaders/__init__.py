"""Model loaders: a path in, a LoadedModel out (config, tensors by HuggingFace name, tokenizer)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InvalidRequestError, ModelNotFoundError, UnsupportedModelError
from .base import LoadedModel, TensorSource
from .gguf import load_gguf
from .hf import load_hf_dir
from .hub import parse_hub_name, resolve_hub_name


def _is_gguf_file(p: Path) -> bool:
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def load_model(path: str | Path) -> LoadedModel:
    """Load a model from a HuggingFace directory (config.json + safetensors) or a GGUF file (llama architecture),
    local or by hub name ("org/name", "org/name:file.gguf", "org/name@revision"; loaders/hub.py)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidRequestError(f"the model must be a path or a hub name (a str or os.PathLike), got a "
                                  f"{type(path).__name__}")
    try:
        p = Path(path).expanduser()
        found = p.exists()
    except (TypeError, RuntimeError, OSError) as e:  # a bytes PathLike; "~nosuchuser/x"; a name too long
        raise ModelNotFoundError(f"model path {str(path)!r:.200} cannot be used: {e}") from None
    if not found:
        hub = parse_hub_name(str(path)) if isinstance(path, str) else None
        if hub is None:
            raise ModelNotFoundError(
                f"model path does not exist: {p} (a model is a local HF directory, a .gguf file, or a hub name "
                f"such as HuggingFaceTB/SmolLM2-135M-Instruct or org/name:file.gguf)"
            )
        p = resolve_hub_name(hub)
    if p.is_dir():
        return load_hf_dir(p)
    if p.is_file() and _is_gguf_file(p):
        return load_gguf(p)
    raise UnsupportedModelError(
        f"{p}: not a model directory or GGUF file (expected a HuggingFace directory with config.json and "
        f"model.safetensors, or a .gguf file)"
    )


__all__ = ["LoadedModel", "TensorSource", "load_model", "load_hf_dir", "load_gguf"]
