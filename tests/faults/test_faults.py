"""The fault-injection suite as tests (tests/faults/suite.py says what each scenario does);
each outcome is a row of the table printed at the end of the run (conftest.py)."""
import json
import re

import pytest

from shard.engine import checkpoint
from tests.faults import suite
from tests.faults.suite import COLLECTIVES, VICTIM, Outcome

pytestmark = [pytest.mark.mpi, pytest.mark.faults]
ROWS: list[Outcome] = []   # the table's rows, in run order (conftest.py prints them)


def recorded(o: Outcome) -> Outcome:
    ROWS.append(o)
    assert not o.hung, f"the job was still running after {o.seconds:.0f} s (a hang):\n{o.output[-3000:]}"
    return o


def waits_on(message: str, rank: int) -> bool:
    """Whether a pccl error says it was waiting on `rank` (as a peer or its world rank)."""
    return re.search(rf"(receive from|send to)[^;]*\b(world rank )?{rank}\b", message) is not None


@pytest.fixture(scope="module")
def collectives(tmp_path_factory) -> dict:
    """Every collective scenario's outcome, run a few at a time (suite.all_collectives)."""
    return suite.all_collectives(tmp_path_factory.mktemp("collectives"))


@pytest.mark.parametrize("place,executor,how", COLLECTIVES, ids=["-".join(c) for c in COLLECTIVES])
def test_a_killed_rank_ends_the_job_naming_the_collective_and_the_peer(place, executor, how, collectives):
    o = recorded(collectives[(place, executor, how)])
    assert o.exit_code != 0, o.output[-3000:]
    assert all(r["rank"] != VICTIM for r in o.reports)
    assert all(r["outcome"] == "raised" for r in o.reports), o.reports   # no survivor went on as if nothing happened
    assert len(o.reports) <= suite.ranks_of(place) - 1
    for r in o.reports:
        assert r["error"] in ("CollectiveTimeout", "PeerLost"), r
        assert "during all-gather (" in r["message"], r["message"]   # the collective, named
        assert r["seconds"] <= suite.timeout_of(how) + suite.SLACK, r
        if place.startswith("plan-"):
            algorithm = "(ring|native_nonblocking)" if place == "plan-native" else "ring"
            assert re.search(rf"the (intra|inter)-node level's all-gather \({algorithm}", r["message"]), r["message"]
    if how == "mpiexec-unnoticed":
        if place == "native" and executor == "cpp":
            # MPI's own blocking collective cannot be cancelled: the watchdog names it and aborts.
            assert "MPI_Allgather did not complete within the timeout" in o.output, o.output[-3000:]
        else:
            assert o.reports, f"no surviving rank raised:\n{o.output[-3000:]}"
        if place == "native_nonblocking":
            # MPI's nonblocking collective, polled: the survivor times out naming MPI's call.
            assert all("in MPI_Iallgather" in r["message"] and "during all-gather (native_nonblocking" in r["message"]
                       for r in o.reports), [r["message"] for r in o.reports]
        elif place == "plan-native":
            # the plan's native intra-node phase on an interruptible communicator: MPI's
            # nonblocking form, never the blocking call that only the watchdog could end
            assert "did not complete within the timeout" not in o.output, o.output[-3000:]
            assert any("in MPI_Iallgather" in r["message"] and "intra-node level's all-gather (native_nonblocking"
                       in r["message"] for r in o.reports), [r["message"] for r in o.reports]
        elif place != "native":
            # Some survivor waited on the dead rank itself (others wait on ranks that wait on it).
            assert any(waits_on(r["message"], VICTIM) for r in o.reports), [r["message"] for r in o.reports]
    elif how == "mpiexec":
        assert "BAD TERMINATION" in o.output or "Killed" in o.output, o.output[-3000:]
    else:
        assert re.search(rf"rank\s*:\s*{VICTIM}\b.*\n.*SIGKILL", o.output) or "Signal 9" in o.output, o.output[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run (6 steps, checkpoints every 2): its losses and snapshots."""
    out = tmp_path_factory.mktemp("faults") / "reference"
    o = recorded(suite.training("", "-", out, "train.steps=6", "train.checkpoint_interval=2", timeout=suite.HEALTHY))
    o.summary = "completed (the reference)"
    assert o.exit_code == 0, o.output[-3000:]
    return out


@pytest.mark.parametrize("fault,place", [("kill@3:1", "step start"), ("kill-backward@3:1", "backward (lane busy)"),
                                         ("kill-data@0:1", "data loader start")])
def test_a_killed_training_rank_fails_the_launch_quickly(fault, place, reference):
    out = reference.parent / fault.replace("@", "-").replace(":", "-")
    o = recorded(suite.training(fault, place, out, "train.steps=6", "train.checkpoint_interval=2",
                                timeout=suite.HEALTHY))
    o.summary = "launcher abort"
    assert o.exit_code not in (0, None), o.output[-3000:]
    assert "BAD TERMINATION" in o.output or "Killed" in o.output, o.output[-3000:]


def test_an_exception_on_one_training_rank_ends_the_job_within_seconds(reference):
    """Rank 1 raises at a step's start (a bug, a data error on it alone): rank 0 waits for it
    in the step's collectives, and rank 1's exit waited for rank 0 (MPI's finalize), so the
    job took the communicators' timeout (HEALTHY, 60 s here; 600 s by default) to end. The
    failed rank now ends within FAILED_EXIT_S, and the launcher ends the job."""
    from shard.tools.train import FAILED_EXIT_S

    out = reference.parent / "raise"
    o = recorded(suite.training("raise@3:1", "step start", out, "train.steps=6", timeout=suite.HEALTHY))
    o.summary = "the raising rank ends the job"
    assert o.exit_code not in (0, None) and "InjectedFault: SHARD_FAULTS: raise@3:1" in o.output, o.output[-3000:]
    assert o.seconds < suite.STARTUP + FAILED_EXIT_S + 10 < suite.HEALTHY, o.seconds


UNNOTICED_TRAINING = [("kill-data@0:1", "data loader start"), ("kill-backward@3:1", "backward (lane busy)"),
                      ("kill-save@4:1", "checkpoint save")]


@pytest.fixture(scope="module")
def unnoticed_training(reference) -> dict:
    """The UNNOTICED_TRAINING runs, all at once (each mostly waits for its timeout)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(UNNOTICED_TRAINING)) as pool:
        root = reference.parent
        futures = {fault: pool.submit(suite.training_unnoticed, fault, place, root / f"unnoticed-{fault.split('@')[0]}",
                                      root / "data", "train.steps=6", "train.checkpoint_interval=2")
                   for fault, place in UNNOTICED_TRAINING}
        return {fault: f.result() for fault, f in futures.items()}


@pytest.mark.parametrize("fault", [f for f, _ in UNNOTICED_TRAINING])
def test_a_training_rank_killed_unnoticed_ends_the_job_through_pccls_timeout(fault, unnoticed_training):
    """The surviving rank's engine (its lanes, the data broadcast, the save's agreement)
    times out naming the collective, and the job ends non-zero; a save cut short leaves
    the previous snapshot the latest, intact."""
    o = recorded(unnoticed_training[fault])
    assert o.exit_code != 0, o.output[-3000:]
    raised = [line for line in o.output.splitlines() if line.startswith("pccl.core.errors.CollectiveTimeout")]
    error = raised[-1] if raised else ""   # the outermost: with the operation named
    # a schedule names the peers it waited for; MPI's nonblocking collective, the MPI call
    assert ("waiting to" in error or " in MPI_I" in error) and "during " in error, o.output[-3000:]
    o.summary = "survivor raised CollectiveTimeout " + error[error.index("during "):][:60]
    if fault.startswith("kill-save"):
        latest = checkpoint.latest(o.out_dir / "checkpoints")
        assert latest.name.startswith("snap-00000002-") and checkpoint.problems(latest) is None


def test_a_rank_killed_mid_save_keeps_the_previous_snapshot_and_the_relaunch_resumes_exactly(reference):
    """kill-save@4: rank 1 dies after writing its files of step 4's snapshot, before the
    manifest: LATEST still names step 2's snapshot, intact; RESTARTS=1 relaunches with
    train.resume=auto, which resumes from step 2 and ends with the uninterrupted losses."""
    out = reference.parent / "kill-save"
    o = recorded(suite.training("kill-save@4:1", "checkpoint save", out, "train.steps=6", "train.checkpoint_interval=2",
                                restarts=1, timeout=suite.HEALTHY))
    o.summary = "relaunched, resumed exactly"
    assert o.exit_code == 0, o.output[-3000:]
    assert "restart 1 of 1" in o.output and "resumed at step 2 from snap-00000002-" in o.output, o.output[-3000:]
    assert suite.losses(out) == suite.losses(reference)
    assert [checkpoint.problems(s) for s in checkpoint.snapshots(out / "checkpoints")] == [None, None]


def test_a_rank_killed_mid_async_write_keeps_the_previous_snapshot_and_the_relaunch_resumes_exactly(reference):
    """train.checkpoint_async=true, kill-save@4: rank 1's writer thread kills it after
    writing its files of step 4's snapshot, while the ranks train step 5; rank 0's writer
    never sees its marker and commits nothing: LATEST still names step 2's snapshot,
    intact, and the relaunch resumes from it and ends with the uninterrupted losses."""
    out = reference.parent / "kill-async-save"
    o = recorded(suite.training("kill-save@4:1", "async checkpoint write", out, "train.steps=6",
                                "train.checkpoint_interval=2", "train.checkpoint_async=true", restarts=1,
                                timeout=suite.HEALTHY))
    o.summary = "relaunched, resumed exactly"
    assert o.exit_code == 0, o.output[-3000:]
    assert "restart 1 of 1" in o.output and "resumed at step 2 from snap-00000002-" in o.output, o.output[-3000:]
    assert suite.losses(out) == suite.losses(reference)
    assert [checkpoint.problems(s) for s in checkpoint.snapshots(out / "checkpoints")] == [None, None]


def test_a_stopped_rank_is_reported_as_a_straggler_and_changes_nothing(reference):
    out = reference.parent / "stop"
    o = recorded(suite.training("stop@3:1:6", "step start", out, "train.steps=6", "train.checkpoint_interval=2",
                                "train.straggler_seconds=2", timeout=suite.HEALTHY))   # stopped for less than it
    assert o.exit_code == 0, o.output[-3000:]
    record = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["step"] == 3)
    straggler = record["straggler"]
    o.summary = f"run completed, straggler rank {straggler['rank']} reported ({straggler['wait_s']:.1f} s)"
    assert straggler["rank"] == 1 and straggler["waiter"] != 1 and straggler["wait_s"] >= 3, straggler
    assert "all-gather" in straggler["operation"], straggler
    assert "straggler at step 3: rank 1" in o.output
    assert suite.losses(out) == suite.losses(reference)


