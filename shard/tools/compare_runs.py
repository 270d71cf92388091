"""The runs shard-compare puts side by side, one class per framework behind one interface,
and the one parser of their names (parse_run). shard/tools/compare.py's worker seeds the
model, feeds the batches, times the steps and builds the row; a Run only sets its framework
up, steps it and reports what only it can measure. A new kind of run (on GPUs, under
torch.compile, ...) is a new class here and a name in parse_run.

Heavy imports (torch, deepspeed, pccl.distributed) stay inside the methods, so that
shard-compare --help and the process that starts the launches do not load the frameworks.
"""
from __future__ import annotations

import os
from typing import Optional

COMMS = {"native": "native", "pccl": "auto", "hierarchical": "hierarchical", "ho_ring": "ho_ring"}
LR, BETAS, EPS = 1e-3, (0.9, 0.95), 1e-8
# Losses of runs doing the same math in fp32 differ only by rounding (sums in another
# order, another AdamW's arithmetic): well below this relative difference.
LOSS_TOLERANCE = 1e-4
# A run whose parameters and gradients travel compressed (STRATEGY-COMM+CODEC) does other
# math on purpose: it is held to 2% of the reference's loss (issue 17's target).
COMPRESSED_LOSS_TOLERANCE = 0.02
STATE_PARTS = ("parameters", "gradients", "optimizer")   # model-state bytes per rank, as the engine reports them


class Run:
    """One framework's training of the shared model on this launch's ranks."""

    name: str

    def unavailable(self) -> str:
        """Why this run cannot run here ("" when it can); asked before launching."""
        return ""

    def set_up(self, model, world, args) -> None:
        """The framework's model and optimizer around `model` (the same initial weights on
        every run); `world` is the launch's MPI communicator, `args` shard-compare's."""
        raise NotImplementedError

    def step(self, micro_batches) -> float:
        """One optimizer step over the step's micro-batches; this rank's mean loss."""
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
    """PyTorch's fully_shard per transformer block and root, on gloo or pccl's backend."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.name = "fsdp2" if backend == "gloo" else f"fsdp2-{backend}"

    def set_up(self, model, world, args) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import pccl.distributed

        pccl.distributed.init_process_group(self.backend)
        count_torch_collectives(self.sent, world.size)
        mesh = init_device_mesh("cpu", (world.size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model, self.rank = model, world.rank
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)

    def step(self, micro_batches) -> float:
        from shard.planning.predict import next_token_loss

        losses = []
        for tokens in micro_batches:
            loss = next_token_loss(self.model, tokens)
            (loss / len(micro_batches)).backward()
            losses.append(loss.item())
        self.optimizer.step()
        self.optimizer.zero_grad()
        return sum(losses) / len(losses)

    def full_state(self) -> Optional[dict]:
        full = {k: v.full_tensor() for k, v in self.model.state_dict().items()}
        return full if self.rank == 0 else None


class DeepSpeedRun(TorchRun):
    """DeepSpeed's ZeRO stage 3 with the same AdamW as its client optimizer, on gloo."""

    name = "deepspeed-zero3"

    def unavailable(self) -> str:
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
        client = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=client, config={
            "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.micro,
            # DeepSpeed 0.19.8 clips the global gradient norm at 1.0 unless told otherwise
            # (runtime/constants.py, GRADIENT_CLIPPING_DEFAULT); the other runs do not clip
            "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
            "steps_per_print": 1 << 30})
        self.rank = rank

    def step(self, micro_batches) -> float:
        return backward_step(self.engine, micro_batches, step_every_micro_batch=True)   # it updates at the last

    def full_state(self) -> Optional[dict]:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.engine.module.parameters())):
            full = {k: v.detach().clone() for k, v in self.engine.module.state_dict().items()}
        return full if self.rank == 0 else None


