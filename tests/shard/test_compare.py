"""shard-compare: every run of the minimal invocation, FSDP2 against the engine's zero3 (the
same math: the same parameters after 3 steps), the learning rates and the corpus every run
trains on, the agreement check (rounding agrees, a real divergence is flagged and gets no
speed-up), and the output files."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from shard.tools.compare import compared, markdown, parse
from shard.tools.compare_runs import DeepSpeedRun, EngineRun, Fsdp2Run, parse_run
from tests.support.mpirun import ROOT, job_env

SMALL_CORPUS = ["--documents", "300"]   # the synthetic corpus, smaller: prepared in about a second


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A data cache shared by this module's comparisons (the tiny model's vocabulary)."""
    return ["--data-cache", str(tmp_path_factory.mktemp("data-cache")), *SMALL_CORPUS]


@pytest.mark.mpi
def test_the_minimal_invocation_reports_every_run_and_fsdp2_equals_zero3(tmp_path, corpus):
    run = subprocess.run([sys.executable, "-m", "shard.tools.compare", "--ranks", "2", "--steps", "3", "--model",
                          "tiny", "--runs", "fsdp2,zero3-native,zero3-pccl,deepspeed-zero3", "--out", str(tmp_path),
                          *corpus], env=job_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
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
        assert r["losses"][-1] < r["losses"][0] - 0.1, r["losses"]   # the corpus is learnable
        assert r["inputs"] == rows["fsdp2"]["inputs"] and r["other_inputs"] == []
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
def test_micro_batches_paro_iig_and_the_predictor(tmp_path, corpus):
    """Two micro-batches a step: FSDP2 (a reduction per micro-batch) and the engine's
    PaRO-IIG (in the group per micro-batch, across groups once) do the same math; the
    engine's model state is PaRO's Table 2 (plus padding); --predict adds a prediction."""
    run = subprocess.run([sys.executable, "-m", "shard.tools.compare", "--ranks", "2", "--ranks-per-node", "1",
                          "--steps", "3", "--micro", "2", "--batch", "2", "--seq", "32", "--width", "64",
                          "--runs", "fsdp2,paro-iig-native", "--predict", "emulated-1gbit", "--out", str(tmp_path),
                          *corpus], env=job_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads((tmp_path / "compare.json").read_text())["runs"]}
    fsdp2, iig = rows["fsdp2"], rows["paro-iig-native"]
    assert not iig["diverged"] and iig["loss_gap"] < 1e-6
    assert iig["tokens_per_s"] == pytest.approx(2 * 2 * 2 * 32 / iig["step_time_s"])
    # the engine's gradients: Table 2's G-scope accumulator, and the optimizer's fp32
    # gradient beside it (4 of the optimizer state's 12 bytes per element) in sharded units
    # (the small replicated ones sum into the optimizer's gradient itself)
    table2, state = iig["table2_bytes"], iig["state_bytes"]
    assert table2["optimizer"] <= state["optimizer"] <= table2["optimizer"] * 1.01 + 64
    # units too small to shard are replicated, and their parameters are the master weights,
    # not a copy: a little less than Table 2 counts
    assert table2["parameters"] * 0.98 <= state["parameters"] <= table2["parameters"] * 1.01 + 64
    assert table2["gradients"] <= state["gradients"] <= (table2["gradients"] + table2["optimizer"] / 3) * 1.01 + 64
    assert "predicted_step_s" not in fsdp2 and iig["predicted_step_s"] > 0
    assert iig["prediction_error"] == pytest.approx(iig["predicted_step_s"] / iig["step_time_s"] - 1)
    first, second = torch.load(tmp_path / "fsdp2.pt"), torch.load(tmp_path / "paro-iig-native.pt")
    for k in first:
        assert torch.allclose(first[k], second[k], rtol=1e-5, atol=1e-6), k
    assert "compute only:" in run.stdout


@pytest.mark.mpi
def test_profiled_steps_follow_the_measured_ones_and_change_nothing_reported(tmp_path, corpus):
    """--profile 2: two more steps under torch.profiler, after the measured ones: the row
    and the saved state are those of a launch without it (plain PyTorch's state dict holds
    its live tensors), and each run gains where its step went."""
    def compare(out, *extra):
        run = subprocess.run([sys.executable, "-m", "shard.tools.compare", "--ranks", "1", "--steps", "2",
                              "--model", "tiny", "--width", "64", "--layers", "2", "--runs", "eager,zero3-pccl",
                              "--out", str(out), *extra, *corpus], env=job_env(), capture_output=True, text=True,
                             timeout=600, cwd=ROOT)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        return {r["name"]: r for r in json.loads((out / "compare.json").read_text())["runs"]}
    plain, profiled = compare(tmp_path / "plain"), compare(tmp_path / "profiled", "--profile", "2")
    for name in ("eager", "zero3-pccl"):
        assert profiled[name]["losses"] == plain[name]["losses"] and len(plain[name]["losses"]) == 2
        mine, theirs = torch.load(tmp_path / "profiled" / f"{name}.pt"), torch.load(tmp_path / "plain" / f"{name}.pt")
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs), name
        assert "profile" not in plain[name] and "profile_table" not in profiled[name]
        top = {e["name"]: e for e in profiled[name]["profile"]}
        # the tiny GPT's matrix products: 2 blocks x 4 linears (forward, 2 backward) + the head's
        assert top["aten::mm"]["calls_per_step"] >= 24 and top["aten::mm"]["self_ms_per_step"] > 0, top
        assert "aten::mm" in (tmp_path / "profiled" / f"profile-{name}.txt").read_text()


