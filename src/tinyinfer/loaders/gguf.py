"""GGUF files (llama.cpp's format), read through the `gguf` package.

One file holds everything: the config (llama.* metadata), the tokenizer (tokenizer.ggml.*), the chat template
(tokenizer.chat_template) and the tensors. What this loader does:

- refuses anything but general.architecture == "llama" (UnsupportedModelError naming the key and value);
- builds a ModelConfig from llama.* metadata (loaders/gguf_config.py);
- yields the tensors one at a time under their HuggingFace names, row-major [out, in] (GGUF lists dimensions
  innermost first, so a [in, out] GGUF shape is a row-major [out, in] array already):
  F32 / F16 / BF16 are passed as they are (views over the memory-mapped file; BF16 as uint16 bits);
  Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K are dequantized to float32 with gguf.quants.dequantize (the same
  reference transformers uses), one tensor at a time; any other type is refused, naming the tensor and type;
- undoes llama.cpp's rope permutation of the attn_q / attn_k rows (transformers' reverse_permute);
- for the GPU engine (LoadedModel.stream), offers every tensor as stored instead: views, Q / K rows still
  permuted (the device undoes it), Q4_0 / Q4_1 raw blocks for an int4 engine (converted on the device), other
  quantized types dequantized 64 MiB of rows at a time;
- turns every failure of a corrupt or truncated file into ModelFormatError naming the file.

The source type of each tensor is kept in LoadedModel.gguf_types (HF name -> "Q4_1", ...); the Q4_0 / Q4_1 and
Q8_0 tensors are also offered in the engine's int4 / int8 layouts (LoadedModel.int4_blocks / int8_blocks), which
Engine(dtype="int4" / "int8") imports without re-rounding.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from .. import _core
from ..errors import ModelFormatError, UnsupportedModelError
from ..tokenizer import Tokenizer
from .base import BlockMatrix, LoadedModel, StreamItem, TensorItem, rows_items
from .gguf_config import config_from_gguf, read_metadata, rope_freqs_as_llama3, validate_config
# quantized types dequantized to float32 at load
_DEQUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# types passed through: GGUF type name -> (numpy dtype to view the data as, core dtype)
_PASSTHROUGH = {"F32": ("<f4", "fp32"), "F16": ("<f2", "fp16"), "BF16": ("<u2", "bf16")}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")

# Big arrays read only when needed (the tokenizer); every other metadata value is read whole.
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                     "tokenizer.ggml.token_type")


def hf_tensor_name(gguf_name: str) -> Optional[str]:
    """The HuggingFace name of a GGUF tensor of a llama model, or None if it has no counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}.weight"
    return None


def reverse_rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of Q/K rows (pairs (i, i+d/2) interleaved per head), giving the
    HuggingFace layout. Works on any row-major [rows, ...] array (rows = n_head * head_dim)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelFormatError(f"cannot un-permute {rows} rows for {n_head} heads")
    dim = rows // n_head // 2
    return np.ascontiguousarray(w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape))


# ---- reading ----

def _reader_class():
    import gguf

    class MappedReader(gguf.GGUFReader):
        """gguf's reader over a plain ndarray view of its memory map instead of the np.memmap itself: the file
        stays mapped (no copy), but the ~10^6 tiny slices it takes while parsing a 49k-token vocabulary skip
        np.memmap's per-slice bookkeeping (SmolLM2's metadata: 1.85 s -> 0.56 s on a 2-core machine)."""

        def _build_fields(self, offs, count):
            self.data = self.data.view(np.ndarray)
            return super()._build_fields(offs, count)

        def _get_field_parts(self, orig_offs, raw_type):
            """An array of strings or numbers (the vocabulary, its scores and types: ~10^5 items each) in one lean
            loop over the bytes, giving the very parts and indices the reader's element-by-element recursion
            gives (a view per item); anything else: the reader itself."""
            array, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
            if raw_type != array or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            itype = gguf.GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
            scalar = self.gguf_scalar_to_np.get(itype)
            if itype != string and scalar is None:  # nested arrays
                return super()._get_field_parts(orig_offs, raw_type)
            data, u64 = self.data, np.dtype("<u8")
            raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            parts, idxs, offs, n_items = [raw_itype, alen], [], orig_offs + 12, int(alen[0])
            if scalar is not None:
                dt = np.dtype(scalar).newbyteorder("<")
                for _ in range(n_items):
                    idxs.append(len(parts))
                    parts.append(data[offs:offs + dt.itemsize].view(dt))
                    offs += dt.itemsize
            else:
                for _ in range(n_items):
                    slen = data[offs:offs + 8].view(u64)
                    n = int(slen[0])
                    parts.append(slen)
                    idxs.append(len(parts))
                    parts.append(data[offs + 8:offs + 8 + n])
                    offs += 8 + n
            if offs > len(data):
                raise ValueError("an array runs past the end of the file")
            return offs - orig_offs, parts, idxs, [array, itype]

    return MappedReader


