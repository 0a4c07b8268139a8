"""The package imports and reports its build on any machine (no GPU or driver needed)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert "build: " in out.stdout and "\nGPU: " in out.stdout and "{" not in out.stdout
    for cmd in ("run", "chat"):
        h = subprocess.run([sys.executable, "-m", "tinyinfer", cmd, "--help"], capture_output=True, text=True,
                           check=True)
        assert "--model" in h.stdout and "--temperature" in h.stdout


def test_no_gpu_sentence_only_without_the_driver(monkeypatch):
    """A CPU-only build on a machine with no NVIDIA driver is told so, not to rebuild (which would not help)."""
    from tinyinfer import loading

    monkeypatch.setattr(loading.sys, "platform", "linux")
    monkeypatch.setattr(loading.os.path, "exists", lambda p: False)
    assert "no NVIDIA GPU on this machine" in loading.no_gpu_sentence()
    monkeypatch.setattr(loading.os.path, "exists", lambda p: p == "/dev/nvidiactl")
    assert loading.no_gpu_sentence() is None
    monkeypatch.setattr(loading.sys, "platform", "darwin")
    assert loading.no_gpu_sentence() is None


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
    from tinyinfer.engine import cuda_status, no_cuda_sentence
    from tinyinfer.loading import no_gpu_sentence

    info = dict(_core.build_info)
    assert set(info) >= {"no_cuda_reason", "nvcc_version", "source_dir"}
    assert info["no_cuda_reason"] in ("", "no-nvcc", "no-cublaslt", "cuda-off")
    assert bool(info["no_cuda_reason"]) != bool(info["cuda"])  # a reason exactly when CUDA is absent
    if info["cuda"] or info["no_cuda_reason"] == "no-cublaslt":
        assert re.fullmatch(r"\d+\.\d+", info["nvcc_version"]), info
    if not info["cuda"]:
        assert cuda_status() == (False, no_gpu_sentence() or no_cuda_sentence(info))
        out = subprocess.run([sys.executable, "-m", "tinyinfer", "info"], capture_output=True, text=True, check=True)
        assert "GPU: none usable: " + (no_gpu_sentence() or no_cuda_sentence(info)) in out.stdout.splitlines()


@pytest.mark.parametrize("reason, nvcc, says, fix", [
    ("no-cublaslt", "13.0", "nvcc 13.0 was found but not cuBLASLt when tinyinfer was built",
     "pip install nvidia-cublas && pip install --force-reinstall --no-deps --no-cache-dir "),
    ("no-cublaslt", "12.4", "nvcc 12.4 was found but not cuBLASLt",
     "pip install nvidia-cublas-cu12 && pip install --force-reinstall --no-deps --no-cache-dir "),
    ("no-nvcc", "", "no CUDA compiler was found when tinyinfer was built",
     "pip install 'cuda-toolkit[nvcc,cudart,cccl]' && pip install --force-reinstall --no-deps --no-cache-dir "),
    ("cuda-off", "", "tinyinfer was built with TINYINFER_CUDA=OFF",
     "fix: pip install --force-reinstall --no-deps --no-cache-dir "),
])
def test_no_cuda_sentence_is_one_flat_sentence_with_the_fix(tmp_path, reason, nvcc, says, fix):
    from tinyinfer.engine import no_cuda_sentence

    src = tmp_path / "my src"
    src.mkdir()
    info = {"cuda": False, "no_cuda_reason": reason, "nvcc_version": nvcc, "source_dir": str(src)}
    # the source tree built is gone (an sdist unpacked in a temporary directory): reinstall from the index
    gone = no_cuda_sentence(info)
    assert gone.startswith("no CUDA backend: ") and says in gone and gone.endswith(fix + "tinyinfer")
    assert "(" not in gone and "\n" not in gone
    # still there (`pip install .` from a checkout): reinstall from it, quoted for the shell
    (src / "pyproject.toml").write_text("")
    assert no_cuda_sentence(info).endswith(fix + shlex.quote(str(src)))


# ---- the build backend's cuBLAS requirement (build_backend/cuda_requirement.py), with fake nvcc layouts ----

_BACKEND = Path(__file__).resolve().parents[1] / "build_backend"


@pytest.fixture
def cureq(monkeypatch):
    if not (_BACKEND / "cuda_requirement.py").is_file():
        pytest.skip("build_backend/ is not beside these tests (an installed-wheel test run)")
    monkeypatch.syspath_prepend(str(_BACKEND))
    import cuda_requirement

    return cuda_requirement


def _toolkit(root: Path, release: str, cublas: bool) -> Path:
    """A fake CUDA toolkit: bin/nvcc that prints `release`, include/cublasLt.h when `cublas`."""
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    if cublas:
        (root / "include").mkdir()
        (root / "include" / "cublasLt.h").write_text("")
    return nvcc


def _extra(cureq, env, config=None, roots=(), system="Linux", machine="x86_64"):
    return cureq.extra_requires(config, env, list(roots), system, machine, system_bins=(), system_roots=())


@pytest.mark.skipif(sys.platform == "win32", reason="fake nvcc is a shell script")
def test_backend_asks_for_cublas_when_the_nvcc_found_has_none(cureq, tmp_path):
    bare = _toolkit(tmp_path / "bare", "13.0", cublas=False)
    env = {"PATH": str(bare.parent)}
    assert _extra(cureq, env) == ["nvidia-cublas>=13.0,<14"]
    assert _extra(cureq, {"CUDACXX": str(_toolkit(tmp_path / "old", "12.4", cublas=False))}) == ["nvidia-cublas-cu12"]
    # a wrapper on PATH linking into a bare toolkit (as /usr/local/bin/nvcc here): still bare
    (tmp_path / "wrap").mkdir()
    (tmp_path / "wrap" / "nvcc").symlink_to(bare)
    assert _extra(cureq, {"PATH": str(tmp_path / "wrap")}) == ["nvidia-cublas>=13.0,<14"]
    # no build requirement: TINYINFER_CUDA=OFF, a platform with no wheel, an nvcc of unknown version
    assert _extra(cureq, {**env, "CMAKE_ARGS": "-G Ninja -DTINYINFER_CUDA:STRING=OFF"}) == []
    assert _extra(cureq, env, config={"cmake.define.TINYINFER_CUDA": "off"}) == []
    assert _extra(cureq, env, machine="aarch64") == [] and _extra(cureq, env, system="Darwin") == []
    assert _extra(cureq, env, system="Windows", machine="AMD64") == ["nvidia-cublas>=13.0,<14"]
    assert _extra(cureq, {"CUDACXX": str(_toolkit(tmp_path / "odd", "abc", cublas=False))}) == []


@pytest.mark.skipif(sys.platform == "win32", reason="fake nvcc is a shell script")
def test_backend_adds_nothing_when_the_toolkit_has_cublas_or_there_is_no_nvcc(cureq, tmp_path):
    full = _toolkit(tmp_path / "full", "13.0", cublas=True)
    assert _extra(cureq, {"PATH": str(full.parent)}) == []
    bare = _toolkit(tmp_path / "bare", "13.0", cublas=False)  # CUDA_HOME: its nvcc, with cuBLAS
    assert _extra(cureq, {"PATH": str(bare.parent), "CUDA_HOME": str(tmp_path / "full")}) == []
    assert _extra(cureq, {"PATH": str(tmp_path)}) == []  # no nvcc anywhere: the CPU build, nothing to add
    # nvcc from NVIDIA's PyPI wheels in the target environment (site-packages/nvidia/cu13/bin)
    site = tmp_path / "site"
    _toolkit(site / "nvidia" / "cu13", "13.0", cublas=False)
    assert _extra(cureq, {"PATH": ""}, roots=[str(site)]) == ["nvidia-cublas>=13.0,<14"]


def test_backend_reads_tinyinfer_cuda_as_cmake_will(cureq):
    assert cureq.cuda_setting(None, "") == "AUTO"
    assert cureq.cuda_setting(None, "-DTINYINFER_CUDA=ON -DFOO=1") == "ON"
    assert cureq.cuda_setting(None, "-DTINYINFER_CUDA=ON -DTINYINFER_CUDA=OFF") == "OFF"  # the last one wins
    assert cureq.cuda_setting({"cmake.define.TINYINFER_CUDA": "off"}, "-DTINYINFER_CUDA=ON") == "OFF"
