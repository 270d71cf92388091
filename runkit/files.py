"""Crash-safe file writes: a reader sees the old file or the whole new one, never a part."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import BinaryIO, Callable, Union


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a new or renamed name) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, content: Union[bytes, str, Callable[[BinaryIO], None]]) -> None:
    """Write `content` (bytes, text, or a function writing into a binary file) to a
    temporary name in the same directory (same file system, so the rename is atomic),
    flush it to disk, then rename it over `path`. The temporary name is this write's own
    (a random part beside the pid): writers of one path at once, threads of a process or
    processes of one pid on two hosts, would otherwise truncate or rename each other's."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, value) -> None:
    write_atomic(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())
