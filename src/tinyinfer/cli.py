"""The tinyinfer command line: run | chat | bench | verify | info.

    tinyinfer run "Write a haiku about GPUs."          # default model, chat template, answer + stats line
    tinyinfer run --model path/to/model --raw "Once"    # plain completion, no chat template
    tinyinfer chat                                      # interactive, multi-turn, streaming
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from .errors import TinyInferError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: auto")
    p.add_argument("--dtype", default="fp16", help="weights: fp16 (default), int8 or int4 (weight-only, quantized at load; the CPU engine then computes in fp32 with the dequantized weights), bf16 | fp32")
    p.add_argument("--max-seq-len", type=int, default=None, help="KV cache length (default: min(model, 4096))")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (vLLM / OpenAI names)")
    g.add_argument("--max-tokens", "-n", type=int, default=256)
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop)


def _engine(args):
    from .engine import Engine

    path = args.model
    if path is None:
        from .models import default_model_path

        path = default_model_path()
    return Engine(path, device=args.device, dtype=args.dtype, max_seq_len=args.max_seq_len)


def stats_line(eng, out) -> str:
    s = out.stats
    return (f"[{eng.device} {eng.dtype}] prompt {s.prompt_tokens} tokens in {s.prefill_ms:.1f} ms | "
            f"{s.decode_tokens} tokens | decode {s.decode_tok_s:.1f} tok/s"
            f"{' (GPU time)' if s.decode_timer == 'GPU time' else ''} | {s.wall_s:.2f} s wall")


def cmd_run(args) -> int:
    eng = _engine(args)
    prompt = " ".join(args.prompt)
    if args.raw or eng.tokenizer is None or not getattr(eng.tokenizer, "chat_template", None):
        pieces = eng.stream(prompt, **_sampling(args)) if not args.no_stream else None
        out = _print_stream(eng, pieces, lambda: eng.generate(prompt, **_sampling(args)))
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}]
        pieces = eng.stream_chat(messages, **_sampling(args)) if not args.no_stream else None
        out = _print_stream(eng, pieces, lambda: eng.chat(messages, **_sampling(args)))
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


def cmd_chat(args) -> int:
    eng = _engine(args)
    if eng.tokenizer is None or not getattr(eng.tokenizer, "chat_template", None):
        print("tinyinfer chat: this model has no chat template", file=sys.stderr)
        return 2
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("tinyinfer chat — empty line or Ctrl-D to quit, /reset to start over", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        try:
            for piece in eng.stream_chat(messages, **_sampling(args)):
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [interrupted]")
        print()
        out = eng.last_completion
        if out is not None:
            messages.append({"role": "assistant", "content": out.text})
            print(stats_line(eng, out), file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from . import bench

    contexts = tuple(int(c) for c in args.contexts.split(","))
    prefill = tuple(int(c) for c in args.prefill.split(",")) if args.prefill else ()
    bench.run(shape=args.shape, model=args.model, contexts=contexts, steps=args.steps, json_path=args.json,
              prefill=prefill, dtype=args.dtype)
    return 0


def cmd_verify(args) -> int:
    from . import bench

    model = args.model
    if model is None:
        from .models import default_model_path

        model = default_model_path()
    res = bench.verify(model, steps=args.steps)
    return 0 if res["argmax_mismatches"] == 0 else 3


def cmd_info(args) -> int:
    from . import _core

    print("build:", dict(_core.build_info))
    print("cuda device:", dict(_core.ops.device_status()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyinfer", description="A small, fast LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="answer one prompt (with the model's chat template) and print stats")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--raw", action="store_true", help="plain completion of the prompt, no chat template")
    p.add_argument("--no-stream", action="store_true", help="print the answer at the end")
    p.add_argument("prompt", nargs="+")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive multi-turn chat, streaming")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="GPU decode speed vs the measured memory roofline; prefill speed and GEMM tactics")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--shape", default=None, help="random weights at a real shape: smollm2-135m, smollm2-360m, "
                   "tinyllama-1.1b (default), llama2-7b")
    g.add_argument("--model", "-m", default=None, help="a real model (HF dir or .gguf)")
    p.add_argument("--contexts", default="16,1024,4096", help="comma-separated contexts (default 16,1024,4096)")
    p.add_argument("--steps", type=int, default=256, help="decode steps timed per context (default 256)")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "int8", "int4"),
                   help="weight format on the GPU (bytes per token are counted as stored, scales included)")
    p.add_argument("--prefill", default="16,256,512,2048",
                   help="comma-separated prompt lengths for the prefill table ('' to skip)")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("verify", help="GPU engine vs CPU engine: worst relative logit error, argmax mismatches")
    p.add_argument("--model", "-m", default=None)
    p.add_argument("steps", nargs="?", type=int, default=32)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("info", help="build and GPU information")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TinyInferError as e:
        print(f"tinyinfer: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntinyinfer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
