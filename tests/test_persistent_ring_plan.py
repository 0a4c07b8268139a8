"""The persistent decode step's weight-ring plan (cpp/gpu/persistent_ring_plan.h): plain C++, built from the
schedule at load and checked on the host. Every row of every GEMV task is in exactly one tile, a block's tiles
are in its task order (it never waits on a tile it would issue later), tiles fit a slot and their copies are
16-byte aligned, the ring fits the shared memory a block may have; a plan that breaks any of it is refused with
a DeviceError naming the problem. No GPU needed."""

from __future__ import annotations

import math

import pytest

from tinyinfer import DeviceError, InvalidRequestError, _core

T = _core.TaskType
GEMV = (T.Qkv, T.O, T.GateUp, T.Down, T.LmHead)


def schedule(grid, hidden=256, heads=4, kv_heads=2, head_dim=64, inter=500, vocab=1000, layers=2):
    s = _core.ScheduleShape()
    s.hidden, s.q_dim, s.kv_dim, s.intermediate = hidden, heads * head_dim, kv_heads * head_dim, inter
    s.n_layers, s.n_heads, s.n_kv_heads, s.vocab, s.max_chunks, s.grid = layers, heads, kv_heads, vocab, 3, grid
    s.fused_merge = True
    return s, _core.build_persistent_schedule(s)


