"""`tinyinfer bench --batch 1,8,32,64`: batched decode throughput through the engine's sequence slots.

Per batch size B: B slots each prefill a prompt of `prompt` random tokens, then `gen` decode steps run for all
B together (greedy; each step launched inside the seq_sample_step that samples the step before, as the scheduler
launches ahead: the tokens come back to the host, no Python runs between).
Aggregate tok/s = B * gen / decode wall time; per-sequence tok/s = gen / decode wall time. Batch 1 is also timed
on the single-sequence path (the captured decode graph Engine.generate uses alone): the ratios divide by that,
the fastest batch-1 figure this engine has. KV pages in use are read while the B sequences are live: they must
equal what B sequences of prompt + gen positions hold (no per-sequence max_seq_len reservation). The same decode
is then run through the Scheduler (tinyinfer.scheduler: admission, per-request sampling configs, Deltas, all
in Python per step): its ms/step against the raw loop's is the scheduler's overhead. Last, the B prompts'
prefill: one seq_prefill each against one seq_prefill_many for all of them (time_prefill).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np

from . import _core


def _pages_for(positions: int, page_size: int) -> int:
    return (positions + page_size - 1) // page_size


def time_batch(core, batch: int, prompt: int, gen: int, vocab: int, seed: int = 0) -> dict:
    """One batch size: aggregate and per-sequence decode tok/s, prefill wall time, KV pages in use."""
    rng = np.random.default_rng(seed)
    greedy = _core.SamplingConfig()
    slots = [core.seq_open() for _ in range(batch)]
    try:
        t = time.perf_counter()
        for s in slots:
            core.seq_prefill(s, rng.integers(0, vocab, prompt).tolist())
        toks, *_ = core.seq_sample(slots, [greedy] * batch, [0] * batch, 0)
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        if gen > 1:
            core.seq_step(slots, [int(x) for x in toks])
        for step in range(1, gen):  # sample this step; launch the next one inside the same call (if there is one)
            toks, *_ = core.seq_sample_step(slots, [greedy] * batch, [step] * batch, 0, [step < gen - 1] * batch,
                                            [[]] * batch)
        decode_s = time.perf_counter() - t
        used = core.kv_pages_total - core.kv_pages_free
    finally:
        for s in slots:
            core.seq_close(s)
    steps = gen - 1  # the first token came from the prefill's logits
    return {"batch": batch, "prompt": prompt, "gen": gen, "decode_s": decode_s, "prefill_s": prefill_s,
            "ms_per_step": decode_s * 1e3 / steps, "tok_s": batch * steps / decode_s,
            "per_seq_tok_s": steps / decode_s, "kv_pages_used": used,
            "kv_pages_expected": batch * _pages_for(prompt + gen - 1, core.kv_page_size)}


def time_prefill(core, batch: int, prompt: int, vocab: int, seed: int = 0, reps: int = 3) -> dict:
    """Wall ms to prefill B prompts of `prompt` tokens into B fresh slots: one seq_prefill each (what the
    scheduler did before seq_prefill_many) against one seq_prefill_many for all (one pass over B * prompt
    tokens, each weight read once per pass). Both are timed until the GPU finished (both return once launched: a copy of
    the last slot's logits waits for them). Best of `reps` after one untimed round of each (GEMM tactics)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, prompt).tolist() for _ in range(batch)]

    def once(many: bool) -> float:
        slots = [core.seq_open() for _ in range(batch)]
        try:
            t = time.perf_counter()
            if many:
                core.seq_prefill_many(slots, prompts)
            else:
                for s, p in zip(slots, prompts):
                    core.seq_prefill(s, p)
            core.seq_logits(slots[-1])  # (both return once launched: a copy back waits for the passes)
            return time.perf_counter() - t
        finally:
            for s in slots:
                core.seq_close(s)

    once(False), once(True)
    one = min(once(False) for _ in range(reps))  # (interleaving buys nothing: both are timed to the end)
    many = min(once(True) for _ in range(reps))
    return {"prefill_each_ms": one * 1e3, "prefill_many_ms": many * 1e3, "prefill_x": one / many}


def time_scheduler(core, cfg, batch: int, prompt: int, gen: int, seed: int = 0) -> dict:
    """time_batch's decode through a Scheduler: every prompt in the first step (chunk_tokens = batch * prompt),
    then gen - 1 steps of all B together, each one seq_step + seq_sample plus the scheduler's Python."""
    from .engine import Engine
    from .sampling import SamplingParams
    from .scheduler import Scheduler

    rng = np.random.default_rng(seed)
    sched = Scheduler(Engine.from_core(core, cfg, max_seq_len=core.max_seq_len, name="bench"), max_batch=batch,
                      chunk_tokens=batch * prompt)
    sp = SamplingParams(max_tokens=gen, ignore_eos=True)
    for _ in range(batch):
        sched.submit(rng.integers(0, int(cfg.vocab), prompt).tolist(), sp)
    try:
        sched.step()  # admission, the prompts, the first tokens
        t = time.perf_counter()
        while sched.step():
            pass
        decode_s = time.perf_counter() - t
    finally:
        sched.close()
    steps = gen - 1
    return {"sched_tok_s": batch * steps / decode_s, "sched_ms_per_step": decode_s * 1e3 / steps}


def time_single(core, prompt: int, gen: int, vocab: int, seed: int = 0) -> float:
    """Decode tok/s of one sequence on the single-sequence path (CUDA: the captured decode graph), wall time."""
    rng = np.random.default_rng(seed)
    core.reset()
    core.forward(rng.integers(0, vocab, prompt).tolist(), all_logits=False)
    t = time.perf_counter()
    n = len(core.decode(gen, _core.SamplingConfig(), [], 0))
    s = time.perf_counter() - t
    core.reset()
    return n / s


def run_batches(core, cfg, batches: Sequence[int], prompt: int = 128, gen: int = 128,
                out: Callable[[str], None] = print) -> dict:
    """The batch table on an engine that has sequence slots (both engines do)."""
    batches = sorted(set(batches))
    if max(batches) > core.max_batch:
        from .errors import InvalidRequestError

        raise InvalidRequestError(f"--batch {max(batches)} exceeds the engine's max_batch={core.max_batch}")
    time_batch(core, min(batches), 8, 4, cfg.vocab)  # warm-up: first graphs, GEMM tactics of the smallest bucket
    single = time_single(core, prompt, gen, cfg.vocab)
    res = {"prompt": prompt, "gen": gen, "single_tok_s": single, "batches": []}
    out(f"\nbatched decode: prompt {prompt} + {gen} generated per sequence, greedy; batch 1 on the "
        f"single-sequence path: {single:,.0f} tok/s")
    out(f"{'batch':>6} {'tok/s':>9} {'per seq':>9} {'ms/step':>8} {'x batch 1':>10} {'KV pages':>9} "
        f"{'expected':>9} {'sched tok/s':>12} {'sched ms/step':>14} {'prefill each ms':>16} {'all at once ms':>15}")
    for b in batches:
        time_batch(core, b, prompt, 4, cfg.vocab, seed=b)  # this bucket's graph and tactics before timing
        row = time_batch(core, b, prompt, gen, cfg.vocab, seed=b)
        row["x_single"] = row["tok_s"] / single
        row.update(time_scheduler(core, cfg, b, prompt, gen, seed=b))
        row.update(time_prefill(core, b, prompt, cfg.vocab, seed=b))
        res["batches"].append(row)
        out(f"{b:>6} {row['tok_s']:>9,.0f} {row['per_seq_tok_s']:>9,.0f} {row['ms_per_step']:>8.3f} "
            f"{row['x_single']:>9.2f}x {row['kv_pages_used']:>9} {row['kv_pages_expected']:>9} "
            f"{row['sched_tok_s']:>12,.0f} {row['sched_ms_per_step']:>14.3f} {row['prefill_each_ms']:>16.2f} "
            f"{row['prefill_many_ms']:>15.2f}")
    return res


def apply_options(opts, spec: str):
    """`--opts name=value,...` (A/B runs, e.g. batch_gemv_f16_max=8,batch_gemv_quant_max=64) onto an options
    object: each name must be one of its fields, each value is parsed as that field's current type (bool: 0/1)."""
    from .errors import InvalidRequestError

    for item in filter(None, spec.split(",")):
        name, eq, text = item.partition("=")
        if not eq or not hasattr(opts, name) or name.startswith("_"):
            raise InvalidRequestError(f"--opts: {item!r} is not name=value with a CudaOptions field name")
        cur = getattr(opts, name)
        if not isinstance(cur, (bool, int, float, str)):
            raise InvalidRequestError(f"--opts: {name} (a {type(cur).__name__}) cannot be set from the command line")
        try:
            if isinstance(cur, bool):
                if text not in ("0", "1"):
                    raise ValueError(text)
                value = text == "1"
            else:
                value = type(cur)(text)
        except ValueError:
            raise InvalidRequestError(f"--opts: {name}={text!r} is not a {type(cur).__name__}") from None
        setattr(opts, name, value)
    return opts


def open_engine(device: str, shape: Optional[str], model: Optional[str], dtype: str, max_seq: int,
                max_batch: int, threads: Optional[int] = None, opts_spec: str = ""):
    """(core, config, name) for the batch bench: random weights at `shape` or a real `model`; opts_spec: CudaOptions
    fields (apply_options), applied last (CUDA only)."""
    from .bench import random_cpu_engine, shape_config

    if opts_spec and device != "cuda":
        from .errors import InvalidRequestError

        raise InvalidRequestError("--opts sets CudaOptions: it needs --device cuda")
    if model is not None:
        from .engine import Engine

        opts = None
        if device == "cuda":
            opts = _core.CudaOptions()
            opts.max_batch = max_batch
            apply_options(opts, opts_spec)
        eng = Engine(model, device=device, dtype=dtype, max_seq_len=max_seq, cuda_options=opts, threads=threads)
        return eng._core, eng.config, str(model)
    name = shape or ("tinyllama-1.1b" if device == "cuda" else "smollm2-135m")
    cfg = shape_config(name, max_seq)
    if device == "cuda":
        opts = _core.CudaOptions()
        opts.weights = dtype
        opts.max_batch = max_batch
        apply_options(opts, opts_spec)
        return _core.CudaEngine.random(cfg, max_seq, 1, opts), cfg, name
    return random_cpu_engine(cfg, max_seq, threads=threads or 0, max_batch=max_batch), cfg, name


def run(device: str, batches: Sequence[int], shape: Optional[str] = None, model: Optional[str] = None,
        dtype: str = "fp16", prompt: int = 128, gen: int = 128, json_path: Optional[str] = None,
        threads: Optional[int] = None, opts_spec: str = "", out: Callable[[str], None] = print) -> dict:
    """`tinyinfer bench --batch ...`: load, print the batch table, write JSON."""
    import json

    if device == "cuda":
        from .engine import cuda_status
        from .errors import DeviceError

        usable, reason = cuda_status()
        if not usable:
            raise DeviceError(f"tinyinfer bench needs a usable GPU (--device cpu times the CPU reference engine): "
                              f"{reason}")
    t0 = time.perf_counter()
    core, cfg, name = open_engine(device, shape, model, dtype, prompt + gen + 16, max(batches), threads,
                                 opts_spec)
    held = "as stored" if device == "cpu" and model is not None and dtype == "fp32" else dtype  # (run_cpu's)
    out(f"tinyinfer bench --batch: {name} ({held} weights{', ' + opts_spec if opts_spec else ''}) on "
        f"{core.device_name if device == 'cuda' else 'the CPU reference engine'} | load "
        f"{time.perf_counter() - t0:.2f} s | {core.kv_pages_total} KV pages of {core.kv_page_size} positions")
    res = {"model": name, "device": device, "dtype": dtype, "opts": opts_spec,
           **run_batches(core, cfg, batches, prompt, gen, out)}
    if device == "cuda":
        res["device_name"] = core.device_name
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    return res
