"""mpiexec worker: the engine's 14 strategies on GPUs over NCCL, against single-process
torch.optim.AdamW on one GPU, as tests/shard/workers/run_engine.py checks them on CPUs.

Usage: mpiexec -n P python -m tests.shard.workers.run_gpu_engine GROUP TRANSPORT REPORT.json
Each rank trains on GPU (local rank) % device count with pccl.init(transport=TRANSPORT):
"nccl" (one rank per GPU), or "mpi" (ranks may share a GPU; messages staged through host
memory unless the MPI is GPU-aware),
3 steps of 2 micro-batches (fp32), and rank 0 compares with the reference run on its own
GPU; bf16 compute is compared with the fp32 reference's losses. Report (rank 0): label ->
{"error", "loss_error"} | {"losses", "reference"} | {"exception"}.

Both sides run in fp32 with attention through torch's math kernel (flash and
memory-efficient attention off), so the two differ only by summation order, as on CPUs.
"""
from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI

import pccl
import shard
from tests.shard import reference
from tests.shard.reference import MICRO, MODELS, RUNS, STEPS, compared, sharded

warnings.simplefilter("ignore")
world = MPI.COMM_WORLD
_node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
torch.cuda.set_device(_node.rank % torch.cuda.device_count())   # before any NCCL group exists
_node.Free()
DEVICE = torch.device("cuda", torch.cuda.current_device())
torch.backends.cuda.enable_flash_sdp(False)
torch.backends.cuda.enable_mem_efficient_sdp(False)
if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):   # torch >= 2.3
    torch.backends.cuda.enable_cudnn_sdp(False)
comm = pccl.init(transport=sys.argv[2], timeout=300)
N, RANK = comm.size, comm.rank
BF16_STRATEGIES = ("NNN", "GGG", "IIG")


def global_batch(kind: str, step: int):
    return reference.global_batch(kind, step, N, device=DEVICE)


def my_micro_batch(batch, j: int):
    return reference.my_micro_batch(batch, j, N, RANK)


def reference_run(kind: str, steps: int, clip):
    """Single-process AdamW on the whole global batch each step, on this GPU."""
    return reference.reference_run(kind, steps, clip, N, device=DEVICE)


def engine_run(kind: str, strategy, steps: int, group: int, clip=None, **options):
    torch.manual_seed(0)
    model = MODELS[kind][0]().to(DEVICE)   # the reference's initial values
    engine, optimizer = sharded(model, comm, clip, strategy=strategy, group_size=group, units=model.units(),
                                min_shard_numel=0, device=DEVICE, **options)
    losses = []
    for step in range(steps):
        batch = global_batch(kind, step)
        total = torch.zeros(1, dtype=torch.float64, device=DEVICE)
        for j in range(MICRO):
            x, y = my_micro_batch(batch, j)
            loss = MODELS[kind][2](engine(x), y)
            engine.backward(loss)
            total += loss.detach()
        optimizer.step()
        comm.all_reduce(total)
        losses.append(total.item() / (N * MICRO))
    return engine, losses


def close(engine) -> None:
    """Stop the lanes and free their NCCL communicators, if any (dozens of engines run here,
    each with its own groups), every rank in the same order once all are done with them."""
    engine.close()
    torch.cuda.synchronize()
    world.Barrier()
    for lane in (engine.gathers, engine.reductions):
        for sub, _ in lane.comms.values():
            if sub.group is not None:
                try:
                    dist.destroy_process_group(sub.group)
                except Exception:  # noqa: BLE001 - freeing memory early is only an economy
                    pass


def equivalence(group: int) -> dict:
    report = {"_device": torch.cuda.get_device_name(DEVICE), "_world": N, "_group": group,
              "_tf32": torch.backends.cuda.matmul.allow_tf32}
    references = ({(kind, clip): reference_run(kind, STEPS, clip) for kind in MODELS for clip in (None, 0.5)}
                  if RANK == 0 else {})
    bf16_reference = reference_run("mlp", 5, None)[0] if RANK == 0 else None
    for strategy in shard.STRATEGIES:
        name = strategy.letters
        for kind, clip, options in RUNS:
            label = f"{name}/{kind}/clip={clip}/{options}"
            try:
                engine, losses = engine_run(kind, strategy, STEPS, group, clip, **options)
                state = engine.full_state_dict()
                if RANK == 0:
                    report[label] = compared(losses, state, references[(kind, clip)])
                close(engine)
            except Exception:  # noqa: BLE001 - reported
                report[label] = {"exception": traceback.format_exc()}
        if name in BF16_STRATEGIES:
            label = f"{name}/bf16"
            try:
                engine, losses = engine_run("mlp", strategy, 5, group, precision="bf16")
                if RANK == 0:
                    report[label] = {"losses": losses, "reference": bf16_reference}
                close(engine)
            except Exception:  # noqa: BLE001 - reported
                report[label] = {"exception": traceback.format_exc()}
    return report


def main() -> None:
    group, out = int(sys.argv[1]), sys.argv[3]
    report = equivalence(group)
    torch.cuda.synchronize()
    if RANK == 0:
        Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
