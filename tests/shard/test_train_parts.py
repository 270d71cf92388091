"""The training loop's parts that need no ranks: learning-rate schedule, throughput and
MFU, the model configuration from Hydra values, the loss plot, and the decisions that let
the default configuration run on any world size and device (global batch, device,
transport, precision, peak memory), tested with stand-ins for GPUs and ranks."""
import math
import os

import pytest
import torch

from shard.planning.throughput import PEAK_TFLOPS, Throughput, device_kind, peak_tflops
from shard.tools.lr_schedule import learning_rate
from shard.tools.run_log import plot_losses


def test_warmup_then_cosine_to_the_floor():
    lr, floor = 1e-3, 1e-4
    rates = [learning_rate(s, lr, floor, 10, 100, 0) for s in range(130)]
    assert rates[0] == pytest.approx(lr / 10) and rates[9] == pytest.approx(lr)
    assert all(a < b for a, b in zip(rates[:9], rates[1:10]))                 # linear warmup
    assert max(rates) == lr and rates.count(lr) == 1                           # the peak is one step
    for s in (10, 34, 59, 84, 109):                                            # half cosine from the peak, then flat
        progress = min(1.0, (s - 9) / 100)
        assert rates[s] == pytest.approx(floor + (lr - floor) * (1 + math.cos(math.pi * progress)) / 2)
    assert rates[59] == pytest.approx((lr + floor) / 2)
    assert rates[108] > floor and rates[109] == rates[129] == pytest.approx(floor)
    # without decay_steps the cosine spans the rest of training: the last update is at the floor
    for warmup in (0, 1, 5):
        rates = [learning_rate(s, lr, floor, warmup, None, 50) for s in range(50)]
        assert rates[max(warmup - 1, 0)] == lr and rates.count(lr) == 1
        assert rates[48] > floor and rates[49] == pytest.approx(floor)
        assert all(a > b for a, b in zip(rates[max(warmup - 1, 0):], rates[max(warmup, 1):]))
    assert learning_rate(0, lr, floor, 1, None, 1) == lr                       # one step: the peak
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
    # the PCIe cards with NVLink bridges run lower clocks: 835.5 dense bf16, not 989
    assert device_kind("NVIDIA H100 NVL") == "H100 NVL" and device_kind("NVIDIA H200 NVL") == "H200 NVL"
    assert PEAK_TFLOPS["H200 NVL"]["bf16"] * 2 == pytest.approx(1671.0)   # the sheet's "with sparsity"
    assert device_kind("NVIDIA A100-SXM4-80GB") == "A100"
    assert device_kind("AMD Instinct MI250X") == "MI250X GCD"
    assert device_kind("Tesla T4") is None
    assert PEAK_TFLOPS["MI250X GCD"]["bf16"] * 2 == pytest.approx(383.0)   # per MI250X, two GCDs
    peak, why = peak_tflops(torch.device("cpu"), "fp32")
    assert peak is None and "not meaningful" in why


def test_model_configuration_from_hydra_values():
    from omegaconf import OmegaConf

    from shard.tools.preflight import model_config
    from shard.tools.train import ConfigError, check_vocab
    m = OmegaConf.create({"preset": "gpt_1p3b", "vocab": None, "context": 512, "width": None, "layers": 2,
                          "heads": None, "tied": None, "positions": "rotary", "bias": None})
    cfg = model_config(OmegaConf.to_container(m))
    check_vocab(cfg, tokenizer_vocab=1000)
    shape = (cfg.width, cfg.heads, cfg.layers, cfg.context, cfg.positions, cfg.vocab)
    assert shape == (2048, 32, 2, 512, "rotary", 50272)
    with pytest.raises(ConfigError, match="set model.vocab >= 60000 or set data.vocab_size <= 50272"):
        check_vocab(cfg, tokenizer_vocab=60000)
    with pytest.raises(ConfigError, match="vocabulary is 50272; set model.vocab >= 60000$"):
        check_vocab(cfg, tokenizer_vocab=60000, given=True)
    with pytest.raises(ConfigError, match="50272 \\(the checkpoint's\\); name a tokenizer of at most that many"):
        check_vocab(cfg, tokenizer_vocab=60000, given=True, pretrained=True)


