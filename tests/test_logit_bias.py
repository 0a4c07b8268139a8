"""OpenAI's logit_bias and vLLM's min_tokens: the reference sampler's bias (added before the penalties; -inf bans a
token, never drawn), its checks, SamplingParams' fields and the core configs they give (min_tokens as the stop ids
and the model's EOS banned for its first tokens), the text side (a stop string must end after min_tokens' text),
stop_reason, and the engines'
generations on the single-sequence path and through the scheduler, on the CPU and (marked gpu) the GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import make_chat_llama, make_llama
from tinyinfer import Engine, InvalidRequestError, SamplingParams, _core
from tinyinfer.sampling import MAX_LOGIT_BIAS, CoreSampling, TextAssembler

sample_row = _core.ops.sample_row
ARANGE = np.arange(10, dtype=np.float32)  # greedy: 9, then 8, ...


def cfg(**kw) -> _core.SamplingConfig:
    s = _core.SamplingConfig()
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def biased(bias: dict, **kw) -> _core.SamplingConfig:
    return cfg(bias_ids=list(bias), bias_values=[float(v) for v in bias.values()], **kw)


# ---- the reference sampler ----

@pytest.mark.parametrize("bias,want", [({}, 9), ({0: 10.0}, 0), ({9: -math.inf}, 8), ({9: -2.5, 8: -1.5}, 7),
                                       ({9: -1.0}, 8)])  # (a tie at 8: the lower id)
def test_bias_moves_the_greedy_choice(bias, want):
    assert sample_row(ARANGE, biased(bias), 0, [], [], 0)[0] == want


def test_bias_applies_before_the_repetition_penalty():
    """vLLM's order: token 0 seen, rep 4, bias +1: (1 + 1) / 4 = 0.5 < 0.8 picks 1; the other order (1 / 4 + 1 =
    1.25) would pick 0."""
    logits = np.array([1.0, 0.8], np.float32)
    assert sample_row(logits, biased({0: 1.0}, repetition_penalty=4.0), 0, [0], [], 0)[0] == 1
    assert sample_row(logits, biased({0: 1.0}), 0, [0], [], 0)[0] == 0


def test_a_banned_token_is_never_drawn_and_logprobs_stay_raw():
    logits = np.zeros(10, np.float32)
    s = biased({3: -math.inf, 7: -math.inf, 9: -math.inf}, temperature=1.0, seed=5)
    toks = [sample_row(logits, s, step, [], [], 2)[0] for step in range(1400)]
    counts = np.bincount(toks, minlength=10)
    assert counts[[3, 7, 9]].sum() == 0
    assert (np.abs(counts[[0, 1, 2, 4, 5, 6, 8]] - 200) < 4.5 * math.sqrt(200 * 6 / 7)).all(), counts
    tok, lp, top_ids, top_lp = sample_row(logits, s, 0, [], [], 2)
    assert lp == pytest.approx(-math.log(10)) and list(top_ids) == [0, 1]  # of the raw logits, bans unseen


def test_bias_checks():
    for s, match in [(cfg(bias_ids=[1, 2], bias_values=[1.0]), "2 ids but 1 values"),
                     (biased({1: 1.0, 2: math.nan}), "finite or -inf"),
                     (biased({1: math.inf}), "finite or -inf"),
                     (biased({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "at most 1024")]:
        with pytest.raises(InvalidRequestError, match=match):
            s.validate()
    with pytest.raises(InvalidRequestError, match="appears twice"):
        cfg(bias_ids=[4, 4], bias_values=[1.0, 2.0]).validate(10)
    for bad in (-1, 10):
        with pytest.raises(InvalidRequestError, match="out of range for vocab 10"):
            biased({bad: 1.0}).validate(10)
        with pytest.raises(InvalidRequestError, match="out of range"):
            sample_row(ARANGE, biased({bad: 1.0}), 0, [], [], 0)
    biased({0: -math.inf, 9: 100.0}).validate(10)
    biased({i: 1.0 for i in range(MAX_LOGIT_BIAS)}).validate(MAX_LOGIT_BIAS)


# ---- SamplingParams ----

@pytest.mark.parametrize("kw,match", [
    (dict(logit_bias=[1, 2]), "mapping"),
    (dict(logit_bias={"1": 2.0}), "keys must be token ids"),
    (dict(logit_bias={True: 2.0}), "keys must be token ids"),
    (dict(logit_bias={-1: 2.0}), "keys must be token ids"),
    (dict(logit_bias={1: 100.5}), r"\[-100, 100\]"),
    (dict(logit_bias={1: -math.inf}), r"\[-100, 100\]"),
    (dict(logit_bias={1: math.nan}), r"\[-100, 100\]"),
    (dict(logit_bias={1: "2"}), r"\[-100, 100\]"),
    (dict(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS + 1)}), "at most 1024"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=True), "min_tokens"),
    (dict(min_tokens=2.0), "min_tokens"),
    (dict(max_tokens=3, min_tokens=4), "at most max_tokens"),
    (dict(bad_words="no"), "bad_words must be a list"),
    (dict(bad_words=["ok", " "]), "non-blank"),
    (dict(bad_words=[1]), "non-blank"),
    (dict(bad_words=["w"] * 513), "at most 512 words"),
])
def test_bad_params_are_refused(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kw)


def bias_of(cfg_) -> dict:
    return dict(zip(cfg_.bias_ids, cfg_.bias_values))


def test_core_sampling_configs():
    sp = SamplingParams(logit_bias={np.int64(5): np.float32(2.5), 7: -100}, min_tokens=3, max_tokens=None)
    assert sp.logit_bias == {5: 2.5, 7: -100} and type(list(sp.logit_bias)[0]) is int
    src = CoreSampling(sp, 1, [7, 9, 10**6], vocab=100)  # (the model's EOS ids)
    # the ban overrides a token's bias; an EOS id outside the vocabulary is never sampled: nothing to ban
    assert bias_of(src.at([])) == bias_of(src.at([1, 1])) == {5: 2.5, 7: -math.inf, 9: -math.inf}
    assert bias_of(src.at([1, 1, 1])) == {5: 2.5, 7: -100.0}
    assert src.at([1, 1, 1]) is src.at([4, 4, 4, 4])  # (one object a set of bans)
    assert [src.same_for(n) for n in (0, 2, 3, 9)] == [3, 1, None, None]
    # stop_token_ids too, and the EOS ids even under ignore_eos (vLLM's "min_tokens before EOS")
    early = CoreSampling(SamplingParams(min_tokens=2, stop_token_ids=[4], ignore_eos=True), 1, [9], 100).at([])
    assert bias_of(early) == {4: -math.inf, 9: -math.inf}
    none = CoreSampling(SamplingParams(min_tokens=3), 1, [], 100)  # no stop id: nothing to hold off
    assert none.same_for(0) is None and bias_of(none.at([])) == {}
    with pytest.raises(InvalidRequestError, match="logit_bias token id 100 is out of range"):
        CoreSampling(SamplingParams(logit_bias={100: 1}), 1, [], 100)
    with pytest.raises(InvalidRequestError, match=r"stop ids \(1\) .* make 1025 logit-bias entries: at most 1024"):
        CoreSampling(SamplingParams(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS)}, min_tokens=1), 1,
                     [MAX_LOGIT_BIAS + 1], MAX_LOGIT_BIAS + 2)
    with pytest.raises(InvalidRequestError, match=r"stop ids \(1100\)"):
        CoreSampling(SamplingParams(stop_token_ids=list(range(1100)), min_tokens=1), 1, [], 2000)


def test_bad_words_bans():
    """A one-token word is always banned; a longer one's last token where the generated tokens end with the rest
    (vLLM's rule: the generated tokens only, not the prompt)."""
    src = CoreSampling(SamplingParams(), 1, [], 100, bad_words_ids=[[5], [1, 2, 3], [7, 8]])
    assert src.same_for(0) == 1
    assert bias_of(src.at([])) == {5: -math.inf}
    assert bias_of(src.at([9, 1, 2])) == {5: -math.inf, 3: -math.inf}
    assert bias_of(src.at([1, 2, 9])) == {5: -math.inf}
    assert bias_of(src.at([1, 2, 7])) == {5: -math.inf, 8: -math.inf}
    with pytest.raises(InvalidRequestError, match="bad_words"):
        CoreSampling(SamplingParams(), 1, [], 3000, bad_words_ids=[[i] for i in range(1025)])
    with pytest.raises(InvalidRequestError, match="make 1025 logit-bias entries"):  # multi-token words' last ids
        CoreSampling(SamplingParams(logit_bias={i: 1 for i in range(1000)}), 1, [], 3000,
                     bad_words_ids=[[1, 2000 + i] for i in range(25)])
    # a word with an id past the vocabulary can never be generated: left out (never an error mid-generation)
    src = CoreSampling(SamplingParams(), 1, [], 100, bad_words_ids=[[4, 100], [3, 7], [200]])
    assert bias_of(src.at([3])) == {7: -math.inf} and bias_of(src.at([4])) == {}


def test_bad_words_tokenization(smol_engine):
    """vLLM's rule on the default model: a word alone, and after a space where that is another first token of as
    many tokens; leading spaces stripped."""
    ids = smol_engine._bad_words_ids(SamplingParams(bad_words=["Paris", "New York", "  Paris"]))
    tok = smol_engine.tokenizer
    assert ids == [tok.encode("Paris", add_special_tokens=False), tok.encode(" Paris", add_special_tokens=False),
                   tok.encode("New York", add_special_tokens=False), tok.encode(" New York", add_special_tokens=False),
                   tok.encode("Paris", add_special_tokens=False), tok.encode(" Paris", add_special_tokens=False)]
    assert len(ids[0]) == len(ids[1]) == 1 and ids[0] != ids[1] and len(ids[2]) == len(ids[3]) == 2


def test_stop_strings_are_looked_for_after_min_tokens():
    chars = "abXYcdXYe"

    def run(min_tokens):
        t = TextAssembler(lambda ids: "".join(chars[i] for i in ids), ["XY"], min_tokens)
        for i in range(len(chars)):
            t.add([i])
            if t.stopped:
                break
        return t.text, len(t.ids)

    assert run(0) == ("ab", 4)
    assert run(4) == ("abXYcd", 8)  # the first XY lies in the first 4 ids' text: not a stop
    assert run(3) == ("ab", 4)  # one that ends after them is (vLLM's rule), and its start was held back
    assert run(8) == ("abXYcdXYe", 9)


# ---- the engines ----

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module", params=DEVICES)
def eng(request, tmp_path_factory):
    d = make_llama(tmp_path_factory.mktemp("bias"), hidden=128, heads=2, kv_heads=2, layers=2, vocab=300,
                   init_std=0.3)
    with Engine(d, device=request.param, max_seq_len=256) as e:
        yield e


def _both(eng, prompt, sp):
    """The single-sequence path's Completion, and the same request inside a batch of two."""
    assert eng.scheduler.idle
    alone = eng.generate(prompt, sp)
    batch = eng.generate([prompt, PROMPT[:2]], sp)[0]
    assert batch.token_ids == alone.token_ids and batch.finish_reason == alone.finish_reason
    return alone


def test_engine_logit_bias(eng):
    free = _both(eng, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
    t = free[1]
    assert _both(eng, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={t: 100})).token_ids == \
        [t] * 12
    down = _both(eng, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={free[0]: -100})).token_ids
    assert down[0] != free[0] and free[0] not in down
    row = eng.logits(PROMPT)[-1]
    assert down[0] == int(np.argsort(-row, kind="stable")[1])  # the runner-up
    seeded = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.5, seed=3, logit_bias={t: -100})
    assert t not in _both(eng, PROMPT, seeded).token_ids
    # a request after biased ones is as before them (the GPU's logits and bias count as they were)
    assert _both(eng, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True)).token_ids == free


