"""What every loader returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from .. import _core
from ..tokenizer import Tokenizer

# One tensor for the core: (HuggingFace name, array, core dtype "fp32" | "fp16" | "bf16"; bf16 as uint16 bits).
TensorItem = tuple[str, np.ndarray, str]
TensorSource = Callable[[], Iterator[TensorItem]]


@dataclass
class LoadedModel:
    config: _core.ModelConfig
    tensors: TensorSource  # called once; yields views over the mapped file, one tensor at a time
    tokenizer: Optional[Tokenizer] = None
    path: Path = Path(".")
    description: str = ""
    extra: dict = field(default_factory=dict)
