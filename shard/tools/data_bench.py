"""The streaming loader's throughput and memory (issue: data at the scale of a 7B run):

    python -m shard.tools.data_bench --documents 10000,100000,1000000 --dir /tmp/data-bench

For each corpus size: DOCUMENTS documents of the project's synthetic corpus (each one of a
base of 10,000 with its number appended, so none repeats) in --files JSON-lines files, and
one byte-level BPE tokenizer.json (--vocab, trained with the `tokenizers` library on the
base: a published tokenizer's format and cost). Then, in a fresh process per measurement,
StreamingBatches over the corpus (one rank, one stream, --workers tokenizing processes,
rows of --seq + 1 tokens) read as fast as the loop takes them, --tokens in all, after one
step of start-up:

    tokens_per_s   the rows' tokens per second of the loop (the loader's throughput)
    start_s        building the batches and the first step (pieces, hold-out, workers)
    main_mb        the training process's peak resident memory (VmHWM)
    worker_mb      the workers' peak resident memory, summed
    chars_per_token  the tokenizer's compression of this corpus (real web text with a
                   32k-50k BPE: about 4), and text_mb_per_s, the text it reads per second
    waited_s       with the loop paced at --rate tokens/s (a training step's consumption,
                   simulated by sleeping): the time steps waited for tokens, over
                   --paced-steps steps after the first

Medians over --repeats launches.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from runkit.args import at_least
from runkit.closed_pipe import quiet_when_its_reader_goes

BASE = 10_000
MEASURE = """
import json, sys, time
from pathlib import Path
from shard.data.stream import Corpus, StreamingBatches

args = json.loads(sys.argv[1])

def peak_mb(pid="self"):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0

corpus = Corpus(((args["paths"],),), (1.0,), "text", args["tokenizer"], 10)
started = time.perf_counter()
b = StreamingBatches(corpus, args["seq"], 1, 1, 0, 1, 0, streams=1, workers=args["workers"])
b.next_step()
start_s = time.perf_counter() - started
out = {"start_s": start_s}
if args["rate"]:
    step_s = args["seq"] / args["rate"]
    waited = b.waited_s
    for _ in range(args["paced_steps"]):
        b.next_step()
        time.sleep(step_s)
    out["waited_s"] = b.waited_s - waited
else:
    steps = args["tokens"] // args["seq"]
    started = time.perf_counter()
    for _ in range(steps):
        b.next_step()
    out["tokens_per_s"] = steps * args["seq"] / (time.perf_counter() - started)
workers = [w.proc.pid for w in b._feeds.workers]
out["worker_mb"] = sum(peak_mb(pid) for pid in workers)
b.close()
out["main_mb"] = peak_mb()
print(json.dumps(out))
"""


def write_corpus(directory: Path, documents: int, files: int) -> None:
    from shard.data import synthetic_documents

    base = synthetic_documents(BASE, seed=0)
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-documents // files)
    for f in range(files):
        with open(directory / f"part-{f:04d}.jsonl", "w") as out:
            for i in range(f * per_file, min(documents, (f + 1) * per_file)):
                out.write(json.dumps({"text": f"{base[i % BASE]} document {i} ."}) + "\n")


def train_tokenizer(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from shard.data import synthetic_documents

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(synthetic_documents(BASE, seed=0), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))


def chars_per_token(tokenizer: Path) -> float:
    from shard.data import synthetic_documents
    from shard.data import tokenizer as tokenizers

    texts = synthetic_documents(1000, seed=0)
    return sum(map(len, texts)) / sum(map(len, tokenizers.load(tokenizer).encode_batch(texts)))


def measure(args, paths: str, tokenizer: Path, rate: float = 0.0) -> dict:
    settings = {"paths": paths, "tokenizer": str(tokenizer), "seq": args.seq, "workers": args.workers,
                "tokens": args.tokens, "rate": rate, "paced_steps": args.paced_steps}
    run = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(settings)], capture_output=True, text=True,
                         check=False)
    if run.returncode:
        raise SystemExit(f"data_bench: the measuring process failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.splitlines()[-1])


@quiet_when_its_reader_goes
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="data_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--documents", default="10000,100000", help="corpus sizes, comma-separated")
    ap.add_argument("--files", type=at_least(1), default=16)
    ap.add_argument("--vocab", type=at_least(300), default=32000)
    ap.add_argument("--seq", type=at_least(1), default=2048)
    ap.add_argument("--tokens", type=at_least(1), default=20_000_000, help="tokens read per throughput launch")
    ap.add_argument("--workers", type=at_least(0), default=1)
    ap.add_argument("--rate", type=float, default=47_900.0, help="tokens/s a paced step consumes")
    ap.add_argument("--paced-steps", type=at_least(1), default=100)
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument("--dir", default="data-bench")
    args = ap.parse_args(argv)
    root = Path(args.dir)
    tokenizer = root / "tokenizer" / "tokenizer.json"
    if not tokenizer.is_file():
        train_tokenizer(tokenizer, args.vocab)
    ratio = chars_per_token(tokenizer)
    for documents in (int(n) for n in args.documents.split(",")):
        corpus = root / f"corpus-{documents}"
        if not corpus.is_dir():
            write_corpus(corpus, documents, args.files)
        runs = [measure(args, str(corpus / "*.jsonl"), tokenizer) for _ in range(args.repeats)]
        paced = [measure(args, str(corpus / "*.jsonl"), tokenizer, args.rate) for _ in range(args.repeats)]
        row = {"documents": documents, "workers": args.workers, "seq": args.seq,
               **{k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]},
               "waited_s": round(statistics.median(r["waited_s"] for r in paced), 4),
               "paced_steps": args.paced_steps, "rate": args.rate, "chars_per_token": round(ratio, 2)}
        row["text_mb_per_s"] = round(row["tokens_per_s"] * ratio / 1e6, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
