"""Tokenizer parity for GGUF vocabularies against each model family's own tokenizer, on an adversarial text set.

References (never transformers' GGUF-to-tokenizer conversion, which drops sentencepiece's dummy prefix before a
leading space):
- SentencePiece ("llama" vocabularies): a sentencepiece BPE model trained here with Llama-2's normalizer settings
  (dummy prefix, whitespace kept, byte fallback, split digits), exported to a vocab-only GGUF as llama.cpp's
  convert script exports tokenizer.model; the reference is sentencepiece's own encode/decode.
- Byte-level BPE ("gpt2" vocabularies, Llama-3 pre-type): a `tokenizers` BPE trained here with Llama-3's
  tokenizer.json pipeline (its Split regex, ByteLevel, "ignore_merges": true) plus one whole word the merges do
  not build (as in Llama-3's vocabulary); the reference is that tokenizer.json.
- Optional, gold: llama.cpp's vocab-only GGUFs of the real Llama-2 / Llama-3 / Phi-3 vocabularies with their
  expected tokenizations (models/ggml-vocab-*.gguf + .inp/.out, made from the models' own HF tokenizers). They are
  in llama-cpp-python's sdist (vendor/llama.cpp/models/); put them in $TINYINFER_LLAMA_VOCAB or
  <tinyinfer cache>/llama-vocab/ to run those tests, which skip otherwise.
"""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path

import gguf
import pytest

from tinyinfer.errors import ModelFormatError, ModelNotFoundError
from tinyinfer.tokenizer import Tokenizer

ADVERSARIAL = {
    "empty": "",
    "space": " ",
    "two_spaces": "  ",
    "three_spaces": "   ",
    "leading_space": " Hello world",
    "leading_spaces": "  a",
    "inner_run": "a  b",
    "trailing_run": "hello   ",
    "long_run": "x" + " " * 17 + "y",
    "tabs_newlines": "\t\n\n x",
    "newline_lead": "\n =",
    "crlf": "line one\r\nline two\r\n",
    "emoji_zwj": "\U0001F469\u200D\U0001F469\u200D\U0001F467 family \U0001F636\u200D\U0001F32B\uFE0F ok",
    "cjk": "我想在apple工作1314151天～ 日本語のテキスト",
    "khmer": "ស្វាគមន៍ កាន់តែពិសេស",
    "accented_precomposed": "Cửa Việt, naïve café, Äpfel, façade",
    "accented_combining": "Cu\u031b\u0309a Vie\u0323\u0302t, nai\u0308ve cafe\u0301",
    "digits": "1234567",
    "digit_mix": "w048 7tuijk 3.14159 on 2024-01-01, 333333333",
    "code": "def f(x):\n    return x**2  # hi",
    "code_indent": "class A:\n\tdef g(self):\n\t\tpass\n\n\n    x = [1,2,3]\n",
    "apostrophes": "I'm sure you'll say WE'VE don't 're",
    "mixed": "Hello, y'all! How are you \U0001F601 ?\n\n\tTabs\tand  spaces  end ",
    "punct_run": "!!!!!! ... ??? ((()))",
}

# The text the trained models learn from: English, code, numbers, some accented and CJK characters. Khmer and the
# emoji are left out on purpose so that they go through byte fallback.
CORPUS = [
    "the quick brown fox jumps over the lazy dog. hello world, this is a test of the tokenizer.",
    "def f(x):\n    return x**2  # square\n\nclass A:\n    def g(self):\n        return [1, 2, 3]\n",
    "Hello, World! How are you? I'm fine, thank you. We'll see what they've done.",
    "numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1234567 and more",
    "naïve café façade Äpfel über Cửa Việt résumé coöperate",
    "我想在apple工作 日本語のテキスト 天气很好",
    "    indented line\n\tindented with a tab\n\n  two spaces  and  more   spaces",
]


# Pieces that random texts are glued from (test_*_random_texts): the joins make the runs and mixtures that a fixed
# list misses (a space run before a digit, a combining mark after CJK, a tab after an emoji...).
FUZZ_PIECES = [" ", "  ", "\t", "\n", "\r\n", "a", "the", "Hello", "zebra", " ngôn", "123", "4567", "'s", "'ll",
               "é", "e\u0301", "ửa", "我", "日本", "ស្វា", "\U0001F469\u200D\U0001F467", "\U0001F601", "#", "**", "(",
               ")", ":", "."]


