"""Training batches streamed from a corpus on disk: read in shares, tokenized in worker
processes, packed into sequences, resumable exactly at any world size.

    batches = StreamingBatches(corpus, seq_len, micro_batch, accumulation, rank, world, seed,
                               streams=4, workers=1)
    batches.next_step()                       # [(x, y)] * accumulation, as Batches gives
    state = batches.state_dict()              # this rank's streams' positions
    batches.load_state_dict(every_ranks)      # before reading: continue from them

The corpus is read as `streams` streams, a number fixed for the run (default: the world size
it started with; a resumed run takes the saved one). Stream s reads its own share of every
source's pieces (feed.py), draws each next document's source from the mixture's weights with
a generator keyed by (seed, s, the document's number), and packs the documents' tokens, each
framed by the tokenizer, one after another into rows of seq_len + 1 tokens; a row starts on
the last token of the one before, so every token is a target once. Step k takes rows [k R,
(k + 1) R) of every stream, R = global batch / streams, and rank r reads streams r, r +
world, ...: the step's set of rows depends on the global batch and the streams, not on the
world size or the workers. A rank needs no other rank's documents, and no process holds the
corpus.

A stream's position is the document its next row starts in (the number of documents drawn
before it and every source's reading position then: epoch, piece, record) and the token
offset in it: a few integers (state_dict), saved with every checkpoint, from which a
stream reads on exactly, on whichever rank owns it.

The first `val_documents` documents of the first source's first file are held out: the
validation split (validation()), never read for training.
"""
from __future__ import annotations

import hashlib
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from shard.data import readers, tokenizer
from shard.data.feed import FeedSpec, Position, framed
from shard.data.workers import Feeds

DRAWS = 4096   # mixture draws made at a time (one generator per block of documents)


@dataclass(frozen=True)
class Corpus:
    """Sources (each a tuple of path patterns, see readers.py) mixed by `weights`."""
    sources: tuple
    weights: tuple
    field: str
    tokenizer: str
    val_documents: int

    def __post_init__(self):
        if not self.sources or any(not s for s in self.sources):
            raise ValueError(f"a corpus needs at least one source, each with paths, got {self.sources!r}")
        if len(self.weights) != len(self.sources) or any(not w > 0 for w in self.weights):
            raise ValueError(f"data.weights must be one positive number per source ({len(self.sources)}), "
                             f"got {list(self.weights)!r}")
        if isinstance(self.val_documents, bool) or not isinstance(self.val_documents, int) or self.val_documents < 1:
            raise ValueError(f"data.val_documents must be an int >= 1, got {self.val_documents!r}")

    @classmethod
    def of(cls, spec: dict, tokenizer_path) -> "Corpus":
        """The corpus of a normalized data spec of source "files" (spec.py): with weights,
        each path a source; without, the paths one source."""
        weights = spec["weights"]
        sources = tuple((p,) for p in spec["paths"]) if weights else (tuple(spec["paths"]),)
        return cls(sources, tuple(weights or (1.0,)), spec["field"], str(tokenizer_path), spec["val_documents"])


def _check(world: int, micro_batch: int, accumulation: int, streams: int) -> int:
    """Rows each stream gives per step; or ValueError saying which numbers do not fit."""
    rows = world * micro_batch * accumulation
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"data.streams must be an int >= 1, got {streams!r}")
    if streams % world or rows % streams:
        raise ValueError(f"the corpus is read as {streams} streams, which {world} ranks cannot share with a global "
                         f"batch of {rows} sequences: the streams must be a multiple of the world size and divide "
                         "the global batch (data.streams is fixed when a run starts; a run resumed at another world "
                         "size keeps its streams)")
    return rows // streams


