"""Sharded checkpoints that survive crashes and change of world size or strategy.

A checkpoint directory holds snapshots and a LATEST file naming the newest complete one:

    path/LATEST                      "snap-00000042-5f3a9c1e"
    path/snap-00000042-5f3a9c1e/     meta.json, shard-<rank>.pt and shard-<rank>.json
                                     (one pair per written shard: the file, its size and
                                     SHA-256)

Saving writes a new snapshot (each file under a temporary name, flushed to disk, then
renamed), learns whether every rank succeeded, and only then writes the manifest
(meta.json: every file's size and checksum, the world size, group, strategy, counters, the
parameters' layout and the caller's extra state, such as the data position and model
config), replaces LATEST (an atomic rename) and removes snapshots beyond the newest
`keep` (one that a reader is opening stays until a later save: pinned()). A crash, or a
failed write on any rank (a full disk), at any point leaves LATEST naming a complete
snapshot; a failed save removes its partial snapshot and raises on every rank, naming the
intact one.

Loading verifies the snapshot first (every rank reads its share of the files against the
manifest; a missing, truncated or corrupted file is named with what is wrong) and raises
CheckpointError on every rank. With fallback, it takes the newest intact snapshot instead
and says which it skipped and why.

    checkpoint.save(engine, optimizer, path, extra={"step": step}, keep=2)
    extra = checkpoint.load(engine, optimizer, path).extra

What is saved is each rank's Engine.state_dict() with its optimizer's
(ShardedAdamW.state_dict()): the fp32 master weights and both moments, the only state a
rank cannot rebuild, as ranges of each unit's flat buffer, and the step counters and loss
scale. The metadata records which parameter sits where in every unit, so a loader with
another world size, group size, strategy or unit split finds each of its elements by
parameter name and offset, and hands the pieces its own state_dict()s describe to their
load_state_dict(). Ranks that hold a replica of another rank's shard (I and N scopes)
write nothing.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import shutil
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from runkit.files import fsync_dir, write_atomic

FORMAT = 2   # 2: meta.json's "files" maps each file to its size and SHA-256
READABLE = (1, 2)   # 1: "files" lists the names only (nothing to verify them against)
STATE = ("master", "exp_avg", "exp_avg_sq")   # the tensors of a unit's piece, in state_dict() and shard files
COUNTERS = ("optimizer_steps", "steps", "skipped_steps", "loss_scale", "loss_scale_clean")
LATEST_READS = 3   # snapshot(): reads of LATEST while a running job replaces the snapshot it named


class CheckpointError(ValueError):
    """A missing or damaged checkpoint, or one written for another model."""


class CheckpointSaveError(OSError):
    """A save that failed on some rank (a full disk, say); the previous snapshot is intact."""


class Restored(NamedTuple):
    extra: Optional[dict]    # what the snapshot was saved with
    snapshot: Path
    skipped: list[str]       # newer snapshots passed over (fallback), each with what is wrong


def _shapes(state: dict) -> dict[str, list[int]]:
    """Every parameter's shape, by its name in the model, from a state_dict()."""
    return {name: shape for u in state["units"] for name, shape in zip(u["params"], u["shapes"])}


def _metadata(state: dict) -> dict:
    return {
        "format": FORMAT,
        **{k: state[k] for k in ("world", "group", "strategy", *COUNTERS)},
        "params": _shapes(state),
        "units": [{k: u[k] for k in ("name", "params", "offsets", "padded")} for u in state["units"]],
    }


def _digest(path: Path) -> dict:
    sha = hashlib.sha256()   # read in blocks (hashlib.file_digest is Python 3.11+)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return {"bytes": path.stat().st_size, "sha256": sha.hexdigest()}


def snapshots(path) -> list[Path]:
    """The snapshot directories under `path`, newest (highest step) first."""
    return sorted(Path(path).glob("snap-*"), reverse=True)


def committed(snap: Path) -> bool:
    """Whether a snapshot's save got as far as its manifest: one cut short before it (a
    crash in the first save) holds nothing to resume from."""
    return (Path(snap) / "meta.json").is_file()


def _state(engine, optimizer) -> dict:
    """engine.state_dict(), the optimizer's counters and each piece's moments merged in."""
    state, theirs = engine.state_dict(), optimizer.state_dict()
    return {**state, **{k: theirs[k] for k in COUNTERS},
            "units": [{**u, **o} for u, o in zip(state["units"], theirs["units"])]}


