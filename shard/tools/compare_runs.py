"""The runs shard-compare puts side by side, one class per framework behind one interface,
and the one parser of their names (parse_run). shard/tools/compare.py's worker seeds the
model, feeds the batches, times the steps and builds the row; a Run only sets its framework
up, steps it and reports what only it can measure. A new kind of run (on GPUs, under
torch.compile, ...) is a new class here and a name in parse_run.

Heavy imports (torch, deepspeed, pccl.distributed) stay inside the methods, so that
shard-compare --help and the process that starts the launches do not load the frameworks.
"""
from __future__ import annotations

import math
import os
from typing import Optional

from runkit.args import refuse

COMMS = {"native": "native", "pccl": "auto", "hierarchical": "hierarchical", "ho_ring": "ho_ring"}
BETAS, EPS = (0.9, 0.95), 1e-8   # the learning rate changes every step: shard/tools/compare.py's schedule
# The agreement check (agreement()): at every step, |loss - reference loss| may be a
# tolerance times (|reference loss| + MOVEMENT x how far the reference's loss has moved
# from its first step). Runs doing the same math differ only by rounding, which enters a
# loss two ways: the forward pass rounds the loss itself (the first term), and every
# update's rounding leaves the weights a little off the reference's, a drift that grows as
# training moves them (the second). A real divergence is a share of the movement itself.
# Measured against fp32 eager (tiny, batch 4 x 128, 10 steps, CPU; the largest gap over
# the steps, relative to the loss / to how far it had moved):
#   fp64 (rounding alone)                          1.5e-7 / 1.5e-6
#   bf16 autocast                                  1.4e-4 / 9.5e-4
#   the engine, FSDP2 in bf16 against eager bf16   3.1e-4 / 2.4e-3   (9 steps)
#   codecs int8, zfp:8 against zero3-pccl          1.8e-4 / 1.5e-3, 1.1e-3 / 1.1e-2   (2 ranks, 9 steps)
#   the gradient's norm clipped at 1               3.4e-3 / 2.0e-2
#   learning rate x1.1, x1.5, x2                   8.2e-3 / 6.0e-2, 3.0e-2 / 0.24, 6.0e-2 / 0.57
#   the last block's gradients lost                5.5e-3 / 0.16
# fp32's tolerance flags every divergence there; bf16's the rate x1.5 and x2 and the lost
# gradients; the compressed runs' the rate x2 and a run that does not train. (bf16 runs
# were held to 2% of the loss before, which flagged the rates x1.5 and x2 only.)
#
# Runs doing the same math in fp32 differ only in the order of sums and in AdamW's
# arithmetic.
LOSS_TOLERANCE = 1e-4
# bf16 runs round differently in each framework (autocast keeps fp32 weights and
# residuals, the engine and FSDP2 compute with bf16 copies): one bf16 rounding, 2**-8.
BF16_LOSS_TOLERANCE = 2 ** -8
# A run whose parameters and gradients travel compressed (STRATEGY-COMM+CODEC) does other
# math on purpose: 2% (issue 17's target).
COMPRESSED_LOSS_TOLERANCE = 0.02
# The drift's weight: bf16 runs may drift 3.9% of the movement, 16x the most measured,
# fp32 runs 0.1%, below the least divergence measured (2%).
MOVEMENT = 10
STATE_PARTS = ("parameters", "gradients", "optimizer")   # model-state bytes per rank, as the engine reports them