def test_engine_config_from_the_hydra_configuration():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from shard.engine.config import EngineConfig, OptimizerConfig
    from shard.tools.preflight import engine_config, optimizer_config
    from shard.tools.train import CONFIGS
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=["strategy=paro-iig", "strategy.prefetch=2", "strategy.group_size=4",
                                           "optim.lr=2e-3", "comm.algorithm={all_gather:ring}"])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert engine_config(resolved, "bf16") == EngineConfig(strategy="IIG", group_size=4, prefetch=2, precision="bf16",
                                                           algorithm={"all_gather": "ring"})
    assert optimizer_config(resolved) == OptimizerConfig(lr=2e-3, betas=(0.9, 0.95), grad_clip=1.0)


def test_loss_plot_is_a_png(tmp_path):
    records = [{"step": s, "loss": 5.0 / s} for s in range(1, 11)]
    records[-1]["val_loss"] = 0.6
    plot_losses({"": records}, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert [p.name for p in tmp_path.iterdir()] == ["loss.png"]   # no temporary left


def _record(step, loss):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0, "tokens_per_s_per_rank": 1.0,
            "tflops_per_rank": 0.0, "mfu": None, "exposed_comm_s": 0.0, "peak_memory_gb": 0.1, "step_time_s": 1.0}


def test_run_log_writes_jsonl_and_wandb_offline_and_trims_on_resume(tmp_path, monkeypatch):
    import json

    from shard.tools.run_log import RunLog
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


def test_the_run_log_holds_a_bounded_number_of_records_however_long_the_run(tmp_path, monkeypatch):
    """Rank 0 kept every record in memory (a kilobyte each, without end): now the latest
    RECENT, which the summary's medians take, and the latest with a validation loss and a
    warm-up's time; the loss plot reads the file, thinned."""
    from shard.tools import run_log, train

    monkeypatch.setattr(run_log, "RECENT", 50)
    monkeypatch.setattr(run_log, "PLOTTED", 40)
    plotted = []
    monkeypatch.setattr(run_log, "plot_losses", lambda curves, path: plotted.extend(curves[""]))
    log = run_log.RunLog(tmp_path, True, 1000, 0, False, None, {})
    log.log({**_record(1, 9.0), "warmup_s": 7.0})
    log.log({**_record(2, 8.0), "val_loss": 8.5})
    for step in range(3, 1001):
        log.log({**_record(step, 1.0), "step_time_s": 2.0 if step > 950 else 1.0})
    assert [r["step"] for r in log.records] == [1, 2, *range(951, 1001)]
    summary = train.summarize(log.records, None, {})
    assert (summary["val_loss"], summary["warmup_s"], summary["final_loss"]) == (8.5, 7.0, 1.0)
    assert summary["step_time_s"] == 2.0   # the latest intervals' median
    log.close(tmp_path / "loss.png")
    steps = [r["step"] for r in plotted]
    assert 20 <= len(steps) <= 41 and steps[0] == 1 and steps[-1] == 1000 and len(set(map(
        lambda a, b: b - a, steps[:-2], steps[1:-1]))) == 1   # evenly spaced, and the last


