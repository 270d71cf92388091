"""The GPU path: CUDA sources must compile and link everywhere nvcc exists (CI has no GPU);
the kernels must match torch wherever a GPU and a GPU build are present."""
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from mpi4py import MPI  # noqa: F401 - loads libmpi for the native module

from pccl import _native
from pccl.core.dtypes import DTYPES, OPS

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def c_code(text):
    """C/C++ source without comments and string literals."""
    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"', " ", text, flags=re.S)


# The double-underscore functions csrc/gpu may call, each found in the AMD HIP headers
# (ROCm/clr hipamd/include/hip/amd_detail/amd_hip_fp16.h and amd_hip_bf16.h) of every ROCm
# checked: tags rocm-5.7.0, 5.7.1, 6.0.0, 6.0.2, 6.1.0, 6.1.1, 6.1.2, 6.2.0, 6.2.1, 6.2.2, the
# release/rocm-rel-6.3.0.1 branch, and ROCm/rocm-systems develop (projects/clr); CUDA
# defines them all too. None of those ROCm headers has __float2bfloat16_rn, and ROCm 5.6 has
# no amd_hip_bf16.h at all (docs/gpu.md). __syncthreads is HIP's block barrier (HIP
# programming guide, "Synchronization functions"; RCCL's device primitives call it under
# __HIPCC__). Add a name here only after checking those headers.
HIP_VERIFIED_FUNCTIONS = {"__half2float", "__float2half", "__float2half_rn", "__bfloat162float", "__float2bfloat16",
                          "__syncthreads"}
KEYWORDS = {"__launch_bounds__", "__attribute__"}


def test_gpu_sources_call_only_functions_every_rocm_defines():
    # One kernel source serves both platforms, so every call is a HIP-side call.
    sources = sorted(p for p in (ROOT / "csrc" / "gpu").iterdir() if p.suffix in (".h", ".cu", ".cpp"))
    called = set()
    for path in sources:
        called |= set(re.findall(r"\b(__\w+)\s*\(", c_code(path.read_text()))) - KEYWORDS
    assert {"__float2bfloat16", "__half2float"} <= called, "the scan found no conversions: is it broken?"
    unverified = sorted(called - HIP_VERIFIED_FUNCTIONS)
    assert not unverified, f"not verified in ROCm's headers: {unverified}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_sources_compile_and_link(tmp_path):
    """The build `make GPU=cuda` runs (scikit-build-core, the project's CMake target, the
    default CUDA architectures), configured from scratch in a temporary build directory.
    The module is inspected, not imported: CI has no GPU."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("CUDAARCHS", None)
    build, wheels, kept = tmp_path / "build", tmp_path / "wheel", tmp_path / "kept"   # kept: nvcc's PTX
    kept.mkdir()
    cmd = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "--no-index",
           "-C", "cmake.define.PCCL_CUDA=ON", "-C", "cmake.define.PCCL_HIP=OFF",
           "-C", f"build-dir={build}", "-C", f"cmake.define.CMAKE_CUDA_FLAGS=--keep --keep-dir={kept}",
           "-w", str(wheels), str(ROOT)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-4000:]
    flags = (build / "build.ninja").read_text()
    for arch in (80, 90):  # the default architectures: A100, H100/H200
        assert f"arch=compute_{arch},code=" in flags, f"sm_{arch} is not among the CUDA targets"
    (wheel,) = wheels.glob("pccl-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.startswith("pccl/_native") and n.endswith(".so")]
        module = zf.read(name)
    for needed in (b"gpu_reduce\0", b"gpu_divide\0", b"gpu_encode\0", b"gpu_decode\0", b"libcudart.so",
                   b".nv_fatbin\0"):
        assert needed in module, f"{needed!r} is missing from the CUDA build of {name}"
    assert_no_contraction(sorted(kept.glob("reduce.*.ptx")))


# In PTX, a float fma (or mad) is one rounding where the CPU twin rounds twice, and a mul or
# add without a rounding modifier is one ptxas may still fuse ("mul/add sequences with no
# rounding modifiers may be optimized to use fused-multiply-add", PTX ISA, mul); one with
# .rn never is. The kernels call no fmaf, so any fused form is the compiler's contraction.
FUSED = re.compile(r"^\s*(?:fma|mad)(?:\.\w+)*\.f(?:16|32|64)\b", re.M)
FUSIBLE = re.compile(r"^\s*(?:mul|add|sub)(?:\.ftz|\.sat)*\.f(?:32|64)\b", re.M)


def assert_no_contraction(ptx_files):
    """Every float multiply and add in the kernels rounds on its own, as on the CPU: nvcc
    contracts q * scale + a by default, and the int8 codec's decode-and-sum then differs
    from the CPU's by an ulp in some elements (seen on an H200 in fp16 and bf16)."""
    assert [p.name for p in ptx_files] == ["reduce.compute_80.ptx", "reduce.compute_90.ptx"], ptx_files
    for path in ptx_files:
        ptx = path.read_text()
        assert re.search(r"^\s*(?:mul|fma)(?:\.\w+)*\.f32\b", ptx, re.M), f"{path.name}: no float multiply found"
        fused = FUSED.findall(ptx) + FUSIBLE.findall(ptx)
        assert not fused, f"{path.name}: {len(fused)} fused or fusible float operations, e.g. {fused[:3]}"


needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or _native.gpu_platform is None,
    reason="needs a GPU and a GPU build (make GPU=cuda or GPU=hip)")


def random_values(n, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, device="cuda") * 100).to(dtype)
    return torch.randint(-2**30, 2**30, (n,), generator=g, device="cuda").to(dtype)


# (dst, a, b) element offsets into larger buffers ("a": in place, dst is a). The kernels
# take 16-byte vectors after a scalar head where the three share their offset modulo the
# vector, narrower ones where they share it modulo 8 or 4 bytes, one element at a time
# otherwise: (1, 3, 5) and (2, 6, 2) take 2- and 4-element vectors for 2-byte types.
LAYOUTS = [(0, 0, 0), (1, 1, 1), (3, 3, 3), (1, 3, 5), (2, 6, 2), (0, 1, 3), ("a", 0, 0), ("a", 3, 3),
           ("a", 1, 2)]
PAD = 8


@needs_gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("n", [0, 1, 7, 1000, (1 << 20) + 3])
def test_gpu_reduce_matches_torch(dtype, op, n):
    """Every layout, against torch; elements around dst's are left alone."""
    torch_op = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    stream = torch.cuda.current_stream()
    for dst_at, a_at, b_at in LAYOUTS:
        a_buf, b_buf = random_values(n + PAD, dtype, seed=n), random_values(n + PAD, dtype, seed=n + 1)
        a, b = a_buf[a_at:a_at + n], b_buf[b_at:b_at + n]
        expected = torch_op(a, b)
        if dst_at == "a":
            dst_buf, dst_at, dst = a_buf, a_at, a
        else:
            dst_buf = torch.full((n + PAD,), 7, dtype=dtype, device="cuda")
            dst = dst_buf[dst_at:dst_at + n]
        around = torch.cat([dst_buf[:dst_at], dst_buf[dst_at + n:]])
        _native.gpu_reduce(dst.data_ptr(), a.data_ptr(), b.data_ptr(), n, DTYPES[dtype], OPS[op],
                           stream.cuda_stream)
        stream.synchronize()
        layout = (dst_at, a_at, b_at)
        assert torch.equal(dst, expected), layout
        assert torch.equal(torch.cat([dst_buf[:dst_at], dst_buf[dst_at + n:]]), around), layout


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 4099, (1 << 20) + 3])
def test_gpu_divide_is_the_cpus_true_division(dtype, n):
    # Against torch on the CPU: torch's CUDA a / 3 multiplies by the reciprocal.
    stream = torch.cuda.current_stream()
    for at in (0, 1, 3):
        buf = torch.randn(n + PAD, generator=torch.Generator().manual_seed(n)).to(dtype).cuda()
        expected = buf.cpu()
        expected[at:at + n] /= 3
        _native.gpu_divide(buf[at:].data_ptr(), n, DTYPES[dtype], 3, stream.cuda_stream)
        stream.synchronize()
        assert torch.equal(buf.cpu(), expected), at


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("n", [6, 4099])
def test_gpu_max_and_min_of_zeros_sign_them_as_the_cpu_does(dtype, op, n):
    """+0 against -0 in either order: the CPU kernel's bits (max +0, min -0), not the order
    of operands, as torch.maximum's would be."""
    from tests.pccl.test_kernels import zeros_of_both_signs

    stream = torch.cuda.current_stream()
    a, b = zeros_of_both_signs(dtype, n)
    for first, second in ((a, b), (b, a)):
        cpu = torch.empty_like(first)
        _native.reduce(cpu.data_ptr(), first.data_ptr(), second.data_ptr(), n, DTYPES[dtype], OPS[op])
        x, y = first.cuda(), second.cuda()
        _native.gpu_reduce(x.data_ptr(), x.data_ptr(), y.data_ptr(), n, DTYPES[dtype], OPS[op], stream.cuda_stream)
        stream.synchronize()
        assert torch.equal(x.cpu().view(torch.uint8), cpu.view(torch.uint8))


