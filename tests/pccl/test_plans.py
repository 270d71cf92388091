"""Two-level plans: the symbolic plan verifier, their structure, and the local steps (single process)."""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from pccl.algorithms import schedule
from pccl.analysis.verify import ScheduleError, verify_plan, verify_plans
from pccl.core.dtypes import reduce_
from pccl.core.topology import Topology, TopologyError
from pccl.executors.plan import PlanExecutor, identity, permute_
from pccl.ir.plan import Combine, Concurrent, Fill, Permute, Phase, Ref
from pccl.ir.schedule import Kind
from pccl.plans import Hierarchical, HORing, ThreeLevel, build
from pccl.plans.layout import grid_perm, inverse

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
SPECS = [Hierarchical(), HORing(), Hierarchical(inter="ring", intra="recursive_doubling"),
         Hierarchical(inter="bruck", intra="ring")]
CASES = [(s, c) for s in SPECS for c in COLLECTIVES]
IDS = [f"{s}-{c}" for s, c in CASES]
DEFAULT_INTER = {"all_gather": "recursive_doubling", "reduce_scatter": "recursive_halving"}

ROUND_ROBIN = [
    Topology(((0, 2, 4), (1, 3, 5))),
    Topology(tuple(tuple(range(n, 12, 3)) for n in range(3))),        # 3 nodes x 4, round robin
    Topology(tuple(tuple(range(n, 8, 4)) for n in range(4))),         # 4 nodes x 2, round robin
]
SHUFFLED = [
    Topology(((7, 2, 9, 0), (4, 11, 1, 6), (10, 3, 8, 5))),
    Topology(((2, 0, 1),)),                                           # one node, local order shuffled
    Topology(((3,), (0,), (2,), (1,))),                               # one rank a node, nodes shuffled
    Topology(((5, 1), (0, 4), (3, 2))),
]


# --- the verifier accepts every plan --------------------------------------------------------------

@pytest.mark.parametrize("spec,collective", CASES, ids=IDS)
def test_plans_verify_on_every_small_grid(spec, collective):
    for n in range(1, 7):
        for l in range(1, 7):
            verify_plan(spec, collective, Topology.regular(n * l, l))


@pytest.mark.parametrize("spec,collective", CASES, ids=IDS)
def test_plans_verify_on_larger_grids(spec, collective):
    for n, l in [(3, 7), (7, 3), (16, 8), (64, 8), (128, 4)]:
        verify_plan(spec, collective, Topology.regular(n * l, l))


@pytest.mark.parametrize("spec,collective", CASES, ids=IDS)
def test_plans_verify_on_non_consecutive_placements(spec, collective):
    for topology in ROUND_ROBIN + SHUFFLED:
        verify_plan(spec, collective, topology)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_ho_ring_verifies_when_only_some_nodes_are_contiguous(collective):
    # Ranks of the contiguous node skip a shuffle the others need: plans differ in local steps.
    verify_plan(HORing(), collective, Topology(((0, 1), (3, 2))))
    verify_plan(HORing(), collective, Topology(((0, 1, 2), (3, 5, 4))))


# --- the verifier rejects broken plans ------------------------------------------------------------

def plans_of(spec, collective, topology, mutate=lambda plan: plan):
    return [mutate(build(spec, collective, topology, r)) for r in range(topology.size)]


def replace_steps(plan, f):
    return dataclasses.replace(plan, steps=tuple(f(list(plan.steps))))


def swap_permute(at):
    def swap(steps):
        step = steps[at]
        assert isinstance(step, Permute)
        perm = list(step.perm)
        perm[0], perm[1] = perm[1], perm[0]
        steps[at] = dataclasses.replace(step, perm=tuple(perm))
        return steps
    return lambda plan: replace_steps(plan, swap)


def without(kind):
    return lambda plan: replace_steps(plan, lambda steps: [s for s in steps if not isinstance(s, kind)])


def test_verifier_rejects_a_swapped_final_permute():
    t = Topology.regular(8, 4)
    with pytest.raises(ScheduleError, match="rank 0 ends with"):
        verify_plans(plans_of(Hierarchical(), "all_gather", t, swap_permute(-1)), t)


