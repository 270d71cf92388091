"""The training engine: what runs a step. It imports pccl and nothing else of shard.

Engine (engine.py), set up by an EngineConfig (config.py), runs a model cut into units
(units.py), each unit's parameters in one flat padded buffer (flat.py), sharded by a
strategy (strategy.py) over a layout of groups (shard_layout.py), with communication on two
lanes (lanes.py). Beside it, ShardedAdamW (optimizer.py) steps the flat optimizer shard
(adamw.py: the fused AdamW kernel over it), with clipping and fp16 loss scaling; sharded,
reshardable checkpoints (checkpoint.py) hold both state_dict()s; and a record of what a step did
(trace.py) for the step-time predictor.
"""
from shard.engine.checkpoint import CheckpointError, CheckpointSaveError
from shard.engine.config import EngineConfig, OptimizerConfig
from shard.engine.engine import Engine, Gradients
from shard.engine.flat import FlatParams
from shard.engine.optimizer import ShardedAdamW, StepResult
from shard.engine.strategy import STRATEGIES, Scope, Strategy, StrategyError
from shard.engine.units import Unit, UnitError, split_units

__all__ = ["Engine", "EngineConfig", "Gradients", "ShardedAdamW", "OptimizerConfig", "StepResult", "CheckpointError",
           "CheckpointSaveError",
           "Scope", "Strategy", "StrategyError", "STRATEGIES", "FlatParams", "Unit", "UnitError", "split_units"]
