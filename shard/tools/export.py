"""shard-export: a training run's weights as a Hugging Face model directory, from a snapshot's
files alone, without the job that wrote them, at whatever world size and strategy wrote it.

    shard-export runs/2026-11-27_14-00-00 --out my-model            # bf16, the newest snapshot
    shard-export runs/.../checkpoints/snap-00000200-... --out m --dtype fp32

The snapshot is verified against its manifest first. Then each parameter is assembled from
the shard files that hold its pieces (memory-mapped), written where it belongs in the output
files, and dropped: the process holds one parameter at a time, never the model. The output
loads in `transformers.AutoModelForCausalLM.from_pretrained(DIR)`, and in `shard-train
model=hf model.path=DIR`. The model's config comes from the snapshot (what the run built),
and the run's tokenizer (its tokenizer.json with its config, or its sentencepiece model) is
copied beside the weights, so that a run from the export tokenizes as this one did; its
end-of-text and beginning-of-text ids go into config.json, where transformers' generate()
reads when to stop.
"""
from __future__ import annotations

import argparse
import sys
import time

from runkit.args import failure_status, fraction
from runkit.closed_pipe import quiet_when_its_reader_goes
from shard.engine.config import PRECISIONS


@quiet_when_its_reader_goes
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="shard-export", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a shard-train run directory, its checkpoints/ directory, or one snapshot")
    ap.add_argument("--format", choices=["hf"], default="hf", help="Hugging Face: config.json and safetensors")
    ap.add_argument("--out", required=True, help="the directory to write (new, or empty)")
    ap.add_argument("--dtype", choices=sorted(PRECISIONS), default="bf16", help="the weights' dtype (default bf16)")
    ap.add_argument("--shard-size", type=fraction(0.0, 1e6, low_open=True), default=2.0,
                    help="GB per safetensors file, beyond which an index lists several (default 2)")
    args = ap.parse_args(argv)
    from shard.data import tokenizer
    from shard.engine import checkpoint
    from shard.models.hf import save_pretrained
    from shard.tools.preflight import run_tokenizer, snapshot_config

    try:
        snap = checkpoint.snapshot(args.path)
        with checkpoint.pinned(snap):   # against a live run's retention, until its files and manifest are read
            params = checkpoint.parameters(snap)   # verified against its manifest, before anything is read of it
            cfg = snapshot_config(snap)
        found = run_tokenizer(snap)
        if found is not None and not found.exists():   # (a data cache cleaned since: it was dropped, silently)
            raise FileNotFoundError(f"the run's tokenizer {found} (its config.yaml's built.tokenizer) is gone: "
                                    "restore it, or export from a run that has one")
        beside = dict(tokenizer.named_files(found)) if found is not None else {}
        tokens = {}
        if beside:   # its ids in config.json: transformers' generate() stops at its end-of-text token
            used = tokenizer.load(found, documents=False)
            tokens = {"eos_token_id": used.eos_id, "bos_token_id": used.prefix[0] if used.prefix else None}
        start = time.perf_counter()
        out = save_pretrained((cfg, params), args.out, PRECISIONS[args.dtype],
                              int(args.shard_size * 1e9), beside, tokens)
    except (checkpoint.CheckpointError, OSError, ValueError) as e:
        print(f"shard-export: {e}", file=sys.stderr)
        return failure_status(e)
    seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"{snap} -> {out}: {cfg.num_params():,} parameters, {size / 1e9:.3f} GB of {args.dtype} in "
          f"{seconds:.1f} s ({seconds / max(size / 1e9, 1e-9):.1f} s/GB)"
          + (f"; the run's tokenizer beside them ({', '.join(beside)})" if beside else "; no tokenizer recorded"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
