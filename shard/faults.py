"""Faults injected on purpose, for the fault-injection tests: SHARD_FAULTS lists what to
break, where and when, as KIND@STEP:RANK entries separated by commas, e.g.

    SHARD_FAULTS="inf-grad@2:1,nan-loss@4:0" shard-train ...

  inf-grad  rank RANK's gradients of train step STEP become infinite (its loss stays
            finite): the engine must skip that step on every rank alike
  nan-loss  rank RANK's loss of train step STEP becomes NaN: the run must stop
  kill      rank RANK kills itself (SIGKILL) at the start of train step STEP, once per
            output directory (a marker file there keeps a relaunch that resumes from an
            earlier checkpoint from dying at the same step again)

Steps count from 1, as the training log does. Unset, nothing is injected (one set lookup
per step).
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

KINDS = ("inf-grad", "nan-loss", "kill")


class _InfiniteGradient(torch.autograd.Function):
    """The identity forward; backward sends infinite gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def planned(env=os.environ) -> set[tuple[str, int, int]]:
    """{(kind, step, rank)} of SHARD_FAULTS; a malformed entry raises ValueError."""
    faults = set()
    for entry in filter(None, (e.strip() for e in env.get("SHARD_FAULTS", "").split(","))):
        try:
            kind, where = entry.split("@")
            step, rank = (int(x) for x in where.split(":"))
        except ValueError:
            raise ValueError(f"SHARD_FAULTS entry {entry!r} is not KIND@STEP:RANK (e.g. inf-grad@2:1)") from None
        if kind not in KINDS:
            raise ValueError(f"SHARD_FAULTS entry {entry!r}: unknown kind {kind!r}, expected one of {KINDS}")
        faults.add((kind, step, rank))
    return faults


def loss(value: torch.Tensor, faults: set, step: int, rank: int) -> torch.Tensor:
    """`value`, broken as `faults` ask for this step and rank."""
    if ("nan-loss", step, rank) in faults:
        value = value * float("nan")
    if ("inf-grad", step, rank) in faults:
        value = _InfiniteGradient.apply(value)
    return value


def kill_if_planned(faults: set, step: int, rank: int, out_dir: Path) -> None:
    """SIGKILL this process at `step` if `faults` say so and it has not happened in
    `out_dir` yet."""
    if ("kill", step, rank) not in faults:
        return
    marker = Path(out_dir) / f".fault-kill@{step}:{rank}"
    if marker.exists():
        return
    marker.touch()
    os.kill(os.getpid(), signal.SIGKILL)
