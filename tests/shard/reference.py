"""The single-process reference the engine's equivalence workers (CPU and GPU) compare
with: the models, the global batches and each rank's micro-batches of them, AdamW on the
whole global batch, and the relative error of a state against it."""
from __future__ import annotations

import torch

from tests.shard.engine_models import MLP, TinyTransformer, mlp_batch, mlp_loss, token_batch, token_loss

STEPS, MICRO, PER_RANK = 3, 2, 2        # optimizer steps, micro-batches per step, samples each
# eps 1e-6: a gradient element that is zero up to rounding (2e-9 where others are 1e-2)
# gets the update lr * g / (|g| + eps). With eps 1e-8 that is a sixth of lr and follows
# the rounding, so summing the gradients in another order (sharded) moved such a weight
# by 6e-5 and the tensor by 1.2e-5 relative; with 1e-6 the worst tensor is at 7e-7.
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
MODELS = {"mlp": (MLP, mlp_batch, mlp_loss), "transformer": (TinyTransformer, token_batch, token_loss)}
# The engine runs each strategy is compared in: (model, clip, more engine settings).
RUNS = (("mlp", None, {}), ("transformer", 0.5, {}),
        ("mlp", 0.5, {"prefetch": 0, "activation_checkpointing": True}),
        ("transformer", None, {"prefetch": 3, "algorithm": "native"}))


def sharded(model, comm, clip=None, **settings):
    """(an Engine over `model` with the engine `settings`, its ShardedAdamW with HYPER and
    `clip`): what the references are compared with."""
    from shard import Engine, ShardedAdamW

    engine = Engine(model, comm, **settings)
    return engine, ShardedAdamW(engine, grad_clip=clip, **HYPER)


def reference_optimizer(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": HYPER["weight_decay"]},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"])


def global_batch(kind: str, step: int, ranks: int, micro: int = MICRO, device="cpu"):
    return tuple(t.to(device) for t in MODELS[kind][1](step, ranks * micro * PER_RANK))


def my_micro_batch(batch, j: int, ranks: int, rank: int):
    """Rank `rank`'s j-th micro-batch of a global batch."""
    at = (j * ranks + rank) * PER_RANK
    return tuple(t[at:at + PER_RANK] for t in batch)


def reference_run(kind: str, steps: int, clip, ranks: int, device="cpu", seed: int = 0):
    """Single-process AdamW on the whole global batch each step: losses and final state
    (on the CPU)."""
    torch.manual_seed(seed)
    model = MODELS[kind][0]().to(device)
    opt = reference_optimizer(model)
    losses = []
    for step in range(steps):
        x, y = global_batch(kind, step, ranks, device=device)
        loss = MODELS[kind][2](model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def relative_error(state: dict, reference: dict) -> float:
    """The largest relative difference, in norm, of a tensor of `state` from `reference`."""
    worst = 0.0
    for k, ref in reference.items():
        diff = (state[k].cpu().double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)
        worst = max(worst, diff.item())
    return worst


def compared(losses: list, state: dict, reference: tuple) -> dict:
    """An engine run's losses and final state against reference_run's: the relative
    error of the state and the largest relative loss difference."""
    ref_losses, ref_state = reference
    return {"error": relative_error(state, ref_state),
            "loss_error": max(abs(a - b) / b for a, b in zip(losses, ref_losses))}
