"""shard-train's configuration as one typed tree: a dataclass per group of configs/, each
field declaring what it takes. `Settings.of(resolved)` builds the tree from the composed
configuration (a plain dict, as OmegaConf.to_container(cfg, resolve=True) gives); a bad
value fails in the field that holds it, which names its key ("train.micro_batch must be an
integer >= 1, got -1"). Fields marked `checked_by` are checked by the class their values
are given to (the model's GPTConfig, the engine's EngineConfig and OptimizerConfig, the
data spec), which name them the same way; configs/ holds the values and their comments.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

Check = Callable[[str, object], None]


class ConfigError(ValueError):
    """A configuration that cannot run, with what was expected."""


def integer(low: int, null: bool = False) -> Check:
    def check(key, value):
        if value is None and null:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{key} must be an integer >= {low}{' or null' if null else ''}, got {value!r}")
    return check


def number(low: float, above: bool = False, null: bool = False) -> Check:
    def check(key, value):
        if value is None and null:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                (value <= low if above else value < low):
            raise ConfigError(f"{key} must be a number {'>' if above else '>='} {low}{' or null' if null else ''}, "
                              f"got {value!r}")
    return check


def choice(*choices) -> Check:
    def check(key, value):
        # `True in (1,)` holds in Python: compare types too, so 1 is not true nor 0 false.
        if not any(value == c and type(value) is type(c) for c in choices):
            raise ConfigError(f"{key} must be one of {choices}, got {value!r}")
    return check


def text(null: bool = False) -> Check:
    def check(key, value):
        if value is None and null:
            return
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key} must be a non-empty string{' or null' if null else ''}, got {value!r}")
    return check


def flag_or_text(key: str, value) -> None:
    if not isinstance(value, bool) and not (isinstance(value, str) and value):
        raise ConfigError(f"{key} must be true, false or a torch.compile backend's name, got {value!r}")


def algorithm(key: str, value) -> None:
    """One pccl algorithm for every collective, or {collective: name}, each one its
    collective takes."""
    from pccl import vocabulary

    pairs = value.items() if isinstance(value, dict) else [(None, value)]
    for collective, name in pairs:
        if isinstance(value, dict) and collective not in vocabulary.COLLECTIVES:
            raise ConfigError(f"{key}: unknown collective {collective!r}; expected keys among "
                              f"{vocabulary.COLLECTIVES}")
        names = vocabulary.names(collective)
        if name not in names:
            raise ConfigError(f"{key}{'.' + collective if collective else ''} must be one of {names}, got {name!r}")


def codec_name(key: str, value) -> None:
    """A codec's name (int8, bf16, fp16, zfp:RATE), or null."""
    from pccl.compression.codecs import codec

    if value is None:
        return
    try:
        if not isinstance(value, str):
            raise ValueError(f"expected a codec name (int8, bf16, fp16, zfp:RATE) or null, got {value!r}")
        codec(value)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def setting(check: Check) -> Any:
    """A field whose value `check(key, value)` accepts."""
    return field(default=None, metadata={"check": check})


def checked_by(owner: str) -> Any:
    """A field whose value the class it is given to (`owner`, in words) checks, naming its key."""
    return field(default=None, metadata={"owner": owner})


def section(kind: type, optional: bool = False) -> Any:
    """A nested group (optional: it may be left out)."""
    return field(default=None, metadata={"section": kind, "optional": optional})


