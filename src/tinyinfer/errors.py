"""tinyinfer's exceptions. Every error the engine raises on purpose is a TinyInferError; the message names the
file, field or value at fault. The C++ core's errors arrive as the matching subclass (see bindings/module.cpp).
"""

from __future__ import annotations

from typing import Optional


class TinyInferError(Exception):
    """Base class of all tinyinfer errors."""


class ModelNotFoundError(TinyInferError, FileNotFoundError):
    """The model path does not exist, or a file the model needs is missing."""


class ModelFormatError(TinyInferError, ValueError):
    """A model file is corrupt or truncated, or a tensor is missing or has the wrong shape."""


class ConfigError(ModelFormatError):
    """The model config lacks a required field or holds an invalid value."""


class UnsupportedModelError(TinyInferError, ValueError):
    """A valid model that this engine cannot run (the field or tensor type is named)."""


class InvalidRequestError(TinyInferError, ValueError):
    """Bad arguments to a call: empty prompt, bad sampling values, too long for max_seq_len, ... `param`: the
    request field at fault where the raiser knows it (a server's 400 names it; kept through pickling, as the
    exception's __dict__), else None."""

    def __init__(self, *args, param: Optional[str] = None):
        super().__init__(*args)
        self.param = param


class TokenizerError(TinyInferError):
    """Text was given but the model has no usable tokenizer."""


class DeviceError(TinyInferError, RuntimeError):
    """No usable GPU, not enough GPU memory (or host memory for the CPU engine), or a CUDA error."""


class QueueFullError(TinyInferError, RuntimeError):
    """The scheduler's waiting queue is full (Scheduler(max_waiting=...)); try again later (a server answers 503)."""


class KvCacheFullError(TinyInferError, RuntimeError):
    """A running request needed a KV page for its next token and the pool had none left: the request ended there.
    `completion` holds what it generated up to that point (finish_reason "length")."""

    def __init__(self, message: str, completion=None):
        super().__init__(message)
        self.completion = completion


class ChatTemplateError(TinyInferError, ValueError):
    """A chat template failed to render: a syntax error, raise_exception() in the template, or an attempt to
    leave the Jinja sandbox (templates come from model files and are untrusted)."""


__all__ = [
    "TinyInferError",
    "ModelNotFoundError",
    "ModelFormatError",
    "ConfigError",
    "UnsupportedModelError",
    "InvalidRequestError",
    "TokenizerError",
    "DeviceError",
    "ChatTemplateError",
    "QueueFullError",
    "KvCacheFullError",
]
