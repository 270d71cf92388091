"""One unit's state under a strategy: its parameter shard, gradient accumulator and the
place of its optimizer-state shard, and the collectives that move between them.

Buffers per rank (padded flat length L, see flat.py):
  parameters   P-scope piece. Where P and OS split the buffer alike (a world of 1, DDP,
               ZeRO-3, MiCS) it is the optimizer's fp32 master piece itself, as FSDP2
               keeps only its sharded fp32 parameters: no copy is kept, and a gather casts
               as it goes. Otherwise a piece of its own in the compute dtype, refreshed
               from the master after each step. Where it is the full buffer in the compute
               dtype (one rank in the scope), the parameters stay bound to it; otherwise a
               full copy is gathered (or cast) in the compute dtype for each forward and
               backward and released after
  gradients    OS-scope piece in fp32, the optimizer's (ensure_grad: from the step's first
               reduction to its update), which sums the micro-batches' reduced gradients;
               when the G scope splits the buffer more coarsely, a G-scope accumulator in
               the reduction dtype sums them instead, reduced to the OS scope at the step
  optimizer    OS-scope piece of fp32 master weights and moments (views into the
               engine's one flat optimizer buffer)

A scope of one rank moves nothing: a world of 1 gathers, copies and reduces nothing.
"""
from __future__ import annotations

from typing import Optional

import torch

from pccl import average_
from shard.engine.flat import FlatParams
from shard.engine.lanes import Handle, Lane
from shard.engine.shard_layout import ShardLayout
from shard.engine.strategy import Scope, Strategy
from shard.engine.units import Unit