def test_engine_min_tokens_holds_off_the_stop_ids(eng):
    free = eng.generate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True)).token_ids
    stops = [free[0], free[3]]
    kw = dict(max_tokens=20, ignore_eos=True, stop_token_ids=stops)
    assert len(eng.generate(PROMPT, SamplingParams(**kw)).token_ids) == 1
    for m in (1, 5, 20):
        out = _both(eng, PROMPT, SamplingParams(min_tokens=m, **kw))
        assert len(out.token_ids) >= m and not set(stops) & set(out.token_ids[:m])
        assert out.finish_reason == ("stop" if out.token_ids[-1] in stops else "length")
    # after min_tokens the stop ids end the answer again; seeded, the same alone and in a batch
    sampled = _both(eng, PROMPT, SamplingParams(min_tokens=6, temperature=1.0, seed=9, **kw))
    assert not set(stops) & set(sampled.token_ids[:6])
    # the stop id is every token's choice (+100) but banned for 3: the 4th ends the answer (the GPU's single path
    # cuts its 32-token decode chunk at min_tokens)
    s = free[0]
    forced = SamplingParams(max_tokens=60, ignore_eos=True, stop_token_ids=[s], min_tokens=3, logit_bias={s: 100})
    out = _both(eng, PROMPT, forced)
    assert len(out.token_ids) == 4 and out.token_ids[-1] == s and out.finish_reason == "stop"
    assert out.stop_reason == s


