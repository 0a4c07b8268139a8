"""Run the test suite against an *installed* tinyinfer (a wheel), not the source tree: copy tests/ to a
temporary directory, install the test-only references (CPU torch, transformers, sentencepiece), check that
`tinyinfer` resolves to site-packages, run pytest (GPU tests skip without a GPU; pass -m gpu on a GPU runner).
    python .github/scripts/test_installed.py PROJECT_DIR [pytest args...]"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile


def pip(*args: str) -> None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *args])


def main() -> int:
    project = os.path.abspath(sys.argv[1])
    extra = sys.argv[2:]
    if os.environ.get("TINYINFER_SKIP_TEST_DEPS") != "1":
        try:
            import torch  # noqa: F401
        except ImportError:  # the CPU build: a plain `pip install torch` fetches a multi-GB CUDA one on Linux
            try:
                pip("torch", "--index-url", "https://download.pytorch.org/whl/cpu")
            except subprocess.CalledProcessError:
                pip("torch==2.13.0")  # (an index mirror that carries the CPU build under its plain name)
        pip("transformers>=4.45", "accelerate>=0.30", "pytest>=7", "mypy>=1.8", "sentencepiece>=0.2")
    work = tempfile.mkdtemp(prefix="tinyinfer-tests-")
    shutil.copytree(os.path.join(project, "tests"), os.path.join(work, "tests"))
    shutil.copy(os.path.join(project, "pyproject.toml"), work)  # pytest markers
    where = subprocess.check_output([sys.executable, "-c", "import tinyinfer, sys; print(tinyinfer.__file__)"],
                                    cwd=work, text=True).strip()
    if where.startswith(project):
        print(f"tinyinfer imports from the source tree ({where}), not from the installed wheel", file=sys.stderr)
        return 2
    print(f"testing the installed tinyinfer at {os.path.dirname(where)}", flush=True)
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", *extra], cwd=work)


if __name__ == "__main__":
    sys.exit(main())
