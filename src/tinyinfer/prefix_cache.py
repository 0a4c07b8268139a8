"""The scheduler's prefix cache (Scheduler(prefix_cache=N); the "Prefix cache" part of scheduler.py's docstring):
the KV caches of ended requests, kept with the tokens they hold, least recently used first, and where each admitted
prompt goes: into a fresh slot given a kept cache's or a running request's prefix (seq_copy), into the queue until
a prefix it shares has been prefilled, or into a fresh slot. The scheduler holds the engine's lock, makes the
admission's core calls (seq_open, seq_copy, seq_rewind) and counts the pool's free pages; this keeps the caches,
counts the pages they hold and drops those it evicts (core.seq_close).

Where the core parks (seq_park: the engines), an ended request's cache leaves its slot and is kept as a parked
sequence: it holds pages, not a slot, so caches survive a full batch (vLLM's cached blocks); a prompt sharing its
prefix is copied from it (whole pages shared, the last, partly filled one copied), which leaves it cached for the
next. A cache whose tokens another kept one extends is dropped (the longer one serves every prompt it would).
Short of pages, the least recently used parked cache gives back only its last pages, as many as are asked for
(seq_rewind of the parked id; vLLM's cached blocks go the same way, tail first), so its prefix stays cached.
A core without seq_park (a test double) keeps the ended request's slot open instead: a prompt is admitted into it,
rewound to the common prefix (seq_rewind), or copied from it where it should not be cut short, and the kept slots
count against the batch's.

The engines' copies share pages (seq_copy: the whole pages of the prefix are held by both slots, the last, partly
filled one copied), so what a copy takes, what a rewind gives back and what the kept slots hold are the core's
to say (seq_rewind_frees, kv_pages_held_by); a core without those (a test double) copies every page."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Optional, Sequence

from .errors import TinyInferError

# Ended requests' caches the CPU engine keeps by default (Scheduler(prefix_cache=...)): its pages are heap memory,
# held until taken back (a chat's turns at SmolLM2-135M: 46 KB a position, fp32)
PREFIX_CACHE_CPU = 4

# ... and the GPU engine per slot: parked, they hold only pages of a pool allocated anyway, given back (least recently
# used first) to whoever needs them; the bound keeps the admission's scan and the pages' recount short.
PREFIX_CACHE_GPU_PER_SLOT = 4

# A request waits for a running one that is still prefilling a prefix they share, to copy it (PrefixCache.plan), when
# that saves at least this many positions of prefill: below it, prefilling them alongside costs about as little as
# the step the wait adds to its first token.
COPY_WAIT_TOKENS = 32


def pages_for(positions: int, page_size: int) -> int:
    """The KV pages `positions` positions take."""
    return -(-positions // page_size)


def common_prefix(a: Sequence[int], b: Sequence[int], chunk: int = 256) -> int:
    """The length of a's and b's common prefix: chunk by chunk (list slices compare in C), then a bisection inside
    the chunk that differs. (Under the engine's lock at every admission: ~6 µs for a 1,024-token prefix.)"""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    lo = 0
    while lo < n and a[lo:min(lo + chunk, n)] == b[lo:min(lo + chunk, n)]:
        lo += chunk
    if lo >= n:
        return n
    hi = min(lo + chunk, n)  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:  # (inside the chunk only: a slice from 0 would cost the whole prefix a test)
            lo = mid
        else:
            hi = mid
    return lo


class Plan(NamedTuple):
    """Where a prompt is admitted (PrefixCache.plan): kind "rewind" (into kept slot `slot`, cut to `cached`
    positions), "copy" (a fresh slot given the first `cached` positions of slot or parked sequence `slot`), "wait"
    or "fresh"."""

    kind: str
    slot: Optional[int] = None
    cached: int = 0


class PrefixCache:
    """The kept caches (parked sequence or kept slot -> the tokens its cache holds, least recently used first) and
    the admission's plan. limit: how many it keeps; copies: whether the core has seq_copy; shares: whether its
    slots share pages (the engines: kv_pages_held_by, seq_rewind_frees); parks: whether it parks (seq_park: needs
    copies, the only way into a parked cache)."""

    def __init__(self, limit: int, page_size: int, copies: bool, shares: bool = False, parks: bool = False) -> None:
        self.limit, self.page_size, self.copies, self.shares = limit, page_size, copies, shares
        self.parks = parks and copies
        self.kept: OrderedDict[int, list[int]] = OrderedDict()
        # the pages only the kept caches hold (dropping them would free them): the scheduler's stats() reads it (and
        # len()) without the engine's lock, one attribute load each under the GIL, as any int the scheduler keeps;
        # where slots share pages, recounted by the core (recount) after the slots change (after a drop, at the
        # step's end: stale until then)
        self.pages = 0
        self.stale = False  # pages is to be counted again (recount): caches were dropped since

    def __len__(self) -> int:
        return len(self.kept)

    def __contains__(self, slot: object) -> bool:
        return slot in self.kept

    def held(self, slot: int) -> list[int]:
        return self.kept[slot]

    @property
    def slots(self) -> int:
        """The core's slots the cache holds (kept slots; parked sequences hold none)."""
        return 0 if self.parks else len(self.kept)

    def recount(self, core) -> None:
        """The pages only the kept caches hold, from the core (where slots share pages: a kept cache's prefix may be
        a running request's too, or another kept cache's)."""
        if self.shares:
            try:
                self.pages = int(core.kv_pages_held_by(list(self.kept))) if self.kept else 0
                self.stale = False
            except TinyInferError:  # a slot the core no longer knows: counted at the next recount
                pass

    def copy_takes(self, cached: int) -> int:
        """The free pages a copy of `cached` positions into a fresh slot takes: the last, partly filled page where
        whole pages are shared, else every page."""
        return int(cached % self.page_size != 0) if self.shares else pages_for(cached, self.page_size)

    def rewind_frees(self, core, slot: int, cached: int) -> int:
        """The free pages a rewind of kept slot `slot` to `cached` positions gives back (less the page it copies
        where it cuts inside a page another slot shares)."""
        if self.shares:
            return int(core.seq_rewind_frees(slot, cached))
        return pages_for(len(self.kept[slot]), self.page_size) - pages_for(cached, self.page_size)

    def drop_frees(self, core, key: int, cached: int) -> int:
        """At least the free pages dropping kept cache `key` gives back once its first `cached` positions are copied
        into a slot: the pages it alone holds, less the whole pages the copy then shares."""
        alone = (int(core.kv_pages_held_by([key])) if self.shares
                 else pages_for(len(self.kept[key]), self.page_size))
        return max(alone - (cached // self.page_size if self.shares else 0), 0)

    def take_over(self, other: "PrefixCache") -> None:
        """Another cache's kept caches become this one's (a closed scheduler's, which could not give them back)."""
        self.kept, self.pages, self.stale = other.kept, other.pages, other.stale
        other.kept, other.pages, other.stale = OrderedDict(), 0, False

    def forget(self) -> None:
        """Forget every kept cache without dropping it (the engine closed: its sequences went with the core)."""
        self.kept, self.pages, self.stale = OrderedDict(), 0, False

    # ---- the admission's plan ----

    def plan(self, prompt: list[int], running: Sequence, max_batch: int) -> Plan:
        """Where a prompt is admitted, and the positions it takes from the cache (short of the prompt's last token,
        whose logits must be computed). running: the admitted requests (the scheduler's _Seq: slot, prompt,
        generated, length, prefilling); max_batch: the core's slots.
        - where the core parks: "copy", a fresh slot given the longest prefix a kept cache or a running request
          shares (nothing is cut, no slot is taken), else "wait" or "fresh" as below; where it does not:
        - "rewind": into the kept slot sharing the most (of those, the one holding the fewest tokens: the least
          thrown away); one that would lose more than half of what it holds only when every slot is taken (one
          kept slot must go anyway);
        - "copy": a fresh slot given the first positions of a running request's slot, or of a kept one not cut
          short as above, where that shares more;
        - "wait": a running request still prefills a prefix it shares, COPY_WAIT_TOKENS longer than any cached now
          (the same system prompt arriving together, a request's n choices: prefilled once);
        - "fresh": nothing shared."""
        # Each candidate is first asked, in O(1), whether it could change the plan: sharing more than the plan's n
        # positions needs its token at n to be the prompt's (so with a system prompt shared by every slot the scan
        # costs one compare a slot, not one prefix: it runs under the engine's lock at every admission).
        last = len(prompt) - 1
        full = len(running) + self.slots >= max_batch
        plan = Plan("fresh")
        held_best = 0
        for slot, held in self.kept.items():
            n0 = plan.cached
            if n0 < last and len(held) > n0 and held[n0] == prompt[n0]:
                n = min(common_prefix(held, prompt), last)
                if self.parks:  # (a parked cache is copied from: nothing is cut, no slot taken)
                    if n > n0:
                        plan = Plan("copy", slot, n)
                    continue
            elif self.parks:
                continue
            elif n0 > 0 and (plan.kind == "copy" or len(held) < held_best) and held[:n0] == prompt[:n0]:
                n = n0  # (a tie that may win: into a slot rather than a copy, or one holding fewer)
            else:
                continue
            if n > 0 and (2 * n >= len(held) or full):  # rewinding it loses at most half (or a slot must go)
                if n > plan.cached or (n == plan.cached and (plan.kind == "copy" or len(held) < held_best)):
                    plan, held_best = Plan("rewind", slot, n), len(held)
            elif n > plan.cached and self.copies and not full:  # (a copy takes a fresh slot)
                plan = Plan("copy", slot, n)
        if not self.copies:
            return plan
        for seq in running:
            n0, p = plan.cached, len(seq.prompt)
            if seq.slot is None or n0 >= min(last, seq.length) or n0 >= p + len(seq.generated) or \
                    (seq.prompt[n0] if n0 < p else seq.generated[n0 - p]) != prompt[n0]:
                continue
            n = common_prefix(seq.prompt, prompt)
            if n == p and seq.generated:  # (a running chat's next turn: its answer so far too)
                n += common_prefix(seq.generated, prompt[n:])
            n = min(n, seq.length, last)
            if n > plan.cached:
                plan = Plan("copy", seq.slot, n)
        m = plan.cached + COPY_WAIT_TOKENS  # waiting pays where a prompt still in its prefill shares m positions
        if m <= last and any(s.prefilling and len(s.prompt) >= m and s.prompt[m - 1] == prompt[m - 1] and
                             s.prompt[:m] == prompt[:m] for s in running):
            return Plan("wait")
        return plan

    # ---- the kept caches ----

    def keep(self, core, slot: int, tokens: list[int]) -> None:
        """An ended request's slot, holding `tokens`, becomes the most recently used kept cache (parked where the
        core parks: the slot closes); the least recently used beyond the limit are dropped. Parked, a kept cache
        whose tokens `tokens` extend is dropped, and `tokens` are not kept where a kept cache extends them."""
        if self.parks:
            n = len(tokens)
            for key, held in self.kept.items():
                if len(held) >= n and held[n - 1] == tokens[-1] and held[:n] == tokens:
                    self.kept.move_to_end(key)  # (it serves every prompt this would)
                    try:
                        core.seq_close(slot)
                    except TinyInferError:
                        pass
                    return
            for key in [k for k, h in self.kept.items()
                        if len(h) < n and h[-1] == tokens[len(h) - 1] and tokens[:len(h)] == h]:
                self.drop(core, key)  # (what it holds, the new one holds too)
            try:
                slot = int(core.seq_park(slot))
            except TinyInferError:  # (not expected: the slot closed instead, nothing kept)
                try:
                    core.seq_close(slot)
                except TinyInferError:
                    pass
                return
        self.kept[slot] = tokens
        self.pages += pages_for(len(tokens), self.page_size)
        while len(self.kept) > self.limit:
            self.evict_lru(core)
        self.recount(core)

    def take(self, slot: int, core=None) -> list[int]:
        """A kept slot leaves the cache (a request is admitted into it: the kept-slot path); returns the tokens it
        held. (core: where slots share pages, the kept caches' pages are counted anew by it.)"""
        tokens = self.kept.pop(slot)
        if self.shares and core is not None:
            self.recount(core)
        else:
            self.pages -= pages_for(len(tokens), self.page_size)
        return tokens

    def touch(self, slot: int) -> None:
        """A kept cache was used (copied from): the most recently used now."""
        self.kept.move_to_end(slot)

    def evict_lru(self, core, spare: Optional[int] = None, want: Optional[int] = None) -> int:
        """Give back the pages of the least recently used kept cache (not `spare`); returns how many it gave back.
        Parked, with `want` pages asked for, it gives back only its last `want` pages where it alone holds more
        (vLLM's cached blocks go least recently used first, a sequence's tail first): the prefix stays cached for
        its conversation's next turn. Else the whole cache is dropped."""
        key = next(s for s in self.kept if s != spare)
        if want is not None and want > 0 and self.parks and self.shares:
            # What only it holds is its tail (a copy shares a prefix's pages), so cutting `want` pages off the end
            # gives back exactly those; the cut is at a page boundary, where nothing is copied.
            total = pages_for(len(self.kept[key]), self.page_size)
            if want < int(core.kv_pages_held_by([key])):
                return self.trim(core, key, (total - want) * self.page_size)
        return self.drop(core, key)

    def trim(self, core, key: int, n: int) -> int:
        """Parked cache `key` cut to its first n positions (seq_rewind; n > 0); returns the pages it gave back. One
        that another kept cache would then extend (which serves every prompt it would) or that the core does not cut
        is dropped."""
        assert n > 0, "a parked cache cut to nothing: dropped instead"
        tokens = self.kept[key]
        if any(k != key and len(h) >= n and h[n - 1] == tokens[n - 1] and h[:n] == tokens[:n]
               for k, h in self.kept.items()):
            return self.drop(core, key)
        before = int(core.kv_pages_free)
        try:
            core.seq_rewind(key, tokens[:n])
        except TinyInferError:
            return self.drop(core, key)
        self.kept[key] = tokens[:n]
        self.stale = True  # (its pages recounted at the step's end, as after a drop)
        return int(core.kv_pages_free) - before

    def drop(self, core, slot: int) -> int:
        """Drop kept cache `slot` (seq_close); returns the pages it gave back."""
        tokens = self.kept.pop(slot)
        if not self.shares:
            self.pages -= pages_for(len(tokens), self.page_size)
        before = int(core.kv_pages_free)
        try:
            core.seq_close(slot)
        except TinyInferError:  # a slot the core no longer knows: nothing left to free
            return 0
        finally:  # (evictions come in runs: the core counts the rest once, at the step's end or the next keep)
            self.stale = self.shares and bool(self.kept)
            if not self.kept:
                self.pages = 0
        return int(core.kv_pages_free) - before

    def drop_all(self, core) -> None:
        """Drop every kept cache (the single path or warm_up needs the pool; close())."""
        while self.kept:
            self.evict_lru(core)
