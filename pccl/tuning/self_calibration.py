"""Self-calibration: algorithm="auto" measured on the machine it runs on, with no user action.

A communicator of two ranks or more over MPI or gloo whose profile nobody chose (no
profile argument, no PCCL_PROFILE) measures (measures()), at its first auto call of a
collective and reduction class on buffers of a device type (host memory, or GPUs), every
candidate of auto for that device's buffers (the schedules, the transport's own
collectives, in both of MPI's forms, the plans where their levels carry it) at sizes from
4 B up (x4 to 64 KiB, then doubling) until BUDGET seconds are spent, and keeps the figures
in a cache file that every later run of the same shape reads instead. The tuner of that
device's buffers then predicts exactly what was measured at those sizes
(Profile.calibration), interpolates between them, and holds the largest size's ratios
beyond it. Until then, where this is off, and on one rank (which moves nothing: there is
nothing to measure), auto runs the transport's own collective (pccl.tuning.selection,
trust_native).

A call larger than the sweep's largest size (a sharded engine's units: tens to hundreds of
MB) is measured at its size (the next power of two) at its first use, up to REACH_MAX:
every candidate where the projection fits REACH times the budget, else the candidates one
at a time in the order auto would run them (its pick first, ranked again after each) until
the time is spent (reach): a candidate's cost need not grow past the sizes measured as the
model's does. The size joins the entry in the cache, so it is measured once per shape.

Each device type is measured apart, and the host's figures never decide for GPU buffers:
over MPI a GPU's messages are staged through pinned host memory or handed to a GPU-aware
library, and either changes every candidate's cost. On GPUs each timed loop ends with the
device synchronized, so a loop times the collectives' work, not only their launch.

Each size: every candidate is warmed up once, then timed in ROUNDS rounds, SHORT_ROUNDS
below DOUBLING_BYTES (the order rotating between rounds, so no candidate always follows
the same one), each an untimed call (switching from another candidate costs something a
training loop, which repeats one, does not pay; from SWITCH_BYTES on the buffers outgrow
the caches a switch leaves cold, and the call is left out), a barrier, so that the loop
does not time the ranks' skew, and a timed loop of calls, about LOOP_SECONDS long (1 to
MAX_ITERS calls, from the size before); a round's time is the slowest rank's, a
candidate's the median of its rounds (more rounds below DOUBLING_BYTES, where one
descheduled rank makes a round of a few short calls an outlier). The next size is measured
only if its projected time fits what is left of the budget: the candidates' summed median
time per call, extrapolated along the line through the last two sizes, times the calls it
makes, and MARGIN; from the medians, not the clock, so that a stall of one call costs its
time but does not end the calibration early. A size's warm-up is charged at most its
calls' expected time: the first call at a new size can pay a setup that a run pays at its
first such call anyway. docs/tuning.md gives the figures behind these choices.

Agreement: rank 0 reads the cache and broadcasts what it found (at the first need, and
again at the first need of an entry the communicator lacks or of a size beyond it: another
communicator of the shape may have stored it since, _catch_up); the times are all-reduced
(max), so every rank holds the same figures, stops at the same size and makes the same
choices. These and the barriers time out on an interruptible communicator (its broadcast
polled, the rest through pccl's schedules), where a blocking MPI call would hang. Rank 0
writes the file, atomically, under a lock; where another communicator of the shape stored
the entry first (a nested strategy's groups measure at once, each with its own rank 0),
the file's figures stay, unless these are them with a larger size reached, and every rank
decides with what the file holds (_store): all communicators of a shape decide with one
set of figures, the one the next run reads.

The cache: PCCL_CACHE_DIR (default $XDG_CACHE_HOME/pccl, else ~/.cache/pccl), file
calibration/<hash of the key>.json. The key holds what determines the answer: the node type
(CPU model, cores, machine), the MPI library and version (over gloo, torch's version and
the backend), the transport and executor, the
world shape (ranks, ranks per node, nodes, NICs per node), pccl's version and FORMAT, and
for GPU buffers the GPU (its name, the GPUs a rank sees) and how MPI moves its memory
(GPU-aware, or staged through host memory). An entry that is not valid JSON, whose key is
not this one (or one of a single rank), whose figures are malformed (not what measure()
writes: a time that is not a positive, finite number, candidates not all measured at
the sweep's sizes) or lack a candidate auto now has, is measured again and rewritten, with a warning;
a cache that cannot be written keeps the figures for this run only, with a warning.

PCCL_SELF_CALIBRATION=0 turns it off; PCCL_CALIBRATION_BUDGET is the budget in seconds per
collective and class (default 0.4: 2 s per communicator shape for the five it can need,
all-gather, and reduce-scatter and all-reduce of each class, and first uses' setups;
all-gather reduces nothing, so one measurement serves both classes), and a size reached
beyond the sweep may take REACH times that (4 s), once per size and shape.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import platform
import statistics
import threading
import time
import warnings
from contextlib import contextmanager
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import Optional

import torch

from pccl.core.dtypes import reduction_class
from pccl.tuning.cost_model import calibrated
from runkit.files import write_atomic

FORMAT = 6   # what is measured and how: an entry of another format is measured again (6: 5 rounds below 64 KiB)
BUDGET = 0.4            # seconds per collective and reduction class (PCCL_CALIBRATION_BUDGET)
MAX_BYTES = 64 << 20    # the largest size measured, budget permitting
ROUNDS = 3
SHORT_ROUNDS = 5        # rounds below DOUBLING_BYTES, where a round lasts 0.1-0.3 ms (see above)
DOUBLING_BYTES = 64 << 10   # sizes grow x4 below this, then double
LOOP_SECONDS = 400e-6   # a round's loop: about this long (from the size before), 1 to MAX_ITERS calls
MAX_ITERS = 8
SWITCH_BYTES = 1 << 20  # from here on no untimed call before a round's loop (see above)
MARGIN = 1.3            # a size's time over its calls' (barriers, Python, the shared figures), and some
REACH = 10              # a size beyond the sweep that a call asks for: measured once if it fits REACH x budget
REACH_MAX = 1 << 30     # ... and is at most this large
DEVICES = ("cpu", "cuda")   # the buffers measured, each device type apart (cuda: CUDA and HIP)
DTYPE_OF = {"full": torch.float32, "half": torch.bfloat16}   # what each reduction class is measured with
_FILES = threading.Lock()   # the engine's two lanes may store one shape's entries at once
_LEDGER: dict[Path, float] = {}   # every cache file this process decided with -> seconds it measured into it


def enabled(env=os.environ) -> bool:
    value = env.get("PCCL_SELF_CALIBRATION", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PCCL_SELF_CALIBRATION must be 0 or 1, got {value!r}")
    return value == "1"


def budget(env=os.environ) -> float:
    text = env.get("PCCL_CALIBRATION_BUDGET")
    try:
        seconds = BUDGET if text is None else float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"PCCL_CALIBRATION_BUDGET must be a positive number of seconds, got {text!r}")
    return seconds


def cache_dir(env=os.environ) -> Path:
    """Where calibrations are kept: PCCL_CACHE_DIR, else the user's cache directory."""
    if env.get("PCCL_CACHE_DIR"):
        return Path(env["PCCL_CACHE_DIR"])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pccl"


