"""Tokenizers: a published one, or one trained on the corpus; every kind used alike.

    load("path/tokenizer.json")     a Hugging Face `tokenizers` file (Llama 3's, GPT-2's, ...)
    load("path/Llama-3.2-1B")       a directory holding tokenizer.json (else tokenizer.model)
    load("path/tokenizer.model")    a sentencepiece model
    train(documents, vocab_size, path)   a sentencepiece BPE model trained on the corpus

A document becomes `prefix + encode(text) + [eos_id]` (Tokenizer.frame): the tokens the
tokenizer's own template puts before a text (a BOS, where it adds one: Llama's), the text's,
and an end-of-document token after it, so a model learns where documents end and each one
starts as the tokenizer's users start it. The end-of-document token is the one
tokenizer_config.json (beside tokenizer.json) names as eos_token, else the template's own,
else the first of END_TOKENS the vocabulary holds; a sentencepiece model's eos_id, and its
bos_id as prefix where it has one.

The trained model's settings, chosen for lossless, deterministic tokenization:
  identity normalization, extra whitespace kept   decode(encode(text)) == text
  byte_fallback, character_coverage 1.0           any character encodes, even unseen ones
  split_digits                                    numbers as digits (arithmetic stays learnable)
  unk 0, eos 1, no bos or pad                     one separator token between documents
  hard_vocab_limit off                            a small corpus gets the vocabulary it supports
                                                  instead of an error (read the real size back)
  input in corpus order, no shuffling             the same corpus gives the same model
"""
from __future__ import annotations

import io
import json
from itertools import chain
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from runkit.cpus import available_cores
from runkit.files import write_atomic

UNK_ID, EOS_ID = 0, 1
MAX_TRAINING_CHARS = 10_000_000  # beyond a few MB of text the merges barely change, the time does
MAX_LINE_CHARS = 4096  # sentencepiece skips longer input lines, so they are cut
END_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")

OPTIONS = dict(model_type="bpe", character_coverage=1.0, byte_fallback=True, split_digits=True,
               normalization_rule_name="identity", remove_extra_whitespaces=False, hard_vocab_limit=False,
               unk_id=UNK_ID, eos_id=EOS_ID, bos_id=-1, pad_id=-1, shuffle_input_sentence=False,
               max_sentence_length=4 * MAX_LINE_CHARS, minloglevel=2,
               num_threads=16)  # fixed: the model file records it, and the pieces do not depend on it