def _open_reader(path: Path):
    try:
        import gguf
    except ImportError as e:  # a declared dependency, but say what is missing if it is not there
        raise UnsupportedModelError(f"{path}: reading GGUF files needs the 'gguf' package (pip install gguf)") from e
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read: {e}") from e
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read: {e}") from e
    if magic != b"GGUF":
        raise ModelFormatError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = _reader_class()(str(path), "r")
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as e:  # ValueError, IndexError, struct/UnicodeDecodeError, ...: truncated or corrupt
        # (the reader's own words are numpy's, "cannot reshape array ...": say first what it means for the user)
        raise ModelFormatError(f"{path}: corrupt or truncated GGUF file ({size:,} bytes; an interrupted download? "
                               f"fetch it again). The gguf reader stopped at: {type(e).__name__}: {e}") from e
    if getattr(reader, "byte_order", "I") != "I":
        raise UnsupportedModelError(f"{path}: big-endian GGUF files are not supported")
    for t in reader.tensors:  # the reader already fails on most of these; say it plainly if it didn't
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelFormatError(f"{path}: tensor '{t.name}' data runs past the end of the file "
                                   f"({end} > {size} bytes): truncated")
    return reader



# ---- int4 blocks ----

_I4_POS = (0, 16, 4, 20, 8, 24, 12, 28)  # nibble offsets of weights 0..7 in a word (cpp/core/quant.h)


