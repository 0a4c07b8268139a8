"""Speculative decoding by n-gram lookup: the drafter's index, the config's checks, the draft-length policy (pass
costs, acceptance, probes), the cores' decode_draft (the tokens decode() draws, the cache and the history as it
leaves them, the refusals that change nothing), and the engine's answers with speculation (the same as without),
on the CPU and (marked gpu) the GPU."""

from __future__ import annotations

import pytest

from conftest import make_chat_llama, make_llama
from tinyinfer import Engine, InvalidRequestError, SamplingParams, _core
from tinyinfer.speculative import (DraftPolicy, NgramDrafter, PassCosts, SpeculativeConfig, best_draft_length,
                                   leading_matches)

# ---- the drafter ----


def test_the_longest_match_wins_and_its_latest_occurrence():
    d = NgramDrafter(SpeculativeConfig(prompt_lookup_max=3, prompt_lookup_min=1),
                     [1, 2, 3, 9, 9, 7, 2, 3, 8, 8, 5, 4, 2, 3])
    assert d.draft(2) == [8, 8]  # [4 2 3] is unseen before; [2 3] last at 6..7, then 8 8 (not 1's 9 9)
    d.extend([8])
    assert d.draft(4) == [8, 5, 4, 2]  # [2 3 8] at 6..8 is followed by 8 5 4 2 ...
    assert d.draft(0) == []


def test_no_draft_without_an_earlier_occurrence():
    d = NgramDrafter(SpeculativeConfig(prompt_lookup_max=2, prompt_lookup_min=2), [4, 5, 6, 7])
    assert d.draft(5) == []  # [6 7] occurs only as the suffix itself
    d.extend([4, 5])
    assert d.draft(5) == [6, 7, 4, 5, 6]  # (past the context's end: the repeat goes on)
    assert NgramDrafter(SpeculativeConfig(), []).draft(3) == []


def test_min_n_bounds_the_match():
    ctx = [1, 2, 3, 4, 7, 4]
    assert NgramDrafter(SpeculativeConfig(prompt_lookup_max=2, prompt_lookup_min=1), ctx).draft(2) == [7, 4]
    assert NgramDrafter(SpeculativeConfig(prompt_lookup_max=2, prompt_lookup_min=2), ctx).draft(2) == []


def test_the_index_grows_with_the_context():
    """Drafts from an index built as tokens arrive equal those of one built over the whole context at once."""
    import random

    rng = random.Random(0)
    toks = [rng.randrange(6) for _ in range(300)]
    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    grown = NgramDrafter(cfg, toks[:10])
    for i in range(10, len(toks)):
        assert grown.draft(4) == NgramDrafter(cfg, toks[:i]).draft(4), i
        grown.extend(toks[i:i + 1])


def test_leading_matches():
    assert leading_matches([1, 2, 3], [1, 2, 4]) == 2
    assert leading_matches([5], [1, 2]) == 0
    assert leading_matches([1, 2, 9], [1, 2]) == 2  # (the bonus token)


# ---- the config ----


@pytest.mark.parametrize("kw,field", [({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_spec"),
                                      ({"num_speculative_tokens": 65}, "num_spec"), ({"prompt_lookup_max": 33}, "max"),
                                      ({"prompt_lookup_min": 5, "prompt_lookup_max": 4}, "min"),
                                      ({"num_speculative_tokens": True}, "num_spec"),
                                      ({"prompt_lookup_min": 2.0}, "min")])
def test_config_checks(kw, field):
    with pytest.raises(InvalidRequestError, match=field):
        SpeculativeConfig(**kw)


def test_config_from_a_dict():
    """vLLM's resolution of the lookup bounds: neither given 5 and 5, one given the other equal to it."""
    assert SpeculativeConfig.of(None) is None
    c = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 3})
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (7, 3, 3)
    c = SpeculativeConfig.of({"method": "[ngram]", "prompt_lookup_min": 2})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 5, 2, 2)
    assert (SpeculativeConfig().prompt_lookup_max, SpeculativeConfig().prompt_lookup_min) == (5, 5)
    assert SpeculativeConfig.of(c) is c
    with pytest.raises(InvalidRequestError, match="'draft_model'"):
        SpeculativeConfig.of({"draft_model": "x"})
    with pytest.raises(InvalidRequestError, match="an object of its fields"):
        SpeculativeConfig.of(["ngram"])


