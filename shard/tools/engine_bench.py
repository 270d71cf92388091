"""shard-bench: step time, memory and hidden communication of each sharding strategy.

One configuration per mpiexec launch, so the peak memory is that configuration's own:
    mpiexec -n 4 python -m shard.tools.engine_bench --strategy zero3 --group 2 --prefetch 1
or let it launch every configuration and print the table, the header first and a row as
each launch ends (progress, with the time elapsed and an estimate of what is left, on stderr):
    shard-bench --ranks 4 --group 2 --strategies ddp,zero1,zero2,zero3,mics,paro-iig,paro-igg,paro-nig

The first launch is the compute-only row, strategy "none": the same model and batches, each
rank alone, no communication. Strategies that shard parameters run once per --prefetch value
(default 0 and 1); the others gather nothing ahead and run once (pf "-").

Columns, all per step. A step is timed on each rank from its first forward to the end of
optimizer.step(); a step's time is that of its slowest rank, and "step s" the median over the
timed steps.
  +comm s   step - compute, where compute is the compute-only row's step time.
  alone s   one step's collectives replayed back to back with no compute, on the same
            communicators (median of 3 replays, each its slowest rank's).
  hidden    the share of "alone" that did not lengthen the step, 1 - (step - compute) / alone,
            with its uncertainty: the noise, the sum of the median absolute deviations of the
            step times, the compute-only step times and the replays, over alone. It is n/a,
            with the reason in the note, where that is not what the formula measures:
            "cores shared": fewer than 2 cores per rank. Compute-only gave each rank a core to
            compute on and the replay one to communicate on; the loop needs both at once, and
            on fewer cores compute and communication take turns, so step - compute mixes the
            two (on 2 cores and 4 ranks the formula gave -776% to 197%).
            "nothing sent": no collective to hide (one rank, say).
            "noise": the noise is half of alone or more.
            "step < compute" / "step > compute + alone": outside the possible range by more
            than the noise. A share within the noise of 0 or 100% shows as that bound.
  busy s    seconds the engine's two communication lanes ran tasks, summed, mean over ranks.
  waited s  seconds the training loop waited for lane tasks, mean over ranks.
  overlap   1 - waited / busy: the share of the lanes' work the loop did not wait for, from
            one launch's own clocks. Lane time slowed by sharing cores with compute counts as
            overlapped, so overlap is not hidden. n/a where waited > busy (a wait also counts
            the lane thread's wake-up, long on shared cores).
  sent MB   bytes a rank's schedules sent, mean over ranks.
  state MB  parameters, gradients and optimizer state a rank holds (the largest rank's).
  peak MB   peak resident memory (the largest rank's).
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

from runkit.args import output
from runkit.closed_pipe import quiet_when_its_reader_goes
from runkit.cpus import available_cores

DEFAULT_STRATEGIES = "ddp,zero1,zero2,zero3,mics,paro-iig,paro-igg,paro-nig"
REPLAYS = 3
CORES_PER_RANK = 2   # compute and communication each on a core of its own, as measured apart


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="shard-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategy", help="one strategy (worker mode, under mpiexec); 'none': no communication")
    ap.add_argument("--strategies", default=None,
                    help=f"driver mode: comma-separated strategies (default {DEFAULT_STRATEGIES})")
    ap.add_argument("--ranks", type=int, default=4, help="driver mode: ranks per launch (default 4)")
    ap.add_argument("--group", type=int, default=2, help="group size M (emulated ranks per node; default 2)")
    ap.add_argument("--prefetch", default=None,
                    help="units gathered ahead; driver mode: comma-separated values (default 0,1), "
                         "worker mode: one value (default 0)")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per step (default 2)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch per rank (default 4)")
    ap.add_argument("--width", type=int, default=128, help="the GPT's width (default 128; width // 64 heads)")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    ap.add_argument("--vocab", type=int, default=2048, help="vocabulary size (default 2048)")
    ap.add_argument("--context", type=int, default=64, help="sequence length (default 64)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed steps first (default 2; auto self-calibrates in the first)")
    ap.add_argument("--algorithm", default="auto", help="pccl algorithm of every collective (default auto)")
    ap.add_argument("--launches", type=int, default=1, help="driver mode: launches per configuration "
                    "(the one with the median step time is reported; default 1)")
    ap.add_argument("--json", type=output(), help="driver mode: write all rows to this file")
    args = ap.parse_args(argv)
    try:
        check(args)
    except ValueError as e:
        ap.error(str(e))
    return args


def check(args: argparse.Namespace) -> None:
    """Refuse bad input before anything launches (ValueError saying what was expected)."""
    from shard.engine.strategy import Strategy
    from shard.models import GPTConfig

    for name in ("ranks", "group", "micro", "batch", "steps", "launches"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {args.warmup}")
    from pccl import vocabulary

    for collective in ("all_gather", "reduce_scatter"):   # the engine's two (a bad name failed after launches)
        vocabulary.check(collective, args.algorithm)
    try:
        args.prefetch = [int(p) for p in args.prefetch.split(",")] if args.prefetch is not None else None
    except ValueError:
        raise ValueError(f"--prefetch must be integers separated by commas, got {args.prefetch!r}") from None
    if args.prefetch is not None and (min(args.prefetch) < 0 or len(set(args.prefetch)) < len(args.prefetch)):
        raise ValueError(f"--prefetch values must be distinct and at least 0, got {args.prefetch}")
    try:
        GPTConfig(vocab=args.vocab, context=args.context, width=args.width, layers=args.layers, heads=heads(args.width))
    except ValueError as e:
        raise ValueError(f"{e} (the model has width // 64 heads, at least 1)") from None
    if args.strategy:   # worker: the launch's own size is mpiexec's, checked by the engine
        if args.prefetch is not None and len(args.prefetch) != 1:
            raise ValueError(f"one --prefetch value per worker, got {args.prefetch}")
        driver = [f"--{k}" for k in ("strategies", "json") if getattr(args, k) is not None]
        if driver:   # (they were ignored: the row printed, no file written, exit 0)
            raise ValueError(f"{', '.join(driver)}: driver-mode options; --strategy runs one worker")
        if args.strategy != "none":
            Strategy.parse(args.strategy)   # (a bad name was a traceback on every rank, after MPI started)
        args.prefetch = args.prefetch[0] if args.prefetch else 0
        return
    args.strategies = args.strategies or DEFAULT_STRATEGIES
    if args.ranks % args.group:
        divisors = [d for d in range(1, args.ranks + 1) if args.ranks % d == 0]
        raise ValueError(f"--ranks {args.ranks} is not divisible by --group {args.group}; "
                         f"expected a group size among {divisors}")
    names = [s.strip() for s in args.strategies.split(",")]
    if "none" in names:
        raise ValueError("'none' is the compute-only launch every run makes first; leave it out of --strategies")
    parsed = [Strategy.parse(s) for s in names]   # StrategyError is a ValueError
    if len({s.letters for s in parsed}) < len(parsed):
        raise ValueError(f"--strategies names a strategy twice: {args.strategies}")
    args.strategies = [s.name for s in parsed]
    args.sharded = {s.name for s in parsed if s.params.name != "N"}   # those that gather parameters


def heads(width: int) -> int:
    return max(1, width // 64)


def worker(args: argparse.Namespace) -> dict:
    import torch
    from mpi4py import MPI

    import pccl
    from shard.engine.engine import Engine
    from shard.engine.optimizer import ShardedAdamW
    from shard.models import GPT, GPTConfig
    from shard.models.loss import next_token_loss

    torch.set_num_threads(1)
    world = pccl.init(ranks_per_node=args.group)
    comm = world.split([[r] for r in range(world.size)]) if args.strategy == "none" else world
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=args.vocab, context=args.context, width=args.width, layers=args.layers,
                          heads=heads(args.width)))
    params = model.num_params()
    engine = Engine(model, comm, strategy="ddp" if args.strategy == "none" else args.strategy,
                    group_size=1 if args.strategy == "none" else args.group, prefetch=args.prefetch,
                    algorithm=args.algorithm)
    optimizer = ShardedAdamW(engine)
    gen = torch.Generator().manual_seed(world.rank)
    tokens = torch.randint(0, args.vocab, (args.micro, args.batch, args.context + 1), generator=gen)

    def step() -> float:
        start = time.perf_counter()
        for j in range(args.micro):
            engine.backward(next_token_loss(engine, tokens[j]))
        optimizer.step()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    for lane in (engine.gathers, engine.reductions):
        lane.log = []
    engine.comm_report(reset=True)
    times = [step() for _ in range(args.steps)]
    report = engine.comm_report()
    one_step = {lane.name: lane.log[:len(lane.log) // args.steps] for lane in (engine.gathers, engine.reductions)}
    replays = replay_alone(engine, one_step, world)
    memory = engine.memory_report()
    mpi = world.mpi_comm

    def slowest(values: list[float]) -> list[float]:
        return [max(column) for column in zip(*mpi.allgather(values))]

    def mean(value: float) -> float:
        return mpi.allreduce(value, op=MPI.SUM) / world.size

    step_times, replays = slowest(times), slowest(replays)
    engine.close()
    return {
        "strategy": args.strategy, "prefetch": args.prefetch, "ranks": world.size, "group": args.group,
        "params": params, "step_s": statistics.median(step_times), "step_times_s": step_times,
        "comm_alone_s": statistics.median(replays), "replays_s": replays,
        "exposed_s": mean(report["exposed_s"] / args.steps),
        "other_waits_s": mean(report["other_waits_s"] / args.steps),
        "busy_s": {k: mean(report["busy_s"].get(k, 0.0) / args.steps) for k in ("gather", "reduce")},
        "sent_bytes": mean(sum(report[s]["intra"] + report[s]["inter"]
                               for s in ("forward", "backward", "update")) / args.steps),
        "state_bytes": mpi.allreduce(memory["parameters"] + memory["gradients"] + memory["optimizer"], op=MPI.MAX),
        # ru_maxrss is in KiB (Linux): MB of 1e6 bytes, as `state MB` counts them
        "peak_rss_mb": mpi.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6, op=MPI.MAX),
    }


def replay_alone(engine, log: dict, world, repeats: int = REPLAYS) -> list[float]:
    """One step's collectives again, with no compute: this rank's seconds per replay."""
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
    return times


# The driver.

def configurations(args: argparse.Namespace) -> list[tuple[str, int | None]]:
    """(strategy, prefetch) of each launch in order, compute only first; prefetch None where
    the strategy gathers no parameters (it then runs once)."""
    prefetch = args.prefetch if args.prefetch is not None else [0, 1]
    runs = [("none", None)]
    for strategy in args.strategies:
        runs += [(strategy, p) for p in prefetch] if strategy in args.sharded else [(strategy, None)]
    return runs


def launch(args: argparse.Namespace, strategy: str, prefetch: int | None) -> dict:
    from runkit.mpirun import launcher

    passthrough = [f"--{k}={getattr(args, k)}" for k in ("group", "micro", "batch", "width", "layers", "vocab",
                                                          "context", "steps", "warmup", "algorithm")]
    cmd = [*launcher(), "-n", str(args.ranks), sys.executable, "-m", "shard.tools.engine_bench",
           f"--strategy={strategy}", f"--prefetch={prefetch or 0}", *passthrough]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    row = json.loads(run.stdout.strip().splitlines()[-1])
    row["prefetch"] = prefetch
    return row


def median_row(rows: list[dict]) -> dict:
    """The launch with the median step time (the upper one of an even count)."""
    return sorted(rows, key=lambda r: r["step_s"])[len(rows) // 2]


def mad(values: list[float]) -> float:
    """Median absolute deviation: the spread of a few samples, one outlier left out."""
    middle = statistics.median(values)
    return statistics.median(abs(v - middle) for v in values)


def hidden_share(row: dict, compute: dict, cores: int) -> tuple[float | None, float | None, str]:
    """(share, its uncertainty, "") or (None, None, why it is not measured); see the docstring."""
    if cores < CORES_PER_RANK * row["ranks"]:
        return None, None, "cores shared"
    if not row["sent_bytes"]:
        return None, None, "nothing sent"
    alone, extra = row["comm_alone_s"], row["step_s"] - compute["step_s"]
    noise = mad(row["step_times_s"]) + mad(compute["step_times_s"]) + mad(row["replays_s"])
    if 2 * noise >= alone:
        return None, None, f"noise {noise * 1e3:.1f} ms, alone {alone * 1e3:.1f} ms"
    if extra < -noise:
        return None, None, "step < compute"
    if extra > alone + noise:
        return None, None, "step > compute + alone"
    return min(1.0, max(0.0, 1 - extra / alone)), noise / alone, ""


def waited(row: dict) -> float:
    return row["exposed_s"] + row["other_waits_s"]


def overlap_share(row: dict) -> tuple[float | None, str]:
    """(1 - waited / busy, "") or (None, why not)."""
    busy = sum(row["busy_s"].values())
    if busy <= 0:
        return None, "no lane work"
    if waited(row) > busy:
        return None, f"waited > busy by {(waited(row) - busy) * 1e3:.1f} ms"
    return 1 - waited(row) / busy, ""


COLUMNS = (f"{'strategy':10} {'pf':>2} {'step s':>8} {'+comm s':>8} {'alone s':>8} {'hidden':>8} {'busy s':>8} "
           f"{'waited s':>8} {'overlap':>7} {'sent MB':>8} {'state MB':>8} {'peak MB':>8}  note")


def format_row(row: dict, compute: dict | None, cores: int) -> str:
    """One table line; the compute-only row (compute None) has no communication columns."""
    memory = f"{row['state_bytes'] / 1e6:8.2f} {row['peak_rss_mb']:8.0f}"
    pf = "-" if row["prefetch"] is None else str(row["prefetch"])
    if compute is None:
        return (f"{row['strategy']:10} {pf:>2} {row['step_s']:8.3f} " + " ".join(f"{'-':>{w}}" for w in
                (8, 8, 8, 8, 8, 7, 8)) + f" {memory}  compute only")
    share, uncertainty, why_hidden = hidden_share(row, compute, cores)
    hidden = "n/a" if share is None else f"{share:.0%}±{uncertainty * 100:.0f}"
    overlap, why_overlap = overlap_share(row)
    notes = [f"hidden: {why_hidden}"] * bool(why_hidden) + [f"overlap: {why_overlap}"] * bool(why_overlap)
    return (f"{row['strategy']:10} {pf:>2} {row['step_s']:8.3f} {row['step_s'] - compute['step_s']:8.3f} "
            f"{row['comm_alone_s']:8.3f} {hidden:>8} {sum(row['busy_s'].values()):8.3f} {waited(row):8.3f} "
            f"{'n/a' if overlap is None else f'{overlap:.0%}':>7} {row['sent_bytes'] / 1e6:8.2f} {memory}  "
            + "; ".join(notes)).rstrip()


def duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """'[k/N] what: elapsed, about T left' on stderr before each launch; what is left is the
    mean launch so far times the launches to come."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.start = time.monotonic()

    def next(self, what: str) -> None:
        elapsed = time.monotonic() - self.start
        left = f"about {duration(elapsed / self.done * (self.total - self.done))} left" if self.done else \
            "estimate after the first launch"
        self.done += 1
        print(f"[{self.done}/{self.total}] {what}: {duration(elapsed)} elapsed, {left}", file=self.stream, flush=True)