def q4_blocks_to_int4(raw: np.ndarray, type_name: str, rows: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q4_0 / Q4_1 blocks -> the engine's int4 layout (groups of 32, fp16 scale and min), with no second
    rounding: Q4_1's w = d q + m is ours with (scale, min) = (d, m); Q4_0's w = d (q - 8) is ours with
    min = -8 d (exact in fp16 unless it overflows, which the caller checks). Returns q (rows, K/2) bytes and
    sm (rows, K/32 * 2) fp16 bits."""
    size = 20 if type_name == "Q4_1" else 18
    b = np.asarray(raw, dtype=np.uint8).reshape(rows, K // 32, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    if type_name == "Q4_1":
        m = b[..., 2:4].copy().view(np.float16)[..., 0]
        qs = b[..., 4:20]
    else:
        with np.errstate(over="raise"):
            m = (d * np.float16(-8)).astype(np.float16)
        qs = b[..., 2:18]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.uint32)  # weights 0..15, then 16..31
    q = q.reshape(rows, K // 32, 4, 8)
    words = np.zeros((rows, K // 32, 4), np.uint32)
    for i, pos in enumerate(_I4_POS):
        words |= q[..., i] << np.uint32(pos)
    q_bytes = np.ascontiguousarray(words.astype("<u4")).view(np.uint8).reshape(rows, K // 2)
    sm = np.ascontiguousarray(np.stack([d, m], axis=-1)).view(np.uint16).reshape(rows, K // 32 * 2)
    return q_bytes, sm


def q8_0_blocks(raw: np.ndarray, rows: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 blocks (fp16 d, then 32 int8 q: w = d q) split into q (rows, K) int8 and d (rows, K/32) fp16
    bits: the numbers of the engine's int8 layout as they are (WeightStore.add_int8 packs them)."""
    b = np.asarray(raw, dtype=np.uint8).reshape(rows, K // 32, 34)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.uint16)[..., 0]
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, K)
    return q, d


def _hf_rows(gguf_name: str, n_heads: int, n_kv: int, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per-row arrays of a GGUF tensor in HuggingFace row order: attn_q / attn_k rows un-permuted."""
    n = n_heads if gguf_name.endswith(".attn_q.weight") else n_kv if gguf_name.endswith(".attn_k.weight") else 0
    if not n:
        return arrays
    order = reverse_rope_permute(np.arange(arrays[0].shape[0])[:, None], n)[:, 0]
    return tuple(np.ascontiguousarray(a[order]) for a in arrays)


# ---- the loader ----

def _check_tensors(infos: dict[str, tuple[str, Any]], where: str) -> dict[str, str]:
    """Refuse early (before any work) tensors we can't convert or don't know; HF name -> GGUF type name."""
    gguf_types = {}
    for name, (type_name, _) in infos.items():
        if name == "rope_freqs.weight":
            continue
        hf = hf_tensor_name(name)
        if hf is None:
            raise UnsupportedModelError(f"{where}: tensor '{name}' ({type_name}) has no counterpart in this engine's "
                                        f"Llama model (e.g. an attention bias)")
        if type_name not in _PASSTHROUGH and type_name not in _DEQUANTIZED:
            raise UnsupportedModelError(
                f"{where}: tensor '{name}' has type {type_name} (supported: {', '.join(_PASSTHROUGH)}, "
                f"{', '.join(_DEQUANTIZED)})"
            )
        gguf_types[hf] = type_name
    return gguf_types


def _config(meta: dict[str, Any], infos: dict[str, tuple[str, Any]], where: str) -> "_core.ModelConfig":
    """The ModelConfig (llama3 rope scaling from rope_freqs.weight where the file has it), with every tensor's
    shape checked against it before the engine copies anything."""
    # rows of each tensor, from the GGUF shape (innermost first: [in, out] -> out rows)
    tensor_rows = {name: int(t.shape[-1]) if len(t.shape) > 1 else int(t.shape[0])
                   for name, (_, t) in infos.items()}
    config = config_from_gguf(meta, tensor_rows, where)
    if "rope_freqs.weight" in infos:
        type_name, rope_freqs = infos["rope_freqs.weight"]
        if type_name != "F32":
            raise UnsupportedModelError(f"{where}: tensor 'rope_freqs.weight' has type {type_name} (expected F32)")
        rope_freqs_as_llama3(config, np.asarray(rope_freqs.data, dtype=np.float32).reshape(-1), where)
        validate_config(config, where)

    store_shapes = _core.WeightStore(config)
    for name, (type_name, t) in infos.items():
        hf = hf_tensor_name(name)
        if hf is None:
            continue
        want = list(store_shapes.expected_shape(hf))
        got = [int(d) for d in reversed([int(x) for x in t.shape])]
        if got != want:
            raise ModelFormatError(f"{where}: tensor '{name}' ({hf}) has shape {got}, expected {want}")
    return config


def _tensors(infos: dict[str, tuple[str, Any]], config: "_core.ModelConfig", where: str,
             skip: frozenset = frozenset()) -> Iterator[TensorItem]:
    """Every tensor under its HF name, row-major, passed through or dequantized to fp32; Q / K rows un-permuted.
    Names in `skip` (already taken as blocks) are left out unread: no fp32 copy of them is ever made."""
    import gguf

    n_heads, n_kv = config.n_heads, config.n_kv_heads
    for name, (type_name, t) in infos.items():
        hf = hf_tensor_name(name)
        if hf is None or hf in skip:
            continue
        try:
            if type_name in _PASSTHROUGH:
                np_dtype, core_dtype = _PASSTHROUGH[type_name]
                shape = [int(x) for x in reversed([int(d) for d in t.shape])]
                array = np.asarray(t.data).view(np_dtype).reshape(shape)
            else:
                core_dtype = "fp32"
                array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
                shape = [int(x) for x in reversed([int(d) for d in t.shape])]
                array = array.reshape(shape)
        except (KeyboardInterrupt, MemoryError):
            raise
        except Exception as e:
            raise ModelFormatError(f"{where}: tensor '{name}' ({type_name}) cannot be read: "
                                   f"{type(e).__name__}: {e}") from e
        if name.endswith(".attn_q.weight"):
            array = reverse_rope_permute(array, n_heads)
        elif name.endswith(".attn_k.weight"):
            array = reverse_rope_permute(array, n_kv)
        elif not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        yield hf, array, core_dtype


def _int4_blocks(infos: dict[str, tuple[str, Any]], config: "_core.ModelConfig") -> Iterator[BlockMatrix]:
    """The Q4_0 / Q4_1 layer matrices in the engine's int4 layout (Engine(dtype="int4") imports them as they
    are: no second rounding). Q and K rows get the same un-permutation as their fp32 twins."""
    n_heads, n_kv = config.n_heads, config.n_kv_heads
    for name, (type_name, t) in infos.items():
        hf = hf_tensor_name(name)
        if hf is None or type_name not in ("Q4_0", "Q4_1") or ".layers." not in hf:
            continue
        rows, K = int(t.shape[-1]), int(t.shape[0])
        try:
            q, sm = q4_blocks_to_int4(np.asarray(t.data), type_name, rows, K)
        except FloatingPointError:
            continue  # a Q4_0 scale whose -8x overflows fp16: this one is re-quantized instead
        yield BlockMatrix(hf, *_hf_rows(name, n_heads, n_kv, q, sm))


def _int8_blocks(infos: dict[str, tuple[str, Any]], config: "_core.ModelConfig", where: str,
                 layers: bool = True) -> Iterator[BlockMatrix]:
    """The Q8_0 matrices as (q int8, d fp16 bits) for the engine's int8 layout (imported as they are: no second
    rounding): the layer matrices unless layers=False, and the LM head (a tied model's: the embedding)."""
    n_heads, n_kv = config.n_heads, config.n_kv_heads
    head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    for name, (type_name, t) in infos.items():
        hf = hf_tensor_name(name)
        if hf is None or type_name != "Q8_0" or not (hf == head_name or (layers and ".layers." in hf)):
            continue
        try:
            q, d = q8_0_blocks(np.asarray(t.data), int(t.shape[-1]), int(t.shape[0]))
        except ValueError as e:  # data of the wrong size for its shape
            raise ModelFormatError(f"{where}: tensor '{name}' (Q8_0) cannot be read: {e}") from e
        yield BlockMatrix(hf, *_hf_rows(name, n_heads, n_kv, q, d))


# Dequantized rows per "rows" item: a bounded fp32 buffer per step, whatever the tensor's size.
_DEQUANT_CHUNK_BYTES = 64 << 20


def _q4_importable(raw: np.ndarray, type_name: str) -> bool:
    """Whether the device can take these Q4 blocks as they are: Q4_0's min -8 d must not overflow fp16 (as in
    q4_blocks_to_int4; such a tensor is re-quantized instead)."""
    if type_name == "Q4_1":
        return True
    d = raw.reshape(raw.shape[0], -1, 18)[..., 0:2].copy().view(np.float16)
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float16(np.abs(d).max()) * np.float16(-8)))