def test_a_record_cut_short_is_left_out_on_resume(tmp_path, capsys):
    """A full disk (or a kill) mid-append leaves the last line cut short: a resume read it
    with json.loads and crashed, every relaunch alike."""
    import json

    from shard.tools.run_log import RunLog
    good = "".join(json.dumps(_record(step, 5.0 - step)) + "\n" for step in (1, 2))
    (tmp_path / "metrics.jsonl").write_text(good + json.dumps(_record(3, 2.0))[:40])
    log = RunLog(tmp_path, True, 4, 2, False, None, {})
    assert [r["step"] for r in log.records] == [1, 2]
    assert "1 record(s) cut short left out" in capsys.readouterr().out
    log.log(_record(3, 1.5))
    log.close(None)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_wandb_failure_ends_wandbs_logging_not_the_training(tmp_path, monkeypatch, capsys):
    """Its server, disk or bugs: a warning, and every record still in metrics.jsonl."""
    import json

    import wandb

    from shard.tools.run_log import RunLog
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb_cfg = {"enabled": True, "project": "shard-test", "entity": None, "name": None, "mode": "offline"}
    log = RunLog(tmp_path, True, 4, 0, False, wandb_cfg, {})
    assert log.wandb.id.startswith(tmp_path.name + "-")   # the directory's name, and its path's hash

    def broken(*args, **kwargs):
        raise OSError("the wandb disk is full")
    monkeypatch.setattr(type(log.wandb), "log", broken)
    for step in range(1, 4):
        log.log(_record(step, 5.0 - step))
    log.close(None)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    said = capsys.readouterr().out
    assert said.count("wandb failed at step 1: OSError: the wandb disk is full; training goes on without it") == 1
    monkeypatch.setattr(wandb, "init", broken)
    (tmp_path / "other").mkdir()
    assert RunLog(tmp_path / "other", True, 4, 0, False, wandb_cfg, {}).wandb is None
    assert "wandb could not start: OSError" in capsys.readouterr().out


def test_global_batch_grows_with_the_world_unless_set():
    from shard.tools.train import ConfigError, global_batch
    # null: world x micro_batch x accumulation x seq_len, the accumulation as configured
    for world in (1, 2, 8):
        assert global_batch(None, 4, world, 8, 128) == (4096 * world, 4)
        assert global_batch(None, 1, world, 8, 128) == (1024 * world, 1)
    # a number: fixed, the accumulation derived from it, as before
    assert global_batch(4096, 99, 1, 8, 128) == (4096, 4)   # train.accumulation plays no part
    assert global_batch(4096, 4, 2, 8, 128) == (4096, 2)
    assert global_batch(65536, 4, 8, 8, 128) == (65536, 8)
    with pytest.raises(ConfigError, match=r"train.global_batch_tokens=4096 is not a multiple of world size x "
                                          r"micro_batch x seq_len = 8 x 8 x 128 = 8192"):
        global_batch(4096, 4, 8, 8, 128)
    with pytest.raises(ConfigError, match="not a multiple of world size"):
        global_batch(1000, 4, 1, 8, 128)
    for bad in (0, -1024, "4096", 4096.0, True):
        with pytest.raises(ConfigError, match="train.global_batch_tokens must be a positive integer, or null"):
            global_batch(bad, 4, 1, 8, 128)
    for bad in (0, -1, 2.0, None, True):
        with pytest.raises(ConfigError, match="train.accumulation must be an integer >= 1"):
            global_batch(None, bad, 1, 8, 128)


def _default_config(*overrides):
    from hydra import compose, initialize_config_dir

    from shard.tools.train import CONFIGS
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_default_configuration_runs_on_any_world_and_device():
    from shard.tools.train import global_batch
    t = _default_config().train
    assert t.global_batch_tokens is None and t.device == "auto" and t.precision == "auto"
    # one rank: the 4096 tokens and 4 micro-batches of 8 x 128 the default had when the batch was fixed
    assert global_batch(t.global_batch_tokens, t.accumulation, 1, t.micro_batch, t.seq_len) == (4096, 4)
    for world in (2, 8, 64):
        assert global_batch(t.global_batch_tokens, t.accumulation, world, t.micro_batch, t.seq_len)[1] == 4


def test_device_auto_is_cuda_where_torch_sees_a_gpu():
    from shard.tools.train import ConfigError, device_type
    gpu, none = (lambda: True), (lambda: False)
    assert device_type("auto", gpu) == "cuda" and device_type("auto", none) == "cpu"
    assert device_type("cpu", gpu) == "cpu" and device_type("cuda", gpu) == "cuda"
    with pytest.raises(ConfigError, match="torch sees no GPU"):
        device_type("cuda", none)
    with pytest.raises(ConfigError, match="train.device must be cpu, cuda or auto"):
        device_type("tpu", gpu)
    assert device_type("auto") == ("cuda" if torch.cuda.is_available() else "cpu")   # the real check by default

