"""The fault-injection suite: each scenario launches a small job, breaks it on purpose and
records what happened (outcome, seconds to the end, exit code, the survivors' errors).

    make test-faults                  # the scenarios as tests, then the table
    python -m tests.faults.suite      # the table alone (Markdown)

Two families:

- Collectives (tests/faults/collective_worker.py; plans on 4 ranks as 2 emulated nodes of 2,
  the rest on 2 ranks): rank 1 is SIGKILLed in a flat ring all-gather, in either level of a
  two-level plan, in an async all-gather on the communicator's worker thread, or in the
  transport's own collective; for
  the C++, Python and torch (gloo) executors. Launchers: `mpiexec` as users run it (it kills
  the job when a rank dies), "mpiexec-unnoticed": mpiexec with the victim under a shell that
  lingers after it was killed, so the launcher never learns of the death (as when a
  node drops off the network): only pccl's own timeouts can end the job; and torchrun.
- Training (shard-train through launch/local.sh, tiny model): a rank SIGKILLed at a
  step's start, mid-backward with reductions in flight, mid-checkpoint-save (then
  relaunched with RESTARTS=1) or as the data loads; a rank stopped (SIGSTOP, SIGCONT later):
  the run goes on with the same losses and reports the straggler; a checkpoint save onto a
  full disk (a small tmpfs).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from runkit.mpirun import launcher
from tests.support.mpirun import ROOT, job_env

TIMEOUT = 2.0            # the communicators' timeout in every scenario, seconds
SLACK = 30.0             # the bound: every survivor ends within TIMEOUT + SLACK
STARTUP = 30.0           # launching and importing on an oversubscribed 2-core machine
# Under torchrun nothing lines the workers up before gloo connects them, which waits the
# communicators' timeout for the last to arrive: their imports, on shared cores, can differ
# by more than TIMEOUT.
ARRIVAL = 10.0
# Runs whose fault the launcher handles (it aborts the job when a rank dies) or that have
# none: a long timeout, so that a healthy step slowed by shared cores (rank 0 building the
# data cache while rank 1 waits) is not taken for a fault.
HEALTHY = 60.0
RANKS, VICTIM = 4, 1     # plans: 2 nodes of 2; the other places need no more than 2 ranks
UNNOTICED = "mpiexec-unnoticed"
TRAIN = ["model.width=64", "model.layers=2", "model.heads=2", "model.vocab=512", "train.seq_len=32",
         "train.micro_batch=4", "train.global_batch_tokens=1024", "optim.warmup_steps=2", "optim.decay_steps=20",
         "train.eval_interval=0", "train.eval_batches=1", "log.interval=1", "log.progress=false",
         "data.documents=300", "data.vocab_size=512"]


@dataclass
class Outcome:
    """What one scenario did."""
    fault: str
    place: str
    executor: str
    launcher: str
    seconds: float = 0.0
    exit_code: Optional[int] = None
    hung: bool = False
    reports: list = field(default_factory=list)   # the survivors' rank-R.json reports (collectives)
    output: str = ""                              # the job's stdout and stderr
    out_dir: Optional[Path] = None
    summary: str = ""                             # the outcome in words, for the table

    def row(self) -> str:
        code = "-" if self.exit_code is None else str(self.exit_code)
        return (f"| {self.fault} | {self.place} | {self.executor} | {self.launcher} | "
                f"{'HANG' if self.hung else self.summary} | {self.seconds:.1f} | {code} |")


def bounded(cmd: list[str], env: dict, limit: float) -> tuple[Optional[int], float, str, bool]:
    """Run `cmd` in its own session; past `limit` seconds, kill the whole session (a hang).
    Returns (exit code, seconds, output, hung)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit)
        return proc.returncode, time.monotonic() - start, output, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, time.monotonic() - start, output, True


def lingering(words: list[str]) -> list[str]:
    """`words` under a shell that stays when the process was SIGKILLed (exit status 137),
    so mpiexec never learns of the death: only pccl's own timeouts can end the job."""
    return ["sh", "-c", " ".join(shlex.quote(w) for w in words) +
            "; code=$?; if [ $code = 137 ]; then sleep 3600; fi; exit $code"]


def victim_lingers(ranks: int, words: list[str]) -> list[str]:
    """mpiexec's arguments after its flags: `ranks` ranks of `words`, rank VICTIM's under
    the lingering shell (MPMD: `-n 1 A : -n 1 B : ...`), the others as users run them. A
    shell around a survivor would hold its process manager's connection past the
    survivor's exit (Hydra's proxy then took that exit for a normal one, now and then, and
    left the job waiting on the victim)."""
    args: list[str] = []
    for count, cmd in ((VICTIM, words), (1, lingering(words)), (ranks - VICTIM - 1, words)):
        if count:
            args += [*([":"] if args else []), "-n", str(count), *cmd]
    return args


def ranks_of(place: str) -> int:
    return RANKS if place.startswith("plan-") else 2


def timeout_of(how: str) -> float:
    return ARRIVAL if how == "torchrun" else TIMEOUT