@needs_gpu
@pytest.mark.parametrize("name", ["int8", "bf16", "fp16"])
@pytest.mark.parametrize("op", ["max", "min"])
def test_gpu_decode_and_max_or_min_signs_zeros_as_the_cpu_does(name, op):
    from pccl.compression.codecs import codec
    from tests.pccl.test_kernels import zeros_of_both_signs

    c = codec(name)
    a, b = zeros_of_both_signs(torch.float32, 300)
    encoded = torch.empty(c.encoded_nbytes(b.numel(), b.dtype), dtype=torch.uint8)
    c.encode(b, encoded)
    cpu, gpu = a.clone(), a.cuda()
    c.decode(encoded, cpu, op)
    c.decode(encoded.cuda(), gpu, op)
    assert torch.equal(gpu.cpu().view(torch.int32), cpu.view(torch.int32))


@needs_gpu
@pytest.mark.mpi
@pytest.mark.parametrize("gpu_aware", ["0", "1"])
def test_gpu_collectives_match_cpu_on_two_ranks(gpu_aware, monkeypatch):
    # "0": messages staged through host memory (works with any MPI); "1" needs a GPU-aware MPI.
    from tests.support.mpirun import mpiexec

    if gpu_aware == "1" and __import__("os").environ.get("PCCL_TEST_GPU_AWARE_MPI") != "1":
        pytest.skip("set PCCL_TEST_GPU_AWARE_MPI=1 where the MPI library is GPU-aware")
    monkeypatch.setenv("PCCL_GPU_AWARE_MPI", gpu_aware)
    run = mpiexec(2, "-m tests.pccl.workers.run_gpu", timeout=600)
    assert run.returncode == 0 and "OK gpu" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


SHUFFLE_DTYPES = [torch.float32, torch.bfloat16, torch.int64]
SHUFFLE_SHAPES = [(2, 4, 1), (4, 2, 1000), (3, 8, 5000)]  # 5000: two chunks of the kernel's grid


