"""Which slice of a unit's flat buffer each rank holds in each scope.

World rank r sits in group r // M at local index r % M (groups of M consecutive ranks,
g = N / M groups). An I-scope shard is the rank's local index: M shards, one per local
rank, replicated across groups. A G-scope shard must lie inside the rank's I-scope shard,
so that an inter-group collective (the ranks with one local index) moves between the two
(PaRO's Figures 1-3): the I shard l is cut into g pieces and group gi holds piece gi,
which is G shard l * g + gi. Strategies with no I scope use plain rank order instead
(G shard r), so their global collectives run on the world communicator in its own order.
"""
from __future__ import annotations

from dataclasses import dataclass

from shard.engine.strategy import Scope


@dataclass(frozen=True)
class ShardLayout:
    world: int     # N
    group: int     # M
    rank: int
    nested: bool   # G shards nest inside I shards (strategies with an I scope)

    def __post_init__(self) -> None:
        if self.world % self.group or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} with groups of {self.group} does not fit a world of {self.world}")

    @property
    def groups(self) -> int:
        return self.world // self.group

    @property
    def group_index(self) -> int:
        return self.rank // self.group

    @property
    def local(self) -> int:
        return self.rank % self.group

    def shards(self, scope: Scope) -> int:
        return scope.shards(self.world, self.group)

    def index(self, scope: Scope, rank: int | None = None) -> int:
        """Which of the scope's shards `rank` (default: this rank) holds."""
        gi, local = divmod(self.rank if rank is None else rank, self.group)
        if scope == Scope.N:
            return 0
        if scope == Scope.I:
            return local
        return local * self.groups + gi if self.nested else gi * self.group + local

    def span(self, scope: Scope, padded: int, rank: int | None = None) -> tuple[int, int]:
        """[start, end) of the shard `rank` holds of a buffer of `padded` elements."""
        size = padded // self.shards(scope)
        start = self.index(scope, rank) * size
        return start, start + size

    def replicas(self, scope: Scope) -> int:
        """How many ranks hold each shard of the scope."""
        return self.world // self.shards(scope)

    def is_first_replica(self, scope: Scope) -> bool:
        """This rank holds the lowest-ranked copy of its shard (the one checkpoints write)."""
        return self.rank == min(r for r in range(self.world) if self.index(scope, r) == self.index(scope))

    def group_members(self) -> list[list[int]]:
        """The ranks of each group, by local index (the intra-group communicators)."""
        return [[gi * self.group + l for l in range(self.group)] for gi in range(self.groups)]

    def cross_members(self) -> list[list[int]]:
        """The ranks with each local index, by group (the inter-group communicators)."""
        return [[gi * self.group + l for gi in range(self.groups)] for l in range(self.group)]

    def same_group(self, rank: int) -> bool:
        return rank // self.group == self.group_index
