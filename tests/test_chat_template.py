"""Chat templates: rendered exactly as transformers' apply_chat_template does, in a Jinja sandbox.

The reference is transformers itself: apply_chat_template on the tokenizer it builds from the real GGUF, and
render_jinja_template (the function apply_chat_template calls) for templates written here that use every global,
filter and extension transformers provides.
"""

from __future__ import annotations

import datetime
import json

import pytest

from tinyinfer.chat import render_chat
from tinyinfer.errors import ChatTemplateError, InvalidRequestError, TinyInferError

SINGLE = [{"role": "user", "content": "What is 12345 + 67890?"}]
MULTI = [
    {"role": "system", "content": "You are a pirate. Answer in one sentence."},
    {"role": "user", "content": "Hello! Who are you?"},
    {"role": "assistant", "content": "Arr, I be Captain SmolBeard, terror o' the seven seas!"},
    {"role": "user", "content": "Tell me about the café on the hill — and bring 3 friends. 日本語もOK?"},
]
NO_SYSTEM_MULTI = MULTI[1:]


# ---- the real model's template ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,messages", [("single", SINGLE), ("multi_with_system", MULTI),
                                           ("multi_default_system", NO_SYSTEM_MULTI)])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_template_matches_transformers(name, messages, add_generation_prompt, smollm_tokenizer,
                                              hf_smollm_tokenizer):
    text = smollm_tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
    ref_text = hf_smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                       tokenize=False)
    assert text == ref_text
    ids = smollm_tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    ref_ids = hf_smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True, return_dict=False)
    assert ids == list(ref_ids)
    assert ids[0] == 1 and ids.count(1) == len(messages) + (1 if messages[0]["role"] != "system" else 0) + (
        1 if add_generation_prompt else 0)  # one <|im_start|> per turn, never split
    if add_generation_prompt:
        assert text.endswith("<|im_start|>assistant\n")
    if messages[0]["role"] != "system":  # the template adds its default system prompt
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_render_chat_function_matches_tokenizer_method(smollm_tokenizer):
    direct = render_chat(smollm_tokenizer.chat_template, MULTI, bos_token=smollm_tokenizer.bos_token,
                         eos_token=smollm_tokenizer.eos_token)
    assert direct == smollm_tokenizer.render_chat(MULTI)


# ---- templates using everything transformers' environment offers --------------------------------------------------

FEATURE_TEMPLATES = {
    "tojson": "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ {'b': 1, 'a': '<&>'} | tojson(sort_keys=True) }}",
    "namespace": "{% set ns = namespace(system=false, n=0) %}{% for m in messages %}{% if m.role == 'system' %}"
                 "{% set ns.system = true %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.system }} {{ ns.n }}",
    "loopcontrols": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                    "{% if loop.index > 3 %}{% break %}{% endif %}[{{ loop.index }}:{{ m.content }}]{% endfor %}",
    "trim_lstrip": "{% for m in messages %}\n    {% if m.role == 'user' %}\n        <u>{{ m.content }}</u>\n"
                   "    {% else %}\n        <o>{{ m.content }}</o>\n    {% endif %}\n{% endfor %}\n"
                   "{% if add_generation_prompt %}\n    <a>\n{% endif %}",
    "dict_global": "{% set d = dict(a=1, b='x') %}{{ d.a }}{{ d['b'] }}{{ dict.fromkeys(['k'], 0) | tojson }}",
    "special_tokens_and_kwargs": "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}{{ eos_token }}"
                                 "{% endfor %}{{ unk_token }}|{{ enable_thinking }}|{{ tools }}|{{ documents }}",
    "generation_tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                      "{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}",
    "reasoning_alias": "{% for m in messages %}{{ m.role }}:{{ m.thinking }}/{{ m.reasoning_content }}/"
                       "{{ m.content }}\n{% endfor %}",
    "string_methods": "{% for m in messages %}{{ m.content.strip().upper()[:10] }}|{{ m.content.split(' ') | length }}"
                      "|{{ m.role.startswith('u') }}\n{% endfor %}",
    "whitespace_control": "{%- for m in messages -%}\n  {{- m.role -}}\n  :  {{ m.content }}\n{%- endfor -%}",
}

