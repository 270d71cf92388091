#!/usr/bin/env python3
"""Validate the cost model on emulated nodes: measured vs predicted time of every
algorithm, auto against the best fixed algorithm, and the link bytes the runs moved.

    .venv/bin/python launch/emulate/validate.py --out bench-results/emulated

For each shape (nodes x ranks per node) it launches pccl-bench `--launches` times on
emulated nodes with links shaped to `--rate`, and takes the median time of each
(collective, size, algorithm) over the launches. The profile the model predicts with is
calibrated first on the first shape (pccl-bench --calibrate, in the same emulation) unless
--profile names one; auto runs with it (PCCL_PROFILE). Writes results.json and report.md.

Two tiers: `--groups K --uplink-rate R` puts the nodes in K groups of consecutive nodes,
each behind one uplink of rate R to the core (cluster.py), tells pccl (PCCL_NODES_PER_GROUP)
and predicts with the profile's network tier, or, where the profile has none, one derived
from the rates: a group's nodes' links over its uplink is the oversubscription, and
messages between groups cost the inter-node alpha (a switch hop more is not measurable
here). For example 2 groups x 2 nodes x 2 ranks, the three-level plan against the
two-level one, the ring and MPI's own:

    .venv/bin/python launch/emulate/validate.py --shapes 4x2 --groups 2 --uplink-rate 500mbit \
        --profile pccl/tuning/profiles/emulated-1gbit.json --algorithms three_level,hierarchical,ring,native,auto
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

# Run as a script: its folder is on sys.path, so the sibling module `cluster` imports as is.
from cluster import EmulatedCluster, delta, rate_bits, venv_bin

from pccl import plans
from pccl.analysis import traffic
from pccl.core.topology import Topology
from pccl.tuning import cost_model, profiles
from pccl.tuning.profiles import Network
from runkit.args import at_least, checked, fraction
from runkit.sizes import parse_size, size_label

ROOT = Path(__file__).resolve().parents[2]


def bench(cluster: EmulatedCluster, args, json_path: Path, profile_path: Path) -> dict:
    """One pccl-bench launch: its rows and the link bytes it moved."""
    argv = [str(venv_bin() / "pccl-bench"), "-b", args.min_size, "-e", args.max_size, "-f", "4",
            "-n", str(args.iters), "-w", "1", "--executors", "cpp",
            "--collectives", "all_gather,reduce_scatter", "--json", str(json_path)]
    if args.algorithms:
        argv += ["--algorithms", args.algorithms]
    env = {"PCCL_PROFILE": str(profile_path)}
    if args.groups > 1:
        env["PCCL_NODES_PER_GROUP"] = str(len(cluster.nodes) // args.groups)
    before = cluster.counters()
    job = cluster.launch(argv, env=env, capture=True, timeout=args.timeout)
    moved = delta(before, cluster.counters())
    if job.returncode != 0:
        raise RuntimeError(f"pccl-bench failed (exit {job.returncode}):\n{job.stdout[-2000:]}\n{job.stderr[-2000:]}")
    return {"rows": json.loads(json_path.read_text()), "link_bytes": moved}


def calls_per_row(args) -> int:
    """pccl-bench's calls per row: warm-up, timed (one repeat) and the check."""
    return 1 + args.iters + 1


def crossing(collective: str, algorithm: str, topology: Topology, prof: profiles.Profile, count: int,
             itemsize: int):
    """(rank, peer, bytes) of every message between nodes in one call, read off the
    schedules (MPI's own collectives: the schedule the profile counts them as)."""
    if algorithm == "native":
        algorithm = profiles.for_group(prof.native_algorithm(collective), topology.size)
    spec = plans.NAMED.get(algorithm, algorithm)
    for rank in range(topology.size):
        for peer, nbytes in traffic.sent(collective, spec, topology, rank, count, itemsize).items():
            if topology.node_of(peer) != topology.node_of(rank):
                yield rank, peer, nbytes


