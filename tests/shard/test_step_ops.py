"""What a training step costs in operations, counted by a TorchDispatchMode that sees every
op torch runs: no wasted copies at world 1, an update whose ops do not grow with the model,
and nothing that waits for the device inside the step (on GPUs a `.item()` or a
device-to-host copy blocks the host until the queue drains)."""
import dataclasses
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shard.engine.engine import Engine
from shard.engine.optimizer import ShardedAdamW
from shard.models import GPT, GPTConfig
from shard.models.loss import next_token_loss

COPIES = {"aten.copy_.default", "aten._to_copy.default", "aten.clone.default"}
VIEWS = {"aten.slice.Tensor", "aten.view.default", "aten.alias.default"}   # no kernel: a view per gradient piece
SYNCS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.item.default"}


class Ops(TorchDispatchMode):
    """Every op run while active: its name, and for copies (dst dtype, src dtype, numel)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.copies: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        self.names.append(name)
        if name in COPIES:
            src = args[1] if name == "aten.copy_.default" else args[0]
            dst = args[0] if name == "aten.copy_.default" else out
            self.copies.append((dst.dtype, src.dtype, dst.numel()))
        return out


def gpt(layers: int, width: int = 128) -> GPTConfig:
    return GPTConfig(vocab=256, context=16, width=width, layers=layers, heads=4)


def built(comm, engines: list, cfg: GPTConfig, clip=None, **settings) -> ShardedAdamW:
    """A GPT of `cfg` in an engine of `settings`, and its optimizer (which holds it: .engine)."""
    engines.append(Engine(GPT(cfg, seed=0), comm, **settings))
    return ShardedAdamW(engines[-1], grad_clip=clip)


def train(optimizer: ShardedAdamW, cfg: GPTConfig, steps: int = 2) -> torch.Tensor:
    tokens = torch.randint(0, cfg.vocab, (1, 9), generator=torch.Generator().manual_seed(0))
    engine = optimizer.engine
    for _ in range(steps):
        loss = next_token_loss(engine, tokens)
        engine.backward(loss)
        optimizer.step()
    return tokens


@pytest.mark.parametrize("strategy", ["zero3", "ddp", "paro-iig"])
def test_a_world_1_step_copies_parameters_only_to_cast_them(comm, engines, strategy):
    """bf16 on one rank: no copy of a parameter-sized tensor into its own dtype (no gather,
    no staging); the only parameter-sized copies are casts, each gradient once into the
    fp32 sum, each unit's parameters from the fp32 master weights for its forward and
    again for its backward (the root's once: it is held for the whole pass), since no bf16
    copy of the model is kept, and the head's weight gradient, which the fused loss sums
    over its chunks in fp32, into bf16."""
    cfg = gpt(3)
    optimizer = built(comm, engines, cfg, strategy=strategy, precision="bf16")
    engine = optimizer.engine
    tokens = train(optimizer, cfg)
    with Ops() as ops:
        engine.backward(next_token_loss(engine, tokens))
        optimizer.step()
    big = cfg.width * cfg.width   # the smallest weight matrix; activations here are far smaller
    copies = [c for c in ops.copies if c[2] >= big]
    assert not [c for c in copies if c[0] == c[1]], copies
    matrices = sum(shape.numel() >= big for u in engine.units for shape in u.flat.shapes)   # released ones too
    to_fp32 = [c for c in copies if c[0] == torch.float32]
    to_bf16 = [c for c in copies if c[0] == torch.bfloat16]
    assert len(to_fp32) == matrices, copies
    units = [u.flat.padded for u in engine.units if u is not engine.root] * 2 + [engine.root.flat.padded]
    head = cfg.vocab * cfg.width
    assert sorted(c[2] for c in to_bf16) == sorted([n for n in units if n >= big] + [head]), copies


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_step_runs_the_same_ops_however_many_units_and_never_waits_for_the_device(comm, engines, precision, clip):
    """optimizer.step() on one rank: the same operations for 2 and for 6 transformer blocks (the
    update is fused: AdamW, the norm, the clipping factor and the refresh each take a
    fixed number of kernels; views of each unit's gradient launch none), and no read of
    a device value anywhere in the step: not in forward, backward or step (whether to
    skip, clip or rescale is decided on the device)."""
    steps = {}
    for layers in (2, 6):
        cfg = gpt(layers, width=64)
        optimizer = built(comm, engines, cfg, clip, strategy="zero3", precision=precision)
        engine = optimizer.engine
        tokens = train(optimizer, cfg)
        with Ops() as whole:
            loss = next_token_loss(engine, tokens)
            engine.backward(loss)
            with Ops() as step:
                result = optimizer.step()
        steps[layers] = Counter(n for n in step.names if n not in VIEWS)
        assert not [n for n in whole.names if n in SYNCS], Counter(whole.names)
        assert result.grad_norm > 0 and not result.skipped   # read after the step: here it may wait
    assert steps[2] == steps[6]
    assert steps[2]["aten._fused_adamw_.default"] <= 2   # decayed and not decayed


def test_non_finite_gradients_skip_the_update_on_the_device(comm, engines):
    """An inf in one gradient: the step leaves master weights, moments and the step count as
    they were, and says so when read; the next finite step updates as usual."""
    cfg = gpt(2, width=64)
    optimizer = built(comm, engines, cfg, strategy="zero3")
    engine = optimizer.engine
    tokens = train(optimizer, cfg, steps=1)
    state = lambda: {"master": engine.master, **optimizer.adamw.moments()}  # noqa: E731
    before = {k: v.clone() for k, v in state().items()}
    loss = next_token_loss(engine, tokens)
    engine.model.blocks[0].attn.qkv.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    engine.backward(loss)
    result = optimizer.step()
    assert result.skipped and result.grad_norm != result.grad_norm   # nan
    assert all(torch.equal(before[k], v) for k, v in state().items())
    assert (optimizer.steps, optimizer.skipped_steps, optimizer.adamw.steps) == (1, 1, 1)


@pytest.mark.parametrize("strategy", ["zero3", "paro-iig"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_compiled_units_train_as_the_eager_engine(comm, engines, strategy, checkpointing, positions):
    """compile= compiles each unit's forward, and each module the model calls outside its
    units (the tied embedding, and the head with its loss); the engine's hooks stay outside
    it (they still see every unit, in order) and training gives the eager engine's losses.
    aot_eager: the graphs torch.compile captures, run without generating code (fast on CPU).
    Rotary positions with checkpointing: the table made inside the first compiled forward
    traced another graph than the recomputation, and torch's checkpoint refused the step."""
    cfg = dataclasses.replace(gpt(2, width=64), positions=positions)
    losses = {}
    for compiled in (False, "aot_eager"):
        optimizer = built(comm, engines, cfg, strategy=strategy, compile=compiled,
                          activation_checkpointing=checkpointing)
        engine = optimizer.engine
        tokens = torch.randint(0, cfg.vocab, (2, 9), generator=torch.Generator().manual_seed(0))
        losses[compiled] = []
        for _ in range(3):
            loss = next_token_loss(engine, tokens)
            engine.backward(loss)
            optimizer.step()
            losses[compiled].append(loss.item())
        assert [u.name for u in engine._forward_order] == [u.name for u in engine.units if u is not engine.root]
        modules = [engine.model.embed, engine.model.head]   # the root's (a checkpointed unit's forward wraps its own)
        modules += [] if checkpointing else [u.unit.module for u in engine.units if u is not engine.root]
        assert [hasattr(m.forward, "_torchdynamo_orig_callable") for m in modules] == [bool(compiled)] * len(modules)
    assert losses["aot_eager"] == pytest.approx(losses[False], rel=1e-5)


def test_each_compiled_module_class_keeps_its_own_budget_of_compiled_variants(comm, engines):
    """dynamo compiles at most recompile_limit (8) variants (shapes, grad modes) per code
    object and runs the rest uncompiled; torch's own wrapper for a torch.nn module's forward
    is one code object for all of them. A GPT trained, then evaluated without gradients at
    three shapes, then trained again: each compiled module class has a budget of its own, so
    no variant is refused (with torch's wrapper, the root's embeddings and LayerNorm filled
    the one budget and the ninth variant was refused: fail_on_recompile_limit_hit raises)."""
    cfg = dataclasses.replace(gpt(2, width=64), context=32)
    optimizer = built(comm, engines, cfg, strategy="zero3", precision="bf16", compile="aot_eager")
    engine = optimizer.engine
    tokens = torch.randint(0, cfg.vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for shapes in ([], [(2, 17), (1, 9), (3, 13)], []):
            for batch, length in shapes:
                with torch.no_grad():
                    next_token_loss(engine, torch.randint(0, cfg.vocab, (batch, length)))
            for _ in range(2):
                engine.backward(next_token_loss(engine, tokens))
                optimizer.step()
    compiled = [engine.model.embed, engine.model.head, *(u.unit.module for u in engine.units if u is not engine.root)]
    callers = {type(m): m.forward._torchdynamo_orig_callable.__code__ for m in compiled}
    assert len(set(callers.values())) == len(callers)   # one frame per class, shared by its instances


def test_one_rank_waits_for_no_communication(comm, engines):
    """A world of 1 hands nothing to the lanes: no exposed communication, no other waits."""
    cfg = gpt(2, width=64)
    optimizer = built(comm, engines, cfg, strategy="paro-iig", precision="bf16")
    train(optimizer, cfg)
    report = optimizer.engine.comm_report()
    assert report["exposed_s"] == report["other_waits_s"] == 0.0 and report["busy_s"] == {}, report