def row(name, losses, tokens):
    return {"name": name, "losses": losses, "tokens_per_s": tokens, "step_time_s": 1.0, "exposed_comm_s": None,
            "sent_bytes_per_rank": 1, "peak_mem_bytes": 1}


def test_a_compressed_run_is_held_to_two_percent_of_the_loss_and_its_movement():
    """2% of (the loss + 10 x how far it moved): 0.1 at the first step (the loss is 5),
    0.02 x (4 + 10 x 1) = 0.28 at the second."""
    rows = compared([row("zero3-pccl", [5.0, 4.0], 100.0), row("zero3-pccl+int8", [5.09, 4.27], 150.0),
                     row("zero3-pccl+zfp:8", [5.0, 4.29], 300.0), row("zero3-pccl+bf16", [5.11, 4.0], 300.0)])
    assert not rows[1]["diverged"] and rows[1]["speedup"] == pytest.approx(1.5)
    assert rows[1]["loss_gap"] == pytest.approx(0.27 / 4) and rows[1]["loss_allowed"] == pytest.approx(0.28 / 4)
    assert rows[2]["diverged"] and rows[2]["speedup"] is None
    assert rows[3]["diverged"] and rows[3]["loss_gap"] == pytest.approx(0.11 / 5)


def test_a_run_whose_losses_diverge_gets_no_speedup():
    rows = compared([row("fsdp2", [5.0, 4.0], 100.0), row("zero3-pccl", [5.0, 4.00001], 150.0),
                     row("zero3-ring", [5.0, 4.1], 300.0), {"name": "deepspeed-zero3", "not_run": "no DeepSpeed"},
                     row("ddp-pccl", [5.0, math.nan], 400.0), row("mics-pccl", [5.0], 500.0)])
    assert rows[1]["speedup"] == pytest.approx(1.5) and not rows[1]["diverged"]
    assert rows[2]["diverged"] and rows[2]["speedup"] is None
    assert rows[4]["diverged"] and rows[5]["diverged"]   # a non-finite loss; fewer steps
    table = markdown(rows)
    assert "diverged: none reported" in table and "3.00x" not in table and "not run: no DeepSpeed" in table
    assert "| 2.5e-02 (3.5e-04) |" in table   # zero3-ring: 0.1 and 1e-4 x (4 + 10 x 1), relative to 4