def fuzz_texts(n: int = 200, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    return ["".join(rnd.choice(FUZZ_PIECES) for _ in range(rnd.randint(1, 12))) for _ in range(n)]


def _corpus_lines(n: int = 40) -> list[str]:
    return [f"{line} {i}" if i % 3 else line for i in range(n) for line in CORPUS]


def _new_writer(path: Path, model: str, pre: str, tokens, types, *, bos, eos, unk=None, add_bos=None,
                add_eos=None) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if unk is not None:
        w.add_unk_token_id(unk)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    return w


def _finish(w: gguf.GGUFWriter) -> None:
    """Header and metadata only: a vocab-only GGUF, as llama.cpp's convert --vocab-only writes."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


# ---- SentencePiece ----------------------------------------------------------------------------------------------

def train_spm(**overrides):
    """A small sentencepiece BPE model with Llama-2's tokenizer.model settings."""
    import sentencepiece as spm

    model = io.BytesIO()
    kw = dict(model_type="bpe", vocab_size=700, byte_fallback=True, add_dummy_prefix=True,
              remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
              normalization_rule_name="identity", character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2,
              pad_id=-1, max_sentencepiece_length=16, hard_vocab_limit=False, num_threads=1, minloglevel=2)
    kw.update(overrides)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus_lines()), model_writer=model, **kw)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def write_spm_gguf(path: Path, sp, *, space_prefix=None, **writer_kw) -> Path:
    """sp's vocabulary as llama.cpp's convert script writes a tokenizer.model (_create_vocab_sentencepiece)."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                     else 6 if sp.is_byte(i) else 1)
    w = _new_writer(path, "llama", "default", tokens, types, bos=sp.bos_id(), eos=sp.eos_id(), unk=sp.unk_id(),
                    **writer_kw)
    w.add_token_scores(scores)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    _finish(w)
    return path


@pytest.fixture(scope="module")
def spm_pair(tmp_path_factory):
    sp = train_spm()
    path = write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm-vocab.gguf", sp)
    return Tokenizer.from_gguf(path), sp


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_sentencepiece_matches_sentencepiece(name, spm_pair):
    tok, sp = spm_pair
    text = ADVERSARIAL[name]
    ref = sp.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ref, [sp.id_to_piece(i) for i in ref]
    assert tok.encode(text) == [sp.bos_id(), *ref]  # a sentencepiece vocabulary adds BOS unless told otherwise
    assert tok.decode(ref) == sp.decode(ref)


def test_sentencepiece_random_texts(spm_pair):
    tok, sp = spm_pair
    wrong = [t for t in fuzz_texts() if tok.encode(t, add_special_tokens=False) != sp.encode(t)]
    assert not wrong, wrong[:5]


def test_sentencepiece_leading_space_is_prefix_plus_space(spm_pair):
    """The issue's case: " " is the dummy prefix and the space, one "▁▁" piece when the vocabulary has it."""
    tok, sp = spm_pair
    ids = tok.encode(" ", add_special_tokens=False)
    assert "".join(sp.id_to_piece(i) for i in ids) == "\u2581\u2581"
    assert [sp.id_to_piece(i) for i in tok.encode(" a", add_special_tokens=False)][0].startswith("\u2581\u2581")


def test_sentencepiece_byte_fallback_is_exercised(spm_pair):
    """Khmer and the emoji are not in the training text: they must come out as <0x..> byte pieces, and decode."""
    tok, sp = spm_pair
    for name in ("khmer", "emoji_zwj"):
        ids = tok.encode(ADVERSARIAL[name], add_special_tokens=False)
        assert any(sp.is_byte(i) for i in ids), name
        assert tok.decode(ids) == ADVERSARIAL[name]


@pytest.mark.parametrize("name", ["khmer", "emoji_zwj", "leading_spaces", "crlf"])
def test_sentencepiece_token_bytes_join_to_the_text(name, spm_pair):
    """What logprobs show of a token: its piece with "▁" as the space it stands for (decoding "▁cat" alone
    strips it) and a byte piece as its byte (alone it decodes to U+FFFD), as llama.cpp's token_to_piece; so the
    tokens' bytes join to the text after the dummy prefix's space, characters split into byte pieces included."""
    tok, sp = spm_pair
    text = ADVERSARIAL[name]
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == (" " + text).encode()


