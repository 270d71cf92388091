"""The cost model against the textbook formulas (PCCL paper Section 2.2, Thakur et al.),
the profiles, and auto's choice."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pccl import plans
from pccl.algorithms import algorithms_for
from pccl.core.topology import Topology
from pccl.tuning import calibrate, cost_model, profiles
from pccl.tuning.profiles import Link, Network, Profile
from pccl.tuning.selection import Tuner, bucket, forced

MB = 1 << 20


def make_profile(**changes) -> Profile:
    base = dict(name="test", ranks_per_node=4, nics_per_node=1,
                intra=Link(2e-6, 40e9), inter=Link(7e-6, 10e9),
                reduce_bandwidth=60e9, copy_bandwidth=90e9)
    base.update(changes)
    return Profile(**base)


PROFILE = make_profile()


def close(a, b):
    assert a == pytest.approx(b, rel=1e-12)


@pytest.mark.parametrize("p", [2, 4, 7, 8])
def test_single_node_matches_the_formulas(p):
    """One node: every message is intra-node."""
    topo = Topology.regular(p, p)
    n = 3 * MB * p
    a, b, g = PROFILE.intra.alpha, PROFILE.intra.beta, PROFILE.gamma
    m = n / p
    close(cost_model.predict("all_gather", "ring", topo, PROFILE, n), (p - 1) * (a + m * b))
    close(cost_model.predict("reduce_scatter", "ring", topo, PROFILE, n), (p - 1) * (a + m * b + m * g))
    close(cost_model.predict("all_reduce", "ring", topo, PROFILE, n), (p - 1) * (2 * a + 2 * m * b + m * g))
    if p & (p - 1) == 0:
        k = int(math.log2(p))
        close(cost_model.predict("all_gather", "recursive_doubling", topo, PROFILE, n),
              k * a + (p - 1) * m * b)
        close(cost_model.predict("reduce_scatter", "recursive_halving", topo, PROFILE, n),
              k * a + (p - 1) * m * (b + g))


def test_one_rank_per_node_pays_the_inter_node_link():
    p = 8
    topo = Topology.regular(p, 1)
    n = 64 * MB
    m = n / p
    close(cost_model.predict("all_gather", "ring", topo, PROFILE, n),
          (p - 1) * (PROFILE.inter.alpha + m * PROFILE.inter.beta))
    close(cost_model.predict("all_gather", "recursive_doubling", topo, PROFILE, n),
          3 * PROFILE.inter.alpha + (p - 1) * m * PROFILE.inter.beta)
    # Bruck's blocks wrap around the buffer: a step may send two runs, two messages.
    bruck = cost_model.predict("all_gather", "bruck", topo, PROFILE, n)
    assert 0 < bruck - (3 * PROFILE.inter.alpha + (p - 1) * m * PROFILE.inter.beta) <= 3 * PROFILE.inter.alpha


def test_flat_ring_on_nodes_is_bound_by_the_node_boundary():
    """N nodes of L: each step one rank per node crosses nodes; the slower link sets the step."""
    topo = Topology.regular(8, 4)
    n = 64 * MB
    m = n / 8
    step = max(PROFILE.intra.alpha + m * PROFILE.intra.beta, PROFILE.inter.alpha + m * PROFILE.inter.beta)
    close(cost_model.predict("all_gather", "ring", topo, PROFILE, n), 7 * step)


@pytest.mark.parametrize("nics", [1, 2, 4])
def test_hierarchical_all_gather_shares_the_nics(nics):
    """Inter phase: recursive doubling over N nodes with every local rank at once, the NIC
    shared by L/nics ranks; intra phase: the native (ring) all-gather of N-block columns;
    then the shuffle of all p blocks."""
    N, L = 4, 4
    topo = Topology.regular(N * L, L, nics)
    n = 32 * MB
    m = n / (N * L)
    inter = 2 * PROFILE.inter.alpha + (N - 1) * m * (L // nics) * PROFILE.inter.beta
    intra = (L - 1) * (PROFILE.intra.alpha + N * m * PROFILE.intra.beta)
    shuffle = n * PROFILE.copy_beta
    close(cost_model.predict("all_gather", "hierarchical", topo, PROFILE, n), inter + intra + shuffle)


def test_stream_bandwidth_caps_one_rank():
    slow_stream = make_profile(inter=Link(7e-6, 10e9, stream_bandwidth=2e9))
    topo = Topology.regular(4, 1)
    n = 16 * MB
    close(cost_model.predict("all_gather", "ring", topo, slow_stream, n),
          3 * (7e-6 + n / 4 / 2e9))


def test_native_striping_spreads_the_boundary_hop_over_the_nics():
    topo = Topology.regular(32, 8, 4)
    n = 1 << 30
    striped = make_profile(ranks_per_node=8, nics_per_node=4, native_stripes_nics=True)
    plain = make_profile(ranks_per_node=8, nics_per_node=4)
    m = n / 32
    ring = cost_model.predict("all_gather", "ring", topo, striped, n)
    close(ring, 31 * max(2e-6 + m / 40e9, 7e-6 + m / 10e9))
    close(cost_model.predict("all_gather", "native", topo, plain, n), ring)
    close(cost_model.predict("all_gather", "native", topo, striped, n),
          31 * max(2e-6 + m / 40e9, 7e-6 + m / 4 / 10e9))


def test_native_is_counted_as_the_profiles_schedule():
    """MPICH's long reduce-scatter is a pairwise exchange: more inter-node bytes than a ring."""
    topo = Topology.regular(8, 4)
    mpich = make_profile(native_algorithms=(("reduce_scatter", "pairwise"),))
    n = 64 * MB
    native = cost_model.predict("reduce_scatter", "native", topo, mpich, n)
    assert native == cost_model.predict("reduce_scatter", "pairwise", topo, mpich, n)
    assert native > 1.5 * cost_model.predict("reduce_scatter", "ring", topo, mpich, n)
    assert cost_model.predict("all_gather", "native", topo, mpich, n) == cost_model.predict(
        "all_gather", "ring", topo, mpich, n)
    with pytest.raises(ValueError, match="not a schedule of that collective"):
        make_profile(native_algorithms=(("all_gather", "pairwise"),))


