"""Structured outputs (vLLM's StructuredOutputsParams; OpenAI's response_format): an answer held to a JSON schema,
any JSON object, a regular expression, one of a list of strings, or a grammar (Lark or llama.cpp's GBNF).

llguidance (the library vLLM and llama.cpp use) compiles the constraint against the model's tokenizer and, before
each token, gives the tokens that keep the text inside the language as a bit mask (bit t % 32 of word t / 32);
the samplers read that mask (SamplingConfig.allowed: the CPU reference and the GPU's sample kernels alike). A
request ends with finish_reason "stop" once its grammar is complete (nothing more may follow). The mask is the
host's, made after the previous token is known: a constrained request decodes one token per core call.
"""

from __future__ import annotations

import json as _json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from .errors import InvalidRequestError

log = logging.getLogger(__name__)

MAX_CHOICES = 1024  # choice's strings a request may list
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar's text (what llguidance compiles for each request)


def _invalid(message: str) -> InvalidRequestError:
    """A refusal of this module's, which names the request's field (a server names the field its client used)."""
    return InvalidRequestError(message, param="structured_outputs")


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # (a dependency: only an install made with --no-deps lacks it)
        raise _invalid(f"structured outputs need the llguidance package (pip install llguidance): {e}") \
            from None
    return llguidance


@dataclass
class StructuredOutputs:
    """The constraint of one request (vLLM's StructuredOutputsParams): exactly one of json, regex, choice, grammar
    or json_object. The JSON options are vLLM's: disable_any_whitespace (no whitespace between the JSON's tokens,
    which also keeps a small model from spending its tokens on whitespace), whitespace_pattern (a regex for it),
    disable_additional_properties (objects take only the properties their schema names, as if each said
    "additionalProperties": false). disable_fallback is accepted and changes nothing (one grammar engine here)."""

    json: Optional[Union[str, Mapping[str, Any]]] = None  # a JSON schema: a mapping, or its JSON text
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None  # the answer is one of these strings
    grammar: Optional[str] = None  # Lark (llguidance's dialect) or llama.cpp's GBNF
    json_object: Optional[bool] = None  # any JSON object (OpenAI's response_format {"type": "json_object"})
    disable_any_whitespace: bool = False
    whitespace_pattern: Optional[str] = None
    disable_additional_properties: bool = False
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def kind(self) -> str:
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            set_.append("json_object")
        if len(set_) != 1:
            raise _invalid(
                "invalid structured_outputs: give exactly one of json, regex, choice, grammar or json_object "
                f"(got {', '.join(set_) if set_ else 'none'})")
        return set_[0]

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return _invalid(f"invalid structured_outputs: {msg}")

        kind = self.kind()
        if self.json_object not in (None, True, False):
            raise bad(f"json_object must be true, false or null (got {self.json_object!r:.40})")
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be true or false (got {getattr(self, name)!r:.40})")
        if self.whitespace_pattern is not None and (not isinstance(self.whitespace_pattern, str)
                                                    or not self.whitespace_pattern):
            raise bad(f"whitespace_pattern must be a non-empty string (got {self.whitespace_pattern!r:.40})")
        if kind == "json":
            if isinstance(self.json, str):
                if len(self.json) > MAX_SPEC_CHARS:
                    raise bad(f"json: the schema may be at most {MAX_SPEC_CHARS} characters")
                try:
                    schema = _json.loads(self.json)
                except ValueError as e:
                    raise bad(f"json: the schema is not valid JSON ({e})") from None
            else:
                schema = self.json
            if not isinstance(schema, (Mapping, bool)):
                raise bad(f"json must be a JSON schema: an object (got {type(schema).__name__})")
        elif kind in ("regex", "grammar"):
            v = getattr(self, kind)
            if not isinstance(v, str) or not v.strip():
                raise bad(f"{kind} must be a non-empty string (got {v!r:.60})")
            if len(v) > MAX_SPEC_CHARS:
                raise bad(f"{kind} may be at most {MAX_SPEC_CHARS} characters")
        elif kind == "choice":
            c = self.choice
            if isinstance(c, str) or not isinstance(c, (list, tuple)) or not c or any(
                    not isinstance(s, str) or not s for s in c):
                raise bad(f"choice must be a non-empty list of non-empty strings (got {c!r:.60})")
            if len(c) > MAX_CHOICES:
                raise bad(f"choice takes at most {MAX_CHOICES} strings (got {len(c)})")

    def to_grammar(self) -> str:
        """The llguidance grammar of this constraint (not yet checked against a tokenizer)."""
        llguidance = _llguidance()
        kind = self.kind()
        ws: dict[str, Any] = {"whitespace_flexible": not self.disable_any_whitespace}
        if self.whitespace_pattern is not None:
            ws["whitespace_pattern"] = self.whitespace_pattern
        try:
            if kind == "json":
                schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
                if self.disable_additional_properties:
                    schema = _closed(schema)
                return llguidance.LLMatcher.grammar_from_json_schema(_json.dumps(schema), defaults=ws)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=ws)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.regex)
            if kind == "choice":
                # (a regex of the escaped strings: the text must be one of them exactly)
                lark = "start: " + " | ".join(_json.dumps(s) for s in self.choice)
                return llguidance.LLMatcher.grammar_from_lark(lark)
            return llguidance.grammar_from("grammar", self.grammar)  # Lark or GBNF, told apart by llguidance
        except (ValueError, TypeError) as e:
            raise _invalid(f"invalid structured_outputs: {kind}: {e}") from None

    @classmethod
    def from_value(cls, v: Union["StructuredOutputs", Mapping[str, Any], None]) -> Optional["StructuredOutputs"]:
        """A StructuredOutputs from itself, None, or a mapping of its fields (unknown names refused)."""
        if v is None or isinstance(v, cls):
            return v
        if not isinstance(v, Mapping):
            raise _invalid(
                f"invalid structured_outputs: a StructuredOutputs or a mapping of its fields (got {type(v).__name__})")
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(v) - names)
        if "structural_tag" in unknown:
            raise _invalid("invalid structured_outputs: structural_tag is not supported by this engine")
        if unknown:
            raise _invalid(f"invalid structured_outputs: unknown field(s) {', '.join(map(str, unknown))} "
                           f"(known: {', '.join(sorted(names))})")
        return cls(**v)


