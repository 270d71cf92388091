"""shard-data: a corpus tokenized once, in parallel, for shard-train data=files to stream.

    shard-data prepare 'web/*.jsonl.zst' --tokenizer Llama-3.2-1B --out web-tokens --workers 8
    shard-train data=files 'data.paths=[web-tokens]' ...

prepare tokenizes every piece of the files the paths name (globs, files, directories: as
data.paths takes them) with the tokenizer (a tokenizer.json, a directory holding one, a
sentencepiece .model) in --workers processes, into token shards and a manifest in --out
(shard/data/pretokenize.py). A run that streams the directory reads the tokens as they are,
with the tokenizer copied beside them.
"""
from __future__ import annotations

import argparse
import sys
import time

from runkit.args import at_least, failure_status
from runkit.closed_pipe import quiet_when_its_reader_goes


@quiet_when_its_reader_goes
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="shard-data", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = ap.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser("prepare", help="tokenize a corpus into token shards")
    prepare.add_argument("paths", nargs="+", help="globs, files or directories of the corpus")
    prepare.add_argument("--tokenizer", required=True,
                         help="a tokenizer.json, a directory holding one, or a sentencepiece .model")
    prepare.add_argument("--out", required=True, help="a new directory for the token shards")
    prepare.add_argument("--field", default="text", help="the record field holding the text (default text)")
    prepare.add_argument("--workers", type=at_least(0), default=1, help="tokenizing processes (0: this one)")
    args = ap.parse_args(argv)

    from shard.data.pretokenize import tokenize_corpus

    started = time.perf_counter()
    try:
        manifest = tokenize_corpus(args.paths, args.tokenizer, args.out, args.field, args.workers)
    except (OSError, ValueError) as e:
        print(f"shard-data: {e}", file=sys.stderr)
        return failure_status(e)
    seconds = time.perf_counter() - started
    print(f"{args.out}: {manifest['documents']} documents, {manifest['tokens']} tokens in {len(manifest['shards'])} "
          f"shard(s) ({manifest['dtype']}), {seconds:.1f} s ({manifest['tokens'] / seconds:,.0f} tokens/s with "
          f"{args.workers} worker(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
