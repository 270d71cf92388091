"""AdamW over one flat fp32 buffer: this rank's optimizer-state shard of every unit.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments), done
as a handful of vectorized operations over the whole shard instead of a loop over
tensors. Weight decay applies to the stretches of the shard that belong to decayed
parameters (by default those with two or more dimensions, as nanoGPT and torchtitan do).
"""
from __future__ import annotations

import math

import torch

OPTIMIZER_BYTES = 12   # per element: fp32 master weights and two fp32 moments


class FlatAdamW:
    def __init__(self, master: torch.Tensor, decayed: list[tuple[int, int]], betas: tuple[float, float],
                 eps: float, weight_decay: float):
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError(f"master weights must be a flat fp32 tensor, got {master.dtype} {tuple(master.shape)}")
        self.master = master
        self.exp_avg = torch.zeros_like(master)
        self.exp_avg_sq = torch.zeros_like(master)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.steps = 0
        self._decayed = [master[a:b] for a, b in decayed if b > a]

    def step(self, grad: torch.Tensor, lr: float) -> None:
        """One update with the (already averaged, clipped) gradient shard; `grad` is used
        as scratch and holds garbage afterwards."""
        beta1, beta2 = self.betas
        self.steps += 1
        if self.weight_decay and self._decayed:
            torch._foreach_mul_(self._decayed, 1.0 - lr * self.weight_decay)
        self.exp_avg.lerp_(grad, 1.0 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        correction1 = 1.0 - beta1 ** self.steps
        correction2 = 1.0 - beta2 ** self.steps
        denom = torch.sqrt(self.exp_avg_sq, out=grad)
        denom.div_(math.sqrt(correction2)).add_(self.eps)
        self.master.addcdiv_(self.exp_avg, denom, value=-lr / correction1)

    def state(self) -> dict[str, torch.Tensor]:
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
