"""The OpenAI wire format: request bodies checked field by field into typed requests, errors in OpenAI's shape,
and the response / chunk dictionaries.

Bodies are checked by hand rather than by pydantic models: every refusal must be a 400 in OpenAI's error shape
that names the parameter (`param`), and the tables below say in one place what is honoured, what is refused
because this engine cannot do it, and what is accepted and ignored.

Field policy (README "Serving"): a field of OpenAI's API that this server cannot honour is refused with 400 naming
it (unless it holds the value that means "off", e.g. `"functions": []`, `"echo": false`, `"best_of": 1`); an
unknown field is refused too, so a typo never silently changes nothing. Only `user`, `metadata` and `store` (false)
are accepted and ignored: clients send them routinely.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from ..chat import joined_text_parts
from ..errors import InvalidRequestError
from ..sampling import (DEFAULTABLE, INT64_MAX, LOGIT_BIAS_RANGE, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGPROBS,
                        MAX_STOP_CHARS, SamplingParams, TextAssembler, as_float32)
from ..structured import StructuredOutputs
from ..tools import ToolCall, check_tool_choice, check_tools, forced_constraint
from ..tokenizer import not_unicode


class APIError(Exception):
    """An error answered in OpenAI's shape {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict] = None):
        # what the client sent may hold a lone surrogate (JSON's "\ud800"), which the response could not encode
        message = message.encode("utf-8", "backslashreplace").decode()
        param = None if param is None else param.encode("utf-8", "backslashreplace").decode()
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- typed requests ----


@dataclass
class GenerationRequest:
    """What both endpoints ask of the scheduler: prompts (token ids or chat messages, resolved by the app), the
    sampling parameters of choice 0 (choice i gets seed + i), how many choices per prompt, how to answer."""

    kind: str  # "chat" | "completion"
    model: Optional[str]
    params: SamplingParams  # max_tokens may be None-ish: see max_tokens below
    max_tokens: Optional[int]  # None: the endpoint's default (chat: the rest of the context; completions: 16)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # None: off; k: the chosen token's logprob and k top entries
    messages: Optional[list[dict]] = None  # chat
    prompts: list[Union[str, list[int]]] = field(default_factory=list)  # completions: one or more prompts
    structured_from: Optional[str] = None  # the field that asked for structured outputs (errors name it)
    tools: Optional[list[dict]] = None  # chat: OpenAI's tool definitions (the template's `tools`)
    tool_choice: Union[str, dict] = "none"  # "none" | "auto" | "required" | {"type": "function", ...}
    echo: bool = False  # completions: the prompt's text before the answer (with logprobs: its tokens' too)
    # completions' max_tokens 0 with echo: the prompt alone, scored (one token generated and left out, as vLLM)
    prompt_only: bool = False
    parallel_tool_calls: bool = True  # false: one call at most


# ---- field checkers: each returns the value or raises a 400 naming the field ----


def _int(body: dict, name: str, lo: int, hi: Optional[int] = None) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise bad(f"'{name}' must be an integer {rng} (got {v!r})", name)
    return v


def _num(body: dict, name: str, ok: Callable[[float], bool], what: str) -> Optional[float]:
    v = body.get(name)
    if v is None:
        return None
    f = None if isinstance(v, bool) or not isinstance(v, (int, float)) else as_float32(v)
    # the core holds these as float32: 1e300 (or 10**400) would be infinite there, 1e-50 zero
    if f is None or not math.isfinite(f) or not ok(v) or not ok(f):
        raise bad(f"'{name}' must be {what} as a float32 (got {v!r})", name)
    return float(v)


def _bool(body: dict, name: str) -> Optional[bool]:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean (got {v!r})", name)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(f"'stop' must be a string or a list of strings (got {v!r:.100})", "stop")
    if len(v) > 4:  # OpenAI's limit
        raise bad(f"'stop' takes at most 4 sequences (got {len(v)})", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in v):
        raise bad(f"'stop' sequences may be at most {MAX_STOP_CHARS} characters long", "stop")
    for s in v:
        if not_unicode(s):
            raise bad(f"'stop' sequence {s!r:.60} is not valid Unicode: {not_unicode(s)}", "stop")
    return [s for s in v if s]  # "" can never be found; OpenAI accepts and ignores it


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's logit_bias: an object of token ids (JSON keys: strings of digits) to numbers in [-100, 100]. Ids past
    the vocabulary: the app's check, which knows it."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad(f"'logit_bias' must be an object of token ids to numbers (got {v!r:.100})", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries (got {len(v)})", "logit_bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        if not (k.isascii() and k.isdigit()) or len(k) > 10:
            raise bad(f"'logit_bias' keys must be token ids (got {k!r:.40})", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100] (got {b!r:.40} for token {k})", "logit_bias")
        if int(k) in out:  # ("7" and "07")
            raise bad(f"'logit_bias' names token {int(k)} twice", "logit_bias")
        out[int(k)] = float(b)
    return out


