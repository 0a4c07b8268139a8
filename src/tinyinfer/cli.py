"""The tinyinfer command line: run | chat | serve | bench | verify | perplexity | info.

    tinyinfer run "Write a haiku about GPUs."          # default model, chat template, answer + stats line
    tinyinfer run --model path/to/model --raw "Once"    # plain completion, no chat template
    echo "Summarize: ..." | tinyinfer run -             # the prompt from stdin ("-", or no prompt and a pipe)
    tinyinfer chat                                      # interactive, multi-turn, streaming
    tinyinfer perplexity text.txt --dtype int4          # judge a quantization
    tinyinfer serve --port 8000                         # an OpenAI-compatible HTTP server (the `serve` extra)

Everything that can be checked without the model (sampling values, dtype names, the prompt) is checked before
the model loads. A closed stdout (`| head`) ends the command quietly.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Optional

from .errors import InvalidRequestError, TinyInferError

_DTYPE_CHOICES = ("auto", "fp16", "fp32", "int8", "int4")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="HF model directory, .gguf file, or hub name org/name[@revision][:file.gguf] "
                   "(default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: auto")
    p.add_argument("--dtype", default="auto", choices=_DTYPE_CHOICES,
                   help="weights: auto (fp16 on the GPU, fp32 on the CPU), int8 or int4 (weight-only, quantized at "
                   "load; the CPU engine then computes in fp32 with the dequantized weights); a dtype the device "
                   "cannot honour is refused")
    p.add_argument("--max-seq-len", type=int, default=None, help="KV cache length (default: min(model, 4096))")
    _add_threads_arg(p)


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="CPU engine threads (default: the cores this process may use)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (vLLM / OpenAI names)")
    g.add_argument("--max-tokens", "-n", type=int, default=256,
                   help="tokens to generate at most (default 256; -1: until EOS or the context is full)")
    # (-t is llama-cli's threads, as here; --temp is its temperature)
    g.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="default 0: off")
    g.add_argument("--top-p", type=float, default=1.0, help="default 1: off")
    g.add_argument("--min-p", type=float, default=0.0, help="default 0: off")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="default 1: off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="default 0: off")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="default 0: off")
    g.add_argument("--logit-bias", "-l", action="append", default=[], metavar="TOKEN_ID(+/-)BIAS",
                   help="add BIAS (-100..100) to a token's logit, as llama-cli's: 15043+1, 2-100 (repeatable)")
    g.add_argument("--min-tokens", type=int, default=0, help="no stop before this many tokens (default 0)")
    g.add_argument("--seed", type=int, default=None, help="default (or -1): a random one")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the model's end-of-sequence")
    c = p.add_argument_group("structured outputs (llama-cli's flags; one of them)").add_mutually_exclusive_group()
    c.add_argument("--json-schema", "-j", metavar="SCHEMA", help="the answer is JSON valid under this JSON schema "
                   "(its text; {} for any JSON object)")
    c.add_argument("--json-schema-file", metavar="FILE", help="the same, the schema read from FILE")
    c.add_argument("--grammar", metavar="GRAMMAR", help="the answer follows this grammar (llama.cpp's GBNF or Lark)")
    c.add_argument("--grammar-file", metavar="FILE", help="the same, the grammar read from FILE")
    p.add_argument_group("speculative decoding").add_argument(
        "--speculative-config", metavar="JSON", default=None,
        help='vLLM\'s n-gram speculation: "ngram" (drafts of up to 5 tokens after a 5-gram match) or its JSON, e.g. '
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}; the '
        'answer is unchanged, made in fewer passes where it repeats its context (the stats line counts the drafted '
        'tokens kept)')


# The longest context `bench --device cpu` times (each is one prefill on the reference engine first).
CPU_BENCH_MAX_CONTEXT = 8192


def _logit_bias(items: list[str]) -> Optional[dict[int, float]]:
    """llama-cli's --logit-bias TOKEN_ID(+/-)BIAS flags as a logit_bias mapping (a later flag for the same id wins)."""
    out: dict[int, float] = {}
    for item in items:
        m = re.fullmatch(r"\s*(\d+)\s*([+-]\s*[0-9.eE+-]+)\s*", item)
        try:
            if m is None:
                raise ValueError
            out[int(m[1])] = float(m[2].replace(" ", ""))
        except ValueError:
            raise InvalidRequestError(f"--logit-bias {item!r}: expected TOKEN_ID+BIAS or TOKEN_ID-BIAS, as in "
                                      f"15043+1 or 2-100") from None
    return out or None


