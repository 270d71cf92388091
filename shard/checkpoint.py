"""Sharded checkpoints that survive crashes and change of world size or strategy.

A checkpoint directory holds snapshots and a LATEST file naming the complete one:

    path/LATEST                      "snap-00000042-5f3a9c1e"
    path/snap-00000042-5f3a9c1e/     meta.json, shard-<rank>.pt (one per written shard)

Saving writes a new snapshot (each file under a temporary name, flushed to disk, then
renamed), waits for every rank, and only then replaces LATEST (an atomic rename) and
removes older snapshots. A crash at any point leaves LATEST naming a complete snapshot.

What is saved is each rank's Engine.state_dict(): the optimizer state (fp32 master
weights and both moments), the only state a rank cannot rebuild, as ranges of each unit's
flat buffer, and the step counters and loss scale. The metadata records which parameter
sits where in every unit, so a loader with another world size, group size, strategy or
unit split finds each of its elements by parameter name and offset, and hands the pieces
its own state_dict() describes to load_state_dict(). Ranks that hold a replica of another
rank's shard (I and N scopes) write nothing.
"""
from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Optional

import torch

from pccl.util.files import fsync_dir, write_atomic

FORMAT = 1
STATE = ("master", "exp_avg", "exp_avg_sq")   # the tensors of a unit's piece, in state_dict() and shard files
COUNTERS = ("optimizer_steps", "steps", "skipped_steps", "loss_scale", "loss_scale_clean")


class CheckpointError(ValueError):
    """A missing or damaged checkpoint, or one written for another model."""


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


def save(engine, path, extra: Optional[dict] = None) -> None:
    root = Path(path)
    token = engine.agree(int(uuid.uuid4().int % (1 << 62)))
    state, rank = engine.state_dict(), engine.layout.rank
    snap = root / f"snap-{state['steps']:08d}-{token:016x}"
    snap.mkdir(parents=True, exist_ok=True)
    shards = {u["name"]: {"start": u["start"], "end": u["end"], **{k: u[k].cpu().clone() for k in STATE}}
              for u in state["units"] if u["first_replica"]}
    if shards:
        write_atomic(snap / f"shard-{rank}.pt", lambda f: torch.save(shards, f))
    engine.barrier()
    if rank == 0:
        meta = _metadata(state)
        meta["files"] = sorted(p.name for p in snap.glob("shard-*.pt"))
        meta["extra"] = extra
        write_atomic(snap / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
        fsync_dir(snap)
        write_atomic(root / "LATEST", lambda f: f.write(snap.name.encode()))
        fsync_dir(root)
        for old in root.glob("snap-*"):
            if old.name != snap.name:
                shutil.rmtree(old, ignore_errors=True)
    engine.barrier()


def latest(path) -> Path:
    """The complete snapshot `path`'s LATEST names."""
    root = Path(path)
    pointer = root / "LATEST"
    if not pointer.is_file():
        raise CheckpointError(f"no checkpoint at {root}: {pointer} is missing")
    snap = root / pointer.read_text().strip()
    if not (snap / "meta.json").is_file():
        raise CheckpointError(f"checkpoint {snap} is incomplete: meta.json is missing")
    return snap


def _check_model(state: dict, meta: dict) -> None:
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint format {meta.get('format')!r} is not {FORMAT}")
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
        """Elements [lo, hi) of `param` (flattened) into `out` (one tensor per STATE key)."""
        unit, base = self.where[param]
        a, b = base + lo, base + hi
        covered = 0
        for start, end, name in self.pieces.get(unit, []):
            s, e = max(a, start), min(b, end)
            if s < e:
                shard = self._load(name)[unit]
                for k in STATE:
                    out[k][s - a:e - a].copy_(shard[k][s - start:e - start])
                covered += e - s
        if covered != b - a:
            raise CheckpointError(f"checkpoint {self.snap} lacks part of {param} (elements {lo}..{hi}): "
                                  "a shard file is missing")


def load(engine, path) -> Optional[dict]:
    """Restore the latest snapshot into `engine`; returns the `extra` it was saved with."""
    snap = latest(path)
    meta = json.loads((snap / "meta.json").read_text())
    mine = engine.state_dict()   # which pieces this engine holds
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
    engine.load_state_dict({**mine, **{k: meta[k] for k in COUNTERS}, "units": units})
    return meta.get("extra")
