"""GPT models: definitions and size presets; nothing distributed."""
from .gpt import GPT, PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS"]
