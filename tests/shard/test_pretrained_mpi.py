"""A Hugging Face model through a 2- and 4-rank ZeRO-3 engine and back out
(tests/shard/workers/run_pretrained.py): each rank reads only the parameters its shards
hold, never the model, and the export from the snapshot's files is the original bit for bit."""
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.models.test_hf import random_hf_model
from tests.support.mpirun import mpiexec

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_pretrained_model_goes_through_zero3_and_out_bit_for_bit(ranks, tmp_path):
    random_hf_model("llama").save_pretrained(tmp_path / "hf")   # fp32
    run = mpiexec(ranks, "-m tests.shard.workers.run_pretrained", str(tmp_path / "hf"), str(tmp_path), timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    model_bytes = sum(t.numel() * 4 for t in load_file(tmp_path / "hf" / "model.safetensors").values())
    for rank in report["ranks"]:
        # the files are read for the parameters the rank's shards overlap, and no others
        assert rank["read"] == rank["overlapping"], rank
        assert len(rank["read"]) < len(report["ranks"][0]["overlapping"]) * ranks
        # what loading left: the rank's fp32 shards (and the norm's few weights); on the way,
        # beyond them, at most a unit's shard being made, a parameter it cuts through in full
        # and that parameter as read from the file (2 ranks: 34 KB of a 80 KB model; 4: 28 KB)
        assert rank["held"] <= rank["master"] + 64, rank
        assert rank["peak"] - rank["held"] <= rank["largest_shard"] + 2 * rank["largest"], rank
        assert rank["peak"] < model_bytes, (rank, model_bytes)
    original = load_file(tmp_path / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for key, value in original.items():
        assert torch.equal(exported[key], value), key
    # and full_state_dict (rank 0's host memory) holds the same values
    state = torch.load(tmp_path / "full_state.pt")
    assert torch.equal(state["blocks.1.mlp.down.weight"], original["model.layers.1.mlp.down_proj.weight"])


def test_model_hf_tokenizes_the_corpus_with_the_models_own_tokenizer(tmp_path):
    """model=hf with data.tokenizer null: the model directory's tokenizer.json (and its
    config's end-of-document token) makes the tokens, and one larger than the model's
    embedding stops the run before training, saying both sizes."""
    from shard.data import TokenData
    from tests.shard.published_tokenizers import byte_bpe

    model = tmp_path / "hf"
    random_hf_model("llama", vocab_size=512).save_pretrained(model)
    byte_bpe(model, "llama", vocab=500)
    args = ["-m shard.tools.train", "model=hf", f"model.path={model}", "optim.lr=1e-3", "train.seq_len=32",
            "train.micro_batch=2", "train.steps=2", "train.eval_batches=1", "log.progress=false",
            "data.documents=100", f"data.cache_dir={tmp_path / 'cache'}"]
    run = mpiexec(1, *args, f"train.out_dir={tmp_path / 'run'}", timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    import yaml
    data = TokenData(yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["built"]["data"])
    assert (data.directory / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    assert (data.vocab_size, data.eos_id, data.tokenizer.prefix) == (500, 1, (0,))
    byte_bpe(model, "llama", vocab=1000)
    run = mpiexec(1, *args, f"train.out_dir={tmp_path / 'too-large'}", timeout=240)
    assert run.returncode == 2, run.stderr
    assert "the tokenizer has 1000 tokens but the model's vocabulary is 512 (the checkpoint's)" in run.stderr
    assert not (tmp_path / "too-large" / "metrics.jsonl").exists()
