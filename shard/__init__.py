"""shard: a ZeRO-3/FSDP-style training engine with PaRO's grouped sharding strategies.

Work in progress: the strategy set (strategy.py), units (units.py) and flat parameter
buffers (flat.py) are here; the engine comes next.
"""
from .flat import FlatParams
from .strategy import Scope, Strategy, StrategyError
from .units import Unit, UnitError, split_units

__all__ = ["Scope", "Strategy", "StrategyError", "FlatParams", "Unit", "UnitError", "split_units"]