FEATURE_MESSAGES = MULTI + [{"role": "assistant", "content": "  Done.  ", "reasoning_content": "think first"}]


def _transformers_aliases_reasoning(render_jinja_template) -> bool:
    rendered, _ = render_jinja_template(conversations=[[{"role": "assistant", "content": "", "reasoning_content": "r"}]],
                                        chat_template="{{ messages[0].thinking }}")
    return rendered[0] == "r"


@pytest.mark.parametrize("name", sorted(FEATURE_TEMPLATES))
def test_template_features_match_transformers(name):
    from transformers.utils.chat_template_utils import render_jinja_template

    template = FEATURE_TEMPLATES[name]
    extra = {"unk_token": "<unk>", "enable_thinking": False}
    ours = render_chat(template, FEATURE_MESSAGES, bos_token="<s>", eos_token="</s>", **extra)
    rendered, _ = render_jinja_template(conversations=[FEATURE_MESSAGES], chat_template=template,
                                        add_generation_prompt=True, bos_token="<s>", eos_token="</s>", **extra)
    if not _transformers_aliases_reasoning(render_jinja_template):
        # A transformers from before it gave a message's reasoning under both names (ours follows the newer
        # ones): the rendering itself is still compared, on the messages as ours and the newer ones alias them.
        aliased = [{"thinking": m["reasoning_content"], **m} if "reasoning_content" in m else m
                   for m in FEATURE_MESSAGES]
        rendered, _ = render_jinja_template(conversations=[aliased], chat_template=template,
                                            add_generation_prompt=True, bos_token="<s>", eos_token="</s>", **extra)
    assert ours == rendered[0]
    assert ours  # every template renders something


def test_tojson_is_not_html_escaped():
    out = render_chat("{{ messages[0].content | tojson }}", [{"role": "user", "content": "<b>&'é\""}],
                      bos_token=None, eos_token=None)
    assert out == json.dumps("<b>&'é\"", ensure_ascii=False)


def test_strftime_now():
    out = render_chat("{{ strftime_now('%Y') }}", SINGLE, bos_token=None, eos_token=None)
    assert out in {str(datetime.datetime.now().year), str(datetime.datetime.now().year - 1)}


def test_messages_are_not_modified():
    msgs = [{"role": "user", "content": "hi", "reasoning": "r"}]
    render_chat("{% for m in messages %}{{ m.thinking }}{% endfor %}", msgs, bos_token=None, eos_token=None)
    assert msgs == [{"role": "user", "content": "hi", "reasoning": "r"}]


# ---- untrusted templates --------------------------------------------------------------------------------------------

ESCAPES = {
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals_via_cycler": "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "globals_via_self": "{{ self.__init__.__globals__['__builtins__']['open']('MARKER', 'w') }}",
    "raise_exception_globals": "{{ raise_exception.__globals__['os'].system('touch MARKER') }}",
    "namespace_dunder": "{% set ns = namespace() %}{% set ns.__class__ = 1 %}{{ ns }}",
    "namespace_underscore_kw": "{{ namespace(_x=1) }}",
    "mutate_messages": "{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}",
    "mutate_dict": "{% set _ = messages[0].update({'role': 'x'}) %}{{ messages[0].role }}",
    "format_attr": "{{ '{0.__class__.__init__.__globals__}'.format(messages) }}",
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_sandbox_escape_is_refused(name, tmp_path, monkeypatch):
    from jinja2.exceptions import SecurityError

    monkeypatch.chdir(tmp_path)
    template = ESCAPES[name]
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError) as info:
        render_chat(template, msgs, bos_token="<s>", eos_token="</s>")
    assert isinstance(info.value, TinyInferError)
    cause = info.value.__cause__
    # the sandbox refused (SecurityError), or the unsafe attribute came back undefined and using it failed
    assert cause is not None and (isinstance(cause, SecurityError) or "unsafe" in str(cause) or
                                  "undefined" in str(cause).lower()), repr(cause)
    assert not (tmp_path / "MARKER").exists()
    assert msgs == [{"role": "user", "content": "hi"}]