# vLLM's older extensions for structured outputs, each one StructuredOutputs field (vLLM's structured_outputs now)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured(body: dict) -> tuple[Optional[StructuredOutputs], Optional[str]]:
    """Structured outputs from OpenAI's response_format ({"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}), vLLM's structured_outputs object or its older guided_* fields;
    at most one of them. Returns the constraint (None: plain text) and the field it came from."""
    given = [f for f in ("response_format", "structured_outputs", *_GUIDED)
             if body.get(f) is not None and body.get(f) != {"type": "text"}]
    if not given:
        return None, None
    if len(given) > 1:
        raise bad(f"give structured outputs one way: {', '.join(map(repr, given))} were all set", given[1])
    name = given[0]
    v = body[name]
    try:
        if name == "response_format":
            if not isinstance(v, dict) or v.get("type") not in ("json_object", "json_schema"):
                raise bad("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                          f"{{\"type\": \"json_schema\", \"json_schema\": {{...}}}} (got {v!r:.100})", name)
            _refuse_unknown(v, {"type", "json_schema"} if v["type"] == "json_schema" else {"type"})
            if v["type"] == "json_object":
                return StructuredOutputs(json_object=True), name
            js = v.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise bad("'response_format' json_schema must be an object with a 'schema' object (got "
                          f"{js!r:.100})", name)
            _refuse_unknown(js, {"name", "description", "schema", "strict"})
            return StructuredOutputs(json=js["schema"]), name
        if name == "structured_outputs":
            return StructuredOutputs.from_value(v), name
        return StructuredOutputs(**{_GUIDED[name]: v}), name
    except APIError as e:
        e.param = name
        raise
    except InvalidRequestError as e:
        raise bad(str(e), name) from None


# Fields of OpenAI's API this engine cannot honour, each with the values that mean "not used" (accepted).
_OFF = {
    "functions": (None, []), "function_call": (None, "none"),
    "best_of": (None, 1), "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "service_tier": (None, "auto", "default"),
}
OPENAI_TEMPERATURE = 1.0  # a request's temperature when it has none (OpenAI's API reference)
_IGNORED = {"user", "metadata", "store"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "seed", "stop", "n", "stream", "stream_options", "ignore_eos", "logprobs",
           "stop_token_ids", "logit_bias", "min_tokens", "bad_words", "response_format", "structured_outputs",
           "skip_special_tokens", *_GUIDED}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "echo"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo"}


def _check_fields(body: dict, known: set) -> None:
    for name, off in _OFF.items():
        if name in body and not any(body[name] == o and type(body[name]) is type(o) for o in off):
            raise bad(f"'{name}' is not supported by this server", name, "unsupported_parameter")
    if body.get("store") not in (None, False):
        raise bad("'store' is not supported by this server (only false)", "store", "unsupported_parameter")
    _refuse_unknown(body, known | set(_OFF) | _IGNORED)


def _refuse_unknown(body: dict, known: set) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad(f"unknown parameter(s): {', '.join(map(repr, unknown))}", unknown[0], "unknown_parameter")


def _sampling(body: dict, max_tokens: Optional[int], defaults: Mapping[str, Any]) -> SamplingParams:
    """The body's sampling fields as SamplingParams (the remaining checks are SamplingParams.validate's, with
    the field named in the message); the fields it leaves out from `defaults` (checked_defaults'), then
    temperature from OpenAI's default."""
    kw: dict[str, Any] = {}
    t = _num(body, "temperature", lambda x: 0 <= x <= 2, "a number in [0, 2]")
    # unset: OpenAI's default (1, as vLLM's server without a generation config), not the library's greedy 0 — an
    # OpenAI client that leaves it out asks for sampling, and n > 1 would otherwise give n equal choices
    kw["temperature"] = defaults.get("temperature", OPENAI_TEMPERATURE) if t is None else t
    for name in DEFAULTABLE:
        if name in defaults and body.get(name) is None:
            kw[name] = defaults[name]
    p = _num(body, "top_p", lambda x: 0 < x <= 1, "a number in (0, 1]")
    if p is not None:
        kw["top_p"] = p
    k = body.get("top_k")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or not -1 <= k <= INT64_MAX:
            raise bad(f"'top_k' must be an integer in 0..2**63-1, or -1 / 0 for off (got {k!r})", "top_k")
        kw["top_k"] = k
    m = _num(body, "min_p", lambda x: 0 <= x <= 1, "a number in [0, 1]")
    if m is not None:
        kw["min_p"] = m
    r = _num(body, "repetition_penalty", lambda x: x > 0, "a number > 0")
    if r is not None:
        kw["repetition_penalty"] = r
    for name in ("presence_penalty", "frequency_penalty"):
        v = _num(body, name, lambda x: -2 <= x <= 2, "a number in [-2, 2]")
        if v is not None:
            kw[name] = v
    seed = body.get("seed")
    if seed is not None:
        # OpenAI's seed is a signed 64-bit integer (vLLM takes negative ones too); the core's RNG takes an unsigned
        # one: a negative seed is its two's complement, so every signed seed is its own stream
        if isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**63:
            raise bad(f"'seed' must be an integer in -2**63..2**63-1 (got {seed!r})", "seed")
        kw["seed"] = seed % 2**64
    kw["stop"] = _stop(body)
    ids = body.get("stop_token_ids")  # (vLLM's extension; ids past the vocabulary: the app's check, which knows it)
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise bad(f"'stop_token_ids' must be a list of token ids (got {ids!r:.100})", "stop_token_ids")
        kw["stop_token_ids"] = ids
    if _bool(body, "ignore_eos"):
        kw["ignore_eos"] = True
    skip = _bool(body, "skip_special_tokens")  # (vLLM's extension; default true)
    if skip is not None:
        kw["skip_special_tokens"] = skip
    bias = _logit_bias(body)
    if bias:
        kw["logit_bias"] = bias
    words = body.get("bad_words")  # (vLLM's extension)
    if words is not None:
        if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
            raise bad(f"'bad_words' must be a list of non-blank strings (got {words!r:.100})", "bad_words")
        if len(words) > MAX_BAD_WORDS:
            raise bad(f"'bad_words' takes at most {MAX_BAD_WORDS} words (got {len(words)})", "bad_words")
        kw["bad_words"] = words
    mt = body.get("min_tokens")  # (vLLM's extension)
    if mt is not None:
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 0:
            raise bad(f"'min_tokens' must be an integer >= 0 (got {mt!r:.40})", "min_tokens")
        if max_tokens is not None and mt > max_tokens:
            raise bad(f"'min_tokens' ({mt}) must be at most max_tokens ({max_tokens})", "min_tokens")
        kw["min_tokens"] = mt
    so, _ = _structured(body)
    if so is not None:
        kw["structured_outputs"] = so
    try:
        return SamplingParams(max_tokens=max_tokens, **kw)  # (None: the endpoint's default, set by the app)
    except InvalidRequestError as e:  # a check above should have named the field; a 400 all the same
        raise bad(str(e)) from None


def _stream(body: dict) -> tuple[bool, bool]:
    stream = bool(_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise bad(f"'stream_options' may only hold 'include_usage' (got {opts!r:.100})", "stream_options")
    inc = opts.get("include_usage")
    if inc is not None and not isinstance(inc, bool):
        raise bad("'stream_options.include_usage' must be a boolean", "stream_options")
    return stream, bool(inc)


def _model(body: dict) -> Optional[str]:
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise bad(f"'model' must be a string (got {m!r:.100})", "model")
    return m


def checked_defaults(raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A model's sampling defaults (Engine.sampling_defaults) as the server takes them: (the valid ones, a
    description of each one left out). A generation config is advice that a model's files carry, so a value the
    sampler would refuse (top_p 0, a string) is left out rather than refusing the model or every request."""
    ok: dict[str, Any] = {}
    dropped = []
    for name, v in raw.items():
        try:
            if name not in DEFAULTABLE:
                raise InvalidRequestError("not a sampling default")
            SamplingParams(**{name: v}).validate()
            if name == "temperature" and not v <= 2:  # (the API's own bound, _sampling's)
                raise InvalidRequestError("above 2")
            ok[name] = v
        except (InvalidRequestError, TypeError) as e:
            dropped.append(f"{name}={v!r:.40} ({e})")
    return ok, dropped


def _messages(body: dict) -> list[dict]:
    """The body's 'messages': a non-empty list; a message's list of text parts joined into one string."""
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        # (joined here, in the HTTP side, so that the 400 names its param; the template would join them too)
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            try:
                msgs[i] = {**m, "content": joined_text_parts(m["content"], i)}
            except InvalidRequestError as e:
                raise bad(str(e), "messages") from None
    return msgs


def parse_chat(body: Any, defaults: Mapping[str, Any] = MappingProxyType({})) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS)
    if _bool(body, "echo"):  # (vLLM's chat echo, the last message first: not here; false is accepted)
        raise bad("'echo' is not supported for chat by this server", "echo", "unsupported_parameter")
    msgs = _messages(body)
    mt, mct = _int(body, "max_tokens", 1), _int(body, "max_completion_tokens", 1)
    if mt is not None and mct is not None and mt != mct:
        raise bad("'max_tokens' and 'max_completion_tokens' disagree; give one", "max_completion_tokens")
    lp = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top and not lp:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    stream, usage = _stream(body)
    max_tokens = mct if mct is not None else mt
    params, structured_from = _sampling(body, max_tokens, defaults), _structured(body)[1]
    tools, choice = _tools(body)
    parallel = _bool(body, "parallel_tool_calls") is not False  # (OpenAI's default: true)
    try:
        forced = forced_constraint(tools, choice, parallel) if tools else None
    except InvalidRequestError as e:
        raise bad(str(e), "tools") from None
    if forced is not None:  # a named tool_choice or "required": the answer held to the calls' JSON
        if params.structured_outputs is not None:
            raise bad(f"'tool_choice' {choice if isinstance(choice, str) else 'naming a function'} and "
                      f"'{structured_from}' both constrain the answer; give one", "tool_choice")
        # (what fails to compile then is a tool's parameters)
        params, structured_from = dataclasses.replace(params, structured_outputs=forced), "tools"
    elif tools and choice == "auto":  # a parser may read tags the tokenizer holds as special tokens (vLLM's rule)
        params = dataclasses.replace(params, skip_special_tokens=False)
    return GenerationRequest(kind="chat", model=_model(body), params=params,
                             max_tokens=max_tokens, n=_int(body, "n", 1, 128) or 1, stream=stream,
                             include_usage=usage, logprobs=(top or 0) if lp else None, messages=msgs,
                             structured_from=structured_from, tools=tools, tool_choice=choice,
                             parallel_tool_calls=parallel)


def _tools(body: dict) -> tuple[Optional[list[dict]], Union[str, dict]]:
    """OpenAI's tools (an empty list: none) and tool_choice, checked."""
    tools = body.get("tools")
    try:
        tools = check_tools(tools) if tools not in (None, []) else None
    except InvalidRequestError as e:
        raise bad(str(e), "tools") from None
    try:
        return tools, check_tool_choice(body.get("tool_choice"), tools)
    except InvalidRequestError as e:
        raise bad(str(e), "tool_choice") from None


def _prompts(p: Any) -> list[Union[str, list[int]]]:
    """OpenAI's four prompt forms: a string, a list of token ids, a list of strings, a list of token-id lists."""
    def ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(p, str):
        out: list = [p]
    elif ids(p):
        out = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or ids(x) for x in p):
        out = list(p)
    else:
        raise bad("'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt")
    if any(x == "" for x in out):
        raise bad("'prompt' is empty", "prompt")
    return out


def parse_completion(body: Any, defaults: Mapping[str, Any] = MappingProxyType({})) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise bad("'prompt' is required", "prompt")
    prompts = _prompts(body["prompt"])
    mt = _int(body, "max_tokens", 0)
    lp = _int(body, "logprobs", 0, MAX_LOGPROBS)
    echo = bool(_bool(body, "echo"))
    prompt_only = mt == 0
    if prompt_only:
        if not echo:
            raise bad("'max_tokens' must be an integer >= 1 (0 only with 'echo': the prompt alone, with its "
                      "logprobs)", "max_tokens")
        mt = 1
    stream, usage = _stream(body)
    params = _sampling(body, mt, defaults)
    if echo and lp is not None:  # the prompt's tokens' logprobs, as many top entries as the answer's
        params = dataclasses.replace(params, prompt_logprobs=lp)
    return GenerationRequest(kind="completion", model=_model(body), params=params, max_tokens=mt,
                             n=_int(body, "n", 1, 128) or 1, stream=stream, include_usage=usage, logprobs=lp,
                             prompts=prompts, structured_from=_structured(body)[1], echo=echo,
                             prompt_only=prompt_only)


# ---- responses ----


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: of the prompt tokens, those the prefix cache held (as OpenAI and vLLM
    report them)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class TokenText:
    """Token id -> (its text, its bytes), as logprobs show them: the text is the bytes' UTF-8 (" cat" for
    SentencePiece's "▁cat", U+FFFD for part of a character); cached (a vocabulary is small)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            data = bytes(self._tok.token_bytes(token_id))
            hit = self._cache[token_id] = (data.decode("utf-8", errors="replace"), data)
        return hit


class TextOffsets:
    """The legacy format's text_offset of each token of one choice: the characters of the choice's text before it
    (its tokens decoded as the engine decodes the text, whole characters only), so a character split across
    tokens counts once (the tokens' texts show a U+FFFD each) and a first token's space that decoding strips
    (SentencePiece's "▁Hello") is not counted."""

    def __init__(self, tokenizer, context: Sequence[int] = ()):
        """context: the prompt's last ids, which the choice's text is decoded after (its TextAssembler's)."""
        self._text = TextAssembler(functools.partial(tokenizer.decode, skip_special_tokens=True), (),
                                   context=context)

    def next(self, token_id: int) -> int:
        at = self._text.emitted
        self._text.add([token_id])
        return at


def chat_logprobs(items: Sequence, token_text: TokenText) -> dict:
    """OpenAI chat format: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""
    def entry(tid: int, lp: float) -> dict:
        text, data = token_text(tid)
        return {"token": text, "logprob": lp, "bytes": list(data)}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top]}
                        for x in items], "refusal": None}


def completion_logprobs(items: Sequence, token_text: TokenText, offsets_of: TextOffsets,
                        first_id: Optional[int] = None) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs (dicts), text_offset (characters into
    the choice's text, from `offsets_of`, which has seen the choice's earlier tokens). A top_logprobs dict holds the
    chosen token too (OpenAI's rule: up to logprobs + 1 entries; logprobs 0: the chosen one alone). first_id: an
    echoed prompt's first token, which has no logprob (null entries, as OpenAI's and vLLM's), before the items."""
    tokens: list[str] = []
    lps: list[Optional[float]] = []
    tops: list[Optional[dict]] = []
    offsets: list[int] = []
    if first_id is not None:
        tokens.append(token_text(first_id)[0])
        lps.append(None)
        tops.append(None)
        offsets.append(offsets_of.next(first_id))
    for x in items:
        tokens.append(token_text(x.token_id)[0])
        lps.append(x.logprob)
        top = {token_text(t)[0]: lp for t, lp in x.top}
        top.setdefault(tokens[-1], x.logprob)
        tops.append(top)
        offsets.append(offsets_of.next(x.token_id))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def joined_logprobs(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    """Two legacy logprobs objects of one choice, one after the other (an echoed prompt's, then the answer's)."""
    if a is None or b is None:
        return a if b is None else b
    return {k: a[k] + b[k] for k in a}


def sse(body: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class ChunkFormat:
    """The SSE chunks of one streamed answer (`head`: id, object, created, model, ...). The frequent chunk, a
    choice's new text without logprobs, comes from a template made once per choice index: only the text is
    JSON-encoded per chunk (a server streaming to 64 clients writes thousands of them a second)."""

    _MARK = "tinyinfer-text-7f3a9c1e"

    def __init__(self, head: dict, kind: str, include_usage: bool):
        self.head = head
        self.kind = kind
        self.tail = {"usage": None} if include_usage else {}
        self._text: dict[int, tuple[str, str]] = {}

    def chunk(self, *choices: dict) -> str:
        return sse({**self.head, "choices": list(choices), **self.tail})

    def text(self, index: int, text: str, logprobs: Optional[dict]) -> str:
        """The chunk of new text (and its logprobs) of choice `index`: sse(...) of the same dictionary."""
        if logprobs is not None:
            return self.chunk(stream_choice(self.kind, index, text, logprobs, None))
        t = self._text.get(index)
        if t is None:
            pre, post = self.chunk(stream_choice(self.kind, index, self._MARK, None, None)).split(
                json.dumps(self._MARK))
            t = self._text[index] = (pre, post)
        return t[0] + json.dumps(text, ensure_ascii=False) + t[1]

    def tool_calls(self, index: int, calls: Sequence[ToolCall]) -> str:
        """The chunk of a chat choice's tool calls, each whole (its arguments in one piece, as OpenAI's stream may
        send them)."""
        return self.chunk({"index": index, "delta": {"tool_calls": [c.to_openai(k) for k, c in enumerate(calls)]},
                           "logprobs": None, "finish_reason": None})

    def finish(self, index: int, reason: str, stop_reason: Union[int, str, None] = None) -> str:
        """A choice's last chunk: its finish_reason and vLLM's stop_reason (the stop string or id that ended it)."""
        return self.chunk({**stream_choice(self.kind, index, "", None, reason), "stop_reason": stop_reason})


def stream_choice(kind: str, index: int, text: str, logprobs: Optional[dict], finish: Optional[str],
                  first: bool = False) -> dict:
    """One choice of a streamed chunk. Chat: the first carries the role, the last (finish) an empty delta."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if first else ({} if finish else {"content": text})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def final_choice(kind: str, index: int, text: Optional[str], logprobs: Optional[dict], finish: str,
                 stop_reason: Union[int, str, None] = None, tool_calls: Sequence[ToolCall] = ()) -> dict:
    """One choice of a whole (non-streamed) answer; stop_reason: vLLM's (the stop string or id that ended it);
    a chat answer's tool calls in its message (its content then null unless text came before them)."""
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = [c.to_openai() for c in tool_calls]
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stop_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}


# ---- /tokenize and /detokenize (vLLM's routes beside the OpenAI API) ----


@dataclass
class TokenizeRequest:
    """POST /tokenize: a text prompt, or a chat rendered with the model's template, to token ids."""

    model: Optional[str]
    prompt: Optional[str] = None
    messages: Optional[list[dict]] = None
    add_special_tokens: bool = True  # prompt: the tokenizer's own (BOS), as a completion's prompt gets them
    add_generation_prompt: bool = True  # messages: the assistant's turn opened, as a chat request renders it
    return_token_strs: bool = False  # the tokens' vocabulary strings too ("token_strs")
    tools: Optional[list[dict]] = None  # messages: the tools a chat request would render with them


TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs",
                   "tools"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def _only(body: Any, known: set) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _refuse_unknown(body, known)
    return body


def parse_tokenize(body: Any) -> TokenizeRequest:
    body = _only(body, TOKENIZE_FIELDS)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad("give either 'prompt' (a string) or 'messages' (a chat)", "prompt")
    if has_prompt:
        for name in ("add_generation_prompt", "tools"):
            if body.get(name) is not None:
                raise bad(f"'{name}' applies to 'messages'", name)
        p = body["prompt"]
        if not isinstance(p, str):
            raise bad(f"'prompt' must be a string (got {p!r:.100})", "prompt")
        if not_unicode(p):
            raise bad(f"'prompt' is not valid Unicode: {not_unicode(p)}", "prompt")
        asp = _bool(body, "add_special_tokens")
        return TokenizeRequest(_model(body), prompt=p, add_special_tokens=True if asp is None else asp,
                               return_token_strs=bool(_bool(body, "return_token_strs")))
    if _bool(body, "add_special_tokens"):  # (false, vLLM's default for a chat, is accepted)
        raise bad("'add_special_tokens': true applies to 'prompt' (a chat's template writes its special tokens)",
                  "add_special_tokens")
    agp = _bool(body, "add_generation_prompt")
    return TokenizeRequest(_model(body), messages=_messages(body), add_generation_prompt=True if agp is None else agp,
                           return_token_strs=bool(_bool(body, "return_token_strs")), tools=_tools(body)[0])


def parse_detokenize(body: Any) -> tuple[Optional[str], list[int]]:
    """POST /detokenize's (model, token ids)."""
    body = _only(body, DETOKENIZE_FIELDS)
    toks = body.get("tokens")
    if toks is None:
        raise bad("'tokens' is required", "tokens")
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        raise bad(f"'tokens' must be a list of token ids (got {toks!r:.100})", "tokens")
    return _model(body), toks
