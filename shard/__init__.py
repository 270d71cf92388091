"""shard: a ZeRO-3/FSDP-style training engine with PaRO's grouped sharding strategies.

Work in progress: the strategy set (strategy.py) is here; the engine comes next.
"""
from .strategy import Scope, Strategy, StrategyError

__all__ = ["Scope", "Strategy", "StrategyError"]
