"""What the decode tools share: CudaOptions from a command-line spec and an engine from the tools' common
command line. The tools run as scripts (`python bench/tools/NAME.py ...`); Python puts the script's directory,
bench/tools/, first on sys.path, so they import this module as `common`."""

import sys

from tinyinfer import _core
from tinyinfer.bench import shape_config


_ROLES = {"qkv": "Qkv", "o": "O", "gate_up": "GateUp", "down": "Down", "lm_head": "LmHead"}


def gemv_pins(text: str) -> list:
    """ "qkv:2/2;down:1/2" (role:rows_per_warp/blocks_per_sm;...) -> [_core.GemvPin, ...]."""
    pins = []
    for item in filter(None, text.split(";")):
        role, _, variant = item.partition(":")
        if role not in _ROLES or variant.count("/") != 1:
            raise SystemExit(f"gemv_pins: {item!r} is not role:R/blocks_per_sm with role in {', '.join(_ROLES)}")
        R, bps = variant.split("/")
        pins.append(_core.GemvPin(getattr(_core.MatrixRole, _ROLES[role]), int(R), int(bps)))
    return pins


def options(spec: str, dtype: str) -> "_core.CudaOptions":
    o = _core.CudaOptions()
    o.weights = dtype
    for kv in filter(None, spec.split(",")):
        k, v = kv.split("=", 1)
        if k == "gemv_pins":
            o.gemv_pins = gemv_pins(v)
            continue
        if k == "decode_path":  # graph | persistent | auto
            o.decode_path = getattr(_core.DecodePath, v.capitalize())
            continue
        cur = getattr(o, k)
        setattr(o, k, type(cur)(int(v)) if isinstance(cur, (bool, int)) else type(cur)(v))
    return o


def engine_from_argv(**extra) -> tuple:
    """The profiling tools' command line: SHAPE DTYPE [CONTEXT] [--opts=k=v,...] [--layers=N]; `extra` sets further
    options; --layers keeps the shape's matrices but not its depth (a smaller footprint for the same kernels).
    Returns (engine, shape, dtype, context, spec)."""
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    shape = args[0] if args else "tinyllama-1.1b"
    dtype = args[1] if len(args) > 1 else "fp16"
    ctx = int(args[2]) if len(args) > 2 else 16
    spec = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--opts=")), "")
    opts = options(spec, dtype)
    for k, v in extra.items():
        setattr(opts, k, v)
    cfg = shape_config(shape)
    layers = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--layers=")), 0)
    if layers:
        cfg.n_layers = layers
    eng = _core.CudaEngine.random(cfg, max(ctx + 64, 256), 1, opts)
    return eng, shape, dtype, ctx, spec
