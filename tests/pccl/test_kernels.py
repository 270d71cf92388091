"""The C++ reduction kernels against torch, element by element (single process)."""
import pytest
import torch
from mpi4py import MPI  # noqa: F401 - loads libmpi for the native module

from pccl import _native
from pccl.core.dtypes import DTYPES, OPS, reduce_
from tests.pccl.workers.cases import reduce_reference

TORCH_REF = {
    "sum": torch.add,
    "avg": torch.add,  # avg reduces as sum; the caller divides once at the end
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
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("n", [7, 1000])   # the scalar tail, and the vector loop (AVX2 for fp32, fp16, bf16)
def test_max_and_min_keep_a_nan_on_either_side_as_torch_does(dtype, op, n):
    """A NaN one rank holds reaches every rank, whichever side of the kernel it arrives on
    (the schedule decides that): `a > b ? a : b` alone dropped it when it came as `a`."""
    a, b = sample(dtype, n, 1), sample(dtype, n, 2)
    a[::3], b[1::3] = float("nan"), float("nan")
    b[2::6] = float("inf") if op == "max" else -float("inf")
    expected = TORCH_REF[op](a, b)
    for first, second in ((a, b), (b, a)):
        dst = torch.empty_like(a)
        _native.reduce(dst.data_ptr(), first.data_ptr(), second.data_ptr(), n, DTYPES[dtype], OPS[op])
        assert torch.equal(dst.isnan(), expected.isnan()) and torch.equal(dst.nan_to_num(), expected.nan_to_num())


def zeros_of_both_signs(dtype, n):
    """Every pairing of +0 and -0 (a, b), repeated to n values, with some other values between."""
    a = torch.tensor([0.0, -0.0, 0.0, -0.0, 1.0, -0.0], dtype=dtype).repeat(n // 6 + 1)[:n]
    b = torch.tensor([0.0, 0.0, -0.0, -0.0, -0.0, -1.0], dtype=dtype).repeat(n // 6 + 1)[:n]
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("n", [6, 1000])   # the scalar loop, and the vector loop (AVX2 for fp32, fp16, bf16)
@pytest.mark.parametrize("kernel", ["native", "python"])
def test_max_and_min_of_zeros_sign_them_alike_in_either_order(dtype, op, n, kernel):
    """max(+0, -0) is +0 and min(+0, -0) is -0, whichever side each comes from (IEEE
    754-2019's maximum and minimum), in the C++ kernels and the Python executor's alike.
    torch.maximum returns either operand there, so a schedule's order of operands decided
    the sign and ranks ended with different zeros."""
    a, b = zeros_of_both_signs(dtype, n)
    expected = reduce_reference([a, b], op).to(dtype)
    assert expected.signbit()[:4].tolist() == ([False, False, False, True] if op == "max" else
                                               [False, True, True, True])
    for first, second in ((a, b), (b, a)):
        dst = first.clone()
        if kernel == "native":
            _native.reduce(dst.data_ptr(), first.data_ptr(), second.data_ptr(), n, DTYPES[dtype], OPS[op])
        else:
            reduce_(dst, second, op)
        assert torch.equal(dst, expected) and torch.equal(dst.signbit(), expected.signbit())


@pytest.mark.parametrize("name", ["int8", "bf16", "fp16"])
@pytest.mark.parametrize("op", ["max", "min"])
def test_decode_and_max_or_min_signs_zeros_as_the_kernels_do(name, op):
    """A decoded +0 or -0 met with the accumulator's zero of either sign (the codecs keep a
    zero's sign: int8's 0 * scale is +0)."""
    from pccl.compression.codecs import codec

    c = codec(name)
    a, b = zeros_of_both_signs(torch.float32, 300)
    encoded = torch.empty(c.encoded_nbytes(b.numel(), b.dtype), dtype=torch.uint8)
    c.encode(b, encoded)
    decoded = c.round_trip(b)
    acc = a.clone()
    c.decode(encoded, acc, op)
    expected = reduce_reference([a, decoded], op).float()
    assert torch.equal(acc, expected) and torch.equal(acc.signbit(), expected.signbit())


def true_quotient(a: torch.Tensor, divisor: int) -> torch.Tensor:
    """a / divisor correctly rounded to a's dtype, by numpy: float32 and float64 divide in
    their own type; half types in float64, rounded once (exact: a 53-bit quotient rounded
    to 11 or 8 bits is the correctly rounded one)."""
    if a.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(a.numpy() / a.numpy().dtype.type(divisor))
    return torch.from_numpy(a.double().numpy() / divisor).to(a.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("divisor", [1, 2, 3, 5, 7, 1000, 65537])
def test_divide_is_a_true_division_as_torch_and_numpy_divide(dtype, divisor):
    a = sample(dtype, 4099, 3)
    expected = a / divisor
    assert torch.equal(expected, true_quotient(a, divisor))
    _native.divide(a.data_ptr(), a.numel(), DTYPES[dtype], divisor)
    assert torch.equal(a, expected)


def test_divide_is_not_a_multiplication_by_the_reciprocal():
    # The bug this guards: x * float32(1/3) differs from x / 3 in about a third of values.
    a = sample(torch.float32, 4099, 3)
    by_reciprocal = a * torch.tensor(1 / 3, dtype=torch.float32)
    _native.divide(a.data_ptr(), a.numel(), DTYPES[torch.float32], 3)
    assert 0.2 < (a != by_reciprocal).float().mean() < 0.5


def test_divide_refuses_integers():
    a = torch.ones(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="floating-point"):
        _native.divide(a.data_ptr(), 4, DTYPES[torch.int32], 2)


def test_bf16_rounds_to_nearest_even_and_keeps_nan():
    a = torch.tensor([1.0, float("nan"), 3.0e38, -0.0], dtype=torch.bfloat16)
    b = torch.tensor([2**-8, 1.0, 3.0e38, 0.0], dtype=torch.bfloat16)
    expected = torch.add(a, b)
    _native.reduce(a.data_ptr(), a.data_ptr(), b.data_ptr(), 4, DTYPES[torch.bfloat16], OPS["sum"])
    assert torch.equal(a[[0, 2, 3]], expected[[0, 2, 3]]) and torch.isnan(a[1])


def every_value(dtype):
    """All 65536 bit patterns of a 16-bit float type, NaNs included."""
    return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def same_values(actual, expected):
    """Equal bit for bit, except that any NaN matches any NaN (payloads are not kept)."""
    nan = torch.isnan(expected)
    return torch.equal(torch.isnan(actual), nan) and torch.equal(actual[~nan], expected[~nan])


def in_pieces(kernel, tensors, n, *args, piece):
    """kernel(pointers..., count, *args) over all n elements at once (piece None), or in
    pieces of `piece` elements. Pieces shorter than a vector step (8 or 16 values) run the
    portable conversions, which other CPUs and every remainder use."""
    step = n if piece is None else piece
    for start in range(0, n, step):
        kernel(*(t.data_ptr() + start * t.element_size() for t in tensors), min(step, n - start), *args)


HALF_TYPES = [torch.float16, torch.bfloat16]
PATHS = pytest.mark.parametrize("piece", [None, 7], ids=["vector", "portable"])


@PATHS
@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_half_types_convert_every_value_as_torch_does(dtype, piece):
    # max(x, x) is a load to float and a store back, for every value: subnormals, zeros of
    # both signs, infinities and NaNs.
    a = every_value(dtype)
    out = torch.empty_like(a)
    in_pieces(_native.reduce, (out, a, a), a.numel(), DTYPES[dtype], OPS["max"], piece=piece)
    assert same_values(out, a)


@PATHS
@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("divisor", [2, 3, 7, 1000, 2**20, 65537])
def test_half_types_divide_like_torch(dtype, divisor, piece):
    # Dividing every value rounds results onto every part of the range: ties to even,
    # results that become subnormal or zero; infinities and NaNs stay what they are.
    a = every_value(dtype)
    expected = a / divisor
    in_pieces(_native.divide, (a,), a.numel(), DTYPES[dtype], divisor, piece=piece)
    assert same_values(a, expected)


@PATHS
@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_half_types_sum_every_value_with_a_shuffle_of_them(dtype, piece):
    a = every_value(dtype)
    b = a[torch.randperm(a.numel(), generator=torch.Generator().manual_seed(0))]
    expected = (a.float() + b.float()).to(dtype)
    in_pieces(_native.reduce, (a, a, b), a.numel(), DTYPES[dtype], OPS["sum"], piece=piece)
    assert same_values(a, expected)
