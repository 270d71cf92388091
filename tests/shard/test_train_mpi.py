"""End to end: shard-train under mpiexec on 2 and 4 ranks (tiny model, synthetic corpus),
ZeRO-3 and PaRO-IIG. The loss falls; strategies and world sizes that see the same global
batch follow the same trajectory; a resumed run continues with exactly the losses of an
uninterrupted one; a model built on the meta device trains exactly as an eager one; the
default global batch (null: it grows with the world) is the explicit one it adds up to."""
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shard.engine import checkpoint
from shard.tools import run_claim
from tests.support.mpirun import ROOT, job_env, mpiexec

pytestmark = pytest.mark.mpi

STEPS = 6
SMALL = ["model.width=64", "model.layers=2", "model.heads=2", "model.vocab=512", "train.seq_len=32",
         "train.micro_batch=4", "train.global_batch_tokens=1024", "optim.lr=3e-3", "optim.min_lr=3e-4",
         "optim.warmup_steps=2", "optim.decay_steps=20", "train.eval_interval=3", "train.eval_batches=2",
         "train.checkpoint_interval=0", "log.interval=1", "log.progress=false", "data.documents=300",
         "data.vocab_size=512"]
RUNS: dict = {}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The corpus's cache; and, for the module's runs, a calibration cache of their own:
    each world shape is measured by the first run of it, as on a fresh machine."""
    calibrations = pytest.MonkeyPatch()
    calibrations.setenv("PCCL_CACHE_DIR", str(tmp_path_factory.mktemp("calibration-cache")))
    yield tmp_path_factory.mktemp("data-cache")
    calibrations.undo()


def train(tmp_path_factory, cache, key, ranks, strategy, *extra, out=None):
    """metrics.jsonl records of a run (launched once per key); its output in stdout.txt."""
    if key not in RUNS:
        out = out or tmp_path_factory.mktemp(key)
        rpn = {1: 1, 2: 1, 4: 2}[ranks]   # 4 ranks: 2 emulated nodes of 2, so IIG's groups are real
        run = mpiexec(ranks, "-m shard.tools.train", f"strategy={strategy}", f"comm.ranks_per_node={rpn}",
                      f"train.out_dir={out}", f"data.cache_dir={cache}", f"train.steps={STEPS}", *SMALL, *extra)
        assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        (out / "stdout.txt").write_text(run.stdout)
        RUNS[key] = (out, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    return RUNS[key]


@pytest.mark.parametrize("ranks,strategy", [(1, "zero3"), (2, "zero3"), (4, "zero3"), (2, "paro-iig"),
                                            (4, "paro-iig")])
def test_loss_falls_and_outputs_are_written(tmp_path_factory, cache, ranks, strategy):
    """As shipped: auto decides with the self-calibration (its real budget) on two ranks or
    more, and on one rank, which moves nothing, measures nothing."""
    out, records = train(tmp_path_factory, cache, f"{strategy}-{ranks}", ranks, strategy)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.5, losses
    for r in records:
        for key in ("loss", "lr", "tokens_per_s", "tflops_per_rank", "grad_norm", "exposed_comm_s", "peak_memory_gb"):
            assert isinstance(r[key], float) and r[key] >= 0, (key, r)
        assert r["mfu"] is None   # CPU: no peak to compare with
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    config = (out / "config.yaml").read_text()
    assert f"world: {ranks}" in config and "num_params:" in config
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss"] == records[-1]["val_loss"] and summary["accumulation"] == 8 // ranks
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoints" / "LATEST").is_file()
    said = (out / "stdout.txt").read_text()
    # the launcher's OMP_NUM_THREADS=1 (tests/support/mpirun.py), on one rank as on several
    assert summary["cpu_threads"] == 1 and "(1 CPU thread per rank)" in said
    if ranks == 1:
        assert summary["self_calibration"] == {} and "auto: unmeasured (one rank, nothing to measure)" in said
    else:
        calibrated = summary["self_calibration"]
        assert calibrated["shapes"] >= 1 and calibrated["cache"] in said
        assert list(Path(calibrated["cache"]).glob("*.json")), "rank 0 keeps the figures"


def test_each_world_shape_is_measured_by_its_first_run_and_read_by_the_next(tmp_path_factory, cache):
    """Two runs of one shape (2 ranks, zero3): the first launched measured every shape it
    used, in this run, within the self-calibration's budget; the second read them all."""
    train(tmp_path_factory, cache, "zero3-2", 2, "zero3")
    train(tmp_path_factory, cache, "zero3-2-null", 2, "zero3", *NULL_BATCH_PROFILED)
    first, second = (json.loads((out / "summary.json").read_text())["self_calibration"]
                     for key, (out, _) in RUNS.items() if key in ("zero3-2", "zero3-2-null"))
    assert first["measured"] == first["shapes"] >= 1 and 0 < first["measured_s"] < 10 * first["shapes"]
    assert second == {**first, "measured": 0, "measured_s": 0.0}


