"""mpiexec worker: a Hugging Face model through a ZeRO-3 engine and back out.

Usage: mpiexec -n P python -m tests.shard.workers.run_pretrained HF_DIR OUT_DIR

Each rank builds the model on the meta device from HF_DIR and lets the engine materialize
it, every parameter read from the files as its unit's shard is made, counting what it reads
and the bytes torch allocates meanwhile (a census on the loading thread). The engine then
writes a checkpoint, and rank 0 exports the snapshot's files to OUT_DIR/export in fp32.
Rank 0 writes OUT_DIR/report.json: per rank the parameters read, those its shards overlap,
the peak bytes, its master bytes and the largest parameter's; and the full_state_dict.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import pccl
from shard.engine import checkpoint
from shard.engine.engine import Engine
from shard.engine.optimizer import ShardedAdamW
from shard.models.hf import from_pretrained, save_pretrained
from tests.shard.test_footprint import LiveBytes

torch.set_num_threads(1)
os.environ["PCCL_SELF_CALIBRATION"] = "0"   # nothing here depends on which algorithm gathers
world = MPI.COMM_WORLD


def main() -> None:
    hf, out = Path(sys.argv[1]), Path(sys.argv[2])
    comm = pccl.init()
    model = from_pretrained(hf, device="meta")
    read = []
    weights = model.weights
    model.weights = lambda name, tensor: (read.append(name), weights(name, tensor))
    largest = max(p.numel() for p in model.parameters()) * 4
    with LiveBytes() as live:
        engine = Engine(model, comm, strategy="zero3", device="cpu", min_shard_numel=1)   # every unit sharded
    overlapping = sorted({name for u in engine.units for name, start, end in
                          zip(u.flat.names, u.flat.offsets, u.flat.offsets[1:])
                          if max(start, u.os_span[0]) < min(end, u.os_span[1])})
    mine = {"read": sorted(read), "overlapping": overlapping, "peak": live.peak, "held": live.now,
            "master": engine.master.numel() * 4, "largest": largest,
            "largest_shard": max(u.os_numel for u in engine.units) * 4}
    checkpoint.save(engine, ShardedAdamW(engine), out / "checkpoints")
    state = engine.full_state_dict()
    ranks = world.gather(mine, root=0)
    if world.rank == 0:
        snap = checkpoint.latest(out / "checkpoints")
        save_pretrained((model.cfg, checkpoint.parameters(snap)), out / "export", dtype=torch.float32)
        torch.save(state, out / "full_state.pt")
        (out / "report.json").write_text(json.dumps({"ranks": ranks}))
    engine.close()


if __name__ == "__main__":
    main()
