"""shard-train: train a GPT with the sharding engine, configured by Hydra (configs/).

    shard-train                                                   # tiny model, synthetic data, one rank
    mpiexec -n 4 shard-train model=gpt_125m strategy=paro-iig comm=pccl comm.ranks_per_node=2
    shard-train train.resume=true train.out_dir=runs/mine         # continue from the latest checkpoint
    shard-train train.resume=auto train.out_dir=runs/mine         # the newest intact one, or start fresh

A run writes into train.out_dir: config.yaml (the resolved configuration, with the model
as built and the world it ran on), metrics.jsonl, checkpoints/, loss.png, summary.json.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import pccl
from runkit.cpus import available_cores
from runkit.files import write_atomic
from runkit.local_rank import local_rank
from shard.engine import checkpoint
from shard.engine.checkpoint_async import AsyncSaver
from shard.engine.config import EngineConfig, OptimizerConfig, algorithm_for
from shard.engine.engine import Engine
from shard.engine.optimizer import ShardedAdamW, StepResult
from shard.engine.strategy import StrategyError
from shard.models import GPT, GPTConfig, from_pretrained
from shard.planning.planner import PlanError, StrategyPlan, build_engine, label
from shard.planning.predict import Workload
from shard.planning.throughput import Throughput, peak_rss_bytes, peak_tflops
from shard.tools import faults, preflight, run_claim
from shard.tools.lr_schedule import learning_rate
from shard.tools.profiling import StepProfiler
from shard.tools.run_log import RunLog

CONFIGS = preflight.CONFIGS
META_INIT_PARAMS = 10 ** 9    # meta_init=auto builds models above this size on the meta device
RELAUNCH_WAIT_S = 300.0       # a resuming run's wait for its directories (NFSv4 leases: 90 s by default)
FAILED_EXIT_S = 15.0          # a failed rank's exit (its traceback, the shut-down) before it ends unfinished
ConfigError = preflight.ConfigError


def device_type(name: str, cuda_available: Callable[[], bool] = torch.cuda.is_available) -> str:
    """train.device as a device type: auto is cuda where torch sees a GPU (CUDA, or ROCm
    under the same name), else cpu."""
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device must be cpu, cuda or auto, got {name!r}")
    if name == "auto":
        return "cuda" if cuda_available() else "cpu"
    if name == "cuda" and not cuda_available():
        raise ConfigError("train.device=cuda, but torch sees no GPU")
    return name


def cpu_threads(setting: Optional[int], ranks: int, env=os.environ) -> int:
    """torch's CPU threads per rank: train.threads where set, else OMP_NUM_THREADS where the
    user or the launcher set it (torchrun sets 1), else 1 when the job has several ranks,
    else every CPU this process may run on (its affinity: a Slurm job's or a container's
    cores, not the whole node's)."""
    if setting:
        return setting
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given:
        first = given.split(",")[0]   # OpenMP's list form: the outermost level's count
        if not (first.isdigit() and int(first) > 0):
            raise ConfigError(f"OMP_NUM_THREADS must be a positive number of threads, got {given!r}")
        return int(first)
    if ranks > 1:
        return 1
    return available_cores()


def _device(name: str) -> torch.device:
    if device_type(name) == "cuda":
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def comm_transport(transport: str, device: str) -> str:
    """comm.transport with auto resolved for the training device type: torch.distributed's
    NCCL (RCCL on ROCm) with GPUs, gloo on CPUs. mpi, gloo and nccl stay as they are."""
    if transport == "auto":
        return "nccl" if device == "cuda" else "gloo"
    return transport


def check_comm_device(transport: str, carries: tuple, device: str) -> None:
    """Refuse, before any collective, a communicator that cannot carry the training
    device type's tensors (`carries`: the Communicator's `devices`)."""
    if device in carries:
        return
    if transport == "mpi":
        fix = ("pccl's native module was built without GPU kernels: rebuild it on a GPU machine (make GPU=cuda, "
               "docs/gpu.md), or use comm.transport=nccl (or comm=torch)")
    else:
        fix = "use comm.transport=auto (nccl with GPUs, gloo on CPUs)"
    raise ConfigError(f"comm.transport={transport} carries {', '.join(carries)} tensors here, but training runs on "
                      f"{device}; {fix}")


def level_transports(intra: Optional[str], inter: Optional[str], transport: str, device: str) -> dict:
    """comm.intra/comm.inter as Communicator options: as set, except that on GPUs over MPI
    the intra-node level defaults to NCCL (RCCL on ROCm), the PCCL paper's design."""
    if intra is None and transport == "mpi" and device == "cuda":
        intra = "nccl"
    return {k: v for k, v in (("intra", intra), ("inter", inter)) if v is not None}


def _communicator(c, device: torch.device) -> pccl.Communicator:
    transport = comm_transport(c.transport, device.type)
    options = level_transports(c.get("intra"), c.get("inter"), transport, device.type)
    options.update({k: int(c[k]) for k in ("ranks_per_node", "nics_per_node") if c.get(k) is not None})
    # interruptible: auto leaves MPI's blocking collectives out, so a dead peer is named
    # by a timeout instead of ending the job through the watchdog (docs/faults.md)
    try:   # (a transport with no GPU here, nodes that do not divide the world: every rank alike)
        comm = pccl.init(transport, timeout=float(c.timeout), interruptible=True, **options)
    except ValueError as e:
        raise ConfigError(f"comm: {e}") from None
    check_comm_device(transport, tuple(comm.devices), device.type)   # every rank alike, before any collective
    return comm


def check_algorithms(comm: pccl.Communicator, algorithm, device: torch.device) -> None:
    """comm.algorithm resolved on `comm` for `device` tensors, each collective, before any
    runs: a form its transport has not (MPI's nonblocking collective over gloo), or a plan
    it cannot build, is a setting to fix, refused in one line, not a traceback at the first
    forward."""
    for collective in pccl.COLLECTIVES:
        try:
            comm.selector.resolve(collective, algorithm_for(algorithm, collective), 1 << 20, device.type)
        except ValueError as e:
            raise ConfigError(f"comm.algorithm for {collective}: {e}") from None


def _gather(comm: pccl.Communicator, device: torch.device, values: list[float]) -> list[list[float]]:
    """Every rank's `values`, row by rank: one small all-gather however many scalars (the
    logged interval's loss, memory and waits), where a reduction per scalar would be one
    collective each. Collective."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    rows = torch.empty(comm.size, len(values), dtype=torch.float64, device=device)
    comm.all_gather(rows, mine)
    return rows.tolist()


def _max(comm: pccl.Communicator, device: torch.device, values: list[float]) -> list[float]:
    """The largest of each value over the ranks. Collective: every rank calls it, in the
    same order as the other collectives."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    comm.all_reduce(t, op="max")
    return t.tolist()


def check_vocab(cfg: GPTConfig, tokenizer_vocab: int, given: bool = False, pretrained: bool = False) -> None:
    """The tokenizer's ids fit the model's embedding; else what to change, of what applies:
    `given`, a published tokenizer (data.tokenizer, or a Hugging Face model's own), has a
    fixed vocabulary, as `pretrained`, a Hugging Face checkpoint, has."""
    if cfg.vocab >= tokenizer_vocab:
        return
    fix = []
    if not pretrained:
        fix.append(f"set model.vocab >= {tokenizer_vocab}")
    if not given:
        fix.append(f"set data.vocab_size <= {cfg.vocab} (the tokenizer trained on the corpus)")
    if pretrained:
        fix.append("name a tokenizer of at most that many tokens in data.tokenizer")
    raise ConfigError(f"the tokenizer has {tokenizer_vocab} tokens but the model's vocabulary is {cfg.vocab}"
                      + (" (the checkpoint's)" if pretrained else "") + "; " + " or ".join(fix))


def _precision(name: str, device: torch.device) -> str:
    if name == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return name


def global_batch(tokens: Optional[int], accumulation: int, world: int, micro_batch: int,
                 seq_len: int) -> tuple[int, int]:
    """(tokens per optimizer step over all ranks, micro-batches per rank per step).
    tokens=None (train.global_batch_tokens=null): the batch grows with the world, each rank
    running `accumulation` micro-batches per step. A number: the accumulation it needs,
    which must be whole."""
    per_micro = world * micro_batch * seq_len
    if tokens is None:
        if not (isinstance(accumulation, int) and not isinstance(accumulation, bool) and accumulation >= 1):
            raise ConfigError(f"train.accumulation must be an integer >= 1, got {accumulation!r}")
        return per_micro * accumulation, accumulation
    if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1):
        raise ConfigError(f"train.global_batch_tokens must be a positive integer, or null to grow with the world "
                          f"size, got {tokens!r}")
    if tokens % per_micro:
        raise ConfigError(f"train.global_batch_tokens={tokens} is not a multiple of world size x "
                          f"micro_batch x seq_len = {world} x {micro_batch} x {seq_len} = {per_micro}")
    return tokens, tokens // per_micro


