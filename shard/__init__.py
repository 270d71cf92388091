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
from importlib import import_module

# Loaded on first use (PEP 562): shard.data's tokenizing workers import their own modules
# without torch and the engine.
_EXPORTS = {
    "CheckpointError": "shard.engine.checkpoint", "CheckpointSaveError": "shard.engine.checkpoint",
    "EngineConfig": "shard.engine.config", "OptimizerConfig": "shard.engine.config",
    "Engine": "shard.engine.engine", "Gradients": "shard.engine.engine", "FlatParams": "shard.engine.flat",
    "ShardedAdamW": "shard.engine.optimizer", "StepResult": "shard.engine.optimizer",
    "STRATEGIES": "shard.engine.strategy", "Scope": "shard.engine.strategy", "Strategy": "shard.engine.strategy",
    "StrategyError": "shard.engine.strategy", "Unit": "shard.engine.units", "UnitError": "shard.engine.units",
    "split_units": "shard.engine.units",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shard' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
