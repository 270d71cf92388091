"""A shard-train configuration checked whole before anything starts: any key of configs/
with a wrong type, a number out of range or an unknown choice fails naming the key and
what was expected, on every rank alike (each rank reads the same configuration), before
a communicator exists or a file is written. The model, engine and data keys are checked
by their own classes (GPTConfig, EngineConfig, the data spec), called from here; the
other groups' keys are the tables below. A null optim.lr is the model preset's peak rate
and a null optim.min_lr a tenth of optim.lr (learning_rates)."""
from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import Callable

from shard.engine.config import EngineConfig, OptimizerConfig
from shard.models import GPTConfig

# The configuration tree (configs/): in the source tree and an editable install, or a wheel's shard/configs
CONFIGS = next(p for p in (Path(__file__).resolve().parents[2] / "configs",
                           Path(__file__).resolve().parents[1] / "configs") if p.is_dir())
MODEL_FIELDS = ("vocab", "context", "width", "layers", "heads", "tied", "positions", "bias")
Check = Callable[[str, object], None]


class ConfigError(ValueError):
    """A configuration that cannot run, with what was expected."""


def _integer(low: int, null: bool = False) -> Check:
    def check(key, value):
        if value is None and null:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{key} must be an integer >= {low}{' or null' if null else ''}, got {value!r}")
    return check


def _number(low: float, above: bool = False, null: bool = False) -> Check:
    def check(key, value):
        if value is None and null:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                (value <= low if above else value < low):
            raise ConfigError(f"{key} must be a number {'>' if above else '>='} {low}{' or null' if null else ''}, "
                              f"got {value!r}")
    return check


def _choice(*choices) -> Check:
    def check(key, value):
        # `True in (1,)` holds in Python: compare types too, so 1 is not true nor 0 false.
        if not any(value == c and type(value) is type(c) for c in choices):
            raise ConfigError(f"{key} must be one of {choices}, got {value!r}")
    return check


def _text(null: bool = False) -> Check:
    def check(key, value):
        if value is None and null:
            return
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key} must be a non-empty string{' or null' if null else ''}, got {value!r}")
    return check


def _flag_or_text() -> Check:
    def check(key: str, value) -> None:
        if not isinstance(value, bool) and not (isinstance(value, str) and value):
            raise ConfigError(f"{key} must be true, false or a torch.compile backend's name, got {value!r}")
    return check


TRANSPORTS = ("mpi", "gloo", "nccl")
TABLES: dict[str, dict[str, Check]] = {
    "train": {"steps": _integer(1), "global_batch_tokens": _integer(1, null=True), "accumulation": _integer(1),
              "micro_batch": _integer(1), "seq_len": _integer(1), "precision": _choice("auto", "fp32", "bf16", "fp16"),
              "device": _choice("auto", "cpu", "cuda"), "seed": _integer(0), "eval_interval": _integer(0),
              "eval_batches": _integer(1), "checkpoint_interval": _integer(0), "resume": _choice(True, False, "auto"),
              "max_skipped_steps": _integer(0, null=True), "straggler_seconds": _number(0),
              "keep_checkpoints": _integer(1), "out_dir": _text(), "peak_tflops": _number(0, above=True, null=True),
              "threads": _integer(1, null=True), "compile": _flag_or_text()},
    "log": {"interval": _integer(1), "progress": _choice(True, False), "plot": _choice(True, False)},
    "log.wandb": {"enabled": _choice(True, False), "project": _text(), "entity": _text(null=True),
                  "name": _text(null=True), "mode": _choice("offline", "online", "disabled")},
    "comm": {"name": _text(), "transport": _choice(*TRANSPORTS, "auto"), "intra": _choice(*TRANSPORTS, None),
             "inter": _choice(*TRANSPORTS, None), "ranks_per_node": _integer(1, null=True),
             "nics_per_node": _integer(1, null=True), "timeout": _number(0, above=True)},
    "optim": {"lr": _number(0, above=True, null=True), "min_lr": _number(0, null=True),
              "warmup_steps": _integer(0), "decay_steps": _integer(1, null=True)},
    "model": {"meta_init": _choice("auto", True, False), "tied": _choice(True, False, None),
              "bias": _choice(True, False, None)},
    "data": {"cache_dir": _text(), "tokenizer": _text(null=True), "name": _text(null=True),
             "config": _text(null=True), "split": _text(null=True), "field": _text(null=True)},
}


def _group(resolved: dict, path: str) -> dict:
    node = resolved
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        raise ConfigError(f"the configuration has no {path} group")
    return node


