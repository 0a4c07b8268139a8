"""Structured outputs (vLLM's StructuredOutputsParams, OpenAI's response_format): the reference sampler's
allowed-token mask and its checks, StructuredOutputs' checks, the grammar state (llguidance's mask, read from the
tokenizer's JSON or, for a tokenizer it cannot read, from each token's bytes), and the engines' answers — held to
the regex, choice, grammar or JSON schema, ended once the grammar is complete, the same alone and in a batch — on
the CPU and (marked gpu) the GPU."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from conftest import make_chat_llama
from tinyinfer import Engine, InvalidRequestError, SamplingParams, _core
from tinyinfer.sampling import CoreSampling
from tinyinfer.structured import GrammarCompiler, StructuredOutputs

sample_row = _core.ops.sample_row


def mask_of(ids, vocab: int) -> np.ndarray:
    m = np.zeros((vocab + 31) // 32, np.uint32)
    for t in ids:
        m[t >> 5] |= np.uint32(1 << (t & 31))
    return m


def cfg(**kw) -> _core.SamplingConfig:
    s = _core.SamplingConfig()
    for k, v in kw.items():
        setattr(s, k, v)
    return s


# ---- the reference sampler's mask ----

def test_the_mask_holds_greedy_and_sampled_choices_to_the_allowed_tokens():
    logits = np.arange(70, dtype=np.float32)  # greedy: 69
    assert sample_row(logits, cfg(allowed=mask_of([3, 40], 70)), 0, [], [], 0)[0] == 40
    assert sample_row(logits, cfg(allowed=mask_of([3], 70)), 0, [], [], 0)[0] == 3
    # the mask first, then the bias: a lifted token outside the mask stays out
    s = cfg(allowed=mask_of([3, 40], 70), bias_ids=[5], bias_values=[100.0])
    assert sample_row(logits, s, 0, [], [], 0)[0] == 40
    flat = np.zeros(70, np.float32)
    toks = [sample_row(flat, cfg(allowed=mask_of([1, 33, 69], 70), temperature=1.0, seed=2, top_k=50), step,
                       [], [], 0)[0] for step in range(600)]
    counts = np.bincount(toks, minlength=70)
    assert counts.sum() == counts[[1, 33, 69]].sum() and (np.abs(counts[[1, 33, 69]] - 200) < 4.5 * 12).all()
    tok, lp, top_ids, _ = sample_row(logits, cfg(allowed=mask_of([3], 70)), 0, [], [], 2)
    assert list(top_ids) == [69, 68] and lp == pytest.approx(3 - 69 - math.log(np.exp(logits - 69).sum()), 1e-5)


def test_mask_checks():
    for m, match in [(np.ones(2, np.uint32), "mask has 2 words; a vocab of 70 needs 3"),
                     (np.zeros(3, np.uint32), "allows no token"),
                     (np.array([0, 0, 0xFFFFFFC0], np.uint32), "allows no token")]:  # (bits past the vocabulary)
        with pytest.raises(InvalidRequestError, match=match):
            cfg(allowed=m).validate(70)
        with pytest.raises(InvalidRequestError, match=match):
            sample_row(np.zeros(70, np.float32), cfg(allowed=m), 0, [], [], 0)
    cfg(allowed=np.array([0, 0, 0x20], np.uint32)).validate(70)  # token 69
    c = cfg(allowed=mask_of([7], 70))
    assert c.allowed.dtype == np.uint32 and c.allowed.tolist() == [128, 0, 0]
    c.allowed = np.zeros(0, np.uint32)  # empty: every token
    c.validate(70)


# ---- StructuredOutputs ----

@pytest.mark.parametrize("kw,match", [
    ({}, "exactly one of .* \\(got none\\)"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json_object": False}, "got none"),
    ({"json": "{not json"}, "json: the schema is not valid JSON"),
    ({"json": 3}, "json must be a JSON schema"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"grammar": 5}, "grammar must be a non-empty string"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": "yes"}, "choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "choice must be a non-empty list"),
    ({"choice": ["a"], "disable_any_whitespace": "yes"}, "disable_any_whitespace must be true or false"),
])
def test_bad_constraints_are_refused(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        StructuredOutputs(**kw)


def test_vllms_json_options():
    from tinyinfer.structured import _closed

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"properties": {"type": "string"}}},  # (a property named so)
        "b": {"anyOf": [{"type": "object"}, {"type": "array", "items": {"properties": {}}}]},
        "c": {"type": "object", "additionalProperties": True}}, "$defs": {"d": {"type": "object"}}}
    closed = _closed(schema)
    assert closed["additionalProperties"] is False
    a = closed["properties"]["a"]
    assert a["additionalProperties"] is False and a["properties"] == {"properties": {"type": "string"}}
    assert closed["properties"]["b"]["anyOf"][0]["additionalProperties"] is False
    assert closed["properties"]["b"]["anyOf"][1]["items"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True and closed["$defs"]["d"][
        "additionalProperties"] is False
    assert "additionalProperties" not in schema  # (the caller's schema unchanged)
    StructuredOutputs(json={"type": "object"}, whitespace_pattern=" ?", disable_fallback=True)
    with pytest.raises(InvalidRequestError, match="whitespace_pattern must be a non-empty string"):
        StructuredOutputs(json={}, whitespace_pattern="")
    with pytest.raises(InvalidRequestError, match="structural_tag is not supported"):
        StructuredOutputs.from_value({"structural_tag": "{}"})


def test_sampling_params_take_a_mapping_and_refuse_unknown_fields():
    sp = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert sp.structured_outputs == StructuredOutputs(regex="[0-9]+")
    with pytest.raises(InvalidRequestError, match="unknown field\\(s\\) guided_json"):
        SamplingParams(structured_outputs={"guided_json": {}})
    with pytest.raises(InvalidRequestError, match="a StructuredOutputs or a mapping"):
        SamplingParams(structured_outputs="json")


# ---- the grammar state ----

@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    return make_chat_llama(tmp_path_factory.mktemp("structured") / "m", init_std=0.3)


def _char_compiler(char_dir):
    from tinyinfer.tokenizer import Tokenizer

    return GrammarCompiler(Tokenizer.from_file(char_dir / "tokenizer.json"), 300, [2])


def allowed_ids(mask: np.ndarray) -> list[int]:
    return np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0].tolist()


def test_grammar_state_on_a_tokenizer_read_from_its_tokens_bytes(char_dir):
    """The character tokenizer (a word-level model llguidance does not read from JSON): ids 4..97 are the
    printable characters from the space; the mask follows the regex character by character, EOS once it may end,
    and the state is finished when nothing more may follow."""
    g = _char_compiler(char_dir).start(StructuredOutputs(regex="[0-9]{2}(x|yz)"))
    digits = [ord(c) - 32 + 3 for c in "0123456789"]
    assert allowed_ids(g.mask()) == digits
    g.advance([digits[4]])
    g.advance([digits[4], digits[7]])  # (consumes only what is new)
    assert allowed_ids(g.mask()) == [ord("x") - 29, ord("y") - 29] and not g.finished
    g.advance([digits[4], digits[7], ord("y") - 29, ord("z") - 29])
    assert g.finished


def test_a_constraint_that_does_not_compile_names_what_is_wrong(char_dir):
    c = _char_compiler(char_dir)
    with pytest.raises(InvalidRequestError, match="(?s)invalid structured_outputs: regex: .*unclosed"):
        c.start(StructuredOutputs(regex="(["))
    with pytest.raises(InvalidRequestError, match="(?s)invalid structured_outputs: json: .*foo"):
        c.start(StructuredOutputs(json={"type": "foo"}))
    with pytest.raises(InvalidRequestError, match="invalid structured_outputs: grammar"):
        c.start(StructuredOutputs(grammar="root ::= ("))
    c.start(StructuredOutputs(grammar='root ::= "a" | "b"'))  # still usable


def test_compiled_constraints_are_kept_and_each_request_gets_its_own_state(char_dir):
    c = _char_compiler(char_dir)
    so = StructuredOutputs(regex="[0-9]{2}")
    assert c.compile(so) is c.compile(StructuredOutputs(regex="[0-9]{2}"))
    one, two = c.start(so), c.start(so)
    one.advance([19, 20])
    assert one.finished and not two.finished and len(allowed_ids(two.mask())) == 10


def test_the_grammar_wins_over_bans_that_would_leave_nothing(char_dir):
    """min_tokens bans EOS; a choice whose only continuation is EOS would leave no token: the bans are dropped for
    that step (the answer ends once the grammar is complete anyway)."""
    c = _char_compiler(char_dir)
    a = ord("a") - 29
    sp = SamplingParams(min_tokens=5, bad_words=["b"], structured_outputs={"choice": ["a", "ab"]})
    cs = CoreSampling(sp, 0, [2], 300, [[ord("b") - 29]], c.start(sp.structured_outputs))
    assert cs.same_for(0) == 1
    first = cs.at([])
    assert allowed_ids(first.allowed) == [a] and 2 in first.bias_ids  # EOS banned beside the mask
    second = cs.at([a])  # "a" may end (EOS) or go on with "b", which bad_words bans, and EOS is banned: both kept
    assert set(allowed_ids(second.allowed)) == {2, ord("b") - 29} and list(second.bias_ids) == []
    assert not cs.finished([a]) and cs.finished([a, ord("b") - 29])


# ---- the engines ----

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module", params=DEVICES)
def eng(request, char_dir):
    with Engine(char_dir, device=request.param, max_seq_len=256) as e:
        yield e


def chars(out) -> str:
    """The answer's text on the character tokenizer (whose decode puts a space between tokens): id i is chr(i + 29)."""
    return "".join(chr(t + 29) for t in out.token_ids if t >= 3)


