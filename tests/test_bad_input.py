"""Bad input (docs/ARCHITECTURE.md, Layers): each case raises the matching TinyInferError naming the culprit, and
nothing crashes; an engine stays usable after a refused request."""

from __future__ import annotations

import json
import re
import shutil
import struct

import numpy as np
import pytest

from conftest import edit_config, make_chat_llama, make_llama
from tinyinfer import (
    ConfigError,
    Engine,
    InvalidRequestError,
    ModelFormatError,
    ModelNotFoundError,
    TinyInferError,
    TokenizerError,
    UnsupportedModelError,
    DeviceError,
)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("good"), layers=1, heads=2, kv_heads=1, hidden=128, vocab=300)


@pytest.fixture
def model_copy(good_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(good_dir, dst)
    return dst


def _rewrite_safetensors(path, mutate):
    """Parse a safetensors file, let `mutate(header, data) -> (header, data)` change it, write it back."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header, data = mutate(header, raw[8 + n :])
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def test_missing_dir(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Engine(tmp_path / "nope")


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        Engine(tmp_path)


def test_dir_without_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="model.safetensors"):
        Engine(model_copy)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"])
def test_missing_config_field(model_copy, field):
    edit_config(model_copy, **{field: None})
    with pytest.raises(ConfigError, match=field):
        Engine(model_copy)


def test_config_not_json(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="config.json"):
        Engine(model_copy)


def test_truncated_safetensors(model_copy):
    f = model_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelFormatError, match="model.safetensors"):
        Engine(model_copy)


def test_garbage_safetensors(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(ModelFormatError, match="model.safetensors"):
        Engine(model_copy)


def test_wrong_shape_tensor(model_copy):
    name = "model.layers.0.mlp.up_proj.weight"

    def mutate(header, data):
        header[name]["shape"] = header[name]["shape"][::-1]  # same bytes, transposed shape
        return header, data

    _rewrite_safetensors(model_copy / "model.safetensors", mutate)
    with pytest.raises(ModelFormatError, match=r"mlp\.up_proj\.weight.*shape"):
        Engine(model_copy)


def _resave(path, mutate):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    mutate(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor(model_copy):
    _resave(model_copy / "model.safetensors", lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ModelFormatError, match=r"missing tensor 'model\.layers\.0\.self_attn\.k_proj\.weight'"):
        Engine(model_copy)


def test_unexpected_tensor(model_copy):
    import torch

    _resave(model_copy / "model.safetensors", lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}))
    with pytest.raises(UnsupportedModelError, match=r"q_proj\.bias"):
        Engine(model_copy)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"model_type": "mistral"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "rope_type"),
        ({"head_dim": 32}, "head_dim"),
    ],
)
def test_unsupported_field(model_copy, changes, field):
    edit_config(model_copy, **changes)
    with pytest.raises(UnsupportedModelError, match=field):
        Engine(model_copy)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"rope_scaling": "linear"}, "'rope_scaling' must be an object"),
        ({"rope_scaling": ["linear"]}, "'rope_scaling' must be an object"),
        ({"rope_scaling": {"rope_type": "linear", "factor": None}}, "'rope_scaling.factor' must be a number"),
        ({"rope_scaling": {**LLAMA3, "low_freq_factor": "1"}}, "'rope_scaling.low_freq_factor' must be a number"),
        ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8192.5}},
         "'rope_scaling.original_max_position_embeddings' must be an integer"),
        ({"rope_theta": None}, "'rope_theta' must be a number"),
        ({"rms_norm_eps": None}, "'rms_norm_eps' must be a number"),
        ({"max_position_embeddings": None}, "'max_position_embeddings' must be an integer"),
        ({"num_key_value_heads": "abc"}, "'num_key_value_heads' must be an integer"),
        ({"num_key_value_heads": 1.7}, "'num_key_value_heads' must be an integer"),
        ({"head_dim": "64"}, "'head_dim' must be an integer"),
        ({"architectures": 5}, "'architectures' must be a list"),
        ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be true or false"),
    ],
)
def test_config_field_of_the_wrong_type(model_copy, changes, field):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.pop("rope_parameters")  # (it would take precedence over rope_scaling and rope_theta)
    cfg.update(changes)  # (edit_config would drop the keys set to None: here they are written as null)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=re.escape(field)):
        Engine(model_copy)


def test_config_null_that_means_the_default(model_copy):
    edit_config(model_copy, rope_parameters=None)
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**cfg, "head_dim": None, "rope_scaling": None}))
    assert Engine(model_copy, device="cpu").config.head_dim == 64  # hidden / heads, as transformers takes it


def test_bad_gqa_config(model_copy):
    edit_config(model_copy, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        Engine(model_copy)


def test_bad_engine_arguments(good_dir):
    with pytest.raises(InvalidRequestError, match="device"):
        Engine(good_dir, device="tpu")
    with pytest.raises(InvalidRequestError, match="dtype"):
        Engine(good_dir, dtype="fp8")
    with pytest.raises(InvalidRequestError, match="max_seq_len"):
        Engine(good_dir, max_seq_len=10**9)
    with pytest.raises(InvalidRequestError, match="max_seq_len"):
        Engine(good_dir, max_seq_len=0)


def test_cuda_device_without_a_gpu(good_dir):
    from tinyinfer.engine import cuda_status

    if cuda_status()[0]:
        pytest.skip("a GPU is usable here")
    with pytest.raises(DeviceError, match="no usable GPU"):
        Engine(good_dir, device="cuda")
    assert Engine(good_dir, device="auto").device == "cpu"  # auto falls back


def test_refused_requests_leave_engine_usable(good_dir):
    eng = Engine(good_dir, device="cpu", max_seq_len=64)
    want = eng.generate([5, 6, 7], max_tokens=5, ignore_eos=True).token_ids
    bad_calls = [
        (lambda: eng.generate([], max_tokens=4), "empty prompt"),
        (lambda: eng.generate([5, 10**6], max_tokens=4), "out of range"),
        (lambda: eng.generate([-1], max_tokens=4), "out of range"),
        (lambda: eng.generate([5, 6.0], max_tokens=4), "token ids must be integers"),
        (lambda: eng.generate([5, True], max_tokens=4), "token ids must be integers"),
        (lambda: eng.generate([5, b"6"], max_tokens=4), "token ids must be integers"),
        (lambda: eng.generate(np.array(["5", "6"]), max_tokens=4), "token ids must be integers"),
        (lambda: eng.generate(np.array([5.0, 6.0]), max_tokens=4), "token ids must be integers"),
        (lambda: eng.generate(b"\x05\x06", max_tokens=4), "not bytes"),
        (lambda: eng.generate(5, max_tokens=4), "sequence of token ids"),
        (lambda: eng.generate([5] * 60, max_tokens=10), "max_seq_len"),
        (lambda: eng.generate([5], max_tokens=0), "max_tokens"),
        (lambda: eng.generate([5], temperature=-1.0), "temperature"),
        (lambda: eng.generate([5], top_p=0.0), "top_p"),
        (lambda: eng.generate([5], min_p=2.0), "min_p"),
        (lambda: eng.generate([5], top_k=-5), "top_k"),
        (lambda: eng.generate([5], max_tokens=4, top_k=2**63), "top_k"),
        (lambda: eng.generate([5], max_tokens=4, seed=2**64), "seed"),
        (lambda: eng.generate([5], repetition_penalty=0.0), "repetition_penalty"),
        (lambda: eng.generate([5], temperature=float("nan")), "temperature"),
        (lambda: eng.generate([5], max_tokens=4, temperature=1e39), "temperature"),  # infinite as a float32
        (lambda: eng.generate([5], bogus=1), "bogus"),
        (lambda: eng.generate([5], n=3), r"unknown sampling parameter\(s\): n; .*generate\(\[prompt\] \* n"),
        (lambda: eng.generate([5], max_tokens=4, stop_token_ids=[-1]), "stop token id -1 is out of range"),
        (lambda: eng.generate([5], max_tokens=4, stop_token_ids=[300]), "stop token id 300 is out of range"),
        (lambda: eng.generate([5], max_tokens=4, stop_token_ids=[2**31]), "out of range"),
        # the scheduler's path
        (lambda: eng.generate([[5], [6]], max_tokens=4, stop_token_ids=[2**31]), "out of range"),
        (lambda: eng.generate("text", max_tokens=4), "tokenizer"),  # this model has no tokenizer.json
        (lambda: eng.logits([]), "empty prompt"),
        (lambda: eng.logits(list(range(65))), "max_seq_len"),
    ]
    for call, needle in bad_calls:
        with pytest.raises(TinyInferError, match=needle):
            call()
    assert eng.generate([5, 6, 7], max_tokens=5, ignore_eos=True).token_ids == want
    assert eng.generate(np.array([5, 6, 7]), max_tokens=5, ignore_eos=True).token_ids == want  # numpy ints are ids


def test_text_that_is_not_unicode(tmp_path):
    """A lone surrogate ("\\ud800" in JSON) cannot be UTF-8: refused, naming it, in a prompt and in a message."""
    eng = Engine(make_chat_llama(tmp_path / "m"), device="cpu", max_seq_len=64)
    for call in (lambda: eng.generate("a\ud800b", max_tokens=2), lambda: eng.tokenize("\udfff"),
                 lambda: eng.chat([{"role": "user", "content": "hi \ud800"}], max_tokens=2)):
        with pytest.raises(InvalidRequestError, match=r"not valid Unicode: '\\ud"):
            call()
    with pytest.raises(InvalidRequestError, match="must be a str"):
        eng.tokenize(5)
    assert eng.generate("ab", max_tokens=2).token_ids


def test_tokenizer_error_type(good_dir):
    eng = Engine(good_dir, device="cpu")
    with pytest.raises(TokenizerError):
        eng.tokenize("hello")


def test_core_rejects_bad_store_use(good_dir):
    """The core's own checks (reached without the Python loader) raise TinyInferErrors too."""
    from tinyinfer import _core

    eng = Engine(good_dir, device="cpu")
    store = _core.WeightStore(eng.config)
    with pytest.raises(ModelFormatError, match="shape"):
        store.add("model.norm.weight", np.zeros(3, np.float32), "fp32")
    with pytest.raises(InvalidRequestError, match="item size"):
        store.add("model.norm.weight", np.zeros(eng.config.hidden, np.float32), "fp16")
    with pytest.raises(ModelFormatError, match="missing tensor"):
        store.finish()


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"rms_norm_eps": float("inf")}, "rms_norm_eps"),  # (loaded, it gave all-zero logits)
        ({"rope_theta": float("inf")}, "rope_theta"),
        ({"rope_scaling": {"rope_type": "linear", "factor": float("inf")}}, "rope_scaling.factor"),
        ({"rope_scaling": {**LLAMA3, "high_freq_factor": float("inf")}}, "high_freq_factor"),
    ],
)
def test_config_number_that_is_not_finite(model_copy, changes, field):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(changes)
    (model_copy / "config.json").write_text(json.dumps(cfg))  # (written as Infinity, which json reads back)
    with pytest.raises(ConfigError, match=f"{re.escape(field)}.*finite"):
        Engine(model_copy, device="cpu")


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"hidden_size": 2**70}, "'hidden_size' is out of range"),  # (was nanobind's TypeError)
        ({"max_position_embeddings": 2**64}, "'max_position_embeddings' is out of range"),
        ({"eos_token_id": 2**70}, "'eos_token_id' must be a token id"),
        ({"eos_token_id": True}, "'eos_token_id' must be a token id"),  # (was read as id 1)
        ({"eos_token_id": [1, "2"]}, "'eos_token_id' must be a token id"),
    ],
)
def test_config_integer_out_of_range(model_copy, changes, needle):
    edit_config(model_copy, **changes)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        Engine(model_copy, device="cpu")


