"""shard-sim: the engine's training throughput predicted at scale (shard/planning/predict.py).

    shard-sim --model gpt_7b,gpt_13b --profile frontier --ranks 128:1024 --comms native,pccl,hierarchical

For each model x world size x strategy x collective layer, the engine traces one step of
the model on the meta device over a dry-run communicator of that world, and the trace is
replayed with the cost model's collective times and compute from FLOPs at `--mfu` of the
device's peak. The default workload is the PCCL paper's end-to-end runs (Section 5.2):
a global batch of 4M tokens of 2048-token sequences, strong scaling, bf16.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from runkit.args import at_least, fraction, names, output, refuse
from runkit.closed_pipe import quiet_when_its_reader_goes
from shard.planning.throughput import DEFAULT_MFU

# Ratios the PCCL paper measured with DeepSpeed ZeRO-3 on Frontier, PCCL over RCCL (Section 6.2)
PAPER = {("gpt_7b", 1024): 1.60, ("gpt_13b", 1024): 1.39, ("gpt_7b", 512): 1 / 0.70, ("gpt_13b", 512): 1 / 0.84}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="shard-sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_7b,gpt_13b", help="comma-separated presets of shard.models")
    ap.add_argument("--profile", default="frontier", help="a built-in machine profile or a profile file")
    ap.add_argument("--ranks", default="128:1024", help="world sizes: a, a,b,c or a:b (doubling)")
    ap.add_argument("--ranks-per-node", type=at_least(1), default=None, help="default: the profile's")
    ap.add_argument("--strategies", type=names, default="zero3")
    ap.add_argument("--comms", type=names, default="native,pccl,hierarchical",
                    help="collective layers: native (the vendor's), pccl (auto), hierarchical, ho_ring")
    ap.add_argument("--global-batch", type=at_least(1), default=4 * 2 ** 20, help="tokens per step over all ranks")
    ap.add_argument("--seq", type=at_least(1), default=2048)
    ap.add_argument("--micro-batch", type=at_least(1), default=1, help="sequences per micro-batch per rank")
    ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--prefetch", type=at_least(0), default=1)
    ap.add_argument("--mfu", type=fraction(low_open=True), default=DEFAULT_MFU,
                    help="compute efficiency of forward and backward alone (no communication), of the peak")
    ap.add_argument("--peak-tflops", type=fraction(0, float("inf"), low_open=True), default=None,
                    help="default: the profile's device at --precision")
    ap.add_argument("--json", type=output(), help="write the rows to this file")
    return ap.parse_args(argv)


def peak(args, profile) -> float:
    from shard.planning.throughput import PEAK_TFLOPS, PROFILE_DEVICES

    if args.peak_tflops is not None:
        return args.peak_tflops
    device = PROFILE_DEVICES.get(profile.name)
    if device is None:
        refuse("shard-sim", f"no device known for profile {profile.name!r}; pass --peak-tflops")
    return PEAK_TFLOPS[device][args.precision]


def workload(args, ranks: int):
    from shard.planning.predict import Workload

    sequences = args.global_batch / args.seq / ranks
    micro_batches = sequences / args.micro_batch
    if micro_batches != int(micro_batches) or micro_batches < 1:
        refuse("shard-sim", f"a global batch of {args.global_batch} tokens is {sequences:g} sequences of "
                            f"{args.seq} per rank on {ranks} ranks, not a whole number of micro-batches of "
                            f"{args.micro_batch}")
    return Workload(args.seq, args.micro_batch, int(micro_batches))


def simulate(args) -> list[dict]:
    import torch

    from pccl import TopologyError
    from pccl.tuning import profiles
    from pccl.tuning.profiles import topology_for
    from runkit.sizes import doubling_range
    from shard.engine.strategy import Strategy, StrategyError
    from shard.engine.units import split_units
    from shard.models import GPT, GPTConfig
    from shard.planning.predict import ComputeRate, Workload, predict_step, unit_flops
    from shard.tools.compare_runs import COMMS

    try:
        worlds = doubling_range(args.ranks, int)
    except ValueError:
        worlds = []
    if not worlds or min(worlds) < 1:
        refuse("shard-sim", f"--ranks: expected positive world sizes as a, a,b,c or a:b, got {args.ranks!r}")
    try:   # all before the first row
        profile = profiles.load(args.profile)
        for ranks in worlds:
            topology_for(ranks, profile, args.ranks_per_node, None)
    except (ValueError, OSError, TopologyError) as e:
        refuse("shard-sim", str(e))
    strategies = args.strategies
    try:
        for s in strategies:
            Strategy.parse(s)
    except StrategyError as e:
        refuse("shard-sim", f"--strategies: {e}")
    micro = {ranks: workload(args, ranks) for ranks in worlds}
    tflops = peak(args, profile)
    rate = ComputeRate.on(profile, tflops * 1e12 * args.mfu, f"{args.mfu:.0%} of {tflops} TFLOP/s")
    comms = args.comms
    for c in comms:
        if c not in COMMS:
            refuse("shard-sim", f"unknown collective layer {c!r}; expected one of {tuple(COMMS)}")
    rows = []
    presets = []
    for name in args.model.split(","):
        try:
            presets.append((name, GPTConfig.preset(name, context=args.seq)))
        except ValueError as e:   # before any row is computed
            refuse("shard-sim", f"--model: {e}")
    print(f"# predicted (shard/planning/predict.py): compute at {args.mfu:.0%} of peak; the lanes share the network; "
          f"communication assumed not to slow compute\n{HEADER}", flush=True)
    for name, cfg in presets:
        with torch.device("meta"):
            model = GPT(cfg)
        # one micro-batch's FLOPs, the same at every world size (counted once: seconds for a 7B model)
        flops = unit_flops(model, [u.name for u in split_units(model)], Workload(args.seq, args.micro_batch, 1))
        for ranks in worlds:
            topology = topology_for(ranks, profile, args.ranks_per_node, None)
            for strategy in strategies:
                base: Optional[float] = None
                for comm in comms:
                    r = predict_step(model, topology, profile, micro[ranks], rate, flops=flops, strategy=strategy,
                                     algorithm=COMMS[comm], precision=args.precision, reduce_dtype=args.precision,
                                     prefetch=args.prefetch, group_size=topology.ranks_per_node)
                    base = r["step_s"] if comm == "native" else base
                    row = {"model": name, "ranks": ranks, "strategy": strategy, "comm": comm,
                           "micro_batches": micro[ranks].micro_batches, "compute_rate": rate.source,
                           "speedup_vs_native": base / r["step_s"] if base else None,
                           # the paper's ratios are ZeRO-3's (DeepSpeed's), on Frontier
                           "paper_speedup": PAPER.get((name, ranks))
                           if profile.name == "frontier" and strategy == "zero3" else None,
                           **r}
                    rows.append(row)
                    print(line(row), flush=True)
    return rows


def line(r: dict) -> str:
    speedup = f"{r['speedup_vs_native']:.2f}x" if r["speedup_vs_native"] else "-"
    paper = f"  (paper, PCCL vs RCCL: {r['paper_speedup']:.2f}x)" if r["paper_speedup"] and r["comm"] != "native" \
        else ""
    return (f"{r['model']:8} {r['ranks']:6} {r['strategy']:8} {r['comm']:12} {r['step_s']:9.3f} {r['compute_s']:9.3f} "
            f"{r['comm_s']:9.3f} {r['exposed_s']:9.3f} {r['tokens_per_s']:12.0f} {speedup:>8}{paper}")


HEADER = (f"{'model':8} {'ranks':>6} {'strategy':8} {'comm':12} {'step s':>9} {'compute':>9} {'comm s':>9} "
          f"{'exposed':>9} {'tokens/s':>12} {'vs native':>8}")


@quiet_when_its_reader_goes
def main(argv=None) -> None:
    args = parse(argv)
    rows = simulate(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