def _stream(infos: dict[str, tuple[str, Any]], config: "_core.ModelConfig", fmt: str,
            where: str) -> Iterator[StreamItem]:
    """The GPU engine's load: each tensor as stored. F32 / F16 / BF16 as views over the mapped file; Q4_0 / Q4_1
    layer matrices for an int4 engine as their raw blocks (the device converts them to int4 block for block); Q8_0
    as int8 rows as they are (the layer matrices of an int8 engine, the LM head of int8 / int4 ones: a tied
    model's head as "lm_head.weight" from the embedding's blocks, the embedding itself dequantized too); any
    other quantized tensor dequantized to fp32 a bounded chunk of rows at a time. Q / K rows keep llama.cpp's
    order (rope_heads says so): the device undoes the permutation."""
    import gguf

    n_heads, n_kv = config.n_heads, config.n_kv_heads
    tied = bool(config.tie_word_embeddings)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    for name, (type_name, t) in infos.items():
        hf = hf_tensor_name(name)
        if hf is None:
            continue
        rope = n_heads if name.endswith(".attn_q.weight") else n_kv if name.endswith(".attn_k.weight") else 0
        dims = [int(x) for x in reversed([int(d) for d in t.shape])]
        rows, K = (dims[0], dims[1]) if len(dims) == 2 else (1, dims[0])
        try:
            if type_name in _PASSTHROUGH:
                np_dtype, core_dtype = _PASSTHROUGH[type_name]
                yield from rows_items(hf, np.asarray(t.data).view(np_dtype).reshape(dims), core_dtype, rope)
                continue
            raw = np.asarray(t.data).reshape(rows, -1)
            if fmt == "int4" and type_name in ("Q4_0", "Q4_1") and ".layers." in hf and _q4_importable(raw, type_name):
                yield StreamItem(type_name.lower(), hf, raw, None, "", rope, 0, (rows, K), int(t.n_bytes))
                continue
            if type_name == "Q8_0" and (fmt == "int8" and ".layers." in hf or fmt in ("int8", "int4") and hf == head):
                q, d = q8_0_blocks(raw, rows, K)  # our int8 layout stores u = q + 128: flip the sign bit
                yield StreamItem("int8", "lm_head.weight" if hf == head else hf, q.view(np.uint8) ^ np.uint8(0x80),
                                 d, "", rope, 0, (rows, K), 0 if tied and hf == head else int(t.n_bytes))
                if not (tied and hf == head):  # a tied embedding's rows are needed for the lookup as well
                    continue
            step = max(1, _DEQUANT_CHUNK_BYTES // (4 * K))
            for r0 in range(0, rows, step):
                part = gguf.quants.dequantize(raw[r0:r0 + step], t.tensor_type).astype(np.float32, copy=False)
                part = part.reshape(-1, K) if len(dims) == 2 else part.reshape(K)
                yield StreamItem("rows", hf, part, None, "fp32", rope, r0, (rows, K),
                                 int(raw[r0:r0 + step].nbytes))
        except (KeyboardInterrupt, MemoryError, GeneratorExit):
            raise
        except (ValueError, TypeError, AssertionError) as e:
            raise ModelFormatError(f"{where}: tensor '{name}' ({type_name}) cannot be read: "
                                   f"{type(e).__name__}: {e}") from e


def load_gguf(path: Path) -> LoadedModel:
    """Load a llama-architecture GGUF: config, tensors (HF names, dequantized where needed), tokenizer."""
    path = Path(path)
    where = str(path)
    reader = _open_reader(path)
    meta = read_metadata(reader, path)

    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"{where}: general.architecture = {arch!r} is not supported (only 'llama')")

    infos = {t.name: (t.tensor_type.name, t) for t in reader.tensors}  # gguf name -> (type name, reader tensor)
    gguf_types = _check_tensors(infos, where)
    config = _config(meta, infos, where)

    tokenizer = None
    if "tokenizer.ggml.model" in meta:
        tokenizer = Tokenizer.from_gguf_metadata(meta, where=where)

    n_quant = sum(1 for ty in gguf_types.values() if ty in _DEQUANTIZED)
    kinds = sorted(set(gguf_types.values()))
    return LoadedModel(
        config=config,
        tensors=lambda skip=frozenset(): _tensors(infos, config, where, skip),
        tokenizer=tokenizer,
        path=path,
        description=f"GGUF ({', '.join(kinds)}; {n_quant} tensor{'s' if n_quant != 1 else ''} dequantized to fp32)",
        int4_blocks=lambda: _int4_blocks(infos, config),
        int8_blocks=lambda layers=True: _int8_blocks(infos, config, where, layers),
        stream=lambda fmt: _stream(infos, config, fmt, where),
        stream_bytes=sum(int(t.n_bytes) for _, t in infos.values()),
        gguf_types=gguf_types,
        gguf_metadata={k: v for k, v in meta.items() if k not in _TOKENIZER_ARRAYS},
    )


__all__ = ["load_gguf", "config_from_gguf", "hf_tensor_name", "reverse_rope_permute", "read_metadata",
           "q4_blocks_to_int4", "q8_0_blocks"]
