"""Multi-level plans (PCCL's hierarchical collectives on two levels, and on three where the
network has groups of nodes; PaRO's HO-Ring), built per rank and cached."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

from pccl.algorithms import NATIVES, algorithms_for
from pccl.core.topology import Topology, TopologyError
from pccl.ir.plan import Plan
from pccl.plans import hierarchical, ho_ring, three_level

# An inter-node algorithm named for one collective, used for its mirror image.
DUAL = {"recursive_doubling": "recursive_halving", "recursive_halving": "recursive_doubling",
        "bruck": "recursive_halving"}
DEFAULT_INTER = {"all_gather": "recursive_doubling", "reduce_scatter": "recursive_halving"}


@dataclass(frozen=True)
class Hierarchical:
    """PCCL's two-level plan: the inter-node phase on every local rank at once (every NIC
    busy, log2(nodes) latency with the default algorithms), the intra-node phase with the
    vendor/native collective, and the local shuffle.

    inter: the inter-node algorithm (default recursive doubling for all-gather, recursive
    halving for reduce-scatter; a name is mapped to its mirror for the other collective).
    intra: the intra-node algorithm (default "native": the intra transport's own).
    """

    inter: Optional[str] = None
    intra: str = "native"

    def algorithm_for(self, level: str, collective: str) -> str:
        """The algorithm of `level`'s phases: `inter` on every level above the node."""
        name = self.intra if level == "intra" else (self.inter or DEFAULT_INTER[collective])
        valid = algorithms_for(collective) + NATIVES
        if name not in valid:
            name = DUAL.get(name, name)
        if name not in valid:
            raise ValueError(f"Hierarchical {level}={name!r} has no {collective} counterpart; "
                             f"expected one of {valid}")
        return name


@dataclass(frozen=True)
class ThreeLevel(Hierarchical):
    """The hierarchical plan on three levels (pccl.plans.three_level): global (one rank per
    network group), group, node; `inter` runs both network levels, `intra` the node's."""


@dataclass(frozen=True)
class HORing:
    """PaRO's Hierarchical Overlapping Ring (Section 3.4): the inter-node and intra-node
    rings run concurrently, then an intra-node ring moves the rest; rings throughout."""


PlanSpec = Union[Hierarchical, ThreeLevel, HORing]
NAMED = {"hierarchical": Hierarchical(), "three_level": ThreeLevel(), "ho_ring": HORing()}


def spec_of(algorithm) -> Optional[PlanSpec]:
    """The plan spec an `algorithm` argument names, or None for a flat algorithm."""
    if isinstance(algorithm, (Hierarchical, HORing)):
        return algorithm
    return NAMED.get(algorithm) if isinstance(algorithm, str) else None


def compresses_consistently(spec, collective: str) -> bool:
    """Whether `collective` run by plan `spec` with compression leaves every rank the same
    result where it should: HO-Ring's all-gather (alone, or as an all-reduce's second half)
    moves each block both exactly and encoded in its concurrent phases, so nodes would end
    with different values; its reduce-scatter, whose results are per rank, is fine."""
    return not (isinstance(spec, HORing) and collective in ("all_gather", "all_reduce"))


def assemble(collective: str, name: str, topology: Topology, rank: int, all_gather, reduce_scatter) -> Plan:
    """A Plan from part builders `f(src, dst) -> (steps, workspaces)`; all-reduce is the
    reduce-scatter into a one-block "shard" followed by the all-gather from it, in place on "io"."""
    if collective == "all_gather":
        steps, spaces = all_gather("input", "output")
    elif collective == "reduce_scatter":
        steps, spaces = reduce_scatter("input", "output")
    else:
        rs_steps, rs_spaces = reduce_scatter("io", "shard")
        ag_steps, ag_spaces = all_gather("shard", "io")
        steps = rs_steps + ag_steps
        spaces = {k: max(rs_spaces.get(k, 0), ag_spaces.get(k, 0)) for k in {**rs_spaces, **ag_spaces}}
        spaces["shard"] = 1
    return Plan(collective, name, topology.num_nodes, topology.ranks_per_node, rank, tuple(steps),
                tuple(sorted(spaces.items())))


@lru_cache(maxsize=1024)
def build(spec: PlanSpec, collective: str, topology: Topology, rank: int) -> Plan:
    """The cached plan of `spec` for `collective` on `rank` of `topology`."""
    if not topology.is_uniform:
        raise TopologyError(f"two-level plans need the same number of ranks on every node, got "
                            f"{[len(n) for n in topology.nodes]}; use a flat algorithm")
    if isinstance(spec, HORing):
        return assemble(collective, "ho_ring", topology, rank,
                        lambda src, dst: ho_ring.all_gather(topology, rank, src, dst),
                        lambda src, dst: ho_ring.reduce_scatter(topology, rank, src, dst))
    pick = spec.algorithm_for
    name, levels = ("three_level", three_level) if isinstance(spec, ThreeLevel) else ("hierarchical", hierarchical)
    return assemble(
        collective, name, topology, rank,
        lambda src, dst: levels.all_gather(topology, rank, pick("inter", "all_gather"),
                                           pick("intra", "all_gather"), src, dst),
        lambda src, dst: levels.reduce_scatter(topology, rank, pick("inter", "reduce_scatter"),
                                               pick("intra", "reduce_scatter"), src, dst))