def expected_link_bytes(rows: list[dict], topology: Topology, prof: profiles.Profile, args) -> int:
    """Bytes all ranks send to other nodes during a launch."""
    total = sum(nbytes for row in rows for _, _, nbytes in
                crossing(row["collective"], row["picked"], topology, prof, row["count"], row["size"] // row["count"]))
    return total * calls_per_row(args)


def busiest_link_bytes(collective: str, algorithm: str, topology: Topology, prof: profiles.Profile,
                       nbytes: int) -> int:
    """Bytes through the busiest node link direction in one call (what the rate limits)."""
    out: Counter = Counter()
    for rank, peer, sent in crossing(collective, algorithm, topology, prof, nbytes // 4, 4):
        out[("tx", topology.node_of(rank))] += sent
        out[("rx", topology.node_of(peer))] += sent
    return max(out.values(), default=0)


def measure_shape(nodes: int, local: int, args, profile_path: Path, out: Path) -> list[dict]:
    """The launches of one shape; also saved to launches-<shape>.json for --report-only."""
    launches = []
    with EmulatedCluster(nodes, local, args.rate, groups=args.groups, uplink_rate=args.uplink_rate) as cluster:
        for i in range(args.launches):
            launches.append(bench(cluster, args, out / f"bench-{nodes}x{local}-{i}.json", profile_path))
            print(f"# {nodes}x{local}: launch {i + 1}/{args.launches} done", flush=True)
    (out / f"launches-{nodes}x{local}.json").write_text(json.dumps(launches) + "\n")
    return launches


def validate_shape(nodes: int, local: int, launches: list[dict], args, profile_path: Path) -> dict:
    """Measured (median over launches) against predicted, per (collective, size, algorithm)."""
    topology = Topology.regular(nodes * local, local, 1, nodes // args.groups if args.groups > 1 else None)
    prof = profiles.load(profile_path)
    times: dict = {}
    picked: dict = {}
    for launch in launches:
        for row in launch["rows"]:
            key = (row["collective"], row["size"], row["executor"], row["algorithm"])
            times.setdefault(key, []).append(row["time_us"] * 1e-6)
            if row["algorithm"] == "auto":
                picked.setdefault(key, []).append(row["picked"])
    link_rate = rate_bits(args.rate) / 8
    results = []
    for (collective, size, executor, algorithm), samples in sorted(times.items()):
        measured = statistics.median(samples)
        runs = algorithm
        if algorithm == "auto":
            runs = Counter(picked[(collective, size, executor, algorithm)]).most_common(1)[0][0]
        predicted = cost_model.predict(collective, plans.NAMED.get(runs, runs), topology, prof, size)
        link = busiest_link_bytes(collective, runs, topology, prof, size)
        results.append({"collective": collective, "size": size, "executor": executor, "algorithm": algorithm,
                        "runs": runs, "measured_s": measured, "samples_s": samples, "predicted_s": predicted,
                        "error": predicted / measured - 1,
                        "link_bytes_per_call": link, "link_GBps": link / measured / 1e9,
                        "link_utilization": link / measured / link_rate})
    counted = [sum(c["tx_bytes"] for c in launch["link_bytes"].values()) for launch in launches]
    expected = [expected_link_bytes(launch["rows"], topology, prof, args) for launch in launches]
    return {"shape": f"{nodes}x{local}", "rate": args.rate, "results": results,
            "link_bytes_counted": counted, "link_bytes_expected": expected}


def auto_rows(shape: dict) -> list[dict]:
    """Per (collective, size): auto's measured time against the best fixed algorithm's."""
    out = []
    groups: dict = {}
    for r in shape["results"]:
        groups.setdefault((r["collective"], r["size"]), []).append(r)
    for (collective, size), rows in sorted(groups.items()):
        auto = next(r for r in rows if r["algorithm"] == "auto")
        fixed = [r for r in rows if r["algorithm"] != "auto"]
        best = min(fixed, key=lambda r: r["measured_s"])
        out.append({"collective": collective, "size": size, "auto_runs": auto["runs"],
                    "auto_s": auto["measured_s"], "best": best["algorithm"], "best_s": best["measured_s"],
                    "slowdown": auto["measured_s"] / best["measured_s"] - 1})
    return out


def report(shapes: list[dict], prof: profiles.Profile, args) -> str:
    lines = [f"# Cost model on emulated nodes ({args.rate} links, median of {args.launches} launches)", "",
             f"Profile: {prof.description}; intra alpha {prof.intra.alpha * 1e6:.1f} us, "
             f"{prof.intra.bandwidth / 1e9:.2f} GB/s; inter alpha {prof.inter.alpha * 1e6:.1f} us, NIC "
             f"{prof.inter.bandwidth / 1e9:.3f} GB/s, stream {prof.inter.stream_beta ** -1 / 1e9:.3f} GB/s; "
             f"reduce {prof.reduce_bandwidth / 1e9:.2f} GB/s; copy {prof.copy_bandwidth / 1e9:.2f} GB/s", ""]
    for shape in shapes:
        lines += [f"## {shape['shape']}", "",
                  "| collective | size | algorithm | measured ms | predicted ms | error | busiest link GB/s "
                  "| of the rate |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in shape["results"]:
            name = f"auto ({r['runs']})" if r["algorithm"] == "auto" else (
                "native (MPI)" if r["algorithm"] == "native" else r["algorithm"])
            lines.append(f"| {r['collective']} | {size_label(r['size'])} | {name} | {r['measured_s'] * 1e3:.1f} | "
                         f"{r['predicted_s'] * 1e3:.1f} | {r['error'] * 100:+.0f}% | {r['link_GBps']:.3f} | "
                         f"{r['link_utilization'] * 100:.0f}% |")
        lines += ["", "| collective | size | auto ran | auto ms | best fixed | best ms | auto slower by |",
                  "|---|---|---|---|---|---|---|"]
        for a in auto_rows(shape):
            lines.append(f"| {a['collective']} | {size_label(a['size'])} | {a['auto_runs']} | "
                         f"{a['auto_s'] * 1e3:.1f} | {a['best']} | {a['best_s'] * 1e3:.1f} | "
                         f"{a['slowdown'] * 100:+.1f}% |")
        lines += ["", "Link bytes per launch, counted on the interfaces vs read off the schedules: " +
                  ", ".join(f"{c:,} vs {e:,} ({c / e:.3f})" for c, e in
                            zip(shape["link_bytes_counted"], shape["link_bytes_expected"])), ""]
    return "\n".join(lines)


def with_network(profile_path: Path, args) -> Path:
    """The profile with a network tier: its own, or one derived from the emulated rates."""
    prof = profiles.load(profile_path)
    if prof.network is not None:
        return profile_path
    nodes = args.shapes[0][0] // args.groups
    over = nodes * rate_bits(args.rate) / rate_bits(args.uplink_rate or args.rate)
    derived = dataclasses.replace(prof, name=f"{prof.name}-groups", network=Network(
        nodes, prof.inter.alpha, over, f"derived from the emulation: {nodes} nodes of {args.rate} links share a "
                                       f"{args.uplink_rate or args.rate} uplink per group; alpha as between nodes"))
    path = args.out / "profile-groups.json"
    derived.save(path)
    return path


def shape_arg(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"shapes look like 2x4,4x2 (nodes x ranks per node, each >= 1); got {text!r}")
    return shapes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "emulated")
    ap.add_argument("--shapes", type=shape_arg, default=[(2, 4), (4, 2)])
    ap.add_argument("--rate", type=checked(rate_bits), default="1gbit")
    ap.add_argument("--launches", type=at_least(1), default=3)
    ap.add_argument("--iters", type=at_least(1), default=3, help="timed calls per row")
    ap.add_argument("--min-size", type=checked(parse_size), default="1M")
    ap.add_argument("--max-size", type=checked(parse_size), default="64M")
    ap.add_argument("--profile", type=Path, default=None, help="skip calibration and predict with this profile")
    ap.add_argument("--timeout", type=fraction(0.0, 1e9, low_open=True), default=1800)
    ap.add_argument("--groups", type=at_least(1), default=1, help="network groups of consecutive nodes (two tiers)")
    ap.add_argument("--uplink-rate", type=checked(rate_bits), default=None,
                    help="each group's uplink to the core (default --rate)")
    ap.add_argument("--algorithms", default=None, help="pccl-bench --algorithms (default: all; include auto)")
    ap.add_argument("--report-only", action="store_true",
                    help="no launches: predict again for the launches saved in --out (after a model change)")
    args = ap.parse_args(argv)
    if args.groups > 1 and len({n for n, _ in args.shapes}) > 1:   # one derived network tier for all shapes
        ap.error(f"--groups takes shapes of one node count, got {args.shapes}")
    if args.shapes[0][0] % args.groups:
        ap.error(f"--groups {args.groups} must divide the shapes' {args.shapes[0][0]} nodes")
    args.out.mkdir(parents=True, exist_ok=True)
    profile_path = args.profile
    if args.report_only:
        profile_path = profile_path or args.out / "profile.json"
    elif profile_path is None:
        profile_path = args.out / "profile.json"
        nodes, local = args.shapes[0]
        with EmulatedCluster(nodes, local, args.rate) as cluster:
            job = cluster.launch([str(venv_bin() / "pccl-bench"), "--calibrate", str(profile_path),
                                  "--profile-name", f"emulated-{args.rate}"], capture=True, timeout=args.timeout)
        if job.returncode != 0:
            raise SystemExit(f"calibration failed:\n{job.stdout[-2000:]}\n{job.stderr[-2000:]}")
        print(f"# calibrated {profile_path}", flush=True)
    if args.groups > 1:
        profile_path = with_network(profile_path, args)
    shapes = []
    for n, l in args.shapes:
        saved = args.out / f"launches-{n}x{l}.json"
        if args.report_only:
            launches = json.loads(saved.read_text())
        else:
            launches = measure_shape(n, l, args, profile_path, args.out)
        shapes.append(validate_shape(n, l, launches, args, profile_path))
    (args.out / "results.json").write_text(json.dumps(shapes, indent=1) + "\n")
    text = report(shapes, profiles.load(profile_path), args)
    (args.out / "report.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
