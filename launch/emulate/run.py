#!/usr/bin/env python3
"""Run an MPI job on emulated nodes (network namespaces on this machine, links shaped
with tc tbf), print each node link's bytes during the job, exit with the job's status.

    sudo .venv/bin/python launch/emulate/run.py --nodes 2 --ranks-per-node 4 --rate 1gbit \\
        --counters out.json -- .venv/bin/pccl-bench -b 1M -e 1M --algorithms ring

The command runs on every rank (mpiexec -n nodes*ranks-per-node), in this directory, with
the venv's bin/ first on PATH (this interpreter's, else .venv/bin). See launch/README.md, "Emulated nodes".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Run as a script: its folder is on sys.path, so the sibling module `cluster` imports as is.
from cluster import PREFIX, EmulatedCluster, EmulationError, delta, rate_bits

from runkit.args import at_least, checked, fraction

positive, rate = at_least(1), checked(rate_bits)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="%(prog)s [options] -- command [args...]")
    ap.add_argument("--nodes", type=positive, default=2, help="emulated nodes (default 2)")
    ap.add_argument("--ranks-per-node", type=positive, default=1, help="MPI ranks per node (default 1)")
    ap.add_argument("--rate", type=rate, default="1gbit", help="each link, each direction (tc units; default 1gbit)")
    ap.add_argument("--groups", type=positive, default=1,
                    help="network groups of consecutive nodes, each behind one shared uplink (default 1: none)")
    ap.add_argument("--uplink-rate", type=rate, default=None,
                    help="each group's uplink to the core, each direction (default: --rate)")
    ap.add_argument("--counters", metavar="PATH", help="write the per-node byte counts as JSON")
    ap.add_argument("--timeout", type=fraction(0.0, 1e9, low_open=True), help="seconds before the job is killed")
    ap.add_argument("--prefix", default=PREFIX, help=f"name prefix of namespaces and files (default {PREFIX})")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command given; put it after --")
    if args.counters and not (Path(args.counters).resolve().parent.is_dir() and
                              os.access(Path(args.counters).resolve().parent, os.W_OK)):
        ap.error(f"--counters {args.counters}: its directory is not a writable one (checked before the job, whose "
                 "counts it would lose)")

    try:
        with EmulatedCluster(args.nodes, args.ranks_per_node, args.rate, args.prefix, args.groups,
                             args.uplink_rate) as cluster:
            before, start = cluster.counters(), time.perf_counter()
            job = cluster.launch(command, timeout=args.timeout)
            seconds, traffic = time.perf_counter() - start, delta(before, cluster.counters())
    except EmulationError as e:
        print(f"run.py: error: {e}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired:
        print(f"run.py: the job ran past --timeout {args.timeout:g} s and was killed; namespaces removed",
              file=sys.stderr)
        return 124
    except KeyboardInterrupt as e:
        print(f"run.py: interrupted ({e or 'SIGINT'}); namespaces removed", file=sys.stderr)
        return 130
    except ValueError as e:
        ap.error(str(e))

    print(f"run.py: exit {job.returncode} after {seconds:.2f} s; link bytes during the job "
          f"({args.nodes} nodes x {args.ranks_per_node} ranks, {args.rate}):", file=sys.stderr)
    for host, c in traffic.items():
        print(f"  {host}: tx {c['tx_bytes']:>14,}  rx {c['rx_bytes']:>14,}", file=sys.stderr)
    if args.counters:
        Path(args.counters).write_text(json.dumps(
            {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "rate": args.rate,
             "exit": job.returncode, "seconds": seconds, "bytes": traffic}, indent=1) + "\n")
    return job.returncode


if __name__ == "__main__":
    sys.exit(main())
