"""shard-generate: text sampled from a model, to see what a run learned.

    shard-generate runs/2026-11-27_14-00-00 --prompt "Alice found"          # a run: its newest snapshot
    shard-generate my-llama-hf --prompt "The capital of France" --temperature 0

PATH is a shard-train run directory (its newest snapshot, and the tokenizer its corpus was
prepared with, from its config.yaml), a directory of runs (`runs`: the one whose snapshot is
newest), a checkpoint or snapshot directory inside one, or a Hugging Face model directory
(its tokenizer.json). --tokenizer names another: a tokenizer.json, a sentencepiece .model,
or a directory holding one. Sampling runs through a KV cache
(shard/models/generate.py) on --device, in the model's fp32 values or --dtype.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from runkit.args import at_least, failure_status
from runkit.closed_pipe import quiet_when_its_reader_goes
from shard.engine.config import PRECISIONS


class Text:
    """A tokenizer as generation uses it: a prompt's ids as the model saw documents start
    (after an end of text, for a corpus's tokenizer), decode, vocabulary, end of text."""

    def __init__(self, path: Path, after_eos: bool):
        from shard.data import tokenizer

        self.tokenizer = tokenizer.load(path, documents=after_eos)
        self.start = ([self.tokenizer.eos_id] if after_eos else []) + list(self.tokenizer.prefix)
        self.vocab, self.eos = self.tokenizer.vocab_size, self.tokenizer.eos_id

    def encode(self, prompt: str) -> list[int]:
        return self.start + self.tokenizer.encode(prompt)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)


def newest_run(path: Path) -> Path:
    """`path`, or where it is a directory of runs (runs/), the run whose snapshot is newest."""
    if any((path / name).exists() for name in ("config.json", "meta.json", "LATEST", "checkpoints")):
        return path
    runs = [p for p in path.iterdir() if (p / "checkpoints" / "LATEST").is_file()] if path.is_dir() else []
    return max(runs, key=lambda p: (p / "checkpoints" / "LATEST").stat().st_mtime) if runs else path


def load(path: Path, device, tokenizer: str | None):
    """(model, Text) from a run, a snapshot or a Hugging Face directory."""
    from shard.models import GPT
    from shard.models.hf import from_pretrained

    if (path / "config.json").is_file():   # Hugging Face
        model = from_pretrained(path, device=device)
        found, corpus = path, False
    else:
        from shard.engine import checkpoint
        from shard.tools.preflight import run_tokenizer, snapshot_config

        snap = checkpoint.snapshot(path)
        with checkpoint.pinned(snap):   # against a live run's retention, until its files and manifest are read
            _, read = checkpoint.parameter_reader(snap)   # one parameter at a time, not the model twice
            cfg = snapshot_config(snap)
        with torch.device(device):
            model = GPT(cfg, weights=lambda name, tensor: tensor.copy_(read(name)))
        found, corpus = run_tokenizer(snap), True
    chosen = Path(tokenizer) if tokenizer else found
    if chosen is None:
        raise FileNotFoundError(f"no tokenizer for {path}: name one with --tokenizer (a tokenizer.json, a "
                                "sentencepiece .model, or a directory holding one)")
    return model, Text(chosen, after_eos=corpus)


@quiet_when_its_reader_goes
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="shard-generate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a shard-train run directory, a snapshot, or a Hugging Face model directory")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--tokens", type=at_least(1), default=64, help="tokens to sample (default 64)")
    ap.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    ap.add_argument("--top-k", type=at_least(0), default=40, help="sample among the k most likely (default 40; "
                                                                  "0: among all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=at_least(1), default=1, help="texts to sample, seeds seed, seed+1, ...")
    ap.add_argument("--tokenizer", default=None,
                    help="a tokenizer.json, a sentencepiece .model, or a directory holding one")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(PRECISIONS), default="fp32")
    args = ap.parse_args(argv)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        ap.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        ap.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch sees no GPU")
    from shard.engine.checkpoint import CheckpointError
    from shard.models.generate import check_seed, generate

    try:   # every sample's seed (seed, seed + 1, ...), before the model loads
        for seed in (args.seed, args.seed + args.samples - 1):
            check_seed(seed)
    except ValueError as e:
        ap.error(f"--seed {args.seed} with --samples {args.samples}: {e}")

    try:
        model, text = load(newest_run(Path(args.path)), args.device, args.tokenizer)
        model.to(PRECISIONS[args.dtype])
        prompt = text.encode(args.prompt)
        for i in range(args.samples):
            ids = generate(model, prompt, args.tokens, args.temperature, args.top_k or None, args.seed + i,
                           vocab=min(text.vocab, model.cfg.vocab), stop=text.eos)
            print(text.decode([*prompt, *ids]).strip())
    except (CheckpointError, OSError, ValueError) as e:
        print(f"shard-generate: {e}", file=sys.stderr)
        return failure_status(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