def collective(place: str, executor: str, how: str, out: Path) -> Outcome:
    """Rank VICTIM SIGKILLed at `place` of a collective on `executor`, launched `how`
    ("mpiexec", "mpiexec-unnoticed" or "torchrun")."""
    out.mkdir(parents=True, exist_ok=True)
    ranks, timeout = ranks_of(place), timeout_of(how)
    worker = [sys.executable, "-m", "tests.faults.collective_worker", "--executor", executor, "--place", place,
              "--out", str(out), "--timeout", str(timeout), "--victim", str(VICTIM)]
    if how == "mpiexec":
        cmd = [*launcher(), "-n", str(ranks), *worker]
    elif how == UNNOTICED:
        cmd = [*launcher(), *victim_lingers(ranks, worker)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *worker[1:]]
    code, seconds, output, hung = bounded(cmd, job_env(), timeout + SLACK + STARTUP)
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    o = Outcome("kill", place, executor, how, seconds, code, hung, reports, output, out)
    raised = [r for r in reports if r["outcome"] == "raised"]
    errors = sorted({r["error"] for r in raised})
    aborted = ranks - 1 - len(reports)
    o.summary = (f"{len(raised)} raised {'/'.join(errors) or '-'}" if raised else "no survivor raised") + \
        (f", {aborted} ended by the {'job' if how == UNNOTICED else 'launcher'}'s abort" if aborted else "")
    if "did not complete within the timeout" in output:
        o.summary += "; watchdog named the stuck call"
    return o


def training(fault: str, place: str, out: Path, *extra: str, restarts: int = 0, ranks: int = 2,
             cache: Optional[Path] = None, timeout: float = TIMEOUT) -> Outcome:
    """shard-train through launch/local.sh with SHARD_FAULTS=`fault` (empty: none), the
    communicators' `timeout`, the data cache in `cache` (default: beside `out`)."""
    run_env = dict(job_env(), SHARD_FAULTS=fault, NPROC=str(ranks), RANKS_PER_NODE="1", PYTHON=sys.executable,
                   MODEL="", STRATEGY="zero3", RESTARTS=str(restarts))
    cmd = ["bash", str(ROOT / "launch" / "local.sh"), f"train.out_dir={out}",
           f"data.cache_dir={cache or out.parent / 'data'}", f"comm.timeout={timeout}", *TRAIN, *extra]
    limit = (timeout + SLACK + STARTUP) * (restarts + 1) + 60
    code, seconds, output, hung = bounded(cmd, run_env, limit)
    return Outcome(fault.split("@")[0] if fault else "none", place, "cpp", "local.sh" + (
        f" RESTARTS={restarts}" if restarts else ""), seconds, code, hung, [], output, out)


def training_unnoticed(fault: str, place: str, out: Path, cache: Path, *extra: str) -> Outcome:
    """shard-train on 2 ranks with SHARD_FAULTS=`fault`, the victim's death unnoticed by
    mpiexec (lingering): the survivor's engine must time out and end the job."""
    words = [sys.executable, "-m", "shard.tools.train", f"train.out_dir={out}", f"data.cache_dir={cache}",
             f"comm.timeout={TIMEOUT}", "strategy=zero3", "comm.ranks_per_node=1", *TRAIN, *extra]
    code, seconds, output, hung = bounded([*launcher(), *victim_lingers(2, words)],
                                          dict(job_env(), SHARD_FAULTS=fault), TIMEOUT + SLACK + STARTUP + 30)
    return Outcome(fault.split("@")[0], place, "cpp", UNNOTICED, seconds, code, hung, [], output, out)


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def mount_tmpfs(path: Path, nbytes: int) -> bool:
    """A tmpfs of `nbytes` at `path` (root only); False where it cannot be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


PLACES = ("flat", "plan-intra", "plan-inter", "lane")
COLLECTIVES = [(place, executor, UNNOTICED) for executor in ("cpp", "python", "torch") for place in PLACES] + \
    [("native", "cpp", UNNOTICED), ("native_nonblocking", "cpp", UNNOTICED), ("plan-native", "cpp", UNNOTICED),
     ("native", "torch", UNNOTICED),
     ("flat", "cpp", "mpiexec"), ("plan-inter", "torch", "torchrun")]
TABLE_HEAD = ("| fault | place | executor | launcher | outcome | seconds | exit |\n"
              "|---|---|---|---|---|---|---|")


PARALLEL = 3   # scenarios at once: most of each is waiting (startup aside), not computing


def all_collectives(root: Path) -> dict[tuple, Outcome]:
    """Every scenario of COLLECTIVES, PARALLEL at a time (each in its own directory)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = {c: pool.submit(collective, *c, root / "-".join(c)) for c in COLLECTIVES}
        return {c: f.result() for c, f in futures.items()}


def main() -> None:
    """Run the collective scenarios and print the table (the training ones run as tests)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(TABLE_HEAD)
        for outcome in all_collectives(Path(tmp)).values():
            print(outcome.row(), flush=True)


if __name__ == "__main__":
    main()
