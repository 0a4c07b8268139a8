"""`tinyinfer bench`: decode speed against the memory roofline measured on this GPU (bench/results/README.md), and the
batched prefill: ms and tok/s per prompt length, with the cuBLASLt tactic table (default vs tuned algorithm).

Bytes per token (batch 1) = every weight matrix as stored (fp16, rows padded to 16 bytes) + norm weights + the
embedding row + the KV cache read at the current context. Ceiling = this GPU's streaming-read bandwidth
(cuda/bandwidth.cu, measured in the same run) / bytes per token.
"""

from __future__ import annotations

import json
import time
from typing import Optional

from . import _core
from .errors import DeviceError, InvalidRequestError

# Real shapes; random weights (speed does not depend on the values).
SHAPES = {
    "smollm2-135m": dict(hidden=576, intermediate=1536, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                         vocab=49152, tie=True),
    "smollm2-360m": dict(hidden=960, intermediate=2560, n_layers=32, n_heads=15, n_kv_heads=5, head_dim=64,
                         vocab=49152, tie=True),
    "tinyllama-1.1b": dict(hidden=2048, intermediate=5632, n_layers=22, n_heads=32, n_kv_heads=4, head_dim=64,
                           vocab=32000, tie=False),
    "llama2-7b": dict(hidden=4096, intermediate=11008, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                      vocab=32000, tie=False),
}


def shape_config(name: str, positions: int = 0) -> _core.ModelConfig:
    """A named shape's config; `positions`: the most a run will hold, its max_position_embeddings if past 8,192
    (random weights: the shapes hold no RoPE limit of their own)."""
    if name not in SHAPES:
        raise InvalidRequestError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    s = SHAPES[name]
    c = _core.ModelConfig()
    c.hidden, c.intermediate, c.n_layers = s["hidden"], s["intermediate"], s["n_layers"]
    c.n_heads, c.n_kv_heads, c.head_dim, c.vocab = s["n_heads"], s["n_kv_heads"], s["head_dim"], s["vocab"]
    c.tie_word_embeddings = s["tie"]
    c.max_position_embeddings = max(8192, positions)
    c.rms_eps = 1e-5
    c.validate()
    return c


