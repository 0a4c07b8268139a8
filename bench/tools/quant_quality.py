"""Quality of the weight formats on a real model, on the CPU reference engine (which computes with exactly
the dequantized numbers the GPU uses): perplexity on tests/data/eval.txt, top-1 agreement with the fp32
engine at every position, and how many greedy tokens stay identical. Also int4 variants that were candidates
for the format (group size 64 / 128, symmetric groups) and the per-channel int8 the Q8_0 blocks replaced,
simulated by dequantizing in numpy. The formats with int8 inputs (act8, docs/perf/decode-options.md) on the CPU
engine's twin of the GPU's rounding: int8 with act8 = 2, int4 with act8 = -1 (the int8 head on fp16 inputs), -2
(and down on fp16 inputs) and 2.
With --cuda, also the GPU engine's int8 and int4 decode with fp16 and with int8 inputs (CudaOptions.act8 = 0 / 2),
every position fed through the decode graph (batched_prefill off).
    python bench/tools/quant_quality.py [model.gguf] [--tokens N] [--cuda] > bench/results/quant-quality-smollm2-135m.txt"""

from __future__ import annotations

import sys
import time

import numpy as np

from tinyinfer import Engine, _core
from tinyinfer.loaders import load_model
from tinyinfer.perplexity import perplexity_from_logits as perplexity

MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def f16(a):
    return a.astype(np.float16).astype(np.float32)