def test_a_run_handed_other_weights_or_batches_gets_no_speedup_whatever_its_losses():
    """bf16's allowance passed a run from another seed or shuffle: the inputs' digests are
    compared apart from the losses."""
    same = {"initial_weights": "a", "batches": "b"}
    rows = compared([dict(row("eager", [5.0, 4.0], 100.0), inputs=same),
                     dict(row("zero3-pccl", [5.0, 4.0], 150.0), inputs=same),
                     dict(row("fsdp2", [5.0, 4.0], 150.0), inputs=dict(same, initial_weights="c")),
                     dict(row("ddp-pccl", [5.0, 4.0], 150.0), inputs=dict(same, batches="d"))])
    assert rows[1]["speedup"] == pytest.approx(1.5) and rows[1]["other_inputs"] == []
    assert [r["other_inputs"] for r in rows[2:]] == [["initial_weights"], ["batches"]]
    assert all(r["diverged"] and r["speedup"] is None for r in rows[2:])
    assert "other initial_weights: none reported" in markdown(rows)


def test_the_weights_digest_tells_seeds_apart_and_builds_alike():
    from shard.models import GPT
    from shard.tools.compare import model_config, weights_digest

    cfg = model_config(parse(["--ranks", "1", "--width", "64", "--layers", "2", "--heads", "2"]))
    first = weights_digest(GPT(cfg, seed=0))
    assert weights_digest(GPT(cfg, seed=0)) == first and weights_digest(GPT(cfg, seed=1)) != first
    model = GPT(cfg, seed=0)
    with torch.no_grad():
        model.blocks[-1].mlp.up.weight[0, 0] += 1e-6   # one element of one parameter
    assert weights_digest(model) != first


def test_rounding_agrees_and_a_real_divergence_is_flagged(tmp_path):
    """Real training, in this process (eager PyTorch, a small model, the comparison's
    corpus and learning rates): the same run in fp64, or in bf16 autocast, differs from
    fp32 only by rounding and agrees; a 1.5x learning rate, or one block's gradients lost,
    is flagged, in fp32 and in bf16 alike. (The previous rule, 2% of the loss in bf16,
    passed the lost gradients.)"""
    from shard.models import GPT
    from shard.tools.compare import learning_rates, model_config, prepare_data, rank_batches, step_batches
    from shard.tools.compare_runs import EagerRun, agreement, loss_tolerance

    args = parse(["--ranks", "1", "--steps", "8", "--batch", "4", "--seq", "32", "--width", "64", "--layers", "2",
                  "--heads", "2", "--data-cache", str(tmp_path), *SMALL_CORPUS])
    prepare_data(args)

    def losses(dtype=torch.float32, lr_scale=1.0, precision="fp32", lost_gradients=False) -> list[float]:
        model = GPT(model_config(args), seed=0).to(dtype)
        if lost_gradients:
            for p in model.blocks[-1].parameters():
                p.register_hook(torch.zeros_like)
        run = EagerRun(compiled=False)
        run.set_up(model, None, SimpleNamespace(device="cpu", precision=precision))
        batches = rank_batches(args, 0, 1)
        return [float(run.step(step_batches(batches, "cpu"), lr * lr_scale)) for lr in learning_rates(args)]

    fp32 = losses()
    assert fp32[-1] < fp32[0] - 0.3, fp32
    fp32_rule, bf16_rule = loss_tolerance("eager"), loss_tolerance("eager", "bf16")
    assert not agreement(losses(torch.float64), fp32, fp32_rule)["diverged"]
    assert not agreement(losses(precision="bf16"), fp32, bf16_rule)["diverged"]
    lost = losses(lost_gradients=True)
    for wrong in (losses(lr_scale=1.5), lost):
        assert agreement(wrong, fp32, fp32_rule)["diverged"] and agreement(wrong, fp32, bf16_rule)["diverged"]
    assert max(abs(a - b) / b for a, b in zip(lost, fp32)) < 0.02