def test_cpu_threads_follow_the_setting_then_omp_num_threads_then_the_cores_this_process_may_use():
    """A one-rank run took os.cpu_count() threads, over OMP_NUM_THREADS and the process's
    affinity: two such runs side by side on 2 cores each kept an OpenMP thread spinning."""
    from shard.tools.train import ConfigError, cpu_threads
    allowed = len(os.sched_getaffinity(0))
    assert cpu_threads(None, 1, {}) == allowed
    assert cpu_threads(None, 4, {}) == 1
    assert cpu_threads(None, 1, {"OMP_NUM_THREADS": "1"}) == 1
    assert cpu_threads(None, 4, {"OMP_NUM_THREADS": " 3 "}) == 3
    assert cpu_threads(None, 1, {"OMP_NUM_THREADS": "6,2"}) == 6   # OpenMP's nested form: the outer level
    assert cpu_threads(5, 1, {"OMP_NUM_THREADS": "1"}) == 5
    assert cpu_threads(None, 1, {"OMP_NUM_THREADS": ""}) == allowed
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ConfigError, match=f"OMP_NUM_THREADS must be a positive number of threads, got '{bad}'"):
            cpu_threads(None, 1, {"OMP_NUM_THREADS": bad})



def test_transport_follows_the_device_and_must_carry_its_tensors():
    from shard.tools.train import ConfigError, check_comm_device, comm_transport
    assert comm_transport("auto", "cuda") == "nccl" and comm_transport("auto", "cpu") == "gloo"
    for fixed in ("mpi", "gloo", "nccl"):
        assert comm_transport(fixed, "cuda") == fixed and comm_transport(fixed, "cpu") == fixed
    check_comm_device("mpi", ("cpu",), "cpu")
    check_comm_device("mpi", ("cpu", "cuda"), "cuda")   # a GPU build of the native module
    check_comm_device("nccl", ("cuda",), "cuda")
    with pytest.raises(ConfigError, match=r"comm.transport=mpi carries cpu tensors here, but training runs on cuda; "
                                          r"pccl's native module was built without GPU kernels"):
        check_comm_device("mpi", ("cpu",), "cuda")
    with pytest.raises(ConfigError, match="use comm.transport=auto"):
        check_comm_device("gloo", ("cpu",), "cuda")
    with pytest.raises(ConfigError, match="carries cuda tensors here, but training runs on cpu"):
        check_comm_device("nccl", ("cuda",), "cpu")
    # the comm groups: torch's transport follows the device, pccl's run over MPI on both
    assert _default_config("comm=torch").comm.transport == "auto"
    for name in ("pccl", "native", "hierarchical", "ho_ring"):
        assert _default_config(f"comm={name}").comm.transport == "mpi"


def test_precision_is_bf16_on_gpus_and_the_reduce_dtype_is_configurable():
    from omegaconf import OmegaConf

    from shard.tools.preflight import engine_config
    from shard.tools.train import _precision
    assert _precision("auto", torch.device("cuda")) == "bf16" and _precision("auto", torch.device("cpu")) == "fp32"
    assert _precision("fp16", torch.device("cuda")) == "fp16" and _precision("bf16", torch.device("cpu")) == "bf16"
    for strategy in ("ddp", "zero1", "zero2", "zero3", "mics", "paro-iig", "paro-igg", "paro-nig"):
        resolved = OmegaConf.to_container(_default_config(f"strategy={strategy}"), resolve=True)
        assert engine_config(resolved, "bf16").reduce_dtype == "fp32", strategy   # the default: fp32 reduction
    resolved = OmegaConf.to_container(_default_config("strategy.reduce_dtype=bf16"), resolve=True)
    config = engine_config(resolved, "bf16")
    assert (config.precision, config.reduce_dtype) == ("bf16", "bf16")


