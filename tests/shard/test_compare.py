"""shard-compare: every run of the minimal invocation, FSDP2 against the engine's zero3 (the
same math: the same parameters after 3 steps), the refusal to report a speed-up for a
diverged run, and the output files."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shard.tools.compare import compared, markdown
from shard.tools.compare_runs import DeepSpeedRun, EngineRun, Fsdp2Run, parse_run
from tests.support.mpirun import ROOT, job_env


@pytest.mark.mpi
def test_the_minimal_invocation_reports_every_run_and_fsdp2_equals_zero3(tmp_path):
    run = subprocess.run([sys.executable, "-m", "shard.tools.compare", "--ranks", "2", "--steps", "3", "--model",
                          "tiny", "--runs", "fsdp2,zero3-native,zero3-pccl,deepspeed-zero3", "--out", str(tmp_path)],
                         env=job_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads((tmp_path / "compare.json").read_text())["runs"]}
    assert list(rows) == ["fsdp2", "zero3-native", "zero3-pccl", "deepspeed-zero3"]
    deepspeed = rows["deepspeed-zero3"]   # runs where DeepSpeed is installed (make deepspeed)
    assert "DeepSpeed does not import" in deepspeed["not_run"] if "not_run" in deepspeed else not deepspeed["diverged"]
    for name in ("fsdp2", "zero3-native", "zero3-pccl"):
        r = rows[name]
        for key in ("tokens_per_s", "step_time_s", "sent_bytes_per_rank", "peak_mem_bytes"):
            assert r[key] > 0, (name, key, r[key])
        assert len(r["losses"]) == 3 and not r["diverged"] and r["speedup"] > 0
    assert rows["fsdp2"]["exposed_comm_s"] is None and rows["zero3-native"]["exposed_comm_s"] >= 0
    # ZeRO-3 sends each parameter twice gathered and once reduce-scattered a step, (p-1)/p of
    # it on 2 ranks: both tools count about the same bytes (FSDP2 pads differently).
    assert rows["zero3-native"]["sent_bytes_per_rank"] == pytest.approx(rows["fsdp2"]["sent_bytes_per_rank"],
                                                                        rel=0.05)
    fsdp2, zero3 = torch.load(tmp_path / "fsdp2.pt"), torch.load(tmp_path / "zero3-native.pt")
    assert fsdp2.keys() == zero3.keys()
    for k in fsdp2:
        assert torch.allclose(fsdp2[k], zero3[k], rtol=1e-5, atol=1e-6), k
    assert (tmp_path / "compare.md").read_text().count("\n") == 2 + 4
    assert (tmp_path / "compare.png").stat().st_size > 0


@pytest.mark.mpi
def test_micro_batches_paro_iig_and_the_predictor(tmp_path):
    """Two micro-batches a step: FSDP2 (a reduction per micro-batch) and the engine's
    PaRO-IIG (in the group per micro-batch, across groups once) do the same math; the
    engine's model state is PaRO's Table 2 (plus padding); --predict adds a prediction."""
    run = subprocess.run([sys.executable, "-m", "shard.tools.compare", "--ranks", "2", "--ranks-per-node", "1",
                          "--steps", "3", "--micro", "2", "--batch", "2", "--seq", "32", "--width", "64",
                          "--runs", "fsdp2,paro-iig-native", "--predict", "emulated-1gbit", "--out", str(tmp_path)],
                         env=job_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads((tmp_path / "compare.json").read_text())["runs"]}
    fsdp2, iig = rows["fsdp2"], rows["paro-iig-native"]
    assert not iig["diverged"] and iig["loss_gap"] < 1e-6
    assert iig["tokens_per_s"] == pytest.approx(2 * 2 * 2 * 32 / iig["step_time_s"])
    # the engine's gradients: Table 2's G-scope accumulator, and the optimizer's fp32
    # gradient beside it (4 of the optimizer state's 12 bytes per element) in sharded units
    # (the small replicated ones sum into the optimizer's gradient itself)
    table2, state = iig["table2_bytes"], iig["state_bytes"]
    for part in ("parameters", "optimizer"):
        assert table2[part] <= state[part] <= table2[part] * 1.01 + 64, part
    assert table2["gradients"] <= state["gradients"] <= (table2["gradients"] + table2["optimizer"] / 3) * 1.01 + 64
    assert "predicted_step_s" not in fsdp2 and iig["predicted_step_s"] > 0
    assert iig["prediction_error"] == pytest.approx(iig["predicted_step_s"] / iig["step_time_s"] - 1)
    first, second = torch.load(tmp_path / "fsdp2.pt"), torch.load(tmp_path / "paro-iig-native.pt")
    for k in first:
        assert torch.allclose(first[k], second[k], rtol=1e-5, atol=1e-6), k
    assert "compute only:" in run.stdout


def row(name, losses, tokens):
    return {"name": name, "losses": losses, "tokens_per_s": tokens, "step_time_s": 1.0, "exposed_comm_s": None,
            "sent_bytes_per_rank": 1, "peak_mem_bytes": 1}


def test_a_compressed_run_is_held_to_two_percent_of_the_loss():
    rows = compared([row("zero3-pccl", [5.0, 4.0], 100.0), row("zero3-pccl+int8", [5.0, 4.06], 150.0),
                     row("zero3-pccl+zfp:8", [5.0, 4.1], 300.0)])
    assert not rows[1]["diverged"] and rows[1]["speedup"] == pytest.approx(1.5)
    assert rows[2]["diverged"] and rows[2]["speedup"] is None


def test_a_run_whose_losses_diverge_gets_no_speedup():
    rows = compared([row("fsdp2", [5.0, 4.0], 100.0), row("zero3-pccl", [5.0, 4.00001], 150.0),
                     row("zero3-ring", [5.0, 4.1], 300.0), {"name": "deepspeed-zero3", "not_run": "no DeepSpeed"}])
    assert rows[1]["speedup"] == pytest.approx(1.5) and not rows[1]["diverged"]
    assert rows[2]["diverged"] and rows[2]["speedup"] is None
    table = markdown(rows)
    assert "diverged: none reported" in table and "3.00x" not in table and "not run: no DeepSpeed" in table


def test_unknown_runs_are_refused_before_anything_launches():
    for name in ("fsdp3", "zero3-gloo", "zero9-native"):
        with pytest.raises((SystemExit, ValueError)):
            parse_run(name)
    parse_run("paro-iig-hierarchical")
    parse_run("zero3-pccl+int8")
    with pytest.raises(ValueError, match="unknown codec"):
        parse_run("zero3-pccl+int4")


def test_each_run_name_maps_to_its_run_and_bad_names_say_what_was_expected():
    fsdp2, fsdp2_pccl = parse_run("fsdp2"), parse_run("fsdp2-pccl")
    assert type(fsdp2) is Fsdp2Run and fsdp2.backend == "gloo" and fsdp2.name == "fsdp2"
    assert type(fsdp2_pccl) is Fsdp2Run and fsdp2_pccl.backend == "pccl" and fsdp2_pccl.name == "fsdp2-pccl"
    deepspeed = parse_run("deepspeed-zero3")
    assert type(deepspeed) is DeepSpeedRun and deepspeed.name == "deepspeed-zero3"
    engines = {"zero3-pccl": ("zero3", "pccl", None), "zero3-native+bf16": ("zero3", "native", "bf16"),
               "paro-iig-native+int8": ("paro-iig", "native", "int8"), "mics-ho_ring": ("mics", "ho_ring", None),
               "ddp-hierarchical+zfp:8": ("ddp", "hierarchical", "zfp:8")}
    for name, (strategy, comm, codec) in engines.items():
        run = parse_run(name)
        assert type(run) is EngineRun and (run.strategy, run.comm, run.codec) == (strategy, comm, codec), name
        assert run.name == name
    expected = (r"expected one of \('eager', 'eager-compile', 'fsdp2', 'fsdp2-compile', 'fsdp2-pccl', "
                r"'deepspeed-zero3'\) or STRATEGY-COMM\[\+CODEC\]\[\+compile\] with COMM one of "
                r"\('native', 'pccl', 'hierarchical', 'ho_ring'\)")
    for bad in ("fsdp3", "zero3-gloo", "zero3", "-native", "deepspeed-zero2", "zero3-gloo+int8"):
        with pytest.raises(SystemExit, match=f"unknown run '{bad.partition('+')[0]}'; {expected}"):
            parse_run(bad)
    with pytest.raises(ValueError, match="unknown strategy 'zero9'; expected"):
        parse_run("zero9-native")
    with pytest.raises(ValueError, match="unknown codec 'int4'; expected none, int8, bf16, fp16 or zfp:RATE"):
        parse_run("zero3-pccl+int4")


def test_plain_pytorch_and_compiled_runs_by_name():
    """eager and eager-compile are plain PyTorch on one rank; fsdp2-compile and +compile
    compile each block or unit; bf16 runs are held to 2% like compressed ones."""
    from types import SimpleNamespace

    from shard.tools.compare_runs import EagerRun, loss_tolerance

    eager, compiled = parse_run("eager"), parse_run("eager-compile")
    assert type(eager) is EagerRun and not eager.compiled and compiled.compiled and compiled.name == "eager-compile"
    assert "--ranks 1" in eager.unavailable(SimpleNamespace(ranks=2))
    assert eager.unavailable(SimpleNamespace(ranks=1)) == ""
    fsdp2 = parse_run("fsdp2-compile")
    assert type(fsdp2) is Fsdp2Run and fsdp2.compiled and fsdp2.name == "fsdp2-compile"
    for name, codec in (("zero3-pccl+compile", None), ("zero3-pccl+int8+compile", "int8")):
        run = parse_run(name)
        assert type(run) is EngineRun and run.compiled and run.codec == codec and run.name == name
    with pytest.raises(SystemExit, match="two codecs"):
        parse_run("zero3-pccl+int8+bf16")
    assert loss_tolerance("zero3-pccl+compile") == 1e-4 and loss_tolerance("zero3-pccl+compile", "bf16") == 0.02
    assert loss_tolerance("zero3-pccl+int8+compile") == 0.02


def test_emulated_nodes_launch_through_launch_emulate():
    from shard.tools.compare import EMULATE, launch_command, parse

    args = parse(["--nodes", "2x4", "--rate", "1gbit", "--steps", "3"])
    args.ranks, args.ranks_per_node = 8, 4   # as main() sets them
    cmd = launch_command(args, "zero3-pccl")
    assert cmd[1:8] == [str(EMULATE), "--nodes", "2", "--ranks-per-node", "4", "--rate", "1gbit"]
    assert cmd[8] == "--" and "--worker=zero3-pccl" in cmd and "--ranks-per-node=4" in cmd
    local = launch_command(parse(["--ranks", "3"]), "fsdp2")
    assert local[local.index("-n") + 1] == "3" and str(EMULATE) not in local
    with pytest.raises(SystemExit):
        parse(["--nodes", "2by4"])


def test_several_launches_report_the_median_one(monkeypatch):
    from shard.tools import compare

    speeds = iter([300.0, 100.0, 200.0])
    monkeypatch.setattr(compare, "launch", lambda args, name: {"name": name, "tokens_per_s": next(speeds)})
    args = compare.parse(["--launches", "3"])
    assert compare.median_launch(args, "zero3-pccl") == {
        "name": "zero3-pccl", "tokens_per_s": 200.0, "launches_tokens_per_s": [100.0, 200.0, 300.0]}
    monkeypatch.setattr(compare, "launch", lambda args, name: {"name": name, "not_run": "no DeepSpeed"})
    assert compare.median_launch(args, "deepspeed-zero3") == {"name": "deepspeed-zero3", "not_run": "no DeepSpeed"}