def test_engine_min_tokens_bans_the_eos(eng):
    free = eng.generate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True)).token_ids
    eng.config.eos_token_ids = [free[0]]  # the config object is the engine's: patch it for this test
    try:
        assert eng.generate(PROMPT, SamplingParams(max_tokens=20)).token_ids == free[:1]
        for ignore in (False, True):  # (banned under ignore_eos too, as vLLM's)
            out = _both(eng, PROMPT, SamplingParams(max_tokens=20, min_tokens=5, ignore_eos=ignore))
            assert len(out.token_ids) >= 5 and free[0] not in out.token_ids[:5]
            assert out.stop_reason is None  # (EOS or length)
    finally:
        eng.config.eos_token_ids = [2]


def test_engine_refuses_an_id_past_its_vocabulary(eng):
    for bias in ({300: 1.0}, {10**12: 1}):
        sp = SamplingParams(max_tokens=4, logit_bias=bias)
        with pytest.raises(InvalidRequestError, match="logit_bias token id"):
            eng.generate(PROMPT, sp)
        with pytest.raises(InvalidRequestError, match="logit_bias token id"):
            eng.generate([PROMPT, PROMPT], sp)
    with pytest.raises(InvalidRequestError, match="bad_words needs the model's tokenizer"):
        eng.generate(PROMPT, SamplingParams(max_tokens=2, bad_words=["x"]))
    assert len(eng.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True)).token_ids) == 3  # still usable