class Tokenizer:
    """encode/encode_batch (the text's tokens, no special ones), decode (special tokens
    dropped), frame (documents' tokens), vocab_size (every id is below it), eos_id, prefix,
    and `files`: the files that define it."""

    vocab_size: int
    eos_id: int
    prefix: tuple[int, ...]
    files: tuple[Path, ...]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def frame(self, texts: Sequence[str], dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, ends): the documents' framed tokens one after another, and where each ends
        (exclusive offsets)."""
        encoded = self.encode_batch(texts)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ends = np.cumsum(lengths + len(self.prefix) + 1)
        starts = ends - lengths - len(self.prefix) - 1
        out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dtype)
        text = np.ones(len(out), dtype=bool)
        for i, token in enumerate(self.prefix):
            out[starts + i], text[starts + i] = token, False
        out[ends - 1], text[ends - 1] = self.eos_id, False
        out[text] = np.fromiter(chain.from_iterable(encoded), dtype=dtype, count=int(lengths.sum()))
        return out, ends

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({str(self.files[0])!r}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id}, prefix={list(self.prefix)})")


class SentencePiece(Tokenizer):
    def __init__(self, path: Path):
        import sentencepiece as spm

        try:
            self.processor = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{path} is not a sentencepiece model: {e}") from e
        self.files = defining_files(path)
        self.vocab_size = self.processor.get_piece_size()
        self.eos_id = self.processor.eos_id()
        if self.eos_id < 0:
            raise ValueError(f"{path}: the sentencepiece model has no end-of-document (eos) id; train it with "
                             "eos_id set")
        self.prefix = (self.processor.bos_id(),) if self.processor.bos_id() >= 0 else ()

    def encode_batch(self, texts):
        return self.processor.encode(list(texts), num_threads=min(16, available_cores()))

    def decode(self, ids) -> str:
        return self.processor.decode(_ints(ids))


class HuggingFace(Tokenizer):
    def __init__(self, path: Path, documents: bool = True):
        from tokenizers import Tokenizer as Rust

        try:
            self.rust = Rust.from_file(str(path))
        except Exception as e:   # the library raises a bare Exception for a damaged file
            raise ValueError(f"{path} is not a Hugging Face tokenizer.json: {e}") from e
        # a file saved with padding or truncation on would pad each document of a batch to the
        # longest and cut the long ones: whole documents, one at a time, are what is framed
        self.rust.no_padding()
        self.rust.no_truncation()
        self.files = defining_files(path)
        config_path = path.with_name("tokenizer_config.json")
        config = json.loads(config_path.read_text()) if config_path in self.files else {}
        vocab = self.rust.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        bare = self.rust.encode("a", add_special_tokens=False).ids
        full = self.rust.encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
        self.prefix, suffix = tuple(full[:at]), full[at + len(bare):]
        named = config.get("eos_token")
        named = named.get("content") if isinstance(named, dict) else named
        if named is not None:
            if named not in vocab:
                raise ValueError(f"{config_path}: eos_token {named!r} is not in {path.name}'s vocabulary")
            self.eos_id = vocab[named]
        elif suffix:
            self.eos_id = suffix[-1]
        else:
            found = [t for t in END_TOKENS if t in vocab]
            if not found and documents:
                raise ValueError(f"{path}: no end-of-document token: no tokenizer_config.json naming eos_token "
                                 f"beside it, no special token its template appends, none of {list(END_TOKENS)} "
                                 "in its vocabulary")
            self.eos_id = vocab[found[0]] if found else None
        self._batch = getattr(self.rust, "encode_batch_fast", self.rust.encode_batch)   # fast: no offsets

    def encode_batch(self, texts):
        return [e.ids for e in self._batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.rust.decode(_ints(ids), skip_special_tokens=True)


def _ints(ids) -> list[int]:
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def locate(path) -> Path:
    """The file a tokenizer path means: the file itself, or a directory's tokenizer.json
    (else its tokenizer.model)."""
    path = Path(path)
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"{path} holds no tokenizer.json or tokenizer.model")
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path} (expected a tokenizer.json, a sentencepiece .model, or a "
                                "directory holding one)")
    return path


def defining_files(path) -> tuple[Path, ...]:
    """The files that make the tokenizer at `path` what it is: its file, and beside a
    tokenizer.json its tokenizer_config.json (which may name the end-of-document token)."""
    path = locate(path)
    config = path.with_name("tokenizer_config.json")
    return (path, config) if path.suffix == ".json" and config.is_file() else (path,)


def named_files(path) -> list[tuple[str, Path]]:
    """The files defining the tokenizer at `path`, each with the name load() looks for in a
    directory: what a directory that carries it (a prepared corpus, token shards, an
    exported model) copies."""
    main, *rest = defining_files(path)
    return [("tokenizer.json" if main.suffix == ".json" else "tokenizer.model", main), *((f.name, f) for f in rest)]


def load(path, documents: bool = True) -> Tokenizer:
    """The tokenizer at `path`: a tokenizer.json, a sentencepiece model, or a directory
    holding one (see the module's docstring). documents=False: for text alone (generation),
    a tokenizer.json without an end-of-document token is taken (its eos_id is None)."""
    path = locate(path)
    return HuggingFace(path, documents) if path.suffix == ".json" else SentencePiece(path)


def training_sample(documents: Sequence[str], max_chars: int = MAX_TRAINING_CHARS) -> list[str]:
    """Every k-th document, k the smallest that brings the sample to about max_chars: spread over
    the whole corpus, unlike a prefix."""
    total = sum(len(d) for d in documents)
    stride = max(1, -(-total // max_chars))
    return list(documents[::stride])


def _lines(documents: Sequence[str]) -> Iterator[str]:
    # Sentencepiece learns from lines; newlines themselves are left to byte fallback.
    for document in documents:
        for line in document.split("\n"):
            for start in range(0, len(line), MAX_LINE_CHARS):
                yield line[start:start + MAX_LINE_CHARS]


def train(documents: Sequence[str], vocab_size: int, path: Path) -> None:
    """Train on (a sample of) the documents and write the model to `path` atomically."""
    import sentencepiece as spm

    model = io.BytesIO()
    lines = (line for line in _lines(training_sample(documents)) if line.strip())
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=lines, model_writer=model, vocab_size=vocab_size,
                                       **OPTIONS)
    except RuntimeError as e:
        raise ValueError(f"sentencepiece could not train a tokenizer with vocab_size={vocab_size}: {e}") from e
    write_atomic(Path(path), model.getvalue())