# ---- the draft-length policy ----


def test_pass_costs_interpolate_and_extrapolate():
    c = PassCosts()
    assert c.ratio(5) == pytest.approx(1 + 4 * PassCosts.PRIOR_ROW_COST)  # nothing measured: the prior
    c.observe(1, 50.0)
    c.observe(3, 80.0)  # (the first pass of each row count: left out)
    assert c.ratio(3) == pytest.approx(1 + 2 * PassCosts.PRIOR_ROW_COST)
    c.observe(1, 1.0)
    c.observe(3, 2.0)
    assert c.ratio(1) == 1 and c.ratio(3) == 2 and c.ratio(2) == pytest.approx(1.5)
    assert c.ratio(5) == pytest.approx(2 + 2 * PassCosts.PRIOR_ROW_COST)  # past the largest measured
    c.observe(3, 4.0)  # a moving average
    assert c.ratio(3) == pytest.approx(2 + PassCosts.EMA * 2)


def measured(passes: dict) -> PassCosts:
    c = PassCosts()
    for rows, s in passes.items():
        c.observe(rows, s)  # (the first of each is left out)
        c.observe(rows, s)
    return c


def test_best_draft_length():
    cheap = measured({1: 1.0, 6: 1.2})  # a memory-bound pass: rows nearly free
    dear = measured({1: 1.0, 2: 1.7, 6: 3.1})  # the CPU's
    assert best_draft_length(0.9, 5, cheap) == 5
    assert best_draft_length(0.3, 5, cheap) == 2  # 1.39 tokens for 1.08 steps (5: 1.43 for 1.2)
    assert best_draft_length(0.02, 5, cheap) == 0  # 1.02 tokens for 1.04 steps
    assert best_draft_length(0.9, 5, dear) == 5  # 4.69 tokens for 3.1 steps
    assert best_draft_length(0.5, 5, dear) == 0
    assert best_draft_length(0.9, 0, cheap) == 0


def test_the_policy_probes_and_backs_off():
    costs = measured({rows: float(rows) for rows in range(1, 8)})  # every row a step: no draft pays
    p = DraftPolicy(costs)
    assert p.length(5) == 0 and p.plain_steps() == DraftPolicy.PROBE_FIRST  # (steps in one call until a probe)
    for _ in range(DraftPolicy.PROBE_FIRST):
        assert p.length(5) == 0
        p.stepped(1, 1, 1.0)
    assert p.plain_steps() == 1
    assert p.length(5) == DraftPolicy.PROBE_LENGTH  # a probe
    p.drafted(3, 0, 4, 4.0)
    assert p.probe_every == 2 * DraftPolicy.PROBE_FIRST and p.idle == 0
    assert p.length(5) == 0
    p.stepped(2 * DraftPolicy.PROBE_FIRST - 1, 2 * DraftPolicy.PROBE_FIRST - 1, 15.0)  # (one call of 15)
    assert p.length(5) == 0
    p.stepped(1, 0, 0.5)  # no pass ran: nothing measured
    assert costs.ratio(1) == 1.0
    assert p.length(2) == 2  # (at most k_max)
    p.drafted(2, 2, 3, 3.0)
    kept, checked = 0.8 * (0.8 * 1 + 0) + 2, 0.8 * (0.8 * 2 + 1) + 2  # (each draft's counts decay by 0.8)
    assert p.probe_every == DraftPolicy.PROBE_FIRST and p.rate == pytest.approx(kept / checked)
    cheap = DraftPolicy(measured({1: 1.0, 4: 1.1}))
    assert cheap.length(3) == 3 and cheap.plain_steps() == 1  # a draft pays: the next token may bring a match
    runs = []
    for _ in range(8):
        cheap.length(3)
        cheap.missed()  # (the lookup found nothing)
        runs.append(cheap.plain_steps())
    assert runs == [1, 1, 1, 2, 4, 8, 16, 16]
    cheap.drafted(3, 3, 4, 1.1)
    assert cheap.plain_steps() == 1 and cheap.misses == 0


