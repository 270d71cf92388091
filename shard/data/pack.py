"""Tokenize documents once into flat token files that training memory-maps.

train.bin and val.bin are raw little-endian arrays of token ids (uint16 when the vocabulary
fits, else uint32), each document framed by the tokenizer (tokenizer.py: its prefix, its
tokens, the end-of-document id). The last `val_fraction` of the documents (at least one) are
the validation split, so the two splits share no document. The files are little-endian whatever the machine.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

ENCODE_BATCH = 1024  # documents per encode call: both tokenizer libraries spread a batch over threads


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def split_point(documents: int, val_fraction: float) -> int:
    """Index of the first validation document."""
    if documents < 2:
        raise ValueError(f"need at least 2 documents (one for training, one for validation), got {documents}")
    val = min(documents - 1, max(1, round(documents * val_fraction)))
    return documents - val


def _write_tokens(path: Path, documents: Sequence[str], tok, dtype: np.dtype) -> int:
    count = 0
    with open(path, "wb") as f:
        for start in range(0, len(documents), ENCODE_BATCH):
            ids, _ = tok.frame(documents[start:start + ENCODE_BATCH], dtype)
            f.write(ids.tobytes())
            count += len(ids)
        f.flush()
        os.fsync(f.fileno())
    return count


def pack(documents: Sequence[str], tok, directory: Path, val_fraction: float) -> dict:
    """Write train.bin and val.bin into `directory` with the Tokenizer `tok`; returns what
    meta.json records of them."""
    dtype = token_dtype(tok.vocab_size)
    split = split_point(len(documents), val_fraction)
    return {
        "dtype": dtype.name,  # read back as little-endian (tokens.py)
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "prefix": list(tok.prefix),
        "documents": {"train": split, "val": len(documents) - split},
        "tokens": {"train": _write_tokens(Path(directory) / "train.bin", documents[:split], tok, dtype),
                   "val": _write_tokens(Path(directory) / "val.bin", documents[split:], tok, dtype)},
    }
