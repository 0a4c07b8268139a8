"""Tool calling (OpenAI's `tools` / `tool_choice`), as vLLM's server does it.

- The tools go to the chat template (`tools=[...]`, transformers' convention); a template that does not use them
  leaves the model unaware of them.
- `tool_choice` a named function, or "required": the answer is held by structured outputs to that function's
  parameters (named), or to a JSON array of {"name", "parameters"} objects of the given tools (required), and
  parsed into tool calls — whatever the model and its template.
- "auto": the model decides, in its own format, which a parser reads from the text (vLLM's
  --enable-auto-tool-choice --tool-call-parser): "hermes" (<tool_call>{"name": ..., "arguments": ...}</tool_call>:
  Hermes, Qwen2.5, SmolLM3) or "llama3_json" (an answer that is {"name": ..., "parameters": ...}, several joined
  by ";": Llama 3.1-3.3). Without a parser "auto" is refused (vLLM's rule); "none" generates text as usual.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from .errors import InvalidRequestError
from .structured import StructuredOutputs

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
PARSERS = ("hermes", "llama3_json")


def _bad(msg: str, what: str = "tools") -> InvalidRequestError:
    return InvalidRequestError(f"invalid {what}: {msg}")


def check_tools(tools: Any) -> list[dict]:
    """OpenAI's tools: a list of {"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}}; the function names distinct. Returns them as given (the template's `tools`)."""
    if not isinstance(tools, list) or not tools:
        raise _bad(f"'tools' must be a non-empty list (got {tools!r:.80})")
    if len(tools) > MAX_TOOLS:
        raise _bad(f"at most {MAX_TOOLS} tools (got {len(tools)})")
    names = set()
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(t.get("function"), Mapping):
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}} (got {t!r:.80})")
        f = t["function"]
        unknown = sorted(set(t) - {"type", "function"}) + sorted(set(f) - {"name", "description", "parameters",
                                                                          "strict"})
        if unknown:
            raise _bad(f"tools[{i}] has unknown field(s) {', '.join(map(repr, unknown))}")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"tools[{i}].function.name must be 1-64 letters, digits, _ or - (got {name!r:.80})")
        if name in names:
            raise _bad(f"tools[{i}]: the function name {name!r} is given twice")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise _bad(f"tools[{i}].function.description must be a string")
        if f.get("parameters") is not None and not isinstance(f["parameters"], Mapping):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise _bad(f"tools[{i}].function.strict must be true or false")
    return tools


def check_tool_choice(choice: Any, tools: Optional[list[dict]]) -> Union[str, dict]:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name": <one of the tools>}}; without tools
    only "none". Unset: "auto" with tools (OpenAI's default), else "none"."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise _bad(f"'tool_choice' {choice!r} needs 'tools'", "tool_choice")
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("function"),
                                                                                        Mapping):
        name = choice["function"].get("name")
        if not isinstance(name, str) or not tools or name not in {t["function"]["name"] for t in tools}:
            raise _bad(f"'tool_choice' names the function {name!r:.80}, which is not among the tools",
                       "tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise _bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
               f"{{\"name\": ...}}}} (got {choice!r:.80})", "tool_choice")


def _params(tool: dict) -> dict:
    return dict(tool["function"].get("parameters") or {"type": "object"})


def forced_constraint(tools: list[dict], choice: Union[str, dict],
                      parallel: bool = True) -> Optional[StructuredOutputs]:
    """The structured-output constraint of a named tool_choice (its parameters) or "required" (a JSON array of
    calls, one at most unless parallel); None for "none" / "auto"."""
    if isinstance(choice, dict):
        tool = next(t for t in tools if t["function"]["name"] == choice["function"]["name"])
        return StructuredOutputs(json=_params(tool))
    if choice != "required":
        return None
    # Each tool's parameters sit under items.anyOf[i].properties.parameters, but their "#/$defs/X" references
    # (pydantic's schemas use them) point at the document's root: the definitions move there (vLLM's rule), a name
    # two tools define differently refused.
    defs: dict[str, dict] = {}
    calls = []
    for t in tools:
        params = _params(t)
        for key in ("$defs", "definitions"):
            for name, d in (params.pop(key, None) or {}).items():
                have = defs.setdefault(key, {})
                if name in have and have[name] != d:
                    raise _bad(f"two tools define {key}/{name} differently; \"required\" needs one meaning")
                have[name] = d
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                       "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, **defs}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputs(json=schema)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text (OpenAI's function.arguments)
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"  # (vLLM's form of OpenAI's "call_...")

    def to_openai(self, index: Optional[int] = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def _args_text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v if v is not None else {}, ensure_ascii=False)


def forced_calls(text: str, choice: Union[str, dict]) -> Optional[list[ToolCall]]:
    """The calls of an answer held to forced_constraint; None where the text is not that (max_tokens cut it)."""
    if isinstance(choice, dict):
        try:
            json.loads(text)
        except ValueError:
            return None
        return [ToolCall(choice["function"]["name"], text)]
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    return [ToolCall(c["name"], _args_text(c.get("parameters"))) for c in items
            if isinstance(c, dict) and isinstance(c.get("name"), str)]


def _json_objects(text: str) -> Optional[list[Any]]:
    """The JSON values of `text` one after another (separated by whitespace or ';'); None if any part is not JSON."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(v)