def test_verifier_rejects_a_swapped_permute_on_one_rank_only():
    t = Topology.regular(8, 4)
    broken = swap_permute(-1)
    with pytest.raises(ScheduleError, match="rank 5 ends with"):
        verify_plans(plans_of(Hierarchical(), "all_gather", t, lambda p: broken(p) if p.rank == 5 else p), t)


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce"])
def test_verifier_rejects_a_swapped_reduce_scatter_shuffle(collective):
    # Right contributors, wrong input blocks: only block fingerprints can tell.
    t = Topology.regular(8, 4)
    with pytest.raises(ScheduleError):
        verify_plans(plans_of(Hierarchical(), collective, t, swap_permute(0)), t)


@pytest.mark.parametrize("topology", [Topology.regular(8, 4), Topology(((0, 2, 4), (1, 3, 5)))])
@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce"])
def test_verifier_rejects_a_missing_combine(topology, collective):
    with pytest.raises(ScheduleError):
        verify_plans(plans_of(HORing(), collective, topology, without(Combine)), topology)


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_reduce"])
def test_verifier_rejects_reading_a_workspace_before_writing_it(collective):
    # HO-Ring without its Fill reduces whatever the reused workspace held.
    t = Topology.regular(8, 4)
    with pytest.raises(ScheduleError):
        verify_plans(plans_of(HORing(), collective, t, without(Fill)), t)


def test_verifier_rejects_a_missing_shuffle():
    t = Topology.regular(6, 3)
    with pytest.raises(ScheduleError):
        verify_plans(plans_of(Hierarchical(), "reduce_scatter", t, without(Permute)), t)


def test_verifier_rejects_a_phase_of_the_wrong_size():
    def shrink_inter(steps):
        return [dataclasses.replace(s, output=dataclasses.replace(s.output, count=s.output.count - 1))
                if isinstance(s, Phase) and s.level == "inter" else s for s in steps]

    t = Topology.regular(8, 4)
    with pytest.raises(ScheduleError, match="blocks"):
        verify_plans(plans_of(Hierarchical(), "all_gather", t, lambda p: replace_steps(p, shrink_inter)), t)


def test_verifier_rejects_a_phase_on_the_wrong_level():
    # The intra-node all-gather run across nodes instead: the column lands at the wrong ranks.
    def swap_levels(steps):
        return [dataclasses.replace(s, level="inter" if s.level == "intra" else "intra")
                if isinstance(s, Phase) else s for s in steps]

    t = Topology.regular(4, 2)
    with pytest.raises(ScheduleError):
        verify_plans(plans_of(Hierarchical(), "all_gather", t, lambda p: replace_steps(p, swap_levels)), t)


def test_verifier_rejects_ranks_that_disagree_on_a_phase():
    t = Topology.regular(8, 4)
    plans = plans_of(Hierarchical(), "all_gather", t)
    first = plans[3].steps[0]
    plans[3] = dataclasses.replace(plans[3], steps=(dataclasses.replace(first, collective="reduce_scatter"),)
                                   + plans[3].steps[1:])
    with pytest.raises(ScheduleError, match="disagree"):
        verify_plans(plans, t)


# --- structure ------------------------------------------------------------------------------------

def kinds(plan):
    return [type(s).__name__ for s in plan.steps]


@pytest.mark.parametrize("n,l", [(2, 2), (2, 4), (4, 8), (3, 5)])
def test_hierarchical_all_gather_is_inter_then_intra_then_shuffle(n, l):
    t = Topology.regular(n * l, l)
    for r in range(n * l):
        plan = build(Hierarchical(), "all_gather", t, r)
        assert (plan.collective, plan.name, plan.nodes, plan.local, plan.rank) == \
            ("all_gather", "hierarchical", n, l, r)
        assert kinds(plan) == ["Phase", "Phase", "Permute"]
        inter, intra, shuffle = plan.steps
        assert (inter.collective, inter.level, inter.algorithm) == ("all_gather", "inter", "recursive_doubling")
        assert (intra.collective, intra.level, intra.algorithm) == ("all_gather", "intra", "native")
        assert intra.input == inter.output
        assert shuffle.src == intra.output and shuffle.dst == Ref("output", 0, n * l)
        assert shuffle.perm == grid_perm(t, list(range(n)), list(range(l)))
        assert sorted(shuffle.perm) == list(range(n * l))