def _peak_memory_gb(device: torch.device) -> float:
    """The peak since the last _reset_peak_memory, in GB (10^9 bytes, as its name and the
    log line say): on GPUs the memory torch's tensors held; on CPUs the process's resident
    set (tensors, Python, libraries, the mapped data pages it touched)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return peak_rss_bytes() / 1e9


def _reset_peak_memory(device: torch.device) -> None:
    """Start a new peak at the current use. On CPUs this needs Linux >= 4.0
    (/proc/self/clear_refs); where it fails the CPU figure is the peak since the start."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")   # 5: reset the peak RSS (VmHWM) only
    except OSError:
        pass


def check_same_config(comm: pccl.Communicator, device: torch.device, resolved: dict) -> None:
    """Every rank runs rank 0's configuration (collective): a rank launched with another
    (an override on some nodes only) trained its shard at its own learning rate, silently,
    or waited in other collectives until the timeout. ConfigError on every rank, naming
    what differs. train.out_dir may (a time in its default): rank 0's is every rank's."""
    if comm.size == 1:
        return
    mine = {k: v for k, v in preflight.dotted(resolved).items() if k != "train.out_dir"}
    theirs = comm.broadcast_object(mine)
    differing = sorted(set(mine) ^ set(theirs) | {k for k in set(mine) & set(theirs) if mine[k] != theirs[k]})
    counts = [int(row[0]) for row in _gather(comm, device, [len(differing)])]
    ranks = [r for r, n in enumerate(counts) if n]
    if not ranks:
        return
    # the first such rank's differences, for rank 0's one line
    said = comm.broadcast_object(", ".join(f"{k}={mine.get(k, '(unset)')!r} where rank 0 has "
                                           f"{theirs.get(k, '(unset)')!r}" for k in differing[:4]), root=ranks[0])
    which = f"ranks {', '.join(map(str, ranks[:8]))}{' ...' * (len(ranks) > 8)} differ" if len(ranks) > 1 else \
        f"rank {ranks[0]} differs"
    raise ConfigError(f"the ranks were launched with different configurations: {which} from rank 0; on rank "
                      f"{ranks[0]}: {said}")


