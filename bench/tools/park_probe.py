"""Multi-turn chat with more conversations than slots, through the scheduler (docs/perf/serve.md, "Kept caches
parked"): N conversations (a 512-token document each, 32 tokens out), then each one's next turn (its first turn +
answer + 16 new tokens, 32 out), every turn of a round submitted at once. Prints, per set of new documents, the
second round's cached tokens, wall time, tok/s and TTFT p50.

    python bench/tools/park_probe.py MODEL park  --max-batch 16 --conversations 64 --pool 1024 --sets 2
    python bench/tools/park_probe.py MODEL slots ...   # the A/B: seq_park hidden (the kept-slot path)
    python bench/tools/park_probe.py MODEL whole --pool 600   # parked, eviction dropping whole caches

mode park: the engine's seq_park (kept caches hold pages, given back tail pages first); slots: the core seen without
seq_park, so the prefix cache keeps ended requests' slots open; whole: parked, but an eviction drops the whole least
recently used cache (as before tail-first eviction). --device cpu runs it on the CPU engine (its max_batch is
fixed)."""
from __future__ import annotations

import argparse
import json
import statistics
import time

from tinyinfer import Engine, SamplingParams, _core
from tinyinfer.prefix_cache import PrefixCache
from tinyinfer.scheduler import Scheduler


class _NoPark:
    """The core without seq_park (everything else passed through)."""

    def __init__(self, core):
        self._c = core

    def __getattr__(self, name):
        if name == "seq_park":
            raise AttributeError(name)
        return getattr(self._c, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("mode", choices=("park", "slots", "whole"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--pool", type=int, default=1024, help="KV pages (cuda; 0: the engine's default)")
    ap.add_argument("--sets", type=int, default=2, help="sets of new documents (the first includes the captures)")
    a = ap.parse_args()
    if a.mode == "whole":
        evict = PrefixCache.evict_lru
        PrefixCache.evict_lru = lambda self, core, spare=None, want=None: evict(self, core, spare)  # type: ignore
    kw: dict = {"device": a.device}
    if a.device == "cuda":
        opts = _core.CudaOptions()
        opts.kv_pool_pages, opts.max_batch = a.pool, a.max_batch
        kw["cuda_options"] = opts
    with Engine(a.model, max_seq_len=2048, **kw) as e:
        real = e._core
        if a.mode == "slots":
            e._core = _NoPark(real)
        sched = Scheduler(e, mixed_steps=True, prefix_cache=4 * a.max_batch)
        sched.start()
        sp = SamplingParams(max_tokens=32, ignore_eos=True)
        n = a.conversations
        for rep in range(a.sets):
            sched.reset_prefix_cache()
            docs = [[(1000 + 97 * i + 13 * j + 5 * rep) % 30000 for j in range(512)] for i in range(n)]
            first = e.generate(docs, sp)
            turns = [d + f.token_ids + [(500 + 7 * i + j) % 30000 for j in range(16)]
                     for i, (d, f) in enumerate(zip(docs, first))]
            t0 = time.perf_counter()
            out = e.generate(turns, sp)
            dt = time.perf_counter() - t0
            print(json.dumps({"mode": a.mode, "max_batch": a.max_batch, "conversations": n, "set": rep,
                              "cached_tokens": sum(o.stats.cached_tokens for o in out),
                              "prompt_tokens": sum(len(t) for t in turns), "wall_s": round(dt, 3),
                              "tok_s": round(sum(len(o.token_ids) for o in out) / dt),
                              "ttft_p50_ms": round(1e3 * statistics.median(o.stats.wall_s - o.stats.decode_s
                                                                           for o in out), 1),
                              "cached_sequences": sched.stats()["cached_sequences"]}))
        sched.close()
        e._core = real


if __name__ == "__main__":
    main()