MPICH_BANDS = (("all_gather", ((81920, ("recursive_doubling", "bruck")), (524288, ("recursive_doubling", "ring")),
                               (None, "ring"))),
               ("reduce_scatter", ((524288, "recursive_halving"), (None, "pairwise"))),
               ("all_reduce", ((9, "recursive_doubling"), (None, "rabenseifner"))))


def test_native_is_counted_as_its_librarys_schedule_for_each_size_band():
    """MPICH's selection (pccl.tuning.calibrate.NATIVE_SELECTION): the schedule changes
    at the thresholds, which count the whole buffer's bytes."""
    topo, mpich = Topology.regular(8, 4), make_profile(native_algorithms=MPICH_BANDS)
    expected = {("all_gather", 256 << 10): "recursive_doubling", ("all_gather", 512 << 10): "ring",
                ("reduce_scatter", 64 << 10): "recursive_halving", ("reduce_scatter", 4 * MB): "pairwise",
                ("all_reduce", 8): "recursive_doubling", ("all_reduce", 64): "rabenseifner"}
    for (collective, n), schedule in expected.items():
        assert cost_model.predict(collective, "native", topo, mpich, n) == \
            cost_model.predict(collective, schedule, topo, mpich, n), (collective, n)
    sizes = np.array([256 << 10, 512 << 10, 4 * MB])
    vector = cost_model.predict("all_gather", "native", topo, mpich, sizes)
    assert list(vector) == [cost_model.predict("all_gather", "native", topo, mpich, int(n)) for n in sizes]
    assert Profile.from_dict(mpich.to_dict()).native_algorithms == mpich.native_algorithms
    assert Profile.from_dict(json.loads(json.dumps(mpich.to_dict()))) == mpich
    # MPICH's all-gather on a group whose size is no power of two: Bruck below 80 KiB, the
    # ring above (it was counted as recursive doubling, folded: 4x the ring at 256 KiB on 12)
    twelve = Topology.regular(12, 4)
    for n, schedule in ((4 << 10, "bruck"), (256 << 10, "ring"), (MB, "ring")):
        assert cost_model.predict("all_gather", "native", twelve, mpich, n) == \
            cost_model.predict("all_gather", schedule, twelve, mpich, n), n
    # ... and a plan's native phases by their level's size (4 ranks a node: recursive doubling)
    three_nodes = Topology.regular(12, 4)
    spec = plans.Hierarchical(intra="native", inter="ring")
    assert cost_model.predict("all_gather", spec, three_nodes, mpich, 4 << 10) == \
        cost_model.predict("all_gather", plans.Hierarchical(intra="recursive_doubling", inter="ring"), three_nodes,
                           mpich, 4 << 10)
    assert calibrate.NATIVE_SELECTION["MPICH"][0]["all_gather"] == [[81920, ["recursive_doubling", "bruck"]],
                                                                     [524288, ["recursive_doubling", "ring"]],
                                                                     [None, "ring"]]
    # a pair alone stands for every size
    assert make_profile(native_algorithms=(("all_gather", ("recursive_doubling", "bruck")),)).native_algorithm(
        "all_gather", 4) == ("recursive_doubling", "bruck")
    with pytest.raises(ValueError, match="no schedule nor a pair"):
        make_profile(native_algorithms=(("all_gather", ((None, ("ring", "bruck", "ring")),)),))
    with pytest.raises(ValueError, match="must ascend and end with one for every larger size"):
        make_profile(native_algorithms=(("all_gather", ((512, "ring"),)),))
    with pytest.raises(ValueError, match="must ascend"):
        make_profile(native_algorithms=(("all_gather", ((512, "ring"), (64, "bruck"), (None, "ring"))),))


