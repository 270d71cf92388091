"""Training data: a corpus (synthetic.py, or files and Hub datasets through sources.py),
a tokenizer (tokenizer.py: a published tokenizer.json or sentencepiece model, or one
trained on the corpus), token files packed once per spec into a cache (pack.py,
prepare.py), opened memory-mapped (tokens.py) and cut into deterministic, resumable per-rank
batches (batches.py).

    path = prepare({"source": "synthetic", "documents": 2000, "vocab_size": 4096}, cache_dir)  # rank 0
    data = TokenData(path)                                                                       # every rank
    batches = Batches(data.train, seq_len, micro_batch, accumulation, rank, world, seed)
"""
from shard.data.batches import Batches, eval_batches
from shard.data.prepare import prepare
from shard.data.synthetic import synthetic_documents
from shard.data.tokens import DataError, TokenData

__all__ = ["prepare", "TokenData", "DataError", "Batches", "eval_batches", "synthetic_documents"]
