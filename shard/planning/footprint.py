"""The engine's memory per rank, predicted by part, for a GPT under a strategy.

Held all the time (the model state; exactly what Engine.memory_report counts):
    parameters   each unit's P-scope shard in the compute dtype (padded: flat.py), where it
                 is a buffer of its own: where P and OS split a unit alike (a world of 1,
                 DDP, ZeRO-3, MiCS) the parameters are the fp32 master weights, counted
                 under optimizer
    gradients    each unit's OS-scope gradient in fp32 (the optimizer's, which sums the
                 micro-batches), and where the G scope is coarser than OS, a G-scope
                 accumulator in the reduce dtype besides. Held from the unit's first
                 reduction in a step to the update (as zero_grad(set_to_none=True) leaves
                 eager PyTorch's): with several micro-batches a step, from the first one's
                 backward on; with one, they arrive unit by unit during the backward
    optimizer    12 bytes per element of each unit's OS-scope shard (fp32 master, 2 moments)
A scope that does not split a buffer (one rank in it) is no sharding: such parameters are
never gathered (unless they are the master weights and the compute dtype is another: then
each use casts them, as a gather would), and gradients with such a G scope are summed
straight from autograd's.

Held while a micro-batch runs forward and backward, at two moments:
  the loss (the end of the forward: the loss, fused with the head, makes the head's
  gradients there, shard/models/loss.py):
    activations  what autograd keeps (shard/planning/activations.py), the head's gradients
                 included
    loss         the fused loss's working set: a chunk's logits and weight-gradient product,
                 and in a compute dtype narrower than fp32, the fp32 sum of the weight's
                 gradient besides the one kept (_loss_bytes)
    gathered     the root unit's full parameters (tied embeddings: gathered for the pass)
  a unit's backward (the head's activations are gone by then):
    activations  the rest, and with activation checkpointing one block's own while it is
                 recomputed
    gathered     the root's and the unit's full parameters and the `prefetch` units
                 gathered ahead of it (the largest such run; capped by prefetch_bytes).
                 Views of gathered parameters that autograd saves do not keep a unit's
                 buffer alive after its forward (Engine._pack): the backward gathers again
    reducing     gradients on their way to their shards: the root's, held for the whole
                 backward, and the largest unit's autograd .grad in the compute dtype, and
                 where gradients are reduced per micro-batch, the flat copies in the reduce
                 dtype that the reductions read: the engine lets REDUCING_AT_ONCE exist
                 (the one being reduced, the next one queued), counted as the largest
    workspace    the collective layer's landing buffer: at most one gradient buffer of the
                 largest unit reduced per micro-batch (a schedule receives at most its
                 whole input before reducing); none where the transport's own collective
                 reduces (landing_buffers=False: MPI's and NCCL's buffers are their own).
                 An upper bound: the Python and torch executors allocate it from torch for
                 the steps that receive; the C++ executor's is its own, grown to the
                 largest step's (for a ring, 1/p of the input) and kept between calls

Held while the optimizer steps (fused AdamW needs no scratch, the norm is a few scalars):
the largest per-step reduction's landing buffer and, in a reduce dtype other than fp32,
its result before the cast, for units whose accumulator is not the optimizer's gradient.

The peak is the model state (gradients included where a step has several micro-batches)
plus the largest of the three transients; with one micro-batch, the unit backward's is
the largest over the units of what is left of the activations and the gradients arrived,
and the update's holds every gradient. On GPUs the
collective library keeps buffers of its own outside torch's allocator (NCCL: a few
channels of NCCL_BUFFSIZE, 4 MiB each, per peer): the planner's headroom covers them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shard.engine.adamw import OPTIMIZER_BYTES
from shard.engine.config import PRECISIONS
from shard.engine.engine import REDUCING_AT_ONCE
from shard.engine.flat import FlatParams
from shard.engine.strategy import REPLICATED, Strategy
from shard.engine.units import MIN_SHARD_NUMEL, split_units
from shard.models.gpt import GPTConfig
from shard.models.loss import chunk_rows
from shard.planning.activations import FP32, activation_bytes, block_bytes, head_bytes

ROOT = "<root>"


@dataclass(frozen=True)
class UnitSize:
    name: str
    numel: int


def unit_sizes(model: torch.nn.Module, units=None) -> list[UnitSize]:
    """The model's units (as Engine cuts them) and their elements; a meta-device model costs
    nothing to build."""
    return [UnitSize(u.name, u.numel) for u in split_units(model, units)]


def _padded(numel: int, world: int) -> int:
    return FlatParams.padded_length(numel, world)


def _element(precision: str) -> int:
    return PRECISIONS[precision].itemsize


def model_state(sizes: list[UnitSize], strategy: Strategy, world: int, group: int, precision: str = "fp32",
                reduce_dtype: str = "fp32", min_shard_numel: int = MIN_SHARD_NUMEL) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer"}: bytes per rank, as Engine.memory_report's
    P, G and OS (units below min_shard_numel stay replicated)."""
    strategy.check_group(world, group)
    out = {"parameters": 0, "gradients": 0, "optimizer": 0}
    for u in sizes:
        s = strategy if u.numel >= min_shard_numel else REPLICATED
        padded = _padded(u.numel, world)
        os_numel = padded // s.optimizer.shards(world, group)
        if not _params_are_master(s, world, group):
            out["parameters"] += padded // s.params.shards(world, group) * _element(precision)
        out["gradients"] += _gradient_bytes(padded, s, world, group, reduce_dtype)
        out["optimizer"] += os_numel * OPTIMIZER_BYTES
    return out


