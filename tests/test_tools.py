"""Tool calling (OpenAI's tools / tool_choice, vLLM's way): the checks of tools and tool_choice, the constraints of a
named and a "required" tool_choice, the parsers of "auto" (hermes, llama3_json) and what a stream may show of an
answer that may hold a call; the chat template's tools and tool-call turns; and the server end to end (the real app
in-process over the CPU engine on a small random model with a character tokenizer, through the official openai
client): a named function's arguments held to its schema, "required", "auto" read by the hermes parser (the model's
text forced to a call by a regex), streamed and whole, and the refusals."""

from __future__ import annotations

import asyncio
import json

import pytest

from conftest import make_llama, save_char_tokenizer
from tinyinfer import Engine, InvalidRequestError, Scheduler
from tinyinfer.tools import (HermesParser, Llama3JsonParser, ToolAnswer, check_tool_choice, check_tools,
                             forced_calls, forced_constraint)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}


# ---- checks ----

@pytest.mark.parametrize("tools,match", [
    ([], "non-empty list"),
    ({"type": "function"}, "non-empty list"),
    ([{"type": "code_interpreter"}], "tools\\[0\\] must be"),
    ([{"type": "function", "function": {"name": "a b"}}], "1-64 letters"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "parameters must be a JSON schema"),
    ([{"type": "function", "function": {"name": "f", "params": {}}}], "unknown field\\(s\\) 'params'"),
])
def test_bad_tools_are_refused(tools, match):
    with pytest.raises(InvalidRequestError, match=match):
        check_tools(tools)


def test_tool_choice():
    tools = check_tools([WEATHER, TIME])
    assert check_tool_choice(None, tools) == "auto" and check_tool_choice(None, None) == "none"
    named = {"type": "function", "function": {"name": "get_time"}}
    assert check_tool_choice(named, tools) == named
    for bad, match in [("required", "needs 'tools'"), ("sometimes", "must be")]:
        with pytest.raises(InvalidRequestError, match=match):
            check_tool_choice(bad, None)
    for name in ("nope", ["get_time"], {"n": 1}):
        with pytest.raises(InvalidRequestError, match="invalid tool_choice: .*not among the tools"):
            check_tool_choice({"type": "function", "function": {"name": name}}, tools)


