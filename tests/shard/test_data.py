"""shard.data: synthetic corpus, tokenizer, packing, the prepare cache, token files, batches.

Checked against independent references: the source documents themselves (decoding the
packed tokens gives them back), plain numpy slicing of the token array (batches), and
set arithmetic over window start offsets (which windows each rank and step reads).
"""
import importlib
import json
import os
import re
import shutil

import numpy as np
import pytest
import sentencepiece as spm
import torch

from shard.data import Batches, DataError, TokenData, eval_batches, prepare, readers, synthetic_documents, tokenizer
from shard.data.pack import pack
from tests.shard.published_tokenizers import byte_bpe

SPEC = {"source": "synthetic", "documents": 200, "seed": 0, "vocab_size": 512, "val_fraction": 0.05}


@pytest.fixture(scope="module")
def docs():
    return synthetic_documents(200, seed=0)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def prepared(cache):
    return prepare(SPEC, cache)


@pytest.fixture(scope="module")
def data(prepared):
    return TokenData(prepared)


# --- synthetic corpus -------------------------------------------------------------------------

def test_synthetic_is_deterministic_and_seeded(docs):
    assert synthetic_documents(200, seed=0) == docs
    assert synthetic_documents(50, seed=0) == docs[:50]
    other = synthetic_documents(200, seed=1)
    assert not set(other) & set(docs)


def test_synthetic_has_learnable_structure(docs):
    assert all(500 <= len(d) <= 2000 for d in docs)
    words = {w for d in docs for w in d.split()}
    assert 100 < len(words) < 1000, "a small fixed vocabulary"
    sums = re.findall(r"(\d+) (plus|minus|times) (\d+) is (\d+) \.", "\n".join(docs))
    assert len(sums) > 100
    ops = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
    assert all(ops[op](int(a), int(b)) == int(c) for a, op, b, c in sums)
    numbers = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen " \
              "fifteen sixteen seventeen eighteen nineteen twenty".split()
    counts = re.findall(r"counted ([a-z ]+) \.", "\n".join(docs))
    assert len(counts) > 100
    for run in counts:
        values = [numbers.index(w) for w in run.split()]
        assert values == list(range(values[0], values[0] + len(values)))
    # Each document's cast, named in its first line, makes most of the names in the rest.
    names = set(re.findall(r"\b[A-Z][a-z]+\b", "\n".join(docs)))
    in_cast = mentions = 0
    for d in docs:
        title, body = d.split("\n", 1)
        cast = re.match(r"the story of (.*) in the", title).group(1).split(" and ")
        mentioned = [w for w in body.split() if w in names]
        in_cast, mentions = in_cast + sum(w in cast for w in mentioned), mentions + len(mentioned)
    assert in_cast > 0.75 * mentions and len(names) < 50


def test_synthetic_rejects_bad_count():
    with pytest.raises(ValueError, match="count"):
        synthetic_documents(-1)


# --- tokenizer --------------------------------------------------------------------------------

def test_tokenizer_round_trips_any_text(tmp_path, docs):
    tokenizer.train(docs, 512, tmp_path / "t.model")
    sp = tokenizer.load(tmp_path / "t.model")
    assert sp.vocab_size == 512
    assert (sp.eos_id, sp.prefix) == (1, ())
    assert (sp.processor.bos_id(), sp.processor.pad_id()) == (-1, -1)
    assert all(sp.decode(sp.encode(d)) == d for d in docs)
    odd = ["  two  spaces\n\nand\ttabs ", "unseen: 日本語 café 🙂", " leading space", ""]
    assert [sp.decode(sp.encode(t)) for t in odd] == odd
    assert sum(len(sp.encode(d)) for d in docs) < sum(len(d) for d in docs) / 2, "merges compress text"


def test_tokenizer_training_is_deterministic(tmp_path, docs):
    tokenizer.train(docs, 512, tmp_path / "a.model")
    tokenizer.train(docs, 512, tmp_path / "b.model")
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary files left"


