"""shard-export and shard-generate as a user runs them: a snapshot that a one-rank engine
wrote goes out as a Hugging Face directory that transformers loads with our logits, and
text comes back from a Hugging Face directory with its tokenizer.json, as transformers'
greedy decoding gives it."""
import json
import os
import weakref
from dataclasses import asdict

import pytest
import torch
import transformers

from shard.engine import checkpoint
from shard.engine.engine import Engine
from shard.engine.optimizer import ShardedAdamW
from shard.models import GPT, GPTConfig
from shard.tools import export
from shard.tools import generate as generate_tool
from tests.models.test_generate import transformers_greedy
from tests.models.test_hf import random_hf_model
from tests.shard.published_tokenizers import byte_bpe


def test_shard_export_writes_what_transformers_loads(comm, engines, tmp_path, capsys, monkeypatch):
    cfg = GPTConfig.preset("llama_tiny", vocab=96, context=32)
    model = GPT(cfg, seed=4)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
    engine = Engine(model, comm, strategy="zero3")
    engines.append(engine)
    checkpoint.save(engine, ShardedAdamW(engine), tmp_path / "run" / "checkpoints", extra={"config": asdict(cfg)})
    # the run's config.yaml names its tokenizer (a tokenizer.json with its config): it goes out beside the weights
    tokenizer = byte_bpe(tmp_path / "tokenizer", "llama", vocab=300) / "tokenizer.json"
    (tmp_path / "run" / "config.yaml").write_text(f"built:\n  tokenizer: {tokenizer}\n")
    # a live run's retention as the export has verified and opened the files: the snapshot is
    # still pinned (its manifest is read next), so the run leaves it to a later save
    verified = checkpoint.parameters

    def then_retention(snap):
        params = verified(snap)
        assert not checkpoint.remove_unread(snap)
        return params
    monkeypatch.setattr(checkpoint, "parameters", then_retention)
    assert export.main([str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    assert "parameters" in capsys.readouterr().out and (tmp_path / "hf" / "config.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (tokenizer.parent / name).read_bytes()
    # its ids: transformers' generate() stops at the end-of-text token the run's data ended documents with
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)   # <|begin_of_text|>, <|end_of_text|>
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id == 1
    text = "Alice found the old lamp ."
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(tokenizer.parent)(text)["input_ids"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        assert (theirs(tokens).logits - ours).abs().max().item() <= 1e-4
    # shard-generate builds the same model from the snapshot, reading one parameter at a time
    read_by_name = checkpoint.parameter_reader
    alive = []

    def reader(snap):
        names, read = read_by_name(snap)
        assert not checkpoint.remove_unread(snap), "shard-generate reads the manifest next: still pinned"

        def one(name):
            assert all(ref() is None for ref in alive), "a parameter read before is still held"
            values = read(name)
            alive.append(weakref.ref(values))
            return values
        return names, one
    monkeypatch.setattr(checkpoint, "parameter_reader", reader)
    sampler, _ = generate_tool.load(tmp_path / "run", "cpu", None)
    assert len(alive) == len(list(model.parameters()))
    with torch.no_grad():
        assert torch.equal(sampler(tokens), ours)
    assert export.main([str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2   # not empty: refused
    assert "exists and is not empty" in capsys.readouterr().err
    assert export.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2   # bad input: 2, as README says
    assert "no checkpoint at" in capsys.readouterr().err
    cut = tmp_path / "run" / "checkpoints" / "snap-00000009-00000000000000ab"   # a save cut short: no manifest
    cut.mkdir()
    assert export.main([str(cut), "--out", str(tmp_path / "x")]) == 2   # (it said: "LATEST is missing")
    assert f"{cut / 'meta.json'} is missing (the snapshot is incomplete)" in capsys.readouterr().err
    # a damaged run's files: one line and exit 2 (were tracebacks), and a recorded tokenizer
    # that is gone is no export without one
    config = tmp_path / "run" / "config.yaml"
    for text, message in ((": : :", "config.yaml is not the run's YAML: "),
                          ("- a", "config.yaml is not the run's configuration (a YAML list, not a mapping)"),
                          ("built:\n  tokenizer: /nonexistent/tok.json\n", "the run's tokenizer /nonexistent/tok.json "
                                                                            "(its config.yaml's built.tokenizer) is "
                                                                            "gone")):
        config.write_text(text)
        assert export.main([str(tmp_path / "run"), "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err, text
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit) as refused:   # it wrote one file per tensor
        export.main([str(tmp_path / "run"), "--out", str(tmp_path / "y"), "--shard-size", "0"])
    assert refused.value.code == 2 and "expected a number above 0" in capsys.readouterr().err


def test_shard_generate_samples_what_transformers_would(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(96)]   # w5 is id 5
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    theirs = random_hf_model("llama")
    theirs.save_pretrained(tmp_path)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    prompt = "w5 w17 w3"
    expected = transformers_greedy(theirs, [5, 17, 3], 8)
    assert generate_tool.main([str(tmp_path), "--prompt", prompt, "--tokens", "8", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.split() == [words[i] for i in [5, 17, 3, *expected]]
    assert generate_tool.main([str(tmp_path / "none"), "--prompt", "w1"]) == 2
    assert "shard-generate:" in capsys.readouterr().err
    # a device or seed it cannot take: one line and exit 2 before loading, not a traceback
    for args, message in ((["--device", "bogus"], "--device must be cpu, cuda or cuda:N"),
                          (["--seed", str(2 ** 64 - 2), "--samples", "3"], "seed must be an integer in")) + \
            ((["--device", "cuda"], "torch sees no GPU"),) * (not torch.cuda.is_available()):
        with pytest.raises(SystemExit) as exit_:
            generate_tool.main([str(tmp_path), "--prompt", prompt, *args])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_run_directory_named_like_a_snapshot_is_a_run_directory(tmp_path):
    """A run's out_dir may be named snap-...: its checkpoints/LATEST is read, not taken for a
    snapshot without its manifest (what a snap-* directory without meta.json is)."""
    run = tmp_path / "snap-lr3e-4"
    (run / "checkpoints" / "snap-00000010-00000000000000ab").mkdir(parents=True)
    (run / "checkpoints" / "snap-00000010-00000000000000ab" / "meta.json").write_text("{}")
    (run / "checkpoints" / "LATEST").write_text("snap-00000010-00000000000000ab")
    assert checkpoint.snapshot(run) == run / "checkpoints" / "snap-00000010-00000000000000ab"
    (run / "checkpoints" / "snap-00000020-00000000000000cd").mkdir()   # a save cut short
    with pytest.raises(checkpoint.CheckpointError, match="meta.json is missing"):
        checkpoint.snapshot(run / "checkpoints" / "snap-00000020-00000000000000cd")


def test_shard_generate_takes_the_newest_run_of_a_directory_of_runs(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        (tmp_path / name / "checkpoints" / "LATEST").write_text("snap")
    os.utime(tmp_path / "a" / "checkpoints" / "LATEST", (2e9, 2e9))
    assert generate_tool.newest_run(tmp_path) == tmp_path / "a"
    assert generate_tool.newest_run(tmp_path / "b") == tmp_path / "b"

