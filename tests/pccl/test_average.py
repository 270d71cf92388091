"""op avg's last step, a true division by the rank count, alike on every device
(pccl.core.dtypes.average_ for the Python executors and plans; the native kernels are in
test_kernels.py)."""
import pytest
import torch

from pccl.core.dtypes import average_, divide_by_tensor_
from tests.support.gpu import no_gpu_reason

HALF_TYPES = [torch.float16, torch.bfloat16]
SIZES = [3, 5, 6, 255, 257, 1000, 4097, 65537]   # 257 and up: not every half type holds them


def every_value(dtype):
    """All 65536 bit patterns of a 16-bit float type, infinities and NaNs included."""
    return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def same_values(actual, expected):
    nan = torch.isnan(expected)
    return torch.equal(torch.isnan(actual), nan) and torch.equal(actual[~nan], expected[~nan])


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("size", SIZES)
def test_the_device_path_divides_every_half_value_as_the_cpu_does(dtype, size):
    """GPUs divide by a divisor tensor (divide_by_tensor_). On the CPU torch treats a 0-dim
    divisor like a number, so what this checks is the choice of divisor: the half type
    where it holds size exactly, float (one rounding) where it cannot (bf16 257, fp16 4097;
    fp16 rounds 65537 to inf)."""
    x = every_value(dtype)
    mine = x.clone()
    divide_by_tensor_(mine, size)
    assert same_values(mine, x / size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", SIZES)
def test_the_device_path_divides_full_types_as_the_cpu_does(dtype, size):
    x = torch.randn(4099, generator=torch.Generator().manual_seed(size), dtype=torch.float64).mul(1e3).to(dtype)
    mine = x.clone()
    divide_by_tensor_(mine, size)
    assert torch.equal(mine, x / size) and not torch.equal(mine, x * (1 / size))


@pytest.mark.gpu
@pytest.mark.skipif(no_gpu_reason(nccl=False) is not None, reason=str(no_gpu_reason(nccl=False)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("size", [3, 4, 6, 257, 65537])
def test_on_a_gpu_average_is_the_cpus_true_division(dtype, size):
    x = (torch.randn(4099, generator=torch.Generator().manual_seed(size)) * 100).to(dtype)
    on_gpu = x.cuda()
    average_(on_gpu, size)
    assert torch.equal(on_gpu.cpu(), x / size)