@pytest.fixture(scope="module", params=DEVICES)
def text_eng(request, tmp_path_factory):
    d = make_chat_llama(tmp_path_factory.mktemp("badwords") / "m", init_std=0.3)
    with Engine(d, device=request.param, max_seq_len=256) as e:
        yield e


def test_engine_bad_words(text_eng):
    """vLLM's bad_words on a character tokenizer (ids 4..97: printable ASCII after the space): a two-character word
    of the free answer never appears (its second character banned right after its first), a one-character word
    never at all; the answer is the free one up to where the word would have been completed. The GPU's single
    path decodes a token a call for them."""
    eng = text_eng
    prompt = "Once upon a time"
    free = _both(eng, prompt, SamplingParams(max_tokens=40, ignore_eos=True)).token_ids
    char = {i: chr(32 + i - 3) for i in range(4, 98)}
    j = next(j for j in range(len(free) - 1) if free[j] in char and free[j + 1] in char and free[j] != free[j + 1])
    word = char[free[j]] + char[free[j + 1]]
    out = _both(eng, prompt, SamplingParams(max_tokens=40, ignore_eos=True, bad_words=[word])).token_ids
    assert out[:j + 1] == free[:j + 1] and out[j + 1] != free[j + 1]
    assert all((a, b) != (free[j], free[j + 1]) for a, b in zip(out, out[1:]))
    one = _both(eng, prompt, SamplingParams(max_tokens=40, ignore_eos=True, bad_words=[char[free[j]]])).token_ids
    assert free[j] not in one and one[:free.index(free[j])] == free[:free.index(free[j])]
    # only the generated tokens are matched: a prompt that ends with the word's first character does not ban its
    # second (here made the only choice)
    assert eng._bad_words_ids(SamplingParams(bad_words=[word])) == [[free[j], free[j + 1]]]  # (" " + word: longer)
    first = _both(eng, prompt + word[0], SamplingParams(max_tokens=2, ignore_eos=True, bad_words=[word],
                                                        logit_bias={free[j + 1]: 100})).token_ids
    assert first[0] == free[j + 1]