class ToolParser:
    """Reads a model's tool calls from its answer (parse) and says how much of a growing answer is plain content
    (content_until: a streamed answer shows its content and holds back what may be a call)."""

    name = ""

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """(content, calls): no calls -> the whole text is the content."""
        raise NotImplementedError

    def content_until(self, text: str, final: bool) -> int:
        raise NotImplementedError


class HermesParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks; the text before the first is the content."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        at = text.find(self.OPEN)
        if at < 0:
            return text, []
        calls, dec, i = [], json.JSONDecoder(), at
        while i >= 0:
            # the JSON right after the tag, read as JSON (a "</tool_call>" inside a string is not the block's end)
            j = i + len(self.OPEN)
            while j < len(text) and text[j].isspace():
                j += 1
            try:
                v, _ = dec.raw_decode(text, j)
            except ValueError:
                v = None  # (a block cut by max_tokens, or not JSON: not a call)
            if isinstance(v, dict) and isinstance(v.get("name"), str):
                calls.append(ToolCall(v["name"], _args_text(v.get("arguments", v.get("parameters")))))
            i = text.find(self.OPEN, j)
        if not calls:
            return text, []
        content = text[:at]  # (as streamed: the text before the first call)
        return content if content.strip() else None, calls

    def content_until(self, text: str, final: bool) -> int:
        at = text.find(self.OPEN)
        if at >= 0:
            return at
        if final:
            return len(text)
        for k in range(min(len(self.OPEN) - 1, len(text)), 0, -1):  # a tail that may grow into the tag
            if self.OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonParser(ToolParser):
    """An answer that is a call, {"name": ..., "parameters": {...}} (or "arguments"), or several joined by ';',
    after an optional <|python_tag|>: Llama 3.1-3.3's JSON tool calls. Anything else is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def _body(self, text: str) -> str:
        s = text.lstrip()
        return s[len(self.TAG):] if s.startswith(self.TAG) else s

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        body = self._body(text)
        if not body.startswith("{"):
            return text, []
        values = _json_objects(body)
        if not values or not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in values):
            return text, []
        return None, [ToolCall(v["name"], _args_text(v.get("parameters", v.get("arguments")))) for v in values]

    def content_until(self, text: str, final: bool) -> int:
        s = text.lstrip()
        if not s:
            return 0 if not final else len(text)
        if s.startswith("{") or s.startswith(self.TAG) or self.TAG.startswith(s):
            return len(text) if final and not self.parse(text)[1] else 0
        return len(text)


def parser(name: str) -> ToolParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise InvalidRequestError(f"unknown tool-call parser {name!r} (known: {', '.join(PARSERS)})")


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """OpenAI's assistant tool_calls as chat templates read them (vLLM's rule): each function's arguments as an
    object rather than its JSON text, and no content as "" (templates concatenate it)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, Mapping) else None
        if calls:
            fixed = []
            for c in calls:
                f = c.get("function") if isinstance(c, Mapping) else None
                if isinstance(f, Mapping) and isinstance(f.get("arguments"), str):
                    try:
                        c = {**c, "function": {**f, "arguments": json.loads(f["arguments"])}}
                    except ValueError:
                        pass  # (left as text: the template shows what the client sent)
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
            if m.get("content") is None:
                m["content"] = ""
        out.append(m)
    return out


def with_tools(messages: Sequence[dict], tools: Optional[list[dict]]) -> tuple[list[dict], dict]:
    """The messages (earlier tool-call turns as templates read them, with or without tools now) and extra template
    variables of a chat rendered with `tools` (None: none)."""
    return template_messages(messages), ({} if tools is None else {"tools": check_tools(tools)})


class ToolAnswer:
    """One chat answer under tools (tool_choice other than "none"): how much of its growing text is content (a
    stream shows that and holds back what may be a call) and, at its end, its calls and finish_reason."""

    def __init__(self, choice: Union[str, dict], tool_parser: Optional[ToolParser], parallel: bool = True):
        if choice == "auto" and tool_parser is None:
            raise InvalidRequestError("tool_choice \"auto\" needs a tool-call parser")
        self.choice, self.parser, self.parallel = choice, tool_parser, parallel
        self.text = ""
        self.emitted = 0  # characters of text shown as content so far

    def add(self, piece: str, final: bool = False) -> str:
        """The answer's next piece of text in; the content that may be shown now out."""
        self.text += piece
        until = self.parser.content_until(self.text, final) if self.choice == "auto" else 0
        out = self.text[self.emitted:until] if until > self.emitted else ""
        self.emitted = max(self.emitted, until)
        return out

    def end(self, finish_reason: str) -> tuple[Optional[str], list[ToolCall], str, str]:
        """(the whole answer's content, its calls, its finish_reason, the content not shown yet): "tool_calls"
        where calls end an answer that stopped by itself (a named tool_choice stays "stop", as OpenAI's); an
        answer without calls is all content."""
        if self.choice == "auto":
            content, calls = self.parser.parse(self.text)
        else:
            calls = forced_calls(self.text, self.choice) or []
            content = None if calls else self.text
        if not calls:
            return self.text, [], finish_reason, self.text[self.emitted:]
        if not self.parallel:  # (parallel_tool_calls false: the first call only, as vLLM's)
            calls = calls[:1]
        named = isinstance(self.choice, dict)
        return content, calls, "tool_calls" if finish_reason == "stop" and not named else finish_reason, ""
