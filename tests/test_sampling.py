"""Sampling (SamplingParams -> the core's reference sampler) and the text side (UTF-8-safe pieces, stop strings)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_llama
from tinyinfer import Engine, InvalidRequestError, SamplingParams, _core
from tinyinfer.sampling import TextAssembler


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = make_llama(tmp_path_factory.mktemp("samp"), layers=1, heads=2, kv_heads=2, hidden=128, vocab=256,
                   init_std=0.3)
    return Engine(d, device="cpu", max_seq_len=256)


PROMPT = [3, 14, 15, 92, 65]


def test_seed_reproduces(eng):
    kw = dict(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    a = eng.generate(PROMPT, **kw).token_ids
    b = eng.generate(PROMPT, **kw).token_ids
    c = eng.generate(PROMPT, **{**kw, "seed": 99}).token_ids
    assert a == b
    assert a != c  # 24 draws at temperature 1 over 256 tokens: equal streams would mean the seed is ignored


def test_top_k_1_is_greedy(eng):
    greedy = eng.generate(PROMPT, max_tokens=16, ignore_eos=True).token_ids
    topk1 = eng.generate(PROMPT, max_tokens=16, temperature=1.5, top_k=1, seed=7, ignore_eos=True).token_ids
    assert topk1 == greedy


def test_tiny_min_p_and_top_p_are_greedy(eng):
    greedy = eng.generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids
    assert eng.generate(PROMPT, max_tokens=8, temperature=1.0, min_p=1.0, seed=1, ignore_eos=True).token_ids == greedy
    assert eng.generate(PROMPT, max_tokens=8, temperature=1.0, top_p=1e-6, seed=1, ignore_eos=True).token_ids == greedy


def test_sampled_tokens_follow_the_distribution(eng):
    """At temperature 1 the first sampled token's frequencies over many seeds follow softmax(logits)."""
    logits = eng.logits(PROMPT)[-1].astype(np.float64)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    n = 600
    counts = np.zeros_like(p)
    for seed in range(n):
        counts[eng.generate(PROMPT, max_tokens=1, temperature=1.0, seed=seed, ignore_eos=True).token_ids[0]] += 1
    top = np.argsort(-p)[:5]
    for t in top:  # binomial: 4.5 sigma bound on each of the most likely tokens
        sigma = np.sqrt(n * p[t] * (1 - p[t]))
        assert abs(counts[t] - n * p[t]) <= 4.5 * sigma + 1, (t, counts[t], n * p[t])


def test_repetition_penalty_changes_greedy_choice(eng):
    base = eng.generate(PROMPT, max_tokens=12, ignore_eos=True).token_ids
    pen = eng.generate(PROMPT, max_tokens=12, repetition_penalty=50.0, ignore_eos=True).token_ids
    seen = set(PROMPT)
    for t in pen:  # a huge penalty: no token of the sequence so far is chosen again
        assert t not in seen
        seen.add(t)
    assert base != pen or len(set(base) | set(PROMPT)) == len(base) + len(PROMPT)


def test_stop_token_ids_end_generation(eng):
    free = eng.generate(PROMPT, max_tokens=10, ignore_eos=True).token_ids
    stop = free[3]
    out = eng.generate(PROMPT, max_tokens=10, stop_token_ids=[stop], ignore_eos=True)
    assert out.finish_reason == "stop" and out.stop_reason == stop  # (vLLM's: the id that ended it)
    assert out.token_ids == free[: free.index(stop) + 1]
    assert eng.generate(PROMPT, max_tokens=3, ignore_eos=True).stop_reason is None  # (length)


def test_eos_ends_generation_unless_ignored(eng):
    free = eng.generate(PROMPT, max_tokens=10, ignore_eos=True).token_ids
    eos = free[2]
    eng.config.eos_token_ids = [eos]  # the config object is the engine's: patch it for this test
    try:
        out = eng.generate(PROMPT, max_tokens=10)
        assert out.finish_reason == "stop" and out.token_ids == free[: free.index(eos) + 1]
        assert out.stop_reason is None  # the model's EOS, as vLLM: even when it is a stop id too
        assert eng.generate(PROMPT, max_tokens=10, stop_token_ids=[eos]).stop_reason is None
        assert eng.generate(PROMPT, max_tokens=10, stop_token_ids=[eos], ignore_eos=True).stop_reason == eos
        assert eng.generate(PROMPT, max_tokens=10, ignore_eos=True).token_ids == free
    finally:
        eng.config.eos_token_ids = [2]


