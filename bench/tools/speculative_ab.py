"""Speculative decoding by n-gram lookup against none, on real requests (docs/perf/speculative.md, "Measured"):
each request's decode tok/s, the tokens drafted and kept, and a check that every configuration gives the same
tokens (greedy). One engine; the configurations interleaved in rounds (the engine's measured pass costs carry over
between calls, as they do for a user's calls); the median round is printed.

  python bench/tools/speculative_ab.py                                  # the default model on this machine's engine
  python bench/tools/speculative_ab.py --model PATH --device cuda --rounds 3
  python bench/tools/speculative_ab.py --configs none,5..5:8,4..2:8     # lookup max..min : num_speculative_tokens
"""

import argparse
import statistics

from tinyinfer import Engine
from tinyinfer.models import DEFAULT_MODEL, default_model_path
from tinyinfer.speculative import SpeculativeConfig

_CODE = """def area(w, h):
    return w * h


def perimeter(w, h):
    return 2 * (w + h)


def describe(w, h):
    a = area(w, h)
    p = perimeter(w, h)
    return f"{w}x{h}: area {a}, perimeter {p}"


print(describe(3, 4))
print(area(5, 6))"""
_SENTENCE = ("The quick brown fox jumps over the lazy dog while the farmer watches from the porch and the sun sets "
             "slowly behind the hills.")
REQUESTS = {  # name -> the user's message (the model's chat template around it)
    "code edit": f"Rename the function `area` to `rectangle_area` everywhere in this code and print the whole "
                 f"file:\n```python\n{_CODE}\n```",
    "repeat": f"Repeat this sentence exactly, nothing else: {_SENTENCE}",
    "story": "Write a short story about a lighthouse keeper.",
}


def spec_config(text: str):
    """'none' -> None; 'MAX..MIN:K' -> vLLM's ngram speculative_config."""
    if text == "none":
        return None
    lookup, _, k = text.partition(":")
    hi, _, lo = lookup.partition("..")
    return {"method": "ngram", "num_speculative_tokens": int(k or 5), "prompt_lookup_max": int(hi),
            "prompt_lookup_min": int(lo or hi)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=f"default: {DEFAULT_MODEL}")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--configs", default="none,5..5:8,4..2:8")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    eng = Engine(args.model or str(default_model_path()), device=args.device, progress=False)
    configs = args.configs.split(",")
    print(f"{eng.device} {eng.dtype}: {args.model or DEFAULT_MODEL}; greedy, up to {args.max_tokens} tokens, "
          f"median of {args.rounds} round(s)")
    print(f"{'request':<10} {'config':<8} {'tokens':>6} {'tok/s':>7} {'x none':>7} {'drafted':>8} {'kept':>5}")
    for name, message in REQUESTS.items():
        runs: dict[str, list] = {c: [] for c in configs}
        for _ in range(args.rounds):
            for c in configs:
                eng.speculative_config = SpeculativeConfig.of(spec_config(c))  # (checked as the constructor does)
                r = eng.chat([{"role": "user", "content": message}], max_tokens=args.max_tokens, temperature=0)
                runs[c].append(r)
        want = runs[configs[0]][0].token_ids
        base = statistics.median(r.stats.decode_tok_s for r in runs[configs[0]])
        for c in configs:
            rs = runs[c]
            if any(r.token_ids != want for r in rs):
                raise SystemExit(f"{name}: {c} gave other tokens than {configs[0]}")
            tok_s = statistics.median(r.stats.decode_tok_s for r in rs)
            last = rs[-1].stats
            print(f"{name:<10} {c:<8} {len(want):>6} {tok_s:>7.1f} {tok_s / base:>6.2f}x {last.draft_tokens:>8} "
                  f"{last.accepted_tokens:>5}")


if __name__ == "__main__":
    main()