def matrices(s, fmt="fp16"):
    """The matrices as DeviceWeights lays them out, {type: (rows, row_bytes, scale_row_bytes, scale_alloc)}: fp16
    rows padded to 8 halves; int8 rows of K rounded up to 32 bytes with an fp16 d per 32; int4 rows of K / 2 bytes
    with a (scale, min) fp16 pair per 32."""
    dims = {T.Qkv: (s.q_dim + 2 * s.kv_dim, s.hidden), T.O: (s.hidden, s.q_dim),
            T.GateUp: (2 * s.intermediate, s.hidden), T.Down: (s.hidden, s.intermediate), T.LmHead: (s.vocab, s.hidden)}
    out = {}
    for t, (rows, K) in dims.items():
        if fmt == "fp16":
            out[t] = (rows, 2 * ((K + 7) // 8 * 8), 0, 0)
        elif fmt == "int8":
            ld = (K + 31) // 32 * 32
            out[t] = (rows, ld, ld // 32 * 2, rows * (ld // 32 * 2))
        else:  # int4 (K a multiple of 32)
            out[t] = (rows, K // 2, K // 32 * 4, rows * (K // 32 * 4))
    return out


def ring_shape(s, fmt="fp16", slots=4, slot_kib=32):
    r = _core.RingPlanShape()
    r.slots, r.slot_bytes = slots, slot_kib << 10
    for t, m in matrices(s, fmt).items():
        r.set_matrix(t, *m)
    return r


def ringable(t, m, slot_bytes):
    """Whether build_ring_plan must ring task t of matrix m (persistent_ring_plan.h): its rows tile (the most rows
    that fit a slot less the 16 bytes a scale copy may round up: a multiple of 8 where 8 fit, else of what keeps
    each scale copy 16-byte aligned and of a gate/up pair) and no tile's scale copy, rounded up to 16 bytes, runs
    past the scale array's allocation. Else the task reads its weights from global memory."""
    _, row_bytes, srb, alloc = m
    if row_bytes <= 0 or row_bytes % 16:
        return False
    f = 2 if t.type == T.GateUp else 1
    per = (slot_bytes - 16) // (row_bytes + srb)
    if per >= 8:
        per = per // 8 * 8
    else:
        m16 = next(n for n in range(1, 17) if n * srb % 16 == 0)
        per = per // math.lcm(m16, f) * math.lcm(m16, f)
    if per < 1:
        return False
    return not any(srb and r * srb + -(-min(per, f * t.b - r) * srb // 16) * 16 > alloc
                   for r in range(f * t.a, f * t.b, per))


def covered_once(sched, plan, sh):
    """Every row of every ringed GEMV task in exactly one tile of the task's own block, tiles in task order."""
    for b, (tasks, tiles) in enumerate(zip(sched.blocks, plan.blocks)):
        assert [k.task for k in tiles] == sorted(k.task for k in tiles)
        for i, t in enumerate(tasks):
            mine = [k for k in tiles if k.task == i]
            assert len(mine) == plan.task_tiles[b][i]
            if t.type not in GEMV:
                assert not mine
                continue
            f = 2 if t.type == T.GateUp else 1
            rows = sorted(r for k in mine for r in range(k.row0, k.row0 + k.rows))
            if mine:
                assert rows == list(range(f * t.a, f * t.b)), (b, i, t)
            for k in mine:
                assert k.type == t.type and k.layer == t.layer
                assert k.bytes + k.scale_bytes <= plan.slot_bytes
                assert k.bytes % 16 == 0 and k.scale_bytes % 16 == 0


# awkward shapes: intermediate not a multiple of the tile (or of 8), head dims 64 / 96 / 128 / 256, GQA 1..8
SHAPES = {
    "tinyllama": dict(hidden=2048, heads=32, kv_heads=4, head_dim=64, inter=5632, vocab=32000, layers=2),
    "hd96_gqa8": dict(hidden=384, heads=8, kv_heads=1, head_dim=96, inter=700, vocab=1000),
    "hd256_gqa3": dict(hidden=384, heads=6, kv_heads=2, head_dim=256, inter=900, vocab=1000),
    "hd128_gqa7": dict(hidden=448, heads=7, kv_heads=1, head_dim=128, inter=1000, vocab=1000),
    "hd64_mha": dict(hidden=256, heads=4, kv_heads=4, head_dim=64, inter=500, vocab=1000),
    # an LM head of odd rows: at int8 a one-row tile's scale copy would run past the array (the task is not ringed)
    "odd_vocab": dict(hidden=384, heads=6, kv_heads=2, head_dim=64, inter=512, vocab=1001),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("fmt", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("grid, slots, slot_kib", [(132, 4, 32), (7, 2, 4), (1, 8, 1), (264, 6, 16)])
def test_plan_covers_every_row_once_in_task_order(name, fmt, grid, slots, slot_kib):
    kw = SHAPES[name]
    if fmt == "int4" and any(k % 32 for k in (kw["hidden"], kw["heads"] * kw["head_dim"], kw["inter"])):
        kw = dict(kw, inter=(kw["inter"] + 31) // 32 * 32)  # int4 needs K % 32 (the down matrix's K)
    s, sched = schedule(grid, **kw)
    shape = ring_shape(s, fmt, slots, slot_kib)
    plan = _core.build_ring_plan(sched, shape)
    _core.check_ring_plan(plan, sched, shape, 20 << 10, 227 << 10)
    assert plan.slots == slots and plan.slot_bytes == slot_kib << 10
    covered_once(sched, plan, s)
    mats = matrices(s, fmt)
    unringed = [(b, i) for b, tasks in enumerate(sched.blocks) for i, t in enumerate(tasks)
                if t.type in GEMV and plan.task_tiles[b][i] == 0]
    assert unringed == [(b, i) for b, tasks in enumerate(sched.blocks) for i, t in enumerate(tasks)
                        if t.type in GEMV and not ringable(t, mats[t.type], slot_kib << 10)]
    if slot_kib == 32:  # every row of these shapes fits a 32 KiB slot (and, but for odd_vocab, its scale copies)
        assert plan.n_tiles > 0 and (name == "odd_vocab" and fmt == "int8" or not unringed), unringed


def test_a_scale_copy_past_its_array_leaves_the_task_unringed():
    """An int8 LM head of 1,001 rows (24 bytes of scales a row): the last task's one-row tile would copy 32 bytes of
    scales from 24 before the array's end, so that task reads from global memory; every other task is ringed."""
    s, sched = schedule(132, **SHAPES["odd_vocab"])
    shape = ring_shape(s, "int8")
    plan = _core.build_ring_plan(sched, shape)
    _core.check_ring_plan(plan, sched, shape, 20 << 10, 227 << 10)
    unringed = [(t.type, t.a, t.b) for b, tasks in enumerate(sched.blocks) for i, t in enumerate(tasks)
                if t.type in GEMV and plan.task_tiles[b][i] == 0]
    assert unringed == [(T.LmHead, 1000, 1001)]


def test_tinyllama_plan_at_the_default_ring():
    """The shape the targets are about: at 132 blocks, 4 slots of 32 KiB every GEMV task is ringed."""
    s, sched = schedule(132, **SHAPES["tinyllama"])
    plan = _core.build_ring_plan(sched, ring_shape(s))
    assert all(n > 0 for b, tasks in enumerate(sched.blocks) for i, n in enumerate(plan.task_tiles[b])
               if tasks[i].type in GEMV)
    per_layer = (2560 + 2048 + 2 * 5632) * 2048 * 2 + 2048 * 5632 * 2  # qkv, o, gate/up, down: fp16 bytes
    assert sum(k.bytes for blk in plan.blocks for k in blk) == 2 * per_layer + 32000 * 2048 * 2  # each byte once


def test_ring_too_large_for_the_block_is_refused():
    s, sched = schedule(8)
    shape = ring_shape(s, slots=8, slot_kib=32)
    plan = _core.build_ring_plan(sched, shape)
    with pytest.raises(DeviceError, match="shared memory"):
        _core.check_ring_plan(plan, sched, shape, 20 << 10, 227 << 10)
    assert _core.ring_plan_smem(8, 32 << 10) == 128 + 8 * 32768


@pytest.mark.parametrize("slots, kib", [(1, 32), (9, 32), (4, 0), (4, 129)])
def test_bad_ring_sizes_are_refused(slots, kib):
    s, sched = schedule(4)
    with pytest.raises(InvalidRequestError, match="2 to 8|1 to 128 KiB"):
        _core.build_ring_plan(sched, ring_shape(s, slots=slots, slot_kib=kib))


def test_broken_plans_are_refused():
    """A tile out of task order, a row twice, a tile of another block's task: each refused by name."""
    s, sched = schedule(4)
    shape = ring_shape(s, slots=3, slot_kib=4)
    good = _core.build_ring_plan(sched, shape)

    def refused(mutate, match):
        plan = _core.build_ring_plan(sched, shape)
        blocks = plan.blocks
        mutate(blocks)
        plan.blocks = blocks
        with pytest.raises(DeviceError, match=match):
            _core.check_ring_plan(plan, sched, shape, 0, 227 << 10)

    assert len(good.blocks[0]) > 3
    refused(lambda bl: bl[0].reverse(), "out of task order|not consecutive|not in any")  # consumed before issued
    refused(lambda bl: bl[0].insert(1, bl[0][0]), "a second time|task_tiles")           # a row twice
    refused(lambda bl: bl[1].append(bl[0][-1]), "task_tiles|outside|does not belong|second time|out of")
    refused(lambda bl: bl[2].clear(), "task_tiles|not in any")                          # rows left out