def test_sampling_params_object_and_kwargs(eng):
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)
    a = eng.generate(PROMPT, sp).token_ids
    b = eng.generate(PROMPT, max_tokens=6, temperature=0.8, seed=5, ignore_eos=True).token_ids
    assert a == b and len(a) == 6
    assert eng.generate(PROMPT, sp, max_tokens=3).token_ids == a[:3]  # keyword overrides the object


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=-0.1), dict(top_p=1.5), dict(top_k=2.5), dict(min_p=-0.1), dict(seed=-1),
     dict(max_tokens=-3), dict(stop=[""]), dict(stop_token_ids=["a"]), dict(repetition_penalty=-1.0),
     dict(top_k=2**63), dict(seed=2**64), dict(stop=5), dict(stop={"a": 1}),
     dict(stop_token_ids=5), dict(stop_token_ids=[True]),
     # finite in Python, but infinite or 0 as the core's float32
     dict(temperature=1e39), dict(temperature=10**400), dict(repetition_penalty=1e300),
     dict(repetition_penalty=1e-50), dict(top_p=1e-50), dict(stop=["ok", "x" * 1025])],
)
def test_invalid_sampling_params(kw):
    with pytest.raises(InvalidRequestError, match=next(iter(kw))):  # the message names the field
        SamplingParams(**kw)


def test_none_means_no_stops():
    """stop=None / stop_token_ids=None (OpenAI-style code passes them, and the server reads "stop": null so) are
    no stops, not an error; a single string is a list of one."""
    p = SamplingParams(stop=None, stop_token_ids=None)
    assert list(p.stop) == [] and list(p.stop_token_ids) == []
    assert list(SamplingParams(stop="END").stop) == ["END"]


def test_integer_bounds_are_the_cores():
    """The largest top_k and seed SamplingParams accepts still fit the core's int64 / uint64 fields."""
    s = SamplingParams(top_k=2**63 - 1, seed=2**64 - 1).to_core(0)
    assert (s.top_k, s.seed) == (2**63 - 1, 2**64 - 1)


def test_core_sampler_validates_too():
    s = _core.SamplingConfig()
    s.top_p = 0.0
    with pytest.raises(InvalidRequestError, match="top_p"):
        s.validate()


def test_counter_rng_is_uniform():
    u = np.array([_core.ops.uniform_from_counter(42, i) for i in range(20000)])
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.01
    hist, _ = np.histogram(u, bins=10, range=(0, 1))
    assert hist.min() > 1800 and hist.max() < 2200


# ---- the text side, with a byte-level fake tokenizer: id i is byte i ----

def _decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def _pieces(text: str, stop=(), step=1):
    data = list(text.encode("utf-8"))
    asm = TextAssembler(_decode, stop)
    out = []
    for i in range(0, len(data), step):
        out.append(asm.add(data[i : i + step]))
        if asm.stopped:
            break
    if not asm.stopped:
        out.append(asm.add([], final=True))
    return out, asm


@pytest.mark.parametrize("step", [1, 2, 3])
def test_stream_never_splits_a_character(step):
    text = "héllo wörld — 日本語 🙂🚀 end"
    pieces, asm = _pieces(text, step=step)
    assert "".join(pieces) == text == asm.text
    assert all("\ufffd" not in p for p in pieces)


def test_answer_cut_inside_a_character_ends_before_it():
    """max_tokens can end a stream after the first bytes of a character: its U+FFFD is not part of the answer."""
    data = list("ok 日".encode("utf-8"))[:-1]
    asm = TextAssembler(_decode, [])
    pieces = [asm.add([b]) for b in data] + [asm.add([], final=True)]
    assert "".join(pieces) == asm.text == "ok "


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_string_excluded_and_never_half_emitted(step):
    pieces, asm = _pieces("The answer is 42.\nUser: more", stop=["\nUser:"], step=step)
    assert asm.stopped
    assert "".join(pieces) == asm.text == "The answer is 42."
    for p in pieces:
        assert "\n" not in p  # no piece of the stop string ever went out


def test_stop_prefix_that_does_not_complete_is_released():
    pieces, asm = _pieces("a\nUsb b", stop=["\nUser:"])
    assert not asm.stopped and "".join(pieces) == "a\nUsb b"


