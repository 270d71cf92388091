"""GPT models: definitions, size presets and the language-model loss; nothing distributed."""
from shard.models.gpt import GPT, PRESETS, GPTConfig
from shard.models.loss import linear_cross_entropy, next_token_loss

__all__ = ["GPT", "GPTConfig", "PRESETS", "linear_cross_entropy", "next_token_loss"]
