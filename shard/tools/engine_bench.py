"""shard-bench: step time, memory and hidden communication of each sharding strategy.

One configuration per mpiexec launch, so the peak memory is that configuration's own:
    mpiexec -n 4 python -m shard.tools.engine_bench --strategy zero3 --group 2 --prefetch 1
or let it launch every configuration and print the table:
    shard-bench --ranks 4 --group 2 --strategies ddp,zero1,zero2,zero3,mics,paro-iig,paro-igg,paro-nig

Per configuration it reports the median step time; the compute-only time (the same model
and batch on every rank with no communication at all: strategy "none"); the time of one
step's collectives replayed alone, back to back, on the same communicators; the time the
training loop waited for communication; model-state bytes and the peak resident memory.
Hidden communication = 1 - (step - compute) / communication alone.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_STRATEGIES = "ddp,zero1,zero2,zero3,mics,paro-iig,paro-igg,paro-nig"


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="shard-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategy", help="one strategy (worker mode, under mpiexec); 'none': no communication")
    ap.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="driver mode: comma-separated strategies")
    ap.add_argument("--ranks", type=int, default=4, help="driver mode: ranks per launch")
    ap.add_argument("--group", type=int, default=2, help="group size M (emulated ranks per node)")
    ap.add_argument("--prefetch", type=int, default=None, help="units gathered ahead (driver: both 0 and 1)")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch per rank")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--algorithm", default="auto", help="pccl algorithm of every collective")
    ap.add_argument("--launches", type=int, default=1, help="driver mode: launches per configuration "
                    "(the one with the median step time is reported)")
    ap.add_argument("--json", help="driver mode: write all rows to this file")
    return ap.parse_args(argv)


def worker(args: argparse.Namespace) -> dict:
    import torch
    from mpi4py import MPI

    import pccl
    from shard.engine.engine import Engine
    from shard.models import GPT, GPTConfig

    torch.set_num_threads(1)
    world = pccl.init(ranks_per_node=args.group)
    comm = world.split([[r] for r in range(world.size)]) if args.strategy == "none" else world
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=args.vocab, context=args.context, width=args.width, layers=args.layers,
                          heads=max(1, args.width // 64)))
    params = model.num_params()
    engine = Engine(model, comm, strategy="ddp" if args.strategy == "none" else args.strategy,
                    group_size=1 if args.strategy == "none" else args.group, prefetch=args.prefetch or 0,
                    algorithm=args.algorithm)
    gen = torch.Generator().manual_seed(world.rank)
    tokens = torch.randint(0, args.vocab, (args.micro, args.batch, args.context + 1), generator=gen)

    def step() -> float:
        start = time.perf_counter()
        for j in range(args.micro):
            logits = engine(tokens[j, :, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[j, :, 1:].flatten())
            engine.backward(loss)
        engine.step()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    for lane in (engine.gathers, engine.reductions):
        lane.log = []
    engine.comm_report(reset=True)
    times = [step() for _ in range(args.steps)]
    report = engine.comm_report()
    one_step = {lane.name: lane.log[:len(lane.log) // args.steps] for lane in (engine.gathers, engine.reductions)}
    alone = replay_alone(engine, one_step, world)
    memory = engine.memory_report()
    row = {
        "strategy": args.strategy, "prefetch": args.prefetch or 0, "ranks": world.size, "group": args.group,
        "params": params, "step_s": statistics.median(times), "comm_alone_s": alone,
        "exposed_s": report["exposed_s"] / args.steps,
        "busy_s": {k: v / args.steps for k, v in report["busy_s"].items()},
        "sent_bytes": sum(report[s]["intra"] + report[s]["inter"]
                          for s in ("forward", "backward", "update")) / args.steps,
        "state_bytes": memory["parameters"] + memory["gradients"] + memory["optimizer"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    row["peak_rss_mb"] = world.mpi_comm.allreduce(row["peak_rss_mb"], op=MPI.MAX)
    return row


def replay_alone(engine, log: dict, world, repeats: int = 3) -> float:
    """One step's collectives again, with no compute: median seconds over `repeats`."""
    import torch

    lanes = {"gather": engine.gathers, "reduce": engine.reductions}
    buffers = []
    for name, calls in log.items():
        for level, collective, numel, dtype, algorithm in calls:
            comm = lanes[name].comms[level][0]
            full = torch.ones(numel, dtype=dtype)
            part = torch.ones(numel // comm.size, dtype=dtype)
            buffers.append((comm, collective, full, part, algorithm))
    times = []
    for _ in range(repeats):
        world.mpi_comm.Barrier()
        start = time.perf_counter()
        for comm, collective, full, part, algorithm in buffers:
            if collective == "all_gather":
                comm.all_gather(full, part, algorithm=algorithm)
            elif collective == "reduce_scatter":
                comm.reduce_scatter(part, full, algorithm=algorithm)
            else:
                comm.all_reduce(full, algorithm=algorithm)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def launch(args: argparse.Namespace, strategy: str, prefetch: int) -> dict:
    from pccl.util.mpirun import launcher

    passthrough = [f"--{k}={getattr(args, k)}" for k in ("group", "micro", "batch", "width", "layers", "vocab",
                                                          "context", "steps", "warmup", "algorithm")]
    cmd = [*launcher(), "-n", str(args.ranks), sys.executable, "-m", "shard.tools.engine_bench",
           f"--strategy={strategy}", f"--prefetch={prefetch}", *passthrough]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def median_launch(args: argparse.Namespace, strategy: str, prefetch: int) -> dict:
    rows = sorted((launch(args, strategy, prefetch) for _ in range(args.launches)), key=lambda r: r["step_s"])
    return rows[len(rows) // 2]


def table(rows: list[dict], compute: float) -> str:
    """hidden: 1 - (step - compute) / comm alone (the issue's measure); overlap: the share
    of the lanes' busy time the training loop did not wait for."""
    head = (f"{'strategy':10} {'pf':>2} {'step s':>8} {'+comm s':>8} {'alone s':>8} {'hidden':>7} {'busy s':>8} "
            f"{'waited s':>8} {'overlap':>7} {'sent MB':>8} {'state MB':>8} {'peak MB':>8}")
    lines = [f"compute only (no communication): {compute:.3f} s/step", head]
    for r in rows:
        extra = r["step_s"] - compute
        hidden = 1 - extra / r["comm_alone_s"] if r["comm_alone_s"] > 0 else float("nan")
        busy = sum(r["busy_s"].values())
        overlap = 1 - r["exposed_s"] / busy if busy > 0 else float("nan")
        lines.append(f"{r['strategy']:10} {r['prefetch']:>2} {r['step_s']:8.3f} {extra:8.3f} {r['comm_alone_s']:8.3f} "
                     f"{hidden:7.0%} {busy:8.3f} {r['exposed_s']:8.3f} {overlap:7.0%} {r['sent_bytes'] / 1e6:8.2f} "
                     f"{r['state_bytes'] / 1e6:8.2f} {r['peak_rss_mb']:8.0f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse(argv)
    if args.strategy:
        row = worker(args)
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 0:
            print(json.dumps(row), flush=True)
        return
    compute = median_launch(args, "none", 0)
    rows = []
    for strategy in args.strategies.split(","):
        for prefetch in ([args.prefetch] if args.prefetch is not None else [0, 1]):
            rows.append(median_launch(args, strategy, prefetch))
            print(table(rows[-1:], compute["step_s"]).splitlines()[-1], flush=True)
    print(table(rows, compute["step_s"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"compute": compute, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
