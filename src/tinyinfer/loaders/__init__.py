"""Model loaders: a path in, a LoadedModel out (config, tensors by HuggingFace name, tokenizer)."""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelNotFoundError, UnsupportedModelError
from .base import LoadedModel, TensorSource
from .hf import load_hf_dir


def load_model(path: str | Path) -> LoadedModel:
    """Load a model from a HuggingFace directory (config.json + safetensors)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"model path does not exist: {p}")
    if p.is_dir():
        return load_hf_dir(p)
    raise UnsupportedModelError(
        f"{p}: not a model directory (expected a HuggingFace directory with config.json and model.safetensors)"
    )


__all__ = ["LoadedModel", "TensorSource", "load_model", "load_hf_dir"]