def save(engine, optimizer, path, extra: Optional[dict] = None, keep: int = 1,
         written: Optional[Callable[[], None]] = None) -> None:
    """Write a sharded snapshot of `engine` and its `optimizer` under the directory `path`,
    with a manifest of every file's size and checksum, keeping the newest `keep`
    snapshots: a crash or a failed write mid-save leaves the previous snapshot there
    loadable (a failure raises CheckpointSaveError on every rank). `extra`: rank 0's
    JSON-serializable state of the caller (a training loop's step, data position), kept
    with the snapshot. `written`: called on each rank once its files are written, before
    the ranks agree (where fault injection kills a rank mid-save). Collective.
    (background.BackgroundSaver writes the same snapshots while training goes on.)"""
    check_keep(keep)
    root = Path(path)
    snap, state = begin(engine, optimizer, root)
    shards = {name: {k: v.cpu().clone() if k in STATE else v for k, v in piece.items()}
              for name, piece in pieces(state).items()}
    problem = None
    try:
        write_shards(snap, engine.layout.rank, shards)
    except OSError as e:
        problem = e
    if written is not None:
        written()
    _agree_written(engine, root, snap, problem, "its shard files")
    problem = None
    if engine.layout.rank == 0:
        try:
            commit(root, snap, manifest(state, extra), keep)
        except OSError as e:
            problem = e
    _agree_written(engine, root, snap, problem, "the manifest")
    engine.barrier()


def check_keep(keep) -> None:
    if not (isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1):
        raise ValueError(f"keep must be an integer >= 1 (snapshots kept), got {keep!r}")


def begin(engine, optimizer, root: Path) -> tuple[Path, dict]:
    """The new snapshot's directory (named alike on every rank: collective) and the state
    it is to hold (its tensors the live ones: copy them before training goes on)."""
    token = engine.agree(int(uuid.uuid4().int % (1 << 62)))
    state = _state(engine, optimizer)
    # named by the training steps taken, skipped ones too: by updates alone, a step skipped
    # between two saves gave both one number, and stale() removed the earlier
    return root / f"snap-{state['steps'] + state['skipped_steps']:08d}-{token:016x}", state


def pieces(state: dict) -> dict[str, dict]:
    """{unit: {start, end, master, exp_avg, exp_avg_sq}}: what this rank writes, the units
    whose shard it holds as the first replica."""
    return {u["name"]: {"start": u["start"], "end": u["end"], **{k: u[k] for k in STATE}}
            for u in state["units"] if u["first_replica"]}


def write_shards(snap: Path, rank: int, shards: dict) -> None:
    """This rank's shard file and its size and checksum beside it, each written atomically
    (none where it holds no first replica). Raises an OSError for any failure to write
    them (a serializer's error too): the ranks agree on OSErrors, and one rank's other
    exception would leave the others waiting for its word."""
    try:
        snap.mkdir(parents=True, exist_ok=True)
        if shards:
            write_atomic(snap / f"shard-{rank}.pt", lambda f: _save_tensors(shards, f))
            write_atomic(snap / f"shard-{rank}.json", json.dumps(_digest(snap / f"shard-{rank}.pt")).encode())
    except OSError:
        raise
    except Exception as e:
        raise OSError(errno.EIO, f"writing {snap.name}'s shard-{rank} failed: {type(e).__name__}: {e}") from e


def manifest(state: dict, extra: Optional[dict]) -> dict:
    """meta.json's content less the files' checksums, which commit() reads from the files."""
    return {**_metadata(state), "extra": extra}


