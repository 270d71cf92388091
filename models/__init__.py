"""GPT models: definitions and size presets; nothing distributed."""
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
