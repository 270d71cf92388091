"""One source's documents for one stream, tokenized, in chunks: what a tokenizing worker
process runs (workers.py), or the training process itself with data.workers=0.

Stream s of S reads, in epoch e, the pieces perm_e[s::S] of its source, perm_e a
permutation drawn from (seed, source, e): every stream its own share of the files, a new
order each epoch, and the same for any number of ranks and workers. Its position is
(epoch, index in that order, next record of that piece); a feed started at a position reads
on from exactly there.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple, Optional

import numpy as np

from shard.data import readers, tokenizer

CHUNK_DOCUMENTS = 256   # documents per chunk: one tokenizer batch, and what a worker sends at a time


class Position(NamedTuple):
    epoch: int
    index: int    # the piece's place in the stream's order of the epoch
    record: int   # the next record of that piece to read


@dataclass(frozen=True)
class FeedSpec:
    """Everything a feed needs, picklable (it is sent to a worker process)."""
    pieces: tuple                 # the source's pieces (readers.Piece), at least `streams` of them
    field: str
    tokenizer: str                # a path tokenizer.load takes
    seed: int
    source: int
    stream: int
    streams: int
    held_out: tuple = ("", 0)     # (path, records): the first records of that file are validation's
    dtype: str = "int32"


@dataclass
class Chunk:
    tokens: np.ndarray       # the documents' framed tokens, one after another
    ends: np.ndarray         # int64: where each document ends in `tokens` (exclusive)
    epoch: int
    index: int
    after: np.ndarray        # int64: each document's record index + 1 (where reading resumes after it)


def framed(documents: list, tok, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, ends) of documents as readers.read gives them: texts, framed by the
    Tokenizer `tok`; or a token directory's ids, framed when they were tokenized."""
    if documents and not isinstance(documents[0], str):
        return np.concatenate(documents).astype(dtype), np.cumsum([len(ids) for ids in documents])
    return tok.frame(documents, dtype=dtype)


def order(spec: FeedSpec, epoch: int) -> np.ndarray:
    """The pieces stream `spec.stream` reads in `epoch`, in order."""
    perm = np.random.default_rng([spec.seed, spec.source, epoch]).permutation(len(spec.pieces))
    return perm[spec.stream::spec.streams]


class Feed:
    def __init__(self, spec: FeedSpec, position: Position = Position(0, 0, 0), tok=None):
        self.spec, self.position = spec, Position(*position)
        self.tokenizer = tok or tokenizer.load(spec.tokenizer)
        self._order = (-1, None)
        self._records = None   # the open piece's (index, text) iterator
        self._gave = False     # whether the open piece gave documents
        self._empty = set()    # the pieces opened since the last document came that gave none

    def _piece(self, epoch: int, index: int) -> Optional[readers.Piece]:
        if self._order[0] != epoch:
            self._order = (epoch, order(self.spec, epoch))
        pieces = self._order[1]
        return self.spec.pieces[pieces[index]] if index < len(pieces) else None

    def next_chunk(self) -> Chunk:
        """Up to CHUNK_DOCUMENTS documents of one piece, from the position on."""
        while True:
            epoch, index, record = self.position
            piece = self._piece(epoch, index)
            if piece is None:
                self.position = Position(epoch + 1, 0, 0)
                continue
            if self._records is None:
                path, count = self.spec.held_out
                self._records = readers.read(piece, self.spec.field, record, count if piece.path == path else 0)
                self._gave = False
            documents = list(islice(self._records, CHUNK_DOCUMENTS))
            if documents:
                self._empty.clear()
                self._gave = True
                tokens, ends = framed([d for _, d in documents], self.tokenizer, self.spec.dtype)
                after = np.array([i + 1 for i, _ in documents], dtype=np.int64)
                self.position = Position(epoch, index, int(after[-1]))
                return Chunk(tokens, ends, epoch, index, after)
            self._records = None
            self.position = Position(epoch, index + 1, 0)
            if not self._gave:
                self._empty.add(piece)
            # a stream reads a share of the source's pieces each epoch, another share the next:
            # it has no documents only once every piece, opened since the last document came,
            # gave none (a piece that ran out after giving some did not)
            if len(self._empty) == len(set(self.spec.pieces)):
                raise readers.CorpusError(f"source {self.spec.source} has no documents for stream {self.spec.stream} "
                                          f"in its {len(self.spec.pieces)} piece(s) (from {self.spec.pieces[0].path})")
