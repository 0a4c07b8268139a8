"""The CPU engine's sequence slots (docs/BATCH_CONTRACT.md part 2): several sequences of different lengths stepped
together give bit for bit the logits, tokens and logprobs each gives alone (in a slot by itself, and on the
single-sequence path); KV pages are held as the slots grow and come back when they close; every bad call is a
Request error that changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from tinyinfer import _core
from tinyinfer.errors import InvalidRequestError

VOCAB = 96
MAX_SEQ = 150
PAGE = 64
# Lengths on both sides of a page boundary (64) and a single token.
PROMPTS = [list(np.random.default_rng(i).integers(0, VOCAB, n)) for i, n in enumerate([5, 17, 64, 70, 1])]
GREEDY = _core.SamplingConfig()


def _config(vocab: int = VOCAB) -> _core.ModelConfig:
    c = _core.ModelConfig()
    c.hidden, c.intermediate, c.n_layers = 64, 128, 2
    c.n_heads, c.n_kv_heads, c.head_dim, c.vocab = 2, 1, 64, vocab
    c.max_position_embeddings = 4096
    c.rms_eps = 1e-5
    c.validate()
    return c


def _store(fmt: str, vocab: int = VOCAB) -> _core.WeightStore:
    """Random weights large enough that every token and position changes the logits; held as `fmt`
    (fp16: the one-row products go straight from the format, row_dot.cpp; int8 / int4: quantized blocks)."""
    rng = np.random.default_rng(7)
    store = _core.WeightStore(_config(vocab))
    for name in store.required_names():
        shape = store.expected_shape(name)
        if name.endswith("norm.weight"):
            w = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        else:
            w = (rng.standard_normal(shape) * 0.15).astype(np.float32)
        store.add(name, w.astype(np.float16) if fmt == "fp16" else w, "fp16" if fmt == "fp16" else "fp32")
    store.finish()
    if fmt in ("int8", "int4"):
        store.quantize(fmt)
    return store


@pytest.fixture(scope="module", params=["fp32", "fp16", "int8", "int4"])
def store(request):
    return _store(request.param)


@pytest.fixture(scope="module")
def fp32_store():
    return _store("fp32")


def _engine(store, max_batch: int = 8, threads: int = 2) -> _core.CpuEngine:
    return _core.CpuEngine(store, MAX_SEQ, threads, max_batch)


def _single_greedy(core, prompt, steps: int):
    """The single-sequence path: logits after the prompt and after each greedy token, and the tokens."""
    core.reset()
    logits = [core.forward(prompt)[0]]
    toks = []
    for _ in range(steps):
        toks.append(int(np.argmax(logits[-1])))
        logits.append(core.forward([toks[-1]])[0])
    core.reset()
    return toks, logits


def _generate(core, slots, prompts, steps: int, cfgs=None, k: int = 5):
    """Prefill each slot, then `steps` rounds of sample + step for all slots together. Returns per slot the
    tokens, logprobs, top ids, top logprobs and the logits before each sample."""
    cfgs = cfgs or [GREEDY] * len(slots)
    for s, p in zip(slots, prompts):
        core.seq_prefill(s, p)
    out = [{"tokens": [], "lp": [], "top_ids": [], "top_lp": [], "logits": []} for _ in slots]
    for i in range(steps):
        for o, s in zip(out, slots):
            o["logits"].append(core.seq_logits(s))
        toks, lp, top_ids, top_lp = core.seq_sample(slots, cfgs, [i] * len(slots), k)
        assert toks.dtype == np.int32 and lp.dtype == np.float32 and top_ids.dtype == np.int32
        assert top_lp.dtype == np.float32 and top_ids.shape == top_lp.shape == (len(slots), k)
        for j, o in enumerate(out):
            o["tokens"].append(int(toks[j]))
            o["lp"].append(lp[j])
            o["top_ids"].append(top_ids[j])
            o["top_lp"].append(top_lp[j])
        core.seq_step(slots, [int(t) for t in toks])
    return out


def _alone(core, prompt, steps: int, cfg=GREEDY, k: int = 5):
    s = core.seq_open()
    try:
        return _generate(core, [s], [prompt], steps, [cfg], k)[0]
    finally:
        core.seq_close(s)


def _assert_same_run(got, want):
    for key in ("tokens", "lp", "top_ids", "top_lp", "logits"):
        for i, (g, w) in enumerate(zip(got[key], want[key])):
            np.testing.assert_array_equal(g, w, err_msg=f"{key} at step {i}")


# ---- equal alone and in a batch ----

def test_batched_greedy_equals_the_single_path_bit_for_bit(store):
    core = _engine(store)
    steps = 6
    slots = [core.seq_open() for _ in PROMPTS]
    got = _generate(core, slots, PROMPTS, steps)
    for s, p, g in zip(slots, PROMPTS, got):
        toks, logits = _single_greedy(core, p, steps)
        assert g["tokens"] == toks
        for i in range(steps):
            np.testing.assert_array_equal(g["logits"][i], logits[i], err_msg=f"prompt {len(p)}, step {i}")
        np.testing.assert_array_equal(core.seq_logits(s), logits[steps])  # after the last step
        assert core.seq_length(s) == len(p) + steps
    assert len(set(tuple(g["tokens"]) for g in got)) > 1  # the prompts lead to different text


def test_batched_equals_each_slot_alone_with_logprobs(store):
    core = _engine(store, threads=3)
    one_thread = _engine(store, threads=1)  # the thread count changes no number either
    alone = [_alone(one_thread, p, 5) for p in PROMPTS]
    slots = [core.seq_open() for _ in PROMPTS]
    for got, want in zip(_generate(core, slots, PROMPTS, 5), alone):
        _assert_same_run(got, want)


def test_logprobs_are_the_raw_logits_log_softmax(fp32_store):
    core = _engine(fp32_store)
    s = core.seq_open()
    core.seq_prefill(s, PROMPTS[1])
    x = core.seq_logits(s).astype(np.float64)
    want = x - x.max() - np.log(np.exp(x - x.max()).sum())
    hot = _core.SamplingConfig()
    hot.temperature, hot.seed = 1.5, 3
    toks, lp, top_ids, top_lp = core.seq_sample([s], [hot], [0], 20)
    np.testing.assert_allclose(lp[0], want[toks[0]], rtol=1e-5, atol=1e-5)
    order = np.argsort(-want, kind="stable")[:20]
    np.testing.assert_array_equal(top_ids[0], order)
    np.testing.assert_allclose(top_lp[0], want[order], rtol=1e-5, atol=1e-5)


def test_top_entries_past_a_small_vocabulary_are_padded():
    core = _core.CpuEngine(_store("fp32", vocab=12), 16, 1, 2)
    s = core.seq_open()
    core.seq_prefill(s, [1, 2, 3])
    toks, lp, top_ids, top_lp = core.seq_sample([s], [GREEDY], [0], 20)
    assert top_ids.shape == (1, 20)
    assert sorted(top_ids[0, :12]) == list(range(12)) and top_ids[0, 0] == toks[0] and top_lp[0, 0] == lp[0]
    assert (top_ids[0, 12:] == -1).all() and np.isneginf(top_lp[0, 12:]).all()


def _hot(seed: int, **kw) -> _core.SamplingConfig:
    c = _core.SamplingConfig()
    c.temperature, c.top_k, c.top_p, c.seed = 0.9, 40, 0.95, seed
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def test_seeded_sampling_equal_alone_and_in_a_batch(fp32_store):
    core = _engine(fp32_store)
    cfgs = [_hot(11), _hot(12, repetition_penalty=1.3), _hot(13, presence_penalty=1.0, frequency_penalty=0.5),
            _hot(14, min_p=0.05), _hot(11)]
    alone = [_alone(core, p, 8, c) for p, c in zip(PROMPTS, cfgs)]
    slots = [core.seq_open() for _ in PROMPTS]
    got = _generate(core, slots, PROMPTS, 8, cfgs)
    for g, w in zip(got, alone):
        _assert_same_run(g, w)
    assert len(set(tuple(g["tokens"]) for g in got)) == len(got)
    # Without presence / frequency penalties the single path's decode() draws the same tokens (same counters).
    for p, c, g in zip(PROMPTS[:2], cfgs[:2], got[:2]):
        core.reset()
        core.forward(p)
        assert core.decode(8, c, [], 0) == g["tokens"]


def test_the_penalties_see_each_slots_own_history(fp32_store):
    """A slot's repetition / frequency penalty counts its own tokens only: a heavily penalised greedy slot next
    to others repeats nothing it generated, exactly as alone."""
    core = _engine(fp32_store)
    pen = _core.SamplingConfig()
    pen.frequency_penalty = 2.0
    alone = _alone(core, PROMPTS[0], 12, pen)
    slots = [core.seq_open() for _ in range(3)]
    got = _generate(core, slots, [PROMPTS[0], PROMPTS[0], PROMPTS[2]], 12, [pen, GREEDY, GREEDY])
    _assert_same_run(got[0], alone)
    assert got[0]["tokens"] != got[1]["tokens"]


def test_the_single_sequence_is_independent_of_the_slots(store):
    core = _engine(store)
    toks, logits = _single_greedy(core, PROMPTS[3], 4)
    s = core.seq_open()
    core.seq_prefill(s, PROMPTS[2])
    core.forward(PROMPTS[3])  # the single sequence between the slot's calls
    core.seq_step([s], [1])
    assert core.decode(4, GREEDY, [], 0) == toks
    np.testing.assert_array_equal(core.seq_logits(s), _single_greedy(core, PROMPTS[2] + [1], 0)[1][0])
    assert core.kv_pages_free == core.kv_pages_total - 2  # the single sequence's cache is not the slots'


def test_prefill_in_chunks_equals_one_chunk(store):
    core = _engine(store)
    p = PROMPTS[3]
    a, b = core.seq_open(), core.seq_open()
    core.seq_prefill(a, p)
    for i in range(0, len(p), 30):
        core.seq_prefill(b, p[i:i + 30])
    np.testing.assert_array_equal(core.seq_logits(a), core.seq_logits(b))
    got = core.seq_sample([a, b], [_hot(5), _hot(5)], [0, 0], 3)
    assert got[0][0] == got[0][1] and got[1][0] == got[1][1]


# ---- slots and pages ----

def test_pages_are_held_as_slots_grow_and_freed_on_close(fp32_store):
    core = _engine(fp32_store, max_batch=4)
    assert core.max_batch == 4 and core.kv_page_size == PAGE
    assert core.kv_pages_total == 4 * -(-MAX_SEQ // PAGE)
    total = core.kv_pages_total
    assert core.kv_pages_free == total
    a, b = core.seq_open(), core.seq_open()
    assert (a, b) == (0, 1) and core.seq_length(a) == 0
    assert core.kv_pages_free == total  # an open, empty slot holds nothing
    core.seq_prefill(a, PROMPTS[2])  # 64 positions: one page
    assert core.kv_pages_free == total - 1
    core.seq_step([a], [3])  # position 64: a second page
    assert core.kv_pages_free == total - 2
    core.seq_prefill(b, PROMPTS[0])
    assert core.kv_pages_free == total - 3
    core.seq_close(a)
    assert core.kv_pages_free == total - 1
    with pytest.raises(InvalidRequestError, match="not open"):
        core.seq_length(a)
    core.seq_close(b)
    assert core.kv_pages_free == total


def test_a_rewound_slot_is_a_fresh_prefill_of_its_prefix(store):
    """seq_rewind (the scheduler's prefix cache): a slot that ran a prompt and generated tokens, rewound to a prefix
    of them and given the rest of a new prompt, has bit for bit the logits and samples of a fresh slot given the
    whole new prompt, penalties included (its history restarts as the prefix, as prompt); its pages past the prefix
    go back to the pool."""
    core = _engine(store)
    pen = _hot(11, repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.5)
    a = core.seq_open()
    ran = _generate(core, [a], [PROMPTS[3]], 8, [pen])[0]["tokens"]  # positions 0..77 hold PROMPTS[3] + ran[:8]
    held = PROMPTS[3] + ran
    assert core.seq_length(a) == len(held)
    free = core.kv_pages_free
    core.seq_rewind(a, held[:60])  # 60 of 78 positions: 1 page of 2
    assert core.seq_length(a) == 60 and core.kv_pages_free == free + 1
    with pytest.raises(InvalidRequestError, match="no logits"):
        core.seq_sample([a], [GREEDY], [0], 0)
    new = held[:60] + PROMPTS[1]
    b = core.seq_open()
    got = _generate(core, [a, b], [PROMPTS[1], new], 6, [pen, pen])
    _assert_same_run(got[0], got[1])
    core.seq_rewind(a, [])  # all of it: an empty slot again
    assert core.seq_length(a) == 0


def test_bad_rewinds_are_clear_errors_and_change_nothing(fp32_store):
    core = _engine(fp32_store)
    a = core.seq_open()
    core.seq_prefill(a, PROMPTS[1])
    before = core.seq_logits(a).copy()
    free = core.kv_pages_free
    for tokens, match in ((PROMPTS[1] + [1], "holds 17 positions; cannot keep 18"),
                          (PROMPTS[1][:4] + [(PROMPTS[1][4] + 1) % VOCAB], "does not hold those 5 tokens")):
        with pytest.raises(InvalidRequestError, match=match):
            core.seq_rewind(a, tokens)
        assert core.seq_length(a) == 17 and core.kv_pages_free == free
        np.testing.assert_array_equal(core.seq_logits(a), before)
    with pytest.raises(InvalidRequestError, match="not open"):
        core.seq_rewind(a + 1, [])
    core.seq_rewind(a, PROMPTS[1][:3])  # (the engine is still usable)
    core.seq_prefill(a, PROMPTS[1][3:])
    np.testing.assert_array_equal(core.seq_logits(a), before)


def test_interleaved_open_close_reuses_slots_clean(fp32_store):
    core = _engine(fp32_store, max_batch=3)
    want = _alone(core, PROMPTS[1], 4, _hot(9, repetition_penalty=1.5, presence_penalty=0.7))
    a, b, c = core.seq_open(), core.seq_open(), core.seq_open()
    with pytest.raises(InvalidRequestError, match="all 3"):
        core.seq_open()
    for s in (a, b, c):
        core.seq_prefill(s, PROMPTS[3])
    core.seq_sample([a, b, c], [_hot(1)] * 3, [0] * 3, 0)
    core.seq_close(b)
    assert core.seq_open() == b  # the lowest free slot, empty, with no history
    assert core.seq_length(b) == 0 and core.seq_logits(b).size == 0
    core.seq_close(a)
    got = _generate(core, [b], [PROMPTS[1]], 4, [_hot(9, repetition_penalty=1.5, presence_penalty=0.7)])[0]
    _assert_same_run(got, want)
    assert core.seq_open() == a
    assert core.seq_length(c) == len(PROMPTS[3])


# ---- bad calls: a Request error, nothing changed ----

def _state(core):
    return [(s, core.seq_length(s), core.seq_logits(s).copy()) for s in range(core.max_batch)
            if _is_open(core, s)] + [core.kv_pages_free]


def _is_open(core, s):
    try:
        core.seq_length(s)
        return True
    except InvalidRequestError:
        return False


@pytest.mark.parametrize("max_batch", [0, -1, 1025])
def test_max_batch_out_of_range(fp32_store, max_batch):
    with pytest.raises(InvalidRequestError, match="max_batch"):
        _core.CpuEngine(fp32_store, MAX_SEQ, 1, max_batch)


def _bad_calls(a, b, closed, full):
    """(call, message) pairs; a and b have logits, closed is not open, full holds MAX_SEQ positions."""
    neg = _core.SamplingConfig()
    neg.temperature = -1.0
    g = GREEDY
    return [
        (lambda c: c.seq_close(99), "does not exist"),
        (lambda c: c.seq_close(-1), "does not exist"),
        (lambda c: c.seq_close(closed), "not open"),
        (lambda c: c.seq_length(99), "does not exist"),
        (lambda c: c.seq_prefill(closed, [1]), "not open"),
        (lambda c: c.seq_prefill(a, []), "no tokens"),
        (lambda c: c.seq_prefill(a, [1, VOCAB]), "out of range"),
        (lambda c: c.seq_prefill(a, [-1]), "out of range"),
        (lambda c: c.seq_prefill(a, [1] * (MAX_SEQ - c.seq_length(a) + 1)), "max_seq_len"),
        (lambda c: c.seq_prefill(full, [1]), "max_seq_len"),
        (lambda c: c.seq_step([a, b], [1, VOCAB]), "out of range"),
        (lambda c: c.seq_step([a, a], [1, 2]), "twice"),
        (lambda c: c.seq_step([a, closed], [1, 2]), "not open"),
        (lambda c: c.seq_step([a, 99], [1, 2]), "does not exist"),
        (lambda c: c.seq_step([a, full], [1, 2]), "max_seq_len"),
        (lambda c: c.seq_step([a, b], [1]), "2 slots but 1 tokens"),
        (lambda c: c.seq_step([], []), "no slots"),
        (lambda c: c.seq_sample([a, b, a], [g] * 3, [0] * 3, 0), "twice"),
        (lambda c: c.seq_sample([a, closed], [g] * 2, [0] * 2, 0), "not open"),
        (lambda c: c.seq_sample([b, a], [g, neg], [0, 0], 0), "temperature"),
        (lambda c: c.seq_sample([a], [g], [0], 21), "top_logprobs"),
        (lambda c: c.seq_sample([a], [g], [0], -1), "top_logprobs"),
        (lambda c: c.seq_sample([a], [g], [-1], 0), "negative"),
        (lambda c: c.seq_sample([a, b], [g], [0, 0], 0), "configs"),
        (lambda c: c.seq_sample([], [], [], 0), "no slots"),
    ]


def test_every_bad_call_changes_nothing_and_the_engine_goes_on(fp32_store):
    core = _engine(fp32_store, max_batch=6)
    a, b, empty, closed, full = (core.seq_open() for _ in range(5))
    core.seq_close(closed)
    core.seq_prefill(a, PROMPTS[0])
    core.seq_prefill(b, PROMPTS[3])
    core.seq_prefill(full, [5] * MAX_SEQ)
    calls = _bad_calls(a, b, closed, full) + [
        (lambda c: c.seq_step([a, empty], [1, 2]), "no logits"),
        (lambda c: c.seq_sample([empty], [GREEDY], [0], 0), "no logits"),
    ]
    before = _state(core)
    for call, msg in calls:
        with pytest.raises(InvalidRequestError, match=msg):
            call(core)
        after = _state(core)
        assert len(after) == len(before) and after[-1] == before[-1], msg
        for (s0, n0, l0), (s1, n1, l1) in zip(before[:-1], after[:-1]):
            assert (s0, n0) == (s1, n1), msg
            np.testing.assert_array_equal(l0, l1, err_msg=msg)
    # The engine goes on: a and b continue exactly as they would have without the bad calls.
    got = _generate(core, [a, b], [[7], [8]], 3)
    fresh = _engine(fp32_store)
    want = [_alone(fresh, PROMPTS[0] + [7], 3), _alone(fresh, PROMPTS[3] + [8], 3)]
    for g, w in zip(got, want):
        _assert_same_run(g, w)
    # Sampling a slot twice without a step is allowed (a new draw each time; its history counts both).
    core.seq_sample([full], [GREEDY], [0], 0)