def int4_variant(w: np.ndarray, group: int, symmetric: bool) -> np.ndarray:
    """Dequantized int4 with another group size / symmetry (the candidates the format was chosen among)."""
    rows, K = w.shape
    if K % group:
        raise ValueError(f"width {K} is not a multiple of {group}")
    g = f16(w).reshape(rows, K // group, group)
    if symmetric:  # q in -8..7, s = max|w| / 7 (fp16)
        s = f16(np.abs(g).max(-1, keepdims=True) / 7)
        q = np.clip(np.rint(np.divide(g, s, out=np.zeros_like(g), where=s > 0)), -8, 7)
        return (q * s).reshape(rows, K)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    s, m = f16((hi - lo) / 15), f16(lo)
    q = np.clip(np.rint(np.divide(g - m, s, out=np.zeros_like(g), where=s > 0)), 0, 15)
    return (s * q + m).reshape(rows, K)


def int8_per_channel(w: np.ndarray) -> np.ndarray:
    """The int8 format before Q8_0's blocks: one fp32 scale per row, s = max|w| / 127, q = rint(w / s)."""
    g = f16(w)
    amax = np.abs(g).max(1, keepdims=True)
    s = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    return (np.clip(np.rint(g / s), -127, 127).astype(np.float32) * s).astype(np.float32)


def _dq(fmt):
    return lambda w: _core.ops.dequantize_ref(np.ascontiguousarray(w, np.float32), fmt)


def engine_with(model, transform, max_seq):
    """A CPU engine over the model with `transform` applied to every matrix. A tied head becomes its own
    (transformed) lm_head and the embedding lookup stays as it was: what Engine(dtype=...) does too."""
    from tinyinfer.loaders.gguf_config import clone_config

    cfg = model.config
    tied = cfg.tie_word_embeddings
    store = _core.WeightStore(clone_config(cfg, tie_word_embeddings=False) if tied else cfg)
    head_transform = transform
    if transform == "int4+int8head":  # the body int4, the LM head int8 (as llama.cpp keeps its output at 6-8 bits)
        transform, head_transform = _dq("int4"), _dq("int8")
    for name, arr, src in model.tensors():
        arr = np.ascontiguousarray(arr, np.float32)
        if tied and name == "model.embed_tokens.weight":
            store.add("lm_head.weight", np.ascontiguousarray(head_transform(arr)), "fp32")
        elif name == "lm_head.weight":
            arr = head_transform(arr)
        elif arr.ndim == 2 and any(m in name for m in MATRICES):
            arr = transform(arr)
        if name != "lm_head.weight" or not tied:
            store.add(name, np.ascontiguousarray(arr), "fp32")
    store.finish()
    return _core.CpuEngine(store, max_seq)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(sys.argv[sys.argv.index("--tokens") + 1]) if "--tokens" in sys.argv else 2048
    if args and args[0].isdigit():
        args = args[1:]
    path = args[0] if args else None
    if path is None:
        from tinyinfer.models import default_model_path

        path = str(default_model_path())
    ref_engine = Engine(path, device="cpu", max_seq_len=n + 64)
    ids = ref_engine.tokenize(open("tests/data/eval.txt").read())[:n]
    prompt = ref_engine.tokenize("The history of computing begins")
    ref = ref_engine.logits(ids)
    ref_greedy = ref_engine.generate(prompt, max_tokens=64, ignore_eos=True).token_ids
    print(f"model {path}: {len(ids)} eval tokens; fp32 perplexity {perplexity(ref, ids):.4f}")
    print(f"{'format':<26} {'bytes/weight':>12} {'perplexity':>10} {'vs fp32':>8} {'top-1 agree':>11} {'greedy same':>11}")
    rows = [("fp16 (fp32 engine, fp16 weights)", 2.0, lambda w: f16(w), None),
            ("int8 g32, Q8_0 (ours)", 1.0625, None, "int8"),
            ("int8 per-channel (before)", 1.0, int8_per_channel, None),
            ("int4 g32 asymmetric (ours)", 0.625, None, "int4"),
            ("int4 g64 asymmetric", 0.5625, lambda w: int4_variant(w, 64, False), None),
            ("int4 g32 symmetric", 0.5625, lambda w: int4_variant(w, 32, True), None),
            ("int4 g32 asym, int8 head", 0.625, "int4+int8head", None),
            ("int8, int8 in (act8 2)", 1.0625, None, "int8@2"),
            ("int4, int8 in (act8 -1)", 0.625, None, "int4@-1"),
            ("int4, int8 in (act8 -2)", 0.625, None, "int4@-2"),
            ("int4, int8 in (act8 2)", 0.625, None, "int4@2")]
    if "--cuda" in sys.argv:
        rows += [("int8, GPU decode, fp16 in", 1.0625, None, ("int8", False)),
                 ("int8, GPU decode, int8 in", 1.0625, None, ("int8", True)),
                 ("int4, GPU decode, fp16 in", 0.625, None, ("int4", False)),
                 ("int4, GPU decode, int8 in", 0.625, None, ("int4", True))]
    model = load_model(path)
    for name, bpw, transform, dtype in rows:
        t0 = time.time()
        if isinstance(dtype, tuple):  # the GPU engine's decode steps, with or without act8
            opts = _core.CudaOptions()
            opts.batched_prefill, opts.act8 = False, 2 if dtype[1] else 0
            eng = Engine(path, device="cuda", dtype=dtype[0], max_seq_len=n + 64, cuda_options=opts)
            lg = eng.logits(ids)
            greedy = eng.generate(prompt, max_tokens=64, ignore_eos=True).token_ids
        elif dtype:
            fmt, _, act8 = dtype.partition("@")  # "int4@-1": the CPU engine with act8 = -1
            eng = Engine(path, device="cpu", dtype=fmt, max_seq_len=n + 64, act8=int(act8 or 0))
            lg = eng.logits(ids)
            greedy = eng.generate(prompt, max_tokens=64, ignore_eos=True).token_ids
        else:
            core = engine_with(model, transform, n + 64)
            lg = core.forward(ids, all_logits=True)
            core.reset()
            greedy = _greedy(core, prompt)
        ppl = perplexity(lg, ids)
        agree = (lg.argmax(-1) == ref.argmax(-1)).mean()
        same = int(np.argmax(np.r_[np.array(greedy) != np.array(ref_greedy), True]))
        print(f"{name:<26} {bpw:>12.3f} {ppl:>10.4f} {100 * (ppl / perplexity(ref, ids) - 1):>7.2f}% "
              f"{100 * agree:>10.2f}% {same:>8}/64   ({time.time() - t0:.0f} s)", flush=True)


def _greedy(core, prompt):
    core.forward(prompt, all_logits=False)
    return list(core.decode(64, _core.SamplingConfig(), [], 0))


if __name__ == "__main__":
    main()
