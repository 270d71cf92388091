"""Element types and reduction operators, with the codes the native layer uses."""
from __future__ import annotations

import torch

DTYPES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int32: 4,
    torch.int64: 5,
}
OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3}


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES[dtype]


def op_code(op: str, dtype: torch.dtype) -> int:
    """Validate `op` for `dtype` and return its code. avg = sum, then divide by the size."""
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"op must be one of {tuple(OPS)}, got {op!r}")
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(f"op 'avg' needs a floating-point dtype, got {dtype}; use 'sum' for integers")
    return OPS[op]
