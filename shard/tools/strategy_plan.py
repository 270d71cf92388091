"""shard-plan: which sharding strategy, group size and algorithms to train a GPT with, on
a given cluster, and why.

    shard-plan --model gpt_7b --world 1024 --ranks-per-node 8 --profile frontier --memory 64GB --json

The planner (shard/planning/planner.py) evaluates every strategy PaRO's Principle 1 allows
at every candidate group size and algorithm: memory per rank at its peak against the
device's, and for those that fit the step time the engine's own trace predicts. The table
ranks every candidate; those that do not fit say by how much they miss.
"""
from __future__ import annotations

import argparse
import json

from pccl.tuning import profiles
from pccl.tuning.profiles import topology_for
from runkit.args import at_least, fraction, names, refuse
from runkit.closed_pipe import quiet_when_its_reader_goes
from runkit.sizes import parse_size
from shard.engine.config import OBJECTIVES
from shard.engine.strategy import STRATEGIES
from shard.models.gpt import PRESETS, GPTConfig
from shard.planning.planner import GIB, Cluster, Job, PlanError, StrategyPlan, group_sizes, in_gib, label, make_plan
from shard.planning.predict import ComputeRate
from shard.planning.throughput import DEFAULT_MFU, DEVICE_MEMORY_GIB, PEAK_TFLOPS, PROFILE_DEVICES


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="shard-plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_7b", help="a preset of shard.models: " + ", ".join(PRESETS))
    for name in ("width", "layers", "heads", "vocab"):
        ap.add_argument(f"--{name}", type=at_least(1), default=None, help=f"the preset's {name}, overridden")
    ap.add_argument("--world", type=at_least(2), required=True, help="ranks (GPUs or GCDs) in all")
    ap.add_argument("--ranks-per-node", type=at_least(1), default=None, help="default: the profile's")
    ap.add_argument("--profile", default="frontier", help="a built-in machine profile or a profile file")
    ap.add_argument("--memory", default=None,
                    help="memory per device: 64GB, 80GiB, ... (powers of 1024); default: the profile's device's")
    ap.add_argument("--headroom", type=fraction(0, 0.9), default=0.1, help="fraction of the memory kept free")
    ap.add_argument("--global-batch", type=at_least(1), default=4 * 2 ** 20,
                    help="tokens per step over all ranks (default: the PCCL paper's 4M, 4194304)")
    ap.add_argument("--seq", type=at_least(1), default=2048)
    ap.add_argument("--micro-batch", type=at_least(1), default=1, help="sequences per rank per micro-batch")
    ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--reduce-dtype", default=None, choices=("fp32", "bf16", "fp16"), help="default: --precision")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every block")
    ap.add_argument("--keep-parameters", action="store_true",
                    help="keep each unit's gathered parameters from its forward to its backward "
                         "(the engine's reshard_after_forward=False): one gather per unit and micro-batch")
    ap.add_argument("--prefetch", type=at_least(0), default=1)
    ap.add_argument("--objective", default="throughput", choices=OBJECTIVES)
    ap.add_argument("--strategies", type=names, default=None, help="comma-separated; default: all 14 of PaRO's Table 1")
    ap.add_argument("--groups", default=None,
                    help="comma-separated group sizes, or 'all' (every divisor); default: half a node to 4 nodes")
    ap.add_argument("--algorithms", default="auto", help="comma-separated pccl algorithms to evaluate each with")
    ap.add_argument("--mfu", type=fraction(low_open=True), default=DEFAULT_MFU,
                    help="compute efficiency of forward and backward alone, of the device's peak")
    ap.add_argument("--tflops", type=float, default=None,
                    help="achieved TFLOP/s per rank of forward and backward (overrides --mfu x peak)")
    ap.add_argument("--shared-cores", action="store_true",
                    help="ranks whose cores both compute and communicate (CPU ranks)")
    ap.add_argument("--predict-all", action="store_true", help="predict the step of candidates that do not fit too")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap.parse_args(argv)


