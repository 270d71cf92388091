"""A corpus tokenized once, in parallel, into token shards the streaming reader reads as it
reads text (a data.paths entry naming the directory), for runs that would rather not
tokenize as they train.

    tokenize_corpus(["web/*.jsonl.zst"], "Llama-3.2-1B/", "web-tokens/", workers=8)

    web-tokens/    tokens.json                  the manifest, written last: the directory is
                                                complete once it is there
                   tokenizer.json (+ config)    the tokenizer, copied (or tokenizer.model)
                   shard-00000.bin, .idx ...    one per input piece: the documents' framed
                                                tokens (uint16 where the vocabulary fits, else
                                                uint32, little-endian), and where each ends
                                                and which record it was (int64 pairs)

Each input piece (readers.py) is one task: `workers` processes tokenize the pieces side by
side and write their shards atomically; the manifest lists them in the input's order, so the
shards are the same whatever the number of workers. The whole is built in a temporary
directory beside `out` and renamed into place.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from concurrent.futures import ProcessPoolExecutor
from itertools import islice
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from runkit.files import fsync_dir, write_atomic
from shard.data import readers, tokenizer
from shard.data.pack import ENCODE_BATCH, token_dtype

MANIFEST = "tokens.json"
FORMAT = 1


def _shard(task: tuple) -> dict:
    """Tokenize one piece into shard-<n>.bin/.idx in `directory`, written a batch of
    documents at a time (a piece may be a large file); what the manifest says of it."""
    n, piece, field, tokenizer_path, directory = task
    tok = tokenizer.load(tokenizer_path)
    dtype = token_dtype(tok.vocab_size)
    index = []   # (end, record) of each document

    def write(f) -> None:
        written, records = 0, readers.read(piece, field)
        while batch := list(islice(records, ENCODE_BATCH)):
            ids, ends = tok.frame([text for _, text in batch], dtype=dtype)
            f.write(ids.tobytes())
            index.extend((written + int(e), r) for e, (r, _) in zip(ends, batch))
            written += len(ids)

    name = f"shard-{n:05d}"
    write_atomic(Path(directory) / f"{name}.bin", write)
    pairs = np.array(index, dtype="<i8").reshape(-1, 2)
    write_atomic(Path(directory) / f"{name}.idx", pairs.tobytes())
    return {"name": name, "documents": len(pairs), "tokens": int(pairs[-1, 0]) if len(pairs) else 0,
            "from": piece.path, "rows": piece.rows}


def tokenize_corpus(patterns: list[str], tokenizer_path, out, field: str = "text", workers: int = 1) -> dict:
    """Tokenize the corpus `patterns` name into the directory `out` (module docstring);
    returns the manifest. Refuses an `out` that exists and is not empty."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: give a new directory")
    tok = tokenizer.load(tokenizer_path)
    found = readers.files(patterns)
    readers.check_field(found, field)
    pieces = readers.pieces_of(found)
    if any(p.kind == "tokens" for p in pieces):
        raise readers.CorpusError("the corpus is already tokenized (a token directory among data.paths)")
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        for name, f in tokenizer.named_files(tokenizer_path):
            write_atomic(tmp / name, f.read_bytes())
        tasks = [(n, p, field, str(tmp), str(tmp)) for n, p in enumerate(pieces)]
        if workers > 0:
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
                shards = list(pool.map(_shard, tasks))
        else:
            shards = [_shard(t) for t in tasks]
        if not any(s["documents"] for s in shards):   # (a directory no run could train on)
            raise readers.CorpusError(f"{', '.join(map(str, patterns))}: no documents (records with text in "
                                      f"{field!r}) to tokenize")
        manifest = {"format": FORMAT, "dtype": token_dtype(tok.vocab_size).name, "vocab_size": tok.vocab_size,
                    "eos_id": tok.eos_id, "prefix": list(tok.prefix), "field": field, "shards": shards,
                    "documents": sum(s["documents"] for s in shards), "tokens": sum(s["tokens"] for s in shards)}
        write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
