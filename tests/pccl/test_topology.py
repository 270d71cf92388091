"""Topology: nodes, local indices, NICs and the Frontier environment (single process)."""
import pytest

from pccl.core.topology import FRONTIER_ENV, MACHINES, Topology, TopologyError, from_hosts


def test_topology_error_is_a_value_error():
    assert issubclass(TopologyError, ValueError)


def test_regular_2x4_groups_consecutive_ranks():
    t = Topology.regular(8, 4)
    assert t.nodes == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert (t.size, t.num_nodes, t.ranks_per_node, t.nics_per_node) == (8, 2, 4, 1)
    assert t.is_uniform
    assert [t.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [t.local_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert t.intra_ranks(5) == (4, 5, 6, 7)
    assert t.intra_ranks(0) == (0, 1, 2, 3)
    assert t.inter_ranks(5) == (1, 5)
    assert t.inter_ranks(3) == (3, 7)


def test_regular_4x2_groups_consecutive_ranks():
    t = Topology.regular(8, 2)
    assert t.nodes == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert (t.size, t.num_nodes, t.ranks_per_node) == (8, 4, 2)
    assert [t.node_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [t.local_of(r) for r in range(8)] == [0, 1] * 4
    assert t.intra_ranks(5) == (4, 5)
    assert t.inter_ranks(5) == (1, 3, 5, 7)
    assert t.inter_ranks(6) == (0, 2, 4, 6)


@pytest.mark.parametrize("size,per_node", [(1, 1), (6, 1), (6, 6), (12, 3), (12, 4)])
def test_regular_intra_and_inter_groups_partition_the_ranks(size, per_node):
    t = Topology.regular(size, per_node)
    assert t.num_nodes * t.ranks_per_node == t.size == size
    for r in range(size):
        assert r in t.intra_ranks(r) and r in t.inter_ranks(r)
        assert len(t.intra_ranks(r)) == per_node
        assert len(t.inter_ranks(r)) == size // per_node
        # The two groups meet only in r.
        assert set(t.intra_ranks(r)) & set(t.inter_ranks(r)) == {r}
        assert t.intra_ranks(r)[t.local_of(r)] == r
        assert t.inter_ranks(r)[t.node_of(r)] == r


def test_world_size_not_divisible_by_ranks_per_node():
    with pytest.raises(TopologyError, match=r"world size 10 is not divisible by ranks_per_node=4"):
        Topology.regular(10, 4)


@pytest.mark.parametrize("bad", [0, -2, 2.0, "4", None])
def test_ranks_per_node_must_be_a_positive_int(bad):
    with pytest.raises(TopologyError, match="ranks_per_node must be a positive integer"):
        Topology.regular(8, bad)


@pytest.mark.parametrize("nodes", [((0, 1), (3, 4)), ((0, 1, 2), (1, 3)), ((1, 2), (3, 4))])
def test_nodes_must_hold_each_rank_exactly_once(nodes):
    with pytest.raises(TopologyError, match="each rank .* exactly once"):
        Topology(nodes)


@pytest.mark.parametrize("nodes", [((0, 1), ()), ()])
def test_empty_node_or_no_nodes(nodes):
    with pytest.raises(TopologyError, match="at least one rank"):
        Topology(nodes)


def test_nics_per_node_must_be_positive():
    with pytest.raises(TopologyError, match="nics_per_node must be >= 1"):
        Topology(((0, 1),), nics_per_node=0)
    with pytest.raises(TopologyError, match="nics_per_node"):
        Topology.regular(8, 4, nics_per_node=0)


def test_non_uniform_topology():
    t = Topology(((0, 1, 2), (3,)))
    assert not t.is_uniform
    assert (t.size, t.num_nodes) == (4, 2)
    with pytest.raises(TopologyError, match="different numbers of ranks: \\[3, 1\\]"):
        t.ranks_per_node
    assert t.inter_ranks(0) == (0, 3)
    assert t.inter_ranks(1) == (1,)      # node 1 has no local index 1
    assert t.intra_ranks(3) == (3,)
    assert "[3, 1]" in t.describe()


def test_frontier_node():
    t = Topology.machine("frontier", nodes=2)
    assert (t.size, t.num_nodes, t.ranks_per_node, t.nics_per_node) == (16, 2, 8, 4)
    assert [t.nic_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [t.nic_of(r) for r in range(8, 16)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert t.ranks_per_nic() == 2
    assert t.nic_mapping() == "0:0-1;1:2-3;2:4-5;3:6-7"
    assert t.nic_mapping() == FRONTIER_ENV["MPICH_OFI_NIC_MAPPING"]
    assert "2x8" in t.describe() and "4 NIC" in t.describe()


def test_perlmutter_node():
    t = Topology.machine("perlmutter", nodes=3)
    assert (t.size, t.num_nodes, t.ranks_per_node, t.nics_per_node) == (12, 3, 4, 4)
    assert [t.nic_of(r) for r in range(4)] == [0, 1, 2, 3]
    assert t.ranks_per_nic() == 1
    assert t.nic_mapping() == "0:0;1:1;2:2;3:3"


def test_dgx_h100_node():
    t = Topology.machine("dgx-h100", nodes=1)
    assert (t.size, t.ranks_per_node, t.nics_per_node) == (8, 8, 8)
    assert t.nic_mapping() == ";".join(f"{i}:{i}" for i in range(8))


def test_fewer_ranks_than_nics_and_one_nic():
    assert Topology.regular(4, 2, nics_per_node=4).nic_mapping() == "0:0;1:1"
    assert Topology.regular(4, 2, nics_per_node=4).ranks_per_nic() == 1
    one = Topology.regular(8, 4)
    assert [one.nic_of(r) for r in range(4)] == [0, 0, 0, 0]
    assert one.ranks_per_nic() == 4
    assert one.nic_mapping() == "0:0-3"


def test_machines_table_matches_the_papers():
    assert MACHINES["frontier"] == dict(ranks_per_node=8, nics_per_node=4)
    assert MACHINES["perlmutter"] == dict(ranks_per_node=4, nics_per_node=4)


def test_unknown_machine():
    with pytest.raises(TopologyError, match="unknown machine 'summit'"):
        Topology.machine("summit", nodes=2)


def test_from_hosts_groups_by_host():
    t = from_hosts(["a", "a", "b", "b"], None)
    assert t == Topology.regular(4, 2)
    assert t.nics_per_node == 1
    assert from_hosts(["a", "a", "b", "b"], 2).nics_per_node == 2


def test_from_hosts_round_robin_placement():
    t = from_hosts(["a", "b", "a", "b"], None)
    assert t.nodes == ((0, 2), (1, 3))
    assert t.ranks_per_node == 2 and t.num_nodes == 2
    assert [t.node_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert [t.local_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert t.intra_ranks(0) == (0, 2) and t.intra_ranks(3) == (1, 3)
    assert t.inter_ranks(0) == (0, 1) and t.inter_ranks(2) == (2, 3)
    assert t.inter_ranks(3) == (2, 3)


def test_from_hosts_orders_nodes_by_lowest_rank():
    t = from_hosts(["y", "x", "y", "z", "x", "z"], 1)
    assert t.nodes == ((0, 2), (1, 4), (3, 5))


def test_frontier_env_has_the_papers_variables():
    expected = {
        "MPICH_OFI_NIC_POLICY": "USER",
        "MPICH_OFI_NIC_MAPPING": "0:0-1;1:2-3;2:4-5;3:6-7",
        "MPICH_GPU_SUPPORT_ENABLED": "1",
        "FI_CXI_RDZV_THRESHOLD": "0",
        "NCCL_NET_GDR_LEVEL": "PHB",
        "HSA_ENABLE_SDMA": "0",
    }
    for name, value in expected.items():
        assert FRONTIER_ENV.get(name) == value, name
    assert all(isinstance(v, str) for v in FRONTIER_ENV.values())


def test_topologies_are_hashable_and_compare_by_value():
    assert Topology.regular(8, 4) == Topology(((0, 1, 2, 3), (4, 5, 6, 7)))
    assert hash(Topology.regular(8, 4)) == hash(Topology(((0, 1, 2, 3), (4, 5, 6, 7))))
    assert Topology.regular(8, 4) != Topology.regular(8, 4, nics_per_node=2)


def test_network_groups_give_two_more_levels():
    """2 groups x 2 nodes x 2 ranks: "group" joins a local index's ranks within a group,
    "global" one rank per group at the same place."""
    t = Topology.regular(8, 2, 1, 2)
    assert t.has_groups and [t.group_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert t.level_groups("group") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.level_groups("global") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert t.level_ranks("global", 6) == (2, 6) and t.level_ranks("group", 6) == (4, 6)
    assert "groups of 2 nodes" in t.describe()
    assert not Topology.regular(8, 2, 1, 4).has_groups   # one group of all nodes


@pytest.mark.parametrize("bad", [0, 3, 2.0])
def test_nodes_per_group_must_divide_the_nodes(bad):
    with pytest.raises(TopologyError, match="nodes_per_group must be a positive divisor of the 4 nodes"):
        Topology.regular(8, 2, 1, bad)


def test_a_sub_group_has_no_network_groups():
    assert not Topology.regular(8, 2, 1, 2).restrict([0, 1, 4, 5]).has_groups