def test_a_probe_that_finds_no_match_counts_as_made():
    p = DraftPolicy(measured({rows: float(rows) for rows in range(1, 8)}))
    p.stepped(DraftPolicy.PROBE_FIRST, DraftPolicy.PROBE_FIRST, 8.0)
    assert p.length(5) == DraftPolicy.PROBE_LENGTH
    p.missed()
    assert p.idle == 0 and p.probe_every == DraftPolicy.PROBE_FIRST
    assert p.length(5) == 0 and p.plain_steps() == DraftPolicy.PROBE_FIRST


# ---- the cores ----

# (device, CudaOptions.draft_pass): the GPU's two draft passes, the prefill's and the batched step's
DEVICES = [("cpu", None), pytest.param(("cuda", 0), marks=pytest.mark.gpu, id="cuda-prefill-pass"),
           pytest.param(("cuda", 1), marks=pytest.mark.gpu, id="cuda-batched-pass")]
PROMPT = [3, 14, 15, 92, 65, 35]


def engine(path, device_pass, **kw) -> Engine:
    device, draft_pass = device_pass
    if device == "cuda":
        opts = _core.CudaOptions()
        opts.draft_pass = draft_pass
        opts.max_batch = 8  # (a draft past 7 tokens takes the prefill pass on either)
        kw["cuda_options"] = opts
    return Engine(path, device=device, **kw)


@pytest.fixture(scope="module", params=DEVICES)
def eng(request, tmp_path_factory):
    d = make_llama(tmp_path_factory.mktemp("spec"), hidden=256, heads=4, kv_heads=2, layers=2, vocab=300,
                   init_std=0.3)
    with engine(d, request.param, max_seq_len=96) as e:
        yield e


def cfg(**kw) -> _core.SamplingConfig:
    s = _core.SamplingConfig()
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def reference(core, s, n, prompt=PROMPT):
    core.reset()
    core.forward(prompt)
    return core.decode(n, s, [], 0)


def drafted(core, s, ref, drafts, n, prompt=PROMPT):
    """The tokens of one answer made by decode_draft calls with drafts[i] (a list, or an int j: the reference's next
    j tokens), then plain steps to n tokens."""
    core.reset()
    core.forward(prompt)
    out = []
    for d in drafts:
        if isinstance(d, int):
            d = ref[len(out):len(out) + d]
        got = core.decode_draft(d, s, [], len(out))
        assert 1 <= len(got) <= len(d) + 1
        out += got
    while len(out) < n:
        out += core.decode(1, s, [], len(out))
    return out


SAMPLERS = {"greedy": {}, "seeded": dict(temperature=1.0, top_p=0.9, seed=11),
            "penalties": dict(temperature=0.8, seed=5, repetition_penalty=1.3, presence_penalty=0.5,
                              frequency_penalty=0.3)}


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_decode_draft_draws_what_decode_draws(eng, sampler):
    """Accepted, partly accepted and rejected drafts, first with no pending token then after one: the answer, the
    cache (later tokens) and the history (the penalties) as with decode() alone. The GPU draws the drafts' tokens
    on the host: its sampled answers may part from the device sampler's at rounding, so there greedy only."""
    if eng.device == "cuda" and sampler != "greedy":
        pytest.skip("the host sampler and the device sampler round apart (greedy checked)")
    s = cfg(**SAMPLERS[sampler])
    core = eng._core
    ref = reference(core, s, 40)
    assert drafted(core, s, ref, [5, 3, [1, 2, 3], 4], 40) == ref
    wrong = [(ref[i] + 1) % 300 for i in range(4)]
    assert drafted(core, s, ref, [[wrong[0]], 2, ref[3:4] + wrong[1:3], 6, 1], 40) == ref
    full = drafted(core, s, ref, [8], 9)
    assert full == ref[:9]  # 8 accepted + the bonus