def check_shuffle(shuffle, device, dtype, n_nodes, n_local, m):
    """shuffle(src, dst, perm) against torch's permute, for the node-major/local-major
    reorder of a hierarchical plan and for a partial permutation."""
    from pccl.core.topology import Topology
    from pccl.plans.layout import grid_perm

    p = n_nodes * n_local
    src = torch.arange(p * m, device=device).to(dtype).view(p, m)
    dst = torch.full_like(src, -1)
    perm = grid_perm(Topology.regular(p, n_local), list(range(n_nodes)), list(range(n_local)))
    shuffle(src, dst, perm)
    expected = src.view(n_local, n_nodes, m).permute(1, 0, 2).reshape(p, m)
    assert torch.equal(dst, expected)
    # A partial permutation leaves the unmapped destination blocks alone.
    dst.fill_(-1)
    partial = tuple(-1 if i == 0 else j for i, j in enumerate(perm))
    shuffle(src, dst, partial)
    assert torch.equal(dst[perm[0]], torch.full((m,), -1, device=device).to(dtype))
    assert torch.equal(dst[list(perm[1:])], src[1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", SHUFFLE_DTYPES)
@pytest.mark.parametrize("n_nodes,n_local,m", SHUFFLE_SHAPES)
def test_gpu_shuffle_is_torchs_permute(dtype, n_nodes, n_local, m):
    from pccl.executors.plan import permute_
    from pccl.executors.shuffle_triton import kernel

    if kernel() is None:
        pytest.skip("Triton is not installed")
    check_shuffle(lambda src, dst, perm: permute_(src, dst, perm, lambda q: torch.tensor(q, device="cuda")),
                  "cuda", dtype, n_nodes, n_local, m)


@pytest.fixture
def interpreted_triton(monkeypatch):
    """The shuffle kernel as Triton's interpreter runs it (numpy on the CPU): the kernel's
    own indexing and masking, checked on machines without a GPU."""
    pytest.importorskip("triton")
    from pccl.executors import shuffle_triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    shuffle_triton.kernel.cache_clear()
    yield shuffle_triton.permute_blocks
    shuffle_triton.kernel.cache_clear()


@pytest.mark.parametrize("dtype", SHUFFLE_DTYPES)
@pytest.mark.parametrize("n_nodes,n_local,m", SHUFFLE_SHAPES)
def test_triton_shuffle_kernel_under_the_interpreter(interpreted_triton, dtype, n_nodes, n_local, m):
    def shuffle(src, dst, perm):
        assert interpreted_triton(src, dst, torch.tensor(perm)), "the kernel declined the launch"

    check_shuffle(shuffle, "cpu", dtype, n_nodes, n_local, m)


@needs_gpu
@pytest.mark.parametrize("name", ["int8", "bf16", "fp16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 127, 128, 1000, (1 << 20) + 3])
def test_gpu_codecs_encode_as_the_cpu_does(name, dtype, n):
    """The GPU kernels (csrc/gpu/codec.cuh) write the CPU kernels' encodings bit for bit, and
    decode them to the same values (decode-and-sum within float rounding)."""
    from pccl.compression.codecs import codec

    c = codec(name)
    if dtype not in c.dtypes:
        pytest.skip(f"{name} takes {c.dtypes}")
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 10).to(dtype)
    x[n // 2] = 0 if n > 2 else x[0]
    size = c.encoded_nbytes(n, dtype)
    cpu, gpu = torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8, device="cuda")
    c.encode(x, cpu)
    c.encode(x.cuda(), gpu)
    assert torch.equal(gpu.cpu(), cpu)
    out = torch.empty(n, dtype=dtype, device="cuda")
    c.decode(gpu, out)
    assert torch.equal(out.cpu(), c.round_trip(x))
    base = torch.ones(n, dtype=dtype)
    summed = base.cuda()
    c.decode(gpu, summed, "sum")
    c.decode(cpu, base, "sum")
    torch.testing.assert_close(summed.cpu(), base, rtol=1e-6, atol=1e-6)


@needs_gpu
@pytest.mark.parametrize("name", ["int8", "bf16", "fp16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [7, 300, 1000, (1 << 16) + 5])
def test_gpu_codecs_at_element_offsets(name, dtype, n):
    """Values at element offsets 1, 3 and 4, and an encoding 4, 1 or 3 bytes into its buffer:
    the kernels' scalar heads and narrower vectors. At offset 4 a 2-byte type's 8-value
    vectors straddle int8 groups (the group count is odd for n = 300 and (1 << 16) + 5). An
    encoding packed after another in a message (a schedule's run of blocks) starts at any
    byte: int8's scales, and a bf16 or fp16 wire value at an odd byte, are read and written a
    byte at a time, where a float or 2-byte load would stop the kernel with a misaligned
    address (as the bf16 and fp16 cases at odd bytes did on an H200 before it)."""
    from pccl.compression.codecs import codec

    c = codec(name)
    if dtype not in c.dtypes:
        pytest.skip(f"{name} takes {c.dtypes}")
    size = c.encoded_nbytes(n, dtype)
    x_buf = (torch.randn(n + PAD, generator=torch.Generator().manual_seed(n)) * 10).to(dtype)
    for at, enc_at in [(1, 0), (3, 0), (4, 0), (4, 4), (0, 1), (4, 3)]:
        x = x_buf[at:at + n]
        cpu = torch.empty(size, dtype=torch.uint8)
        c.encode(x, cpu)
        gpu_buf = torch.zeros(size + PAD, dtype=torch.uint8, device="cuda")
        gpu = gpu_buf[enc_at:enc_at + size]
        c.encode(x_buf.cuda()[at:at + n], gpu)
        assert torch.equal(gpu.cpu(), cpu), (at, enc_at)
        out_buf = torch.full((n + PAD,), 7, dtype=dtype, device="cuda")
        c.decode(gpu, out_buf[at:at + n])
        expected = torch.full((n + PAD,), 7, dtype=dtype)
        expected[at:at + n] = c.round_trip(x)
        assert torch.equal(out_buf.cpu(), expected), (at, enc_at)
        for op in ("sum", "max"):
            base = torch.linspace(-5, 5, n + PAD).to(dtype)
            summed = base.cuda()
            c.decode(gpu, summed[at:at + n], op)
            c.decode(cpu, base[at:at + n], op)
            torch.testing.assert_close(summed.cpu(), base, rtol=1e-6, atol=1e-6)


@needs_gpu
@pytest.mark.mpi
def test_compressed_collectives_on_gpus_over_nccl(tmp_path):
    """Every collective x algorithm with int8 and bf16 on GPU tensors over NCCL, against the
    bounds and references of tests/pccl/workers/run_compression.py (GPU encodings equal the
    CPU's, so all-gathered blocks are the CPU round trips)."""
    from tests.support.gpu import GPUS, no_gpu_reason
    from tests.support.mpirun import report_of

    if no_gpu_reason(2):   # over MPI, compressed schedules take host buffers only
        pytest.skip(no_gpu_reason(2))
    result = report_of({}, "nccl", tmp_path, GPUS, "-m tests.pccl.workers.run_compression", "nccl",
                       timeout=900)
    assert "_launch" not in result, result.get("_launch")
    failures = {k: v for k, v in result.items() if v}
    assert not failures, "\n".join(f"{k}: {v[:3]}" for k, v in failures.items())