@pytest.mark.parametrize("n,l", [(2, 2), (2, 4), (4, 8), (3, 5)])
def test_hierarchical_reduce_scatter_mirrors_it(n, l):
    t = Topology.regular(n * l, l)
    for r in range(n * l):
        plan = build(Hierarchical(), "reduce_scatter", t, r)
        assert kinds(plan) == ["Permute", "Phase", "Phase"]
        shuffle, intra, inter = plan.steps
        assert shuffle.src == Ref("input", 0, n * l)
        assert shuffle.perm == inverse(build(Hierarchical(), "all_gather", t, r).steps[-1].perm, n * l)
        assert (intra.collective, intra.level, intra.algorithm) == ("reduce_scatter", "intra", "native")
        assert (inter.collective, inter.level, inter.algorithm) == ("reduce_scatter", "inter", "recursive_halving")
        assert intra.input == shuffle.dst and inter.input == intra.output
        assert inter.output == Ref("output", 0, 1)


def test_hierarchical_all_reduce_is_reduce_scatter_then_all_gather_in_place():
    t = Topology.regular(8, 4)
    plan = build(Hierarchical(), "all_reduce", t, 2)
    phases = list(plan.phases())
    assert [(p.collective, p.level) for p in phases] == [
        ("reduce_scatter", "intra"), ("reduce_scatter", "inter"), ("all_gather", "inter"), ("all_gather", "intra")]
    assert phases[1].output == Ref("shard", 0, 1) == phases[2].input
    assert plan.steps[0].src.buffer == "io" and plan.steps[-1].dst.buffer == "io"
    assert dict(plan.workspaces)["shard"] == 1


@pytest.mark.parametrize("n,l", [(1, 1), (1, 5), (6, 1), (1, 8), (16, 1)])
@pytest.mark.parametrize("spec", [Hierarchical(), HORing()], ids=str)
def test_one_node_or_one_rank_a_node_is_a_single_flat_phase(spec, n, l):
    t = Topology.regular(n * l, l)
    level = "intra" if n == 1 else "inter"
    for r in range(n * l):
        for collective, out, inp in [("all_gather", Ref("output", 0, n * l), Ref("input", 0, 1)),
                                     ("reduce_scatter", Ref("output", 0, 1), Ref("input", 0, n * l))]:
            plan = build(spec, collective, t, r)
            assert len(plan.steps) == 1 and not any(isinstance(s, Permute) for s in plan.steps)
            (phase,) = plan.steps
            assert (phase.collective, phase.level, phase.output, phase.input) == (collective, level, out, inp)
            assert plan.workspaces == ()
            if isinstance(spec, HORing):
                assert phase.algorithm == "ring"
            else:
                assert phase.algorithm == ("native" if n == 1 else DEFAULT_INTER[collective])


def test_one_node_with_shuffled_local_order_still_shuffles():
    t = Topology(((2, 0, 1),))
    plan = build(Hierarchical(), "all_gather", t, 0)
    assert kinds(plan) == ["Phase", "Permute"]
    assert plan.steps[1].perm == (2, 0, 1)


@pytest.mark.parametrize("topology", [Topology.regular(8, 4), Topology.regular(12, 3), ROUND_ROBIN[0]],
                         ids=str)
def test_ho_ring_all_gather_starts_with_concurrent_rings(topology):
    for r in range(topology.size):
        plan = build(HORing(), "all_gather", topology, r)
        assert plan.name == "ho_ring"
        first = plan.steps[0]
        assert isinstance(first, Concurrent) and len(first.phases) == 2
        assert sorted(p.level for p in first.phases) == ["inter", "intra"]
        assert all(p.algorithm == "ring" and p.collective == "all_gather" for p in first.phases)
        assert all(p.input == Ref("input", 0, 1) for p in first.phases)
        assert all(p.algorithm == "ring" for p in plan.phases())
        # The rest is one more intra-node ring.
        assert [p.level for p in plan.phases()][2:] == ["intra"]


