"""The update, beside the engine: AdamW over the optimizer shards an Engine holds, with
global-norm clipping and fp16 dynamic loss scaling. As FSDP2 leaves the optimizer outside
`fully_shard`, the engine shards, gathers and reduces, and this steps the flat shards.

    engine = Engine(model, comm, strategy="zero3", precision="bf16")
    optimizer = ShardedAdamW(engine, lr=3e-4, grad_clip=1.0)   # or ShardedAdamW(engine, OptimizerConfig(...))
    engine.backward(loss)             # once per micro-batch
    result = optimizer.step()         # clip, update, refresh the parameters from the master weights

The optimizer asks the engine for the step's gradient (Engine.gradients: reduced, averaged
over ranks and micro-batches, with its global norm) and writes the engine's fp32 master
weights in place (FlatAdamW), then has the engine refresh its parameters. Under fp16 it
sets the loss scale the engine's backward multiplies by (Engine.loss_scale) and moves it
with each step's overflow; the engine only applies it. Nothing in a step waits for the
device: the clipping factor and whether to skip (non-finite gradients) are decided there.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from shard.engine.adamw import FlatAdamW
from shard.engine.config import OptimizerConfig
from shard.engine.engine import Engine


def default_decay(name: str, param: nn.Parameter) -> bool:
    """Decay matrices and embeddings, not biases and norm gains (nanoGPT, torchtitan)."""
    return param.dim() >= 2


class StepResult:
    """What a step did: grad_norm, the global norm of the averaged gradient before clipping
    (nan when not finite); skipped, whether its gradients were not finite so no update was
    made; loss_scale, the fp16 dynamic loss scale after it (1.0 otherwise). The optimizer
    leaves them on the device, so a step never waits for it: the first read copies all
    three to the host at once (and so waits for the step to finish)."""

    def __init__(self, grad_norm: float, skipped: bool, loss_scale: float):
        self._values = (grad_norm, skipped, loss_scale)

    @classmethod
    def on_device(cls, values: torch.Tensor) -> StepResult:
        """The result whose three values are `values`, read when first asked for."""
        result = cls(0.0, False, 1.0)
        result._values = values
        return result

    def _read(self) -> tuple:
        values = self._values
        if torch.is_tensor(values):
            values = (0.0, 0.0, 1.0) if values.is_meta else tuple(values.tolist())   # a dry run has no values
            self._values = values
        return values

    @property
    def grad_norm(self) -> float:
        norm = float(self._read()[0])
        return norm if math.isfinite(norm) else float("nan")

    @property
    def skipped(self) -> bool:
        return bool(self._read()[1])

    @property
    def loss_scale(self) -> float:
        return float(self._read()[2])

    def __eq__(self, other) -> bool:
        if not isinstance(other, StepResult):
            return NotImplemented
        mine, theirs = (self.grad_norm, self.skipped, self.loss_scale), (other.grad_norm, other.skipped,
                                                                         other.loss_scale)
        return all(a == b or (a != a and b != b) for a, b in zip(mine, theirs))

    def __repr__(self) -> str:
        return f"StepResult(grad_norm={self.grad_norm}, skipped={self.skipped}, loss_scale={self.loss_scale})"


class LossScaler:
    """fp16 dynamic loss scaling: halve on overflow (the step is skipped, never below 1),
    double after each `growth_interval` clean steps in a row. Kept on the device and
    updated there, so the step needs no value on the host. A no-op scale of 1 for bf16
    and fp32."""

    def __init__(self, enabled: bool, device, init: float = 2.0 ** 16, growth_interval: int = 2000):
        self.enabled, self.growth_interval = enabled, growth_interval
        # scale, clean steps since the last overflow (float64: exact counts)
        self._state = torch.tensor([init, 0.0], dtype=torch.float64, device=device) if enabled else None

    @property
    def factor(self):
        """What the loss is multiplied by: the scale on the device, or 1.0."""
        return self._state[0] if self.enabled else 1.0

    @property
    def scale(self) -> float:
        return float(self._state[0].item()) if self.enabled else 1.0

    @property
    def clean(self) -> int:
        return int(self._state[1].item()) if self.enabled else 0

    def load(self, scale: float, clean: int) -> None:
        if self.enabled:
            self._state.copy_(torch.tensor([scale, clean], dtype=torch.float64))

    def update(self, found_inf: torch.Tensor) -> None:
        """After a step: `found_inf` (1.0 or 0.0, on the device) says it overflowed."""
        if not self.enabled:
            return
        scale, clean = self._state.unbind()
        found = found_inf.to(torch.float64)
        clean = (clean + 1) * (1 - found)
        grow = (clean > 0) & (torch.remainder(clean, self.growth_interval) == 0)
        scale = torch.where(found > 0, torch.clamp(scale / 2, min=1.0), torch.where(grow, scale * 2, scale))
        self._state.copy_(torch.stack((scale, clean)))


class ShardedAdamW:
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments) over the
    flat fp32 master weights of an Engine's optimizer shard, with global-norm clipping
    (torch.nn.utils.clip_grad_norm_'s) and, under fp16, dynamic loss scaling."""

    def __init__(self, engine: Engine, config: Optional[OptimizerConfig] = None, *,
                 decay: Callable[[str, nn.Parameter], bool] = default_decay, **settings):
        """AdamW over `engine`'s optimizer shards. config: an OptimizerConfig, or its fields as
        keywords (lr=, betas=, eps=, weight_decay=, grad_clip=), not both. decay(name, param):
        which parameters weight decay applies to (`param`: of the model's shape and dtype)."""
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be a shard.Engine, got {type(engine).__name__}: ShardedAdamW steps the "
                            "optimizer shards an Engine holds (torch optimizers take model.parameters())")
        self.config = OptimizerConfig.given(config, settings)
        self.engine = engine
        self.lr = float(self.config.lr)   # a schedule sets it before each step
        decayed = [(a, b) for name, p, a, b in engine.spans() if decay(name, p)]
        self.adamw = FlatAdamW(engine.master, decayed, self.config.betas, self.config.eps, self.config.weight_decay,
                               pieces=engine.pieces)
        self.scaler = LossScaler(engine.compute_dtype == torch.float16, engine.device)
        engine.loss_scale = self.scaler.factor   # a view of the scaler's state: its updates reach the engine
        self._counts = torch.zeros(2, dtype=torch.float64, device=engine.device)   # steps made, skipped

    def step(self) -> StepResult:
        """Finish the step's gradient (the engine's), clip it, update with AdamW, refresh the
        parameters. Nothing in it waits for the device; the result stays there until read."""
        g = self.engine.gradients()
        found_inf = (~torch.isfinite(g.norm)).to(torch.float32)
        scale, clip = g.scale, self.config.grad_clip
        if clip is not None:   # torch.nn.utils.clip_grad_norm_'s factor, applied with the mean's
            scale = torch.clamp(clip / (g.norm + 1e-6), max=1.0) * scale
        if torch.is_tensor(scale) or scale != 1.0:
            torch._foreach_mul_(g.pieces, scale)
        self.adamw.step(self.lr, g.pieces, found_inf)
        self._counts.add_(torch.stack((1 - found_inf, found_inf)).to(self._counts.dtype))
        self.scaler.update(found_inf)
        self.engine.refresh()
        loss_scale = self.scaler.factor if self.scaler.enabled else torch.ones_like(found_inf)
        return StepResult.on_device(torch.stack((g.norm.float(), found_inf, loss_scale.float())))

    @property
    def steps(self) -> int:
        """Updates made (reading it waits for the device)."""
        return int(self._counts[0].item())

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (reading it waits for the device)."""
        return int(self._counts[1].item())

    def state_dict(self) -> dict:
        """The counters, the loss scale, and each of the engine's unit pieces' moments (views of
        the live state: clone them to keep a snapshot). With the engine's state_dict(), what a
        checkpoint holds (shard/engine/checkpoint.py)."""
        state, offsets = self.adamw.moments(), [*self.engine.pieces, self.engine.master.numel()]
        return {"steps": self.steps, "skipped_steps": self.skipped_steps, "optimizer_steps": self.adamw.steps,
                "loss_scale": self.scaler.scale, "loss_scale_clean": self.scaler.clean,
                "units": [{k: v[a:b] for k, v in state.items()} for a, b in zip(offsets, offsets[1:])]}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned for an engine holding the same pieces."""
        mine = self.state_dict()
        ours = [[v.shape for v in u.values()] for u in mine["units"]]
        theirs = [[piece[k].shape for k in target] for piece, target in zip(state["units"], mine["units"])]
        if len(state["units"]) != len(mine["units"]) or theirs != ours:
            raise ValueError("the state's moments do not match this optimizer's pieces (the engine's units and "
                             "shards); to change world size or strategy, go through a checkpoint")
        for piece, target in zip(state["units"], mine["units"]):
            for k, v in target.items():
                v.copy_(piece[k])
        self._counts.copy_(torch.tensor([state["steps"], state["skipped_steps"]], dtype=self._counts.dtype))
        self.adamw.steps = state["optimizer_steps"]
        self.scaler.load(state["loss_scale"], state["loss_scale_clean"])


