"""Engine: load a model, then generate / stream / score with it.

    eng = Engine("path/to/hf_dir")
    out = eng.generate("Once upon a time", max_tokens=32)
    print(out.text, out.finish_reason, out.stats)

Python tokenizes and keeps the text side (stop strings, UTF-8 safe streaming); the core runs the prompt in one
pass and then decodes tokens in chunks, back to back, without Python between the steps of a chunk.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal, Optional, Sequence, Union, overload

import numpy as np

from . import _core
from .errors import DeviceError, InvalidRequestError, TokenizerError
from .loaders import load_model
# the load's helpers live in loading.py; the public ones are re-exported here (cli, bench and tests import them
# from tinyinfer.engine)
from .loading import (DEVICE_DTYPES, DTYPES, QUANTIZED, TacticsCache, check_dtype, check_threads, cuda_status,
                      load_cpu, load_cuda, no_cuda_sentence, pick_device, plan_file, with_plan_cache)
from .sampling import CONTEXT_TOKENS, CoreSampling, SamplingParams, TextAssembler, stop_reason
from .speculative import DraftPolicy, NgramDrafter, PassCosts, SpeculativeConfig, leading_matches
from .structured import GrammarCompiler, StructuredOutputs
from .tools import (PARSERS, ToolAnswer, ToolCall, check_tool_choice, check_tools, forced_constraint, parser,
                    with_tools)

if TYPE_CHECKING:
    from .request import TokenLogprob
    from .scheduler import Scheduler

Prompt = Union[str, Sequence[int]]

_DEFAULT_MAX_SEQ = 4096

# Prompt tokens per core call, by device: the scheduler's chunk_tokens default, and on the CPU the single path's
# prefill calls too. The GPU prefills 2048 tokens in a few ms, so 64 arriving 128-token prompts are admitted in 4
# scheduler steps rather than 16 (each step also a decode of the running ones: fewer, fuller steps reach the first
# tokens sooner); the CPU takes seconds per 512 (4 s at SmolLM2-135M on 2 cores), which the running sequences wait
# for at every step, and each call reads every weight again (512-token calls: +2% on a 1,500-token prompt there).
CHUNK_TOKENS = {"cuda": 2048, "cpu": 512}


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
    cached_tokens: int = 0  # of prompt_tokens: held from the last call, not prefilled again (its last sampled
    #                         token, not yet fed, is run with the new ones)
    prefill_ms: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_timer: str = "wall"  # "wall" | "GPU time"
    wall_s: float = 0.0
    draft_tokens: int = 0  # speculative decoding: tokens drafted (checked in the model's passes)
    accepted_tokens: int = 0  # of draft_tokens: those the answer kept

    @property
    def decode_tok_s(self) -> float:
        """Decode steps a second: the first token is sampled from the prompt's pass, so n tokens took n - 1 steps
        (llama.cpp's eval "runs"); 0.0 for a single token."""
        return (self.decode_tokens - 1) / self.decode_s if self.decode_s > 0 and self.decode_tokens > 1 else 0.0


@dataclass
class Completion:
    text: str
    token_ids: list[int]  # generated ids only (an EOS / stop id that ended generation included)
    finish_reason: str  # "stop" (EOS, stop id or stop string) | "length" (max_tokens) | "cancelled"
    stop_reason: Union[int, str, None] = None  # vLLM's: the stop string or stop_token_ids id that ended it, else None
    prompt_token_ids: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    logprobs: Optional[list["TokenLogprob"]] = None  # one per generated token when SamplingParams.logprobs is set
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing before it)
    prompt_logprobs: Optional[list[Optional["TokenLogprob"]]] = None
    tool_calls: list["ToolCall"] = field(default_factory=list)  # Engine.chat(tools=...): the reply's calls


