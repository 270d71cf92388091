"""Sharding strategies against PaRO's Table 1, Table 2 and Equation 1."""
import pytest

from shard.engine.strategy import STRATEGIES, Scope, Strategy, StrategyError, grouped_reduce_scatter_saving

# PaRO Table 1, in the paper's order.
TABLE_1 = ["NNN", "NNI", "NNG", "NII", "NIG", "NGG", "INI", "ING", "III", "IIG", "IGG", "GNG", "GIG", "GGG"]


def test_principle_1_leaves_exactly_table_1():
    assert sorted(s.letters for s in STRATEGIES) == sorted(TABLE_1)
    assert len(STRATEGIES) == 14


@pytest.mark.parametrize("letters", TABLE_1)
def test_every_table_1_strategy_parses_by_letters_and_name(letters):
    s = Strategy.parse(letters)
    assert s.letters == letters
    assert Strategy.parse(s.name) == s
    assert Strategy.parse(f"paro-{letters.lower()}") == s


@pytest.mark.parametrize("alias,letters", [("ddp", "NNN"), ("zero1", "NNG"), ("zero2", "NGG"),
                                           ("zero3", "GGG"), ("mics", "III"), ("paro-iig", "IIG"),
                                           ("paro-igg", "IGG"), ("paro-nig", "NIG"), ("ZeRO3", "GGG")])
def test_named_strategies(alias, letters):
    assert Strategy.parse(alias).letters == letters


@pytest.mark.parametrize("letters,nearest", [("GNN", "GNG"), ("IIN", "III"), ("NIN", "NII"), ("GGI", "GGG"),
                                             ("IGN", "IGG")])
def test_principle_1_violations_are_refused_with_the_nearest_valid_strategy(letters, nearest):
    with pytest.raises(StrategyError, match=f"Principle 1.*nearest valid strategy is {nearest}"):
        Strategy.parse(letters)
    assert nearest in TABLE_1


@pytest.mark.parametrize("bad", ["zero4", "XYZ", "NN", "paro-", "", 3])
def test_unknown_strategies_are_refused(bad):
    with pytest.raises(StrategyError, match="strategy"):
        Strategy.parse(bad)


def test_group_size_must_divide_the_world():
    s = Strategy.parse("paro-iig")
    s.check_group(8, 4)
    with pytest.raises(StrategyError,
                       match=r"group size 3 does not divide the world size 8; expected one of \[1, 2, 4, 8\]"):
        s.check_group(8, 3)
    with pytest.raises(StrategyError, match="positive integer"):
        s.check_group(8, 0)


@pytest.mark.parametrize("world,group", [(64, 8), (64, 4), (8, 2), (12, 3)])
def test_scope_shards(world, group):
    """I splits within a group of M ranks, G over all N (at N=64, M=8, N/M = M hid a mix-up)."""
    assert [Scope.N.shards(world, group), Scope.I.shards(world, group), Scope.G.shards(world, group)] == \
        [1, group, world]


# PaRO Table 2 (2-byte P and G, K bytes of optimizer state), psi parameters, N ranks, groups of M.
PSI, N, M, K = 7e9, 64, 8, 12


def table_2(n: int, m: int) -> dict:
    return {
        "zero1": (2 * PSI, 2 * PSI, K * PSI / n),
        "zero2": (2 * PSI, 2 * PSI / n, K * PSI / n),
        "zero3": (2 * PSI / n, 2 * PSI / n, K * PSI / n),
        "mics": (2 * PSI / m, 2 * PSI / m, K * PSI / m),
        "paro-igg": (2 * PSI / m, 2 * PSI / n, K * PSI / n),
        "paro-iig": (2 * PSI / m, 2 * PSI / m, K * PSI / n),
        "paro-nig": (2 * PSI, 2 * PSI / m, K * PSI / n),
    }


TABLE_2 = table_2(N, M)


@pytest.mark.parametrize("n,m", [(N, M), (64, 4), (8, 2)])   # (and where N/M is not M)
@pytest.mark.parametrize("name", list(TABLE_2))
def test_memory_per_rank_is_table_2(name, n, m):
    got = Strategy.parse(name).memory_per_rank(PSI, n, m, state_bytes=K)
    assert (got["parameters"], got["gradients"], got["optimizer"]) == pytest.approx(table_2(n, m)[name])


@pytest.mark.parametrize("s,g", [(1, 8), (8, 1), (8, 8), (4, 2)])
def test_equation_1_saving(s, g):
    world, group = 64, 64 // g
    assert grouped_reduce_scatter_saving(PSI, world, group, s) == pytest.approx(PSI * (s - 1) * (g - 1) / world)