def test_decode_draft_stops_at_a_stop_id(eng):
    core = eng._core
    ref = reference(core, cfg(), 12)
    core.reset()
    core.forward(PROMPT)
    stop = ref[3]
    got = core.decode_draft(ref[:8], cfg(), [stop], 0)
    assert got == ref[:ref.index(stop) + 1]
    assert core.tokens == PROMPT + got and core.position == len(PROMPT) + len(got)


def test_decode_draft_refusals_change_nothing(eng):
    core = eng._core
    ref = reference(core, cfg(), 30)
    core.reset()
    with pytest.raises(InvalidRequestError, match="forward"):
        core.decode_draft([1, 2], cfg(), [], 0)
    core.forward(PROMPT)
    out = core.decode(2, cfg(), [], 0)
    for bad, match in (([], "empty"), ([1, 300], "out of range"), ([5, -1], "out of range"),
                       ([1] * (eng.max_seq_len - core.position), "max_seq_len")):
        with pytest.raises(InvalidRequestError, match=match):
            core.decode_draft(bad, cfg(), [], len(out))
    with pytest.raises(InvalidRequestError):
        core.decode_draft([1], cfg(top_p=0.0), [], len(out))
    assert core.tokens == PROMPT + out
    out += core.decode_draft(ref[2:6], cfg(), [], len(out))
    while len(out) < 30:
        out += core.decode(1, cfg(), [], len(out))
    assert out == ref


def test_a_draft_up_to_the_context_end(eng):
    core = eng._core
    n = eng.max_seq_len - len(PROMPT)
    ref = reference(core, cfg(), n)
    core.reset()
    core.forward(PROMPT)
    out = core.decode(1, cfg(), [], 0)
    k = eng.max_seq_len - core.position - 1
    out += core.decode_draft(ref[1:1 + k], cfg(), [], 1)
    assert out == ref and core.position == eng.max_seq_len


@pytest.mark.gpu
def test_the_batched_pass_across_attention_splits(tmp_path):
    """The batched step's draft pass where rows straddle its attention's splits (64 positions each: a merge) and
    a KV page: the same greedy tokens as decode()."""
    d = make_llama(tmp_path, hidden=256, heads=4, kv_heads=2, layers=2, vocab=300, init_std=0.3)  # (head dim 64)
    opts = _core.CudaOptions()
    opts.draft_pass, opts.max_batch, opts.batch_attn_span, opts.kv_page_size = 1, 8, 64, 64
    with Engine(d, device="cuda", max_seq_len=256, cuda_options=opts) as e:
        prompt = [(7 * i) % 300 for i in range(58)]
        ref = reference(e._core, cfg(), 40, prompt)
        assert drafted(e._core, cfg(), ref, [7, 3, [1, 2], 7, 6, 7], 40, prompt) == ref


# ---- the engine ----


