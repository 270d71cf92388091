"""Exact resume of a streamed corpus (data=files) through shard-train: a 2-rank run killed
after a checkpoint, relaunched at 2 ranks, ends with the uninterrupted run's losses bit for
bit; relaunched at 4 ranks with the same global batch, it reads the same rows (the
checkpoint's data position, loaded by 4 ranks' batches, against the uninterrupted 2-rank
batches' next steps) and its losses agree within fp32 rounding. Every kind of corpus file,
a published tokenizer.json, one tokenizing worker per rank."""
import json
import shutil

import pytest

from shard.data import Corpus, StreamingBatches
from shard.engine import checkpoint
from tests.shard.published_tokenizers import byte_bpe
from tests.shard.test_stream import step_rows, write_corpus
from tests.support.mpirun import mpiexec

pytestmark = pytest.mark.mpi

STEPS = 6
RUN = ["model.width=64", "model.layers=2", "model.heads=2", "model.vocab=512", "train.seq_len=32",
       "train.micro_batch=4", "train.global_batch_tokens=1024", "optim.lr=3e-3", "optim.min_lr=3e-4",
       "optim.warmup_steps=2", "optim.decay_steps=20", "train.eval_interval=3", "train.eval_batches=2",
       "train.checkpoint_interval=3", "log.interval=1", "log.progress=false", f"train.steps={STEPS}",
       "strategy=zero3", "comm.ranks_per_node=1", "data=files", "data.streams=4", "data.workers=1",
       "data.val_documents=8"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamed")
    corpus = write_corpus(root / "corpus")
    tok = byte_bpe(root / "tokenizer", "llama", vocab=500)
    return root, [f"data.paths=[{corpus}/*]", f"data.tokenizer={tok}", f"data.cache_dir={root / 'cache'}"]


def train(ranks: int, out, data: list, *extra: str, faults: str = "", monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("SHARD_FAULTS", faults)
    run = mpiexec(ranks, "-m shard.tools.train", f"train.out_dir={out}", *RUN, *data, *extra, timeout=300)
    if monkeypatch is not None:
        monkeypatch.delenv("SHARD_FAULTS")
    return run


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_killed_streamed_run_resumes_exactly_at_two_ranks_and_reads_the_same_rows_at_four(setup, monkeypatch):
    root, data = setup
    whole = train(2, root / "whole", data)
    assert whole.returncode == 0, whole.stderr[-3000:]
    uninterrupted = losses(root / "whole")
    assert len(uninterrupted) == STEPS and uninterrupted[-1] < uninterrupted[0]
    killed = train(2, root / "killed", data, faults="kill@4:1", monkeypatch=monkeypatch)   # after step 3's save
    assert killed.returncode != 0
    snap = checkpoint.latest(root / "killed" / "checkpoints")
    assert checkpoint._step(snap) == 3 and checkpoint.problems(snap) is None
    shutil.copytree(root / "killed", root / "four")

    again = train(2, root / "killed", data, "train.resume=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert losses(root / "killed")[3:] == uninterrupted[3:]   # bit for bit

    # the same rows: 4 ranks' batches from the snapshot's data position, against the
    # uninterrupted 2-rank batches' steps 4 to 6
    position = json.loads((snap / "meta.json").read_text())["extra"]["data"]
    assert sorted(position["positions"]) == ["0", "1", "2", "3"], "every rank's streams, gathered"
    corpus = Corpus(((data[0].split("[")[1].rstrip("]"),),), (1.0,), "text",
                    str(root / "tokenizer" / "tokenizer.json"), 8)
    two = [StreamingBatches(corpus, 32, 4, 4, r, 2, 0, 4, workers=0) for r in range(2)]
    expected = step_rows(two, STEPS)[3:]
    four = [StreamingBatches(corpus, 32, 4, 2, r, 4, 0, None, workers=0) for r in range(4)]
    for b in four:
        b.load_state_dict(position)
    assert step_rows(four, STEPS - 3) == expected

    resharded = train(4, root / "four", data, "train.resume=true", "comm.ranks_per_node=2")
    assert resharded.returncode == 0, resharded.stderr[-3000:]
    assert losses(root / "four")[3:] == pytest.approx(uninterrupted[3:], rel=1e-4)
    assert "world: 4" in (root / "four" / "config.yaml").read_text()
