"""Chat templates: render a model's Jinja chat template exactly as transformers' `apply_chat_template` does.

Templates come from model files and are untrusted code. They are rendered only in Jinja's
ImmutableSandboxedEnvironment, with the same environment transformers builds (utils/chat_template_utils.py):
trim_blocks + lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now`, a `tojson` filter that
does not HTML-escape, a `dict` without attribute access to the type, and a `namespace` that refuses dunder /
underscore names. Everything the template sees is rebuilt from plain JSON types first. A template that reaches
for Python internals raises ChatTemplateError (from the sandbox's SecurityError) and never runs that code.

    text = render_chat(template, [{"role": "user", "content": "hi"}], bos_token="<s>", eos_token="</s>")
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Optional

from .errors import ChatTemplateError, InvalidRequestError


def _plain(value: Any) -> Any:
    """What a template may see: plain JSON-like data rebuilt from the input (transformers' _plain_template_data,
    minus the numpy/dataclass/pydantic cases our callers don't have). Anything else becomes "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) can carry methods: back to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes; transformers replaces it with plain json.dumps
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        # `dict(...)` for templates without exposing the dict type itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # namespaces refuse underscore-prefixed attributes (a route to CPython internals)
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace "
                                    f"(got {name!r})")

    class GenerationTag(jinja2.ext.Extension):
        # transformers' `{% generation %}...{% endgeneration %}` (marks assistant tokens); renders its body as is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    """As transformers: a message's reasoning, under any of its names, is also given as `reasoning_content` and
    `thinking` (the names templates read)."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# The roles chat templates know (OpenAI's and transformers'); anything else is a typo the template would drop.
ROLES = ("system", "user", "assistant", "tool")
# OpenAI's newer name for the system role (its clients send it); no chat template of ours knows it
ALIASES = {"developer": "system"}


def joined_text_parts(parts: list, i: int) -> str:
    """OpenAI's content as a list of parts: its text parts joined; anything else (images, audio) refused."""
    if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise InvalidRequestError(f"messages[{i}].content: only text parts are supported")
    return "".join(p["text"] for p in parts)


def validate_messages(messages: Any) -> list[dict]:
    """A list of dicts, each with a known str 'role' ('developer' read as 'system') and a str 'content' (not empty
    for user; a list of OpenAI text parts is joined; an assistant's tool_calls turn may have none: ""; tool_calls
    a list of OpenAI's call objects). Keys whose value is None are dropped (as transformers does).
    Raises InvalidRequestError naming the bad message."""
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequestError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise InvalidRequestError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r:.80}")
        calls = m.get("tool_calls")
        if calls is not None and (not isinstance(calls, (list, tuple)) or not all(
                isinstance(c, Mapping) and isinstance(c.get("function"), Mapping)
                and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments", ""), (str, Mapping)) for c in calls)):
            raise InvalidRequestError(f"messages[{i}].tool_calls must be a list of {{\"id\", \"type\": \"function\", "
                                      f"\"function\": {{\"name\", \"arguments\"}}}} objects (got {calls!r:.80})")
        if m.get("role") == "assistant" and calls and m.get("content") is None:
            m = {**m, "content": ""}  # (OpenAI's assistant turn of tool calls has no content; templates add it)
        for key in ("role", "content"):
            if key not in m:
                raise InvalidRequestError(f"messages[{i}] has no {key!r}")
            if key == "content" and isinstance(m[key], list):
                m = {**m, "content": joined_text_parts(m[key], i)}
            if not isinstance(m[key], str):
                raise InvalidRequestError(
                    f"messages[{i}][{key!r}] must be a str, got {type(m[key]).__name__}"
                )
        role = ALIASES.get(m["role"], m["role"])
        if role not in ROLES:
            known = ", ".join(ROLES + tuple(ALIASES))
            raise InvalidRequestError(f"messages[{i}] has an unknown role {m['role']!r} (known: {known})")
        # (an empty system message is what chat front-ends send when the user set none: rendered as it is)
        if role == "user" and not m["content"].strip():
            raise InvalidRequestError(f"messages[{i}] (user) has empty content")
        out.append({k: v for k, v in m.items() if v is not None} | {"role": role})
    return out


def render_chat(
    template: str,
    messages: list[dict],
    *,
    bos_token: Optional[str],
    eos_token: Optional[str],
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """Render `messages` with a chat template, as transformers' apply_chat_template(tokenize=False) does.

    `extra` are further template variables (transformers passes the tokenizer's special tokens —
    unk_token, pad_token — plus any kwargs, e.g. tools=None, documents=None, enable_thinking=False).
    Raises InvalidRequestError for malformed messages and ChatTemplateError for a template that does not parse,
    calls raise_exception(), fails while rendering, or tries to leave the sandbox."""
    if not isinstance(template, str) or not template:
        raise ChatTemplateError("the model has no chat template")
    try:
        msgs = _alias_reasoning(_plain(validate_messages(messages)))
    except RecursionError:  # _plain recurses per level: a message's extra keys may nest without end
        raise InvalidRequestError("messages are nested too deeply") from None
    import jinja2.exceptions

    try:
        compiled = _compile(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error (line {e.lineno}): {e.message}") from e
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
    variables = {"bos_token": bos_token, "eos_token": eos_token}
    variables.update(extra)
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    variables = _plain(variables)
    try:
        return compiled.render(messages=msgs, add_generation_prompt=bool(add_generation_prompt), **variables)
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template tried to leave the sandbox: {e}") from e
    except jinja2.exceptions.TemplateError as e:  # raise_exception(...), undefined errors, ...
        raise ChatTemplateError(f"chat template error: {e}") from e
    except RecursionError as e:
        raise ChatTemplateError("chat template recursed too deeply") from e
    except MemoryError as e:
        raise ChatTemplateError("chat template ran out of memory while rendering") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as e:
        raise ChatTemplateError(f"chat template failed while rendering: {type(e).__name__}: {e}") from e


__all__ = ["render_chat", "validate_messages"]