def test_tokenizer_training_sample_spreads_over_corpus():
    documents = [f"doc{i}" for i in range(100)]
    assert tokenizer.training_sample(documents, max_chars=10_000) == documents
    sample = tokenizer.training_sample(documents, max_chars=100)
    assert sum(map(len, sample)) <= 100 and sample[0] == "doc0" and sample[-1] >= "doc90"


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_a_tokenizer_json_frames_documents_as_transformers_tokenizes_them(tmp_path, docs, style):
    from transformers import AutoTokenizer

    directory = byte_bpe(tmp_path, style)
    tok = tokenizer.load(directory)
    theirs = AutoTokenizer.from_pretrained(directory)
    eos = theirs.convert_tokens_to_ids("<|end_of_text|>" if style == "llama" else "<|endoftext|>")
    assert tok.eos_id == eos and tok.vocab_size == len(theirs) == 1000
    assert tok.prefix == ((0,) if style == "llama" else ())
    ids, ends = tok.frame(docs[:20], dtype=np.uint16)
    expected = [theirs(d)["input_ids"] + [eos] for d in docs[:20]]   # their template's BOS, then our end
    assert np.split(ids, ends[:-1]) and [a.tolist() for a in np.split(ids, ends[:-1])] == expected
    assert [tok.decode(a) for a in np.split(ids, ends[:-1])] == docs[:20]
    assert tokenizer.load(directory / "tokenizer.json").eos_id == eos, "the file, or its directory"


def test_a_tokenizer_json_saved_with_padding_and_truncation_frames_whole_documents(tmp_path, docs):
    """Published files often keep the padding and truncation they were last used with: a
    batch would pad short documents to the longest and cut long ones."""
    from tokenizers import Tokenizer

    directory = byte_bpe(tmp_path / "plain", "gpt2")
    rust = Tokenizer.from_file(str(directory / "tokenizer.json"))
    rust.enable_truncation(max_length=4)
    rust.enable_padding(pad_id=0, pad_token="<|endoftext|>")
    (tmp_path / "padded").mkdir()
    rust.save(str(tmp_path / "padded" / "tokenizer.json"))
    ids, ends = tokenizer.load(tmp_path / "padded").frame(docs[:8])
    plain, plain_ends = tokenizer.load(directory).frame(docs[:8])
    assert ids.tolist() == plain.tolist() and ends.tolist() == plain_ends.tolist()
    assert max(np.diff(ends, prepend=0)) > 5, "some document is longer than the truncation"


