"""The paged KV cache's host bookkeeping (cpp/gpu/kv_pages.h): the pool's free list and a sequence's page table,
and the tests' own paging helpers (conftest.to_pages). Plain C++: runs on every machine."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import from_pages, to_pages, unused_pages
from tinyinfer import InvalidRequestError, _core


def test_pages_are_taken_on_demand_in_order_and_given_back():
    pool = _core.KvPagePool(8, 64)
    seq = _core.KvSequence(pool, 1000)
    assert seq.max_pages == 16 and pool.pages_for(1) == 1 and pool.pages_for(64) == 1 and pool.pages_for(65) == 2
    assert seq.grow(pool, 1) == 0 and seq.table == [0]
    assert seq.grow(pool, 64) == 1 and seq.table == [0]  # the same page still holds positions 0..63
    assert seq.grow(pool, 65) == 1 and seq.table == [0, 1]
    assert seq.grow(pool, 200) == 2 and seq.table == [0, 1, 2, 3]
    assert pool.free_pages == 4
    seq.release(pool)
    assert seq.table == [] and pool.free_pages == 8
    assert seq.grow(pool, 256) == 0 and seq.table == [0, 1, 2, 3]  # the same pages again, in the same order


def test_shrink_keeps_a_prefixs_pages_and_gives_back_the_rest():
    pool = _core.KvPagePool(8, 64)
    seq = _core.KvSequence(pool, 1000)
    seq.grow(pool, 300)  # 5 pages
    seq.shrink(pool, 129)  # positions 0..128: 3 pages
    assert seq.table == [0, 1, 2] and pool.free_pages == 5
    seq.shrink(pool, 128)
    assert seq.table == [0, 1] and pool.free_pages == 6
    seq.shrink(pool, 500)  # (more than it holds: nothing changes)
    assert seq.table == [0, 1] and pool.free_pages == 6
    assert seq.grow(pool, 200) == 2 and seq.table == [0, 1, 2, 3]  # the pages it gave back, in the same order
    seq.shrink(pool, 0)
    assert seq.table == [] and pool.free_pages == 8


def test_two_sequences_share_a_pool_without_sharing_pages():
    pool = _core.KvPagePool(6, 64, shuffle_seed=3)
    a, b = _core.KvSequence(pool, 4096), _core.KvSequence(pool, 4096)
    a.grow(pool, 130)
    b.grow(pool, 64)
    a.grow(pool, 192)
    assert not set(a.table) & set(b.table) and len(a.table) == 3 and len(b.table) == 1
    a.release(pool)
    b.grow(pool, 5 * 64)  # a's pages serve b now
    assert len(set(b.table)) == 5
    assert pool.free_pages == 1


def test_shared_pages_are_counted_and_freed_by_their_last_holder():
    """share(): another sequence's first pages held too (seq_copy's prefix); a page is free once no table holds
    it; unshare() swaps a shared entry for a fresh page (the caller copies the old one's contents into it)."""
    pool = _core.KvPagePool(8, 64)
    a, b, c = (_core.KvSequence(pool, 1000) for _ in range(3))
    a.grow(pool, 200)  # pages 0..3
    b.grow(pool, 10)  # page 4: given back by share
    b.share(pool, a, 2)
    assert b.table == [0, 1] and pool.free_pages == 4 and [pool.refs(p) for p in range(6)] == [2, 2, 1, 1, 0, 0]
    assert a.owned_pages(pool) == 2 and a.owned_pages(pool, 3) == 1 and b.owned_pages(pool) == 0
    assert b.grow(pool, 129) == 2 and b.table == [0, 1, 4]  # b's own third page
    c.share(pool, b, 3)
    assert [pool.refs(p) for p in (0, 1, 4)] == [3, 3, 2]
    assert b.unshare(pool, 2) == 4 and b.table == [0, 1, 5] and pool.refs(4) == 1 and pool.refs(5) == 1
    assert b.unshare(pool, 2) == -1  # its own already
    a.release(pool)
    assert pool.free_pages == 4  # 2 and 3 back; 0, 1 (b, c), 4 (c), 5 (b) held
    b.shrink(pool, 64)
    assert b.table == [0] and pool.refs(1) == 1 and pool.refs(5) == 0
    c.release(pool)
    b.release(pool)
    assert pool.free_pages == 8 and all(pool.refs(p) == 0 for p in range(8))


def test_sharing_refusals_change_nothing():
    pool = _core.KvPagePool(3, 64)
    a, b = _core.KvSequence(pool, 1000), _core.KvSequence(pool, 100)
    a.grow(pool, 192)
    for bad, match in [((pool, a, 4), "cannot share 4 pages"), ((pool, a, -1), "cannot share -1"),
                       ((pool, a, 3), "this one may hold 2")]:
        with pytest.raises(InvalidRequestError, match=match):
            b.share(*bad)
    with pytest.raises(InvalidRequestError, match="cannot share its own"):
        a.share(pool, a, 1)
    b.share(pool, a, 2)
    with pytest.raises(InvalidRequestError, match="none of the 3 is free"):
        b.unshare(pool, 1)  # (the pool is full)
    with pytest.raises(InvalidRequestError, match="no table entry 2"):
        b.unshare(pool, 2)
    assert b.table == [0, 1] and a.table == [0, 1, 2] and pool.refs(1) == 2 and pool.free_pages == 0


def test_shuffled_pool_scatters_pages_reproducibly():
    def order(seed):
        pool = _core.KvPagePool(50, 64, seed)
        seq = _core.KvSequence(pool, 50 * 64)
        seq.grow(pool, 50 * 64)
        return seq.table

    assert sorted(order(7)) == list(range(50))
    assert order(7) == order(7)
    assert order(7) != order(8) and order(7) != list(range(50))
    assert order(0) == list(range(50))


def test_an_exhausted_pool_is_a_clear_error_and_takes_nothing():
    pool = _core.KvPagePool(3, 64)
    seq = _core.KvSequence(pool, 1000)
    seq.grow(pool, 64)
    with pytest.raises(InvalidRequestError, match="pool exhausted: 193 positions need 4 pages of 64 positions; "
                                                  "the sequence holds 1 and the pool has 2 free of 3"):
        seq.grow(pool, 193)
    assert seq.table == [0] and pool.free_pages == 2  # all or nothing
    assert seq.grow(pool, 192) == 1 and seq.table == [0, 1, 2] and pool.free_pages == 0
    with pytest.raises(InvalidRequestError, match="exceed max_seq_len=1000"):
        seq.grow(pool, 1001)
    seq.release(pool)
    assert pool.free_pages == 3


@pytest.mark.parametrize("n_pages, page_size, match", [(4, 48, "power of two up to 2\\^20, got 48"),
                                                        (4, 0, "got 0"), (0, 64, "kv_pool_pages must be in")])
def test_bad_pool_shapes_are_clear_errors(n_pages, page_size, match):
    with pytest.raises(InvalidRequestError, match=match):
        _core.KvPagePool(n_pages, page_size)


def test_the_tests_paging_helpers_round_trip():
    """to_pages scatters a contiguous cache over a pool (the GPU tests' input); from_pages gathers it back."""
    cache = np.arange(2 * 130 * 8, dtype=np.uint16).reshape(2, 130, 8)
    pool, table = to_pages(cache, 64, seed=5)
    assert pool.shape == (3 + 3, 2, 64, 8) and len(table) == 3 and len(set(table)) == 3
    assert list(table) != [0, 1, 2]  # scattered (seed 5)
    np.testing.assert_array_equal(from_pages(pool, table, 130), cache)
    np.testing.assert_array_equal(pool[table[2], :, 2:], 0x7E00)  # the last page's tail
    np.testing.assert_array_equal(unused_pages(pool, table), 0x7E00)
    np.testing.assert_array_equal(pool[table[1], 1, 3], cache[1, 64 + 3])  # page, head, row: as the kernels address
