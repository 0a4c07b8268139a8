"""The load: which engine and weight format run, the core engine built from a model's files, and the caches
that keep its load-time tuning across runs (the GEMV plan, the prefill's GEMM tactics).

Engine.__init__ is the caller: check_threads / pick_device / check_dtype decide, load_cpu / load_cuda (the
latter through with_plan_cache) build the core engine, TacticsCache keeps what the prefill tuned.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from tqdm.auto import tqdm

from . import _core
from .errors import DeviceError, InvalidRequestError, TinyInferError

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "fp16", "bf16", "fp32", "int8", "int4")
QUANTIZED = ("int8", "int4")  # weight-only formats (cpp/core/quant.h): quantized at load, on either engine
# What each engine can honour. The CPU reference engine computes in fp32 with fp32 weights (int8 / int4: the
# dequantized numbers the GPU's quantized kernels stand for); the GPU engine stores fp16, int8 or int4.
DEVICE_DTYPES = {"cpu": ("fp32", "int8", "int4"), "cuda": ("fp16", "int8", "int4")}

# ---- the engine and its weight format ----


def no_cuda_sentence(info: dict) -> str:
    """Why a build (its build_info) has no CUDA backend and the command that fixes it, as one flat sentence."""
    src = info.get("source_dir") or ""
    # A source tree still there is what was installed (`pip install .`); else it came from an index. No pip cache:
    # pip would reinstall the CPU-only wheel it built last time.
    src = shlex.quote(src) if src and os.path.isfile(os.path.join(src, "pyproject.toml")) else "tinyinfer"
    reinstall = f"pip install --force-reinstall --no-deps --no-cache-dir {src}"
    reason, nvcc = info.get("no_cuda_reason"), info.get("nvcc_version") or "?"
    if reason == "no-cublaslt":
        wheel = "nvidia-cublas-cu12" if nvcc.startswith("12.") else "nvidia-cublas"
        return (f"no CUDA backend: nvcc {nvcc} was found but not cuBLASLt when tinyinfer was built; "
                f"fix: pip install {wheel} && {reinstall}")
    if reason == "cuda-off":
        return f"no CUDA backend: tinyinfer was built with TINYINFER_CUDA=OFF; fix: {reinstall}"
    return (f"no CUDA backend: no CUDA compiler was found when tinyinfer was built; "
            f"fix: pip install 'cuda-toolkit[nvcc,cudart,cccl]' && {reinstall}")


def no_gpu_sentence() -> Optional[str]:
    """Why there is no GPU to use whatever the build (Linux without the NVIDIA driver's device), or None: a
    CPU-only build on such a machine is no fault to fix by rebuilding."""
    if sys.platform.startswith("linux") and not any(os.path.exists(p) for p in ("/dev/nvidiactl",
                                                                                "/proc/driver/nvidia")):
        return "no NVIDIA GPU on this machine (no NVIDIA driver: /dev/nvidiactl is absent)"
    return None


def cuda_status() -> tuple[bool, str]:
    """(usable, reason): whether this build has the GPU engine and a usable GPU is present."""
    if not hasattr(_core, "CudaEngine"):
        return False, no_gpu_sentence() or no_cuda_sentence(dict(_core.build_info))
    status = _core.ops.device_status()
    return bool(status["usable"]), str(status.get("reason") or "")


_fallback_said = False


def check_dtype(dtype: str, device: str) -> str:
    """The weight format `device`'s engine runs for `dtype` ("auto": fp16 on the GPU, fp32 on the CPU); a dtype
    the engine cannot honour is refused with the valid ones, never silently swapped."""
    valid = DEVICE_DTYPES[device]
    if dtype == "auto":
        return valid[0]
    if dtype not in valid:
        where = "the GPU engine" if device == "cuda" else "the CPU engine (it computes in fp32)"
        raise InvalidRequestError(f"dtype={dtype!r} cannot be honoured by {where}; valid: auto, {', '.join(valid)}")
    return dtype


def pick_device(device: str) -> str:
    global _fallback_said
    if device not in DEVICES:
        raise InvalidRequestError(f"device must be one of {', '.join(DEVICES)} (got {device!r})")
    if device == "cpu":
        return "cpu"
    usable, reason = cuda_status()
    if usable:
        return "cuda"
    if device == "cuda":
        raise DeviceError(f"device='cuda' but no usable GPU: {reason}")
    if not _fallback_said:  # "auto": say once per process why the CPU engine runs
        print(f"tinyinfer: no usable GPU, running the CPU engine: {reason}", file=sys.stderr)
        _fallback_said = True
    return "cpu"


def check_threads(threads: Optional[int]) -> int:
    """The CPU engine's thread count: None -> the cores this process may run on; else an int >= 1. (The GPU
    engine's host side is one thread; there the value is checked and otherwise unused.)"""
    if threads is None:
        try:
            return len(os.sched_getaffinity(0)) or 1
        except AttributeError:  # not Linux
            return os.cpu_count() or 1
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1024:
        raise InvalidRequestError(f"threads must be an integer in 1..1024, got {threads!r}")
    return threads


# ---- the GEMV plan across runs: the CUDA engine's load-time tuning (cpp/gpu/plan_cache.h) is kept in
# $TINYINFER_CACHE/plans/, one file per key (GPU, driver, build, model shape, options) and per build of _core, so a
# later load takes it instead of tuning. TINYINFER_PLAN_CACHE=0 or Engine(plan_cache=False): neither read nor
# written. A file the engine refuses (stale or corrupt) is said in one warning, re-tuned and overwritten; one
# that cannot be read or written is skipped: it is only a cache.


def plan_file(key: str) -> Optional[Path]:
    """Where the plan for `key` (CudaEngine.plan_key) is kept; None where the plan cache is turned off."""
    if os.environ.get("TINYINFER_PLAN_CACHE", "1") == "0":
        return None
    from .models import cache_dir

    try:  # the module's size and time stand for this build (any rebuilt kernel may time differently)
        st = os.stat(_core.__file__)
        build = f"{st.st_size}-{st.st_mtime_ns}"
    except (OSError, AttributeError, TypeError):
        build = "?"
    digest = hashlib.sha256(f"{key}\n{build}".encode()).hexdigest()[:24]
    return cache_dir() / "plans" / f"{digest}.txt"


def _read_plan(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")  # garbage reads as text the core calls corrupt
    except OSError:
        return ""


def _write_atomic(path: Path, text: str) -> bool:
    """Replace `path` by `text` (False where it cannot be written: the caches skip it)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except OSError:
        return False
    return True


def with_plan_cache(opts: "_core.CudaOptions", path: Optional[Path],
                    make: Callable[["_core.CudaOptions"], "_core.CudaEngine"]) -> "_core.CudaEngine":
    """make(opts) with opts.plan_text read from `path` (None: the cache is off), then the plan kept there: a
    refused one said (one warning) and every tuned one written. opts is left as it was given."""
    given = opts.plan_text
    use_file = path is not None and not given  # a plan_text given by the caller wins over the file
    if use_file:
        opts.plan_text = _read_plan(path)
    try:
        core = make(opts)
    finally:
        opts.plan_text = given
    if core.plan_problem:
        where = f"in {path}" if use_file else "in CudaOptions.plan_text"
        warnings.warn(f"tinyinfer: the cached GEMV plan {where} was ignored ({core.plan_problem}); tuned again",
                      RuntimeWarning, stacklevel=3)
    if use_file and not core.plan_from_cache and core.plan_text:
        _write_atomic(path, core.plan_text)
    return core


# ---- building the core engine ----


def load_cpu_store(model, config, dtype: str, show: bool = False) -> "_core.WeightStore":
    """The CPU engine's store, every tensor in its stored precision: GGUF Q4_0 / Q4_1 / Q8_0 matrices as our
    int4 / int8 blocks (whatever the dtype: their numbers are exactly the fp32 dequantization's), taken first so
    their fp32 twins are never made; the rest as the file has them. int8 / int4: then re-encoded (quantize)."""
    store = _core.WeightStore(config)
    held = set()
    if model.int4_blocks is not None:
        for name, q, sm in model.int4_blocks():
            store.add_int4(name, q, sm)
            held.add(name)
    if model.int8_blocks is not None:
        for name, q, d in model.int8_blocks(layers=True):
            store.add_int8(name, q, d)
            held.add(name)
    skip = frozenset(held)
    n_tensors = 2 + 9 * config.n_layers + (0 if config.tie_word_embeddings else 1) - len(skip)
    for name, array, src_dtype in tqdm(model.tensors(skip=skip) if skip else model.tensors(), total=n_tensors,
                                       desc="loading", unit="tensor", leave=False, disable=not show):
        if name in held or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        store.add(name, array, src_dtype)
    store.finish()
    if dtype in QUANTIZED:
        store.quantize(dtype)
    return store


def load_cpu(model, max_seq_len: int, dtype: str, show: bool, threads: int, act8: int = 0):
    """The CPU reference engine over the store as held (weights in their stored precision); act8: CpuEngine's."""
    return _core.CpuEngine(load_cpu_store(model, model.config, dtype, show), max_seq_len, threads, act8=act8)


def load_cuda(model, max_seq_len: int, opts: "_core.CudaOptions", dtype: str, show: bool):
    """The GPU engine, its weights streamed from the mapped file tensor by tensor (CudaEngine.load): no host copy
    of the model is made. The bar counts the file's bytes as the engine takes them."""
    tied = model.config.tie_word_embeddings
    with tqdm(total=model.stream_bytes, desc="loading", unit="B", unit_scale=True, leave=False,
              disable=not show) as bar:
        def items():
            for item in model.stream(dtype):
                if tied and item.name == "lm_head.weight" and item.kind == "rows":  # a copy some tied files keep
                    continue
                yield item
                bar.update(item.nbytes)

        return _core.CudaEngine.load(model.config, max_seq_len, opts, items())


# ---- GEMM tactics across runs: the prefill's cuBLASLt algorithms, tuned on first use of a shape, are kept in the
# cache directory per cuBLASLt version and GPU, so a later process starts tuned (TINYINFER_TACTICS=0: neither read
# nor written). A file that cannot be read or written is silently skipped: it is only a cache.


class TacticsCache:
    """One engine's tactics file and how many tuned GEMMs it holds (so a save writes only when there are more)."""

    def __init__(self) -> None:
        self.file: Optional[Path] = None  # None: nothing is read or written
        self.saved = 0

    def load(self, core: Any) -> None:  # a CudaEngine
        """Hand the core the tactics kept for its GPU and cuBLASLt (when it prefills with GEMMs)."""
        if os.environ.get("TINYINFER_TACTICS", "1") == "0" or not core.batched_prefill:
            return
        from .models import cache_dir

        name = re.sub(r"[^A-Za-z0-9._-]+", "_", _core.CudaEngine.gemm_fingerprint())
        try:
            self.file = cache_dir() / "tactics" / f"{name}.txt"
            if self.file.exists():
                core.load_tactics(self.file.read_text())
        except (OSError, TinyInferError):
            self.file = None
        self.saved = core.tuned_gemms

    def save(self, core: Any) -> None:  # a CpuEngine or a CudaEngine
        """Write the tactics when the core tuned more since the last save (a CPU core never has a file)."""
        if self.file is None or core.tuned_gemms <= self.saved:
            return
        text = core.save_tactics()  # ("": an engine whose tactics do not belong in the file)
        if text and _write_atomic(self.file, text):
            self.saved = core.tuned_gemms


__all__ = ["DEVICE_DTYPES", "TacticsCache", "check_dtype", "check_threads", "cuda_status", "load_cpu",
           "load_cpu_store", "load_cuda", "no_cuda_sentence", "no_gpu_sentence", "pick_device", "plan_file",
           "with_plan_cache"]