def test_learning_rates_are_the_presets_with_a_warm_up_over_a_third_of_the_steps():
    from shard.tools.compare import learning_rates, parse

    def cosine(peak, s, warmup, steps):   # shard-train's decay from the peak (step warmup - 1) to a tenth of it
        return peak / 10 + 0.45 * peak * (1 + math.cos(math.pi * (s - warmup + 1) / (steps - warmup)))

    rates = learning_rates(parse(["--model", "gpt_1p3b", "--steps", "9"]))
    assert rates[:3] == pytest.approx([2e-4 / 3, 2e-4 * 2 / 3, 2e-4])   # GPT-3's rate for 1.3B
    assert rates[3:] == pytest.approx([cosine(2e-4, s, 3, 9) for s in range(3, 9)])
    assert rates[-1] == pytest.approx(2e-5)   # the last step at the floor
    assert learning_rates(parse(["--steps", "2"])) == pytest.approx([1e-3, 1e-4])   # tiny; a warm-up of one step
    assert learning_rates(parse(["--model", "gpt_125m", "--lr", "3e-3", "--steps", "3"]))[0] == pytest.approx(3e-3)
    with pytest.raises(SystemExit):
        parse(["--lr", "0"])


def test_the_corpus_is_prepared_once_each_rank_its_own_batches(tmp_path, capsys):
    from shard.tools.compare import main, parse, prepare_data, rank_batches, step_batches

    args = parse(["--ranks", "2", "--micro", "2", "--batch", "3", "--seq", "16", "--data-cache", str(tmp_path),
                  *SMALL_CORPUS])
    prepare_data(args)
    assert [p.name for p in tmp_path.iterdir()] == [args.data.rsplit("/", 1)[1]]   # one cache entry
    first, second = (step_batches(rank_batches(args, rank, 2), "cpu") for rank in (0, 1))
    assert first.shape == second.shape == (2, 3, 17) and not torch.equal(first, second)
    assert torch.equal(first, step_batches(rank_batches(args, 0, 2), "cpu"))   # the same in every run
    assert int(first.max()) < 2048   # the tiny model's vocabulary holds the tokenizer's
    with pytest.raises(SystemExit, match="vocab_size must be an int >= 260, got 100.*--vocab is 100"):
        prepare_data(parse(["--vocab", "100", "--data-cache", str(tmp_path), *SMALL_CORPUS]))
    with pytest.raises(SystemExit, match="fewer than one global batch"):
        prepare_data(parse(["--batch", "100000", "--data-cache", str(tmp_path), *SMALL_CORPUS]))
    with pytest.raises(SystemExit, match="unknown model preset 'gpt_9000'"):
        main(["--model", "gpt_9000", "--out", str(tmp_path / "out")])


def test_unknown_runs_are_refused_before_anything_launches():
    for name in ("fsdp3", "zero3-gloo", "zero9-native"):
        with pytest.raises((SystemExit, ValueError)):
            parse_run(name)
    parse_run("paro-iig-hierarchical")
    parse_run("zero3-pccl+int8")
    with pytest.raises(SystemExit, match="unknown codec"):   # one line, not a CodecError's traceback
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
                r"'deepspeed-zero3'\) or STRATEGY-COMM\[\+CODEC\]\[\+keep\]\[\+compile\] with COMM one of "
                r"\('native', 'pccl', 'hierarchical', 'ho_ring'\)")
    for bad in ("fsdp3", "zero3-gloo", "zero3", "-native", "deepspeed-zero2", "zero3-gloo+int8"):
        with pytest.raises(SystemExit, match=f"unknown run '{bad.partition('+')[0]}'; {expected}"):
            parse_run(bad)
    with pytest.raises(SystemExit, match="run 'zero9-native': unknown strategy 'zero9'; expected"):
        parse_run("zero9-native")
    with pytest.raises(SystemExit, match="run 'zero3-pccl\\+int4': unknown codec 'int4'; expected none, int8, bf16, "
                                         "fp16 or zfp:RATE"):
        parse_run("zero3-pccl+int4")


