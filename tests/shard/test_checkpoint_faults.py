"""Checkpoints under injected faults, on one rank in this process: a corrupted, truncated
or missing file is named on load, and fallback takes the newest intact snapshot; a full
disk mid-save leaves the previous snapshot intact and raises clearly; old snapshots are
kept and pruned as asked. (Several ranks: tests/shard/workers/run_engine.py.)"""
import errno
import json

import pytest
import torch

import shard.engine.checkpoint as ckpt
from shard import CheckpointError, CheckpointSaveError, ShardedAdamW
from shard.engine.checkpoint_async import AsyncSaver
from shard.engine.config import EngineConfig
from tests.shard.test_engine_state import build, train_step


def trained(engines, comm, steps: int) -> ShardedAdamW:
    """An engine trained `steps` steps, and its optimizer (which holds it: .engine)."""
    optimizer = build(engines, comm, "mlp", EngineConfig(strategy="zero3", min_shard_numel=0), seed=0)
    for step in range(steps):
        train_step(optimizer, "mlp", step)
    return optimizer


def save(optimizer: ShardedAdamW, path, background: bool = False, **options) -> None:
    """checkpoint.save, or with `background` the same snapshot through an AsyncSaver,
    waited for."""
    if background:
        saver = AsyncSaver(optimizer.engine, path, keep=options.pop("keep", 1))
        saver.save(optimizer, **options)
        saver.wait()
    else:
        ckpt.save(optimizer.engine, optimizer, path, **options)


def load(optimizer: ShardedAdamW, path, fallback: bool = False) -> ckpt.Restored:
    return ckpt.load(optimizer.engine, optimizer, path, fallback)


def shard_file(snap):
    (path,) = snap.glob("shard-*.pt")
    return path