def node_type() -> str:
    """The kind of machine: CPU model, logical cores, architecture (not its host name: the
    nodes of a partition share one calibration)."""
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or 'unknown CPU'}, {os.cpu_count()} cores, {platform.machine()}"


def measures(comm) -> bool:
    """Whether `comm` (a pccl.Communicator whose profile nobody chose) measures itself: one
    of two ranks or more (a world of one moves no bytes: each collective is a local copy,
    with nothing to measure and nothing for the cost model to predict) over a transport
    whose buffers the measurement can share its figures through (MPI; gloo, which carries
    host memory; not NCCL, whose GPU-only groups auto leaves to NCCL's own tuning)."""
    return comm.size > 1 and (comm.transport == "mpi" or comm.backend == "gloo")


def library_of(comm) -> dict:
    """The communication library a communicator's figures depend on: the MPI library's
    version (the key's field as it was before other transports measured), or torch's and
    its backend's."""
    if comm.transport == "mpi":
        from mpi4py import MPI

        return {"mpi": MPI.Get_library_version().splitlines()[0].strip()}
    return {"torch": torch.__version__, "backend": comm.backend}


def key_of(comm, device: str = "cpu") -> dict:
    """What the calibration of `comm`'s shape (a pccl.Communicator) on `device` buffers
    depends on (host buffers: no device field, as before GPUs were measured; GPU buffers:
    the GPU and how MPI moves its memory, Transport.gpu_type): the ranks' placement on
    nodes and network groups, and the plan levels' transports, which change what the plans
    cost (gloo levels ran hierarchical 5x slower than MPI's and read MPI's figures)."""
    t = comm.topology
    key = {"format": FORMAT, "pccl": metadata.version("pccl"), "node": node_type(), **library_of(comm),
           "transport": comm.transport, "executor": comm.executor, "ranks": t.size, "nodes": [list(n) for n in t.nodes],
           "nodes_per_group": t.nodes_per_group, "nics_per_node": t.nics_per_node,
           "interruptible": comm.interruptible, "levels": dict(comm.level_transports)}
    return key if device == "cpu" else {**key, "device": comm.carrier.gpu_type(device)}



