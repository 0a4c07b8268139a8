"""tinyinfer: a small, readable, fast LLM inference engine for Llama-family models."""

from __future__ import annotations

from .errors import (  # noqa: F401  (errors first: the core maps its exceptions onto these)
    ChatTemplateError,
    ConfigError,
    DeviceError,
    InvalidRequestError,
    KvCacheFullError,
    ModelFormatError,
    ModelNotFoundError,
    QueueFullError,
    TinyInferError,
    TokenizerError,
    UnsupportedModelError,
)


def _import_core():
    """Import the compiled core. The CUDA build links libcublasLt.so.1x, found by rpath in NVIDIA's PyPI wheel
    beside tinyinfer (site-packages/nvidia/cu13/lib) or where the build found it. When the wheel sits elsewhere
    on sys.path (a user site, a --system-site-packages venv), load it from there first and retry."""
    import os
    import sys

    if sys.platform == "win32":  # DLLs are not found by rpath: name the wheel's directories
        for base in sys.path:
            for sub in ("cu13", "cublas", "cu12"):
                for b in ("bin", os.path.join("bin", "x64"), os.path.join("bin", "x86_64")):
                    d = os.path.join(base, "nvidia", sub, b)
                    if os.path.isdir(d):
                        os.add_dll_directory(d)
    try:
        from . import _core as core
    except ImportError as e:
        if "cublas" not in str(e).lower():
            raise
        import ctypes

        for base in sys.path:
            for sub in ("cu13", "cublas", "cu12"):
                lib_dir = os.path.join(base, "nvidia", sub, "lib")
                for name in ("libcublasLt.so.13", "libcublasLt.so.12"):
                    if os.path.exists(os.path.join(lib_dir, name)):
                        ctypes.CDLL(os.path.join(lib_dir, name), mode=ctypes.RTLD_GLOBAL)
                        from . import _core as core

                        return core
        raise ImportError(
            f"{e}. tinyinfer was built with CUDA and needs cuBLASLt at run time: pip install nvidia-cublas"
        ) from e
    return core


_core = _import_core()
from ._core import ModelConfig  # noqa: E402
from .engine import Completion, Engine, Stats  # noqa: E402
from .sampling import SamplingParams  # noqa: E402
from .structured import StructuredOutputs  # noqa: E402
from .scheduler import Delta, Request, Scheduler, TokenLogprob  # noqa: E402

__version__ = _core.build_info["version"]

__all__ = [
    "Engine",
    "Completion",
    "Stats",
    "SamplingParams",
    "StructuredOutputs",
    "Scheduler",
    "Request",
    "Delta",
    "TokenLogprob",
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
    "QueueFullError",
    "KvCacheFullError",
]
