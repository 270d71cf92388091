"""A SentencePiece BPE tokenizer trained on the corpus, or a given one.

Settings, chosen for lossless, deterministic tokenization:
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
from pathlib import Path
from typing import Iterator, Sequence

import sentencepiece as spm

from runkit.files import write_atomic

UNK_ID, EOS_ID = 0, 1
MAX_TRAINING_CHARS = 10_000_000  # beyond a few MB of text the merges barely change, the time does
MAX_LINE_CHARS = 4096  # sentencepiece skips longer input lines, so they are cut

OPTIONS = dict(model_type="bpe", character_coverage=1.0, byte_fallback=True, split_digits=True,
               normalization_rule_name="identity", remove_extra_whitespaces=False, hard_vocab_limit=False,
               unk_id=UNK_ID, eos_id=EOS_ID, bos_id=-1, pad_id=-1, shuffle_input_sentence=False,
               max_sentence_length=4 * MAX_LINE_CHARS, minloglevel=2,
               num_threads=16)  # fixed: the model file records it, and the pieces do not depend on it


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
    model = io.BytesIO()
    lines = (line for line in _lines(training_sample(documents)) if line.strip())
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=lines, model_writer=model, vocab_size=vocab_size,
                                       **OPTIONS)
    except RuntimeError as e:
        raise ValueError(f"sentencepiece could not train a tokenizer with vocab_size={vocab_size}: {e}") from e
    write_atomic(Path(path), model.getvalue())


def load(path) -> spm.SentencePieceProcessor:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no sentencepiece model at {path}")
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as e:
        raise ValueError(f"{path} is not a sentencepiece model: {e}") from e