def test_damaged_snapshots_are_named_and_fallback_takes_the_newest_intact(comm, engines, tmp_path):
    optimizer = trained(engines, comm, 1)
    save(optimizer, tmp_path, extra={"step": 1}, keep=3)
    first = optimizer.engine.full_state_dict()
    train_step(optimizer, "mlp", 1)
    save(optimizer, tmp_path, extra={"step": 2}, keep=3)
    newest, older = ckpt.snapshots(tmp_path)[:2]
    assert ckpt.latest(tmp_path) == newest and ckpt.problems(newest) is None
    manifest = json.loads((newest / "meta.json").read_text())
    assert manifest["files"][shard_file(newest).name]["bytes"] == shard_file(newest).stat().st_size
    path = shard_file(newest)
    data = path.read_bytes()
    for damage, message in ((lambda: path.write_bytes(data[:-1] + bytes([data[-1] ^ 1])), "is corrupted"),
                            (lambda: path.write_bytes(data[:100]), "has 100 bytes, the manifest says"),
                            (lambda: path.unlink(), "is missing")):
        damage()
        loader = trained(engines, comm, 0)
        with pytest.raises(CheckpointError, match=f"{path.name} {message}"):
            load(loader, tmp_path)
        restored = load(loader, tmp_path, fallback=True)
        assert restored.extra == {"step": 1} and restored.snapshot == older
        assert len(restored.skipped) == 1 and message in restored.skipped[0]
        assert all(torch.equal(v, first[k]) for k, v in loader.engine.full_state_dict().items())
        path.write_bytes(data)
    # a manifest that parses but is not one: named, and passed over by the fallback (a KeyError before)
    for broken, message in ((None, "is not a manifest"), ({"format": 2}, "is malformed: no params"),
                            ({**manifest, "files": 3}, "is malformed: its file list is not one")):
        (newest / "meta.json").write_text(json.dumps(broken))
        with pytest.raises(CheckpointError, match=message):
            load(trained(engines, comm, 0), tmp_path)
        assert load(trained(engines, comm, 0), tmp_path, fallback=True).snapshot == older
    (newest / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        load(trained(engines, comm, 0), tmp_path)
    # a snapshot a running job's retention removed as it was read (shard-export on a live run)
    gone = tmp_path / "snap-00000099-00"
    assert ckpt.problems(gone).startswith(f"{gone} no longer exists (a newer save of the run removed it")
    for snap in (newest, older):
        shard_file(snap).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no intact checkpoint .* to fall back to"):
        load(trained(engines, comm, 0), tmp_path, fallback=True)


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_full_disk_mid_save_leaves_the_previous_snapshot_intact(comm, engines, tmp_path, monkeypatch, background):
    optimizer = trained(engines, comm, 1)
    save(optimizer, tmp_path, extra={"step": 1})
    good = ckpt.latest(tmp_path)
    before = optimizer.engine.full_state_dict()
    train_step(optimizer, "mlp", 1)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    for target in ("torch.save", "the manifest"):
        with monkeypatch.context() as patch:
            if target == "torch.save":
                patch.setattr(torch, "save", no_space)
            else:
                real = ckpt.write_atomic
                patch.setattr(ckpt, "write_atomic", lambda path, content: no_space() if path.name == "meta.json"
                              else real(path, content))
            with pytest.raises(CheckpointSaveError, match=f"no space left .* the previous snapshot {good.name} is "
                                                          "intact") as failure:
                save(optimizer, tmp_path, background, extra={"step": 2})
        assert failure.value.errno == errno.ENOSPC
        assert ckpt.snapshots(tmp_path) == [good] and ckpt.latest(tmp_path) == good   # no partial snapshot left
        loader = trained(engines, comm, 0)
        assert load(loader, tmp_path).extra == {"step": 1}
        assert all(torch.equal(v, before[k]) for k, v in loader.engine.full_state_dict().items())
    # a failure that is no OSError (the serializer's): the same, not an error on one rank that
    # left the others (and the async saver's wait) waiting for its word
    def cannot_pickle(*args, **kwargs):
        raise RuntimeError("pickling")
    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", cannot_pickle)
        with pytest.raises(CheckpointSaveError, match=f"RuntimeError: pickling; the previous snapshot {good.name}"):
            save(optimizer, tmp_path, background, extra={"step": 2})
    assert ckpt.snapshots(tmp_path) == [good]
    save(optimizer, tmp_path, background, extra={"step": 2})   # the disk has room again
    assert ckpt.snapshots(tmp_path)[0] == ckpt.latest(tmp_path) != good


def test_snapshots_are_kept_as_asked_and_an_abandoned_future_is_removed(comm, engines, tmp_path):
    optimizer = trained(engines, comm, 1)
    for step in range(1, 5):
        save(optimizer, tmp_path, extra={"step": step}, keep=2)
        train_step(optimizer, "mlp", step)
    assert [ckpt._step(s) for s in ckpt.snapshots(tmp_path)] == [4, 3]   # the optimizer's steps at each save
    # A run resumed from step 3 (the newest was lost, say) abandons the snapshots of step 3
    # and later when it saves: they belong to a future it will not have.
    resumed = trained(engines, comm, 0)
    (tmp_path / "LATEST").write_text(ckpt.snapshots(tmp_path)[1].name)
    load(resumed, tmp_path)
    save(resumed, tmp_path, extra={"step": 3}, keep=2)
    assert ckpt.snapshots(tmp_path) == [ckpt.latest(tmp_path)] and ckpt._step(ckpt.latest(tmp_path)) == 3
    with pytest.raises(ValueError, match="keep must be an integer >= 1"):
        save(optimizer, tmp_path, keep=0)


@pytest.mark.parametrize("reader", ["export", "load"])
def test_a_snapshot_being_read_outlives_the_retention_of_a_running_save(comm, engines, tmp_path, monkeypatch,
                                                                         reader):
    """shard-export (or another job's load) verifies a snapshot's files, hashing them all
    (minutes for a 7B run's), while the live run saves again and its retention (keep=1)
    would remove that snapshot: the read goes on, and a later save removes it."""
    optimizer = trained(engines, comm, 1)
    save(optimizer, tmp_path, extra={"step": 1}, keep=1)
    snap = ckpt.latest(tmp_path)
    expected = optimizer.engine.full_state_dict()
    verify = ckpt.problems
    removed_midway = []

    def problems_as_a_save_commits(*args):
        """Verification, with the live run's next save committing (keep=1) in the middle."""
        train_step(optimizer, "mlp", len(removed_midway) + 1)
        save(optimizer, tmp_path, extra={"step": 2}, keep=1)
        removed_midway.append(not snap.exists())
        return verify(*args)
    monkeypatch.setattr(ckpt, "problems", problems_as_a_save_commits)
    if reader == "export":
        got = dict(ckpt.parameters(snap))
    else:
        loader = trained(engines, comm, 0)
        assert load(loader, snap.parent).snapshot == snap
        got = loader.engine.full_state_dict()
    assert removed_midway == [False]
    assert got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())
    monkeypatch.setattr(ckpt, "problems", verify)
    assert snap.exists() and len(ckpt.snapshots(tmp_path)) == 2   # pinned: kept past keep=1 ...
    save(optimizer, tmp_path, extra={"step": 3}, keep=1)
    assert ckpt.snapshots(tmp_path) == [ckpt.latest(tmp_path)]   # ... until the next save


