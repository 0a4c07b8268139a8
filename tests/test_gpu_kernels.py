"""GPU kernels against their CPU twins (skipped without a usable CUDA device)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import from_pages, to_pages, unused_pages
from tinyinfer import InvalidRequestError, _core

pytestmark = pytest.mark.gpu


def gemv_modes(mode_in: str, mode_out: str):
    """The ops.GemvIn / ops.GemvOut enums for this file's short mode names (the numpy reference uses the names)."""
    ins = {"f16": _core.ops.GemvIn.F16, "f32norm": _core.ops.GemvIn.F32Norm}
    outs = {"f32": _core.ops.GemvOut.F32, "add": _core.ops.GemvOut.AddF32, "swiglu": _core.ops.GemvOut.Swiglu}
    return ins[mode_in], outs[mode_out]


@pytest.mark.parametrize("nbytes", [16, 4, 1000, 16 * 333 + 4, 1 << 20, (1 << 24) + 12])
@pytest.mark.parametrize("blocks", [1, 7, 1056])
def test_stream_read_kernel_reads_every_word(nbytes, blocks):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    padded = np.concatenate([data, np.zeros(-nbytes % 4, np.uint8)])
    want = int(np.bitwise_xor.reduce(padded.view("<u4")))
    assert _core.ops.stream_read_xor(data, blocks) == want


def test_read_bandwidth_reports_its_bytes_and_rate():
    """The bytes read and the rate they give over the best time (its speed is bench material, not asserted)."""
    r = _core.ops.read_bandwidth(1 << 28, 5)
    assert r["bytes"] == 1 << 28 and r["best_ms"] > 0 and r["blocks"] >= 1
    assert r["gb_per_s"] == pytest.approx(r["bytes"] / (r["best_ms"] * 1e-3) / 1e9, rel=1e-9)
    # One SM's clock over the best pass, cycles / global-timer ns: a GPU clock, not a count of another unit.
    assert 200 < r["sm_mhz"] < 4000, r


# ---- GEMV (cuda/gemv.cu) vs numpy ----

def _gemv_ref(W16, x, norm_w, eps, y_init, mode_in, mode_out):
    W = W16.astype(np.float64)
    if mode_in == "f16":
        xin = x.astype(np.float16).astype(np.float64)
    else:
        inv = 1.0 / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps)
        xin = (norm_w * (x * np.float32(inv))).astype(np.float16).astype(np.float64)
    y = W @ xin
    bound = np.abs(W) @ np.abs(xin)  # the scale of each dot: rounding error is relative to this
    if mode_out == "add":
        y = y + y_init
    if mode_out == "swiglu":
        # each dot's error (at most 2e-5 of its bound, as the f32 modes') carried through silu(g) u to first
        # order: silu' <= 1.1 and |silu(g)| <= |g|
        g, u = y[0::2], y[1::2]
        y = g / (1 + np.exp(-g)) * u
        bound = 1.1 * bound[0::2] * np.abs(u) + bound[1::2] * np.abs(g)
    return y, bound


# K = 8,192 normed: 48 KB of dynamic shared memory, past the default limit only with the kernel's static arrays counted
@pytest.mark.parametrize("rows, K", [(333, 1000), (2048, 5632), (64, 300), (2, 8), (1000, 2048), (6, 4104), (40, 11008),
                                     (6, 8192)])
@pytest.mark.parametrize("R", [1, 2, 4, 8])  # 8: the split-K variant
@pytest.mark.parametrize("mode_in, mode_out", [("f16", "f32"), ("f32norm", "f32"), ("f16", "add"),
                                               ("f32norm", "swiglu")])
