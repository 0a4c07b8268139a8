"""Engine: load a model, then generate / stream / score with it.

    eng = Engine("path/to/hf_dir")
    out = eng.generate("Once upon a time", max_tokens=32)
    print(out.text, out.finish_reason, out.stats)

Python tokenizes and keeps the text side (stop strings, UTF-8 safe streaming); the core runs the prompt in one
pass and then decodes tokens in chunks, back to back, without Python between the steps of a chunk.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union, overload

import numpy as np
from tqdm.auto import tqdm

from . import _core
from .errors import DeviceError, InvalidRequestError, TinyInferError, TokenizerError
from .loaders import load_model
from .sampling import SamplingParams, TextAssembler

if TYPE_CHECKING:
    from .scheduler import Scheduler, TokenLogprob

Prompt = Union[str, Sequence[int]]

_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "fp16", "bf16", "fp32", "int8", "int4")
_QUANTIZED = ("int8", "int4")  # weight-only formats (cpp/quant.h): quantized at load, on either engine
# What each engine can honour. The CPU reference engine computes in fp32 with fp32 weights (int8 / int4: the
# dequantized numbers the GPU's quantized kernels stand for); the GPU engine stores fp16, int8 or int4.
DEVICE_DTYPES = {"cpu": ("fp32", "int8", "int4"), "cuda": ("fp16", "int8", "int4")}
_DEFAULT_MAX_SEQ = 4096


def is_batch(prompt) -> bool:
    """Whether generate()'s `prompt` is a list of prompts: a list / tuple of strs or of id sequences (a flat
    list of ids is one prompt). Mixed lists and empty ones are refused."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (list, tuple)):
        return False
    if not prompt:
        raise InvalidRequestError("empty prompt (an empty list: neither token ids nor prompts)")
    nested = [isinstance(p, (str, list, tuple, np.ndarray)) for p in prompt]
    if any(nested) and not all(nested):
        raise InvalidRequestError("a prompt list must hold only prompts (strs or lists of ids) or only token ids")
    return nested[0]


@dataclass
class Stats:
    prompt_tokens: int = 0
    prefill_ms: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_timer: str = "wall"  # "wall" | "GPU time"
    wall_s: float = 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # generated ids only (an EOS / stop id that ended generation included)
    finish_reason: str  # "stop" (EOS, stop id or stop string) | "length" (max_tokens) | "cancelled"
    prompt_token_ids: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    logprobs: Optional[list["TokenLogprob"]] = None  # one per generated token when SamplingParams.logprobs is set


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


def cuda_status() -> tuple[bool, str]:
    """(usable, reason): whether this build has the GPU engine and a usable GPU is present."""
    if not hasattr(_core, "CudaEngine"):
        return False, no_cuda_sentence(dict(_core.build_info))
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


def _pick_device(device: str) -> str:
    global _fallback_said
    if device not in _DEVICES:
        raise InvalidRequestError(f"device must be one of {', '.join(_DEVICES)} (got {device!r})")
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


