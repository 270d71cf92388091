"""What a training run leaves behind, written by rank 0: metrics.jsonl (one JSON object per
logged step), a printed line per interval, a progress bar, wandb (when enabled; offline
mode needs no network) and the loss curve as a PNG at the end."""
from __future__ import annotations

import hashlib
import json
import math
from collections import deque
from pathlib import Path
from typing import Optional

from runkit.files import write_atomic


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def readable_records(path: Path, say):
    """The records of a metrics.jsonl, one at a time; a line cut short (a full disk, a kill
    mid-append: it is the last) is left out, and `say` told, so that a resume still starts."""
    torn = 0
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                record = None
                torn += 1
            if isinstance(record, dict) and "step" in record:
                yield record
    if torn:
        say(f"{path}: {torn} record(s) cut short left out (written as the disk filled, or the run was killed)")


# The records the run's summary takes its medians over: the latest. (Kept all, rank 0 grew
# by a kilobyte a logged step, without end: 110 MB at 100,000 records.)
RECENT = 1000
# The most points the loss plot draws (thinned evenly beyond).
PLOTTED = 10_000


class RunLog:
    def __init__(self, out_dir: Path, active: bool, total_steps: int, start_step: int, progress: bool,
                 wandb_cfg: Optional[dict], config: dict):
        self.active, self.path = active, out_dir / "metrics.jsonl"
        self._recent: deque[dict] = deque(maxlen=RECENT)
        self._marked: dict[str, dict] = {}   # the latest record with a validation loss, with a warm-up
        self.bar = self.wandb = None
        if not active:
            return
        if self.path.exists():   # resuming: keep what the checkpoint's steps logged, drop the rest
            def kept(f):
                for record in readable_records(self.path, self.write):
                    if record["step"] <= start_step:
                        self._keep(record)
                        f.write((json.dumps(record) + "\n").encode())
            write_atomic(self.path, kept)
        self.file = open(self.path, "a")
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        if wandb_cfg and wandb_cfg.get("enabled"):
            # one wandb run per output directory, resumed with it: named by the directory, and
            # told apart from another of that name (a/exp1, b/exp1) by its path's hash
            where = str(out_dir.resolve())
            run_id = f"{out_dir.name}-{hashlib.sha1(where.encode()).hexdigest()[:8]}"
            self._wandb(lambda: self._start_wandb(wandb_cfg, out_dir, config, run_id), "could not start")

    def _start_wandb(self, wandb_cfg: dict, out_dir: Path, config: dict, run_id: str) -> None:
        import wandb
        self.wandb = wandb.init(project=wandb_cfg["project"], entity=wandb_cfg.get("entity"),
                                name=wandb_cfg.get("name") or out_dir.name, mode=wandb_cfg["mode"],
                                dir=str(out_dir), config=config, resume="allow", id=run_id)

    def _keep(self, record: dict) -> None:
        self._recent.append(record)
        if record.get("val_loss") is not None:
            self._marked["val"] = record
        if record.get("warmup") or record.get("warmup_s") is not None:
            self._marked["warmup"] = record

    @property
    def records(self) -> list[dict]:
        """What the summary reads, in step order: the latest RECENT records logged (this
        session's or kept from an earlier one), and the latest holding a validation loss and
        a warm-up's time, wherever they lie."""
        by_step = {r["step"]: r for r in (*self._marked.values(), *self._recent)}
        return [by_step[step] for step in sorted(by_step)]

    def _wandb(self, call, doing: str) -> None:
        """A wandb call whose failure (its server, its disk, its bugs) ends wandb's logging for
        this run, with a warning, not the training: metrics.jsonl holds every record anyway."""
        try:
            call()
        except Exception as e:   # wandb raises many kinds
            self.wandb = None
            self.write(f"wandb {doing}: {type(e).__name__}: {e}; training goes on without it "
                       f"(every record is in {self.path})")

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def log(self, record: dict) -> None:
        if not self.active:
            return
        self._keep(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            run = self.wandb
            self._wandb(lambda: run.log({k: v for k, v in record.items() if k != "step" and v is not None},
                                        step=record["step"]), f"failed at step {record['step']}")
        line = (f"step {record['step']:>6}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                f"gnorm {_fmt(record['grad_norm'], '.3f')}  tok/s {record['tokens_per_s']:,.0f} "
                f"({record['tokens_per_s_per_rank']:,.0f}/rank)  TFLOP/s/rank {record['tflops_per_rank']:.2f}  "
                f"MFU {'n/a' if record['mfu'] is None else format(100 * record['mfu'], '.1f') + '%'}  "
                f"exposed comm {record['exposed_comm_s']:.3f}s  peak mem {record['peak_memory_gb']:.2f} GB")
        if record.get("other_waits_s"):   # waits for the lanes that were not communication
            line += f"  other waits {record['other_waits_s']:.3f}s (longest: {record['longest_other_wait']})"
        if record.get("warmup"):   # the session's first step, logged at once: not the training's pace
            line += "  (the warm-up step)"
        if record.get("profiled"):   # steps under torch.profiler (log.profile): slowed by it
            line += "  (profiled steps)"
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
            self._wandb(self.wandb.finish, "could not finish")
        if plot_path is not None and self._recent:
            plot_losses({"": thinned(readable_records(self.path, self.write), PLOTTED)}, plot_path)


def thinned(records, most: int) -> list[dict]:
    """At most `most` of `records` (an iterable, read once), and the last: evenly spaced,
    every other one dropped whenever there are more."""
    kept, stride, last = [], 1, None
    for i, record in enumerate(records):
        last = record
        if i % stride == 0:
            kept.append(record)   # (kept[j] is record j * stride)
            if len(kept) > most:
                kept, stride = kept[::2], stride * 2
    return kept if not kept or kept[-1] is last else [*kept, last]


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