class Run:
    """One framework's training of the shared model on this launch's ranks."""

    name: str

    def unavailable(self, args) -> str:
        """Why this run cannot run here with shard-compare's `args` ("" when it can); asked
        before launching."""
        return ""

    def set_up(self, model, world, args) -> None:
        """The framework's model and optimizer around `model` (the same initial weights on
        every run); `world` is the launch's MPI communicator, `args` shard-compare's."""
        raise NotImplementedError

    def step(self, micro_batches, lr: float):
        """One optimizer step at learning rate `lr` over the step's micro-batches; this
        rank's mean loss (a tensor on the device: reading it waits for the step)."""
        raise NotImplementedError

    def reset(self) -> None:
        """The warm-up is over: what report() counts starts again from zero."""

    def report(self, timed_steps: int) -> dict:
        """This rank's run-specific fields of the row, per timed step: exposed_comm_s and
        sent_bytes_per_rank (None where not measured), then any fields only this run has."""
        raise NotImplementedError

    def full_state(self) -> Optional[dict]:
        """The trained model's full state dict on rank 0, None elsewhere. Collective."""
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to release so far: each run has its own launch, which ends with it."""


def device_of(args):
    """This rank's device: its GPU (local rank modulo the GPUs here) with --device cuda."""
    import torch

    if args.device != "cuda":
        return torch.device("cpu")
    from runkit.local_rank import local_rank

    torch.cuda.set_device(local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def autocast(args):
    """Plain PyTorch's mixed precision: fp32 weights, matrix products in bf16."""
    import torch

    device = "cuda" if args.device == "cuda" else "cpu"
    return torch.autocast(device, dtype=torch.bfloat16, enabled=args.precision == "bf16")


class EagerRun(Run):
    """Plain PyTorch on one rank: the model in fp32 on the device, torch.autocast in bf16
    runs, AdamW(fused=True); `compiled`: torch.compile(model). The baseline a user moves
    from."""

    def __init__(self, compiled: bool) -> None:
        self.compiled = compiled
        self.name = "eager-compile" if compiled else "eager"

    def unavailable(self, args) -> str:
        return "" if args.ranks == 1 else "plain PyTorch trains on one rank: run it with --ranks 1"

    def set_up(self, model, world, args) -> None:
        import torch

        self.model = model.to(device_of(args))
        self.forward = torch.compile(model) if self.compiled else model
        self.optimizer = torch.optim.AdamW(model.parameters(), betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)
        self.args = args

    def step(self, micro_batches, lr: float):
        from shard.models.loss import next_token_loss

        total = 0.0
        for tokens in micro_batches:
            with autocast(self.args):
                loss = next_token_loss(self.forward, tokens)
            (loss / len(micro_batches)).backward()
            total = total + loss.detach()
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / len(micro_batches)

    def report(self, timed_steps: int) -> dict:
        return {"exposed_comm_s": 0.0, "sent_bytes_per_rank": 0}

    def full_state(self) -> Optional[dict]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}


class TorchRun(Run):
    """A run whose collectives go through torch.distributed's functions: their bytes are
    counted by wrapping them (count_torch_collectives); it has no ledger of waits."""

    def __init__(self) -> None:
        self.sent = [0]

    def reset(self) -> None:
        self.sent[0] = 0

    def report(self, timed_steps: int) -> dict:
        return {"exposed_comm_s": None, "sent_bytes_per_rank": self.sent[0] / timed_steps}


class Fsdp2Run(TorchRun):
    """PyTorch's fully_shard per transformer block and root, on gloo or pccl's backend (NCCL
    on GPUs); bf16 runs gather bf16 parameters and reduce fp32 gradients; AdamW(fused=True),
    eager's and the engine's kernel (torch's default on CPUs is its slowest, one tensor at a
    time); `compiled`: each block's forward compiled (as torchtitan does) and each module
    the root computes with, as the engine's compile= compiles them."""

    def __init__(self, backend: str, compiled: bool = False) -> None:
        super().__init__()
        self.backend, self.compiled = backend, compiled
        self.name = ("fsdp2" if backend == "gloo" else f"fsdp2-{backend}") + ("-compile" if compiled else "")

    def set_up(self, model, world, args) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        import pccl.distributed

        device = device_of(args)
        pccl.distributed.init_process_group("nccl" if device.type == "cuda" and self.backend == "gloo"
                                            else self.backend)
        count_torch_collectives(self.sent, world.size)
        mesh = init_device_mesh(device.type, (world.size,))
        model.to(device)
        if self.compiled:   # what the engine's compile= compiles: each block, and the root's modules
            from shard.engine.engine import compile_forward
            from shard.engine.units import root_modules

            for module in [*model.blocks, *root_modules(model, list(model.blocks))]:
                compile_forward(module)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.precision == "bf16" else None,
                                      reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model, self.rank = model, world.rank
        self.optimizer = torch.optim.AdamW(model.parameters(), betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)

    def step(self, micro_batches, lr: float):
        from shard.models.loss import next_token_loss

        total = 0.0
        for tokens in micro_batches:
            loss = next_token_loss(self.model, tokens)
            (loss / len(micro_batches)).backward()
            total = total + loss.detach()
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return total / len(micro_batches)

    def full_state(self) -> Optional[dict]:
        full = {k: v.full_tensor() for k, v in self.model.state_dict().items()}
        return full if self.rank == 0 else None