def test_a_full_disk_fails_the_save_clearly_and_keeps_the_previous_snapshot(reference, tmp_path):
    """out_dir on a tmpfs that holds one snapshot and the run's logs, not two snapshots:
    the second save fails on every rank with CheckpointSaveError, the first stays intact."""
    snapshot = sum(f.stat().st_size for f in checkpoint.snapshots(reference / "checkpoints")[0].iterdir())
    disk = tmp_path / "disk"
    if not suite.mount_tmpfs(disk, int(snapshot * 1.6) + 64 * 1024):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        o = recorded(suite.training("", "checkpoint save", disk / "run", "train.steps=4", "train.checkpoint_interval=2",
                                    cache=reference.parent / "data", timeout=suite.HEALTHY))
        o.fault, o.summary = "full disk", "save failed clearly, previous snapshot intact"
        assert o.exit_code != 0 and "CheckpointSaveError" in o.output, o.output[-3000:]
        assert "No space left on device" in o.output, o.output[-3000:]
        snaps = checkpoint.snapshots(disk / "run" / "checkpoints")
        assert checkpoint.latest(disk / "run" / "checkpoints").name.startswith("snap-00000002-")
        assert checkpoint.problems(checkpoint.latest(disk / "run" / "checkpoints")) is None
        assert all(s.name.startswith("snap-00000002-") for s in snaps)   # the failed one was removed
    finally:
        suite.unmount(disk)