@pytest.mark.parametrize("grid", [0, 1, -3])  # a block per tile / one per SM / 3 blocks looping over tiles
def test_gemv_matches_numpy(rows, K, R, mode_in, mode_out, grid):
    if mode_out == "swiglu" and (R == 1 or rows % 2):
        pytest.skip("swiglu needs R >= 2 and an even row count")
    rng = np.random.default_rng(rows * 7 + K)
    W16 = (rng.standard_normal((rows, K)) / np.sqrt(K)).astype(np.float16)
    x = rng.standard_normal(K).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, K).astype(np.float32)
    y_init = rng.standard_normal(rows).astype(np.float32)
    y = np.array(_core.ops.gemv(W16.view(np.uint16), x, norm_w, 1e-5, y_init, R, *gemv_modes(mode_in, mode_out), grid))
    ref, bound = _gemv_ref(W16, x, norm_w, 1e-5, y_init, mode_in, mode_out)
    assert y.shape == ref.shape
    assert np.isfinite(y).all(), "an output was not written (poisoned NaN left)"
    tol = 2e-5 * bound + 1e-6  # fp32 sums of fp16 products
    if mode_out == "swiglu":  # its fp16 output: rounding is 2^-11 relative, twice that allowed
        tol += 1e-3 * np.abs(ref)
    bad = np.abs(y - ref) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} outside tolerance; worst {np.abs(y - ref).max():.3g}"


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("mode_out", ["f32", "swiglu"])
def test_gemv_normed_input_past_fp16_range(R, mode_out):
    """A residual stream whose values (times the norm weight) pass fp16's 65,504: the normed input is still
    finite and right (a kernel that stages the input in fp16 must normalise it first)."""
    if mode_out == "swiglu" and R == 1:
        pytest.skip("swiglu needs R >= 2")
    rows, K = 96, 2048
    rng = np.random.default_rng(K + R)
    W16 = (rng.standard_normal((rows, K)) / np.sqrt(K)).astype(np.float16)
    x = rng.standard_normal(K).astype(np.float32) * 3e4
    x[[5, 700]] = [2.5e5, -1e5]
    norm_w = rng.uniform(0.5, 1.5, K).astype(np.float32)
    y_init = np.zeros(rows, np.float32)
    y = np.array(_core.ops.gemv(W16.view(np.uint16), x, norm_w, 1e-5, y_init, R, *gemv_modes("f32norm", mode_out), 1))
    ref, bound = _gemv_ref(W16, x, norm_w, 1e-5, y_init, "f32norm", mode_out)
    assert np.isfinite(y).all()
    tol = 2e-5 * bound + 1e-6 + (1e-3 * np.abs(ref) if mode_out == "swiglu" else 0)
    assert (np.abs(y - ref) <= tol).all(), f"worst {np.abs(y - ref).max():.3g}"


def test_gemv_refuses_bad_variant():
    W = np.zeros((4, 8), np.uint16)
    x = np.zeros(8, np.float32)
    with pytest.raises(Exception, match="R=3"):
        _core.ops.gemv(W, x, x, 1e-5, np.zeros(4, np.float32), 3, *gemv_modes("f16", "f32"))


# ---- decode attention (cuda/attention.cu) vs numpy ----

def _rope_tables(max_seq, hd, theta=10000.0):
    inv = (1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)).astype(np.float32)
    ang = np.arange(max_seq, dtype=np.float32)[:, None] * inv[None, :]
    return np.cos(ang.astype(np.float64)).astype(np.float32), np.sin(ang.astype(np.float64)).astype(np.float32)


def _rot(x, c, s):
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


# tensor_cores: head dims 64 / 128 at chunk 64 take the mma.sync tile (fp16 queries and probabilities); False
# keeps the lane-per-position form, which every other head dim and chunk size takes anyway
@pytest.mark.parametrize("group", [1, 3, 4, 7, 8, 16])
@pytest.mark.parametrize("hd", [64, 96, 128, 256])
@pytest.mark.parametrize("pos", [0, 1, 15, 16, 17, 31, 40, 63, 64, 200, 511])
@pytest.mark.parametrize("tensor_cores", [True, False])
def test_decode_attention_matches_numpy(group, hd, pos, tensor_cores):
    _check_attention(group, hd, pos, 64, tensor_cores=tensor_cores)


# chunks of other sizes (CudaOptions.attn_chunk): up to 4 positions per lane (128), several chunks per head; 40:
# chunks that straddle two pages
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("pos", [5, 31, 200])
@pytest.mark.parametrize("chunk", [16, 40, 128])
def test_decode_attention_chunk_sizes(group, hd, pos, chunk):
    _check_attention(group, hd, pos, chunk, page_size=128 if chunk == 128 else 64)


# The paged cache: contexts (pos + 1) of 1, 63, 64, 65, 200, 1000 against pages of 64 (and larger pages, and the
# smallest page a chunk allows), every supported head dim, the GQA groups of Llama-family models.
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("hd", [64, 96, 128, 256])
@pytest.mark.parametrize("pos", [0, 62, 63, 64, 199, 999])
@pytest.mark.parametrize("page_size", [64, 256])
def test_decode_attention_paged(group, hd, pos, page_size):
    _check_attention(group, hd, pos, 64 if hd <= 128 else 32, page_size=page_size, max_seq=1024 + 37)


