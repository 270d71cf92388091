"""pccl-sim: predicted collective times at any scale, from a machine profile and the cost model.

  pccl-sim --profile frontier --collective all_gather --ranks 2048 --size 16M
  pccl-sim --profile frontier --collective all_gather --ranks 2048 --size 16M --json
  pccl-sim --profile frontier --collective all_gather --ranks 32:2048 --size 16M:1G \\
           --heatmap out/frontier-ag --target hierarchical --baseline native
  pccl-sim --profile emulated-1gbit --collective all_reduce --ranks 8 --size 4K:64M --compression int8,bf16

Sizes are whole buffers per rank (the all-gather output, the reduce-scatter input), as in
pccl-bench and the PCCL paper's figures. A range "a:b" doubles from a to b. The heatmap
(PNG and CSV) shows the speedup of --target over --baseline per (ranks, size), like
Figures 9 and 11 of the PCCL paper (blank where the target does not apply: three_level
within one network group). --compression adds every algorithm with each codec
("ring+int8", from the profile's codec speeds) and what compression="auto" would run.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from pccl import plans, vocabulary
from pccl.compression.codecs import codec
from pccl.core.collectives import COLLECTIVES
from pccl.core.topology import Topology, TopologyError
from pccl.tuning import cost_model, profiles
from pccl.tuning.profiles import topology_for
from pccl.tuning.selection import Tuner
from runkit.args import at_least, comma_names, refuse
from runkit.closed_pipe import quiet_when_its_reader_goes
from runkit.files import write_atomic
from runkit.sizes import doubling_range, parse_size, size_label


def evaluate(collective: str, topology: Topology, prof: profiles.Profile, sizes: list[int],
             codecs: tuple = ()) -> dict:
    """{"algorithms": {name: seconds per size}, "auto": [name per size]}; with `codecs`,
    "ALGORITHM+CODEC" entries too and "auto_compressed": what compression="auto" runs."""
    tuner = Tuner(topology, prof)
    nbytes = np.asarray(sizes, dtype=np.float64)
    times = tuner.predictions(collective, nbytes)
    times["native"] = cost_model.predict(collective, "native", topology, prof, nbytes)
    out = {"algorithms": times, "auto": [tuner.name(collective, s) for s in sizes]}
    if codecs:
        for c in codecs:
            for name in tuner.compressible(collective):
                times[f"{name}+{c}"] = cost_model.predict(collective, plans.NAMED.get(name, name), topology, prof,
                                                          nbytes, compression=c)
        chosen = [tuner.choose_compressed(collective, s, torch.float32) for s in sizes]
        out["auto_compressed"] = [name if c is None else f"{name}+{c}" for c, name in chosen]
    return out


def record(collective: str, topology: Topology, prof: profiles.Profile, size: int, result: dict, i: int) -> dict:
    return {"profile": prof.name, "collective": collective, "ranks": topology.size,
            "nodes": topology.num_nodes, "ranks_per_node": topology.ranks_per_node,
            "nics_per_node": topology.nics_per_node,
            "nodes_per_group": topology.nodes_per_group if topology.has_groups else None, "size": size,
            "algorithms": {name: float(t[i]) for name, t in result["algorithms"].items()},
            "auto": result["auto"][i],
            **({"auto_compressed": result["auto_compressed"][i]} if "auto_compressed" in result else {})}


def table(records: list[dict], baseline: str) -> str:
    lines = []
    for rec in records:
        groups = f", groups of {rec['nodes_per_group']} nodes" if rec["nodes_per_group"] else ""
        lines.append(f"# {rec['collective']}  profile: {rec['profile']}  ranks: {rec['ranks']} "
                     f"({rec['nodes']}x{rec['ranks_per_node']}, {rec['nics_per_node']} NIC(s)/node{groups})  "
                     f"size: {rec['size']} B")
        lines.append(f"#{'algorithm':>24} {'time(us)':>12} {'algbw(GB/s)':>12} {'vs ' + baseline:>14}")
        base = rec["algorithms"].get(baseline)
        for name, t in sorted(rec["algorithms"].items(), key=lambda kv: kv[1]):
            mark = " <- auto" if name == rec["auto"] else ""
            mark += " <- compression=auto" if name == rec.get("auto_compressed") else ""
            # (one rank moves nothing: every time is 0)
            ratio = f"{base / t:.2f}x" if base and t else "-"
            algbw = f"{rec['size'] / t / 1e9:12.3f}" if t else f"{'-':>12}"
            lines.append(f"{name:>25} {t * 1e6:12.1f} {algbw} {ratio:>14}{mark}")
    return "\n".join(lines)


def speedups(records: list[dict], target: str, baseline: str, ranks: list[int], sizes: list[int]) -> np.ndarray:
    """grid[size index, ranks index] = time(baseline) / time(target)."""
    grid = np.full((len(sizes), len(ranks)), np.nan)
    for rec in records:
        t = rec["algorithms"][rec["auto"]] if target == "auto" else rec["algorithms"].get(target)
        b = rec["algorithms"].get(baseline)
        if t and b:
            grid[sizes.index(rec["size"]), ranks.index(rec["ranks"])] = b / t
    return grid


def write_heatmap(prefix: str, grid: np.ndarray, ranks: list[int], sizes: list[int], title: str) -> list[str]:
    """prefix.csv (rows: sizes, columns: ranks) and prefix.png; returns the paths."""
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["size_bytes"] + [f"ranks_{r}" for r in ranks])
    for size, row in zip(sizes, grid):
        writer.writerow([size] + [f"{v:.4f}" for v in row])
    write_atomic(f"{prefix}.csv", text.getvalue())

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    fig, ax = plt.subplots(figsize=(1.1 * len(ranks) + 2.5, 0.6 * len(sizes) + 1.8))
    finite = grid[np.isfinite(grid)]
    span = max(float(np.max(np.abs(np.log10(finite)))), 0.1) if finite.size else 1.0
    image = ax.imshow(grid, cmap="RdYlGn", norm=LogNorm(10 ** -span, 10 ** span), origin="upper", aspect="auto")
    for i in range(len(sizes)):
        for j in range(len(ranks)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_yticks(range(len(sizes)), [size_label(s) for s in sizes])
    ax.set_xlabel("ranks (processes)")
    ax.set_ylabel("buffer size per rank")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="speedup (x)")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    write_atomic(f"{prefix}.png", png.getvalue())
    return [f"{prefix}.csv", f"{prefix}.png"]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pccl-sim", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--profile", default=profiles.DEFAULT,
        help=f"a built-in profile {profiles.builtin_names()} or a profile file")
    add("--collective", choices=COLLECTIVES, default="all_gather")
    add("--ranks", default="2048", help="ranks: a number, a comma list, or a doubling range a:b")
    add("--size", default="16M", help="buffer bytes (K/M/G): a size, a comma list, or a doubling range a:b")
    add("--ranks-per-node", type=at_least(1), default=None, help="override the profile's node shape")
    add("--nics-per-node", type=at_least(1), default=None, help="override the profile's NICs per node")
    add("--nodes-per-group", type=at_least(0), default=None,
        help="override the profile's nodes per network group (dragonfly group, pod); 0: no groups")
    add("--baseline", default="ring", choices=vocabulary.names(), help="the algorithm speedups are measured against")
    add("--target", default="hierarchical", choices=vocabulary.names(),
        help="the heatmap's algorithm ('auto': the model's choice)")
    add("--heatmap", metavar="PREFIX", default=None, help="write PREFIX.csv and PREFIX.png")
    add("--compression", default="", metavar="CODECS",
        help="codecs to predict (comma list, e.g. int8,bf16): fp32 payloads, at the profile's codec speeds")
    add("--json", action="store_true", help="print JSON (one object, or a list for several ranks/sizes)")
    args = parser.parse_args(argv)
    try:
        args.profile_obj = profiles.load(args.profile)
        args.codecs = tuple(comma_names(args.compression))
        for name in args.codecs:
            codec(name)
            args.profile_obj.codec_rate(name.removeprefix("p2p:"))
    except ValueError as e:
        parser.error(str(e))
    for flag, field, text, parse in (("--ranks", "ranks_list", args.ranks, int),
                                     ("--size", "sizes", args.size, parse_size)):
        try:   # (a bad one said "invalid literal for int() with base 10", naming no flag)
            setattr(args, field, doubling_range(text, parse))
        except ValueError as e:
            parser.error(f"{flag} {text}: {e}; expected N, N,M,... or N:M (doubling)")
    if not args.ranks_list or min(args.ranks_list) < 1:
        parser.error(f"--ranks must be positive, got {args.ranks!r}")
    if not args.sizes or min(args.sizes) < 1:
        parser.error(f"--size must be positive, got {args.size!r}")
    return args


@quiet_when_its_reader_goes
def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    prof = args.profile_obj
    records = []
    for ranks in args.ranks_list:
        try:
            topology = topology_for(ranks, prof, args.ranks_per_node, args.nics_per_node, args.nodes_per_group)
        except TopologyError as e:
            refuse("pccl-sim", str(e))
        result = evaluate(args.collective, topology, prof, args.sizes, args.codecs)
        records += [record(args.collective, topology, prof, size, result, i) for i, size in enumerate(args.sizes)]
    # the target is the heatmap's: a single node has no hierarchical plan, and its table needs none
    for name in (args.baseline, args.target) if args.heatmap else (args.baseline,):
        if name != "auto" and not any(name in rec["algorithms"] for rec in records):   # three_level needs groups
            refuse("pccl-sim", f"no algorithm {name!r} for {args.collective}; expected auto or one of "
                               f"{sorted(set().union(*(rec['algorithms'] for rec in records)))}")
    if args.json:
        print(json.dumps(records[0] if len(records) == 1 else records, indent=1))
    else:
        print(table(records, args.baseline))
    if args.heatmap:
        grid = speedups(records, args.target, args.baseline, args.ranks_list, args.sizes)
        title = (f"{args.collective}: speedup of {args.target} over {args.baseline} "
                 f"(predicted, profile {prof.name})")
        paths = write_heatmap(args.heatmap, grid, args.ranks_list, args.sizes, title)
        print(f"# wrote {', '.join(paths)}", file=sys.stderr)


if __name__ == "__main__":
    main()