def _structured(args):
    """The structured-output flags as a StructuredOutputs (None: plain text); a file that cannot be read is named."""
    from .structured import StructuredOutputs

    def read(path: str, flag: str) -> str:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"{flag} {path}: cannot read it ({e})") from None

    schema = args.json_schema if args.json_schema is not None else (
        read(args.json_schema_file, "--json-schema-file") if args.json_schema_file else None)
    grammar = args.grammar if args.grammar is not None else (
        read(args.grammar_file, "--grammar-file") if args.grammar_file else None)
    flag = next(f"--{n.replace('_', '-')}" for n in ("json_schema", "json_schema_file", "grammar", "grammar_file", "")
                if not n or getattr(args, n) is not None)
    try:
        if schema is not None:
            if not schema.strip():
                raise InvalidRequestError("invalid structured_outputs: the schema is empty ({} for any JSON object)")
            return StructuredOutputs(json_object=True) if schema.strip() == "{}" else StructuredOutputs(json=schema)
        if grammar is not None:
            return StructuredOutputs(grammar=grammar)
    except InvalidRequestError as e:
        raise InvalidRequestError(str(e).replace("invalid structured_outputs: ", f"{flag}: ", 1)) from None
    return None


def _sampling(args) -> dict:
    """The sampling flags as SamplingParams' fields; -1 is llama.cpp's "none" for -n and --seed."""
    return dict(max_tokens=None if args.max_tokens == -1 else args.max_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                seed=None if args.seed == -1 else args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                logit_bias=_logit_bias(args.logit_bias), min_tokens=args.min_tokens,
                structured_outputs=_structured(args))


def _check_before_load(args) -> None:
    """What can be refused without the model, refused before the seconds a model takes to load."""
    from .sampling import SamplingParams

    fields = _sampling(args)
    try:
        SamplingParams(**fields)
    except InvalidRequestError as e:  # in the command line's terms: "--top-p must be ...", not "top_p"
        msg = str(e).replace("invalid sampling parameter: ", "", 1)
        field = msg.split(" ", 1)[0]
        if field in fields:
            msg = "--" + field.replace("_", "-") + msg[len(field):].replace("or None for", "or -1 for")
        raise InvalidRequestError(msg) from None
    _speculative(getattr(args, "speculative_config", None))
    if args.max_seq_len is not None:
        if args.max_seq_len < 2:
            raise InvalidRequestError(f"--max-seq-len must be >= 2 (got {args.max_seq_len})")
        if args.max_tokens != -1 and args.max_tokens >= args.max_seq_len:
            raise InvalidRequestError(f"--max-tokens {args.max_tokens} leaves no room for a prompt within "
                                      f"--max-seq-len {args.max_seq_len}")
    if getattr(args, "system", None) is not None and not args.system.strip():
        raise InvalidRequestError("--system is empty")
    if getattr(args, "raw", False) and getattr(args, "system", None) is not None:
        raise InvalidRequestError("--system goes into the chat template, which --raw skips: give one of them")
    _check_threads(args)
    if args.dtype != "auto" and args.device != "auto":
        from .engine import check_dtype

        check_dtype(args.dtype, args.device)


def _check_steps(steps: Optional[int], name: str) -> None:
    if steps is not None and steps < 1:  # (0 would time nothing: the rates divide by it)
        raise InvalidRequestError(f"{name} must be >= 1 (got {steps})")


def _check_threads(args) -> None:
    if args.threads is not None and args.threads < 1:
        raise InvalidRequestError(f"--threads must be >= 1 (got {args.threads})")


def _model_path(model: Optional[str]) -> str:
    if model is not None:
        return model
    from .models import default_model_path

    return str(default_model_path())


def _engine(args):
    from .engine import Engine

    return Engine(_model_path(args.model), device=args.device, dtype=args.dtype, max_seq_len=args.max_seq_len,
                  threads=args.threads, speculative_config=_speculative(getattr(args, "speculative_config", None)))


def _speculative(text: Optional[str]):
    """--speculative-config: "ngram" or vLLM's JSON form, as a SpeculativeConfig (None: off)."""
    from .speculative import SpeculativeConfig

    if text is None:
        return None
    if text.strip() in ("ngram", "[ngram]"):
        return SpeculativeConfig()
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"--speculative-config must be \"ngram\" or a JSON object: {e}") from None
    if not isinstance(v, dict):
        raise InvalidRequestError(f"--speculative-config must be \"ngram\" or a JSON object, got {text.strip()!r:.60}")
    try:
        return SpeculativeConfig.of(v)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"--{e}".replace("--speculative_config", "--speculative-config", 1)) from None