def test_subclasses_escape_is_a_security_error():
    from jinja2.exceptions import SecurityError

    with pytest.raises(ChatTemplateError, match="sandbox") as info:
        render_chat("{{ ''.__class__.__mro__[1].__subclasses__() }}", SINGLE, bos_token=None, eos_token=None)
    assert isinstance(info.value.__cause__, SecurityError)


@pytest.mark.parametrize("template", [
    "[{{ ''.__class__ }}]",
    "[{{ '{x.__class__}'.format_map({'x': messages}) }}]",
    "[{{ messages.__class__ }}]",
])
def test_unsafe_attribute_alone_renders_nothing(template):
    # reading an unsafe attribute without using it yields an empty undefined (as in transformers): nothing leaks
    assert render_chat(template, SINGLE, bos_token=None, eos_token=None) == "[]"


@pytest.mark.parametrize("template,needle", [
    ("{% for m in messages %}{{ m.content }}", "syntax error"),
    ("{{ messages[0].content ", "syntax error"),
    ("{% if %}{% endif %}", "syntax error"),
    ("{% frobnicate %}", "syntax error"),
])
def test_template_syntax_error(template, needle):
    with pytest.raises(ChatTemplateError, match=needle):
        render_chat(template, SINGLE, bos_token=None, eos_token=None)


def test_raise_exception_in_template():
    template = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                "{{ raise_exception('Conversation roles must be user/assistant, got ' + m.role) }}"
                "{% endif %}{{ m.content }}{% endfor %}")
    assert render_chat(template, SINGLE, bos_token=None, eos_token=None) == SINGLE[0]["content"]
    with pytest.raises(ChatTemplateError, match="Conversation roles must be user/assistant, got system"):
        render_chat(template, MULTI, bos_token=None, eos_token=None)


def test_runtime_errors_in_template():
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages[0].content.nope.deeper }}", SINGLE, bos_token=None, eos_token=None)
    with pytest.raises(ChatTemplateError):
        render_chat("{{ 1 // 0 }}", SINGLE, bos_token=None, eos_token=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat("", SINGLE, bos_token=None, eos_token=None)


def _deep(depth: int) -> list:
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


@pytest.mark.parametrize("messages,needle", [
    ("hello", "must be a list"),
    ([], "empty"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
    ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], r"messages\[1\]\['content'\] must be a str"),
    ([{"role": None, "content": "hi"}], r"messages\[0\]\['role'\] must be a str"),
    ([{"role": "user", "content": "hi", "extra": _deep(5000)}], "nested too deeply"),  # (past the recursion limit)
])
def test_invalid_messages(messages, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        render_chat("{{ messages }}", messages, bos_token=None, eos_token=None)


def test_tokenizer_without_template(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    from tinyinfer.tokenizer import Tokenizer

    tok = Tokenizer(HFTokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.render_chat(SINGLE)
    assert tok.render_chat(SINGLE, chat_template="{{ messages[0].content }}") == SINGLE[0]["content"]


def test_hf_dir_chat_template_from_tokenizer_config(tmp_path):
    """An HF directory's chat template (tokenizer_config.json) renders and tokenizes as transformers does."""
    import json

    from conftest import make_llama, save_char_tokenizer
    from tinyinfer import Engine

    d = make_llama(tmp_path / "m", layers=1, heads=2, kv_heads=2, hidden=128, vocab=300)
    fast = save_char_tokenizer(d)
    assert "chat_template" in json.loads((d / "tokenizer_config.json").read_text()) or (d / "chat_template.jinja").exists()
    eng = Engine(d, device="cpu")
    assert eng.tokenizer.chat_template  # from tokenizer_config.json or chat_template.jinja
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    want = fast.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if hasattr(want, "keys"):  # transformers 5 returns a BatchEncoding
        want = want["input_ids"]
    assert eng.apply_chat_template(msgs) == list(want)
