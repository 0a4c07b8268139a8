"""Typed options and modes at the core's boundary: enums and checked structs, never strings that fall back.
These need no GPU (only a build with CUDA for the GPU-side types)."""

from __future__ import annotations

import numpy as np
import pytest

from tinyinfer import DeviceError, InvalidRequestError, UnsupportedModelError, _core

needs_cuda_build = pytest.mark.skipif(not _core.build_info["cuda"], reason="built without CUDA")


def test_weight_formats_are_an_enum_and_names_are_checked():
    W = np.ones((2, 32), np.float32)
    by_enum = _core.ops.dequantize_ref(W, _core.WFormat.int8)
    by_name = _core.ops.dequantize_ref(W, "int8")
    np.testing.assert_array_equal(by_enum, by_name)
    with pytest.raises(InvalidRequestError, match="unknown weight format 'int3'"):
        _core.ops.dequantize_ref(W, "int3")
    with pytest.raises(TypeError):
        _core.ops.dequantize_ref(W, 8)


def test_source_dtypes_use_the_format_spelling():
    cfg = _core.ModelConfig()
    cfg.hidden, cfg.intermediate, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads = 64, 128, 1, 1, 1
    cfg.head_dim, cfg.vocab = 64, 10
    cfg.validate()
    store = _core.WeightStore(cfg)
    store.add("model.norm.weight", np.ones(64, np.float32), "fp32")
    store.add("model.embed_tokens.weight", np.ones((10, 64), np.float16), _core.DType.fp16)
    for old in ("f32", "float32"):
        with pytest.raises(UnsupportedModelError, match=f"'{old}' \\(expected fp32, fp16 or bf16\\)"):
            store.add("lm_head.weight", np.ones((10, 64), np.float32), old)
    assert store.format == _core.WFormat.fp16


@needs_cuda_build
def test_cuda_options_weights_enum_or_checked_name():
    o = _core.CudaOptions()
    assert o.weights == _core.WFormat.fp16
    o.weights = "int4"
    assert o.weights == _core.WFormat.int4
    o.weights = _core.WFormat.int8
    assert o.weights == _core.WFormat.int8
    with pytest.raises(InvalidRequestError, match="unknown weight format 'q4'"):
        o.weights = "q4"
    assert o.weights == _core.WFormat.int8  # unchanged by the refused value


@needs_cuda_build
def test_gemv_pins_are_typed_and_checked():
    Role = _core.MatrixRole
    o = _core.CudaOptions()
    assert o.gemv_pins == []
    o.gemv_pins = [_core.GemvPin(Role.Qkv, 4, 2), _core.GemvPin(Role.Down, 8, 0)]
    assert [(p.role, p.rows_per_warp, p.blocks_per_sm) for p in o.gemv_pins] == [(Role.Qkv, 4, 2), (Role.Down, 8, 0)]
    with pytest.raises(InvalidRequestError, match="qkv: rows_per_warp must be 1, 2, 4, 8 \\(split-K\\) or 16 "
                       "\\(tensor cores\\), not 3"):
        _core.GemvPin(Role.Qkv, 3, 2)
    assert _core.GemvPin(Role.O, 16, 0).rows_per_warp == 16  # the tensor-core product on the one row
    with pytest.raises(InvalidRequestError, match="down: the tensor-core product \\(16\\) sizes its own grid"):
        _core.GemvPin(Role.Down, 16, 2)
    with pytest.raises(InvalidRequestError, match="lm_head: blocks_per_sm must be 0, 1 or 2, not 5"):
        _core.GemvPin(Role.LmHead, 2, 5)
    with pytest.raises(InvalidRequestError, match="blocks_per_sm must be 0, 1 or 2, not -1"):
        _core.GemvPin(Role.O, 2, -1)
    with pytest.raises(TypeError):
        _core.GemvPin("qkv", 2, 2)
    with pytest.raises(TypeError):
        o.gemv_pins = "qkv:4/2"


@needs_cuda_build
def test_kernel_op_modes_are_enums():
    """A mode string is refused before anything runs (no silent fallback): the same call with the enums gets past
    the argument check (it runs, or without a GPU fails inside with a DeviceError), so the modes alone are wrong."""
    ops = _core.ops
    W = np.zeros((4, 8), np.uint16)
    x = np.zeros(8, np.float32)

    def gemv(mode_in, mode_out):
        return ops.gemv(W, x, x, 1e-5, np.zeros(4, np.float32), 2, mode_in, mode_out)

    def gemm(mode_out):
        return ops.gemm(W, np.ones((2, 8), np.float32), np.zeros((2, 4), np.float32), mode_out)

    for call in (lambda: gemv(ops.GemvIn.F32Norm, ops.GemvOut.AddF32), lambda: gemm(ops.GemmOut.AddF32)):
        try:
            call()
        except DeviceError:
            pass
    with pytest.raises(TypeError, match=r"^gemv\(\): incompatible function arguments(?s:.*)"
                                        r"Invoked with types: ndarray, ndarray, ndarray, float, ndarray, int, str, str$"):
        gemv("f32norm", "add")
    with pytest.raises(TypeError, match=r"^gemm\(\): incompatible function arguments(?s:.*)"
                                        r"Invoked with types: ndarray, ndarray, ndarray, str$"):
        gemm("add")
    assert {m.name for m in ops.GemvOut} == {"F32", "AddF32", "Swiglu"}
    assert {m.name for m in ops.GemmOut} == {"F32", "AddF32", "F16"}