def test_generation_config_eos_ids_are_stop_ids_too(model_copy):
    """generation_config.json's EOS ids end a generation as config.json's do (transformers' generate() and vLLM
    read them; Llama-3's instruct models keep end-of-turn only there); a bad one is refused naming the file."""
    edit_config(model_copy, eos_token_id=None)
    gen = model_copy / "generation_config.json"
    gen.write_text("{}")  # (save_pretrained wrote one with config.json's EOS)
    prompt = [1, 5, 9]
    with Engine(model_copy, device="cpu") as eng:
        free = eng.generate(prompt, max_tokens=12).token_ids
    k = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i])  # a token the greedy path first meets at k
    gen.write_text(json.dumps({"eos_token_id": [free[k], free[k]], "temperature": 0.6}))
    with Engine(model_copy, device="cpu") as eng:
        got = eng.generate(prompt, max_tokens=12)
        assert got.finish_reason == "stop" and got.token_ids == free[:k + 1]
    other = next(t for t in range(300) if t != free[k])
    edit_config(model_copy, eos_token_id=[other, free[k]])
    with Engine(model_copy, device="cpu") as eng:
        assert list(eng.config.eos_token_ids) == [other, free[k]]  # config.json's first, each id once
    # a generation config is advice beside the model (transformers and vLLM load a model whose file is broken):
    # what is wrong in it is said and left out, config.json's EOS ids stay
    for text, needle in ((json.dumps({"eos_token_id": True}), "'eos_token_id' must be a token id"),
                         (json.dumps({"eos_token_id": ["2"]}), "'eos_token_id' must be a token id"),
                         (json.dumps({"eos_token_id": [2, 10**6]}), "'eos_token_id' 1000000 is out of range"),
                         ("{not json", "not valid JSON"), ("[2]", "expected a JSON object")):
        gen.write_text(text)
        with pytest.warns(UserWarning, match=f"generation_config.json.*{re.escape(needle)}.*ignored"):
            eng = Engine(model_copy, device="cpu")
        assert list(eng.config.eos_token_ids) == [other, free[k]]