class DeepSpeedRun(TorchRun):
    """DeepSpeed's ZeRO stage 3 with the same AdamW as its client optimizer, on gloo."""

    name = "deepspeed-zero3"

    def unavailable(self, args) -> str:
        if args.device != "cpu":
            return "the comparison runs DeepSpeed on CPUs only (gloo)"
        try:
            import deepspeed  # noqa: F401
        except Exception as e:   # noqa: BLE001 - the reason is the report
            return f"DeepSpeed does not import here: {type(e).__name__}: {e}"
        return ""

    def set_up(self, model, world, args) -> None:
        import torch

        import pccl.distributed

        rank, p = world.rank, world.size
        os.environ.setdefault("LOCAL_RANK", str(rank % (args.ranks_per_node or p)))   # DeepSpeed asks for it
        pccl.distributed.init_process_group("gloo")
        count_torch_collectives(self.sent, p)   # before DeepSpeed takes its references to torch's functions
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        # DeepSpeed steps this optimizer itself (ZeRO-3 wraps it): the rate is set on it
        self.client = torch.optim.AdamW(model.parameters(), betas=BETAS, eps=EPS, weight_decay=0.0)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=self.client, config=deepspeed_config(args))
        self.rank = rank

    def step(self, micro_batches, lr: float):
        set_lr(self.client, lr)
        # it updates at the last micro-batch
        return backward_step(self.engine, self.engine.step, micro_batches, step_every_micro_batch=True)

    def full_state(self) -> Optional[dict]:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.engine.module.parameters())):
            full = {k: v.detach().clone() for k, v in self.engine.module.state_dict().items()}
        return full if self.rank == 0 else None


def deepspeed_config(args) -> dict:
    """DeepSpeed ZeRO-3 as the other runs train: the comparison's batch, no clipping
    (DeepSpeed 0.19.8 clips at 1.0 unless told: runtime/constants.py,
    GRADIENT_CLIPPING_DEFAULT), bf16 where --precision bf16 (without its section DeepSpeed
    trained in fp32 under a bf16 label), and every parameter sharded from the engine's
    min_shard_numel on (DeepSpeed's default keeps parameters under 1e5 elements whole on
    every rank: 26 of the tiny model's 27)."""
    from shard.engine.units import MIN_SHARD_NUMEL

    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.micro,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": MIN_SHARD_NUMEL},
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 1 << 30,
            **({"bf16": {"enabled": True}} if args.precision == "bf16" else {})}


