"""Training data: a corpus (synthetic.py, or files and Hub datasets through sources.py),
a tokenizer (tokenizer.py: a published tokenizer.json or sentencepiece model, or one
trained on the corpus), token files packed once per spec into a cache (pack.py,
prepare.py), opened memory-mapped (tokens.py) and cut into deterministic, resumable per-rank
batches (batches.py).

    path = prepare({"source": "synthetic", "documents": 2000, "vocab_size": 4096}, cache_dir)  # rank 0
    data = TokenData(path)                                                                       # every rank
    batches = Batches(data.train, seq_len, micro_batch, accumulation, rank, world, seed)
"""
from importlib import import_module

from shard.data.prepare import prepare
from shard.data.synthetic import synthetic_documents
from shard.data.tokens import DataError, TokenData

# The batches load on first use (PEP 562): a tokenizing worker (workers.py) imports no torch.
_EXPORTS = {"Batches": "shard.data.batches", "eval_batches": "shard.data.batches",
            "StreamingBatches": "shard.data.stream", "Corpus": "shard.data.stream"}
__all__ = ["prepare", "synthetic_documents", "DataError", "TokenData", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shard.data' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