class _Ranks:
    """A stand-in communicator of 2 ranks, this one rank 0: its tensors meet `others`, the
    other rank's values of each collective in call order; records the ops issued."""

    rank, size = 0, 2

    def __init__(self, *others):
        self.others, self.ops = list(others), []

    def all_reduce(self, t, op="sum"):
        self.ops.append(op)
        values = torch.stack([t, torch.tensor(self.others.pop(0), dtype=t.dtype)])
        reduce = {"max": lambda: values.max(0).values, "avg": lambda: values.mean(0), "sum": lambda: values.sum(0)}
        t.copy_(reduce[op]())

    def barrier(self):
        self.ops.append("barrier")

    def broadcast_object(self, obj, root=0):
        self.ops.append(f"broadcast from {root}")
        return obj if root == self.rank else self.others.pop(0)

    def all_gather(self, output, input):
        self.ops.append("gather")
        output.copy_(torch.cat([input.view(-1), torch.tensor(self.others.pop(0), dtype=input.dtype)])
                     .view_as(output))


def test_max_over_ranks():
    from shard.tools.train import _max
    comm = _Ranks([3.0, 0.5])
    assert _max(comm, torch.device("cpu"), [1.0, 2.0]) == [3.0, 2.0] and comm.ops == ["max"]


def test_a_snapshot_directory_some_rank_cannot_see_is_refused(tmp_path):
    """check_shared: rank 0 writes a probe, every rank looks for it. The other rank (the
    stand-in's values) sees it, then does not (a node-local disk): the second is refused,
    and the probe is gone either way."""
    from shard.tools.preflight import ConfigError
    from shard.tools.train import check_shared

    check_shared(_Ranks([0.0]), torch.device("cpu"), tmp_path, "train.out_dir")
    with pytest.raises(ConfigError, match=r"train.checkpoint_dir=.* is not one filesystem for every rank"):
        check_shared(_Ranks([1.0]), torch.device("cpu"), tmp_path, "train.checkpoint_dir")
    assert not list(tmp_path.iterdir())


def test_interval_record_has_the_mean_loss_and_the_largest_ranks_peak_memory_from_one_collective(monkeypatch):
    """log_interval gathers every rank's loss, peak memory and waits in one all-gather:
    one collective per logged interval, not one per scalar. Its throughput is the
    interval's: 4 steps of 8192 tokens in 2 s (a clock the test sets) are 16,384 tokens/s."""
    from types import SimpleNamespace

    from shard.engine.optimizer import StepResult
    from shard.tools.train import log_interval
    comm = _Ranks([3.0, 1000.0, 0.0, 0.0])   # the other rank: loss 3, peak 1000 GiB, no waits
    logged = []
    train = SimpleNamespace(micro_batch=8, seq_len=128, eval_interval=0)
    r = SimpleNamespace(comm=comm, device=torch.device("cpu"), step=10, global_batch_tokens=8192,
                        cfg=SimpleNamespace(train=train), meter=Throughput(1, 2, None),
                        optimizer=SimpleNamespace(lr=1e-3, skipped_steps=0),
                        engine=SimpleNamespace(comm_report=lambda reset: {"exposed_s": 0.0, "busy_s": {},
                                                                          "longest_wait_s": 0.0, "other_waits_s": 0.0,
                                                                          "longest_other_wait": ""}),
                        log=SimpleNamespace(log=logged.append), batches=SimpleNamespace(epoch=0, waited_s=0.0),
                        stalled_s=0.0, data_waited_s=0.0)
    train.straggler_seconds = 0
    result = StepResult(grad_norm=1.0, skipped=False, loss_scale=1.0)
    monkeypatch.setattr("shard.tools.train.time.perf_counter", lambda: 102.0)
    log_interval(r, result, [torch.tensor(1.0)] * 2, (100.0, 4), False)
    assert comm.ops == ["gather"]
    assert logged[0]["loss"] == 2.0 and logged[0]["peak_memory_gb"] == 1000.0 and logged[0]["straggler"] is None
    assert logged[0]["tokens_per_s"] == 4 * 8192 / 2.0 and logged[0]["step_time_s"] == 0.5
    assert logged[0]["tflops_per_rank"] == 4 * 8192 / 2.0 / 2 / 1e12   # 1 FLOP a token, 2 ranks