def test_unigram_token_bytes_join_to_the_text():
    """The same for a Unigram SentencePiece model with byte fallback (whose byte_fallback the tokenizers library
    shows only in its JSON)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = [("<unk>", 0.0), ("\u2581cat", -1.0), ("\u2581", -2.0), ("c", -3.0), ("a", -3.0), ("t", -3.0)]
    hf = HFTokenizer(models.Unigram(vocab + [(f"<0x{b:02X}>", -10.0) for b in range(256)], 0, True))
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok = Tokenizer(hf)
    ids = tok.encode("cat é")
    assert [hf.id_to_token(i) for i in ids] == ["\u2581cat", "\u2581", "<0xC3>", "<0xA9>"]
    assert b"".join(tok.token_bytes(i) for i in ids) == " cat é".encode()


def test_legacy_text_offsets_follow_the_decoded_text(spm_pair):
    """The server's legacy text_offset on a SentencePiece answer: each token's text starts at its offset in the
    text decoding gives (which strips the first token's space), a character in byte pieces counting once."""
    from tinyinfer.server.protocol import TextOffsets, TokenText

    tok, _ = spm_pair
    ids = tok.encode(ADVERSARIAL["khmer"] + " the cat " + ADVERSARIAL["emoji_zwj"], add_special_tokens=False)
    text, token_text, offsets = tok.decode(ids), TokenText(tok), TextOffsets(tok)
    at = [offsets.next(i) for i in ids]
    shown = [token_text(i)[0] for i in ids]
    assert "\ufffd" in "".join(shown)  # some tokens are parts of characters
    for i, (o, t) in enumerate(zip(at, shown)):
        t = t.lstrip(" ") if i == 0 else t
        if "\ufffd" not in t:
            assert text[o:o + len(t)] == t, (i, o, t)
    assert at == sorted(at) and at[-1] < len(text)


def test_sentencepiece_special_tokens_in_text(spm_pair):
    """A control token written in the text stays one token, and the text after it gets the dummy prefix again
    (llama.cpp's tokenizer and Llama-2's tokenizer.json; sentencepiece alone does not parse control tokens)."""
    tok, sp = spm_pair
    ids = tok.encode("hi</s> there", add_special_tokens=False)
    assert ids == sp.encode("hi") + [sp.eos_id()] + sp.encode(" there")
    assert tok.decode(ids) == sp.decode(ids) == "hi  there"  # the prefix stays a space after a special token


@pytest.mark.parametrize("add_bos,add_eos", [(False, False), (True, True), (False, True)])
def test_sentencepiece_bos_eos_follow_the_file(tmp_path, add_bos, add_eos):
    sp = train_spm()
    tok = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "v.gguf", sp, add_bos=add_bos, add_eos=add_eos))
    ref = sp.encode("hello world")
    assert tok.encode("hello world") == [sp.bos_id()] * add_bos + ref + [sp.eos_id()] * add_eos
    assert (tok.add_bos_token, tok.add_eos_token) == (add_bos, add_eos)


def test_sentencepiece_without_dummy_prefix(tmp_path):
    """A model trained without the dummy prefix, exported with tokenizer.ggml.add_space_prefix = false (as
    llama.cpp's convert script writes a tokenizer.model whose add_dummy_prefix is false)."""
    sp = train_spm(add_dummy_prefix=False)
    tok = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "v.gguf", sp, space_prefix=False))
    for name, text in ADVERSARIAL.items():
        ref = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == ref, name
        assert tok.decode(ref) == sp.decode(ref), name


# ---- byte-level BPE (Llama-3) -----------------------------------------------------------------------------------

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# Words the vocabulary holds whole although the merges do not build them (Llama-3's vocabulary has such words, e.g.
# "Cửa Việt" -> "C", "ửa", " Việt"): with ignore_merges they are one token, with merges alone several.
WHOLE_WORDS = (" zebra", " ngôn")
WHOLE_WORD_TEXTS = {"zebra": "a zebra, zebra", "ngon": "tiếng ngôn!"}


def _byte_level(word: str) -> str:
    """word spelled in GPT-2's byte alphabet, as a byte-level vocabulary holds it."""
    from tinyinfer.tokenizer import _bytes_to_unicode

    alphabet = _bytes_to_unicode()
    return "".join(alphabet[b] for b in word.encode("utf-8"))


