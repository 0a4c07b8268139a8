"""Continuous batching: many requests share the core engine's sequence slots, advanced together one step at a time.

    sched = eng.scheduler                           # the engine's own (created on first use)
    req = sched.submit("Once upon a time", SamplingParams(max_tokens=64))
    for delta in req:                               # or `async for delta in req`, or req.result()
        print(delta.text, end="")

One step() (the engine's lock held throughout, so the single-sequence path and the scheduler never touch the
core at the same time):
  1. cancellations: the slots of cancelled requests are closed (their KV pages go back to the pool);
  2. admission, first come first served: the oldest waiting request gets a slot when one is free and the pool
     has the pages its whole prompt (+ its first generated position) needs, after what the admitted prompts
     still need and what this step's decode needs. A request that cannot get them waits (and those behind it:
     a long prompt is never starved by short ones); nothing running is ever evicted;
  3. decode: ONE seq_step for every running sequence holding a sampled token not yet run;
  4. prefill: prompt chunks of the admitted requests, oldest first, at most chunk_tokens tokens per step in all
     (CHUNK_TOKENS by device unless given; so a long prompt never stalls the running sequences for more than
     one chunk), all in ONE seq_prefill_many (batched_prefill: on the GPU one pass over all their tokens, every
     weight read once, rather than a pass per prompt); the finished prompts join the decode at the next step;
     Mixed steps (mixed_steps=True; vLLM's chunked prefill): when 3 and 4 both have work they are
     ONE seq_mixed call: on the GPU one pass whose products take the decode rows and the prompt tokens together
     (every weight read once for both), rather than the decode step's graph and then a prefill pass that reads
     every weight again (on the H200, 57 rows + 7 prompts of 128: 4.3 ms against 5.7; docs/perf/serve.md);
     A request that asked for prompt_logprobs prefills apart (_score): seq_prefill calls that return every
     row's logits, read as its prompt's logprobs, within what the step's other chunks left of chunk_tokens;
  5. sampling: ONE seq_sample for every sequence with fresh logits (the ones just stepped and those whose prompt
     just finished), each with its own SamplingConfig, seed and step counter (= tokens it generated so far: a
     seeded request samples exactly what it samples alone on the single path);
  6. deltas: each request's new text (stop strings, EOS / stop ids, max_tokens checked as Engine.generate does)
     goes to its thread-safe queue; a request that ends has its slot closed in this very step. asyncio consumers
     are woken when the step ends, one call_soon_threadsafe per event loop (Request.batches: at an interval).

Overlap (overlap=True, the default; vLLM's "async scheduling"): seq_step only launches the step (on the GPU: the
bucket's CUDA graph, returning before it ran), and step 6 is Python the device would otherwise wait for (~0.3 ms
at 64 rows, a sixth of a TinyLlama step on an H200). So between 5 and 6 the NEXT decode step is launched for
every sequence sure to go on: its token is no stop id, it has max_tokens left after it, it is not being
cancelled, and the pool has the pages those next positions open (after what the admitted prompts are owed, as
step 3 counts; if not, nothing is launched early and the next step's 3 does it, with its requeue / eviction).
Step 6 then runs while the device computes; at the next step those sequences already hold fresh logits (length
+1, no pending token) so 3 leaves them out, and 5 samples them as usual. What only 6 can tell — a stop string in
the new text — ends a request whose next step is already launched: its slot is closed as any ending's (seq_close
is host bookkeeping plus stream-ordered work, so the in-flight step finishes writing into pages that later work,
issued after it on the one stream, may reuse) and nothing is ever sampled from that step's row. Tokens are the
same as without overlap: the sampling counter is len(generated) either way, every row's computation identical.
A launch that fails with a TinyInferError launches nothing (step 3 meets the error again and pins it on its
requests); anything else ends the requests of that call and is re-raised after the deltas of the others (inside
seq_sample_step: the requests of the whole sampling call, whose tokens are lost with it).
(The CPU engine's seq_step computes before it returns: there nothing overlaps, only the order changes.)
The launch itself happens inside the sampling call where it can (seq_sample_step, both engines): the scheduler
says beforehand which sequences go on unless their token is a stop id (the same conditions, less the token), and
the core launches their step the moment it has the tokens, with no return to Python between — the device would
otherwise idle while the tokens come back, the interpreter gets the GIL (behind a busy event loop in a server)
and builds the rows (docs/perf/serve.md).
With mixed steps the launch ahead carries the prompts too: before the sample the waiting requests are admitted
(as 2 does, after the pages the launched rows open) and their chunks go with the rows that go on in the same
sampling call (seq_sample_mixed: on the GPU the mixed pass is queued behind the sampler before the tokens reach
the host, so a row that draws a stop id steps for nothing and ends here as usual); 6 still overlaps the pass. A
core without seq_sample_mixed gets the seq_mixed from Python after the sample. Prompts that arrive after that launch are
admitted by the next step's 2 but not prefilled by its 4 while its sequences' step is in flight: they ride in
the next launch ahead (up to a step of first-token latency, against a pass of their own).

Decode out of KV pages: running sequences come first; admitted requests still in their prompt go back to the
queue (they have shown nothing; not one preempted before, whose prefill recomputes what its client has seen); if
that is not enough, the youngest decoding sequences by submission, whether or not they need a page this step, are
preempted (preempt=True, vLLM's recompute preemption): the slot closed, the request at the head of the queue with
its prompt and what it generated as what its next admission prefills (seq_mark_generated then counts the answer
as generated again for the presence / frequency penalties), after which it samples on with the same counter (a
seeded request samples the tokens it would have; its client sees a pause). One that cannot be preempted (its
tokens would not fit the pool, or those penalties on a core without seq_mark_generated) ends instead with
KvCacheFullError, its `completion` holding what it generated (finish_reason "length"), but only for a page of its
own. A request
that cannot fit even with nothing running fails the same way instead of waiting forever.
The single path's cache (it shares the GPU pool) is reset() before admitting: only its next call could reuse it.

Prefix cache (prefix_cache; vLLM's cached blocks, llama.cpp's sequences outside the batch): a request that ends
without an error (stop, length, cancelled) leaves its KV cache, with the tokens it holds (its prompt and what ran
of its answer), parked (seq_park: the pages stay, the slot is free at once), so kept caches take pages, not slots,
and survive a full batch. A request whose prompt starts with some of those tokens (a chat's next turn; the same
system prompt or document) gets a fresh slot given the common prefix of the cache sharing the most (seq_copy:
the whole pages below it shared, the last, partly filled one copied; llama.cpp's seq_cp), which stays cached, and
only the rest of its prompt is prefilled (Completion.stats.cached_tokens; at least its last token always runs,
for its logits). A running request's prefix is copied the same way; what a copy takes and what the kept caches
alone hold, the core counts (kv_pages_held_by). A cache whose tokens a newer one extends is dropped (a
conversation keeps one). While a running request still prefills a prefix the prompt shares (the same system
prompt arriving together, the n choices of one request), the prompt waits for it rather than prefilling the same
positions beside it (where that saves prefix_cache.COPY_WAIT_TOKENS or more: shorter prompts are prefilled side by
side); requests behind it in the queue are admitted meanwhile (the choice: PrefixCache.plan in prefix_cache.py,
which keeps the caches; the admission's core calls and the pool's free pages are counted here). A core without
seq_park (a test double) keeps the ended request's slot open instead and rewinds it (seq_rewind) for a prompt
that shares at least half of it. Kept caches give their pages back, least recently used first (a parked one only
its last pages, as many as are asked for: its prefix stays cached), to any request or step that needs them
(admission, a decode step's new page, the launch ahead) before anything else is done for want of them (the one a
prompt copies from after the copy), and all at once to the single path on the GPU (its cache
shares the pool), warm_up and close(). A sequence's numbers are those of a fresh prefill where the engine's
arithmetic does not depend on how the positions were batched (the CPU engine: exactly); on the GPU the cached
positions were computed in other passes, so a near-tie of the logits may break differently.
A failing core call fails exactly the requests in that call (their slots closed); a TinyInferError
stays with those requests, anything else (KeyboardInterrupt raised inside a call, ...) is re-raised by step().

Who drives step(): start() runs a daemon thread while there is work (it ends when idle; a later submit starts
another, so an idle scheduler holds no thread). Without start(), whoever waits on a Request (iteration,
result()) drives the steps itself; `async for` starts the thread (an event loop must never block on a step).

The request side (Request, Delta, TokenLogprob, merge_deltas) lives in request.py; it is re-exported here.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence, Union

from .engine import CHUNK_TOKENS, Completion, Engine, Stats
from .errors import InvalidRequestError, KvCacheFullError, QueueFullError, TinyInferError
from .prefix_cache import PREFIX_CACHE_CPU, PREFIX_CACHE_GPU_PER_SLOT, PrefixCache
from .prefix_cache import pages_for as _pages
from .request import Delta, Request, TokenLogprob, merge_deltas, wake
from .sampling import CoreSampling, SamplingParams, TextAssembler, stop_reason
from .scoring import rows_logprobs
from .totals import Totals
from .trace import Trace

if TYPE_CHECKING:
    from .engine import Prompt


@dataclass
class _Seq:
    """The scheduler's state of one request (touched only by step(), under the engine's lock)."""

    request: Request
    prompt: list[int]
    params: SamplingParams
    sampling: CoreSampling  # the core's SamplingConfig of each next token (seed fixed)
    stop_ids: frozenset
    text: Optional[TextAssembler]
    slot: Optional[int] = None
    length: int = 0  # positions in the slot's cache
    pending: Optional[int] = None  # a sampled token not yet run by seq_step
    fresh: bool = False  # the slot's logits are new (or being computed): a token must be sampled from them
    generated: list[int] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprob]] = None
    # prompt_logprobs: its prompt's, filled while its own prefill runs (on its first Delta, then in its Completion)
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    t_submit: float = 0.0
    t_admit: float = 0.0
    t_first: float = 0.0  # its first token sampled (its prompt has run: the GPU's prefill calls return early)
    cached: int = 0  # prompt tokens its slot held or was copied when admitted (the prefix cache), not prefilled
    preempted: int = 0  # times its slot was taken back mid-decode for want of pages (_preempt)
    stop_reason: Union[int, str, None] = None  # Completion.stop_reason, once a stop id or string ended it
    stop_list: list[int] = field(init=False)  # stop_ids as seq_sample_step takes them
    # what its admission prefills: the prompt; after a preemption the prompt and what it had generated
    feed: list[int] = field(init=False)

    def __post_init__(self) -> None:
        # as seq_sample_step takes them, built once: an id outside int32 matches no token (and would not convert)
        self.stop_list = [t for t in self.stop_ids if 0 <= t < 2**31]
        self.feed = self.prompt

    def config(self) -> object:
        """The core's SamplingConfig for its next token."""
        return self.sampling.at(self.generated)

    @property
    def prefilling(self) -> bool:
        return self.length < len(self.feed) and self.pending is None and (self.preempted > 0 or not self.generated)

    @property
    def scoring(self) -> bool:
        """Its prompt's logprobs are still being computed (SamplingParams.prompt_logprobs): its prefill is its own,
        every row's logits kept (_score), never the batched passes or a cached prefix."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt)


# Request.batches(None): a consumer is woken once per token while at most this many sequences run (see
# Scheduler.adaptive_interval)
STREAM_ROWS = 16
# prompt_logprobs: prompt rows a scoring seq_prefill returns the logits of at once (256 x a 128k vocabulary: 128 MB)
SCORE_ROWS = 256

def _counts_generated(p: SamplingParams) -> bool:
    """Whether sampling with p counts the generated tokens apart from the prompt's (presence / frequency penalties)."""
    return bool(p.presence_penalty or p.frequency_penalty)


