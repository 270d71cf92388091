"""One unit's parameters in one flat buffer, padded so it splits evenly into shards.

The padded length is a multiple of the world size, so every scope (a group of M ranks,
or all N) divides it into equal shards. Each parameter becomes a view into whichever
full buffer is bound (the gathered parameters during a unit's compute); its gradient is
copied into the matching slice of a flat gradient buffer for the reduce-scatter.
"""
from __future__ import annotations

import math

import torch
from torch import nn


class FlatParams:
    def __init__(self, params: list[tuple[str, nn.Parameter]], world: int):
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        self.names = [name for name, _ in params]
        self.params = [p for _, p in params]
        self.shapes = [p.shape for p in self.params]
        sizes = [p.numel() for p in self.params]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.numel = self.offsets[-1]
        self.padded = self.padded_length(self.numel, world)

    @staticmethod
    def padded_length(numel: int, world: int) -> int:
        """`numel` rounded up to a multiple of the world size (at least one element each)."""
        return max(world, math.ceil(numel / world) * world)

    def flatten(self, dtype: torch.dtype, device=None) -> torch.Tensor:
        """A new padded buffer holding the parameters' current values (padding zero)."""
        if device is None:
            device = self.params[0].device if self.params else "cpu"
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for p, start, end in zip(self.params, self.offsets, self.offsets[1:]):
            flat[start:end].copy_(p.detach().reshape(-1))
        return flat

    def materialize(self, init, device, span: tuple[int, int]) -> torch.Tensor:
        """Elements [lo, hi) of the padded fp32 buffer, made by `init(name, tensor)` filling
        each parameter in place (parameters that were never allocated: built on the meta
        device). Only the parameters with elements in the span are made, those it cuts
        through in full first: a rank holds its shard and at most one whole parameter."""
        lo, hi = span
        out = torch.zeros(hi - lo, dtype=torch.float32, device=device)
        with torch.no_grad():
            for name, shape, start, end in zip(self.names, self.shapes, self.offsets, self.offsets[1:]):
                a, b = max(start, lo), min(end, hi)
                if a >= b:
                    continue
                if (a, b) == (start, end):
                    init(name, out[a - lo:b - lo].view(shape))
                else:
                    whole = torch.empty(shape, dtype=torch.float32, device=device)
                    init(name, whole)
                    out[a - lo:b - lo].copy_(whole.view(-1)[a - start:b - start])
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of `flat`, shaped like the parameter."""
        self._check(flat)
        return [flat[start:end].view(shape) for start, end, shape in zip(self.offsets, self.offsets[1:], self.shapes)]

    def bind(self, flat: torch.Tensor) -> None:
        """Make every parameter a view into `flat` (no copy)."""
        for p, view in zip(self.params, self.views(flat)):
            p.data = view

    def release(self) -> None:
        """Point every parameter at an empty tensor, so the gathered buffer can be freed."""
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def gradients(self, flat: torch.Tensor, accumulate: bool = False) -> None:
        """Copy each parameter's gradient into its slice of `flat` (zeros where there is
        none), casting to `flat`'s dtype; with `accumulate`, add them to what is there."""
        self._check(flat)
        if not accumulate:
            flat[self.numel:].zero_()
        for p, start, end in zip(self.params, self.offsets, self.offsets[1:]):
            if p.grad is not None:
                (flat[start:end].add_ if accumulate else flat[start:end].copy_)(p.grad.reshape(-1))
            elif not accumulate:
                flat[start:end].zero_()

    def shard(self, flat: torch.Tensor, index: int, parts: int) -> torch.Tensor:
        """Shard `index` of `parts` equal shards of `flat` (a view)."""
        self._check(flat)
        if self.padded % parts or not 0 <= index < parts:
            raise ValueError(f"cannot take shard {index} of {parts} from {self.padded} elements")
        size = self.padded // parts
        return flat[index * size:(index + 1) * size]

    def _check(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() != self.padded:
            raise ValueError(f"expected a flat buffer of {self.padded} elements, got shape {tuple(flat.shape)}")
