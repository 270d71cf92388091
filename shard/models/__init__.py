"""Decoder models of the GPT family (GPT-2, OPT and Llama shapes): definitions, size presets,
the language-model loss, and Hugging Face checkpoints in and out; nothing distributed."""
from shard.models.gpt import GPT, PRESETS, GPTConfig
from shard.models.hf import from_pretrained, save_pretrained
from shard.models.loss import linear_cross_entropy, next_token_loss

__all__ = ["GPT", "GPTConfig", "PRESETS", "from_pretrained", "linear_cross_entropy", "next_token_loss",
           "save_pretrained"]