class Stream:
    """One stream: the mixture's draws and the packing, over its feeds (one per source)."""

    def __init__(self, index: int, weights: tuple, feeds: Feeds, keys: list, seed: int, state: list[int]):
        self.index, self.feeds, self.keys, self.seed = index, feeds, keys, seed
        self.p = np.asarray(weights, dtype=np.float64) / sum(weights)
        self.n, offset = state[0], state[1]
        self.positions = [Position(*state[2 + 3 * x:5 + 3 * x]) for x in range(len(keys))]
        self.current: list[Optional[tuple]] = [None] * len(keys)   # per source: (chunk, next document)
        self.pending: deque = deque()   # [tokens, state before it] of the documents being packed
        self.offset = 0                 # where the next row starts in pending[0]
        self.buffered = 0               # tokens in pending beyond offset
        self._block = (-1, None)
        if offset:
            self._draw()
            self.offset, self.buffered = offset, self.buffered - offset

    def _source(self, n: int) -> int:
        if len(self.p) == 1:
            return 0
        block, at = divmod(n, DRAWS)
        if self._block[0] != block:
            rng = np.random.default_rng([self.seed, self.index, block])
            self._block = (block, rng.choice(len(self.p), size=DRAWS, p=self.p))
        return int(self._block[1][at])

    def _state(self) -> list[int]:
        return [self.n, 0, *(v for p in self.positions for v in p)]

    def _draw(self) -> None:
        """The next document of the mixture into pending."""
        before = self._state()
        x = self._source(self.n)
        if self.current[x] is None or self.current[x][1] == len(self.current[x][0].ends):
            self.current[x] = (self.feeds.next(self.keys[x]), 0)
        chunk, i = self.current[x]
        start = int(chunk.ends[i - 1]) if i else 0
        tokens = chunk.tokens[start:int(chunk.ends[i])]
        self.current[x] = (chunk, i + 1)
        self.positions[x] = Position(chunk.epoch, chunk.index, int(chunk.after[i]))
        self.n += 1
        self.pending.append((tokens, before))
        self.buffered += len(tokens)

    def rows(self, count: int, seq_len: int) -> np.ndarray:
        out = np.empty((count, seq_len + 1), dtype=np.int64)
        for r in range(count):
            while self.buffered < seq_len + 1:
                self._draw()
            filled, at, doc = 0, self.offset, 0
            while filled < seq_len + 1:
                tokens = self.pending[doc][0]
                take = min(len(tokens) - at, seq_len + 1 - filled)
                out[r, filled:filled + take] = tokens[at:at + take]
                filled, at, doc = filled + take, 0, doc + 1
            self.offset += seq_len
            self.buffered -= seq_len
            while self.pending and self.offset >= len(self.pending[0][0]):
                self.offset -= len(self.pending.popleft()[0])
        return out

    def state(self) -> list[int]:
        """Where the next row starts: [documents drawn before its document, token offset in
        it, then each source's (epoch, piece, record) when that document was drawn]."""
        if not self.pending:
            return self._state()
        before = list(self.pending[0][1])
        before[1] = self.offset
        return before


