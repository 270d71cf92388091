"""Element types and reduction operators, with the codes the native layer uses."""
from __future__ import annotations

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


def reduce_(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    """dst = op(dst, src) in place, for an op of OPS (avg reduces as sum: its caller
    divides once at the end)."""
    if op in ("sum", "avg"):
        dst.add_(src)
    elif op == "max":
        torch.maximum(dst, src, out=dst)
    else:
        torch.minimum(dst, src, out=dst)


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES[dtype]


def op_code(op: str, dtype: torch.dtype) -> int:
    """Validate `op` for `dtype` and return its code. avg = sum, then divide by the size."""
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"op must be one of {tuple(OPS)}, got {op!r}")
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(f"op 'avg' needs a floating-point dtype, got {dtype}; use 'sum' for integers")
    return OPS[op]
