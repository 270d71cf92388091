"""Faults injected on purpose, for the fault-injection tests: SHARD_FAULTS lists what to
break, where and when, as KIND@STEP:RANK entries separated by commas, e.g.

    SHARD_FAULTS="inf-grad@2:1,nan-loss@4:0" shard-train ...

  inf-grad       rank RANK's gradients of train step STEP become infinite (its loss stays
                 finite): the engine must skip that step on every rank alike
  nan-loss       rank RANK's loss of train step STEP becomes NaN: the run must stop
  kill           rank RANK kills itself (SIGKILL) at the start of train step STEP
  kill-backward  ... after its first micro-batch's backward of step STEP, with that
                 micro-batch's gradient reductions queued on the reduction lane
  kill-save      ... in the checkpoint save after step STEP, its own files written, before
                 the ranks agree that the snapshot is complete (train.checkpoint_async: on
                 the writer thread, while the ranks train on)
  kill-data      ... as the run starts loading its data (STEP must be 0)
  raise          rank RANK raises an exception at the start of train step STEP (a bug, or
                 a data error, on one rank only): the run must end within seconds, not
                 wait out the communicators' timeout in the others' next collective
  stop           rank RANK stops (SIGSTOP) at the start of step STEP and is continued
                 (SIGCONT) SECONDS later by a helper process: KIND@STEP:RANK:SECONDS
                 (default 2): a straggler, which the run must survive and report

A kill happens once per output directory (a marker file there keeps a relaunch that resumes
from an earlier checkpoint from dying at the same place again). Steps count from 1, as the
training log does. Unset, nothing is injected (one set lookup per place).
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import torch

KINDS = ("inf-grad", "nan-loss", "kill", "kill-backward", "kill-save", "kill-data", "stop", "raise")
STOP_SECONDS = 2.0


class _InfiniteGradient(torch.autograd.Function):
    """The identity forward; backward sends infinite gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def planned(env=os.environ) -> dict[tuple[str, int, int], float]:
    """{(kind, step, rank): seconds} of SHARD_FAULTS (seconds: a stop's length, else 0); a
    malformed entry raises ValueError."""
    faults = {}
    for entry in filter(None, (e.strip() for e in env.get("SHARD_FAULTS", "").split(","))):
        try:
            kind, where = entry.split("@")
            fields = where.split(":")
            step, rank = int(fields[0]), int(fields[1])
            if len(fields) > (3 if kind == "stop" else 2):
                raise ValueError
            seconds = float(fields[2]) if len(fields) == 3 else (STOP_SECONDS if kind == "stop" else 0.0)
        except (ValueError, IndexError):
            raise ValueError(f"SHARD_FAULTS entry {entry!r} is not KIND@STEP:RANK (e.g. inf-grad@2:1; "
                             "stop@STEP:RANK:SECONDS)") from None
        if kind not in KINDS:
            raise ValueError(f"SHARD_FAULTS entry {entry!r}: unknown kind {kind!r}, expected one of {KINDS}")
        if kind == "kill-data" and step != 0:
            raise ValueError(f"SHARD_FAULTS entry {entry!r}: kill-data happens before the first step; give STEP 0")
        if step < 0 or rank < 0 or seconds < 0:
            raise ValueError(f"SHARD_FAULTS entry {entry!r}: STEP, RANK and SECONDS must not be negative")
        faults[(kind, step, rank)] = seconds
    return faults


def loss(value: torch.Tensor, faults: dict, step: int, rank: int) -> torch.Tensor:
    """`value`, broken as `faults` ask for this step and rank."""
    if ("nan-loss", step, rank) in faults:
        value = value * float("nan")
    if ("inf-grad", step, rank) in faults:
        value = _InfiniteGradient.apply(value)
    return value


def kill_if_planned(faults: dict, kind: str, step: int, rank: int, out_dir: Path) -> None:
    """SIGKILL this process if `faults` plan a `kind` kill at `step` for this rank and it
    has not happened in `out_dir` yet."""
    if (kind, step, rank) not in faults:
        return
    marker = Path(out_dir) / f".fault-{kind}@{step}:{rank}"
    if marker.exists():
        return
    marker.touch()
    os.kill(os.getpid(), signal.SIGKILL)


class InjectedFault(RuntimeError):
    """The exception SHARD_FAULTS=raise@STEP:RANK plants."""


def raise_if_planned(faults: dict, step: int, rank: int) -> None:
    if ("raise", step, rank) in faults:
        raise InjectedFault(f"SHARD_FAULTS: raise@{step}:{rank}")


def stop_if_planned(faults: dict, step: int, rank: int) -> None:
    """SIGSTOP this process at `step` if `faults` say so; a detached helper sends SIGCONT
    after the planned seconds."""
    seconds = faults.get(("stop", step, rank))
    if seconds is None:
        return
    # its output not the rank's: the launcher waits for every holder of the job's pipes to close them
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.kill(os.getpid(), signal.SIGSTOP)
