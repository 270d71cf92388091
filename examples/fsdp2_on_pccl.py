"""A GPT trained with PyTorch's FSDP2 whose collectives run on pccl: one import and a backend name.

    .venv/bin/mpiexec -n 4 .venv/bin/python examples/fsdp2_on_pccl.py
    .venv/bin/torchrun --standalone --nproc-per-node 4 examples/fsdp2_on_pccl.py
    PCCL_ALGO=hierarchical PCCL_RANKS_PER_NODE=2 .venv/bin/mpiexec -n 4 .venv/bin/python examples/fsdp2_on_pccl.py

--backend gloo trains the same run on torch's gloo, for comparison; --json prints the
figures (tokens/s, the median over the steps after warm-up) as one JSON line.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import pccl.distributed
from shard.models import GPT, GPTConfig

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="pccl", choices=("pccl", "gloo"))
parser.add_argument("--model", default="tiny")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
parser.add_argument("--seq", type=int, default=128)
parser.add_argument("--json", action="store_true")
args = parser.parse_args()

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
if args.backend == "pccl":
    pccl.distributed.init_process_group()          # torchrun's environment, or MPI's rendezvous
else:
    pccl.distributed.init_process_group(backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda" if cuda else "cpu")

# The user's script from here on: plain FSDP2.
mesh = init_device_mesh(device.type, (world,))
model = GPT(GPTConfig.preset(args.model, context=args.seq), seed=0).to(device)
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

data = torch.Generator().manual_seed(1 + rank)   # each rank its own batches, the same on every backend
times, losses = [], []
for step in range(args.warmup + args.steps):
    tokens = torch.randint(0, model.cfg.vocab, (args.batch, args.seq + 1), generator=data).to(device)
    start = time.perf_counter()
    loss = model(tokens[:, :-1], targets=tokens[:, 1:])   # the head computes the loss, without the logits
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if cuda:
        torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
    losses.append(loss.item())

step_time = statistics.median(times[args.warmup:])
figures = {"backend": args.backend, "ranks": world, "model": args.model, "params": model.cfg.num_params(),
           "step_time_s": step_time, "tokens_per_s": world * args.batch * args.seq / step_time,
           "losses": [round(x, 5) for x in losses], "algorithm": os.environ.get("PCCL_ALGO", "auto")}
if rank == 0:
    print(json.dumps(figures) if args.json else
          f"FSDP2 on {args.backend}: {world} ranks, {figures['tokens_per_s']:.0f} tokens/s, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
