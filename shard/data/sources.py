"""Documents for a data spec, read through Hugging Face `datasets`.

    synthetic  the project's own corpus (synthetic.py): `documents` documents from `seed`
    text       local files, in the order given: a .txt/.md file is split into documents at
               blank lines (paragraphs, surrounding whitespace stripped; a line of spaces or
               tabs is blank, as data=files has it: readers.paragraphs); a .jsonl/.json file
               gives one document per record, its `field`
    hf         a Hub dataset `name` (`config`, `split`), streamed, its first `max_documents`
               records' `field` (needs the network)

Empty documents are dropped: they would add only an end-of-document token.
"""
from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator

from shard.data.readers import paragraphs
from shard.data.synthetic import synthetic_documents

SOURCES = ("synthetic", "text", "hf", "files")   # files: streamed (stream.py), not loaded here
TEXT_SUFFIXES = (".txt", ".md")
JSON_SUFFIXES = (".jsonl", ".json")


def missing_files(files) -> list[str]:
    return [str(f) for f in files if not Path(f).is_file()]


def _texts(records: Iterable[dict], field: str, origin: str) -> Iterator[str]:
    for i, record in enumerate(records):
        if field not in record:
            raise ValueError(f"{origin}: record {i} has no field {field!r} (it has {sorted(record)}); "
                             f"set `field` to the one holding the text")
        text = record[field]
        if text is None:   # a record without text, skipped as data=files skips it (a parquet null)
            continue
        if not isinstance(text, str):
            raise ValueError(f"{origin}: record {i} field {field!r} is {type(text).__name__}, expected a string")
        if text.strip():
            yield text


def _file_documents(path: Path, field: str, hf_cache) -> Iterator[str]:
    import datasets

    suffix = path.suffix.lower()
    size = path.stat().st_size
    if size < 1 << 16 and not path.read_bytes().strip():   # datasets cannot infer a schema from nothing
        raise ValueError(f"{path}: the file is empty (no documents)")
    if suffix in TEXT_SUFFIXES:   # split as data=files splits it
        try:
            yield from (text for _, text in paragraphs(str(path)) if text)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text: {e}") from None
    elif suffix in JSON_SUFFIXES:
        try:
            ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=hf_cache)
        except (datasets.exceptions.DatasetGenerationError, ValueError) as e:   # bad JSON: a traceback's worth
            raise ValueError(f"{path} cannot be read as JSON lines: {e.__cause__ or e}") from None
        if field not in ds.column_names:
            raise ValueError(f"{path}: no field {field!r} in its records (fields: {ds.column_names}); "
                             f"set `field` to the one holding the text")
        try:
            yield from _texts(({field: t} for t in ds[field]), field, str(path))
        except UnicodeDecodeError as e:   # loaded as they are, its bytes fail as the column is read
            raise ValueError(f"{path} cannot be read as JSON lines: it is not UTF-8 text: {e}") from None
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; expected one of "
                         f"{TEXT_SUFFIXES + JSON_SUFFIXES}")


def load_documents(spec: dict, hf_cache=None) -> Iterator[str]:
    """The documents of a normalized spec (see spec.py). `hf_cache`: where `datasets` may
    write its Arrow files for local files (None: its default cache)."""
    source = spec["source"]
    if source == "synthetic":
        yield from (d for d in synthetic_documents(spec["documents"], spec["seed"]) if d.strip())
    elif source == "text":
        missing = missing_files(spec["files"])
        if missing:
            raise FileNotFoundError(f"text source: no such file(s): {missing}")
        for f in spec["files"]:
            yield from _file_documents(Path(f), spec["field"], hf_cache)
    elif source == "hf":
        import datasets

        stream = datasets.load_dataset(spec["name"], spec["config"], split=spec["split"], streaming=True)
        origin = f"hf dataset {spec['name']} ({spec['config']}, {spec['split']})"
        yield from islice(_texts(stream, spec["field"], origin), spec["max_documents"])
    else:
        raise ValueError(f"unknown data source {source!r}; valid sources: {list(SOURCES)}")
