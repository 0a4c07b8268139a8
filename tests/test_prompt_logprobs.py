"""vLLM's prompt_logprobs: Engine.prompt_logprobs (each prompt token's log-probability given the tokens before it,
the first None, and the top entries, ties to the lower id) against log_softmax of the engine's own logits(); the
same through SamplingParams(prompt_logprobs=k) on the first Delta and in the Completion, alone and in a batch."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_llama
from tinyinfer import Engine, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = make_llama(tmp_path_factory.mktemp("plp") / "m", hidden=64, heads=2, kv_heads=2, layers=1, vocab=150,
                   init_std=0.3)
    with Engine(d, device="cpu", max_seq_len=256) as e:
        yield e


def log_softmax(row):
    x = row.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


PROMPT = list(range(3, 140))  # (more than one block of 64 rows)


def test_prompt_logprobs_are_log_softmax_of_the_logits(eng):
    out = eng.prompt_logprobs(PROMPT, 3)
    logits = eng.logits(PROMPT)
    assert len(out) == len(PROMPT) and out[0] is None
    for i in (1, 2, 64, 65, len(PROMPT) - 1):
        row = log_softmax(logits[i - 1])
        assert out[i].token_id == PROMPT[i] and out[i].logprob == pytest.approx(row[PROMPT[i]], abs=1e-9)
        order = np.lexsort((np.arange(row.size), -row))[:3]
        assert [t for t, _ in out[i].top] == order.tolist()
        assert [v for _, v in out[i].top] == pytest.approx(row[order].tolist(), abs=1e-9)
    assert all(not x.top for x in eng.prompt_logprobs(PROMPT[:5], 0)[1:])
    assert eng.prompt_logprobs([7], 2) == [None]


def test_ties_go_to_the_lower_id():
    from types import SimpleNamespace

    logits = np.zeros((2, 10), np.float32)
    logits[0, [2, 5, 7]] = 1.0
    fake = SimpleNamespace(_prompt_ids=lambda ids: list(ids), logits=lambda ids: logits)
    out = Engine.prompt_logprobs(fake, [0, 5], 2)
    assert [t for t, _ in out[1].top] == [2, 5]


def test_through_sampling_params_alone_and_in_a_batch(eng):
    want = eng.prompt_logprobs(PROMPT[:20], 2)
    sp = SamplingParams(max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    alone = eng.generate(PROMPT[:20], sp)
    batch = eng.generate([PROMPT[:20], PROMPT[:7]], sp)
    for c in (alone, batch[0]):
        assert c.prompt_logprobs[0] is None
        assert [(x.token_id, x.logprob, x.top) for x in c.prompt_logprobs[1:]] == [
            (x.token_id, x.logprob, x.top) for x in want[1:]]
    assert len(batch[1].prompt_logprobs) == 7
    req = eng.scheduler.submit(PROMPT[:20], sp)
    deltas = list(req)
    assert deltas[0].prompt_logprobs is not None and all(d.prompt_logprobs is None for d in deltas[1:])
    assert eng.generate(PROMPT[:20], SamplingParams(max_tokens=2)).prompt_logprobs is None
    one = eng.generate(PROMPT[:20], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert len(one.prompt_logprobs) == 20  # (max_tokens 1: the first Delta is the last)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be None or an integer in 0..20"):
        SamplingParams(prompt_logprobs=21)
