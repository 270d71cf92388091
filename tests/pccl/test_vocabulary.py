"""The one registry of algorithm names (pccl/vocabulary.py), and the places that ask it."""
import pytest

from pccl import vocabulary
from pccl.plans import Hierarchical, HORing

PLANS = ("hierarchical", "three_level", "ho_ring")


def test_each_collective_takes_auto_the_natives_its_schedules_and_the_plans():
    common = ("auto", "native", "native_nonblocking")
    assert vocabulary.names("all_gather") == common + ("ring", "recursive_doubling", "bruck") + PLANS
    assert vocabulary.names("reduce_scatter") == common + ("ring", "recursive_halving", "pairwise") + PLANS
    assert vocabulary.names("all_reduce") == common + ("ring", "recursive_doubling", "rabenseifner") + PLANS
    assert set(vocabulary.names()) == set(common + ("ring", "recursive_doubling", "bruck", "recursive_halving",
                                                    "pairwise", "rabenseifner") + PLANS)
    assert "auto" not in vocabulary.names("all_gather", auto=False)
    with pytest.raises(ValueError, match="collective must be one of"):
        vocabulary.names("broadcast")


def test_every_name_has_one_kind():
    assert [vocabulary.kind(n) for n in ("auto", "native", "native_nonblocking", "bruck", "ho_ring")] == \
        ["auto", "native", "native", "schedule", "plan"]
    assert vocabulary.kind(Hierarchical(inter="ring")) == vocabulary.kind(HORing()) == "plan"
    assert vocabulary.kind("tree") is None and vocabulary.kind(3) is None and vocabulary.kind(None) is None


def test_check_says_what_a_collective_takes():
    assert vocabulary.check("reduce_scatter", "pairwise") == "schedule"
    assert vocabulary.check("all_reduce", Hierarchical()) == "plan"
    with pytest.raises(ValueError, match=r"unknown algorithm 'tree'; expected one of \('auto'"):
        vocabulary.check("all_reduce", "tree")
    with pytest.raises(ValueError, match=r"algorithm 'pairwise' does not implement all_gather; expected one of "
                                         r"\('auto', 'native', 'native_nonblocking', 'ring', 'recursive_doubling'"):
        vocabulary.check("all_gather", "pairwise")


def test_shard_trains_preflight_asks_the_registry_per_collective():
    from functools import partial

    from shard.tools.settings import ConfigError, algorithm
    check = partial(algorithm, "comm.algorithm")   # the comm.algorithm field's check
    check("hierarchical")
    check({"all_gather": "bruck", "reduce_scatter": "pairwise"})
    with pytest.raises(ConfigError, match=r"comm.algorithm.all_gather must be one of \(.*\), got 'pairwise'"):
        check({"all_gather": "pairwise"})   # a reduce-scatter's schedule: refused before anything starts
    with pytest.raises(ConfigError, match=r"comm.algorithm must be one of \(.*\), got 'tree'"):
        check("tree")
    with pytest.raises(ConfigError, match="unknown collective 'broadcast'"):
        check({"broadcast": "ring"})
