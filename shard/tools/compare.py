"""shard-compare: the same GPT training under what a user would pick instead, side by side.

    shard-compare --ranks 2 --steps 3 --model tiny --runs fsdp2,zero3-native,zero3-pccl --out DIR

Every run trains the same model (same initial weights), on the same batches, on the same
ranks, with AdamW of the same settings at the same learning rate each step, for the same
steps, one mpiexec launch per run. The batches are the project's synthetic corpus, the
data shard-train trains on by default (configs/data/synthetic.yaml; --documents), prepared
once before the launches into --data-cache (shard-train's .cache/shard-data) with a
tokenizer the model's vocabulary holds, and cut by shard.data.Batches, each rank its own.
The rate is the preset's peak (shard/models/gpt.py PEAK_LR, GPT-3's per size; --lr), warmed up
linearly over the first third of the steps, then decayed to a tenth on a cosine
(shard/tools/lr_schedule.py, shard-train's schedule). On uniformly random tokens at a
constant 1e-3, as it trained before, the loss of GPT-1.3B rose in bf16 and every run left
eager's by 2-3%: a chaotic workload, not the frameworks wrong (at 1e-4 they agreed to
7e-5). The runs:

- `eager`, `eager-compile`: plain PyTorch on one rank (fp32 weights, `torch.autocast` in
  bf16 runs, `AdamW(fused=True)`; `torch.compile(model)`), the baseline a user moves from;
- `fsdp2`: PyTorch's `fully_shard` per transformer block and root, on gloo (NCCL on
  GPUs; bf16 runs gather bf16 and reduce fp32); `fsdp2-compile` compiles each block;
- `fsdp2-pccl`: the same on the pccl torch.distributed backend (docs/distributed.md);
- `deepspeed-zero3`: DeepSpeed's ZeRO stage 3 with the same AdamW as its client optimizer,
  on gloo (reported as not run, with the reason, where DeepSpeed does not import);
- `STRATEGY-COMM`: the shard engine with a strategy (zero3, paro-iig, mics, ddp, ...) and
  its collectives on `native` (MPI's own), `pccl` (auto), `hierarchical` or `ho_ring`.
  `STRATEGY-COMM+CODEC` (`zero3-pccl+int8`) moves its parameters and gradients
  compressed (the engine's compress_params and compress_grads); such a run is held to a
  tolerance of 2% instead of 1e-4. `+compile` compiles each unit (the engine's
  compile=True): `zero3-pccl+compile`.

`--device cuda` runs every rank on a GPU (local rank modulo the GPUs), the engine over NCCL
where each rank has a GPU of its own and over MPI where ranks share one; `--precision bf16`
computes in bf16 (runs are then held to a tolerance of one bf16 rounding, 2**-8:
frameworks round differently).

`--nodes 2x2 --rate 200mbit` runs every launch on emulated nodes (launch/emulate).
`--micro K` accumulates K micro-batches of `--batch` sequences per step (FSDP2 and
DeepSpeed as their users would: a reduction per micro-batch). `--width/--layers/--heads/
--vocab` resize the preset. `--predict PROFILE` adds, for every engine run, the step time
shard/planning/predict.py predicts from that machine profile and a compute time measured here (one
more launch, computing alone), and the error against the measurement.

Each run reports tokens/s (the median step after warm-up, each step timed to its end on
the device), MFU on GPUs (the model's FLOPs per token, shard/planning/throughput.py's peak),
step time, the communication the loop waited for (the engine's ledger; 0 for eager, null
for FSDP2), bytes sent per rank, peak memory (the largest over ranks: the GPU's allocated
peak, or the resident set on CPUs) and the loss of every step. The first run is the
reference (put `eager` first for ratios to plain PyTorch). A run agrees with it when at
every step its loss is within the tolerance times (the reference's loss + 10 x how far
that loss has moved from its first step): runs doing the same math differ by rounding, of
the loss itself and of every update, whose drift grows as training moves the weights,
while a real divergence is a share of the movement itself (compare_runs.agreement has the
measurements). A run that does not agree, or was handed other initial weights or batches
than the reference (digests of both are compared), is marked and gets no speed-up. DIR
gets compare.json, compare.md and compare.png. `--profile STEPS` runs STEPS more steps of
each run under torch.profiler, after the measured ones, and writes where each run's step
went (its kernels on GPUs, its operators on CPUs) to DIR/profile-RUN.txt and compare.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from runkit.args import at_least, names, output, refuse
from runkit.closed_pipe import quiet_when_its_reader_goes
from shard.tools.compare_runs import (
    BETAS,
    COMMS,
    ENGINE_RUN,
    EPS,
    EngineRun,
    agreement,
    autocast,
    loss_tolerance,
    parse_run,
)

PROFILE_ROWS = 20   # --profile: the operators and kernels each run's row lists


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="shard-compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=names, default="fsdp2,fsdp2-pccl,zero3-native,zero3-pccl",
                    help="comma-separated: eager, eager-compile, fsdp2, fsdp2-compile, fsdp2-pccl, deepspeed-zero3, "
                         f"{ENGINE_RUN}")
    ap.add_argument("--ranks", type=at_least(1), default=2)
    ap.add_argument("--ranks-per-node", type=at_least(1), default=None, help="emulated nodes of consecutive ranks")
    ap.add_argument("--nodes", type=nodes, default=None, metavar="NxM",
                    help="N emulated nodes of M ranks (launch/emulate: network namespaces, links at --rate); "
                         "sets --ranks and --ranks-per-node")
    ap.add_argument("--rate", default=None, help="with --nodes: each node's link, each direction (tc units; "
                                                 "default 1gbit)")
    ap.add_argument("--model", default="tiny", help="a preset of shard.models")
    for field in ("width", "layers", "heads", "vocab"):
        ap.add_argument(f"--{field}", type=at_least(1), default=None, help=f"the preset's {field}, overridden")
    ap.add_argument("--steps", type=at_least(2), default=10, help="steps, warm-up included")
    ap.add_argument("--warmup", type=at_least(0), default=None,
                    help="steps left out of the timing (default: a third, at least the first)")
    ap.add_argument("--batch", type=at_least(1), default=4, help="sequences per rank and micro-batch")
    ap.add_argument("--micro", type=at_least(1), default=1, help="micro-batches per step (gradient accumulation)")
    ap.add_argument("--seq", type=at_least(1), default=128)
    ap.add_argument("--lr", type=positive, default=None,
                    help="peak learning rate (default: the model preset's, shard/models/gpt.py PEAK_LR), reached by a "
                         "linear warm-up over the first third of the steps, then a cosine decay to a tenth of it")
    ap.add_argument("--documents", type=at_least(2), default=None,
                    help="documents of the synthetic corpus (default: shard-train's, configs/data/synthetic.yaml)")
    ap.add_argument("--data-cache", default=None,
                    help="where the corpus is prepared, once (default: shard-train's data.cache_dir)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--launches", type=at_least(1), default=1,
                    help="launches per run; the one with the median tokens/s is reported, with all of them")
    ap.add_argument("--out", type=output(directory=True), default="compare-results",
                    help="the directory the results are written to")
    ap.add_argument("--predict", metavar="PROFILE", default=None,
                    help="also predict each engine run's step (shard/planning/predict.py) with this machine "
                         "profile and the compute time measured here by a compute-only launch")
    ap.add_argument("--profile", type=at_least(0), default=0, metavar="STEPS",
                    help="after the measured steps, STEPS more under torch.profiler: each run's operators and "
                         "kernels by the time they took, per step (DIR/profile-RUN.txt, and the first "
                         f"{PROFILE_ROWS} in compare.json)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)   # the run, inside its mpiexec launch
    ap.add_argument("--data", help=argparse.SUPPRESS)     # the prepared corpus, for the launches
    args = ap.parse_args(argv)
    if args.rate is not None and not args.nodes:
        ap.error(f"--rate {args.rate} shapes emulated nodes' links: give --nodes too")
    args.rate = args.rate or "1gbit"
    if args.warmup is not None and args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must leave timed steps out of --steps ({args.steps})")
    return args


def positive(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def nodes(text: str) -> tuple[int, int]:
    """"2x4" -> (2, 4)."""
    try:
        n, m = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NxM (nodes x ranks per node), got {text!r}") from None
    if n < 1 or m < 1:
        raise argparse.ArgumentTypeError(f"nodes and ranks per node must be >= 1, got {text!r}")
    return n, m


def model_config(args):
    from shard.models import GPTConfig

    overrides = {k: getattr(args, k) for k in ("width", "layers", "heads", "vocab") if getattr(args, k) is not None}
    return GPTConfig.preset(args.model, context=args.seq, **overrides)


def learning_rates(args) -> list[float]:
    """Every step's learning rate: shard-train's schedule (shard/tools/lr_schedule.py) over
    the comparison's few steps, a linear warm-up over the first third to the peak (--lr, or
    the preset's: the rate its size trains stably at), then a cosine decay to a tenth."""
    from shard.models.gpt import peak_lr
    from shard.tools.lr_schedule import learning_rate

    peak = args.lr or peak_lr(args.model)
    return [learning_rate(s, peak, peak / 10, max(1, args.steps // 3), None, args.steps) for s in range(args.steps)]


def prepare_data(args) -> None:
    """The synthetic corpus shard-train trains on by default (configs/data/synthetic.yaml,
    --documents documents), tokenized once into the cache with a vocabulary the model
    holds; its directory, which every launch reads, into args.data. Run before the
    launches."""
    from omegaconf import OmegaConf

    from shard.data import TokenData, prepare
    from shard.tools.preflight import CONFIGS

    spec = OmegaConf.to_container(OmegaConf.load(CONFIGS / "data" / "synthetic.yaml"))
    cache = args.data_cache or spec["cache_dir"]
    vocab = model_config(args).vocab
    spec = {k: v for k, v in spec.items() if k != "cache_dir"}
    spec["vocab_size"] = spec["vocab_size"] or vocab   # as shard-train: null is the model's
    if args.documents:
        spec["documents"] = args.documents
    try:
        data = TokenData(prepare(spec, cache))
    except ValueError as e:
        refuse("shard-compare", f"preparing the synthetic corpus: {e} (the model's --vocab is {vocab})")
    if data.vocab_size > vocab:
        refuse("shard-compare", f"the corpus' tokenizer has {data.vocab_size} tokens, more than the model's "
                                f"vocabulary of {vocab}: raise --vocab")
    args.data = str(data.directory.resolve())
    try:
        rank_batches(args, 0, args.ranks)   # a global batch more than the corpus fails here, not in a launch
    except ValueError as e:
        refuse("shard-compare", str(e))


def step_batches(batches, device):
    """This rank's micro-batches of the next step as one (micro, batch, seq + 1) tensor of
    tokens: each input row with its next-token targets' last token (Batches' targets are
    the inputs shifted by one)."""
    import torch

    return torch.stack([torch.cat((x, y[:, -1:]), 1) for x, y in batches.next_step()]).to(device)


def rank_batches(args, rank: int, world: int):
    """This rank's batches of the prepared corpus: each rank its own, the same in every
    run of the comparison (shard.data.Batches, seed 0, as shard-train's)."""
    from shard.data import Batches, TokenData

    return Batches(TokenData(args.data).train, args.seq, args.batch, args.micro, rank, world, seed=0)


def worker(args: argparse.Namespace) -> dict:
    """One run on this launch's ranks; rank 0 returns its row."""
    import torch

    from pccl import mpi_world
    from shard.models import GPT
    from shard.planning.throughput import Throughput, peak_rss_bytes, peak_tflops
    from shard.tools.compare_runs import device_of

    torch.set_num_threads(1)
    world = mpi_world()
    rank, p = world.rank, world.size
    cfg = model_config(args)
    model = GPT(cfg, seed=0)
    name = args.worker
    if name == "compute":
        return compute_only(args, model, world)
    run = parse_run(name)
    device = device_of(args)
    initial_weights = weights_digest(model)   # what set_up is handed: every run's the same
    if device.type == "cpu":   # its peak is the process's resident set: every run holds torch.compile's
        import torch._dynamo  # noqa: F401  modules (144 MB), which torch.optim's optimizers load and the engine not
    run.set_up(model, world, args)
    gpu = device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else default_warmup(args.steps)
    batches, rates = rank_batches(args, rank, p), learning_rates(args)
    times, losses, data = [], [], hashlib.sha256()
    for s in range(args.steps):
        tokens = step_batches(batches, "cpu")
        data.update(tokens.numpy().tobytes())
        tokens = tokens.to(device)
        world.Barrier()
        start = time.perf_counter()
        loss = run.step(tokens, rates[s])
        if gpu:
            torch.cuda.synchronize(device)   # the step's work is done, not only queued
        times.append(time.perf_counter() - start)
        losses.append(world.allreduce(float(loss)) / p)   # the global batch's mean loss
        if s + 1 == warmup:
            run.reset()
            if gpu:
                torch.cuda.reset_peak_memory_stats(device)
    timed = max(1, args.steps - warmup)
    # the state first, as before Run: a torch run's byte count takes in its gather (the
    # engine's report leaves its own out)
    final = run.full_state()
    fields = run.report(timed)
    step_time = world.allreduce(statistics.median(times[warmup:] or times), op=max_op())
    peak = peak_tflops(device, args.precision)[0]
    measured = Throughput(cfg.flops_per_token(args.seq), p, peak).measure(p * args.micro * args.batch * args.seq,
                                                                          step_time)
    memory = torch.cuda.max_memory_allocated(device) if gpu else peak_rss_bytes()
    if rank == 0:   # before any profiled step: a state dict may hold the live tensors
        torch.save(final, Path(args.out) / f"{name}.pt")
    if args.profile:
        fields.update(profiled(run, batches, rates[-1], args.profile, device))
    row = {"name": name, "ranks": p, "model": args.model, "params": cfg.num_params(), "device": str(device),
           "precision": args.precision, "mfu": measured["mfu"],
           "tokens_per_s": p * args.micro * args.batch * args.seq / step_time, "step_time_s": step_time,
           "exposed_comm_s": fields.pop("exposed_comm_s"),
           "sent_bytes_per_rank": world.allreduce(fields.pop("sent_bytes_per_rank"), op=max_op()),
           "peak_mem_bytes": world.allreduce(memory, op=max_op()),
           "losses": losses, "inputs": {"initial_weights": initial_weights,
                                        "batches": digest_of(world.gather(data.hexdigest()) or [])}, **fields}
    run.close()
    return row if rank == 0 else {}


def weights_digest(model) -> str:
    """A digest of a model's parameters, name by name (each one's sum and norm in fp64):
    runs built alike have the same, a model from another seed or initialization another."""
    import torch

    summary = [(name, p.detach().sum(dtype=torch.float64).item(),
                torch.linalg.vector_norm(p.detach(), dtype=torch.float64).item())
               for name, p in model.named_parameters()]
    return digest_of(summary)


def digest_of(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def profiled(run, batches, lr: float, steps: int, device) -> dict:
    """`steps` more steps of `run` under torch.profiler, after the measured ones, whose
    figures it leaves alone: "profile", the PROFILE_ROWS operators and kernels that took the
    most time of their own per step (shard/tools/profiling.py's hottest), and
    "profile_table", torch's table of them."""
    import torch
    from torch.profiler import profile

    from shard.tools.profiling import activities, hottest

    with profile(activities=activities(device)) as prof:
        for _ in range(steps):
            run.step(step_batches(batches, device), lr)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    top, table = hottest(prof, device, steps, PROFILE_ROWS)
    return {"profile": top, "profile_table": table}


def compute_only(args, model, world) -> dict:
    """What the predictor's compute rate is measured from: forward and backward of one
    micro-batch, and AdamW over the model's elements, on every rank at once (the same
    launch, so the same cores shared) with no communication; medians after warm-up of the
    slowest rank's time."""
    import torch

    from shard.engine.adamw import FlatAdamW
    from shard.models.loss import next_token_loss

    tokens = step_batches(rank_batches(args, world.rank, world.size), "cpu")[0]
    master = torch.cat([p.detach().flatten() for p in model.parameters()])
    optimizer = FlatAdamW(master, [(0, master.numel())], BETAS, EPS, 0.0)
    grad = torch.full_like(master, 1e-3)
    times: dict[str, list] = {"fb": [], "update": []}
    lr = learning_rates(args)[-1]   # any: the update's time does not depend on it
    for _ in range(max(3, args.steps)):
        world.Barrier()
        start = time.perf_counter()
        with autocast(args):   # the runs' precision: bf16 products where --precision bf16
            loss = next_token_loss(model, tokens)
        loss.backward()
        times["fb"].append(world.allreduce(time.perf_counter() - start, op=max_op()))
        model.zero_grad(set_to_none=True)
        world.Barrier()
        start = time.perf_counter()
        optimizer.step(lr, [grad])
        times["update"].append(world.allreduce(time.perf_counter() - start, op=max_op()))
    skip = len(times["fb"]) // 3
    if world.rank != 0:
        return {}
    return {"name": "compute", "ranks": world.size, "fb_s": statistics.median(times["fb"][skip:]),
            "update_s_per_element": statistics.median(times["update"][skip:]) / master.numel()}


def max_op():
    from mpi4py import MPI

    return MPI.MAX


EMULATE = Path(__file__).resolve().parents[2] / "launch" / "emulate" / "run.py"


def launch_command(args: argparse.Namespace, name: str) -> list[str]:
    """The command of one run: mpiexec on this machine, or launch/emulate/run.py's
    emulated nodes (network namespaces, shaped links) with --nodes."""
    from runkit.mpirun import launcher

    worker = [sys.executable, "-m", "shard.tools.compare", f"--worker={name}", f"--model={args.model}",
              f"--steps={args.steps}", f"--batch={args.batch}", f"--micro={args.micro}", f"--seq={args.seq}",
              f"--device={args.device}", f"--precision={args.precision}", f"--out={args.out}", f"--data={args.data}"]
    worker += [f"--{k}={getattr(args, k)}" for k in ("width", "layers", "heads", "vocab") if getattr(args, k)]
    worker += [f"--{k}={getattr(args, k)}" for k in ("warmup", "lr") if getattr(args, k) is not None]
    if args.profile:
        worker.append(f"--profile={args.profile}")
    if args.ranks_per_node:
        worker.append(f"--ranks-per-node={args.ranks_per_node}")
    if not args.nodes:
        return [*launcher(), "-n", str(args.ranks), *worker]
    if not EMULATE.exists():
        refuse("shard-compare", f"--nodes needs the repository's {EMULATE.relative_to(EMULATE.parents[3])}")
    return [sys.executable, str(EMULATE), "--nodes", str(args.nodes[0]), "--ranks-per-node", str(args.nodes[1]),
            "--rate", args.rate, "--", *worker]


def launch(args: argparse.Namespace, name: str) -> dict:
    """One run in its own launch; its row, or a row saying why it did not run."""
    why = "" if name == "compute" else parse_run(name).unavailable(args)
    if why:
        return {"name": name, "not_run": why}
    cmd = launch_command(args, name)
    run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    rows = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not rows:
        raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    return json.loads(rows[-1])


def default_warmup(steps: int) -> int:
    """The steps left out of the timing unless --warmup says: a third, and at least the
    first (it calibrates, compiles and allocates: --steps 2 timed it)."""
    return max(1, steps // 3)


def median_launch(args: argparse.Namespace, name: str) -> dict:
    """The run launched args.launches times: the row of the median launch by tokens/s (of
    an even count, the lower middle one: a row is one launch's, never the fastest of two),
    with every launch's tokens/s in "launches_tokens_per_s"."""
    rows = [launch(args, name) for _ in range(max(1, args.launches))]
    if "not_run" in rows[0]:
        return rows[0]
    rows.sort(key=lambda r: r["tokens_per_s"])
    return dict(rows[(len(rows) - 1) // 2], launches_tokens_per_s=[r["tokens_per_s"] for r in rows])


def compared(rows: list[dict]) -> list[dict]:
    """The rows with each run's agreement with the first run's losses (compare_runs.
    agreement: loss_gap, loss_allowed, diverged), and its speed-up (tokens/s over the
    reference's) unless it diverged."""
    ran = [r for r in rows if "not_run" not in r]
    if not ran:
        return rows
    reference = ran[0]
    for r in ran:
        r.update(agreement(r["losses"], reference["losses"], loss_tolerance(r["name"], r.get("precision", "fp32"))))
        # bf16's allowance cannot tell other initial weights or batches apart: those are compared
        r["other_inputs"] = sorted(k for k, v in r.get("inputs", {}).items() if v != reference.get("inputs", {}).get(k))
        r["diverged"] = r["diverged"] or bool(r["other_inputs"])
        r["speedup"] = None if r["diverged"] else r["tokens_per_s"] / reference["tokens_per_s"]
    return rows


def predicted(args, rows: list[dict], probe: dict) -> None:
    """Each engine run's step predicted (shard/planning/predict.py) from `args.predict`'s profile and
    the compute rate `probe` measured: predicted_* fields and the error against the
    measurement, in place."""
    import torch

    from pccl import Topology
    from pccl.tuning import profiles
    from shard.engine.units import split_units
    from shard.models import GPT
    from shard.planning.predict import ComputeRate, Workload, predict_step, unit_flops

    profile = profiles.load(args.predict)
    with torch.device("meta"):
        model = GPT(model_config(args))
    flops = unit_flops(model, [u.name for u in split_units(model)], Workload(args.seq, args.batch, 1))
    rate = ComputeRate(sum(f + b for f, b in flops.values()) / probe["fb_s"], probe["update_s_per_element"],
                       "measured by a compute-only launch")
    topology = Topology.regular(args.ranks, args.ranks_per_node or args.ranks)
    for r in rows:
        run = None if "not_run" in r else parse_run(r["name"])
        if not isinstance(run, EngineRun) or run.codec:
            continue   # not the engine, or compressed (the cost model does not know codecs yet)
        p = predict_step(model, topology, profile, Workload(args.seq, args.batch, args.micro), rate,
                         flops=flops, shared_cores=True, strategy=run.strategy, algorithm=COMMS[run.comm],
                         group_size=topology.ranks_per_node,   # CPU ranks: cores compute and drive MPI
                         precision=args.precision, reshard_after_forward=not run.kept)
        r.update(predicted_step_s=p["step_s"], predicted_tokens_per_s=p["tokens_per_s"],
                 predicted_exposed_s=p["exposed_s"], predicted_compute_s=p["compute_s"],
                 predicted_comm_s=p["comm_s"], prediction_error=p["step_s"] / r["step_time_s"] - 1,
                 predicted_with=profile.name)


def markdown(rows: list[dict]) -> str:
    reference = next((r["name"] for r in rows if "not_run" not in r), "-")
    lines = [f"| run | tokens/s | MFU | step s | speed-up vs {reference} | waited for comm s | sent MB/rank | "
             f"peak MB | model state MB/rank (Table 2) | loss first -> last | loss gap (allowed) | "
             f"predicted step s (error) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "not_run" in r:
            lines.append(f"| {r['name']} | not run: {r['not_run']} |  |  |  |  |  |  |  |  |  |  |")
            continue
        mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        speedup = f"other {' and '.join(r['other_inputs'])}: none reported" if r.get("other_inputs") else \
            "diverged: none reported" if r["diverged"] else f"{r['speedup']:.2f}x"
        exposed = "-" if r["exposed_comm_s"] is None else f"{r['exposed_comm_s']:.4f}"
        state = "-" if "state_bytes" not in r else \
            f"{sum(r['state_bytes'].values()) / 1e6:.2f} ({sum(r['table2_bytes'].values()) / 1e6:.2f})"
        guess = "-" if "predicted_step_s" not in r else \
            f"{r['predicted_step_s']:.4f} ({r['prediction_error']:+.0%})"
        lines.append(f"| {r['name']} | {r['tokens_per_s']:.0f} | {mfu} | {r['step_time_s']:.4f} | {speedup} | "
                     f"{exposed} | {r['sent_bytes_per_rank'] / 1e6:.2f} | {r['peak_mem_bytes'] / 2**20:.0f} | "
                     f"{state} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | "
                     f"{r['loss_gap']:.1e} ({r['loss_allowed']:.1e}) | {guess} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if "not_run" not in r]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    drawn = bars.bar([r["name"] for r in ran], [r["tokens_per_s"] for r in ran], color="#4878d0")
    for bar, r in zip(drawn, ran):
        bars.annotate("diverged" if r["diverged"] else f"{r['speedup']:.2f}x",
                      (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    bars.set_ylabel("tokens/s")
    bars.set_title(f"speed-up over {ran[0]['name']} on each bar" if ran else "no run")
    bars.tick_params(axis="x", rotation=30)
    for r in ran:
        curves.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["name"])
    curves.set_xlabel("step")
    curves.set_ylabel("loss")
    curves.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@quiet_when_its_reader_goes
def main(argv=None) -> None:
    args = parse(argv)
    if args.worker:
        row = worker(args)
        if row:
            print(json.dumps(row), flush=True)
        return
    if args.nodes:
        args.ranks, args.ranks_per_node = args.nodes[0] * args.nodes[1], args.nodes[1]
    runs = args.runs
    for name in runs:
        parse_run(name)   # a bad name fails here, before anything launches
    if args.ranks_per_node and args.ranks % args.ranks_per_node:
        refuse("shard-compare", f"--ranks-per-node {args.ranks_per_node} does not divide --ranks {args.ranks}")
    if args.predict:
        from pccl.tuning import profiles

        try:   # before the launches, not after them
            profiles.load(args.predict)
        except ValueError as e:
            refuse("shard-compare", f"--predict {args.predict}: {e}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            refuse("shard-compare", "--device cuda, but torch sees no GPU here")
    try:
        model_config(args)   # a bad --model or shape fails here, before anything launches
    except ValueError as e:
        refuse("shard-compare", str(e))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prepare_data(args)   # once, here: every launch reads it
    rows = []
    for name in runs:
        rows.append(median_launch(args, name))
        print(f"{name}: " + (f"not run ({rows[-1]['not_run']})" if "not_run" in rows[-1] else
                             f"{rows[-1]['tokens_per_s']:.0f} tokens/s"), flush=True)
    for r in rows:
        table = r.pop("profile_table", None)
        if table is not None:
            (out / f"profile-{r['name']}.txt").write_text(table)
    rows = compared(rows)
    if args.predict:
        probe = launch(args, "compute")
        predicted(args, rows, probe)
        print(f"compute only: {probe['fb_s']:.4f} s forward+backward per micro-batch; AdamW "
              f"{probe['update_s_per_element'] * 1e9:.2f} ns per element", flush=True)
    (out / "compare.json").write_text(json.dumps({"runs": rows}, indent=1))
    (out / "compare.md").write_text(markdown(rows))
    plot(rows, out / "compare.png")
    print(markdown(rows))


if __name__ == "__main__":
    main()
