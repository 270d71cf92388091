"""A schedule run with compression, collective-level (the OSU design): what each step
encodes, forwards, keeps encoded, decodes and reduces, derived from the schedule alone.

Blocks travel as their encodings. Per block, a rank knows whether it holds a valid
encoding of the block's current value (it encoded it, or received it by a plain copy) and
whether its buffer holds that value or only the encoding. The rules, for every algorithm:

  send            forward the block's encoding; encode the current value first only when
                  there is no valid encoding (so an all-gather block is encoded once, by
                  its owner, and forwarded unchanged by everyone else; a reduction's partial
                  sum is encoded at each step, as the paper's Algorithms 1 and 2)
  receive (copy)  keep the encoding; do not decode (it may be forwarded again)
  receive-reduce  decode-and-reduce into the buffer; first decode a block held only
                  encoded, or one whose value this rank encoded itself (and sent): then
                  both partners of an exchange (recursive doubling) add the same two
                  decodings and hold the same sum; the block's old encoding is no longer valid
  end             decode what is held only encoded; a block whose current value went out
                  encoded is replaced by the decoding of that encoding, so every rank holds
                  what the others decoded (all-gather outputs are identical on every rank,
                  and so are the all-gather phases of a ring all-reduce); an all-reduce's
                  block whose value is a sum computed here (recursive doubling's last
                  exchange) is sealed: encoded and replaced by its decoding, as the ranks a
                  folded schedule sends it to hold it, so every rank ends with the same values

Only the blocks a collective's result holds are finished (reduce-scatter: this rank's).

`per_message=True` is the baseline the OSU paper measures against, compression per
point-to-point message: every send encodes what it sends, every receive decodes at once,
so a forwarded block is decoded and encoded again at every hop (and its error grows).
The symbolic verifier (pccl.analysis.verify.verify_compressed) runs these plans on all
ranks: every block encoded where it must be, never decoded twice, the right result.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from pccl.ir.schedule import Kind, Schedule, Transfer

# The actions of CompressedSchedule.ops, the table the C++ executor runs (csrc/comm.cpp).
SEND, KEEP, REDUCE, ENCODE, THAW, UNPACK, FINISH = range(7)


@dataclass(frozen=True)
class CompressedStep:
    encode: tuple[int, ...]          # blocks encoded from the buffer before the step's messages
    sends: tuple[Transfer, ...]      # each block travels as its encoding
    keeps: tuple[Transfer, ...]      # plain receives: the encodings are kept, not decoded
    thaw: tuple[int, ...]            # blocks held only encoded, or encoded by this rank, decoded into the
                                     # buffer before a reduction lands on them
    reduces: tuple[Transfer, ...]    # decode-and-reduce into the buffer
    unpack: bool = False             # plain receives are decoded on arrival (per message), not kept


@dataclass(frozen=True)
class CompressedSchedule:
    schedule: Schedule
    steps: tuple[CompressedStep, ...]
    decode: tuple[int, ...]   # at the end: held only encoded, decoded into the buffer
    settle: tuple[int, ...]   # at the end: sent encoded and unchanged since, replaced by the decoding
    seal: tuple[int, ...] = ()   # at the end: an all-reduce's sum computed here, encoded and decoded

    @cached_property
    def ops(self) -> np.ndarray:
        """Flat int64 table, one row per action: (step, action, peer, first block, block
        count), peer -1 for local actions. Per step: ENCODE (each block on its own), then
        the receives (KEEP, REDUCE, or UNPACK per message), the SENDs, then THAW; the
        end's ENCODE (seal) and FINISH rows (decode, settle, seal) form one last step. Messages carry runs of
        blocks, their encodings back to back."""
        rows = []
        for i, step in enumerate(self.steps):
            rows += [(i, ENCODE, -1, b, 1) for b in step.encode]
            for kind, transfers in ((UNPACK if step.unpack else KEEP, step.keeps), (REDUCE, step.reduces),
                                    (SEND, step.sends)):
                rows += [(i, kind, t.peer, first, count) for t in transfers for first, count in t.runs]
            rows += [(i, THAW, -1, b, 1) for b in step.thaw]
        rows += [(len(self.steps), ENCODE, -1, b, 1) for b in self.seal]
        rows += [(len(self.steps), FINISH, -1, b, 1) for b in sorted({*self.decode, *self.settle, *self.seal})]
        return np.asarray(rows, dtype=np.int64).reshape(-1, 5)


def result_blocks(sched: Schedule) -> tuple[int, ...]:
    """The blocks the collective's result holds on this rank."""
    return (sched.rank,) if sched.collective == "reduce_scatter" else tuple(range(sched.size))


@lru_cache(maxsize=1024)
def compress(sched: Schedule, per_message: bool = False) -> CompressedSchedule:
    if per_message:
        steps = tuple(CompressedStep(tuple(sorted({b for t in step if t.kind == Kind.SEND for b in t.blocks})),
                                     tuple(t for t in step if t.kind == Kind.SEND),
                                     tuple(t for t in step if t.kind == Kind.RECV), (),
                                     tuple(t for t in step if t.kind == Kind.RECV_REDUCE), unpack=True)
                      for step in sched.steps)
        return CompressedSchedule(sched, steps, (), ())
    encoded: set[int] = set()     # blocks with a valid encoding of their current value
    frozen: set[int] = set()      # blocks whose buffer lacks the current value (encoding only)
    own: set[int] = set()         # valid encodings this rank made itself from its buffer
    steps = []
    for step in sched.steps:
        sends = tuple(t for t in step if t.kind == Kind.SEND)
        keeps = tuple(t for t in step if t.kind == Kind.RECV)
        reduces = tuple(t for t in step if t.kind == Kind.RECV_REDUCE)
        encode = tuple(sorted({b for t in sends for b in t.blocks} - encoded))
        encoded.update(encode)
        own.update(encode)
        reduced = {b for t in reduces for b in t.blocks}
        thaw = tuple(sorted(reduced & (frozen | own)))
        frozen -= reduced
        encoded -= reduced
        own -= reduced
        for t in keeps:
            encoded.update(t.blocks)
            frozen.update(t.blocks)
            own.difference_update(t.blocks)
        steps.append(CompressedStep(encode, sends, keeps, thaw, reduces))
    wanted = set(result_blocks(sched))
    seal = wanted - frozen - own if sched.collective == "all_reduce" and sched.steps else set()
    return CompressedSchedule(sched, tuple(steps), tuple(sorted(frozen & wanted)), tuple(sorted(own & wanted)),
                              tuple(sorted(seal)))
