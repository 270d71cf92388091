"""A corpus on disk as pieces that can be read apart, from any record, by any process.

    pieces(["corpus/*.parquet"])          [Piece("corpus/a.parquet", "parquet", rows=(0, 8192)), ...]
    read(piece, "text", start=100)        (record index, text) of the piece's records from 100 on

A path is a glob (recursive `**` too), a file, or a directory (every readable file under it,
or a Hugging Face `datasets` directory written by save_to_disk). Files are taken in sorted
order, so the same paths give the same pieces on every rank and every run. The kinds:

    .jsonl .json (+ .gz .zst)   one document per line, its `field` (JSON lines)
    .txt .md (+ .gz .zst)       documents are paragraphs: blank lines between them
    .parquet                    one document per row, column `field`; a piece per row group
    datasets on disk            one per row, column `field`; a piece per ROWS_PER_PIECE rows
    token directories           documents tokenized already (pretokenize.py: shard-data
                                prepare): a piece per shard, each document its token ids
    hub(name, config, split)    a Hugging Face dataset streamed (from the Hub: the network),
                                a piece per shard of it (its data files), column `field`

A record's index is its line (JSON lines), paragraph (text) or row in the file; reading from
`start` skips the earlier ones without parsing them. A file that is not split (JSON lines,
text) is one piece; split(pieces, n) cuts a source's pieces by striding until n streams
each have as many (or enough for one more to matter little): piece k of K keeps the records
whose index is k mod K.
Empty documents (whitespace only) are skipped: they would add only an end-of-document token.
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

JSON = (".jsonl", ".json")
TEXT = (".txt", ".md")
COMPRESSED = ("", ".gz", ".zst")
BALANCED = 10   # pieces per stream beyond which split() leaves the streams' shares unequal by one
DOCUMENTATION = ("readme", "license", "licence", "changelog", "citation")   # beside a dataset's data, not of it
ROWS_PER_PIECE = 65536   # datasets on disk: rows per piece (its Arrow files are memory-mapped)
BATCH_ROWS = 1024        # rows read from parquet and Arrow at a time


class CorpusError(ValueError):
    """A corpus path that matches nothing, or a file that cannot be read as documents."""


@dataclass(frozen=True)
class Piece:
    path: str
    kind: str                             # jsonl | text | parquet | arrow | tokens | hub
    rows: Optional[tuple[int, int]] = None   # parquet, arrow, tokens: the records [first, end) of the file
    group: int = 0                        # parquet: the row group; tokens, hub: the shard
    stride: tuple[int, int] = (0, 1)      # (k, K): the records whose index is k mod K


HUB = "hf:"   # a path naming a Hugging Face dataset streamed (hub() makes it)


def hub(name: str, config: Optional[str] = None, split: str = "train", data_files=None) -> str:
    """The path of a Hugging Face dataset, streamed (data=hf streaming=true): `name` on the
    Hub, or a builder such as "json" with its `data_files`."""
    return HUB + json.dumps({"name": name, "config": config, "split": split, "data_files": data_files}, sort_keys=True)


def _hub_stream(path: str):
    import datasets

    spec = json.loads(path[len(HUB):path.rfind("}") + 1])   # a shard's path goes on: "#<shard>"
    try:
        return datasets.load_dataset(spec["name"], spec["config"], split=spec["split"], data_files=spec["data_files"],
                                     streaming=True)
    except Exception as e:   # datasets raises many kinds (missing dataset, no network, bad config)
        raise CorpusError(f"the Hugging Face dataset {spec['name']!r} ({spec['config']}, {spec['split']}) cannot be "
                          f"streamed: {type(e).__name__}: {e}") from None


def _hub_records(piece, field: str, start: int, keep) -> Iterator[tuple[int, str]]:
    ds = _hub_stream(piece.path)
    for i, record in enumerate(ds.shard(num_shards=ds.n_shards, index=piece.group)):
        if i < start or not keep(i):
            continue
        if field not in record:
            raise CorpusError(f"{piece.path}: record {i} of shard {piece.group} has no field {field!r} (it has "
                              f"{sorted(record)}); set data.field")
        yield i, record[field]


def kind_of(path) -> Optional[str]:
    """The kind of a corpus file (None: not one)."""
    if isinstance(path, str):
        return "hub" if path.startswith(HUB) else kind_of(Path(path))
    if path.is_dir():
        return "arrow" if (path / "state.json").is_file() else "tokens" if (path / "tokens.json").is_file() else None
    name = path.name.lower()
    for suffix in COMPRESSED:
        if any(name.endswith(s + suffix) for s in JSON):
            return "jsonl"
        if any(name.endswith(s + suffix) for s in TEXT):
            return "text"
    return "parquet" if name.endswith(".parquet") else None


def _documentation(path: Path, root: Path) -> bool:
    """Whether a file of a directory given as a corpus is the dataset's documentation, not
    its data: a README or licence (a downloaded dataset's card is its README.md), or under a
    hidden directory (a download's .cache)."""
    parts = path.relative_to(root).parts
    return any(p.startswith(".") for p in parts) or path.name.split(".")[0].lower() in DOCUMENTATION


def files(patterns: list[str]) -> list:
    """The corpus files (and datasets directories, and a streamed dataset's shards, as
    strings) `patterns` name, each pattern's sorted, each file once."""
    out, seen = [], set()
    for pattern in patterns:
        if pattern.startswith(HUB):   # its shards, each a "file" of its own
            out += [f"{pattern}#{g}" for g in range(_hub_stream(pattern).n_shards)]
            continue
        path = Path(pattern)
        if path.is_dir() and kind_of(path) is None:   # its files (a datasets directory is named itself)
            found = sorted(p for p in path.rglob("*") if p.is_file() and kind_of(p) and not _documentation(p, path))
            kinds = sorted({kind_of(p) for p in found})
            if len(kinds) > 1:   # a dataset's text files beside its data: which to read is the user's to say
                raise CorpusError(f"data.paths: the directory {pattern!r} holds corpus files of several kinds "
                                  f"({', '.join(kinds)}, such as {[p.name for p in found][:4]}): name the files "
                                  f"to read with a glob, such as '{pattern}/**/*.parquet'")
        else:   # a glob's plain directories (`**` matches them) are not corpus files; their files are
            found = sorted(p for p in map(Path, glob.glob(pattern, recursive=True)) if p.is_file() or kind_of(p))
        if not found:
            raise CorpusError(f"data.paths: {pattern!r} matches no file")
        unreadable = [str(p) for p in found if kind_of(p) is None]
        if unreadable:
            raise CorpusError(f"data.paths: {pattern!r} matches {unreadable[:3]}, which are not corpus files: "
                              f"expected {'/'.join(JSON + TEXT)} (optionally .gz or .zst), .parquet, a "
                              "datasets directory (save_to_disk) or a token directory (shard-data prepare)")
        for p in found:   # patterns that overlap, or spell one file two ways (a/../a, a symlink), name it once
            if p.resolve() not in seen:
                seen.add(p.resolve())
                out.append(p)
    return out


def _manifest(path) -> dict:
    try:
        return json.loads((Path(path) / "tokens.json").read_text())
    except (OSError, ValueError) as e:
        raise CorpusError(f"{path}: its tokens.json cannot be read: {e}") from None


def token_inputs(path) -> list[str]:
    """The input file each shard of the token directory `path` was tokenized from (its
    manifest's "from"), in the shards' order: a piece's is at its group."""
    return [shard["from"] for shard in _manifest(path)["shards"]]


def _tokens(piece: Piece, start: int, keep) -> Iterator[tuple[int, np.ndarray]]:
    manifest = _manifest(piece.path)
    name = manifest["shards"][piece.group]["name"]
    base = Path(piece.path) / name
    ids = np.memmap(f"{base}.bin", dtype=np.dtype(manifest["dtype"]).newbyteorder("<"), mode="r")
    ends, records = np.fromfile(f"{base}.idx", dtype="<i8").reshape(-1, 2).T
    first, end = piece.rows
    for i in range(max(start, first), end):   # i: the document's number in the directory
        local = i - first
        if keep(int(records[local])):   # a stride takes the records the text's stride takes
            yield i, np.asarray(ids[ends[local - 1] if local else 0:ends[local]])


def _arrow(path: str):
    import datasets

    return datasets.load_from_disk(path)


def pieces(patterns: list[str]) -> list[Piece]:
    """Every piece of the files `patterns` name, in order."""
    return pieces_of(files(patterns))


def pieces_of(found: list) -> list[Piece]:
    """Every piece of `found` (files() of some patterns), in order."""
    out = []
    for path in found:
        kind = kind_of(path)
        if kind == "hub":
            out.append(Piece(path, kind, None, int(path.rsplit("#", 1)[1])))
        elif kind == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            first = 0
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                out.append(Piece(str(path), kind, (first, first + rows), g))
                first += rows
        elif kind == "tokens":
            first = 0
            for g, shard in enumerate(_manifest(path)["shards"]):
                out.append(Piece(str(path), kind, (first, first + shard["documents"]), g))
                first += shard["documents"]
        elif kind == "arrow":
            rows = len(_arrow(str(path)))
            out += [Piece(str(path), kind, (a, min(a + ROWS_PER_PIECE, rows))) for a in range(0, rows, ROWS_PER_PIECE)]
        else:
            out.append(Piece(str(path), kind))
    return out


def split(pieces: list[Piece], streams: int) -> list[Piece]:
    """`pieces`, each cut into K strided pieces, K the smallest that deals every one of
    `streams` streams as many as the others, or at least BALANCED each (one more is then at
    most 1/BALANCED more). Streams read at one rate: with 10 pieces among 8 streams, two
    streams would read two pieces an epoch and six one, which the six read again (a third of
    the corpus twice, a third not at all, in the first pass). Striding costs reading a file K
    times, not tokenizing it: a reader skips others' records unparsed."""
    k = 1
    while k * len(pieces) % streams and k * len(pieces) // streams < BALANCED:
        k += 1
    if k == 1:
        return pieces
    return [Piece(p.path, p.kind, p.rows, p.group, (i, k)) for p in pieces for i in range(k)]


class _Zstd(io.RawIOBase):
    """A .zst file's bytes, frame after frame. Its end inside a frame is an EOFError, as gzip
    raises: zstandard's own stream reader ends there quietly, and a truncated download
    would lose its last documents unseen."""

    def __init__(self, path: str):
        import zstandard

        self.file, self.decompressor, self.error = open(path, "rb"), zstandard.ZstdDecompressor(), zstandard.ZstdError
        self.frame, self.inside = self.decompressor.decompressobj(), False
        self.out, self.at = memoryview(b""), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.at == len(self.out):
            raw = self.file.read(1 << 20)
            if not raw:
                if self.inside:
                    raise EOFError("the file ends inside a zstd frame: it is truncated")
                return 0
            out = []
            while raw:
                self.inside = True
                try:
                    out.append(self.frame.decompress(raw))
                except self.error as e:   # damaged data
                    raise OSError(f"zstd: {e}") from None
                if not self.frame.eof:
                    break
                raw, self.frame, self.inside = self.frame.unused_data, self.decompressor.decompressobj(), False
            self.out, self.at = memoryview(b"".join(out)), 0
        n = min(len(buffer), len(self.out) - self.at)
        buffer[:n] = self.out[self.at:self.at + n]
        self.at += n
        return n

    def close(self) -> None:
        self.file.close()
        super().close()


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".zst"):
        return io.TextIOWrapper(io.BufferedReader(_Zstd(path)), encoding="utf-8")
    return open(path, encoding="utf-8")


def _json_lines(path: str, field: str, start: int, keep) -> Iterator[tuple[int, str]]:
    with _open_text(path) as f:
        for i, line in enumerate(f):
            if i < start or not keep(i) or not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}: line {i + 1} is not JSON ({e})") from None
            if not isinstance(record, dict) or field not in record:
                raise CorpusError(f"{path}: line {i + 1} has no field {field!r} (it has "
                                  f"{sorted(record) if isinstance(record, dict) else type(record).__name__}); "
                                  "set data.field to the one holding the text")
            yield i, record[field]   # read() skips a null, as a parquet file's, and refuses a non-string