def _on_rank_0(comm: pccl.Communicator, what: str, make) -> str:
    """The path `make()` returns on rank 0 (it prepares once; the others read the result),
    resolved, on every rank; its error raised on every rank as a ConfigError."""
    path = ""
    if comm.rank == 0:
        try:
            path = str(Path(make()).resolve())
        except (OSError, ValueError, RuntimeError) as e:   # RuntimeError: sentencepiece's
            path = f"!{type(e).__name__}: {e}"   # a resolved path starts with "/"
    try:
        path = comm.broadcast_object(path)
    except pccl.CollectiveTimeout as e:   # the others wait here: rank 0 may be alive and still working
        if comm.rank == 0:
            raise
        # said here, by this rank (a ConfigError is said by rank 0, which knows nothing of it);
        # status 2: a relaunch as it is would wait as long again
        print(f"shard-train: rank {comm.rank}: rank 0 did not finish {what} within comm.timeout={comm.timeout:g} s "
              "(the others wait for it under that timeout): prepare a corpus this large once beforehand (a one-rank "
              "run into the same data.cache_dir, or shard-data prepare for data=files), or raise comm.timeout; if "
              f"rank 0 failed, its error says why ({e})", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if path.startswith("!"):
        raise ConfigError(f"{what} failed on rank 0: {path[1:]}")
    return path


def _restart_interval(engine: Engine, device: torch.device) -> float:
    """Evaluation and checkpoints are not training: their time, traffic and memory stay
    out of the next interval's throughput, communication and peak-memory figures."""
    engine.comm_report(reset=True)
    _reset_peak_memory(device)
    return time.perf_counter()


def evaluate(engine: Engine, batches: list, device: torch.device) -> float:
    """The summed loss of this rank's counted validation micro-batches (eval_batches'): every
    entry runs, since the forward is collective."""
    total = 0.0
    with torch.no_grad():
        for x, y, counted in batches:
            loss = engine(x.to(device), targets=y.to(device)).item()
            total += loss if counted else 0.0
    return total


@dataclass
class Run:
    """What a run's stages hand on to each other: setup() fills the fields up to
    optimizer_config, the later stages the rest."""
    cfg: Any                            # the Hydra configuration
    resolved: dict                      # cfg resolved, and what was built: config.yaml's content
    device: torch.device
    comm: pccl.Communicator
    out_dir: Path
    accumulation: int                   # micro-batches per rank per step
    model: GPTConfig
    engine_config: EngineConfig
    optimizer_config: OptimizerConfig
    data: Any = None                    # the tokenized corpus (TokenData); None when streamed (data=files)
    tokenizer: str = ""                 # where the tokenizer is: its file, or the prepared corpus's directory
    tokenizer_vocab: int = 0
    batches: Any = None                 # this rank's training micro-batches (Batches, StreamingBatches: resumable)
    data_waited_s: float = 0.0          # the time steps waited for tokens, up to the last record
    held_out: list = field(default_factory=list)   # this rank's validation micro-batches
    engine: Optional[Engine] = None
    optimizer: Optional[ShardedAdamW] = None
    plan: Optional[StrategyPlan] = None   # strategy=auto: the planner's, which the engine follows
    meter: Optional[Throughput] = None
    log: Optional[RunLog] = None
    step: int = 0                       # optimizer steps done
    val_loss: Optional[float] = None    # the latest validation loss
    # the losses of the logged interval open at the resumed checkpoint (each step's mean over ranks)
    open_interval: list = field(default_factory=list)
    faults: dict = field(default_factory=faults.planned)   # injected on purpose (shard/tools/faults.py)
    saver: Optional[AsyncSaver] = None  # train.checkpoint_async: snapshots written in the background
    stalled_s: float = 0.0              # training time the saves since the last record took
    claims: list = field(default_factory=list)   # rank 0's hold on its directories, for the run (run_claim)

    @property
    def checkpoints(self) -> Path:
        """Where the snapshots are (a link to train.checkpoint_dir where that is set)."""
        return self.out_dir / "checkpoints"

    @property
    def global_batch_tokens(self) -> int:
        """Tokens per optimizer step, all ranks."""
        t = self.cfg.train
        return self.comm.size * self.accumulation * t.micro_batch * t.seq_len


def run(cfg) -> dict:
    """Train as `cfg` says, stage by stage; returns the summary rank 0 writes to summary.json."""
    r = setup(cfg)
    load_data(r)
    make_engine(r)
    start_log(r, resume(r))
    train_loop(r)
    return finish(r)


def setup(cfg) -> Run:
    """Check the configuration, pick the device, connect the ranks and agree on the output
    directory."""
    from omegaconf import OmegaConf

    resolved = OmegaConf.to_container(cfg, resolve=True)
    t = cfg.train
    mcfg = preflight.check(resolved)   # every key, before anything starts
    resolved["optim"].update(preflight.learning_rates(resolved))   # null: the preset's rate, as config.yaml says
    device = _device(t.device)
    settings = preflight.engine_config(resolved, _precision(t.precision, device))
    optimizer = preflight.optimizer_config(resolved)
    comm = _communicator(cfg.comm, device)
    check_algorithms(comm, settings.algorithm, device)
    check_same_config(comm, device, resolved)
    # every rank fails alike, before any collective
    _, accumulation = global_batch(t.global_batch_tokens, t.accumulation, comm.size, t.micro_batch, t.seq_len)
    torch.set_num_threads(cpu_threads(t.threads, comm.size))
    torch.manual_seed(t.seed)
    out_dir = Path(comm.broadcast_object(str(Path(str(t.out_dir)).resolve())))
    checkpoints = Path(comm.broadcast_object(str(Path(str(t.checkpoint_dir)).resolve()) if t.checkpoint_dir else ""))
    problem, claims = "", []
    if comm.rank == 0:   # rank 0 writes the run's files: it checks, and every rank hears the outcome
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(out_dir / ".writable", b"")
            (out_dir / ".writable").unlink()
        except OSError as e:
            problem = f"train.out_dir={out_dir} cannot be written (on rank 0: {e})"
        patience = relaunch_patience(t.resume, float(cfg.comm.timeout))
        if not problem:
            problem, claims = claim_directory("train.out_dir", out_dir, patience)
        if t.checkpoint_dir and not problem:
            problem = link_checkpoints(out_dir / "checkpoints", checkpoints)
        if t.checkpoint_dir and not problem:
            problem, more = claim_directory("train.checkpoint_dir", checkpoints, patience)
            claims += more
        if not t.resume and not problem:
            problem = earlier_run(out_dir)
    problem = comm.broadcast_object(problem)
    if problem:
        raise ConfigError(problem)
    check_shared(comm, device, checkpoints if t.checkpoint_dir else out_dir,
                 "train.checkpoint_dir" if t.checkpoint_dir else "train.out_dir")
    resolved["train"]["out_dir"] = str(out_dir)
    return Run(cfg, resolved, device, comm, out_dir, accumulation, mcfg, settings, optimizer, claims=claims)


def relaunch_patience(resume, comm_timeout: float) -> float:
    """How long rank 0 waits for another process to let go of the run's directories: a run
    that resumes (a relaunch, a requeued job) up to RELAUNCH_WAIT_S, within half the
    communicator's timeout (the other ranks wait for it in a collective); a fresh one not
    at all (two runs started in the same second)."""
    return min(RELAUNCH_WAIT_S, comm_timeout / 2) if resume in (True, "auto") else 0.0


def claim_directory(key: str, directory: Path, patience: float = 0.0) -> tuple[str, list]:
    """Rank 0: hold `directory` for the run (shard/tools/run_claim.py), waiting up to
    `patience` seconds for another holder to let go; (what went wrong or "", the claims to
    keep)."""
    def waiting(holder: str) -> None:
        print(f"shard-train: {key}: {holder}; waiting up to {patience:.0f} s for it to let go (a relaunch: the "
              "lock of a lost node lasts until the file server notices)", file=sys.stderr, flush=True)
    try:
        held = run_claim.claim(directory, patience, waiting)
    except run_claim.Claimed as e:
        return (f"{key}: {e}; give this run a directory of its own (runs started in the same second share "
                "the default out_dir: set train.out_dir)"), []
    except OSError as e:
        return f"{key}={directory} cannot be written (on rank 0: {e})", []
    return "", [held] if held is not None else []


def earlier_run(out_dir: Path) -> str:
    """A fresh start (train.resume=false) in a directory that holds a run is refused: its
    saves would replace that run's snapshots (retention deletes them) and its log that
    run's metrics. What is there, or ""."""
    found = checkpoint.snapshots(out_dir / "checkpoints")
    logged = out_dir / "metrics.jsonl"
    if not found and not (logged.is_file() and logged.stat().st_size):
        return ""
    names = ", ".join(s.name for s in found[:2]) + ", ..." * (len(found) > 2)
    what = f"snapshots ({names})" if found else "metrics.jsonl"
    return (f"train.out_dir={out_dir} holds an earlier run's {what}, which a fresh start would replace: continue "
            "it with train.resume=true (or auto), or give this run another directory")


def check_shared(comm: pccl.Communicator, device: torch.device, directory: Path, key: str) -> None:
    """Every rank sees the files rank 0 writes in `directory` (collective): a snapshot's
    manifest lists every rank's files, and rank 0 commits once it sees them. A node-local
    directory on several nodes is refused here, not found out at the first save."""
    if comm.size == 1:
        return
    probe = directory / f".shared-{os.getpid()}-{int(time.time() * 1e6)}"
    name = comm.broadcast_object(probe.name)
    if comm.rank == 0:
        write_atomic(probe, b"")
    comm.barrier()
    unseen, = _max(comm, device, [0.0 if (directory / name).is_file() else 1.0])
    comm.barrier()
    if comm.rank == 0:
        probe.unlink()
    if unseen:
        raise ConfigError(f"{key}={directory} is not one filesystem for every rank: some ranks do not see the files "
                          "rank 0 writes there, and snapshots need them to (a shared filesystem, not a node-local "
                          "disk)")


def link_checkpoints(link: Path, target: Path) -> str:
    """Make `link` (out_dir/checkpoints) a symbolic link to `target` (train.checkpoint_dir),
    so that resuming, shard-export and shard-generate find a run's snapshots in its
    directory; what went wrong, or ""."""
    try:
        target.mkdir(parents=True, exist_ok=True)
        write_atomic(target / ".writable", b"")
        (target / ".writable").unlink()
        if link.is_symlink() and link.resolve() == target:
            return ""
        if link.exists() or link.is_symlink():
            return (f"train.checkpoint_dir={target}: {link} already exists and is not a link to it (it holds this "
                    "run's earlier snapshots: move them there and make it a link to it, or leave "
                    "train.checkpoint_dir unset)")
        if (target / "LATEST").exists() or checkpoint.snapshots(target):
            # its first commit would delete them as stale, and their run's link would lead to this run's
            return (f"train.checkpoint_dir={target} holds another run's snapshots ({link} does not link to it): "
                    "give each run a directory of its own")
        link.symlink_to(target, target_is_directory=True)
    except OSError as e:
        return f"train.checkpoint_dir={target} cannot be written (on rank 0: {e})"
    return ""


def load_data(r: Run) -> None:
    """The corpus (tokenized by rank 0, once: cached; or data=files: streamed), this rank's
    training batches and its held-out batches."""
    from shard.data import Batches, TokenData, eval_batches, prepare

    t = r.cfg.train
    if r.faults:
        faults.kill_if_planned(r.faults, "kill-data", 0, r.comm.rank, r.out_dir)
    model_dir = r.cfg.model.path if r.cfg.model.preset == "hf" else None
    if r.cfg.data.source == "files" or (r.cfg.data.source == "hf" and r.cfg.data.get("streaming")):
        r.batches = _stream_data(r, model_dir)
        r.tokenizer, r.tokenizer_vocab = r.batches.corpus.tokenizer, r.batches.tokenizer.vocab_size
        held_out = r.batches.validation()
    else:   # rank 0 tokenizes, once (cached)
        spec = preflight.data_spec(r.cfg.data, r.model.vocab, model_dir)
        r.data = TokenData(_on_rank_0(r.comm, "preparing the data", lambda: prepare(spec, r.cfg.data.cache_dir)))
        r.tokenizer, r.tokenizer_vocab, held_out = str(r.data.directory), r.data.vocab_size, r.data.val
        try:   # a batch the corpus cannot fill: the same on every rank
            r.batches = Batches(r.data.train, t.seq_len, t.micro_batch, r.accumulation, r.comm.rank, r.comm.size,
                                t.seed, corpus=r.data.directory.name)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    check_vocab(r.model, r.tokenizer_vocab, given=bool(r.cfg.data.get("tokenizer") or model_dir),
                pretrained=model_dir is not None)
    try:
        r.held_out = eval_batches(held_out, t.seq_len, t.micro_batch, r.comm.rank, r.comm.size, t.eval_batches)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _stream_data(r: Run, model_dir: Optional[str]):
    """data=files (or data=hf streaming=true): the streamed batches of this rank
    (shard/data/stream.py), with the tokenizer data.tokenizer names, else the Hugging Face
    model's own, else one rank 0 trains on a sample of the corpus (cached)."""
    from shard.data import Corpus, StreamingBatches
    from shard.data.prepare import prepare_tokenizer
    from shard.data.spec import normalize

    t = r.cfg.train
    try:
        spec = normalize(preflight.data_spec(r.cfg.data, r.model.vocab, model_dir))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    path = _on_rank_0(r.comm, "preparing the tokenizer", lambda: prepare_tokenizer(spec, r.cfg.data.cache_dir))
    try:
        return StreamingBatches(Corpus.of(spec, path), t.seq_len, t.micro_batch, r.accumulation, r.comm.rank,
                                r.comm.size, t.seed, spec["streams"], spec["workers"])
    except (OSError, ValueError) as e:
        raise ConfigError(f"data=files: {e}") from None


def make_engine(r: Run) -> None:
    """The model (on the meta device when model.meta_init says so, materialized shard by
    shard by the engine) in the engine, and the optimizer beside it; what was built goes
    into config.yaml."""
    meta = r.cfg.model.meta_init
    meta = r.model.num_params() > META_INIT_PARAMS if meta == "auto" else bool(meta)
    if r.cfg.model.preset == "hf":   # each parameter read from the files as the engine materializes its unit
        model = from_pretrained(r.cfg.model.path, "meta" if meta else r.device, r.model)
    else:
        with torch.device("meta" if meta else r.device):
            model = GPT(r.model, seed=r.cfg.train.seed)
    auto = r.engine_config.strategy == "auto"
    workload = Workload(r.cfg.train.seq_len, r.cfg.train.micro_batch, r.accumulation) if auto else None
    try:
        r.engine, r.plan = build_engine(model, r.comm, r.engine_config, workload=workload,
                                        device=r.device if meta else None)
    except StrategyError as e:   # a strategy that does not fit this world (a group size): every rank alike
        raise ConfigError(f"strategy.{'name' if e.field == 'strategy' else e.field}: {e}") from None
    except PlanError as e:   # strategy=auto: nothing fits (every rank alike: the plan is computed alike)
        raise ConfigError(f"strategy=auto: {e}") from None
    r.optimizer = ShardedAdamW(r.engine, r.optimizer_config)
    if r.cfg.train.checkpoint_async:
        r.saver = AsyncSaver(r.engine, r.checkpoints, keep=r.cfg.train.keep_checkpoints)
    if r.plan is not None:   # the planner's choice, kept with the run, and its table for whoever asks why
        r.resolved["strategy"].update(chosen=r.engine.strategy.name, chosen_group_size=r.engine.layout.group)
        if r.comm.rank == 0:
            write_atomic(r.out_dir / "plan.json", json.dumps(r.plan.to_json(), indent=1, default=str))
    r.resolved["built"] = {"model": asdict(r.model), "num_params": r.model.num_params(), "world": r.comm.size,
                           "ranks_per_node": r.comm.topology.ranks_per_node, "accumulation": r.accumulation,
                           "global_batch_tokens": r.global_batch_tokens, "precision": r.engine_config.precision,
                           "device": str(r.device), "cpu_threads": torch.get_num_threads(), "meta_init": meta,
                           "tokenizer_vocab": r.tokenizer_vocab, "tokenizer": r.tokenizer,
                           "data": r.tokenizer if r.data is None else str(r.data.directory)}


def resume(r: Run) -> str:
    """Continue from a checkpoint if train.resume asks to (true: the latest, verified, which
    must be there; auto: the newest intact one, or a fresh start); how the run starts, in
    words."""
    mode = r.cfg.train.resume
    if not mode:
        return "a fresh start"
    found = checkpoint.snapshots(r.checkpoints)
    committed = [s for s in found if checkpoint.committed(s)]
    if mode == "auto" and not committed:   # none, or only saves cut short before their manifest
        cut = f"; {len(found)} snapshot(s) never completed ({found[0].name}, ...)" if found else ""
        return f"a fresh start: train.resume=auto, and {r.checkpoints} holds no complete checkpoint{cut}"
    if not found:   # a mistyped out_dir would otherwise train again from scratch, unnoticed
        raise ConfigError(f"train.resume=true, but {r.checkpoints} holds no checkpoint to continue from; "
                          "train.resume=auto starts fresh where there is none")
    try:
        restored = checkpoint.load(r.engine, r.optimizer, r.checkpoints, fallback=mode == "auto")
    except checkpoint.CheckpointError as e:   # every rank alike: damaged snapshots, or another model's
        raise ConfigError(f"train.resume={str(mode).lower()}: {e}") from None
    changed = model_changes(restored.extra.get("config"), asdict(r.model))
    if changed:
        raise ConfigError(f"resuming from {restored.snapshot.name}: the model differs from the one trained there "
                          f"({changed}): its weights would compute another function")
    r.step = restored.extra["step"]
    r.open_interval = restored.extra.get("open_interval", [])   # (not in snapshots of earlier versions)
    try:
        r.batches.load_state_dict(restored.extra["data"])
    except ValueError as e:
        raise ConfigError(f"resuming from {restored.snapshot.name}: {e}") from None
    skipped = "".join(f"; skipped {why}" for why in restored.skipped)
    done = f"; train.steps={r.cfg.train.steps}: nothing left to train" if r.step >= r.cfg.train.steps else ""
    return f"resumed at step {r.step} from {restored.snapshot.name}{skipped}{done}"


def model_changes(saved: Optional[dict], now: dict) -> str:
    """The model settings that differ from a snapshot's, in words ("" where none, or where the
    snapshot holds none). The context may change (the learned positions' shape is checked
    with the weights; rotary positions extend); every other setting defines the function."""
    if not saved:
        return ""
    keys = sorted(k for k in set(saved) | set(now) if k != "context" and saved.get(k) != now.get(k))
    return ", ".join(f"model.{k}={now.get(k)!r} where the snapshot has {saved.get(k)!r}" for k in keys)


def start_log(r: Run, resumed: str) -> None:
    """config.yaml, the throughput meter, and the run log with its opening line."""
    from omegaconf import OmegaConf

    t, precision = r.cfg.train, r.engine_config.precision
    if r.comm.rank == 0:
        write_atomic(r.out_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(r.resolved)))
    peak, peak_source = peak_tflops(r.device, precision) if t.peak_tflops is None else (float(t.peak_tflops), "given")
    r.meter = Throughput(r.model.flops_per_token(t.seq_len), r.comm.size, peak)
    r.log = RunLog(r.out_dir, r.comm.rank == 0, t.steps, r.step, r.cfg.log.progress, r.resolved["log"]["wandb"],
                   r.resolved)
    threads = torch.get_num_threads()
    r.log.write(f"{r.model.num_params() / 1e6:.1f}M parameters, {r.meter.flops_per_token / 1e9:.3f} GFLOP/token; "
                f"{r.comm.size} ranks ({r.comm.topology.ranks_per_node} per node), strategy "
                f"{r.engine.strategy.name}, comm {r.cfg.comm.name} ({r.cfg.comm.algorithm}), {precision} on "
                f"{r.device} ({threads} CPU thread{'s' * (threads > 1)} per rank); {r.accumulation} micro-batches of "
                f"{t.micro_batch}x{t.seq_len} per rank per step ({r.global_batch_tokens} tokens); "
                f"peak: {peak_source}; {resumed}; out: {r.out_dir}")
    warmup = r.resolved["optim"]["warmup_steps"]
    if warmup >= t.steps:   # (the schedule is as documented; the run may not be what was meant)
        r.log.write(f"note: optim.warmup_steps={warmup} is not below train.steps={t.steps}: the learning rate "
                    "rises for the whole run and never decays")
    plan = r.plan
    if plan is not None:
        other = plan.runner_up
        r.log.write(f"strategy=auto ({plan.objective}) chose {label(plan.chosen)}"
                    + (f"; runner-up {label(other)}, predicted margin {plan.margin():.1%}" if other else "")
                    + f". {plan.reason()} (plan.json has every candidate)")


