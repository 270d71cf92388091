"""pccl-kernel-bench: pccl's native reduction kernels against a copy of the same bytes.

Every reduce step of a collective runs ``a = op(a, b)`` over a received block. The kernel
is memory bound: it reads two buffers and writes one, 1.5 times the traffic of copying the
buffer. For each dtype, op and size this prints the kernel's time and memory throughput
(bytes read plus bytes written, per second), the same for torch's own in-place op
(add/maximum/minimum with out=a) and for a copy of the buffer (a device-to-device copy on
a GPU, memcpy on the CPU), and the kernel's throughput as a fraction of the copy's (1.0:
copy speed) and of torch's (1.0: as fast as torch).

    pccl-kernel-bench                       # the GPU kernels where built, else the CPU ones
    pccl-kernel-bench --device cpu -d float,bfloat16 -o sum,max -b 1M -e 64M
    pccl-kernel-bench -d all -o all -b 16M -e 256M    # every dtype and op
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from mpi4py import MPI

from pccl.core.dtypes import DATATYPES, DTYPES, OPS
from pccl.tools.cli import comma_list, size_arg, size_sweep, time_per_call
from runkit.args import output, refuse
from runkit.closed_pipe import quiet_when_its_reader_goes
from runkit.files import write_json_atomic
from runkit.sizes import parse_size, size_label

KERNEL_OPS = ("sum", "max", "min")  # avg runs as sum (the division is a separate pass)
TORCH_OPS = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


@dataclass
class Row:
    device: str
    datatype: str
    op: str
    nbytes: int
    pccl_us: float
    pccl_GBps: float
    torch_us: float
    torch_GBps: float
    copy_us: float
    copy_GBps: float
    of_copy: float       # pccl_GBps / copy_GBps
    of_torch: float      # pccl_GBps / torch_GBps
    wrong: int


def native_module():
    """The native module, loaded on first use: mpi4py (imported above) has loaded the libmpi it links."""
    from pccl import _native

    return _native


def pick_device(requested: str) -> str:
    """'cuda' or 'cpu'; a GPU is used only with a GPU build, and asking for one without
    it is an error that says how to get it."""
    gpu_build = native_module().gpu_platform is not None
    if requested == "auto":
        return "cuda" if gpu_build and torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no GPU here")
    if requested == "cuda" and not gpu_build:
        raise ValueError("--device cuda: pccl was built without GPU kernels; rebuild with make GPU=cuda "
                         "(or GPU=hip)")
    return requested


def pccl_call(a: torch.Tensor, b: torch.Tensor, op: str) -> Callable[[], None]:
    """a = op(a, b) with pccl's kernel, on the current stream for GPU tensors."""
    native = native_module()
    args = (a.data_ptr(), a.data_ptr(), b.data_ptr(), a.numel(), DTYPES[a.dtype], OPS[op])
    if a.is_cuda:
        stream = torch.cuda.current_stream().cuda_stream
        return lambda: native.gpu_reduce(*args, stream)
    return lambda: native.reduce(*args)


def seconds_per_call(call: Callable[[], None], device: str, iters: int, warmup: int, repeats: int) -> float:
    """Median over `repeats` loops of the mean time of `iters` calls; GPU loops are timed
    with events on the stream, so launch overhead overlaps as it does in a collective."""
    if device != "cuda":
        return time_per_call(call, iters, warmup, repeats, MPI.COMM_SELF)
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) / 1e3 / iters)
    return statistics.median(samples)


