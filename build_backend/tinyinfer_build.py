"""tinyinfer's PEP 517 build backend: scikit-build-core, plus two things it cannot know on its own.

1. cuBLASLt as a build requirement where it applies (cuda_requirement.py says when): CMakeLists.txt then finds
   NVIDIA's nvidia-cublas wheel on the build's sys.path. At run time the [project] dependency nvidia-cublas
   provides the library (rpath $ORIGIN/../nvidia/cu13/lib).
2. A warning pip shows. pip hides a successful build's output, but shows a backend's `warnings.warn` (pip >= 24:
   "BuildBackendWarning"). CMake writes why a machine with nvcc got a CPU-only build into the file named by
   TINYINFER_BUILD_REPORT; build_wheel turns it into that warning.
"""

from __future__ import annotations

import os
import platform
import sysconfig
import tempfile
import warnings

from cuda_requirement import extra_requires as _extra_requires
from scikit_build_core import build as _skb
from scikit_build_core.build import *  # noqa: F401,F403  (every hook we do not wrap, as scikit-build-core has it)

# the hooks scikit-build-core defines only when it can (prepare_metadata_*), re-exported under their own names
for _name in ("prepare_metadata_for_build_wheel", "prepare_metadata_for_build_editable"):
    if hasattr(_skb, _name):
        globals()[_name] = getattr(_skb, _name)


def extra_requires(config_settings):
    return _extra_requires(config_settings, dict(os.environ), [sysconfig.get_path(k) for k in ("platlib", "purelib")],
                           platform.system(), platform.machine())


def get_requires_for_build_wheel(config_settings=None):
    return _skb.get_requires_for_build_wheel(config_settings) + extra_requires(config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _skb.get_requires_for_build_editable(config_settings) + extra_requires(config_settings)


def _warn_from_report(build):
    """Run `build` (a scikit-build-core hook) with TINYINFER_BUILD_REPORT set; warn with what CMake wrote."""
    fd, report = tempfile.mkstemp(prefix="tinyinfer-build-", suffix=".txt")
    os.close(fd)
    old = os.environ.get("TINYINFER_BUILD_REPORT")
    os.environ["TINYINFER_BUILD_REPORT"] = report
    try:
        result = build()
        with open(report, encoding="utf-8") as f:
            text = f.read().strip()
        if text:  # pip prints "<filename>:<lineno>: BuildBackendWarning: <text>" and that source line, if any
            warnings.warn_explicit(text, UserWarning, filename="tinyinfer", lineno=0)
        return result
    finally:
        os.remove(report)
        if old is None:
            os.environ.pop("TINYINFER_BUILD_REPORT", None)
        else:
            os.environ["TINYINFER_BUILD_REPORT"] = old


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _warn_from_report(lambda: _skb.build_wheel(wheel_directory, config_settings, metadata_directory))


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _warn_from_report(lambda: _skb.build_editable(wheel_directory, config_settings, metadata_directory))