def test_a_straggler_is_the_rank_the_others_waited_for():
    """Rank 0 waited 3.5 s for one all-gather; rank 1 hardly waited at all: rank 1 is the
    straggler, named with rank 0's operation (shared from rank 0, the waiter)."""
    from types import SimpleNamespace

    from shard.tools.train import find_straggler

    operation = "gather: all-gather of blocks.0's parameters (forward)"
    report = {"longest_wait_s": 3.5, "exposed_s": 3.6, "longest_wait": operation}

    def run(limit, *others):
        comm = _Ranks(*others)
        r = SimpleNamespace(comm=comm, device=torch.device("cpu"),
                            cfg=SimpleNamespace(train=SimpleNamespace(straggler_seconds=limit)))
        return find_straggler(r, report, [3.5, 0.01], [3.6, 0.02]), comm.ops   # rank 1 hardly waited

    assert run(2) == ({"rank": 1, "waiter": 0, "operation": operation, "wait_s": 3.5}, ["broadcast from 0"])
    assert run(5) == (None, [])   # under the threshold: nothing shared
    assert run(0) == (None, [])   # off


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="the CPU peak resets through Linux's /proc/self/clear_refs")
def test_cpu_peak_memory_resets_per_interval():
    from shard.tools.train import _peak_memory_gb, _reset_peak_memory
    cpu = torch.device("cpu")
    _reset_peak_memory(cpu)
    base = _peak_memory_gb(cpu)
    block = torch.ones(64 * 2 ** 20)   # 256 MiB, touched
    del block                          # freed: large blocks go back to the system
    high = _peak_memory_gb(cpu)
    assert high >= base + 0.2
    _reset_peak_memory(cpu)
    assert _peak_memory_gb(cpu) < high - 0.2


def test_on_gpus_over_mpi_the_intra_node_level_defaults_to_nccl():
    from shard.tools.train import level_transports
    assert level_transports(None, None, "mpi", "cuda") == {"intra": "nccl"}
    assert level_transports(None, None, "mpi", "cpu") == {}
    assert level_transports(None, None, "nccl", "cuda") == {}
    assert level_transports("mpi", "gloo", "mpi", "cuda") == {"intra": "mpi", "inter": "gloo"}


def test_fault_plans_parse_and_bad_ones_say_why():
    from shard.tools import faults

    assert faults.planned({"SHARD_FAULTS": "inf-grad@2:1, nan-loss@4:0, stop@3:2:0.5, stop@5:0, kill-data@0:1"}) == {
        ("inf-grad", 2, 1): 0.0, ("nan-loss", 4, 0): 0.0, ("stop", 3, 2): 0.5, ("stop", 5, 0): faults.STOP_SECONDS,
        ("kill-data", 0, 1): 0.0}
    assert faults.planned({}) == {}
    for entry, message in (("inf-grad@2", "is not KIND@STEP:RANK"), ("kill@2:1:3", "is not KIND@STEP:RANK"),
                           ("stop@2:1:soon", "is not KIND@STEP:RANK"), ("explode@2:1", "unknown kind 'explode'"),
                           ("kill-data@3:1", "give STEP 0"), ("kill@-1:0", "must not be negative")):
        with pytest.raises(ValueError, match=message):
            faults.planned({"SHARD_FAULTS": entry})
    x = torch.ones(3, requires_grad=True)
    loss = faults.loss((x * 2).sum(), {("inf-grad", 1, 0)}, 1, 0)
    loss.backward()
    assert loss.item() == 6 and torch.isinf(x.grad).all()
    assert torch.isnan(faults.loss(torch.tensor(1.0), {("nan-loss", 3, 1)}, 3, 1))
    assert faults.loss(torch.tensor(1.0), {("nan-loss", 3, 1)}, 3, 0).item() == 1


