"""pccl-sim's output against the cost model, its heatmaps, and calibration."""
from __future__ import annotations

import csv
import json
import subprocess

import numpy as np
import pytest

from pccl import plans
from pccl.algorithms import algorithms_for
from pccl.core.topology import Topology
from pccl.tools.sim import main
from pccl.tuning import cost_model, profiles
from pccl.tuning.calibrate import fit
from runkit.sizes import doubling_range
from tests.support.mpirun import mpiexec


def sim(capsys, *args: str) -> subprocess.CompletedProcess:
    """pccl-sim run in this process (a process of its own would import torch again): its
    exit status, standard output and error."""
    code, message = 0, ""
    try:
        main(list(args))
    except SystemExit as e:   # argparse's errors (status 2), and sys.exit("pccl-sim: ...") (status 1)
        code, message = (e.code, "") if isinstance(e.code, int) else (1, f"{e.code}\n")
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["pccl-sim", *args], code, out, err + message)


def test_json_for_scripts_matches_the_model(capsys):
    run = sim(capsys, "--profile", "frontier", "--collective", "all_gather", "--ranks", "2048", "--size", "16M",
              "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    topo = Topology.regular(2048, 8, 4, 128)   # 2 of Frontier's dragonfly groups
    prof = profiles.load("frontier")
    assert set(out["algorithms"]) == {"ring", "recursive_doubling", "bruck", "hierarchical", "three_level",
                                      "ho_ring", "native"}
    for name, seconds in out["algorithms"].items():
        predicted = cost_model.predict("all_gather", plans.NAMED.get(name, name), topo, prof, 16 << 20)
        assert seconds == pytest.approx(predicted)
    candidates = {k: v for k, v in out["algorithms"].items() if k != "native"}
    assert out["auto"] == min(candidates, key=candidates.get) == "three_level"
    assert (out["ranks"], out["nodes"], out["nodes_per_group"], out["size"]) == (2048, 256, 128, 16 << 20)


def test_heatmap_csv_holds_the_speedups(tmp_path, capsys):
    prefix = tmp_path / "maps" / "rs"
    run = sim(capsys, "--profile", "perlmutter", "--collective", "reduce_scatter", "--ranks", "16:64", "--size",
              "16M,64M", "--heatmap", str(prefix), "--baseline", "ring", "--target", "auto")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "maps" / "rs.png").stat().st_size > 1000
    rows = list(csv.reader(open(f"{prefix}.csv")))
    assert rows[0] == ["size_bytes", "ranks_16", "ranks_32", "ranks_64"]
    prof = profiles.load("perlmutter")
    for row in rows[1:]:
        size = int(row[0])
        for ranks, cell in zip((16, 32, 64), row[1:]):
            topo = Topology.regular(ranks, 4, 4)
            times = {a: cost_model.predict("reduce_scatter", plans.NAMED.get(a, a), topo, prof, size)
                     for a in ("ring", "recursive_halving", "pairwise", "native", "hierarchical", "ho_ring")}
            best = min(times, key=times.get)
            auto = best if times[best] <= 0.9 * times["native"] else "native"   # native unless clearly beaten
            assert float(cell) == pytest.approx(times["ring"] / times[auto], rel=1e-3)
    assert "auto" in run.stdout


def test_one_node_gets_its_table_without_a_hierarchical_plan(capsys):
    """The default --target (hierarchical) is the heatmap's: a node alone has no such plan,
    and its table was refused for it."""
    run = sim(capsys, "--profile", "dgx-h100", "--collective", "all_reduce", "--ranks", "8", "--size", "1G")
    assert run.returncode == 0, run.stderr
    assert "ranks: 8 (1x8" in run.stdout and "hierarchical" not in run.stdout and "<- auto" in run.stdout


def test_one_rank_moves_nothing_and_its_table_says_so(capsys, tmp_path):
    """One rank's times are all 0: its table divided by them (ZeroDivisionError), and so
    did a range of ranks that holds 1."""
    run = sim(capsys, "--ranks", "1", "--size", "16M")
    assert run.returncode == 0, run.stderr
    assert "ring          0.0            -              - <- auto" in run.stdout
    run = sim(capsys, "--ranks", "1:4", "--size", "1K", "--heatmap", str(tmp_path / "h"), "--target", "ring")
    assert run.returncode == 0 and (tmp_path / "h.csv").exists(), run.stderr


