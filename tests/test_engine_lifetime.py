"""Engine lifetime and identity (issue 15, row 5): close(), `with Engine(...) as eng:`, a useful repr; on the
GPU, loading and closing in a loop leaves device memory flat. The single path's core calls: a Ctrl-C inside a long
prompt leaves the engine usable, and the CPU streams every token."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import GPU_MEMORY_SLACK, gpu_free_bytes, make_chat_llama, make_llama
from tinyinfer import Engine, InvalidRequestError, ModelNotFoundError


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_chat_llama(tmp_path_factory.mktemp("life") / "m")


def test_repr(small):
    eng = Engine(str(small), device="cpu", dtype="int8", max_seq_len=64)
    assert repr(eng) == f"Engine(model={str(small)!r}, device='cpu', dtype='int8', max_seq_len=64)"
    eng.close()
    assert repr(eng).endswith("max_seq_len=64, closed)")


def test_close_releases_the_core_and_later_calls_are_refused(small):
    eng = Engine(small, device="cpu", max_seq_len=64)
    assert eng.generate([1, 2, 3], max_tokens=2).token_ids
    # nothing but the engine holds the core (getrefcount's own argument is the other one), so dropping it
    # runs the C++ destructor at once (counted outside the assert: pytest's rewriting keeps its operands)
    refs = sys.getrefcount(eng._core)
    assert refs == 2
    eng.close()
    assert eng.closed
    for call in (lambda: eng.generate([1, 2, 3], max_tokens=2), lambda: eng.logits([1, 2, 3]),
                 lambda: list(eng.stream([1, 2], max_tokens=2))):
        with pytest.raises(InvalidRequestError, match="closed"):
            call()
    eng.close()  # idempotent


def test_context_manager(small):
    with Engine(small, device="cpu", max_seq_len=64) as eng:
        assert not eng.closed
        eng.generate([1, 2, 3], max_tokens=2)
    assert eng.closed
    with pytest.raises(ZeroDivisionError):
        with Engine(small, device="cpu", max_seq_len=64) as eng2:
            1 / 0
    assert eng2.closed  # closed on the way out of an exception too


def test_close_with_an_unfinished_stream_in_this_thread(small):
    eng = Engine(small, device="cpu", max_seq_len=64)
    gen = eng.stream([1, 2, 3], max_tokens=20, ignore_eos=True)
    assert next(gen)  # suspended inside the generation, holding the engine
    with pytest.raises(InvalidRequestError, match="unfinished stream"):
        eng.close()
    gen.close()
    eng.close()
    assert eng.closed


def test_failed_load_then_close_and_repr(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model path does not exist: .*nope"):
        Engine(tmp_path / "nope", device="cpu")
    eng = Engine.__new__(Engine)  # an engine whose __init__ never ran must not break repr / close
    eng._core = None
    assert "closed" in repr(eng)
    eng.close()


@pytest.mark.gpu
def test_gpu_memory_is_flat_over_load_close_cycles(tmp_path):
    d = make_llama(tmp_path / "m", hidden=1024, intermediate=2816, layers=4, heads=16, kv_heads=4, vocab=32000,
                   dtype="float16")
    with Engine(d, device="cuda", max_seq_len=2048) as eng:
        eng.generate([1, 2, 3], max_tokens=4)
    base = gpu_free_bytes()
    used = []
    for _ in range(5):
        eng = Engine(d, device="cuda", max_seq_len=2048)
        eng.generate([1, 2, 3], max_tokens=4)
        used.append(base - gpu_free_bytes())
        eng.close()
        after = base - gpu_free_bytes()
        # a loaded engine holds ~100 MB of weights + KV cache; after close() nothing of it may remain
        assert after < GPU_MEMORY_SLACK, f"{after / 2**20:.1f} MiB still held after close()"
    assert min(used) > 64 << 20  # the measurement sees a loaded engine at all


class _InterruptedCore:
    """The engine's core, with a Ctrl-C arriving during its first forward call (after that call's work)."""

    def __init__(self, core):
        self._core, self.forward_lengths = core, []

    def forward(self, ids, all_logits=False):
        self.forward_lengths.append(len(ids))
        out = self._core.forward(ids, all_logits=all_logits)
        if len(self.forward_lengths) == 1:
            raise KeyboardInterrupt
        return out

    def __getattr__(self, name):
        return getattr(self._core, name)


def test_a_long_prompt_is_prefilled_in_chunks_and_ctrl_c_lands_after_the_first(small):
    """The single path and logits() prefill a prompt in calls of _prefill_chunk tokens (CHUNK_TOKENS: 512 on the
    CPU), so a Ctrl-C waits for one call, not for the whole prompt; the engine stays usable, and a chunked prompt
    gives the logits of the prompt in one call."""
    prompt = [(7 * i) % 200 + 3 for i in range(50)]
    with Engine(small, device="cpu", max_seq_len=128) as eng:
        eng._prefill_chunk = 16
        real = eng._core
        eng._core = spy = _InterruptedCore(real)
        with pytest.raises(KeyboardInterrupt):
            eng.generate(prompt, max_tokens=4, ignore_eos=True)
        assert spy.forward_lengths == [16]
        spy.forward_lengths = [0]  # (no more interrupts)
        out = eng.generate(prompt, max_tokens=1, ignore_eos=True)
        assert spy.forward_lengths == [0, 16, 16, 2]  # the first call's 16 tokens are in the cache: reused
        assert out.stats.cached_tokens == 16
        eng._core = real
        chunked = eng.logits(prompt)  # logits() prefills in the same calls
        eng._prefill_chunk = 1 << 20
        np.testing.assert_array_equal(chunked, eng.logits(prompt))  # the CPU's numbers do not depend on the call
        assert out.token_ids == [int(np.argmax(chunked[-1]))]


def test_the_cpu_single_path_decodes_a_token_per_call(small):
    """stream() yields after each core.decode call: on the CPU that is every token (a call costs nothing there
    next to a step), so a slow model's answer does not arrive in bursts."""
    with Engine(small, device="cpu", max_seq_len=64) as eng:
        steps = []
        real = eng._core

        class Spy:
            def decode(self, max_steps, *a):
                steps.append(max_steps)
                return real.decode(max_steps, *a)

            def __getattr__(self, name):
                return getattr(real, name)

        eng._core = Spy()
        list(eng.stream([1, 2, 3], max_tokens=5, ignore_eos=True))
        eng._core = real
        assert steps == [1] * 5


