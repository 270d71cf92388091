"""The cost model and auto with compression: hand-computed predictions of compressed
schedules, the profiles' codec speeds, and compression="auto"'s choices."""
from __future__ import annotations

import math

import pytest
import torch

from pccl import plans
from pccl.core.topology import Topology
from pccl.runtime.dry_run import DryRunCommunicator
from pccl.tuning import cost_model, profiles
from pccl.tuning.profiles import CodecRate, Link, Profile
from pccl.tuning.selection import GAIN_FOR_LOSS, Tuner, compression_problem

MB = 1 << 20
INT8 = CodecRate(encode=2e9, decode=8e9, call=1e-6)
PROFILE = Profile(name="test", ranks_per_node=4, nics_per_node=1, intra=Link(2e-6, 40e9), inter=Link(7e-6, 1e9),
                  reduce_bandwidth=60e9, copy_bandwidth=90e9, codecs=(("int8", INT8),))


def int8_ratio(block_bytes: float) -> float:
    values = block_bytes / 4
    return (values + 4 * -(-values // 128)) / block_bytes


@pytest.mark.parametrize("p", [2, 4, 8])
def test_compressed_rings_match_the_formulas(p):
    """One rank per node, every hop crosses the network. All-gather: the owner encodes its
    block once, the encodings travel p-1 hops, every block (its own too) is decoded at the
    end. Reduce-scatter: each step encodes the partial sum and decodes-and-reduces one.
    Per message (p2p): every hop encodes and decodes."""
    topo, m = Topology.regular(p, 1), 1 * MB
    a, b, r = PROFILE.inter.alpha, PROFILE.inter.beta, int8_ratio(m)
    hop, enc, dec, call = a + r * m * b, m / INT8.encode, m / INT8.decode, INT8.call
    predict = lambda collective, codec: cost_model.predict(collective, "ring", topo, PROFILE, p * m,  # noqa: E731
                                                           compression=codec)
    assert predict("all_gather", "int8") == pytest.approx((p - 1) * hop + enc + p * dec + (1 + p) * call, rel=1e-12)
    assert predict("reduce_scatter", "int8") == pytest.approx((p - 1) * (hop + enc + dec + 2 * call), rel=1e-12)
    assert predict("all_gather", "p2p:int8") == pytest.approx((p - 1) * (hop + enc + dec + 2 * call), rel=1e-12)
    exact = cost_model.predict("all_gather", "ring", topo, PROFILE, p * m)
    assert exact == pytest.approx((p - 1) * (a + m * b), rel=1e-12)


def test_plans_compress_their_inter_node_level_only():
    topo = Topology.regular(8, 4)
    both = {"intra": "int8", "inter": "int8"}
    plain, inter, everywhere = (cost_model.predict("all_gather", "hierarchical", topo, PROFILE, 64 * MB, compression=c)
                                for c in (None, "int8", both))
    assert inter < plain          # the slow link carries a quarter of the bytes
    assert everywhere != inter    # the intra-node phase is compressed too
    assert inter == cost_model.predict("all_gather", "hierarchical", topo, PROFILE, 64 * MB,
                                       compression={"inter": "int8"})


def test_a_profile_without_the_codecs_speed_says_how_to_get_it(tmp_path):
    with pytest.raises(ValueError, match="no speed for codec 'bf16'.*calibrate"):
        cost_model.predict("all_reduce", "ring", Topology.regular(4, 1), PROFILE, MB, compression="bf16")
    path = tmp_path / "p.json"
    PROFILE.save(path)
    assert profiles.load(path) == PROFILE   # codec speeds round-trip through the file
    with pytest.raises(ValueError, match="call must be a finite number >= 0"):
        Profile(**{**PROFILE.__dict__, "codecs": (("int8", CodecRate(1e9, 1e9, -1.0)),)})


def test_auto_compresses_only_where_it_clearly_pays():
    tuner = Tuner(Topology.regular(8, 4), profiles.load("emulated-1gbit"))
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        codec, algorithm = tuner.choose_compressed(collective, 64 * MB, torch.float32)
        assert codec == "int8"
        times = tuner.compressed_predictions(collective, 64 * MB, torch.float32)
        assert times[(codec, algorithm)] == min(times.values())
        assert times[(codec, algorithm)] <= GAIN_FOR_LOSS * min(t for (c, _), t in times.items() if c is None)
        assert tuner.choose_compressed(collective, 64, torch.float32)[0] is None   # 64 bytes: kernels cost more
        assert tuner.choose_compressed(collective, 64 * MB, torch.bfloat16)[0] in ("int8", None)   # never a cast
    assert tuner.choose_compressed("all_reduce", 64 * MB, torch.float32, "recursive_doubling")[1] == \
        "recursive_doubling"
    assert tuner.choose_compressed("all_gather", 64 * MB, torch.float32, "native") == (None, "native")
    for ho_ring in ("ho_ring", plans.HORing()):   # its all-reduce cannot compress consistently
        assert tuner.choose_compressed("all_reduce", 64 * MB, torch.float32, ho_ring)[0] is None
    assert tuner.choose_compressed("reduce_scatter", 64 * MB, torch.float32, plans.HORing())[0] == "int8"
    assert Tuner(Topology.regular(64, 8, 4), profiles.load("frontier")).choose_compressed(
        "all_reduce", 64 * MB, torch.float32)[0] is None   # no codec speeds in the profile: none


def test_a_lossy_codec_is_taken_only_past_its_margin_at_each_buckets_edge():
    """A codec must be predicted GAIN_FOR_LOSS of the exact time or less, not just faster
    (sizes exist on this profile where it is faster by less), decided at each size
    bucket's lower edge."""
    from pccl.tuning.selection import BUCKETS_PER_DOUBLING

    tuner = Tuner(Topology.regular(8, 4), profiles.load("emulated-1gbit"))
    narrow = 0
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        for q in range(8 * BUCKETS_PER_DOUBLING, 22 * BUCKETS_PER_DOUBLING):   # 256 B - 4 MB (narrow ones lie low)
            edge = 2 ** (q / BUCKETS_PER_DOUBLING)
            times = tuner.compressed_predictions(collective, edge, torch.float32)
            exact = min(t for (c, _), t in times.items() if c is None)
            coded = min(t for (c, _), t in times.items() if c is not None)
            chosen = tuner.choose_compressed(collective, math.ceil(edge), torch.float32)[0]
            assert (chosen is not None) == (coded <= GAIN_FOR_LOSS * exact), (collective, edge)
            narrow += GAIN_FOR_LOSS * exact < coded < exact
    assert narrow > 0, "no size where the codec is faster by less than the margin: the test tests nothing"


def test_each_dtype_decides_its_compression_apart():
    """A bf16 call after an fp32 one of the same size took fp32's lossy choice where the
    model says it does not pay for bf16."""
    topology, profile = Topology.regular(8, 4), profiles.load("emulated-1gbit")
    differ = 0
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        for k in range(8, 24):
            fresh = {dtype: Tuner(topology, profile).choose_compressed(collective, 1 << k, dtype)
                     for dtype in (torch.float32, torch.bfloat16)}
            shared = Tuner(topology, profile)
            assert [shared.choose_compressed(collective, 1 << k, dtype) for dtype in fresh] == list(fresh.values())
            differ += fresh[torch.float32] != fresh[torch.bfloat16]
    assert differ > 0, "fp32 and bf16 never decide differently here: the test tests nothing"


def test_compression_auto_resolves_before_anything_is_sent(monkeypatch):
    comm = DryRunCommunicator(Topology.regular(8, 4), profiles.load("emulated-1gbit"))
    codecs, algorithm = comm._codecs("auto", torch.empty(16 * MB // 4), "all_reduce", "auto")
    assert codecs["flat"].name == codecs["inter"].name == "int8" and isinstance(algorithm, str)
    assert comm._codecs("auto", torch.empty(16), "all_reduce", "auto")[0] == {}
    assert comm._codecs("auto", torch.empty(16 * MB // 4, device="meta"), "all_reduce", "ring") == ({}, "ring")
    monkeypatch.setenv("PCCL_COMPRESSION", "auto")   # read when a communicator is made
    assert comm._codecs(None, torch.empty(16 * MB // 4), "all_reduce", "auto") == ({}, "auto")
    comm = DryRunCommunicator(Topology.regular(8, 4), profiles.load("emulated-1gbit"))
    assert comm._codecs(None, torch.empty(16 * MB // 4), "all_reduce", "ring")[1] == "ring"
    assert comm._codecs(None, torch.empty(16 * MB // 4), "all_reduce", "auto")[0]["flat"].name == "int8"
    with pytest.raises(ValueError, match="algorithm"):
        comm._codecs("auto", torch.empty(16), "all_reduce", "no-such-algorithm")


def test_auto_leaves_max_and_min_exact_as_the_default_does(monkeypatch):
    """compression="auto" compressed a 16 MB max with int8 where it predicted a gain: on 4
    ranks its maximum moved by up to 0.045 (values in [-1, 1]), while PCCL_COMPRESSION=auto
    left it exact. Now neither compresses a max or min; a codec named on the call still
    does (the caller's rule)."""
    big = torch.empty(16 * MB // 4)
    comm = DryRunCommunicator(Topology.regular(8, 4), profiles.load("emulated-1gbit"))
    for op in ("max", "min"):
        assert comm._codecs("auto", big, "all_reduce", "auto", op)[0] == {}
        assert comm._codecs("auto", big, "reduce_scatter", "auto", op)[0] == {}
        assert comm._codecs("int8", big, "all_reduce", "auto", op)[0]["flat"].name == "int8"
    for op in ("sum", "avg"):
        assert comm._codecs("auto", big, "all_reduce", "auto", op)[0]["flat"].name == "int8"
    monkeypatch.setenv("PCCL_COMPRESSION", "auto")   # read when a communicator is made
    comm = DryRunCommunicator(Topology.regular(8, 4), profiles.load("emulated-1gbit"))
    assert comm._codecs(None, big, "all_reduce", "auto", "max")[0] == {}
    assert comm._codecs(None, big, "all_reduce", "auto", "sum")[0]["flat"].name == "int8"


def test_a_codec_on_a_plan_level_running_the_transports_own_collective_is_refused_before_sending():
    """Hierarchical's intra-node phases are MPI's own collective by default: nothing to encode
    there. Refused as the call resolves, not after the inter-node phase has moved data."""
    from pccl.compression.codecs import codec

    comm = DryRunCommunicator(Topology.regular(8, 4), profiles.load("emulated-1gbit"))
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        with pytest.raises(ValueError, match="compression on the intra level of .* the transport's own collective"):
            comm.selector.resolve(collective, plans.Hierarchical(), 16 * MB, "cpu", {"intra": codec("int8")})
        for spec in (plans.Hierarchical(intra="ring"), plans.Hierarchical()):   # a schedule there; the inter level
            comm.selector.resolve(collective, spec, 16 * MB, "cpu",
                                  {"intra": codec("int8")} if spec.intra == "ring" else {"inter": codec("int8")})


def test_a_compressed_calls_auto_is_the_fastest_predicted_with_its_codec(monkeypatch):
    topo, prof = Topology.regular(8, 4), profiles.load("emulated-1gbit")
    tuner = Tuner(topo, prof)
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        for size in (64 << 10, 4 * MB, 64 * MB):
            chosen = tuner.choose_for(collective, size, torch.float32, "int8")
            times = {n: cost_model.predict(collective, plans.NAMED.get(n, n), topo, prof, size, compression="int8")
                     for n in tuner.candidates(collective)
                     if plans.compresses_consistently(plans.spec_of(n), collective)}
            assert chosen == min(times, key=times.get)
    assert "ho_ring" not in {tuner.choose_for("all_gather", s, torch.float32, "int8") for s in (MB, 16 * MB)}
    # A profile without the codec's speed: the fastest uncompressed prediction among those.
    frontier = Tuner(Topology.regular(64, 8, 4), profiles.load("frontier"))
    assert frontier.choose_for("all_gather", 64 * MB, torch.float32, "int8") != "ho_ring"
    comm = DryRunCommunicator(topo, prof)
    chosen = tuner.choose_for("all_reduce", 4 * MB, torch.float32, "int8")   # what a compressed call's auto runs
    assert comm.selector.resolve("all_reduce", "auto", 4 * MB, compression="int8") == plans.NAMED.get(chosen, chosen)
    monkeypatch.setenv("PCCL_ALGO", "ring")
    assert Tuner(topo, prof).choose_for("all_gather", MB, torch.float32, "int8") == "ring"


def test_a_codec_for_a_level_the_algorithm_lacks_is_refused_and_auto_takes_only_what_runs_it():
    """compression={"inter": ...} on a flat ring ran it exact, silently; {"flat": ...} on a
    plan likewise; and auto with {"intra": ...} chose Hierarchical, whose intra level runs
    MPI's own collective, then refused it (from 64 KiB on)."""
    from pccl.compression.codecs import codec

    comm = DryRunCommunicator(Topology.regular(8, 4), profiles.load("emulated-1gbit"))
    inter, flat, intra = ({level: codec("bf16")} for level in ("inter", "flat", "intra"))
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        with pytest.raises(ValueError, match="'ring' is a flat schedule and the compression names plan levels only"):
            comm.selector.resolve(collective, "ring", 16 * MB, "cpu", inter)
        with pytest.raises(ValueError, match="is a plan and the compression names none of its levels"):
            comm.selector.resolve(collective, plans.Hierarchical(), 16 * MB, "cpu", flat)
        assert comm.selector.resolve(collective, "ring", 16 * MB, "cpu", flat) == "ring"
        for size in (16, 64 << 10, 16 * MB):   # auto: only what carries the codec where it is asked for, or
            for levels in (intra, inter):      # a clear refusal where nothing it weighs does
                try:
                    chosen = comm.selector.resolve(collective, "auto", size, "cpu", levels)
                except ValueError as e:
                    assert "no algorithm auto weighs" in str(e) and levels is intra, e
                    continue
                assert compression_problem(chosen, collective, levels) == "", (collective, size, chosen)
        assert comm.selector.resolve(collective, plans.Hierarchical(intra="ring"), MB, "cpu", intra).intra == "ring"


def test_a_three_level_plan_refuses_a_codec_for_its_network_levels():
    """Its network phases run on levels of their own (group, global), which a codec given for
    "inter" (or one codec, a plan's inter level's) never reached: 8 ranks in 2 groups of 2
    nodes of 2 ran int8 exact. Refused by name; its node level compresses; auto with a codec
    never takes it."""
    from pccl.compression.codecs import codec

    grouped = Topology.regular(8, 2, nodes_per_group=2)
    assert plans.three_level.applies(grouped)
    comm = DryRunCommunicator(grouped, profiles.load("frontier"))
    int8 = codec("int8")
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        for compression in (int8, {"inter": int8}, {"intra": int8, "inter": int8}):
            with pytest.raises(ValueError, match="runs its network phases on two levels of its own"):
                comm.selector.resolve(collective, "three_level", 16 * MB, "cpu", compression)
        node = plans.ThreeLevel(intra="ring")
        assert comm.selector.resolve(collective, node, 16 * MB, "cpu", {"intra": int8}) == node
        for size in (64 << 10, 16 * MB, 256 * MB):
            chosen = comm.selector.resolve(collective, "auto", size, "cpu", int8)
            assert not isinstance(chosen, plans.ThreeLevel), (collective, size, chosen)
