"""Element types and reduction operators, with the codes the native layer uses."""
from __future__ import annotations

from functools import lru_cache

import torch

# (name the command-line tools use, as nccl-tests names it; torch dtype; native code)
_TABLE = (
    ("float", torch.float32, 0),
    ("double", torch.float64, 1),
    ("half", torch.float16, 2),
    ("bfloat16", torch.bfloat16, 3),
    ("int32", torch.int32, 4),
    ("int64", torch.int64, 5),
)
DTYPES = {dtype: code for _, dtype, code in _TABLE}
DATATYPES = {name: dtype for name, dtype, _ in _TABLE}
OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3}
# Dtypes whose reductions run apart from the others', so that auto measures and chooses for
# them apart: MPI has no fp16/bf16, so pccl reduces them through user-defined MPI operations
# (its own kernels) where MPI's built-in ones reduce fp32, fp64 and the integers.
HALF = (torch.float16, torch.bfloat16)
REDUCTION_CLASSES = ("full", "half")
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}   # a float's bits, by its size


def reduction_class(dtype: torch.dtype) -> str:
    """"half" for fp16 and bf16, else "full": the class auto's calibration is kept per."""
    return "half" if dtype in HALF else "full"


def reduce_(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    """dst = op(dst, src) in place, for an op of OPS (avg reduces as sum: its caller
    divides once at the end)."""
    if op in ("sum", "avg"):
        dst.add_(src)
        return
    # The native kernels' rule (csrc/extrema.h): a NaN on either side wins, as torch.maximum
    # has it; between +0 and -0, max is +0 and min -0, where torch returns either operand.
    # Ties take the AND (max) or the OR (min) of the two bit patterns: equal values have
    # equal bits, except zeros, whose sign alone moves.
    if not dst.is_floating_point():
        (torch.maximum if op == "max" else torch.minimum)(dst, src, out=dst)
        return
    bits, theirs = dst.view(_BITS[dst.element_size()]), src.view(_BITS[dst.element_size()])
    tied = dst == src
    tie = bits & theirs if op == "max" else bits | theirs
    (torch.maximum if op == "max" else torch.minimum)(dst, src, out=dst)
    torch.where(tied, tie, bits, out=bits)


def average_(tensor: torch.Tensor, size: int) -> None:
    """tensor /= size in place: op avg's last step, after a sum over `size` ranks. A true
    division, as the native CPU and GPU kernels divide, so avg has one meaning everywhere.
    torch divides truly on CPUs, but its CUDA and ROCm kernels multiply by the reciprocal of a
    Python-number divisor (x * float(1/3) and x / 3 differ in about a third of all values)."""
    if tensor.device.type == "cpu" or size & (size - 1) == 0:   # a power of two: both are exact
        tensor.div_(size)
    else:
        divide_by_tensor_(tensor, size)


def divide_by_tensor_(tensor: torch.Tensor, size: int) -> None:
    """tensor /= size with the divisor a tensor on tensor's device, which torch divides by on
    every device. A half type that cannot hold `size` exactly divides in float and rounds once."""
    divisor = _divisor(size, tensor.dtype, tensor.device)
    if divisor.dtype == tensor.dtype:
        tensor.div_(divisor)
    else:
        tensor.copy_(tensor.float().div_(divisor))


@lru_cache(maxsize=None)
def _divisor(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`size` as a tensor on `device`: of `dtype` where that holds it exactly, else float32."""
    exact = torch.tensor(size, dtype=dtype).item() == size   # (fp16 rounds 65537 to inf)
    return torch.tensor(size, dtype=dtype if exact else torch.float32, device=device)


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES[dtype]


def op_code(op: str, dtype: torch.dtype) -> int:
    """Validate `op` for `dtype` and return its code. avg = sum, then divide by the size."""
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"op must be one of {tuple(OPS)}, got {op!r}")
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(f"op 'avg' needs a floating-point dtype, got {dtype}; use 'sum' for integers")
    return OPS[op]