def train_loop(r: Run) -> None:
    """Optimizer steps up to train.steps: a metrics record every log.interval steps, the
    validation loss and checkpoints when due.

    The session's first step compiles, allocates and measures (self-calibration at new
    sizes): it is timed apart (warmup_s in the next record), so each logged interval's
    throughput and communication are its other steps' own (its loss and peak memory take
    in every step). A first step that is logged at once is its own interval, marked
    "warmup": true. Steps log.profile traces (shard/tools/profiling.py) mark their
    intervals "profiled": true."""
    window = r.cfg.log.profile
    profiler = StepProfiler(window.start, window.steps, r.step, r.cfg.train.steps, r.out_dir / "profile",
                            r.comm.rank, r.device, r.log.write) if window.steps else None
    try:
        _train_steps(r, profiler)
    finally:   # a run that fails inside the window still writes what was traced
        if profiler is not None:
            profiler.close()


def _train_steps(r: Run, profiler: Optional[StepProfiler]) -> None:
    t = r.cfg.train
    losses = [torch.tensor(v, dtype=torch.float64, device=r.device) for v in r.open_interval]   # (train_step's)
    started, unread = _restart_interval(r.engine, r.device), []
    first, warmup_s, timed = True, None, 0   # timed: the steps since `started`
    profiled = False   # whether the open interval has steps that ran under the profiler
    while r.step < t.steps:
        with profiler.step(r.step + 1) if profiler is not None else nullcontext():
            result, loss = train_step(r)
        profiled = profiled or (profiler is not None and profiler.slows(r.step))
        unread.append((r.step, result, loss))
        losses.append(loss)
        timed += 1
        r.log.step()
        evaluate_now = r.step == t.steps or (t.eval_interval and r.step % t.eval_interval == 0)
        log_now = r.step % r.cfg.log.interval == 0 or evaluate_now
        save_now = r.step == t.steps or (t.checkpoint_interval and r.step % t.checkpoint_interval == 0)
        warming, first = first, False
        if warming and not log_now:   # (a checkpoint due at once is saved after it, as at any step)
            loss.item()   # waits for the step, as log_interval's reading of the losses does
            warmup_s = time.perf_counter() - started
            r.log.write(f"step {r.step:>6}  warm-up {warmup_s:.2f} s (compilation, first allocations and "
                        "measurements): timed apart from the intervals"
                        + ("; under the profiler, so not the warm-up's own time" if profiled else ""))
            r.engine.comm_report(reset=True)
            started, timed = time.perf_counter(), 0
            if profiled:   # its time is the profiler's start too: no warm-up figure, and the interval's steps its own
                warmup_s, profiled = None, False
            if not save_now:
                continue
        if log_now or save_now:   # the steps' results are read here, not after each step: reading waits
            check_skipped(r, unread)
            unread = []
        if log_now:
            log_interval(r, result, losses, (started, timed), evaluate_now, warming, warmup_s, profiled)
            losses, started, timed, warmup_s = [], _restart_interval(r.engine, r.device), 0, None
            profiled = False
        if save_now:
            save_checkpoint(r, losses)
            started, timed = _restart_interval(r.engine, r.device), 0


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite losses, too many skipped steps)."""


def check_skipped(r: Run, unread: list[tuple[int, StepResult, torch.Tensor]]) -> None:
    """For each step the engine skipped among `unread` (step, result, mean loss), in order
    (non-finite gradients, alike on every rank): stop on a non-finite loss on any rank, or
    past train.max_skipped_steps; every rank decides alike (collective)."""
    skipped = [(step, loss) for step, result, loss in unread if result.skipped]
    before = r.optimizer.skipped_steps - len(skipped) if skipped else 0
    def again() -> str:
        last = checkpoint.latest(r.checkpoints).name if (r.checkpoints / "LATEST").is_file() else "none yet"
        return f"the last good snapshot is {last} (train.resume=auto continues from it)"

    limit = r.cfg.train.max_skipped_steps
    for count, (step, loss) in enumerate(skipped, before + 1):
        bad_loss, = _max(r.comm, r.device, [0.0 if math.isfinite(loss.item()) else 1.0])
        if bad_loss:
            raise TrainingError(f"non-finite loss at step {step} ({r.engine_config.precision} training): stopping; "
                                f"{again()}")
        if limit is not None and count > limit:
            raise TrainingError(f"{count} steps skipped for non-finite gradients (the latest: step {step}), more "
                                f"than train.max_skipped_steps={limit}: stopping; {again()}")
        if r.comm.rank == 0:
            print(f"step {step}: skipped (non-finite gradients; {count} so far)", file=sys.stderr, flush=True)


def train_step(r: Run) -> tuple[StepResult, torch.Tensor]:
    """One optimizer step over this rank's micro-batches; its result and mean loss (on the
    device, not synchronized)."""
    t, o = r.cfg.train, r.resolved["optim"]   # its rates filled in (setup)
    r.optimizer.lr = learning_rate(r.step, o["lr"], o["min_lr"], o["warmup_steps"], o["decay_steps"], t.steps)
    loss_sum = torch.zeros((), dtype=torch.float64, device=r.device)
    if r.faults:
        faults.kill_if_planned(r.faults, "kill", r.step + 1, r.comm.rank, r.out_dir)
        faults.stop_if_planned(r.faults, r.step + 1, r.comm.rank)
        faults.raise_if_planned(r.faults, r.step + 1, r.comm.rank)
    for x, y in r.batches.next_step():
        x, y = x.to(r.device, non_blocking=True), y.to(r.device, non_blocking=True)
        loss = r.engine(x, targets=y)
        if r.faults:
            loss = faults.loss(loss, r.faults, r.step + 1, r.comm.rank)
        r.engine.backward(loss)
        if r.faults:
            faults.kill_if_planned(r.faults, "kill-backward", r.step + 1, r.comm.rank, r.out_dir)
        loss_sum += loss.detach()
    result = r.optimizer.step()
    r.step += 1
    return result, loss_sum / r.accumulation


def log_interval(r: Run, result: StepResult, losses: list[torch.Tensor], timing: tuple[float, int],
                 evaluate_now: bool, warmup: bool = False, warmup_s: Optional[float] = None,
                 profiled: bool = False) -> None:
    """The record of the interval's steps (their mean `losses`): loss (mean over ranks),
    throughput and communication of the last of them, timing = (when they started, how
    many: a warm-up or a checkpoint may come between), peak memory in the interval (the
    largest rank's), and the validation loss when due; `warmup`: the steps are the
    session's first (its throughput is not the training's); `warmup_s`: the first step's
    time, taken apart; `profiled`: some of them ran under the profiler (log.profile), which
    slows them."""
    local_loss = torch.stack(losses).mean().item()   # synchronizes the device
    started, steps = timing
    elapsed = time.perf_counter() - started
    report = r.engine.comm_report(reset=True)
    rows = _gather(r.comm, r.device, [local_loss, _peak_memory_gb(r.device), report["longest_wait_s"],
                                      report["exposed_s"]])
    loss, peak_memory, longest, exposed = (list(column) for column in zip(*rows))
    record = {"step": r.step, "loss": sum(loss) / len(loss), "lr": r.optimizer.lr, "grad_norm": result.grad_norm,
              **r.meter.measure(r.global_batch_tokens * steps, elapsed),
              "exposed_comm_s": report["exposed_s"] / steps, "comm_busy_s": sum(report["busy_s"].values()) / steps,
              "other_waits_s": report["other_waits_s"] / steps,
              "longest_other_wait": report["longest_other_wait"] if report["other_waits_s"] else None,
              "step_time_s": elapsed / steps, "peak_memory_gb": max(peak_memory),
              "skipped": result.skipped, "skipped_steps": r.optimizer.skipped_steps, "loss_scale": result.loss_scale,
              "epoch": r.batches.epoch, "straggler": find_straggler(r, report, longest, exposed),
              "warmup": warmup, "warmup_s": warmup_s, "profiled": profiled, "checkpoint_stall_s": r.stalled_s,
              "data_wait_s": r.batches.waited_s - r.data_waited_s}
    r.stalled_s, r.data_waited_s = 0.0, r.batches.waited_s
    if evaluate_now:
        r.val_loss = validate(r)
        record["val_loss"] = r.val_loss
    r.log.log(record)


def find_straggler(r: Run, report: dict, longest: list[float], exposed: list[float]) -> Optional[dict]:
    """When some rank waited train.straggler_seconds or longer for one operation in the
    interval (`longest`: each rank's longest wait, `exposed`: its waits in all, as
    log_interval gathers them): {"rank": the straggler, the rank that waited least in all
    (the others waited for it), "waiter": the rank that waited longest, "operation": what
    it waited for, "wait_s"}; else None. Collective only then (rank `waiter` names the
    operation)."""
    limit, n = r.cfg.train.straggler_seconds, r.comm.size
    if not limit or n == 1:
        return None
    waiter = max(range(n), key=longest.__getitem__)
    if longest[waiter] < limit:
        return None
    operation = r.comm.broadcast_object(report["longest_wait"], root=waiter)
    return {"rank": min(range(n), key=exposed.__getitem__), "waiter": waiter, "operation": operation,
            "wait_s": round(longest[waiter], 3)}


def validate(r: Run) -> float:
    """The held-out loss: the mean over the validation set's micro-batches, which the ranks
    share out (the same set on any number of ranks)."""
    total = torch.tensor([evaluate(r.engine, r.held_out, r.device)], dtype=torch.float64, device=r.device)
    r.comm.all_reduce(total, op="sum")
    return total.item() / r.cfg.train.eval_batches


def save_checkpoint(r: Run, losses: list) -> None:
    """The engine's and the optimizer's state with the step and the data position, to
    resume from: written before training goes on, or with train.checkpoint_async handed to
    the background writer (its time, the stall, is added to stalled_s). `losses`: the
    steps' of the logged interval still open, kept so that a resumed run logs the record
    an uninterrupted one does (each step's mean over ranks: what the record averages)."""
    started, step = time.perf_counter(), r.step   # the saved step: an async writer runs on as r.step moves
    injected = (lambda: faults.kill_if_planned(r.faults, "kill-save", step, r.comm.rank, r.out_dir)) \
        if r.faults else None
    rows = _gather(r.comm, r.device, [x.item() for x in losses]) if losses else []
    extra = {"step": r.step, "data": data_position(r), "model": r.resolved["model"],
             "config": asdict(r.model), "strategy": r.resolved["strategy"],
             "open_interval": [sum(column) / len(column) for column in zip(*rows)]}
    if r.saver is not None:
        r.saver.save(r.optimizer, extra=extra, written=injected)
    else:
        checkpoint.save(r.engine, r.optimizer, r.checkpoints, extra=extra, keep=r.cfg.train.keep_checkpoints,
                        written=injected)
    r.stalled_s += time.perf_counter() - started


def data_position(r: Run) -> dict:
    """The batches' position, to resume from: a streamed corpus's with every rank's streams
    (one all-gather of their few integers each). Collective."""
    state = r.batches.state_dict()
    if r.data is not None:   # the memmap batches' position is the same on every rank
        return state
    mine = [[int(s), *v] for s, v in state["positions"].items()]
    rows = _gather(r.comm, r.device, [v for row in mine for v in row])
    width = len(mine[0])
    state["positions"] = {str(int(row[i])): [int(v) for v in row[i + 1:i + width]]
                          for row in rows for i in range(0, len(row), width)}
    return state


def finish(r: Run) -> dict:
    """summary.json and the loss plot; the engine's threads stopped. Returns the summary."""
    if r.saver is not None:   # the last snapshot committed before the run says it is done
        r.saver.wait()
    summary = summarize(r.log.records, r.val_loss, r.resolved["built"])
    summary["self_calibration"], line = auto_basis(r.comm)
    r.log.write(line)
    if r.comm.rank == 0:
        write_atomic(r.out_dir / "summary.json", json.dumps(summary, indent=1))
    r.log.close(r.out_dir / "loss.png" if r.cfg.log.plot else None)
    r.batches.close()
    r.engine.close()
    return summary


def auto_basis(comm: pccl.Communicator) -> tuple[dict, str]:
    """What the run's algorithm="auto" decided with: the self-calibration of every
    communicator shape it used (the world's and the engine's groups), read from the cache
    or measured in this run, with the seconds that took ({} where none measures itself);
    and a line saying so."""
    from pccl.tuning import self_calibration

    ledger = self_calibration.ledger()
    if not ledger:
        return {}, f"auto: {self_calibration.basis(comm)}"
    figures = {"shapes": len(ledger), "measured": sum(s > 0 for s in ledger.values()),
               "measured_s": sum(ledger.values()), "cache": str(next(iter(ledger)).parent)}
    return figures, (f"auto: the self-calibration of {figures['shapes']} communicator shape(s) in {figures['cache']}: "
                     f"{figures['measured']} measured in this run ({figures['measured_s']:.1f} s), "
                     f"{figures['shapes'] - figures['measured']} read")


def summarize(records: list[dict], val_loss: Optional[float], built: dict) -> dict:
    """Final losses, and throughput as the median over the logged intervals that hold
    neither a session's first step nor steps under the profiler (all of them, where no
    other was logged); the time of the latest warm-up not taken under the profiler. The
    validation loss is the latest logged, by this session or an earlier one (a relaunch
    that resumes a finished run validates nothing), else `val_loss` (ranks that log no
    records)."""
    import statistics

    val_loss = next((r["val_loss"] for r in reversed(records) if r.get("val_loss") is not None), val_loss)

    timed = [r for r in records if not r.get("warmup") and not r.get("profiled")] or records
    # a warm-up logged at once (log.interval=1) is its record's one step (not under the profiler:
    # its time is then the profiler's start too)
    warmups = [r["step_time_s"] if r.get("warmup") else r["warmup_s"] for r in records
               if (r.get("warmup") and not r.get("profiled")) or r.get("warmup_s") is not None]

    def median(key: str) -> Optional[float]:
        return statistics.median(r[key] for r in timed) if timed and timed[0][key] is not None else None
    return {"final_loss": records[-1]["loss"] if records else None, "val_loss": val_loss,
            "tokens_per_s": median("tokens_per_s"), "tokens_per_s_per_rank": median("tokens_per_s_per_rank"),
            "tflops_per_rank": median("tflops_per_rank"), "mfu": median("mfu"),
            "exposed_comm_s": median("exposed_comm_s"), "step_time_s": median("step_time_s"),
            "warmup_s": warmups[-1] if warmups else None, **built}


def launcher_rank() -> int:
    """This process's rank as its launcher numbered it (mpiexec, torchrun, srun), known
    before any communicator exists; 0 for a process launched alone."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def refused(e: ConfigError) -> SystemExit:
    """The user's mistake, not the program's: one line (every rank fails alike: the first
    says it) and the exit status of bad usage."""
    if launcher_rank() == 0:
        print(f"shard-train: {e}", file=sys.stderr, flush=True)
    return SystemExit(2)


def main() -> None:
    import hydra

    def task(cfg) -> None:
        try:
            run(cfg)
        except ConfigError as e:   # every rank alike
            raise refused(e) from None
        except BaseException:   # maybe this rank alone (a bug, Ctrl-C): the others wait for it
            pccl.exit_within(FAILED_EXIT_S)
            raise
    try:
        preflight.check_choices(sys.argv[1:])
        preflight.check_overrides(sys.argv[1:])
    except ConfigError as e:
        raise refused(e) from None
    hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="config")(task)()


if __name__ == "__main__":
    main()