def paragraphs(path: str, start: int = 0, keep=lambda i: True) -> Iterator[tuple[int, str]]:
    """(index, text) of a text file's paragraphs, split at lines holding only whitespace
    (data=files' and data=text's split), from the `start`th, those `keep(index)` takes."""
    with _open_text(path) as f:
        index, lines = 0, []
        for line in f:
            if line.strip():
                lines.append(line)
                continue
            if lines:
                if index >= start and keep(index):
                    yield index, "".join(lines).strip()
                index, lines = index + 1, []
        if lines and index >= start and keep(index):
            yield index, "".join(lines).strip()


def _has_column(path, names: list, field: str) -> None:
    if field not in names:
        raise CorpusError(f"{path}: no column {field!r} (columns: {names}); set data.field")


def check_field(found: list, field: str) -> None:
    """Every file of `found` (files() of some patterns) holds `field`: its columns (parquet,
    datasets on disk) or its first record (JSON lines), so that a file without it stops
    the run at the start, not when the streams reach it. A Hub dataset's shards are not
    opened here (the network)."""
    for path in found:
        kind = kind_of(path)
        if kind == "jsonl":
            try:
                next(_json_lines(str(path), field, 0, lambda i: True), None)
            except (EOFError, OSError, UnicodeDecodeError, zlib.error) as e:
                raise CorpusError(f"{path} cannot be read: {type(e).__name__}: {e}") from None
        elif kind == "parquet":
            import pyarrow.parquet as pq

            _has_column(path, pq.read_schema(path).names, field)
        elif kind == "arrow":
            _has_column(path, _arrow(str(path)).column_names, field)


