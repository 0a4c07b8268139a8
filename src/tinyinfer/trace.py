"""A timeline recorder for the scheduler: what the core ran when, and what happened to each request.

    trace = Trace()
    sched = Scheduler(engine, trace=trace)      # or `tinyinfer serve --trace FILE`
    ...
    trace.save("serve.json")                    # bench/tools/serve_timeline.py reads it

Two lists of tuples, appended as things happen (a list append is atomic under the GIL, so the scheduler's thread
and the server's event loop share them without a lock; the cost is a perf_counter() and an append, ~0.2 us):
  calls:  (name, t_start, t_end, n) for each core call the scheduler makes through the wrapper (CORE_CALLS);
          n is the rows of a seq_step / seq_sample, the prompt tokens of a seq_prefill(_many) or a seq_mixed
          (whose decode rows its seq_sample counts), else 0; a seq_sample_step (seq_sample_mixed) is recorded as its
          seq_sample and the seq_step (seq_mixed) it launched, split at the launch's own host time, which the
          core reports;
  events: (kind, t, request id, a, b). From the scheduler: "submit" (a = prompt tokens), "admit" (a slot
          opened), "prefilled" (the call with the prompt's last chunk
          returned: on the GPU, once launched), "first" (the first token sampled), "preempt" (its slot taken
          back for want of KV pages, a = tokens generated; "admit" and "prefilled" come again when it resumes),
          "end" (a = tokens generated, b = the finish reason). From the server, under the HTTP call's id (its choices' scheduler
          ids are "<id>-<k>"): "http_start" (the handler began), "http_first" (the event loop has the first
          token), "http_end" (the last chunk handed over to be written; a = tokens, b = the outcome).
Times are time.perf_counter(): on Linux clock_gettime(CLOCK_MONOTONIC), one clock for every process of the
machine, so another process's perf_counter() marks (serve_bench's levels) fall on the same axis.
Off (no trace given) there is no wrapper at all: the scheduler calls the core directly.
"""

from __future__ import annotations

import json
import time
from typing import Optional

CORE_CALLS = ("seq_open", "seq_prefill", "seq_prefill_many", "seq_mixed", "seq_step", "seq_sample", "seq_close",
              "seq_rewind", "seq_copy", "seq_park", "reset")


class Trace:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.events: list[tuple] = []

    def wrap(self, core) -> "TracedCore":
        return TracedCore(core, self.calls)

    def event(self, kind: str, request_id: str, a=None, b=None, t: Optional[float] = None) -> None:
        self.events.append((kind, time.perf_counter() if t is None else t, request_id, a, b))

    def to_json(self) -> dict:
        info = time.get_clock_info("perf_counter")
        return {"clock": f"time.perf_counter ({info.implementation})",
                "calls": [list(c) for c in self.calls], "events": [list(e) for e in self.events]}

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)


class TracedCore:
    """The core, with the calls in CORE_CALLS timed into `calls`; everything else (kv_pages_free, position, ...)
    forwarded as is."""

    def __init__(self, core, calls: list) -> None:
        self._core, self._calls = core, calls
        if hasattr(core, "seq_sample_step"):  # (only then: the scheduler asks hasattr(core, "seq_sample_step"))
            self.seq_sample_step = self._sample_step
        if hasattr(core, "seq_sample_mixed"):
            self.seq_sample_mixed = self._sample_mixed

    def __getattr__(self, name):
        return getattr(self._core, name)

    def _timed(self, name: str, n: int, f, *args):
        t = time.perf_counter()
        try:
            return f(*args)
        finally:
            self._calls.append((name, t, time.perf_counter(), n))

    def seq_open(self):
        return self._timed("seq_open", 0, self._core.seq_open)

    def seq_close(self, slot):
        return self._timed("seq_close", 0, self._core.seq_close, slot)

    def seq_rewind(self, slot, tokens):
        return self._timed("seq_rewind", 0, self._core.seq_rewind, slot, tokens)

    def seq_copy(self, dst, src, tokens):
        return self._timed("seq_copy", len(tokens), self._core.seq_copy, dst, src, tokens)

    def seq_park(self, slot):
        return self._timed("seq_park", 0, self._core.seq_park, slot)

    def reset(self):
        return self._timed("reset", 0, self._core.reset)

    def seq_prefill(self, slot, tokens, all_logits=False):
        return self._timed("seq_prefill", len(tokens), self._core.seq_prefill, slot, tokens, all_logits)

    def seq_prefill_many(self, slots, chunks):
        return self._timed("seq_prefill_many", sum(len(c) for c in chunks), self._core.seq_prefill_many, slots,
                           chunks)

    def seq_mixed(self, step_slots, step_tokens, slots, chunks):
        return self._timed("seq_mixed", sum(len(c) for c in chunks), self._core.seq_mixed, step_slots, step_tokens,
                           slots, chunks)

    def seq_step(self, slots, tokens):
        return self._timed("seq_step", len(slots), self._core.seq_step, slots, tokens)

    def seq_sample(self, slots, *args):
        return self._timed("seq_sample", len(slots), self._core.seq_sample, slots, *args)

    def _sample_step(self, slots, *args):
        """seq_sample_step, recorded as what it is made of: the seq_sample, then the seq_step it launched (when it did)."""
        t = time.perf_counter()
        try:
            r = self._core.seq_sample_step(slots, *args)
        except BaseException:
            self._calls.append(("seq_sample", t, time.perf_counter(), len(slots)))
            raise
        t1 = time.perf_counter()
        launch, n = float(r[5]), int(r[4].sum())
        self._calls.append(("seq_sample", t, t1 - launch, len(slots)))
        if n:
            self._calls.append(("seq_step", t1 - launch, t1, n))
        return r

    def _sample_mixed(self, slots, cfgs, steps, k, go_on, prompt_slots, prompts):
        """seq_sample_mixed, recorded as the seq_sample, then the seq_mixed it launched (when it did)."""
        t = time.perf_counter()
        try:
            r = self._core.seq_sample_mixed(slots, cfgs, steps, k, go_on, prompt_slots, prompts)
        except BaseException:
            self._calls.append(("seq_sample", t, time.perf_counter(), len(slots)))
            raise
        t1 = time.perf_counter()
        launch = float(r[5])
        self._calls.append(("seq_sample", t, t1 - launch, len(slots)))
        if r[6]:
            self._calls.append(("seq_mixed", t1 - launch, t1, sum(len(c) for c in prompts)))
        return r
