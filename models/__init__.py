"""GPT models: definitions and size presets; nothing distributed.

Imported as shard.models: the package maps this folder in (pyproject.toml's wheel.packages,
and the editable install), so the repository has no top-level package with a name as
generic as "models"."""
from .gpt import GPT, PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS"]