class EngineRun(Run):
    """The shard engine with a strategy, its collectives on a layer of COMMS, and its
    parameters and gradients sent compressed by `codec` (None: uncompressed)."""

    def __init__(self, strategy: str, comm: str, codec: Optional[str] = None) -> None:
        self.strategy, self.comm, self.codec = strategy, comm, codec
        self.name = f"{strategy}-{comm}" + (f"+{codec}" if codec else "")
        self.comm_at_state: Optional[dict] = None

    def set_up(self, model, world, args) -> None:
        import pccl
        from shard.engine import Engine
        from shard.engine.config import EngineConfig, OptimizerConfig

        comm = pccl.init(ranks_per_node=args.ranks_per_node, timeout=300, interruptible=True)   # as shard-train
        self.engine = Engine(model, comm, EngineConfig(
            strategy=self.strategy, algorithm=COMMS[self.comm], group_size=args.ranks_per_node or world.size,
            compress_params=self.codec, compress_grads=self.codec,
            optimizer=OptimizerConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)))
        self.params, self.world = model.cfg.num_params(), world.size

    def step(self, micro_batches) -> float:
        return backward_step(self.engine, micro_batches, step_every_micro_batch=False)

    def reset(self) -> None:
        self.engine.comm_report(reset=True)

    def full_state(self) -> Optional[dict]:
        # the ledger as training left it: the gather below would add to it
        self.comm_at_state = self.engine.comm_report()
        return self.engine.full_state_dict()

    def report(self, timed_steps: int) -> dict:
        comm = self.comm_at_state or self.engine.comm_report()
        engine = self.engine
        # model-state bytes per rank, the engine's (padded) and PaRO's Table 2 (fp32 training)
        state = engine.memory_report()
        table2 = engine.strategy.memory_per_rank(self.params, self.world, engine.layout.group,
                                                 param_bytes=4, grad_bytes=4, state_bytes=12)
        return {"exposed_comm_s": comm["exposed_s"] / timed_steps,
                "sent_bytes_per_rank": sum(comm[s]["intra"] + comm[s]["inter"]
                                           for s in ("forward", "backward", "update")) / timed_steps,
                "state_bytes": {part: state[part] for part in STATE_PARTS},
                "table2_bytes": {part: table2[part] for part in STATE_PARTS}}


def parse_run(name: str) -> Run:
    """The run a name stands for: fsdp2, fsdp2-pccl, deepspeed-zero3 or STRATEGY-COMM[+CODEC];
    a clear error for a name the tool does not know, before anything launches."""
    from shard.engine.strategy import Strategy

    if name == "fsdp2":
        return Fsdp2Run("gloo")
    if name == "fsdp2-pccl":
        return Fsdp2Run("pccl")
    if name == "deepspeed-zero3":
        return DeepSpeedRun()
    run, _, compression = name.partition("+")
    if compression:
        from pccl.compression.codecs import codec

        codec(compression)
    strategy, _, comm = run.rpartition("-")
    if comm not in COMMS or not strategy:
        raise SystemExit(f"shard-compare: unknown run {run!r}; expected fsdp2, fsdp2-pccl, deepspeed-zero3 or "
                         f"STRATEGY-COMM[+CODEC] with COMM one of {tuple(COMMS)}")
    Strategy.parse(strategy)
    return EngineRun(strategy, comm, compression or None)


def loss_tolerance(name: str) -> float:
    """How far a run's losses may leave the reference's: a compressed run (+CODEC) does
    other math on purpose."""
    return COMPRESSED_LOSS_TOLERANCE if "+" in name else LOSS_TOLERANCE


def backward_step(engine, micro_batches, step_every_micro_batch: bool) -> float:
    """One training step on an engine that takes backward(loss) per micro-batch and step()
    (DeepSpeed's, every micro-batch; shard's, once); this rank's mean loss."""
    from shard.planning.predict import next_token_loss

    losses = []
    for tokens in micro_batches:
        loss = next_token_loss(engine, tokens)
        engine.backward(loss)
        if step_every_micro_batch:
            engine.step()
        losses.append(loss.item())
    if not step_every_micro_batch:
        engine.step()
    return sum(losses) / len(losses)


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
        setattr(dist, name, counting(getattr(dist, name), rings))