@pytest.mark.parametrize("topology", [Topology.regular(8, 4), Topology.regular(12, 3), ROUND_ROBIN[0]],
                         ids=str)
def test_ho_ring_reduce_scatter_ends_with_concurrent_then_combine(topology):
    for r in range(topology.size):
        plan = build(HORing(), "reduce_scatter", topology, r)
        *_, concurrent, combine = plan.steps
        assert isinstance(concurrent, Concurrent) and isinstance(combine, Combine)
        assert sorted(p.level for p in concurrent.phases) == ["inter", "intra"]
        assert all(p.algorithm == "ring" and p.collective == "reduce_scatter" for p in concurrent.phases)
        inter = next(p for p in concurrent.phases if p.level == "inter")
        intra = next(p for p in concurrent.phases if p.level == "intra")
        assert combine.dst == inter.output == Ref("output", 0, 1)
        assert combine.src == intra.output
        # The node's own entry of the inter-node column starts at the identity.
        fills = [s for s in plan.steps if isinstance(s, Fill)]
        assert fills == [Fill(Ref("column", topology.node_of(r), 1))]


def test_inter_algorithm_maps_to_its_mirror():
    t = Topology.regular(8, 4)
    rs = build(Hierarchical(inter="recursive_doubling"), "reduce_scatter", t, 0)
    assert next(p for p in rs.phases() if p.level == "inter").algorithm == "recursive_halving"
    ag = build(Hierarchical(inter="recursive_halving"), "all_gather", t, 0)
    assert next(p for p in ag.phases() if p.level == "inter").algorithm == "recursive_doubling"
    rs = build(Hierarchical(inter="bruck"), "reduce_scatter", t, 0)
    assert next(p for p in rs.phases() if p.level == "inter").algorithm == "recursive_halving"
    assert Hierarchical(inter="ring").algorithm_for("inter", "reduce_scatter") == "ring"
    assert Hierarchical(intra="recursive_doubling").algorithm_for("intra", "reduce_scatter") == "recursive_halving"
    assert Hierarchical().algorithm_for("intra", "all_gather") == "native"


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_an_inter_algorithm_without_a_counterpart_is_refused(collective):
    with pytest.raises(ValueError, match="Hierarchical inter='rabenseifner' has no .* counterpart"):
        build(Hierarchical(inter="rabenseifner"), collective, Topology.regular(8, 4), 0)
    with pytest.raises(ValueError, match="intra='tree'"):
        build(Hierarchical(intra="tree"), collective, Topology.regular(8, 4), 0)


# --- inter-node data volume -----------------------------------------------------------------------

@pytest.mark.parametrize("n,l", [(2, 4), (4, 8), (8, 8), (3, 5), (16, 2)])
def test_inter_node_phase_moves_one_block_per_node(n, l):
    t = Topology.regular(n * l, l)
    for r in range(n * l):
        ag = [p for p in build(Hierarchical(), "all_gather", t, r).phases() if p.level == "inter"]
        rs = [p for p in build(Hierarchical(), "reduce_scatter", t, r).phases() if p.level == "inter"]
        assert len(ag) == len(rs) == 1
        assert (ag[0].input.count, ag[0].output.count) == (1, n)     # a column of N blocks, not N*L
        assert (rs[0].input.count, rs[0].output.count) == (n, 1)
        assert len(t.inter_ranks(r)) == n
        ho = [p for p in build(HORing(), "all_gather", t, r).phases() if p.level == "inter"]
        assert [(p.input.count, p.output.count) for p in ho] == [(1, n)]


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_inter_node_traffic_is_that_of_an_n_rank_all_gather_of_one_block(n):
    l = 8
    t = Topology.regular(n * l, l)
    for r in (0, l - 1, n * l - 1):
        (inter,) = [p for p in build(Hierarchical(), "all_gather", t, r).phases() if p.level == "inter"]
        # The phase's buffer is `output.count` blocks of m elements; its schedule runs on N ranks.
        sched = schedule("all_gather", inter.algorithm, len(t.inter_ranks(r)), t.node_of(r))
        sent = sum(len(x.blocks) for step in sched.steps for x in step if x.kind == Kind.SEND)
        assert sched.size == inter.output.count == n
        assert sent == n - 1                        # (N-1) m elements, independent of L
        assert sched.num_steps == int(math.log2(n))


