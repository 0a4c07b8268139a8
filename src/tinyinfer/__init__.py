"""tinyinfer: a small, readable, fast LLM inference engine for Llama-family models."""

from __future__ import annotations

from .errors import (  # noqa: F401  (errors first: the core maps its exceptions onto these)
    ChatTemplateError,
    ConfigError,
    DeviceError,
    InvalidRequestError,
    ModelFormatError,
    ModelNotFoundError,
    TinyInferError,
    TokenizerError,
    UnsupportedModelError,
)
from . import _core  # noqa: E402
from ._core import ModelConfig  # noqa: E402
from .engine import Completion, Engine, Stats  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__version__ = _core.build_info["version"]

__all__ = [
    "Engine",
    "Completion",
    "Stats",
    "SamplingParams",
    "ModelConfig",
    "TinyInferError",
    "ChatTemplateError",
    "ModelNotFoundError",
    "ModelFormatError",
    "ConfigError",
    "UnsupportedModelError",
    "InvalidRequestError",
    "TokenizerError",
    "DeviceError",
]
