"""A prepared data directory (prepare.py), opened for training: token splits memory-mapped,
the tokenizer loaded on first use."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shard.data import tokenizer as _tokenizer

SPLITS = ("train", "val")
DTYPES = ("uint16", "uint32")


class DataError(ValueError):
    """A prepared data directory that is damaged or unfinished."""


class TokenData:
    """`train` and `val`: read-only 1-D arrays of token ids, each document followed by
    `eos_id`; `vocab_size`: the tokenizer's vocabulary (ids are below it)."""

    def __init__(self, directory):
        self.directory = Path(directory)
        meta_path = self.directory / "meta.json"
        if not self.directory.is_dir():
            raise FileNotFoundError(f"no prepared data directory {self.directory} (make one with shard.data.prepare)")
        if not meta_path.is_file():
            raise DataError(f"{self.directory} has no meta.json: not a prepared data directory, or an unfinished one")
        try:
            self.meta = json.loads(meta_path.read_text())
            dtype = self.meta["dtype"]
            self.vocab_size = int(self.meta["vocab_size"])
            self.eos_id = int(self.meta["eos_id"])
            counts = {split: int(self.meta["tokens"][split]) for split in SPLITS}
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{meta_path} is damaged: {e!r}") from e
        if dtype not in DTYPES:
            raise DataError(f"{meta_path}: dtype {dtype!r}, expected one of {DTYPES}")
        dtype = np.dtype(dtype).newbyteorder("<")  # pack.py writes little-endian
        if not any((self.directory / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
            raise DataError(f"{self.directory} has no tokenizer (tokenizer.json or tokenizer.model)")
        for split in SPLITS:
            path = self.directory / f"{split}.bin"
            size = path.stat().st_size if path.is_file() else None
            if size != counts[split] * dtype.itemsize or counts[split] == 0:
                raise DataError(f"{path}: {size} bytes, meta.json says {counts[split]} {dtype.name} tokens "
                                f"({counts[split] * dtype.itemsize} bytes, and at least one)")
            setattr(self, split, np.memmap(path, dtype=dtype, mode="r", shape=(counts[split],)))
        self._tokenizer = None

    @property
    def tokenizer(self):
        """The tokenizer that made the tokens (shard.data.tokenizer.Tokenizer)."""
        if self._tokenizer is None:
            self._tokenizer = _tokenizer.load(self.directory)
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        """Text of token ids (a list, numpy array or tensor); special ids (eos) are dropped."""
        return self.tokenizer.decode(ids)

    def __repr__(self) -> str:
        return (f"TokenData({str(self.directory)!r}, vocab_size={self.vocab_size}, "
                f"train={len(self.train)} tokens, val={len(self.val)} tokens)")
