"""Per-rank training and evaluation batches from a token array.

The array is cut into non-overlapping windows of seq_len + 1 tokens (input and its
next-token target). Training visits the windows in a random order, a fresh permutation per
epoch drawn from (seed, epoch), and the order runs on across epochs. Step s takes the next
G = world * micro_batch * accumulation windows of that order, a set that depends only on G,
not on how it is divided, so runs on 2 and on 4 ranks see the same data per step. Inside a
step, micro-batch m of rank r is positions [(m * world + r) * micro_batch, + micro_batch):
each micro-batch round spans all ranks. The whole state is the count of windows consumed.
"""
from __future__ import annotations

import numpy as np
import torch


def _positive(**values) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")


def _check_tokens(tokens) -> None:
    if getattr(tokens, "ndim", None) != 1:
        raise ValueError(f"tokens must be a 1-D array of token ids, got {type(tokens).__name__} "
                         f"with shape {getattr(tokens, 'shape', None)}")


def _check_rank(rank, world) -> None:
    _positive(world=world)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")


def _pairs(tokens: np.ndarray, windows: np.ndarray, seq_len: int, micro_batch: int):
    """(x, y) int64 tensors of shape [micro_batch, seq_len] for each run of micro_batch windows."""
    rows = np.stack([np.asarray(tokens[w * seq_len:w * seq_len + seq_len + 1], dtype=np.int64) for w in windows])
    rows = torch.from_numpy(rows).view(-1, micro_batch, seq_len + 1)
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]


class Batches:
    """Training batches of one rank; deterministic in (tokens, seed, global batch), resumable."""

    waited_s = 0.0   # the memory-mapped tokens are read as the step asks: nothing runs ahead to wait for

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch: int, accumulation: int, rank: int,
                 world: int, seed: int, corpus: str = ""):
        """`corpus`: what the tokens are (a prepared directory's name: a digest of its
        documents, tokenizer and vocabulary), kept in the state so that a resume over
        another corpus is refused."""
        _check_tokens(tokens)
        _positive(seq_len=seq_len, micro_batch=micro_batch, accumulation=accumulation)
        _check_rank(rank, world)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.tokens, self.seq_len, self.micro_batch, self.accumulation = tokens, seq_len, micro_batch, accumulation
        self.rank, self.world, self.seed, self.corpus = rank, world, seed, corpus
        self.global_batch = world * micro_batch * accumulation
        self.windows = (len(tokens) - 1) // seq_len if len(tokens) else 0
        if self.windows < self.global_batch:
            raise ValueError(f"{len(tokens)} tokens make {self.windows} windows of {seq_len}+1 tokens, fewer than "
                             f"one global batch of {self.global_batch} (world {world} x micro_batch {micro_batch} "
                             f"x accumulation {accumulation}); it needs at least {self.global_batch * seq_len + 1} "
                             f"tokens: more data, or a smaller seq_len or batch")
        self.consumed = 0
        self._order = (-1, None)  # (epoch, permutation), the permutation last used

    @property
    def epoch(self) -> int:
        """The epoch of the next window to be read."""
        return self.consumed // self.windows

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.windows))
        return self._order[1]

    def _window(self, position: int) -> int:
        epoch, index = divmod(position, self.windows)
        return int(self._permutation(epoch)[index])

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`accumulation` (x, y) micro-batches of this rank for the next step; y is x shifted by one."""
        positions = [self.consumed + (m * self.world + self.rank) * self.micro_batch + i
                     for m in range(self.accumulation) for i in range(self.micro_batch)]
        windows = np.array([self._window(p) for p in positions])
        self.consumed += self.global_batch
        return _pairs(self.tokens, windows, self.seq_len, self.micro_batch)

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "seq_len": self.seq_len, "corpus": self.corpus}

    def close(self) -> None:
        """Nothing to release (StreamingBatches stops its workers)."""

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.seed:
            raise ValueError(f"batch state was saved with seed {state.get('seed')!r}, these batches use seed "
                             f"{self.seed}: resuming would visit other data")
        # (states saved before these were kept have neither: taken as they come)
        if state.get("seq_len", self.seq_len) != self.seq_len:
            raise ValueError(f"batch state was saved with seq_len {state['seq_len']}, these batches use "
                             f"{self.seq_len}: its position counts windows of the saved length, so resuming would "
                             "read some data twice and some never")
        if state.get("corpus", self.corpus) != self.corpus:
            raise ValueError(f"batch state was saved over the corpus {state['corpus']!r}, these batches read "
                             f"{self.corpus!r} (another tokenizer, vocabulary or set of documents): resuming would "
                             "read other data")
        consumed = state.get("consumed")
        if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
            raise ValueError(f"batch state: consumed must be a non-negative int, got {consumed!r}")
        self.consumed = consumed


def eval_batches(tokens: np.ndarray, seq_len: int, micro_batch: int, rank: int, world: int,
                 count: int) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """This rank's part of the validation set: `count` fixed micro-batches, the same set
    whatever the world size, so validation losses compare across runs on any number of ranks.
    Micro-batch b is windows [b * micro_batch, + micro_batch) in order, wrapping around a
    small split; rank r takes micro-batches r, r + world, ... Every rank gets
    ceil(count / world) entries (x, y, counted), since a sharded model's forward is collective
    and the ranks must run as many: a rank short of one repeats its first micro-batch (or
    the set's first) with counted False, to be left out of the sum."""
    _check_tokens(tokens)
    _positive(seq_len=seq_len, micro_batch=micro_batch, count=count)
    _check_rank(rank, world)
    windows = (len(tokens) - 1) // seq_len if len(tokens) else 0
    if windows == 0:
        raise ValueError(f"the evaluation split has {len(tokens)} tokens, fewer than one window of seq_len + 1 = "
                         f"{seq_len + 1}: hold out more data (data.val_fraction; data.val_documents for data=files) or "
                         "use a smaller seq_len")
    mine = list(range(rank, count, world))
    filler = mine[0] if mine else 0
    batches = mine + [filler] * (-(-count // world) - len(mine))
    positions = [b * micro_batch + i for b in batches for i in range(micro_batch)]
    pairs = _pairs(tokens, np.array(positions) % windows, seq_len, micro_batch)
    return [(x, y, i < len(mine)) for i, (x, y) in enumerate(pairs)]