def fake_loop(monkeypatch, tmp_path, interval: int, checkpoint_interval: int, window: tuple = (0, 10)) -> list:
    """train_loop's records for 12 steps on a clock where the first step takes 10 s and the
    others 1 s (a checkpoint 5 s; a step under the profiler, window = (steps, start) of
    log.profile with the step warming it up, 3 s more, as if the profiler slowed it)."""
    from types import SimpleNamespace

    from shard.tools import train
    clock = [0.0]
    monkeypatch.setattr(train.time, "perf_counter", lambda: clock[0])
    steps, start = window
    slow = set(range(start - 1, start + steps)) if steps else set()

    def step(r):
        clock[0] += (10.0 if r.step == 0 else 1.0) + (3.0 if r.step + 1 in slow else 0.0)
        r.step += 1
        return SimpleNamespace(skipped=False), torch.tensor(float(r.step))

    logged = []

    def log_interval(r, result, losses, timing, evaluate_now, warmup=False, warmup_s=None, profiled=False):
        started, steps = timing
        seconds = (clock[0] - started) / steps
        logged.append({"step": r.step, "losses": [x.item() for x in losses], "loss": losses[-1].item(),
                       "step_time_s": seconds, "warmup": warmup, "warmup_s": warmup_s, "tokens_per_s": 1 / seconds,
                       "tokens_per_s_per_rank": 1 / seconds, "tflops_per_rank": 0.0, "mfu": None,
                       "exposed_comm_s": 0.0, "profiled": profiled})

    def save(r, losses):
        clock[0] += 5.0
    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(train, "log_interval", log_interval)
    monkeypatch.setattr(train, "save_checkpoint", save)
    monkeypatch.setattr(train, "check_skipped", lambda r, unread: None)
    monkeypatch.setattr(train, "_restart_interval", lambda engine, device: clock[0])
    cfg = SimpleNamespace(train=SimpleNamespace(steps=12, eval_interval=0, checkpoint_interval=checkpoint_interval),
                          log=SimpleNamespace(interval=interval, profile=SimpleNamespace(steps=steps, start=start)))
    r = SimpleNamespace(cfg=cfg, step=0, engine=SimpleNamespace(comm_report=lambda reset: {}),
                        device=torch.device("cpu"), log=SimpleNamespace(step=lambda: None, write=lambda line: None),
                        open_interval=[], out_dir=tmp_path, comm=SimpleNamespace(rank=0))
    train.train_loop(r)
    assert [x["step"] for x in logged] == list(range(interval, 13, interval))
    # every step's loss is in its interval's, the warm-up's too
    assert [v for x in logged for v in x["losses"]] == [float(s) for s in range(1, 13)]
    return logged


@pytest.mark.parametrize("interval,checkpoint_interval,profiled", [(4, 0, 0), (1, 0, 0), (4, 6, 0), (4, 1, 0),
                                                                    (4, 0, 2), (1, 0, 2)])
def test_each_interval_is_timed_over_its_own_steps_with_the_warm_up_apart(monkeypatch, tmp_path, interval,
                                                                          checkpoint_interval, profiled):
    """Every logged interval's timing covers its own steps at 1 s each; the first step's 10 s
    are reported apart (a checkpoint at every step too: warmup_s was lost where the first
    step was saved at once), or, where that step is logged at once, its record says it is
    the warm-up, and the summary leaves it out. With steps 6-7 profiled (log.profile), the
    intervals holding them or step 5, which warms the profiler up, are marked, and the
    summary leaves them out too."""
    from shard.tools import train

    logged = fake_loop(monkeypatch, tmp_path, interval, checkpoint_interval, (profiled, 6))
    assert [x["step"] for x in logged if x["profiled"]] == ([] if not profiled else [8] if interval == 4 else [5, 6, 7])
    assert (tmp_path / "profile" / "steps6-7" / "rank0.json.gz").exists() == bool(profiled)
    first, rest = logged[0], [x for x in logged[1:] if not x["profiled"]]
    if interval == 1:
        assert first["warmup"] and first["step_time_s"] == 10.0 and first["warmup_s"] is None
    else:
        assert not first["warmup"] and first["warmup_s"] == 10.0 and first["step_time_s"] == 1.0
    assert all(x["step_time_s"] == 1.0 and not x["warmup"] and x["warmup_s"] is None for x in rest)
    summary = train.summarize(logged, None, {})
    assert summary["step_time_s"] == 1.0 and summary["warmup_s"] == 10.0   # (it was None at interval 1)
    if profiled:   # left out even where they are most of the records
        assert train.summarize([x for x in logged if x["profiled"]] * 10 + rest, None, {})["step_time_s"] == 1.0