def test_bad_tokenizers_are_refused_with_the_reason(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer at .*absent.json"):
        tokenizer.load(tmp_path / "absent.json")
    with pytest.raises(FileNotFoundError, match="holds no tokenizer.json or tokenizer.model"):
        tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
        tokenizer.load(tmp_path)
    (tmp_path / "bad.model").write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        tokenizer.load(tmp_path / "bad.model")
    byte_bpe(tmp_path / "llama", "llama")
    (tmp_path / "llama" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
    with pytest.raises(ValueError, match="eos_token '<\\|eot\\|>' is not in tokenizer.json's vocabulary"):
        tokenizer.load(tmp_path / "llama")
    from tokenizers import Tokenizer, models, pre_tokenizers
    bare = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    bare.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(ValueError, match="no end-of-document token"):
        tokenizer.load(tmp_path / "bare.json")
    assert tokenizer.load(tmp_path / "bare.json", documents=False).eos_id is None, "text alone needs none"


# --- packing ----------------------------------------------------------------------------------

def _split_on(ids: np.ndarray, eos: int) -> list[list[int]]:
    """Token lists between eos ids; every document must end with one."""
    assert len(ids) and ids[-1] == eos
    ends = np.flatnonzero(ids == eos)
    return [ids[a + 1:b].tolist() for a, b in zip(np.r_[-1, ends[:-1]], ends)]


def test_pack_gives_back_the_documents(tmp_path, docs):
    tokenizer.train(docs, 512, tmp_path / "t.model")
    sp = tokenizer.load(tmp_path / "t.model")
    meta = pack(docs, sp, tmp_path, val_fraction=0.1)
    train = np.fromfile(tmp_path / "train.bin", dtype="<u2")
    val = np.fromfile(tmp_path / "val.bin", dtype="<u2")
    assert meta["dtype"] == "uint16" and meta["tokens"] == {"train": len(train), "val": len(val)}
    assert meta["documents"] == {"train": 180, "val": 20}
    assert (train == 1).sum() == 180 and (val == 1).sum() == 20, "one eos per document"
    decoded = [sp.decode(t) for t in _split_on(train, 1) + _split_on(val, 1)]
    assert decoded == docs, "the last documents are the validation split, in order"


def test_pack_keeps_at_least_one_document_per_split(tmp_path, docs):
    tokenizer.train(docs, 400, tmp_path / "t.model")
    sp = tokenizer.load(tmp_path / "t.model")
    assert pack(docs[:10], sp, tmp_path, val_fraction=0.001)["documents"] == {"train": 9, "val": 1}
    assert pack(docs[:2], sp, tmp_path, val_fraction=0.99)["documents"] == {"train": 1, "val": 1}
    with pytest.raises(ValueError, match="at least 2 documents"):
        pack(docs[:1], sp, tmp_path, val_fraction=0.5)


# --- prepare and TokenData --------------------------------------------------------------------

def test_prepared_entry(prepared, data, docs):
    assert prepared.name.startswith("synthetic-") and len(prepared.name) == len("synthetic-") + 12
    assert sorted(p.name for p in prepared.iterdir()) == ["meta.json", "tokenizer.model", "train.bin", "val.bin"]
    meta = json.loads((prepared / "meta.json").read_text())
    assert prepared.name.endswith(meta["spec_hash"][:12])
    assert data.vocab_size == 512 and data.eos_id == 1
    assert data.train.dtype == np.uint16 and data.val.dtype == np.uint16
    assert not data.train.flags.writeable
    assert int(max(data.train.max(), data.val.max())) < data.vocab_size
    texts = [data.decode(t) for t in _split_on(np.asarray(data.train), 1) + _split_on(np.asarray(data.val), 1)]
    assert texts == docs
    assert data.decode(torch.tensor(data.val[:50].astype(np.int64))) == data.tokenizer.decode(data.val[:50].tolist())


def test_prepare_reuses_a_complete_entry(prepared, cache, monkeypatch):
    stamps = {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()}

    def fail(*args, **kwargs):
        raise AssertionError("the tokenizer was trained again")
    monkeypatch.setattr(spm.SentencePieceTrainer, "train", fail)
    assert prepare(dict(SPEC), cache) == prepared
    assert {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()} == stamps


@pytest.mark.parametrize("change", [{"seed": 1}, {"documents": 150}, {"vocab_size": 400}, {"val_fraction": 0.1}])
def test_another_spec_gets_another_entry(prepared, cache, change):
    other = prepare({**SPEC, **change}, cache)
    assert other != prepared and TokenData(other).train.tobytes() != TokenData(prepared).train.tobytes()


def test_settings_that_change_nothing_share_the_entry(prepared, cache):
    assert prepare({**SPEC, "files": None, "name": None, "field": "text"}, cache) == prepared
    # another source's key set otherwise would be ignored: refused ('+data.streams=7' for synthetic data
    # trained as if it were not there)
    with pytest.raises(ValueError, match=r"name='unused', streams=7: not read by source 'synthetic'; name is for "
                                         r"source hf; streams is for source hf and files"):
        prepare({**SPEC, "name": "unused", "streams": 7}, cache)


def test_two_prepares_of_one_entry_at_once_both_get_it(tmp_path, monkeypatch):
    """A live prepare's temporary directory is not a crash's; and the prepare that finishes
    second finds the first one's entry in place, drops its own build and returns it."""
    import socket
    import subprocess

    prep = importlib.import_module("shard.data.prepare")
    entry = prepare(SPEC, tmp_path / "first")
    gone = subprocess.Popen(["true"])
    gone.wait()   # a process id that no longer runs
    live = tmp_path / "cache" / f".tmp-{entry.name}-{socket.gethostname()}-{os.getpid()}-0000aaaa"
    dead = tmp_path / "cache" / f".tmp-{entry.name}-{socket.gethostname()}-{gone.pid}-0000bbbb"
    elsewhere = tmp_path / "cache" / f".tmp-{entry.name}-another-host-{gone.pid}-0000cccc"
    for d in (live, dead, elsewhere):
        d.mkdir(parents=True)
    build = prep._build

    def raced(spec, ident, key, directory):   # the other prepare renames its build in first
        build(spec, ident, key, directory)
        shutil.copytree(entry, tmp_path / "cache" / entry.name)
    monkeypatch.setattr(prep, "_build", raced)
    assert prepare(SPEC, tmp_path / "cache") == tmp_path / "cache" / entry.name
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([entry.name, live.name, elsewhere.name])
    TokenData(tmp_path / "cache" / entry.name)


def test_crash_leaves_no_complete_looking_entry(tmp_path, monkeypatch):
    prep = importlib.import_module("shard.data.prepare")  # the module, not the function of that name

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while packing")
    monkeypatch.setattr(prep, "pack", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(SPEC, tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    # A hard kill leaves its temporary directory; a damaged entry lacks meta.json. Both are rebuilt over.
    entry = prepare(SPEC, tmp_path)
    (tmp_path / f".tmp-{entry.name}-dead").mkdir()
    (entry / "meta.json").unlink()
    with pytest.raises(DataError, match="meta.json"):
        TokenData(entry)
    assert prepare(SPEC, tmp_path) == entry
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]
    TokenData(entry)


def test_token_data_rejects_missing_or_damaged_directories(tmp_path, prepared):
    with pytest.raises(FileNotFoundError, match="no prepared data directory"):
        TokenData(tmp_path / "absent")
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in prepared.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    TokenData(copy)
    with open(copy / "train.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="train.bin"):
        TokenData(copy)
    (copy / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="damaged"):
        TokenData(copy)


def test_prepare_with_a_given_tokenizer(tmp_path, prepared, data, cache):
    model = tmp_path / "given.model"
    model.write_bytes((prepared / "tokenizer.model").read_bytes())
    spec = {"source": "synthetic", "documents": 200, "tokenizer": str(model), "val_fraction": 0.05}
    entry = prepare(spec, cache)
    assert entry != prepared
    assert np.array_equal(TokenData(entry).train, data.train)
    with pytest.raises(FileNotFoundError, match="missing.model"):
        prepare({**spec, "tokenizer": str(tmp_path / "missing.model")}, cache)


def test_prepare_with_a_published_tokenizer_directory(tmp_path, docs):
    directory = byte_bpe(tmp_path / "llama-tokenizer", "llama")
    spec = {"source": "synthetic", "documents": 200, "tokenizer": str(directory), "val_fraction": 0.05}
    entry = prepare(spec, tmp_path / "cache")
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "tokenizer.json", "tokenizer_config.json",
                                                      "train.bin", "val.bin"]
    data = TokenData(entry)
    tok = data.tokenizer
    assert (data.eos_id, tok.prefix, json.loads((entry / "meta.json").read_text())["prefix"]) == (1, (0,), [0])
    train = np.asarray(data.train)
    documents = _split_on(train, data.eos_id)
    assert all(d[0] == 0 for d in documents), "every document starts with the tokenizer's BOS"
    assert [data.decode(d) for d in documents] == docs[:190]
    assert prepare({**spec, "tokenizer": str(directory / "tokenizer.json")}, tmp_path / "cache") == entry
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|begin_of_text|>"}))
    assert prepare(spec, tmp_path / "cache") != entry, "another end-of-document token: other tokens"


def test_text_source_reads_txt_paragraphs_and_jsonl_records(tmp_path):
    story = synthetic_documents(12, seed=5)
    (tmp_path / "book.txt").write_text("\n\n".join(story[:6]) + "\n\n\n")
    with open(tmp_path / "records.jsonl", "w") as f:
        for i, text in enumerate(story[6:]):
            f.write(json.dumps({"id": i, "body": text}) + "\n")
        f.write(json.dumps({"id": 99, "body": ""}) + "\n")
        f.write(json.dumps({"id": 98, "body": None}) + "\n")   # skipped, as data=files skips it (was an error)
    spec = {"source": "text", "files": [str(tmp_path / "book.txt"), str(tmp_path / "records.jsonl")],
            "field": "body", "vocab_size": 400, "val_fraction": 0.2}
    entry = prepare(spec, tmp_path / "cache")
    data = TokenData(entry)
    texts = [data.decode(t) for t in _split_on(np.asarray(data.train), data.eos_id)
             + _split_on(np.asarray(data.val), data.eos_id)]
    assert texts == story, "paragraphs of the .txt, then the records' field, empty ones dropped"
    assert json.loads((entry / "meta.json").read_text())["documents"] == {"train": 10, "val": 2}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [entry.name]
    assert prepare(spec, tmp_path / "cache") == entry
    with open(tmp_path / "book.txt", "a") as f:
        f.write("one more paragraph\n")
    assert prepare(spec, tmp_path / "cache") != entry, "an edited file is another corpus"
    with pytest.raises(ValueError, match="'text'"):
        prepare({**spec, "field": "text"}, tmp_path / "cache")
    # a line of spaces or a tab is blank, as data=files has it (datasets' paragraphs needed an empty line)
    (tmp_path / "spaced.txt").write_text("one\nline two\n \npara two\n\t\npara three\n\n\n")
    data = TokenData(prepare({**spec, "files": [str(tmp_path / "spaced.txt")]}, tmp_path / "cache"))
    assert [data.decode(t) for t in _split_on(np.asarray(data.train), data.eos_id)
            + _split_on(np.asarray(data.val), data.eos_id)] == [
        text for _, text in readers.paragraphs(str(tmp_path / "spaced.txt"))] == ["one\nline two", "para two",
                                                                                 "para three"]
    # bytes that are not UTF-8: one line naming the file (datasets' traceback before, for .jsonl)
    (tmp_path / "latin.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "latin.jsonl").write_bytes(b'{"body": "caf\xe9"}\n')
    for name, message in (("latin.txt", "is not UTF-8 text"), ("latin.jsonl", "cannot be read as JSON lines")):
        with pytest.raises(ValueError, match=f"{name} {message}"):
            prepare({**spec, "files": [str(tmp_path / name)]}, tmp_path / "cache")


def test_bad_specs_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match=r"unknown source 'web'.*synthetic.*text.*hf"):
        prepare({"source": "web", "vocab_size": 512}, tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere.txt"):
        prepare({"source": "text", "files": [str(tmp_path / "nowhere.txt")], "vocab_size": 512}, tmp_path)
    with pytest.raises(ValueError, match="unsupported file type"):
        (tmp_path / "data.csv").write_text("a,b\n")
        prepare({"source": "text", "files": [str(tmp_path / "data.csv")], "vocab_size": 512}, tmp_path)
    with pytest.raises(ValueError, match="unknown key.*vocab-size"):
        prepare({**SPEC, "vocab-size": 512}, tmp_path)
    with pytest.raises(ValueError, match="needs.*documents"):
        prepare({"source": "synthetic", "vocab_size": 512}, tmp_path)
    with pytest.raises(ValueError, match="vocab_size"):
        prepare({"source": "synthetic", "documents": 10}, tmp_path)
    with pytest.raises(ValueError, match="val_fraction"):
        prepare({**SPEC, "val_fraction": 1.0}, tmp_path)
    with pytest.raises(ValueError, match="files must be"):
        prepare({"source": "text", "files": "a.txt", "vocab_size": 512}, tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("synthetic", "text", ".tmp"))]


# --- training batches -------------------------------------------------------------------------

def _starts(x: torch.Tensor, tokens: np.ndarray, seq_len: int) -> list[int]:
    """Window index of each row of x, found by comparing with the token array itself."""
    out = []
    for row in x:
        hits = [w for w in range((len(tokens) - 1) // seq_len)
                if np.array_equal(tokens[w * seq_len:w * seq_len + seq_len], row.numpy())]
        assert len(hits) == 1
        out.append(hits[0])
    return out


def _step_windows(batches: list[Batches], seq_len: int) -> list[int]:
    """The window indices one step reads over all ranks (tokens are a distinct-valued arange)."""
    windows = []
    for b in batches:
        for x, y in b.next_step():
            assert x.dtype == y.dtype == torch.int64 and x.shape == (b.micro_batch, seq_len)
            assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
            assert torch.all(x[:, 0] % seq_len == 0)
            windows += (x[:, 0] // seq_len).tolist()
    return windows


def test_batches_are_windows_shifted_by_one(data):
    b = Batches(data.train, seq_len=32, micro_batch=4, accumulation=2, rank=1, world=2, seed=3)
    pairs = b.next_step()
    assert len(pairs) == 2
    for x, y in pairs:
        assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
        for row_x, row_y, w in zip(x, y, _starts(x, np.asarray(data.train), 32)):
            window = torch.from_numpy(data.train[w * 32:w * 32 + 33].astype(np.int64))
            assert torch.equal(row_x, window[:-1]) and torch.equal(row_y, window[1:])


def test_every_window_is_visited_once_per_epoch_across_ranks():
    seq_len, windows = 4, 48
    tokens = np.arange(windows * seq_len + 3, dtype=np.int64)  # 3 spare tokens: still 48 windows
    world, micro, accumulation = 3, 2, 2
    ranks = [Batches(tokens, seq_len, micro, accumulation, r, world, seed=7) for r in range(world)]
    epoch = []
    for _ in range(windows // (world * micro * accumulation)):
        epoch += _step_windows(ranks, seq_len)
    assert sorted(epoch) == list(range(windows))
    assert epoch != sorted(epoch), "shuffled"
    assert all(b.epoch == 1 for b in ranks)
    second = []
    for _ in range(windows // (world * micro * accumulation)):
        second += _step_windows(ranks, seq_len)
    assert sorted(second) == list(range(windows)) and second != epoch, "a new order each epoch"


def test_the_global_batch_does_not_depend_on_the_world_size():
    seq_len = 4
    tokens = np.arange(50 * seq_len + 1, dtype=np.int64)  # 50 windows: steps of 8 straddle epochs
    two = [Batches(tokens, seq_len, micro_batch=2, accumulation=2, rank=r, world=2, seed=11) for r in range(2)]
    four = [Batches(tokens, seq_len, micro_batch=1, accumulation=2, rank=r, world=4, seed=11) for r in range(4)]
    one = [Batches(tokens, seq_len, micro_batch=8, accumulation=1, rank=0, world=1, seed=11)]
    for _ in range(15):
        a, b, c = _step_windows(two, seq_len), _step_windows(four, seq_len), _step_windows(one, seq_len)
        assert len(a) == 8 and sorted(a) == sorted(b) == sorted(c)
        assert len(set(a)) == 8 or two[0].consumed % 50 < 8, "repeats only across an epoch boundary"


def test_micro_batches_interleave_ranks():
    seq_len = 4
    tokens = np.arange(64 * seq_len + 1, dtype=np.int64)
    single = Batches(tokens, seq_len, micro_batch=6, accumulation=1, rank=0, world=1, seed=2)
    order = _step_windows([single], seq_len)
    # world 3, micro 1, accumulation 2: micro-batch m of rank r is position m * 3 + r.
    for r in range(3):
        b = Batches(tokens, seq_len, micro_batch=1, accumulation=2, rank=r, world=3, seed=2)
        assert _step_windows([b], seq_len) == [order[r], order[3 + r]]


def test_resume_continues_exactly(data):
    def make(seq_len=16, corpus="corpus-a"):
        return Batches(data.train, seq_len=seq_len, micro_batch=2, accumulation=3, rank=1, world=2, seed=5,
                       corpus=corpus)
    straight = make()
    for _ in range(4):
        straight.next_step()
    state = json.loads(json.dumps(straight.state_dict()))  # survives a checkpoint's JSON
    assert state == {"consumed": 4 * 12, "seed": 5, "seq_len": 16, "corpus": "corpus-a"}
    resumed = make()
    resumed.load_state_dict(state)
    for _ in range(3):
        for (x1, y1), (x2, y2) in zip(straight.next_step(), resumed.next_step()):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert resumed.state_dict() == straight.state_dict()
    with pytest.raises(ValueError, match="seed 6"):
        make().load_state_dict({"consumed": 0, "seed": 6})
    with pytest.raises(ValueError, match="saved with seq_len 16, these batches use 8"):
        make(seq_len=8).load_state_dict(state)
    with pytest.raises(ValueError, match="saved over the corpus 'corpus-a', these batches read 'corpus-b'"):
        make(corpus="corpus-b").load_state_dict(state)
    make().load_state_dict({"consumed": 0, "seed": 5})   # a state saved before seq_len and corpus were kept


def test_batches_refuse_a_corpus_smaller_than_a_global_batch():
    tokens = np.arange(8 * 4, dtype=np.int64)  # 7 windows of 4+1
    with pytest.raises(ValueError, match="needs at least 33 tokens"):
        Batches(tokens, seq_len=4, micro_batch=2, accumulation=2, rank=0, world=2, seed=0)
    Batches(np.arange(33), seq_len=4, micro_batch=2, accumulation=2, rank=0, world=2, seed=0)
    with pytest.raises(ValueError, match="rank"):
        Batches(tokens, seq_len=4, micro_batch=1, accumulation=1, rank=2, world=2, seed=0)
    with pytest.raises(ValueError, match="1-D"):
        Batches(tokens.reshape(4, 8), seq_len=4, micro_batch=1, accumulation=1, rank=0, world=1, seed=0)


# --- evaluation batches -----------------------------------------------------------------------

def test_eval_batches_are_one_set_shared_out_whatever_the_world_size():
    # the validation set is the first count micro-batches of windows, in order, on any number
    # of ranks: every rank runs as many forwards (a sharded forward is collective), the ones
    # past its share repeated and not counted
    seq_len, micro_batch, count = 4, 3, 5
    tokens = np.arange(40 * seq_len + 1, dtype=np.int64)
    expected = list(range(count * micro_batch))
    for world in (1, 2, 3, 4, 7):
        counted, lengths = [], set()
        for r in range(world):
            a = eval_batches(tokens, seq_len, micro_batch=micro_batch, rank=r, world=world, count=count)
            b = eval_batches(tokens, seq_len, micro_batch=micro_batch, rank=r, world=world, count=count)
            assert all(torch.equal(x1, x2) and torch.equal(y1, y2) and c1 == c2
                       for (x1, y1, c1), (x2, y2, c2) in zip(a, b)), "fixed"
            assert all(torch.equal(y[:, :-1], x[:, 1:]) and x.shape == (3, 4) for x, y, _ in a)
            lengths.add(len(a))
            counted += [w for x, _, c in a if c for w in (x[:, 0] // seq_len).tolist()]
        assert lengths == {-(-count // world)}, f"world {world}: every rank runs as many forwards"
        assert sorted(counted) == expected, f"world {world}: the first windows, each once"


def test_eval_batches_wrap_around_a_small_split(data):
    small = eval_batches(np.arange(11), seq_len=4, micro_batch=3, rank=0, world=1, count=2)
    assert [x[:, 0].tolist() for x, _, _ in small] == [[0, 4, 0], [4, 0, 4]]
    real = eval_batches(data.val, seq_len=64, micro_batch=2, rank=1, world=2, count=2)
    assert real[0][0].shape == (2, 64)
    # the key each source takes (data=files has no val_fraction: the advice failed as an override)
    with pytest.raises(ValueError, match="fewer than one window .*data.val_fraction; data.val_documents for "
                                         "data=files"):
        eval_batches(np.arange(4), seq_len=4, micro_batch=1, rank=0, world=1, count=1)
