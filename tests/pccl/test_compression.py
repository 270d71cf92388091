"""Collective-level compression: the codecs against independent references (numpy's int8
quantization, zfpy's own round trip, torch's casts), their documented bounds on awkward
inputs, and the compressed plans of every algorithm checked symbolically."""
import numpy as np
import pytest
import torch

from pccl.algorithms import GENERATORS
from pccl.analysis.verify import ScheduleError, verify_compressed
from pccl.compression.codecs import CodecError, codec
from pccl.ir.compressed import compress
from pccl.ir.schedule import Schedule, recv, recv_reduce, send

GROUP = 128


def numpy_int8(x: np.ndarray) -> np.ndarray:
    """Block-wise absmax int8 round trip, written independently in numpy (float32 math)."""
    out = np.empty_like(x, dtype=np.float32)
    for start in range(0, len(x), GROUP):
        g = x[start:start + GROUP].astype(np.float32)
        if not np.isfinite(g).all():
            out[start:start + GROUP] = np.nan
            continue
        scale = np.float32(np.abs(g).max()) / np.float32(127)
        if scale == 0:
            q = np.zeros_like(g)
        elif scale < 1e-36:   # subnormal groups: 1 / scale would overflow, so divide
            q = np.clip(np.rint(g / scale), -127, 127)
        else:                 # multiply by the rounded inverse, as the kernel does
            q = np.rint(np.clip(g * (np.float32(1) / scale), -127, 127))
        out[start:start + GROUP] = q.astype(np.float32) * scale
    return out


def inputs(n: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"random": torch.randn(n, generator=g), "constant": torch.full((n,), 3.25), "zero": torch.zeros(n),
            "denormal": torch.randn(n, generator=g) * 1e-40, "huge": torch.randn(n, generator=g) * 1e30,
            "mixed scales": torch.randn(n, generator=g) * torch.logspace(-20, 20, n)}


