"""What a training step did, in program order, for the step-time predictor (predict.py).

The engine and its lanes append, while a trace is attached (Engine.traced()):
  ("compute", kind, unit)  the training loop is about to compute: "forward" or "backward"
                           of a unit (by name), or "update" (the optimizer, unit None)
  ("submit", task)         a task went to a lane (tasks[task]: its lane and collectives)
  ("wait", task)           the loop waited for that task
  ("call", call)           a collective issued outside any task, on the loop's own thread
Each collective is kept with the communicator it ran on, so a dry-run communicator can say
how long it takes. Replaying these events with a duration for each computation and each
collective gives the step's time with the engine's own overlap (its prefetch depth, its
lanes, the points where it waits), not a formula of it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class TracedCall:
    level: str          # the lane's communicator: world, group or cross
    collective: str
    nbytes: int         # the full buffer (all-gather output, reduce-scatter input)
    algorithm: object   # resolved: a name, "native" or a plan spec
    dtype: torch.dtype  # the payload's (the calibration's ratios are per reduction class)
    comm: object = field(compare=False, repr=False)


@dataclass
class Task:
    lane: str
    calls: list[TracedCall] = field(default_factory=list)


class StepTrace:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.tasks: list[Task] = []
        self.marks: list[int] = []   # where each micro-batch's events begin, then the step's own
        self._lock = threading.Lock()

    def micro_batch(self) -> None:
        """The next events belong to the next micro-batch (or, after the last, to the step)."""
        self.marks.append(len(self.events))

    def repeated(self, index: int, times: int) -> "StepTrace":
        """This trace with micro-batch `index` (a middle one) in it `times` times: its tasks
        copied for each repetition, its waits on its own tasks pointed at the copy's, and
        later waits on them at the last copy's (a lane runs its tasks in order: when the
        last copy's is done, so are the earlier ones')."""
        if not 0 < index < len(self.marks) - 2 or times < 1:
            raise ValueError(f"micro-batch {index} of {len(self.marks) - 1} is not a middle one, or times={times} < 1")
        start, end = self.marks[index], self.marks[index + 1]
        out = StepTrace()
        latest: dict[int, int] = {}   # a task of this trace -> its id in `out` (the latest copy's)

        def copy(events) -> None:
            for e in events:
                if e[0] == "submit":
                    latest[e[1]] = len(out.tasks)
                    out.tasks.append(Task(self.tasks[e[1]].lane, list(self.tasks[e[1]].calls)))
                    out.events.append(("submit", latest[e[1]]))
                elif e[0] == "wait":
                    if e[1] not in latest:
                        raise ValueError(f"task {e[1]} is waited for before it is submitted")
                    out.events.append(("wait", latest[e[1]]))
                else:
                    out.events.append(e)

        copy(self.events[:start])
        for _ in range(times):
            out.micro_batch()
            copy(self.events[start:end])
        for mark in self.marks[index + 1:]:
            out.marks.append(mark - end + len(out.events))
        copy(self.events[end:])
        out.marks = self.marks[:index] + out.marks
        return out

    def compute(self, kind: str, unit: Optional[str]) -> None:
        self.events.append(("compute", kind, unit))

    def submit(self, lane: str) -> int:
        with self._lock:
            self.tasks.append(Task(lane))
            task = len(self.tasks) - 1
        self.events.append(("submit", task))
        return task

    def call(self, task: Optional[int], call: TracedCall) -> None:
        if task is None:
            self.events.append(("call", call))
        else:
            self.tasks[task].calls.append(call)

    def wait(self, task: int) -> None:
        self.events.append(("wait", task))

    def calls(self) -> list[TracedCall]:
        """Every collective, tasks' in submission order."""
        out = []
        for event in self.events:
            if event[0] == "submit":
                out += self.tasks[event[1]].calls
            elif event[0] == "call":
                out.append(event[1])
        return out
