"""What speculative decoding's checking pass costs against a plain decode step (docs/perf/speculative.md's time model):
the wall time of decode(1) (one step: the pending token's pass and a draw) and of decode_draft(k) (the pending
token and k drafted tokens in one pass, every row's logits to the host) for k in KS, at a context, interleaved in
rounds. Greedy, the drafts rejected at their first token: the pass and the copy cost the same whatever is kept;
the host's draws (one greedy draw a kept token more, ~20 us at 49,152 tokens) are left out.

  python bench/tools/draft_cost.py tinyllama-1.1b fp16 [CONTEXT] [--opts=draft_pass=1] [--json=FILE]   # the GPU
  python bench/tools/draft_cost.py smollm2-135m fp16 --cpu     # the CPU reference engine (fp16 weights, fp32 math)
Random weights at the shape (speed does not depend on the values).
"""

import json
import statistics
import sys
import time

from common import engine_from_argv

from tinyinfer import _core
from tinyinfer.bench import random_cpu_engine, shape_config

KS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def main() -> None:
    cpu = "--cpu" in sys.argv
    if cpu:
        args = [a for a in sys.argv[1:] if not a.startswith("--")]
        shape, dtype, ctx = (args + ["smollm2-135m"])[0], "fp16", int(args[2]) if len(args) > 2 else 16
        eng = random_cpu_engine(shape_config(shape), ctx + 512)
    else:
        eng, shape, dtype, ctx, _ = engine_from_argv()
    s = _core.SamplingConfig()
    rounds = 3 if cpu else 20
    times: dict[int, list[float]] = {k: [] for k in (0,) + KS}
    for _ in range(rounds):
        for k in (0,) + KS:  # 0: a plain step
            eng.reset()
            eng.forward([1 + i % 100 for i in range(ctx)])
            eng.decode(1, s, [], 0)  # a pending token: every timed call runs it
            t = time.perf_counter()
            if k == 0:
                eng.decode(1, s, [], 1)
            else:
                first = eng.decode_draft([7] * k, s, [], 1)
                assert len(first) >= 1
            times[k].append(time.perf_counter() - t)
    step = statistics.median(times[0])
    res = {"shape": shape, "dtype": dtype, "context": ctx, "device": "cpu" if cpu else "cuda",
           "step_ms": step * 1e3, "passes": {}}
    print(f"{shape} {dtype} ctx {ctx} ({res['device']}): a plain step {step * 1e3:.3f} ms (median of {rounds})")
    for k in KS:
        m = statistics.median(times[k])
        res["passes"][k] = {"rows": k + 1, "ms": m * 1e3, "ratio": m / step}
        print(f"  draft {k:2d} ({k + 1:2d} rows): {m * 1e3:8.3f} ms = {m / step:5.2f} steps")
    out = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--json=")), None)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
