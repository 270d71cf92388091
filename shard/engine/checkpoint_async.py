"""Checkpoints that do not stall training: checkpoint.save's snapshots, written in the
background.

    saver = AsyncSaver(engine, path, keep=2)
    saver.save(optimizer, extra={"step": step})   # returns once the shards are copied
    ...                                            # training goes on while a thread writes
    saver.wait()                                   # before exit: the last snapshot committed

save() copies this rank's shards (fp32 master and both moments, the first replicas it
holds) into host buffers that live as long as the saver (pinned on GPUs, so the copy is a
DMA), and hands them to a writer thread: that is the step's only stall. The thread writes
and hashes the shard file as checkpoint.save does, then a marker saying it did (or what
failed). Rank 0's thread waits for every rank's marker, then commits: manifest, LATEST,
older snapshots removed. No collective runs off the main thread: the ranks learn of each
other's progress through the snapshot directory (a filesystem every rank sees, as the
manifest already needs). A crash at any point before LATEST is replaced leaves the
previous snapshot the newest intact one.

The next save() first waits for the previous snapshot (one in flight: its buffers are
reused), and so does wait(); both are collective, and raise CheckpointSaveError on every
rank when any rank failed to write it (the partial snapshot removed, the previous one
named intact).

Host memory: the buffers hold 12 bytes per parameter / world size, for the whole run.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from runkit.files import write_atomic
from shard.engine import checkpoint

POLL_S = 0.05   # rank 0's writer looks for the other ranks' markers this often


class _Write:
    """One snapshot in flight."""

    def __init__(self, snap: Path):
        self.snap = snap
        self.own_done = threading.Event()   # this rank's files and marker written (or failed)
        self.own_error: Optional[OSError] = None
        self.abort = threading.Event()      # rank 0: another rank failed, do not commit
        self.commit_error: Optional[OSError] = None
        self.thread: Optional[threading.Thread] = None


class AsyncSaver:
    """Snapshots of one engine under `path`, written in the background (module docstring)."""

    def __init__(self, engine, path, keep: int = 1):
        checkpoint.check_keep(keep)
        self.engine, self.root, self.keep = engine, Path(path), keep
        self.rank, self.world = engine.layout.rank, engine.layout.world
        self._buffers: dict[str, dict] = {}
        self._pending: Optional[_Write] = None

    def save(self, optimizer, extra: Optional[dict] = None, written: Optional[Callable[[], None]] = None) -> None:
        """Start a snapshot of the engine and `optimizer` (see checkpoint.save for `extra`
        and `written`; `written` runs on the writer thread). Collective."""
        self.wait()
        snap, state = checkpoint.begin(self.engine, optimizer, self.root)
        shards = self._copy(checkpoint.pieces(state))
        meta = checkpoint.manifest(state, extra) if self.rank == 0 else None
        pending = _Write(snap)
        pending.thread = threading.Thread(target=self._write, args=(pending, shards, meta, written),
                                          name=f"checkpoint {snap.name}", daemon=True)
        pending.thread.start()
        self._pending = pending

    def _copy(self, pieces: dict) -> dict:
        """`pieces` copied into the saver's host buffers (made at the first save; pinned
        where the state is on a GPU), waited for: training may change the live ones next."""
        for name, piece in pieces.items():
            kept = self._buffers.get(name)
            if kept is None or kept["master"].numel() != piece["master"].numel():
                pin = piece["master"].device.type == "cuda"
                kept = {k: torch.empty(piece[k].shape, dtype=piece[k].dtype, pin_memory=pin)
                        for k in checkpoint.STATE}
                self._buffers[name] = kept
            for k in checkpoint.STATE:
                kept[k].copy_(piece[k], non_blocking=True)
            kept.update(start=piece["start"], end=piece["end"])
        if any(p["master"].device.type == "cuda" for p in pieces.values()):
            torch.cuda.synchronize()
        return {name: self._buffers[name] for name in pieces}

    def _write(self, pending: _Write, shards: dict, meta: Optional[dict], written) -> None:
        try:
            checkpoint.write_shards(pending.snap, self.rank, shards)
        except OSError as e:   # (any failure to write is one: write_shards)
            pending.own_error = e
        if written is not None:
            written()
        try:
            error = None if pending.own_error is None else str(pending.own_error)
            write_atomic(pending.snap / f".written-{self.rank}", json.dumps({"error": error}).encode())
        except OSError as e:
            pending.own_error = pending.own_error or e
        pending.own_done.set()
        if self.rank == 0 and pending.own_error is None:
            try:
                if self._all_written(pending):
                    for marker in pending.snap.glob(".written-*"):
                        marker.unlink()
                    checkpoint.commit(self.root, pending.snap, meta, self.keep)
            except OSError as e:
                pending.commit_error = e

    def _all_written(self, pending: _Write) -> bool:
        """Rank 0: wait until every rank's marker is there; whether all wrote their files
        (False as soon as one says it failed, or when told to abort)."""
        while not pending.abort.is_set():
            markers = list(pending.snap.glob(".written-*"))
            for marker in markers:
                if json.loads(marker.read_text())["error"] is not None:
                    return False
            if len(markers) == self.world:
                return True
            time.sleep(POLL_S)
        return False

    def wait(self) -> None:
        """Until the snapshot in flight is committed; raises CheckpointSaveError on every
        rank if any failed to write it. Collective."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.own_done.wait()
        failed = self.engine.total(int(pending.own_error is not None))
        if failed:
            pending.abort.set()
        if self.rank == 0:
            pending.thread.join()
        problem = pending.own_error or pending.commit_error
        what = "its shard files" if failed else "the manifest"
        failed = failed or self.engine.total(int(pending.commit_error is not None))
        if failed:
            self.engine.barrier()
            raise checkpoint.failure(self.root, pending.snap, failed, problem, what, remove=self.rank == 0)
        pending.thread.join()
