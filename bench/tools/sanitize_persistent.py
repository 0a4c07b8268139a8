"""The persistent decode step under compute-sanitizer (issue 16: memcheck, synccheck and racecheck clean):
    python3 bench/tools/sanitize_persistent.py prep          # no sanitizer: saves the GEMV plan and the graph
                                                             # path's tokens (sanitize_prep.json, here)
    compute-sanitizer --tool memcheck  python3 bench/tools/sanitize_persistent.py run noring
    compute-sanitizer --tool racecheck python3 bench/tools/sanitize_persistent.py run ring
A small random model (hidden 256, GQA 2, head_dim 64, intermediate 500: not a multiple of 8), a 77-token prompt (two
attention chunks: the last one merges) and `--steps` persistent steps (default 20), with the weight ring and the
staged keys / values off (noring) or on (ring); the tokens are compared with the graph path's. `run` takes the
saved plan, so the sanitizer sees the step rather than the GEMV tuner's timing loops (racecheck did not finish
within 100 s with them), and waits up to 10 minutes on a counter (the sanitizer slows every block)."""

import json
import sys
from pathlib import Path

from tinyinfer import _core

PREP = Path("sanitize_prep.json")
PROMPT = list(range(3, 80))


def config() -> "_core.ModelConfig":
    c = _core.ModelConfig()
    c.hidden, c.intermediate, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab = 256, 500, 2, 4, 2, 64, 500
    c.max_position_embeddings = 2048
    c.validate()
    return c


def options(mode: str, plan: str = "") -> "_core.CudaOptions":
    o = _core.CudaOptions()
    o.gemv_rows, o.gemv_grid, o.decode_long_from, o.gemm_autotune = 2, 2, 0, False  # one variant each: quick
    o.attn_tensor_cores = False  # the graph path in fp32, as the persistent step (tokens compared exactly)
    o.plan_text = plan
    if mode != "graph":
        o.decode_path = _core.DecodePath.Persistent
        o.persistent_ring = o.persistent_kv_stage = mode == "ring"
        o.persistent_timeout_ms = 600_000
    return o


def tokens(engine, steps: int) -> list:
    engine.forward(PROMPT, False)
    return list(engine.decode(steps, _core.SamplingConfig(), [], 0))


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    steps = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--steps=")), 20)
    run_ok = len(args) == 2 and args[0] == "run" and args[1] in ("ring", "noring")
    if not (run_ok or args == ["prep"]):
        raise SystemExit(__doc__)
    if args[0] == "prep":
        e = _core.CudaEngine.random(config(), 256, 1, options("graph"))
        PREP.write_text(json.dumps({"plan": e.plan_text, "steps": steps, "tokens": tokens(e, steps)}))
        print(f"saved {PREP}: the plan and {steps} graph-path tokens")
        return
    prep = json.loads(PREP.read_text())
    e = _core.CudaEngine.random(config(), 256, 1, options(args[1], prep["plan"]))
    got = tokens(e, prep["steps"])
    print(f"{args[1]}: plan from the saved one: {e.plan_from_cache}; tokens equal to the graph path's: "
          f"{got == prep['tokens']}")
    if got != prep["tokens"] or not e.plan_from_cache:
        sys.exit(1)


if __name__ == "__main__":
    main()
