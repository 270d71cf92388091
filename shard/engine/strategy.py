"""Sharding strategies: a scope for parameters (P), gradients (G) and optimizer state (OS).

Scopes (PaRO, Section 3.1): N replicated on every rank; I sharded inside a group of M ranks
and replicated across the g = N/M groups; G sharded over all N ranks. A strategy is
written as three letters ("IIG") or by name.

PaRO's Principle 1: optimizer state is sharded at least as finely as parameters and as
gradients; any other combination costs more memory and saves no communication. That
leaves the 14 strategies of PaRO's Table 1, listed in STRATEGIES in the table's order.
(Written as sharding degree N < I < G, the rule is S_OS >= S_P and S_OS >= S_G.)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from itertools import product


class StrategyError(ValueError):
    """An unknown strategy, one Principle 1 rules out, or a group size that does not fit;
    `field`: the setting that raised it (EngineConfig's "strategy" or "group_size")."""

    def __init__(self, message: str, field: str = "strategy"):
        super().__init__(message)
        self.field = field


class Scope(enum.IntEnum):
    """How widely one kind of state is sharded; larger is finer."""

    N = 0   # replicated
    I = 1   # sharded in a group of M ranks
    G = 2   # sharded over all ranks

    def shards(self, world: int, group: int) -> int:
        """Into how many pieces this scope splits a tensor."""
        return (1, group, world)[self]


ALIASES = {"ddp": "NNN", "zero1": "NNG", "zero2": "NGG", "zero3": "GGG", "mics": "III"}


@dataclass(frozen=True)
class Strategy:
    """The scope of each kind of state: PaRO's P, G and OS, spelled out here because G is
    also the global scope's letter (Strategy(params=Scope.I, grads=Scope.G, ...) is "IGG")."""

    params: Scope      # P: parameters
    grads: Scope       # G: gradients
    optimizer: Scope   # OS: optimizer state (fp32 master weights and moments)

    def __post_init__(self) -> None:
        if self.optimizer < self.params or self.optimizer < self.grads:
            raise StrategyError(
                f"strategy {self.letters} breaks PaRO's Principle 1: optimizer state must be sharded at "
                f"least as finely as parameters and gradients (N < I < G), otherwise it costs more memory "
                f"and saves no communication; the nearest valid strategy is {self.nearest_valid()}")

    @classmethod
    def parse(cls, text) -> "Strategy":
        """A strategy from "IIG", "paro-iig", or a name: ddp, zero1, zero2, zero3, mics."""
        if isinstance(text, Strategy):
            return text
        if not isinstance(text, str):
            raise StrategyError(f"strategy must be a string such as 'zero3' or 'IIG', got {type(text).__name__}")
        key = text.strip().lower()
        letters = ALIASES.get(key, key[len("paro-"):] if key.startswith("paro-") else key).upper()
        if len(letters) != 3 or any(c not in "NIG" for c in letters):
            raise StrategyError(f"unknown strategy {text!r}; expected three letters of N/I/G (P, G, OS scopes) "
                                f"or one of {sorted(set(ALIASES) | {s.name for s in STRATEGIES})}")
        return cls(*(Scope[c] for c in letters))

    @property
    def letters(self) -> str:
        return f"{self.params.name}{self.grads.name}{self.optimizer.name}"

    @property
    def name(self) -> str:
        """The alias where there is one (ddp, zero1, ...), else paro-xyz."""
        for alias, letters in ALIASES.items():
            if letters == self.letters:
                return alias
        return f"paro-{self.letters.lower()}"

    def nearest_valid(self) -> str:
        """The same P and G with optimizer state sharded as finely as they need."""
        return f"{self.params.name}{self.grads.name}{max(self.params, self.grads, self.optimizer).name}"

    def uses_groups(self) -> bool:
        return Scope.I in (self.params, self.grads, self.optimizer)

    def check_group(self, world: int, group: int) -> None:
        """A group of `group` ranks must divide the world (any size works without I scopes)."""
        if not (isinstance(group, int) and group >= 1):
            raise StrategyError(f"group size must be a positive integer, got {group!r}", field="group_size")
        if world % group:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            raise StrategyError(f"group size {group} does not divide the world size {world}; "
                                f"expected one of {divisors}", field="group_size")

    def memory_per_rank(self, psi: float, world: int, group: int, param_bytes: int = 2,
                        grad_bytes: int = 2, state_bytes: int = 12) -> dict[str, float]:
        """PaRO's Table 2: bytes per rank of parameters, gradients and optimizer state (its P,
        G and OS) for psi parameters (mixed precision: 2-byte parameters and gradients, K = 12
        bytes of fp32 master weights and two moments)."""
        return {
            "parameters": param_bytes * psi / self.params.shards(world, group),
            "gradients": grad_bytes * psi / self.grads.shards(world, group),
            "optimizer": state_bytes * psi / self.optimizer.shards(world, group),
        }


STRATEGIES = tuple(Strategy(*scopes) for scopes in product(Scope, repeat=3)
                   if scopes[2] >= scopes[0] and scopes[2] >= scopes[1])
REPLICATED = Strategy(Scope.N, Scope.N, Scope.N)   # what units too small to shard use


def grouped_reduce_scatter_saving(psi: float, world: int, group: int, steps: int) -> float:
    """PaRO's Equation 1: per-rank bytes saved by reducing gradients inside the group each
    micro-batch and across groups once per step, instead of a global reduce-scatter per
    micro-batch (in units of psi's elements)."""
    groups = world // group
    global_rs = steps * psi / world * (world - 1)
    grouped = steps * psi / group * (group - 1) + psi / world * (groups - 1)
    return global_rs - grouped
