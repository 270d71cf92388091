"""The engine on GPUs: every strategy of PaRO's Table 1, 3 steps, against single-process
torch.optim.AdamW (worker: tests/shard/workers/run_gpu_engine.py), in three configurations:
one_gpu (one rank, NCCL), all_gpus (one rank per GPU over NCCL) and mpi (the MPI transport:
one rank per GPU, or 4 ranks sharing one GPU, in groups of 2; messages staged through host
memory unless the MPI is GPU-aware).

The same runs and bounds as tests/shard/test_engine_mpi.py on CPUs: an MLP and a tiny
transformer (tied embedding, loose parameter), with and without clipping, prefetch,
activation checkpointing and NCCL's own collectives, parameters within 1e-5 (relative, in
norm per tensor) and losses within 1e-5 of the reference; bf16 compute within 2% of the
fp32 loss curve. Skipped, with the reason, without a GPU, without NCCL in torch (one_gpu,
all_gpus), with fewer than 2 (all_gpus), or without pccl's GPU build (mpi). make test-gpu
runs these (docs/gpu.md, "GPU test suite").
"""
from __future__ import annotations

import pytest

from shard import STRATEGIES
from tests.support.gpu import GPUS, mpi_ranks, no_gpu_reason, no_mpi_gpu_reason
from tests.support.mpirun import report_of

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

WORKER = "-m tests.shard.workers.run_gpu_engine"
CONFIGS = ("one_gpu", "all_gpus", "mpi")

_reports: dict = {}


def world_of(config: str) -> tuple[int, int, str]:
    """(ranks, group size, transport): all_gpus in groups of half of them where that makes
    groups of 2+ (as the CPU test's 4 ranks in groups of 2), else groups of 1; mpi the same
    over MPI, 4 ranks in groups of 2 where they share one GPU."""
    if config == "one_gpu":
        return 1, 1, "nccl"
    ranks = GPUS if config == "all_gpus" else mpi_ranks()
    return ranks, (ranks // 2 if ranks >= 4 and ranks % 2 == 0 else 1), "mpi" if config == "mpi" else "nccl"


def skip_reason(config: str):
    if config == "mpi":
        return no_mpi_gpu_reason()
    return no_gpu_reason(1 if config == "one_gpu" else 2)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    def get(config: str) -> dict:
        reason = skip_reason(config)
        if reason:
            pytest.skip(reason)
        ranks, group, transport = world_of(config)
        result = report_of(_reports, config, tmp_path_factory.mktemp(config), ranks, WORKER, str(group),
                           transport, timeout=1800)
        assert "_launch" not in result, result.get("_launch")
        return result
    return get


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("strategy", [s.letters for s in STRATEGIES])
def test_every_strategy_matches_single_process_adamw_on_gpus(report, config, strategy):
    mine = {k: v for k, v in report(config).items() if k.startswith(strategy + "/") and k != f"{strategy}/bf16"}
    assert len(mine) == 4, sorted(mine)
    for label, run in mine.items():
        assert "exception" not in run, f"{label}\n{run.get('exception')}"
        assert run["error"] <= 1e-5, (label, run)
        assert run["loss_error"] <= 1e-5, (label, run)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("strategy", ["NNN", "GGG", "IIG"])
def test_bf16_loss_curve_follows_fp32_on_gpus(report, config, strategy):
    run = report(config)[f"{strategy}/bf16"]
    assert "exception" not in run, run.get("exception")
    assert len(run["losses"]) == len(run["reference"]) == 5, run
    for got, want in zip(run["losses"], run["reference"]):
        assert abs(got - want) <= 0.02 * want, run