# The merge kernel over many chunks: more than one round of 8 chunks per thread (head dim 64 at chunk 16: 63
# chunks over 4 threads a dim), a head dim whose block is rounded up to whole warps (72: 2 x 72 threads -> 160),
# and one thread a dim (256).
@pytest.mark.parametrize("hd, chunk, pos", [(64, 16, 999), (72, 64, 700), (72, 16, 1000), (128, 16, 1000),
                                            (256, 32, 1023)])
def test_decode_attention_merge_many_chunks(hd, chunk, pos):
    _check_attention(4, hd, pos, chunk, page_size=64, max_seq=1024 + 37)


@pytest.mark.parametrize("pos", [0, 15, 16, 17, 100])
def test_decode_attention_small_pages(pos):
    """Pages as small as the chunk (16): every chunk its own page."""
    _check_attention(4, 64, pos, 16, page_size=16, max_seq=128)


def _attention_twin(qkv, kc, vc, kb, vb, pos, n_heads, cos, sin):
    """The CPU twin of one row's decode attention (float64), after checking what the kernel wrote into the row's
    cache: rope(k) and v at pos (fp16) and nothing else. kc, vc: the cache before the call (n_kv, > pos, hd) fp16
    (NaN past pos; pos is set here); kb, vb: the same positions read back from the pools after it (fp16 bits)."""
    n_kv, _, hd = kc.shape
    group = n_heads // n_kv
    q = qkv[: n_heads * hd].reshape(n_heads, hd)
    k = qkv[n_heads * hd : (n_heads + n_kv) * hd].reshape(n_kv, hd)
    v = qkv[(n_heads + n_kv) * hd :].reshape(n_kv, hd)
    c, s = cos[pos], sin[pos]
    k_new = _rot(k, c, s).astype(np.float16)
    kc[:, pos], vc[:, pos] = k_new, v.astype(np.float16)
    np.testing.assert_array_equal(kb.view(np.float16)[:, pos], k_new)
    np.testing.assert_array_equal(vb.view(np.float16)[:, pos], v.astype(np.float16))
    np.testing.assert_array_equal(kb.view(np.float16)[:, :pos], kc[:, :pos])
    np.testing.assert_array_equal(vb.view(np.float16)[:, :pos], vc[:, :pos])
    np.testing.assert_array_equal(kb[:, pos + 1 :], 0x7E00)
    qr = _rot(q, c, s).astype(np.float64) / np.sqrt(hd)
    ref = np.empty((n_heads, hd))
    for h in range(n_heads):
        K = kc[h // group, : pos + 1].astype(np.float64)
        V = vc[h // group, : pos + 1].astype(np.float64)
        sc = K @ qr[h]
        p = np.exp(sc - sc.max())
        ref[h] = p @ V / p.sum()
    return ref


def _check_attention(group, hd, pos, chunk, page_size=64, max_seq=512, tensor_cores=True):
    n_kv = 2
    n_heads = n_kv * group
    rng = np.random.default_rng(group * 1000 + hd + pos)
    qkv = rng.standard_normal((n_heads + 2 * n_kv) * hd).astype(np.float32)
    kc = rng.standard_normal((n_kv, max_seq, hd)).astype(np.float16)
    vc = rng.standard_normal((n_kv, max_seq, hd)).astype(np.float16)
    kc[:, pos + 1 :] = np.nan  # positions past pos must never be read
    vc[:, pos + 1 :] = np.nan
    cos, sin = _rope_tables(max_seq, hd)
    # the pages scattered over a pool with unused pages among them (NaN: a wrong page read shows)
    kp, table = to_pages(kc.view(np.uint16), page_size, seed=pos + hd)
    vp, _ = to_pages(vc.view(np.uint16), page_size, seed=pos + hd)
    spare_k, spare_v = unused_pages(kp, table).copy(), unused_pages(vp, table).copy()
    out = np.array(_core.ops.decode_attention(qkv, kp, vp, table, cos, sin, pos, n_heads, chunk, tensor_cores))
    kb, vb = from_pages(kp, table, max_seq), from_pages(vp, table, max_seq)

    np.testing.assert_array_equal(unused_pages(kp, table), spare_k)
    np.testing.assert_array_equal(unused_pages(vp, table), spare_v)
    ref = _attention_twin(qkv, kc, vc, kb, vb, pos, n_heads, cos, sin)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out.reshape(n_heads, hd), ref, atol=3e-3, rtol=3e-3)


def test_decode_attention_bad_pages_are_clear_errors():
    hd, n_kv, n_heads, max_seq = 64, 1, 2, 128
    qkv = np.zeros((n_heads + 2 * n_kv) * hd, np.float32)
    cos, sin = _rope_tables(max_seq, hd)
    pool = np.zeros((2, n_kv, 64, hd), np.uint16)
    with pytest.raises(InvalidRequestError, match=r"page_table\[1\] = 5 is not a page of a pool of 2"):
        _core.ops.decode_attention(qkv, pool, pool.copy(), np.array([0, 5], np.int32), cos, sin, 70, n_heads, 64)
    with pytest.raises(InvalidRequestError, match="positions out of range of a page table of 1 pages"):
        _core.ops.decode_attention(qkv, pool, pool.copy(), np.array([0], np.int32), cos, sin, 3, n_heads, 64)
    with pytest.raises(InvalidRequestError, match="page size 64 must be >= the chunk of 128"):
        _core.ops.decode_attention(qkv, pool, pool.copy(), np.array([0, 1], np.int32), cos, sin, 3, n_heads, 128)
    odd = np.zeros((2, n_kv, 48, hd), np.uint16)
    with pytest.raises(InvalidRequestError, match="must be a power of two, got 48"):
        _core.ops.decode_attention(qkv, odd, odd.copy(), np.array([0, 1, 0], np.int32), cos, sin, 3, n_heads, 16)


# The batched form (cuda/attention_rows.cu): splits of `span` positions per block (by default 256 at head dim 64,
# 128 up to 128, 64 above; smaller by DecodeAttnParams::rows_span); a longer row is split, and merged in the same
# launch by its last split to finish.
def _span(hd, span=0):
    return span or (256 if hd <= 64 else 128 if hd <= 128 else 64)


def _rows_lengths(hd, span=0):
    """Contexts (pos + 1) mixed in one batch: 1, span - 1, span, span + 1, a padding row (0), rows crossing 2 and 3
    splits, a short odd one."""
    sp = _span(hd, span)
    return [1, sp - 1, sp, sp + 1, 0, 3 * sp + 7, 2 * sp, 37]


def _rows_case(group, hd, lengths, page_size, max_seq, n_kv=2, seed=0):
    """Rows of the given contexts (0: padding) in one shared pool (pages in a random order, 3 spare pages, NaN
    past each row's cached positions), each with its own page table; the slots in a shuffled order."""
    n_heads, n_rows = n_kv * group, len(lengths)
    rng = np.random.default_rng(seed * 7919 + group * 131 + hd)
    stride = -(-max_seq // page_size)
    n_pages = [-(-L // page_size) for L in lengths]
    ids = rng.permutation(sum(n_pages) + 3).astype(np.int32)
    kp = np.full((len(ids), n_kv, page_size, hd), 0x7E00, np.uint16)
    vp = kp.copy()
    row_slot = rng.permutation(n_rows).astype(np.int32)
    tables = np.full((n_rows, stride), -1, np.int32)
    caches, used = [], 0
    for r, L in enumerate(lengths):
        kc = np.full((n_kv, n_pages[r] * page_size, hd), np.nan, np.float16)
        vc = kc.copy()
        kc[:, : max(L - 1, 0)] = rng.standard_normal((n_kv, max(L - 1, 0), hd))
        vc[:, : max(L - 1, 0)] = rng.standard_normal((n_kv, max(L - 1, 0), hd))
        table = ids[used : used + n_pages[r]]
        used += n_pages[r]
        tables[row_slot[r], : n_pages[r]] = table
        for j, pg in enumerate(table):
            kp[pg] = kc[:, j * page_size : (j + 1) * page_size].view(np.uint16)
            vp[pg] = vc[:, j * page_size : (j + 1) * page_size].view(np.uint16)
        caches.append((kc, vc, table))
    cos, sin = _rope_tables(max_seq, hd)
    return dict(qkv=rng.standard_normal((n_rows, (n_heads + 2 * n_kv) * hd)).astype(np.float32), kp=kp, vp=vp,
                tables=tables, cos=cos, sin=sin, row_pos=np.array([L - 1 for L in lengths], np.int32),
                row_slot=row_slot, n_heads=n_heads, caches=caches, spare=ids[used:])


def _attention_rows(c, rows=None, grid_x=0, span=0, heads=0):
    """ops.decode_attention_rows on case c (rows: a subset of its rows, in this order); the pools updated in place."""
    rows = np.arange(len(c["row_pos"])) if rows is None else np.asarray(rows)
    return np.asarray(_core.ops.decode_attention_rows(
        np.ascontiguousarray(c["qkv"][rows]), c["kp"], c["vp"], c["tables"], c["cos"], c["sin"],
        np.ascontiguousarray(c["row_pos"][rows]), np.ascontiguousarray(c["row_slot"][rows]), c["n_heads"], grid_x,
        span, heads))


def _check_attention_rows(group, hd, lengths, page_size=64, max_seq=1024 + 37, grid_x=0, span=0, heads=0):
    c = _rows_case(group, hd, lengths, page_size, max_seq)
    kp, vp, n_heads = c["kp"], c["vp"], c["n_heads"]
    spare_k, spare_v = kp[c["spare"]].copy(), vp[c["spare"]].copy()
    out = _attention_rows(c, grid_x=grid_x, span=span, heads=heads)
    assert out.shape == (len(lengths), n_heads * hd)
    np.testing.assert_array_equal(kp[c["spare"]], spare_k)
    np.testing.assert_array_equal(vp[c["spare"]], spare_v)
    for r, L in enumerate(lengths):
        if L == 0:  # a padding row: no output written (its pages: none to write)
            assert np.isnan(out[r]).all()
            continue
        kc, vc, table = c["caches"][r]
        n = len(table) * kp.shape[2]  # the whole last page: nothing past pos written
        kb, vb = from_pages(kp, table, n), from_pages(vp, table, n)
        ref = _attention_twin(c["qkv"][r], kc, vc, kb, vb, L - 1, n_heads, c["cos"], c["sin"])
        assert np.isfinite(out[r]).all(), f"row {r} (context {L})"
        np.testing.assert_allclose(out[r].reshape(n_heads, hd), ref, atol=3e-3, rtol=3e-3,
                                   err_msg=f"row {r} (context {L})")


@pytest.mark.parametrize("group", [1, 3, 4, 7, 8, 16])
@pytest.mark.parametrize("hd", [64, 96, 128, 256])
def test_decode_attention_rows_matches_twin(group, hd):
    _check_attention_rows(group, hd, _rows_lengths(hd))


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("page_size", [16, 256])
def test_decode_attention_rows_page_sizes(hd, page_size):
    """Pages smaller than a split (a split over many pages) and larger (several splits in one page)."""
    _check_attention_rows(4, hd, _rows_lengths(hd), page_size=page_size)


@pytest.mark.parametrize("hd, span, group", [(64, 64, 8), (64, 128, 4), (128, 64, 8), (96, 64, 3), (256, 64, 7)])
def test_decode_attention_rows_smaller_spans(hd, span, group):
    """CudaOptions::batch_attn_span: shorter blocks (more lanes per position), more splits and merges."""
    _check_attention_rows(group, hd, _rows_lengths(hd, span), span=span)
    _check_attention_rows(group, hd, _rows_lengths(hd, span), span=span, grid_x=1, page_size=16)


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
@pytest.mark.parametrize("hd, group", [(64, 1), (64, 3), (64, 8), (96, 7), (128, 4), (128, 16), (256, 5)])
def test_decode_attention_rows_heads_per_block(hd, group, heads):
    """CudaOptions::batch_attn_heads: a KV head's group in slices of 1 / 2 / 4 / 8 query heads per block (the last
    slice partial when the group is not a multiple), with splits and merges (span 64) and without."""
    _check_attention_rows(group, hd, _rows_lengths(hd), heads=heads)
    _check_attention_rows(group, hd, _rows_lengths(hd, 64), span=64, heads=heads, page_size=16)


@pytest.mark.parametrize("hd, group", [(64, 8), (128, 7)])
def test_decode_attention_rows_same_bits_at_any_heads_per_block(hd, group):
    """Each head's operations do not depend on which other heads share its block: the slices give the same bits
    as the whole group (auto, 2, 4, 8), so a bucket's choice never changes a sequence's tokens."""
    c = _rows_case(group, hd, _rows_lengths(hd), 64, 1024 + 37)
    ref = _attention_rows(c, heads=8)
    for heads in (0, 1, 2, 4):
        np.testing.assert_array_equal(_attention_rows(c, heads=heads), ref)


@pytest.mark.parametrize("grid_x", [1, 2])
def test_decode_attention_rows_blocks_loop_over_splits(grid_x):
    """A grid narrower than the longest row's splits (as for large buckets): each block takes several splits."""
    _check_attention_rows(8, 64, [4 * 256 + 3, 1, 600, 0, 257], grid_x=grid_x)


@pytest.mark.parametrize("hd", [64, 128])
def test_decode_attention_rows_row_independent_of_the_batch(hd):
    """A row's output is bit for bit the same among others, alone, and on a narrower grid: split boundaries and
    the merge order depend on its own length only (the greedy tokens of a slot must not depend on the batch)."""
    lengths = _rows_lengths(hd)
    c = _rows_case(4, hd, lengths, 64, 1024 + 37)
    together = _attention_rows(c)
    np.testing.assert_array_equal(_attention_rows(c, grid_x=1), together)
    for r, L in enumerate(lengths):
        np.testing.assert_array_equal(_attention_rows(c, rows=[r])[0], together[r])
    rev = list(range(len(lengths)))[::-1]
    np.testing.assert_array_equal(_attention_rows(c, rows=rev), together[rev])


@pytest.mark.parametrize("hd, group, heads", [(64, 4, 0), (96, 3, 1), (96, 3, 2), (128, 8, 2), (256, 2, 0)])
def test_decode_attention_rows_act8_out_is_the_rounding_of_its_output(hd, group, heads):
    """DecodeAttnParams::act8_out (the batched step's o on int8 inputs): the output, single splits and merged ones
    alike, whole slices of a group's heads and a partial one (group 3 in slices of 2), is bit for bit
    act8_round_rows of the plain output (fp16(d xq) per group of 32 dims)."""
    c = _rows_case(group, hd, _rows_lengths(hd), 64, 1024 + 37)
    plain = _attention_rows(c, heads=heads)
    rows = np.asarray(c["row_pos"]) >= 0  # (padding rows: nothing written, NaN)
    got = np.asarray(_core.ops.decode_attention_rows(
        c["qkv"], c["kp"], c["vp"], c["tables"], c["cos"], c["sin"], c["row_pos"], c["row_slot"], c["n_heads"],
        heads=heads, act8_out=True))
    np.testing.assert_array_equal(got[rows], _core.ops.act8_round_rows(plain[rows]))
    assert np.isnan(got[~rows]).all()


def test_decode_attention_rows_bad_input_is_a_clear_error():
    c = _rows_case(4, 64, [10, 70], 64, 128)
    bad_pos = c["row_pos"].copy()
    bad_pos[1] = 500
    with pytest.raises(InvalidRequestError, match="position or slot out of range"):
        _core.ops.decode_attention_rows(c["qkv"], c["kp"], c["vp"], c["tables"], c["cos"], c["sin"], bad_pos,
                                        c["row_slot"], c["n_heads"])
    with pytest.raises(InvalidRequestError, match="batch_attn_span 256 must be 64, 128 or 256 and at most 128"):
        c128 = _rows_case(1, 128, [10], 64, 128)
        _attention_rows(c128, span=256)
    with pytest.raises(InvalidRequestError, match="batch_attn_span 96 must be"):
        _attention_rows(c, span=96)
    with pytest.raises(InvalidRequestError, match=r"batch_attn_heads 3 must be 0 \(auto\), 1, 2, 4 or 8"):
        _attention_rows(c, heads=3)
    with pytest.raises(InvalidRequestError, match="act8_out needs head_dim % 32 == 0"):
        c72 = _rows_case(2, 72, [10, 3], 64, 128)
        _core.ops.decode_attention_rows(c72["qkv"], c72["kp"], c72["vp"], c72["tables"], c72["cos"], c72["sin"],
                                        c72["row_pos"], c72["row_slot"], c72["n_heads"], act8_out=True)
    with pytest.raises(InvalidRequestError, match="is not a page of a pool"):
        tables = c["tables"].copy()
        tables[c["row_slot"][1], 1] = -1
        _core.ops.decode_attention_rows(c["qkv"], c["kp"], c["vp"], tables, c["cos"], c["sin"], c["row_pos"],
                                        c["row_slot"], c["n_heads"])
