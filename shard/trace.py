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


@dataclass(frozen=True)
class Call:
    level: str          # the lane's communicator: world, group or cross
    collective: str
    nbytes: int         # the full buffer (all-gather output, reduce-scatter input)
    algorithm: object   # resolved: a name, "native" or a plan spec
    comm: object = field(compare=False, repr=False)


@dataclass
class Task:
    lane: str
    calls: list[Call] = field(default_factory=list)


class StepTrace:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.tasks: list[Task] = []
        self._lock = threading.Lock()

    def compute(self, kind: str, unit: Optional[str]) -> None:
        self.events.append(("compute", kind, unit))

    def submit(self, lane: str) -> int:
        with self._lock:
            self.tasks.append(Task(lane))
            task = len(self.tasks) - 1
        self.events.append(("submit", task))
        return task

    def call(self, task: Optional[int], call: Call) -> None:
        if task is None:
            self.events.append(("call", call))
        else:
            self.tasks[task].calls.append(call)

    def wait(self, task: int) -> None:
        self.events.append(("wait", task))

    def calls(self) -> list[Call]:
        """Every collective, tasks' in submission order."""
        out = []
        for event in self.events:
            if event[0] == "submit":
                out += self.tasks[event[1]].calls
            elif event[0] == "call":
                out.append(event[1])
        return out
