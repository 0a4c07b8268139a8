"""Whether tinyinfer's build needs NVIDIA's cuBLAS wheel as a build requirement (tinyinfer_build.py asks for it).
Plain functions of the environment, standard library only: tests/test_build.py checks them with fake layouts.

A system nvcc often comes without cuBLAS; under pip's build isolation only build requirements are importable,
so the nvidia-cublas wheel must be requested for CMakeLists.txt to find it. It is requested only when a CUDA
build is possible (nvcc found, TINYINFER_CUDA not OFF, a platform NVIDIA publishes the wheel for) and the
toolkit has no cuBLASLt of its own.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess


def cuda_setting(config_settings: dict | None, cmake_args: str) -> str:
    """TINYINFER_CUDA as the build will see it: -C cmake.define.TINYINFER_CUDA=..., else CMAKE_ARGS, else AUTO."""
    value = (config_settings or {}).get("cmake.define.TINYINFER_CUDA")
    if isinstance(value, str):
        return value.upper()
    for arg in shlex.split(cmake_args):
        m = re.fullmatch(r"-DTINYINFER_CUDA(?::\w+)?=(\w+)", arg)
        if m:
            value = m.group(1)
    return (value or "AUTO").upper()


def find_nvcc(env: dict, target_roots: list[str], system_bins=("/usr/local/cuda/bin",)) -> str | None:
    """The nvcc CMakeLists.txt would use (same order): CUDACXX, CUDA_HOME / CUDA_PATH, PATH, /usr/local/cuda,
    NVIDIA's PyPI wheels in the target environment (target_roots: its site-packages)."""
    if env.get("CUDACXX"):
        return env["CUDACXX"]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var) and shutil.which("nvcc", path=os.path.join(env[var], "bin")):
            return shutil.which("nvcc", path=os.path.join(env[var], "bin"))
    wheel_bins = [os.path.join(r, "nvidia", d, "bin") for r in target_roots for d in ("cu13", "cu12", "cuda_nvcc")]
    return shutil.which("nvcc", path=os.pathsep.join([env.get("PATH", ""), *system_bins, *wheel_bins]))


def has_own_cublaslt(nvcc: str, env: dict, system_roots=("/usr/local/cuda",)) -> bool:
    """Whether the toolkit beside `nvcc` (or CUDA_HOME, /usr/local/cuda, as CMakeLists.txt searches) has
    cublasLt.h. nvcc may be a wrapper script (/usr/local/bin/nvcc -> exec .../cuda-13.0/bin/nvcc): its own
    directory's parent and its resolved one's are both tried."""
    roots = {os.path.dirname(os.path.dirname(p)) for p in (nvcc, os.path.realpath(nvcc))}
    roots |= {r for r in (env.get("CUDA_HOME"), env.get("CUDA_PATH"), *system_roots) if r}
    subdirs = ("include", os.path.join("targets", "x86_64-linux", "include"))
    return any(os.path.isfile(os.path.join(r, s, "cublasLt.h")) for r in roots for s in subdirs)


def cublas_requirement(cuda_major: int | None, system: str, machine: str) -> list[str]:
    """NVIDIA's cuBLAS wheel for the CUDA major version of the nvcc found, on platforms it is published for."""
    if (system, machine.lower()) not in (("Linux", "x86_64"), ("Windows", "amd64")):
        return []
    if cuda_major == 12:
        return ["nvidia-cublas-cu12"]
    if cuda_major == 13:
        return ["nvidia-cublas>=13.0,<14"]
    return []  # an nvcc we do not know: CMake says what it finds


def nvcc_major(nvcc: str) -> int | None:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def extra_requires(config_settings: dict | None, env: dict, target_roots: list[str], system: str, machine: str,
                   system_bins=("/usr/local/cuda/bin",), system_roots=("/usr/local/cuda",)) -> list[str]:
    """The build requirements to add: NVIDIA's cuBLAS wheel when a CUDA build is possible and the toolkit found
    has no cuBLASLt. target_roots: the target environment's site-packages."""
    if cuda_setting(config_settings, env.get("CMAKE_ARGS", "")) == "OFF":
        return []
    nvcc = find_nvcc(env, target_roots, system_bins)
    if not nvcc or has_own_cublaslt(nvcc, env, system_roots):
        return []
    return cublas_requirement(nvcc_major(nvcc), system, machine)