class Engine:
    """A loaded model. Safe to share between threads: a call on an idle engine runs its sequence alone (the engine's
    lock held), a batch, a request with logprobs or a call while the scheduler has work joins the scheduler's
    batch (`Engine.scheduler`). close() (or leaving a `with Engine(...) as eng:` block) frees its memory at once,
    GPU memory included."""

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
        act8: Optional[int] = None,
        speculative_config: Union[None, SpeculativeConfig, dict] = None,
    ):
        """progress: a bar over the bytes loaded and one line with the load's time split, on stderr (None: only
        when stderr is a terminal; False: silent). threads: the CPU engine's (default: the cores this process may
        use; the thread count never changes a result). act8: int8 inputs for the quantized matrices' products
        (dtype int8 / int4; docs/perf/decode-options.md): 0 none (weight-only quantization), -1 the int4 matrices',
        -2 the int4 matrices' but down's,
        2 every quantized matrix's, 1 (cuda) chosen per role by timing at load; None: cuda_options.act8 on cuda
        (default 0), 0 on the CPU, whose engine rounds the inputs as the GPU quantizes them.
        speculative_config: speculative decoding by n-gram lookup on the single-sequence path (generate / stream /
        chat of one prompt while no batch runs), vLLM's form: a SpeculativeConfig or its fields as a dict, e.g.
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2} (the
        defaults: 5 tokens, lookup 5..5); answers unchanged; on the GPU greedy ones only (docs/perf/speculative.md);
        None: off."""
        self._core = None  # first: close() and repr must work on an engine whose loading failed
        t0 = time.perf_counter()
        if dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
        self.threads = check_threads(threads)
        self.speculative_config = SpeculativeConfig.of(speculative_config)
        self._pass_costs = PassCosts()  # (speculative decoding's: measured on this engine's passes)
        for name, v in (("plan_cache", plan_cache), ("progress", progress)):
            if not isinstance(v, bool) and not (name == "progress" and v is None):  # ("no" would read as true)
                raise InvalidRequestError(f"{name} must be true or false{' or None' if name == 'progress' else ''}, "
                                          f"got {v!r:.40}")
        options_type = getattr(_core, "CudaOptions", None)  # (none in a CPU-only build)
        if cuda_options is not None and (options_type is None or not isinstance(cuda_options, options_type)):
            raise InvalidRequestError(f"cuda_options must be a tinyinfer CudaOptions or None, got "
                                      f"{type(cuda_options).__name__}")
        # (its type before the load, rather than the bindings' TypeError after it; its values: the engine's check)
        if act8 is not None and (isinstance(act8, bool) or not isinstance(act8, int) or not -2**31 <= act8 < 2**31):
            raise InvalidRequestError(f"act8 must be None or an integer (docs/perf/decode-options.md), got "
                                      f"{act8!r:.40}")
        self.device = pick_device(device)
        self.dtype = check_dtype(dtype, self.device)
        model = load_model(path)
        self.config: _core.ModelConfig = model.config
        self.tokenizer = model.tokenizer
        self.path = Path(path)
        self.model_name = str(path)  # as given: a local path or a hub name
        self.model_description = model.description
        # the model's generation_config.json sampling fields, as given (the server's defaults; generate's are
        # SamplingParams')
        self.sampling_defaults: dict = dict(model.sampling_defaults)
        limit = self.config.max_position_embeddings
        if max_seq_len is None:
            max_seq_len = min(limit, _DEFAULT_MAX_SEQ)
        if isinstance(max_seq_len, np.integer):  # (as SamplingParams takes numpy's integers)
            max_seq_len = int(max_seq_len)
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= limit:
            raise InvalidRequestError(
                f"max_seq_len must be an integer in 1..{limit} (the model's max_position_embeddings), "
                f"got {max_seq_len!r}"
            )
        self.max_seq_len = max_seq_len
        self._tactics = TacticsCache()
        self._grammars: Optional[GrammarCompiler] = None  # structured outputs: made on the first such request
        self._grammars_lock = threading.Lock()
        show = progress is None and sys.stderr.isatty() or progress is True
        if self.device == "cuda":
            # a copy: dtype and act8 below are this engine's, not the caller's options object's
            opts = copy.copy(cuda_options) if cuda_options is not None else _core.CudaOptions()
            if dtype in QUANTIZED:
                opts.weights = dtype
            if act8 is not None:
                opts.act8 = act8
            key = _core.CudaEngine.plan_key(self.config, max_seq_len, opts)
            self._core = with_plan_cache(opts, plan_file(key) if plan_cache else None,
                                         lambda o: load_cuda(model, max_seq_len, o, o.weights.name, show))
            self._tactics.load(self._core)
            t = self._core.load_times
            self.load_report = (f"tinyinfer: loaded {self.model_name} in {time.perf_counter() - t0:.2f} s "
                                f"(read+upload {t['weights']:.2f} s, tune {t['tune']:.2f} s, "
                                f"graphs {t['graphs']:.2f} s)")
        else:
            try:
                self._core = load_cpu(model, max_seq_len, self.dtype, show, self.threads,
                                      0 if act8 is None else act8)
            except MemoryError as e:  # (std::bad_alloc: the weights, or tables sized by max_seq_len)
                raise DeviceError(f"out of host memory building the CPU engine for {self.model_name} (dtype "
                                  f"{self.dtype}, max_seq_len={max_seq_len}): {str(e) or 'bad_alloc'}; a smaller "
                                  f"max_seq_len or dtype needs less") from None
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
        # work is wasted after an EOS). On the CPU a step is milliseconds, so one call a token costs nothing
        # measurable (SmolLM2-135M on 2 cores: 50.6 against 50.8 tok/s at 8) and stream() yields every token;
        # on the GPU a call's Python and sync would be a large part of a ~0.7 ms step.
        self._chunk = 32 if self.device == "cuda" else 1
        # prompt tokens per core call on the single path and in logits(): Ctrl-C lands between calls (a
        # 1,500-token prompt is 12 s of SmolLM2-135M on 2 cores). The GPU's prefill chunks inside one call
        # (CudaOptions.prefill_chunk) and a whole context takes it well under a second: one call.
        self._prefill_chunk = CHUNK_TOKENS["cpu"] if self.device == "cpu" else (1 << 62)

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
        self.sampling_defaults = {}
        self._tactics = TacticsCache()
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
        if not isinstance(add_special_tokens, bool):
            raise InvalidRequestError(f"add_special_tokens must be true or false, got {add_special_tokens!r:.40}")
        return self._need_tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if not isinstance(skip_special_tokens, bool):
            raise InvalidRequestError(f"skip_special_tokens must be true or false, got {skip_special_tokens!r:.40}")
        tok = self._need_tokenizer()
        return tok.decode(self._token_ids(ids, "the ids to detokenize", "a sequence of token ids"),
                          skip_special_tokens=skip_special_tokens)

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("empty prompt")
            prompt = self.tokenize(prompt)  # (its ids checked below too: a tokenizer may outgrow the model)
        ids = self._token_ids(prompt, "prompt", "a str or a sequence of token ids")
        if not ids:
            raise InvalidRequestError("empty prompt")
        return ids

    def _token_ids(self, ids: object, what: str, accepted: str) -> list[int]:
        """`ids` as a list of plain ints, each in the vocabulary (an empty list stays empty); else
        InvalidRequestError naming `what` and what it may be (`accepted`)."""
        if isinstance(ids, (bytes, bytearray)):  # (iterated, they would pass for token ids)
            raise InvalidRequestError(f"{what} must be {accepted}, not bytes")
        if isinstance(ids, (str, set, frozenset, dict)):  # (iterated: characters, or ids in no order)
            raise InvalidRequestError(f"{what} must be {accepted}, not a {type(ids).__name__}")
        try:
            out = list(ids)  # type: ignore[call-overload]
        except TypeError as e:
            raise InvalidRequestError(f"{what} must be {accepted}: {e}") from e
        if not set(map(type, out)) <= {int}:  # (plain ints, the usual case: one pass in C, no copy)
            # int() would take 2.7, True, b"5" and "5" as ids: only integers are
            odd = [t for t in out if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
            if odd:
                raise InvalidRequestError(f"{what}: token ids must be integers (got {odd[0]!r:.40}, a "
                                          f"{type(odd[0]).__name__})")
            out = [int(t) for t in out]
        bad = [t for t in out if not 0 <= t < self.config.vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is out of range for a vocabulary of {self.config.vocab}")
        return out

    def _fit(self, sp: SamplingParams, n_prompt: int) -> SamplingParams:
        """sp with max_tokens None made the rest of the context; a prompt + max_tokens past max_seq_len refused."""
        if sp.max_tokens is None:
            if n_prompt >= self.max_seq_len:
                raise InvalidRequestError(f"prompt ({n_prompt} tokens) leaves no room to generate within "
                                          f"max_seq_len={self.max_seq_len}")
            if sp.min_tokens > self.max_seq_len - n_prompt:
                raise InvalidRequestError(f"min_tokens ({sp.min_tokens}) is more than the rest of the context after a "
                                          f"prompt of {n_prompt} tokens (max_seq_len={self.max_seq_len})",
                                          param="min_tokens")
            return dataclasses.replace(sp, max_tokens=self.max_seq_len - n_prompt)
        if n_prompt + sp.max_tokens > self.max_seq_len:
            raise InvalidRequestError(f"prompt ({n_prompt} tokens) + max_tokens ({sp.max_tokens}) exceeds "
                                      f"max_seq_len={self.max_seq_len}")
        return sp

    def _stop_ids(self, sp: SamplingParams) -> list[int]:
        """The ids that end a generation: sp's stop_token_ids, and the model's EOS ids unless ignore_eos."""
        bad = [t for t in sp.stop_token_ids if not 0 <= t < self.config.vocab]
        if bad:  # (never sampled; past int32 the core's paths would even disagree on them)
            raise InvalidRequestError(f"stop token id {bad[0]} is out of range for a vocabulary of "
                                      f"{self.config.vocab}", param="stop_token_ids")
        return list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(self.config.eos_token_ids))

    def _bad_words_ids(self, sp: SamplingParams) -> list[list[int]]:
        """sp.bad_words as token sequences, as vLLM's: each word as the tokenizer encodes it, and after a space
        where that is another first token of as many tokens (the word inside a text)."""
        if not sp.bad_words:
            return []
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words needs the model's tokenizer (this model has none)", param="bad_words")
        out: list[list[int]] = []
        for w in sp.bad_words:
            alone = self.tokenizer.encode(w.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
            out.append(alone)
            if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return [ids for ids in out if ids]

    def compile_grammar(self, so: StructuredOutputs) -> None:
        """Compiles a structured-output constraint now (kept for the requests that use it; the first one also
        reads the tokenizer): a server does it off its event loop. InvalidRequestError if it does not compile."""
        self._grammar_compiler().compile(so)

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.config.vocab, self.config.eos_token_ids)
            return self._grammars

    def _text(self, sp: SamplingParams, prompt_ids: Sequence[int]) -> Optional[TextAssembler]:
        """The text side of one request's answer (None without a tokenizer), decoded as the prompt's continuation.
        (The tokenizer's decode, not detokenize: the sampled ids need no checks, at two decodes a token.)"""
        if self.tokenizer is None:
            return None
        return TextAssembler(functools.partial(self.tokenizer.decode, skip_special_tokens=bool(sp.skip_special_tokens)),
                             sp.stop, sp.min_tokens, context=prompt_ids[-CONTEXT_TOKENS:])

    def _core_sampling(self, sp: SamplingParams, seed: int) -> CoreSampling:
        grammar = None
        if sp.structured_outputs is not None:
            grammar = self._grammar_compiler().start(sp.structured_outputs)
        return CoreSampling(sp, seed, self.config.eos_token_ids, self.config.vocab, self._bad_words_ids(sp), grammar)

    # ---- scoring ----

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of one prefill: float32 array (len(token_ids), vocab)."""
        ids = self._prompt_ids(token_ids)
        if len(ids) > self.max_seq_len:
            raise InvalidRequestError(f"{len(ids)} tokens exceed max_seq_len={self.max_seq_len}")
        with self._exclusive():
            self._core.reset()
            out = self._prefill(ids, all_logits=True)
            self._tactics.save(self._core)
            return out

    def _prefill(self, ids: list[int], all_logits: bool) -> np.ndarray:
        """forward(ids) from the current position, in calls of _prefill_chunk tokens (so a Ctrl-C lands between
        them); the logits of every position (all_logits) or of the last."""
        sched = self._scheduler
        if sched is not None and len(sched._cache) and self.device == "cuda":
            sched._cache.drop_all(self._core)  # (the single sequence's pages come from the slots' pool)
        n = self._prefill_chunk
        parts = [self._core.forward(ids[i:i + n], all_logits=all_logits) for i in range(0, len(ids), n)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if all_logits else parts[-1]

    def prompt_logprobs(self, token_ids: Sequence[int], top: int = 0) -> list[Optional["TokenLogprob"]]:
        """Each token's log-probability given the tokens before it (None for the first), from one prefill's
        logits (logits()), with its `top` most likely tokens (ties: the lower id first) — vLLM's prompt_logprobs,
        what scoring a text reads. (A request's SamplingParams.prompt_logprobs come from its own prefill in the
        scheduler instead.)"""
        from .scoring import rows_logprobs

        ids = self._prompt_ids(token_ids)
        out: list[Optional[TokenLogprob]] = [None]
        return out + list(rows_logprobs(self.logits(ids), ids[1:], top))

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

    @overload
    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                            tokenize: Literal[True] = True, tools: Optional[list[dict]] = None) -> list[int]: ...

    @overload
    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                            tokenize: Literal[False], tools: Optional[list[dict]] = None) -> str: ...

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                            tokenize: bool = True, tools: Optional[list[dict]] = None) -> Union[list[int], str]:
        """Token ids of a conversation rendered with the model's chat template (as transformers'
        apply_chat_template(tokenize=True) gives them); tokenize=False: the rendered text (to read the prompt).
        tools: OpenAI's tool definitions, the template's `tools` (tools.check_tools' form)."""
        tok = self._need_tokenizer()
        if not getattr(tok, "chat_template", None):
            raise TokenizerError(f"{self.path}: the model has no chat template")
        for name, v in (("add_generation_prompt", add_generation_prompt), ("tokenize", tokenize)):
            if not isinstance(v, bool):
                raise InvalidRequestError(f"{name} must be true or false, got {v!r:.40}")
        try:
            if isinstance(messages, (str, bytes, dict)):
                raise TypeError
            msgs = list(messages)
        except TypeError:
            raise InvalidRequestError(f"messages must be a list of {{'role': ..., 'content': ...}} objects, got "
                                      f"a {type(messages).__name__}") from None
        msgs, extra = with_tools(msgs, tools)
        if not tokenize:
            return tok.render_chat(msgs, add_generation_prompt=add_generation_prompt, **extra)
        return tok.encode_chat(msgs, add_generation_prompt=add_generation_prompt, **extra)

    @overload
    def chat(self, messages: Sequence[dict], params: Optional[SamplingParams] = None, **kwargs) -> Completion: ...

    @overload
    def chat(self, messages: list[list[dict]],
             params: Union[None, SamplingParams, Sequence[SamplingParams]] = None, **kwargs) -> list[Completion]: ...

    def chat(self, messages, params=None, *, tools: Optional[list[dict]] = None,
             tool_choice: Union[None, str, dict] = None, tool_parser: Optional[str] = None,
             parallel_tool_calls: bool = True, **kwargs):
        """The assistant's reply to a conversation [{"role": ..., "content": ...}, ...]; a list of conversations
        gives the replies in order (one batch, as generate([...])).
        tools: OpenAI's tool definitions (given to the chat template), with tool_choice as OpenAI's (default
        "auto"): a named function or "required" hold the answer to the calls' JSON (any model); "auto" reads the
        model's own format with tool_parser ("hermes" | "llama3_json", tools.PARSERS). A reply's calls are its
        Completion.tool_calls (ToolCall: name, arguments as JSON text, id), its text the content before them,
        finish_reason "tool_calls" ("stop" for a named function, as OpenAI's)."""
        batch = isinstance(messages, (list, tuple)) and messages and all(isinstance(m, (list, tuple)) for m in messages)
        convs = list(messages) if batch else [messages]
        if tools is None and tool_choice is None:
            if batch:
                return self.generate([self.apply_chat_template(m) for m in convs], params, **kwargs)
            return self.generate(self.apply_chat_template(messages), params, **kwargs)
        tools = check_tools(tools) if tools else None
        choice = check_tool_choice(tool_choice, tools)
        reader = parser(tool_parser) if tool_parser is not None else None
        if choice == "auto" and reader is None:
            raise InvalidRequestError("tool_choice \"auto\" (the default with tools) reads the model's own tool-call "
                                      f"format: give tool_parser ({' or '.join(PARSERS)}), or a named function or "
                                      "\"required\" as tool_choice")
        forced = forced_constraint(tools, choice, parallel_tool_calls) if tools else None
        if forced is not None:
            given = [p for p in (params if isinstance(params, (list, tuple)) else [params]) if p is not None]
            if "structured_outputs" in kwargs or any(p.structured_outputs is not None for p in given):
                raise InvalidRequestError("a named tool_choice or \"required\" and structured_outputs both constrain "
                                          "the answer; give one")
            kwargs["structured_outputs"] = forced
        elif choice == "auto":
            kwargs.setdefault("skip_special_tokens", False)  # (a parser may read tags held as special tokens)
        prompts = [self.apply_chat_template(m, tools=tools) for m in convs]
        outs = self.generate(prompts, params, **kwargs) if batch else [self.generate(prompts[0], params, **kwargs)]
        if choice != "none":
            for i, c in enumerate(outs):
                answer = ToolAnswer(choice, reader, parallel_tool_calls)
                answer.add(c.text, final=True)
                content, calls, finish, _ = answer.end(c.finish_reason)
                outs[i] = dataclasses.replace(c, text=content or "", finish_reason=finish, tool_calls=calls)
        return outs if batch else outs[0]

    def stream_chat(self, messages: Sequence[dict], params: Optional[SamplingParams] = None, **kwargs) -> Iterator[str]:
        return self.stream(self.apply_chat_template(messages), params, **kwargs)

    def _generate(self, prompt: Prompt, sp: SamplingParams) -> Iterator[Union[str, Completion]]:
        t_start = time.perf_counter()
        prompt_ids = self._prompt_ids(prompt)
        sp = self._fit(sp, len(prompt_ids))
        if sp.logprobs is None and sp.prompt_logprobs is None:
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

    def _cached_prefix(self, prompt_ids: list[int], sp: SamplingParams) -> int:
        """How many of the prompt's tokens the single sequence's cache already holds, as llama-cpp-python and
        llama-cli reuse it: a chat's next turn extends the last prompt and its answer, and only the new tokens
        need a prefill (a CPU turn was ~6.5 ms a token of history at SmolLM2-135M). All of the cache or nothing:
        the cache is never cut back. Not under presence / frequency penalties, which count only the request's
        own tokens (an earlier answer in the cache is counted as generated)."""
        if sp.presence_penalty or sp.frequency_penalty:
            return 0
        cached = self._core.tokens  # (a sampled token not yet fed is in it: the next forward feeds it first)
        n = len(cached)
        return n if 0 < n < len(prompt_ids) and prompt_ids[:n] == list(cached) else 0

    def _generate_single(self, prompt_ids: list[int], sp: SamplingParams,
                         t_start: float) -> Iterator[Union[str, Completion]]:
        """The single-sequence path; the caller holds the engine's lock."""
        stop_ids = self._stop_ids(sp)
        seed = sp.seed if sp.seed is not None else int.from_bytes(os.urandom(4), "little")
        sampling = self._core_sampling(sp, seed)
        text = self._text(sp, prompt_ids)
        stats = Stats(prompt_tokens=len(prompt_ids), cached_tokens=self._cached_prefix(prompt_ids, sp))
        out: list[int] = []
        finish = "length"
        if not stats.cached_tokens:
            self._core.reset()
        t0 = time.perf_counter()
        self._prefill(prompt_ids[stats.cached_tokens:], all_logits=False)
        stats.prefill_ms = (time.perf_counter() - t0) * 1e3
        self._tactics.save(self._core)
        t0 = time.perf_counter()
        gpu_ms = 0.0
        spec = self.speculative_config
        # (on the GPU the drafted rows are drawn by the host's reference sampler: a sampled draw, ~0.3 ms a row,
        # costs ~0.4 of a step; there only greedy answers draft, until the draws move to the device)
        drafter = NgramDrafter(spec, prompt_ids) if spec is not None and (
            self.device == "cpu" or sp.temperature == 0) else None
        policy = DraftPolicy(self._pass_costs)
        while len(out) < sp.max_tokens:
            # a chunk ends where its config changes (min_tokens' bans end; bad words, a grammar: after each token)
            same = sampling.same_for(len(out))
            draft: list[int] = []
            if drafter is not None:  # a draft and the token after it, all drawn with one config, within the context
                k = min(spec.num_speculative_tokens, sp.max_tokens - len(out) - 1,
                        self.max_seq_len - self._core.position - 1,
                        spec.num_speculative_tokens if same is None else same - 1)
                want = policy.length(k)
                draft = drafter.draft(want)
                if want and not draft:
                    policy.missed()
            t_call = time.perf_counter()
            if draft:
                new = self._core.decode_draft(draft, sampling.at(out), stop_ids, len(out))
                kept = leading_matches(new, draft)
                stats.draft_tokens += len(draft)
                stats.accepted_tokens += kept
                # (before the first token there is no pending token to run: the pass is the draft's rows alone)
                policy.drafted(len(draft), kept, len(draft) + bool(out), time.perf_counter() - t_call)
            else:
                n = min(self._chunk, sp.max_tokens - len(out), same or self._chunk)
                if drafter is not None:  # (no more than until a draft could be chosen)
                    n = min(n, policy.plain_steps())
                new = self._core.decode(n, sampling.at(out), stop_ids, len(out))
                gpu_ms += getattr(self._core, "last_decode_ms", 0.0)
                if drafter is not None:  # (the first token is drawn from the prompt's pass: no pass of its own)
                    policy.stepped(len(new), len(new) - (not out), time.perf_counter() - t_call)
            if drafter is not None:
                drafter.extend(new)
            out += new
            ended = bool(new) and new[-1] in stop_ids
            # (a grammar completed by the chunk's last token: the answer ends as the scheduler's does, "stop" even
            # where it is also the max_tokens-th)
            ended = ended or sampling.finished(out)
            if text is not None:
                visible = [t for t in new if t not in stop_ids]
                if sp.stop:  # token by token: generation ends at the token that completes a stop string
                    piece = ""
                    for i, t in enumerate(visible):
                        piece += text.add([t])
                        if text.stopped:
                            cut = len(new) - (i + 1)
                            del out[len(out) - cut:]
                            if cut:  # (the cache then ends where the answer does: a next turn extending it reuses it)
                                self._core.rewind(self._core.position - cut)
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
        if self.device == "cuda" and not stats.draft_tokens:  # GPU time of the decode steps (events), as said
            stats.decode_s, stats.decode_timer = gpu_ms / 1e3, "GPU time"
        if text is not None and not text.stopped and finish == "length":
            yield text.add([], final=True)
        stats.decode_tokens = len(out)
        stats.wall_s = time.perf_counter() - t_start
        reason = None
        if text is not None and text.stopped:
            reason = text.stop_string
        elif finish == "stop" and out:
            reason = stop_reason(sp, out[-1], self.config.eos_token_ids)
        yield Completion(
            text=text.text if text is not None else "",
            token_ids=out,
            finish_reason=finish,
            stop_reason=reason,
            prompt_token_ids=prompt_ids,
            stats=stats,
        )


__all__ = ["Engine", "Completion", "Stats", "Prompt", "is_batch",
           # re-exported from loading.py
           "DEVICE_DTYPES", "check_dtype", "check_threads", "cuda_status", "no_cuda_sentence", "plan_file",
           "with_plan_cache"]
