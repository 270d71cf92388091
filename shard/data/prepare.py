"""Prepare a data spec once: documents -> tokenizer -> packed token files, in a cache entry.

    cache_dir/<source>-<hash12>/    the tokenizer's files (tokenizer.model, or tokenizer.json and
                                    tokenizer_config.json), train.bin, val.bin, meta.json

The hash (spec.py) covers everything that determines the tokens, so an entry is reused
only for the same data, and any change gives a new entry. An entry is built in a
temporary directory beside it and renamed into place when complete (one atomic rename),
so a crash leaves at most a temporary directory, which the next prepare removes, never an
entry that looks complete. One process prepares (rank 0); the others wait, then open the
returned directory with TokenData.

Two runs may prepare the same entry at once (two jobs in one checkout): a temporary
directory names its host and process, and only one whose process is gone from this host
is removed as a crash's; the first to finish renames its build into place, and the other
drops its own and returns the same entry.
"""
from __future__ import annotations

import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Mapping

from runkit.files import fsync_dir, write_atomic, write_json_atomic
from shard.data import tokenizer
from shard.data.pack import pack
from shard.data.sources import load_documents
from shard.data.spec import digest, identity, normalize
from shard.data.tokens import DataError, TokenData


def _complete(entry: Path) -> bool:
    try:
        TokenData(entry)
    except (FileNotFoundError, DataError):
        return False
    return True


def _build(spec: dict, ident: dict, key: str, directory: Path) -> None:
    hf_cache = directory / "hf-cache"  # datasets' Arrow copies of local files, dropped when read
    documents = list(load_documents(spec, hf_cache=str(hf_cache)))
    shutil.rmtree(hf_cache, ignore_errors=True)
    if spec["tokenizer"] is None:
        tokenizer.train(documents, spec["vocab_size"], directory / "tokenizer.model")
    else:   # its defining files, copied under the names load() looks for: the entry stands alone
        tokenizer.load(spec["tokenizer"])   # a damaged file is named as the user gave it
        for name, f in tokenizer.named_files(spec["tokenizer"]):
            write_atomic(directory / name, f.read_bytes())
    counts = pack(documents, tokenizer.load(directory), directory, spec["val_fraction"])
    # meta.json last: TokenData and _complete treat a directory without it as unfinished.
    write_json_atomic(directory / "meta.json", {**counts, "spec_hash": key, "spec": ident})


def prepare(spec: Mapping, cache_dir) -> Path:
    """The cache entry holding the tokens of `spec` (see spec.py for its keys), built if absent."""
    spec = normalize(spec)
    cache = Path(cache_dir)
    ident = identity(spec)
    key = digest(ident)
    entry = cache / f"{spec['source']}-{key[:12]}"
    if _complete(entry):
        return entry
    cache.mkdir(parents=True, exist_ok=True)
    prefix = f".tmp-{entry.name}-"
    for stale in cache.glob(prefix + "*"):
        if _abandoned(stale.name[len(prefix):]):
            shutil.rmtree(stale, ignore_errors=True)
    if entry.exists():
        if _complete(entry):   # another prepare finished it meanwhile
            return entry
        shutil.rmtree(entry, ignore_errors=True)   # damaged: complete entries only ever appear by rename
    tmp = cache / f"{prefix}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _build(spec, ident, key, tmp)
        fsync_dir(tmp)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not _complete(entry):   # not another prepare's finished build: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(cache)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return entry


def prepare_tokenizer(spec: Mapping, cache_dir) -> Path:
    """A streamed corpus's tokenizer (a normalized spec of source "files"): the one it names,
    that of its first pre-tokenized directory, or one trained on a sample of its documents
    (every piece's first, up to the training budget in all), cached in
    cache_dir/files-<hash12>/tokenizer.model. One process prepares (rank 0)."""
    from shard.data import readers
    from shard.data.spec import digest

    if spec["tokenizer"] is not None:
        return tokenizer.locate(spec["tokenizer"])
    found = readers.files(spec["paths"])
    tokenized = [path for path in found if readers.kind_of(path) == "tokens"]
    if tokenized:   # the tokenizer its tokens were made with
        return tokenizer.locate(tokenized[0])
    ident = {"format": 1, "source": "files", "field": spec["field"], "vocab_size": spec["vocab_size"],
             "files": readers.identity(found)}
    path = Path(cache_dir) / f"files-{digest(ident)[:12]}" / "tokenizer.model"
    if path.is_file():
        return path
    pieces = readers.pieces_of(found)
    budget, documents = tokenizer.MAX_TRAINING_CHARS // len(pieces) + 1, []
    for piece in pieces:
        chars = 0
        for _, text in readers.read(piece, spec["field"]):
            documents.append(text)
            chars += len(text)
            if chars >= budget:
                break
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.train(documents, spec["vocab_size"], path)   # written atomically
    return path


def _abandoned(suffix: str) -> bool:
    """Whether the temporary directory named `suffix` after its entry ("HOST-PID-XXXXXXXX")
    is a crashed prepare's: made on this host by a process that no longer runs (one of
    another host's, which this one cannot see, is left to that host). A name without a
    host and process, from an older version, counts as abandoned."""
    host, _, rest = suffix.rpartition("-")[0].rpartition("-")
    pid = rest if rest.isdigit() else ""
    if not host or not pid:
        return True
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:   # alive, another user's
        return False
    return False