def test_a_calibration_scales_each_algorithms_prediction_by_its_measured_ratio():
    topo = Topology.regular(8, 4)
    points = ((4, 10.0), (4096, 2.0), (MB, 1.0))
    calibrated = make_profile(calibration=(("all_gather", "full", "ring", points),))
    plain = cost_model.predict("all_gather", "ring", topo, PROFILE, np.array([1, 4, 64, 4096, MB, 1 << 30]))
    scaled = cost_model.predict("all_gather", "ring", topo, calibrated, np.array([1, 4, 64, 4096, MB, 1 << 30]))
    # log-linear between the points (64 B lies 40% of the way from 4 B to 4 KiB), held beyond them
    np.testing.assert_allclose(scaled / plain, [10, 10, 10 - 0.4 * 8, 2, 1, 1], rtol=1e-12)
    assert cost_model.predict("all_gather", "bruck", topo, calibrated, 64) == \
        cost_model.predict("all_gather", "bruck", topo, PROFILE, 64)     # no calibration: unscaled
    assert Profile.from_dict(json.loads(json.dumps(calibrated.to_dict()))).calibration == calibrated.calibration
    for points in (((64, 1.0), (4, 2.0)), ((4, math.inf),), ((4, 0.0),), ((4, math.nan),)):
        with pytest.raises(ValueError, match="sizes ascending and finite ratios > 0"):
            make_profile(calibration=(("all_gather", "full", "ring", points),))


def test_auto_takes_the_native_collective_where_it_was_measured_faster():
    """The calibration ratio of native at a size is what `calibrated` keeps from a
    measurement: auto's prediction of native there equals the measured time."""
    from pccl.tuning.cost_model import calibrated

    topo = Topology.regular(4, 4)
    sizes = [4, 1024, 64 * MB]
    measured = {("all_gather", "full", "native"): [(n, 1e-7 if n < MB else 10.0) for n in sizes],
                ("all_gather", "full", "ring"): [(n, cost_model.predict("all_gather", "ring", topo, PROFILE, n))
                                                 for n in sizes]}
    profile = calibrated(PROFILE, topo, measured, "a test")
    for n, seconds in measured[("all_gather", "full", "native")]:
        close(cost_model.predict("all_gather", "native", topo, profile, n), seconds)
    ratios = {name: points for c, _, name, points in profile.calibration if c == "all_gather"}
    assert ratios["ring"] == ((4, 1.0), (1024, 1.0), (64 * MB, 1.0))
    tuner = Tuner(topo, profile)
    assert tuner.name("all_gather", 1024) == "native"
    assert tuner.name("all_gather", 64 * MB) != "native"
    assert profile.sources["calibration"] == "a test"