def check(resolved: dict) -> GPTConfig:
    """Check every key of a resolved shard-train configuration (a plain dict, as
    OmegaConf.to_container(cfg, resolve=True) gives); ConfigError names the first bad one.
    Returns the model configuration it builds on the way."""
    for path, table in TABLES.items():
        group = _group(resolved, path)
        for key, check_key in table.items():
            check_key(f"{path}.{key}", group.get(key))
    model = model_config(_group(resolved, "model"))
    train = resolved["train"]
    if train["seq_len"] > model.context:
        raise ConfigError(f"train.seq_len={train['seq_len']} exceeds the model's context of {model.context}")
    _algorithm(resolved["comm"].get("algorithm"))
    _codecs(resolved["comm"].get("compression") or {})
    engine_config(resolved, "fp32" if train["precision"] == "auto" else train["precision"])
    rates = learning_rates(resolved)
    if rates["min_lr"] > rates["lr"]:
        preset = " (the model preset's)" if resolved["optim"]["lr"] is None else ""
        raise ConfigError(f"optim.min_lr={rates['min_lr']} must not exceed optim.lr={rates['lr']}{preset}")
    _data(_group(resolved, "data"), model)
    return model


def model_config(m: dict) -> GPTConfig:
    """The preset with the fields the config sets (null keeps the preset's value)."""
    try:
        return GPTConfig.preset(m.get("preset"), **{k: m[k] for k in MODEL_FIELDS if m.get(k) is not None})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model: {e}") from None


def learning_rates(resolved: dict) -> dict:
    """{"lr", "min_lr"} as the run uses them: optim.lr, or when null the model preset's
    peak rate (a larger model needs a smaller one); optim.min_lr, or when null a tenth of
    the rate, as GPT-3 and OPT decay to."""
    from shard.models.gpt import peak_lr

    optim = resolved["optim"]
    lr = peak_lr(resolved["model"]["preset"]) if optim["lr"] is None else optim["lr"]
    return {"lr": lr, "min_lr": lr / 10 if optim["min_lr"] is None else optim["min_lr"]}


def _algorithm(value) -> None:
    """comm.algorithm: one name for every collective, or {collective: name}, each one its
    collective takes."""
    from pccl import vocabulary

    pairs = value.items() if isinstance(value, dict) else [(None, value)]
    for key, name in pairs:
        if isinstance(value, dict) and key not in vocabulary.COLLECTIVES:
            raise ConfigError(f"comm.algorithm: unknown collective {key!r}; expected keys among "
                              f"{vocabulary.COLLECTIVES}")
        names = vocabulary.names(key)
        if name not in names:
            raise ConfigError(f"comm.algorithm{'.' + key if key else ''} must be one of {names}, got {name!r}")


def _codecs(compression: dict) -> None:
    """comm.compression.params and .grads: a codec's name, or null."""
    from pccl.compression.codecs import codec

    for name in ("params", "grads"):
        value = compression.get(name)
        if value is None:
            continue
        try:
            if not isinstance(value, str):
                raise ValueError(f"expected a codec name (int8, bf16, fp16, zfp:RATE) or null, got {value!r}")
            codec(value)
        except ValueError as e:
            raise ConfigError(f"comm.compression.{name}: {e}") from None


# Which key of the configuration each EngineConfig/OptimizerConfig field comes from, so
# their errors (which start with the field's name) name it.
ENGINE_KEYS = {"group_size": "strategy.group_size", "prefetch": "strategy.prefetch",
               "prefetch_bytes": "strategy.prefetch_bytes", "min_shard_numel": "strategy.min_shard_numel",
               "activation_checkpointing": "strategy.activation_checkpointing",
               "reduce_dtype": "strategy.reduce_dtype", "algorithm": "comm.algorithm",
               "compress_params": "comm.compression.params", "compress_grads": "comm.compression.grads",
               "objective": "strategy.auto.objective", "memory": "strategy.auto.memory",
               "headroom": "strategy.auto.headroom", "auto": "strategy.auto", "compile": "train.compile",
               **{f.name: f"optim.{f.name}" for f in fields(OptimizerConfig)}}


def engine_config(resolved: dict, precision: str) -> EngineConfig:
    """The engine's settings from the resolved configuration: the strategy group (its name
    is the strategy), the optimizer group's AdamW fields (a null lr: learning_rates'),
    comm.algorithm, comm.compression and `precision`."""
    strategy, optim = dict(resolved["strategy"]), {**resolved["optim"], **learning_rates(resolved)}
    compression = resolved["comm"].get("compression") or {}
    try:
        return EngineConfig(strategy=strategy.pop("name"), **strategy, precision=precision,
                            compile=resolved["train"].get("compile", False),
                            algorithm=resolved["comm"]["algorithm"], compress_params=compression.get("params"),
                            compress_grads=compression.get("grads"),
                            optimizer=OptimizerConfig(**{f.name: optim[f.name] for f in fields(OptimizerConfig)}))
    except (TypeError, ValueError) as e:
        first = str(e).split(" ", 1)[0]
        key = ENGINE_KEYS.get(first, "strategy.name")
        raise ConfigError(f"{key}: {e}") from None


def _data(d: dict, model: GPTConfig) -> None:
    from shard.data.spec import normalize

    spec = {k: v for k, v in d.items() if k != "cache_dir"}
    if spec.get("vocab_size") is None:
        spec["vocab_size"] = model.vocab
    try:
        normalize(spec)
    except ValueError as e:
        raise ConfigError(str(e)) from None
