"""shard-train: train a GPT with the sharding engine, configured by Hydra (configs/).

    shard-train                                                   # tiny model, synthetic data, one rank
    mpiexec -n 4 shard-train model=gpt_125m strategy=paro-iig comm=pccl comm.ranks_per_node=2
    shard-train train.resume=true train.out_dir=runs/mine         # continue from the latest checkpoint

A run writes into train.out_dir: config.yaml (the resolved configuration, with the model
as built and the world it ran on), metrics.jsonl, checkpoints/, loss.png, summary.json.
"""
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

import pccl
from models import GPT, GPTConfig
from pccl.files import write_atomic

from .engine import Engine
from .lr_schedule import learning_rate
from .run_log import RunLog
from .throughput import Throughput, peak_tflops

CONFIGS = next(p for p in (Path(__file__).resolve().parents[1] / "configs",   # source tree, editable install
                           Path(__file__).resolve().parent / "configs") if p.is_dir())   # wheel
MODEL_FIELDS = ("vocab", "context", "width", "layers", "heads", "tied", "positions", "bias")
META_INIT_PARAMS = 10 ** 9    # meta_init=auto builds models above this size on the meta device
LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")


class ConfigError(ValueError):
    """A configuration that cannot run, with what was expected."""


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"train.device must be cpu, cuda or auto, got {name!r}")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda, but torch sees no GPU")
        local = next((int(os.environ[v]) for v in LOCAL_RANK_VARS if v in os.environ), 0)
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _communicator(c, device: torch.device) -> pccl.Communicator:
    transport = c.transport
    if transport == "auto":
        transport = "nccl" if device.type == "cuda" else "gloo"
    options = {k: c[k] for k in ("intra", "inter") if c.get(k) is not None}
    options.update({k: int(c[k]) for k in ("ranks_per_node", "nics_per_node") if c.get(k) is not None})
    return pccl.init(transport, timeout=float(c.timeout), **options)


def _share(comm: pccl.Communicator, device: torch.device, text: str, width: int = 4096) -> str:
    """Rank 0's `text` on every rank (a sum in which the other ranks add zeros)."""
    codes = torch.zeros(width, dtype=torch.int32, device=device)
    if comm.rank == 0:
        data = text.encode()
        if len(data) > width:
            raise ConfigError(f"{text[:60]!r}... is longer than {width} bytes")
        codes[:len(data)] = torch.tensor(list(data), dtype=torch.int32)
    comm.all_reduce(codes)
    return bytes(c for c in codes.tolist() if c).decode()


def _mean(comm: pccl.Communicator, device: torch.device, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    comm.all_reduce(t, op="avg")
    return t.tolist()


def model_config(m) -> GPTConfig:
    """The preset with the fields the config sets (null keeps the preset's value)."""
    return GPTConfig.preset(m.preset, **{k: m[k] for k in MODEL_FIELDS if m.get(k) is not None})


def check_vocab(cfg: GPTConfig, tokenizer_vocab: int) -> None:
    if cfg.vocab < tokenizer_vocab:
        raise ConfigError(f"the tokenizer has {tokenizer_vocab} tokens but model.vocab is {cfg.vocab}; "
                          f"set model.vocab >= {tokenizer_vocab} or a smaller data.vocab_size")


def _precision(name: str, device: torch.device) -> str:
    if name == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return name


def _accumulation(t, world: int) -> int:
    per_micro = world * t.micro_batch * t.seq_len
    if t.global_batch_tokens % per_micro:
        raise ConfigError(f"train.global_batch_tokens={t.global_batch_tokens} is not a multiple of world size x "
                          f"micro_batch x seq_len = {world} x {t.micro_batch} x {t.seq_len} = {per_micro}")
    return t.global_batch_tokens // per_micro


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # KiB on Linux: peak RSS


def _prepare_data(d, comm: pccl.Communicator, device: torch.device, vocab: int):
    from .data import TokenData, prepare

    spec = {k: v for k, v in d.items() if k != "cache_dir"}
    if spec.get("vocab_size") is None:
        spec["vocab_size"] = vocab
    path = ""
    if comm.rank == 0:   # one rank tokenizes (once: cached); the others read the result
        path = str(prepare(spec, Path(d.cache_dir)).resolve())
    return TokenData(_share(comm, device, path))


def _restart_interval(engine: Engine) -> float:
    """Evaluation and checkpoints are not training: their time and traffic stay out of
    the next interval's throughput and communication figures."""
    engine.comm_report(reset=True)
    return time.perf_counter()


def evaluate(engine: Engine, batches: list, device: torch.device) -> float:
    total = 0.0
    with torch.no_grad():
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            total += F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten()).item()
    return total / len(batches)


