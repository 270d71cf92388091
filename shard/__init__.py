"""shard: a ZeRO-3/FSDP-style training engine with PaRO's grouped sharding strategies.

Three layers, each importing only those below it (tests/shard/test_imports.py holds this):

  shard.tools     the command lines (shard-train, shard-compare, shard-bench, shard-plan,
                  shard-sim, ...) and the helpers only they use
  shard.planning  the planner (strategy="auto": planning.build_engine), the memory model and
                  the step-time predictor
  shard.engine    the engine (units, strategies, lanes), the optimizer beside it (AdamW),
                  checkpoints; imports pccl only

beside them shard.data (corpora, tokenizer, batches) and shard.models (the GPT and its
loss), which import no other part of shard.

This module exports the engine's API.
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
