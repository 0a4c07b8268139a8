"""The command line's edges (issue 15, row 4), run as a user runs it: `python -m tinyinfer ...` in a subprocess,
on a small random Llama with a character tokenizer and a chat template (conftest.make_chat_llama)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import edit_config, make_chat_llama
from tinyinfer import Engine, InvalidRequestError

# What `tinyinfer` prints once it has loaded the default model: absent from a command refused before loading.
LOADED_DEFAULT = "default model SmolLM2"


def cli(*args, input=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "tinyinfer", *map(str, args)], input=input, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_chat_llama(tmp_path_factory.mktemp("cli") / "m")


def _prompt_tokens(stderr: str) -> int:
    return int(re.search(r"prompt (\d+) tokens?", stderr).group(1))


def test_version():
    from tinyinfer import __version__

    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"tinyinfer {__version__}"


def test_prompt_from_stdin(tiny):
    base = ["run", "-m", tiny, "--device", "cpu", "-n", "2"]
    by_arg = cli(*base, "hello there")
    dash = cli(*base, "-", input="hello there\n")
    piped = cli(*base, input="hello there")
    for r in (by_arg, dash, piped):
        assert r.returncode == 0, r.stderr
    assert _prompt_tokens(dash.stderr) == _prompt_tokens(piped.stderr) == _prompt_tokens(by_arg.stderr)
    assert dash.stdout == by_arg.stdout  # greedy: the same prompt gives the same answer


def test_logit_bias_flags(tiny):
    """llama-cli's --logit-bias TOKEN_ID(+/-)BIAS: +100 on 'A' (id 36 of the character tokenizer) makes every greedy
    token an 'A'; -100 then (a later flag for the same id wins) bans it."""
    base = ["run", "-m", tiny, "--device", "cpu", "-n", "6", "--ignore-eos"]
    r = cli(*base, "--logit-bias", "36+100", "hi")
    assert r.returncode == 0 and r.stdout.split() == ["A"] * 6, r.stderr  # (its decode joins with spaces)
    r = cli(*base, "-l", "36+100", "-l", "36-100", "--presence-penalty", "1.5", "--min-tokens", "6", "hi")
    assert r.returncode == 0 and "A" not in r.stdout, r.stderr
    r = cli(*base, "-l", "100000+1", "hi")
    assert r.returncode == 1 and "logit_bias token id 100000 is out of range" in r.stderr


def test_structured_output_flags(tiny, tmp_path):
    """llama-cli's --grammar / --grammar-file (GBNF) and -j / --json-schema(-file): the answer holds to them and
    ends once complete (the character tokenizer's decode joins characters with spaces)."""
    base = ["run", "-m", tiny, "--device", "cpu", "-n", "30"]
    r = cli(*base, "--grammar", 'root ::= "yes" | "no"', "hi")
    assert r.returncode == 0 and r.stdout.replace(" ", "").strip() in ("yes", "no"), r.stderr
    (tmp_path / "g.gbnf").write_text('root ::= [0-9] [0-9] "!"\n')
    r = cli(*base, "--grammar-file", tmp_path / "g.gbnf", "hi")
    assert r.returncode == 0 and re.fullmatch("[0-9]{2}!", r.stdout.replace(" ", "").strip()), r.stderr
    schema = '{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], ' \
             '"additionalProperties": false}'
    (tmp_path / "s.json").write_text(schema)
    for flags in (["-j", schema], ["--json-schema-file", tmp_path / "s.json"]):
        r = cli(*base, *flags, "-l", "3-100", "hi")  # (JSON may hold whitespace: the random model's space is held off)
        assert r.returncode == 0, r.stderr
        assert r.stdout.replace(" ", "").strip() in ('{"a":true}', '{"a":false}'), r.stdout
    (tmp_path / "bad.json").write_text("{bad")
    r = cli(*base, "--json-schema-file", tmp_path / "bad.json", "hi")
    assert r.returncode == 1 and "--json-schema-file: json: the schema is not valid JSON" in r.stderr
    r = cli(*base, "--grammar", "root ::= [", "hi")  # (compiled once the model's tokenizer is loaded)
    assert r.returncode == 1 and "invalid structured_outputs: grammar" in r.stderr and "Traceback" not in r.stderr


def test_speculative_flag(tiny):
    """--speculative-config: the same answer as without it; the stats line counts the drafts where any ran."""
    base = ["run", "-m", tiny, "--device", "cpu", "-n", "40", "--ignore-eos", "--raw", "abcabcabcabcabcabc"]
    plain = cli(*base)
    for spec in ("ngram", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
                 '"prompt_lookup_max": 3}'):
        r = cli(*base, "--speculative-config", spec)
        assert r.returncode == 0 and r.stdout == plain.stdout, r.stderr
        assert "drafts" in r.stderr  # (this answer repeats its prompt: drafts run)
    assert "drafts" not in plain.stderr


@pytest.mark.parametrize("args", [["run", "--device", "cpu", "-n", "40", "--ignore-eos", "hi"], ["info"]])
def test_closed_stdout_ends_quietly(tiny, args):
    if args[0] == "run":
        args = args[:1] + ["-m", str(tiny)] + args[1:]
    p = subprocess.Popen([sys.executable, "-m", "tinyinfer", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # the reader is gone before the first write: every write meets a closed pipe
    err = p.stderr.read()
    rc = p.wait(timeout=600)
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    assert rc == 141


@pytest.mark.parametrize("args,needle", [
    (["run", ""], "empty prompt"),
    (["run", "-"], "empty prompt"),  # stdin empty
    (["run", "   "], "empty prompt"),
    (["run", "--system", " ", "hi"], "--system is empty"),
    (["run", "--top-p", "0", "hi"], "--top-p must be in (0, 1]"),
    (["run", "--temperature", "-1", "hi"], "--temperature must be >= 0"),
    (["run", "--max-tokens", "0", "hi"], "--max-tokens must be an integer >= 1, or -1 for"),
    (["chat", "--min-p", "2"], "--min-p must be in"),
    (["run", "--presence-penalty", "3", "hi"], "--presence-penalty must be in [-2, 2]"),
    (["run", "--logit-bias", "abc", "hi"], "--logit-bias 'abc': expected TOKEN_ID+BIAS"),
    (["run", "--logit-bias", "5+1+", "hi"], "--logit-bias '5+1+': expected"),
    (["run", "--logit-bias", "5+101", "hi"], "--logit-bias values must be numbers in [-100, 100]"),
    (["run", "--min-tokens", "-1", "hi"], "--min-tokens must be an integer >= 0"),
    (["run", "--json-schema", "{bad", "hi"], "--json-schema: json: the schema is not valid JSON"),
    (["run", "-j", " ", "hi"], "--json-schema: the schema is empty ({} for any JSON object)"),
    (["run", "--json-schema-file", "/no/such/schema.json", "hi"], "--json-schema-file /no/such/schema.json: cannot"),
    (["run", "--grammar-file", "/no/such.gbnf", "hi"], "--grammar-file /no/such.gbnf: cannot read it"),
    (["run", "-n", "4", "--min-tokens", "5", "hi"], "--min-tokens (5) must be at most max_tokens (4)"),
    (["run", "--speculative-config", "{bad", "hi"], "--speculative-config must be \"ngram\" or a JSON object"),
    (["run", "--speculative-config", '{"num_speculative_tokens": 0}', "hi"],
     "--speculative-config.num_speculative_tokens must be an integer in 1..64"),
    (["chat", "--speculative-config", '{"draft": 1}'], "--speculative-config: unknown field(s) 'draft'"),
    (["run", "--speculative-config", "null", "hi"], "--speculative-config must be \"ngram\" or a JSON object, got"),
    (["run", "--max-seq-len", "64", "--max-tokens", "64", "hi"], "--max-seq-len 64"),
    (["run", "--device", "cpu", "--dtype", "fp16", "hi"], "valid: auto, fp32, int8, int4"),
    (["bench", "--device", "cpu", "--steps", "-1"], "--steps must be >= 1"),  # (the rates would divide by 0)
    (["bench", "--device", "cpu", "--steps", "0"], "--steps must be >= 1"),
    (["bench", "--device", "cpu", "--contexts", "16,100000"], "--contexts 100000: the CPU reference engine is timed up to 8,192"),
    (["verify", "0"], "steps must be >= 1"),
])
def test_refused_before_the_model_loads(args, needle):
    r = cli(*args, input="")
    assert r.returncode == 1, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert LOADED_DEFAULT not in r.stderr  # refused without loading (or fetching) the default model


def test_input_that_is_not_utf8(tiny):
    """Bytes that are not UTF-8 on stdin: `run -` refuses them in one line; at the chat prompt the line is refused
    and the session goes on."""
    def cli_bytes(*args, input: bytes):
        return subprocess.run([sys.executable, "-m", "tinyinfer", *map(str, args)], input=input,
                              capture_output=True, timeout=600, env={**os.environ, "PYTHONIOENCODING": "utf-8"})

    r = cli_bytes("run", "-m", tiny, "--device", "cpu", "-n", "2", "-", input=b"hi \xff there\n")
    err = r.stderr.decode()
    assert r.returncode == 1 and "not valid utf-8 text (byte 0xff)" in err.lower() and "Traceback" not in err, err
    r = cli_bytes("chat", "-m", tiny, "--device", "cpu", "-n", "2", input=b"caf\xe9\nhello\n\n")
    err = r.stderr.decode()
    assert r.returncode == 0 and "(byte 0xe9)" in err and "Traceback" not in err, err
    assert err.count(" s wall") == 1  # the next line got its answer


def test_chat_goes_on_after_a_template_error(tmp_path):
    from conftest import CHAR_CHAT_TEMPLATE, make_llama, save_char_tokenizer

    d = make_llama(tmp_path / "m", layers=1, heads=2, kv_heads=2, hidden=128, vocab=300)
    save_char_tokenizer(d, "{% if messages[-1]['content'] == 'boom' %}{{ raise_exception('no boom here') }}"
                           "{% endif %}" + CHAR_CHAT_TEMPLATE)
    r = cli("chat", "-m", d, "--device", "cpu", "-n", "2", input="hi\nboom\nagain\n\n")
    assert r.returncode == 0 and "no boom here" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count(" s wall") == 2  # the turns before and after the refused one


def test_dtype_the_device_cannot_honour_is_refused(tiny):
    with pytest.raises(InvalidRequestError, match=r"valid: auto, fp32, int8, int4"):
        Engine(tiny, device="cpu", dtype="bf16")
    with Engine(tiny, device="cpu") as eng:
        assert eng.dtype == "fp32"  # auto


def test_chat_messages_refused(tiny):
    with Engine(tiny, device="cpu") as eng:
        for msgs, needle in (([{"role": "user", "content": ""}], r"messages\[0\] \(user\) has empty content"),
                             ([{"role": "usr", "content": "hi"}], "unknown role 'usr'")):
            with pytest.raises(InvalidRequestError, match=needle):
                eng.chat(msgs, max_tokens=2)
        assert eng.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                         {"role": "user", "content": "again"}], max_tokens=2).token_ids  # an empty reply is kept
        # an empty system message (what chat front-ends send when none is set) is rendered as it is; 'developer'
        # (OpenAI's newer name for the system role) is the system role
        user = {"role": "user", "content": "hi"}
        assert (eng.apply_chat_template([{"role": "developer", "content": "Be brief."}, user])
                == eng.apply_chat_template([{"role": "system", "content": "Be brief."}, user]))
        assert eng.chat([{"role": "system", "content": " "}, user], max_tokens=2).token_ids
        # OpenAI's content parts (text ones, joined); the rendered prompt as text (transformers' tokenize=False)
        parts = {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}
        assert eng.apply_chat_template([parts]) == eng.apply_chat_template([user])
        with pytest.raises(InvalidRequestError, match="only text parts"):
            eng.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
        text = eng.apply_chat_template([user], tokenize=False)
        assert isinstance(text, str) and "hi" in text
        assert eng.tokenize(text, add_special_tokens=False) == eng.apply_chat_template([user])
        with pytest.raises(InvalidRequestError, match="tokenize must be true or false"):
            eng.apply_chat_template([user], tokenize="no")


@pytest.mark.parametrize("kw, needle", [(dict(progress="yes"), "progress must be true or false or None"),
                                         (dict(plan_cache="no"), "plan_cache must be true or false"),
                                         (dict(cuda_options="junk"), "cuda_options must be a tinyinfer CudaOptions")])
def test_engine_arguments_of_the_wrong_type(tiny, kw, needle):
    with pytest.raises(InvalidRequestError, match=needle):  # (refused before the load; "no" would read as true)
        Engine(tiny, device="cpu", **kw)


def test_max_tokens_none_is_the_rest_of_the_context(tiny):
    """max_tokens=None: until EOS or the context is full (vLLM's and llama-cpp-python's None), alone and batched."""
    with Engine(tiny, device="cpu", max_seq_len=48) as eng:
        ids = eng.tokenize("hello")
        one = eng.generate(ids, max_tokens=None, ignore_eos=True)
        assert len(one.token_ids) == 48 - len(ids) and one.finish_reason == "length"
        both = eng.generate([ids, ids + ids], max_tokens=None, ignore_eos=True)
        assert [len(c.token_ids) for c in both] == [48 - len(ids), 48 - 2 * len(ids)]
        assert both[0].token_ids == one.token_ids
        with pytest.raises(InvalidRequestError, match="leaves no room to generate"):
            eng.generate(list(range(3, 51)), max_tokens=None)
        with pytest.raises(InvalidRequestError, match="max_tokens must be an integer >= 1, or None"):
            eng.generate(ids, max_tokens=0)


def test_ignore_eos(tiny, tmp_path):
    import shutil

    d = tmp_path / "all_eos"
    shutil.copytree(tiny, d)
    edit_config(d, eos_token_id=list(range(300)))  # every token ends the sequence
    base = ["run", "-m", d, "--device", "cpu", "-n", "7", "--raw", "hi"]
    assert "| 1 token | no decode step |" in cli(*base).stderr  # (sampled from the prompt's pass)
    r = cli(*base, "--ignore-eos")
    assert r.returncode == 0 and "| 7 tokens |" in r.stderr


def test_decode_rate_counts_the_steps_after_the_first_token():
    """n tokens took n - 1 decode steps (the first is sampled from the prompt's pass), as llama.cpp's eval runs."""
    from tinyinfer.engine import Stats

    assert Stats(decode_tokens=5, decode_s=2.0).decode_tok_s == 2.0
    assert Stats(decode_tokens=1, decode_s=0.001).decode_tok_s == 0.0


def test_chat_keeps_going_when_the_context_fills(tiny):
    lines = [f"message number {i}, a little longer" for i in range(6)] + ["x" * 200, "short one", ""]
    r = cli("chat", "-m", tiny, "--device", "cpu", "--max-seq-len", "160", "-n", "20", "--ignore-eos",
            "--system", "be brief", input="\n".join(lines) + "\n")
    assert r.returncode == 0, r.stderr
    assert "[context full: dropped the oldest" in r.stderr
    assert "exceeds max_seq_len=160" in r.stderr  # the 200-character message alone does not fit: refused ...
    assert r.stderr.count(" s wall") == 7  # ... and every other turn got its answer


def test_chat_keeps_the_history_when_a_message_is_too_long(tiny):
    """A refused message is taken back with nothing else: the turns before it stay (the next prompt holds them)."""
    r = cli("chat", "-m", tiny, "--device", "cpu", "--max-seq-len", "160", "-n", "8", "--ignore-eos",
            input="first message\n" + "x" * 200 + "\nsecond\n")
    assert r.returncode == 0 and "exceeds max_seq_len=160: raise --max-seq-len (up to the model's" in r.stderr
    first, second = [int(x) for x in re.findall(r"prompt (\d+) tokens", r.stderr)]
    assert second > first + 8  # "second" after the first exchange (alone it would be shorter than the first)


def test_minus_one_is_llama_cpps_none_for_n_and_seed(tiny):
    """-n -1: until EOS or the context is full; --seed -1: a random seed (llama-cli's meanings)."""
    r = cli("run", "-m", tiny, "--device", "cpu", "--max-seq-len", "40", "-n", "-1", "--seed", "-1",
            "--temperature", "1", "--ignore-eos", "--raw", "hi")
    assert r.returncode == 0, r.stderr
    prompt, n = [int(x) for x in re.search(r"prompt (\d+) tokens? in .* \| (\d+) tokens? \|", r.stderr).groups()]
    assert prompt + n == 40
    r = cli("chat", "-m", tiny, "--device", "cpu", "--max-seq-len", "200", "-n", "-1", "--ignore-eos", input="hi\n")
    assert r.returncode == 0 and r.stderr.count(" s wall") == 1, r.stderr


def test_run_names_the_flags_for_a_prompt_too_long(tiny):
    r = cli("run", "-m", tiny, "--device", "cpu", "--max-seq-len", "64", "-n", "8", "--raw", "x" * 100)
    assert r.returncode == 1 and "exceeds max_seq_len=64: raise --max-seq-len (up to the model's" in r.stderr


def test_chat_lines_commands_and_continuations(tiny):
    """A blank line is skipped, /exit quits, a line ending in a backslash goes on on the next one; with stdin a
    pipe, no "> " prompts in the answers."""
    r = cli("chat", "-m", tiny, "--device", "cpu", "-n", "2", "--ignore-eos",
            input="hi\n\n/help\nline one\\\nline two\n/reset\n/exit\nnever read\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(" s wall") == 2 and "[history cleared]" in r.stderr
    assert "/exit to quit" in r.stderr and ">" not in r.stdout
    one, two = [int(x) for x in re.findall(r"prompt (\d+) tokens", r.stderr)]
    assert two > one + len("line one\nline two")  # the two lines were one message, after the first exchange
    r = cli("chat", "-m", tiny, "--device", "cpu", "-n", "2", "--ignore-eos", input="cut off at the end\\")
    assert r.returncode == 0 and r.stderr.count(" s wall") == 1, r.stderr  # what was typed before the end: sent


def test_chat_ctrl_c_keeps_the_history_consistent(tiny):
    """Ctrl-C cannot be timed reliably into a subprocess's generation: the turn is driven in-process, with the
    KeyboardInterrupt raised from inside the stream after its first piece."""
    from tinyinfer.cli import _chat_turn, build_parser

    args = build_parser().parse_args(["chat", "-n", "10", "--ignore-eos"])  # (every sampling flag's default)
    with Engine(tiny, device="cpu", max_seq_len=256) as eng:
        messages = [{"role": "user", "content": "first"}]
        _chat_turn(eng, args, messages)
        assert [m["role"] for m in messages] == ["user", "assistant"]
        real = eng.stream_chat

        def interrupted(*a, **kw):
            for i, piece in enumerate(real(*a, **kw)):
                yield piece
                raise KeyboardInterrupt

        eng.stream_chat = interrupted
        messages.append({"role": "user", "content": "second"})
        _chat_turn(eng, args, messages)
        assert [m["role"] for m in messages] == ["user", "assistant"]  # the interrupted turn was taken back
        eng.stream_chat = real
        messages.append({"role": "user", "content": "third"})
        _chat_turn(eng, args, messages)
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]


def test_a_flag_typo_is_named_with_the_commands_usage(tiny):
    r = cli("run", "-m", tiny, "--temprature", "0.5", "hi")
    assert r.returncode == 2 and "usage: tinyinfer run" in r.stderr, r.stderr
    assert "unrecognized arguments: --temprature" in r.stderr
    r = cli("run", "--dtype", "bf16", "hi")  # (not offered: no engine computes in it)
    assert r.returncode == 2 and "invalid choice: 'bf16'" in r.stderr, r.stderr
    r = cli("run", "-m", tiny, "--device", "cpu", "--max-token", "3", "hi")  # a prefix: refused, not --max-tokens
    assert r.returncode == 2 and "unrecognized arguments: --max-token" in r.stderr, r.stderr


def test_run_without_a_chat_template_says_so(tiny, tmp_path):
    """A model with no chat template continues the prompt as plain text: said on stderr, and --system (which only a
    template can place) refused rather than dropped; --system with --raw likewise, before the load."""
    import shutil

    m = tmp_path / "m"
    shutil.copytree(tiny, m)
    (m / "chat_template.jinja").unlink()
    r = cli("run", "-m", m, "--device", "cpu", "--max-tokens", "2", "hi")
    assert r.returncode == 0 and "no chat template: the prompt is continued as plain text" in r.stderr, r.stderr
    r = cli("run", "-m", m, "--device", "cpu", "--max-tokens", "2", "--system", "be brief", "hi")
    assert r.returncode == 1 and "--system needs a chat template" in r.stderr and "Traceback" not in r.stderr
    r = cli("run", "-m", tmp_path / "nothing-here", "--raw", "--system", "be brief", "hi")
    assert r.returncode == 1 and "--raw skips" in r.stderr  # (refused before the model is looked for)


def test_commands_refuse_a_model_without_a_tokenizer(tiny, tmp_path):
    import shutil

    m = tmp_path / "m"
    shutil.copytree(tiny, m)
    (m / "tokenizer.json").unlink()
    (tmp_path / "t.txt").write_text("some text to score")
    for args, kw in ((("run", "hi"), {}), (("chat",), {"input": "hi\n"}), (("perplexity", tmp_path / "t.txt"), {})):
        r = cli(*args, "-m", m, "--device", "cpu", **kw)
        assert r.returncode == 1 and "has no tokenizer (no tokenizer.json, or a GGUF without one)" in r.stderr, r.stderr
        assert "pass token ids" not in r.stderr and "chat template" not in r.stderr


def test_perplexity_command_matches_the_logits(tiny, tmp_path):
    from tinyinfer.perplexity import perplexity

    text = "The quick brown fox jumps over the lazy dog. " * 6
    f = tmp_path / "eval.txt"
    f.write_text(text)
    r = cli("perplexity", f, "-m", tiny, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    got = float(re.search(r"perplexity (\S+)", r.stdout).group(1))
    with Engine(tiny, device="cpu", max_seq_len=2048) as eng:
        ids = eng.tokenize(text)
        want = float(np.exp(_nll(eng, ids).mean()))  # from the logits, not tinyinfer.perplexity's own functions
        assert got == pytest.approx(want, abs=1e-4)
        assert f"{len(ids) - 1} tokens scored in 1 window" in r.stdout
        two = perplexity(eng, ids, window=len(ids) // 2 + 1)  # windows: each scored from an empty cache
        a, b = ids[: two.window], ids[two.window:]
        nll = np.concatenate([_nll(eng, x) for x in (a, b)])
        assert two.windows == 2 and two.perplexity == pytest.approx(float(np.exp(nll.mean())), rel=1e-12)
    r = cli("perplexity", tmp_path / "missing.txt", "-m", tiny)
    assert r.returncode == 1 and "missing.txt" in r.stderr


def test_perplexity_tokens_0_scores_all_the_text(tiny, tmp_path):
    f = tmp_path / "eval.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 60)  # 2,700 characters: tokens past 2048
    r = cli("perplexity", f, "-m", tiny, "--device", "cpu", "--tokens", "0", "--window", "1024")
    assert r.returncode == 0, r.stderr
    with Engine(tiny, device="cpu") as eng:
        n = len(eng.tokenize(f.read_text()))
    assert n > 2048 and f"{n - 3} tokens scored in 3 windows of 1024" in r.stdout  # (a window's first is not)
    r = cli("perplexity", f, "-m", tiny, "--tokens", "1")
    assert r.returncode == 1 and "--tokens must be >= 2, or 0 for all" in r.stderr
    r = cli("perplexity", f, "-m", tiny, "--device", "cpu", "--tokens", "0")  # no --window: the engine's context
    assert r.returncode == 0, r.stderr
    assert f"{n - 2} tokens scored in 2 windows of 2048" in r.stdout  # (the model's 2,048 positions)
    r = cli("perplexity", f, "-m", tiny, "--device", "cpu", "--tokens", "2500")  # one window past the model's
    assert r.returncode == 1 and "--tokens 2500: one window of 2500 tokens does not fit" in r.stderr
    assert "--window" in r.stderr and "Traceback" not in r.stderr


def _nll(eng, ids):
    """-log_softmax(logits[:-1])[i, ids[i + 1]] in float64, computed here (the code under test has its own)."""
    x = eng.logits(ids)[:-1].astype(np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    return lse - x[np.arange(len(ids) - 1), ids[1:]]


def test_bench_cpu(tiny, tmp_path):
    out = tmp_path / "b.json"
    r = cli("bench", "--device", "cpu", "-m", tiny, "--contexts", "4,16", "--steps", "3", "--prefill", "8",
            "--json", out)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and [d["context"] for d in res["decode"]] == [4, 16]
    assert all(d["steps"] == 3 and d["tok_s"] > 0 for d in res["decode"]) and res["prefill"][0]["tokens"] == 8
    assert "tok/s" in r.stdout
    r = cli("bench", "--device", "cpu", "--contexts", "4,x")
    assert r.returncode == 1 and "--contexts" in r.stderr


def test_bench_cpu_random_weights_at_a_shape():
    from tinyinfer import _core
    from tinyinfer.bench import random_cpu_engine

    c = _core.ModelConfig()
    c.hidden, c.intermediate, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab = 128, 256, 2, 2, 1, 64, 100
    c.max_position_embeddings, c.rms_eps = 64, 1e-5
    c.validate()
    core = random_cpu_engine(c, 32)
    logits = core.forward([1, 2, 3], all_logits=True)
    assert logits.shape == (3, 100) and np.isfinite(logits).all() and logits.std() > 0


def test_bench_refuses_before_running(tiny, tmp_path):
    """What would fail only after the run (a --json folder that is not there) or size memory by an absurd
    number (contexts past the shape's positions) is refused first, naming the flag."""
    for out in (tmp_path / "no" / "such" / "b.json", tmp_path):
        r = cli("bench", "--device", "cpu", "-m", tiny, "--contexts", "4", "--steps", "2", "--prefill", "",
                "--json", out)
        assert r.returncode == 1 and "a folder, or a file whose folder does not exist" in r.stderr
        assert "Traceback" not in r.stderr and "tok/s" not in r.stdout  # (refused before the run)
    # positions past any address space: refused before an engine is made, naming the flag
    r = cli("bench", "--device", "cpu", "--contexts", str(10**13), "--steps", "2", "--prefill", "")
    assert r.returncode == 1 and f"--contexts {10**13}: the CPU reference engine is timed up to" in r.stderr
    assert "Traceback" not in r.stderr


def test_short_flags_mean_what_they_do_in_llama_cli():
    """-t is threads and --temp the temperature, as in llama-cli; -n the tokens to generate."""
    from tinyinfer.cli import build_parser

    a = build_parser().parse_args(["run", "-t", "3", "--temp", "0.7", "-n", "5", "hi"])
    assert (a.threads, a.temperature, a.max_tokens) == (3, 0.7, 5)
    assert build_parser().parse_args(["bench", "-t", "2"]).threads == 2


def test_bench_json_writes_enums_by_name(tmp_path):
    """`tinyinfer bench --json`: the GPU's GEMV table rows carry the bindings' MatrixRole enum, written by name
    (json.dump alone raised TypeError after the decode and prefill tables had been printed)."""
    import enum
    import json

    from tinyinfer.bench import write_json

    class Role(enum.Enum):
        Qkv = 0

    write_json({"gemv": [{"role": Role.Qkv, "R": 2}]}, str(tmp_path / "b.json"))
    assert json.loads((tmp_path / "b.json").read_text()) == {"gemv": [{"role": "Qkv", "R": 2}]}
