"""A shard-train configuration checked whole before anything starts: any key of configs/
with a wrong type, a number out of range or an unknown choice fails naming the key and
what was expected, on every rank alike (each rank reads the same configuration), before
a communicator exists or a file is written. The keys are the fields of the typed tree
(shard/tools/settings.py), each checked by the field that holds it, or by the class it is
given to (GPTConfig, EngineConfig, the data spec); then the checks across keys. A null
optim.lr is the model preset's peak rate and a null optim.min_lr a tenth of optim.lr
(learning_rates)."""
from __future__ import annotations

import json
import re
from dataclasses import fields, replace
from pathlib import Path
from typing import Optional

from shard.engine.checkpoint import CheckpointError
from shard.engine.config import EngineConfig, OptimizerConfig, SettingError
from shard.engine.strategy import StrategyError
from shard.models import GPTConfig
from shard.tools.settings import ConfigError, Model, Settings, register_presets

# The configuration tree (configs/): in the source tree and an editable install, or a wheel's shard/configs
CONFIGS = next(p for p in (Path(__file__).resolve().parents[2] / "configs",
                           Path(__file__).resolve().parents[1] / "configs") if p.is_dir())
register_presets()   # the strategy group's options, which configs/ does not hold
__all__ = ["CONFIGS", "ConfigError", "check", "check_choices", "engine_config", "group_options", "learning_rates",
           "model_config"]


def group_options() -> dict[str, list[str]]:
    """{group: its options}: the files of each folder of configs/, and the strategy presets."""
    from shard.tools.settings import presets

    found = {p.name: sorted(f.stem for f in p.glob("*.yaml")) for p in CONFIGS.iterdir() if p.is_dir()}
    return {**found, "strategy": sorted(presets())}


def check_choices(overrides: list[str]) -> None:
    """Command-line overrides that pick a group's option (strategy=zero3): each one the
    group has, before Hydra composes (which would fail with a traceback hint)."""
    options = group_options()
    for override in overrides:
        group, sep, option = override.partition("=")
        if not sep or group not in options or "(" in option:   # glob(...), choice(...): Hydra's sweeps
            continue
        for one in option.split(","):   # a multirun's sweep (-m model=tiny,llama_tiny)
            if one not in options[group]:
                raise ConfigError(f"{group}={one}: no such option; expected one of {options[group]}")


def check_overrides(argv: list[str]) -> None:
    """A run's overrides composed as Hydra will compose them (a key no group has, a
    malformed value): ConfigError in one line, so the run exits 2 as for any refused
    setting, where Hydra's own error exits 1 and a RESTARTS loop relaunched it. A
    command line with Hydra's flags (-m's sweep, --cfg job, ...) is left to Hydra: their
    syntax is its own."""
    if any(a.startswith("-") for a in argv):
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = [a for a in argv if not a.startswith(("hydra.", "hydra/", "+hydra"))]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        try:
            compose("config", overrides=overrides)
        except (HydraException, OmegaConfBaseException) as e:
            missing = re.match(r"Could not override '([^']+)'", str(e))
            if not missing:
                raise ConfigError(" ".join(str(e).split())) from None
            # a key no group has: named with the keys of its group as the run chose it (data=files'
            # for data.pathz), not with Hydra's advice to add it
            key = missing.group(1)
            try:
                cfg = compose("config", overrides=[o for o in overrides if o.partition("=")[0].lstrip("+~") != key])
            except (HydraException, OmegaConfBaseException):
                cfg = compose("config")
            raise ConfigError(no_such_key(key, cfg)) from None


def no_such_key(key: str, cfg) -> str:
    """What to say of a dotted `key` that the composed configuration `cfg` lacks: the
    keys of the deepest group of its path that exists."""
    from omegaconf import OmegaConf

    parts = key.split(".")
    depth = max(d for d in range(len(parts)) if d == 0 or OmegaConf.select(cfg, ".".join(parts[:d])) is not None)
    group = ".".join(parts[:depth])
    section = OmegaConf.select(cfg, group) if group else cfg
    keys = list(section.keys()) if OmegaConf.is_dict(section) else []
    return f"{'.'.join(parts[:depth + 1])}: no such key; {group or 'the configuration'} has {keys}"


