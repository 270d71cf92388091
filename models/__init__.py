"""GPT models: definitions, size presets and the language-model loss; nothing distributed.

Imported as shard.models: the package maps this folder in (pyproject.toml's wheel.packages,
and the editable install), so the repository has no top-level package with a name as
generic as "models"."""
from .gpt import GPT, PRESETS, GPTConfig
from .loss import linear_cross_entropy, next_token_loss

__all__ = ["GPT", "GPTConfig", "PRESETS", "linear_cross_entropy", "next_token_loss"]
