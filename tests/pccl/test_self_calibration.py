"""auto out of the box: the self-calibration's cache (its key, atomic writes, corrupt and
stale entries), what auto does before and after a measurement, the reduction classes, and
(on several ranks) that every rank holds rank 0's figures and decides alike."""
from __future__ import annotations

import json
import math

import pytest
import torch

from pccl.core.topology import Topology
from pccl.tuning import self_calibration as sc
from pccl.tuning.cost_model import calibrated
from pccl.tuning.profiles import Link, Profile
from pccl.tuning.selection import Tuner
from tests.support.mpirun import mpiexec

MB = 1 << 20
KEY = {"format": sc.FORMAT, "pccl": "0.1.0", "node": "a CPU, 2 cores, x86_64", "mpi": "MPICH Version: 4.3",
       "transport": "mpi", "executor": "cpp", "ranks": 4, "nodes": [4], "nics_per_node": 1, "interruptible": False}
FIGURES = {"all_gather": {"ring": [[16, 2e-5], [32, 3e-5]], "native": [[16, 1e-5], [32, 4e-5]]}}


def test_every_part_of_the_key_names_its_own_file(tmp_path):
    env = {"PCCL_CACHE_DIR": str(tmp_path)}
    path = sc.path_of(KEY, env)
    assert path.parent == tmp_path / "calibration" and path == sc.path_of(dict(KEY), env)
    others = {sc.path_of({**KEY, field: "other"}, env) for field in KEY}
    assert len(others) == len(KEY) and path not in others


def test_the_cache_directory_comes_from_the_environment(tmp_path):
    assert sc.cache_dir({"PCCL_CACHE_DIR": "/x/y"}) == sc.Path("/x/y")
    assert sc.cache_dir({"XDG_CACHE_HOME": "/c"}) == sc.Path("/c/pccl")
    assert sc.cache_dir({}).parts[-2:] == (".cache", "pccl")


def test_an_entry_reads_back_as_written(tmp_path):
    path = tmp_path / "calibration" / "x.json"
    sc.write(path, KEY, FIGURES)
    assert sc.read(path, KEY) == (FIGURES, None)
    assert sc.read(tmp_path / "missing.json", KEY) == ({}, None)   # no file: an empty cache, no complaint


