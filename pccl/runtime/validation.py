"""Argument checks run before anything is sent, so bad input never leaves peers waiting."""
from __future__ import annotations

import torch

from pccl.core.dtypes import DTYPES


def check_tensor(name: str, t, devices: tuple[str, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported dtypes are {tuple(str(d) for d in DTYPES)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")
    if t.device.type not in devices:
        raise ValueError(f"{name} is on device {t.device}; this communicator supports {devices}")


def check_pair(output: torch.Tensor, input: torch.Tensor) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"output and input dtypes differ: output is {output.dtype}, input is {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"output and input are on different devices: output on {output.device}, "
                         f"input on {input.device}")


def check_blocks(output: torch.Tensor, input: torch.Tensor, full: str, size: int, devices: tuple[str, ...]) -> None:
    """An (output, input) pair whose `full` side holds `size` blocks of the other."""
    check_tensor("output", output, devices)
    check_tensor("input", input, devices)
    check_pair(output, input)
    big, small = (output, input) if full == "output" else (input, output)
    other = "input" if full == "output" else "output"
    check_numel(full, big.numel(), size * small.numel(), f"size * {other}.numel() = {size} * {small.numel()}")


def check_numel(name: str, actual: int, expected: int, why: str) -> None:
    if actual != expected:
        raise ValueError(f"{name}.numel() must be {expected} ({why}), got {actual}")


def check_root(root, size: int) -> None:
    if not (isinstance(root, int) and not isinstance(root, bool) and 0 <= root < size):
        raise ValueError(f"root must be a rank of this communicator, 0..{size - 1}, got {root!r}")
