"""shard: a ZeRO-3/FSDP-style training engine with PaRO's grouped sharding strategies.

Engine (engine.py), set up by an EngineConfig (config.py), runs a model cut into units
(units.py), each unit's parameters in one flat padded buffer (flat.py), sharded by a
strategy (strategy.py) over a layout of groups (layout.py), with communication on two
lanes (lanes.py), AdamW over the flat optimizer shard (adamw.py) and sharded, reshardable
checkpoints (checkpoint.py) of the engine's state_dict().
"""
from .checkpoint import CheckpointError, CheckpointSaveError
from .config import EngineConfig, OptimizerConfig
from .engine import Engine, StepResult
from .flat import FlatParams
from .strategy import STRATEGIES, Scope, Strategy, StrategyError
from .units import Unit, UnitError, split_units

__all__ = ["Engine", "EngineConfig", "OptimizerConfig", "StepResult", "CheckpointError", "CheckpointSaveError",
           "Scope", "Strategy", "StrategyError", "STRATEGIES", "FlatParams", "Unit", "UnitError", "split_units"]
