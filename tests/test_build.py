"""The package imports and reports its build on any machine (no GPU or driver needed)."""

from __future__ import annotations

import subprocess
import sys

import tinyinfer
from tinyinfer import _core


def test_build_info_and_device_status_without_raising():
    info = _core.build_info
    assert set(info) >= {"cuda", "cuda_architectures", "openmp", "version"}
    assert info["version"] == tinyinfer.__version__
    status = _core.ops.device_status()
    assert isinstance(status["usable"], bool)
    if not status["usable"]:
        assert status["reason"]  # says why


def test_cli_info_and_help():
    out = subprocess.run([sys.executable, "-m", "tinyinfer", "info"], capture_output=True, text=True, check=True)
    assert "build:" in out.stdout and "cuda device:" in out.stdout
    for cmd in ("run", "chat"):
        h = subprocess.run([sys.executable, "-m", "tinyinfer", cmd, "--help"], capture_output=True, text=True,
                           check=True)
        assert "--model" in h.stdout and "--temperature" in h.stdout


def test_bench_without_a_gpu_says_why():
    from tinyinfer.engine import cuda_status

    if cuda_status()[0]:
        import pytest

        pytest.skip("a GPU is usable here")
    out = subprocess.run([sys.executable, "-m", "tinyinfer", "bench", "--shape", "smollm2-135m"],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert "tinyinfer: error:" in out.stderr and ("CUDA" in out.stderr or "GPU" in out.stderr)


def test_build_info_says_why_there_is_no_cuda_backend():
    from tinyinfer import _core
    from tinyinfer.engine import cuda_status

    info = _core.build_info
    assert bool(info["no_cuda_reason"]) != bool(info["cuda"])  # a reason exactly when CUDA is absent
    if not info["cuda"]:
        usable, why = cuda_status()
        assert not usable and info["no_cuda_reason"] in why