def _tokens(n: int) -> str:
    return f"{n} token{'' if n == 1 else 's'}"


def stats_line(eng, out) -> str:
    s = out.stats
    cached = f" ({s.cached_tokens} cached)" if s.cached_tokens else ""
    return (f"[{eng.device} {eng.dtype}] prompt {_tokens(s.prompt_tokens)}{cached} in {s.prefill_ms:.1f} ms | "
            f"{_tokens(s.decode_tokens)} | "
            + (f"decode {s.decode_tok_s:.1f} tok/s{' (GPU time)' if s.decode_timer == 'GPU time' else ''}"
               if s.decode_tokens > 1 else "no decode step")
            + (f" | drafts {s.accepted_tokens}/{s.draft_tokens} accepted" if s.draft_tokens else "")
            + f" | {s.wall_s:.2f} s wall")


def _from_stdin(read, *args) -> str:
    """read(*args) (sys.stdin.read, input) with bytes that stdin's encoding cannot decode refused as an
    InvalidRequestError: read with surrogateescape they arrive as lone surrogates, where strict decoding would
    raise part-way through a read (and lose the rest of what it had buffered)."""
    if isinstance(sys.stdin, io.TextIOWrapper) and sys.stdin.errors != "surrogateescape":
        sys.stdin.reconfigure(errors="surrogateescape")  # (possible before the first read only)
    text = read(*args)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) - 0xDC00
        raise InvalidRequestError(f"the input is not valid {sys.stdin.encoding} text (byte 0x{byte:02x})") from None
    return text


def _read_prompt(args) -> str:
    """The prompt: the arguments joined, or stdin for "-" or for no argument with stdin not a terminal."""
    if args.prompt == ["-"] or (not args.prompt and not sys.stdin.isatty()):
        prompt = _from_stdin(sys.stdin.read).rstrip("\n")
    elif not args.prompt:
        raise InvalidRequestError("no prompt: give it as arguments, or \"-\" to read it from stdin")
    else:
        prompt = " ".join(args.prompt)
    if not prompt.strip():
        raise InvalidRequestError("empty prompt")
    return prompt


def _needs_tokenizer(eng) -> None:
    """The commands read and write text: a model folder with no tokenizer.json is refused in their terms (the
    Python API's "pass token ids" names what the command line cannot do)."""
    if eng.tokenizer is None:
        from .errors import TokenizerError

        raise TokenizerError(f"{eng.model_name} has no tokenizer (no tokenizer.json, or a GGUF without one): the "
                             f"command line needs one to read the prompt and write the answer")


def cmd_run(args) -> int:
    prompt = _read_prompt(args)
    _check_before_load(args)
    eng = _engine(args)
    _needs_tokenizer(eng)
    templated = bool(getattr(eng.tokenizer, "chat_template", None))
    if not args.raw and not templated:  # (said, not done silently: the reply is then a plain continuation)
        if args.system is not None:
            raise InvalidRequestError(f"--system needs a chat template, and {eng.model_name} has none (it "
                                      f"continues the prompt as plain text: drop --system)")
        print("tinyinfer: the model has no chat template: the prompt is continued as plain text (as --raw)",
              file=sys.stderr)
    try:
        if args.raw or not templated:
            pieces = eng.stream(prompt, **_sampling(args)) if not args.no_stream else None
            out = _print_stream(eng, pieces, lambda: eng.generate(prompt, **_sampling(args)))
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}]
            pieces = eng.stream_chat(messages, **_sampling(args)) if not args.no_stream else None
            out = _print_stream(eng, pieces, lambda: eng.chat(messages, **_sampling(args)))
    except InvalidRequestError as e:
        if f"max_seq_len={eng.max_seq_len}" not in str(e):
            raise
        raise InvalidRequestError(f"{e}: {_LONGER.format(limit=eng.config.max_position_embeddings)}") from None
    print(stats_line(eng, out), file=sys.stderr)
    return 0


def _print_stream(eng, pieces, run_once):
    if pieces is None:
        out = run_once()
        print(out.text)
        return out
    for piece in pieces:
        print(piece, end="", flush=True)
    print()
    return eng.last_completion


_LONGER = "raise --max-seq-len (up to the model's {limit}) or lower -n"  # (what a prompt too long can do)


