"""Planning: what a training run will need and how fast it will go, before it runs.

The planner (planner.py) ranks PaRO's strategies for a GPT on a cluster by the memory each
needs (footprint.py, activations.py) and the step time the engine's own trace predicts
(predict.py over skeleton.py's stand-in units), and builds the engine for strategy="auto"
(planner.build_engine). throughput.py holds the devices' peak rates and what a run measures.
Planning imports the engine, the models and pccl; the engine never imports planning.
"""
from shard.planning.planner import PlanError, StrategyPlan, build_engine, make_plan
from shard.planning.predict import Workload

__all__ = ["build_engine", "make_plan", "PlanError", "StrategyPlan", "Workload"]