def path_of(key: dict, env=os.environ) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir(env) / "calibration" / f"{digest}.json"


def entry_key(collective: str, klass: str) -> str:
    """The entry of a collective and class in a cache file ("all_gather" serves both)."""
    return collective if collective == "all_gather" else f"{collective}/{klass}"


def read(path: Path, key: dict) -> tuple[dict, Optional[str]]:
    """({entry: {candidate: [[bytes, seconds], ...]}}, why it was refused or None): a
    missing file is an empty cache; a file that is not a valid entry of `key` is refused."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return {}, f"unreadable ({type(e).__name__}: {e})"
    if not isinstance(data, dict) or data.get("key") != key:
        return {}, "made for another key (another version of pccl or of its format)"
    if not (isinstance(key.get("ranks"), int) and key["ranks"] > 1):
        return {}, "degenerate: a world of one rank has nothing to measure"
    measured = data.get("measured")
    if not isinstance(measured, dict) or not all(map(valid_entry, measured.values())):
        return {}, "malformed figures"
    return measured, None


def valid_entry(entry) -> bool:
    """What measure() and reach() write: {candidate: [[bytes, seconds], ...]}, every
    candidate at the same sizes, ascending (reach() may add larger ones to some), and every
    time a positive, finite number of seconds."""
    def valid_points(points) -> bool:
        if not isinstance(points, list) or not points:
            return False
        if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and p[0] > 0
                   and isinstance(p[1], (int, float)) and 0 < p[1] < math.inf for p in points):
            return False
        return [p[0] for p in points] == sorted({p[0] for p in points})
    if not (isinstance(entry, dict) and entry and all(
            isinstance(name, str) and valid_points(points) for name, points in entry.items())):
        return False
    swept = swept_sizes(entry)   # every candidate at the sweep's sizes, some also at sizes reach() added
    return all([p[0] for p in points[:len(swept)]] == swept for points in entry.values())


def write(path: Path, key: dict, measured: dict) -> None:
    """The cache file of `key`, atomically: a reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"key": key, "measured": measured}, indent=1) + "\n")