@pytest.mark.parametrize("kind", list(inputs()))
@pytest.mark.parametrize("n", [1, 127, 128, 1000])
def test_int8_matches_numpy_and_its_bound(kind, n):
    x = inputs(n)[kind]
    c = codec("int8")
    assert c.encoded_nbytes(n, torch.float32) == n + 4 * -(-n // GROUP)
    out = c.round_trip(x)
    assert torch.equal(out, torch.from_numpy(numpy_int8(x.numpy())))
    for start in range(0, n, GROUP):
        g, o = x[start:start + GROUP], out[start:start + GROUP]
        assert ((o - g).abs() <= g.abs().max() / 254 * (1 + 1e-6)).all()


def test_int8_non_finite_values_poison_their_group_only():
    x = torch.randn(300, generator=torch.Generator().manual_seed(2))
    x[5], x[200] = float("nan"), float("inf")
    out = codec("int8").round_trip(x)
    assert out[:128].isnan().all() and out[128:256].isnan().all()
    assert torch.isfinite(out[256:]).all() and ((out[256:] - x[256:]).abs() <= x[256:].abs().max() / 254).all()


def test_int8_groups_of_the_smallest_subnormals_keep_their_signs():
    """Where the scale is subnormal, x / scale can round past 127: clamped, as every other
    group is (a cast of 150 to int8 wrapped to -106, a flipped sign)."""
    for value in (4.2e-43, 1.4e-44, 2.9e-39):
        x = torch.tensor([value, -value / 3, value / 7] * 43, dtype=torch.float32)
        out = codec("int8").round_trip(x)
        assert torch.equal(out, torch.from_numpy(numpy_int8(x.numpy()))), value
        assert (out * x >= 0).all() and ((out - x).abs() <= x.abs().max()).all(), value


@pytest.mark.parametrize("name", ["int8", "bf16", "fp16"])
def test_decode_and_max_or_min_keeps_a_nan_on_either_side(name):
    """As the uncompressed kernels: a NaN a rank holds reaches every rank, whichever side
    of the combine it is on."""
    c = codec(name)
    x = torch.tensor([1.0, float("nan"), -2.0, 3.0] * 64)
    encoded = torch.empty(c.encoded_nbytes(x.numel(), x.dtype), dtype=torch.uint8)
    c.encode(torch.where(x.isnan(), torch.zeros_like(x), x), encoded)   # no NaN in the encoding
    for op in ("max", "min"):
        acc = x.clone()   # the NaN in the accumulator
        c.decode(encoded, acc, op)
        assert torch.equal(acc.isnan(), x.isnan()), (name, op)


def test_zfp_refuses_rates_below_3_and_codes_no_values():
    pytest.importorskip("zfpy")
    for rate in (1, 2):
        with pytest.raises(CodecError, match="zfp rate must be an integer number of bits per value in 3..32"):
            codec(f"zfp:{rate}")
    c = codec("zfp:16")
    empty = torch.empty(0)
    c.encode(empty, torch.empty(c.encoded_nbytes(0, torch.float32), dtype=torch.uint8))
    c.decode(torch.empty(0, dtype=torch.uint8), empty, "sum")   # a block of no values: nothing (zfpy faulted)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_on_16_bit_payloads_and_decode_and_reduce(dtype):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    c = codec("int8")
    exact = torch.from_numpy(numpy_int8(x.float().numpy()))
    assert torch.equal(c.round_trip(x), exact.to(dtype))
    encoded = torch.empty(c.encoded_nbytes(1000, dtype), dtype=torch.uint8)
    c.encode(x, encoded)
    acc = torch.ones(1000, dtype=dtype)
    c.decode(encoded, acc, "sum")
    decoded = exact.to(dtype).float()   # reduced as the payload's dtype holds it
    assert torch.equal(acc, (torch.ones(1000) + decoded).to(dtype))
    for op, fn in (("max", torch.maximum), ("min", torch.minimum)):
        acc = torch.zeros(1000, dtype=dtype)
        c.decode(encoded, acc, op)
        assert torch.equal(acc, fn(torch.zeros(1000), decoded).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int8_decode_and_sum_commutes_between_exchange_partners(dtype):
    """Recursive doubling's partners each hold their own block as the decoding of the
    encoding they sent, and add the other's: a + decode(b) on one, b + decode(a) on the
    other. The decoded value is rounded to the payload's dtype before the sum, so both
    add the same two values and all-reduce ends identical on every rank (in fp16 and bf16
    a sum of the unrounded float differed in a tenth of the elements)."""
    n, c = 1000, codec("int8")
    g = torch.Generator().manual_seed(3)
    a, b = ((torch.randn(n, generator=g) * 3).to(dtype) for _ in range(2))
    encoded = {}
    for name, x in (("a", a), ("b", b)):
        encoded[name] = torch.empty(c.encoded_nbytes(n, dtype), dtype=torch.uint8)
        c.encode(x, encoded[name])
    ends = []
    for mine, theirs in (("a", "b"), ("b", "a")):
        acc = torch.empty(n, dtype=dtype)
        c.decode(encoded[mine], acc)           # the block replaced by its own encoding's decoding
        c.decode(encoded[theirs], acc, "sum")  # the partner's decoded and added
        ends.append(acc)
    assert torch.equal(ends[0], ends[1]), f"{(ends[0] != ends[1]).sum()} of {n} elements differ between partners"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int8_decode_and_sum_rounds_the_product_then_the_sum(dtype):
    """Decode-and-sum is float32(q * scale) in the accumulator's dtype, then the sum rounded
    to it: what every device computes. A fused multiply-add rounds once and differs in some of these
    elements (emulated here in float64, where q * scale is exact), so a kernel built with
    contraction (nvcc's default, GCC's on aarch64) fails; the GPU build's PTX is checked for
    it in tests/pccl/test_gpu.py."""
    n = 65541
    g = torch.Generator().manual_seed(7)
    x, start = ((torch.randn(n, generator=g) * 100).to(dtype) for _ in range(2))
    c = codec("int8")
    encoded = torch.empty(c.encoded_nbytes(n, dtype), dtype=torch.uint8)
    c.encode(x, encoded)
    acc = start.clone()
    c.decode(encoded, acc, "sum")
    groups = -(-n // GROUP)
    scale = np.repeat(encoded[:4 * groups].numpy().view(np.float32), GROUP)[:n]
    q = encoded[4 * groups:].numpy().view(np.int8)
    a = start.float().numpy()
    decoded = torch.from_numpy(q.astype(np.float32) * scale).to(dtype).float().numpy()
    twice = torch.from_numpy(decoded + a).to(dtype)
    fused = torch.from_numpy((q.astype(np.float64) * scale + a).astype(np.float32)).to(dtype)
    assert not torch.equal(fused, twice), "the data no longer tells one rounding from two"
    assert torch.equal(acc, twice), f"{(acc != twice).sum()} of {n} elements rounded otherwise"


@pytest.mark.parametrize("name,wire,relative", [("bf16", torch.bfloat16, 2 ** -8), ("fp16", torch.float16, 2 ** -11)])
def test_casts_match_torch_and_their_bounds(name, wire, relative):
    c = codec(name)
    x = torch.randn(999, generator=torch.Generator().manual_seed(3)) * 100
    out = c.round_trip(x)
    assert torch.equal(out, x.to(wire).float())
    assert ((out - x).abs() <= x.abs() * relative).all()
    assert c.encoded_nbytes(999, torch.float32) == 2 * 999
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6])
    decoded = c.round_trip(special)
    assert decoded[0].isnan() and decoded[1] == float("inf") and decoded[2] == -float("inf")
    assert decoded[3] == (float("inf") if name == "fp16" else special[3].to(wire).float())   # fp16 overflows
    with pytest.raises(CodecError, match="takes.*would not make torch.bfloat16 data smaller"):
        c.check(torch.bfloat16)
    with pytest.raises(CodecError, match="got torch.float64: not supported"):   # it would make fp64 smaller
        c.check(torch.float64)
    edge = torch.tensor([65519.0, 65520.0, 3.3961e38, 3.3962e38])   # the docstring's overflow thresholds
    assert c.round_trip(edge).isinf().tolist() == ([False, True, True, True] if name == "fp16" else
                                                   [False, False, False, True])


@pytest.mark.parametrize("name", ["int8", "bf16"])
def test_native_kernels_refuse_an_encoding_they_would_overrun(name):
    """The native kernels take raw pointers: a short, long, strided or foreign-device
    encoding, or strided values, is refused by name before a byte is touched ("meta"
    stands in for another device)."""
    c, x = codec(name), torch.randn(300)
    size = c.encoded_nbytes(300, torch.float32)
    for bad, why in ((torch.empty(size - 1, dtype=torch.uint8), f"encoding of {size} bytes, got torch.uint8 of "
                                                                 f"{size - 1}"),
                     (torch.empty(size, dtype=torch.int16), "got torch.int16"),
                     (torch.empty(2 * size, dtype=torch.uint8)[::2], "not contiguous"),
                     (torch.empty(size, dtype=torch.uint8, device="meta"), "both must be on one device")):
        for call in (lambda: c.encode(x, bad), lambda: c.decode(bad, x), lambda: c.decode(bad, x, "sum")):
            with pytest.raises(CodecError, match=why):
                call()
    with pytest.raises(CodecError, match="not contiguous"):
        c.encode(torch.randn(600)[::2], torch.empty(size, dtype=torch.uint8))


def test_the_native_binding_refuses_an_unknown_codec_and_a_cast_of_other_values():
    """Below the Python codecs' own checks, the binding guards its raw pointers too: a cast
    codec (bf16) handed fp16 values would read twice the bytes they hold."""
    from pccl import _native
    from pccl.core.dtypes import DTYPES

    half, out = torch.ones(4, dtype=torch.float16), torch.zeros(64, dtype=torch.uint8)
    bf16 = codec("bf16").native
    with pytest.raises(ValueError, match="take float32 values"):
        _native.encode(bf16, out.data_ptr(), half.data_ptr(), half.numel(), DTYPES[torch.float16])
    with pytest.raises(ValueError, match="unknown native codec code 3"):
        _native.encoded_bytes(3, 10)


# rates whose blocks of 4 values fill whole 64-bit words (8, 16, 32) and rates whose blocks
# do not (3, 5, 6, 13), where the size is rounded up per stream, not per value
@pytest.mark.parametrize("rate", [3, 5, 6, 8, 13, 16, 32])
@pytest.mark.parametrize("n", [1, 3, 4, 9, 1000, 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zfp_matches_zfpys_round_trip_and_size(rate, n, dtype):
    zfpy = pytest.importorskip("zfpy")
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=dtype)
    c = codec(f"zfp:{rate}")
    stream = zfpy.compress_numpy(x.numpy(), rate=rate, write_header=False)
    assert c.encoded_nbytes(n, dtype) == len(stream)
    expected = zfpy._decompress(stream, zfpy.dtype_to_ztype(np.dtype(str(dtype).removeprefix("torch."))), [n],
                                rate=rate)
    assert torch.equal(c.round_trip(x), torch.from_numpy(expected))
    relative = (c.round_trip(x) - x).norm() / x.norm()
    assert relative < 2.0 ** -(rate - 6)   # the unit codecs.py documents (fp64 at 32 bits: 1.2e-8 for 3 values)


def test_codec_names_and_payloads_are_checked():
    assert codec(None) is None and codec("none") is None
    for bad in ("int4", "zfp", "zfp:x", "zfp:0", 8):
        with pytest.raises(CodecError):
            codec(bad)
    for name in ("int8", "bf16"):
        with pytest.raises(CodecError, match="integer data is never compressed"):
            codec(name).check(torch.int64)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("collective,algorithm", [(c, a) for c, algs in GENERATORS.items() for a in algs])
def test_every_compressed_schedule_is_verified_symbolically(collective, algorithm, p):
    """Right contributions, only valid encodings forwarded, none decoded twice; all-gather
    blocks encoded once each, by their owners, and decoded alike everywhere."""
    encodes = verify_compressed(collective, algorithm, p)["encodes"]
    if collective == "all_gather":
        assert encodes == [int(p > 1)] * p
    if (collective, algorithm) == ("all_reduce", "ring"):
        assert encodes == [p if p > 1 else 0] * p   # p - 1 partial sums and the final value (Algorithm 1)


@pytest.mark.parametrize("p", [2, 5, 8])
def test_per_message_compression_encodes_at_every_hop(p):
    """The baseline: an all-gather block is re-encoded at each of its p - 1 hops (p(p - 1)
    encodings in all, against p), a ring all-reduce's final values too (2p(p - 1) against
    p^2); both still compute the right contributions."""
    assert sum(verify_compressed("all_gather", "ring", p, per_message=True)["encodes"]) == p * (p - 1)
    assert sum(verify_compressed("all_gather", "ring", p)["encodes"]) == p
    assert sum(verify_compressed("all_reduce", "ring", p, per_message=True)["encodes"]) == 2 * p * (p - 1)
    assert sum(verify_compressed("all_reduce", "ring", p)["encodes"]) == p * p
    assert codec("p2p:int8").per_message and codec("p2p:int8").name == "p2p:int8"
    with pytest.raises(CodecError):
        codec("p2p:none")


def test_the_verifier_catches_a_rank_that_forwards_what_it_never_received():
    # rank 1 forwards block 0 to rank 2 before it has it: it would encode nothing
    steps = {0: ((send(1, [0]),), ()), 1: ((send(2, [0]),), (recv(0, [0]),)), 2: ((), (recv(1, [0]),))}
    schedules = [Schedule("all_gather", "bad", 3, r, tuple(steps[r])) for r in range(3)]
    from pccl.analysis.verify import Encoded, simulate

    with pytest.raises(ScheduleError, match="encodes block 0, which it does not hold"):
        simulate(schedules, Encoded(schedules))


def test_a_plan_keeps_received_encodings_and_thaws_before_reducing():
    sched = Schedule("all_reduce", "hand", 2, 0, (
        (recv(1, [1]),), (send(1, [1]),), (recv_reduce(1, [1]),)))
    plan = compress(sched)
    assert [s.encode for s in plan.steps] == [(), (), ()]   # block 1 is forwarded as received
    assert plan.steps[2].thaw == (1,) and plan.decode == () and plan.settle == ()


_reports: dict = {}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from tests.support.mpirun import report_of

    def get(p: int) -> dict:
        return report_of(_reports, p, tmp_path_factory.mktemp(f"p{p}"), p, "-m tests.pccl.workers.run_compression")
    return get


@pytest.mark.mpi
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_every_collective_algorithm_and_codec_on_real_ranks(report, p):
    """All-gathers equal the codec's round trip of each owner's input, alike on every rank;
    reductions within the propagated bound (tests/pccl/workers/run_compression.py); plans
    compress their inter-node phases; bad codecs and dtypes raise before anything is sent."""
    result = report(p)
    assert "_launch" not in result, result.get("_launch")
    failures = {k: v for k, v in result.items() if v}
    assert not failures, "\n".join(f"{k}: {v[:3]}" for k, v in failures.items())
    assert any(k.startswith("plans/") for k in result) == (p in (4, 8))
