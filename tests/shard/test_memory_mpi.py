"""A training step's peak memory on 2 ranks (tests/shard/workers/run_memory.py): the engine's
ZeRO-3 against PyTorch's FSDP2 with the same sharding (fully_shard per block and the root),
both bf16 with fp32 reductions and fused AdamW, and against the memory model, by a census
of every byte torch allocates on the training loop's thread."""
import json

import pytest

from tests.support.mpirun import mpiexec

pytestmark = pytest.mark.mpi


def test_zero3_holds_no_more_than_fsdp2_and_the_memory_model_is_within_10_percent(tmp_path):
    """(Measured here, GPT width 256, 4 layers, micro-batch 2 x 128: 36.3 MB per rank
    against FSDP2's 43.2 MB; the model predicts 39.3 MB. Behind a slow link, 8 layers of 1 x 16
    tokens: predicted over measured 0.97-1.02, and 0.78 without the bound on the buffers.)"""
    out = tmp_path / "memory.json"
    run = mpiexec(2, "-m tests.shard.workers.run_memory", str(out), timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["reductions"] == ["native"]   # MPI's own reduce-scatter: the model without landing buffers
    for engine, fsdp2, slow_link in zip(report["engine"], report["fsdp2"], report["slow_link"]):
        assert engine <= fsdp2, report
        assert 0.9 <= report["predicted"] / engine <= 1.1, report
        # lanes on threads behind a slow link: the backward runs ahead, and before the engine
        # bounded the buffers in flight every unit's gradient buffer waited in the queue
        assert 0.9 <= report["slow_link_predicted"] / slow_link <= 1.1, report
