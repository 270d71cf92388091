"""The training engine: a model cut into units, each unit's state sharded by a PaRO
strategy, parameters gathered just in time (and prefetched), gradients reduced as soon as
each unit's backward ends into this rank's optimizer shard, whose fp32 master weights an
optimizer beside the engine updates (shard/engine/optimizer.py).

    engine = Engine(model, comm, strategy="paro-iig")       # or config=EngineConfig(...)
    optimizer = ShardedAdamW(engine, lr=3e-4)
    loss = loss_fn(engine(inputs), targets)
    engine.backward(loss)        # once per micro-batch
    optimizer.step()             # engine.gradients(), clip, update, engine.refresh()

Gradients are averaged over ranks and micro-batches, so k micro-batches of b samples on
N ranks give the update one process would make from the mean loss over all k*N*b samples.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from types import CodeType
from typing import Callable, Optional, Union

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._pytree import tree_flatten, tree_map

from pccl import Communicator
from pccl.compression.codecs import codec
from shard.engine.adamw import OPTIMIZER_BYTES
from shard.engine.config import PRECISIONS, EngineConfig
from shard.engine.lanes import STAGES, Handle, Lane, Ledger, shared_queue
from shard.engine.shard_layout import ShardLayout
from shard.engine.sharded_unit import ShardedUnit
from shard.engine.strategy import REPLICATED, Scope
from shard.engine.trace import StepTrace
from shard.engine.units import root_modules, split_units

# set on a model an Engine wrapped: its parameters were released into the engine's shards
WRAPPED = "_wrapped_by_shard_engine"
# Gradient buffers of per-micro-batch reductions that may exist at once: the one the lane
# reduces and the next unit's, copied out meanwhile. Without a bound the backward runs
# ahead of a slow link, and every unit's buffer waits in the lane's queue (measured on CPU:
# 7 of 8 units' buffers at once, a peak 26% above shard/planning/footprint.py's).
REDUCING_AT_ONCE = 2


# a calling frame of its own per module class: see compile_forward
_CALLERS: dict[type, CodeType] = {}


def compile_forward(module: nn.Module, backend=True) -> None:
    """torch.compile the module's forward alone, so hooks on the module run around it,
    outside the compiled code (as torchtitan compiles each block under FSDP2). `backend`:
    True for torch.compile's default (inductor), or a backend's name.

    dynamo keeps its compiled variants (each shape, grad mode) per code object, at most
    torch._dynamo.config.recompile_limit (8) of them, and runs the rest uncompiled. torch
    compiles a torch.nn module's forward (an embedding, a LayerNorm) through one wrapper
    shared by all of them, so a model's root modules, trained and then evaluated at a few
    shapes, filled that one budget. The forward is called here from a frame whose code
    object is its class's own: one budget per class, and instances of a class (the blocks)
    still share their compiled graphs."""
    forward = module.forward

    def call(*args, **kwargs):
        return forward(*args, **kwargs)
    call.__code__ = _CALLERS.setdefault(type(module), call.__code__.replace(co_name=f"{type(module).__name__}_forward"))
    module.forward = torch.compile(call, **({} if backend is True else {"backend": backend}))


_PLACEMENT = ("params", "shapes", "offsets", "padded", "start", "end")   # of a unit, beside its name


def _placement_difference(theirs: dict, mine: dict) -> Optional[str]:
    """How the pieces of state_dict() `theirs` lie otherwise than `mine`'s (None where they
    lie alike): what a load must match, named for its error."""
    setup = [f"{k} {theirs[k]} (this engine: {mine[k]})" for k in ("world", "group", "strategy")
             if theirs[k] != mine[k]]
    if setup:
        return "it was taken at " + ", ".join(setup)
    if len(theirs["units"]) != len(mine["units"]):
        return (f"it holds {len(theirs['units'])} units ({', '.join(u['name'] for u in theirs['units'])}), this "
                f"engine {len(mine['units'])} ({', '.join(u['name'] for u in mine['units'])})")
    for i, (a, b) in enumerate(zip(theirs["units"], mine["units"])):
        if a["name"] != b["name"]:
            return f"its unit {i} is {a['name']}, this engine's is {b['name']}"
        for k in _PLACEMENT:
            if a[k] != b[k]:
                return f"unit {i} ({a['name']}) has {k} {a[k]}, this engine's ({b['name']}) {b[k]}"
    return None


@dataclass(frozen=True)
class Gradients:
    """A step's gradient (Engine.gradients): `pieces`, one per piece of the master weights;
    the mean gradient over ranks and micro-batches, unscaled, is `scale` times them (a
    number, or a tensor on the device under fp16); `norm` is the mean's global L2 norm (a
    device tensor, not finite when some gradient was not)."""

    pieces: list[torch.Tensor]
    norm: torch.Tensor
    scale: Union[float, torch.Tensor]


@dataclass(frozen=True)
class _GatheredView:
    """A saved view of a unit's gathered parameters, by place (see Engine._pack)."""

    unit: ShardedUnit
    offset: int
    shape: torch.Size
    stride: tuple

    def get(self) -> torch.Tensor:
        full = self.unit.full
        if full is None:
            raise RuntimeError(f"the backward needs {self.unit.name}'s parameters, which are not gathered: the "
                               "unit's backward ran before its pre-backward hook (a bug in the engine)")
        return full.as_strided(self.shape, self.stride, self.offset)