def _write_atomic(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except OSError:
        pass


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


def _load_cpu_store(model, config, dtype: str, show: bool = False) -> "_core.WeightStore":
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
    if dtype in _QUANTIZED:
        store.quantize(dtype)
    return store


def _load_cpu(model, max_seq_len: int, dtype: str, show: bool, threads: int):
    """The CPU reference engine over the store as held (weights in their stored precision)."""
    return _core.CpuEngine(_load_cpu_store(model, model.config, dtype, show), max_seq_len, threads)


def _load_cuda(model, max_seq_len: int, opts: "_core.CudaOptions", dtype: str, show: bool):
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


class Engine:
    """A loaded model. One sequence at a time: concurrent calls on one Engine are serialised by a lock.
    close() (or leaving a `with Engine(...) as eng:` block) frees its memory at once, GPU memory included."""

    def __init__(
        self,
        path: Union[str, os.PathLike],
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_seq_len: Optional[int] = None,
        cuda_options: Optional["_core.CudaOptions"] = None,
        plan_cache: bool = True,
        progress: Optional[bool] = None,
        threads: Optional[int] = None,
    ):
        """progress: a bar over the bytes loaded and one line with the load's time split, on stderr (None: only
        when stderr is a terminal; False: silent). threads: the CPU engine's (default: the cores this process may
        use; the thread count never changes a result)."""
        self._core = None  # first: close() and repr must work on an engine whose loading failed
        t0 = time.perf_counter()
        if dtype not in _DTYPES:
            raise InvalidRequestError(f"dtype must be one of {', '.join(_DTYPES)} (got {dtype!r})")
        self.threads = check_threads(threads)
        self.device = _pick_device(device)
        self.dtype = check_dtype(dtype, self.device)
        model = load_model(path)
        self.config: _core.ModelConfig = model.config
        self.tokenizer = model.tokenizer
        self.path = Path(path)
        self.model_name = str(path)  # as given: a local path or a hub name
        self.model_description = model.description
        limit = self.config.max_position_embeddings
        if max_seq_len is None:
            max_seq_len = min(limit, _DEFAULT_MAX_SEQ)
        if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= limit:
            raise InvalidRequestError(
                f"max_seq_len must be an integer in 1..{limit} (the model's max_position_embeddings), "
                f"got {max_seq_len!r}"
            )
        self.max_seq_len = max_seq_len
        self._tactics_file: Optional[Path] = None
        self._tactics_saved = 0
        show = progress is None and sys.stderr.isatty() or progress is True
        if self.device == "cuda":
            opts = cuda_options or _core.CudaOptions()
            if dtype in _QUANTIZED:
                opts.weights = dtype
            key = _core.CudaEngine.plan_key(self.config, max_seq_len, opts)
            self._core = with_plan_cache(opts, plan_file(key) if plan_cache else None,
                                         lambda o: _load_cuda(model, max_seq_len, o, o.weights.name, show))
            self._load_tactics()
            t = self._core.load_times
            self.load_report = (f"tinyinfer: loaded {self.model_name} in {time.perf_counter() - t0:.2f} s "
                                f"(read+upload {t['weights']:.2f} s, tune {t['tune']:.2f} s, "
                                f"graphs {t['graphs']:.2f} s)")
        else:
            self._core = _load_cpu(model, max_seq_len, self.dtype, show, self.threads)
            self.load_report = f"tinyinfer: loaded {self.model_name} in {time.perf_counter() - t0:.2f} s"
        if show:
            print(self.load_report, file=sys.stderr)
        self._init_state()

    def _init_state(self) -> None:
        self._lock = threading.Lock()
        self._owner: Optional[int] = None  # thread holding the lock
        self._sched_lock = threading.Lock()  # guards _scheduler's creation
        self._scheduler: Optional["Scheduler"] = None
        self.last_completion: Optional[Completion] = None
        # decode steps per core call: the granularity of streaming and of EOS checks (at most one chunk of
        # work is wasted after an EOS)
        self._chunk = 32 if self.device == "cuda" else 8

    @classmethod
    def from_core(cls, core, config: "_core.ModelConfig", *, max_seq_len: int, tokenizer=None,
                  name: str = "core") -> "Engine":
        """An Engine around a core engine made elsewhere (random weights for a benchmark, a test double):
        token ids in, no tokenizer unless given."""
        self = cls.__new__(cls)
        self._core, self.config, self.tokenizer, self.max_seq_len = core, config, tokenizer, max_seq_len
        self.path, self.model_name, self.model_description = Path(name), name, name
        self.device = "cuda" if hasattr(core, "device_name") else "cpu"
        self.dtype, self.threads, self.load_report = "?", 1, ""
        self._tactics_file, self._tactics_saved = None, 0
        self._init_state()
        return self

    @contextlib.contextmanager
    def _exclusive(self):
        """One sequence at a time: other threads wait; the same thread re-entering (a stream left unfinished
        while another call starts) is refused rather than allowed to corrupt the suspended generation."""
        me = threading.get_ident()
        if self._owner == me:
            raise InvalidRequestError(
                "this engine is busy with an unfinished stream in this thread; exhaust or close() it first"
            )
        with self._lock:
            if self._core is None:
                raise InvalidRequestError(f"{self!r} is closed")
            self._owner = me
            try:
                yield
            finally:
                self._owner = None

    # ---- lifetime ----

    def close(self) -> None:
        """Release the core engine now (on the GPU: weights, KV cache, graphs; all device memory it holds).
        Waits for a generation running in another thread; later calls raise InvalidRequestError. Idempotent."""
        if self._core is None:
            return
        if self._owner == threading.get_ident():
            raise InvalidRequestError("close(): an unfinished stream in this thread still uses the engine; "
                                      "exhaust or close() the stream first")
        if self._scheduler is not None:  # first: its requests end "cancelled" and its slots close
            self._scheduler.close()
        with self._lock:
            core, self._core = self._core, None
            del core  # the last reference: the C++ destructor frees the memory here, not at garbage collection

    @property
    def closed(self) -> bool:
        return self._core is None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if getattr(self, "_core", None) is None else ""
        return (f"Engine(model={getattr(self, 'model_name', '?')!r}, device={getattr(self, 'device', '?')!r}, "
                f"dtype={getattr(self, 'dtype', '?')!r}, max_seq_len={getattr(self, 'max_seq_len', None)}{state})")

    # ---- tokens <-> text ----

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise TokenizerError(f"{self.path}: the model has no tokenizer (tokenizer.json); pass token ids")
        return self.tokenizer

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._need_tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._need_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("empty prompt")
            ids = self.tokenize(prompt)
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(f"prompt must be a str or a sequence of token ids: {e}") from e
        if not ids:
            raise InvalidRequestError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.config.vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is out of range for a vocabulary of {self.config.vocab}")
        return ids

    # ---- scoring ----

    # ---- GEMM tactics across runs: the prefill's cuBLASLt algorithms, tuned on first use of a shape, are kept
    # in the cache directory per cuBLASLt version and GPU, so a later process starts tuned (TINYINFER_TACTICS=0:
    # neither read nor written). A file that cannot be read or written is silently skipped: it is only a cache.

    def _load_tactics(self) -> None:
        if os.environ.get("TINYINFER_TACTICS", "1") == "0" or not self._core.batched_prefill:
            return
        from .models import cache_dir

        name = re.sub(r"[^A-Za-z0-9._-]+", "_", _core.CudaEngine.gemm_fingerprint())
        try:
            self._tactics_file = cache_dir() / "tactics" / f"{name}.txt"
            if self._tactics_file.exists():
                self._core.load_tactics(self._tactics_file.read_text())
        except (OSError, TinyInferError):
            self._tactics_file = None
        self._tactics_saved = self._core.tuned_gemms

    def _save_tactics(self) -> None:
        if self._tactics_file is None or self._core.tuned_gemms <= self._tactics_saved:
            return
        try:
            self._tactics_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._tactics_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(self._core.save_tactics())
            os.replace(tmp, self._tactics_file)
        except OSError:
            return
        self._tactics_saved = self._core.tuned_gemms

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of one prefill: float32 array (len(token_ids), vocab)."""
        ids = self._prompt_ids(list(token_ids))
        if len(ids) > self.max_seq_len:
            raise InvalidRequestError(f"{len(ids)} tokens exceed max_seq_len={self.max_seq_len}")
        with self._exclusive():
            self._core.reset()
            out = self._core.forward(ids, all_logits=True)
            self._save_tactics()
            return out

    # ---- generation ----

    @property
    def scheduler(self) -> "Scheduler":
        """The continuous-batching scheduler of this engine (tinyinfer.scheduler), created on first use with its
        defaults (construct Scheduler(eng, ...) first for others) and its driver thread started."""
        with self._sched_lock:
            sched = self._scheduler
        if sched is None or sched._closed:
            if self._core is None:
                raise InvalidRequestError(f"{self!r} is closed")
            from .scheduler import Scheduler

            try:
                sched = Scheduler(self)
            except InvalidRequestError:  # another thread made it first
                sched = self._scheduler
        sched.start()
        return sched

    @overload
    def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None, **kwargs) -> Completion: ...

    @overload
    def generate(self, prompt: list[Prompt], params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 **kwargs) -> list[Completion]: ...

    def generate(self, prompt, params=None, **kwargs):
        """Generate a completion. Sampling settings come as a SamplingParams and/or keyword arguments
        (max_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop, stop_token_ids, ...).
        A list of prompts (strs or lists of ids; a flat list of ids is one prompt) runs as one batch through the
        scheduler and gives the Completions in order; `params` is then one SamplingParams or one per prompt."""
        if is_batch(prompt):
            return self._generate_batch(prompt, params, kwargs)
        if isinstance(params, (list, tuple)):
            raise InvalidRequestError("a list of SamplingParams needs a list of prompts")
        for _ in self.stream(prompt, params, **kwargs):
            pass
        assert self.last_completion is not None
        return self.last_completion

    def _generate_batch(self, prompts: Sequence[Prompt], params, kwargs: dict) -> list[Completion]:
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise InvalidRequestError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
            sps = [SamplingParams.from_kwargs(p, kwargs) for p in params]
        else:
            sps = [SamplingParams.from_kwargs(params, kwargs)] * len(prompts)
        self._refuse_own_stream()
        reqs = self.scheduler._submit_many(prompts, sps)
        try:
            return [r.result() for r in reqs]
        except BaseException:  # KeyboardInterrupt, or one request failed: the others end too
            for r in reqs:
                r.cancel()
            for r in reqs:  # within one step: when this raises, their pages are back in the pool
                r._done.wait()
            raise

    def _refuse_own_stream(self) -> None:
        """The scheduler's steps need the engine's lock, which a suspended single-path stream of this very
        thread holds: waiting for them here would never end."""
        if self._owner == threading.get_ident():
            raise InvalidRequestError(
                "this engine is busy with an unfinished stream in this thread; exhaust or close() it first"
            )

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None, **kwargs) -> Iterator[str]:
        """Yield text pieces as they are generated (whole characters only; stop strings never half-shown).
        When the iterator is exhausted, `last_completion` holds the Completion. On an idle engine the prompt
        runs alone (the chunked single-sequence path); while the scheduler has work, or when logprobs are asked,
        it joins the scheduler's batch."""
        if is_batch(prompt):
            raise InvalidRequestError("stream() takes one prompt; for many: generate([...]), or submit each to "
                                      "Engine.scheduler and iterate its Request")
        sp = SamplingParams.from_kwargs(params, kwargs)
        self.last_completion = None
        gen = self._generate(prompt, sp)
        try:
            for item in gen:
                if isinstance(item, Completion):
                    self.last_completion = item
                elif item:
                    yield item
        finally:  # closing this stream closes the generation now (releasing the engine), not at garbage collection
            gen.close()

    # ---- chat ----

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template (as transformers'
        apply_chat_template(tokenize=True) gives them)."""
        tok = self._need_tokenizer()
        if not getattr(tok, "chat_template", None):
            raise TokenizerError(f"{self.path}: the model has no chat template")
        return tok.encode_chat(list(messages), add_generation_prompt=add_generation_prompt)

    @overload
    def chat(self, messages: Sequence[dict], params: Optional[SamplingParams] = None, **kwargs) -> Completion: ...

    @overload
    def chat(self, messages: list[list[dict]],
             params: Union[None, SamplingParams, Sequence[SamplingParams]] = None, **kwargs) -> list[Completion]: ...

    def chat(self, messages, params=None, **kwargs):
        """The assistant's reply to a conversation [{"role": ..., "content": ...}, ...]; a list of conversations
        gives the replies in order (one batch, as generate([...]))."""
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, (list, tuple)) for m in messages):
            return self.generate([self.apply_chat_template(m) for m in messages], params, **kwargs)
        return self.generate(self.apply_chat_template(messages), params, **kwargs)

    def stream_chat(self, messages: Sequence[dict], params: Optional[SamplingParams] = None, **kwargs) -> Iterator[str]:
        return self.stream(self.apply_chat_template(messages), params, **kwargs)

    def _generate(self, prompt: Prompt, sp: SamplingParams) -> Iterator[Union[str, Completion]]:
        t_start = time.perf_counter()
        prompt_ids = self._prompt_ids(prompt)
        if len(prompt_ids) + sp.max_tokens > self.max_seq_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sp.max_tokens}) exceeds "
                f"max_seq_len={self.max_seq_len}"
            )
        if sp.logprobs is None:
            with self._exclusive():  # the scheduler idle under the lock: no slot holds pages, none will meanwhile
                if self._scheduler is None or self._scheduler.idle:
                    yield from self._generate_single(prompt_ids, sp, t_start)
                    return
        yield from self._generate_scheduled(prompt_ids, sp)

    def _generate_scheduled(self, prompt_ids: list[int], sp: SamplingParams) -> Iterator[Union[str, Completion]]:
        self._refuse_own_stream()
        req = self.scheduler._submit_many([prompt_ids], [sp])[0]
        try:
            for delta in req:
                if delta.text:
                    yield delta.text
                if delta.completion is not None:
                    yield delta.completion
        finally:  # abandoned (closed, KeyboardInterrupt): its slot is freed at the next step
            req.cancel()

    def _generate_single(self, prompt_ids: list[int], sp: SamplingParams,
                         t_start: float) -> Iterator[Union[str, Completion]]:
        """The single-sequence path; the caller holds the engine's lock."""
        stop_ids = list(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop_ids += list(self.config.eos_token_ids)
        seed = sp.seed if sp.seed is not None else int.from_bytes(os.urandom(4), "little")
        sampling = sp.to_core(seed)
        sampling.validate()
        text = TextAssembler(self.detokenize, sp.stop) if self.tokenizer is not None else None
        stats = Stats(prompt_tokens=len(prompt_ids))
        out: list[int] = []
        finish = "length"
        self._core.reset()
        t0 = time.perf_counter()
        self._core.forward(prompt_ids, all_logits=False)
        stats.prefill_ms = (time.perf_counter() - t0) * 1e3
        self._save_tactics()
        t0 = time.perf_counter()
        gpu_ms = 0.0
        while len(out) < sp.max_tokens:
            new = self._core.decode(min(self._chunk, sp.max_tokens - len(out)), sampling, stop_ids, len(out))
            gpu_ms += getattr(self._core, "last_decode_ms", 0.0)
            out += new
            ended = bool(new) and new[-1] in stop_ids
            if text is not None:
                visible = [t for t in new if t not in stop_ids]
                if sp.stop:  # token by token: generation ends at the token that completes a stop string
                    piece = ""
                    for i, t in enumerate(visible):
                        piece += text.add([t])
                        if text.stopped:
                            del out[len(out) - len(new) + i + 1:]
                            break
                    if ended and not text.stopped:
                        piece += text.add([], final=True)
                else:
                    piece = text.add(visible, final=ended)
                if text.stopped:
                    finish, ended = "stop", True
                yield piece
            if ended:
                finish = "stop"
                break
        stats.decode_s = time.perf_counter() - t0
        if self.device == "cuda":  # GPU time of the decode steps (events), as the stats line says
            stats.decode_s, stats.decode_timer = gpu_ms / 1e3, "GPU time"
        if text is not None and not text.stopped and finish == "length":
            yield text.add([], final=True)
        stats.decode_tokens = len(out)
        stats.wall_s = time.perf_counter() - t_start
        yield Completion(
            text=text.text if text is not None else "",
            token_ids=out,
            finish_reason=finish,
            prompt_token_ids=prompt_ids,
            stats=stats,
        )