def run(cfg) -> dict:
    """Train as `cfg` says; returns the summary rank 0 writes to summary.json."""
    from omegaconf import OmegaConf

    from .data import Batches, eval_batches

    resolved = OmegaConf.to_container(cfg, resolve=True)
    t, o = cfg.train, cfg.optim
    for name, value, low in (("train.steps", t.steps, 1), ("log.interval", cfg.log.interval, 1),
                             ("train.micro_batch", t.micro_batch, 1), ("train.seq_len", t.seq_len, 1),
                             ("train.eval_batches", t.eval_batches, 1), ("train.eval_interval", t.eval_interval, 0),
                             ("train.checkpoint_interval", t.checkpoint_interval, 0)):
        if not isinstance(value, int) or value < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    device = _device(t.device)
    comm = _communicator(cfg.comm, device)
    accumulation = _accumulation(t, comm.size)   # every rank fails alike, before any collective
    torch.set_num_threads(t.threads or (1 if comm.size > 1 else os.cpu_count() or 1))
    torch.manual_seed(t.seed)
    out_dir = Path(_share(comm, device, str(Path(str(t.out_dir)).resolve())))
    if comm.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    mcfg = model_config(cfg.model)
    if t.seq_len > mcfg.context:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds the model's context of {mcfg.context}")
    data = _prepare_data(cfg.data, comm, device, mcfg.vocab)
    check_vocab(mcfg, data.vocab_size)
    meta = cfg.model.meta_init
    meta = mcfg.num_params() > META_INIT_PARAMS if meta == "auto" else bool(meta)
    with torch.device("meta" if meta else device):
        model = GPT(mcfg, seed=t.seed)
    s = cfg.strategy
    precision = _precision(t.precision, device)
    engine = Engine(model, comm, strategy=s.name, group_size=s.group_size, lr=o.lr, betas=tuple(o.betas),
                    eps=o.eps, weight_decay=o.weight_decay, precision=precision, grad_clip=o.grad_clip,
                    prefetch=s.prefetch, reduce_dtype=s.reduce_dtype,
                    algorithm=resolved["comm"]["algorithm"],
                    activation_checkpointing=s.activation_checkpointing, min_shard_numel=s.min_shard_numel,
                    prefetch_bytes=s.prefetch_bytes, device=device if meta else None)
    batches = Batches(data.train, t.seq_len, t.micro_batch, accumulation, comm.rank, comm.size, t.seed)
    held_out = eval_batches(data.val, t.seq_len, t.micro_batch, comm.rank, comm.size, t.eval_batches)

    checkpoints = out_dir / "checkpoints"
    start, resumed = 0, "a fresh start"
    if t.resume and (checkpoints / "LATEST").is_file():
        extra = engine.load(checkpoints)
        start = extra["step"]
        batches.load_state_dict(extra["data"])
        resumed = f"resumed at step {start}"
    elif t.resume:
        resumed = f"a fresh start: train.resume=true, but {checkpoints} holds no checkpoint"
    resolved["train"]["out_dir"] = str(out_dir)
    resolved["built"] = {"model": asdict(mcfg), "num_params": mcfg.num_params(), "world": comm.size,
                         "ranks_per_node": comm.topology.ranks_per_node, "accumulation": accumulation,
                         "precision": precision, "device": str(device), "meta_init": meta,
                         "tokenizer_vocab": data.vocab_size, "data": str(data.directory)}
    if comm.rank == 0:
        write_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(resolved)))

    peak, peak_source = peak_tflops(device, precision) if t.peak_tflops is None else (float(t.peak_tflops), "given")
    meter = Throughput(mcfg.flops_per_token(t.seq_len), comm.size, peak)
    log = RunLog(out_dir, comm.rank == 0, t.steps, start, cfg.log.progress, resolved["log"]["wandb"], resolved)
    log.write(f"{mcfg.num_params() / 1e6:.1f}M parameters, {meter.flops_per_token / 1e9:.3f} GFLOP/token; "
              f"{comm.size} ranks ({comm.topology.ranks_per_node} per node), strategy {engine.strategy.name}, "
              f"comm {cfg.comm.name} ({cfg.comm.algorithm}), {precision} on {device}; {accumulation} micro-batches "
              f"of {t.micro_batch}x{t.seq_len} per rank per step; peak: {peak_source}; {resumed}; out: {out_dir}")

    interval_losses, interval_start, interval_steps = [], _restart_interval(engine), 0
    step = start
    last_val: Optional[float] = None
    while step < t.steps:
        engine.lr = learning_rate(step, o.lr, o.min_lr, o.warmup_steps, o.decay_steps, t.steps)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for x, y in batches.next_step():
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
            engine.backward(loss)
            loss_sum += loss.detach()
        result = engine.step()
        step += 1
        interval_losses.append(loss_sum / accumulation)
        interval_steps += 1
        log.step()
        evaluate_now = step == t.steps or (t.eval_interval and step % t.eval_interval == 0)
        if step % cfg.log.interval == 0 or evaluate_now:
            local_loss = torch.stack(interval_losses).mean().item()   # synchronizes the device
            elapsed = time.perf_counter() - interval_start
            loss_value, = _mean(comm, device, [local_loss])
            report = engine.comm_report(reset=True)
            record = {"step": step, "loss": loss_value, "lr": engine.lr, "grad_norm": result.grad_norm,
                      **meter.measure(t.global_batch_tokens * interval_steps, elapsed),
                      "exposed_comm_s": report["exposed_s"] / interval_steps,
                      "comm_busy_s": sum(report["busy_s"].values()) / interval_steps,
                      "step_time_s": elapsed / interval_steps, "peak_memory_gb": _peak_memory_gb(device),
                      "skipped": result.skipped, "loss_scale": result.loss_scale, "epoch": batches.epoch}
            if evaluate_now:
                last_val, = _mean(comm, device, [evaluate(engine, held_out, device)])
                record["val_loss"] = last_val
            log.log(record)
            interval_losses, interval_steps = [], 0
            interval_start = _restart_interval(engine)
        if step == t.steps or (t.checkpoint_interval and step % t.checkpoint_interval == 0):
            engine.save(checkpoints, extra={"step": step, "data": batches.state_dict()})
            interval_start = _restart_interval(engine)

    summary = summarize(log.records, last_val, resolved["built"])
    if comm.rank == 0:
        write_atomic(out_dir / "summary.json", json.dumps(summary, indent=1))
    log.close(out_dir / "loss.png" if cfg.log.plot else None)
    engine.close()
    return summary


def summarize(records: list[dict], val_loss: Optional[float], built: dict) -> dict:
    """Final losses, and throughput as the median over logged intervals after the first
    (which includes warm-up)."""
    import statistics

    timed = records[1:] or records

    def median(key: str) -> Optional[float]:
        return statistics.median(r[key] for r in timed) if timed and timed[0][key] is not None else None
    return {"final_loss": records[-1]["loss"] if records else None, "val_loss": val_loss,
            "tokens_per_s": median("tokens_per_s"), "tokens_per_s_per_rank": median("tokens_per_s_per_rank"),
            "tflops_per_rank": median("tflops_per_rank"), "mfu": median("mfu"),
            "exposed_comm_s": median("exposed_comm_s"), "step_time_s": median("step_time_s"), **built}


def main() -> None:
    import hydra

    hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="config")(run)()


if __name__ == "__main__":
    main()
