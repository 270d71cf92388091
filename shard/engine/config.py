"""The engine's settings: frozen dataclasses that check their values when built, so a bad
setting fails with its name and what was expected, before any communication starts.

    engine = Engine(model, comm, config=EngineConfig(strategy="zero3", precision="bf16"))
    engine = Engine(model, comm, strategy="zero3", precision="bf16")            # the same
    optimizer = ShardedAdamW(engine, OptimizerConfig(lr=1e-3, grad_clip=1.0))
    optimizer = ShardedAdamW(engine, lr=1e-3, grad_clip=1.0)                   # the same

What belongs to one model rather than to a run's settings (its units, which of its
parameters decay, how to materialize it) stays an argument of Engine or ShardedAdamW.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional, Union

import torch

from pccl.compression.codecs import codec
from pccl.tuning.selection import compression_problem
from shard.engine.strategy import Scope, Strategy, StrategyError
from shard.engine.units import MIN_SHARD_NUMEL

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class SettingError(ValueError):
    """A bad setting, raised by the field that holds it: `field` is its name
    ("auto.memory" for AutoConfig's inside EngineConfig); the message starts with it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _number(value) or not value > 0 or not math.isfinite(value):
        raise SettingError(name, f"{name} must be a positive number, got {value!r}")


def _integer(name: str, value, low: int, meaning: str) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise SettingError(name, f"{name} must be an integer >= {low} ({meaning}), got {value!r}")


def _compile_backends() -> list[str]:
    import torch._dynamo

    return torch._dynamo.list_backends(exclude_tags=())


def _one_of(name: str, value, valid) -> None:
    if value not in valid:
        raise SettingError(name, f"{name} must be one of {tuple(valid)}, got {value!r}")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (decoupled weight decay) and gradient clipping."""

    lr: float = 3e-4                     # the initial rate; a schedule may change ShardedAdamW.lr later
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1            # for the parameters ShardedAdamW's `decay` selects
    grad_clip: Optional[float] = None    # largest global gradient norm; None: no clipping

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _positive("eps", self.eps)
        _positive("grad_clip", self.grad_clip, allow_none=True)
        betas = self.betas
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_number(b) and 0 <= b < 1 for b in betas)):
            raise SettingError("betas", f"betas must be two numbers in [0, 1), got {betas!r}")
        object.__setattr__(self, "betas", tuple(betas))   # a list from YAML compares equal to a tuple
        if not (_number(self.weight_decay) and 0 <= self.weight_decay < math.inf):
            raise SettingError("weight_decay", f"weight_decay must be a finite number >= 0, got "
                                               f"{self.weight_decay!r}")

    @classmethod
    def given(cls, config: Optional[OptimizerConfig], settings: dict) -> OptimizerConfig:
        """The config passed as config= or as keywords (ShardedAdamW's two forms), not both."""
        return _given(cls, config, settings, "lr=")


OBJECTIVES = ("throughput", "memory")


def compressed_collectives(strategy, name: str) -> tuple:
    """The collectives `strategy` certainly runs compressed with the codec of `name`
    (compress_params, compress_grads): the parameters' all-gathers (unless nothing is
    sharded); the gradients' reduce-scatters where they are sharded, their all-reduce
    where not. (A unit too small to shard all-reduces its gradients besides: known only
    with the model.) None while strategy="auto" is to be chosen."""
    if not isinstance(strategy, Strategy):
        return ()
    if name == "compress_params":
        return () if strategy.letters == "NNN" else ("all_gather",)
    return ("all_reduce",) if strategy.grads == Scope.N else ("reduce_scatter",)


@dataclass(frozen=True)
class AutoConfig:
    """How strategy="auto" chooses (shard/planning/planner.py): the fastest strategy that fits, or the
    one with the smallest peak memory; in `memory` bytes per device (None: the GPU's, or
    on CPUs the machine's memory shared by its ranks) less a `headroom` fraction."""

    objective: str = "throughput"
    memory: Optional[Union[int, str]] = None   # bytes, or a size such as "64GB"
    headroom: float = 0.1

    def __post_init__(self) -> None:
        _one_of("objective", self.objective, OBJECTIVES)
        if self.memory is not None:
            from runkit.sizes import parse_size

            memory = self.memory
            if not isinstance(memory, int) or isinstance(memory, bool):
                try:
                    memory = parse_size(memory)
                except ValueError as e:
                    raise SettingError("memory", f"memory must be a size such as 64GB or a number of bytes: "
                                                 f"{e}") from None
            if memory <= 0:
                raise SettingError("memory", f"memory must be a positive size such as 64GB, got {self.memory!r}")
            object.__setattr__(self, "memory", memory)
        if not (_number(self.headroom) and 0 <= self.headroom < 1):
            raise SettingError("headroom", f"headroom must be a fraction in [0, 1), got {self.headroom!r}")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine shards, computes and communicates."""

    # a name (zero3, paro-iig) or letters (IIG), kept as a Strategy; or "auto": the planner's
    # choice for the model, the world and its machine, made before the engine is built
    # (shard.planning.build_engine, which needs the workload)
    strategy: Union[str, Strategy] = "paro-iig"
    group_size: Optional[int] = None     # ranks per group (I scope); None: the topology's ranks per node
    precision: str = "fp32"              # compute dtype of forward and backward
    reduce_dtype: str = "fp32"           # dtype gradients are reduced in
    prefetch: int = 1                    # units gathered ahead (0: none)
    prefetch_bytes: Optional[int] = None   # cap on the bytes prefetched units hold
    min_shard_numel: int = MIN_SHARD_NUMEL   # smaller units stay replicated (DDP-like)
    algorithm: Union[str, dict] = "auto"   # pccl algorithm of every collective, or a dict per collective name
    activation_checkpointing: bool = False
    # release each unit's gathered (or cast) parameters after its forward and gather them
    # again for its backward (True, as ZeRO-3 and FSDP2's default), or keep them until its
    # backward (False, FSDP2's reshard_after_forward=False): one gather per unit and step
    # instead of two, for the whole model's parameters in the compute dtype at the peak
    reshard_after_forward: bool = True
    # torch.compile each unit's forward (as torchtitan compiles each block under FSDP2), the
    # engine's hooks outside the compiled code: False, True (inductor) or a torch.compile
    # backend's name ("aot_eager": the same graphs, no code generation)
    compile: Union[bool, str] = False
    # Codecs (pccl.compression.codecs: int8, bf16, fp16, zfp:RATE) of the parameter
    # all-gathers (those of forward and backward, ZeRO++'s qwZ, and the one that refreshes
    # the parameter shards from the optimizer's after each update) and of the gradient
    # reductions (qgZ); None: exact. Master weights and optimizer state are never compressed.
    compress_params: Optional[str] = None
    compress_grads: Optional[str] = None
    auto: AutoConfig = AutoConfig()       # how strategy="auto" chooses

    def __post_init__(self) -> None:
        if self.strategy != "auto":
            object.__setattr__(self, "strategy", Strategy.parse(self.strategy))
        if isinstance(self.auto, dict):   # from YAML
            try:
                object.__setattr__(self, "auto", AutoConfig(**self.auto))
            except SettingError as e:
                raise SettingError(f"auto.{e.field}", str(e)) from None
        if not isinstance(self.auto, AutoConfig):
            raise SettingError("auto", f"auto must be an AutoConfig or a dict of its fields, got "
                                       f"{type(self.auto).__name__}")
        group = self.group_size
        if group is not None and not (isinstance(group, int) and not isinstance(group, bool) and group >= 1):
            raise StrategyError(f"group_size must be a positive integer, or None for the topology's ranks per node, "
                                f"got {group!r}", field="group_size")
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("reduce_dtype", self.reduce_dtype, PRECISIONS)
        _integer("prefetch", self.prefetch, 0, "units gathered ahead")
        _positive("prefetch_bytes", self.prefetch_bytes, allow_none=True)
        _integer("min_shard_numel", self.min_shard_numel, 0, "elements below which a unit stays replicated")
        if not isinstance(self.algorithm, (str, dict)):
            raise SettingError("algorithm", "algorithm must be a pccl algorithm name such as 'auto' or 'ring', or a "
                                            f"dict of one per collective name, got {self.algorithm!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise SettingError("activation_checkpointing", f"activation_checkpointing must be True or False, got "
                                                           f"{self.activation_checkpointing!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise SettingError("reshard_after_forward", f"reshard_after_forward must be True or False, got "
                                                        f"{self.reshard_after_forward!r}")
        if not isinstance(self.compile, (bool, str)) or self.compile == "":
            raise SettingError("compile", f"compile must be True, False or a torch.compile backend such as "
                                          f"'inductor', got {self.compile!r}")
        if isinstance(self.compile, str) and self.compile not in _compile_backends():
            raise SettingError("compile", f"compile must be True, False or a torch.compile backend here, one of "
                                          f"{_compile_backends()}; got {self.compile!r}")
        for name in ("compress_params", "compress_grads"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise SettingError(name, f"{name} must be a codec name (int8, bf16, fp16, zfp:RATE) or None, got "
                                         f"{value!r}")
            # the parameters travel in the compute dtype, the gradients in the reduce dtype
            carried = "precision" if name == "compress_params" else "reduce_dtype"
            try:
                chosen = codec(value)   # an unknown name fails here, with the names it knows
                if chosen is not None:
                    chosen.check(PRECISIONS[getattr(self, carried)])
            except ValueError as e:
                raise SettingError(name, f"{name} with {carried}={getattr(self, carried)}: {e}") from None
            # an algorithm that cannot run its collectives compressed (the transport's own, a
            # compressed all-gather on HO-Ring) would fail only at the first forward
            for collective in compressed_collectives(self.strategy, name) if value is not None else ():
                problem = compression_problem(algorithm_for(self.algorithm, collective), collective, value)
                if problem:
                    raise SettingError(name, f"{name}={value} with algorithm {self.algorithm!r}: {problem}")

    @classmethod
    def given(cls, config: Optional[EngineConfig], settings: dict) -> EngineConfig:
        """The config passed as config= or as keywords (Engine's two forms), not both."""
        return _given(cls, config, settings, "strategy=")


def algorithm_for(algorithm: Union[str, dict], collective: str):
    """The algorithm `collective` runs with: EngineConfig.algorithm, or its entry for it
    (default auto)."""
    return algorithm.get(collective, "auto") if isinstance(algorithm, dict) else algorithm


def _given(cls, config, settings: dict, example: str):
    """`config`, or a `cls` made of the keywords `settings` (not both), for its taker
    (TAKERS); a keyword of the other config is named as such."""
    if config is None:
        unknown = sorted(set(settings) - {f.name for f in fields(cls)})
        if unknown:
            other = next(c for c in TAKERS if c is not cls)
            theirs = sorted(set(unknown) & {f.name for f in fields(other)})
            where = f" ({theirs} are settings of {other.__name__}, for {TAKERS[other]})" if theirs else ""
            raise TypeError(f"unknown {TAKERS[cls]} settings {unknown}; expected fields of {cls.__name__}{where}")
        return cls(**settings)
    if not isinstance(config, cls):
        raise TypeError(f"config must be an {cls.__name__}, got {type(config).__name__}; pass settings such as "
                        f"{example} by keyword")
    if settings:
        raise TypeError(f"pass the settings either as config= or as keywords, not both; got config= and "
                        f"{sorted(settings)}")
    return config


TAKERS = {EngineConfig: "Engine", OptimizerConfig: "ShardedAdamW"}   # what each config sets up
