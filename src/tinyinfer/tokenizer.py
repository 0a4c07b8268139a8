"""Tokenizer: a thin wrapper over the `tokenizers` library (the same Rust tokenizer HuggingFace uses)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from .errors import ModelFormatError


class Tokenizer:
    def __init__(self, tok, *, bos_token: Optional[str] = None, eos_token: Optional[str] = None):
        self._tok = tok
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_file(cls, path: Path, **kw) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on a bad file
            raise ModelFormatError(f"{path}: cannot read the tokenizer: {e}") from e
        return cls(tok, **kw)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)