@pytest.mark.parametrize("bos", [2**70, -1, True, [1]])
def test_config_bos_that_is_no_id_is_none(model_copy, bos):
    """The engine never reads bos_token_id: anything but an id is "none" (-1), as it always was, never a crash."""
    edit_config(model_copy, bos_token_id=bos)
    assert Engine(model_copy, device="cpu").config.bos_token_id == -1


@pytest.mark.parametrize("value", [5, ["a.safetensors"]])
def test_shard_index_whose_files_are_not_names(model_copy, value):
    (model_copy / "model.safetensors").rename(model_copy / "a.safetensors")
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": value}}))
    with pytest.raises(ModelFormatError, match="'weight_map' values must be file names"):
        Engine(model_copy, device="cpu")


def test_model_path_of_the_wrong_kind(tmp_path):
    for path in (None, 5, ["m"], b"m"):
        with pytest.raises(InvalidRequestError, match="must be a path or a hub name"):
            Engine(path, device="cpu")
    for path in ("~no_such_user_tinyinfer/m", str(tmp_path / ("x" * 5000))):  # no such home; a name too long
        with pytest.raises(ModelNotFoundError):
            Engine(path, device="cpu")


def test_engine_options_checked_before_the_load(good_dir, monkeypatch):
    import tinyinfer.engine as engine_mod

    def no_load(path):
        raise AssertionError("the model was loaded before a bad option was refused")

    for act8 in ("x", 1.5, True, 2**40):  # (was the bindings' TypeError after the load; 5: the engine's check)
        monkeypatch.setattr(engine_mod, "load_model", no_load)
        with pytest.raises(InvalidRequestError, match="act8 must be None or an integer"):
            Engine(good_dir, device="cpu", act8=act8)
    monkeypatch.undo()
    with pytest.raises(InvalidRequestError, match="act8 must be 0"):
        Engine(good_dir, device="cpu", act8=5)
    with pytest.raises(InvalidRequestError, match="max_seq_len"):
        Engine(good_dir, device="cpu", max_seq_len=True)  # (a bool is no length: it refused every request)