def bpe_tokenizer_json(*, ignore_merges: bool = True) -> str:
    """A byte-level BPE trained here with Llama-3's tokenizer.json pipeline, plus WHOLE_WORDS; its JSON."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = HFTokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus_lines(), trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for w in map(_byte_level, WHOLE_WORDS):
        assert w not in vocab
        vocab[w] = len(vocab)
    data["model"]["ignore_merges"] = ignore_merges
    return json.dumps(data, ensure_ascii=False)


def write_bpe_gguf(path: Path, tokenizer_json: str, *, pre: str = "llama-bpe", **writer_kw) -> Path:
    """A tokenizer.json's vocabulary as llama.cpp's convert script writes it (get_vocab_base, SpecialVocab)."""
    data = json.loads(tokenizer_json)
    vocab = data["model"]["vocab"]
    added = {a["content"]: a for a in data["added_tokens"]}
    tokens = [""] * len(vocab)
    types = [1] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
        if t in added:
            types[i] = 3 if added[t]["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w = _new_writer(path, "gpt2", pre, tokens, types, bos=vocab[BOS], eos=vocab[EOS], **writer_kw)
    w.add_token_merges(merges)
    _finish(w)
    return path


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory):
    from tokenizers import Tokenizer as HFTokenizer

    source = bpe_tokenizer_json()
    path = write_bpe_gguf(tmp_path_factory.mktemp("bpe") / "bpe-vocab.gguf", source)
    return Tokenizer.from_gguf(path), HFTokenizer.from_str(source)


@pytest.mark.parametrize("name", sorted({**ADVERSARIAL, **WHOLE_WORD_TEXTS}))
def test_llama3_bpe_matches_tokenizer_json(name, bpe_pair):
    tok, ref = bpe_pair
    text = {**ADVERSARIAL, **WHOLE_WORD_TEXTS}[name]
    expected = ref.encode(text).ids
    assert tok.encode(text) == expected, ref.encode(text).tokens
    assert expected[0] == ref.token_to_id(BOS)  # Llama-3 adds BOS, and the GGUF (no add_bos_token) must too
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False).ids
    assert tok.decode(expected) == ref.decode(expected) == text


def test_llama3_bpe_random_texts(bpe_pair):
    tok, ref = bpe_pair
    wrong = [t for t in fuzz_texts() if tok.encode(t) != ref.encode(t).ids or tok.decode(tok.encode(t)) != t]
    assert not wrong, wrong[:5]


def test_whole_words_need_ignore_merges(bpe_pair):
    """The WHOLE_WORD_TEXTS cases tell ignore_merges apart: one token with it, several from the merges alone."""
    from tokenizers import Tokenizer as HFTokenizer

    tok, ref = bpe_pair
    merges_only = HFTokenizer.from_str(bpe_tokenizer_json(ignore_merges=False))
    for text in WHOLE_WORD_TEXTS.values():
        assert ref.encode(text).ids != merges_only.encode(text).ids, text
    for w in WHOLE_WORDS:
        assert tok.encode(w, add_special_tokens=False) == [ref.token_to_id(_byte_level(w))], w


@pytest.mark.parametrize("pre,add_bos,expect_bos", [("llama-bpe", False, False), ("gpt2", None, False),
                                                    ("gpt2", True, True), ("llama3", None, True)])
def test_bpe_bos_follows_the_file(tmp_path, pre, add_bos, expect_bos):
    """add_bos_token when the file has it; else llama.cpp's default for the pre-type (Llama-3's adds BOS)."""
    source = bpe_tokenizer_json()
    tok = Tokenizer.from_gguf(write_bpe_gguf(tmp_path / "v.gguf", source, pre=pre, add_bos=add_bos))
    ids = tok.encode("hello")
    assert (ids[0] == tok.token_to_id(BOS)) is expect_bos
    assert tok.add_bos_token is expect_bos


# ---- llama.cpp's vocab files (optional gold references) ---------------------------------------------------------

def _llama_vocab_dir() -> Path:
    from tinyinfer.models import cache_dir

    env = os.environ.get("TINYINFER_LLAMA_VOCAB")
    return Path(env).expanduser() if env else cache_dir() / "llama-vocab"


def _llama_vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 cases: texts split by __ggml_vocab_test__, one line of ids per text (no BOS)."""
    base = _llama_vocab_dir() / f"ggml-vocab-{name}.gguf"
    texts = base.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = base.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(lines) >= len(texts), base
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


@pytest.mark.parametrize("name,add_bos", [("llama-spm", True), ("llama-bpe", True), ("phi-3", True)])
def test_llama_cpp_vocab_files(name, add_bos):
    """The real Llama-2 (SentencePiece), Llama-3 (byte-level BPE, ignore_merges) and Phi-3 vocabularies, read from
    llama.cpp's vocab-only GGUFs, against the expected ids llama.cpp ships beside them."""
    path = _llama_vocab_dir() / f"ggml-vocab-{name}.gguf"
    if not path.is_file() or not path.with_suffix(".gguf.out").is_file():
        pytest.skip(f"{path} (+ .inp/.out) not present: see this file's docstring")
    tok = Tokenizer.from_gguf(path)
    cases = _llama_vocab_cases(name)
    wrong = [(t, tok.encode(t, add_special_tokens=False), ids) for t, ids in cases
             if tok.encode(t, add_special_tokens=False) != ids]
    assert not wrong, wrong[:5]
    assert tok.add_bos_token is add_bos
    assert tok.encode("Hello")[0] == tok.token_to_id(tok.bos_token)


# ---- from_gguf --------------------------------------------------------------------------------------------------

def test_from_gguf_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="nope.gguf"):
        Tokenizer.from_gguf(tmp_path / "nope.gguf")


def test_from_gguf_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        Tokenizer.from_gguf(tmp_path / "x.gguf")


def test_from_gguf_without_a_tokenizer(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "llama")
    w.add_block_count(1)
    _finish(w)
    with pytest.raises(ModelFormatError, match="no tokenizer"):
        Tokenizer.from_gguf(tmp_path / "x.gguf")
