"""What every loader returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np

from .. import _core
from ..tokenizer import Tokenizer

# One tensor for the core: (HuggingFace name, array, core dtype "fp32" | "fp16" | "bf16"; bf16 as uint16 bits).
TensorItem = tuple[str, np.ndarray, str]
TensorSource = Callable[..., Iterator[TensorItem]]


class BlockMatrix(NamedTuple):
    """One weight matrix already in one of the engine's block formats, for the engine to import as it is (no
    second rounding). The layouts are cpp/core/quant.h's; for int4: q (rows, K/2) uint8 and scales (rows, K/32 * 2)
    fp16 bits, a (scale, min) pair per group of 32."""

    name: str  # HuggingFace name
    q: np.ndarray  # packed weights
    scales: np.ndarray  # per-block fp16 bits


BlockSource = Callable[[], Iterator[BlockMatrix]]


class StreamItem(NamedTuple):
    """One piece of the GPU engine's load (CudaEngine.load; bindings/engines.cpp load_item reads the first 8
    fields): rows of a tensor in their stored form, or a whole matrix in one of the engine's quantized layouts."""

    kind: str  # "rows" | "int4" | "int8"
    name: str  # HuggingFace name
    data: np.ndarray  # rows: (n, K) or (K,) elements, a view over the mapped file where possible; else (rows, bytes)
    scales: Optional[np.ndarray]  # int4 / int8: (rows, ...) the layout's scales; rows: None
    dtype: str  # rows: "fp32" | "fp16" | "bf16" (bf16 as uint16 bits)
    rope_heads: int  # > 0: GGUF attn_q / attn_k rows in llama.cpp's permuted order, undone on the device
    row0: int  # rows: the first row of the tensor `data` holds
    shape: tuple[int, int]  # the whole tensor: (rows, K); a vector: (1, K)
    nbytes: int  # bytes of the file this item stands for (the progress bar)


# Called with the engine's weight format ("fp16" | "int8" | "int4"): which matrices can come as stored blocks.
StreamSource = Callable[[str], Iterator[StreamItem]]


def rows_items(name: str, array: np.ndarray, dtype: str, rope_heads: int = 0,
               nbytes: Optional[int] = None) -> Iterator[StreamItem]:
    """A float tensor as one "rows" item (a vector as shape (1, K)); views stay views."""
    shape = (1, int(array.shape[0])) if array.ndim == 1 else (int(array.shape[0]), int(np.prod(array.shape[1:])))
    data = array if array.ndim <= 2 else array.reshape(shape)
    yield StreamItem("rows", name, data, None, dtype, rope_heads, 0, shape,
                     int(array.nbytes if nbytes is None else nbytes))


@dataclass
class LoadedModel:
    config: _core.ModelConfig
    # called once; yields views over the mapped file, one tensor at a time. GGUF: tensors(skip=names) leaves
    # those out unread (the CPU engine holds them as blocks)
    tensors: TensorSource
    tokenizer: Optional[Tokenizer] = None
    path: Path = Path(".")
    description: str = ""
    # Matrices stored in a block layout the engine takes over bit for bit, one source per engine format (GGUF
    # Q4_0 / Q4_1 -> int4, Q8_0 -> int8); None where the file has none. Engine(dtype="int4" / "int8") imports
    # these over `tensors`. int8_blocks(layers=False) gives only the LM head (an int4 model's int8 head).
    int4_blocks: Optional[BlockSource] = None
    int8_blocks: Optional[Callable[..., Iterator["BlockMatrix"]]] = None
    # GGUF only: the stored type of each tensor (HuggingFace name -> "Q4_1", "F16", ...) and the file's metadata
    # (the tokenizer's big arrays left out).
    gguf_types: dict[str, str] = field(default_factory=dict)
    gguf_metadata: dict[str, Any] = field(default_factory=dict)
    # generation_config.json's sampling fields (HF directories; checked by their user, the server: they are
    # advice, not the model), e.g. {"temperature": 0.6, "top_p": 0.9}
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # The GPU engine's load: every tensor in its stored form (see StreamItem), and the bytes it will read.
    stream: Optional[StreamSource] = None
    stream_bytes: int = 0