def test_host_memory_exhausted_at_the_load_is_named(good_dir, monkeypatch):
    import tinyinfer.engine as engine_mod

    def bad_alloc(*a, **k):
        raise MemoryError("std::bad_alloc")

    monkeypatch.setattr(engine_mod, "load_cpu", bad_alloc)
    with pytest.raises(DeviceError, match=r"out of host memory .*max_seq_len=64"):
        Engine(good_dir, device="cpu", max_seq_len=64)


def test_bad_text_side_calls_leave_the_engine_usable(tmp_path):
    eng = Engine(make_chat_llama(tmp_path / "m"), device="cpu", max_seq_len=64)
    vocab = eng.config.vocab
    want = (eng.detokenize([40, 41, 42]), eng.generate([5, 6, 7], max_tokens=3, ignore_eos=True).token_ids)
    msgs = [{"role": "user", "content": "hi"}]
    bad_calls = [
        (lambda: eng.detokenize(None), "the ids to detokenize must be a sequence of token ids"),
        (lambda: eng.detokenize(5), "must be a sequence of token ids"),
        (lambda: eng.detokenize("abc"), "not a str"),
        (lambda: eng.detokenize([5.5]), "the ids to detokenize: token ids must be integers"),
        (lambda: eng.detokenize([[5]]), "token ids must be integers"),
        (lambda: eng.detokenize([-1]), "token id -1 is out of range"),
        (lambda: eng.detokenize([vocab]), f"token id {vocab} is out of range"),  # (was decoded as '')
        (lambda: eng.detokenize([2**70]), "out of range"),
        (lambda: eng.detokenize([5], skip_special_tokens="no"), "skip_special_tokens"),
        (lambda: eng.tokenize("ab", add_special_tokens="no"), "add_special_tokens"),
        (lambda: eng.logits(None), "prompt must be a str or a sequence of token ids"),
        (lambda: eng.logits(5), "prompt must be a str or a sequence of token ids"),
        (lambda: eng.generate({5, 6}, max_tokens=2), "not a set"),  # (ids in no order)
        (lambda: eng.apply_chat_template(None), "messages must be a list"),
        (lambda: eng.apply_chat_template("hi"), "messages must be a list"),
        (lambda: eng.apply_chat_template(msgs[0]), "messages must be a list"),  # (one message, not a list)
        (lambda: eng.apply_chat_template(msgs, add_generation_prompt="no"), "add_generation_prompt"),
        (lambda: eng.chat(None, max_tokens=2), "messages must be a list"),
        (lambda: eng.generate([5], max_tokens=2, ignore_eos="false"), "ignore_eos must be true or false"),
        (lambda: eng.generate([5], max_tokens=2, stop=["a\ud800"]), "not valid Unicode"),
    ]
    for call, needle in bad_calls:
        with pytest.raises(InvalidRequestError, match=re.escape(needle)):
            call()
    assert eng.detokenize([]) == "" and eng.detokenize(np.array([40, 41, 42])) == want[0]
    assert (eng.detokenize([40, 41, 42]), eng.generate([5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == want


def test_bad_scheduler_calls(tmp_path):
    from tinyinfer import SamplingParams, Scheduler

    eng = Engine(make_chat_llama(tmp_path / "m"), device="cpu", max_seq_len=64)
    with pytest.raises(InvalidRequestError, match="engine must be a tinyinfer.Engine"):
        Scheduler(None)
    sched = Scheduler(eng)
    for call, needle in [(lambda: sched.cancel([1]), "request_id must be a str"),
                         (lambda: sched.wait_idle("x"), "timeout must be None or a number"),
                         (lambda: sched.wait_idle(float("nan")), "timeout must be None or a number"),
                         (lambda: sched.warm_up(prompt_tokens="x"), "prompt_tokens must be None or an integer"),
                         (lambda: sched.warm_up(max_batch=-1), "max_batch must be None or an integer")]:
        with pytest.raises(InvalidRequestError, match=re.escape(needle)):
            call()
    assert sched.submit([5, 6], SamplingParams(max_tokens=2)).result().token_ids
    sched.close()