class EngineRun(Run):
    """The shard engine with a strategy, its collectives on a layer of COMMS, its
    parameters and gradients sent compressed by `codec` (None: uncompressed), with `kept`
    each unit's parameters kept from its forward to its backward (reshard_after_forward=
    False), and with `compiled` each unit's forward compiled."""

    def __init__(self, strategy: str, comm: str, codec: Optional[str] = None, compiled: bool = False,
                 kept: bool = False) -> None:
        self.strategy, self.comm, self.codec, self.compiled, self.kept = strategy, comm, codec, compiled, kept
        self.name = (f"{strategy}-{comm}" + (f"+{codec}" if codec else "") + ("+keep" if kept else "") +
                     ("+compile" if compiled else ""))
        self.comm_at_state: Optional[dict] = None

    def set_up(self, model, world, args) -> None:
        import torch

        import pccl
        from shard.engine import Engine, ShardedAdamW
        from shard.engine.config import EngineConfig

        device = device_of(args)
        # NCCL where each rank has a GPU of its own (it refuses two ranks on one), else MPI
        transport = "nccl" if device.type == "cuda" and world.size <= torch.cuda.device_count() else "mpi"
        comm = pccl.init(transport, ranks_per_node=args.ranks_per_node, timeout=300,
                         interruptible=transport == "mpi")   # as shard-train
        self.engine = Engine(model.to(device), comm, EngineConfig(
            strategy=self.strategy, algorithm=COMMS[self.comm], group_size=args.ranks_per_node or world.size,
            precision=args.precision, compile=self.compiled, compress_params=self.codec, compress_grads=self.codec,
            reshard_after_forward=not self.kept))
        self.optimizer = ShardedAdamW(self.engine, betas=BETAS, eps=EPS, weight_decay=0.0)
        self.params, self.world = model.cfg.num_params(), world.size
        self.half = args.precision == "bf16"   # PaRO's mixed precision: bf16 parameters and gradients

    def step(self, micro_batches, lr: float):
        self.optimizer.lr = lr
        return backward_step(self.engine, self.optimizer.step, micro_batches, step_every_micro_batch=False)

    def reset(self) -> None:
        self.engine.comm_report(reset=True)

    def full_state(self) -> Optional[dict]:
        # the ledger as training left it: the gather below would add to it
        self.comm_at_state = self.engine.comm_report()
        return self.engine.full_state_dict()

    def report(self, timed_steps: int) -> dict:
        comm = self.comm_at_state or self.engine.comm_report()
        engine = self.engine
        # model-state bytes per rank, the engine's (padded) and PaRO's Table 2 at the run's precision
        # (2 + 2 + 12 bytes a parameter in bf16, the paper's mixed precision; 4 + 4 + 12 in fp32)
        state = engine.memory_report()
        width = 2 if self.half else 4
        table2 = engine.strategy.memory_per_rank(self.params, self.world, engine.layout.group,
                                                 param_bytes=width, grad_bytes=width, state_bytes=12)
        return {"exposed_comm_s": comm["exposed_s"] / timed_steps,
                "sent_bytes_per_rank": sum(comm[s]["intra"] + comm[s]["inter"]
                                           for s in ("forward", "backward", "update")) / timed_steps,
                "state_bytes": {part: state[part] for part in STATE_PARTS},
                "table2_bytes": {part: table2[part] for part in STATE_PARTS}}


FLAGS = ("keep", "compile")   # a run name's extras that are not codecs
ENGINE_RUN = "STRATEGY-COMM[+CODEC][+keep][+compile]"   # how an engine run is named

PLAIN = {"eager": lambda: EagerRun(False), "eager-compile": lambda: EagerRun(True),
         "fsdp2": lambda: Fsdp2Run("gloo"), "fsdp2-compile": lambda: Fsdp2Run("gloo", compiled=True),
         "fsdp2-pccl": lambda: Fsdp2Run("pccl"), "deepspeed-zero3": DeepSpeedRun}


def parse_run(name: str) -> Run:
    """The run a name stands for: eager, eager-compile, fsdp2, fsdp2-compile, fsdp2-pccl,
    deepspeed-zero3 or ENGINE_RUN; a clear error for a name the tool does not know, before
    anything launches."""
    from shard.engine.strategy import Strategy

    if name in PLAIN:
        return PLAIN[name]()
    run, *extras = name.split("+")
    if run in PLAIN:
        refuse("shard-compare", f"run {name!r}: +CODEC, +keep and +compile apply to the engine's runs "
                                f"(STRATEGY-COMM) only; {run!r} takes none")
    if len(set(extras)) < len(extras):
        refuse("shard-compare", f"run {name!r} names a suffix twice; expected {ENGINE_RUN}")
    codecs = [e for e in extras if e not in FLAGS]
    if len(codecs) > 1:
        refuse("shard-compare", f"run {name!r} names two codecs; expected {ENGINE_RUN}")
    strategy, _, comm = run.rpartition("-")
    if comm not in COMMS or not strategy:
        refuse("shard-compare", f"unknown run {run!r}; expected one of {tuple(PLAIN)} or "
                                f"{ENGINE_RUN} with COMM one of {tuple(COMMS)}")
    try:   # an unknown codec or strategy: one line, not a traceback
        if codecs:
            from pccl.compression.codecs import codec

            codec(codecs[0])
        Strategy.parse(strategy)
    except ValueError as e:
        refuse("shard-compare", f"run {name!r}: {e}")
    return EngineRun(strategy, comm, codecs[0] if codecs else None, "compile" in extras, "keep" in extras)