def _token_buckets(top: int):
    """The row counts the GPU engine tunes its prefill GEMMs at (cuda::Gemm::bucket), up to top: powers of two
    from 16, and past 128 the half octaves between them (192, 384, 768, ...)."""
    n = 16
    while n <= top:
        yield n
        if n >= 128 and n + n // 2 <= top:
            yield n + n // 2
        n *= 2


class Scheduler:
    """Continuous batching over one Engine's sequence slots. One scheduler per engine (Engine.scheduler is it;
    constructing one registers it there). submit / cancel / properties from any thread."""

    def __init__(self, engine: "Engine", *, max_batch: Optional[int] = None, chunk_tokens: Optional[int] = None,
                 max_waiting: int = 1024, batched_prefill: bool = True, overlap: bool = True,
                 sample_launch: bool = True, mixed_steps: bool = False, prefix_cache: Optional[int] = None,
                 preempt: bool = True, trace: Optional[Trace] = None):
        """chunk_tokens: prompt tokens prefilled per step in all (None: CHUNK_TOKENS of the engine's device).
        batched_prefill: a step's prompt chunks in one seq_prefill_many (every weight read once for all of
        them); False: one seq_prefill each (the A/B reference). overlap: launch the next decode step before a
        step's per-token work, which then runs while the device computes (see the module's docstring); False:
        every step in turn (the A/B reference). sample_launch: with overlap, that launch inside the sampling call
        (seq_sample_step) where the core has it; False: from Python after the sample (the A/B reference).
        mixed_steps: a step's decode rows and prompt chunks in one seq_mixed, and with overlap the waiting
        prompts launched with the next step (needs batched_prefill; see the module's docstring; on the H200,
        through seq_sample_mixed, +1.4% throughput at 64 streams and a lower TTFT p50: docs/perf/serve.md;
        `tinyinfer serve` turns them on). The rows of a mixed pass take the prefill's arithmetic (cuBLASLt over
        the pass, the LM head as a GEMM), so on the GPU a request's tokens may then depend on when others arrive,
        at near-ties of its logits. False (the default): seq_step, then the prefill. prefix_cache: how many ended
        requests' KV caches are kept for later prompts that start with their tokens (see the module's docstring,
        "Prefix cache"); None: PREFIX_CACHE_GPU_PER_SLOT times the engine's slots on the GPU, whose pool is
        allocated anyway (kept caches take only pages, given back to whoever needs them), and PREFIX_CACHE_CPU on
        the CPU, whose pages come from the heap; 0 (or a core without seq_rewind): off.
        preempt: a decode step short of KV pages takes the youngest sequences' slots back and queues them to be
        recomputed (prompt + what they generated) once pages free up (see the module's docstring); False: they
        end with KvCacheFullError. trace: record into it every
        core call the steps make and each request's submit / admit / prefilled / first token / end (trace.py;
        None: nothing recorded, the core called directly)."""
        if not isinstance(engine, Engine):
            raise InvalidRequestError(f"Scheduler: engine must be a tinyinfer.Engine (got {type(engine).__name__})")
        core = engine._core
        if core is None:
            raise InvalidRequestError(f"{engine!r} is closed")
        limit = int(core.max_batch)
        for name, v, lo in (("max_batch", max_batch, 1), ("chunk_tokens", chunk_tokens, 1),
                            ("max_waiting", max_waiting, 0), ("prefix_cache", prefix_cache, 0)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
                raise InvalidRequestError(f"Scheduler: {name} must be an integer >= {lo} (got {v!r})")
        for name, v in (("batched_prefill", batched_prefill), ("overlap", overlap), ("sample_launch", sample_launch),
                        ("mixed_steps", mixed_steps), ("preempt", preempt)):
            if not isinstance(v, bool):
                raise InvalidRequestError(f"Scheduler: {name} must be a bool (got {v!r})")
        if trace is not None and not isinstance(trace, Trace):
            raise InvalidRequestError(f"Scheduler: trace must be a tinyinfer.trace.Trace (got {type(trace).__name__})")
        if max_batch is not None and max_batch > limit:
            raise InvalidRequestError(f"Scheduler: max_batch={max_batch} exceeds the engine's {limit} slots")
        self.max_batch = max_batch or limit
        self.chunk_tokens = chunk_tokens or CHUNK_TOKENS.get(engine.device, CHUNK_TOKENS["cpu"])
        self.max_waiting = max_waiting
        self.batched_prefill = batched_prefill
        self.overlap = overlap
        self.sample_launch = sample_launch
        self.preempt = preempt
        self._marks = hasattr(core, "seq_mark_generated")  # (the engines; not every test double)
        self.mixed_steps = mixed_steps and batched_prefill
        self.prefix_cache = 0 if not hasattr(core, "seq_rewind") else prefix_cache if prefix_cache is not None else (
            PREFIX_CACHE_GPU_PER_SLOT * limit if engine.device == "cuda"
            else PREFIX_CACHE_CPU)  # (a core without seq_rewind: a test double)
        self.trace = trace
        self._engine = engine
        self._page_size = int(core.kv_page_size)
        self._pages_total = int(core.kv_pages_total)
        # _state guards the queues, the id table and the driver thread; the engine's lock (taken by step())
        # guards the core. Order: engine lock, then _state (briefly), never the other way round.
        self._state = threading.Condition()
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # admitted (holding a slot), oldest first
        # the prefix cache (prefix_cache.py): changed under the engine's lock (the hand-over below under
        # _sched_lock); stats() reads its page count and size without it. Copies of a prefix between slots where
        # the core has seq_copy. (prefix_cache, its limit, is fixed here.)
        self._cache = PrefixCache(self.prefix_cache, self._page_size,
                                  copies=self.prefix_cache > 0 and hasattr(core, "seq_copy"),
                                  shares=hasattr(core, "kv_pages_held_by"), parks=hasattr(core, "seq_park"))
        with engine._sched_lock:
            prev = engine._scheduler
            if prev is not None and prev._closed and len(prev._cache):
                # slots its close() could not give back (the engine was busy in that thread): this one owns them
                self._cache.take_over(prev._cache)
        self._totals = Totals()  # what has been served (metrics())
        # a slot closed or copied from this step: the kept caches' own pages are counted again at its end (not every
        # step: the count walks every kept cache's table)
        self._recount = False
        self._cancels: set[str] = set()
        self._live: dict[str, _Seq] = {}  # every request not yet ended, by id
        self._closed = False
        self._started = False
        self._thread: Optional[threading.Thread] = None
        self._reraised: Optional[BaseException] = None  # the last exception step() raised after failing its requests
        # during a step: the asyncio consumers to wake when it ends (event loop -> Events), so a step hands each
        # loop one call_soon_threadsafe rather than one per request (64 self-pipe writes and wake-ups a step)
        self._wakes: Optional[dict] = None
        with engine._sched_lock:
            if engine._scheduler is not None and not engine._scheduler._closed:
                raise InvalidRequestError(f"{engine!r} already has a scheduler (Engine.scheduler)")
            engine._scheduler = self

    # ---- state ----

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        """No request waiting, running or being cancelled (only the prefix cache's kept caches hold KV pages)."""
        with self._state:
            return not self._has_work_locked()

    @property
    def kv_pages_total(self) -> int:
        return self._pages_total

    @property
    def kv_pages_used(self) -> int:
        """Pages the requests hold (not the prefix cache's: those go back to whoever needs them)."""
        core = self._engine._core
        return 0 if core is None else max(self._pages_total - int(core.kv_pages_free) - self._cache.pages, 0)

    @property
    def kv_pages_cached(self) -> int:
        """Pages only the prefix cache's kept caches hold."""
        return self._cache.pages

    def stats(self) -> dict:
        """running, waiting, kv_pages_used, kv_pages_total, and the prefix cache's kv_pages_cached and
        cached_sequences (a server's /health)."""
        return {"running": self.running, "waiting": self.waiting, "kv_pages_used": self.kv_pages_used,
                "kv_pages_total": self.kv_pages_total, "kv_pages_cached": self.kv_pages_cached,
                "cached_sequences": len(self._cache)}

    def metrics(self) -> dict:
        """stats() and what has been served since the scheduler started (totals.py): requests by how they ended,
        prompt, cached and generated tokens, histograms of the time to first token and of a request's time (a
        server's GET /metrics)."""
        return {**self.stats(), **self._totals.snapshot()}

    def _has_work_locked(self) -> bool:
        return bool(self._waiting or self._running or self._cancels)

    def __repr__(self) -> str:
        return (f"Scheduler(running={self.running}, waiting={self.waiting}, max_batch={self.max_batch}, "
                f"chunk_tokens={self.chunk_tokens}{', closed' if self._closed else ''})")

    def adaptive_interval(self) -> int:
        """Deltas per wake-up of a consumer of Request.batches(None): 1 while at most STREAM_ROWS sequences run,
        then one more per STREAM_ROWS (64 running: every 4th token), so the event loop's work per step stays
        about that of STREAM_ROWS streams however many run."""
        return 1 + max(len(self._running) - 1, 0) // STREAM_ROWS

    # ---- submission ----

    def submit(self, prompt: "Prompt", params: Optional[SamplingParams] = None, *,
               request_id: Optional[str] = None) -> Request:
        """Queue a request; it is admitted at the next step that has a slot and pages for it. Checked at once:
        InvalidRequestError (empty prompt, prompt + max_tokens > max_seq_len, bad params, a live id);
        QueueFullError when max_waiting requests already wait (not counting preempted ones)."""
        seq = self._prepare(prompt, params, request_id)
        self._enqueue([seq], bounded=True)
        return seq.request

    def _submit_many(self, prompts: Sequence["Prompt"], params: Sequence[SamplingParams]) -> list[Request]:
        """All checked before any is queued; not bounded by max_waiting (a local batch, not a server's queue)."""
        seqs = [self._prepare(p, sp, None) for p, sp in zip(prompts, params)]
        self._enqueue(seqs, bounded=False)
        return [s.request for s in seqs]

    def _prepare(self, prompt: "Prompt", params: Optional[SamplingParams], request_id: Optional[str]) -> _Seq:
        eng = self._engine
        sp = SamplingParams() if params is None else params
        if not isinstance(sp, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams (got {type(sp).__name__})")
        sp = dataclasses.replace(sp)  # a copy (checked again): the caller may change or reuse theirs
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidRequestError(f"request_id must be a non-empty str (got {request_id!r})")
        ids = eng._prompt_ids(prompt)
        sp = eng._fit(sp, len(ids))
        need = _pages(len(ids) + 1, self._page_size)
        if need > self._pages_total:
            raise InvalidRequestError(f"a prompt of {len(ids)} tokens needs {need} KV pages; the pool has "
                                      f"{self._pages_total}")
        seed = sp.seed if sp.seed is not None else int.from_bytes(os.urandom(4), "little")
        stop_ids = eng._stop_ids(sp)
        sampling = eng._core_sampling(sp, seed)
        rid = request_id or uuid.uuid4().hex
        return _Seq(request=Request(self, rid, ids), prompt=ids, params=sp, sampling=sampling,
                    stop_ids=frozenset(stop_ids), prompt_logprobs=[None] if sp.prompt_logprobs is not None else None,
                    text=eng._text(sp, ids),
                    logprobs=[] if sp.logprobs is not None else None, t_submit=time.perf_counter())

    def _enqueue(self, seqs: list[_Seq], bounded: bool) -> None:
        with self._state:
            if self._closed:
                raise InvalidRequestError("the scheduler is closed")
            if bounded and len(self._waiting) + len(seqs) > self.max_waiting:
                # (preempted requests were admitted once: they wait for pages, not in the server's queue)
                queued = sum(1 for s in self._waiting if not s.preempted)
                if queued + len(seqs) > self.max_waiting:
                    raise QueueFullError(f"{queued} requests already wait (max_waiting={self.max_waiting})")
            seen = set(self._live)
            for s in seqs:
                if s.request.id in seen:
                    raise InvalidRequestError(f"request id {s.request.id!r} is already in use")
                seen.add(s.request.id)
            for s in seqs:
                self._live[s.request.id] = s
                self._waiting.append(s)
                if self.trace is not None:
                    self.trace.event("submit", s.request.id, len(s.prompt), t=s.t_submit)
            self._wake_locked()

    def cancel(self, request_id: str) -> None:
        """End a request (finish_reason "cancelled"). A waiting one ends now; a running one at the next step,
        which frees its pages. An unknown or already ended id is ignored (ending races with cancelling)."""
        if not isinstance(request_id, str):
            raise InvalidRequestError(f"Scheduler.cancel: request_id must be a str (got {type(request_id).__name__})")
        with self._state:
            seq = self._live.get(request_id)
            if seq is None:
                return
            if seq.slot is None and seq in self._waiting:
                self._waiting.remove(seq)
                del self._live[request_id]
                end = seq
            else:
                self._cancels.add(request_id)
                self._wake_locked()
                return
        self._cancelled_waiting(end)

    def _cancelled_waiting(self, seq: _Seq) -> None:
        """A request cancelled before it was admitted (taken off the queue already): its last Delta."""
        self._count(seq, "cancelled")
        if self.trace is not None:
            self.trace.event("end", seq.request.id, len(seq.generated), "cancelled")
        seq.request._put(Delta("", [], [] if seq.logprobs is not None else None, self._completion(seq, "cancelled")))

    # ---- before serving ----

    def warm_up(self, prompt_tokens: Optional[int] = None, max_batch: Optional[int] = None) -> float:
        """Do now, before any request, what the GPU engine otherwise does on the first use of each shape: tune the
        prefill GEMMs of every token bucket (16, 32, 64, 128, 192, 256, 384, ... as cuda::Gemm::bucket, up to
        prompt_tokens, default chunk_tokens, and
        max_seq_len: cuBLASLt tactics, kept in the tactics file) and tune + capture the batched decode step of
        every bucket up to max_batch (default the scheduler's), so no request waits for them (docs/perf/serve.md).
        Prompts of token 0 in slots opened and closed
        here (the pool as it was); call it while no request runs. Returns the seconds it took."""
        for name, v in (("prompt_tokens", prompt_tokens), ("max_batch", max_batch)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InvalidRequestError(f"Scheduler.warm_up: {name} must be None or an integer >= 1 (got {v!r:.40})")
        t0 = time.perf_counter()
        eng = self._engine
        top_prompt = min(prompt_tokens or self.chunk_tokens, eng.max_seq_len - 1)
        top_batch = min(max_batch or self.max_batch, self.max_batch)
        with eng._exclusive():
            core = eng._core
            with self._state:
                if self._running or self._waiting:
                    raise InvalidRequestError("Scheduler.warm_up: requests are running; call it before serving")
            if int(core.position) > 0:
                core.reset()  # (the single path's pages back to the pool, as _admit does)
            self._cache.drop_all(core)
            free = int(core.kv_pages_free)  # a small pool bounds what can run: warm what fits
            top_prompt = min(top_prompt, free * self._page_size - 1)
            top_batch = min(top_batch, free)
            for n in _token_buckets(top_prompt):
                slot = int(core.seq_open())
                try:
                    core.seq_prefill(slot, [0] * n)
                finally:
                    core.seq_close(slot)
            # the batch buckets, and past 128 the GEMM buckets between them (the LM-head GEMM over that many
            # finished prompts or mixed rows)
            buckets = {min(1 << i, top_batch) for i in range(top_batch.bit_length() + 1)}
            for b in sorted(buckets | {n for n in _token_buckets(top_batch) if n > 128}):
                slots = [int(core.seq_open()) for _ in range(b)]
                try:
                    core.seq_prefill_many(slots, [[0]] * b)
                    core.seq_step(slots, [0] * b)
                    if self.mixed_steps and b > 1:  # (the LM-head GEMM over b gathered rows)
                        core.seq_mixed(slots[1:], [0] * (b - 1), slots[:1], [[0]])
                finally:
                    for s in slots:
                        core.seq_close(s)
            eng._tactics.save(core)
        return time.perf_counter() - t0

    # ---- the driver thread ----

    def start(self) -> None:
        """Drive step() from a daemon thread whenever there is work (idempotent)."""
        with self._state:
            if self._closed:
                return
            self._started = True
            self._wake_locked()

    def _has_driver(self) -> bool:
        with self._state:
            return self._started and not self._closed or self._thread is not None

    def _wake_locked(self) -> None:
        if self._started and self._thread is None and self._has_work_locked():
            self._thread = threading.Thread(target=self._drive, name="tinyinfer-scheduler", daemon=True)
            self._thread.start()
        self._state.notify_all()

    def _drive(self) -> None:
        while True:
            with self._state:
                if not self._has_work_locked():
                    self._thread = None
                    self._state.notify_all()
                    return
            try:
                self.step()
            except BaseException as e:  # noqa: BLE001 (the thread must outlive any one failure)
                if e is not self._reraised:  # not pinned on the requests it hit: fail all, rather than spin
                    self._fail_all(e)

    def close(self) -> None:
        """Cancel every request in flight (their slots closed), stop the thread; later submits are refused."""
        with self._state:
            if self._closed and not self._live:
                return
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            for s in waiting:
                self._live.pop(s.request.id, None)
            self._cancels.update(s.request.id for s in self._running)
            thread = self._thread
        for s in waiting:
            self._cancelled_waiting(s)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        elif thread is None and self._running and not self._engine.closed:
            self.step()
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Drop the prefix cache's kept caches now (their pages back to the pool), as vLLM's reset_prefix_cache."""
        eng = self._engine
        if len(self._cache) and not eng.closed:
            try:
                with eng._exclusive():
                    self._cache.drop_all(eng._core)
            except InvalidRequestError:  # closed meanwhile, or this thread's own unfinished stream holds the engine
                pass  # (a later Scheduler of this engine takes the slots over)
        if eng.closed:  # (its slots went with the core)
            self._cache.forget()

    # ---- one step ----

    def step(self) -> bool:
        """One iteration (see the module's docstring). False when there was nothing to do."""
        with self._state:
            if not self._has_work_locked():
                return False
        eng = self._engine
        if eng.closed:  # closed under us: nothing can run; the requests end with the reason
            self._fail_all(InvalidRequestError(f"{eng!r} is closed"))
            return False
        try:
            with eng._exclusive():
                self._wakes = {}
                try:
                    self._step_locked(eng._core if self.trace is None else self.trace.wrap(eng._core))
                finally:
                    if (self._recount or self._cache.stale) and not eng.closed:  # (the kept caches' pages: what
                        self._recount = False  # the step's ends, copies, evictions and preemptions left shared or not)
                        try:
                            self._cache.recount(eng._core)
                        except TinyInferError:  # (a failing step's error is the one to see)
                            pass
                    wakes, self._wakes = self._wakes, None
                    for loop, events in wakes.items():
                        wake(loop, events)
        finally:
            with self._state:
                self._state.notify_all()  # wait_idle() looks again
        return True

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Wait until no request waits or runs (all slots closed); without a driver thread, drive the steps.
        False on timeout."""
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                    or not timeout >= 0):
            raise InvalidRequestError(f"Scheduler.wait_idle: timeout must be None or a number >= 0 "
                                      f"(got {timeout!r:.40})")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._state:
                if not self._has_work_locked():
                    return True
                if self._started and not self._closed or self._thread is not None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._state.wait(left)
                    continue
            if deadline is not None and time.monotonic() > deadline:
                return False
            self.step()

    def _step_locked(self, core) -> None:
        with self._state:
            cancels, self._cancels = self._cancels, set()
            # a request preempted (back in the queue) while its cancel was on its way, or by the step close() waited on
            gone = [s for s in self._waiting if s.request.id in cancels]
            for s in gone:
                self._waiting.remove(s)
                self._live.pop(s.request.id, None)
        for seq in gone:
            self._cancelled_waiting(seq)
        for seq in [s for s in self._running if s.request.id in cancels]:
            self._end(core, seq, "cancelled")
        stepping = [s for s in self._running if s.pending is not None]
        stepping = self._pages_for_decode(core, stepping)
        self._admit(core, decode_pages=sum(1 for s in stepping if s.length % self._page_size == 0))
        chunks = self._chunks(len(stepping) if self.mixed_steps else 0)
        if self.mixed_steps and chunks and not stepping and any(s.fresh for s in self._running):
            # the running sequences' next step was launched ahead before these prompts came: they ride in the
            # next launch ahead (this step's sample), mixed, rather than in a pass of their own
            chunks = []
        if not (stepping and chunks and self.mixed_steps and self._mixed(core, stepping, chunks)):
            if stepping and self._core_call(core, stepping, lambda: core.seq_step([s.slot for s in stepping],
                                                                                      [s.pending for s in stepping])):
                self._stepped(stepping)
            self._prefill(core, chunks)
        # (what the step's other chunks left, but at least half a step's worth, as _chunks: scoring always advances)
        self._score(core, max(self.chunk_tokens - sum(len(c) for _, c in chunks), (self.chunk_tokens + 1) // 2))
        sampling = [s for s in self._running if s.fresh]
        if sampling:
            self._sample(core, sampling)

    @staticmethod
    def _stepped(seqs: list[_Seq]) -> None:
        for s in seqs:
            s.length, s.pending, s.fresh = s.length + 1, None, True

    def _mixed(self, core, stepping: list[_Seq], chunks: list[tuple[_Seq, list[int]]]) -> bool:
        """Steps 3 and 4 in one seq_mixed. False when the core refused it with a TinyInferError (it checks the
        whole call before it runs any of it): the separate calls then pin the error on the request(s) it belongs
        to, exactly as without mixed steps."""
        ok = False

        def call() -> None:
            nonlocal ok
            try:
                core.seq_mixed([s.slot for s in stepping], [s.pending for s in stepping],
                               [s.slot for s, _ in chunks], [c for _, c in chunks])
                ok = True
            except TinyInferError:
                pass
        self._core_call(core, stepping + [s for s, _ in chunks], call)  # (anything else: all end, re-raised)
        if ok:
            self._stepped(stepping)
            self._prefilled(chunks)
        return ok

    def _owed(self) -> int:
        """Pages the admitted prompts still need for their remaining chunks (+ their first generated position)."""
        ps = self._page_size
        return sum(_pages(len(s.feed) + 1, ps) - _pages(s.length, ps) for s in self._running if s.prefilling)

    def _pages_for_decode(self, core, stepping: list[_Seq]) -> list[_Seq]:
        """The sequences that can run this step. Running sequences come first for pages: when the pool cannot
        give each one whose next position opens a page its page, admitted requests still in their prompt go
        back to the queue (youngest first; they have shown nothing yet, so starting over later is invisible);
        if that is not enough, the youngest decoding sequences by submission are preempted (_preempt), and one
        that needs a page and cannot be preempted ends with KvCacheFullError."""
        needy = [s for s in stepping if s.length % self._page_size == 0]
        if not needy:  # (the common case: no page opens; nothing to count)
            return stepping
        free = int(core.kv_pages_free) - self._owed()
        while len(needy) > free and len(self._cache):
            free += self._cache.evict_lru(core, want=len(needy) - free)
        while len(needy) > free:  # (not one preempted before: its prefill recomputes what its client has seen)
            back = next((s for s in reversed(self._running) if s.prefilling and not s.preempted), None)
            if back is None:
                break
            free += _pages(len(back.feed) + 1, self._page_size) - _pages(back.length, self._page_size)  # owed
            before = int(core.kv_pages_free)
            self._requeue(core, back)
            free += int(core.kv_pages_free) - before  # what it held alone (a copy's shared pages stay held)
        # then the youngest decoding sequences (by submission, whether or not they need a page: vLLM's order),
        # preempted (recomputed later), or ended where they cannot be
        victims = sorted(stepping, key=lambda s: s.t_submit)
        while len(needy) > free and victims:
            s = victims.pop()
            wanted = s in needy
            if not wanted and not self._preemptible(s):
                continue  # (ended only for a page of its own)
            if wanted:
                needy.remove(s)
            before = int(core.kv_pages_free)
            if self._preemptible(s):
                self._preempt(core, s)
            else:
                msg = (f"request {s.request.id!r} ran out of KV pages after {len(s.generated)} generated tokens "
                       f"({self._pages_total} pages of {self._page_size} positions, all in use)")
                self._end(core, s, "length", error=KvCacheFullError(msg))
            free += int(core.kv_pages_free) - before  # (what it held alone)
        return [s for s in stepping if s.slot is not None]

    def _preemptible(self, seq: _Seq) -> bool:
        """Whether a decoding sequence out of pages can be preempted rather than ended: its prompt and answer so far
        fit the pool, and where its sampling counts the generated tokens apart from the prompt's (presence /
        frequency penalties), the core can mark them so again after they are prefilled as prompt."""
        return (self.preempt and (not _counts_generated(seq.params) or self._marks)
                and _pages(len(seq.prompt) + len(seq.generated) + 1, self._page_size) <= self._pages_total)

    def _preempt(self, core, seq: _Seq) -> None:
        """Its slot taken back for want of pages (vLLM's recompute preemption): to the head of the queue, to prefill
        its prompt and what it generated once pages free up, then sample on with the same counter (a seeded request
        samples what it would have; its client sees only a pause)."""
        slot, seq.slot = seq.slot, None
        self._recount = True
        try:
            core.seq_close(slot)
        except TinyInferError:
            pass
        seq.feed = seq.prompt + seq.generated  # (the last token was sampled, not yet run: the prefill runs it)
        seq.length, seq.pending, seq.fresh = 0, None, False
        seq.preempted += 1
        with self._state:
            self._running.remove(seq)
            self._waiting.appendleft(seq)
        self._totals.preempted()
        if self.trace is not None:
            self.trace.event("preempt", seq.request.id, len(seq.generated))

    def _requeue(self, core, seq: _Seq) -> None:
        """Un-admit a request still in its prompt: slot closed (pages back), to the head of the queue."""
        self._recount = True
        slot, seq.slot, seq.length = seq.slot, None, 0
        if not seq.preempted:  # (a preempted request keeps its first admission's count)
            seq.cached = 0
        if slot is not None:
            try:
                core.seq_close(slot)
            except TinyInferError:
                pass
        with self._state:
            self._running.remove(seq)
            self._waiting.appendleft(seq)

    def _need(self, core, seq: _Seq, kind: str, src: Optional[int], cached: int) -> int:
        """The free pages admitting `seq` as planned takes: its prompt's pages (+ its first generated position)
        past the `cached` positions it starts from, plus what a copy takes (the part of a page it copies, or every
        page where the core copies them all), less what a rewind of kept slot `src` gives back."""
        ps = self._page_size
        if kind not in ("copy", "rewind"):
            return _pages(len(seq.feed) + 1, ps)
        grow = _pages(len(seq.feed) + 1, ps) - _pages(cached, ps)
        if kind == "copy":
            return grow + self._cache.copy_takes(cached)
        return grow - self._cache.rewind_frees(core, src, cached)

    def _admit(self, core, decode_pages: int) -> None:
        if not self._waiting:  # (read without the lock: a request queued meanwhile waits for the next step)
            return
        if int(core.position) > 0:
            # the single-sequence path's cache (the GPU engine's shares the pool) serves only a next single call
            # that extends it (Engine._cached_prefix): give its pages back before asking for more
            core.reset()
        free = int(core.kv_pages_free) - self._owed() - decode_pages
        ahead = 0  # requests left at the head of the queue, each waiting for a prefix in flight to copy
        while len(self._running) < self.max_batch:
            with self._state:
                if len(self._waiting) <= ahead or ahead >= self.max_batch:  # (a burst sharing a prefix: the scan
                    return  # stops after a batch's worth of waiting ones, each planned again at every step)
                seq = self._waiting[ahead]
                kind, src, cached = self._cache.plan(seq.feed, self._running, int(core.max_batch))
                if seq.scoring:  # (every prompt row's logits: nothing taken from a cache)
                    kind, src, cached = "fresh", None, 0
                    seq.prompt_logprobs = [None]  # (again from its start: a preemption mid-prompt)
                if kind == "wait":
                    ahead += 1  # it copies that prefix once prefilled (a step or a few); those behind it go on
                    continue
                spare = src if src in self._cache else None  # (a kept cache it rewinds or copies from stays)
                slot = src if kind == "rewind" else None
                need = self._need(core, seq, kind, src, cached)
                if need > free and kind == "copy" and spare is not None and not self._cache.parks:
                    # short of pages: into that kept slot after all, rather than evicting other caches for a copy
                    kind, slot = "rewind", src
                    need = self._need(core, seq, kind, src, cached)
                while need > free and len(self._cache) > (spare is not None):
                    free += self._cache.evict_lru(core, spare=spare, want=need - free)
                    need = self._need(core, seq, kind, src, cached)  # (a rewound slot may own more pages now)
                drop_src = False
                if need > free and kind == "copy" and spare is not None and self._cache.parks:
                    # what it lacks are the parked source's own pages: copied from, then dropped (giving back at least
                    # the pages it alone holds less those the copy shares). The copy comes first, so the partly
                    # filled page it copies must be free now; else it stops at a page boundary (none: the source
                    # dropped, the prompt prefilled whole). Where even that is short, the source stays: dropping it
                    # first never fits what copying first does not.
                    ps = self._page_size
                    if self._cache.copy_takes(cached) > int(core.kv_pages_free):
                        cached -= cached % ps
                    frees = self._cache.drop_frees(core, src, cached)
                    if cached == 0:
                        kind = "fresh"
                    need = self._need(core, seq, kind, src, cached)
                    if need - frees <= free:
                        if kind == "fresh":
                            free += self._cache.drop(core, src)
                            src = spare = None
                        else:
                            need, drop_src = need - frees, True
                if need > free and self._running:
                    return  # it waits for pages; so do those behind it (first come, first served)
                del self._waiting[ahead]
                if need > free:  # nothing runs that could free pages: waiting would never end
                    more = f" (beyond its {cached} cached positions)" if cached else ""
                    err = KvCacheFullError(f"request {seq.request.id!r} needs {need} KV pages{more} and only "
                                           f"{free} are free with nothing running")
                else:
                    self._running.append(seq)
                    free -= need
                    err = None
            if err is not None:
                self._end(core, seq, "length", error=err)
                continue
            refused = False  # a rewind or copy the engine refused (a page it could not take): the slot prefills all
            try:
                if slot is not None:
                    self._cache.take(slot, core)
                    self._recount = True  # (what the rewind frees or copies may leave a kept cache's pages its own)
                    try:
                        core.seq_rewind(slot, seq.feed[:cached])
                        seq.slot, seq.length = slot, cached
                        seq.cached = cached if not seq.preempted else seq.cached
                    except InvalidRequestError:
                        refused = True
                        try:
                            core.seq_close(slot)
                        except TinyInferError:
                            pass
                        slot = None
                if slot is None:
                    if len(self._running) - 1 + self._cache.slots >= int(core.max_batch):
                        # every slot is running or kept: the least recently used goes (not the one copied from)
                        free += self._cache.evict_lru(core, spare=src if kind == "copy" else None)
                    seq.slot = int(core.seq_open())
                    if kind == "copy":
                        self._recount = True
                        try:
                            core.seq_copy(seq.slot, src, seq.feed[:cached])
                            seq.length = cached
                            seq.cached = cached if not seq.preempted else seq.cached
                        except InvalidRequestError:
                            refused = True
                        if drop_src:
                            free += self._cache.drop(core, src) - frees  # (what it gave back beyond the count)
                        elif src in self._cache:
                            self._cache.touch(src)
                if seq.preempted and _counts_generated(seq.params):  # (its answer so far: prefilled as prompt)
                    core.seq_mark_generated(seq.slot, seq.generated)
            except BaseException:
                self._requeue(core, seq)
                raise
            if refused:  # its whole prompt's pages now (the copy's shared pages were not all it needed): counted anew
                free = int(core.kv_pages_free) - self._owed() - decode_pages
                while free < 0 and len(self._cache):
                    free += self._cache.evict_lru(core, want=-free)
                if free < 0 and len(self._running) > 1:
                    self._requeue(core, seq)  # it waits for pages, at the head of the queue
                    return
            if not seq.preempted:  # (a preempted request's prefill time stays its first admission's)
                seq.t_admit = time.perf_counter()
            if self.trace is not None:
                self.trace.event("admit", seq.request.id, t=time.perf_counter())

    def _chunks(self, rows: int = 0) -> list[tuple[_Seq, list[int]]]:
        """This step's prompt chunks: the admitted prompts oldest first, chunk_tokens tokens in all, less the `rows`
        decode rows of a mixed call riding in the same pass (a pass holds chunk_tokens rows by default: one more
        would read every weight again for a few tokens), but never less than half of it (prompts always advance)."""
        budget = max(self.chunk_tokens - rows, (self.chunk_tokens + 1) // 2)
        chunks: list[tuple[_Seq, list[int]]] = []
        for seq in [s for s in self._running if s.prefilling and not s.scoring]:
            if budget <= 0:
                break
            n = min(budget, len(seq.feed) - seq.length)
            chunks.append((seq, seq.feed[seq.length:seq.length + n]))
            budget -= n
        return chunks

    def _prefill(self, core, chunks: list[tuple[_Seq, list[int]]]) -> None:
        """The chunks in ONE seq_prefill_many (batched_prefill), else one seq_prefill each."""
        if not chunks:
            return
        done = None
        if self.batched_prefill and len(chunks) > 1:
            def many() -> None:
                nonlocal done
                try:
                    core.seq_prefill_many([s.slot for s, _ in chunks], [c for _, c in chunks])
                    done = chunks
                except TinyInferError:
                    # The engine checks the whole call before it runs any of it: one call each below pins the
                    # error on the request(s) it belongs to, exactly as without the batched call.
                    pass
            self._core_call(core, [s for s, _ in chunks], many)  # (anything else: all of them end, re-raised)
        if done is None:
            done = [(seq, chunk) for seq, chunk in chunks
                    if self._core_call(core, [seq], lambda seq=seq, chunk=chunk: core.seq_prefill(seq.slot, chunk))]
        self._prefilled(done)

    def _score(self, core, budget: int) -> None:
        """The prompt chunks of requests that asked for prompt_logprobs: seq_prefill calls that return every row's
        logits (SCORE_ROWS rows a call: (rows, vocab) float32 on the host), read at once as the logprob of the
        prompt token after each row; `budget` rows in all, oldest first."""
        for seq in [s for s in self._running if s.scoring and s.prefilling]:
            while budget > 0 and seq.slot is not None and seq.prefilling:
                n = min(SCORE_ROWS, budget, len(seq.feed) - seq.length)
                chunk = seq.feed[seq.length:seq.length + n]
                out: list = []
                if not self._core_call(core, [seq], lambda: out.append(core.seq_prefill(seq.slot, chunk,
                                                                                        all_logits=True))):
                    break
                at = seq.length + 1  # row i: the token at position seq.length + i + 1
                rows = out[0][:max(0, min(n, len(seq.prompt) - at))]
                seq.prompt_logprobs += rows_logprobs(rows, seq.prompt[at:at + len(rows)], seq.params.prompt_logprobs)
                self._prefilled([(seq, chunk)])
                budget -= n

    def _prefilled(self, done: list[tuple[_Seq, list[int]]]) -> None:
        now = time.perf_counter() if self.trace is not None else 0.0
        for seq, chunk in done:
            seq.length += len(chunk)
            if seq.length == len(seq.feed):
                seq.fresh = True
                if self.trace is not None:
                    self.trace.event("prefilled", seq.request.id, t=now)

    def _sample(self, core, seqs: list[_Seq]) -> None:
        k = max((s.params.logprobs or 0) for s in seqs)
        args = ([s.slot for s in seqs], [s.config() for s in seqs], [len(s.generated) for s in seqs], k)
        mixed = self._mixed_ahead(core, seqs) if self.overlap else None
        go_on = self._go_on(core, seqs) if self.overlap and mixed is None else None
        out = []
        if mixed is not None:  # the launch ahead, with the waiting prompts, inside the core's call
            go, chunks = mixed
            ok = self._core_call(core, seqs + [s for s, _ in chunks], lambda: out.append(core.seq_sample_mixed(
                *args, go, [s.slot for s, _ in chunks], [c for _, c in chunks])))
        elif go_on is not None:  # the launch ahead inside the core's call (seq_sample_step)
            ok = self._core_call(core, seqs, lambda: out.append(core.seq_sample_step(
                *args, go_on, [s.stop_list for s in seqs])))
        else:
            ok = self._core_call(core, seqs, lambda: out.append(core.seq_sample(*args)))
        if not ok:
            return
        tokens, lps, top_ids, top_lps = out[0][:4]
        toks = tokens.tolist()
        for seq in seqs:
            seq.fresh = False
        if mixed is not None or go_on is not None:
            ahead, failed = set(), None
            for seq, stepped in zip(seqs, out[0][4].tolist()):
                if stepped:
                    seq.length += 1
                    seq.fresh = True
                    ahead.add(id(seq))
            if mixed is not None and out[0][6]:
                self._prefilled(mixed[1])
        else:
            ahead, failed = self._step_ahead(core, seqs, toks) if self.overlap else ((), None)
        for i, seq in enumerate(seqs):
            if seq.slot is None:  # ended by a failed launch ahead
                continue
            lp = None
            if seq.logprobs is not None:
                n = seq.params.logprobs
                top = [(int(top_ids[i][j]), float(top_lps[i][j])) for j in range(n)]
                lp = TokenLogprob(toks[i], float(lps[i]), [e for e in top if e[0] >= 0])  # -1: past vocab
            self._take(core, seq, toks[i], lp, id(seq) in ahead)
        if failed is not None:
            raise failed

    def _mixed_ahead(self, core, seqs: list[_Seq]) -> Optional[tuple[list[bool], list[tuple[_Seq, list[int]]]]]:
        """For the launch ahead inside seq_sample_mixed (mixed steps, prompts waiting or being prefilled): the
        rows that go on (not being cancelled, a token left after this one; a row that draws a stop id steps too,
        for nothing, and ends) and the prompt chunks that ride with them, admitted as step 2 would. None: no
        such launch (not mixed, the core has no seq_sample_mixed, no prompt or no row to carry, short of pages)."""
        if not (self.mixed_steps and self.sample_launch and hasattr(core, "seq_sample_mixed")):
            return None
        if not (self._waiting or any(s.prefilling for s in self._running)):
            return None
        with self._state:
            cancels = self._cancels
            go = [self._goes_on(s, cancels) for s in seqs]
        needy = self._pages_opened([s for s, g in zip(seqs, go) if g])
        if not any(go) or self._short_of_pages(core, needy):
            return None
        self._admit(core, decode_pages=needy)
        chunks = self._chunks(sum(go))
        return (go, chunks) if chunks else None

    def _go_on(self, core, seqs: list[_Seq]) -> Optional[list[bool]]:
        """For the launch ahead inside seq_sample_step: per sequence, whether it goes on unless its token is a
        stop id (not being cancelled, a token left after this one; and the pool has the pages those next
        positions open, after what the admitted prompts are owed: else none goes on, as _step_ahead decides).
        None: the launch ahead is _step_ahead's, after the sample — sample_launch off, the core has no
        seq_sample_step, or with mixed steps on a core without seq_sample_mixed prompts wait or are being
        prefilled (they ride in that launch: a seq_mixed)."""
        if not (self.sample_launch and hasattr(core, "seq_sample_step")):
            return None
        if self.mixed_steps and not hasattr(core, "seq_sample_mixed") and (
                self._waiting or any(s.prefilling for s in self._running)):
            return None  # (with seq_sample_mixed, _mixed_ahead has found no prompt that could ride now)
        with self._state:
            cancels = self._cancels
            go = [self._goes_on(s, cancels) for s in seqs]
        if self._short_of_pages(core, self._pages_opened([s for s, g in zip(seqs, go) if g])):
            return [False] * len(seqs)  # step 3 decides who gets them
        return go

    @staticmethod
    def _goes_on(seq: _Seq, cancels: set) -> bool:
        """A step after this token, unless the token is a stop id: a token left after it, not being cancelled."""
        return len(seq.generated) + 1 < seq.params.max_tokens and seq.request.id not in cancels

    def _pages_opened(self, seqs: list[_Seq]) -> int:
        """Pages these sequences' next positions open (one each whose length fills its last page)."""
        return sum(1 for s in seqs if s.length % self._page_size == 0)

    def _short_of_pages(self, core, needy: int) -> bool:
        """The pool lacks `needy` pages after what the admitted prompts are owed, even with the prefix cache's
        slots given back (nothing is launched ahead)."""
        while needy > 0 and needy > int(core.kv_pages_free) - self._owed() and len(self._cache):
            self._cache.evict_lru(core, want=needy - (int(core.kv_pages_free) - self._owed()))
        return needy > 0 and needy > int(core.kv_pages_free) - self._owed()

    def _step_ahead(self, core, seqs: list[_Seq], toks: list[int]) -> tuple[set, Optional[BaseException]]:
        """Launch the next decode step of the sequences sure to go on after these tokens (the module's docstring,
        "Overlap"); they are then as after step 3 (fresh logits coming, no pending token). Returns their id()s,
        and what a failed launch raised that must be re-raised once the step's deltas are out."""
        with self._state:
            cancels = self._cancels
            ahead = [(s, t) for s, t in zip(seqs, toks) if t not in s.stop_ids and self._goes_on(s, cancels)]
        if not ahead:
            return set(), None
        needy = self._pages_opened([s for s, _ in ahead])
        if self._short_of_pages(core, needy):
            return set(), None  # short of pages: step 3 decides who gets them
        chunks = []
        if self.mixed_steps:  # the waiting prompts ride in this launch (admitted as step 2 would)
            try:
                self._admit(core, decode_pages=needy)
            except BaseException as e:  # nothing launched: these tokens are still taken, then it is re-raised
                self._reraised = e
                return set(), e
            chunks = self._chunks(len(ahead))
        try:
            if chunks:
                core.seq_mixed([s.slot for s, _ in ahead], [t for _, t in ahead], [s.slot for s, _ in chunks],
                               [c for _, c in chunks])
            else:
                core.seq_step([s.slot for s, _ in ahead], [t for _, t in ahead])
        except TinyInferError:
            return set(), None  # (the core checks before it launches anything: step 3 meets it again)
        except BaseException as e:  # state unknown: as _core_call, these requests end with it
            for s in [s for s, _ in ahead] + [s for s, _ in chunks]:
                self._end(core, s, "error", error=e)
            self._reraised = e
            return set(), e
        for s, _ in ahead:
            s.length += 1
            s.fresh = True
        self._prefilled(chunks)
        return {id(s) for s, _ in ahead}, None

    def _take(self, core, seq: _Seq, tok: int, lp: Optional[TokenLogprob], stepped: bool = False) -> None:
        """One generated token: the checks Engine.generate makes, a Delta, and the end when it is the last.
        stepped: its next step is launched already (the token is in flight, not pending)."""
        seq.generated.append(tok)
        if len(seq.generated) == 1:
            seq.t_first = time.perf_counter()
            if self.trace is not None:
                self.trace.event("first", seq.request.id, t=seq.t_first)
        if lp is not None:
            seq.logprobs.append(lp)
        stop_id = tok in seq.stop_ids
        finish = "stop" if stop_id else None
        if finish:
            seq.stop_reason = stop_reason(seq.params, tok, self._engine.config.eos_token_ids)
        else:
            try:
                if seq.sampling.finished(seq.generated):  # a complete grammar (structured outputs)
                    finish = "stop"
            except InvalidRequestError as e:  # the grammar refused the token: this request's error alone
                self._end(core, seq, "error", error=e)
                return
        last = finish is not None or len(seq.generated) >= seq.params.max_tokens
        piece = ""
        if seq.text is not None:
            piece = seq.text.add([] if stop_id else [tok], final=last)
            if seq.text.stopped:
                finish, seq.stop_reason = "stop", seq.text.stop_string
        if finish is None and last:
            finish = "length"
        first = seq.prompt_logprobs if len(seq.generated) == 1 else None  # (the prompt's, on the first Delta)
        if finish is None:
            if not stepped:
                seq.pending = tok
            seq.request._put(Delta(piece, [tok], None if lp is None else [lp], prompt_logprobs=first), self._wakes)
        else:
            self._end(core, seq, finish, piece=piece, last_ids=[tok], last_lp=None if lp is None else [lp],
                      prompt_logprobs=first)

    # ---- ending ----

    def _core_call(self, core, seqs: list[_Seq], call) -> bool:
        """call(); if it raises, the sequences it was for are in an unknown state: they end with the error (their
        slots closed). A TinyInferError stays with them (False); anything else is re-raised."""
        try:
            call()
            return True
        except BaseException as e:
            for s in seqs:
                self._end(core, s, "error", error=e)
            if isinstance(e, TinyInferError):
                return False
            self._reraised = e
            raise

    def _end(self, core, seq: _Seq, finish: str, *, error: Optional[BaseException] = None, piece: str = "",
             last_ids: Sequence[int] = (), last_lp: Optional[list] = None, prompt_logprobs=None) -> None:
        """The request ends: its slot is closed now (or kept by the prefix cache, holding what ran: its cache is
        sound unless an error ended it), then its last Delta (or its error) is pushed. Once: a request already
        ended (two threads failing the same live requests: _fail_all) is left as it is."""
        with self._state:
            if self._live.get(seq.request.id) is not seq:
                return
        if seq.slot is not None:
            slot, seq.slot = seq.slot, None
            self._recount = True
            if error is None and self.prefix_cache > 0 and seq.length > 0:
                self._cache.keep(core, slot, (seq.prompt + seq.generated)[:seq.length])
            else:
                try:
                    core.seq_close(slot)
                except TinyInferError:  # a slot the core no longer knows: nothing left to free
                    pass
        with self._state:
            if seq in self._running:
                self._running.remove(seq)
            self._live.pop(seq.request.id, None)
        self._count(seq, finish if error is None or isinstance(error, KvCacheFullError) else "error")
        if self.trace is not None:
            self.trace.event("end", seq.request.id, len(seq.generated), finish)
        if error is not None:
            if isinstance(error, KvCacheFullError):
                error.completion = self._completion(seq, finish)
            seq.request._put(error, self._wakes)
            return
        if last_lp is None and seq.logprobs is not None:
            last_lp = []
        seq.request._put(Delta(piece, list(last_ids), last_lp, self._completion(seq, finish), prompt_logprobs),
                         self._wakes)

    def _fail_all(self, error: BaseException) -> None:
        """End every live request with `error` (the engine closed under us, or a failure step() could not pin
        on the requests it hit); their slots are closed under the engine's lock while the core is there."""
        with self._state:
            seqs = list(self._live.values())
            self._waiting.clear()
            self._cancels.clear()
        eng = self._engine
        if not eng.closed:
            try:
                with eng._exclusive():
                    for s in seqs:
                        self._end(eng._core, s, "error", error=error)
                    self._cache.recount(eng._core)  # (pages their slots shared with kept ones: the kept caches' now)
                return
            except InvalidRequestError:  # closed meanwhile: its slots went with it
                pass
        for s in seqs:
            s.slot = None
            self._end(None, s, "error", error=error)

    def _count(self, seq: _Seq, end: str) -> None:
        now = time.perf_counter()
        self._totals.add(end, len(seq.prompt), seq.cached, len(seq.generated),
                         seq.t_first - seq.t_submit if seq.t_first else None, now - seq.t_submit)

    def _completion(self, seq: _Seq, finish: str) -> Completion:
        now = time.perf_counter()
        started = seq.t_first or now
        stats = Stats(prompt_tokens=len(seq.prompt), cached_tokens=seq.cached,
                      prefill_ms=(seq.t_first - seq.t_admit) * 1e3 if seq.t_first else 0.0,
                      decode_tokens=len(seq.generated), decode_s=now - started, wall_s=now - seq.t_submit)
        return Completion(text=seq.text.text if seq.text is not None else "", token_ids=list(seq.generated),
                          finish_reason=finish, stop_reason=seq.stop_reason if finish == "stop" else None,
                          prompt_token_ids=seq.prompt, stats=stats,
                          logprobs=None if seq.logprobs is None else list(seq.logprobs),
                          # (None where it ended before its prompt was scored: cancelled, failed)
                          prompt_logprobs=None if seq.scoring else seq.prompt_logprobs)


__all__ = ["Scheduler", "Request", "Delta", "TokenLogprob", "merge_deltas"]