@pytest.mark.parametrize("size,per_node", [(1, 1), (2, 1), (2, 2), (3, 3), (6, 3), (8, 4), (16, 4)])
def test_a_calibration_never_divides_by_a_prediction_of_no_time(size, per_node):
    """Every candidate auto has, on worlds of one rank up: a ratio is kept only where the
    measured and the predicted time are positive and finite. A world of one rank moves
    nothing (predicted 0 s): none of its figures calibrates anything, and its profile is
    the uncalibrated one (the self-calibration of one rank used to divide by that 0)."""
    from pccl.tuning.cost_model import calibrated

    topo = Topology.regular(size, per_node)
    sizes = [4, 64, 4096, MB, 64 * MB]
    measured = {}
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        for name in Tuner(topo, PROFILE, natives=("native", "native_nonblocking")).candidates(collective):
            measured[(collective, "full", name)] = [(n, 1e-4) for n in sizes]
            measured[(collective, "half", name)] = [(4, 0.0), (64, -1.0), (4096, math.nan), (MB, math.inf),
                                                    (64 * MB, 2e-3)]
    profile = calibrated(PROFILE, topo, measured, "a test")
    if size == 1:
        assert profile.calibration == (), "one rank: nothing to calibrate"
        return
    kept = {(c, k, name): points for c, k, name, points in profile.calibration}
    assert kept.keys() == measured.keys()
    for (collective, klass, name), points in kept.items():
        assert all(0 < r < math.inf for _, r in points)
        if klass == "half":
            assert [n for n, _ in points] == [64 * MB], "only the one valid time makes a ratio"
        else:
            assert [n for n, _ in points] == sizes
            # the ratio is measured / predicted: the calibrated prediction is the measurement
            close(cost_model.predict(collective, plans.NAMED.get(name, name), topo, profile, MB), 1e-4)


def test_sizes_vectorize():
    topo = Topology.regular(16, 4)
    sizes = np.array([1, 4, 64]) * MB
    vector = cost_model.predict("reduce_scatter", "hierarchical", topo, PROFILE, sizes)
    assert vector.shape == (3,)
    for size, t in zip(sizes, vector):
        close(cost_model.predict("reduce_scatter", "hierarchical", topo, PROFILE, int(size)), t)
    assert np.all(np.diff(vector) > 0)


def test_a_2048_rank_heatmap_column_is_quick():
    import time

    prof = profiles.load("frontier")
    topo = Topology.regular(2048, 8, 4)
    start = time.perf_counter()
    times = {a: cost_model.predict("all_gather", a, topo, prof, np.array([16, 64, 1024]) * MB)
             for a in ("ring", "recursive_doubling", "hierarchical")}
    assert time.perf_counter() - start < 20  # a loose bound; the CLI reports the real figure
    speedup = times["ring"] / times["hierarchical"]
    assert speedup[0] > 10 and speedup[0] > speedup[1] > speedup[2]


# ------------------------------------------------------------------ profiles


@pytest.mark.parametrize("name", profiles.builtin_names())
def test_builtin_profiles_load_and_cite_their_numbers(name):
    prof = profiles.load(name)
    assert prof.name == name
    assert prof.intra.source and prof.inter.source
    assert prof.sources["reduce"] and prof.sources["copy"] and prof.sources["native"]
    assert Profile.from_dict(prof.to_dict()) == prof


def test_builtin_machines_match_the_topology_table():
    from pccl.core.topology import MACHINES

    for machine, shape in MACHINES.items():
        prof = profiles.load(machine)
        assert (prof.ranks_per_node, prof.nics_per_node) == (shape["ranks_per_node"], shape["nics_per_node"])