def test_an_abandoned_snapshot_goes_even_while_read_so_a_fallback_resume_never_takes_it(comm, engines, tmp_path):
    """A run resumed from step 1 abandons the snapshot of step 2 at its next save. Kept
    because a reader had it pinned, it would be the newest a fallback resume finds."""
    optimizer = trained(engines, comm, 1)
    save(optimizer, tmp_path, extra={"step": 1}, keep=2)
    first = ckpt.latest(tmp_path)
    train_step(optimizer, "mlp", 1)
    save(optimizer, tmp_path, extra={"step": 2}, keep=2)
    abandoned = ckpt.latest(tmp_path)
    (tmp_path / "LATEST").write_text(first.name)
    resumed = trained(engines, comm, 0)
    load(resumed, tmp_path)
    with ckpt.pinned(abandoned):
        save(resumed, tmp_path, extra={"step": "resumed"}, keep=2)
        assert not abandoned.exists()
    assert load(trained(engines, comm, 0), tmp_path, fallback=True).extra == {"step": "resumed"}


def test_an_async_snapshot_holds_the_state_of_its_step_while_training_goes_on(comm, engines, tmp_path, monkeypatch):
    """save() returns before anything is written (the writer is held back here), training
    changes the live state, and the snapshot still holds the state of its step: the same
    tensors and manifest as checkpoint.save's of that state. LATEST moves only once the
    snapshot is complete, and keep prunes as in checkpoint.save."""
    import threading

    optimizer = trained(engines, comm, 1)
    save(optimizer, tmp_path / "sync", extra={"step": 1})
    expected = optimizer.engine.full_state_dict()
    saver = AsyncSaver(optimizer.engine, tmp_path / "async", keep=1)
    release, real = threading.Event(), ckpt.write_shards
    monkeypatch.setattr(ckpt, "write_shards", lambda *a: (release.wait(), real(*a)))
    saver.save(optimizer, extra={"step": 1})
    train_step(optimizer, "mlp", 1)   # the live state moves on while the write waits
    assert not (tmp_path / "async" / "LATEST").exists(), "nothing committed before the files are written"
    release.set()
    saver.wait()
    mine, theirs = ckpt.latest(tmp_path / "async"), ckpt.latest(tmp_path / "sync")
    assert ckpt.problems(mine) is None and not list(mine.glob(".written-*"))
    assert json.loads((mine / "meta.json").read_text())["extra"] == {"step": 1}
    strip = lambda meta: {k: v for k, v in meta.items() if k != "files"}   # noqa: E731
    assert strip(json.loads((mine / "meta.json").read_text())) == strip(json.loads((theirs / "meta.json").read_text()))
    a, b = (torch.load(shard_file(s), weights_only=True) for s in (mine, theirs))
    assert a.keys() == b.keys() and all(torch.equal(a[u][k], b[u][k]) for u in a for k in ckpt.STATE)
    loader = trained(engines, comm, 0)
    assert load(loader, tmp_path / "async").extra == {"step": 1}
    assert all(torch.equal(v, expected[k]) for k, v in loader.engine.full_state_dict().items())
    saver.save(optimizer, extra={"step": 2})
    saver.save(optimizer, extra={"step": 2})   # waits for the one before, then replaces it (keep=1)
    saver.wait()
    assert ckpt.snapshots(tmp_path / "async") == [ckpt.latest(tmp_path / "async")]