def _gradient_bytes(padded: int, s: Strategy, world: int, group: int, reduce_dtype: str) -> int:
    """A unit's gradients of `padded` elements: the optimizer's fp32 OS-scope piece and,
    where the G scope is coarser, a G-scope accumulator in the reduce dtype."""
    accumulator = 0 if _direct(s, world, group) else padded // s.grads.shards(world, group) * _element(reduce_dtype)
    return padded // s.optimizer.shards(world, group) * 4 + accumulator


def _params_are_master(s: Strategy, world: int, group: int) -> bool:
    """The parameter shard is the master weights' (ShardedUnit.local_refresh)."""
    return s.params.shards(world, group) == s.optimizer.shards(world, group)


def _gathers(s: Strategy, world: int, group: int, precision: str) -> bool:
    """A unit's full parameters are gathered (or cast) for each use (ShardedUnit.gathers_params)."""
    return s.params.shards(world, group) > 1 or (_params_are_master(s, world, group) and precision != "fp32")


def _direct(s: Strategy, world: int, group: int) -> bool:
    """The micro-batches' gradient sum is the optimizer's fp32 gradient (ShardedUnit.direct)."""
    return s.grads.shards(world, group) == s.optimizer.shards(world, group)


@dataclass(frozen=True)
class Footprint:
    parts: dict[str, int]     # bytes per rank by part (the module docstring's names)
    moments: dict[str, int]   # the transient above the model state at each moment
    peak: int                 # model state + the largest transient
    phase: str                # the moment of the peak

    STATE = ("parameters", "gradients", "optimizer")


def _loss_bytes(cfg: GPTConfig, tokens: int, ce: int) -> int:
    """The fused loss's working set over the head's activations (the parts above): a
    chunk's fp32 logits, with their copy in a narrower compute dtype while it is cast (the
    matmul's output, then the gradient), and then the chunk's weight-gradient product; in
    a narrower dtype, the fp32 sum of the weight's gradient besides the one kept."""
    weight, chunk = cfg.vocab * cfg.width, min(tokens, chunk_rows(cfg.vocab)) * cfg.vocab
    if ce == FP32:   # the gradient is the logits, in place, while the product is made
        return chunk * FP32 + weight * FP32
    return weight * FP32 + max(chunk * (FP32 + ce), (chunk + weight) * ce)


