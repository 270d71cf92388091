"""A stand-in of a model for tracing the engine: the same units, parameters (names, shapes,
dtypes) and call order, and almost no computation.

The engine's communication in a step depends on its units and their parameters, on the
order units run forward and backward, and on when each unit's gradients are complete;
not on what a unit computes. Tracing the real GPT-7B on the meta device costs about 3 s a
step (thousands of meta kernels); this stand-in gives the same trace (events, tasks and
collectives; tests/shard/test_skeleton.py holds them equal) at a small fraction of that,
which lets the planner (shard/planning/planner.py) trace every strategy and group size.

Each unit passes its input through one node of autograd (_Touch) that takes every
parameter and saves a tensor, so a unit under activation checkpointing is recomputed in
its backward as a real one is. The units run in the order split_units lists them (for the
GPT: embeddings, blocks, the final norm and head), after a node of the root unit's
parameters.
"""
from __future__ import annotations

import torch
from torch import nn

from shard.engine.units import Unit, split_units


class _Unit(nn.Module):
    def __init__(self, params: list[tuple[str, nn.Parameter]]):
        super().__init__()
        self.names = []
        for name, p in params:
            key = name.replace(".", "_")
            self.register_parameter(key, _like(p))
            self.names.append(key)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Touch.apply(x, *(getattr(self, k) for k in self.names))


class Skeleton(nn.Module):
    def __init__(self, model: nn.Module, units=None):
        """The stand-in of `model` cut as Engine would cut it (`units` as Engine's)."""
        super().__init__()
        cut: list[Unit] = split_units(model, units)
        self.unit_names = [u.name for u in cut if u.name != "<root>"]
        self._root = [k.replace(".", "_") for u in cut if u.name == "<root>" for k, _ in u.params]
        for u in cut:
            if u.name == "<root>":
                for name, p in u.params:
                    self.register_parameter(name.replace(".", "_"), _like(p))
            else:
                self._place(u.name, _Unit(u.params))

    def _place(self, path: str, module: nn.Module) -> None:
        """Register `module` at a dotted path (blocks.3), so its unit keeps the model's name."""
        *parents, leaf = path.split(".")
        holder: nn.Module = self
        for part in parents:
            if not hasattr(holder, part):
                holder.add_module(part, nn.Module())
            holder = getattr(holder, part)
        holder.add_module(leaf, module)

    @property
    def units(self) -> list[nn.Module]:
        return [self.get_submodule(name) for name in self.unit_names]

    def forward(self, tokens: torch.Tensor, targets=None) -> torch.Tensor:
        """A (batch, seq, 1) 'logits' tensor that depends on every parameter, or given the
        targets, as a model computes its loss, a scalar that does."""
        x = torch.ones((), dtype=torch.float32, device=tokens.device)
        if self._root:
            x = _Touch.apply(x, *(getattr(self, k) for k in self._root))
        for unit in self.units:
            x = unit(x)
        return x.expand(*tokens.shape, 1) if targets is None else x


class _Touch(torch.autograd.Function):
    """What a unit's computation means to the engine, in one node: its output depends on
    every parameter (each gets a gradient, of its shape and dtype, in the unit's backward),
    and its backward reads a saved tensor (so activation checkpointing recomputes the unit
    as it would a real one). Written as x * (1 + the parameters' sum) it took about 25
    meta kernels a unit each way, most of the planner's time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.params = [(p.shape, p.dtype, p.device) for p in params]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.saved_tensors   # noqa: B018 - read, as a real unit's backward reads what it saved
        return (grad, *(torch.empty(shape, dtype=dtype, device=device) if needed else None
                        for (shape, dtype, device), needed in zip(ctx.params, ctx.needs_input_grad[1:])))


def _like(p: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
