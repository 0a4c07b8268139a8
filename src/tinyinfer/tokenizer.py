"""Tokenizer: a thin wrapper over the `tokenizers` library (the same Rust tokenizer HuggingFace uses)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Optional, Union

from .errors import InvalidRequestError, ModelFormatError


def not_unicode(s: str) -> Optional[str]:
    """Why `s` has no UTF-8 (a lone surrogate, "\\ud800" in JSON), or None: such a string cannot be tokenized,
    nor match a model's text."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"{s[e.start]!r} (a lone surrogate) at character {e.start}"
    return None


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


class Tokenizer:
    def __init__(self, tok, *, bos_token: Optional[str] = None, eos_token: Optional[str] = None):
        self._tok = tok
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._byte_of: Optional[dict[str, int]] = None  # token_bytes' byte-level table, made on first use
        self._added: set[int] = set()
        self._byte_pieces = self._spaces = False  # token_bytes: "<0xNN>" pieces are bytes; "▁" is a space

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
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the library's one message for both: "TextInputSequence must be str"
            if not isinstance(text, str):
                raise InvalidRequestError(f"the text to tokenize must be a str (got {type(text).__name__})") from None
            if not_unicode(text):
                raise InvalidRequestError(f"the text is not valid Unicode: {not_unicode(text)}") from None
            raise

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        """The token's string in the vocabulary ("Ġcat", "▁cat", "<0xE6>"; transformers' convert_ids_to_tokens)."""
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for inside a text (logprobs show them), as llama.cpp's token_to_piece:
        byte-level BPE tokens (GPT-2 / Llama-3 / SmolLM2) map back exactly; a SentencePiece token (Llama-2,
        TinyLlama) is its piece with "▁" as the space it stands for ("▁cat" is " cat", which decoding it alone
        strips) and, with byte fallback, "<0xE6>" the byte itself, so a token holding part of a UTF-8
        character keeps its bytes; added tokens and other tokenizers give the UTF-8 of the token decoded alone."""
        if self._byte_of is None:
            from tokenizers import decoders

            byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
            self._added = set(self._tok.get_added_tokens_decoder())
            if not byte_level:  # (the library shows a Unigram model's byte_fallback only in its JSON)
                spec = json.loads(self._tok.to_str())
                self._byte_pieces = bool((spec.get("model") or {}).get("byte_fallback"))
                self._spaces = "\u2581" in json.dumps(spec.get("decoder"), ensure_ascii=False)  # Metaspace, Replace
            # last: another thread's call goes on once this is set
            self._byte_of = {c: b for b, c in _bytes_to_unicode().items()} if byte_level else {}
        raw = self._tok.id_to_token(token_id) or ""
        if raw and token_id not in self._added:
            if self._byte_of and all(c in self._byte_of for c in raw):
                return bytes(self._byte_of[c] for c in raw)
            m = _BYTE_PIECE.fullmatch(raw) if self._byte_pieces else None
            if m:
                return bytes([int(m.group(1), 16)])
            if self._spaces:
                return raw.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    # Set by from_gguf_metadata (and by loaders that know them); None / False elsewhere.
    chat_template: Optional[str] = None  # Jinja source from the model file: untrusted, rendered in a sandbox
    unk_token: Optional[str] = None
    pad_token: Optional[str] = None
    add_bos_token: bool = False  # informational: encode() already applies them (the post-processor)
    add_eos_token: bool = False

    @classmethod
    def from_gguf(cls, path: Union[str, Path]) -> "Tokenizer":
        """The tokenizer of a GGUF file, read from its metadata alone: a vocab-only GGUF (no tensors) will do."""
        from .errors import ModelNotFoundError
        from .loaders.gguf import _open_reader, read_metadata

        path = Path(path)
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file does not exist: {path}")
        return _tokenizer_from_gguf(cls, read_metadata(_open_reader(path), path), where=str(path))

    @classmethod
    def from_gguf_metadata(cls, meta: dict, *, where: str = "GGUF") -> "Tokenizer":
        """A Tokenizer from a GGUF file's metadata (key -> value, arrays as lists); see _tokenizer_from_gguf."""
        return _tokenizer_from_gguf(cls, meta, where=where)

    def special_tokens_map(self) -> dict:
        """The special-token variables a chat template sees (transformers passes its special_tokens_map)."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {n: getattr(self, n) for n in names if getattr(self, n, None) is not None}

    def render_chat(self, messages, *, add_generation_prompt: bool = True, chat_template: Optional[str] = None,
                    **extra) -> str:
        """The prompt text for `messages` ([{"role", "content"}, ...]) from the model's chat template, rendered in
        a Jinja sandbox exactly as transformers' apply_chat_template(tokenize=False) renders it."""
        from .chat import render_chat
        from .errors import ChatTemplateError

        template = chat_template if chat_template is not None else self.chat_template
        if not template:
            raise ChatTemplateError("the model has no chat template (pass chat_template=...)")
        variables = {"bos_token": None, "eos_token": None, **self.special_tokens_map(), **extra}
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(self, messages, *, add_generation_prompt: bool = True, chat_template: Optional[str] = None,
                    **extra) -> list[int]:
        """Token ids of the rendered chat, as transformers' apply_chat_template(tokenize=True): the template writes
        its own special tokens, so none are added (add_special_tokens=False)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                chat_template=chat_template, **extra)
        return self.encode(text, add_special_tokens=False)


# ---- GGUF ----------------------------------------------------------------------------------------------------
#
# A GGUF holds no tokenizer.json: the vocabulary, merges/scores, token types and special ids are metadata under
# llama.cpp's key names (tokenizer.ggml.*). We build the same `tokenizers` pipeline transformers builds from them
# (transformers/integrations/gguf/gguf_tokenizer_mapping.py), with two deliberate differences, both where the file
# says more than transformers reads:
# - the pre-tokenizer named by tokenizer.ggml.pre is honoured for the llama.cpp pre-types that split numbers one
#   character at a time ("smollm", "starcoder", ...), as llama.cpp and those models' own tokenizer.json do
#   (SmolLM2: Sequence[Digits(individual_digits=True), ByteLevel]). transformers has no entry for them and falls
#   back to the plain GPT-2 split, which differs where whitespace or a symbol directly precedes a number character
#   and the vocabulary has a merge across that boundary ("\n\n1." is "ĊĊ","1","." here, "Ċ","Ċ","1","." there);
# - a SentencePiece ("llama") vocabulary with tokenizer.ggml.add_space_prefix = false gets no "▁" prefix, as in
#   llama.cpp (transformers always adds it);
# - a SentencePiece vocabulary adds its dummy prefix as sentencepiece does, whatever the text starts with: " " is
#   "▁▁" and " Hello" is "▁", "▁Hello" (Llama-2's tokenizer.model, llama.cpp). transformers uses a Metaspace
#   pre-tokenizer, which adds no prefix to a text that already starts with a space;
# - a byte-level vocabulary whose pre-type is Llama-3's (or Tekken's) looks a whole word up in the vocabulary before
#   merging, as those models' tokenizer.json ("ignore_merges": true) and llama.cpp do; the merges alone can split
#   a word that the vocabulary holds whole ("Cửa Việt").

_GGUF_TOKEN_CONTROL = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_GGUF_TOKEN_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex (then byte-level without its own regex), as in transformers
_GGUF_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
# llama.cpp pre-types that split every number character on its own before the GPT-2 split (llama-vocab.cpp)
_GGUF_PRE_DIGITS = frozenset(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"))
# llama.cpp pre-types that match a whole word against the vocabulary before merging (ignore_merges) and that add
# BOS when the file does not say (llama-vocab.cpp's LLAMA3 and TEKKEN pre-types)
_GGUF_PRE_IGNORE_MERGES = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                                     "lfm2", "jina-v5-nano", "tekken"))
_GGUF_PRE_ADD_BOS = _GGUF_PRE_IGNORE_MERGES | {"chameleon"}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two vocabulary tokens, best
    score first (transformers' generate_merges with vocab_scores)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    vocab_scores = dict(zip(tokens, scores))
    merges = []
    for merge, score in vocab_scores.items():
        local = []
        for i in range(1, len(merge)):
            left, right = merge[:i], merge[i:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _gguf_merges(meta: dict, where: str) -> list[tuple[str, str]]:
    merges = []
    for i, m in enumerate(meta["tokenizer.ggml.merges"]):
        parts = m.split(" ")
        if len(parts) != 2:
            raise ModelFormatError(f"{where}: tokenizer.ggml.merges[{i}] = {m!r} is not two tokens")
        merges.append((parts[0], parts[1]))
    return merges


def _tokenizer_from_gguf(cls, meta: dict, *, where: str = "GGUF") -> "Tokenizer":
    """A Tokenizer from a GGUF file's metadata (a dict of key -> value, arrays as lists).

    tokenizer.ggml.model "gpt2": byte-level BPE from tokens + merges, pre-tokenizer per tokenizer.ggml.pre.
    tokenizer.ggml.model "llama": SentencePiece-style BPE from tokens + merges (or merges derived from scores),
    byte fallback. Control tokens become special tokens (never split), user-defined tokens added tokens;
    add_bos/add_eos from tokenizer.ggml.add_bos_token / add_eos_token. Keeps bos/eos/unk/pad token strings and
    the chat template (tokenizer.chat_template)."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    from .errors import UnsupportedModelError

    model_type = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model_type is None or tokens is None:
        raise ModelFormatError(f"{where}: no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelFormatError(f"{where}: tokenizer.ggml.tokens is not a list of strings")
    token_types = meta.get("tokenizer.ggml.token_type") or []
    if token_types and len(token_types) != len(tokens):
        raise ModelFormatError(f"{where}: tokenizer.ggml.token_type has {len(token_types)} entries for "
                               f"{len(tokens)} tokens")
    pre = meta.get("tokenizer.ggml.pre")

    def special_id(key: str) -> Optional[int]:
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is None:
            return None
        if not isinstance(v, int) or not 0 <= v < len(tokens):
            raise ModelFormatError(f"{where}: tokenizer.ggml.{key} = {v!r} is not a token id (vocabulary of "
                                   f"{len(tokens)})")
        return v

    if model_type == "gpt2":
        alphabet = _bytes_to_unicode()
        spelled = set(alphabet.values())
        # a token written outside the byte alphabet is respelled byte by byte (as transformers does)
        vocab = {}
        for i, t in enumerate(tokens):
            key = t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))
            vocab.setdefault(key, i)
        merges = _gguf_merges(meta, where) if "tokenizer.ggml.merges" in meta else []
        tok = HFTokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                              end_of_word_suffix="", fuse_unk=False, ignore_merges=pre in _GGUF_PRE_IGNORE_MERGES))
        if pre in _GGUF_PRE_DIGITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ])
        elif pre in _GGUF_PRE_SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_GGUF_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        else:  # "default", "gpt2", unknown: the GPT-2 split (transformers' fallback too)
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        add_bos_default = pre in _GGUF_PRE_ADD_BOS
    elif model_type == "llama":
        vocab = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        if "tokenizer.ggml.merges" in meta:
            merges = _gguf_merges(meta, where)
        else:
            scores = meta.get("tokenizer.ggml.scores")
            if not isinstance(scores, list) or len(scores) != len(tokens):
                raise ModelFormatError(f"{where}: a 'llama' tokenizer needs tokenizer.ggml.scores (one per token) "
                                       f"or tokenizer.ggml.merges")
            merges = _merges_from_scores(tokens, [float(s) for s in scores])
        tok = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
        # sentencepiece's dummy prefix: "▁" before the text even when it starts with a space (" a" is "▁▁a"), and,
        # as llama.cpp and Llama-2's tokenizer.json do, before the text after each special token (the normalizer
        # runs on each stretch between added tokens). A file that says add_space_prefix = false gets none.
        prefix = meta.get("tokenizer.ggml.add_space_prefix", True) is not False
        steps = [normalizers.Prepend("\u2581")] if prefix else []
        tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
        tok.decoder = decoders.Sequence(steps)
        add_bos_default = True  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
    else:
        raise UnsupportedModelError(f"{where}: tokenizer.ggml.model = {model_type!r} is not supported "
                                    f"(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")

    if token_types:
        byte_level = model_type == "gpt2"
        spelled = set(_bytes_to_unicode().values()) if byte_level else None
        control = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, token_types)
            # in a byte-level vocabulary a "control" token outside the byte alphabet is a llama.cpp mislabel
            if ty == _GGUF_TOKEN_CONTROL and (spelled is None or set(t) <= spelled)
        ]
        if control:
            tok.add_special_tokens(control)
        current = tok.get_vocab()
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, token_types) if ty == _GGUF_TOKEN_USER_DEFINED and t in current]
        if user:
            tok.add_tokens(user)

    ids = {k: special_id(f"{k}_token_id") for k in ("bos", "eos")}
    ids["unk"] = special_id("unknown_token_id")
    ids["pad"] = special_id("padding_token_id")
    strings = {k: (tokens[v] if v is not None else None) for k, v in ids.items()}
    # the bos/eos/unk/pad tokens are special whatever their token type (transformers registers them too), so
    # "<unk>" in a text stays one token and decode(skip_special_tokens=True) drops them
    named = [AddedToken(s, normalized=False, special=True) for s in dict.fromkeys(strings.values())
             if s is not None and tok.token_to_id(s) is not None]
    if named:
        tok.add_special_tokens(named)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and ids["bos"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and ids["eos"] is not None
    bos, eos = strings["bos"], strings["eos"]
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    specials = ([(bos, ids["bos"])] if add_bos else []) + ([(eos, ids["eos"])] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    out = cls(tok, bos_token=strings["bos"], eos_token=strings["eos"])
    out.unk_token = strings["unk"]
    out.pad_token = strings["pad"]
    out.add_bos_token = add_bos
    out.add_eos_token = add_eos
    template = meta.get("tokenizer.chat_template")
    out.chat_template = template if isinstance(template, str) and template else None
    return out

