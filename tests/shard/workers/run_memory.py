"""mpiexec worker: a training step's peak memory on each rank, the engine's ZeRO-3 against
PyTorch's FSDP2 with the same sharding (fully_shard per block and the root), and against
the memory model (shard/planning/footprint.py).

Usage: mpiexec -n P python -m tests.shard.workers.run_memory REPORT.json

The same GPT, bf16 compute and fp32 gradient reduction, fused AdamW, one micro-batch a
step; the second step is measured (optimizer state exists), by a census of the bytes of
every storage torch allocates on the training loop's thread and frees (the engine's
lanes run their collectives on that thread, as they do over NCCL; FSDP2's run there on
CPU); and the engine with its lanes on their threads and a slow link (a deeper model, short
sequences), where the gradient buffers are made on that thread and wait for the lane.
Rank 0 writes {"engine": [peak per rank], "slow_link": [...], "fsdp2": [...],
"predicted": bytes, "slow_link_predicted": bytes}.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import pccl
import pccl.distributed
from shard.engine.engine import Engine
from shard.engine.optimizer import ShardedAdamW
from shard.engine.strategy import Strategy
from shard.models import GPT, GPTConfig, next_token_loss
from shard.planning.footprint import footprint, unit_sizes
from tests.shard.test_footprint import LiveBytes

torch.set_num_threads(1)
# The memory of a step does not depend on which algorithm moves its bytes: the choice stays
# the transport's own, and no measurement spends the test's time
os.environ["PCCL_SELF_CALIBRATION"] = "0"
world = MPI.COMM_WORLD
CFG = GPTConfig(vocab=512, context=128, width=256, layers=4, heads=4)
MICRO_BATCH, SEQ = 2, 128
# Behind a slow link: deeper, with short sequences, so that gradient buffers weigh most
SLOW_CFG = GPTConfig(vocab=512, context=128, width=256, layers=8, heads=4)
SLOW_MICRO_BATCH, SLOW_SEQ = 1, 16
SLOW_LINK_S = 0.2   # each backward reduction's delay


def tokens(cfg: GPTConfig, micro_batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab, (micro_batch, seq + 1), generator=torch.Generator().manual_seed(world.rank))


def peak(build) -> int:
    """The second step's peak of live bytes over the bytes held before it."""
    with LiveBytes() as live:
        step = build()
        for _ in range(2):
            live.peak = live.now
            step()
        del step
    return live.peak


ENGINES = []


def engine_step(slow_link: bool = False):
    """The engine's step: its lanes inline (the census sees one thread), or, slow_link, as a
    run has them, on their threads, the reductions slowed as by a slow link: the backward
    runs ahead, and no more gradient buffers may wait than the model counts."""
    comm = pccl.init()
    model = GPT(SLOW_CFG if slow_link else CFG)
    engine = Engine(model, comm, strategy="zero3", precision="bf16")
    optimizer = ShardedAdamW(engine)
    if slow_link:
        reduce_scatter = engine.reductions.reduce_scatter

        def slowly(stage, *args, **kwargs):
            if stage == "backward":
                time.sleep(SLOW_LINK_S)
            return reduce_scatter(stage, *args, **kwargs)
        engine.reductions.reduce_scatter = slowly
        assert not engine.reductions.inline
    else:
        engine.gathers.inline = engine.reductions.inline = True
        engine.reductions.log = []   # the algorithms the reductions ran
    ENGINES.append(engine)
    batch = tokens(SLOW_CFG, SLOW_MICRO_BATCH, SLOW_SEQ) if slow_link else tokens(CFG, MICRO_BATCH, SEQ)
    del model

    def step():
        engine.backward(next_token_loss(engine, batch))
        optimizer.step()
    return step


def fsdp2_step():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world.size,))
    model = GPT(CFG)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batch = tokens(CFG, MICRO_BATCH, SEQ)

    def step():
        next_token_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def main() -> None:
    pccl.distributed.init_process_group("gloo")
    engine = peak(engine_step)
    slow_link = peak(lambda: engine_step(slow_link=True))
    fsdp2 = peak(fsdp2_step)
    with torch.device("meta"):
        sizes, slow_sizes = unit_sizes(GPT(CFG)), unit_sizes(GPT(SLOW_CFG))
    # MPI's own reduce-scatter (auto's choice without a measurement) keeps its buffers outside torch
    native = {call[-1] for call in ENGINES[0].reductions.log} == {"native"}
    zero3 = Strategy.parse("zero3")
    predicted = footprint(CFG, sizes, zero3, world.size, world.size, micro_batch=MICRO_BATCH, seq_len=SEQ,
                          precision="bf16", landing_buffers=not native).peak
    slow_predicted = footprint(SLOW_CFG, slow_sizes, zero3, world.size, world.size, micro_batch=SLOW_MICRO_BATCH,
                               seq_len=SLOW_SEQ, precision="bf16", landing_buffers=not native).peak
    for e in ENGINES:
        e.close()
    report = {"engine": world.gather(engine), "slow_link": world.gather(slow_link), "fsdp2": world.gather(fsdp2),
              "predicted": predicted, "slow_link_predicted": slow_predicted,
              "reductions": sorted({str(call[-1]) for call in ENGINES[0].reductions.log})}
    dist.destroy_process_group()
    if world.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
