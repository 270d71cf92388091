"""torch.profiler around training steps: shard-train's window of steps (log.profile) and
the hottest operators of a profile (shard-train's and shard-compare's tables).

A traced step is a span "step N" on the training thread. The engine names its lane tasks
as its straggler report does ("gather: all-gather of blocks.3's parameters (forward)",
"reduce: reduction of blocks.3's gradients"), on the lanes' threads (or, where NCCL only
queues work, on the training thread as the kernels are queued), and each wait of the
training thread for one is a span "wait: ..." (shard/engine/lanes.py): the timeline shows
which communication ran under compute and which a step waited for. Every thread is traced
(torch's `profile_all_threads`; a torch without it traces the training thread alone, and
says so).
"""
from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from runkit.files import write_atomic

TABLE_ROWS = 40   # operators (on GPUs, kernels) in a profile's table


def activities(device: torch.device) -> list:
    """What a profile records: the host's operators, and a GPU's kernels."""
    return [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]


def every_thread() -> dict:
    """profile()'s keyword that traces every thread, the lanes' too; {} on a torch without it."""
    try:
        from torch._C._profiler import _ExperimentalConfig
        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        return {}


def hottest(prof, device: torch.device, steps: int, rows: int) -> tuple[list[dict], str]:
    """The `rows` operators and kernels of `prof` that took the most time of their own per
    step (GPU kernels' time on the device, on CPUs the host's), with how often each ran per
    step; and torch's table of them (3 x rows lines)."""
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()   # (aggregating the trace once, for the rows and the table)
    events = sorted(averages, key=lambda e: getattr(e, key), reverse=True)
    top = [{"name": e.key, "self_ms_per_step": getattr(e, key) / 1e3 / steps, "calls_per_step": e.count / steps}
           for e in events[:rows] if getattr(e, key) > 0]
    return top, averages.table(sort_by=key, row_limit=3 * rows)


class StepProfiler:
    """Steps `first`..`first + steps - 1` (numbered from 1, as the log numbers them) under
    torch.profiler, on this rank, those of them this session runs (it starts after `done`
    and ends at `last_step`); the step before them warms the profiler up (its start's costs
    stay out of the trace), unless the window opens at the session's first step. When the
    window closes (or the run ends inside it), `directory`/steps{a}-{b}/ gets
    rank{R}.json.gz, the trace (ui.perfetto.dev, chrome://tracing), and rank{R}.txt, the
    hottest operators' table; `say` tells where (rank 0 says it). Profiling never stops
    the training: a trace it cannot write is reported and skipped."""

    def __init__(self, first: int, steps: int, done: int, last_step: int, directory: Path, rank: int,
                 device: torch.device, say: Callable[[str], None]):
        self.first, self.last = max(first, done + 1), min(first + steps - 1, last_step)
        self.directory, self.rank, self.device, self.say = directory, rank, device, say
        self._warmup = 1 if self.first - 1 > done else 0
        self._prof = None
        self._step = 0   # the step running now
        if self.first > self.last:
            say(f"log.profile: steps {first}-{first + steps - 1} lie outside this session's steps "
                f"{done + 1}-{last_step}: nothing is traced")
            self.first, self.last = 0, -1

    def slows(self, step: int) -> bool:
        """Whether step `step` runs under the profiler: the window's, and the one warming it up."""
        return self.first - self._warmup <= step <= self.last

    @contextmanager
    def step(self, step: int):
        """Around step `step`: starts the profiler for the window's first (or warm-up) step, and
        writes the trace once the window's last has run."""
        self._step = step
        if step == self.first - self._warmup:
            threads = every_thread()
            if not threads:
                self.say("log.profile: this torch cannot trace other threads: the engine's lanes are left out")
            with warnings.catch_warnings():   # (torch warns of a window with no warm-up: one at the first step)
                warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
                plan = schedule(wait=0, warmup=self._warmup, active=self.last - self.first + 1, repeat=1)
            self._prof = profile(activities=activities(self.device), on_trace_ready=self._write, schedule=plan,
                                 acc_events=True, **threads)
            self._prof.start()
        if self._prof is None:
            yield
            return
        with record_function(f"step {step}"):
            yield
        self._prof.step()
        if step == self.last:
            self.close()

    def close(self) -> None:
        """Stop tracing (writing what the window traced so far, if it had begun)."""
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                prof.stop()
            except Exception as e:   # noqa: BLE001 - not the training's failure, nor one to hide it
                self._failed("could not stop the profiler", e)

    def _write(self, prof) -> None:
        steps = min(self._step, self.last) - self.first + 1
        where = self.directory / f"steps{self.first}-{self.first + steps - 1}"
        partial = where / f"rank{self.rank}.partial-{os.getpid()}.json.gz"   # (torch writes .gz by its name)
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            where.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(partial))
            os.replace(partial, where / f"rank{self.rank}.json.gz")
            write_atomic(where / f"rank{self.rank}.txt", hottest(prof, self.device, steps, TABLE_ROWS)[1])
        except Exception as e:   # noqa: BLE001 - a full disk, a bad directory: training goes on
            with suppress(OSError):
                partial.unlink()
            self._failed(f"could not write the trace of steps {self.first}-{self.first + steps - 1} to {where}", e)
            return
        self.say(f"profile of steps {self.first}-{self.first + steps - 1}: {where}/rank*.json.gz (every rank's "
                 f"trace: ui.perfetto.dev or chrome://tracing) and rank*.txt (the operators that took the most time)")

    def _failed(self, doing: str, e: Exception) -> None:
        print(f"shard-train: rank {self.rank}: log.profile: {doing}: {type(e).__name__}: {e}; training goes on "
              "without it", file=sys.stderr, flush=True)

