"""The GEMV plan across runs (cpp/gpu/plan_cache.h, loading.py's plan cache): the saved text is taken only when it
is whole and made for this key (hit), refused as stale for another key or format version and as corrupt when
damaged (checksum, truncation, garbage, fields out of range); the Python side reads and writes the file, warns
once for a refused one, rewrites it, and stays off with TINYINFER_PLAN_CACHE=0 or Engine(plan_cache=False).
The text checks and the file logic need no GPU; the end-to-end tests (`gpu`) build engines."""

from __future__ import annotations

import types
import warnings

import pytest

from conftest import make_llama
from tinyinfer import Engine, _core
from tinyinfer import engine as engine_mod

needs_cuda_build = pytest.mark.skipif(not hasattr(_core, "CudaEngine"), reason="this build has no CUDA backend")

KEY = "NVIDIA H200 sm_90 132 SMs, driver 13000 runtime 13000 | cuda 13000 | model h256 ... | rows 0 grid -1"
ROLES = ["qkv", "o", "gate_up", "down", "lm_head"]


def fnv1a64(text: str) -> int:
    h = 1469598103934665603
    for b in text.encode():
        h = ((h ^ b) * 1099511628211) % (1 << 64)
    return h


def seal(body: str) -> str:
    """A body (every line up to the checksum) with its checksum line, as plan_cache.h documents the format."""
    return body + f"checksum {fnv1a64(body):016x}\n"


def plan_body(key: str = KEY, version: int = 4, long: str = "long -1 0 0 0", picks=None, skip=(), extra=(),
              carveout: str = "carveout 50", early: str = "early 1") -> str:
    picks = picks or {}
    lines = [f"tinyinfer-gemv-plan {version}", f"key {key}"]
    for i, role in enumerate(ROLES):
        if role in skip:
            continue
        R, bps, a8 = (picks.get(role, (2, 2)) + (0,))[:3]
        tried = f"3 2 0 0 10.5 {R} {bps} {a8} 9.25 8 1 1 11.0"
        lines.append(f"shape {role} {512 + i} 256 256 2 {(512 + i) * 512} {R} {bps} {a8} 123.456 {tried}")
    lines += list(extra) + [long] + ([early] if early else []) + ([carveout] if carveout else [])
    return "\n".join(lines) + "\n"


def read(text: str, key: str = KEY):
    return _core.CudaEngine.read_plan(text, key)


# ---- the text: hit, stale, corrupt (no GPU) ----

@needs_cuda_build
def test_a_whole_plan_for_this_key_is_taken():
    picks = {"qkv": (4, 2, 1), "o": (1, 1, 0), "gate_up": (8, 0, 1), "down": (2, 2, 0), "lm_head": (1, 2, 0)}
    table, long, step, problem = read(seal(plan_body(picks=picks, long="long 256 4 1 1")))
    assert problem == ""
    assert step == {"carveout": 50, "early_trigger": 1}
    assert {g["name"]: (g["R"], g["blocks_per_sm"], int(g["act8"])) for g in table} == picks
    assert long == (256, 4, 1, True)
    qkv = table[0]
    assert (qkv["rows"], qkv["K"], qkv["copies"]) == (512, 256, 2)
    assert qkv["tried_R"] == [2, 4, 8] and qkv["tried_blocks_per_sm"] == [0, 2, 1] and qkv["us"] == [10.5, 9.25, 11.0]
    assert qkv["tried_act8"] == [False, True, True]
    assert qkv["gb_per_s"] == pytest.approx(123.456)


@needs_cuda_build
def test_a_plan_may_put_any_role_on_the_tensor_core_product():
    picks = {r: (16, 0, 0) for r in ("qkv", "o", "gate_up", "down", "lm_head")}
    table, _, _, problem = read(seal(plan_body(picks=picks)))
    assert problem == ""
    assert {g["name"]: g["R"] for g in table} == {r: 16 for r in picks}