def from_args(args: argparse.Namespace) -> tuple[Job, Cluster, dict]:
    """The job, the cluster and make_plan's keywords of a command line."""
    profile = profiles.load(args.profile)
    overrides = {k: getattr(args, k) for k in ("width", "layers", "heads", "vocab") if getattr(args, k) is not None}
    cfg = GPTConfig.preset(args.model, context=max(args.seq, GPTConfig.preset(args.model).context), **overrides)
    device = PROFILE_DEVICES.get(profile.name)
    if args.memory is not None:
        memory = parse_size(args.memory)
    elif device is not None:
        memory = DEVICE_MEMORY_GIB[device] * GIB
    else:
        raise PlanError(f"no device memory known for profile {profile.name!r}; pass --memory (64GB, 80GiB, ...)")
    peak = PEAK_TFLOPS[device][args.precision] * 1e12 if device else None
    if args.tflops is not None:
        rate_source, flops = f"{args.tflops} TFLOP/s per rank, as given", args.tflops * 1e12
    elif peak is not None:
        rate_source, flops = f"{args.mfu:.0%} of {peak / 1e12:g} TFLOP/s ({device}, {args.precision})", args.mfu * peak
    else:
        raise PlanError(f"no peak FLOP/s known for profile {profile.name!r}; pass --tflops (achieved per rank)")
    rate = ComputeRate.on(profile, flops, rate_source)
    topology = topology_for(args.world, profile, args.ranks_per_node, None)
    cluster = Cluster(topology, profile, memory, rate, args.headroom, peak, args.shared_cores)
    job = Job.for_global_batch(cfg, args.world, args.global_batch, args.seq, args.micro_batch,
                               precision=args.precision, reduce_dtype=args.reduce_dtype,
                               checkpointing=args.checkpointing, prefetch=args.prefetch,
                               reshard_after_forward=not args.keep_parameters, name=args.model)
    groups = None
    if args.groups == "all":
        groups = group_sizes(args.world, topology.ranks_per_node, every=True)
    elif args.groups:
        groups = [int(g) for g in args.groups.split(",") if g.strip()]
    keywords = {"objective": args.objective, "groups": groups, "predict_all": args.predict_all,
                "algorithms": tuple(a for a in args.algorithms.split(",") if a),
                "strategies": tuple(args.strategies) if args.strategies else STRATEGIES}
    return job, cluster, keywords


def table(plan: StrategyPlan) -> str:
    c, job = plan.cluster, plan.job
    head = [f"# {job.name}: {job.cfg.num_params() / 1e9:.3g}B parameters, {job.micro_batches} micro-batch(es) of "
            f"{job.micro_batch} x {job.seq} tokens per rank per step, {job.precision}"
            f"{', activation checkpointing' if job.checkpointing else ''}, prefetch {job.prefetch}"
            f"{', parameters kept to the backward' if not job.reshard_after_forward else ''}",
            f"# {c.topology.size} ranks ({c.topology.ranks_per_node} per node), profile {c.profile.name}, "
            f"{in_gib(c.memory)} per device, {in_gib(c.usable)} usable",
            *(f"# assumed: {a}" for a in plan.assumptions),
            f"{'#':>3} {'strategy':14} {'group':>5} {'algorithm':10} {'param':>7} {'grad':>7} {'optim':>7} "
            f"{'activ':>7} {'gather':>7} {'peak at':>8} {'peak GiB':>8} {'fits':>10} {'step s':>8} {'tokens/s':>10} "
            f"{'MFU':>5} {'exposed':>8}"]
    for r in plan.rows():
        # each part's size; the peak is the model state and the transient of one moment of the
        # step, which need not hold all of each (one micro-batch: the gradients arrive as the
        # backward frees the activations), so the parts need not add up to it
        m = r["memory"]
        gib = [f"{m[k] / GIB:7.2f}" for k in ("parameters", "gradients", "optimizer", "activations", "gathered")]
        fits = "yes" if r["fits"] else f"+{r['miss_bytes'] / GIB:.2f} GiB"
        mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.0%}"
        timed = (f"{r['step_s']:8.3f} {r['tokens_per_s']:10.4g} {mfu:>5} {r['exposed_s']:8.3f}" if "step_s" in r
                 else f"{'-':>8} {'-':>10} {'-':>5} {'-':>8}")
        group = "-" if r["group"] is None else r["group"]
        head.append(f"{r['rank']:3} {r['name']:14} {group:>5} {str(r['algorithm']):10} {' '.join(gib)} "
                    f"{m['moment'].removeprefix('unit '):>8} {m['peak'] / GIB:8.2f} {fits:>10} {timed}")
    head.append(f"chosen: {label(plan.chosen)}. {plan.reason()}")
    return "\n".join(head)


@quiet_when_its_reader_goes
def main(argv=None) -> None:
    args = parse(argv)
    try:
        job, cluster, keywords = from_args(args)
        plan = make_plan(job, cluster, **keywords)
    except (PlanError, ValueError) as e:
        refuse("shard-plan", str(e))
    print(json.dumps(plan.to_json(), indent=1, default=str) if args.json else table(plan))


if __name__ == "__main__":
    main()