# The run with the default global batch also traces steps 3-4 (log.profile), so its exact
# losses against the explicit batch's run show that profiling changes nothing computed.
NULL_BATCH_PROFILED = ("train.global_batch_tokens=null", "train.accumulation=4", "log.profile.steps=2",
                       "log.profile.start=3")


def test_default_global_batch_grows_with_the_world(tmp_path_factory, cache):
    """train.global_batch_tokens=null on 2 ranks with accumulation 4: 2 x 4 x 4 x 32 = 1024
    tokens, the explicit batch of the other runs, so exactly their losses (and under the
    profiler, for steps 2-4, too)."""
    out, records = train(tmp_path_factory, cache, "zero3-2-null", 2, "zero3", *NULL_BATCH_PROFILED)
    _, explicit = train(tmp_path_factory, cache, "zero3-2", 2, "zero3")
    assert [r["loss"] for r in records] == [r["loss"] for r in explicit]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["accumulation"], summary["global_batch_tokens"]) == (4, 1024)


def test_a_profiled_window_shows_every_ranks_steps_gathers_reductions_and_waits(tmp_path_factory, cache):
    """log.profile.steps=2 log.profile.start=3 on 2 ranks: each rank's trace holds steps 3
    and 4 on the training thread, where it waited for which gather and reduction, and the
    lanes' gathers and reductions of every unit, each on its lane's thread; the intervals
    with steps under the profiler (the warm-up step 2, and 3-4) are marked and left out of
    the summary's throughput."""
    out, records = train(tmp_path_factory, cache, "zero3-2-null", 2, "zero3", *NULL_BATCH_PROFILED)
    where = out / "profile" / "steps3-4"
    assert sorted(p.name for p in where.iterdir()) == ["rank0.json.gz", "rank0.txt", "rank1.json.gz", "rank1.txt"]
    for rank in (0, 1):
        events = [e for e in json.load(gzip.open(where / f"rank{rank}.json.gz"))["traceEvents"] if e.get("ph") == "X"]
        threads = {}   # span name -> the threads it ran on
        for e in events:
            threads.setdefault(e["name"], set()).add(e["tid"])
        (main,) = threads["step 3"]
        assert sorted(n for n in threads if n.startswith("step ")) == ["step 3", "step 4"]
        units = ("<root>", "pos", "blocks.0", "blocks.1")
        gathers = [f"gather: all-gather of {u}'s parameters (forward)" for u in units]
        reductions = [f"reduce: reduction of {u}'s gradients" for u in units]
        lanes = [threads[name] for name in gathers + reductions]
        assert all(len(t) == 1 and main not in t for t in lanes), lanes
        assert len(set.union(*lanes)) == 2   # one thread per lane
        assert all(threads[f"wait: {name}"] == {main} for name in gathers + reductions)
    assert [r["step"] for r in records if r["profiled"]] == [2, 3, 4]
    said = (out / "stdout.txt").read_text()
    assert f"profile of steps 3-4: {where}/rank*.json.gz" in said and said.count("(profiled steps)") == 3
    summary = json.loads((out / "summary.json").read_text())
    timed = [r["tokens_per_s"] for r in records if not r["profiled"] and not r["warmup"]]
    assert summary["tokens_per_s"] == statistics.median(timed)