def test_profile_files_round_trip_and_bad_ones_say_why(tmp_path):
    path = tmp_path / "sub" / "p.json"
    PROFILE.save(path)
    assert profiles.load(path) == PROFILE
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="not a valid profile"):
        profiles.load(tmp_path / "bad.json")
    # fields of another JSON type: an AttributeError on rank 0 left the other ranks waiting for its profile
    for wrong in ([], {**PROFILE.to_dict(), "intra": None}, {**PROFILE.to_dict(), "native": "ring"}):
        (tmp_path / "wrong.json").write_text(json.dumps(wrong))
        with pytest.raises(ValueError, match="not a valid profile"):
            profiles.load(tmp_path / "wrong.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        profiles.load(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="built-in name"):
        profiles.load("no-such-machine")
    with pytest.raises(ValueError, match="inter.bandwidth"):
        make_profile(inter=Link(1e-6, 0.0))


# ------------------------------------------------------------------ auto


def auto_of(times: dict) -> str:
    """auto's rule: the fastest prediction, but native unless that is 10% faster."""
    best = min(times, key=times.get)
    return best if times[best] <= 0.9 * times["native"] else "native"


def test_auto_takes_the_fastest_prediction_and_native_unless_clearly_beaten():
    topo = Topology.regular(64, 8, 4)
    prof = profiles.load("frontier")
    tuner = Tuner(topo, prof)
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        for size in (64 << 10, 16 * MB, 1 << 30):
            times = tuner.predictions(collective, size)
            assert tuner.name(collective, size) == auto_of(times)
    # native within 5% of the fastest: native; more than 5% behind: the fastest
    sizes = [4, 1024, 64 * MB]
    close_call = make_profile(calibration=(("all_gather", "full", "native", tuple((n, 0.7) for n in sizes)),))
    flat = Tuner(Topology.regular(4, 4), close_call)
    times = flat.predictions("all_gather", 1024)
    best = min(times, key=times.get)
    assert best != "native" and times["native"] < times[best] / 0.95, times
    assert flat.name("all_gather", 1024) == "native"
    slow_native = make_profile(calibration=(("all_gather", "full", "native", tuple((n, 2.0) for n in sizes)),))
    assert Tuner(Topology.regular(4, 4), slow_native).name("all_gather", 1024) == best
    assert set(tuner.candidates("all_gather")) == set(algorithms_for("all_gather")) | {"native", "hierarchical",
                                                                                         "ho_ring"}
    assert "hierarchical" not in Tuner(Topology.regular(8, 8), prof).candidates("all_gather")
    assert "hierarchical" not in Tuner(topo, prof, with_plans=False).candidates("all_gather")


def test_auto_decides_once_per_size_bucket(monkeypatch):
    tuner = Tuner(Topology.regular(16, 4), PROFILE)
    calls = []
    real = tuner.predictions
    monkeypatch.setattr(tuner, "predictions", lambda c, n, dtype: calls.append(n) or real(c, n, dtype))
    first = tuner.choose("all_gather", 16 * MB + 4096)
    assert tuner.choose("all_gather", 16 * MB) == first
    # one evaluation, at the bucket's lower edge, whichever size came first (a choice that
    # depended on it would differ between processes whose calls came in another order)
    assert calls == [16 * MB]
    tuner.choose("all_gather", 32 * MB)
    assert len(calls) == 2
    assert bucket(16 * MB) == bucket(16 * MB + 1) < bucket(20 * MB)
    tuner.choose("all_gather", 16 * MB, torch.bfloat16)
    assert len(calls) == 3, "each reduction class decides on its own"


def test_the_environment_forces_a_choice_read_when_the_tuner_is_made(monkeypatch):
    def tuner():
        return Tuner(Topology.regular(16, 4), PROFILE)
    monkeypatch.setenv("PCCL_ALGO", "ring")
    made = tuner()
    assert made.choose("all_gather", 1 << 30) == "ring"
    monkeypatch.setenv("PCCL_ALGO", "bruck")
    assert made.choose("all_gather", 1 << 30) == "ring", "read once, as NCCL reads NCCL_ALGO"
    monkeypatch.setenv("PCCL_ALGO", "recursive_halving")   # not an all-gather: ignored there
    assert forced("all_gather") is None
    assert tuner().choose("reduce_scatter", MB) == "recursive_halving"
    monkeypatch.setenv("PCCL_ALL_GATHER_ALGO", "hierarchical")
    assert tuner().choose("all_gather", MB) == plans.Hierarchical()
    monkeypatch.setenv("PCCL_ALL_GATHER_ALGO", "fastest")
    with pytest.raises(ValueError, match="PCCL_ALL_GATHER_ALGO='fastest'"):
        tuner()
    monkeypatch.delenv("PCCL_ALL_GATHER_ALGO")
    monkeypatch.setenv("PCCL_ALGO", "fastest")
    with pytest.raises(ValueError, match="PCCL_ALGO='fastest'"):
        tuner()


@pytest.mark.parametrize("shape,with_plans", [((8, 8), True),     # one node
                                              ((16, 4), False)])   # no levels
def test_a_forced_plan_is_ignored_where_plans_cannot_run(monkeypatch, shape, with_plans):
    monkeypatch.setenv("PCCL_ALGO", "hierarchical")
    tuner = Tuner(Topology.regular(*shape), PROFILE, with_plans=with_plans)
    assert tuner.choose("all_gather", MB) in tuner.candidates("all_gather")
    assert isinstance(tuner.choose("all_gather", MB), str)


def test_a_ring_between_network_groups_waits_on_the_groups_links():
    """4 nodes of 1 rank in 2 groups, links between groups oversubscribed 8:1: each ring
    step one rank per group sends a block out, over a group bandwidth of 2 NICs / 8."""
    net = make_profile(ranks_per_node=1, network=Network(2, 9e-6, 8.0))
    m = 1 * MB
    grouped = cost_model.predict("all_gather", "ring", Topology.regular(4, 1, 1, 2), net, 4 * m)
    close(grouped, 3 * (9e-6 + m * 8 / (2 * 10e9)))
    flat = cost_model.predict("all_gather", "ring", Topology.regular(4, 1), net, 4 * m)
    close(flat, 3 * (7e-6 + m / 10e9))


def test_three_levels_send_less_between_groups_and_auto_takes_them_there():
    """Frontier's dragonfly (128-node groups, 1.75:1): the two-level plan's recursive
    doubling between nodes crosses groups with N - G blocks per rank, the three-level plan
    with K - 1; without groups the three-level plan is no candidate."""
    frontier = profiles.load("frontier")
    topo = Topology.regular(16384, 8, 4, 128)
    size = 256 * MB
    three = cost_model.predict("all_gather", plans.NAMED["three_level"], topo, frontier, size)
    two = cost_model.predict("all_gather", "hierarchical", topo, frontier, size)
    assert three < 0.9 * two
    assert Tuner(topo, frontier).name("all_gather", size) == "three_level"
    assert "three_level" not in Tuner(Topology.regular(16384, 8, 4), frontier).candidates("all_gather")


def test_network_tier_profiles_carry_sources_and_bad_values_say_why():
    for name in ("frontier", "dgx-h100", "fat-tree-2to1"):
        net = profiles.load(name).network
        assert net.nodes_per_group > 1 and net.oversubscription >= 1 and len(net.source) > 100
        assert Profile.from_dict(profiles.load(name).to_dict()) == profiles.load(name)
    with pytest.raises(ValueError, match="network.oversubscription must be a finite positive number"):
        make_profile(network=Network(4, 1e-6, 0.0))
    # an infinite latency (1e999 in a JSON file) made every prediction NaN, and shard-sim's
    # replay of them never ended; a bool is no count of NICs
    for bad, message in (({"inter": Link(math.inf, 10e9)}, "inter.alpha must be a finite number >= 0 seconds"),
                         ({"copy_bandwidth": math.inf}, "copy_bandwidth must be a finite positive number"),
                         ({"network": Network(4, math.inf, 1.0)}, "network.alpha must be a finite"),
                         ({"nics_per_node": True}, "nics_per_node must be a positive integer, got True")):
        with pytest.raises(ValueError, match=message):
            make_profile(**bad)
    text = {**profiles.load("generic").to_dict()}
    text["intra"] = {**text["intra"], "bandwidth_GBps": "fast"}   # (float() said only "could not convert")
    with pytest.raises(ValueError, match=r"here.json: not a valid profile \(TypeError: 'fast' is a string"):
        Profile.from_dict(text, origin="here.json")


@pytest.mark.parametrize("shape", [(8, 4, 2), (12, 6, 4), (16, 8, 4), (6, 3, 2), (8, 2, 4)])
def test_the_cost_models_places_are_the_topologys(shape):
    """Each rank's node, NIC and network group as Topology says (nic_of: consecutive local
    ranks share a NIC); a round-robin NIC mapping changed Bruck's prediction by 15% unseen."""
    size, per_node, nics = shape
    topology = Topology.regular(size, per_node, nics, nodes_per_group=2 if size // per_node % 2 == 0 else None)
    node, nic, group = cost_model.places(topology)
    assert node.tolist() == [topology.node_of(r) for r in range(size)]
    assert nic.tolist() == [topology.node_of(r) * nics + topology.nic_of(r) for r in range(size)]
    per_group = topology.nodes_per_group or topology.num_nodes
    assert group.tolist() == [topology.node_of(r) // per_group for r in range(size)]
