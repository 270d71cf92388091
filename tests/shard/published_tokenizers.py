"""Tokenizers in the published formats, made here: a byte-level BPE tokenizer.json trained
with the `tokenizers` library on the project's corpus, in the two shapes published models
ship (Llama 3's: a BOS its template adds, eos_token named in tokenizer_config.json; GPT-2's:
no template, <|endoftext|> ends documents)."""
from __future__ import annotations

import json
from pathlib import Path

from shard.data import synthetic_documents


def byte_bpe(directory: Path, style: str = "llama", vocab: int = 1000, documents: int = 300) -> Path:
    """Write `directory`/tokenizer.json (and for style="llama" tokenizer_config.json); returns
    the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<|begin_of_text|>", "<|end_of_text|>"] if style == "llama" else ["<|endoftext|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(synthetic_documents(documents, seed=11), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    if style == "llama":
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", 0)])
        (directory / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
             "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072}))
    tok.save(str(directory / "tokenizer.json"))
    return directory
