"""The installed package is typed: py.typed and the nanobind-generated _core.pyi ship with it, and mypy
--strict accepts a small program that uses the public API as the README does (and rejects a wrong call)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

USE = textwrap.dedent('''
    from tinyinfer import Completion, Engine, SamplingParams, TinyInferError


    def run(path: str) -> str:
        eng = Engine(path, device="auto", max_seq_len=2048, dtype="int4")
        out: Completion = eng.generate("The capital of France is", max_tokens=32)
        for piece in eng.stream("Tell me a story", SamplingParams(temperature=0.8, top_p=0.95, seed=0)):
            print(piece, end="")
        reply = eng.chat([{"role": "user", "content": "hi"}], max_tokens=64)
        logits = eng.logits(eng.tokenize("Score this text."))
        vocab: int = eng.config.vocab
        try:
            eng.generate("x", max_tokens=-1)
        except TinyInferError as e:
            print(e)
        return out.text + reply.text + str(logits.shape) + str(vocab) + out.finish_reason
    ''')


def mypy(tmp_path, code: str) -> subprocess.CompletedProcess:
    f = tmp_path / "use.py"
    f.write_text(code)
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir",
                           str(tmp_path / ".mypy"), str(f)], capture_output=True, text=True, cwd=tmp_path)


def test_package_ships_types():
    import tinyinfer

    pkg = os.path.dirname(tinyinfer.__file__)
    assert os.path.exists(os.path.join(pkg, "py.typed"))
    stub = os.path.join(pkg, "_core.pyi")
    assert os.path.exists(stub)
    text = open(stub).read()
    assert "class CudaOptions" in text or "class CpuEngine" in text


def test_mypy_accepts_the_readme_usage_and_rejects_a_wrong_call(tmp_path):
    pytest.importorskip("mypy")
    r = mypy(tmp_path, USE)
    assert r.returncode == 0, r.stdout + r.stderr
    r = mypy(tmp_path, "from tinyinfer import Engine\nEngine(3)\n")
    assert r.returncode != 0 and "arg-type" in r.stdout, r.stdout