@pytest.fixture(scope="module", params=DEVICES)
def pair(request, tmp_path_factory):
    """The same chat model with and without speculation; drafts on every chance (the policy's pick pinned to the
    longest draft), so that every path of the loop runs."""
    d = make_chat_llama(tmp_path_factory.mktemp("spec_chat"), layers=2, init_std=0.3)
    spec = {"num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with engine(d, request.param, max_seq_len=256) as plain, \
            engine(d, request.param, max_seq_len=256, speculative_config=spec) as fast:
        yield plain, fast


@pytest.fixture
def always_draft(monkeypatch):
    monkeypatch.setattr(DraftPolicy, "length", lambda self, k_max: k_max)


@pytest.mark.parametrize("params", [dict(max_tokens=60, ignore_eos=True),
                                    dict(max_tokens=45, ignore_eos=True, temperature=0.9, seed=2),
                                    dict(max_tokens=50, ignore_eos=True, stop=["ab"]),
                                    dict(max_tokens=33, ignore_eos=True, min_tokens=20, presence_penalty=0.4,
                                         temperature=0.7, seed=9)])
@pytest.mark.parametrize("chunk", [None, 32])
def test_answers_are_unchanged(pair, always_draft, params, chunk, monkeypatch):
    """chunk 32: plain steps 32 a call where no draft runs, as on the GPU."""
    plain, fast = pair
    if chunk:
        monkeypatch.setattr(plain, "_chunk", chunk)
        monkeypatch.setattr(fast, "_chunk", chunk)
    if plain.device == "cuda" and params.get("temperature"):
        pytest.skip("the GPU's drafts are drawn on the host: sampled answers may part at rounding")
    prompt = "abcabcabc the cat the cat the cat"
    want = plain.generate(prompt, **params)
    got = fast.generate(prompt, **params)
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
        (want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert got.stats.draft_tokens > 0 and 0 <= got.stats.accepted_tokens <= got.stats.draft_tokens
    assert len(got.token_ids) <= params["max_tokens"]
    pieces = "".join(fast.stream(prompt, **params))
    assert pieces == want.text


def test_the_next_prompt_reuses_a_speculative_answers_cache(pair, always_draft):
    """A prompt that extends the last one and its answer prefills only its new tokens: the cache a speculative
    answer left holds its kept tokens, the rejected drafts' positions forgotten."""
    plain, fast = pair
    ids = [40 + i % 7 for i in range(30)]
    for _ in range(3):
        want, got = plain.generate(ids, max_tokens=25, ignore_eos=True), fast.generate(ids, max_tokens=25,
                                                                                         ignore_eos=True)
        assert got.token_ids == want.token_ids and got.stats.cached_tokens == want.stats.cached_tokens
        ids = ids + got.token_ids + [41, 42, 43]
    assert got.stats.cached_tokens == len(ids) - 25 - 3 - 3 and got.stats.draft_tokens > 0


def test_rewind(eng):
    """The single sequence cut back to n tokens: the next prompt's logits as after those n alone; refusals change
    nothing."""
    core = eng._core
    core.reset()
    core.forward(PROMPT)
    out = core.decode(5, cfg(), [], 0)
    for bad in (-1, len(PROMPT) + 6):
        with pytest.raises(InvalidRequestError, match="rewind"):
            core.rewind(bad)
    core.rewind(core.position)  # (nothing changes: the pending token stays pending)
    assert core.tokens == PROMPT + out
    core.rewind(len(PROMPT) + 2)
    assert core.tokens == PROMPT + out[:2]
    with pytest.raises(InvalidRequestError, match="forward"):
        core.decode(1, cfg(), [], 0)
    got = core.forward([7, 8], all_logits=True)
    core.reset()
    want = core.forward(PROMPT + out[:2] + [7, 8], all_logits=True)[-2:]
    assert abs(got - want).max() <= 1e-4 * abs(want).max()


class CoreSpy:
    """An engine's core with its calls counted (the bindings' objects take no new attributes)."""

    def __init__(self, core):
        self._core, self.calls = core, {}

    def __getattr__(self, name):
        attr = getattr(self._core, name)
        if not callable(attr):
            return attr

        def counted(*args, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kw)
        return counted


@pytest.fixture
def spied(pair, monkeypatch):
    spies = [CoreSpy(e._core) for e in pair]
    for e, spy in zip(pair, spies):
        monkeypatch.setattr(e, "_core", spy)
    return spies


@pytest.mark.parametrize("chunk", [None, 32])
def test_a_stop_string_inside_a_draft_leaves_the_cache_at_the_answers_end(pair, spied, always_draft, chunk,
                                                                          monkeypatch):
    """An answer cut by a stop string after a call that drew more tokens: the cache is cut back, so a prompt
    extending the answer reuses it as without speculation. chunk 32: plain steps 32 a call, as the GPU's (on the
    CPU engine too, where the cut also applies without speculation)."""
    plain, fast = pair
    if chunk:
        monkeypatch.setattr(plain, "_chunk", chunk)
        monkeypatch.setattr(fast, "_chunk", chunk)
    ids = [40 + i % 5 for i in range(40)]
    stops = 0
    free = plain.generate(ids, max_tokens=30, ignore_eos=True).token_ids
    # an oracle's drafts (the free answer's next tokens, whatever the n-grams say): drafts kept whole, so that a
    # stop string falls inside one's tokens
    monkeypatch.setattr(NgramDrafter, "draft", lambda self, k: (free + [0] * k)[len(self.tokens) - len(ids):][:k])
    for stop in sorted({plain.detokenize([t]) for t in free[2:]} - {""}):
        want, got = (e.generate(ids, max_tokens=30, stop=[stop], ignore_eos=True) for e in (plain, fast))
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        stops += got.finish_reason == "stop"
        nxt = ids + got.token_ids + [41, 42]
        want, got = (e.generate(nxt, max_tokens=3, ignore_eos=True) for e in (plain, fast))
        assert got.token_ids == want.token_ids and got.stats.cached_tokens == want.stats.cached_tokens > 0
    assert stops
    if not chunk:  # (plain steps are a token a call: every cut came after a draft's tokens)
        assert spied[1].calls.get("rewind", 0) > 0 and "rewind" not in spied[0].calls


@pytest.mark.parametrize("paying", [True, False])
def test_an_answer_with_nothing_to_quote_keeps_long_calls(pair, spied, monkeypatch, paying):
    """Where the lookups find nothing, the plain steps run in lengthening calls (the GPU's 32 tokens a call), not a
    token a call: whether the pass costs measured so far make drafts pay (the lookups asked each step) or not (only
    the probes')."""
    plain, fast = pair
    for e in pair:
        monkeypatch.setattr(e, "_chunk", 32)
    monkeypatch.setattr(fast, "_pass_costs", measured({1: 1.0, 8: 1.1} if paying else {1: 1.0, 2: 5.0, 8: 40.0}))
    monkeypatch.setattr(PassCosts, "observe", lambda self, rows, seconds: None)  # (the prices stay as set)
    monkeypatch.setattr(NgramDrafter, "draft", lambda self, k: [])
    want, got = (e.generate(PROMPT, max_tokens=200, ignore_eos=True) for e in pair)
    assert got.token_ids == want.token_ids and got.stats.draft_tokens == 0
    assert spied[0].calls["decode"] == 7 and spied[1].calls["decode"] <= 25, (spied[0].calls, spied[1].calls)


def test_the_gpu_drafts_greedy_answers_only(pair, always_draft, monkeypatch):
    """On the GPU the drafted rows are drawn on the host, whose sampled draw is slow: a sampled answer there does
    not draft (its device steps draw it); a greedy one does. (The device is pretended here: the CPU engine's
    calls are the same.)"""
    plain, fast = pair
    monkeypatch.setattr(fast, "device", "cuda")
    prompt = "abcabcabc the cat the cat the cat"
    assert fast.generate(prompt, max_tokens=30, ignore_eos=True, temperature=0.8, seed=1).stats.draft_tokens == 0
    assert fast.generate(prompt, max_tokens=30, ignore_eos=True).stats.draft_tokens > 0


def test_the_engine_refuses_a_bad_config(tmp_path):
    d = make_llama(tmp_path, hidden=64, heads=2, kv_heads=2, layers=1, vocab=64)
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        Engine(d, device="cpu", speculative_config={"num_speculative_tokens": 0})


def test_grammar_and_bad_words_still_hold(pair, always_draft):
    """A config that changes every token (a grammar, multi-token bad words) drafts nothing and is obeyed."""
    plain, fast = pair
    prompt = "abcabcabc the cat the cat the cat"
    assert len(plain.tokenize("ab", add_special_tokens=False)) == 2  # (a two-token bad word)
    for sp in (SamplingParams(max_tokens=20, structured_outputs={"regex": "(ab|cd)+"}, ignore_eos=True),
               SamplingParams(max_tokens=20, bad_words=["ab"], ignore_eos=True)):
        got = fast.generate(prompt, sp)
        assert got.stats.draft_tokens == 0 and got.token_ids == plain.generate(prompt, sp).token_ids