def test_strategies_and_world_sizes_follow_one_trajectory(tmp_path_factory, cache):
    """The same global batch of the same data (the batch split differs with the world),
    so the losses differ only by summation order; and so do the validation losses, of one
    validation set on any number of ranks (its 2 micro-batches shared out: on 4 ranks, two
    run theirs uncounted)."""
    records = train(tmp_path_factory, cache, "ddp-4", 4, "ddp")[1]
    reference = [r["loss"] for r in records]
    validation = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(validation) == 2
    for key, ranks, strategy in [("zero3-4", 4, "zero3"), ("paro-iig-4", 4, "paro-iig"), ("zero3-2", 2, "zero3"),
                                 ("paro-iig-2", 2, "paro-iig"), ("zero3-1", 1, "zero3")]:
        records = train(tmp_path_factory, cache, key, ranks, strategy)[1]
        assert [r["loss"] for r in records] == pytest.approx(reference, rel=1e-4), key
        assert [r["val_loss"] for r in records if "val_loss" in r] == pytest.approx(validation, rel=1e-4), key


def test_strategy_auto_trains_with_the_plans_choice_on_the_same_trajectory(tmp_path_factory, cache):
    """strategy=auto on 2 nodes of 2: every rank makes the same plan (it trains at all), the
    choice and every candidate are kept, and the losses are those of any other strategy."""
    reference = [r["loss"] for r in train(tmp_path_factory, cache, "ddp-4", 4, "ddp")[1]]
    out = tmp_path_factory.mktemp("auto-4")
    run = mpiexec(4, "-m shard.tools.train", "strategy=auto", "comm.ranks_per_node=2", f"train.out_dir={out}",
                  f"data.cache_dir={cache}", f"train.steps={STEPS}", *SMALL)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == pytest.approx(reference, rel=1e-4)
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["rows"]) == 14 and plan["cluster"]["world"] == 4 and plan["job"]["micro_batches"] == 2
    chosen = plan["chosen"]["name"]
    assert f"chosen: {chosen}" in (out / "config.yaml").read_text()
    assert f"strategy=auto (throughput) chose {chosen}" in run.stdout and "runner-up" in run.stdout


def first_half(tmp_path_factory, cache) -> Path:
    """A 2-rank ZeRO-3 run stopped after STEPS // 2 steps, with its final checkpoint (once)."""
    if "first-half" not in RUNS:
        out = tmp_path_factory.mktemp("first-half")
        run = mpiexec(2, "-m shard.tools.train", "strategy=zero3", "comm.ranks_per_node=1", f"train.out_dir={out}",
                      f"data.cache_dir={cache}", f"train.steps={STEPS // 2}", *SMALL)
        assert run.returncode == 0, run.stderr[-3000:]
        RUNS["first-half"] = out
    return RUNS["first-half"]


