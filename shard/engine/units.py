"""Cutting a model into units: the pieces whose parameters are gathered, used and released
together.

By default each direct child module that holds parameters is a unit (for a GPT: the
embedding, each transformer block of its ModuleList, the final norm and head), or the
user passes a list of submodules. Parameters that belong to no unit, or to several (tied weights such as a
shared embedding and output head), go to the root unit, which is gathered for the whole
forward and backward pass. Units whose parameters are fewer than `min_shard_numel`
stay replicated: sharding them would cost more in latency than it saves in memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

MIN_SHARD_NUMEL = 1 << 12   # units smaller than this (elements) are replicated, not sharded


class UnitError(ValueError):
    """Units that do not cover the model's parameters properly."""


@dataclass
class Unit:
    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]   # (qualified name in the model, parameter)

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


def default_units(model: nn.Module) -> list[nn.Module]:
    """Direct children with parameters; containers that are never called themselves
    (ModuleList, ModuleDict) contribute their children instead, so each transformer block
    of a ModuleList is its own unit."""
    out = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out += default_units(child)
        elif any(True for _ in child.parameters()):
            out.append(child)
    return out


def root_modules(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """The model's children (those of its containers too) that neither are units nor hold
    one: what the model computes with outside its units."""
    out, unit_set = [], set(units)
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out += root_modules(child, units)
        elif not any(m in unit_set for m in child.modules()):
            out.append(child)
    return out


def split_units(model: nn.Module, units: Optional[list[nn.Module]] = None) -> list[Unit]:
    """The model's units, in registration order, with a root unit first if any parameter
    belongs to none or to several units."""
    names = {module: name for name, module in model.named_modules()}
    if units is None:
        units = default_units(model)
    for module in units:
        if module not in names:
            raise UnitError(f"unit {type(module).__name__} is not a submodule of the model")
        if module is model:
            raise UnitError("the model itself cannot be a unit; pass its submodules")
    qualified = {param: name for name, param in model.named_parameters(remove_duplicate=True)}
    owners: dict[nn.Parameter, list[int]] = {}
    for index, module in enumerate(units):
        for param in dict.fromkeys(module.parameters()):
            owners.setdefault(param, []).append(index)
    nested = [(names[a], names[b]) for a in units for b in units
              if a is not b and names[b].startswith(names[a] + ".")]
    if nested:
        raise UnitError(f"units must not contain each other: {nested[0][1]!r} is inside {nested[0][0]!r}")
    root = [(qualified[p], p) for p in qualified if len(owners.get(p, [])) != 1]
    out = [Unit("<root>", model, root)] if root else []
    for index, module in enumerate(units):
        params = [(qualified[p], p) for p in dict.fromkeys(module.parameters()) if owners[p] == [index]]
        if params:  # a unit whose parameters all went to the root has nothing to gather
            out.append(Unit(names[module], module, params))
    covered = sum(len(u.params) for u in out)
    if covered != len(qualified):
        raise UnitError(f"units cover {covered} of the model's {len(qualified)} parameters")
    return out


def is_sharded(unit: Unit, min_shard_numel: int = MIN_SHARD_NUMEL) -> bool:
    return unit.numel >= min_shard_numel


__all__ = ["Unit", "UnitError", "split_units", "root_modules", "is_sharded", "MIN_SHARD_NUMEL"]