def test_earliest_of_several_stop_strings_wins():
    _, asm = _pieces("one two three", stop=["three", "two"], step=4)
    assert asm.stopped and asm.text == "one " and asm.stop_string == "two"
    _, asm = _pieces("one two three", stop=["tw", "two"], step=8)  # found at one place: the first listed
    assert asm.stop_string == "tw"


def test_held_tail_is_the_longest_that_could_become_a_stop_string():
    """The assembler compares only the tails that start like a stop string; it holds back exactly what trying
    every tail length would."""
    def every_tail(full, stops):
        for n in range(min(max(map(len, stops)) - 1, len(full)), 0, -1):
            if any(s.startswith(full[-n:]) for s in stops):
                return len(full) - n
        return len(full)

    rng = np.random.default_rng(0)
    for _ in range(2000):
        stops = ["".join(rng.choice(list("ab\n"), rng.integers(1, 7))) for _ in range(rng.integers(1, 4))]
        full = "".join(rng.choice(list("ab\n"), rng.integers(0, 12)))
        if any(s in full for s in stops):  # add() has cut the text at the stop string by then
            continue
        assert TextAssembler(_decode, stops)._held_from(full) == every_tail(full, stops), (full, stops)


def test_stream_without_tokenizer_still_sets_last_completion(eng):
    assert list(eng.stream(PROMPT, max_tokens=4, ignore_eos=True)) == []  # no tokenizer: no text pieces
    assert len(eng.last_completion.token_ids) == 4


def test_unfinished_stream_in_same_thread_is_refused_not_corrupted(eng, monkeypatch):
    monkeypatch.setattr(eng, "tokenizer", type("T", (), {"decode": lambda self, ids, **k: "x" * len(ids)})())
    want = eng.generate(PROMPT, max_tokens=20, ignore_eos=True).token_ids
    it = eng.stream(PROMPT, max_tokens=20, ignore_eos=True)
    assert next(it)  # suspended mid-generation, holding the engine
    with pytest.raises(InvalidRequestError, match="unfinished stream"):
        eng.generate(PROMPT, max_tokens=3)
    "".join(it)  # finishing the suspended stream gives exactly the undisturbed generation
    assert eng.last_completion.token_ids == want
    it.close()
    assert eng.generate(PROMPT, max_tokens=20, ignore_eos=True).token_ids == want
    it2 = eng.stream(PROMPT, max_tokens=20, ignore_eos=True)
    next(it2)
    it2.close()  # abandoned early: the engine is free again
    assert eng.generate(PROMPT, max_tokens=20, ignore_eos=True).token_ids == want


def test_keyboard_interrupt_mid_generation_leaves_engine_usable(eng, monkeypatch):
    want = eng.generate(PROMPT, max_tokens=24, ignore_eos=True).token_ids
    real = type(eng._core).decode
    calls = {"n": 0}

    class Interrupting:
        def __init__(self, core):
            self._c = core

        def __getattr__(self, k):
            return getattr(self._c, k)

        def decode(self, *a, **k):
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
            return real(self._c, *a, **k)

    core = eng._core
    monkeypatch.setattr(eng, "_core", Interrupting(core))
    with pytest.raises(KeyboardInterrupt):
        eng.generate(PROMPT, max_tokens=24, ignore_eos=True)
    monkeypatch.setattr(eng, "_core", core)
    assert eng.generate(PROMPT, max_tokens=24, ignore_eos=True).token_ids == want


# ---- the assembler's windowed decode against decoding everything, on real tokenizers ----

MIXED_TEXT = "Once upon a time, héllo wörld — 日本語のテキスト 🙂🚀 <s> the dog  \n\n x=1+2; «quotes» ok."


def _char_tokenizer(tmp_path):
    from conftest import save_char_tokenizer
    from tinyinfer.tokenizer import Tokenizer

    save_char_tokenizer(tmp_path)
    return Tokenizer.from_file(tmp_path / "tokenizer.json")


@pytest.fixture(params=["char", "bytelevel", "sentencepiece"])
def tokenizer(request, tmp_path):
    """(tokenizer, windowed): whether the assembler's windowed decode must hold on every stream. A sentencepiece
    byte-fallback run that is still incomplete turns its earlier, complete characters into U+FFFD too (not a
    local decode): there the assembler falls back to decoding everything, on ASCII text it must not."""
    if request.param == "char":  # WordLevel, tokens joined with spaces
        return _char_tokenizer(tmp_path), True
    if request.param == "bytelevel":  # SmolLM2's byte-level BPE
        return request.getfixturevalue("smollm_tokenizer"), True
    from tinyinfer.loaders import load_model

    return load_model(request.getfixturevalue("tiny_gguf_dir") / "tiny.gguf").tokenizer, False