def _rows(piece: Piece, field: str, start: int, keep) -> Iterator[tuple[int, str]]:
    first, end = piece.rows
    start = max(start, first)
    if piece.kind == "parquet":
        import pyarrow.parquet as pq

        f = pq.ParquetFile(piece.path)
        _has_column(piece.path, f.schema_arrow.names, field)
        index = first
        for batch in f.iter_batches(batch_size=BATCH_ROWS, row_groups=[piece.group], columns=[field]):
            if index + batch.num_rows > start:   # batches wholly before `start` are not converted
                for i, text in enumerate(batch.column(0).to_pylist(), index):
                    if i >= start and keep(i):
                        yield i, text
            index += batch.num_rows
    else:
        ds = _arrow(piece.path)
        _has_column(piece.path, ds.column_names, field)
        ds = ds.select_columns([field])
        for a in range(start, end, BATCH_ROWS):
            for i, text in enumerate(ds[a:min(a + BATCH_ROWS, end)][field], a):
                if keep(i):
                    yield i, text


def read(piece: Piece, field: str, start: int = 0, held_out: int = 0) -> Iterator[tuple[int, str]]:
    """(index, text) of the piece's non-empty documents whose index is >= start and
    >= held_out (the first records of a file kept for validation), in order; of a token
    directory's, (index, token ids)."""
    k, n = piece.stride
    keep = (lambda i: i % n == k) if n > 1 else (lambda i: True)
    start = max(start, held_out)
    if piece.kind == "jsonl":
        records = _json_lines(piece.path, field, start, keep)
    elif piece.kind == "text":
        records = paragraphs(piece.path, start, keep)
    elif piece.kind in ("parquet", "arrow"):
        records = _rows(piece, field, start, keep)
    elif piece.kind == "hub":
        records = _hub_records(piece, field, start, keep)
    elif piece.kind == "tokens":
        yield from _tokens(piece, start, keep)   # token ids, framed already
        return
    else:
        raise CorpusError(f"{piece.path}: unknown piece kind {piece.kind!r}")
    index = start - 1
    try:
        for index, text in records:
            if text is None:
                continue
            if not isinstance(text, str):
                raise CorpusError(f"{piece.path}: record {index}'s {field!r} is {type(text).__name__}, expected a "
                                  "string")
            if text.strip():
                yield index, text
    except (EOFError, OSError, UnicodeDecodeError, zlib.error) as e:   # a truncated or damaged file
        what = "is not UTF-8 text" if isinstance(e, UnicodeDecodeError) else "cannot be read"
        where = f"past record {index}" if index >= start else "before its first record"   # (text is decoded ahead)
        raise CorpusError(f"{piece.path} {what} ({where}): {type(e).__name__}: {e}") from None


def identity(found: list) -> list[dict]:
    """What a resumed run checks the corpus against: every file's (of `found`, files() of
    some patterns) path, size and time."""
    out = []
    for path in found:
        if isinstance(path, str):   # a streamed dataset's shard: nothing to stat
            out.append({"path": path})
            continue
        stat = os.stat(path / ("state.json" if kind_of(path) == "arrow" else "tokens.json") if path.is_dir() else path)
        out.append({"path": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return out