def check(resolved: dict) -> GPTConfig:
    """Check every key of a resolved shard-train configuration (a plain dict, as
    OmegaConf.to_container(cfg, resolve=True) gives); ConfigError names the first bad one.
    Returns the model configuration it builds on the way."""
    missing = [path for path, value in dotted(resolved).items() if value == "???"]
    if missing:   # (OmegaConf's mark of a value the config leaves to the command line)
        raise ConfigError(f"{missing[0]} has no value (??? in its config): give one, {missing[0]}=...")
    Settings.of(resolved)
    model = model_config(resolved["model"])
    train = resolved["train"]
    if train["seq_len"] > model.context:
        raise ConfigError(f"train.seq_len={train['seq_len']} exceeds the model's context of {model.context}")
    engine_config(resolved, "fp32" if train["precision"] == "auto" else train["precision"])
    optimizer_config(resolved)
    rates = learning_rates(resolved)
    if rates["min_lr"] > rates["lr"]:
        preset = " (the model preset's)" if resolved["optim"]["lr"] is None else ""
        raise ConfigError(f"optim.min_lr={rates['min_lr']} must not exceed optim.lr={rates['lr']}{preset}")
    m = resolved["model"]
    _data(resolved["data"], model, m.get("path") if m.get("preset") == "hf" else None)
    return model