def fit_history(eng, messages: list[dict], max_tokens: int) -> int:
    """Drop the oldest user/assistant turns (never the system prompt, never the last user message) until the
    rendered conversation plus max_tokens fits in the engine's max_seq_len. Returns how many turns went; raises
    InvalidRequestError, with `messages` as it was, when even the last message alone does not fit."""
    first = 1 if messages and messages[0]["role"] == "system" else 0
    kept = list(messages)
    while len(eng.apply_chat_template(kept)) + max_tokens > eng.max_seq_len:
        if len(kept) - first < 3:  # only the new user message is left
            n = len(eng.apply_chat_template(kept))
            raise InvalidRequestError(f"this message ({n} tokens with the template) + max_tokens ({max_tokens}) "
                                      f"exceeds max_seq_len={eng.max_seq_len}: "
                                      f"{_LONGER.format(limit=eng.config.max_position_embeddings)}")
        del kept[first:first + 2]  # one user turn and its reply
    dropped = (len(messages) - len(kept)) // 2
    messages[:] = kept
    return dropped


def _chat_turn(eng, args, messages: list[dict]) -> None:
    """One exchange; on any failure or Ctrl-C the user message is taken back, so the history stays a valid
    alternation of user and assistant turns."""
    try:
        # -n -1 (the rest of the context): old turns still go once fewer than a quarter of it (at most 256) is left
        room = _sampling(args)["max_tokens"] or min(256, eng.max_seq_len // 4)
        dropped = fit_history(eng, messages, room)
        if dropped:
            print(f"[context full: dropped the oldest {dropped} turn{'s' if dropped > 1 else ''}]", file=sys.stderr)
        for piece in eng.stream_chat(messages, **_sampling(args)):
            print(piece, end="", flush=True)
    except KeyboardInterrupt:
        print(" [interrupted]")
        messages.pop()
        return
    except TinyInferError as e:  # a refused message, a template that raised, ...: the session goes on
        print(f"\ntinyinfer: {e}", file=sys.stderr)
        messages.pop()
        return
    print()
    out = eng.last_completion
    messages.append({"role": "assistant", "content": out.text})
    print(stats_line(eng, out), file=sys.stderr)


def cmd_chat(args) -> int:
    _check_before_load(args)
    eng = _engine(args)
    _needs_tokenizer(eng)
    if not getattr(eng.tokenizer, "chat_template", None):
        print("tinyinfer chat: this model has no chat template", file=sys.stderr)
        return 2
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print(f"tinyinfer chat — {_chat_help()}", file=sys.stderr)
    while True:
        try:
            line = _chat_input()
        except EOFError:
            print()
            break
        except InvalidRequestError as e:  # (the line is dropped; the conversation goes on)
            print(f"tinyinfer: {e}", file=sys.stderr)
            continue
        command = line.strip()
        if not command:  # (a blank line in a paste is not the end of the session)
            continue
        if command in ("/exit", "/quit", "/bye"):
            break
        if command in ("/help", "/?"):
            print(_chat_help(), file=sys.stderr)
            continue
        if command == "/reset":
            messages = list(system)
            print("[history cleared]", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        _chat_turn(eng, args, messages)
    return 0


def _chat_help() -> str:
    eof = "Ctrl-Z Enter" if os.name == "nt" else "Ctrl-D"
    return f"{eof} or /exit to quit, /reset to start over, a line ending in \\ goes on on the next line"


def _chat_input() -> str:
    """One message: a line, or lines joined while each ends in a backslash (llama-cli's way to type several; the
    end of input after one sends what was typed). The "> " prompt only where a person types and reads (input()
    writes it to stdout: a pipe's or a log's answers stay free of it)."""
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    lines = [_from_stdin(input, "> " if tty else "")]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        try:
            lines.append(_from_stdin(input, ". " if tty else ""))
        except EOFError:
            break
    return "\n".join(lines)


def _int_list(text: Optional[str], flag: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(c) for c in text.split(",")) if text else ()
    except ValueError:
        raise InvalidRequestError(f"{flag} must be comma-separated integers (got {text!r})") from None
    if any(v < 1 for v in vals):
        raise InvalidRequestError(f"{flag} values must be >= 1 (got {text!r})")
    return vals


def cmd_bench(args) -> int:
    from . import bench

    cpu = args.device == "cpu"
    # the CPU reference engine is far slower: shorter defaults that still finish in seconds
    contexts = _int_list(args.contexts or ("16,256" if cpu else "16,1024,4096"), "--contexts")
    prefill = _int_list(("16,128" if cpu else "16,256,512,2048") if args.prefill is None else args.prefill,
                        "--prefill")
    _check_steps(args.steps, "--steps")
    steps = args.steps or (32 if cpu else 256)
    _check_threads(args)
    if args.json is not None and (os.path.isdir(args.json)
                                  or not os.path.isdir(os.path.dirname(os.path.abspath(args.json)))):
        raise InvalidRequestError(f"--json {args.json!r}: a folder, or a file whose folder does not exist; "
                                  f"give a file to write")  # (before the run, not after it)
    if not contexts:
        raise InvalidRequestError("--contexts is empty")
    if cpu and max(contexts) > CPU_BENCH_MAX_CONTEXT and args.batch is None:
        # (each context is one prefill on the reference engine first: 8,192 tokens are already minutes there)
        raise InvalidRequestError(f"--contexts {max(contexts)}: the CPU reference engine is timed up to "
                                  f"{CPU_BENCH_MAX_CONTEXT:,} (each context is a prefill there first)")
    if args.batch is not None:
        from . import bench_batch

        batches = _int_list(args.batch, "--batch")
        if not batches:
            raise InvalidRequestError("--batch is empty")
        dtype = ("fp32" if cpu else "fp16") if args.dtype == "auto" else args.dtype
        bench_batch.run(args.device, batches, shape=args.shape, model=args.model, dtype=dtype,
                        json_path=args.json, threads=args.threads, opts_spec=args.opts)
        return 0
    if args.opts and cpu:
        raise InvalidRequestError("--opts is for cuda runs")
    if cpu:
        bench.run_cpu(shape=args.shape, model=args.model, contexts=contexts, steps=steps, prefill=prefill,
                      json_path=args.json, dtype="fp32" if args.dtype == "auto" else args.dtype,
                      threads=args.threads)
    else:
        bench.run(shape=args.shape, model=args.model, contexts=contexts, steps=steps, json_path=args.json,
                  prefill=prefill, dtype="fp16" if args.dtype == "auto" else args.dtype, opts_spec=args.opts)
    return 0


def cmd_perplexity(args) -> int:
    from .engine import Engine
    from .perplexity import perplexity

    if args.tokens < 0 or args.tokens == 1:
        raise InvalidRequestError(f"--tokens must be >= 2, or 0 for all (got {args.tokens})")
    if args.window is not None and args.window < 2:
        raise InvalidRequestError(f"--window must be >= 2 (got {args.window})")
    _check_threads(args)
    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"cannot read the text {args.file}: {e}") from e
    if not text.strip():
        raise InvalidRequestError(f"{args.file} is empty")
    if args.dtype != "auto" and args.device != "auto":
        from .engine import check_dtype

        check_dtype(args.dtype, args.device)
    window = args.window or args.tokens or None  # None (--tokens 0, no --window): the engine's context
    try:
        eng = Engine(_model_path(args.model), device=args.device, dtype=args.dtype,
                     max_seq_len=args.max_seq_len or window, threads=args.threads)
    except InvalidRequestError as e:
        if args.max_seq_len or window is None or "max_seq_len must be" not in str(e):
            raise
        flag = "--window" if args.window else "--tokens"  # (the context was sized by it: say so)
        raise InvalidRequestError(f"{flag} {window}: one window of {window} tokens does not fit the model ({e}); "
                                  f"give a smaller --window to score the text in several") from None
    with eng:
        _needs_tokenizer(eng)
        ids = eng.tokenize(text)
        if args.tokens:
            ids = ids[:args.tokens]
        r = perplexity(eng, ids, min(window, len(ids)) if window else None)
        print(f"perplexity {r.perplexity:.4f} | {_tokens(r.scored_tokens)} scored in {r.windows} window"
              f"{'s' if r.windows > 1 else ''} of {r.window} | {args.file} | {eng.model_name} [{eng.device} "
              f"{eng.dtype}]")
    return 0


def cmd_verify(args) -> int:
    from . import bench

    _check_steps(args.steps, "verify's steps")
    model = args.model
    if model is None:
        from .models import default_model_path

        model = default_model_path()
    res = bench.verify(model, steps=args.steps)
    return 0 if res["argmax_mismatches"] == 0 else 3


def cmd_serve(args) -> int:
    from .server.main import serve

    if args.max_seq_len is not None and args.max_seq_len < 2:
        raise InvalidRequestError(f"--max-seq-len must be >= 2 (got {args.max_seq_len})")
    _check_threads(args)
    if args.dtype != "auto" and args.device != "auto":
        from .engine import check_dtype

        check_dtype(args.dtype, args.device)
    return serve(args, _engine)


def cmd_info(args) -> int:
    from . import _core
    from .engine import cuda_status

    info = dict(_core.build_info)
    print(f"tinyinfer {info.pop('version', '?')}")
    print("build: " + ", ".join(f"{k}={v}" for k, v in info.items() if v != ""))
    usable, reason = cuda_status()  # (on a machine with no GPU a CPU-only build is no fault: the run's sentence)
    if usable:
        st = dict(_core.ops.device_status())
        print(f"GPU: {st.get('name')} (compute capability {st.get('compute_capability')}, "
              f"{int(st.get('total_mem', 0)) / 2**30:.0f} GiB; {st.get('count')} device(s) visible)")
    else:
        print(f"GPU: none usable: {reason}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    # allow_abbrev=False: "--max-token" is a typo to report, not --max-tokens
    parser = argparse.ArgumentParser(prog="tinyinfer", description="A small, fast LLM inference engine.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"tinyinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))

    p = sub.add_parser("run", help="answer one prompt (with the model's chat template) and print stats")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--raw", action="store_true", help="plain completion of the prompt, no chat template")
    p.add_argument("--no-stream", action="store_true", help="print the answer at the end")
    p.add_argument("prompt", nargs="*", help='the prompt; "-" or none with a pipe: read from stdin')
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive multi-turn chat, streaming")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="decode speed (GPU: vs the measured memory roofline), prefill speed, GEMM tactics")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--shape", default=None, help="random weights at a real shape: smollm2-135m (CPU default), "
                   "smollm2-360m, tinyllama-1.1b (GPU default), llama2-7b")
    g.add_argument("--model", "-m", default=None, help="a real model (HF dir, .gguf or hub name)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda (default) or cpu: the CPU reference engine, wall time")
    p.add_argument("--contexts", default=None, help="comma-separated contexts (default 16,1024,4096; CPU 16,256)")
    p.add_argument("--steps", type=int, default=None, help="decode steps timed per context (default 256; CPU 32)")
    p.add_argument("--dtype", default="auto", choices=("auto", "fp16", "fp32", "int8", "int4"),
                   help="weight format (GPU: fp16 | int8 | int4; CPU: fp32, or int8 | int4 with --model); bytes "
                   "per token are counted as stored, scales included")
    p.add_argument("--prefill", default=None,
                   help="comma-separated prompt lengths for the prefill table (default 16,256,512,2048; CPU "
                   "16,128; '' to skip)")
    p.add_argument("--batch", default=None,
                   help="comma-separated batch sizes, e.g. 1,8,32,64: batched decode tok/s (aggregate and per "
                   "sequence; prompt 128 + 128 generated) instead of the batch-1 tables")
    p.add_argument("--opts", default="",
                   help="on cuda: CudaOptions fields as name=value,... for A/B runs, e.g. "
                   "batch_gemv_f16_max=8,batch_gemv_quant_max=64 (--batch) or persistent_ring=0,"
                   "persistent_ring_slots=6 (the decode table's persistent column)")
    p.add_argument("--json", default=None, help="write the results here")
    _add_threads_arg(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("verify", help="GPU engine vs CPU engine: worst relative logit error, argmax mismatches")
    p.add_argument("--model", "-m", default=None)
    p.add_argument("steps", nargs="?", type=int, default=32)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("perplexity", help="perplexity of a model on a text file (to judge a quantization)")
    _add_model_args(p)
    p.add_argument("file", help="a UTF-8 text file")
    p.add_argument("--tokens", type=int, default=2048,
                   help="score the first N tokens of the text (default 2048, as bench/tools/quant_quality.py; 0 = all)")
    p.add_argument("--window", type=int, default=None,
                   help="tokens per window, each scored from an empty cache (default: --tokens, one window; "
                   "with --tokens 0, the engine's context)")
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    _add_model_args(p)
    from .server.main import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("info", help="build and GPU information")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said with the command's usage, not the top level's (as parse_args would)
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        rc = args.func(args)
        sys.stdout.flush()  # here, so that a closed pipe is met inside the try and not at interpreter exit
        return rc
    except BrokenPipeError:
        # `tinyinfer run ... | head`: the reader has gone; end quietly, as a killed-by-SIGPIPE tool would. Point
        # stdout at devnull so that the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except TinyInferError as e:
        print(f"tinyinfer: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntinyinfer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