@pytest.mark.parametrize("args,message", [
    (("--profile", "nowhere"), "no profile 'nowhere'"),
    (("--size", "12Q"), "size must be"),
    (("--ranks", "12", "--ranks-per-node", "8"), "not divisible"),
    (("--target", "fastest"), "invalid choice: 'fastest'"),   # no such name, with or without --heatmap
    (("--collective", "reduce_scatter", "--target", "bruck", "--heatmap", "x"),
     "no algorithm 'bruck' for reduce_scatter"),
])
def test_bad_input_says_what_is_wrong(args, message, capsys):
    run = sim(capsys, *args)
    assert run.returncode != 0
    assert message in run.stderr


def test_ranges():
    assert doubling_range("16:128", int) == [16, 32, 64, 128]
    assert doubling_range("3,5", int) == [3, 5]
    with pytest.raises(ValueError):
        doubling_range("64:16", int)


def test_fit_recovers_alpha_and_bandwidth():
    sizes = np.array([1 << 10, 1 << 14, 1 << 18, 1 << 22])
    alpha, bandwidth = fit(sizes, 3e-6 + sizes / 2.5e9)
    assert alpha == pytest.approx(3e-6) and bandwidth == pytest.approx(2.5e9)
    with pytest.raises(RuntimeError, match="does not grow"):
        fit(sizes, 1e-3 - sizes * 1e-12)


@pytest.mark.mpi
def test_calibrate_writes_a_profile_that_loads(tmp_path):
    path = tmp_path / "measured.json"
    # -e 16: the collectives timed at one size (the one-node test below times several)
    run = mpiexec(4, "-m pccl.tools.bench", "--calibrate", str(path), "--ranks-per-node", "2", "--profile-name", "here",
                  "-b", "4", "-e", "16", timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    prof = profiles.load(path)
    assert (prof.name, prof.ranks_per_node, prof.nics_per_node) == ("here", 2, 1)
    for value in (prof.intra.bandwidth, prof.inter.bandwidth, prof.reduce_bandwidth, prof.copy_bandwidth):
        assert 1e6 < value < 1e13
    assert "measured by pccl-bench --calibrate" in prof.inter.source
    # 2 ranks per NIC: the NIC's bandwidth is twice what each loaded rank got.
    assert prof.inter.stream_bandwidth > 0
    assert cost_model.predict("all_gather", "hierarchical", Topology.regular(4, 2), prof, 1 << 20) > 0


@pytest.mark.mpi
def test_calibrating_one_node_measures_every_candidate_of_auto(tmp_path):
    """One node: no inter-node link (the intra-node figures stand in); every candidate of
    auto, MPI's own collectives too, is timed up to --maxbytes and kept as measured /
    predicted, so the profile predicts what was measured."""
    path = tmp_path / "p.json"
    run = mpiexec(2, "-m pccl.tools.bench", "--calibrate", str(path), "-b", "4", "-e", "64", timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    prof = profiles.load(path)
    assert "one node" in prof.inter.source and prof.inter.bandwidth == prof.intra.bandwidth
    assert dict(prof.native_algorithms)["all_reduce"][0] == (9, "recursive_doubling"), "MPICH's selection"
    kept = {(c, k, name): points for c, k, name, points in prof.calibration}
    for collective, klass in [("all_gather", "full"), *((c, k) for c in ("reduce_scatter", "all_reduce")
                                                         for k in ("full", "half"))]:
        for name in algorithms_for(collective) + ("native", "native_nonblocking"):
            points = kept[(collective, klass, name)]
            # from 4 B x4 (to 64 KiB), in whole elements per rank (4 B of fp32 splits over no 2 ranks)
            unit = (1 if collective == "all_reduce" else 2) * (4 if klass == "full" else 2)
            assert [n for n, _ in points] == sorted({-(-s // unit) * unit for s in (4, 16, 64)}), \
                (collective, klass, name)
            assert all(0 < ratio < 1e6 for _, ratio in points)
    assert ("all_gather", "half") not in {(c, k) for c, k, _ in kept}, "all-gather reduces nothing: one class"
    assert "every candidate of auto" in prof.sources["calibration"]


@pytest.mark.mpi
def test_every_rank_decides_with_rank_0s_profile(tmp_path):
    path = tmp_path / "report.json"
    run = mpiexec(4, "-m tests.pccl.workers.run_profile", str(path), timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(path.read_text())
    assert report["names"] == ["frontier"] * 4
    assert report["same_choice"] and report["gathered"]
    for message in [report["bad_profile"]] + report["others_bad_profile"]:
        assert "machine profile on rank 0" in message and "no profile" in message