@pytest.mark.parametrize("interval", [4, 1])
def test_a_warm_up_step_under_the_profiler_gives_no_warm_up_time(monkeypatch, tmp_path, interval):
    """log.profile from step 2: the session's first step warms the profiler up, so its time
    (13 s here) is not the warm-up's own: no warmup_s, in its record or the summary; the
    interval after it is marked for its own steps under the profiler (2 and 3) only."""
    from shard.tools import train

    logged = fake_loop(monkeypatch, tmp_path, interval, 0, (2, 2))
    assert [x["step"] for x in logged if x["profiled"]] == ([4] if interval == 4 else [1, 2, 3])
    assert all(x["warmup_s"] is None for x in logged)
    assert train.summarize(logged, None, {})["warmup_s"] is None
    assert train.summarize(logged, None, {})["step_time_s"] == 1.0


def test_the_summary_keeps_the_latest_validation_loss_logged_before_a_resume():
    """A relaunch that resumes a finished run validates nothing: its summary takes the
    val_loss its records (kept from the earlier session) hold."""
    from shard.tools import train

    records = [{**_record(1, 3.0), "val_loss": 3.5}, _record(2, 2.0)]
    assert train.summarize(records, None, {})["val_loss"] == 3.5
    assert train.summarize([*records, {**_record(3, 1.0), "val_loss": 1.5}], 1.5, {})["val_loss"] == 1.5
    assert train.summarize([], 2.5, {})["val_loss"] == 2.5   # a rank that logs nothing


def test_an_async_saves_injected_kill_is_for_the_step_saved_not_the_step_training_has_reached(monkeypatch):
    """kill-save@4 on an async save: the writer thread calls back after training has moved
    on; the callback read r.step then, saw 5 and did not kill (a fault test passed without
    its fault, once, in CI)."""
    from types import SimpleNamespace

    from shard.tools import faults, train
    asked = []
    monkeypatch.setattr(faults, "kill_if_planned", lambda planned, kind, step, rank, out: asked.append((kind, step)))
    monkeypatch.setattr(train, "data_position", lambda r: {})
    writes = []
    saver = SimpleNamespace(save=lambda optimizer, extra, written: writes.append(written))
    r = SimpleNamespace(step=4, faults={("kill-save", 4, 0): 0.0}, comm=SimpleNamespace(rank=0), out_dir="out",
                        resolved={"model": {}, "strategy": {}}, model=train.GPTConfig(), saver=saver,
                        optimizer=None, stalled_s=0.0)
    train.save_checkpoint(r, [])
    r.step = 5   # training goes on before the writer is done
    writes[0]()
    assert asked == [("kill-save", 4)]


def test_a_rank_that_waits_out_rank_0s_data_preparation_says_so(capsys):
    """A corpus rank 0 tokenizes for longer than comm.timeout failed a healthy run on the
    other ranks with "a peer died, or did not call the same collective"."""
    from types import SimpleNamespace

    import pccl
    from shard.tools.train import _on_rank_0

    def waited(path):
        raise pccl.CollectiveTimeout("pccl: rank 1 timed out after 3 s in MPI_Ibcast")
    comm = SimpleNamespace(rank=1, timeout=3.0, broadcast_object=waited)
    with pytest.raises(SystemExit) as e:
        _on_rank_0(comm, "preparing the data", lambda: "unused")
    assert e.value.code == 2
    assert "shard-train: rank 1: rank 0 did not finish preparing the data within comm.timeout=3 s" in \
        capsys.readouterr().err
