"""The persistent kernel's synchronisation (cuda/sync.cuh) and weight ring (cuda/ring.cuh), through the probe
kernels of cuda/persistent_probe.cu, and the hand-off inside a thread-block cluster (cuda/cluster_probe.cu):
exact integer results against the CPU, epochs on counters never reset, and the probes' own checksums (skipped
without a usable CUDA device)."""

from __future__ import annotations

import numpy as np
import pytest

from tinyinfer import DeviceError, InvalidRequestError, _core

ops = _core.ops
# Every test needs the GPU except the replica's, which needs only a CUDA build (the op is bound there).
gpu = pytest.mark.gpu
cuda_build = pytest.mark.skipif(not _core.build_info["cuda"], reason="tinyinfer built without CUDA")


def _sm() -> int:
    return int(ops.device_status()["compute_capability"].split(".")[0])


def _copies():
    return [ops.RingCopy.CpAsync] + ([ops.RingCopy.Bulk] if _sm() >= 9 else [])


# ---- the counters: a 64-bit sum carried through every stage's hand-off ----

@gpu
@pytest.mark.parametrize("stages, n", [(1, 1), (3, 1000), (17, 333), (64, 4096)])
@pytest.mark.parametrize("blocks", [1, 7, 0])  # 0: every co-resident block
def test_reduction_chain_equals_the_cpu_sum_for_every_epoch(stages, n, blocks):
    x = np.random.default_rng(stages * n).integers(0, 2**32, (stages, n), dtype=np.uint64).astype(np.uint32)
    epochs = 5
    totals = ops.reduction_chain(x, blocks, epochs)
    base = int(x.astype(np.uint64).sum())
    assert totals == [base + e * x.size for e in range(1, epochs + 1)]


@gpu
def test_reduction_chain_reads_every_partial():
    # ones: any partial read stale or missed (the 0xFF.. poison, or the previous epoch's value) changes the total
    x = np.ones((40, 999), np.uint32)
    assert ops.reduction_chain(x, 0, 3) == [2 * x.size, 3 * x.size, 4 * x.size]


# ---- the hand-off chain: the kernel's last vector against the host replicas ----

def _mix(x, i, k, epoch):
    """cuda/persistent_probe.cu's mix, in numpy uint32 arithmetic (the Python twin of the host replica)."""
    m = np.uint32(0xFFFFFFFF)
    h = (np.uint64(x) ^ (i.astype(np.uint64) * 0x9E3779B1) ^ np.uint64(k * 0x85EBCA77) ^ np.uint64(epoch * 0xC2B2AE3D)) & m
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x7FEB352D)) & m
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(0x846CA68B)) & m
    h ^= h >> np.uint64(16)
    return h.astype(np.uint32)


