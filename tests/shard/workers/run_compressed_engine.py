"""mpiexec worker: the engine with compressed parameter gathers and gradient reductions.

Usage: mpiexec -n 4 python -m tests.shard.workers.run_compressed_engine REPORT.json

4 ranks as 2 groups of 2; the tiny transformer, 3 steps of 2 micro-batches, for zero3 and
paro-iig: each codec setting against the same run uncompressed. Rank 0 reports the loss
curves, the largest parameter difference, and the bytes sent, plus the errors bad settings
raise.
"""
from __future__ import annotations

import json
import sys
import traceback

import torch

import pccl
from shard import Engine
from tests.shard.engine_models import TinyTransformer, token_loss
from tests.shard.reference import sharded

torch.set_num_threads(1)
comm = pccl.init(ranks_per_node=2)
SETTINGS = {"exact": {}, "int8": {"compress_params": "int8", "compress_grads": "int8"},
            "bf16-grads": {"compress_grads": "bf16"}, "zfp16-params": {"compress_params": "zfp:16"}}


def train(strategy: str, **codecs) -> dict:
    torch.manual_seed(0)
    model = TinyTransformer()
    engine, optimizer = sharded(model, comm, strategy=strategy, group_size=2, units=model.units(), min_shard_numel=0,
                                **codecs)
    g = torch.Generator().manual_seed(comm.rank)
    losses = []
    for _ in range(3):
        total = 0.0
        for _ in range(2):
            tokens = torch.randint(0, 61, (2, 17), generator=g)
            loss = token_loss(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            total += loss.item() / 2
        optimizer.step()
        losses.append(comm.mpi_comm.allreduce(total) / comm.size)
    report = engine.comm_report()
    sent = sum(report[s]["intra"] + report[s]["inter"] for s in ("forward", "backward", "update"))
    state = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "sent": sent, "state": state}


def main() -> None:
    out = {}
    for strategy in ("zero3", "paro-iig"):
        runs = {name: train(strategy, **codecs) for name, codecs in SETTINGS.items()}
        exact = runs["exact"]
        for name, run in runs.items():
            diff = max((run["state"][k] - exact["state"][k]).abs().max().item() for k in exact["state"]) \
                if comm.rank == 0 else None
            out[f"{strategy}/{name}"] = {"losses": run["losses"], "sent": run["sent"], "max_param_diff": diff}
    errors = {}
    for label, settings in (("unknown codec", {"compress_grads": "int4"}),
                            ("bf16 of bf16 parameters", {"compress_params": "bf16", "precision": "bf16"})):
        try:
            Engine(TinyTransformer(), comm, strategy="zero3", **settings)
            errors[label] = "raised nothing"
        except ValueError as e:
            errors[label] = str(e)
    out["_errors"] = errors
    if comm.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