def inputs(n: int, dtype: torch.dtype, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        a, b = (torch.randn(n, generator=g) * 100).to(dtype), (torch.randn(n, generator=g) * 100).to(dtype)
    else:
        a, b = (torch.randint(-2**30, 2**30, (n,), generator=g).to(dtype) for _ in range(2))
    return a.to(device), b.to(device)


def count_wrong(dtype: torch.dtype, op: str, n: int, device: str) -> int:
    """Elements where one pccl kernel call differs from torch's op on fresh inputs, with a
    and b at element offsets (0, 0), (1, 1) (the GPU kernels' scalar head, then vectors)
    and (1, 0) (one element at a time) into their buffers."""
    wrong = 0
    for a_at, b_at in ((0, 0), (1, 1), (1, 0)):
        a, b = inputs(n + 1, dtype, device, seed=n)
        a, b = a[a_at:a_at + n], b[b_at:b_at + n]
        expected = TORCH_OPS[op](a, b)
        pccl_call(a, b, op)()
        if device == "cuda":
            torch.cuda.synchronize()
        wrong += int((a != expected).sum())
    return wrong


def measure(device: str, datatype: str, op: str, nbytes: int, args: argparse.Namespace) -> Row:
    dtype = DATATYPES[datatype]
    n = nbytes // dtype.itemsize
    a, b = inputs(n, dtype, device, seed=0)
    copy_dst = torch.empty_like(a)
    torch_op = TORCH_OPS[op]
    timed = {
        "pccl": pccl_call(a, b, op),
        "torch": lambda: torch_op(a, b, out=a),
        "copy": lambda: copy_dst.copy_(a),
    }
    us = {name: 1e6 * seconds_per_call(call, device, args.iters, args.warmup_iters, args.repeats)
          for name, call in timed.items()}
    traffic = {"pccl": 3 * n * dtype.itemsize, "torch": 3 * n * dtype.itemsize, "copy": 2 * n * dtype.itemsize}
    gbps = {name: traffic[name] / (us[name] * 1e3) for name in us}
    wrong = count_wrong(dtype, op, n, device) if args.check else 0
    return Row(device, datatype, op, n * dtype.itemsize, us["pccl"], gbps["pccl"], us["torch"], gbps["torch"],
               us["copy"], gbps["copy"], gbps["pccl"] / gbps["copy"], gbps["pccl"] / gbps["torch"], wrong)


def names_or_all(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list from `choices`, or "all" for every one."""
    parse = comma_list(choices)
    return lambda text: list(choices) if text.strip() == "all" else parse(text)


HEADER = (f"{'dtype':>9} {'op':>4} {'size':>6} | {'pccl us':>9} {'GB/s':>7} | {'torch us':>9} {'GB/s':>7} | "
          f"{'copy us':>9} {'GB/s':>7} | {'of copy':>7} {'of torch':>8} {'wrong':>5}")


def format_row(r: Row) -> str:
    return (f"{r.datatype:>9} {r.op:>4} {size_label(r.nbytes):>6} | {r.pccl_us:9.1f} {r.pccl_GBps:7.1f} | "
            f"{r.torch_us:9.1f} {r.torch_GBps:7.1f} | {r.copy_us:9.1f} {r.copy_GBps:7.1f} | "
            f"{r.of_copy:7.2f} {r.of_torch:8.2f} {r.wrong:5d}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pccl-kernel-bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="cuda: the GPU kernels (CUDA or HIP build); cpu: the vectorized CPU kernels")
    add("-d", "--datatypes", type=names_or_all(tuple(DATATYPES)), default=["float", "half", "bfloat16"],
        help="comma list, or all")
    add("-o", "--ops", type=names_or_all(KERNEL_OPS), default=["sum"], help="comma list, or all")
    add("-b", "--minbytes", type=size_arg, default=parse_size("64K"), help="smallest buffer (K/M/G suffixes)")
    add("-e", "--maxbytes", type=size_arg, default=parse_size("64M"), help="largest buffer")
    add("-f", "--stepfactor", type=int, default=4, help="multiply the size by this between rows")
    add("-n", "--iters", type=int, default=20, help="timed calls per loop")
    add("-w", "--warmup_iters", type=int, default=5, help="untimed calls first")
    add("--repeats", type=int, default=5, help="timed loops; the median is reported")
    add("--threads", type=int, default=1,
        help="torch CPU threads (the CPU kernels are single-threaded, as each rank's are in a collective)")
    add("-c", "--check", type=int, choices=(0, 1), default=1, help="check the kernel against torch")
    add("--json", metavar="PATH", type=output(), default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.stepfactor < 2:
        parser.error("--stepfactor must be at least 2")
    if min(args.iters, args.repeats, args.threads) < 1 or args.warmup_iters < 0:
        parser.error("--iters, --repeats and --threads must be >= 1, --warmup_iters >= 0")
    if args.minbytes < 8 or args.maxbytes < args.minbytes:
        parser.error(f"need 8 <= --minbytes <= --maxbytes, got {args.minbytes} and {args.maxbytes}")
    return args


def run(argv: Optional[list[str]] = None) -> list[Row]:
    """Print the table (and write the JSON); the rows, for callers and tests."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        device = pick_device(args.device)
    except ValueError as e:
        refuse("pccl-kernel-bench", str(e))
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {args.threads} torch thread(s)"
    print(f"# pccl-kernel-bench on {where}: a = op(a, b) in place; GB/s counts bytes read + written "
          f"(3x the size for the ops, 2x for the copy); median of {args.repeats} loops of {args.iters}", flush=True)
    print(HEADER, flush=True)
    rows = []
    for datatype in args.datatypes:
        for op in args.ops:
            itemsize = DATATYPES[datatype].itemsize
            for nbytes in size_sweep(args.minbytes, args.maxbytes, args.stepfactor, 1, itemsize):
                rows.append(measure(device, datatype, op, nbytes, args))
                print(format_row(rows[-1]), flush=True)
    if args.json:
        write_json_atomic(args.json, [asdict(row) for row in rows])
    if any(row.wrong for row in rows):
        raise SystemExit("pccl-kernel-bench: the kernel's results differ from torch's (column 'wrong')")
    return rows


@quiet_when_its_reader_goes
def main(argv: Optional[list[str]] = None) -> None:
    run(argv)


if __name__ == "__main__":
    main()
