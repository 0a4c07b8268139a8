"""What a scheduler has served since it started (Scheduler.metrics(); a server's GET /metrics): requests by how
they ended, prompt / cached / generated tokens, and histograms of the time to first token and of a request's
whole time, as vLLM's and llama.cpp's servers export them. Added to as each request ends (on whichever thread
ends it: a step's, a cancel's for a request still queued, close()'s) and read from any thread, so it has a lock of
its own. Each of a request's n choices is one request; a request out of KV pages ends as "length" (what its client
is told, with the error); a prompt's tokens count when its request ends, prefilled or not; a preemption (a running
request's slot taken back for want of pages, its tokens recomputed later) when it happens."""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Optional

# Upper bounds (seconds) of the histograms' buckets; each also has +Inf. The first token of a batch-1 decode lands
# in the first buckets on a GPU, a long prompt behind a full batch in the last.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    """Counts per bucket (`bounds`, then +Inf: each value in the first bucket whose bound is >= it), their sum."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class Totals:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {"stop": 0, "length": 0, "cancelled": 0, "error": 0}
        self.prompt_tokens = self.cached_tokens = self.generated_tokens = 0
        self.preemptions = 0  # running requests whose slot was taken back for want of KV pages (recomputed later)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.request_time = Histogram(REQUEST_BUCKETS)

    def add(self, end: str, prompt: int, cached: int, generated: int, ttft: Optional[float], wall: float) -> None:
        """One request ended: `end` its finish reason ("error" for a failure), its tokens, the seconds from its
        submission to its first token (None: it had none) and to its end."""
        with self._lock:
            self.requests[end] = self.requests.get(end, 0) + 1
            self.prompt_tokens += prompt
            self.cached_tokens += cached
            self.generated_tokens += generated
            if ttft is not None:
                self.ttft.observe(ttft)
            self.request_time.observe(wall)

    def preempted(self) -> None:
        with self._lock:
            self.preemptions += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "prompt_tokens": self.prompt_tokens,
                    "preemptions": self.preemptions,
                    "cached_tokens": self.cached_tokens, "generated_tokens": self.generated_tokens,
                    "time_to_first_token": self.ttft.snapshot(), "request_time": self.request_time.snapshot()}