_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SUB_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SUB_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
            "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def _closed(schema: Any) -> Any:
    """The schema with "additionalProperties": false wherever an object schema does not set it (vLLM's
    disable_additional_properties), through the keywords whose values are schemas."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for k in _SUB_MAPS:
        if isinstance(out.get(k), Mapping):
            out[k] = {name: _closed(s) for name, s in out[k].items()}
    for k in _SUB_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [_closed(s) for s in out[k]]
    for k in _SUB_ONE:
        if k in out:
            out[k] = [_closed(s) for s in out[k]] if isinstance(out[k], list) else _closed(out[k])
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GrammarCompiler:
    """One engine's llguidance tokenizer (made on the first constrained request: ~0.3 s at a 49,152-token
    vocabulary) and the compilation of each request's constraint against it."""

    CACHED = 64  # compiled constraints kept (a server's requests often share one: n choices, a client's schema)

    def __init__(self, tokenizer, vocab: int, eos_ids: Sequence[int]):
        self._tokenizer, self._vocab, self._eos = tokenizer, vocab, [int(t) for t in eos_ids]
        self._ll = None
        self._lock = threading.Lock()
        self._compiled: "OrderedDict[str, Any]" = OrderedDict()  # grammar -> a fresh matcher (copied per request)

    def _ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                self._ll = self._make_ll_tokenizer()
            return self._ll

    def _make_ll_tokenizer(self):
        llguidance = _llguidance()
        tok = self._tokenizer
        if tok is None:
            raise _invalid("structured outputs need the model's tokenizer (this model has none)")
        if tok.vocab_size > self._vocab:
            raise _invalid(f"structured outputs: the tokenizer has {tok.vocab_size} tokens, more than the "
                           f"model's {self._vocab} logits")
        eos = self._eos or None
        try:  # the tokenizer's own JSON, as vLLM and transformers hand it over (its normalizer, decoder, specials)
            return llguidance.LLTokenizer(tok._tok.to_str(), n_vocab=self._vocab, eos_token=eos)
        except Exception as e:  # a pipeline llguidance does not read (e.g. a word-level model): each token's bytes
            log.debug("llguidance cannot read the tokenizer's JSON (%s); using the tokens' bytes", e)
            return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes(tok, self._vocab, self._eos)),
                                          n_vocab=self._vocab, eos_token=eos)

    def compile(self, so: StructuredOutputs) -> Any:
        """The constraint's matcher at its start, compiled once and kept (least recently used out); a constraint
        that does not compile is the request's error (InvalidRequestError naming what llguidance found). The
        first call also makes the tokenizer's side: a server calls this off its event loop."""
        grammar = so.to_grammar()
        with self._lock:
            m = self._compiled.get(grammar)
            if m is not None:
                self._compiled.move_to_end(grammar)
                return m
        llguidance = _llguidance()
        m = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise _invalid(f"invalid structured_outputs: {so.kind()}: {m.get_error().strip()[:500]}")
        with self._lock:
            self._compiled[grammar] = m
            while len(self._compiled) > self.CACHED:
                self._compiled.popitem(last=False)
        return m

    def start(self, so: StructuredOutputs) -> "GrammarState":
        """A request's matcher at the start of its answer (a copy of the compiled one)."""
        return GrammarState(self.compile(so).deep_copy(), self._vocab)


