"""Every key of configs/, in every option of every group, tried with bad values (a wrong
type, a negative or zero number, an unknown choice): shard.tools.preflight.check refuses each
with a ConfigError naming the key, from the configuration alone (no communicator, no file
written: it runs first in shard-train, on every rank alike). The bad values come from
each key's default by rule; the tables below list only the exceptions, and every key must
be covered."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from shard.tools import preflight

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# the groups of configs/, and the strategy group, whose options are presets of one schema
GROUPS = sorted({p.name for p in CONFIGS.iterdir() if p.is_dir()} | {"strategy"})
# Keys for which zero, or a negative number, is a valid value.
ZERO_VALID = {"train.seed", "train.eval_interval", "train.checkpoint_interval", "train.max_skipped_steps",
              "train.straggler_seconds", "optim.min_lr", "optim.warmup_steps", "optim.weight_decay",
              "strategy.prefetch", "strategy.min_shard_numel", "strategy.auto.headroom", "data.seed", "data.workers",
              "log.profile.steps"}
NEGATIVE_VALID = {"data.seed"}   # any integer seeds the synthetic corpus
FREE_TEXT = {"train.out_dir", "comm.name", "log.wandb.project", "data.cache_dir", "data.field", "data.name",
             "data.split", "model.preset"}   # any string goes (model.preset: an unknown one is below)
# Keys whose default is null, so no rule can derive their bad values.
NULL_DEFAULTS = {
    **{f"model.{k}": ["x", 0, -1] for k in ("vocab", "context", "width", "layers", "heads", "kv_heads", "hidden")},
    "model.tied": ["x"], "model.bias": ["x"], "model.positions": ["sideways"], "model.mlp": ["geglu"],
    "model.norm": ["batch"], "model.path": [3, "/no/such/model"],
    "train.global_batch_tokens": ["x", 0, -1], "train.max_skipped_steps": ["x", -1], "train.peak_tflops": ["x", 0],
    "train.threads": ["x", 0], "comm.intra": ["carrier-pigeon"], "comm.inter": ["carrier-pigeon"],
    "comm.ranks_per_node": ["x", 0], "comm.nics_per_node": ["x", 0], "comm.compression.params": ["int7", 3],
    "comm.compression.grads": ["int7", 3], "optim.decay_steps": ["x", 0], "strategy.group_size": ["x", 0],
    "optim.lr": ["x", 0, -1], "optim.min_lr": ["x", -1],
    "strategy.prefetch_bytes": ["x", 0], "strategy.auto.memory": ["x", 0, -1, "64XB"], "data.tokenizer": [3],
    "data.vocab_size": ["x", 10], "data.weights": ["x", [1.0, 2.0], [0]], "data.streams": ["x", 0],
    "data.config": [3], "log.wandb.entity": [3], "log.wandb.name": [3], "train.checkpoint_dir": [3],
}


def options(group: str) -> list[str]:
    return preflight.group_options()[group]


def composed(overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)


def leaves(node: dict, prefix: str = ""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and not path == "comm.algorithm":
            yield from leaves(value, path + ".")
        else:
            yield path, value


def bad_values(path: str, value) -> list:
    """What must fail at `path`, from its (valid) default `value`."""
    if value is None:
        return NULL_DEFAULTS[path]
    if isinstance(value, bool):
        return ["yes", 2]
    if isinstance(value, (int, float)):
        bad = ["x"] + ([] if path in NEGATIVE_VALID else [-1]) + ([] if path in ZERO_VALID else [0])
        return bad
    if isinstance(value, str):
        return [3] + ([] if path in FREE_TEXT else ["no-such-choice"])
    if isinstance(value, list):
        return ["x", []]
    raise AssertionError(f"{path}: no rule for a {type(value).__name__} default")


def with_value(resolved: dict, path: str, value) -> dict:
    bad = copy.deepcopy(resolved)
    node = bad
    *parents, leaf = path.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    return bad


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_key_of_every_option_refuses_bad_values_naming_the_key(group, option, tmp_path):
    extra = {("data", "text"): [f"data.files=[{tmp_path / 'corpus.txt'}]"],
             ("data", "files"): [f"data.paths=[{tmp_path / '*.jsonl'}]"],
             ("model", "hf"): [f"model.path={hf_model(tmp_path)}", "optim.lr=1e-4", "train.seq_len=32"]}.get(
        (group, option), [])
    resolved = composed([f"{group}={option}", *extra])
    assert preflight.check(resolved) is not None   # the option itself is valid
    missed = []
    for path, value in leaves(resolved):
        for bad in bad_values(path, value):
            try:
                preflight.check(with_value(resolved, path, bad))
                missed.append(f"{path}={bad!r}: accepted")
            except preflight.ConfigError as e:
                if path.rsplit(".", 1)[-1] not in str(e):
                    missed.append(f"{path}={bad!r}: the error does not name the key: {e}")
    assert not missed, "\n".join(missed)


def hf_model(tmp_path: Path) -> Path:
    """A tiny Llama written by transformers, for model=hf (a vocabulary the corpus's tokenizer can fill)."""
    from tests.models.test_hf import random_hf_model

    random_hf_model("llama", vocab_size=512).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_model_hf_reads_the_directorys_config_and_wants_a_learning_rate(tmp_path):
    path = hf_model(tmp_path)
    cfg = preflight.check(composed(["model=hf", f"model.path={path}", "optim.lr=1e-4", "train.seq_len=32"]))
    assert (cfg.width, cfg.layers, cfg.kv, cfg.norm, cfg.mlp) == (32, 2, 2, "rms", "swiglu")
    # the checkpoint's model, a shorter context at most: a tie its weights were not trained with is refused
    assert preflight.check(composed(["model=hf", f"model.path={path}", "optim.lr=1e-4", "train.seq_len=16",
                                     "model.context=16"])).context == 16
    with pytest.raises(preflight.ConfigError, match="tied=False; got tied=True"):
        preflight.check(composed(["model=hf", f"model.path={path}", "optim.lr=1e-4", "train.seq_len=32",
                                  "model.tied=true"]))
    with pytest.raises(preflight.ConfigError, match="model=hf has no preset learning rate: set optim.lr"):
        preflight.check(composed(["model=hf", f"model.path={path}", "train.seq_len=32"]))
    with pytest.raises(preflight.ConfigError, match="model=hf needs model.path"):
        preflight.check(with_value(composed(["model=hf", f"model.path={path}"]), "model.path", None))
    with pytest.raises(preflight.ConfigError, match="model.path is for model=hf; model=tiny is a preset"):
        preflight.check(composed([f"model.path={path}"]))


def test_model_hf_is_checked_with_its_own_tokenizer_as_the_run_uses_it(tmp_path):
    """A model of 259 tokens with its own tokenizer of 258 trains (shard-train takes the
    directory's tokenizer); the check took the vocabulary for one to train, which needs 260,
    and refused the run."""
    from tests.models.test_hf import random_hf_model
    from tests.shard.published_tokenizers import byte_bpe

    random_hf_model("llama", vocab_size=259).save_pretrained(tmp_path / "hf")
    byte_bpe(tmp_path / "hf", "llama", vocab=258)
    overrides = ["model=hf", f"model.path={tmp_path / 'hf'}", "optim.lr=1e-4", "train.seq_len=32"]
    assert preflight.check(composed(overrides)).vocab == 259
    assert preflight.data_spec({"tokenizer": None, "vocab_size": None}, 259, str(tmp_path / "hf"))["tokenizer"] == \
        str(tmp_path / "hf" / "tokenizer.json")


@pytest.mark.parametrize("override, key", [("+optim.warmup_step=0", "optim.warmup_step"),
                                           ("+model.layer=1", "model.layer"), ("+trian.steps=5", "trian"),
                                           ("+log.intervall=1", "log.intervall"), ("+strategy.foo=1", "strategy.foo"),
                                           ("+comm.compression.param=int8", "comm.compression.param"),
                                           ("+data.documnets=5", "documnets")])
def test_a_key_added_with_plus_that_no_group_has_is_refused_by_name(override, key):
    """Hydra's `+` adds any key: a typo would leave the setting it meant as it was."""
    with pytest.raises(preflight.ConfigError, match=key):
        preflight.check(composed([override]))


def test_cross_key_checks():
    resolved = composed([])
    for path, value, words in (("train.seq_len", 10 ** 6, "exceeds the model's context"),
                               ("optim.min_lr", 1.0, "must not exceed optim.lr"),
                               ("comm.algorithm", {"all_gather": "ring", "broadcast": "ring"}, "unknown collective"),
                               ("model.preset", "gpt_9000", "unknown model preset"),
                               ("comm.compression", 3, r"comm.compression must be a group of keys \(params, grads\)")):
        with pytest.raises(preflight.ConfigError, match=words):
            preflight.check(with_value(resolved, path, value))
    # the tokenizer's vocabulary taken from model.vocab: the error names the key the user set
    with pytest.raises(preflight.ConfigError, match=r"model.vocab=100 \(the tokenizer's vocabulary, data.vocab_size "
                                                    r"being null\): data spec: vocab_size must be an int >= 260"):
        preflight.check(with_value(resolved, "model.vocab", 100))
    # a value the config leaves to the command line (???) is named as such (it was "??? is not a
    # Hugging Face model directory", "files must be a non-empty list of paths, got '???'")
    for group, key in (("model=hf", "model.path"), ("data=text", "data.files")):
        with pytest.raises(preflight.ConfigError, match=rf"^{key} has no value \(\?\?\? in its config\): give one"):
            preflight.check(composed([group]))
    # ... and only where the error is about the vocabulary (every unknown key's message lists vocab_size)
    with pytest.raises(preflight.ConfigError, match=r"^data spec: unknown key\(s\) \['documentz'\]"):
        preflight.check(with_value(resolved, "data.documentz", 100))
    with pytest.raises(preflight.ConfigError, match=r"^data spec: val_documents=1: not read by source 'synthetic'"):
        preflight.check(with_value(resolved, "data.val_documents", 1))
    # a codec that cannot take the dtype its payload travels in (was a traceback at engine build)
    bf16 = with_value(resolved, "train.precision", "bf16")
    with pytest.raises(preflight.ConfigError, match="comm.compression.params: compress_params with precision=bf16: "
                                                    "codec 'bf16' takes"):
        preflight.check(with_value(bf16, "comm.compression", {"params": "bf16", "grads": None}))
    fp16_grads = with_value(with_value(resolved, "train.precision", "fp16"), "strategy.reduce_dtype", "fp16")
    with pytest.raises(preflight.ConfigError, match="comm.compression.grads: compress_grads with reduce_dtype=fp16"):
        preflight.check(with_value(fp16_grads, "comm.compression", {"params": None, "grads": "fp16"}))


# GPT-3's peak rates per size (Brown et al., 2020, Table 2.1), OPT-66B's (Zhang et al.,
# 2022, Table 1), Llama 2's for 7B and 13B (Touvron et al., 2023, Table 1), and the tiny
# presets' 1e-3.
PUBLISHED_LR = {"tiny": 1e-3, "gpt_125m": 6e-4, "gpt_350m": 3e-4, "gpt_1p3b": 2e-4, "gpt_2p7b": 1.6e-4,
                "gpt_7b": 1.2e-4, "gpt_13b": 1e-4, "gpt_66b": 8e-5,
                "llama_tiny": 1e-3, "llama_1b": 3e-4, "llama_8b": 3e-4, "llama_13b": 3e-4}


def test_null_learning_rates_are_the_presets_and_a_tenth_of_it():
    from shard.models import PRESETS

    assert set(PUBLISHED_LR) == set(PRESETS)
    for preset, lr in PUBLISHED_LR.items():
        # every preset has its config (model=gpt_66b was refused: "no such option")
        assert composed([f"model={preset}"])["model"]["preset"] == preset
        resolved = with_value(composed([]), "model.preset", preset)
        preflight.check(resolved)
        assert preflight.learning_rates(resolved) == {"lr": lr, "min_lr": pytest.approx(lr / 10)}, preset
        assert preflight.optimizer_config(resolved).lr == lr
    given = composed(["model=gpt_125m", "optim.lr=2e-3"])   # a rate given is kept, and its tenth is the floor
    assert preflight.learning_rates(given) == {"lr": 2e-3, "min_lr": pytest.approx(2e-4)}
    assert preflight.learning_rates(composed(["optim.lr=2e-3", "optim.min_lr=0"])) == {"lr": 2e-3, "min_lr": 0}
    with pytest.raises(preflight.ConfigError, match="must not exceed optim.lr"):   # min_lr above the preset's
        preflight.check(composed(["model=gpt_13b", "optim.min_lr=1e-3"]))


def test_a_bad_setting_on_the_command_line_is_one_line_and_exit_status_2(tmp_path):
    """The user's mistake, not the program's: no traceback, no Hydra hint; the line names
    the key, what it got and what it takes. A launched rank other than the first says
    nothing (every rank fails alike)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "shard.tools.train", "train.micro_batch=-1", f"train.out_dir={tmp_path}"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "PMI_RANK": "0"})
    assert run.returncode == 2, run.stderr
    assert run.stderr == "shard-train: train.micro_batch must be an integer >= 1, got -1\n"
    assert run.stdout == ""
    quiet = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "PMI_RANK": "1"})
    assert (quiet.returncode, quiet.stderr) == (2, "")
    # a group's option that does not exist: refused before Hydra composes, in the same form
    unknown = subprocess.run([sys.executable, "-m", "shard.tools.train", "strategy=zero9"], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "PMI_RANK": "0"})
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1, unknown.stderr
    assert unknown.stderr.startswith("shard-train: strategy=zero9: no such option; expected one of ['auto', 'ddp'")


def test_a_key_no_group_has_is_refused_as_a_setting_is():
    """Hydra's own error for it exited 1, so a RESTARTS loop relaunched a typo."""
    # named with the group's keys (Hydra's "To append to your config use +train.nosuchkey=1"
    # led to a second refusal)
    with pytest.raises(preflight.ConfigError, match=r"^train.nosuchkey: no such key; train has \[.*'steps'"):
        preflight.check_overrides(["train.nosuchkey=1"])
    with pytest.raises(preflight.ConfigError, match=r"^trian: no such key; the configuration has \[.*'train'"):
        preflight.check_overrides(["trian.steps=1"])
    with pytest.raises(preflight.ConfigError, match=r"^comm.compression.parms: no such key; comm.compression has"):
        preflight.check_overrides(["comm.compression.parms=int8"])
    with pytest.raises(preflight.ConfigError, match=r"^data.pathz: no such key; data has \[.*'paths'"):   # data=files'
        preflight.check_overrides(["data=files", "data.pathz=x"])
    with pytest.raises(preflight.ConfigError, match="no viable alternative at input"):
        preflight.check_overrides(["train.steps=[1,"])
    preflight.check_overrides(["train.steps=3", "hydra.run.dir=x"])
    for flags in (["-m", "train.steps=1,2"], ["--cfg", "job"]):   # Hydra's own syntax: Hydra's to check
        preflight.check_overrides(flags)


def test_a_multiruns_sweep_over_a_groups_options_is_checked_option_by_option():
    preflight.check_choices(["model=tiny,llama_tiny", "strategy=zero3,paro-iig", "model=glob(*)"])
    with pytest.raises(preflight.ConfigError, match="model=gpt_9000: no such option"):
        preflight.check_choices(["model=tiny,gpt_9000"])
