"""Folding a world of any size onto a power of two (Thakur, Rabenseifner and Gropp 2005).

With p = q + rem ranks, q the largest power of two <= p: among the first 2*rem ranks each
even rank hands its data to the odd rank after it and sits out; the q remaining ranks
("virtual ranks" 0..q-1) run the power-of-two algorithm; at the end the odd ranks hand
the result back. Virtual rank v stands for real blocks [f(v), f(v+1)): two blocks for
v < rem (its own and its folded partner's), one block otherwise, so any range of virtual
ranks owns a contiguous range of real blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Fold:
    size: int

    @cached_property
    def pow2(self) -> int:
        return 1 << (self.size.bit_length() - 1)

    @cached_property
    def rem(self) -> int:
        return self.size - self.pow2

    def is_folded_out(self, rank: int) -> bool:
        """True for the even ranks among the first 2*rem, which sit out the main phase."""
        return rank < 2 * self.rem and rank % 2 == 0

    def virtual(self, rank: int) -> int:
        if self.is_folded_out(rank):
            raise ValueError(f"rank {rank} is folded out of the power-of-two phase")
        return rank // 2 if rank < 2 * self.rem else rank - self.rem

    def real(self, v: int) -> int:
        return 2 * v + 1 if v < self.rem else v + self.rem

    def first_block(self, v: int) -> int:
        return 2 * v if v <= self.rem else v + self.rem

    def blocks(self, vlo: int, vhi: int) -> range:
        """Real blocks owned by virtual ranks [vlo, vhi)."""
        return range(self.first_block(vlo), self.first_block(vhi))
