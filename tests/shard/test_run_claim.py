"""shard-train's hold on its directories (shard/tools/run_claim.py, train.claim_directory,
train.link_checkpoints): a directory another process holds is refused, naming the holder,
until that process ends however it ends; a forked child does not keep its parent's hold;
a checkpoint_dir holding another run's snapshots is refused, and a fresh start in a directory
that holds a run."""
import os
import signal
import subprocess
import sys
import time

import pytest

from shard.tools import run_claim
from shard.tools.train import RELAUNCH_WAIT_S, claim_directory, earlier_run, link_checkpoints, relaunch_patience

HOLD = ("import sys, time; from pathlib import Path; from shard.tools import run_claim\n"
        "held = run_claim.claim(Path(sys.argv[1])); print('held', flush=True); time.sleep(float(sys.argv[2]))")


def holder(directory, seconds: float = 600) -> subprocess.Popen:
    """A process that claims `directory` and sleeps `seconds`, once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), str(seconds)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_directory_another_process_holds_is_refused_naming_it_until_that_process_ends(tmp_path):
    proc = holder(tmp_path)
    try:
        with pytest.raises(run_claim.Claimed, match=rf"in use by another run: host .*, pid {proc.pid}, since "):
            run_claim.claim(tmp_path)
        problem, claims = claim_directory("train.out_dir", tmp_path)
        assert problem.startswith(f"train.out_dir: {tmp_path} is in use by another run") and claims == []
        assert "set train.out_dir" in problem
    finally:
        proc.send_signal(signal.SIGKILL)   # ended without a chance to let go: the system does
        proc.wait()
    problem, claims = claim_directory("train.out_dir", tmp_path)
    assert problem == "" and len(claims) == 1
    assert f"pid {os.getpid()}" in (tmp_path / run_claim.LOCK).read_text()
    claims[0].close()


def test_a_relaunch_waits_for_the_holder_to_let_go_and_a_fresh_run_does_not(tmp_path):
    """A run that resumes waits (a lost node's lock lasts until the file server notices),
    within half the communicator's timeout, saying once whom it waits for; a fresh run
    stops at once."""
    assert relaunch_patience("auto", 600) == relaunch_patience(True, 600) == RELAUNCH_WAIT_S == 300
    assert relaunch_patience("auto", 60) == 30 and relaunch_patience(False, 600) == 0
    proc = holder(tmp_path, seconds=1.5)
    try:
        heard = []
        start = time.monotonic()
        held = run_claim.claim(tmp_path, patience=30, waiting=heard.append)
        assert 0.5 < time.monotonic() - start < 30 and len(heard) == 1 and f"pid {proc.pid}" in heard[0]
        held.close()
    finally:
        proc.kill()
        proc.wait()
    proc = holder(tmp_path)
    try:
        start = time.monotonic()
        with pytest.raises(run_claim.Claimed):
            run_claim.claim(tmp_path, patience=0)
        assert time.monotonic() - start < 1
    finally:
        proc.kill()
        proc.wait()


def test_a_forked_child_does_not_keep_its_parents_hold(tmp_path):
    """A data worker forked from rank 0 outlives nothing: once rank 0 lets go (it ends), the
    directory is free though the child still has the file open (flock would keep it)."""
    held = run_claim.claim(tmp_path)
    child = os.fork()
    if child == 0:   # the child: sleeps with the parent's descriptor open
        time.sleep(60)
        os._exit(0)
    try:
        held.close()
        run_claim.claim(tmp_path).close()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_checkpoint_dir_with_another_runs_snapshots_is_refused_and_this_runs_own_is_kept(tmp_path):
    target, first, second = tmp_path / "fast", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    assert link_checkpoints(first / "checkpoints", target) == ""
    (target / "snap-00000002-0123456789abcdef").mkdir()
    (target / "LATEST").write_text("snap-00000002-0123456789abcdef\n")
    problem = link_checkpoints(second / "checkpoints", target)
    assert "holds another run's snapshots" in problem and not (second / "checkpoints").exists()
    assert link_checkpoints(first / "checkpoints", target) == "", "the run that made the link resumes"


def test_a_fresh_start_in_a_directory_that_holds_a_run_is_refused(tmp_path):
    """Its first save would replace that run's snapshots (retention deletes them: shard-train
    twice with one train.out_dir left only the second run's), its log that run's metrics."""
    assert earlier_run(tmp_path) == ""
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "checkpoints").mkdir()
    assert earlier_run(tmp_path) == ""   # an empty log, no snapshot: nothing to lose
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert earlier_run(tmp_path).startswith(f"train.out_dir={tmp_path} holds an earlier run's metrics.jsonl")
    for step in (2, 4, 6):
        (tmp_path / "checkpoints" / f"snap-{step:08d}-ab").mkdir()
    problem = earlier_run(tmp_path)
    assert "snapshots (snap-00000006-ab, snap-00000004-ab, ...)" in problem and "train.resume=true" in problem