@quiet_when_its_reader_goes
def main(argv=None) -> None:
    args = parse(argv)
    if args.strategy:
        row = worker(args)
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 0:
            print(json.dumps(row), flush=True)
        return
    runs, cores = configurations(args), available_cores()
    ranks = f"{args.ranks} rank{'s' * (args.ranks > 1)}"
    print(f"shard-bench: {len(runs) * args.launches} launches of {ranks} in groups of {args.group}, "
          f"{args.warmup} warm-up and {args.steps} timed steps each"
          + (f", {args.launches} per row (the median shown)" if args.launches > 1 else "")
          + "; progress on stderr", flush=True)
    if cores < CORES_PER_RANK * args.ranks:
        print(f"hidden: n/a on this machine: {args.ranks} ranks need {CORES_PER_RANK * args.ranks} cores "
              f"(compute and communication each on its own, as they were measured apart), {cores} here",
              flush=True)
    print(COLUMNS, flush=True)
    progress, compute, rows = Progress(len(runs) * args.launches), None, []
    for strategy, prefetch in runs:
        launched = []
        for _ in range(args.launches):
            progress.next(strategy if prefetch is None else f"{strategy} prefetch {prefetch}")
            launched.append(launch(args, strategy, prefetch))
        row = median_row(launched)
        print(format_row(row, compute, cores), flush=True)
        if compute is None:
            compute = row
        else:
            rows.append(row)
    print(f"done in {duration(time.monotonic() - progress.start)}", file=sys.stderr, flush=True)
    if args.json:
        for row in rows:
            row["hidden"], row["hidden_uncertainty"], row["hidden_note"] = hidden_share(row, compute, cores)
            row["overlap"], row["overlap_note"] = overlap_share(row)
        Path(args.json).write_text(json.dumps({"compute": compute, "rows": rows, "cores": cores}, indent=1))


if __name__ == "__main__":
    main()
