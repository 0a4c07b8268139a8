"""SamplingParams (vLLM / OpenAI names) and the text-side bookkeeping of a generation: incremental
detokenization that never emits half a UTF-8 character, and stop strings that are never half-emitted."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import numpy as np

from . import _core
from .errors import InvalidRequestError
from .tokenizer import not_unicode

if TYPE_CHECKING:
    from .structured import GrammarState, StructuredOutputs

MAX_LOGPROBS = 20  # top entries per token a request may ask for (OpenAI's limit)
INT64_MAX = 2**63 - 1  # the core's top_k is an int64 (its seed a uint64)
MAX_STOP_CHARS = 1024  # the longest stop string: each token's text is searched for every stop's prefixes
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a logit_bias value is in [-100, 100]
# logit_bias entries the core takes (its GPU sampler gives each one thread), a min_tokens request's stop ids included
MAX_LOGIT_BIAS = _core.MAX_LOGIT_BIAS
MAX_BAD_WORDS = MAX_LOGIT_BIAS // 2  # (each may ban two tokens at once: the word alone and after a space)


def as_float32(v: float) -> float:
    """v as the core's float32 fields hold it: beyond float32's range it is infinite, a tiny value may be 0."""
    try:
        v = float(v)
    except OverflowError:  # an int beyond a double
        return math.inf if v > 0 else -math.inf
    return struct.unpack("f", struct.pack("f", v))[0]


# The fields a model's generation_config.json may give the server's defaults for (`tinyinfer serve
# --generation-config`, as vLLM's server reads that file)
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class SamplingParams:
    """How to choose tokens. temperature 0 means greedy. A fixed seed reproduces a sampled generation exactly."""

    max_tokens: Optional[int] = 256  # None: the rest of the context (as vLLM's and llama-cpp-python's None)
    temperature: float = 0.0
    top_k: int = 0  # 0 (or -1): off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence among the generated tokens
    seed: Optional[int] = None
    # strings that end generation (excluded from the text); None: none, as the server's null
    stop: Optional[Sequence[str]] = field(default_factory=list)
    stop_token_ids: Optional[Sequence[int]] = field(default_factory=list)  # in addition to the model's EOS ids
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # None: off; 0..20: the chosen token's logprob plus this many top entries
    # vLLM's: None: off; 0..20: each prompt token's logprob (given the tokens before it; the first has none) plus
    # this many top entries (Completion.prompt_logprobs)
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the text (a tool-call parser may need them)
    # OpenAI's: token id -> a value in [-100, 100] added to its logit before the penalties (-100 all but bans it)
    logit_bias: Optional[Mapping[int, float]] = None
    # vLLM's: the first min_tokens tokens can be neither a stop id (the model's EOS even under ignore_eos,
    # stop_token_ids) nor complete a stop string
    min_tokens: int = 0
    # vLLM's: words banned as the model tokenizes them, alone and after a space (another tokenization of the same
    # text is not): the last token of one is banned where the tokens generated so far end with the rest of it
    bad_words: Optional[Sequence[str]] = None
    # vLLM's: the answer held to a JSON schema, any JSON object, a regex, a choice of strings or a grammar
    # (a StructuredOutputs, or a mapping of its fields)
    structured_outputs: Optional["StructuredOutputs"] = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # numpy's numbers as Python's (a prompt may be a numpy array; its values and a model's come as numpy
        # scalars): the checks below and the core take int / float; np.bool_ stays a bool-like for ignore_eos
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (np.integer, np.floating)):
                setattr(self, f.name, v.item())
        if isinstance(self.logit_bias, Mapping):  # (numpy keys and values as Python's, for the checks)
            self.logit_bias = {k.item() if isinstance(k, np.integer) else k:
                               v.item() if isinstance(v, (np.integer, np.floating)) else v
                               for k, v in self.logit_bias.items()}
        if isinstance(self.stop_token_ids, np.ndarray) and self.stop_token_ids.dtype.kind in "iu":
            self.stop_token_ids = self.stop_token_ids.tolist()
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = [t.item() if isinstance(t, np.integer) else t for t in self.stop_token_ids]
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter: {msg}")

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise bad(f"max_tokens must be an integer >= 1, or None for the rest of the context (got "
                      f"{self.max_tokens!r})")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(as_float32(v)):
                raise bad(f"{name} must be a finite number within float32's range (got {v!r})")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0 (got {self.temperature})")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not -1 <= self.top_k <= INT64_MAX:
            raise bad(f"top_k must be an integer in 0..2**63-1, or -1 / 0 for off (got {self.top_k!r})")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1] (got {self.top_p})")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1] (got {self.min_p})")
        if self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")
        for name in ("top_p", "repetition_penalty"):  # the core would see 0 and refuse it
            if as_float32(getattr(self, name)) == 0:
                raise bad(f"{name} must be > 0 as a float32 (got {getattr(self, name)!r}, which rounds to 0)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(f"{name} must be in [-2, 2] (got {getattr(self, name)})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(f"{name} must be None or an integer in 0..{MAX_LOGPROBS} (got {v!r})")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**64):
            raise bad(f"seed must be an integer in 0..2**64-1 or None (got {self.seed!r})")
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad(f"stop must be a string or a list of non-empty strings (got {self.stop!r:.100})")
        for s in self.stop:  # (as prompts and messages are)
            if not_unicode(s):
                raise bad(f"stop string {s!r:.60} is not valid Unicode: {not_unicode(s)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise bad(f"stop strings may be at most {MAX_STOP_CHARS} characters long (got one of "
                      f"{max(len(s) for s in self.stop)})")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                not isinstance(t, int) or isinstance(t, bool) for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be a list of integers (got {self.stop_token_ids!r:.100})")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):  # ("false" would be true)
                raise bad(f"{name} must be true or false (got {getattr(self, name)!r:.40})")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0 (got {self.min_tokens!r:.40})")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple)) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad(f"bad_words must be a list of non-blank strings (got {self.bad_words!r:.100})")
        if self.bad_words and len(self.bad_words) > MAX_BAD_WORDS:
            raise bad(f"bad_words takes at most {MAX_BAD_WORDS} words (got {len(self.bad_words)})")
        from .structured import StructuredOutputs
        self.structured_outputs = StructuredOutputs.from_value(self.structured_outputs)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise bad(f"logit_bias must be a mapping of token ids to numbers (got {self.logit_bias!r:.100})")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise bad(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries (got {len(self.logit_bias)})")
            for t, v in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise bad(f"logit_bias keys must be token ids, integers >= 0 (got {t!r:.40})")
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not (
                        -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE):
                    raise bad(f"logit_bias values must be numbers in [-100, 100] (got {v!r:.40} for token {t})")

    @classmethod
    def from_kwargs(cls, params: Optional["SamplingParams"], kwargs: dict) -> "SamplingParams":
        """A SamplingParams from an optional object plus keyword overrides, refusing unknown names."""
        if params is not None and not isinstance(params, cls):
            raise InvalidRequestError(f"params must be a SamplingParams (got {type(params).__name__})")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            hint = ("; for n samples of one prompt pass it n times, generate([prompt] * n) or chat([messages] * n): "
                    "each gets its own random seed (seeded: params=[SamplingParams(seed=s + i) for i in range(n)])"
                    ) if {"n", "best_of"} & set(unknown) else ""
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}{hint}")
        base = {f.name: getattr(params, f.name) for f in fields(cls)} if params is not None else {}
        base.update(kwargs)
        return cls(**base)

    def to_core(self, default_seed: int, ban: Sequence[int] = ()) -> _core.SamplingConfig:
        """The core's config; ban: ids whose logit is -inf on top of logit_bias (min_tokens: the stop ids, for
        the steps before it). The core checks the ids against the vocabulary (validate(vocab))."""
        s = _core.SamplingConfig()
        s.temperature = float(self.temperature)
        s.top_k = max(int(self.top_k), 0)
        s.top_p = float(self.top_p)
        s.min_p = float(self.min_p)
        s.repetition_penalty = float(self.repetition_penalty)
        s.presence_penalty = float(self.presence_penalty)
        s.frequency_penalty = float(self.frequency_penalty)
        s.seed = int(self.seed if self.seed is not None else default_seed)
        bias = {int(t): float(v) for t, v in (self.logit_bias or {}).items()}
        bias.update((int(t), -math.inf) for t in ban)
        ids = sorted(bias)  # (in id order the core's per-step check needs no sort)
        s.bias_ids, s.bias_values = ids, [bias[t] for t in ids]
        return s


class CoreSampling:
    """The core's SamplingConfig for each next token of one request: logit_bias, plus -inf on the tokens a step may
    not take — for the first min_tokens tokens the stop ids (stop_token_ids and the model's EOS ids, even under
    ignore_eos, as vLLM's "min_tokens before EOS"), and vLLM's bad_words: a one-token word always, a longer one's
    last token where the tokens generated so far end with the rest of it. Every config checked against the
    vocabulary; the largest set of bans a step can meet is counted against the core's limit up front.
    With a grammar (structured outputs), each config also carries the grammar's mask of the next token; where the
    bans would leave none of its tokens, the grammar wins (the bans are dropped for that token)."""

    def __init__(self, sp: SamplingParams, seed: int, eos_ids: Sequence[int], vocab: int,
                 bad_words_ids: Sequence[Sequence[int]] = (), grammar: Optional["GrammarState"] = None):
        bad = [t for t in (sp.logit_bias or {}) if t >= vocab]
        if bad:
            raise InvalidRequestError(f"invalid sampling parameter: logit_bias token id {bad[0]} is out of range for "
                                      f"a vocabulary of {vocab}", param="logit_bias")
        self._sp, self._seed, self._vocab = sp, seed, vocab
        self.min_tokens = sp.min_tokens
        # (a stop id outside the vocabulary is never sampled: nothing to ban)
        self._stop_ban = frozenset(t for t in (*sp.stop_token_ids, *eos_ids) if 0 <= t < vocab) \
            if sp.min_tokens else frozenset()
        # (a word with an id past the vocabulary can never be generated: nothing to ban)
        words = [tuple(w) for w in bad_words_ids if all(0 <= t < vocab for t in w)]
        self._always = frozenset(w[0] for w in words if len(w) == 1)
        self._multi = sorted({w for w in words if len(w) > 1})
        most = set(sp.logit_bias or ()) | self._stop_ban | self._always | {w[-1] for w in self._multi}
        if len(most) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"invalid sampling parameter: logit_bias ({len(sp.logit_bias or ())} entries), min_tokens' bans "
                f"of the stop ids ({len(self._stop_ban)}) and bad_words' ({len(self._always) + len(self._multi)}) "
                f"make {len(most)} logit-bias entries: at most {MAX_LOGIT_BIAS}",
                param="logit_bias" if sp.logit_bias else "bad_words" if words else "min_tokens")
        self._configs: dict[frozenset, _core.SamplingConfig] = {}
        self._late: Optional[_core.SamplingConfig] = None
        self._grammar = grammar
        if grammar is None:
            self.at(())  # (the config of the first token, checked now)
            # every later token's when nothing changes it: no set built a step (the scheduler asks every step)
            if not self._multi:
                self._late = self.at((0,) * sp.min_tokens)

    def same_for(self, n_generated: int) -> Optional[int]:
        """How many tokens from n_generated on are sampled with at(...) of now (None: all of them; 1 with
        multi-token bad words or a grammar: the GPU's single path then decodes a token a call)."""
        if self._multi or self._grammar is not None:
            return 1
        return self.min_tokens - n_generated if n_generated < self.min_tokens and self._stop_ban else None

    def finished(self, generated: Sequence[int]) -> bool:
        """Whether the request's grammar is complete after `generated` (nothing more may follow): it ends there."""
        if self._grammar is None:
            return False
        self._grammar.advance(generated)
        return self._grammar.finished

    def _bans(self, generated: Sequence[int]) -> set[int]:
        ban = set(self._always)
        if len(generated) < self.min_tokens:
            ban |= self._stop_ban
        for w in self._multi:
            k = len(w) - 1
            if len(generated) >= k and tuple(generated[-k:]) == w[:-1]:
                ban.add(w[-1])
        return ban

    def at(self, generated: Sequence[int]) -> _core.SamplingConfig:
        """The config of the token after `generated` (the request's generated tokens so far)."""
        if self._grammar is not None:
            return self._with_grammar(generated)
        if self._late is not None and len(generated) >= self.min_tokens:
            return self._late
        key = frozenset(self._bans(generated))
        cfg = self._configs.get(key)
        if cfg is None:
            if len(self._configs) >= 64:  # (bad words' combinations: a bounded cache)
                self._configs.clear()
            cfg = self._configs[key] = self._sp.to_core(self._seed, sorted(key))
            cfg.validate(self._vocab)
        return cfg

    def _with_grammar(self, generated: Sequence[int]) -> _core.SamplingConfig:
        self._grammar.advance(generated)
        mask = self._grammar.mask()
        ban = self._bans(generated)
        if ban:
            left = mask.copy()
            for t in ban:
                left[t >> 5] &= ~np.uint32(1 << (t & 31))
            if not left.any():  # (e.g. min_tokens against a grammar that allows only EOS: the grammar wins)
                ban = set()
        cfg = self._sp.to_core(self._seed, sorted(ban))
        cfg.allowed = mask
        cfg.validate(self._vocab)
        return cfg


def stop_reason(sp: SamplingParams, token: int, eos_ids: Sequence[int]) -> Optional[int]:
    """vLLM's stop_reason of an answer that a sampled stop id ended: the id when it is one of sp.stop_token_ids,
    None when it is the model's EOS (unless ignore_eos, which makes it an ordinary token)."""
    if not sp.ignore_eos and token in eos_ids:
        return None
    return token if token in sp.stop_token_ids else None


# Prompt tokens an answer's text is decoded after (vLLM's): a tokenizer that treats a text's first token specially
# (SentencePiece drops its leading space: "▁Paris" alone is "Paris") decodes the answer as the prompt's continuation.
CONTEXT_TOKENS = 5


class TextAssembler:
    """Turns a growing list of token ids into text pieces that are safe to show: whole UTF-8 characters only,
    and nothing that could be the start of a stop string until it is known not to be one. With min_tokens, only a
    stop string that ends after the text of the first min_tokens ids counts (vLLM's rule). context: the ids before
    them (a prompt's last CONTEXT_TOKENS): the text is what decoding them after those adds ("The capital of France
    is" + " Paris", not "Paris")."""

    def __init__(self, decode, stop: Sequence[str], min_tokens: int = 0, context: Sequence[int] = ()):
        self._decode = decode
        self._stop = list(stop)
        self._min_tokens = min_tokens
        self._floor = 0  # a stop string must end past this (the text of the first min_tokens ids)
        self._hold = max((len(s) for s in self._stop), default=0)
        self.ids: list[int] = []
        self.emitted = 0  # characters of the text handed out so far
        self.text = ""
        self.stopped = False  # a stop string was found; self.text ends before it
        self.stop_string: Optional[str] = None  # that string (the first listed of those found at one place)
        # Decoding every id again for each new token costs O(length) per token (~30 us at 256 tokens: 2 ms a
        # step for a batch of 64). Instead the text is kept as a settled part (the ids before _read, which end
        # on a whole character) plus the decode of a short window from _prefix (vLLM's prefix / read offsets):
        # the window starts one settled chunk (with text) back, so a tokenizer that treats a first token
        # specially (a leading-space strip, a joining space) does so to both the window and its known head.
        # Should a window ever disagree
        # with its head, this assembler falls back to decoding everything (exact, slower) for good.
        # The windows run over _seq (the context, then ids); the context's own text is never part of the text.
        self._ctx = list(context)
        self._seq = list(context)
        self._settled = ""
        self._prefix, self._read = 0, len(self._ctx)
        self._head = self._decode(self._ctx) if self._ctx else ""  # decode(_seq[_prefix:_read])
        if self._head.endswith("\ufffd"):  # a context cut inside a character: none (the answer decoded alone)
            self._ctx, self._seq, self._read, self._head = [], [], 0, ""
        self._windowed = True

    def _full_text(self, final: bool) -> str:
        """decode(ids), less an incomplete multi-byte character at the end unless final."""
        if self._windowed:
            window = self._decode(self._seq[self._prefix:])
            if window.startswith(self._head):
                tail = window[len(self._head):]
                if final or not tail.endswith("\ufffd"):
                    self._settled += tail
                    head = self._decode(self._seq[self._read:])
                    if head:  # else keep the window's start: its head must hold text (context for a joiner)
                        self._prefix, self._head = self._read, head
                    else:
                        self._head = window
                    self._read = len(self._seq)
                    return self._settled
                return self._settled + tail.rstrip("\ufffd")
            self._windowed = False
        full = self._decode(self.ids)
        if self._ctx:  # (the context's text off the front, where decoding after it still starts with it)
            ctx, both = self._decode(self._ctx), self._decode(self._seq)
            if both.startswith(ctx):
                full = both[len(ctx):]
        if not final:  # an incomplete multi-byte character decodes to U+FFFD at the end: wait for its bytes
            full = full.rstrip("\ufffd")
        return full

    def _held_from(self, full: str) -> int:
        """Where the longest tail of `full` that might grow into a stop string starts (len(full): none). Only
        the tails that start with a stop string's first character are compared: trying every tail length was
        O(len(stop)**2) a token (0.75 ms a token for 1,024-character stops)."""
        safe = len(full)
        for s in self._stop:
            i = full.find(s[0], max(len(full) - len(s) + 1, 0))
            while 0 <= i < safe:
                if s.startswith(full[i:]):
                    safe = i
                    break
                i = full.find(s[0], i + 1)
        return safe

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Adds tokens; returns the new piece of text that is safe to emit."""
        self.ids.extend(new_ids)
        self._seq.extend(new_ids)
        full = self._full_text(final)
        if final:  # an answer cut inside a character (max_tokens, EOS) ends without it, as vLLM's (which drops a
            full = full.rstrip("\ufffd")  # U+FFFD the model itself wrote last too: the text cannot tell them apart)
        if len(self.ids) <= self._min_tokens:
            self._floor = len(full)
        elif self._stop:
            start = max(0, self.emitted - self._hold)
            hits = [(i, s) for s in self._stop for i in (full.find(s, max(start, self._floor - len(s) + 1)),)
                    if i >= 0]
            if hits:
                at, self.stop_string = min(hits, key=lambda h: h[0])
                full = full[:at]
                self.stopped = True
                final = True
        safe = len(full) if final else self._held_from(full)
        safe = max(safe, self.emitted)
        piece = full[self.emitted : safe]
        self.emitted = safe
        self.text = full[:safe]
        return piece
