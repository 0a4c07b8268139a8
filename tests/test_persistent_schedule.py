"""The persistent decode step's schedule (cpp/gpu/persistent_schedule.h): plain C++, checked on the host before the
kernel may run it. A schedule that could hang the GPU (a missing producer, a wrong producer count, a self-wait, a
cycle, a grid past co-residency) is refused with a DeviceError naming the problem. No GPU needed."""

from __future__ import annotations

import pytest

from tinyinfer import DeviceError, _core

T = _core.TaskType


def shape(grid=8, layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, inter=500, vocab=512, max_chunks=5):
    s = _core.ScheduleShape()
    s.hidden, s.q_dim, s.kv_dim, s.intermediate = hidden, heads * head_dim, kv_heads * head_dim, inter
    s.n_layers, s.n_heads, s.n_kv_heads, s.vocab, s.max_chunks, s.grid = layers, heads, kv_heads, vocab, max_chunks, grid
    return s


def all_tasks(sched):
    return [t for block in sched.blocks for t in block]


@pytest.mark.parametrize("grid", [1, 3, 8, 132])
def test_built_schedule_is_accepted_and_covers_every_unit(grid):
    sh = shape(grid=grid)
    sched = _core.build_persistent_schedule(sh)
    _core.check_persistent_schedule(sched, grid)  # raises on a bad one
    assert sched.grid == grid and len(sched.blocks) == grid
    tasks = all_tasks(sched)
    assert sched.n_tasks == len(tasks)
    # every output row of every phase is covered exactly once
    def covered(kind, layer, n):
        rows = sorted(r for t in tasks if t.type == kind and t.layer == layer for r in range(t.a, t.b))
        assert rows == list(range(n)), (kind, layer)
    covered(T.Embed, 0, sh.hidden)
    covered(T.LmHead, 0, sh.vocab)
    for layer in range(sh.n_layers):
        covered(T.Qkv, layer, sh.q_dim + 2 * sh.kv_dim)
        covered(T.O, layer, sh.hidden)
        covered(T.GateUp, layer, sh.intermediate)
        covered(T.Down, layer, sh.hidden)
        units = sorted((t.a, t.b) for t in tasks if t.type == T.AttnPartial and t.layer == layer)
        assert units == [(h, c) for h in range(sh.n_kv_heads) for c in range(sh.max_chunks)]
        assert sorted(t.a for t in tasks if t.type == T.AttnMerge and t.layer == layer) == list(range(sh.n_heads))
    # each block's list is in phase order: the waits' counters never decrease
    for block in sched.blocks:
        waits = [t.wait for t in block]
        assert waits == sorted(waits)
    assert sched.final_counter == sched.n_counters - 1


@pytest.mark.parametrize("grid", [1, 8, 132])
def test_fused_merge_schedule_has_no_merge_phase(grid):
    """ScheduleShape.fused_merge: the attention tasks merge (the last of a KV head's chunks); the O tasks wait on
    the attention partials' counter, for every attention task (those past the context signal at once)."""
    sh = shape(grid=grid)
    sh.fused_merge = True
    sched = _core.build_persistent_schedule(sh)
    _core.check_persistent_schedule(sched, grid)
    tasks = all_tasks(sched)
    assert not [t for t in tasks if t.type == T.AttnMerge]
    unfused = _core.build_persistent_schedule(shape(grid=grid))
    assert sched.n_counters == unfused.n_counters - sh.n_layers  # one phase fewer per layer
    for layer in range(sh.n_layers):
        attn = {t.signal for t in tasks if t.type == T.AttnPartial and t.layer == layer}
        o = [t for t in tasks if t.type == T.O and t.layer == layer]
        assert len(attn) == 1 and {t.wait for t in o} == attn
        assert {t.wait_count for t in o} == {sh.n_kv_heads * sh.max_chunks}


def test_grid_past_coresidency_is_refused():
    sched = _core.build_persistent_schedule(shape(grid=8))
    with pytest.raises(DeviceError, match="exceeds the 7 co-resident blocks"):
        _core.check_persistent_schedule(sched, 7)


def first_index(sched, kind):
    for b, block in enumerate(sched.blocks):
        for i, t in enumerate(block):
            if t.type == kind:
                return b, i
    raise AssertionError(kind)


def test_missing_producer_is_refused():
    sched = _core.build_persistent_schedule(shape(grid=4))
    blocks = sched.blocks
    b, i = first_index(sched, T.O)
    del blocks[b][i]  # one O task gone: the gate/up tasks would wait for a signal that never comes
    sched.blocks = blocks
    with pytest.raises(DeviceError, match="which 3 tasks signal per step"):
        _core.check_persistent_schedule(sched, 4)


def test_extra_producer_is_refused():
    """One signal too many per step would let the next step's waiters pass early (the epochs drift)."""
    sched = _core.build_persistent_schedule(shape(grid=4))
    blocks = sched.blocks
    b, i = first_index(sched, T.O)
    extra = blocks[b][i]
    blocks[(b + 1) % 4].append(extra)
    sched.blocks = blocks
    with pytest.raises(DeviceError, match="which 5 tasks signal per step"):
        _core.check_persistent_schedule(sched, 4)


def test_self_wait_is_refused():
    """A down task waiting on its own counter, for as many signals as that counter gets (so the producer-count
    check passes): the self-wait check names it."""
    sched = _core.build_persistent_schedule(shape(grid=4))
    blocks = sched.blocks
    b, i = first_index(sched, T.Down)
    t = blocks[b][i]
    t.wait, t.wait_count = t.signal, sum(k.signal == t.signal for k in all_tasks(sched))
    sched.blocks = blocks
    with pytest.raises(DeviceError, match=f"^persistent schedule rejected: down task {i} of block {b} "
                                          f"\\(layer 0\\) waits on the counter it signals itself$"):
        _core.check_persistent_schedule(sched, 4)


def test_cycle_is_refused():
    """Every count right, but a block runs a later phase's task first: it waits for a counter its own later
    tasks feed — the simulation finds the deadlock."""
    sched = _core.build_persistent_schedule(shape(grid=1, layers=1))
    blocks = sched.blocks
    blocks[0].insert(0, blocks[0].pop())  # the LM head first: it waits for the last down, which waits for it
    sched.blocks = blocks
    with pytest.raises(DeviceError, match="deadlock: block 0 task 0 \\(lm_head"):
        _core.check_persistent_schedule(sched, 1)


def test_counter_out_of_range_is_refused():
    sched = _core.build_persistent_schedule(shape(grid=2))
    blocks = sched.blocks
    blocks[1][0].signal = sched.n_counters
    sched.blocks = blocks
    with pytest.raises(DeviceError, match="out of range"):
        _core.check_persistent_schedule(sched, 2)


def test_bad_shape_is_a_request_error():
    from tinyinfer import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="grid must be >= 1"):
        _core.build_persistent_schedule(shape(grid=0))
    with pytest.raises(InvalidRequestError, match="bad model shape"):
        _core.build_persistent_schedule(shape(heads=6, kv_heads=4))