@needs_cuda_build
def test_a_plan_for_another_key_or_format_is_stale():
    _, _, _, problem = read(seal(plan_body(key="another GPU | model h4096")))
    assert problem.startswith("stale:") and "another GPU" in problem
    _, _, _, problem = read(seal(plan_body(version=1)))  # the format before act8
    assert problem.startswith("stale:") and "format 1" in problem
    _, _, _, problem = read(seal(plan_body(version=2, carveout="", early="")))  # the format before the carveout
    assert problem.startswith("stale:") and "format 2" in problem
    _, _, _, problem = read(seal(plan_body(version=3, early="")))  # the format before the early-trigger line
    assert problem.startswith("stale:") and "format 3" in problem


@needs_cuda_build
def test_a_plan_keeps_the_driver_choice_of_carveout_and_each_trigger_level():
    _, _, step, problem = read(seal(plan_body(carveout="carveout -1", early="early 0")))
    assert (step, problem) == ({"carveout": -1, "early_trigger": 0}, "")
    _, _, step, problem = read(seal(plan_body(early="early 2")))  # the attention triggers early too
    assert (step, problem) == ({"carveout": 50, "early_trigger": 2}, "")


@pytest.mark.parametrize("damage", ["digit", "truncated", "no_checksum", "garbage", "empty", "trailing"])
@needs_cuda_build
def test_a_damaged_plan_is_corrupt(damage):
    good = seal(plan_body())
    text = {
        "digit": good.replace("9.25", "9.26", 1),          # an edited number: the checksum no longer matches
        "truncated": good[: len(good) // 2],               # a write cut short
        "no_checksum": plan_body(),
        "garbage": "\x00\xff not a plan \n" * 3,
        "empty": "",
        "trailing": good + "shape qkv 1 1 1 1 1 1 1 0 1 0\n",  # lines after the checksum
    }[damage]
    table, long, step, problem = read(text)
    assert table is None and long is None and step is None and problem.startswith("corrupt:"), problem


@pytest.mark.parametrize("body", [
    plan_body(picks={"gate_up": (1, 0)}),                 # swiglu has no R = 1
    plan_body(picks={"o": (3, 0)}),                       # no such R
    plan_body(picks={"down": (2, 3)}),                    # blocks per SM 0..2
    plan_body(picks={"o": (16, 2)}),                      # the tensor-core product: its own grid,
    plan_body(picks={"down": (16, 0, 1)}),                # fp16 inputs
    plan_body(skip=("lm_head",)),                         # a role missing
    plan_body(extra=(plan_body().splitlines()[2],)),      # a role twice
    plan_body(long="long 0 2 1 0"),                       # from: -1 or > 0
    plan_body(long="long 128 3 1 0"),                     # the long qkv variant out of range
    plan_body(long="long -1 0 0"),                        # a field missing
    plan_body(long="long 128 2 1 2"),                     # act8: 0 or 1
    plan_body(picks={"o": (2, 2, 2)}),                    # act8: 0 or 1
    plan_body(extra=("hello",)),                          # not a plan line
    plan_body(carveout=""),                               # no carveout line
    plan_body(carveout="carveout 101"),                   # a percent, or -1
    plan_body(carveout="carveout -2"),
    plan_body(carveout="carveout 5 0"),                   # one field
    plan_body(extra=("carveout 50",)),                    # twice
    plan_body(early=""),                                  # no early-trigger line
    plan_body(early="early 3"),                           # 0, 1 or 2
    plan_body(early="early 1.0"),
    plan_body(early="early -1"),                          # (-1 is the option's "timed", never a plan's)
    plan_body(early="early"),                             # one field
    plan_body(extra=("early 0",)),                        # twice
    plan_body().replace("123.456", "12x", 1),             # not a number
    plan_body().replace("123.456", "-5", 1),              # negative
    "not a plan\nkey x\n",
])
@needs_cuda_build
def test_a_sealed_plan_with_bad_fields_is_corrupt(body):
    table, _, _, problem = read(seal(body))  # the checksum matches: the fields themselves are checked
    assert table is None and problem.startswith("corrupt:"), problem


# ---- the file (no GPU: a stand-in for the engine) ----

class FakeCore:
    """What with_plan_cache reads of a CudaEngine: made from opts.plan_text as the real one would be."""

    def __init__(self, opts, tuned_text: str):
        self.given = opts.plan_text
        _, _, _, problem = read(opts.plan_text) if opts.plan_text else (None, None, None, "")
        self.plan_from_cache = bool(opts.plan_text) and problem == ""
        self.plan_problem = problem
        self.plan_text = self.given if self.plan_from_cache else tuned_text


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYINFER_CACHE", str(tmp_path))
    monkeypatch.delenv("TINYINFER_PLAN_CACHE", raising=False)
    return tmp_path


@needs_cuda_build
def test_plan_file_is_per_key_under_the_cache_and_can_be_turned_off(cache, monkeypatch):
    a, b = engine_mod.plan_file("key a"), engine_mod.plan_file("key b")
    assert a.parent == cache / "plans" and a.suffix == ".txt" and a != b and a == engine_mod.plan_file("key a")
    monkeypatch.setenv("TINYINFER_PLAN_CACHE", "0")
    assert engine_mod.plan_file("key a") is None


@needs_cuda_build
def test_cache_miss_tunes_and_writes_then_hits(cache):
    path, tuned = engine_mod.plan_file(KEY), seal(plan_body(picks={"qkv": (4, 2)}))
    opts = _core.CudaOptions()
    first = engine_mod.with_plan_cache(opts, path, lambda o: FakeCore(o, tuned))
    assert first.given == "" and not first.plan_from_cache and path.read_text() == tuned
    assert opts.plan_text == ""  # the caller's options are left as given
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a hit says nothing
        second = engine_mod.with_plan_cache(opts, path, lambda o: FakeCore(o, "never written"))
    assert second.given == tuned and second.plan_from_cache and path.read_text() == tuned
    assert not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize("content", [
    seal(plan_body(key="another GPU")),
    seal(plan_body()).replace("9.25", "9.5"),
    "\x00\x01garbage",
    seal(plan_body())[:40],
])
@needs_cuda_build
def test_a_refused_file_warns_once_and_is_rewritten(cache, content):
    path, tuned = engine_mod.plan_file(KEY), seal(plan_body(picks={"down": (4, 1)}))
    path.parent.mkdir(parents=True)
    path.write_bytes(content.encode("latin-1"))
    with pytest.warns(RuntimeWarning, match="ignored") as caught:
        core = engine_mod.with_plan_cache(_core.CudaOptions(), path, lambda o: FakeCore(o, tuned))
    assert len(caught) == 1 and str(path) in str(caught[0].message)
    assert not core.plan_from_cache and path.read_text() == tuned


@needs_cuda_build
def test_cache_off_reads_and_writes_nothing(cache):
    path = cache / "plans" / "x.txt"
    path.parent.mkdir(parents=True)
    path.write_text(seal(plan_body()))
    core = engine_mod.with_plan_cache(_core.CudaOptions(), None, lambda o: FakeCore(o, "tuned"))
    assert core.given == "" and path.read_text() == seal(plan_body())
    assert list(path.parent.iterdir()) == [path]


@needs_cuda_build
def test_a_plan_text_given_in_the_options_wins_over_the_file(cache):
    path = engine_mod.plan_file(KEY)
    opts = _core.CudaOptions()
    opts.plan_text = seal(plan_body(picks={"o": (4, 0)}))
    core = engine_mod.with_plan_cache(opts, path, lambda o: FakeCore(o, "tuned"))
    assert core.plan_from_cache and core.given == opts.plan_text and not path.exists()


# ---- end to end on the GPU ----

def _config():
    c = _core.ModelConfig()
    c.hidden, c.intermediate, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab = 256, 600, 2, 4, 2, 64, 500
    c.max_position_embeddings = 2048
    c.validate()
    return c


def _picks(eng):
    """The picks and the timings behind them (as saved: µs to 4 decimals)."""
    table = [(g["name"], g["R"], g["blocks_per_sm"], [round(u, 4) for u in g["us"]]) for g in eng.gemv_table()]
    return table, eng.decode_long, eng.smem_carveout, eng.early_trigger


@pytest.mark.gpu
def test_gpu_engine_takes_its_saved_plan():
    opts = _core.CudaOptions()
    opts.gemm_autotune = False  # the prefill's GEMMs the same in both engines (not a part of the plan's key)
    tuned = _core.CudaEngine.random(_config(), 1500, 2, opts)
    assert not tuned.plan_from_cache and tuned.plan_problem == "" and tuned.tune_seconds > 0
    assert set(tuned.tune_parts) == {"plan", "graphs", "long_context"}
    key = _core.CudaEngine.plan_key(_config(), 1500, _core.CudaOptions())
    assert tuned.plan_text.splitlines()[1] == f"key {key}"
    opts.plan_text = tuned.plan_text
    hit = _core.CudaEngine.random(_config(), 1500, 2, opts)
    assert hit.plan_from_cache and hit.plan_problem == "" and _picks(hit) == _picks(tuned)
    assert hit.plan_text == tuned.plan_text
    # the same weights and the same plan: token for token the same decode, past 1,024 (the long graph, if any)
    prompt = [(7 * i + 3) % 500 for i in range(1000)]
    s = _core.SamplingConfig()
    outs = []
    for e in (tuned, hit):
        e.forward(prompt, all_logits=False)
        outs.append(e.decode(40, s, [], 0))
    assert outs[0] == outs[1] and len(outs[0]) == 40


@pytest.mark.gpu
def test_gpu_engine_retunes_a_stale_or_corrupt_plan():
    tuned = _core.CudaEngine.random(_config(), 1500, 1)
    other = _core.CudaOptions()
    other.gemv_grid = 2  # another key: what is tuned differs
    for text, kind in ((_core.CudaEngine.random(_config(), 1500, 1, other).plan_text, "stale:"),
                       (tuned.plan_text.replace("shape qkv", "shape  qkv"), "corrupt:"), ("junk", "corrupt:")):
        opts = _core.CudaOptions()
        opts.plan_text = text
        e = _core.CudaEngine.random(_config(), 1500, 1, opts)
        assert not e.plan_from_cache and e.plan_problem.startswith(kind), e.plan_problem
        assert e.plan_text.splitlines()[1] == tuned.plan_text.splitlines()[1]  # this key's plan, tuned again


@pytest.mark.gpu
def test_gpu_pins_apply_after_a_saved_plan():
    tuned = _core.CudaEngine.random(_config(), 256, 1)
    opts = _core.CudaOptions()
    opts.plan_text = tuned.plan_text
    opts.gemv_pins = [_core.GemvPin(_core.MatrixRole.Down, 4, 1)]
    pinned = _core.CudaEngine.random(_config(), 256, 1, opts)
    table = {g["name"]: g for g in pinned.gemv_table()}
    assert pinned.plan_from_cache and (table["down"]["R"], table["down"]["blocks_per_sm"]) == (4, 1)
    assert pinned.plan_text == ""  # a pinned plan is not this key's plan: never saved


@pytest.mark.gpu
def test_gpu_engine_keeps_the_plan_in_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TINYINFER_PLAN_CACHE", raising=False)
    d = make_llama(tmp_path / "m", vocab=300, layers=1)
    first = Engine(d, device="cuda", max_seq_len=256)
    files = list((tmp_path / "cache" / "plans").glob("*.txt"))
    assert len(files) == 1 and not first._core.plan_from_cache
    again = Engine(d, device="cuda", max_seq_len=256)
    assert again._core.plan_from_cache and _picks(again._core) == _picks(first._core)
    files[0].write_text("damaged")
    with pytest.warns(RuntimeWarning, match="corrupt"):
        third = Engine(d, device="cuda", max_seq_len=256)
    assert not third._core.plan_from_cache and files[0].read_text() == third._core.plan_text
    assert not Engine(d, device="cuda", max_seq_len=256, plan_cache=False)._core.plan_from_cache
    monkeypatch.setenv("TINYINFER_PLAN_CACHE", "0")
    assert not Engine(d, device="cuda", max_seq_len=256)._core.plan_from_cache