def test_resume_continues_with_the_uninterrupted_losses(tmp_path_factory, cache):
    _, uninterrupted = train(tmp_path_factory, cache, "zero3-2", 2, "zero3")
    resumed = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(first_half(tmp_path_factory, cache), resumed)
    _, records = train(tmp_path_factory, cache, "resumed", 2, "zero3", "train.resume=true", out=resumed)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))   # the log continues, without repeats
    after = slice(STEPS // 2, None)
    assert [r["loss"] for r in records[after]] == [r["loss"] for r in uninterrupted[after]]   # exactly
    assert [r["grad_norm"] for r in records[after]] == [r["grad_norm"] for r in uninterrupted[after]]


def test_async_checkpoints_in_their_own_directory_resume_exactly(tmp_path_factory, cache):
    """train.checkpoint_async=true with train.checkpoint_dir: a snapshot after every step,
    written in the background into another directory (out_dir/checkpoints links to it),
    the last committed before the run ends; resumed from it, the run ends with the
    uninterrupted losses bit for bit."""
    _, uninterrupted = train(tmp_path_factory, cache, "zero3-2", 2, "zero3")
    root = tmp_path_factory.mktemp("async")
    snapshots = root / "fast-disk" / "snapshots"
    options = ("train.checkpoint_async=true", f"train.checkpoint_dir={snapshots}", "train.checkpoint_interval=1")
    run = mpiexec(2, "-m shard.tools.train", "strategy=zero3", "comm.ranks_per_node=1", f"train.out_dir={root / 'run'}",
                  f"data.cache_dir={cache}", f"train.steps={STEPS // 2}", *SMALL, *options)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (root / "run" / "checkpoints").resolve() == snapshots
    assert [checkpoint._step(s) for s in checkpoint.snapshots(snapshots)] == [STEPS // 2, STEPS // 2 - 1]   # keep 2
    assert checkpoint.problems(checkpoint.latest(snapshots)) is None
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["checkpoint_stall_s"] > 0 for r in records[1:])   # each record's: the save after the one before
    _, resumed = train(tmp_path_factory, cache, "async-resumed", 2, "zero3", "train.resume=true", *options,
                       out=root / "run")
    after = slice(STEPS // 2, None)
    assert [r["loss"] for r in resumed[after]] == [r["loss"] for r in uninterrupted[after]]


def test_resume_auto_on_another_world_size_and_strategy_continues_the_trajectory(tmp_path_factory, cache):
    """The 2-rank ZeRO-3 checkpoint resumed by 4 ranks under PaRO-IIG (resharded on load):
    the same step and data position, so the uninterrupted run's losses up to summation
    order (as test_strategies_and_world_sizes_follow_one_trajectory)."""
    _, uninterrupted = train(tmp_path_factory, cache, "zero3-2", 2, "zero3")
    resumed = tmp_path_factory.mktemp("resharded") / "run"
    shutil.copytree(first_half(tmp_path_factory, cache), resumed)
    _, records = train(tmp_path_factory, cache, "resharded", 4, "paro-iig", "train.resume=auto", out=resumed)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    after = slice(STEPS // 2, None)
    assert [r["loss"] for r in records[after]] == pytest.approx([r["loss"] for r in uninterrupted[after]], rel=1e-4)
    assert "world: 4" in (resumed / "config.yaml").read_text()


@pytest.mark.parametrize("changed, message", [
    ("model.mlp=relu", "the model differs from the one trained there (model.mlp='relu' where the snapshot has "
                       "'gelu')"),
    ("data.vocab_size=400", "batch state was saved over the corpus"),
    ("train.seq_len=16", "batch state was saved with seq_len 32, these batches use 16"),
])
def test_a_resume_that_would_compute_or_read_otherwise_is_refused(tmp_path_factory, cache, changed, message):
    """A model of the same shapes with another function (an MLP activation), another
    tokenizer or corpus, another window length: each resumed silently, on other losses
    than the uninterrupted run's. Refused, one line and exit 2."""
    resumed = tmp_path_factory.mktemp("changed") / "run"
    shutil.copytree(first_half(tmp_path_factory, cache), resumed)
    run = mpiexec(2, "-m shard.tools.train", "strategy=zero3", "comm.ranks_per_node=1", f"train.out_dir={resumed}",
                  f"data.cache_dir={cache}", f"train.steps={STEPS}", *SMALL, "train.resume=true", changed,
                  timeout=300)
    raised = [line for line in run.stderr.splitlines() if line.startswith("shard-train: ") and message in line]
    assert run.returncode == 2 and len(raised) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]


def test_a_resume_with_nothing_left_to_train_says_so(tmp_path_factory, cache):
    resumed = tmp_path_factory.mktemp("finished") / "run"
    shutil.copytree(first_half(tmp_path_factory, cache), resumed)
    run = mpiexec(2, "-m shard.tools.train", "strategy=zero3", "comm.ranks_per_node=1", f"train.out_dir={resumed}",
                  f"data.cache_dir={cache}", f"train.steps={STEPS // 2}", *SMALL, "train.resume=true")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"resumed at step {STEPS // 2} from snap-" in run.stdout and \
        f"train.steps={STEPS // 2}: nothing left to train" in run.stdout, run.stdout[-3000:]


def test_meta_device_model_trains_exactly_as_an_eager_one(tmp_path_factory, cache):
    _, eager = train(tmp_path_factory, cache, "paro-iig-4", 4, "paro-iig")
    _, meta = train(tmp_path_factory, cache, "paro-iig-4-meta", 4, "paro-iig", "model.meta_init=true")
    assert [r["loss"] for r in meta] == [r["loss"] for r in eager]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad-input")
    (d / "empty.txt").write_text("")
    (d / "short.txt").write_text("hello world")
    (d / "garbage.model").write_bytes(bytes(range(256)) * 8)
    (d / "a-file").write_text("not a directory")
    return d


@pytest.mark.parametrize("override, message", [
    ("train.global_batch_tokens=1000", "not a multiple of world size"),
    ("model.vocab=100", "set model.vocab >= "),
    ("strategy.name=GNN", "Principle 1"),
    ("strategy.group_size=3", "strategy.group_size: group size 3 does not divide the world size 2"),   # (was exit 1)
    ("train.resume=maybe", "train.resume must be one of (True, False, 'auto'), got 'maybe'"),
    ("data=text data.files=[{d}/empty.txt]", "empty.txt: the file is empty (no documents)"),
    ("data=text data.files=[{d}/short.txt]", "need at least 2 documents"),
    ("data.tokenizer={d}/garbage.model", "garbage.model is not a sentencepiece model"),
    ("train.out_dir={d}/a-file/run", "cannot be written (on rank 0: [Errno 20] Not a directory"),
    ("train.resume=true", "holds no checkpoint to continue from; train.resume=auto starts fresh"),
    ("train.micro_batch=5000 train.global_batch_tokens=null train.accumulation=1",   # (was a traceback per rank)
     "fewer than one global batch"),
    # communicator settings (were a traceback per rank and exit 1, which RESTARTS relaunched)
    ("comm.ranks_per_node=3", "comm: world size 2 is not divisible by ranks_per_node=3"),
    ("comm=torch comm.algorithm=native_nonblocking", "comm.algorithm for all_gather: 'native_nonblocking' is MPI's"),
    ("strategy=auto strategy.auto.memory=1KB", "strategy=auto: model (0.00"),
    # a setting that differs between ranks (here through each rank's environment): rank 1 trained as told
    ("log.wandb.name=rank-${{oc.env:PMI_RANK}}", "the ranks were launched with different configurations: rank 1 "
                                                "differs from rank 0; on rank 1: log.wandb.name='rank-1' where rank 0 "
                                                "has 'rank-0'"),
])
def test_bad_input_fails_every_rank_clearly_and_leaves_nothing_to_misread(tmp_path, cache, bad_files, override,
                                                                            message):
    """2 ranks: each stops with the same clear error (rank 0's data or output-directory failure
    is shared with the others), which the first rank says in one line, without a traceback,
    and exit status 2; the job ends without waiting out a timeout, and the output directory
    holds nothing a later run would read (no checkpoint, no metrics)."""
    out = tmp_path / "run"
    small = [a for a in SMALL if not (override.startswith("data=text") and a.startswith("data.documents="))]
    run = mpiexec(2, "-m shard.tools.train", f"train.out_dir={out}", f"data.cache_dir={cache}", "comm.timeout=60",
                  *small, *override.format(d=bad_files).split(), timeout=120)
    raised = [line for line in run.stderr.splitlines() if line.startswith("shard-train: ") and message in line]
    assert run.returncode == 2 and len(raised) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_a_run_into_a_directory_another_run_holds_stops_clearly_and_writes_nothing(tmp_path, cache):
    """Two runs in one out_dir (runs started in the same second share the default one): the
    second, on 2 ranks, stops with exit status 2 and one line naming the holder (here this
    process), before it writes anything there."""
    out = tmp_path / "run"
    out.mkdir()
    held = run_claim.claim(out)
    try:
        run = mpiexec(2, "-m shard.tools.train", f"train.out_dir={out}", f"data.cache_dir={cache}", "comm.timeout=60",
                      *SMALL, timeout=120)
    finally:
        held.close()
    said = [line for line in run.stderr.splitlines() if line.startswith("shard-train: ")]
    assert run.returncode == 2 and len(said) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"{out} is in use by another run: host " in said[0] and f"pid {os.getpid()}," in said[0]
    assert sorted(p.name for p in out.iterdir()) == [run_claim.LOCK]


def faulty_run(tmp_path, cache, monkeypatch, faults: str, *extra) -> tuple:
    """A 2-rank zero3 run with SHARD_FAULTS (shard/tools/faults.py): its output directory and process."""
    monkeypatch.setenv("SHARD_FAULTS", faults)
    out = tmp_path / "run"
    run = mpiexec(2, "-m shard.tools.train", "strategy=zero3", "comm.ranks_per_node=1", f"train.out_dir={out}",
                  f"data.cache_dir={cache}", f"train.steps={STEPS}", *SMALL, *extra, timeout=300)
    return out, run


def test_infinite_gradients_on_one_rank_skip_the_step_on_every_rank(tmp_path, cache, monkeypatch):
    """Rank 1's gradients of step 2 are infinite: both ranks skip it alike (a rank that
    stepped while the other skipped would leave them waiting on different collectives),
    count it, log it, and train on."""
    out, run = faulty_run(tmp_path, cache, monkeypatch, "inf-grad@2:1", "train.max_skipped_steps=1",
                          "train.checkpoint_interval=1", "train.keep_checkpoints=2")
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, True] + [False] * (STEPS - 2)
    assert [r["skipped_steps"] for r in records] == [0] + [1] * (STEPS - 1)
    assert "step 2: skipped (non-finite gradients; 1 so far)" in run.stderr
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    # snapshots are named by the step, the skipped one counted: two kept, of steps 5 and 6
    kept = checkpoint.snapshots(out / "checkpoints")
    assert [int(s.name.split("-")[1]) for s in kept] == [STEPS, STEPS - 1], [s.name for s in kept]
    assert json.loads((kept[0] / "meta.json").read_text())["extra"]["step"] == STEPS


def test_a_resume_inside_a_logged_interval_logs_the_uninterrupted_record(tmp_path, cache, monkeypatch):
    """log.interval=4 and a snapshot at step 3, rank 0 killed at step 5: the resumed run's
    record of steps 1-4 averages the steps before the snapshot too (it was step 4's loss
    alone: steps 1-3 were never logged), as the uninterrupted run's does."""
    options = ("log.interval=4", "train.checkpoint_interval=3", "train.eval_interval=0")
    whole = mpiexec(2, "-m shard.tools.train", "strategy=zero3", "comm.ranks_per_node=1",
                    f"train.out_dir={tmp_path / 'whole'}", f"data.cache_dir={cache}", f"train.steps={STEPS}", *SMALL,
                    *options, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    out, run = faulty_run(tmp_path, cache, monkeypatch, "kill@5:0", *options)
    assert run.returncode != 0
    out, run = faulty_run(tmp_path, cache, monkeypatch, "kill@5:0", *options, "train.resume=true")
    assert run.returncode == 0, run.stderr[-3000:]
    expected, records = ([json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
                         for d in (tmp_path / "whole", out))
    assert [r["step"] for r in records] == [r["step"] for r in expected] == [4, STEPS]
    for mine, theirs in zip(records, expected):   # bit for bit (the saved losses were once rounded to fp32)
        assert mine["loss"] == theirs["loss"]


def test_resume_auto_over_a_save_cut_short_starts_fresh(tmp_path, cache):
    """A crash in the first save leaves a snapshot without its manifest: nothing to resume
    from, so auto starts fresh (and says so) instead of refusing every relaunch."""
    out = tmp_path / "run"
    cut = out / "checkpoints" / "snap-00000002-00000000000000ab"
    cut.mkdir(parents=True)
    (cut / "shard-0.pt").write_bytes(b"half a file")
    run = mpiexec(1, "-m shard.tools.train", f"train.out_dir={out}", f"data.cache_dir={cache}", "train.steps=2",
                  "train.resume=auto", *SMALL, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "a fresh start: train.resume=auto" in run.stdout and "1 snapshot(s) never completed" in run.stdout
    assert "note: optim.warmup_steps=2 is not below train.steps=2: the learning rate rises" in run.stdout
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("faults, extra, message", [
    ("inf-grad@2:1,inf-grad@3:0", "train.max_skipped_steps=1",
     "2 steps skipped for non-finite gradients (the latest: step 3), more than train.max_skipped_steps=1"),
    ("nan-loss@4:1", "train.checkpoint_interval=2", "non-finite loss at step 4 (fp32 training): stopping; the last "
                                                   "good snapshot is snap-00000002-"),
])
def test_too_many_skipped_steps_or_a_nan_loss_stop_the_run(tmp_path, cache, monkeypatch, faults, extra, message):
    _, run = faulty_run(tmp_path, cache, monkeypatch, faults, extra, "train.precision=fp32")
    assert run.returncode != 0 and "TrainingError" in run.stderr and message in run.stderr, run.stderr[-3000:]


def snapshot_tensors(out: Path) -> dict:
    """Every tensor of the latest checkpoint in `out`, by (file, unit, key)."""
    snap = checkpoint.latest(out / "checkpoints")
    return {(f.name, unit, key): value for f in sorted(snap.glob("shard-*.pt"))
            for unit, state in torch.load(f).items() for key, value in state.items() if torch.is_tensor(value)}


def test_a_killed_rank_relaunched_with_resume_auto_ends_as_the_uninterrupted_run(tmp_path_factory, cache):
    """launch/local.sh RESTARTS=1, 4 ranks: rank 2 is SIGKILLed at the start of step 4
    (checkpoints every 2 steps); the job fails, is relaunched with train.resume=auto,
    resumes from step 2's snapshot, and its losses and final parameters and optimizer
    state equal the uninterrupted run's exactly."""
    reference_out, reference = train(tmp_path_factory, cache, "zero3-4", 4, "zero3")
    out = tmp_path_factory.mktemp("killed") / "run"
    small = [a for a in SMALL if not a.startswith("train.checkpoint_interval=")]
    env = dict(job_env(), SHARD_FAULTS="kill@4:2", RESTARTS="1", NPROC="4", RANKS_PER_NODE="2",
               PYTHON=sys.executable, MODEL="", STRATEGY="zero3")
    run = subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), f"train.out_dir={out}", f"data.cache_dir={cache}",
                          f"train.steps={STEPS}", "train.checkpoint_interval=2", *small],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "restart 1 of 1 with train.resume=auto" in run.stderr
    assert "resumed at step 2 from snap-" in run.stdout + run.stderr   # not a fresh start, which would match too
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in reference]
    mine, theirs = snapshot_tensors(out), snapshot_tensors(reference_out)
    assert mine.keys() == theirs.keys() and len(mine) > 0
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), [k for k in mine if not torch.equal(mine[k], theirs[k])]