class Section:
    OPEN = False   # whether keys it does not name are another checker's (the data group's: its source's)

    @classmethod
    def of(cls, values, path: str = ""):
        """The section from `values` (the group's dict): each field's check run with its
        key. A key it does not name is refused (`+optim.warmup_step=0`, a typo Hydra's `+`
        lets through, would leave warmup_steps as it was), unless the section is OPEN."""
        if values is None:
            raise ConfigError(f"the configuration has no {path} group")
        names = [f.name for f in fields(cls)]
        if not isinstance(values, dict):
            raise ConfigError(f"{path} must be a group of keys ({', '.join(names)}), got {values!r}")
        unknown = sorted(set(values) - set(names))
        if unknown and not cls.OPEN:
            key = f"{path}.{unknown[0]}" if path else unknown[0]
            raise ConfigError(f"{key}: no such key; {path or 'the configuration'} has {names}")
        built = {}
        for f in fields(cls):
            key = f"{path}.{f.name}" if path else f.name
            value = values.get(f.name)
            if "section" in f.metadata:
                if value is not None or not f.metadata["optional"]:
                    value = f.metadata["section"].of(value, key)
            elif "check" in f.metadata:
                f.metadata["check"](key, value)
            built[f.name] = value
        return cls(**built)


TRANSPORTS = ("mpi", "gloo", "nccl")


@dataclass(frozen=True)
class Train(Section):
    steps: int = setting(integer(1))
    global_batch_tokens: Optional[int] = setting(integer(1, null=True))
    accumulation: int = setting(integer(1))
    micro_batch: int = setting(integer(1))
    seq_len: int = setting(integer(1))
    precision: str = setting(choice("auto", "fp32", "bf16", "fp16"))
    device: str = setting(choice("auto", "cpu", "cuda"))
    seed: int = setting(integer(0))
    eval_interval: int = setting(integer(0))
    eval_batches: int = setting(integer(1))
    checkpoint_interval: int = setting(integer(0))
    resume: Any = setting(choice(True, False, "auto"))
    max_skipped_steps: Optional[int] = setting(integer(0, null=True))
    straggler_seconds: float = setting(number(0))
    keep_checkpoints: int = setting(integer(1))
    checkpoint_async: bool = setting(choice(True, False))
    checkpoint_dir: Optional[str] = setting(text(null=True))
    out_dir: str = setting(text())
    peak_tflops: Optional[float] = setting(number(0, above=True, null=True))
    threads: Optional[int] = setting(integer(1, null=True))
    compile: Any = setting(flag_or_text)


@dataclass(frozen=True)
class Wandb(Section):
    enabled: bool = setting(choice(True, False))
    project: str = setting(text())
    entity: Optional[str] = setting(text(null=True))
    name: Optional[str] = setting(text(null=True))
    mode: str = setting(choice("offline", "online", "disabled"))


@dataclass(frozen=True)
class Profile(Section):
    steps: int = setting(integer(0))
    start: int = setting(integer(1))


@dataclass(frozen=True)
class Log(Section):
    interval: int = setting(integer(1))
    progress: bool = setting(choice(True, False))
    plot: bool = setting(choice(True, False))
    wandb: Wandb = section(Wandb)
    profile: Profile = section(Profile)


@dataclass(frozen=True)
class Compression(Section):
    params: Optional[str] = setting(codec_name)
    grads: Optional[str] = setting(codec_name)


@dataclass(frozen=True)
class Comm(Section):
    name: str = setting(text())
    transport: str = setting(choice(*TRANSPORTS, "auto"))
    intra: Optional[str] = setting(choice(*TRANSPORTS, None))
    inter: Optional[str] = setting(choice(*TRANSPORTS, None))
    ranks_per_node: Optional[int] = setting(integer(1, null=True))
    nics_per_node: Optional[int] = setting(integer(1, null=True))
    timeout: float = setting(number(0, above=True))
    algorithm: Any = setting(algorithm)
    compression: Compression = section(Compression)


@dataclass(frozen=True)
class Optim(Section):
    lr: Optional[float] = setting(number(0, above=True, null=True))   # null: the model preset's peak rate
    min_lr: Optional[float] = setting(number(0, null=True))           # null: a tenth of lr
    warmup_steps: int = setting(integer(0))
    decay_steps: Optional[int] = setting(integer(1, null=True))
    betas: Any = checked_by("OptimizerConfig")
    eps: Any = checked_by("OptimizerConfig")
    weight_decay: Any = checked_by("OptimizerConfig")
    grad_clip: Any = checked_by("OptimizerConfig")