# --- build ----------------------------------------------------------------------------------------

def test_build_refuses_non_uniform_topologies():
    t = Topology(((0, 1, 2), (3,)))
    for spec in (Hierarchical(), HORing()):
        for c in COLLECTIVES:
            with pytest.raises(TopologyError, match=r"same number of ranks on every node.*\[3, 1\]"):
                build(spec, c, t, 0)


def test_plans_are_cached():
    a = build(Hierarchical(), "all_gather", Topology.regular(8, 4), 3)
    assert build(Hierarchical(), "all_gather", Topology.regular(8, 4), 3) is a
    assert build(Hierarchical(inter=None, intra="native"), "all_gather", Topology(((0, 1, 2, 3), (4, 5, 6, 7))), 3) is a
    topology = Topology.regular(8, 2)
    assert build(HORing(), "all_reduce", topology, 1) is build(HORing(), "all_reduce", Topology.regular(8, 2), 1)
    assert build(Hierarchical(), "all_gather", Topology.regular(8, 4), 2) is not a
    assert build(Hierarchical(), "all_gather", Topology.regular(8, 2), 3) is not a


# --- the local shuffle against torch --------------------------------------------------------------

def index(perm):
    return torch.tensor(perm)


def blocks(count, m, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(count, m, generator=g).to(dtype)
    low, high = max(-1000, torch.iinfo(dtype).min), min(1000, torch.iinfo(dtype).max)
    return torch.randint(low, high, (count, m), generator=g, dtype=dtype)


DTYPES = [torch.float32, torch.bfloat16, torch.int64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("n,l", [(1, 1), (2, 4), (4, 2), (3, 5), (8, 8)])
def test_permute_is_the_grid_transpose(n, l, m, dtype):
    t = Topology.regular(n * l, l)
    perm = grid_perm(t, list(range(n)), list(range(l)))
    grid = blocks(n * l, m, dtype)
    out = torch.empty_like(grid)
    permute_(grid, out, perm, index)
    expected = grid.view(l, n, m).permute(1, 0, 2).reshape(n * l, m)
    assert torch.equal(out, expected)
    # And the reduce-scatter's shuffle undoes it.
    back = torch.empty_like(grid)
    permute_(out, back, inverse(perm, n * l), index)
    assert torch.equal(back, grid)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("perm,dst_blocks", [
    ((-1, -1, -1, -1, 0, 1, 2, 3), 4),        # HO-Ring: the blocks bound for other nodes
    ((0, -1, 1, -1, 2, -1), 3),               # round robin
    ((-1, 0), 1),
    ((3, -1, 0, 1, -1, 5), 7),                # runs and gaps, a destination never written
    ((-1, -1, -1), 2),
    ((2, 3, -1, 0), 4),
])
def test_partial_permute_copies_only_the_mapped_blocks(perm, dst_blocks, m, dtype):
    src = blocks(len(perm), m, dtype, seed=1)
    dst = torch.full((dst_blocks, m), 77, dtype=dtype)
    before = dst.clone()
    permute_(src, dst, perm, index)
    written = set()
    for i, j in enumerate(perm):
        if j >= 0:
            assert torch.equal(dst[j], src[i])
            written.add(j)
    for j in range(dst_blocks):
        if j not in written:
            assert torch.equal(dst[j], before[j])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_permute_into_a_larger_destination(dtype):
    # HO-Ring's last step: a full permutation of the foreign blocks into part of the output.
    t = Topology.regular(8, 4)
    perm = grid_perm(t, [1], list(range(4)))
    assert perm == (4, 5, 6, 7)
    src = blocks(4, 3, dtype)
    dst = torch.zeros(8, 3, dtype=dtype)
    permute_(src, dst, perm, index)
    assert torch.equal(dst[4:], src) and not dst[:4].any()


# --- the reduction identity -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int64, torch.int32, torch.int8, torch.uint8], ids=str)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_identity_leaves_values_unchanged(op, dtype):
    value = identity(op, dtype)
    if op in ("sum", "avg"):
        assert value == 0
    elif dtype.is_floating_point:
        assert value == (-math.inf if op == "max" else math.inf)
    else:
        info = torch.iinfo(dtype)
        assert value == (info.min if op == "max" else info.max)
    x = blocks(4, 6, dtype, seed=2)
    if dtype.is_floating_point:
        x[0, 0], x[0, 1] = torch.finfo(dtype).max, torch.finfo(dtype).min
    else:
        x[0, 0], x[0, 1] = torch.iinfo(dtype).max, torch.iinfo(dtype).min
    ident = torch.full_like(x, value)
    out = ident.clone()
    reduce_(out, x, op)                      # identity op x
    assert torch.equal(out, x)
    out = x.clone()
    reduce_(out, ident, op)                  # x op identity
    assert torch.equal(out, x)


# --- three levels: node, network group, world ------------------------------------------------------

@pytest.mark.parametrize("collective", COLLECTIVES)
def test_three_level_plans_verify_on_grids_with_network_groups(collective):
    for nodes, local, per_group in [(4, 2, 2), (6, 3, 2), (6, 2, 3), (8, 4, 2), (12, 2, 4), (16, 3, 4), (9, 1, 3)]:
        topology = Topology.regular(nodes * local, local, 1, per_group)
        for spec in (ThreeLevel(), ThreeLevel(inter="ring", intra="ring"), ThreeLevel(inter="bruck")):
            verify_plan(spec, collective, topology)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_three_level_plans_verify_on_shuffled_placements(collective):
    shuffled = Topology(((5, 1), (0, 4), (3, 2), (7, 6)), 1, 2)
    round_robin = Topology(tuple(tuple(range(n, 12, 6)) for n in range(6)), 1, 3)
    for topology in (shuffled, round_robin):
        verify_plan(ThreeLevel(), collective, topology)


def test_three_level_phases_run_the_least_data_between_groups():
    """All-gather: the global phase moves one block per rank, the group phase one per group,
    the node phase one per node; without groups the plan is the two-level one."""
    t = Topology.regular(24, 2, 1, 3)
    phases = list(build(ThreeLevel(), "all_gather", t, 5).phases())
    assert [(ph.level, ph.input.count, ph.output.count) for ph in phases] == [
        ("global", 1, 4), ("group", 4, 12), ("intra", 12, 24)]
    flat = Topology.regular(24, 2, 1)
    assert build(ThreeLevel(), "all_gather", flat, 5).steps == build(Hierarchical(), "all_gather", flat, 5).steps


class RecordingLevel:
    """A plan level's communicator stand-in (MPI: it blocks the caller) that records the
    algorithm each phase asked for; its selector's `own_native` as an interruptible MPI level's."""

    def __init__(self, own_native, log):
        self.selector, self.log = SimpleNamespace(own_native=own_native), log

    def queues_on_device(self, device):
        return False

    def all_gather(self, output, input, algorithm, async_op, compression):
        self.log.append(("all_gather", algorithm))

    def reduce_scatter(self, output, input, op, algorithm, async_op, compression):
        self.log.append(("reduce_scatter", algorithm))


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_a_plans_native_phases_run_the_levels_own_native(collective):
    """A dead peer must raise CollectiveTimeout on the engine's (interruptible) communicators:
    the hierarchical plan's intra-node "native" runs MPI's nonblocking form there, never
    the blocking one; named algorithms run as named."""
    logs = {"intra": [], "inter": []}
    levels = {"intra": RecordingLevel("native_nonblocking", logs["intra"]),
              "inter": RecordingLevel("native_nonblocking", logs["inter"])}
    plan = build(Hierarchical(), collective, Topology.regular(4, 2), 0)
    n = 3
    buffers = ({"input": torch.ones(n), "output": torch.empty(4 * n)} if collective == "all_gather" else
               {"input": torch.ones(4 * n), "output": torch.empty(n)})
    PlanExecutor(levels).run(plan, buffers, n, "sum")
    assert logs["intra"] == [(collective, "native_nonblocking")]
    inter = "recursive_doubling" if collective == "all_gather" else "recursive_halving"
    assert logs["inter"] == [(collective, inter)]