def write_json(res: dict, path: str) -> None:
    """The results as JSON; the bindings' enums (e.g. the GEMV table's MatrixRole) by name."""

    def by_name(o):
        if hasattr(o, "name"):
            return o.name
        raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")

    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=by_name)


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def matrix_bytes(fmt: str, rows: int, K: int) -> int:
    """Bytes of one (rows, K) matrix as the GPU stores it, scales included (cpp/core/quant.h)."""
    if fmt == "int8":  # blocks of 32 (the last one padded), an fp16 scale each
        return rows * ((K + 31) // 32) * (32 + 2)
    if fmt == "int4":
        return rows * K // 2 + 4 * rows * (K // 32)
    return 2 * rows * _pad8(K)


def bytes_per_token(c: _core.ModelConfig, context: int, fmt: str = "fp16") -> dict:
    ld_h = _pad8(c.hidden)
    per_layer = (matrix_bytes(fmt, c.q_dim + 2 * c.kv_dim, c.hidden) + matrix_bytes(fmt, c.hidden, c.q_dim)
                 + matrix_bytes(fmt, 2 * c.intermediate, c.hidden) + matrix_bytes(fmt, c.hidden, c.intermediate)
                 + 2 * 4 * c.hidden)
    head = matrix_bytes("int8" if fmt == "int4" else fmt, c.vocab, c.hidden)  # int4 models keep an int8 head
    weights = c.n_layers * per_layer + head + 4 * c.hidden + 2 * ld_h  # head, final norm, 1 embedding row
    kv = c.n_layers * 2 * c.kv_dim * 2 * context
    return {"weights": weights, "kv": kv, "total": weights + kv}


def prefill_flops(c: _core.ModelConfig, n: int) -> float:
    """FLOPs of prefilling n tokens at position 0: 2 per weight per token (the LM head on the last token only)
    plus causal attention (QK^T and PV over n(n+1)/2 pairs per head)."""
    per_token = 2 * c.n_layers * ((c.q_dim + 2 * c.kv_dim) * c.hidden + c.hidden * c.q_dim
                                  + 3 * c.intermediate * c.hidden)
    attn = c.n_layers * c.n_heads * 4 * c.head_dim * n * (n + 1) / 2
    return per_token * n + attn + 2 * c.vocab * c.hidden


def run_prefill(core, cfg: _core.ModelConfig, lengths=(16, 256, 512, 2048), reps: int = 10, out=print) -> dict:
    """Prefill ms and tok/s per prompt length, then the GEMM tactic table (cuBLASLt default vs tuned)."""
    res = {"prefill": [], "gemm": []}
    if not core.batched_prefill:
        out("\nprefill: this model runs prompts token by token (head_dim not a multiple of 16 in 16..256)")
        return res
    out(f"\n{'prompt':>8} {'ms':>9} {'tok/s':>9} {'TFLOP/s':>8}")
    for n in lengths:
        ms = core.time_prefill(n, reps)
        row = {"tokens": n, "ms": ms, "tok_s": n / (ms * 1e-3), "tflop_s": prefill_flops(cfg, n) / (ms * 1e-3) / 1e12}
        res["prefill"].append(row)
        out(f"{n:>8} {ms:>9.3f} {row['tok_s']:>9.0f} {row['tflop_s']:>8.1f}")
    out(f"\n{'GEMM':>8} {'M x N x K':>20} {'out':>7} {'default µs':>11} {'tuned µs':>9} {'speed-up':>9} "
        f"{'pick':>5}  algorithm (candidates timed)")
    for g in core.gemm_table():
        row = dict(g, speedup=g["default_us"] / g["tuned_us"] if g["tuned_us"] else 1.0)
        res["gemm"].append(row)
        shape = f"{g['M']}x{g['N']}x{g['K']}"
        out(f"{g['name']:>8} {shape:>20} {g['out']:>7} {g['default_us']:>11.1f} {g['tuned_us']:>9.1f} "
            f"{row['speedup']:>8.2f}x {g['chosen']:>5}  {g['algo']} ({g['offered']} offered + "
            f"{g['candidates'] - g['offered']} split-K{'; from the tactics file' if g['from_file'] else ''})")
    return res


def run(shape: Optional[str] = None, model: Optional[str] = None, contexts=(16, 1024, 4096), steps: int = 256,
        json_path: Optional[str] = None, out=print, prefill=(16, 256, 512, 2048), dtype: str = "fp16",
        persistent: bool = True, opts_spec: str = "") -> dict:
    """persistent: also build the persistent decode step (CudaOptions.decode_path = Auto) and time both passes
    (the decode table's `tok/s` stays the graph path's; `persistent` beside it, '-' where it cannot run).
    opts_spec: CudaOptions fields as name=value,... (bench_batch.apply_options), e.g. persistent_ring=0."""
    from .bench_batch import apply_options
    from .engine import cuda_status

    usable, reason = cuda_status()
    if not usable:
        raise DeviceError(f"tinyinfer bench needs a usable GPU (--device cpu times the CPU reference engine): {reason}")
    bw = _core.ops.read_bandwidth(1 << 31, 20)
    gbs = bw["gb_per_s"]
    max_ctx = max(contexts)
    max_seq = max(max_ctx + steps + 16, max(prefill, default=0))
    t0 = time.perf_counter()
    if model is not None:
        from .engine import Engine

        opts = _core.CudaOptions()
        opts.decode_path = _core.DecodePath.Auto if persistent else _core.DecodePath.Graph
        apply_options(opts, opts_spec)
        eng = Engine(model, device="cuda", max_seq_len=max_seq, dtype=dtype, cuda_options=opts)
        core, cfg, name = eng._core, eng.config, str(model)
    else:
        cfg = shape_config(shape or "tinyllama-1.1b", max_seq)
        opts = _core.CudaOptions()
        opts.weights = dtype
        opts.decode_path = _core.DecodePath.Auto if persistent else _core.DecodePath.Graph
        apply_options(opts, opts_spec)
        core = _core.CudaEngine.random(cfg, max_seq, 1, opts)
        name = shape or "tinyllama-1.1b"
    load_s = time.perf_counter() - t0
    res = {"model": name, "dtype": dtype, "device": core.device_name, "read_bandwidth_gb_s": gbs,
           "read_sm_mhz": bw["sm_mhz"], "load_s": load_s,
           "pdl": core.uses_pdl, "graphs": core.uses_graphs, "weight_bytes_on_device": core.weight_bytes,
           "scratch_bytes": core.scratch_bytes, "kv_cache_bytes": core.kv_cache_bytes, "decode": [], "gemv": [],
           "attention": [], "tune_s": core.tune_seconds, "tune_parts": core.tune_parts,
           "plan_from_cache": core.plan_from_cache}
    out(f"tinyinfer bench: {name} ({dtype} weights, {core.weight_bytes / 1e6:,.0f} MB) on {core.device_name} | read bandwidth {gbs:,.0f} GB/s (cuda/bandwidth.cu; SM clock {bw['sm_mhz']:,.0f} MHz) | "
        f"PDL {'on' if core.uses_pdl else 'off'}, graphs {'on' if core.uses_graphs else 'off'} | "
        f"scratch {core.scratch_bytes / 2**20:.1f} MiB | load {load_s:.2f} s, tuning {core.tune_seconds:.2f} s"
        f"{' (a saved plan)' if core.plan_from_cache else ''}")
    has_p = core.decode_path == _core.DecodePath.Persistent
    res["persistent"] = {"built": has_p, "problem": core.persistent_problem, "grid": list(core.persistent_grid)}
    if persistent and not has_p:
        out(f"persistent decode step: not built ({core.persistent_problem})")
    out(f"\n{'context':>8} {'tok/s':>9} {'ms/token':>9} {'MB/token':>9} {'roofline tok/s':>15} {'% roofline':>11}"
        f" {'persistent tok/s':>17}")
    for ctx in contexts:
        ms = core.time_decode_step(ctx, steps, _core.DecodePath.Graph)
        ms_p = None
        if has_p:
            try:
                ms_p = core.time_decode_step(ctx, steps, _core.DecodePath.Persistent)
            except DeviceError as e:  # a timed-out wait (the engine recovers): reported, the graph numbers kept
                res["persistent"]["problem"] = str(e)
                out(f"persistent decode step at context {ctx}: {e}")
        b = bytes_per_token(cfg, ctx, dtype)["total"]
        roof = gbs * 1e9 / b
        row = {"context": ctx, "tok_s": 1e3 / ms, "ms_per_token": ms, "bytes_per_token": b, "roofline_tok_s": roof,
               "pct_roofline": 100 * (1e3 / ms) / roof, "effective_gb_s": b / (ms * 1e-3) / 1e9}
        row["persistent_tok_s"] = 1e3 / ms_p if ms_p else None
        res["decode"].append(row)
        p_col = f"{row['persistent_tok_s']:>17.0f}" if ms_p else f"{'-':>17}"
        out(f"{ctx:>8} {row['tok_s']:>9.0f} {ms:>9.3f} {b / 1e6:>9.1f} {roof:>15.0f} {row['pct_roofline']:>10.1f}% {p_col}")
    out(f"\n{'matrix':>8} {'rows x K':>13} {'copies':>6} {'R':>2} {'grid':>4} {'best µs per R (1/2/4/8=split-K/16=mma)':>38} "
        f"{'GB/s':>7} {'% peak':>7}")
    for g in core.gemv_table():
        best = {}
        for R, u in zip(g["tried_R"], g["us"]):
            best[R] = min(u, best.get(R, u))
        us = "/".join(f"{u:.1f}" for u in best.values())
        row = dict(g, pct_peak=100 * g["gb_per_s"] / gbs)
        res["gemv"].append(row)
        grid = (f"{g['blocks_per_sm']}/SM" if g["blocks_per_sm"] else "tile") + (" a8" if g["act8"] else "")
        out(f"{g['name']:>8} {g['rows']:>6}x{g['K']:<6} {g['copies']:>6} {g['R']:>2} {grid:>4} {us:>32} "
            f"{g['gb_per_s']:>7.0f} {row['pct_peak']:>6.1f}%")
    frm, long_r, long_bps = core.decode_long
    res["decode_long"] = {"from_context": frm, "qkv_R": long_r, "qkv_blocks_per_sm": long_bps}
    out("long-context decode graph: " + (f"from context {frm}, qkv R {long_r} at {long_bps}/SM" if frm >= 0
                                          else "none (one graph for every context)"))
    res["smem_carveout"] = core.smem_carveout
    out("decode kernels' shared-memory carveout: " + (f"{core.smem_carveout}% each" if core.smem_carveout >= 0
                                                      else "the driver's choice per kernel"))
    res["early_trigger"] = int(core.early_trigger)
    out("decode kernels that trigger their successor at their start: "
        + ("none", "the GEMVs but qkv", "the GEMVs but qkv, and the attention")[core.early_trigger])
    chain = {"pdl": _core.ops.kernel_chain_us(200, 132, True, False),
             "no_pdl": _core.ops.kernel_chain_us(200, 132, False, False)}
    res["kernel_chain_us"] = chain
    out(f"\nkernel boundary (graph-replayed chain of 200 near-empty dependent kernels, 132 blocks): "
        f"{chain['pdl']:.2f} µs with PDL, {chain['no_pdl']:.2f} µs without")
    out(f"\n{'context':>8} {'attention µs/layer':>19}")
    for ctx in sorted(set(contexts) | {256}):
        us = core.time_attention(ctx, 20)
        res["attention"].append({"context": ctx, "us_per_layer": us})
        out(f"{ctx:>8} {us:>19.2f}")
    if prefill:
        res.update(run_prefill(core, cfg, prefill, out=out))
    if json_path:
        write_json(res, json_path)
    return res


def verify(model: str, steps: int = 32, prompt: str = "The quick brown fox", out=print) -> dict:
    """GPU engine vs CPU engine on one prompt: worst relative logit error and argmax mismatches over `steps`
    teacher-forced greedy steps (the CPU engine's tokens)."""
    import numpy as np

    from .engine import Engine

    cpu = Engine(model, device="cpu")
    gpu = Engine(model, device="cuda")
    ids = cpu.tokenize(prompt) if cpu.tokenizer is not None else [1, 2, 3, 4]
    toks = cpu.generate(ids, max_tokens=steps, ignore_eos=True).token_ids
    seq = ids + toks[:-1]
    c, g = cpu.logits(seq), gpu.logits(seq)
    rel = np.abs(c - g).max(-1) / np.abs(c).max(-1)
    mism = int((c.argmax(-1) != g.argmax(-1)).sum())
    res = {"positions": len(seq), "worst_rel_logit_error": float(rel.max()), "mean_rel_logit_error": float(rel.mean()),
           "argmax_mismatches": mism}
    out(f"verify {model}: {len(seq)} positions | worst relative logit error {rel.max():.2e} "
        f"(mean {rel.mean():.2e}) | argmax mismatches {mism}")
    return res


# ---- the CPU reference engine ----

def random_cpu_engine(cfg: _core.ModelConfig, max_seq: int, seed: int = 0, threads: int = 0, max_batch: int = 64):
    """A CPU engine with random weights at `cfg`'s shape (speed does not depend on the values); max_batch
    sequence slots."""
    import numpy as np

    rng = np.random.default_rng(seed)
    store = _core.WeightStore(cfg)
    for name in store.required_names():
        shape = store.expected_shape(name)
        if name.endswith("norm.weight"):
            w = np.ones(shape, np.float16)
        else:  # fp16, as an fp16 checkpoint is held (widened to fp32 row by row in the products)
            w = (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)
        store.add(name, w, "fp16")
    store.finish()
    try:
        return _core.CpuEngine(store, max_seq, threads, max_batch)
    except MemoryError as e:  # (std::bad_alloc: its tables are sized by max_seq)
        raise DeviceError(f"out of host memory for a CPU engine of {max_seq} positions (the longest context + "
                          f"steps + 1, or the longest prompt): {str(e) or 'bad_alloc'}") from None


def run_cpu(shape: Optional[str] = None, model: Optional[str] = None, contexts=(16, 256), steps: int = 32,
            prefill=(16, 128), json_path: Optional[str] = None, dtype: str = "fp32", out=print,
            threads: Optional[int] = None) -> dict:
    """Decode tok/s at each context and prefill tok/s per prompt length on the CPU reference engine (wall
    time, fp32 math; this engine is the correctness oracle, not a fast path)."""
    import numpy as np

    from .engine import check_threads

    threads = check_threads(threads)
    max_seq = max(max(contexts) + steps + 1, max(prefill, default=0))
    t0 = time.perf_counter()
    if model is not None:
        from .engine import Engine

        eng = Engine(model, device="cpu", dtype=dtype, max_seq_len=max_seq, threads=threads)
        core, cfg, name = eng._core, eng.config, str(model)
    else:
        if dtype != "fp32":
            raise InvalidRequestError(f"--device cpu with --shape runs fp32 random weights (got --dtype {dtype}); "
                                      f"pass --model to time a quantized model")
        name = shape or "smollm2-135m"
        cfg = shape_config(name, max_seq)
        core = random_cpu_engine(cfg, max_seq, threads=threads)
    res = {"model": name, "device": "cpu", "dtype": dtype, "threads": threads, "load_s": time.perf_counter() - t0,
           "decode": [], "prefill": []}
    # (a model's weights are held as its file stores them, dtype fp32 meaning no quantization at load)
    held = "as stored" if model is not None and dtype == "fp32" else dtype
    res["weight_bytes"] = int(core.weight_bytes)
    out(f"tinyinfer bench: {name} on the CPU reference engine (weights {held}: {core.weight_bytes / 1e6:.0f} MB; "
        f"fp32 math; {threads} thread{'s' if threads != 1 else ''}; wall time)")
    rng = np.random.default_rng(0)
    greedy = _core.SamplingConfig()
    out(f"\n{'context':>8} {'tok/s':>9} {'ms/token':>9}")
    for ctx in contexts:
        core.reset()
        core.forward(rng.integers(0, cfg.vocab, ctx).tolist(), all_logits=False)
        t = time.perf_counter()
        n = len(core.decode(steps, greedy, [], 0))
        ms = (time.perf_counter() - t) * 1e3 / n
        res["decode"].append({"context": ctx, "tok_s": 1e3 / ms, "ms_per_token": ms, "steps": n})
        out(f"{ctx:>8} {1e3 / ms:>9.1f} {ms:>9.2f}")
    if prefill:
        out(f"\n{'prompt':>8} {'ms':>9} {'tok/s':>9}")
    for n in prefill:
        core.reset()
        ids = rng.integers(0, cfg.vocab, n).tolist()
        t = time.perf_counter()
        core.forward(ids, all_logits=False)
        ms = (time.perf_counter() - t) * 1e3
        res["prefill"].append({"tokens": n, "ms": ms, "tok_s": n / (ms * 1e-3)})
        out(f"{n:>8} {ms:>9.1f} {n / (ms * 1e-3):>9.1f}")
    if json_path:
        write_json(res, json_path)
    return res
