"""One launch of each decode kernel of interest, at real shapes, for Nsight Compute to look at in isolation:
    ncu --clock-control none -k regex:"gemv|decode_attn_kernel" --section SpeedOfLight --section WarpStateStats \
        python3 bench/tools/ncu_kernels.py [--tinyllama-fp16]
(each GEMV runs once on a freshly quantized matrix: DRAM-cold, as in a decode step). `--tinyllama-fp16`: that
step's four GEMVs as its plan picks them (bench/results/h200-tinyllama-1.1b-fp16.json) and, beside them, the
streaming-read kernel (cuda/bandwidth.cu) over the same bytes on the same grid, so the GEMV's shortfall against a
plain stream shows kernel by kernel (add `-k regex:"gemv|stream_read"`)."""

import sys

import numpy as np

from tinyinfer import _core

ops = _core.ops
rng = np.random.default_rng(0)


def gemv(fmt, rows, K, R, grid, inp=ops.GemvIn.F32Norm, out=ops.GemvOut.Swiglu):
    W = (rng.standard_normal((rows, K)) * 0.02).astype(np.float32)
    x = rng.standard_normal(K).astype(np.float32)
    nw = np.ones(K, np.float32)
    y0 = np.zeros(rows, np.float32)
    if fmt == "fp16":
        ops.gemv(W.astype(np.float16).view(np.uint16), x, nw, 1e-5, y0, R, inp, out, grid)
    else:
        ops.gemv_quant(W, fmt, x, nw, 1e-5, y0, R, inp, out, grid)
    print(f"gemv {fmt} {rows}x{K} R={R} grid={grid} {inp.name}/{out.name}")


if "--tinyllama-fp16" in sys.argv[1:]:
    sms = ops.sm_count()
    for rows, K, R, inp, out in [(2560, 2048, 2, ops.GemvIn.F32Norm, ops.GemvOut.F32),
                                 (2048, 2048, 8, ops.GemvIn.F16, ops.GemvOut.AddF32),
                                 (11264, 2048, 2, ops.GemvIn.F32Norm, ops.GemvOut.Swiglu),
                                 (11264, 2048, 8, ops.GemvIn.F32Norm, ops.GemvOut.Swiglu),
                                 (2048, 5632, 1, ops.GemvIn.F16, ops.GemvOut.AddF32)]:
        gemv("fp16", rows, K, R, 2, inp, out)
        data = rng.integers(0, 256, rows * K * 2, dtype=np.uint8)
        for blocks in (2 * sms, 8 * sms):
            ops.stream_read_xor(data, blocks)
            print(f"stream_read {rows * K * 2 / 1e6:.1f} MB blocks={blocks}")
    sys.exit(0)

gemv("int4", 11264, 2048, 2, 2)   # TinyLlama gate_up, as tuned
gemv("int8", 11264, 2048, 2, 2)
gemv("fp16", 11264, 2048, 8, 2)
gemv("int4", 2048, 2048, 2, 1, ops.GemvIn.F16, ops.GemvOut.AddF32)  # TinyLlama o
gemv("int4", 22016, 4096, 2, 2)   # Llama-2-7B gate_up
n_kv, group, hd, max_seq, pos = 4, 8, 64, 256, 16
qkv = rng.standard_normal((n_kv * group + 2 * n_kv) * hd).astype(np.float32)
kp = rng.standard_normal((max_seq // 64, n_kv, 64, hd)).astype(np.float16).view(np.uint16).copy()  # pages of 64
vp = kp.copy()
table = np.arange(max_seq // 64, dtype=np.int32)
ang = np.arange(max_seq)[:, None] * (1.0 / 10000 ** (np.arange(0, hd, 2) / hd))[None, :]
ops.decode_attention(qkv, kp, vp, table, np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32), pos,
                     n_kv * group, 64)
print("decode attention TinyLlama pos 16")
