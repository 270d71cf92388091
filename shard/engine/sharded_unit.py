"""One unit's state under a strategy: its parameter shard, gradient accumulator and the
place of its optimizer-state shard, and the collectives that move between them.

Buffers per rank (padded flat length L, see flat.py):
  parameters   P-scope piece in the compute dtype; with P = N it is the full buffer and
               the parameters stay bound to it, otherwise a full copy is gathered for
               each forward and backward and released after
  gradients    G-scope piece in the reduction dtype, summed over the micro-batches
  optimizer    OS-scope piece of fp32 master weights and moments (views into the
               engine's one flat optimizer buffer)
"""
from __future__ import annotations

from typing import Optional

import torch

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
        self.params = torch.empty(self._numel(strategy.params), dtype=compute_dtype, device=device)
        self.grads: Optional[torch.Tensor] = None   # G-scope sum over micro-batches
        self.full: Optional[torch.Tensor] = None    # gathered parameters (sharded P only)
        self.gathering: Optional[Handle] = None
        self.pending = 0                            # gradients still to arrive this backward
        self.reduced = False                        # gradients of this backward handed off
        self.trainable = sum(p.requires_grad for p in self.flat.params)   # gradients per backward

    def _numel(self, scope: Scope) -> int:
        return self.flat.padded // self.layout.shards(scope)

    @property
    def sharded_params(self) -> bool:
        return self.strategy.params != Scope.N

    @property
    def os_numel(self) -> int:
        return self._numel(self.strategy.optimizer)

    # Parameters.

    def load_master(self, lane: Lane, master: torch.Tensor, init=None) -> None:
        """Take this rank's optimizer shard from rank 0's values of the model's parameters
        (a sum in which every other rank adds zeros: exact, and ranks cannot disagree).
        With `init` (a model on the meta device), every rank builds this one unit's values
        itself, deterministically, and keeps its slice: no communication."""
        if init is not None:
            lo, hi = self.os_span
            master.copy_(self.flat.materialize(init, self.device)[lo:hi])
            return
        full = self.flat.flatten(torch.float32, self.device)
        if self.layout.rank != 0:
            full.zero_()
        lane.reduce_scatter("update", master, full, Scope.N, self.strategy.optimizer)
        lane.all_reduce("update", master, self.strategy.optimizer)   # and over the shard's replicas

    def refresh(self, lane: Lane, stage: str, master: torch.Tensor) -> None:
        """The parameter shard from the updated master weights (PaRO Figures 1-3: a copy
        when P and OS share a scope, else an all-gather from OS out to P)."""
        lane.gather(stage, self.params, master.to(self.compute_dtype), self.strategy.optimizer, self.strategy.params,
                    self.codecs.get("params"))
        if not self.sharded_params:
            self.flat.bind(self.params)

    def start_gather(self, lane: Lane, stage: str) -> None:
        """Queue the all-gather of the full parameters (no-op when held or in flight)."""
        if not self.sharded_params or self.full is not None or self.gathering is not None:
            return
        full = torch.empty(self.flat.padded, dtype=self.compute_dtype, device=self.device)
        shard = self.params
        codec = self.codecs.get("params")
        scope = self.strategy.params
        self.gathering = lane.submit(lambda: lane.gather(stage, full, shard, scope, Scope.N, codec), full,
                                     shard, what=f"all-gather of {self.name}'s parameters ({stage})")
        self.full = full

    def ensure_gathered(self, lane: Lane, stage: str) -> bool:
        """Full parameters bound to the model, waiting for a prefetch if one is in flight;
        True when they had been prefetched."""
        if not self.sharded_params:
            return False
        prefetched = self.full is not None
        self.start_gather(lane, stage)
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering = None
        self.flat.bind(self.full)
        return prefetched

    def release(self) -> None:
        if self.sharded_params and self.full is not None:
            if self.gathering is not None:  # never bound: let the gather land first
                self.gathering.wait()
                self.gathering = None
            self.flat.release()
            self.full = None

    @property
    def full_bytes(self) -> int:
        """Bytes of the gathered parameters."""
        return self.flat.padded * self.params.element_size()

    @property
    def held_bytes(self) -> int:
        return self.full_bytes if self.full is not None else 0

    # Gradients.

    def take_gradients(self, scale: float) -> torch.Tensor:
        """The parameters' gradients as one flat buffer in the reduction dtype, times
        `scale`; the parameters' .grad are cleared."""
        flat = torch.empty(self.flat.padded, dtype=self.reduce_dtype, device=self.device)
        self.flat.gradients(flat)
        for p in self.flat.params:
            p.grad = None
        if scale != 1.0:
            flat.mul_(scale)
        return flat

    def reduce_micro_batch(self, lane: Lane, flat: torch.Tensor) -> Handle:
        """Queue the per-micro-batch reduction: to the gradient scope (PaRO 3.3: inside the
        group for I), summed into the accumulator. N-scope gradients accumulate locally."""
        g = self.strategy.grads

        def task() -> None:
            if g == Scope.N:
                shard = flat
            else:
                shard = torch.empty(self._numel(g), dtype=flat.dtype, device=flat.device)
                lane.reduce_scatter("backward", shard, flat, Scope.N, g, self.codecs.get("grads"))
            if self.grads is None:
                self.grads = shard
            else:
                self.grads.add_(shard)
        # `flat` comes from the backward on the caller's stream and is dropped by the caller
        # at once: without keeping it, its memory could go to the next unit's kernels while
        # the lane still reduces it.
        return lane.submit(task, flat, what=f"reduction of {self.name}'s gradients")

    def finish_gradients(self, lane: Lane, out: torch.Tensor, scale: float) -> None:
        """The summed gradient of this rank's optimizer shard into `out` (fp32), times
        `scale`: what the micro-batches left unreduced is reduced once, per step (across
        groups for I, over everyone for N), then narrowed to the optimizer scope."""
        g, os = self.strategy.grads, self.strategy.optimizer
        grads = self.grads if self.grads is not None else torch.zeros(self._numel(g), dtype=self.reduce_dtype,
                                                                      device=self.device)
        self.grads = None
        if g == Scope.I and os == Scope.G:   # the inter-group reduce-scatter
            shard = torch.empty(self._numel(os), dtype=grads.dtype, device=grads.device)
            lane.reduce_scatter("update", shard, grads, Scope.I, Scope.G, self.codecs.get("grads"))
        else:
            lane.all_reduce("update", grads, g, self.codecs.get("grads"))
            start, end = self.layout.span(os, self.flat.padded)
            offset = self.layout.span(g, self.flat.padded)[0]
            shard = grads[start - offset:end - offset]
        out.copy_(shard).mul_(scale)