def test_plain_pytorch_and_compiled_runs_by_name():
    """eager and eager-compile are plain PyTorch on one rank; fsdp2-compile and +compile
    compile each block or unit; bf16 runs are held to one bf16 rounding, compressed ones
    to 2%."""
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
    assert loss_tolerance("zero3-pccl+compile") == 1e-4 and loss_tolerance("zero3-pccl+compile", "bf16") == 2 ** -8
    assert loss_tolerance("zero3-pccl+int8+compile") == 0.02
    kept = parse_run("zero3-pccl+keep+compile")   # reshard_after_forward=False: the same math, held alike
    assert kept.kept and kept.compiled and kept.codec is None and kept.name == "zero3-pccl+keep+compile"
    assert not parse_run("zero3-pccl").kept and loss_tolerance("zero3-pccl+keep", "bf16") == 2 ** -8
    for bad, said in (("fsdp2+keep", "apply to the engine's runs"), ("fsdp2-pccl+keep", "'fsdp2-pccl' takes none"),
                      ("eager+compile", "apply to the engine's runs"), ("zero3-pccl+keep+keep", "a suffix twice")):
        with pytest.raises(SystemExit, match=said):
            parse_run(bad)


def test_the_prediction_of_a_keep_run_has_no_backward_gathers():
    """--predict predicts each engine run as it runs: +keep (reshard_after_forward=False)
    gathers no parameters in the backward, so less communication than ZeRO-3's default."""
    from shard.tools.compare import predicted

    args = parse(["--ranks", "2", "--width", "64", "--seq", "32", "--batch", "2", "--predict", "emulated-1gbit"])
    rows = [{"name": name, "step_time_s": 1.0} for name in ("zero3-native", "zero3-native+keep")]
    predicted(args, rows, {"fb_s": 1e-3, "update_s_per_element": 1e-9})
    default, kept = rows
    assert 0 < kept["predicted_comm_s"] < default["predicted_comm_s"]


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
    # of two launches the slower one's row (the upper middle was the faster: the maximum)
    speeds = iter([300.0, 100.0])
    monkeypatch.setattr(compare, "launch", lambda args, name: {"name": name, "tokens_per_s": next(speeds)})
    assert compare.median_launch(compare.parse(["--launches", "2"]), "fsdp2")["tokens_per_s"] == 100.0


def test_the_first_step_is_never_timed_by_default():
    """--steps 2 left no warm-up: the first step, with pccl's self-calibration, was timed
    (zero3-pccl at 0.27x where --steps 3 gave 2.36x)."""
    from shard.tools.compare import default_warmup

    assert [default_warmup(s) for s in (2, 3, 5, 6, 13)] == [1, 1, 1, 2, 4]


def test_deepspeed_trains_as_the_other_runs_do():
    """bf16 where --precision bf16 (without its section DeepSpeed trained in fp32 under the
    bf16 label), every parameter from the engine's min_shard_numel on sharded (its default
    kept all but one of the tiny model's tensors whole on every rank), no clipping."""
    from types import SimpleNamespace

    from shard.engine.units import MIN_SHARD_NUMEL
    from shard.tools.compare_runs import deepspeed_config

    for precision in ("fp32", "bf16"):
        config = deepspeed_config(SimpleNamespace(batch=2, micro=3, precision=precision))
        assert config["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": MIN_SHARD_NUMEL}
        assert config["gradient_clipping"] == 0.0 and config["gradient_accumulation_steps"] == 3
        assert config.get("bf16") == ({"enabled": True} if precision == "bf16" else None)


def test_bad_settings_are_refused_before_any_launch(monkeypatch, tmp_path):
    from shard.tools import compare

    monkeypatch.setattr(compare, "launch", lambda args, name: pytest.fail("launched"))
    monkeypatch.setattr(compare, "prepare_data", lambda args: pytest.fail("prepared"))
    for argv, said in ((["--ranks", "2", "--ranks-per-node", "3"], "--ranks-per-node 3 does not divide --ranks 2"),
                       (["--predict", "nosuch"], "--predict nosuch: "),   # (it failed after every run)
                       (["--runs", "bogus-native"], "run 'bogus-native': unknown strategy")):
        with pytest.raises(SystemExit, match=said):
            compare.main([*argv, "--out", str(tmp_path)])