class StreamingBatches:
    """Training batches of one rank from a Corpus (module docstring)."""

    def __init__(self, corpus: Corpus, seq_len: int, micro_batch: int, accumulation: int, rank: int, world: int,
                 seed: int, streams: Optional[int] = None, workers: int = 1):
        self.corpus, self.seq_len, self.micro_batch, self.accumulation = corpus, seq_len, micro_batch, accumulation
        self.rank, self.world, self.seed, self.workers = rank, world, seed, workers
        self.tokenizer = tokenizer.load(corpus.tokenizer)
        self._tokenizer_files = [f.read_bytes() for f in self.tokenizer.files]
        # positions are token offsets in documents: what they are offsets of
        self.tokenizer_digest = hashlib.sha256(b"".join(self._tokenizer_files)).hexdigest()
        self.files = [readers.files(list(s)) for s in corpus.sources]   # globbed (a Hub dataset: listed) once
        self.identity = [readers.identity(found) for found in self.files]
        for found in self.files:
            readers.check_field(found, corpus.field)
        self._check_token_directories()
        self._given = streams
        self._feeds: Optional[Feeds] = None
        self._streams: list[Stream] = []
        self._configure(world if streams is None else streams)
        self.held_out, self._validation = self._hold_out()

    def _check_token_directories(self) -> None:
        """A pre-tokenized source must have been tokenized by this run's tokenizer."""
        for found in self.files:
            for path in found:
                if readers.kind_of(path) == "tokens" and [f.read_bytes() for f in tokenizer.load(path).files] != \
                        self._tokenizer_files:
                    raise readers.CorpusError(f"{path} was tokenized with another tokenizer than "
                                              f"{self.corpus.tokenizer} (data.tokenizer): its tokens mean other text")

    def _configure(self, streams: int) -> None:
        self.per_stream = _check(self.world, self.micro_batch, self.accumulation, streams)
        self.streams = streams
        self.pieces = [tuple(readers.split(readers.pieces_of(found), streams)) for found in self.files]
        self.mine = list(range(self.rank, streams, self.world))
        self._states = {s: [0] * (2 + 3 * len(self.corpus.sources)) for s in self.mine}

    def _hold_out(self) -> tuple[tuple[str, int], np.ndarray]:
        first = self.files[0][0]
        documents = []
        groups = None   # of a token directory: the shards of its first input file, as in the text
        if readers.kind_of(first) == "tokens":
            inputs = readers.token_inputs(first)
            groups = {g for g, source in enumerate(inputs) if source == inputs[0]}

        def of_first(p: readers.Piece) -> bool:
            return p.path == str(first) and (groups is None or p.group in groups)
        for piece in (p for p in self.pieces[0] if of_first(p) and p.stride[0] == 0):
            whole = readers.Piece(piece.path, piece.kind, piece.rows, piece.group)
            wanted = self.corpus.val_documents - len(documents)
            documents += list(zip(range(wanted), readers.read(whole, self.corpus.field)))
            if len(documents) == self.corpus.val_documents:
                break
        if not documents:
            raise readers.CorpusError(f"{first}: no documents to hold out for validation")
        if len(documents) < self.corpus.val_documents and all(of_first(p) for found in self.pieces for p in found):
            raise readers.CorpusError(f"data.val_documents={self.corpus.val_documents} holds out all {len(documents)} "
                                      f"documents of {first}, the corpus' only file: none is left to train on; "
                                      "lower data.val_documents or add files")
        if len(documents) < self.corpus.val_documents:
            warnings.warn(f"data.val_documents={self.corpus.val_documents}, but the first file {first} holds "
                          f"{len(documents)}: validation takes those, and training reads none of that file",
                          stacklevel=2)
        tokens, _ = framed([d for _, (_, d) in documents], self.tokenizer, np.int64)
        return (str(first), documents[-1][1][0] + 1), tokens

    def validation(self) -> np.ndarray:
        """The held-out documents' tokens, framed, one after another (for eval_batches)."""
        return self._validation

    def _start(self) -> None:
        self._feeds = Feeds(self.workers)
        for s in self.mine:
            keys = []
            for x, pieces in enumerate(self.pieces):
                spec = FeedSpec(pieces, self.corpus.field, self.corpus.tokenizer, self.seed, x, s, self.streams,
                                self.held_out)
                state = self._states[s]
                self._feeds.add((s, x), spec, Position(*state[2 + 3 * x:5 + 3 * x]))
                keys.append((s, x))
            self._streams.append(Stream(s, self.corpus.weights, self._feeds, keys, self.seed, self._states[s]))

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`accumulation` (x, y) micro-batches of [micro_batch, seq_len] int64 tokens."""
        if self._feeds is None:
            self._start()
        rows = torch.from_numpy(np.concatenate([s.rows(self.per_stream, self.seq_len) for s in self._streams]))
        rows = rows.view(self.accumulation, self.micro_batch, self.seq_len + 1)
        return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]

    @property
    def epoch(self) -> int:
        """The most epochs any source of this rank's streams has begun."""
        states = [s.state() for s in self._streams] if self._streams else list(self._states.values())
        return max(v for state in states for v in state[2::3])

    @property
    def waited_s(self) -> float:
        """Time the training process spent getting tokens: waiting for its workers (or, with
        none, tokenizing)."""
        return self._feeds.waited_s if self._feeds else 0.0

    def state_dict(self) -> dict:
        """This rank's streams' positions, and what they are positions in."""
        states = {s: stream.state() for s, stream in zip(self.mine, self._streams)} if self._streams else self._states
        return {"streams": self.streams, "seed": self.seed, "corpus": self.identity, "tokenizer": self.tokenizer_digest,
                "pieces": [len(p) for p in self.pieces],
                "positions": {str(s): list(map(int, v)) for s, v in states.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`: every stream's position (the merge of all ranks'
        state_dict()s), before the first next_step()."""
        if self._feeds is not None:
            raise RuntimeError("load_state_dict must come before the first next_step()")
        if self._given is None and state.get("streams") != self.streams:   # the run's own, from its start
            self._configure(state["streams"])
        for key, mine in (("streams", self.streams), ("seed", self.seed)):
            if state.get(key) != mine:
                raise ValueError(f"the data position was saved with {key} {state.get(key)!r}, this run has {mine!r}: "
                                 "resuming would read other data")
        if state.get("tokenizer", self.tokenizer_digest) != self.tokenizer_digest:   # (absent: saved before 2026-11-28)
            raise ValueError("the data position was saved with another tokenizer (data.tokenizer): its positions are "
                             "token offsets in that tokenizer's documents, so resuming would read other data")
        if state.get("corpus") != self.identity:
            raise ValueError("the corpus changed since the data position was saved (a file added, removed or "
                             "modified): resuming would read other data")
        pieces = [len(p) for p in self.pieces]
        if state.get("pieces", pieces) != pieces:   # a position is an index into them
            raise ValueError(f"the data position was saved with the sources cut into {state['pieces']} pieces, "
                             f"this run cuts them into {pieces} (another version of shard/data/readers.py's "
                             "split): resuming would read other data")
        positions = state["positions"]
        missing = [s for s in self.mine if str(s) not in positions]
        if missing:
            raise ValueError(f"the data position has no state for streams {missing}")
        self._states = {s: list(positions[str(s)]) for s in self.mine}

    def close(self) -> None:
        if self._feeds is not None:
            self._feeds.close()