def _both(eng, prompt, sp):
    """The single-sequence path's Completion, and the same request inside a batch of two."""
    assert eng.scheduler.idle
    alone = eng.generate(prompt, sp)
    batch = eng.generate([prompt, "x"], sp)[0]
    assert batch.token_ids == alone.token_ids and batch.finish_reason == alone.finish_reason
    assert batch.text == alone.text
    return alone


@pytest.mark.parametrize("sampled", [False, True])
def test_engine_answers_match_the_regex_and_end_with_it(eng, sampled):
    kw = dict(temperature=1.0, seed=4) if sampled else {}
    out = _both(eng, "Once upon a time", SamplingParams(max_tokens=40, structured_outputs={
        "regex": "[a-z]{3,6}-[0-9]{2}"}, **kw))
    assert re.fullmatch("[a-z]{3,6}-[0-9]{2}", chars(out)), chars(out)
    assert out.finish_reason == "stop" and out.stop_reason is None


def test_engine_choice_and_grammar(eng):
    out = _both(eng, "Pick one:", SamplingParams(max_tokens=20, temperature=1.0, seed=1,
                                                 structured_outputs={"choice": ["red", "green", "blue"]}))
    assert chars(out) in ("red", "green", "blue") and out.finish_reason == "stop"
    g = 'root ::= "The answer is " [0-9] [0-9]? "."'
    out = _both(eng, "Q", SamplingParams(max_tokens=30, structured_outputs={"grammar": g}))
    assert re.fullmatch(r"The answer is [0-9][0-9]?\.", chars(out)), chars(out)
    # a grammar completed by the max_tokens-th token: "stop" on both paths
    out = _both(eng, "Q", SamplingParams(max_tokens=3, structured_outputs={"regex": "abc"}))
    assert chars(out) == "abc" and out.finish_reason == "stop"
    # max_tokens cuts a grammar that is not complete: "length", the text a prefix of a valid answer
    out = _both(eng, "Q", SamplingParams(max_tokens=5, structured_outputs={"grammar": g}))
    assert chars(out) == "The a" and out.finish_reason == "length"