def sizes_of(collective: str, ranks: int, element_size: int, largest: int = MAX_BYTES) -> list[int]:
    """Buffer sizes from 4 B up, each rounded up to whole elements per rank: x4 below
    DOUBLING_BYTES (latency-bound sizes, each about as costly to measure as the next: on 8
    ranks of 2 cores half the budget went there) and doubling above, where choices flip."""
    unit = element_size * (1 if collective == "all_reduce" else ranks)
    out: list[int] = []
    nbytes = 4
    while nbytes <= largest:
        rounded = -(-nbytes // unit) * unit
        if rounded not in out and rounded <= largest:
            out.append(rounded)
        nbytes *= 4 if nbytes < DOUBLING_BYTES else 2
    return out


def summed_per_call(sizes: list[int], per_call: list[float], nbytes: int) -> float:
    """The candidates' summed time per call at `nbytes`, from `per_call` at the sizes
    measured: along the line through the last two (a latency and a bandwidth term), never
    below the last."""
    slope = max(0.0, (per_call[-1] - per_call[-2]) / (sizes[-1] - sizes[-2])) if len(sizes) > 1 else 0.0
    return per_call[-1] + slope * (nbytes - sizes[-1])


def loop_length(seconds_per_call: float) -> int:
    """Timed calls in a round's loop: LOOP_SECONDS of them, 1 to MAX_ITERS."""
    return max(1, min(MAX_ITERS, round(LOOP_SECONDS / seconds_per_call)))


def rounds_at(nbytes: int) -> int:
    """Timed rounds at `nbytes`: SHORT_ROUNDS where calls are short, ROUNDS above."""
    return SHORT_ROUNDS if nbytes < DOUBLING_BYTES else ROUNDS


def calls_per_candidate(nbytes: int, iters: int) -> int:
    """A candidate's calls at `nbytes` with loops of `iters`: its warm-up and, each round,
    its loop and (below SWITCH_BYTES) the untimed call before it."""
    return 1 + rounds_at(nbytes) * (iters + (nbytes < SWITCH_BYTES))


def measure(comm, collective: str, names: tuple, dtype: torch.dtype, seconds: float,
            largest: int = MAX_BYTES, device: str = "cpu") -> dict:
    """{candidate: [[bytes, seconds per call], ...]}: every candidate in `names` (auto's,
    for `device` buffers: "cpu", or "cuda", the current GPU's) timed through `comm` from 4 B
    up until `seconds` are spent (the slowest rank's clock, so that every rank stops at the
    same size). Collective over `comm`."""
    element = dtype.itemsize
    out: dict = {name: [] for name in names}
    spent = 0.0
    sizes: list[int] = []
    per_call: list[float] = []   # the candidates' summed median time per call, at each of sizes
    for nbytes in sizes_of(collective, comm.size, element, largest):
        iters = MAX_ITERS
        if sizes:
            # from the medians, not the clock (see above)
            summed = summed_per_call(sizes, per_call, nbytes)
            iters = loop_length(summed / len(names))
            if spent + MARGIN * summed * calls_per_candidate(nbytes, iters) > seconds:
                break
        medians, charged = time_size(comm, collective, names, nbytes, dtype, iters, device)
        for name, median in zip(names, medians):
            out[name].append([nbytes, median])
        sizes.append(nbytes)
        per_call.append(sum(medians))
        spent += charged
    return out


def time_size(comm, collective: str, names: list[str], nbytes: int, dtype: torch.dtype, iters: int,
              device: str) -> tuple[list[float], float]:
    """(each candidate's median seconds per call at `nbytes`, the seconds charged to the
    budget): a warm-up call of each, then rounds_at(nbytes) rounds of `iters`-call loops,
    the times the slowest rank's. Collective over `comm`."""
    finish = torch.cuda.synchronize if device == "cuda" else lambda: None   # a loop times the work
    together = torch.zeros(1, dtype=torch.int32)
    start = time.perf_counter()
    call = calls(comm, collective, nbytes // dtype.itemsize, dtype, device)
    for name in names:
        call(name)
    finish()
    warmed = time.perf_counter()
    rounds = torch.zeros(rounds_at(nbytes), len(names) + 2, dtype=torch.float64)
    for r in range(len(rounds)):
        for i in [(j + r) % len(names) for j in range(len(names))]:
            if nbytes < SWITCH_BYTES:
                call(names[i])   # the switch from another candidate is not its cost: a loop repeats one
            # a barrier: every rank starts the loop at once, so that a short loop times the
            # call, not the ranks' skew (recursive doubling: they leave it about together)
            comm.all_reduce(together, algorithm="recursive_doubling", compression="none")
            began = time.perf_counter()
            for _ in range(iters):
                call(names[i])
            finish()
            rounds[r, i] = (time.perf_counter() - began) / iters
    rounds[:, -2:] = torch.tensor([warmed - start, time.perf_counter() - warmed], dtype=torch.float64)
    comm.all_reduce(rounds, op="max", algorithm="ring", compression="none")   # every rank the same figures, exactly
    medians = [statistics.median(rounds[:, i].tolist()) for i in range(len(names))]
    warm_up, timed = rounds[0, -2:].tolist()
    # a first use's setup (MPICH's first large calls stalled 0.1-0.3 s on 2 cores), which a
    # run pays at its first such call anyway, is not charged: the warm-up costs its calls
    return medians, timed + min(warm_up, MARGIN * sum(medians))


def reach_size(collective: str, ranks: int, element_size: int, nbytes: int) -> int:
    """The size measured for a call of `nbytes` beyond the sweep: the next power of two, in
    whole elements per rank, so that calls of nearby sizes share one measurement."""
    unit = element_size * (1 if collective == "all_reduce" else ranks)
    power = 1 << max(0, (nbytes - 1).bit_length())
    return -(-power // unit) * unit


def reach(comm, collective: str, dtype: torch.dtype, entry: dict, nbytes: int, seconds: float,
          device: str = "cpu", choose=None) -> Optional[dict]:
    """`entry` ({candidate: points}, as measure() returns it) measured at one more size, the
    one reach_size gives for a call of `nbytes` above every size it holds, up to REACH_MAX;
    None where nothing was measured. Where every candidate's projected time (along the line
    through the last two sizes, as measure() projects) fits `seconds`, every candidate is
    timed there. Otherwise, with `choose` (entry -> the candidates in the order auto would
    run them at that size with those figures: its pick, then the others by predicted time),
    the first not yet timed there is timed, and the candidates ranked again, until every one
    is timed or the next does not fit what is left of `seconds`: a candidate is never chosen
    there on a ratio held from below, which could hide a growth the model lacks, without its
    own figure, and the time left goes to the pick's likeliest rivals (one never timed
    there, held from below, could hide a slower growth as well). Each is timed in ROUNDS
    one-call loops (at such sizes a call lasts milliseconds). Collective over `comm` (every
    rank holds the same entry and asks for the same size)."""
    names = list(entry)
    element = dtype.itemsize
    target = reach_size(collective, comm.size, element, nbytes)
    sizes = swept_sizes(entry)
    if target <= largest(entry) or target > REACH_MAX:
        return None

    def projected(chosen: list[str]) -> float:
        per_call = [sum(entry[name][i][1] for name in chosen) for i in range(len(sizes))]
        return MARGIN * summed_per_call(sizes, per_call, target) * calls_per_candidate(target, 1)

    if projected(names) <= seconds:
        medians, _ = time_size(comm, collective, names, target, dtype, 1, device)
        return {name: [*entry[name], [target, median]] for name, median in zip(names, medians)}
    grown, left = dict(entry), seconds
    while choose is not None:
        ranking = choose(grown)
        if ranking[0] not in grown:   # one the environment forces: nothing to decide
            break
        untimed = [name for name in ranking if name in grown and grown[name][-1][0] != target]
        if not untimed or projected(untimed[:1]) > left:
            break
        name = untimed[0]
        (median,), charged = time_size(comm, collective, [name], target, dtype, 1, device)
        grown[name] = [*grown[name], [target, median]]
        left -= charged
    return grown if grown != entry else None


def largest(entry: dict) -> int:
    """The largest size any candidate of `entry` was measured at."""
    return max(n for points in entry.values() for n, _ in points)


def swept_sizes(entry: dict) -> list[int]:
    """The sizes every candidate of `entry` was measured at (the sweep's; reach may have
    timed some candidates at larger ones)."""
    return [n for n, _ in min(entry.values(), key=len)]


def calls(comm, collective: str, count: int, dtype: torch.dtype, device: str = "cpu"):
    """call(name): `collective` of `count` elements in all of `device` buffers, with
    algorithm `name`."""
    # exact whatever the communicator's default codec (PCCL_COMPRESSION): the candidates
    # include the transport's own collectives, which cannot encode
    if collective == "all_reduce":
        tensor = torch.ones(count, dtype=dtype, device=device)
        return lambda name: comm.all_reduce(tensor, algorithm=name, compression="none")
    full = torch.ones(count, dtype=dtype, device=device)
    block = torch.ones(count // comm.size, dtype=dtype, device=device)
    if collective == "all_gather":
        return lambda name: comm.all_gather(full, block, algorithm=name, compression="none")
    return lambda name: comm.reduce_scatter(block, full, algorithm=name, compression="none")


class SelfCalibration:
    """The calibration of one communicator's shape on one device type's buffers ("cpu",
    "cuda"): read from the cache at first need, measured where missing, and published to
    the communicator's selector (pccl/runtime/selector.py) as the profile for those
    buffers. `comm`, the bench: the communicator, which times the candidates, drains what
    it queued before, and agrees rank 0's cache entry and the figures."""

    def __init__(self, comm, selector, device: str = "cpu"):
        self.comm = comm
        self.selector = selector
        self.device = device
        self.on = enabled()
        self.budget = budget()
        self.base = selector.given_profile    # what the measured ratios are taken against
        self.measured: Optional[dict] = None   # {entry: {candidate: points}}, once read
        self.seconds: dict[str, float] = {}    # entry -> seconds this process spent measuring it
        self.settled: dict[str, int] = {}      # entry -> the largest call size reach() was asked about

    @cached_property
    def key(self) -> dict:   # at first need: a communicator that never measures pays nothing
        return key_of(self.comm, self.device)

    @cached_property
    def path(self) -> Path:
        return path_of(self.key)

    def ensure(self, collective: str, dtype: torch.dtype, nbytes: int = 0) -> None:
        """Make sure auto's choices for `collective` of `dtype` rest on a measurement: the
        cache's, or one made now, reaching a call of `nbytes` (the full buffer) beyond the
        sweep where that fits (reach). Collective: every rank reaches it at the same call."""
        if not self.on:
            return
        klass = "full" if collective == "all_gather" else reduction_class(dtype)
        entry = entry_key(collective, klass)
        if self.measured is not None and entry in self.measured and not self._beyond(entry, nbytes):
            return
        self.comm.drain()   # what is measured must not queue behind the caller's calls
        if self.measured is None:
            self.measured = self._agreed_cache()
            self._apply()
            _account(self.path, 0.0)
        else:
            self._catch_up(entry)
        if not self._current(entry, collective):
            start = time.perf_counter()
            names = self.selector.tuner_for(self.device).candidates(collective)
            self.measured[entry] = measure(self.comm, collective, names, DTYPE_OF[klass], self.budget,
                                           device=self.device)
            self._keep(entry, time.perf_counter() - start)
        if self._beyond(entry, nbytes):
            self._reach(entry, collective, DTYPE_OF[klass], nbytes)

    def _catch_up(self, entry: str) -> None:
        """Take `entry` from rank 0's cache file where the file holds it and this
        communicator does not, or holds it to a larger size: communicators of one shape
        share a file (the engine's lanes and shard-train's own), and another may have
        measured it since this one read the file: measuring it again would spend the
        budget twice and end with the file's figures anyway (_store). Collective over
        `comm`."""
        stored = None
        if self.comm.rank == 0:
            on_disk, refused = read(self.path, self.key)
            stored = on_disk.get(entry) if refused is None else None
        stored = self.comm.broadcast_object(stored)
        if stored is not None and (entry not in self.measured or largest(stored) > largest(self.measured[entry])):
            self.measured[entry] = stored
            self._apply()

    def _beyond(self, entry: str, nbytes: int) -> bool:
        """Whether a call of `nbytes` is larger than every size `entry` holds and every call
        reach() was asked about."""
        return nbytes > max(largest(self.measured[entry]), self.settled.get(entry, 0))

    def _reach(self, entry: str, collective: str, dtype: torch.dtype, nbytes: int) -> None:
        """Measure `entry` at a call's size beyond its largest, where reach() takes it."""
        self.settled[entry] = nbytes
        start = time.perf_counter()
        grown = reach(self.comm, collective, dtype, self.measured[entry], nbytes, REACH * self.budget, self.device,
                      choose=lambda figures: self._ranking(entry, figures, collective, dtype, nbytes))
        if grown is not None:
            self.measured[entry] = grown
            self._keep(entry, time.perf_counter() - start)

    def _ranking(self, entry: str, figures: dict, collective: str, dtype: torch.dtype, nbytes: int) -> list[str]:
        """The candidates in the order auto would run them for `nbytes` with `figures` as
        `entry`'s: its pick, then the others by predicted time (and decides with them from
        then on, as it will once they are kept)."""
        self.measured[entry] = figures
        self._apply()
        tuner = self.selector.tuner_for(self.device)
        size = reach_size(collective, self.comm.size, dtype.itemsize, nbytes)
        pick, times = tuner.name(collective, size, dtype), tuner.predictions(collective, size, dtype)
        return [pick, *sorted((name for name in times if name != pick), key=times.get)]

    def _keep(self, entry: str, seconds: float) -> None:
        """After measuring `entry` for `seconds`: account, store (rank 0), and decide with
        what the file holds then, on every rank (_store: it may be another communicator's)."""
        self.seconds[entry] = self.seconds.get(entry, 0.0) + seconds
        _account(self.path, seconds)
        kept = self._store(entry) if self.comm.rank == 0 else None
        self.measured[entry] = self.comm.broadcast_object(kept)
        self._apply()

    def _current(self, entry: str, collective: str) -> bool:
        """Whether the cache's figures for `entry` cover every candidate auto has now."""
        return entry in self.measured and self._covers(self.measured[entry], collective)

    def _covers(self, figures: dict, collective: str) -> bool:
        """Whether `figures` hold every candidate auto has now for `collective`."""
        return set(self.selector.tuner_for(self.device).candidates(collective)) <= set(figures)

    def _agreed_cache(self) -> dict:
        """Rank 0's cache entry, on every rank."""
        measured = None
        if self.comm.rank == 0:
            measured, refused = read(self.path, self.key)
            if refused is not None:
                warnings.warn(f"pccl: the calibration cache {self.path} is {refused}; measuring again",
                              RuntimeWarning, stacklevel=4)
        return self.comm.broadcast_object(measured)

    def _store(self, entry: str) -> dict:
        """Rank 0: merge `entry` into the file (another run may have added others), and
        return the figures to decide with. Where another communicator of this shape stored
        it first (the groups of a nested strategy measure at once, each with its own rank
        0), and these figures are not theirs with sizes added above (a reach), theirs stay
        and are returned: every communicator of a shape then decides with one set of
        figures, the file's, as the next run (a resumed one) will."""
        mine = self.measured[entry]
        try:
            with _FILES, _locked(self.path):
                on_disk, refused = read(self.path, self.key)
                held = on_disk.get(entry) if refused is None else None
                if held is not None and self._covers(held, entry_parts(entry)[0]) and not extends(mine, held):
                    return held
                write(self.path, self.key, {**(on_disk if refused is None else {}), entry: mine})
        except OSError as e:
            warnings.warn(f"pccl: cannot write the calibration cache {self.path} ({e}); this run keeps its "
                          "measurement, the next measures again", RuntimeWarning, stacklevel=4)
        return mine

    def _apply(self) -> None:
        """The communicator decides with the base profile calibrated by every figure held."""
        figures = {(collective, klass, name): [tuple(p) for p in points]
                   for entry, by_name in self.measured.items()
                   for collective, klass in [entry_parts(entry)]
                   for name, points in by_name.items()}
        if figures:
            self.selector.use_profile(calibrated(self.base, self.selector.topology, figures,
                                                 f"self-calibration, {self.path}"), self.device)


@contextmanager
def _locked(path: Path):
    """`path`'s lock, across processes (the ranks 0 of one shape's communicators may
    store at once), held while the block runs; none where the file system has no locks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield   # closing the file releases the lock


def extends(entry: dict, base: dict) -> bool:
    """Whether `entry` is `base` with points added above its largest size (what reach()
    makes of it)."""
    top = largest(base)
    return set(entry) == set(base) and all(
        entry[name][:len(points)] == points and all(n > top for n, _ in entry[name][len(points):])
        for name, points in base.items())


def _account(path: Path, seconds: float) -> None:
    with _FILES:
        _LEDGER[path] = _LEDGER.get(path, 0.0) + seconds


def ledger() -> dict[Path, float]:
    """{cache file: seconds}: the calibration of every communicator shape this process's
    auto decided with, and the seconds it spent measuring into it (0: read from the cache)."""
    with _FILES:
        return dict(_LEDGER)


def basis(comm, device: str = "cpu") -> str:
    """What auto's choices for `device` buffers of `comm` (a pccl.Communicator) rest on,
    in words: its self-calibration's figures (measured in this run, with the seconds each
    took, or read from the cache), a chosen profile, or neither and why."""
    selector = comm.selector
    own = selector.calibration_for(device) if selector.self_calibration is not None else None
    if own is None:
        if not selector.trust_native:
            return f"profile {selector.profile.name!r}"
        why = "one rank, nothing to measure" if comm.size == 1 else "no self-calibration on this transport"
        return f"unmeasured ({why}): the transport's own collective"
    if not own.on:
        return "no self-calibration (PCCL_SELF_CALIBRATION=0): the transport's own collective"
    if own.measured is None:
        return f"no auto call on {device} buffers ran, so none was measured or read"
    spent = ", ".join(f"{entry} {seconds:.2f} s" for entry, seconds in own.seconds.items())
    held = ", ".join(own.measured) or "none"
    return (f"self-calibration {own.path}; figures for {held}; measured in this run: "
            f"{spent or 'none (read from the cache)'}"
            + (f", {sum(own.seconds.values()):.2f} s in all" if own.seconds else ""))


def entry_parts(entry: str) -> tuple[str, str]:
    collective, _, klass = entry.partition("/")
    return collective, klass or "full"
