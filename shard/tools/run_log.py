"""What a training run leaves behind, written by rank 0: metrics.jsonl (one JSON object per
logged step), a printed line per interval, a progress bar, wandb (when enabled; offline
mode needs no network) and the loss curve as a PNG at the end."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from runkit.files import write_atomic


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


class RunLog:
    def __init__(self, out_dir: Path, active: bool, total_steps: int, start_step: int, progress: bool,
                 wandb_cfg: Optional[dict], config: dict):
        self.active, self.path = active, out_dir / "metrics.jsonl"
        self.records: list[dict] = []
        self.bar = self.wandb = None
        if not active:
            return
        if self.path.exists():   # resuming: keep what the checkpoint's steps logged, drop the rest
            kept = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            self.records = [r for r in kept if r["step"] <= start_step]
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        self.file = open(self.path, "a")
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        if wandb_cfg and wandb_cfg.get("enabled"):
            import wandb
            self.wandb = wandb.init(project=wandb_cfg["project"], entity=wandb_cfg.get("entity"),
                                    name=wandb_cfg.get("name") or out_dir.name, mode=wandb_cfg["mode"],
                                    dir=str(out_dir), config=config, resume="allow", id=out_dir.name)

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def log(self, record: dict) -> None:
        if not self.active:
            return
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=record["step"])
        line = (f"step {record['step']:>6}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                f"gnorm {_fmt(record['grad_norm'], '.3f')}  tok/s {record['tokens_per_s']:,.0f} "
                f"({record['tokens_per_s_per_rank']:,.0f}/rank)  TFLOP/s/rank {record['tflops_per_rank']:.2f}  "
                f"MFU {'n/a' if record['mfu'] is None else format(100 * record['mfu'], '.1f') + '%'}  "
                f"exposed comm {record['exposed_comm_s']:.3f}s  peak mem {record['peak_memory_gb']:.2f} GB")
        if record.get("other_waits_s"):   # waits for the lanes that were not communication
            line += f"  other waits {record['other_waits_s']:.3f}s (longest: {record['longest_other_wait']})"
        if record.get("warmup"):   # the session's first step, logged at once: not the training's pace
            line += "  (the warm-up step)"
        if record.get("val_loss") is not None:
            line += f"  val {record['val_loss']:.4f}"
        self.write(line)
        if record.get("straggler"):
            s = record["straggler"]
            self.write(f"straggler at step {record['step']}: rank {s['rank']} (rank {s['waiter']} waited "
                       f"{s['wait_s']:.1f} s for {s['operation']})")

    def write(self, line: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self, plot_path: Optional[Path]) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
        if plot_path is not None and self.records:
            plot_losses({"": self.records}, plot_path)


def plot_losses(curves: dict[str, list[dict]], path: Path) -> None:
    """Training loss, and validation loss where measured, against step for each named run
    (one run: the name ""), as a PNG written atomically; a log scale when every loss is
    positive."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, records in curves.items():
        prefix = f"{name} " if name else ""
        line, = ax.plot([r["step"] for r in records], [r["loss"] for r in records], label=prefix + "train")
        val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val), "o--", color=line.get_color(), label=prefix + "validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    if all(r["loss"] > 0 and math.isfinite(r["loss"]) for records in curves.values() for r in records):
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)