def footprint(cfg: GPTConfig, sizes: list[UnitSize], strategy: Strategy, world: int, group: int, *,
              micro_batch: int, seq_len: int, precision: str = "fp32", reduce_dtype: str = "fp32",
              checkpointing: bool = False, prefetch: int = 1, prefetch_bytes=None,
              min_shard_numel: int = MIN_SHARD_NUMEL, micro_batches: int = 1,
              landing_buffers: bool = True, reshard_after_forward: bool = True) -> Footprint:
    """The engine's memory per rank training `cfg` cut into `sizes` (unit_sizes of the
    model) with these settings (EngineConfig's names), `micro_batches` per step.
    `landing_buffers`: the reductions run pccl's schedules, whose received blocks land in a
    workspace (the planner's assumption: the larger; see `workspace` above); False where
    they run the transport's own (MPI's, NCCL's), which keeps its buffers outside torch's
    allocator. `reshard_after_forward=False`: each unit's gathered parameters are kept from
    its forward to its backward, so the forward ends holding all of them."""
    state = model_state(sizes, strategy, world, group, precision, reduce_dtype, min_shard_numel)
    ce, re = _element(precision), _element(reduce_dtype)
    tokens = micro_batch * seq_len
    activations = activation_bytes(cfg, micro_batch, seq_len, ce, checkpointing)
    recompute = block_bytes(cfg, tokens, ce) if checkpointing else 0

    def full(u: UnitSize) -> int:
        return _padded(u.numel, world)

    def scoped(u: UnitSize) -> Strategy:
        return strategy if u.numel >= min_shard_numel else REPLICATED

    sharded = [u for u in sizes if _gathers(scoped(u), world, group, precision)]
    root = sum(full(u) for u in sharded if u.name == ROOT) * ce
    runs = [u for u in sharded if u.name != ROOT]
    # casts of the master weights (an unsplit P scope) are made when needed, not prefetched
    ahead_of = 0 if all(scoped(u).params.shards(world, group) == 1 for u in runs) else prefetch
    ahead = 0   # the largest run of a unit and the `prefetch` units after it, in bytes
    for i in range(len(runs)):
        held = 0
        for u in runs[i:i + 1 + ahead_of]:
            if prefetch_bytes is not None and held and held + full(u) * ce > prefetch_bytes:
                break
            held += full(u) * ce
        ahead = max(ahead, held)
    kept = not reshard_after_forward   # every unit's gathered parameters, from its forward to its backward
    if kept:
        ahead = sum(full(u) for u in runs) * ce
    largest = max((full(u) for u in sizes if u.name != ROOT), default=0)
    root_numel = sum(full(u) for u in sizes if u.name == ROOT)
    # units whose gradients are reduced per micro-batch (a G scope that splits them)
    reduced = [u for u in sizes if scoped(u).grads.shards(world, group) > 1]
    in_flight = sum(sorted(full(u) for u in reduced if u.name != ROOT)[-REDUCING_AT_ONCE:])
    per_step = [full(u) // scoped(u).grads.shards(world, group) for u in sizes
                if not _direct(scoped(u), world, group)]
    parts = {**state,
             "activations": activations,
             "loss": _loss_bytes(cfg, tokens, ce),
             "gathered": root + ahead,
             "reducing": root_numel * ce + largest * ce + in_flight * re,
             "workspace": max((full(u) for u in reduced), default=0) * re if landing_buffers else 0}
    # gradients exist from a unit's first reduction in a step to the update: with several
    # micro-batches from the first one's backward on, all of them; with one, they arrive unit
    # by unit as the backward frees the blocks' activations
    one = micro_batches == 1

    # each unit's backward at two moments: as it starts (its activations all there, its
    # recomputation made, the reductions before it in flight) and as it ends (its
    # activations freed, its .grad made and copied into its flat buffer)
    held_through = parts["gathered"] + root_numel * ce + in_flight * re + parts["workspace"]
    # (kept parameters: those of the units whose backward is done are released)
    backward, arrived, freed, released = 0, 0, 0, 0
    for u in reversed([u for u in sizes if u.name != ROOT]):
        own = block_bytes(cfg, tokens, ce, checkpointing) if u.name.startswith("blocks.") else 0
        left = activations - head_bytes(cfg, tokens, ce) - freed
        starts = left + recompute + held_through - released + arrived
        arrived += _gradient_bytes(full(u), scoped(u), world, group, reduce_dtype) if one else 0
        ends = left - own + held_through - released + full(u) * ce + arrived
        backward = max(backward, starts, ends)
        freed += own
        if kept and u in runs:
            released += full(u) * ce
    moments = {
        "loss": activations + parts["loss"] + root + (ahead if kept else 0),
        "unit backward": backward,
        # every gradient, and the largest per-step reduction's landing buffer (and its result
        # before the cast)
        "update": (state["gradients"] if one else 0) + max(per_step, default=0) * re * (1 if reduce_dtype == "fp32"
                                                                                       else 2),
    }
    phase = max(moments, key=moments.get)
    held = sum(state.values()) - (state["gradients"] if one else 0)
    return Footprint(parts, moments, held + moments[phase], phase)
