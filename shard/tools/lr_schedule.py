"""The learning-rate schedule: linear warmup, then cosine decay to a floor."""
from __future__ import annotations

import math
from typing import Optional


def learning_rate(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: Optional[int],
                  total_steps: int) -> float:
    """The rate of the update made at `step` (0-based): warmup reaches `lr` at step
    warmup_steps - 1 (step 0 without warmup), then a half cosine from that peak reaches
    `min_lr` `decay_steps` steps later (default: at the last step, total_steps - 1) and
    stays there. The peak is one step, not two: the cosine counts from it."""
    if warmup_steps < 0 or not 0 <= min_lr <= lr:
        raise ValueError(f"need warmup_steps >= 0 and 0 <= min_lr <= lr, got {warmup_steps}, {min_lr}, {lr}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    peak = max(warmup_steps - 1, 0)
    span = decay_steps if decay_steps is not None else max(1, total_steps - 1 - peak)
    if span < 1:
        raise ValueError(f"decay_steps must be >= 1, got {span}")
    progress = min(1.0, (step - peak) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
