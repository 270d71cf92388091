"""Checkpoint save and load time, and what the manifest's checksums cost (issue: verified
checkpoints). Under mpiexec, one model and strategy per launch:

    mpiexec -n 4 python -m shard.tools.checkpoint_bench --model gpt_125m --repeats 5 --dir /tmp/ckpt

Per repeat: checkpoint.save() (writing every rank's shard, hashing it, the manifest), then
checkpoint.load() (the ranks verify the files against the manifest together, then each rank
reads what it needs). Measured apart in the same run: the hashing alone (each rank's SHA-256 of its
own files) and the verification alone (checkpoint.choose: every rank re-hashing its share
of the files), so "without the manifest" is the same save and load less those. Medians
over repeats, the slowest rank.

And the training stall per snapshot, sync against async (train.checkpoint_async): the
time checkpoint.save() holds training, against the time AsyncSaver.save() does (copying
the shards to host buffers) and the time its background write takes to commit; and
--steps training steps of --seq tokens timed alone and right after an async save, while
its thread writes (what the write costs the steps it overlaps, on shared cores).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from runkit.args import at_least
from runkit.closed_pipe import quiet_when_its_reader_goes


@quiet_when_its_reader_goes
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="checkpoint_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="a preset of shard.models")
    ap.add_argument("--strategy", default="zero3")
    ap.add_argument("--repeats", type=at_least(1), default=5)
    ap.add_argument("--dir", default="checkpoint-bench", help="where the snapshots go (removed at the end)")
    ap.add_argument("--steps", type=at_least(1), default=2, help="training steps timed alone and during a write")
    ap.add_argument("--seq", type=at_least(1), default=64, help="tokens per training step")
    args = ap.parse_args(argv)

    import pccl
    from shard.engine import checkpoint
    from shard.engine.checkpoint_async import AsyncSaver
    from shard.engine.engine import Engine
    from shard.engine.optimizer import ShardedAdamW
    from shard.models import GPT, GPTConfig

    torch.set_num_threads(1)
    comm = pccl.init()
    engine = Engine(GPT(GPTConfig.preset(args.model)), comm, strategy=args.strategy)
    optimizer = ShardedAdamW(engine)
    root = Path(args.dir)
    rows = {"save_s": [], "load_s": [], "hash_s": [], "verify_s": [], "async_stall_s": [], "async_commit_s": [],
            "steps_alone_s": [], "steps_during_write_s": []}
    saver = AsyncSaver(engine, root, keep=1)
    tokens = torch.randint(0, engine.model.cfg.vocab, (1, args.seq + 1))

    def steps() -> float:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.backward(engine(tokens[:, :-1], targets=tokens[:, 1:]))
            optimizer.step()
        return time.perf_counter() - start

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        comm.all_reduce(t, op="max")
        return t.item()

    for _ in range(args.repeats):
        engine.barrier()
        start = time.perf_counter()
        checkpoint.save(engine, optimizer, root, extra={"step": 0}, keep=1)
        rows["save_s"].append(slowest(time.perf_counter() - start))
        snap = checkpoint.latest(root)
        start = time.perf_counter()
        for f in snap.glob(f"shard-{comm.rank}.pt"):
            checkpoint._digest(f)
        rows["hash_s"].append(slowest(time.perf_counter() - start))
        start = time.perf_counter()
        assert checkpoint.choose(engine, root, fallback=False) == (snap, [])
        rows["verify_s"].append(slowest(time.perf_counter() - start))
        engine.barrier()
        start = time.perf_counter()
        checkpoint.load(engine, optimizer, root)
        rows["load_s"].append(slowest(time.perf_counter() - start))
        rows["steps_alone_s"].append(slowest(steps()))
        engine.barrier()
        start = time.perf_counter()
        saver.save(optimizer, extra={"step": 0})
        rows["async_stall_s"].append(slowest(time.perf_counter() - start))
        rows["steps_during_write_s"].append(slowest(steps()))
        saver.wait()
        rows["async_commit_s"].append(slowest(time.perf_counter() - start))
    if comm.rank == 0:
        nbytes = sum(f.stat().st_size for f in checkpoint.latest(root).iterdir())
        median = {k: statistics.median(v) for k, v in rows.items()}
        print(json.dumps({"model": args.model, "strategy": args.strategy, "ranks": comm.size, "bytes": nbytes,
                          "repeats": args.repeats, **{k: round(v, 4) for k, v in median.items()},
                          "save_without_manifest_s": round(median["save_s"] - median["hash_s"], 4),
                          "load_without_manifest_s": round(median["load_s"] - median["verify_s"], 4),
                          "params": engine.model.cfg.num_params(),
                          "async_stall_over_sync": round(median["async_stall_s"] / median["save_s"], 4)}))
        shutil.rmtree(root, ignore_errors=True)
    engine.close()


if __name__ == "__main__":
    main()
