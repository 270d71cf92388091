"""The C++ reduction kernels against torch, element by element (single process)."""
import pytest
import torch
from mpi4py import MPI  # noqa: F401 - loads libmpi for the native module

from pccl import _native
from pccl.dtypes import DTYPES, OPS

TORCH_REF = {
    "sum": torch.add,
    "avg": torch.add,  # avg reduces as sum; the caller scales once at the end
    "max": torch.maximum,
    "min": torch.minimum,
}


def sample(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
    return torch.randint(-2**30, 2**30, (n,), generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("n", [0, 1, 7, 64, 1000, 4099])
@pytest.mark.parametrize("in_place", [True, False])
def test_reduce_matches_torch(dtype, op, n, in_place):
    a, b = sample(dtype, n, 1), sample(dtype, n, 2)
    expected = TORCH_REF[op](a, b)
    dst = a if in_place else torch.full_like(a, 3)
    _native.reduce(dst.data_ptr(), a.data_ptr(), b.data_ptr(), n, DTYPES[dtype], OPS[op])
    # Same rounding as torch: widen to float, combine, round to nearest even.
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_scale_matches_torch(dtype):
    a = sample(dtype, 1001, 3)
    expected = (a.float() * (1 / 3)).to(dtype) if dtype != torch.float64 else a * (1 / 3)
    _native.scale(a.data_ptr(), a.numel(), DTYPES[dtype], 1 / 3)
    assert torch.equal(a, expected)


def test_scale_refuses_integers():
    a = torch.ones(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="floating-point"):
        _native.scale(a.data_ptr(), 4, DTYPES[torch.int32], 0.5)


def test_bf16_rounds_to_nearest_even_and_keeps_nan():
    a = torch.tensor([1.0, float("nan"), 3.0e38, -0.0], dtype=torch.bfloat16)
    b = torch.tensor([2**-8, 1.0, 3.0e38, 0.0], dtype=torch.bfloat16)
    expected = torch.add(a, b)
    _native.reduce(a.data_ptr(), a.data_ptr(), b.data_ptr(), 4, DTYPES[torch.bfloat16], OPS["sum"])
    assert torch.equal(a[[0, 2, 3]], expected[[0, 2, 3]]) and torch.isnan(a[1])
