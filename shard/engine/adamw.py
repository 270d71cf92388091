"""AdamW over one flat fp32 buffer: this rank's optimizer-state shard of every unit.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments), done
by torch's fused AdamW kernel (`torch._fused_adamw_`, what `AdamW(fused=True)` runs; on
CPUs and GPUs) over two lists of views: the stretches of the shard that belong to decayed
parameters (by default those with two or more dimensions, as nanoGPT and torchtitan do)
and the rest. The gradient is not the optimizer's: each step takes one tensor per piece of
the buffer (the engine's units), which the engine holds only from a step's first gradient
to its update, as `zero_grad(set_to_none=True)` leaves eager PyTorch's. So a step is the
same few kernels however many units and parameters there are, reads each element once, and
never asks the host anything: the step count lives on the device, and a step whose
gradients were not finite (`found_inf`) leaves everything, the count included, as it was
(as torch's GradScaler does), with no synchronization.
"""
from __future__ import annotations

from typing import Optional

import torch

OPTIMIZER_BYTES = 12   # per element: fp32 master weights and two fp32 moments


def _stretches(decayed: list[tuple[int, int]], numel: int) -> tuple[list, list]:
    """[start, end) stretches with and without weight decay, covering [0, numel)."""
    on, off, at = [], [], 0
    for a, b in sorted((a, b) for a, b in decayed if b > a):
        if a > at:
            off.append((at, a))
        on.append((a, b))
        at = b
    if at < numel:
        off.append((at, numel))
    return on, off


class FlatAdamW:
    def __init__(self, master: torch.Tensor, decayed: list[tuple[int, int]], betas: tuple[float, float],
                 eps: float, weight_decay: float, pieces: Optional[list[int]] = None):
        """decayed: the [start, end) stretches of `master` weight decay applies to; pieces:
        the offsets where the gradient's pieces start (default: one piece, the whole)."""
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError(f"master weights must be a flat fp32 tensor, got {master.dtype} {tuple(master.shape)}")
        self.master = master
        self.exp_avg = torch.zeros_like(master)
        self.exp_avg_sq = torch.zeros_like(master)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        # updates made: fp32 as the fused kernel reads it (as torch.optim.AdamW's fused state;
        # it stops at 2**24, where the bias corrections are 1 anyway), and counted exactly
        self._count = torch.zeros((), dtype=torch.float32, device=master.device)
        self._updates = torch.zeros((), dtype=torch.float64, device=master.device)
        starts = sorted(set(pieces or [0]) | {0})
        self.pieces = [(a, b) for a, b in zip(starts, starts[1:] + [master.numel()]) if b > a]
        on, off = _stretches(decayed, master.numel())
        self._groups = []   # (the state's views, where each lies in the gradient's pieces, decay)
        for spans, decay in ((on, weight_decay), (off, 0.0)):
            cut = [(i, max(a, lo) - lo, min(b, hi) - lo) for a, b in spans
                   for i, (lo, hi) in enumerate(self.pieces) if max(a, lo) < min(b, hi)]
            if cut:
                views = [[t[self.pieces[i][0] + a:self.pieces[i][0] + b] for i, a, b in cut]
                         for t in (master, self.exp_avg, self.exp_avg_sq)]
                self._groups.append((views, cut, decay))

    @property
    def steps(self) -> int:
        """Updates made (reading it waits for the device)."""
        return int(self._updates.item())

    @steps.setter
    def steps(self, value: int) -> None:
        self._count.fill_(value)
        self._updates.fill_(value)

    def step(self, lr: float, grads: list[torch.Tensor], found_inf: Optional[torch.Tensor] = None) -> None:
        """One update with the (already averaged, clipped) gradient, one tensor per piece;
        none where `found_inf` (a float tensor on the device) is 1."""
        if [g.numel() for g in grads] != [b - a for a, b in self.pieces]:
            raise ValueError(f"gradient pieces of {[g.numel() for g in grads]} elements; the master weights' are "
                             f"{[b - a for a, b in self.pieces]}")
        made = 1 if found_inf is None else 1 - found_inf
        self._count.add_(made)
        self._updates.add_(made)
        beta1, beta2 = self.betas
        for (params, exp_avgs, exp_avg_sqs), cut, decay in self._groups:
            views = [grads[i][a:b] for i, a, b in cut]
            torch._fused_adamw_(params, views, exp_avgs, exp_avg_sqs, [], [self._count] * len(params), lr=lr,
                                beta1=beta1, beta2=beta2, weight_decay=decay, eps=self.eps, amsgrad=False,
                                maximize=False, grad_scale=None, found_inf=found_inf)

    def moments(self) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