def test_windowed_decode_equals_decoding_everything(tokenizer):
    tokenizer, always_windowed = tokenizer

    def dec(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    rng = np.random.default_rng(0)
    vocab = tokenizer.vocab_size
    ascii_ids = tokenizer.encode("The quick brown fox, 12 dogs; and\nnew  lines.", add_special_tokens=False)
    streams = [ascii_ids, tokenizer.encode(MIXED_TEXT, add_special_tokens=False),
               rng.integers(0, vocab, 200).tolist(),  # anything: specials, lone bytes, broken UTF-8
               rng.integers(0, min(vocab, 400), 200).tolist()]  # the low ids: byte tokens and specials
    for ids in streams:
        asm = TextAssembler(dec, [])
        for i, t in enumerate(ids):
            asm.add([t])
            assert asm.text == dec(ids[:i + 1]).rstrip("\ufffd"), (i, ids[:i + 1])
        asm.add([], final=True)
        assert asm.text == dec(ids).rstrip("\ufffd")
        if always_windowed or ids is ascii_ids:  # the fast path held (a fallback passes the checks above too)
            assert asm._windowed


def test_numpy_numbers_are_taken_as_pythons():
    """numpy scalars (and an integer array of stop ids) as Python's numbers: the core takes int / float."""
    sp = SamplingParams(max_tokens=np.int64(2), top_k=np.int32(5), seed=np.uint64(3), temperature=np.float32(0.5),
                        stop_token_ids=np.array([5, 7]), ignore_eos=np.bool_(True))
    assert (type(sp.max_tokens), type(sp.top_k), type(sp.seed), type(sp.temperature)) == (int, int, int, float)
    assert sp.stop_token_ids == [5, 7] and all(type(t) is int for t in sp.stop_token_ids)
    assert SamplingParams(stop_token_ids=[np.int64(9)]).stop_token_ids == [9]
    with pytest.raises(InvalidRequestError, match="max_tokens must be an integer"):
        SamplingParams(max_tokens=np.float64(2.0))  # (a float is no count, numpy's or Python's)


def _spm_tokenizer():
    from gguf_writer import spm_vocab
    from tinyinfer.tokenizer import Tokenizer

    toks, types, scores = spm_vocab()
    return Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": toks, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True})


@pytest.mark.parametrize("one_by_one", [False, True])
def test_an_answer_is_decoded_as_the_prompts_continuation(one_by_one):
    """SentencePiece decodes a text's first token without its space ("▁cat" alone is "cat"): after the prompt's
    last tokens (vLLM's context), the answer's text keeps it, and the prompt's text plus the answer's is the
    whole text's decode — token by token or at once, with a stop string too."""
    tok = _spm_tokenizer()
    ids = tok.encode("the quick cat sat over the dog", add_special_tokens=True)
    cut = ids.index(tok.encode("the quick cat", add_special_tokens=True)[-1]) + 1
    prompt, answer = ids[:cut], ids[cut:]
    dec = tok.decode
    assert dec(answer).startswith("sat")  # (alone: the space lost)
    for stop in ([], ["dog"]):
        t = TextAssembler(dec, stop, context=prompt[-5:])
        pieces = [t.add([i]) for i in answer] if one_by_one else [t.add(answer)]
        pieces.append(t.add([], final=True))
        want = " sat over the dog" if not stop else " sat over the "
        assert "".join(pieces) == t.text == want
        assert dec(prompt) + t.text == dec(ids)[:len(dec(prompt)) + len(want)]
    plain = TextAssembler(dec, [])
    assert plain.add(answer, final=True) == dec(answer)  # (no context: as before)


def test_a_context_cut_inside_a_character_is_left_out():
    """A prompt whose last token is the first byte of a character ("<0xE6>"): that context would start the answer
    with U+FFFD; it is left out and the answer decoded alone (windowed, as without a context)."""
    tok = _spm_tokenizer()
    byte = tok.token_to_id("<0xE6>")
    answer = tok.encode("the dog", add_special_tokens=False)
    t = TextAssembler(tok.decode, [], context=[byte])
    assert t.add(answer, final=True) == tok.decode(answer) and t._windowed
