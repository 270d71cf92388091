"""A data spec: validation, defaults, and the identity of the tokens it produces.

Keys (a plain dict, e.g. from an OmegaConf config; a key of other sources only is refused
unless it holds its default, which it would be read as):
    source        "synthetic" | "text" | "hf"                                   (required)
    documents     synthetic: number of documents                               (synthetic)
    seed          synthetic: corpus seed                                       (default 0)
    files         text: list of .txt/.md/.jsonl/.json paths                    (text)
    name, config, split, max_documents   hf: Hub dataset, its first documents  (hf; config
                  default None, split default "train")
    streaming     hf: streamed as source "files" streams (below), the whole dataset, instead
                  of its first max_documents cached                            (default False)
    field         the record field holding the text, .json(l) and hf           (default "text")
    tokenizer     a tokenizer.json, a directory holding one, a sentencepiece .model
                  (tokenizer.py); None or "train": train one on the corpus     (default None)
    vocab_size    vocabulary of the trained tokenizer                          (when training)
    val_fraction  share of the documents (the last ones) held out, in (0, 1)   (default 0.01)

The streamed source (stream.py: read, tokenized and packed as training goes, nothing cached
but a trained tokenizer):
    files         paths: a list of globs, files or directories (readers.py)    (files)
    weights       one positive weight per path, each path a source of the mixture; None:
                  the paths are one source                                     (default None)
    val_documents the first documents of the first file held out for validation (default 200)
    streams       the streams the corpus is read as; None: the world size      (default None)
    workers       tokenizing processes per rank (0: in the training process)   (default 1)
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Mapping

from shard.data import readers, tokenizer
from shard.data.sources import SOURCES, missing_files

FORMAT = 2  # bump when the files a spec produces change, so old cache entries are not reused (2: text paragraphs)
DEFAULTS = {"seed": 0, "documents": None, "files": None, "name": None, "config": None, "split": "train",
            "max_documents": None, "field": "text", "tokenizer": None, "vocab_size": None, "val_fraction": 0.01,
            "paths": None, "weights": None, "val_documents": 200, "streams": None, "workers": 1, "streaming": False}
REQUIRED = {"synthetic": ("documents",), "text": ("files",), "hf": ("name", "max_documents"), "files": ("paths",)}
STREAMED = ("files",)
# The keys each source reads beside tokenizer and vocab_size (hf: cached or streamed)
USES = {"synthetic": {"documents", "seed", "val_fraction"},
        "text": {"files", "field", "val_fraction"},
        "hf": {"name", "config", "split", "field", "streaming", "max_documents", "val_fraction", "val_documents",
               "streams", "workers"},
        "files": {"paths", "weights", "field", "val_documents", "streams", "workers"}}
MIN_VOCAB = 260  # 256 byte pieces, unk, eos and a few more


def _int(spec: dict, key: str, low: int) -> None:
    value = spec[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"data spec: {key} must be an int >= {low}, got {value!r}")


def normalize(spec: Mapping) -> dict:
    """The spec with defaults filled in, or ValueError saying which key is wrong and why."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"data spec must be a mapping, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(DEFAULTS) - {"source"})
    if unknown:
        raise ValueError(f"data spec: unknown key(s) {unknown}; known keys: {['source', *DEFAULTS]}")
    out = {**DEFAULTS, **spec}
    if out.get("source") not in SOURCES:
        raise ValueError(f"data spec: unknown source {out.get('source')!r}; valid sources: {list(SOURCES)}")
    ignored = sorted(k for k in set(spec) - USES[out["source"]] - {"source", "tokenizer", "vocab_size"}
                     if spec[k] != DEFAULTS[k])
    if ignored:   # (a '+data.key=' override for another source: it would be ignored, silently)
        raise ValueError(f"data spec: {', '.join(f'{k}={spec[k]!r}' for k in ignored)}: not read by source "
                         f"{out['source']!r}; " + "; ".join(
                             f"{k} is for source {' and '.join(s for s in USES if k in USES[s])}" for k in ignored))
    if out["streaming"] not in (True, False):
        raise ValueError(f"data spec: streaming must be true or false, got {out['streaming']!r}")
    if out["source"] == "hf" and out["streaming"]:   # streamed as data=files streams its paths
        out.update(source="files", paths=[readers.hub(out["name"], out["config"], out["split"])], weights=None)
    missing = [k for k in REQUIRED[out["source"]] if out[k] is None]
    if out["tokenizer"] in (None, "train") and out["vocab_size"] is None:
        missing.append("vocab_size (or a tokenizer)")
    if missing:
        raise ValueError(f"data spec: source {out['source']!r} needs {missing}")
    _int(out, "seed", -(1 << 63))
    if out["source"] == "synthetic":
        _int(out, "documents", 2)
    if out["source"] == "text":
        if isinstance(out["files"], (str, bytes)) or not out["files"]:
            raise ValueError(f"data spec: files must be a non-empty list of paths, got {out['files']!r}")
        out["files"] = [str(f) for f in out["files"]]
    if out["source"] == "hf":
        _int(out, "max_documents", 2)
    if out["source"] == "files":
        _streamed(out)
    _int(out, "val_documents", 1)   # the streamed sources' keys: checked wherever they are set
    _int(out, "workers", 0)
    if out["streams"] is not None:
        _int(out, "streams", 1)
    if out["tokenizer"] == "train":
        out["tokenizer"] = None
    if out["tokenizer"] is None:
        _int(out, "vocab_size", MIN_VOCAB)
    else:
        out["tokenizer"] = str(out["tokenizer"])
    if not isinstance(out["field"], str):
        raise ValueError(f"data spec: field must be a string, got {out['field']!r}")
    fraction = out["val_fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"data spec: val_fraction must be a number in (0, 1), got {fraction!r}")
    return out


def _streamed(out: dict) -> None:
    paths = out["paths"]
    if paths == "???":   # Hydra's mark of a value the config leaves to the command line
        raise ValueError("data spec: source 'files' needs paths: data.paths=[GLOB,...] (globs, files or directories)")
    if isinstance(paths, (str, bytes)) or not paths or not all(isinstance(p, str) for p in paths):
        raise ValueError(f"data spec: paths must be a non-empty list of globs, files or directories, got {paths!r}")
    weights = out["weights"]
    if weights is not None:
        if isinstance(weights, (str, bytes)) or len(weights) != len(paths) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in weights):
            raise ValueError(f"data spec: weights must be one positive number per path ({len(paths)}), or null for "
                             f"one source, got {weights!r}")
        out["weights"] = [float(w) for w in weights]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def identity(spec: dict) -> dict:
    """What determines the tokens of a normalized spec: its entries for the source, each
    local file's size and modification time, the tokenizer file's contents."""
    source = spec["source"]
    out = {"format": FORMAT, "source": source, "val_fraction": float(spec["val_fraction"])}
    if source == "synthetic":
        out.update(documents=spec["documents"], seed=spec["seed"])
    elif source == "text":
        missing = missing_files(spec["files"])
        if missing:
            raise FileNotFoundError(f"text source: no such file(s): {missing}")
        stats = [(str(Path(f).resolve()), Path(f).stat()) for f in spec["files"]]
        out.update(field=spec["field"], files=[{"path": p, "size": s.st_size, "mtime_ns": s.st_mtime_ns}
                                               for p, s in stats])
    else:
        out.update({k: spec[k] for k in ("name", "config", "split", "max_documents", "field")})
    if spec["tokenizer"] is None:
        out["vocab_size"] = spec["vocab_size"]
    else:
        out["tokenizer_sha256"] = {p.name: _sha256(p) for p in tokenizer.defining_files(spec["tokenizer"])}
    return out


def digest(identity: dict) -> str:
    """sha256 of the canonical JSON of an identity."""
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()
