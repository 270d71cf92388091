"""The engine's settings (shard/engine/config.py): a bad value is refused when the config is
built, naming the field, what was expected and what was given; Engine's keyword form
builds the same config."""
import dataclasses

import pytest

from shard.engine.config import EngineConfig, OptimizerConfig
from shard.engine.strategy import Strategy, StrategyError


@pytest.mark.parametrize("build,error,words", [
    (lambda: OptimizerConfig(lr=-1), ValueError, ["lr must be a positive number", "-1"]),
    (lambda: OptimizerConfig(lr=float("inf")), ValueError, ["lr must be a positive number", "inf"]),
    (lambda: OptimizerConfig(lr="3e-4"), ValueError, ["lr must be a positive number", "'3e-4'"]),
    (lambda: OptimizerConfig(eps=0), ValueError, ["eps must be a positive number", "0"]),
    (lambda: OptimizerConfig(grad_clip=0.0), ValueError, ["grad_clip must be a positive number", "0.0"]),
    (lambda: OptimizerConfig(betas=(0.9, 1.0)), ValueError, ["betas must be two numbers in [0, 1)", "(0.9, 1.0)"]),
    (lambda: OptimizerConfig(betas=(0.9,)), ValueError, ["betas must be two numbers in [0, 1)", "(0.9,)"]),
    (lambda: OptimizerConfig(betas=("0.9", 0.95)), ValueError, ["betas must be two numbers", "'0.9'"]),
    (lambda: OptimizerConfig(weight_decay=-0.1), ValueError, ["weight_decay must be a finite number >= 0", "-0.1"]),
    (lambda: OptimizerConfig(weight_decay=float("inf")), ValueError, ["weight_decay must be a finite", "inf"]),
    # an algorithm that cannot run its collective compressed: at construction, not the first forward
    (lambda: EngineConfig(algorithm="native", compress_params="int8"), ValueError,
     ["compress_params=int8 with algorithm 'native'", "pccl cannot encode"]),
    (lambda: EngineConfig(strategy="ddp", algorithm={"reduce_scatter": "ring", "all_reduce": "native"},
                          compress_grads="int8"), ValueError, ["compress_grads=int8", "'native' is the transport's"]),
    (lambda: EngineConfig(strategy="zero3", algorithm={"reduce_scatter": "native"}, compress_grads="int8"),
     ValueError, ["compress_grads=int8", "'native' is the transport's own collective"]),
    (lambda: EngineConfig(algorithm="ho_ring", compress_params="int8"), ValueError,
     ["a compressed all-gather cannot run HO-Ring"]),
    (lambda: OptimizerConfig(weight_decay=float("nan")), ValueError, ["weight_decay must be a finite", "nan"]),
    (lambda: EngineConfig(strategy="zero9"), StrategyError, ["unknown strategy 'zero9'", "zero3"]),
    (lambda: EngineConfig(strategy="GGI"), StrategyError, ["Principle 1", "nearest valid strategy is GGG"]),
    (lambda: EngineConfig(group_size=0), StrategyError, ["group_size must be a positive integer", "got 0"]),
    (lambda: EngineConfig(precision="fp8"), ValueError, ["precision must be one of ('fp32', 'bf16', 'fp16')", "'fp8'"]),
    (lambda: EngineConfig(reduce_dtype="int8"), ValueError, ["reduce_dtype must be one of ('fp32',", "'int8'"]),
    (lambda: EngineConfig(prefetch=-1), ValueError, ["prefetch must be an integer >= 0 (units gathered ahead)", "-1"]),
    (lambda: EngineConfig(prefetch=1.5), ValueError, ["prefetch must be an integer >= 0", "1.5"]),
    (lambda: EngineConfig(prefetch_bytes=0), ValueError, ["prefetch_bytes must be a positive number", "got 0"]),
    (lambda: EngineConfig(min_shard_numel=-5), ValueError, ["min_shard_numel must be an integer >= 0", "-5"]),
    (lambda: EngineConfig(algorithm=3), ValueError, ["algorithm must be a pccl algorithm name", "got 3"]),
    (lambda: EngineConfig(activation_checkpointing="yes"), ValueError,
     ["activation_checkpointing must be True or False", "'yes'"]),
    (lambda: EngineConfig(reshard_after_forward=0), ValueError, ["reshard_after_forward must be True or False", "0"]),
    (lambda: EngineConfig(optimizer={"lr": 1e-3}), TypeError, ["unexpected keyword argument 'optimizer'"]),
    (lambda: OptimizerConfig.given(None, {"lr": 0}), ValueError, ["lr must be a positive number", "0"]),
    (lambda: OptimizerConfig.given(None, {"learning_rate": 1e-3}), TypeError,
     ["unknown ShardedAdamW settings ['learning_rate']; expected fields of OptimizerConfig"]),
    (lambda: EngineConfig.given(None, {"lr": 1e-3}), TypeError,
     ["unknown Engine settings ['lr']", "(['lr'] are settings of OptimizerConfig, for ShardedAdamW)"]),
])
def test_bad_values_are_refused_naming_the_field_and_what_was_expected(build, error, words):
    with pytest.raises(error) as info:
        build()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_codec_is_checked_against_the_collectives_the_strategy_compresses():
    """zero2/zero3 reduce-scatter their gradients and send the all-reduces uncompressed: an
    all-reduce the transport runs itself is no obstacle to compressed gradients there (it
    was refused, and those settings train); nor an all-gather where nothing is sharded."""
    native_all_reduce = {"all_gather": "ring", "reduce_scatter": "ring", "all_reduce": "native"}
    for strategy in ("zero2", "zero3", "auto"):
        EngineConfig(strategy=strategy, algorithm=native_all_reduce, compress_grads="int8")
    EngineConfig(strategy="ddp", algorithm="native", compress_params="int8")


def test_keywords_build_the_same_config():
    config = EngineConfig.given(None, {"strategy": "zero3", "prefetch": 2})
    assert config == EngineConfig(strategy=Strategy.parse("GGG"), prefetch=2)
    assert config.strategy == Strategy.parse("zero3")
    assert EngineConfig.given(None, {}) == EngineConfig()
    optimizer = OptimizerConfig.given(None, {"lr": 1e-3, "betas": [0.8, 0.9], "grad_clip": 1.0})
    assert optimizer == OptimizerConfig(lr=1e-3, betas=(0.8, 0.9), grad_clip=1.0) and optimizer.betas == (0.8, 0.9)


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().prefetch = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        OptimizerConfig().lr = 1.0
