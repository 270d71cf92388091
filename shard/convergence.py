"""Convergence benchmark: the same training run under several sharding strategies, whose
loss curves must agree (sharding changes where state lives, not the mathematics).

    python -m shard.convergence                       # tinyshakespeare from ../shared/data when present
    python -m shard.convergence --text my.txt --ranks 4 --strategies ddp,zero3,paro-iig --steps 300

Each strategy is one shard-train launch on the same data, seed and global batch. Writes
into --out: one run directory per strategy, curves.png (every strategy's training and
validation loss), convergence.json, and prints a table of final losses, tokens/s and the
largest relative difference of each curve from the first strategy's. Exits 1 when a
curve differs by more than --tolerance.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from pccl.mpirun import launcher

from .run_log import plot_losses

SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tinyshakespeare.txt"


def _arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", type=Path, default=SHAKESPEARE if SHAKESPEARE.is_file() else None,
                   help="a text file to train on (default: tinyshakespeare when present, else the synthetic corpus)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2, help="emulated nodes (groups for PaRO's I scope)")
    p.add_argument("--strategies", default="ddp,zero3,paro-iig")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tolerance", type=float, default=0.01, help="largest relative loss difference allowed")
    p.add_argument("--out", type=Path, default=Path("bench-results/convergence"))
    p.add_argument("overrides", nargs="*", help="more shard-train overrides for every run")
    return p.parse_args(argv)


def _run(args: argparse.Namespace, strategy: str) -> list[dict]:
    out = args.out / strategy
    data = ["data=text", f"data.files=[{args.text.resolve()}]", "data.vocab_size=2048", "data.val_fraction=0.05"] \
        if args.text else ["data=synthetic"]
    cmd = [*launcher(), "-n", str(args.ranks), sys.executable, "-m", "shard.train", f"strategy={strategy}",
           f"comm.ranks_per_node={args.ranks_per_node}", f"train.out_dir={out}", f"train.steps={args.steps}",
           "model.vocab=2048", "model.width=192", "model.layers=4", "model.heads=6", "train.seq_len=128",
           "train.micro_batch=8", f"train.global_batch_tokens={args.ranks * 8 * 128}", "optim.lr=2e-3",
           "optim.min_lr=2e-4", f"optim.warmup_steps={max(1, args.steps // 20)}", "train.eval_interval=50",
           "train.eval_batches=16", "log.interval=10", "log.progress=false", *data, *args.overrides]
    print(f"== {strategy}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main(argv=None) -> int:
    args = _arguments(argv)
    strategies = args.strategies.split(",")
    curves = {s: _run(args, s) for s in strategies}
    reference = curves[strategies[0]]
    rows = []
    for name, records in curves.items():
        summary = json.loads((args.out / name / "summary.json").read_text())
        diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(records, reference))
        rows.append({"strategy": name, "final_loss": records[-1]["loss"], "val_loss": summary["val_loss"],
                     "tokens_per_s": summary["tokens_per_s"], "exposed_comm_s": summary["exposed_comm_s"],
                     "max_rel_diff": diff})
    print(f"\n{'strategy':<10} {'final loss':>10} {'val loss':>9} {'tokens/s':>9} {'exposed s':>9} "
          f"{'max rel diff vs ' + strategies[0]:>24}")
    for r in rows:
        print(f"{r['strategy']:<10} {r['final_loss']:>10.4f} {r['val_loss']:>9.4f} {r['tokens_per_s']:>9.0f} "
              f"{r['exposed_comm_s']:>9.4f} {r['max_rel_diff']:>24.2e}")
    plot_losses(curves, args.out / "curves.png")
    (args.out / "convergence.json").write_text(json.dumps({"data": str(args.text or "synthetic"), "ranks": args.ranks,
                                                           "steps": args.steps, "rows": rows}, indent=1))
    agree = all(r["max_rel_diff"] <= args.tolerance for r in rows)
    print(f"curves {'agree' if agree else 'DISAGREE'} within {args.tolerance:.0%}; {args.out / 'curves.png'}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
