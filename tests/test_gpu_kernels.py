"""GPU kernels against their CPU twins (skipped without a usable CUDA device)."""

from __future__ import annotations

import numpy as np
import pytest

from tinyinfer import _core

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("nbytes", [16, 4, 1000, 16 * 333 + 4, 1 << 20, (1 << 24) + 12])
@pytest.mark.parametrize("blocks", [1, 7, 1056])
def test_stream_read_kernel_reads_every_word(nbytes, blocks):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    padded = np.concatenate([data, np.zeros(-nbytes % 4, np.uint8)])
    want = int(np.bitwise_xor.reduce(padded.view("<u4")))
    assert _core.ops.stream_read_xor(data, blocks) == want


def test_read_bandwidth_reports_a_plausible_number():
    r = _core.ops.read_bandwidth(1 << 28, 5)
    assert r["bytes"] == 1 << 28 and r["best_ms"] > 0
    assert 10 < r["gb_per_s"] < 20000  # GB/s: any real GPU is inside this range
