"""The training loop's parts that need no ranks: learning-rate schedule, throughput and
MFU, the model configuration from Hydra values, the loss plot."""
import math

import pytest
import torch

from shard.lr_schedule import learning_rate
from shard.run_log import plot_losses
from shard.throughput import PEAK_TFLOPS, Throughput, device_kind, peak_tflops


def test_warmup_then_cosine_to_the_floor():
    lr, floor = 1e-3, 1e-4
    rates = [learning_rate(s, lr, floor, 10, 100, 0) for s in range(130)]
    assert rates[0] == pytest.approx(lr / 10) and rates[9] == pytest.approx(lr)
    assert all(a < b for a, b in zip(rates[:9], rates[1:10]))                 # linear warmup
    for s in (10, 35, 60, 85, 110):                                            # half cosine, then flat
        progress = min(1.0, (s - 10) / 100)
        assert rates[s] == pytest.approx(floor + (lr - floor) * (1 + math.cos(math.pi * progress)) / 2)
    assert rates[60] == pytest.approx((lr + floor) / 2) and rates[129] == pytest.approx(floor)
    # without decay_steps the cosine spans the rest of training
    cosine = floor + (lr - floor) * (1 + math.cos(math.pi * 49 / 50)) / 2
    assert learning_rate(49, lr, floor, 0, None, 50) == pytest.approx(cosine)
    with pytest.raises(ValueError, match="min_lr"):
        learning_rate(0, 1e-4, 1e-3, 0, None, 10)


def test_throughput_and_mfu():
    meter = Throughput(flops_per_token=6 * 10 ** 9, world=4, peak=100.0)
    m = meter.measure(tokens=40_000, seconds=2.0)
    assert m["tokens_per_s"] == 20_000 and m["tokens_per_s_per_rank"] == 5_000
    assert m["tflops_per_rank"] == pytest.approx(5_000 * 6e9 / 1e12)
    assert m["mfu"] == pytest.approx(30.0 / 100.0)
    assert Throughput(1, 1, None).measure(10, 1.0)["mfu"] is None


def test_peak_table_and_device_names():
    assert device_kind("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert device_kind("NVIDIA H100 PCIe") == "H100 PCIe"
    assert device_kind("NVIDIA H200") == "H200"
    assert device_kind("NVIDIA A100-SXM4-80GB") == "A100"
    assert device_kind("AMD Instinct MI250X") == "MI250X GCD"
    assert device_kind("Tesla T4") is None
    assert PEAK_TFLOPS["MI250X GCD"]["bf16"] * 2 == pytest.approx(383.0)   # per MI250X, two GCDs
    peak, why = peak_tflops(torch.device("cpu"), "fp32")
    assert peak is None and "not meaningful" in why


def test_model_configuration_from_hydra_values():
    from omegaconf import OmegaConf

    from shard.train import ConfigError, check_vocab, model_config
    m = OmegaConf.create({"preset": "gpt_1p3b", "vocab": None, "context": 512, "width": None, "layers": 2,
                          "heads": None, "tied": None, "positions": "rotary", "bias": None})
    cfg = model_config(m)
    check_vocab(cfg, tokenizer_vocab=1000)
    shape = (cfg.width, cfg.heads, cfg.layers, cfg.context, cfg.positions, cfg.vocab)
    assert shape == (2048, 32, 2, 512, "rotary", 50272)
    with pytest.raises(ConfigError, match="model.vocab >= 60000"):
        check_vocab(cfg, tokenizer_vocab=60000)


def test_engine_config_from_the_hydra_configuration():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from shard.config import EngineConfig, OptimizerConfig
    from shard.train import CONFIGS, engine_config
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=["strategy=paro-iig", "strategy.prefetch=2", "strategy.group_size=4",
                                           "optim.lr=2e-3", "comm.algorithm={all_gather:ring}"])
    config = engine_config(OmegaConf.to_container(cfg, resolve=True), "bf16")
    assert config == EngineConfig(strategy="IIG", group_size=4, prefetch=2, precision="bf16",
                                  algorithm={"all_gather": "ring"},
                                  optimizer=OptimizerConfig(lr=2e-3, betas=(0.9, 0.95), grad_clip=1.0))


def test_loss_plot_is_a_png(tmp_path):
    records = [{"step": s, "loss": 5.0 / s} for s in range(1, 11)]
    records[-1]["val_loss"] = 0.6
    plot_losses({"": records}, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert [p.name for p in tmp_path.iterdir()] == ["loss.png"]   # no temporary left


def _record(step, loss):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0, "tokens_per_s_per_rank": 1.0,
            "tflops_per_rank": 0.0, "mfu": None, "exposed_comm_s": 0.0, "peak_memory_gb": 0.1}


def test_run_log_writes_jsonl_and_wandb_offline_and_trims_on_resume(tmp_path, monkeypatch):
    import json

    from shard.run_log import RunLog
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb_cfg = {"enabled": True, "project": "shard-test", "entity": None, "name": None, "mode": "offline"}
    log = RunLog(tmp_path, True, 4, 0, False, wandb_cfg, {"model": {"preset": "tiny"}})
    for step in range(1, 5):
        log.log(_record(step, 5.0 - step))
    log.close(tmp_path / "loss.png")
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")), "no offline wandb run was written"
    # resuming from a checkpoint at step 2 drops what steps 3 and 4 logged
    again = RunLog(tmp_path, True, 4, 2, False, None, {})
    again.log(_record(3, 1.5))
    again.close(None)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == [(1, 4.0), (2, 3.0), (3, 1.5)]
