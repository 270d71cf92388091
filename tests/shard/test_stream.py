"""Streaming data (shard/data/readers.py, feed.py, workers.py, stream.py), against
independent references: the documents as written (every file kind reads back what was
written), a stream's rows against the documents of its pieces, framed and concatenated by
hand, and the rows of a step as one set, whatever the world size, the workers, or a resume
from a saved position."""
import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from shard.data import readers, synthetic_documents, tokenizer
from shard.data.feed import FeedSpec, order
from shard.data.pretokenize import tokenize_corpus
from shard.data.stream import Corpus, StreamingBatches
from tests.shard.published_tokenizers import byte_bpe

DOCS = synthetic_documents(360, seed=3)


def write_corpus(d: Path) -> Path:
    """DOCS over every kind of file: jsonl, jsonl.gz, jsonl.zst, txt and parquet of 3 row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    d.mkdir(parents=True, exist_ok=True)
    lines = lambda docs: "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs))  # noqa: E731
    (d / "a.jsonl").write_text(lines(DOCS[:80]))
    with gzip.open(d / "b.jsonl.gz", "wt") as f:
        f.write(lines(DOCS[80:140]))
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines(DOCS[140:200]).encode()))
    (d / "d.txt").write_text("\n\n".join(DOCS[200:260]) + "\n")
    pq.write_table(pa.table({"text": DOCS[260:]}), d / "e.parquet", row_group_size=40)
    return d


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return str(byte_bpe(tmp_path_factory.mktemp("tok"), "llama") / "tokenizer.json")


def corpus(corpus_dir, tok_path, **settings) -> Corpus:
    values = dict(sources=((str(corpus_dir / "*"),),), weights=(1.0,), field="text", tokenizer=tok_path,
                  val_documents=5)
    return Corpus(**{**values, **settings})


def test_every_file_kind_reads_back_its_documents_from_any_record(corpus_dir):
    pieces = readers.pieces([str(corpus_dir / "*")])
    assert [(Path(p.path).name, p.kind, p.rows) for p in pieces] == [
        ("a.jsonl", "jsonl", None), ("b.jsonl.gz", "jsonl", None), ("c.jsonl.zst", "jsonl", None),
        ("d.txt", "text", None), ("e.parquet", "parquet", (0, 40)), ("e.parquet", "parquet", (40, 80)),
        ("e.parquet", "parquet", (80, 100))]
    texts = [t for p in pieces for _, t in readers.read(p, "text")]
    assert texts == DOCS
    assert [i for i, _ in readers.read(pieces[0], "text", start=77)] == [77, 78, 79]
    assert [t for _, t in readers.read(pieces[5], "text", start=75)] == DOCS[260 + 75:260 + 80]
    assert [t for _, t in readers.read(pieces[3], "text", start=58)] == DOCS[258:260]
    assert [t for _, t in readers.read(pieces[0], "text", held_out=78)] == DOCS[78:80]
    strided = readers.split(pieces[:1], 3)
    assert [p.stride for p in strided] == [(0, 3), (1, 3), (2, 3)]
    parts = [[i for i, _ in readers.read(p, "text")] for p in strided]
    assert sorted(sum(parts, [])) == list(range(80)) and parts[1][:2] == [1, 4]
    assert readers.split(pieces, 7) == pieces, "as many for each stream: not split"
    assert len(readers.split(pieces, 4)) == 28, "7 among 4 streams: cut in 4, 7 each"
    assert len(readers.split(pieces * 10, 8)) == 140, "70 among 8 (8 or 9 each): cut in 2, 17 or 18 each"
    assert readers.split(pieces * 20, 8) == pieces * 20, "140 among 8: 17 or 18 each, within 1/10"


def test_a_datasets_directory_reads_in_pieces_of_rows(tmp_path, monkeypatch):
    import datasets

    datasets.Dataset.from_dict({"text": DOCS[:50], "n": list(range(50))}).save_to_disk(str(tmp_path / "ds"))
    monkeypatch.setattr(readers, "ROWS_PER_PIECE", 20)
    pieces = readers.pieces([str(tmp_path / "ds")])
    assert [(p.kind, p.rows) for p in pieces] == [("arrow", (0, 20)), ("arrow", (20, 40)), ("arrow", (40, 50))]
    assert [t for p in pieces for _, t in readers.read(p, "text")] == DOCS[:50]
    assert [i for i, _ in readers.read(pieces[1], "text", start=37)] == [37, 38, 39]


def test_a_directory_reads_its_data_not_its_card_and_each_file_once(tmp_path, corpus_dir):
    """A downloaded dataset: its card (README.md), licence and download cache beside the
    data are not documents; a directory of several kinds of files is the user's to narrow;
    `**` names the files under it, and overlapping patterns each file once."""
    import shutil

    d = tmp_path / "dataset"
    (d / "data").mkdir(parents=True)
    (d / ".cache" / "huggingface").mkdir(parents=True)
    for name in ("README.md", "LICENSE.txt", ".cache/huggingface/notes.txt"):
        (d / name).write_text("---\nlicense: mit\n---\n# Dataset card\n")
    shutil.copy(corpus_dir / "e.parquet", d / "data" / "train-0.parquet")
    assert readers.files([str(d)]) == [d / "data" / "train-0.parquet"]
    assert readers.files([str(d / "**" / "*.parquet")]) == [d / "data" / "train-0.parquet"]
    (d / "data" / "notes.txt").write_text("a stray text file\n")
    with pytest.raises(readers.CorpusError, match="holds corpus files of several kinds \\(parquet, text"):
        readers.files([str(d)])
    assert readers.files([str(d / "data" / "*.parquet"), str(d / "data" / "train-*")]) == [
        d / "data" / "train-0.parquet"]
    assert readers.files([str(d / "data" / "**")]) == [d / "data" / "notes.txt", d / "data" / "train-0.parquet"]
    # one file spelled two ways (relative and absolute, through `..`, through a link) is one
    # file: read twice, its held-out documents were trained on
    (tmp_path / "link").symlink_to(d / "data")
    spellings = [str(d / "data" / "train-0.parquet"), str(d / "data" / ".." / "data" / "train-0.parquet"),
                 str(tmp_path / "link" / "train-0.parquet"), os.path.relpath(d / "data" / "train-0.parquet")]
    assert readers.files(spellings) == [d / "data" / "train-0.parquet"]


def test_a_truncated_or_damaged_compressed_file_is_an_error_naming_it(tmp_path):
    """An interrupted download: gzip raises at the cut; zstandard's own reader ended there
    quietly and lost the documents after it. Several frames, as `zstd` writes large files in,
    read whole."""
    import zstandard

    lines = "".join(json.dumps({"text": t}) + "\n" for t in DOCS[:200]).encode()
    frames = [zstandard.ZstdCompressor().compress(lines[a:a + 5000]) for a in range(0, len(lines), 5000)]
    (tmp_path / "whole.jsonl.zst").write_bytes(b"".join(frames))
    piece, = readers.pieces([str(tmp_path / "whole.jsonl.zst")])
    assert [t for _, t in readers.read(piece, "text")] == DOCS[:200]
    (tmp_path / "cut.jsonl.zst").write_bytes(b"".join(frames)[:-40])
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(lines)[:-40])
    (tmp_path / "bad.jsonl.zst").write_bytes(frames[0][:20] + bytes(40) + frames[0][60:])
    for name in ("cut.jsonl.zst", "cut.jsonl.gz", "bad.jsonl.zst"):
        piece, = readers.pieces([str(tmp_path / name)])
        with pytest.raises(readers.CorpusError, match=f"{name} cannot be read \\((past record|before its first)"):
            list(readers.read(piece, "text"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    piece, = readers.pieces([str(tmp_path / "latin1.txt")])
    # (it said "cannot be read after record -1")
    with pytest.raises(readers.CorpusError, match="latin1.txt is not UTF-8 text \\(before its first record\\): "
                                                  "UnicodeDecodeError"):
        list(readers.read(piece, "text"))


def test_bad_corpora_are_named_with_the_reason(tmp_path, corpus_dir):
    with pytest.raises(readers.CorpusError, match="matches no file"):
        readers.pieces([str(tmp_path / "nothing-*.jsonl")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(readers.CorpusError, match="not corpus files"):
        readers.pieces([str(tmp_path / "x.csv")])
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": null}\n{"body": "no text"}\nnot json\n'
                                        '{"text": 3}\n')
    piece, = readers.pieces([str(tmp_path / "bad.jsonl")])
    with pytest.raises(readers.CorpusError, match="line 3 has no field 'text'.*body"):
        list(readers.read(piece, "text"))
    (tmp_path / "nulls.jsonl").write_text('{"text": "a"}\n{"text": null}\n{"text": "b"}\n')
    nulls, = readers.pieces([str(tmp_path / "nulls.jsonl")])
    assert list(readers.read(nulls, "text")) == [(0, "a"), (2, "b")]   # a null is skipped, as in parquet
    with pytest.raises(readers.CorpusError, match="line 4 is not JSON"):
        list(readers.read(piece, "text", start=3))
    with pytest.raises(readers.CorpusError, match="record 4's 'text' is int, expected a string"):
        list(readers.read(piece, "text", start=4))
    piece = readers.pieces([str(corpus_dir / "e.parquet")])[0]
    with pytest.raises(readers.CorpusError, match="no column 'body'"):
        list(readers.read(piece, "body"))


def framed(tok_path: str, texts: list[str]) -> np.ndarray:
    ids, _ = tokenizer.load(tok_path).frame(texts, dtype=np.int64)
    return ids


def test_a_stream_packs_its_pieces_documents_in_order_into_rows(corpus_dir, tok_path):
    """One stream: its rows, each starting on the previous row's last token, are the framed
    documents of its pieces in the epoch's order, the held-out ones left out, epoch after epoch."""
    c = corpus(corpus_dir, tok_path)
    batches = StreamingBatches(c, seq_len=64, micro_batch=2, accumulation=1, rank=0, world=1, seed=7, streams=1,
                               workers=0)
    spec = FeedSpec(tuple(batches.pieces[0]), "text", tok_path, 7, 0, 0, 1, batches.held_out)
    path, held = batches.held_out
    assert (Path(path).name, held) == ("a.jsonl", 5)
    assert np.array_equal(batches.validation(), framed(tok_path, DOCS[:5]))
    expected = []
    for epoch in range(2):
        for p in order(spec, epoch):
            piece = batches.pieces[0][p]
            expected += [t for _, t in readers.read(piece, "text", held_out=held if piece.path == path else 0)]
    stream = framed(tok_path, expected)
    steps = len(stream) // (2 * 64) - 2   # into the second epoch
    rows = np.concatenate([np.concatenate([x, y[:, -1:]], axis=1) for _ in range(steps)
                           for x, y in batches.next_step()])
    flat = np.concatenate([rows[0, :1], rows[:, 1:].reshape(-1)])
    assert np.array_equal(flat, stream[:len(flat)])
    assert batches.epoch == 1
    batches.close()