def commit(root: Path, snap: Path, meta: dict, keep: int) -> None:
    """Rank 0, once every rank's files are written: the manifest (with every shard file's
    size and checksum), then LATEST naming the snapshot (the moment it becomes the one to
    resume from), then the snapshots beyond the newest `keep` removed. Raises OSError."""
    meta = {**meta, "files": {p.name: json.loads(p.with_suffix(".json").read_text())
                              for p in sorted(snap.glob("shard-*.pt"))}}
    write_atomic(snap / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
    fsync_dir(snap)
    write_atomic(root / "LATEST", lambda f: f.write(snap.name.encode()))
    fsync_dir(root)
    abandoned, surplus = stale(root, snap, keep)
    for old in abandoned:   # removed even while read: a fallback resume takes the newest step
        shutil.rmtree(old, ignore_errors=True)
    for old in surplus:
        remove_unread(old)


# Readers and retention. A reader (an export, a generation, another job's load) pins a
# snapshot while it verifies and opens its files: a shared flock on its manifest. Retention
# removes a surplus snapshot only under an exclusive one, taken without waiting, and leaves
# a pinned one to a later save (stale() lists it again). Once open, the files outlive their
# removal (torch.load maps them), so the pin ends there. An abandoned snapshot goes at once,
# read or not: kept, it would be the newest a fallback resume finds. Where the filesystem
# has no flock (some Lustre mounts), neither side locks, as before: a reader can still find
# the snapshot gone, and says so (problems()).

@contextmanager
def pinned(snap: Path):
    """Hold `snap` against retention inside the block (nothing where it has no manifest:
    there is nothing to read, and problems() says why)."""
    try:
        manifest_file = open(snap / "meta.json", "rb")
    except OSError:
        yield
        return
    with manifest_file:
        try:
            fcntl.flock(manifest_file, fcntl.LOCK_SH)   # waits only for a removal under way
        except OSError:
            pass
        yield


def remove_unread(snap: Path) -> bool:
    """Remove `snap` unless a reader has it pinned; whether it was removed."""
    try:   # opened for writing: NFS emulates flock with fcntl locks, whose exclusive lock needs it
        manifest_file = open(snap / "meta.json", "r+b")
    except OSError:
        try:
            manifest_file = open(snap / "meta.json", "rb")
        except OSError:   # no manifest: a save cut short, which nobody reads
            shutil.rmtree(snap, ignore_errors=True)
            return True
    with manifest_file:
        try:
            fcntl.flock(manifest_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):   # a reader holds it
                return False
            # no flock on this filesystem (ENOLCK, EOPNOTSUPP): removed, as before
        shutil.rmtree(snap, ignore_errors=True)
        return True


def _save_tensors(obj, f) -> None:
    """torch.save, raising the OSError of a failed write (a full disk) itself: torch's zip
    writer masks it with a RuntimeError ("unexpected pos") as it closes."""
    try:
        torch.save(obj, f)
    except RuntimeError as e:
        cause = e.__context__
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            raise
        raise cause from e


def _step(snap: Path) -> int:
    return int(snap.name.split("-")[1])


def stale(root: Path, snap: Path, keep: int) -> tuple[list[Path], list[Path]]:
    """The snapshots to remove once `snap` is written: (abandoned) any of a step at or after
    its own that is not it (a run that resumed from an earlier snapshot abandoned them), and
    (surplus) all but the newest `keep` (counting `snap`) before it."""
    others = [s for s in snapshots(root) if s != snap]
    later = [s for s in others if _step(s) >= _step(snap)]
    earlier = [s for s in others if _step(s) < _step(snap)]
    return later, earlier[keep - 1:]


def _agree_written(engine, root: Path, snap: Path, problem: Optional[OSError], what: str) -> None:
    """Raise on every rank if writing failed on any (collective): the partial snapshot is
    removed and LATEST still names the previous one."""
    failed = engine.total(int(problem is not None))
    if not failed:
        return
    engine.barrier()
    raise failure(root, snap, failed, problem, what, remove=engine.layout.rank == 0)


def failure(root: Path, snap: Path, failed: int, problem: Optional[OSError], what: str,
            remove: bool) -> CheckpointSaveError:
    """The error of a save that failed writing `what` on `failed` ranks (`problem`: this
    rank's own error, if any); `remove`: the partial snapshot is removed (by one rank)."""
    previous = (root / "LATEST").read_text().strip() if (root / "LATEST").is_file() else None
    if remove and previous != snap.name:
        shutil.rmtree(snap, ignore_errors=True)
    why = ""
    if problem is not None:
        why = f"{' (no space left on the device)' if problem.errno == errno.ENOSPC else ''}: {problem}"
    intact = f"the previous snapshot {previous} is intact" if previous else "no earlier snapshot exists"
    return CheckpointSaveError(problem.errno if problem else errno.EIO, f"saving checkpoint {snap.name} failed "
                               f"writing {what} on {failed} rank(s){why}; {intact}")


def problems(snap: Path, part: tuple[int, int] = (0, 1)) -> Optional[str]:
    """What is wrong with snapshot `snap` (a missing or unreadable manifest, a file missing,
    truncated or corrupted against it), or None when it is intact. Reads every file, or
    with part=(index, count) the manifest and every count-th file from the index-th (the
    share of one of `count` ranks checking together)."""
    try:
        meta = json.loads((snap / "meta.json").read_text())
    except FileNotFoundError:
        if not snap.is_dir():   # read while a running job saves: its retention removed it
            return (f"{snap} no longer exists (a newer save of the run removed it, as train.keep_checkpoints "
                    "asks): try again, or name a snapshot the run keeps")
        return f"{snap / 'meta.json'} is missing (the snapshot is incomplete)"
    except (OSError, json.JSONDecodeError) as e:
        return f"{snap / 'meta.json'} cannot be read: {e}"
    if not isinstance(meta, dict):
        return f"{snap / 'meta.json'} is not a manifest (a JSON {type(meta).__name__}, not an object)"
    if meta.get("format") not in READABLE:
        return f"{snap / 'meta.json'}: checkpoint format {meta.get('format')!r}, expected one of {READABLE}"
    files = meta.get("files")
    if isinstance(files, list):
        files = dict.fromkeys(files)
    lacking = [k for k in ("params", "units", *COUNTERS) if k not in meta]
    if not isinstance(files, dict) or lacking or not all(
            v is None or (isinstance(v, dict) and {"bytes", "sha256"} <= set(v)) for v in files.values()):
        return f"{snap / 'meta.json'} is malformed: " + (f"no {', '.join(lacking)}" if lacking else
                                                        "its file list is not one")
    index, count = part
    for name, expected in sorted(files.items())[index::count]:
        path = snap / name
        if not path.is_file():
            return f"{path} is missing"
        if expected is None:
            continue
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"{path} has {size} bytes, the manifest says {expected['bytes']} (truncated or overwritten)"
        if _digest(path)["sha256"] != expected["sha256"]:
            return f"{path} is corrupted: its SHA-256 differs from the manifest's"
    return None


def latest(path) -> Path:
    """The snapshot `path`'s LATEST names."""
    root = Path(path)
    pointer = root / "LATEST"
    if not pointer.is_file():
        raise CheckpointError(f"no checkpoint at {root}: {pointer} is missing")
    return root / pointer.read_text().strip()


def choose(engine, path, fallback: bool, pin: Optional[ExitStack] = None) -> tuple[Path, list[str]]:
    """The snapshot to load: the one LATEST names, or with `fallback` the newest intact one;
    and the snapshots skipped, with why. Every rank checks its share of each candidate's
    files (hashing runs on all ranks at once) and the ranks agree on the outcome
    (collective); the one chosen stays pinned (against retention) until `pin` closes
    (without one, until it is chosen). Raises CheckpointError on every rank when there is
    none to load."""
    root, skipped = Path(path), []
    rank, world = engine.layout.rank, engine.layout.world
    candidates = snapshots(root) if fallback else [latest(root)] if (root / "LATEST").is_file() else []
    for i in range(engine.agree(len(candidates))):   # rank 0's list decides
        snap = candidates[i] if i < len(candidates) else None
        held = ExitStack()
        if snap is not None:
            held.enter_context(pinned(snap))
        mine = problems(snap, (rank, world)) if snap is not None else "this rank does not see it"
        if not engine.total(int(mine is not None)):
            if pin is None:
                held.close()
            else:
                pin.enter_context(held)
            return snap, skipped
        held.close()
        if rank == 0:   # the failure path: rank 0 words it, from its own view when it found nothing
            skipped.append(f"{snap.name}: {mine or problems(snap) or 'damaged, as another rank found'}")
    if rank != 0:
        raise CheckpointError(f"no checkpoint to load at {root}: rank 0 found none intact (see its error)")
    if skipped:
        raise CheckpointError(f"no intact checkpoint under {root}{' to fall back to' if fallback else ''}: "
                              + "; ".join(skipped))
    raise CheckpointError(f"no checkpoint at {root}: " +
                          ("it holds no snapshot" if fallback else f"{root / 'LATEST'} is missing"))


def _check_model(state: dict, meta: dict) -> None:
    if meta.get("format") not in READABLE:
        raise CheckpointError(f"checkpoint format {meta.get('format')!r} is not one of {READABLE}")
    mine = _shapes(state)
    theirs = meta["params"]
    if mine != theirs:
        missing = sorted(set(mine) - set(theirs))
        extra = sorted(set(theirs) - set(mine))
        shapes = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
        raise CheckpointError(
            "the checkpoint was written for another model: "
            f"parameters missing from it {missing[:5]}, not in this model {extra[:5]}, "
            f"with other shapes {[(n, theirs[n], mine[n]) for n in shapes[:5]]}")


class _Source:
    """Where each parameter's elements lie in the checkpoint's shard files."""

    def __init__(self, snap: Path, meta: dict):
        self.snap = snap
        self.where = {}
        for unit in meta["units"]:
            for name, start in zip(unit["params"], unit["offsets"]):
                self.where[name] = (unit["name"], start)
        self.pieces: dict[str, list] = {}  # unit -> [(start, end, file)]
        self._files: dict[str, dict] = {}
        for name in meta["files"]:
            for unit, shard in self._load(name).items():
                self.pieces.setdefault(unit, []).append((shard["start"], shard["end"], name))

    def _load(self, name: str) -> dict:
        if name not in self._files:
            self._files[name] = torch.load(self.snap / name, map_location="cpu", mmap=True, weights_only=True)
        return self._files[name]

    def read(self, param: str, lo: int, hi: int, out: dict[str, torch.Tensor]) -> None:
        """Elements [lo, hi) of `param` (flattened) into `out` (a tensor per STATE key it holds)."""
        unit, base = self.where[param]
        a, b = base + lo, base + hi
        covered = 0
        for start, end, name in self.pieces.get(unit, []):
            s, e = max(a, start), min(b, end)
            if s < e:
                shard = self._load(name)[unit]
                for k in out:
                    out[k][s - a:e - a].copy_(shard[k][s - start:e - start])
                covered += e - s
        if covered != b - a:
            raise CheckpointError(f"checkpoint {self.snap} lacks part of {param} (elements {lo}..{hi}): "
                                  "a shard file is missing")


def snapshot(path) -> Path:
    """The snapshot `path` names: a snapshot directory, a checkpoint directory (its LATEST),
    or a shard-train run directory (its checkpoints/ directory's LATEST)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    if path.name.startswith("snap-") and not (path / "checkpoints").is_dir() and not (path / "LATEST").is_file():
        raise CheckpointError(problems(path))   # a snapshot without its manifest (a save cut short, or removed)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    for _ in range(LATEST_READS):   # a running job may replace the one LATEST named as it is read
        named = latest(path)
        if named.is_dir():
            break
    return named


def parameters(snap: Path):
    """(name, values) of every parameter of the model a verified snapshot holds, each in
    full, fp32, on the CPU, one at a time, from its files alone (any world size or
    strategy wrote it): what an export streams. Raises CheckpointError if it is damaged,
    at once (not at the first value)."""
    names, read = parameter_reader(snap)
    return ((name, read(name)) for name in names)


def parameter_reader(snap: Path):
    """(the parameters' names in the model's order, read): read(name) is that parameter of
    a verified snapshot in full, fp32, on the CPU, from its files alone, in any order: a
    model filled one parameter at a time holds one parameter more than itself. Raises
    CheckpointError if the snapshot is damaged."""
    with pinned(snap):
        problem = problems(snap)
        if problem:
            raise CheckpointError(problem)
        meta = json.loads((snap / "meta.json").read_text())
        source, shapes = _Source(snap, meta), meta["params"]

    def read(name: str) -> torch.Tensor:
        values = torch.empty(shapes[name], dtype=torch.float32)
        source.read(name, 0, values.numel(), {"master": values.view(-1)})
        return values
    return list(shapes), read


def load(engine, optimizer, path, fallback: bool = False) -> Restored:
    """Restore the latest snapshot under `path` into `engine` and its `optimizer`, written at
    any world size, group size or strategy for a model with the same parameters. Verified
    first: a damaged snapshot raises CheckpointError naming the file (with `fallback`, the
    newest intact one is loaded instead, and Restored.skipped says which were passed over;
    see choose()). Collective."""
    with ExitStack() as pin:
        snap, skipped = choose(engine, path, fallback, pin)
        meta = json.loads((snap / "meta.json").read_text())
        mine = _state(engine, optimizer)   # which pieces this rank holds
        _check_model(mine, meta)
        source = _Source(snap, meta)
    units = []
    for u in mine["units"]:
        lo, hi = u["start"], u["end"]
        piece = {k: torch.zeros_like(u[k], device="cpu") for k in STATE}   # padding stays zero
        for name, start, end in zip(u["params"], u["offsets"], u["offsets"][1:]):
            a, b = max(start, lo), min(end, hi)
            if a < b:
                source.read(name, a - start, b - start, {k: t[a - lo:b - lo] for k, t in piece.items()})
        units.append({**u, **piece})
    state = {**mine, **{k: meta[k] for k in COUNTERS}, "units": units}
    optimizer.load_state_dict(state)
    engine.load_state_dict(state)
    return Restored(meta.get("extra"), snap, skipped)