def test_a_failed_write_leaves_the_previous_entry_whole(tmp_path, monkeypatch):
    path = tmp_path / "calibration" / "x.json"
    sc.write(path, KEY, FIGURES)

    def crash(*args):
        raise OSError("disk full")
    monkeypatch.setattr(sc.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        sc.write(path, KEY, {"all_reduce/half": FIGURES["all_gather"]})
    assert sc.read(path, KEY) == (FIGURES, None)
    assert [p.name for p in path.parent.iterdir()] == ["x.json"], "no temporary file left behind"


def test_an_entry_reach_grew_for_some_candidates_is_valid():
    assert sc.valid_entry({"ring": [[16, 1e-5], [64, 2e-5]], "native": [[16, 1e-5]]})
    assert not sc.valid_entry({"ring": [[16, 1e-5], [64, 2e-5]], "native": [[32, 1e-5]]})


@pytest.mark.parametrize("content,why", [
    (b"\x00\xff garbage", "unreadable"),
    (b'{"key": ', "unreadable"),
    (json.dumps({"key": {**KEY, "format": sc.FORMAT + 1}, "measured": FIGURES}).encode(), "another key"),
    (json.dumps({"key": {**KEY, "pccl": "0.0.9"}, "measured": FIGURES}).encode(), "another key"),
    (json.dumps({"key": KEY, "measured": {"all_gather": {"ring": [[32, 1e-5], [16, 1e-5]]}}}).encode(), "malformed"),
    (json.dumps({"key": KEY, "measured": {"all_gather": {"ring": [[16, -1.0]]}}}).encode(), "malformed"),
    (json.dumps({"key": KEY, "measured": {"all_gather": {"ring": []}}}).encode(), "malformed"),
    (json.dumps({"key": KEY, "measured": [1, 2]}).encode(), "malformed"),
    (json.dumps([KEY]).encode(), "another key"),
    (json.dumps({"key": KEY, "measured": {"all_gather": {"ring": [[16, float("inf")]]}}}).encode(), "malformed"),
    (json.dumps({"key": KEY, "measured": {"all_gather": {"ring": [[16, float("nan")]]}}}).encode(), "malformed"),
    (json.dumps({"key": KEY, "measured": {"all_gather": {"ring": [[16, 0]]}}}).encode(), "malformed"),
    (json.dumps({"key": KEY, "measured": {"all_gather": {"ring": [[16, 1e-5]], "native": [[32, 1e-5]]}}}).encode(),
     "malformed"),   # not what measure() writes: every candidate at the same sizes
])
def test_a_corrupt_or_stale_entry_is_refused_with_the_reason_never_raised(tmp_path, content, why):
    path = tmp_path / "x.json"
    path.write_bytes(content)
    measured, refused = sc.read(path, KEY)
    assert measured == {} and why in refused


def test_the_world_1_file_an_older_pccl_wrote_is_refused_as_degenerate(tmp_path):
    """What a one-rank run of 5b5c60c left in ~/.cache/pccl: positive times that measure
    no communication (the cost model predicts 0 s for them)."""
    key = {**KEY, "ranks": 1, "nodes": [1]}
    path = tmp_path / "x.json"
    sc.write(path, key, {"all_reduce/full": {"ring": [[4, 2.7e-6]], "native_nonblocking": [[4, 2.9e-6]]}})
    measured, refused = sc.read(path, key)
    assert measured == {} and "degenerate: a world of one rank" in refused


def test_a_communicator_measures_itself_where_it_has_peers_and_a_host_transport():
    from types import SimpleNamespace

    def comm(size, transport, backend):
        return SimpleNamespace(size=size, transport=transport, backend=backend)
    assert sc.measures(comm(2, "mpi", "mpi")) and sc.measures(comm(3, "torch", "gloo"))
    assert not sc.measures(comm(1, "mpi", "mpi")) and not sc.measures(comm(1, "torch", "gloo"))
    assert not sc.measures(comm(2, "torch", "nccl")), "NCCL's groups carry GPU buffers only"


def test_sizes_grow_from_4_bytes_x4_then_doubling_in_whole_blocks_per_rank():
    assert sc.sizes_of("all_reduce", 4, 4, 1 << 20) == [4 << (2 * k) for k in range(8)] + [128 << 10, 256 << 10,
                                                                                           512 << 10, 1 << 20]
    assert sc.sizes_of("all_gather", 3, 4, 100) == [12, 24, 72]   # multiples of 3 ranks x 4 B
    assert sc.sizes_of("reduce_scatter", 4, 2, 64) == [8, 16, 64]
    assert sc.entry_key("all_gather", "half") == "all_gather"   # it reduces nothing: one entry serves both
    assert sc.entry_parts(sc.entry_key("all_reduce", "half")) == ("all_reduce", "half")


def test_a_size_is_projected_along_the_line_through_the_last_two_and_never_below_the_last():
    # bandwidth-bound: 1 ms at 1 MiB, 2 ms at 2 MiB -> 4 ms a call at 4 MiB
    assert sc.summed_per_call([MB, 2 * MB], [1e-3, 2e-3], 4 * MB) == pytest.approx(4e-3)
    # latency-bound, or faster at the larger size (noise): the last size's time per call
    assert sc.summed_per_call([16, 64], [2e-5, 2e-5], 256) == pytest.approx(2e-5)
    assert sc.summed_per_call([16, 64], [3e-5, 2e-5], 256) == pytest.approx(2e-5)
    assert sc.summed_per_call([16], [2e-5], 64) == pytest.approx(2e-5)


def test_a_loop_lasts_about_loop_seconds_and_large_sizes_skip_the_untimed_call():
    assert sc.loop_length(1e-6) == sc.MAX_ITERS and sc.loop_length(1.0) == 1
    assert sc.loop_length(sc.LOOP_SECONDS / 2) == 2
    assert sc.calls_per_candidate(16, 8) == 1 + sc.SHORT_ROUNDS * 9
    assert sc.calls_per_candidate(64 * MB, 1) == 1 + sc.ROUNDS   # no untimed switch call


def test_short_calls_take_more_rounds(monkeypatch):
    assert sc.SHORT_ROUNDS > sc.ROUNDS
    assert sc.rounds_at(sc.DOUBLING_BYTES - 1) == sc.SHORT_ROUNDS and sc.rounds_at(sc.DOUBLING_BYTES) == sc.ROUNDS
    # measure() makes those calls: 10 us a call on a fake clock, loops of MAX_ITERS, 5 candidates
    comm = FakeClockComm(lambda n: 1e-5)
    monkeypatch.setattr(sc.time, "perf_counter", comm.clock)
    sc.measure(comm, "all_gather", candidates(comm), torch.float32, 1.0, largest=sc.DOUBLING_BYTES)
    short = len(sc.sizes_of("all_gather", 1, 4, sc.DOUBLING_BYTES - 1))
    calls = 5 * (short * (1 + sc.SHORT_ROUNDS * (sc.MAX_ITERS + 1)) + (1 + sc.ROUNDS * (sc.MAX_ITERS + 1)))
    assert comm.now == pytest.approx(calls * 1e-5)


def candidates(comm) -> tuple:
    """What auto weighs for an all-gather on a fake communicator's shape (as the
    self-calibration asks its selector)."""
    return comm.tuner_for("cpu").candidates("all_gather")


class FakeClockComm:
    """One rank whose all-gathers take `seconds(nbytes)` on a fake clock, and its
    `stall_call`-th call at `stall_at` bytes (1: the warm-up) `stall` more: what measure()
    sees, with no time passing."""

    size, rank = 1, 0

    def __init__(self, seconds, stall_at=None, stall_call=1, stall=0.0):
        self.now, self.seconds, self.stall_at, self.stall_call, self.stall = 0.0, seconds, stall_at, stall_call, stall

    def clock(self) -> float:
        return self.now

    def tuner_for(self, device):
        return Tuner(Topology.regular(1, 1), FAST_LINKS, natives=("native", "native_nonblocking"))

    def all_gather(self, full, block, algorithm, compression=None):
        assert compression == "none", "timed exact, whatever the communicator's default codec"
        nbytes = full.numel() * full.element_size()
        self.now += self.seconds(nbytes)
        if nbytes == self.stall_at:
            self.stall_call -= 1
            self.now += self.stall if self.stall_call == 0 else 0.0

    def all_reduce(self, tensor, op="sum", algorithm="auto", compression=None):
        assert compression == "none", "the rounds' figures agreed exactly"


@pytest.mark.parametrize("stall_call, stall, seconds", [
    (1, 0.3, 0.2),    # the warm-up: a first use's setup, not charged to the budget
    (9, 0.1, 0.5),    # in a round: charged, but the medians drop it and the projection holds
])
def test_a_stalled_call_does_not_end_the_calibration(monkeypatch, stall_call, stall, seconds):
    comm = FakeClockComm(lambda n: 2e-5, stall_at=4096, stall_call=stall_call, stall=stall)
    monkeypatch.setattr(sc.time, "perf_counter", comm.clock)
    measured = sc.measure(comm, "all_gather", candidates(comm), torch.float32, seconds, largest=MB)
    assert [n for n, _ in measured["ring"]] == sc.sizes_of("all_gather", 1, 4, MB)   # every size, to the largest
    assert all(t == pytest.approx(2e-5) for n, t in measured["ring"])                # the medians drop the stall
    assert stall < comm.now < stall + seconds


def test_the_budget_holds_where_calls_grow_with_their_bytes(monkeypatch):
    comm = FakeClockComm(lambda n: 1e-5 + n / 1e8)   # 100 MB/s: 64 MiB would take 0.67 s a call
    monkeypatch.setattr(sc.time, "perf_counter", comm.clock)
    measured = sc.measure(comm, "all_gather", candidates(comm), torch.float32, 0.5)
    reach = measured["ring"][-1][0]
    assert 64 << 10 <= reach < 8 * MB and comm.now <= 0.5
    # it stopped for want of time: the next size, with the margin, would not have fitted
    per_call = 1e-5 + 2 * reach / 1e8
    next_size = 5 * per_call * sc.calls_per_candidate(2 * reach, sc.loop_length(per_call))   # 5 candidates
    assert comm.now + sc.MARGIN * next_size > 0.5


class GrowingComm(FakeClockComm):
    """Two ranks on a fake clock whose all-gathers cost what `seconds(nbytes, algorithm)`
    says, as MPI's own staged reduce-scatter did on one H200: fastest to 16 MB, then 9x
    slower at 64 MB, where a schedule wins."""

    size = 2

    def tuner_for(self, device):
        return Tuner(Topology.regular(2, 2), FAST_LINKS, natives=("native", "native_nonblocking"))

    def all_gather(self, full, block, algorithm, compression=None):
        self.now += self.seconds(full.numel() * full.element_size(), algorithm)


def staged_mpi(nbytes, algorithm):
    base = 1e-5 + nbytes / 1e9
    if algorithm in ("native", "native_nonblocking"):
        return base * (1 if nbytes <= 16 * MB else (nbytes / (16 * MB)) ** 1.58)   # 9x from 16 to 64 MB
    return 2 * base if algorithm == "ring" else 3 * base


def test_a_call_beyond_the_sweep_is_measured_at_its_size_and_auto_follows(monkeypatch):
    comm = GrowingComm(None)
    comm.seconds = staged_mpi
    monkeypatch.setattr(sc.time, "perf_counter", comm.clock)
    swept = sc.measure(comm, "all_gather", candidates(comm), torch.float32, 100.0, largest=16 * MB)
    assert max(n for n, _ in swept["ring"]) == 16 * MB

    def auto(entry, nbytes):
        return ranking(entry, nbytes)[0]

    assert auto(swept, 16 * MB) == "native" and auto(swept, 48 * MB) == "native", "the held 16 MB ratio misleads"
    before = comm.now
    grown = sc.reach(comm, "all_gather", torch.float32, swept, 48 * MB, 100.0)
    assert {n for n, _ in grown["ring"]} - {n for n, _ in swept["ring"]} == {64 * MB}, "the next power of two"
    assert comm.now - before == pytest.approx(sum(staged_mpi(64 * MB, a) for a in grown) * (1 + sc.ROUNDS))
    assert auto(grown, 48 * MB) == "ring" and auto(grown, 64 * MB) == "ring"
    # nothing is measured inside the sweep, past REACH_MAX, or past the time allowed
    assert sc.reach(comm, "all_gather", torch.float32, swept, 16 * MB, 100.0) is None
    assert sc.reach(comm, "all_gather", torch.float32, swept, sc.REACH_MAX + 1, 1e9) is None
    spent = comm.now
    assert sc.reach(comm, "all_gather", torch.float32, swept, 48 * MB, 0.1) is None and comm.now == spent
    # where not every candidate fits, they are timed one at a time in the order auto would
    # run them, until the time is spent: here the two natives (their ratios held from 16 MB
    # hide their growth), and auto then runs the ring, as it should
    chosen = []
    grown = sc.reach(comm, "all_gather", torch.float32, swept, 48 * MB, 3.0,
                     choose=lambda figures: chosen.append(ranking(figures, 64 * MB)) or chosen[-1])
    assert [order[0] for order in chosen] == ["native", "native_nonblocking", "ring"]
    assert {name for name, points in grown.items() if points[-1][0] == 64 * MB} == {"native", "native_nonblocking"}
    assert sc.valid_entry(grown) and auto(grown, 64 * MB) == "ring"


def ranking(entry, nbytes):
    """What reach() is told by the communicator's calibration: the candidates in the order
    auto would run them with `entry`'s figures, its pick first."""
    figures = {("all_gather", "full", name): [tuple(p) for p in points] for name, points in entry.items()}
    profile = calibrated(FAST_LINKS, Topology.regular(2, 2), figures, "test")
    tuner = Tuner(Topology.regular(2, 2), profile, natives=("native", "native_nonblocking"))
    pick, times = tuner.name("all_gather", nbytes, torch.float32), tuner.predictions("all_gather", nbytes)
    return [pick, *sorted((name for name in times if name != pick), key=times.get)]


def slower_growth(nbytes, algorithm):
    """Two schedules a ratio apart up to 16 MB; past it the faster one's cost grows faster
    than its bytes (a cache it outgrows: 1.5x its bytes' share at 64 MB), so the runner-up
    wins at 64 MB."""
    base = 1e-5 + nbytes / 1e9
    growth = max(1.0, nbytes / (16 * MB)) ** 0.3 if algorithm == "recursive_doubling" else 1.0
    factor = {"recursive_doubling": 1.0, "bruck": 1.1}.get(algorithm, 2.0)
    return factor * base * growth


def test_beyond_the_sweep_the_time_left_after_the_pick_goes_to_its_likeliest_rival(monkeypatch):
    """On 4 CPU ranks at 256 MB, the calibration timed the reduce-scatter auto would run
    (recursive halving) and kept it; pairwise, never timed there, was 1.03-1.27x faster in 6
    launches out of 6. The pick's likeliest rival is now timed with the time left."""
    comm = GrowingComm(None)
    comm.seconds = slower_growth
    monkeypatch.setattr(sc.time, "perf_counter", comm.clock)
    swept = sc.measure(comm, "all_gather", candidates(comm), torch.float32, 100.0, largest=16 * MB)
    assert ranking(swept, 64 * MB)[:2] == ["recursive_doubling", "bruck"], "held from 16 MB"
    call = {name: slower_growth(64 * MB, name) for name in ("recursive_doubling", "bruck")}
    # time for the pick and (projected along the sweep's line, with its margin) its rival,
    # not for every candidate
    seconds = (1 + sc.ROUNDS) * (call["recursive_doubling"] + sc.MARGIN * call["bruck"]) * 1.02
    before = comm.now
    grown = sc.reach(comm, "all_gather", torch.float32, swept, 48 * MB, seconds, choose=lambda f: ranking(f, 64 * MB))
    timed = {name for name, points in grown.items() if points[-1][0] == 64 * MB}
    assert timed == {"recursive_doubling", "bruck"}
    assert comm.now - before == pytest.approx((1 + sc.ROUNDS) * sum(call.values()))
    assert ranking(grown, 64 * MB)[0] == "bruck"


def test_its_settings_are_checked():
    assert sc.enabled({}) and not sc.enabled({"PCCL_SELF_CALIBRATION": "0"})
    with pytest.raises(ValueError, match="PCCL_SELF_CALIBRATION must be 0 or 1, got 'yes'"):
        sc.enabled({"PCCL_SELF_CALIBRATION": "yes"})
    assert sc.budget({}) == sc.BUDGET and sc.budget({"PCCL_CALIBRATION_BUDGET": "1.5"}) == 1.5
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(ValueError, match="PCCL_CALIBRATION_BUDGET must be a positive number of seconds"):
            sc.budget({"PCCL_CALIBRATION_BUDGET": bad})


# ----------------------------------------------------------------- auto's decisions

# A profile under which pccl's schedules are predicted far faster than the native collective
# (counted as the ring): a measurement-free auto must still take native on one node.
FAST_LINKS = Profile(name="generic", ranks_per_node=4, nics_per_node=1, intra=Link(2e-6, 40e9),
                     inter=Link(7e-6, 10e9), reduce_bandwidth=60e9, copy_bandwidth=90e9)


def test_unmeasured_auto_runs_the_transports_own_collective_on_one_node():
    one_node = Topology.regular(8, 8)
    trusting = Tuner(one_node, FAST_LINKS, natives=("native", "native_nonblocking"), trust_native=True)
    modelled = Tuner(one_node, FAST_LINKS, natives=("native", "native_nonblocking"))
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        for n in (16, 4096, MB, 64 * MB):
            assert trusting.name(collective, n) == "native"
        assert modelled.name(collective, 16) != "native", "the model alone predicts a schedule faster"
    interruptible = Tuner(one_node, FAST_LINKS, natives=("native_nonblocking",), trust_native=True)
    assert interruptible.name("all_reduce", MB) == "native_nonblocking"
    for bad in ((), ("gloo",)):   # every communicator has a form of its transport's own collective
        with pytest.raises(ValueError, match="natives must be one or more of"):
            Tuner(one_node, FAST_LINKS, natives=bad)


def test_unmeasured_auto_takes_a_plan_only_where_it_is_predicted_at_least_twice_as_fast():
    topo = Topology.regular(16, 4)
    tuner = Tuner(topo, FAST_LINKS, trust_native=True)
    for n in (4096, MB, 64 * MB):
        times = tuner.predictions("all_gather", n)
        plan = min((p for p in ("hierarchical", "ho_ring") if p in times), key=times.get)
        expected = plan if times[plan] <= 0.5 * times["native"] else "native"
        assert tuner.name("all_gather", n) == expected


def measured_profile(topo: Topology, klass: str, fastest: str) -> Profile:
    """FAST_LINKS calibrated for all-reduce of `klass` so that `fastest` measured 4x
    faster than every other candidate at every size (MPI's two forms of its own among them,
    as an MPI communicator measures them)."""
    names = ("ring", "recursive_doubling", "rabenseifner", "native", "native_nonblocking")
    sizes = (16, 4096, MB)
    figures = {("all_reduce", klass, n): [(s, 1e-3 / (4 if n == fastest else 1)) for s in sizes] for n in names}
    return calibrated(FAST_LINKS, topo, figures, "a test")


def test_measured_auto_takes_what_was_measured_fastest_per_reduction_class():
    topo = Topology.regular(4, 4)
    prof = measured_profile(topo, "half", "rabenseifner")
    tuner = Tuner(topo, prof, trust_native=True)
    assert tuner.measured("all_reduce", torch.bfloat16) and tuner.measured("all_reduce", torch.float16)
    assert not tuner.measured("all_reduce", torch.float32), "fp32 was not measured: its own class"
    for n in (16, 4096, MB, 64 * MB):   # held beyond the largest size measured
        assert tuner.name("all_reduce", n, torch.bfloat16) == "rabenseifner"
        assert tuner.name("all_reduce", n, torch.float32) == "native"
    full = measured_profile(topo, "full", "recursive_doubling")
    fallback = Tuner(topo, full, trust_native=True)
    assert fallback.name("all_reduce", 4096, torch.bfloat16) == "recursive_doubling", "half falls back to full"


def test_a_calibration_per_class_round_trips_through_the_file_form_and_older_files_read_as_full():
    topo = Topology.regular(4, 4)
    prof = calibrated(measured_profile(topo, "half", "ring"), topo,
                      {("all_reduce", "full", "ring"): [(16, 1e-5)]}, "a test")
    again = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again.calibration == prof.calibration and {k for _, k, _, _ in again.calibration} == {"full", "half"}
    old = prof.to_dict()
    old["calibration"] = {"source": "an older file", "ratios": {"all_gather": {"ring": [[16, 2.0]]}}}
    assert Profile.from_dict(old).calibration == (("all_gather", "full", "ring", ((16, 2.0),)),)
    with pytest.raises(ValueError, match="calibration class 'quarter' is not one of"):
        Profile(**{**prof.__dict__, "calibration": (("all_gather", "quarter", "ring", ((16, 1.0),)),)})



# ----------------------------------------------------------------- GPU buffers, apart

STAND_IN_GPU = {"type": "cuda", "gpu": "Stand-in GPU", "visible": 1, "mpi": "staged"}


def test_gpu_buffers_and_each_placement_and_level_transport_have_a_key_of_their_own():
    """A GPU's key adds the GPU and how MPI moves its memory to the host's, so neither reads
    the other's figures; so do the ranks' placement on nodes and the plan levels'
    transports (gloo levels read the figures MPI levels measured: 5x off for hierarchical)."""
    from types import SimpleNamespace

    def comm(topology=Topology.regular(4, 2), levels=None):
        return SimpleNamespace(topology=topology, transport="mpi", executor="cpp", interruptible=False,
                               level_transports=levels or {"intra": "mpi", "inter": "mpi"},
                               carrier=SimpleNamespace(gpu_type=lambda device: {**STAND_IN_GPU, "type": device}))
    host, gpu = sc.key_of(comm()), sc.key_of(comm(), "cuda")
    assert "device" not in host and gpu == {**host, "device": STAND_IN_GPU}
    assert sc.path_of(host) != sc.path_of(gpu)
    assert sc.path_of(gpu) != sc.path_of({**host, "device": {**STAND_IN_GPU, "mpi": "GPU-aware"}})
    others = [comm(levels={"intra": "gloo", "inter": "gloo"}), comm(Topology(((0, 2), (1, 3)), 1)),
              comm(Topology(((0, 1), (2, 3)), 1, nodes_per_group=1))]
    assert len({sc.path_of(k) for k in [host, *map(sc.key_of, others)]}) == 4


def test_on_a_gpu_each_timed_loop_ends_with_the_device_synchronized(monkeypatch):
    """A GPU collective may return before its kernels ran: the loop's time includes the
    synchronize that waits for them (here 50 us on the fake clock, after loops of calls
    that take 10 us to issue), once after each size's warm-up and after every loop."""
    comm = FakeClockComm(lambda n: 1e-5)
    monkeypatch.setattr(sc.time, "perf_counter", comm.clock)
    host_calls = sc.calls
    monkeypatch.setattr(sc, "calls", lambda comm, collective, count, dtype, device: host_calls(comm, collective,
                                                                                              count, dtype))
    synced = []

    def synchronize():
        synced.append(comm.now)
        comm.now += 5e-5
    monkeypatch.setattr(sc.torch.cuda, "synchronize", synchronize)
    measured = sc.measure(comm, "all_gather", candidates(comm), torch.float32, 1.0, largest=64, device="cuda")
    sizes = sc.sizes_of("all_gather", 1, 4, 64)
    assert len(synced) == len(sizes) * (1 + 5 * sc.SHORT_ROUNDS)   # 5 candidates
    assert all(t == pytest.approx(1e-5 + 5e-5 / sc.MAX_ITERS) for _, t in measured["ring"])


def test_a_gpus_profile_decides_for_its_buffers_only_and_the_hosts_never_for_a_gpus():
    """Host figures measured that MPI's own all-reduce is fastest; the GPU's (staged through
    host memory) that Rabenseifner's is: each device's buffers get their own choice, and a
    device never measured decides as the communicator was made (here: trusting native)."""
    from pccl.runtime.dry_run import DryRunCommunicator

    topo = Topology.regular(4, 4)
    comm = DryRunCommunicator(topo, FAST_LINKS, trust_native=True)
    given = comm.selector.tuner_for("cuda")
    comm.selector.use_profile(measured_profile(topo, "full", "ring"), "cpu")
    assert comm.selector.tuner_for("cpu").name("all_reduce", MB) == "ring"
    assert comm.selector.tuner_for("cuda") is given
    assert given.name("all_reduce", MB) == "native", "host figures stay the host's"
    comm.selector.use_profile(measured_profile(topo, "full", "rabenseifner"), "cuda")
    assert comm.selector.tuner_for("cuda").name("all_reduce", MB) == "rabenseifner"
    assert comm.selector.tuner_for("cpu").name("all_reduce", MB) == "ring" and comm.selector.tuner_for("meta") is given
    assert comm.selector.resolve("all_reduce", "auto", MB, "cuda") == "rabenseifner"
    assert comm.selector.resolve("all_reduce", "auto", MB) == "ring"
    comm.selector.use_profile(FAST_LINKS)   # a profile for every device: the devices' own are dropped
    tuner_for = comm.selector.tuner_for
    assert tuner_for("cuda").name("all_reduce", MB) == "native" == tuner_for("cpu").name("all_reduce", MB)

# ----------------------------------------------------------------- a world of one rank

@pytest.mark.parametrize("transport", ["cpp", "python", "gloo"])
def test_a_world_of_one_rank_never_calibrates_on_any_executor(tmp_path, monkeypatch, transport):
    """As shipped (self-calibration on) with the world-1 file 5b5c60c left in the cache:
    a one-rank communicator has nothing to measure, reads and writes no cache, and its
    auto calls, on host and (stand-in) GPU buffers, run and are exact."""
    import torch.distributed as dist
    from mpi4py import MPI

    import pccl

    monkeypatch.delenv("PCCL_SELF_CALIBRATION", raising=False)
    monkeypatch.setenv("PCCL_CACHE_DIR", str(tmp_path))
    if transport == "gloo":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        comm = pccl.Communicator(dist.group.WORLD, timeout=10)
    else:
        comm = pccl.Communicator(MPI.COMM_SELF, executor=transport, timeout=10)
    try:
        old = sc.path_of({**sc.key_of(comm), "format": 6})
        sc.write(old, {**sc.key_of(comm), "format": 6}, {"all_reduce/full": {"ring": [[4, 2.7e-6]]}})
        before = old.read_bytes()
        x, out = torch.arange(8.0), torch.empty(8)
        comm.all_reduce(x)
        comm.all_gather(out, x)
        comm.reduce_scatter(out, x)
        comm.all_reduce(x.bfloat16())
        comm.selector.measure_auto("all_reduce", "auto", torch.float32, "cuda")   # GPU buffers: the same rule
        assert comm.selector.self_calibration is None and comm.selector._device_calibrations == {}
        assert torch.equal(x, torch.arange(8.0)) and torch.equal(out, torch.arange(8.0))
        assert [f for f in tmp_path.rglob("*.json")] == [old] and old.read_bytes() == before
    finally:
        comm.close()
        if transport == "gloo":
            dist.destroy_process_group()


# ----------------------------------------------------------------- on several ranks

@pytest.mark.mpi
def test_ranks_measure_once_share_rank_0s_figures_and_redo_a_corrupt_entry(tmp_path):
    """3 ranks, each with its own cache directory (as on nodes without a shared file
    system): the first communicator measures, a second reads rank 0's file, a corrupt file
    is measured again, a second communicator of a shape takes what the first measured
    since it read the file, a gloo communicator measures as MPI's do; every rank holds the
    same figures and makes the same choices; the collectives stay exact throughout; GPU
    buffers (a stand-in GPU) are measured apart and read back
    (tests/pccl/workers/run_self_calibration.py)."""
    report_path = tmp_path / "report.json"
    run = mpiexec(3, "-m tests.pccl.workers.run_self_calibration", str(tmp_path), str(report_path), timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(report_path.read_text())
    first, second, corrupt, tiny, interruptible = (report[k] for k in
                                                    ("first", "second", "corrupt", "tiny", "interruptible"))
    assert first["agree"] and second["agree"] and corrupt["agree"], "every rank the same figures and choices"
    assert first["exact"] and second["exact"] and corrupt["exact"]
    assert set(first["measured_now"]) == {"all_reduce/half", "all_gather"}
    assert first["files"] == [1, 0, 0], "rank 0 alone writes the cache"
    assert second["measured_now"] == [] and second["figures"] == first["figures"], "read, not measured again"
    assert set(corrupt["measured_now"]) == {"all_reduce/half", "all_gather"} and "unreadable" in corrupt["warning"]
    assert corrupt["valid_after"]
    assert all(len(points) == 1 for points in tiny["figures"]["all_reduce/full"].values()), \
        "a budget spent by the first size ends the measurement there, on every rank"
    reach = report["reach"]
    assert reach["agree"] and reach["exact"]
    assert reach["grown"] == reach["swept"] + [sc.reach_size("all_reduce", 3, 4, 2 * reach["swept"][-1])], \
        "a call beyond the sweep adds its size (a power of two), one inside it none"
    assert reach["read_back"] and reach["measured_again"] == [], "the reached size is kept in the cache"
    side = report["side_by_side"]
    assert side["exact"] and side["lane_measured_now"] == ["all_gather"] and side["grown"]
    assert side["measured_now"] == ["all_reduce/full"] and side["same"] and side["kept"], \
        "a second communicator of the shape takes the first's figures from the file, and leaves them there"
    names = set(interruptible["figures"]["all_reduce/full"])
    assert "native_nonblocking" in names and "native" not in names, "an interruptible communicator never blocks"
    assert interruptible["path"] != first["path"]
    gloo = report["gloo"]
    assert gloo["agree"] and gloo["exact"] and gloo["files"] == [1, 0, 0]
    assert set(gloo["measured_now"]) == {"all_reduce/half", "all_gather"}
    assert {"native", "ring"} <= set(gloo["figures"]["all_gather"]) and "native_nonblocking" not in \
        gloo["figures"]["all_gather"], "gloo's own collective and pccl's schedules over gloo"
    assert math.isfinite(sum(first["seconds"].values()))
    gpu = report["gpu"]
    assert gpu["first"]["agree"] and gpu["second"]["agree"]
    assert gpu["first"]["measured_now"] == ["all_reduce/full"] and gpu["first"]["synchronized"] > 0
    assert gpu["first"]["device"]["gpu"] == "Stand-in GPU" and gpu["first"]["path"] != first["path"]
    assert gpu["first"]["host"] is None, "GPU buffers' first call measures them alone, not the host's"
    assert gpu["second"]["measured_now"] == [] and gpu["second"]["figures"] == gpu["first"]["figures"]


@pytest.mark.mpi
def test_the_groups_of_a_shape_measuring_at_once_decide_with_the_figures_the_file_keeps(tmp_path):
    """4 ranks split into two groups of 2 (one shape, ranks 0 in different processes) over
    one cache directory: both groups measure all-gather at once and reach a size beyond
    the sweep, and every rank ends with the figures the file holds, as the next run (a
    resumed one) reads them (tests/pccl/workers/run_calibration_groups.py)."""
    report_path = tmp_path / "report.json"
    run = mpiexec(4, "-m tests.pccl.workers.run_calibration_groups", str(tmp_path / "cache"), str(report_path),
                  timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ranks = json.loads(report_path.read_text())
    assert all(r["exact"] and r["grown"] and r["measured_now"] == ["all_gather"] for r in ranks)
    assert len({r["path"] for r in ranks}) == 1, "one shape, one file"
    assert all(r["figures"] == ranks[0]["stored"] for r in ranks), "one set of figures: the file's"