def step_rows(batches: list[StreamingBatches], steps: int) -> list[list[tuple]]:
    """Per step, every rank's rows (input and its last target) as one sorted list."""
    out = []
    for _ in range(steps):
        rows = []
        for b in batches:
            for x, y in b.next_step():
                rows += [tuple(r) + (int(t),) for r, t in zip(x.tolist(), y[:, -1].tolist())]
        out.append(sorted(rows))
    return out


def ranks(c: Corpus, world: int, streams: int = 4, workers: int = 0, seed: int = 0, global_batch: int = 8):
    return [StreamingBatches(c, 32, 2, global_batch // (2 * world), r, world, seed, streams, workers)
            for r in range(world)]


def merged_state(batches: list[StreamingBatches]) -> dict:
    """What train.py saves: rank 0's state with every rank's positions."""
    state = batches[0].state_dict()
    for b in batches[1:]:
        state["positions"].update(b.state_dict()["positions"])
    return json.loads(json.dumps(state))   # as a checkpoint's meta.json gives it back


def test_a_step_reads_the_same_rows_at_any_world_size_with_any_workers(corpus_dir, tok_path):
    c = corpus(corpus_dir, tok_path)
    reference = step_rows(ranks(c, 1), 6)
    assert step_rows(ranks(c, 2), 6) == reference
    four = ranks(c, 4, workers=1)
    assert step_rows(four, 6) == reference
    assert all(b.waited_s >= 0 for b in four)
    for b in four:
        b.close()
    assert step_rows(ranks(c, 1, seed=1), 6) != reference, "another seed, another order"
    rows = [r for step in reference for r in step]
    assert len(set(rows)) == len(rows), "no row twice"
    held_out = framed(tok_path, DOCS[:5])
    assert not any(np.array_equal(held_out[i:i + 33], r) for r in map(np.array, rows)
                   for i in range(0, len(held_out) - 33, 97)), "validation documents are not trained on"


@pytest.mark.parametrize("world_after", [2, 4])
def test_a_resumed_stream_reads_exactly_what_the_uninterrupted_one_would(corpus_dir, tok_path, world_after):
    c = corpus(corpus_dir, tok_path)
    uninterrupted = step_rows(ranks(c, 2), 9)
    first = ranks(c, 2)
    assert step_rows(first, 4) == uninterrupted[:4]
    state = merged_state(first)
    after = ranks(c, world_after, workers=1 if world_after == 4 else 0)
    for b in after:
        b.load_state_dict(state)
    assert step_rows(after, 5) == uninterrupted[4:]
    for b in after:
        b.close()


def test_a_mixture_draws_sources_by_weight_and_resumes_mid_document(corpus_dir, tok_path):
    """Two sources weighted 3:1: about three quarters of the documents from the first; and a
    position saved with rows cut through documents resumes exactly."""
    c = corpus(corpus_dir, tok_path, sources=((str(corpus_dir / "*.jsonl*"),), (str(corpus_dir / "e.parquet"),)),
               weights=(3.0, 1.0))
    reference = step_rows(ranks(c, 1, streams=2), 8)
    first = ranks(c, 1, streams=2)
    step_rows(first, 3)
    state = merged_state(first)
    assert any(v[1] > 0 for v in state["positions"].values()), "a row starts inside a document"
    resumed = ranks(c, 2, streams=2)
    for b in resumed:
        b.load_state_dict(state)
    assert step_rows(resumed, 5) == reference[3:]
    stream = first[0]._streams[0]
    drawn = [stream._source(n) for n in range(4000)]
    assert 0.72 < drawn.count(0) / len(drawn) < 0.78


def test_streams_that_do_not_fit_the_world_or_the_batch_are_refused_before_reading(corpus_dir, tok_path):
    c = corpus(corpus_dir, tok_path)
    with pytest.raises(ValueError, match="4 streams, which 3 ranks cannot share"):
        StreamingBatches(c, 32, 2, 1, 0, 3, 0, streams=4)
    with pytest.raises(ValueError, match="must be a multiple of the world size and divide the global batch"):
        StreamingBatches(c, 32, 1, 1, 0, 2, 0, streams=4)
    b = StreamingBatches(c, 32, 2, 2, 0, 2, 0, streams=4, workers=0)
    state = merged_state(ranks(c, 1))
    with pytest.raises(ValueError, match="saved with seed"):
        StreamingBatches(c, 32, 2, 2, 0, 2, 1, streams=4, workers=0).load_state_dict(state)
    changed = json.loads(json.dumps(state))
    changed["corpus"][0][0]["bytes"] += 1
    with pytest.raises(ValueError, match="the corpus changed"):
        b.load_state_dict(changed)
    recut = {**state, "pieces": [p + 1 for p in state["pieces"]]}
    with pytest.raises(ValueError, match="cut into .* pieces, this run cuts them into"):
        b.load_state_dict(recut)
    # positions are token offsets: another tokenizer's (data.tokenizer swapped, same vocabulary size) are refused
    with pytest.raises(ValueError, match="saved with another tokenizer"):
        b.load_state_dict({**state, "tokenizer": "0" * 64})
    b.load_state_dict({k: v for k, v in state.items() if k != "tokenizer"})   # saved before it was kept: taken
    with pytest.raises(ValueError, match="data.weights must be one positive number per source"):
        corpus(corpus_dir, tok_path, weights=(1.0, 2.0))


def test_a_file_validation_holds_out_whole_leaves_the_others_to_train_on_for_good(tmp_path, tok_path):
    """The first file, shorter than val_documents, is all validation's: the stream trains on
    the second, epoch after epoch. Only a source whose every piece gives nothing is refused."""
    for name, first in (("a", 0), ("b", 10)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"story {i} ."}) + "\n"
                                                        for i in range(first, 40 if first else 10)))
    for seed in range(3):   # the order of the two files, drawn per epoch
        with pytest.warns(UserWarning, match="val_documents=20, but the first file .*a.jsonl holds 10"):
            b = StreamingBatches(Corpus(((str(tmp_path / "*.jsonl"),),), (1.0,), "text", tok_path, 20), 32, 2, 1, 0,
                                 1, seed, streams=1, workers=0)
        assert b.held_out == (str(tmp_path / "a.jsonl"), 10)
        for _ in range(60):
            b.next_step()
        assert b.epoch >= 10
        b.close()
    # the corpus' only file, all held out: refused as the batches are made (a traceback at step 1 before)
    with pytest.raises(readers.CorpusError, match="val_documents=20 holds out all 10 documents of .*a.jsonl, the "
                                                  "corpus' only file: none is left to train on"):
        StreamingBatches(Corpus(((str(tmp_path / "a.jsonl"),),), (1.0,), "text", tok_path, 20), 32, 2, 1, 0, 1, 0,
                         streams=1, workers=0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_text(json.dumps({"text": "  "}) + "\n")
    (tmp_path / "empty" / "b.jsonl").write_text("\n")
    b = StreamingBatches(Corpus(((str(tmp_path / "b.jsonl"),), (str(tmp_path / "empty" / "*"),)), (1.0, 1.0),
                                "text", tok_path, 1), 32, 1, 1, 0, 1, 0, streams=1, workers=0)
    with pytest.raises(readers.CorpusError, match="source 1 has no documents for stream 0 in its 2 piece"):
        for _ in range(10):
            b.next_step()


def test_a_file_without_the_field_stops_the_run_at_the_start_not_when_reached(tmp_path, tok_path):
    """A corpus whose later files name their text otherwise (a mixture of exports): every
    file's columns, or first record, are checked when the batches are made, before a step."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS[:20]))
    (tmp_path / "z.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in DOCS[20:40]))
    pq.write_table(pa.table({"content": DOCS[40:60]}), tmp_path / "z.parquet")
    for late, message in (("z.jsonl", "z.jsonl: line 1 has no field 'text'.*content"),
                          ("z.parquet", "z.parquet: no column 'text'.*content")):
        c = Corpus(((str(tmp_path / "a.jsonl"), str(tmp_path / late)),), (1.0,), "text", tok_path, 2)
        with pytest.raises(readers.CorpusError, match=message):
            StreamingBatches(c, 32, 1, 1, 0, 1, 0, streams=1, workers=0)
        out = tmp_path / f"tokens-{late}"
        with pytest.raises(readers.CorpusError, match=message):
            tokenize_corpus([str(tmp_path / "a.jsonl"), str(tmp_path / late)], tok_path, out)
        assert not out.exists() and not list(tmp_path.glob(".tmp-*")), "nothing written"


def test_a_worker_that_fails_says_why(tmp_path, tok_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS[:20]) + "{broken\n")
    c = Corpus(((str(tmp_path / "a.jsonl"),),), (1.0,), "text", tok_path, 2)
    for workers in (0, 1):
        b = StreamingBatches(c, 32, 1, 1, 0, 1, 0, streams=1, workers=workers)
        with pytest.raises(readers.CorpusError, match="line 21 is not JSON"):
            for _ in range(100):
                b.next_step()
        b.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_corpus_tokenized_once_streams_the_same_rows_as_its_text(corpus_dir, tok_path, tmp_path, workers):
    """shard-data prepare's token shards (any number of workers) streamed in place of the
    text: the same rows, the same held-out documents, exactly."""
    from shard.tools.data import main as shard_data

    out = tmp_path / "tokens"
    assert shard_data(["prepare", str(corpus_dir / "*"), "--tokenizer", tok_path, "--out", str(out),
                       "--workers", str(workers)]) == 0
    manifest = json.loads((out / "tokens.json").read_text())
    assert manifest["documents"] == len(DOCS) and len(manifest["shards"]) == 7
    assert (out / "tokenizer.json").read_bytes() == Path(tok_path).read_bytes()
    text = ranks(corpus(corpus_dir, tok_path), 2)
    tokens = ranks(corpus(corpus_dir, tok_path, sources=((str(out),),)), 2)
    assert np.array_equal(tokens[0].validation(), text[0].validation())
    assert step_rows(tokens, 12) == step_rows(text, 12)
    # validation asks more than the first file holds: all of it, and none of the next file,
    # as the text is held out (the directory's shards were all "the first file")
    first = manifest["shards"][0]["documents"]
    with pytest.warns(UserWarning, match=f"holds {first}: validation takes those"):
        text = ranks(corpus(corpus_dir, tok_path, val_documents=first + 3), 2)
        tokens = ranks(corpus(corpus_dir, tok_path, sources=((str(out),),), val_documents=first + 3), 2)
    assert tokens[0].held_out[1] == text[0].held_out[1] == first
    assert np.array_equal(tokens[0].validation(), text[0].validation())
    assert step_rows(tokens, 12) == step_rows(text, 12)
    # more streams than pieces: each piece cut into strided ones, of the text's records
    text = ranks(corpus(corpus_dir, tok_path), 2, streams=16, global_batch=16)
    tokens = ranks(corpus(corpus_dir, tok_path, sources=((str(out),),)), 2, streams=16, global_batch=16)
    assert step_rows(tokens, 6) == step_rows(text, 6)
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        tokenize_corpus([str(corpus_dir / "*")], tok_path, out)
    (tmp_path / "empty.jsonl").write_text("")   # no documents: no directory no run could train on (was exit 0)
    with pytest.raises(readers.CorpusError, match="empty.jsonl: no documents"):
        tokenize_corpus([str(tmp_path / "empty.jsonl")], tok_path, tmp_path / "none", workers=0)
    assert not (tmp_path / "none").exists()
    other = byte_bpe(tmp_path / "other", "gpt2")
    with pytest.raises(readers.CorpusError, match="tokenized with another tokenizer"):
        corpus_of_tokens = corpus(corpus_dir, str(other / "tokenizer.json"), sources=((str(out),),))
        StreamingBatches(corpus_of_tokens, 32, 2, 1, 0, 1, 0, 1, workers=0)


def test_a_streamed_hugging_face_dataset_gives_the_rows_its_files_give(corpus_dir, tok_path):
    """data=hf streaming=true reads a dataset's shards through `datasets` streaming: here the
    "json" builder over three local files (the Hub needs the network), against the same
    files read directly. The spec becomes the streamed source's."""
    from shard.data.spec import normalize

    parts = [str(corpus_dir / n) for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst")]
    spec = normalize({"source": "hf", "name": "json", "streaming": True, "vocab_size": 512})
    assert spec["source"] == "files" and spec["paths"] == [readers.hub("json", None, "train")]
    streamed = readers.hub("json", None, "train", data_files=parts)
    assert [p.group for p in readers.pieces([streamed])] == [0, 1, 2]
    direct = ranks(corpus(corpus_dir, tok_path, sources=(tuple(parts),)), 1, streams=2)
    hub = ranks(corpus(corpus_dir, tok_path, sources=((streamed,),)), 2, streams=2)
    assert step_rows(hub, 8) == step_rows(direct, 8)
    with pytest.raises(readers.CorpusError, match="cannot be streamed"):
        readers.pieces([readers.hub("json", None, "train", data_files=[str(corpus_dir / "none.jsonl")])])


def test_a_worker_ends_with_the_training_process_that_started_it(corpus_dir, tok_path):
    """A rank killed outright (SIGKILL: no close()) leaves no worker behind: its worker sees
    its pipes close and exits."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (f"import time\nfrom shard.data.stream import Corpus, StreamingBatches\n"
              f"c = Corpus((({str(corpus_dir / '*')!r},),), (1.0,), 'text', {tok_path!r}, 5)\n"
              "b = StreamingBatches(c, 32, 1, 1, 0, 1, 0, 1, workers=1)\nb.next_step()\n"
              "print(b._feeds.workers[0].proc.pid, flush=True)\ntime.sleep(120)\n")
    rank = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    worker = int(rank.stdout.readline())
    os.kill(worker, 0)   # running
    rank.send_signal(signal.SIGKILL)
    rank.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:   # gone, or a zombie that a container's init has not reaped yet: ended either way
            if "State:\tZ" in Path(f"/proc/{worker}/status").read_text():
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    raise AssertionError(f"worker {worker} still runs 20 s after its rank was killed")
