"""The training engine: what runs a step. It imports pccl and nothing else of shard.

Engine (engine.py), set up by an EngineConfig (config.py), runs a model cut into units
(units.py), each unit's parameters in one flat padded buffer (flat.py), sharded by a
strategy (strategy.py) over a layout of groups (shard_layout.py), with communication on two
lanes (lanes.py), AdamW over the flat optimizer shard (adamw.py), sharded, reshardable
checkpoints (checkpoint.py) of the engine's state_dict(), and a record of what a step did
(trace.py) for the step-time predictor.
"""
from shard.engine.checkpoint import CheckpointError, CheckpointSaveError
from shard.engine.config import EngineConfig, OptimizerConfig
from shard.engine.engine import Engine, StepResult
from shard.engine.flat import FlatParams
from shard.engine.strategy import STRATEGIES, Scope, Strategy, StrategyError
from shard.engine.units import Unit, UnitError, split_units

__all__ = ["Engine", "EngineConfig", "OptimizerConfig", "StepResult", "CheckpointError", "CheckpointSaveError",
           "Scope", "Strategy", "StrategyError", "STRATEGIES", "FlatParams", "Unit", "UnitError", "split_units"]