def loss_tolerance(name: str, precision: str = "fp32") -> float:
    """The tolerance agreement() holds a run to: a compressed run (+CODEC) does other math
    on purpose, and bf16 runs round differently in each framework."""
    compressed = any(e not in FLAGS for e in name.split("+")[1:])
    if compressed:
        return COMPRESSED_LOSS_TOLERANCE
    return BF16_LOSS_TOLERANCE if precision == "bf16" else LOSS_TOLERANCE


def agreement(losses: list, reference: list, tolerance: float) -> dict:
    """Whether a run's per-step losses follow the reference's: at each step the gap
    |loss - reference| may be `tolerance` times (|reference loss| + MOVEMENT x the farthest
    the reference's loss has moved from its first step so far), the loss's own rounding
    and the drift the updates' rounding leaves (the comment above LOSS_TOLERANCE).
    {"loss_gap", "loss_allowed"}: the gap and its allowance relative to the reference's
    loss, at the step where the gap used most of its allowance; "diverged": beyond it
    there, or a non-finite loss, or another number of steps."""
    if len(losses) != len(reference):
        return {"loss_gap": math.inf, "loss_allowed": 0.0, "diverged": True}
    worst, moved = (-1.0, 0.0, 0.0), 0.0
    for loss, ref in zip(losses, reference):
        moved = max(moved, abs(ref - reference[0]))
        gap, allowed = abs(loss - ref), tolerance * (abs(ref) + MOVEMENT * moved)
        used = gap / allowed if allowed else (0.0 if gap == 0 else math.inf)
        if not math.isfinite(used):   # NaN too: it would compare as agreeing
            used = math.inf
        scale = abs(ref) if math.isfinite(ref) and ref else 1.0
        if used > worst[0]:
            worst = (used, gap / scale, allowed / scale)
    used, gap, allowed = worst
    return {"loss_gap": gap, "loss_allowed": allowed, "diverged": used > 1}


def set_lr(optimizer, lr: float) -> None:
    """A torch optimizer's rate for its next step (a float: fused AdamW takes one too)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def backward_step(engine, step, micro_batches, step_every_micro_batch: bool):
    """One training step on an engine that takes backward(loss) per micro-batch, and `step`
    (DeepSpeed's engine.step, every micro-batch; shard's optimizer.step, once); this rank's
    mean loss, on the device."""
    from shard.models.loss import next_token_loss

    total = 0.0
    for tokens in micro_batches:
        loss = next_token_loss(engine, tokens)
        engine.backward(loss)
        if step_every_micro_batch:
            step()
        total = total + loss.detach()
    if not step_every_micro_batch:
        step()
    return total / len(micro_batches)


def count_torch_collectives(sent: list, p: int) -> None:
    """FSDP2's (and DeepSpeed's) collectives, counted as the bytes a ring sends per rank
    ((p-1)/p of the full buffer): their calls go through torch.distributed's functions,
    wrapped here."""
    import torch
    import torch.distributed as dist

    def counting(fn, rings: int):
        """fn, counting `rings` passes over its largest tensor (the full buffer)."""
        def call(*args, **kwargs):
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            sent[0] += rings * max(t.numel() * t.element_size() for t in tensors) * (p - 1) // p
            return fn(*args, **kwargs)
        return call

    for name, rings in (("all_gather_single", 1), ("all_gather_into_tensor", 1), ("reduce_scatter_single", 1),
                        ("reduce_scatter_tensor", 1), ("all_reduce", 2)):
        if hasattr(dist, name):   # the *_single names are newer than torch 2.11
            setattr(dist, name, counting(getattr(dist, name), rings))