def test_engine_json_schema_without_whitespace(eng):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    out = _both(eng, "{", SamplingParams(max_tokens=60, structured_outputs={"json": schema,
                                                                            "disable_any_whitespace": True}))
    assert out.finish_reason == "stop", chars(out)
    v = json.loads(chars(out))
    assert set(v) == {"n", "ok"} and 0 <= v["n"] <= 99 and isinstance(v["ok"], bool)


def test_engine_refuses_a_bad_constraint_and_stays_usable(eng):
    for sp in (SamplingParams(max_tokens=4, structured_outputs={"regex": "(["}),
               SamplingParams(max_tokens=4, structured_outputs={"json": {"type": "foo"}})):
        with pytest.raises(InvalidRequestError, match="invalid structured_outputs"):
            eng.generate("a", sp)
        with pytest.raises(InvalidRequestError, match="invalid structured_outputs"):
            eng.generate(["a", "b"], sp)
    assert len(eng.generate("a", SamplingParams(max_tokens=3, ignore_eos=True)).token_ids) == 3


def test_a_token_the_grammar_refuses_is_the_requests_error(eng):
    """A regex needing a character the tokenizer has no token for ('ü'): llguidance lets the unknown token through
    and then refuses it. The request ends with an error naming that (not an answer that breaks its constraint),
    alone and in a batch (the other request unharmed); the engine goes on."""
    sp = SamplingParams(max_tokens=5, structured_outputs={"regex": "a\u00fc"})
    with pytest.raises(InvalidRequestError, match="the grammar refused the sampled token"):
        eng.generate("x", sp)
    req = eng.scheduler.submit("x", sp)
    other = eng.scheduler.submit("y", SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match="the grammar refused the sampled token"):
        req.result()
    assert len(other.result().token_ids) == 3
    assert len(eng.generate("a", SamplingParams(max_tokens=3, ignore_eos=True)).token_ids) == 3


def test_engine_without_a_tokenizer_refuses(tmp_path):
    from conftest import make_llama

    d = make_llama(tmp_path / "m", hidden=64, heads=2, kv_heads=2, layers=1, vocab=100)
    with Engine(d, device="cpu", max_seq_len=64) as e:
        with pytest.raises(InvalidRequestError, match="need the model's tokenizer"):
            e.generate([1, 2, 3], SamplingParams(max_tokens=4, structured_outputs={"regex": "a"}))
        assert len(e.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)).token_ids) == 2


def test_real_tokenizer_json_schema(smol_engine):
    """The default model (SmolLM2-135M, a byte-level BPE llguidance reads from its JSON): a chat answer under a
    schema parses and holds to it, seeded sampling the same alone and in a batch."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    prompt = smol_engine.apply_chat_template([{"role": "user", "content": "A person as JSON, please."}])
    sp = SamplingParams(max_tokens=60, temperature=0.7, seed=3,
                        structured_outputs={"json": schema, "disable_any_whitespace": True})
    out = _both(smol_engine, prompt, sp)
    v = json.loads(out.text)
    assert isinstance(v["name"], str) and len(v["name"]) <= 10 and isinstance(v["age"], int)
    assert out.finish_reason == "stop"