class Engine:
    def __init__(self, model: nn.Module, comm: Communicator, config: Optional[EngineConfig] = None, *,
                 units: Optional[list[nn.Module]] = None, device=None,
                 init: Optional[Callable[[str, torch.Tensor], None]] = None, **settings):
        """config: the engine's settings (shard/engine/config.py), or `settings`, the same as keywords
        (strategy="zero3", precision="bf16", ...), not both. units: the submodules gathered together
        (default: see shard/engine/units.py).

        A model built on the meta device is materialized one unit at a time on `device`:
        `init(name, tensor)` (default: the model's `init_parameter`) fills each parameter,
        the same on every rank, and each rank keeps only its shards, so no rank ever holds
        more than one unit in full.

        strategy="auto" is chosen before the engine exists: shard.planning.build_engine plans,
        then builds the engine with the chosen strategy and group size."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a pccl.Communicator, got {type(comm).__name__}")
        if "auto" in (settings.get("strategy"), getattr(config, "strategy", None)):
            raise ValueError("strategy='auto' is the planner's choice, made before an engine exists: build it with "
                             "shard.planning.build_engine(model, comm, config, workload=Workload(seq, micro_batch, "
                             "micro_batches)), which returns the engine with the chosen strategy and the plan")
        config = EngineConfig.given(config, settings)
        self.config, self.strategy = config, config.strategy
        group = comm.topology.ranks_per_node if config.group_size is None else config.group_size
        self.strategy.check_group(comm.size, group)
        named = list(model.named_parameters())
        params = [p for _, p in named]
        if not params:
            raise ValueError("the model has no parameters to train")
        if getattr(model, WRAPPED, False):
            raise ValueError("this model was wrapped by an earlier Engine, which released its parameters into its "
                             "shards (they now hold no elements): build a fresh model, or load the earlier "
                             "engine's full_state_dict() into one")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device, found {sorted(map(str, devices))}")
        dtypes = {}
        for name, p in named:
            dtypes.setdefault(p.dtype, name)
        if len(dtypes) != 1:   # each unit's parameters are views of one flat buffer, of one dtype
            raise ValueError("all parameters must have one dtype (the engine keeps them in fp32 master weights and "
                             "computes in its precision), found " +
                             ", ".join(f"{d} ({name}, ...)" for d, name in dtypes.items()))
        self.device, init = self._materialization(model, devices.pop(), device, init)
        cut = split_units(model, units)   # before any communication: bad units fail alone

        self.model, self.comm = model, comm
        self.compute_dtype, self.reduce_dtype = PRECISIONS[config.precision], PRECISIONS[config.reduce_dtype]
        self.layout = ShardLayout(comm.size, group, comm.rank, nested=self.strategy.uses_groups())
        self.ledger = Ledger(self.layout)
        levels = self.strategy.uses_groups()
        shared = shared_queue(comm, self.device)
        self.gathers = Lane("gather", comm, self.layout, levels, config.algorithm, self.ledger, self.device, shared)
        self.reductions = Lane("reduce", comm, self.layout, levels, config.algorithm, self.ledger, self.device,
                               shared)
        # what backward multiplies the loss by (a tensor on the device, or 1.0): fp16's loss
        # scale, which the optimizer sets and moves; gradients() divides it out
        self.loss_scale = 1.0

        self.units = self._shard_units(cut, config)
        self.root = self.units[0] if self.units[0].name == "<root>" else None
        self._dtypes = {id(p): p.dtype for u in self.units for p in u.flat.params}
        self._init_master(init)
        self.ledger.reset()

        self._forward_order: list[ShardedUnit] = []
        self._backward_order: list[ShardedUnit] = []
        self._this_backward: list[ShardedUnit] = []
        self._reductions: list[Handle] = []
        self._in_backward = False   # backward() is running: gradient hooks outside it are refused
        self._settled = 0   # the first _reductions that are done (REDUCING_AT_ONCE)
        self._micro_batches = 0
        self._warned_order = False
        self.gather_stats = {"needed": 0, "prefetched": 0}   # sharded units at the moment they ran
        self._trace: Optional[StepTrace] = None
        self._gathered: dict[int, ShardedUnit] = {}   # this forward's gathered buffers, by address (_pack)
        self._register_hooks(config.activation_checkpointing, config.compile)
        # which parameters train is fixed here: the hooks and each unit's count of the
        # gradients it waits for were set from it
        self._trainable = [p.requires_grad for u in self.units for p in u.flat.params]
        setattr(model, WRAPPED, True)

    # Set-up.

    def _shard_units(self, cut: list, config: EngineConfig) -> list[ShardedUnit]:
        """Each unit sharded by the strategy (small ones replicated), with the codecs of
        its compressed collectives."""
        # (EngineConfig checked that each codec takes the dtype its payload travels in)
        codecs = {kind: codec(name) for kind, name in (("params", config.compress_params),
                                                        ("grads", config.compress_grads)) if name}
        return [ShardedUnit(unit, self.strategy if unit.numel >= config.min_shard_numel else REPLICATED, self.layout,
                            self.compute_dtype, self.reduce_dtype, self.device, codecs) for unit in cut]

    def _register_hooks(self, activation_checkpointing: bool, compiled) -> None:
        """Gather before each unit's forward, release after it, reduce each gradient as it is
        ready. Compiled units compile their forward alone: the hooks run around it, outside
        the compiled code. The model's own forward calls the units, so it is not compiled;
        the modules it calls that belong to no unit are (a tied model's embedding and head,
        with the loss), each on its own."""
        if compiled:
            for module in root_modules(self.model, [u.unit.module for u in self.units if u is not self.root]):
                compile_forward(module, compiled)
        for u in self.units:
            if u is not self.root:
                u.unit.module.register_forward_pre_hook(partial(self._before_forward, u))
                u.unit.module.register_forward_hook(partial(self._after_forward, u))
                if compiled:
                    compile_forward(u.unit.module, compiled)
                if activation_checkpointing:
                    self._checkpoint_activations(u.unit.module)
            for p in u.flat.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(partial(self._gradient_ready, u))

    @staticmethod
    def _materialization(model: nn.Module, where: torch.device, device, init):
        """The engine's device, and the initializer of a meta-device model (None for a
        model that already holds its values)."""
        if where.type != "meta":
            if device is not None and torch.device(device).type != where.type:
                raise ValueError(f"device={device!r}, but the model is on {where}; move the model, or build it "
                                 f"on the meta device to materialize it on {device!r}")
            if init is not None:
                raise ValueError("init= is for models built on the meta device; this one is on " + str(where))
            return where, None
        if device is None:
            raise ValueError("the model is on the meta device: pass device= (where to materialize its shards)")
        init = init if init is not None else getattr(model, "init_parameter", None)
        if not callable(init):
            raise ValueError("a model on the meta device needs init=(name, tensor) -> None, or a model.init_parameter "
                             "method, to build its values")
        buffers = [name for name, b in model.named_buffers() if b.device.type == "meta"]
        if buffers:
            raise ValueError(f"buffers on the meta device cannot be materialized: {buffers}; compute them in forward "
                             "or build them on a real device")
        return torch.device(device), init

    def _init_master(self, init) -> None:
        """The fp32 master weights of this rank's optimizer shard of every unit, one flat
        buffer (`master`), the parameters placed from it."""
        offsets = self._os_offsets = [0]
        for u in self.units:
            offsets.append(offsets[-1] + u.os_numel)
        self.master = torch.empty(offsets[-1], dtype=torch.float32, device=self.device)
        self._os_views = [self.master[a:b] for a, b in zip(offsets, offsets[1:])]
        if init is not None:   # meta parameters become real, empty ones (the same objects, so ties hold)
            for u in self.units:
                for p in u.flat.params:
                    empty = nn.Parameter(torch.empty(0, dtype=p.dtype, device=self.device), p.requires_grad)
                    torch.utils.swap_tensors(p, empty)
        for u, view in zip(self.units, self._os_views):
            u.load_master(self.reductions, view, init)
        # each optimizer shard is held by `replicas` ranks: the norm counts it once
        self._norm_weights = torch.tensor([1.0 / self.layout.replicas(u.strategy.optimizer) for u in self.units],
                                          dtype=torch.float32, device=self.device)
        for u, view in zip(self.units, self._os_views):
            u.place_params(view)
        self._refresh("update")
        for u in self.units:
            if u.gathers_params:
                u.flat.release()   # the model's own full copy is no longer needed
            else:
                u.flat.bind(u.params)   # for good: steps and refreshes write into it

    @property
    def pieces(self) -> list[int]:
        """Where each unit's piece of `master` starts (its gradient is one tensor a piece)."""
        return self._os_offsets[:-1]

    def spans(self):
        """(name, parameter, start, end) of each trainable parameter with elements in this
        rank's shard: where in `master` they lie (weight decay's selection). The parameter
        is a stand-in on the meta device with the original's shape and dtype: the engine
        has released the storage of the parameters it gathers."""
        for u, base in zip(self.units, self._os_offsets):
            lo, hi = u.os_span
            for (name, p), shape, start, end in zip(u.unit.params, u.flat.shapes, u.flat.offsets, u.flat.offsets[1:]):
                a, b = max(start, lo), min(end, hi)
                if p.requires_grad and a < b:
                    like = nn.Parameter(torch.empty(shape, dtype=self._dtypes[id(p)], device="meta"))
                    yield name, like, base + a - lo, base + b - lo

    def refresh(self) -> None:
        """The parameters from `master`, after an update wrote it."""
        self._refresh("update")

    def _refresh(self, stage: str) -> None:
        """Parameter shards of their own from the master weights (units whose shard is the
        master's need nothing: a world of 1, DDP, ZeRO-3 and MiCS have none); parameters a
        forward kept (reshard_after_forward=False) are the old master's, and are released."""
        for u in self.units:
            u.release()
        if all(u.local_refresh for u in self.units):
            return

        def task() -> None:
            for u, view in zip(self.units, self._os_views):
                u.refresh(self.gathers, stage, view)
        self.gathers.submit(task, what=f"parameter refresh ({stage})").wait()

    @staticmethod
    def _checkpoint_activations(module: nn.Module) -> None:
        forward = module.forward

        def checkpointed(*args, **kwargs):
            return torch_checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        module.forward = checkpointed

    # Forward.

    def __call__(self, *args, **kwargs):
        if self.compute_dtype != torch.float32:
            cast = lambda t: t.to(self.compute_dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        self._gathered = {}
        if self.root is not None:
            self.root.ensure_gathered(self.gathers, "forward")
            self._note_gathered(self.root)
            self._mark("forward", self.root)
        if self.device.type == "meta":   # a dry run: storages have no addresses to tell apart
            out = self.model(*args, **kwargs)
        else:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                out = self.model(*args, **kwargs)
        if self.root is not None and not torch.is_grad_enabled():
            self.root.release()
        return out

    # Autograd keeps views of the gathered parameters (a linear layer saves its weight's
    # transpose) from a unit's forward to its backward, which would keep every unit's
    # gathered buffer alive across the pass and make sharded parameters cost their full
    # size at the peak. Such a view is saved as where it lies in its unit instead, and
    # read back from the buffer the backward gathers again (as FSDP frees and refills
    # its unsharded storage in place).

    def _pack(self, t: torch.Tensor):
        # _gathered maps a gathered buffer's address to its unit; an address may since have
        # been freed and reused, so the unit's buffer must still be there, at that address
        ptr = t.untyped_storage().data_ptr()
        u = self._gathered.get(ptr)
        if u is not None and u.full is not None and u.full.untyped_storage().data_ptr() == ptr:
            return _GatheredView(u, t.storage_offset(), t.shape, t.stride())
        return t

    def _note_gathered(self, u: ShardedUnit) -> None:
        if u.full is not None:
            self._gathered[u.full.untyped_storage().data_ptr()] = u

    @staticmethod
    def _unpack(saved):
        return saved.get() if isinstance(saved, _GatheredView) else saved

    def _before_forward(self, u: ShardedUnit, module, args) -> None:
        if u not in self._forward_order:
            self._forward_order.append(u)
        self._count_gather(u, u.ensure_gathered(self.gathers, "forward"))
        self._note_gathered(u)
        self._prefetch(self._forward_order, u, "forward")
        self._mark("forward", u)

    def _after_forward(self, u: ShardedUnit, module, args, output) -> None:
        if torch.is_grad_enabled():
            leaves = tree_flatten(output)[0]
            for t in leaves:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(partial(self._before_backward, u))
            if u.trainable and u.gathers_params and not any(torch.is_tensor(t) for t in leaves):
                raise TypeError(f"unit {u.name} returned a {type(output).__name__}, in which the engine finds no "
                                "tensor: it gathers a unit's parameters again for its backward when the gradient "
                                "reaches its output's tensors; return tensors (or tuples, lists, dicts of them), or "
                                "register the type with torch.utils._pytree")
            if not self.config.reshard_after_forward:
                return   # kept for the backward, which releases it (_reduce)
        u.release()

    def _count_gather(self, u: ShardedUnit, prefetched: bool) -> None:
        if u.gathers_params:
            self.gather_stats["needed"] += 1
            self.gather_stats["prefetched"] += prefetched

    def _prefetch(self, order: list[ShardedUnit], current: ShardedUnit, stage: str) -> None:
        ahead, cap = self.config.prefetch, self.config.prefetch_bytes
        if not ahead or current not in order:
            return
        at = order.index(current)
        # the units ahead whose gathers started (those behind are released, or kept for their
        # backward: reshard_after_forward=False; neither is a prefetch)
        held = sum(u.held_bytes for u in order[at + 1:])
        for u in order[at + 1:at + 1 + ahead]:
            if u.casts_params:   # made when needed: nothing to overlap
                continue
            if u.gathers_params and cap is not None and held + u.full_bytes > cap:
                break
            u.start_gather(self.gathers, stage)
            held += u.held_bytes

    # Backward.

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's loss; gradients are summed into their shards."""
        if not (torch.is_tensor(loss) and loss.numel() == 1 and loss.requires_grad):
            raise ValueError("backward() needs a scalar loss tensor that requires grad, got "
                             f"{type(loss).__name__} {tuple(loss.shape) if torch.is_tensor(loss) else ''}")
        self._check_trainable()
        self._this_backward = []
        if self.root is not None:
            # gathered again where a forward without gradients released it meanwhile
            # (a validation forward taken between a forward and its backward)
            self.root.ensure_gathered(self.gathers, "backward")
            self._mark("backward", self.root)
        scaled = torch.is_tensor(self.loss_scale) or self.loss_scale != 1.0
        self._in_backward = True
        try:
            (loss * self.loss_scale if scaled else loss).backward()
        finally:
            self._in_backward = False
        # Units whose gradients did not all arrive (unused parameters) and the root unit
        # reduce now, in unit order, so every rank issues the same collectives.
        for u in self.units:
            if not u.reduced:
                self._reduce(u)
            u.reduced = False
            u.pending = 0
        if self._backward_order and self._this_backward != self._backward_order and not self._warned_order:
            warnings.warn("the order in which units run backward changed between iterations; backward "
                          "prefetch follows the latest order", stacklevel=2)
            self._warned_order = True
        self._backward_order = self._this_backward
        self._micro_batches += 1

    def _check_trainable(self) -> None:
        """requires_grad may not change once the engine is built: a unit would reduce and
        release before a newly trainable parameter's gradient arrived (a crash, or a wrong
        update), or wait for a frozen one's forever."""
        now = [p.requires_grad for u in self.units for p in u.flat.params]
        if now == self._trainable:
            return
        names = [name for u in self.units for name in u.flat.names]
        changed = [f"{name} ({'trainable' if was else 'frozen'} when the engine was built)"
                   for name, was, is_ in zip(names, self._trainable, now) if was != is_]
        raise ValueError(f"requires_grad changed after the engine was built: {', '.join(changed[:4])}"
                         f"{' ...' if len(changed) > 4 else ''}; set it before building the engine (to change it "
                         "mid-training, build a new engine from a checkpoint)")

    def _outside_backward(self) -> None:
        """A gradient hook fired outside backward(): loss.backward() (or torch.autograd.grad)
        on the engine's loss, which would leave units marked reduced and stray gradients
        in the next step. The gradients it made are dropped, and it raises."""
        for u in self.units:
            u.clear_grads()
        raise RuntimeError("the engine's gradients flow through engine.backward(loss), not loss.backward() or "
                           "torch.autograd.grad: it reduces each unit's gradient into its shard as it arrives "
                           "(the gradients this pass made were dropped)")

    def _before_backward(self, u: ShardedUnit, grad):
        if not self._in_backward:
            self._outside_backward()
        if u in self._this_backward:
            return None
        self._this_backward.append(u)
        u.pending = u.trainable
        kept = u.full is not None and u.gathering is None   # from its forward (reshard_after_forward=False)
        prefetched = u.ensure_gathered(self.gathers, "backward")
        if not kept:
            self._count_gather(u, prefetched)
        self._prefetch(self._backward_order, u, "backward")
        self._mark("backward", u)
        return None

    def _gradient_ready(self, u: ShardedUnit, param) -> None:
        if not self._in_backward:
            self._outside_backward()
        if u is self.root or u.reduced:
            return
        u.pending -= 1
        if u.pending == 0:
            self._reduce(u)

    def _reduce(self, u: ShardedUnit) -> None:
        u.reduced = True
        u.ensure_grad()
        while len(self._reductions) - self._settled >= REDUCING_AT_ONCE:   # room for this unit's buffer
            self._reductions[self._settled].settle()
            self._settled += 1
        handle = u.reduce_micro_batch(self.reductions)
        if u is not self.root:
            u.release()
        if handle is not None:
            self._reductions.append(handle)

    # Update.

    def gradients(self) -> Gradients:
        """Finish the step's gradient reduction: this rank's piece of every unit's gradient
        (one fp32 tensor per piece of `master`), still sums over micro-batches of the scaled
        losses, with what makes them the mean unscaled gradient and that gradient's global
        norm (every rank's shard counted once), both on the device: nothing here waits for
        it. The next backward starts the next step's gradient."""
        if not self._micro_batches:
            raise RuntimeError("step() needs at least one backward() since the last step (the optimizer's step "
                               "asks the engine for the gradients of the backward passes since)")
        for u in self.units:   # the root, and what a forward without its backward kept (reshard_after_forward)
            u.release()
        for handle in self._reductions:
            handle.wait()
        self._reductions, self._settled = [], 0
        scale = 1.0 / (self._micro_batches * self.loss_scale)
        self._micro_batches = 0
        grads = [u.ensure_grad() for u in self.units]
        norm = self._finish_gradients(grads).sqrt() * scale
        for u in self.units:
            u.grad = None   # the optimizer holds this step's; the next backward starts anew
        self._mark("update", None)
        return Gradients(grads, norm, scale)

    def _finish_gradients(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Complete every unit's gradient into the optimizer's; the sum of its squares over
        all ranks (each shard counted once), as a tensor on the device."""
        squares = torch.zeros(1, dtype=torch.float32, device=self.device)

        def task() -> None:
            for u in self.units:
                u.finish_gradients(self.reductions)
            norms = torch.stack(torch._foreach_norm(grads))
            squares.copy_(torch.dot(norms * norms, self._norm_weights))
            self.reductions.all_reduce(None, squares, Scope.N)
        if self.layout.world == 1:   # nothing to communicate: no lane hand-off
            task()
        else:
            self.reductions.submit(task, *grads, squares, what="gradient reduction and norm").wait()
        return squares[0]

    # Tracing.

    @contextmanager
    def traced(self):
        """Record what the engine does inside the block (shard/engine/trace.py): its computations,
        lane tasks with their collectives, and waits, in program order."""
        trace = StepTrace()
        self._trace = self.gathers.trace = self.reductions.trace = trace
        try:
            yield trace
        finally:
            self._trace = self.gathers.trace = self.reductions.trace = None

    def _mark(self, kind: str, u: Optional[ShardedUnit]) -> None:
        if self._trace is not None:
            self._trace.compute(kind, None if u is None else u.name)

    # Reports.

    def memory_report(self) -> dict:
        """Bytes per rank of parameters, gradients and optimizer state (ShardedAdamW's: the
        master weights and both moments) as this strategy holds them (PaRO Table 2's P, G
        and OS, padding included; P only where it is a buffer of its own, not the master
        weights), and the element counts."""
        return {
            "parameters": sum(u.params.numel() * u.params.element_size() for u in self.units if not u.local_refresh),
            "gradients": sum(4 * u.os_numel
                             + (0 if u.direct else u.flat.padded // self.layout.shards(u.strategy.grads)
                                * self.reduce_dtype.itemsize) for u in self.units),
            "optimizer": OPTIMIZER_BYTES * self.master.numel(),
            "numel": sum(u.flat.numel for u in self.units),
            "padded_numel": sum(u.flat.padded for u in self.units),
            "units": {u.name: {"numel": u.flat.numel, "padded": u.flat.padded, "strategy": u.strategy.letters}
                      for u in self.units},
        }

    def comm_report(self, reset: bool = False) -> dict:
        """Bytes this rank sent per stage (forward, backward, update), intra-group and
        inter-group, since the engine was built or last reset; seconds each communication
        lane was busy and seconds the training loop waited for it (exposed), and its longest
        single wait (longest_wait_s, with what it waited for: longest_wait); seconds it
        waited for lane tasks that sent nothing (other_waits_s; longest_other_wait_s,
        longest_other_wait: which); how many
        parameter gathers units needed and how many of them prefetch had started."""
        report = {stage: dict(self.ledger.sent[stage]) for stage in STAGES}
        report["busy_s"] = dict(self.ledger.busy)
        report["exposed_s"] = self.ledger.exposed
        report["longest_wait_s"], report["longest_wait"] = self.ledger.longest_wait
        report["other_waits_s"] = self.ledger.other
        report["longest_other_wait_s"], report["longest_other_wait"] = self.ledger.longest_other
        report["gathers"] = dict(self.gather_stats)
        if reset:
            self.ledger.reset()
            self.gather_stats = {"needed": 0, "prefetched": 0}
        return report

    # State.

    def full_state_dict(self) -> Optional[dict]:
        """A plain state dict with the model's own keys (fp32 master values in each
        parameter's original dtype) in host memory on rank 0; None elsewhere. The units
        are gathered one at a time: no device ever holds the whole model. Collective."""
        values: dict[int, torch.Tensor] = {}
        for u, view in zip(self.units, self._os_views):
            full = torch.empty(u.flat.padded, dtype=torch.float32, device=self.device)
            self.gathers.submit(lambda u=u, view=view, full=full: self.gathers.gather(
                None, full, view, u.strategy.optimizer, Scope.N), full).wait()
            if self.layout.rank == 0:
                for p, v in zip(u.flat.params, u.flat.views(full)):
                    values[id(p)] = v.to("cpu", self._dtypes[id(p)], copy=True)
            del full
        if self.layout.rank != 0:
            return None
        return {k: values[id(v)] if id(v) in values else v.detach().to("cpu", copy=True)
                for k, v in self.model.state_dict(keep_vars=True).items()}

    def state_dict(self) -> dict:
        """This rank's part of the model's training state: each unit's piece of the fp32
        master weights, from which the parameters are refreshed, with where the piece lies,
        so a checkpoint (shard/engine/checkpoint.py, with the optimizer's state_dict()) can
        place its elements at another world size or strategy. The tensors are views of the
        live state, as in nn.Module.state_dict: clone them to keep a snapshot.

        Keys: world, group, strategy (letters); units: per unit, name, params (names),
        shapes, offsets (of the parameters in the unit's flat buffer), padded (its length),
        start and end (this rank's piece of it), first_replica (no lower rank holds the
        same piece), and master (the piece)."""
        offsets = self._os_offsets
        return {
            "world": self.layout.world, "group": self.layout.group, "strategy": self.strategy.letters,
            "units": [{"name": u.name, "params": list(u.flat.names), "shapes": [list(s) for s in u.flat.shapes],
                       "offsets": list(u.flat.offsets), "padded": u.flat.padded, "start": u.os_span[0],
                       "end": u.os_span[1], "first_replica": self.layout.is_first_replica(u.strategy.optimizer),
                       "master": self.master[a:b]}
                      for u, a, b in zip(self.units, offsets, offsets[1:])],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned on an engine holding the same pieces (world
        size, strategy and units); the parameters are refreshed from the restored master
        weights. Collective. Across world sizes, group sizes or strategies, go through a
        checkpoint, which places every element by parameter name."""
        mine = self.state_dict()
        difference = _placement_difference(state, mine)
        if difference is not None:
            raise ValueError(
                f"the state's units or pieces differ from this engine's: {difference}; to change world size, group "
                "size, strategy or units, go through a checkpoint (shard.engine.checkpoint: save, load)")
        for piece, target in zip(state["units"], mine["units"]):
            target["master"].copy_(piece["master"])
        self._refresh("update")
        self.ledger.reset()   # restoring is not training traffic

    def barrier(self) -> None:
        """Every rank reached this point (after the reductions queued before it)."""
        self.reductions.submit(self.reductions.barrier).wait()

    def agree(self, value: int) -> int:
        """Rank 0's `value`, on every rank (after the reductions queued before it)."""
        token = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.reductions.submit(lambda: self.reductions.broadcast(token), token).wait()
        return int(token.item())

    def total(self, value: int) -> int:
        """The sum of every rank's `value`, on every rank (a tiny all-reduce on the reduction
        lane): how many ranks failed, for instance."""
        token = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.reductions.submit(lambda: self.reductions.all_reduce(None, token, Scope.N), token).wait()
        return int(token.item())

    def close(self) -> None:
        """Stop the communication threads and free the lanes' communicators (NCCL ones hold
        GPU memory): every rank calls it, after its last collective."""
        self.gathers.close()
        self.reductions.close()