class _TokenBytes:
    """llguidance's TokenizerWrapper input for a tokenizer it cannot read from JSON: each id's bytes in a text
    (Tokenizer.token_bytes, as logprobs show them), the added tokens and ids past the tokenizer special."""

    def __init__(self, tok, vocab: int, eos_ids: Sequence[int]):
        n = tok.vocab_size
        self.tokens = [tok.token_bytes(i) if i < n else b"" for i in range(vocab)]
        added = set(tok._tok.get_added_tokens_decoder())
        self.special_token_ids = sorted(added | set(range(n, vocab)) | set(eos_ids))
        self.eos_token_id = eos_ids[0] if eos_ids else None
        bos = tok.token_to_id(tok.bos_token) if tok.bos_token else None
        self.bos_token_id = bos
        self._tok = tok

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special_tokens=False)


class GrammarState:
    """One request's place in its grammar: the tokens generated so far consumed, the mask of the next."""

    def __init__(self, matcher, vocab: int):
        self._m, self._vocab = matcher, vocab
        self._n = 0  # generated tokens consumed
        self._words = (vocab + 31) // 32
        # (bits past the vocabulary in the last word: never a token)
        self._tail = np.uint32((1 << (vocab % 32)) - 1) if vocab % 32 else np.uint32(0xFFFFFFFF)

    def advance(self, generated: Sequence[int]) -> None:
        """Consumes the generated tokens not consumed yet. A token the grammar refuses (the samplers never take a
        token outside the mask; a tokenizer whose tokens llguidance read wrongly could make one) is an error:
        InvalidRequestError, the request's end, rather than an answer that breaks its constraint."""
        if len(generated) > self._n:
            new = [int(t) for t in generated[self._n:]]
            self._n = len(generated)
            if not self._m.consume_tokens(new):
                raise _invalid("structured outputs: the grammar refused the sampled token(s) "
                               f"{new}: {self._m.get_error().strip().splitlines()[0][:300]}")

    @property
    def finished(self) -> bool:
        """Nothing more may follow: the grammar is complete."""
        return self._m.is_stopped()

    def mask(self) -> np.ndarray:
        """The allowed tokens of the next step: uint32 words, bit t % 32 of word t / 32."""
        m = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint32)
        if m.size < self._words:
            raise RuntimeError(f"llguidance's mask has {m.size} words, the vocabulary needs {self._words}")
        m = m[:self._words].copy()  # (llguidance's has a word more where the vocabulary fills its last word)
        m[-1] &= self._tail
        return m