def dotted(tree: dict, prefix: str = "") -> dict:
    """{"optim.lr": 0.001, ...}: every leaf of a resolved configuration by its dotted key."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def model_config(m: dict) -> GPTConfig:
    """The preset (model=hf: the config.json at model.path) with the fields the config sets
    (null keeps the preset's value)."""
    given = {f.name for f in fields(GPTConfig)} & {f.name for f in fields(Model)}
    overrides = {k: m[k] for k in given if m.get(k) is not None}
    try:
        if m.get("preset") == "hf":
            from shard.models.hf import Checkpoint, config_from_hf, fit

            if not m.get("path"):
                raise ValueError("model=hf needs model.path: a Hugging Face model directory")
            try:
                theirs = config_from_hf(Checkpoint(m["path"]).hf)[0]
            except (ValueError, OSError) as e:
                raise ValueError(f"model.path={m['path']}: {e}") from None
            cfg = replace(theirs, **overrides)
            fit(theirs, cfg)
            return cfg
        if m.get("path") is not None:
            raise ValueError(f"model.path is for model=hf; model={m.get('preset')} is a preset")
        return GPTConfig.preset(m.get("preset"), **overrides)
    except (TypeError, ValueError, OSError) as e:
        raise ConfigError(f"model: {e}") from None


def snapshot_config(snap: Path) -> GPTConfig:
    """The config of the model a checkpoint snapshot holds: what the run built (its extra
    "config"), or for snapshots written before it was kept, the run's model group."""
    extra = json.loads((snap / "meta.json").read_text()).get("extra") or {}
    if "config" in extra:
        return GPTConfig(**extra["config"])
    if "model" in extra:
        return model_config(extra["model"])
    raise CheckpointError(f"{snap} does not say which model it holds: its meta.json has no model config")


def run_tokenizer(snap: Path) -> Path | None:
    """The tokenizer of the run that wrote snapshot `snap` (its config.yaml's, beside the
    snapshot's checkpoints directory): a tokenizer file, or a prepared corpus's directory;
    None where the run did not record one."""
    import yaml

    for run in (snap.parent.parent, snap.parent, snap):
        config = run / "config.yaml"
        if config.is_file():
            try:
                written = yaml.safe_load(config.read_text())
            except yaml.YAMLError as e:
                raise ValueError(f"{config} is not the run's YAML: {' '.join(str(e).split())}") from None
            if not isinstance(written, dict):
                raise ValueError(f"{config} is not the run's configuration (a YAML {type(written).__name__}, not a "
                                 "mapping)")
            built = written.get("built") or {}
            found = built.get("tokenizer") or built.get("data")   # runs before streamed data recorded "data" only
            return Path(found) if found else None
    return None


def learning_rates(resolved: dict) -> dict:
    """{"lr", "min_lr"} as the run uses them: optim.lr, or when null the model preset's
    peak rate (a larger model needs a smaller one); optim.min_lr, or when null a tenth of
    the rate, as GPT-3 and OPT decay to."""
    from shard.models.gpt import peak_lr

    optim, preset = resolved["optim"], resolved["model"]["preset"]
    if optim["lr"] is None and preset == "hf":
        raise ConfigError("model=hf has no preset learning rate: set optim.lr (fine-tuning takes far smaller rates "
                          "than pretraining, such as 2e-5)")
    lr = peak_lr(preset) if optim["lr"] is None else optim["lr"]
    return {"lr": lr, "min_lr": lr / 10 if optim["min_lr"] is None else optim["min_lr"]}


def optimizer_config(resolved: dict) -> OptimizerConfig:
    """The optimizer's settings: the optim group's AdamW fields (a null lr: learning_rates').
    A bad one is named by the field that raised it."""
    optim = {**resolved["optim"], **learning_rates(resolved)}
    try:
        return OptimizerConfig(**{f.name: optim[f.name] for f in fields(OptimizerConfig)})
    except SettingError as e:
        raise ConfigError(f"optim.{e.field}: {e}") from None


def engine_config(resolved: dict, precision: str) -> EngineConfig:
    """The engine's settings from the resolved configuration: the strategy group (its name
    is the strategy), comm.algorithm, comm.compression and `precision`. A bad one is named
    by the field of EngineConfig that raised it, as the key its value came from."""
    strategy = dict(resolved["strategy"])
    compression = resolved["comm"].get("compression") or {}
    elsewhere = {"strategy": "strategy.name", "precision": "train.precision", "compile": "train.compile",
                 "algorithm": "comm.algorithm", "compress_params": "comm.compression.params",
                 "compress_grads": "comm.compression.grads"}   # the other fields are the strategy group's keys
    try:
        return EngineConfig(strategy=strategy.pop("name"), **strategy, precision=precision,
                            compile=resolved["train"].get("compile", False), algorithm=resolved["comm"]["algorithm"],
                            compress_params=compression.get("params"), compress_grads=compression.get("grads"))
    except (SettingError, StrategyError) as e:
        raise ConfigError(f"{elsewhere.get(e.field, f'strategy.{e.field}')}: {e}") from None


def data_spec(d, vocab: int, model_dir: Optional[str]) -> dict:
    """The data group `d` as a data spec: a tokenizer trained to `vocab` where it sets none,
    or with data.tokenizer null and a Hugging Face model (`model_dir`), that model's own."""
    from shard.data import tokenizer

    spec = {k: v for k, v in d.items() if k != "cache_dir"}
    if spec.get("vocab_size") is None:
        spec["vocab_size"] = vocab
    if spec.get("tokenizer") is None and model_dir is not None:
        try:
            spec["tokenizer"] = str(tokenizer.locate(model_dir))
        except FileNotFoundError:   # a model directory without one: a tokenizer trained on the corpus
            pass
    return spec


def _data(d: dict, model: GPTConfig, model_dir: Optional[str]) -> None:
    """The data group checked as the run will use it (data_spec): with a Hugging Face
    model's own tokenizer, a vocabulary under the 260 a trained one needs is no error."""
    from shard.data.spec import normalize

    from_model = d.get("vocab_size") is None
    spec = data_spec(d, model.vocab, model_dir)
    try:
        normalize(spec)
    except ValueError as e:   # the value may be the model's, which the user set
        origin = f"model.vocab={model.vocab} (the tokenizer's vocabulary, data.vocab_size being null): " \
            if from_model and str(e).startswith("data spec: vocab_size") else ""
        raise ConfigError(f"{origin}{e}") from None