def test_forced_constraints_and_their_calls():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert forced_constraint([WEATHER], named).json == WEATHER["function"]["parameters"]
    assert forced_constraint([WEATHER], "auto") is None
    req = forced_constraint([WEATHER, TIME], "required", parallel=False).json
    assert req["minItems"] == 1 and req["maxItems"] == 1 and len(req["items"]["anyOf"]) == 2
    assert "maxItems" not in forced_constraint([WEATHER], "required").json
    calls = forced_calls('{"city": "Oslo"}', named)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    calls = forced_calls('[{"name": "get_time", "parameters": {"tz": "UTC"}}, {"name": "get_weather", '
                         '"parameters": {"city": "Paris"}}]', "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"}),
                                                                  ("get_weather", {"city": "Paris"})]
    assert forced_calls('{"city": "Os', named) is None and forced_calls("[{", "required") is None
    # definitions ($defs: pydantic's) move to the document's root, where the references point
    ref = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"who": {"$ref": "#/$defs/P"}}, "required": ["who"],
        "$defs": {"P": {"type": "object", "properties": {"n": {"type": "string"}}}}}}}
    req = forced_constraint([ref, TIME], "required").json
    assert req["$defs"] == {"P": {"type": "object", "properties": {"n": {"type": "string"}}}}
    assert "$defs" not in req["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in ref["function"]["parameters"]  # (the caller's tool unchanged)
    other = {"type": "function", "function": {"name": "other", "parameters": {"$defs": {"P": {"type": "string"}}}}}
    with pytest.raises(InvalidRequestError, match="define \\$defs/P differently"):
        forced_constraint([ref, other], "required")


# ---- parsers ----

def test_hermes_parser():
    p = HermesParser()
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    content, calls = p.parse(text)
    assert content == "Let me look.\n" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert len({c.id for c in calls}) == 2
    assert p.parse("no calls here") == ("no calls here", [])
    assert p.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    # read as JSON: the closing tag inside a string, an unclosed block before another
    content, calls = p.parse('<tool_call>{"name": "say", "arguments": {"text": "a </tool_call> b"}}</tool_call>')
    assert content is None and json.loads(calls[0].arguments) == {"text": "a </tool_call> b"}
    content, calls = p.parse('<tool_call>{"name": "a", "arg<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert [c.name for c in calls] == ["b"]
    # a stream shows the text up to a tag, and holds a tail that may grow into one
    assert p.content_until("Hi <tool", False) == 3 and p.content_until("Hi <tool", True) == 8
    assert p.content_until("Hi <tool_call>{", False) == 3 and p.content_until("Hi <b>", False) == 6


def test_llama3_json_parser():
    p = Llama3JsonParser()
    content, calls = p.parse('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; '
                             '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert p.parse('{"a": 1}') == ('{"a": 1}', []) and p.parse("Sure: {}") == ("Sure: {}", [])
    assert p.content_until('  {"name": "f"', False) == 0 and p.content_until("Hello", False) == 5
    assert p.content_until('{"not": "a call"}', True) == len('{"not": "a call"}')


def test_tool_answer_streams_content_and_ends_with_the_calls():
    a = ToolAnswer("auto", HermesParser())
    shown = "".join(a.add(piece) for piece in ["Checking", " now <tool", '_call>{"name": "get_time", ',
                                               '"arguments": {"tz": "UTC"}}</tool_call>'])
    assert shown == "Checking now "
    content, calls, finish, rest = a.end("stop")
    assert (content, [c.name for c in calls], finish, rest) == ("Checking now ", ["get_time"], "tool_calls", "")
    two = ToolAnswer("auto", HermesParser(), parallel=False)
    two.add('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>', final=True)
    assert [c.name for c in two.end("stop")[1]] == ["a"]  # (parallel_tool_calls false: the first only)
    plain = ToolAnswer("auto", HermesParser())
    assert plain.add("a <to") == "a " and plain.add("y", final=True) == "<toy"
    assert plain.end("length") == ("a <toy", [], "length", "")
    named = ToolAnswer({"type": "function", "function": {"name": "get_time"}}, None)
    assert named.add('{"tz": "UTC"}', final=True) == ""
    content, calls, finish, rest = named.end("stop")
    assert (content, [(c.name, c.arguments) for c in calls], finish, rest) == (
        None, [("get_time", '{"tz": "UTC"}')], "stop", "")
    cut = ToolAnswer("required", None)
    cut.add('[{"name": "get_ti')
    assert cut.end("length") == ('[{"name": "get_ti', [], "length", '[{"name": "get_ti')


# ---- the chat template ----

TOOLS_TEMPLATE = ("{% if tools %}[tools]{% for t in tools %} {{ t.function.name }}{% endfor %} {% endif %}"
                  "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% for c in m.tool_calls or [] %}"
                  "{{ c.function.name }}{{ c.function.arguments.city }}{% endfor %}{{ eos_token }}{% endfor %}"
                  "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = make_llama(tmp_path_factory.mktemp("tools") / "m", layers=1, heads=2, kv_heads=2, hidden=128, vocab=300,
                   init_std=0.3)
    save_char_tokenizer(d, chat_template=TOOLS_TEMPLATE, fused=True)
    with Engine(d, device="cpu", max_seq_len=512) as e:
        yield e


TURNS = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_the_template_gets_the_tools_and_the_tool_call_turns(eng):
    """The tools reach the template; an assistant turn of tool calls (no content) renders with its arguments as
    an object (vLLM's rule), the tool's answer as its own turn."""
    text = eng.apply_chat_template(TURNS, tokenize=False, tools=[WEATHER, TIME])
    assert text == ("[tools] get_weather get_time [user] Weather in Paris?</s>[assistant] get_weatherParis</s>"
                    "[tool] sunny</s>[assistant] ")
    assert eng.apply_chat_template(TURNS[:1], tokenize=False) == "[user] Weather in Paris?</s>[assistant] "
    # a later request without tools renders the earlier calls the same way
    assert eng.apply_chat_template(TURNS, tokenize=False).startswith("[user] Weather in Paris?</s>[assistant] "
                                                                     "get_weatherParis</s>")
    with pytest.raises(InvalidRequestError, match="tool_calls must be a list"):
        eng.apply_chat_template([TURNS[0], {**TURNS[1], "tool_calls": "junk"}])
    with pytest.raises(InvalidRequestError, match="invalid tools"):
        eng.apply_chat_template(TURNS, tools=[{"type": "function"}])


# ---- the server ----

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


def _serve(eng, calls, tool_parser="hermes"):
    """Runs `calls(client)` against the app in-process (the openai client over httpx's ASGI transport)."""
    from tinyinfer.server.app import create_app

    sched = Scheduler(eng)
    app = create_app(eng, sched, model_name="m", tool_parser=tool_parser)

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/v1") as h:
                client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=h, max_retries=0)
                return await calls(client)

    try:
        return asyncio.run(main())
    finally:
        sched.close()


MSGS = [{"role": "user", "content": "Weather?"}]


def test_named_and_required_tool_choice(eng):
    async def calls(client):
        named = await client.chat.completions.create(model="m", messages=MSGS, tools=[WEATHER, TIME], temperature=0,
                                                     tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}})
        required = await client.chat.completions.create(model="m", messages=MSGS, tools=[WEATHER, TIME],
                                                        tool_choice="required", temperature=0.8, seed=2)
        stream = await client.chat.completions.create(model="m", messages=MSGS, tools=[WEATHER, TIME],
                                                      tool_choice="required", temperature=0.8, seed=2, stream=True)
        chunks = [c async for c in stream]
        return named, required, chunks

    named, required, chunks = _serve(eng, calls)
    c = named.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    c = required.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert (call.function.name, set(args)) in (("get_weather", {"city"}), ("get_time", {"tz"}))
    # streamed (the same seed): no content, the calls in one chunk, then finish_reason "tool_calls"
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.content or "" for d in deltas) == "" and all(d.content is None for d in deltas[1:])
    got = [t for d in deltas for t in (d.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in got] == [
        (t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert [t.index for t in got] == list(range(len(got)))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_read_by_the_hermes_parser(eng):
    """The model's text forced (vLLM's structured_outputs regex) to content and then a call in hermes's format:
    the answer's content is the text before it, its call parsed; streamed, the content arrives and the call
    after it."""
    forced = {"structured_outputs": {"regex": r'Ok\. <tool_call>\{"name": "get_time", "arguments": '
                                              r'\{"tz": "(UTC|CET)"\}\}</tool_call>'}}

    async def calls(client):
        whole = await client.chat.completions.create(model="m", messages=MSGS, tools=[WEATHER, TIME], temperature=0,
                                                     max_tokens=100, extra_body=forced)
        stream = await client.chat.completions.create(model="m", messages=MSGS, tools=[WEATHER, TIME],
                                                      temperature=0, max_tokens=100, extra_body=forced, stream=True)
        plain = await client.chat.completions.create(model="m", messages=MSGS, tools=[WEATHER], temperature=0,
                                                     max_tokens=8, tool_choice="none")
        return whole, [c async for c in stream], plain

    whole, chunks, plain = _serve(eng, calls)
    c = whole.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Ok. "
    assert [(t.function.name, json.loads(t.function.arguments)["tz"] in ("UTC", "CET"))
            for t in c.message.tool_calls] == [("get_time", True)]
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.content or "" for d in deltas) == "Ok. "
    assert [t.function.name for d in deltas for t in (d.tool_calls or [])] == ["get_time"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_tool_refusals(eng):
    async def calls(client):
        errors = []
        for kw in (dict(tools=[WEATHER]),  # tools without tool_choice: "auto", which needs a parser
                   dict(tools=[WEATHER], tool_choice="auto"),
                   dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
                   dict(tools=[{"type": "function", "function": {"name": "bad name"}}], tool_choice="required"),
                   dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
                   dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
                        tool_choice="required"),  # (a tool's schema llguidance refuses)
                   dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": ["get_weather"]}})):
            try:
                await client.chat.completions.create(model="m", messages=MSGS, max_tokens=4, **kw)
                errors.append(None)
            except openai.BadRequestError as e:
                errors.append(e.response.json()["error"]["param"])
        ok = await client.chat.completions.create(model="m", messages=TURNS, max_tokens=3, temperature=0,
                                                  tools=[WEATHER], tool_choice="none")
        return errors, ok

    errors, ok = _serve(eng, calls, tool_parser=None)
    assert errors == ["tool_choice", "tool_choice", "tool_choice", "tools", "tool_choice", "tools", "tool_choice"]
    assert ok.choices[0].finish_reason == "length"  # a conversation with tool-call turns is served


def test_tokenize_takes_the_tools(eng):
    """vLLM's /tokenize with tools counts what a chat request with them submits."""
    from tinyinfer.server.app import create_app

    sched = Scheduler(eng)
    app = create_app(eng, sched, model_name="m")

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
                return await h.post("/tokenize", json={"messages": TURNS, "tools": [WEATHER]})

    try:
        r = asyncio.run(main())
    finally:
        sched.close()
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == eng.apply_chat_template(TURNS, tools=[WEATHER])


def test_special_tokens_kept_in_the_text_when_asked(eng):
    """vLLM's skip_special_tokens (false for a tool parser reading special tags): the EOS forced under ignore_eos
    shows as "</s>" in the text, on both paths; by default it shows as nothing."""
    from tinyinfer import SamplingParams

    kw = dict(max_tokens=2, ignore_eos=True, logit_bias={2: 100})
    for skip, want in ((True, ""), (False, "</s></s>")):
        sp = SamplingParams(skip_special_tokens=skip, **kw)
        assert eng.generate([5, 6, 7], sp).text == want
        assert eng.generate([[5, 6, 7], [8]], sp)[0].text == want


def test_engine_chat_with_tools(eng):
    """Engine.chat(tools=..., tool_choice=...): the Python API's calls, as the server's (named, "required" in a
    batch of two conversations, "auto" read by the hermes parser) and its refusals."""
    from tinyinfer import SamplingParams

    named = eng.chat(MSGS, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                     max_tokens=60)
    assert named.finish_reason == "stop" and named.text == "" and [c.name for c in named.tool_calls] == ["get_time"]
    assert json.loads(named.tool_calls[0].arguments)["tz"] in ("UTC", "CET")
    both = eng.chat([MSGS, TURNS], tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                    max_tokens=None, temperature=0.7, seed=1)
    for c in both:
        assert c.finish_reason == "tool_calls" and len(c.tool_calls) == 1  # (parallel_tool_calls false: one)
        assert all(t.name in ("get_weather", "get_time") for t in c.tool_calls)
    forced = {"regex": r'Hm <tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}</tool_call>'}
    auto = eng.chat(MSGS, tools=[WEATHER], tool_parser="hermes", structured_outputs=forced, max_tokens=100)
    assert (auto.text, auto.finish_reason) == ("Hm ", "tool_calls")
    assert [(c.name, json.loads(c.arguments)) for c in auto.tool_calls] == [("get_weather", {"city": "Oslo"})]
    plain = eng.chat(MSGS, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert plain.tool_calls == [] and plain.finish_reason == "length" and len(plain.token_ids) == 4
    with pytest.raises(InvalidRequestError, match="give tool_parser"):
        eng.chat(MSGS, tools=[WEATHER], max_tokens=4)
    with pytest.raises(InvalidRequestError, match="both constrain the answer"):
        eng.chat(MSGS, tools=[WEATHER], tool_choice="required", params=SamplingParams(structured_outputs={
            "regex": "a"}))
    with pytest.raises(InvalidRequestError, match="unknown tool-call parser"):
        eng.chat(MSGS, tools=[WEATHER], tool_parser="nope")
    assert eng.chat(MSGS, max_tokens=2).tool_calls == []