def test_a_prompt_that_extends_the_cache_reuses_it(small):
    """The single sequence's cache is reused when the next prompt extends it (a chat's next turn: the last prompt,
    its answer, the new message): only the new tokens are prefilled, and on the CPU every number is what a fresh
    engine computes. Not reused: a prompt the cache does not lead (the same prompt again: the cache also holds its
    answer), and presence / frequency penalties (which count only the request's own tokens)."""
    kw = dict(max_tokens=6, temperature=0.9, seed=4, repetition_penalty=1.3, ignore_eos=True)
    with Engine(small, device="cpu", max_seq_len=128) as eng, Engine(small, device="cpu", max_seq_len=128) as ref:
        first = eng.generate([5, 6, 7, 8], **kw)
        assert first.stats.cached_tokens == 0
        turn = [5, 6, 7, 8] + first.token_ids + [9, 10, 11]
        second = eng.generate(turn, **kw)
        assert second.stats.cached_tokens == 4 + 6  # the prompt and the answer (its last token not yet fed)
        assert second.token_ids == ref.generate(turn, **kw).token_ids
        last = eng.generate(turn, **kw)
        assert last.stats.cached_tokens == 0  # the cache held turn and an answer: longer than turn
        nxt, pen = turn + last.token_ids + [12], dict(presence_penalty=0.5, frequency_penalty=2.0)
        again = eng.generate(nxt, **kw, **pen)  # (it extends the cache, but the penalties would count its answer)
        assert again.stats.cached_tokens == 0 and again.token_ids == ref.generate(nxt, **kw, **pen).token_ids
        eng.logits([1, 2, 3])
        after = eng.generate([1, 2, 3, 4], **kw)
        assert after.stats.cached_tokens == 3 and after.token_ids == ref.generate([1, 2, 3, 4], **kw).token_ids