class ShardedUnit:
    def __init__(self, unit: Unit, strategy: Strategy, layout: ShardLayout, compute_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, device: torch.device, codecs: Optional[dict] = None):
        """codecs: {"params": codec, "grads": codec} of the parameter gathers and the
        gradient reductions (pccl.compression.codecs; absent: exact)."""
        self.unit, self.strategy, self.layout = unit, strategy, layout
        self.codecs = codecs or {}
        self.name = unit.name
        self.flat = FlatParams(unit.params, layout.world)
        self.compute_dtype, self.reduce_dtype, self.device = compute_dtype, reduce_dtype, device
        self.os_span = layout.span(strategy.optimizer, self.flat.padded)
        self.params: Optional[torch.Tensor] = None   # the P-scope shard, or the master's (place_params)
        self.grad: Optional[torch.Tensor] = None    # the optimizer's fp32 OS-scope gradient, during a step
        self.grads: Optional[torch.Tensor] = None   # G-scope sum over micro-batches
        # The G-scope sum is the optimizer's gradient itself (same shard), summed in fp32
        self.direct = layout.shards(strategy.grads) == layout.shards(strategy.optimizer)
        self.local_grads = layout.shards(strategy.grads) == 1   # nothing to reduce per micro-batch
        self.full: Optional[torch.Tensor] = None    # gathered parameters (gathers_params only)
        self.gathering: Optional[Handle] = None
        self.pending = 0                            # gradients still to arrive this backward
        self.reduced = False                        # gradients of this backward handed off
        self.trainable = sum(p.requires_grad for p in self.flat.params)   # gradients per backward

    def _numel(self, scope: Scope) -> int:
        return self.flat.padded // self.layout.shards(scope)

    @property
    def gathers_params(self) -> bool:
        """Whether the full parameters are gathered for each forward and backward and
        released after: where the parameter shard is a piece of the buffer, or the master
        weights in another dtype than the compute dtype (then the cast is the gather).
        Otherwise the parameters stay bound to the shard, which is the whole buffer."""
        return self.layout.shards(self.strategy.params) > 1 or self.params.dtype != self.compute_dtype

    @property
    def os_numel(self) -> int:
        return self._numel(self.strategy.optimizer)

    # Parameters.

    def load_master(self, lane: Lane, master: torch.Tensor, init=None) -> None:
        """Take this rank's optimizer shard from rank 0's values of the model's parameters
        (a sum in which every other rank adds zeros: exact, and ranks cannot disagree).
        With `init` (a model on the meta device), every rank builds the parameters of its
        slice itself, deterministically: no communication."""
        if init is not None:
            master.copy_(self.flat.materialize(init, self.device, self.os_span))
            return
        full = self.flat.flatten(torch.float32, self.device)
        if self.layout.rank != 0:
            full.zero_()
        lane.reduce_scatter("update", master, full, Scope.N, self.strategy.optimizer)
        lane.all_reduce("update", master, self.strategy.optimizer)   # and over the shard's replicas

    def place_params(self, master: torch.Tensor) -> None:
        """The parameter shard: the optimizer's `master` piece where P and OS split the
        buffer alike (local_refresh), else a compute-dtype buffer of its own."""
        self.params = master if self.local_refresh else torch.empty(
            self._numel(self.strategy.params), dtype=self.compute_dtype, device=self.device)

    @property
    def local_refresh(self) -> bool:
        """P and OS split the buffer alike (the same shard on this rank): the parameter
        shard is the master piece, and needs no refresh."""
        return self.layout.shards(self.strategy.params) == self.layout.shards(self.strategy.optimizer)

    def refresh(self, lane: Lane, stage: str, master: torch.Tensor) -> None:
        """The parameter shard from the updated master weights (PaRO Figures 1-3: an
        all-gather from OS out to P in the compute dtype); nothing where it is the master."""
        if not self.local_refresh:
            lane.gather(stage, self.params, master, self.strategy.optimizer, self.strategy.params,
                        self.codecs.get("params"))

    @property
    def casts_params(self) -> bool:
        """The full parameters are a cast of the master weights here (P scope unsplit): made
        on the caller's stream when needed, with nothing to send or to prefetch."""
        return self.gathers_params and self.layout.shards(self.strategy.params) == 1

    def start_gather(self, lane: Lane, stage: str) -> None:
        """Queue the all-gather of the full parameters (no-op when held or in flight); a
        cast (casts_params) is made at once."""
        if not self.gathers_params or self.full is not None or self.gathering is not None:
            return
        full = torch.empty(self.flat.padded, dtype=self.compute_dtype, device=self.device)
        if self.casts_params:
            self.full = full.copy_(self.params)
            return
        shard = self.params
        codec = self.codecs.get("params")
        scope = self.strategy.params
        self.gathering = lane.submit(lambda: lane.gather(stage, full, shard, scope, Scope.N, codec), full,
                                     shard, what=f"all-gather of {self.name}'s parameters ({stage})")
        self.full = full

    def ensure_gathered(self, lane: Lane, stage: str) -> bool:
        """Full parameters bound to the model, waiting for a prefetch if one is in flight;
        True when they had been prefetched."""
        if not self.gathers_params:
            return False
        prefetched = self.full is not None
        self.start_gather(lane, stage)
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering = None
        self.flat.bind(self.full)
        return prefetched

    def release(self) -> None:
        if self.gathers_params and self.full is not None:
            if self.gathering is not None:  # never bound: let the gather land first
                self.gathering.wait()
                self.gathering = None
            self.flat.release()
            self.full = None

    @property
    def full_bytes(self) -> int:
        """Bytes of the gathered parameters."""
        return self.flat.padded * self.compute_dtype.itemsize

    @property
    def held_bytes(self) -> int:
        return self.full_bytes if self.full is not None else 0

    # Gradients.

    def ensure_grad(self) -> torch.Tensor:
        """The optimizer's gradient of this unit's shard, allocated at its first need in a
        step (the engine drops it after the update, as zero_grad(set_to_none=True) does),
        so that gradients take memory as the backward frees activations. Called on the
        training loop's thread: on GPUs the buffer belongs to its stream."""
        if self.grad is None:
            self.grad = torch.empty(self.os_numel, dtype=torch.float32, device=self.device)
        return self.grad

    def reduce_micro_batch(self, lane: Lane) -> Optional[Handle]:
        """This micro-batch's gradients, taken from the parameters' .grad (cleared), into
        the G-scope sum. Where the G scope does not split the buffer they are added to it
        at once, cast, with no copy in between (None is returned); otherwise they are
        copied into one flat buffer in the reduction dtype, divided by the world size (the
        sum over ranks is then their average), and the reduce-scatter to the G scope (PaRO
        3.3: inside the group for I) is queued."""
        if self.local_grads:
            first = self.grads is None
            if first:
                self.grads = self.grad if self.direct else torch.empty(self.flat.padded, dtype=self.reduce_dtype,
                                                                       device=self.device)
            self.flat.gradients(self.grads, accumulate=not first)
            self.clear_grads()
            return None
        flat = torch.empty(self.flat.padded, dtype=self.reduce_dtype, device=self.device)
        self.flat.gradients(flat)
        self.clear_grads()
        average_(flat, self.layout.world)
        g = self.strategy.grads

        def task() -> None:
            first = self.grads is None
            if first and self.direct and flat.dtype == self.grad.dtype:
                shard = self.grad
            else:
                shard = torch.empty(self._numel(g), dtype=flat.dtype, device=flat.device)
            lane.reduce_scatter("backward", shard, flat, Scope.N, g, self.codecs.get("grads"))
            if not first:
                self.grads.add_(shard)
            elif self.direct and shard is not self.grad:
                self.grads = self.grad.copy_(shard)
            else:
                self.grads = shard
        # `flat` comes from the backward on the caller's stream and is dropped by the caller
        # at once: without keeping it, its memory could go to the next unit's kernels while
        # the lane still reduces it.
        return lane.submit(task, flat, self.grad, what=f"reduction of {self.name}'s gradients")

    def clear_grads(self) -> None:
        for p in self.flat.params:
            p.grad = None

    def finish_gradients(self, lane: Lane) -> None:
        """The summed gradient of this rank's optimizer shard into `grad` (fp32): what the
        micro-batches left unreduced is reduced once, per step (across groups for I, over
        everyone for N), then narrowed to the optimizer scope. Gradients summed locally
        are divided by the world size first (the others were, before their reduction)."""
        g, os = self.strategy.grads, self.strategy.optimizer
        grads, self.grads = self.grads, None
        if grads is None:   # no gradient arrived this step
            grads = self.grad.zero_() if self.direct else torch.zeros(self._numel(g), dtype=self.reduce_dtype,
                                                                      device=self.device)
        elif self.local_grads and self.layout.world > 1:
            average_(grads, self.layout.world)
        codec = self.codecs.get("grads")
        if self.direct:   # the sum is the optimizer's shard already: only its replicas to add up
            if self.layout.replicas(g) > 1:
                sent = grads if grads.dtype == self.reduce_dtype else grads.to(self.reduce_dtype)
                lane.all_reduce("update", sent, g, codec)
                if sent is not grads:
                    grads.copy_(sent)
            return
        if g == Scope.I and os == Scope.G:   # the inter-group reduce-scatter
            shard = self.grad if grads.dtype == self.grad.dtype else torch.empty(
                self._numel(os), dtype=grads.dtype, device=grads.device)
            lane.reduce_scatter("update", shard, grads, Scope.I, Scope.G, codec)
        else:
            lane.all_reduce("update", grads, g, codec)
            start, end = self.layout.span(os, self.flat.padded)
            offset = self.layout.span(g, self.flat.padded)[0]
            shard = grads[start - offset:end - offset]
        if shard is not self.grad:
            self.grad.copy_(shard)
