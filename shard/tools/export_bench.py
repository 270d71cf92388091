"""Export and load memory and time (issue: Hugging Face weights in and out). One process:

    python -m shard.tools.export_bench --model gpt_1p3b --layers 4 --repeats 3 --dir /tmp/export-bench

Writes one snapshot of the model (world 1, ZeRO-3; `--layers` keeps the preset's unit sizes
with fewer blocks, so a 1.3B-shaped model fits a small machine), then per repeat:
`shard-export` of the snapshot in bf16, in a process of its own, and loading that export
into an engine from the meta device (what `shard-train model=hf` does), in another. For
each it samples the process's memory every 5 ms: anonymous memory (what the process
allocated) and the resident set (which adds the pages of the memory-mapped files it reads,
the kernel's to drop). Reported: medians over repeats, beside the largest unit and
parameter in fp32, the bound the issue sets (1.5 x the largest unit, plus the writer's
buffer: none here, each tensor is written from its own memory), and seconds per GB written.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from runkit.args import at_least
from runkit.closed_pipe import quiet_when_its_reader_goes

LOAD = """
import sys, torch, pccl
from shard.engine.engine import Engine
from shard.models import from_pretrained
torch.set_num_threads(1)
Engine(from_pretrained(sys.argv[1], device="meta"), pccl.init(), strategy="zero3", device="cpu")
"""


def memory(pid: int) -> tuple[int, int]:
    """(anonymous, resident) bytes of process `pid`, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmRSS"):
                fields[key] = int(value.split()[0]) * 1024
    return fields.get("RssAnon", 0), fields.get("VmRSS", 0)


def sampled(cmd: list[str]) -> dict:
    """Run `cmd`; its wall time and peak anonymous and resident memory."""
    start = time.perf_counter()
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = [0, 0]

    def watch() -> None:
        while job.poll() is None:
            try:
                peaks[:] = [max(a, b) for a, b in zip(peaks, memory(job.pid))]
            except (OSError, ValueError):
                pass
            time.sleep(0.005)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, _ = job.communicate()
    watcher.join()
    if job.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out[-2000:]}")
    return {"s": time.perf_counter() - start, "anon": peaks[0], "rss": peaks[1]}


@quiet_when_its_reader_goes
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="export_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_1p3b", help="a preset of shard.models")
    ap.add_argument("--layers", type=at_least(1), default=None, help="the preset's blocks, fewer (default: all)")
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument("--dir", default="export-bench", help="where the snapshot and exports go (removed at the end)")
    args = ap.parse_args(argv)

    import torch

    import pccl
    from shard.engine import checkpoint
    from shard.engine.engine import Engine
    from shard.engine.optimizer import ShardedAdamW
    from shard.models import GPT, GPTConfig

    root = Path(args.dir)
    comm = pccl.init()

    def snapshot(cfg: GPTConfig, where: Path) -> tuple[int, int]:
        """A snapshot of `cfg` under `where`; its largest unit and parameter in fp32 bytes."""
        with torch.device("meta"):
            engine = Engine(GPT(cfg), comm, strategy="zero3", device="cpu")
        checkpoint.save(engine, ShardedAdamW(engine), where / "checkpoints", extra={"config": asdict(cfg)})
        sizes = (max(u.flat.numel for u in engine.units) * 4,
                 max(shape.numel() for u in engine.units for shape in u.flat.shapes) * 4)
        engine.close()
        return sizes

    def export(where: Path, out: Path) -> tuple[dict, dict]:
        return (sampled([sys.executable, "-m", "shard.tools.export", str(where), "--out", str(out)]),
                sampled([sys.executable, "-c", LOAD, str(out)]))

    cfg = GPTConfig.preset(args.model, **({"layers": args.layers} if args.layers else {}))
    largest_unit, largest_param = snapshot(cfg, root)
    # the same programs on a model of a few kilobytes: the interpreter's and libraries' own memory
    snapshot(GPTConfig(vocab=64, context=8, width=8, layers=1, heads=1), root / "small")
    fixed = export(root / "small", root / "small" / "export")
    exports, loads = zip(*(export(root, root / f"export-{i}") for i in range(args.repeats)))
    written = sum(f.stat().st_size for f in (root / "export-0").glob("*.safetensors"))

    def median(rows: list, key: str) -> float:
        return statistics.median(r[key] for r in rows)
    print(json.dumps({
        "model": args.model, "layers": cfg.layers, "parameters": cfg.num_params(), "written_bytes": written,
        "largest_unit_fp32": largest_unit, "largest_parameter_fp32": largest_param, "repeats": args.repeats,
        "fixed_anon": {"export": fixed[0]["anon"], "load": fixed[1]["anon"]},
        "export": {"s": round(median(exports, "s"), 2), "s_per_gb": round(median(exports, "s") / (written / 1e9), 2),
                   "peak_anon": median(exports, "anon"), "peak_rss": median(exports, "rss"),
                   "above_fixed_over_largest_unit": round((median(exports, "anon") - fixed[0]["anon"])
                                                          / largest_unit, 3)},
        "load": {"s": round(median(loads, "s"), 2), "peak_anon": median(loads, "anon"),
                 "peak_rss": median(loads, "rss"), "model_fp32": cfg.num_params() * 4,
                 "above_fixed_over_model": round((median(loads, "anon") - fixed[1]["anon"]) / (cfg.num_params() * 4),
                                                 3)}}, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