@dataclass(frozen=True)
class Model(Section):
    preset: Any = checked_by("GPTConfig")   # a preset's name, or hf: the config.json at `path`
    path: Optional[str] = setting(text(null=True))
    vocab: Any = checked_by("GPTConfig")
    context: Any = checked_by("GPTConfig")
    width: Any = checked_by("GPTConfig")
    layers: Any = checked_by("GPTConfig")
    heads: Any = checked_by("GPTConfig")
    kv_heads: Any = checked_by("GPTConfig")
    hidden: Any = checked_by("GPTConfig")
    mlp: Any = checked_by("GPTConfig")
    norm: Any = checked_by("GPTConfig")
    positions: Any = checked_by("GPTConfig")
    tied: Optional[bool] = setting(choice(True, False, None))
    bias: Optional[bool] = setting(choice(True, False, None))
    meta_init: Any = setting(choice("auto", True, False))


@dataclass(frozen=True)
class Data(Section):
    """The keys every corpus has; a source's own (files, documents, ...) are the data
    spec's (shard.data.spec.normalize), which refuses the others."""

    OPEN = True

    cache_dir: str = setting(text())
    tokenizer: Optional[str] = setting(text(null=True))
    name: Optional[str] = setting(text(null=True))
    config: Optional[str] = setting(text(null=True))
    split: Optional[str] = setting(text(null=True))
    field: Optional[str] = setting(text(null=True))


@dataclass(frozen=True)
class Auto(Section):
    objective: Any = checked_by("AutoConfig")   # throughput | memory
    memory: Any = checked_by("AutoConfig")      # per device, e.g. 64GB; null: the GPU's, or on CPUs the machine's
    headroom: Any = checked_by("AutoConfig")    # fraction of the memory kept free


@dataclass(frozen=True)
class Strategy(Section):
    """One schema for every strategy: the presets (strategy=zero3, paro-iig, ..., auto)
    differ only in their name, and take the engine's defaults (presets())."""

    name: Any = checked_by("EngineConfig")       # zero3, paro-iig, ... or letters such as IIG; auto: the planner's
    group_size: Any = checked_by("EngineConfig")  # ranks per group (I scope); null: the topology's ranks per node
    prefetch: Any = checked_by("EngineConfig")   # units gathered ahead
    prefetch_bytes: Any = checked_by("EngineConfig")   # cap on the bytes prefetched units hold
    min_shard_numel: Any = checked_by("EngineConfig")  # smaller units stay replicated
    activation_checkpointing: Any = checked_by("EngineConfig")
    reshard_after_forward: Any = checked_by("EngineConfig")   # false: keep each unit's parameters to its backward
    reduce_dtype: Any = checked_by("EngineConfig")     # gradient reduction dtype: fp32 | bf16 | fp16
    auto: Optional[Auto] = section(Auto, optional=True)   # how strategy=auto chooses


def presets() -> dict[str, dict]:
    """{name: the strategy group's values}: every strategy the engine names (its aliases,
    paro-<letters> for the others) and auto, each with the engine's default settings
    (EngineConfig's, AutoConfig's for auto)."""
    from dataclasses import asdict

    from shard.engine.config import AutoConfig, EngineConfig
    from shard.engine.strategy import STRATEGIES

    engine = EngineConfig()
    base = {f.name: getattr(engine, f.name) for f in fields(Strategy) if f.name not in ("name", "auto")}
    named = {s.name: {"name": s.name, **base} for s in STRATEGIES}
    return {**named, "auto": {"name": "auto", **base, "auto": asdict(AutoConfig())}}


def register_presets() -> None:
    """The strategy group's options, for Hydra (configs/ has no strategy files)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, values in presets().items():
        store.store(group="strategy", name=name, node=values)


@dataclass(frozen=True)
class Settings(Section):
    train: Train = section(Train)
    log: Log = section(Log)
    comm: Comm = section(Comm)
    optim: Optim = section(Optim)
    model: Model = section(Model)
    data: Data = section(Data)
    strategy: Strategy = section(Strategy)