def _chain_numpy(n_words, groups, stages, epoch):
    n4 = n_words // 4
    bounds = [4 * (g * n4 // groups) for g in range(groups + 1)]
    prev = np.zeros(n_words, np.uint32)
    seed = int(_mix(0x5EED, np.zeros(1, np.uint32), 0, epoch)[0])
    for k in range(1, stages + 1):
        X = [seed] * groups if k == 1 else [int(np.bitwise_xor.reduce(prev[bounds[g]:bounds[g + 1]]))
                                            for g in range(groups)]
        cur = np.empty_like(prev)
        for g in range(groups):
            i = np.arange(bounds[g], bounds[g + 1], dtype=np.uint32)
            cur[bounds[g]:bounds[g + 1]] = _mix(X[(g + 1) % groups], i, k, epoch)
        prev = cur
    return prev


@pytest.mark.parametrize("n_words, groups, stages", [(4, 1, 1), (2048, 1, 9), (5632, 1, 33), (2048, 4, 20),
                                                     (5632, 7, 12)])
@cuda_build
def test_host_replica_matches_numpy(n_words, groups, stages):
    want = _chain_numpy(n_words, groups, stages, 3)
    assert np.array_equal(np.array(ops.handoff_chain_reference(n_words, groups, stages, 3), np.uint32), want)


@pytest.mark.parametrize("n_words, groups, blocks", [(2048, 1, 0), (5632, 1, 0), (2048, 1, 7), (2048, 7, 7),
                                                     (2048, 3, 132), (5632, 32, 64), (1000, 250, 250)])
@gpu
@pytest.mark.parametrize("epochs", [1, 4])
def test_handoff_chain_equals_the_host_replica(n_words, groups, blocks, epochs):
    got = np.array(ops.handoff_chain(n_words, groups, 24, blocks, epochs), np.uint32)
    assert np.array_equal(got, _chain_numpy(n_words, groups, 24, epochs))


# ---- the hand-off inside a thread-block cluster (sm_90) ----

def _cluster_chain_numpy(n_words, stages):
    i = np.arange(n_words, dtype=np.uint32)
    v = _mix(0x5EED, i, 0, 0)
    for s in range(1, stages + 1):
        v = _mix(int(np.bitwise_xor.reduce(v)) if n_words else 0, i, s, 0)
    return v


@cuda_build
@pytest.mark.parametrize("n_words, stages", [(0, 1), (1, 3), (2051, 7)])
def test_cluster_host_replica_matches_numpy(n_words, stages):
    want = _cluster_chain_numpy(n_words, stages)
    assert np.array_equal(np.array(ops.cluster_chain_reference(n_words, stages), np.uint32), want)


@gpu
@pytest.mark.parametrize("n_words", [1, 7, 300, 2051, 5632])  # fewer words than blocks; slices of unequal size
@pytest.mark.parametrize("cluster", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("where", ["dsmem", "global", "one_way"])
def test_cluster_chain_equals_the_host_replica(n_words, cluster, where):
    if _sm() < 9:
        pytest.skip("thread-block clusters need sm_90")
    if where == "one_way" and cluster == 1:
        pytest.skip("st.async needs a cluster of two or more (the refusal: test_cluster_probe_checksum...)")
    got = np.array(ops.cluster_chain(n_words, cluster, where != "global", 9, where == "one_way"), np.uint32)
    assert np.array_equal(got, _cluster_chain_numpy(n_words, 9))


@gpu
@pytest.mark.parametrize("stages", [1, 2, 3, 200])  # both buffers' phases, an odd and an even last stage
def test_cluster_one_way_chain_over_many_stages(stages):
    if _sm() < 9:
        pytest.skip("thread-block clusters need sm_90")
    for cluster in (2, 16):
        got = np.array(ops.cluster_chain(2051, cluster, True, stages, True), np.uint32)
        assert np.array_equal(got, _cluster_chain_numpy(2051, stages))


@gpu
def test_cluster_probe_checksum_and_bad_arguments():
    if _sm() < 9:
        with pytest.raises(DeviceError, match="sm_90"):
            ops.cluster_handoff_latency(2048, 2, True, 4, 1)
        return
    r = ops.cluster_handoff_latency(2048, 4, True, 16, 2)
    assert r["checksum_ok"] and r["clusters"] >= 1 and r["blocks"] == 4 * r["clusters"]
    assert ops.cluster_handoff_latency(0, 8, True, 16, 2, True)["checksum_ok"]
    with pytest.raises(InvalidRequestError, match="relaxed_barrier needs n_words = 0"):
        ops.cluster_handoff_latency(64, 2, True, 4, 1, True)
    r = ops.cluster_handoff_latency(2048, 4, True, 16, 2, False, True)
    assert r["checksum_ok"] and r["blocks"] == 4 * r["clusters"]
    r = ops.cluster_handoff_latency(2048, 4, True, 16, 2, False, True, 3)  # at most 3 clusters
    assert r["checksum_ok"] and r["clusters"] == 3 and r["blocks"] == 12
    with pytest.raises(InvalidRequestError, match="max_clusters"):
        ops.cluster_handoff_latency(64, 2, True, 4, 1, False, False, -1)
    for n_words, cluster, dsmem in ((0, 2, True), (64, 2, False), (64, 1, True)):
        with pytest.raises(InvalidRequestError, match="one_way needs dsmem, n_words >= 1 and cluster >= 2"):
            ops.cluster_chain(n_words, cluster, dsmem, 2, True)
    for bad in (0, 17):
        with pytest.raises(InvalidRequestError, match="cluster must be 1 to 16"):
            ops.cluster_chain(64, bad, True, 2)
    for stages in (0, 1 << 25):
        with pytest.raises(InvalidRequestError, match="stages"):
            ops.cluster_chain(64, 2, False, stages)
    with pytest.raises(InvalidRequestError, match="shared memory"):
        ops.cluster_chain(1 << 20, 2, True, 1)
    assert ops.cluster_chain(64, 2, True, 2) == ops.cluster_chain_reference(64, 2)  # still usable


# ---- the weight ring ----

@gpu
@pytest.mark.parametrize("stages", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("slot_kib", [8, 16])
@pytest.mark.parametrize("chunks, blocks", [(1, 1), (5, 3), (333, 7), (100, 0)])
def test_ring_xor_reads_every_word(stages, slot_kib, chunks, blocks):
    data = np.random.default_rng(chunks * stages).integers(0, 256, chunks * slot_kib * 1024, dtype=np.uint8)
    want = int(np.bitwise_xor.reduce(data.view("<u4")))
    for copy in _copies():
        assert ops.ring_xor(data, copy, stages, slot_kib, blocks) == want, copy


@gpu
def test_ring_bandwidth_checksum_and_bytes():
    """The ring read every byte (checksum) of the 2^28 asked for (whole 16 KiB chunks); its rate is bench material."""
    for copy in _copies():
        r = ops.ring_bandwidth(copy, 4, 16, 1 << 28, 3)
        assert r["checksum_ok"], copy
        assert r["bytes"] == 1 << 28 and r["blocks"] >= 1 and r["best_ms"] > 0, (copy, r)
        assert r["gb_per_s"] == pytest.approx(r["bytes"] / (r["best_ms"] * 1e-3) / 1e9, rel=1e-9)


@gpu
def test_handoff_latency_checksum():
    for groups in (1, 8):
        r = ops.handoff_latency(2048, groups, 32, 1, 0, 2)
        assert r["checksum_ok"] and r["blocks"] >= 8 and r["stages"] == 32


@gpu
def test_stream_handoff_checksum():
    r = ops.stream_handoff(_copies()[-1], 4, 16, 1 << 28, 4e6, 2048, 0, 2)
    assert r["checksum_ok"] and r["handoffs"] >= 1 and r["gb_per_s_alone"] > 0


# ---- bad input ----

@gpu
def test_bad_arguments_are_request_errors():
    with pytest.raises(InvalidRequestError, match="multiple of 4"):
        ops.handoff_chain(1001, 1, 4, 0, 1)
    with pytest.raises(InvalidRequestError, match="groups"):
        ops.handoff_chain(16, 5, 4, 0, 1)
    with pytest.raises(InvalidRequestError, match="co-resident"):
        ops.handoff_chain(2048, 1, 4, 10**7, 1)
    with pytest.raises(InvalidRequestError, match="groups must be <= blocks"):
        ops.handoff_chain(2048, 8, 4, 4, 1)
    with pytest.raises(InvalidRequestError, match="stages must be one of"):
        ops.ring_xor(np.zeros(8192, np.uint8), ops.RingCopy.CpAsync, 5, 8, 1)
    with pytest.raises(InvalidRequestError, match="multiple of slot_kib"):
        ops.ring_xor(np.zeros(1000, np.uint8), ops.RingCopy.CpAsync, 2, 8, 1)
    with pytest.raises(InvalidRequestError, match="shared memory"):
        ops.ring_bandwidth(ops.RingCopy.CpAsync, 8, 64, 1 << 28, 1)
    with pytest.raises(InvalidRequestError, match="epochs"):
        ops.reduction_chain(np.ones((2, 2), np.uint32), 1, 0)
    for w in (-1, 8):
        with pytest.raises(InvalidRequestError, match="issuer_warp must be 0 to 7"):
            ops.ring_bandwidth(ops.RingCopy.Bulk, 4, 16, 1 << 24, 1, 1, w)
        with pytest.raises(InvalidRequestError, match="issuer_warp must be 0 to 7"):
            ops.stream_handoff(ops.RingCopy.Bulk, 4, 16, 1 << 26, 4e6, 2048, 0, 1, 1, w)


@gpu
def test_bulk_ring_below_sm90_is_a_device_error():
    if _sm() >= 9:
        pytest.skip("sm_90+: the bulk ring runs")
    with pytest.raises(DeviceError, match="sm_90"):
        ops.ring_xor(np.zeros(8192, np.uint8), ops.RingCopy.Bulk, 2, 8, 1)
