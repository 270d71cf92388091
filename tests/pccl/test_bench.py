"""pccl-bench: size parsing and rounding, bandwidth formulas, test data, and one small run."""
import json
import os
import re
from types import SimpleNamespace

import pytest
import torch

from pccl.algorithms import NATIVES, algorithms_for
from pccl.core.dtypes import DATATYPES
from pccl.tools import cli
from pccl.tools.bench import Case, bandwidths, bus_factor, value_modulus
from pccl.tools.cli import round_size, size_sweep
from runkit.sizes import parse_size
from tests.support.mpirun import MPIEXEC, mpiexec, report_of


@pytest.mark.parametrize("text,nbytes", [("64", 64), ("4K", 4096), ("4k", 4096), ("1M", 1 << 20),
                                         ("2G", 2 << 30), ("0", 0), ("4KB", 4096), ("64GB", 64 << 30),
                                         ("80GiB", 80 << 30), ("1T", 1 << 40), ("512B", 512)])
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "K", "4X", "1.5K", "-1", "4KiBB", "4iB", "four"])
def test_parse_size_rejects_bad_input(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 13])
def test_bus_factors_match_nccl_tests(p):
    # nccl-tests (doc/PERFORMANCE.md): allgather and reducescatter (n-1)/n, allreduce 2(n-1)/n.
    assert bus_factor("all_gather", p) == pytest.approx((p - 1) / p)
    assert bus_factor("reduce_scatter", p) == pytest.approx((p - 1) / p)
    assert bus_factor("all_reduce", p) == pytest.approx(2 * (p - 1) / p)


def test_bandwidths_in_gb_per_second():
    algbw, busbw = bandwidths("all_reduce", 2_000_000_000, 0.5, 4)
    assert algbw == pytest.approx(4.0)
    assert busbw == pytest.approx(6.0)


def test_round_size_gives_equal_blocks_of_whole_elements():
    assert round_size(4096, 4, 4) == 4096
    assert round_size(4096, 3, 4) == 4092
    assert round_size(1000, 3, 8) == 984
    assert round_size(10, 4, 4) == 0


def test_size_sweep_multiplies_rounds_and_drops_empty_sizes():
    assert size_sweep(4096, 65536, 4, 4, 4) == [4096, 16384, 65536]
    assert size_sweep(4096, 65535, 4, 3, 4) == [4092, 16380]
    assert size_sweep(8, 64, 2, 4, 4) == [16, 32, 64]  # 8 B cannot hold 4 floats


@pytest.mark.parametrize("name", ["half", "bfloat16", "float"])
@pytest.mark.parametrize("p", [2, 3, 8, 21, 64])
def test_sums_of_test_values_are_exact(name, p):
    dtype = DATATYPES[name]
    largest_sum = (value_modulus(dtype, p) - 1) * p
    assert torch.tensor(float(largest_sum), dtype=dtype).item() == largest_sum


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_case_counts_wrong_elements(collective):
    case = Case(collective, 4 * 4 * 6, torch.float32, "sum", rank=1, ranks=4)
    case.fill()
    assert case.wrong() > 0  # poisoned output, or one rank's input for all_reduce
    case.output.copy_(case.expected)
    assert case.wrong() == 0
    case.output[-1] += 1
    assert case.wrong() == 1


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_values_made_a_chunk_at_a_time_are_the_whole_buffers(op, monkeypatch):
    """Inputs and expected results are made CHUNK elements at a time (whole buffers took 17x
    their size); across the chunks' seams they are what the hash and a float64 reduction
    of the whole buffers give."""
    from pccl.tools import bench
    monkeypatch.setattr(bench, "CHUNK", 1000)
    start, count, p, dtype = 777, 3 * 1000 + 17, 5, torch.bfloat16

    def whole(rank):   # the definition, on the whole range at once
        index = torch.arange(start, start + count, dtype=torch.int64)
        return (bench.mixed(index * 0x9E3779B1 + rank * 0x85EBCA77 + 1) % value_modulus(dtype, p)).to(dtype)
    inputs = torch.stack([whole(r) for r in range(p)]).double()
    assert all(torch.equal(bench.rank_values(r, start, count, dtype, p), whole(r)) for r in range(p))
    exact = {"sum": inputs.sum(0), "avg": inputs.sum(0) / p, "max": inputs.amax(0), "min": inputs.amin(0)}[op]
    assert torch.equal(bench.reduce_over_ranks(op, start, count, dtype, p), exact.to(dtype))


def test_errors_summed_a_chunk_at_a_time_are_the_whole_buffers(monkeypatch):
    """A compressed row's error sums, taken a chunk at a time: the largest error, the sums
    of squares, and a NaN anywhere is the largest error (a codec that wrote one is not
    reported exact)."""
    from pccl.tools import bench
    monkeypatch.setattr(bench, "CHUNK", 100)
    case = Case("all_reduce", 4 * 350, torch.float32, "sum", rank=0, ranks=4)
    exact = case.expected.double()
    case.output.copy_(case.expected)
    case.output[::7] += 0.25
    case.output[123] -= 2.0
    error = case.output.double() - exact
    largest, squares, reference = case.error_sums()
    assert largest == 2.0 and squares == pytest.approx(error.square().sum().item(), rel=1e-15)
    assert reference == pytest.approx(exact.square().sum().item(), rel=1e-15)
    case.output[250] = float("nan")
    assert torch.isnan(torch.tensor(case.error_sums()[0]))


def test_a_large_case_takes_about_its_buffers_in_memory():
    """A 64 MB bf16 reduce-scatter's input and expected result, made on one rank: about the
    buffers' size in memory (the case's own, 80 MB, and the input made before it is copied
    in: 150 MB measured). Made whole, the hash's int64 steps took 1 GB here, 4.5 GB at
    256 MB, where 4 ranks of a 24 GB machine were killed."""
    import subprocess
    import sys
    script = ("import resource, torch; from pccl.tools.bench import Case; "
              "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
              "case = Case('reduce_scatter', 64 << 20, torch.bfloat16, 'sum', 0, 4); case.fill(); case.expected; "
              "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)")
    grown = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)
    assert grown < 4 * (64 << 20), f"{grown / 2**20:.0f} MB for a 64 MB case"


@pytest.mark.parametrize("name,p", [("float", 16), ("bfloat16", 64)])
def test_misplaced_data_is_counted_wrong_at_any_distance(name, p):
    """The test data repeated every 13 positions and ranks (fewer in bf16 at many ranks):
    a block swapped with one 13 ranks on, a reduce-scatter handing out the next rank's
    block, or a result shifted by 13 elements came out bit for bit right."""
    dtype = DATATYPES[name]
    block = 4 * 13
    gather = Case("all_gather", p * block * dtype.itemsize, dtype, "sum", rank=0, ranks=p)
    for distance in (1, 4, 13):
        swapped = gather.expected.view(p, block).clone()
        swapped[[0, distance]] = swapped[[distance, 0]]
        gather.output.copy_(swapped.view(-1))
        assert gather.wrong() > block, distance
    scatter = Case("reduce_scatter", p * block * dtype.itemsize, dtype, "sum", rank=0, ranks=p)
    scatter.output.copy_(Case("reduce_scatter", scatter.nbytes, dtype, "sum", rank=1, ranks=p).expected)
    assert scatter.wrong() > block // 2
    reduced = Case("all_reduce", p * block * dtype.itemsize, dtype, "sum", rank=0, ranks=p)
    for shift in (1, 4, 13):
        reduced.output.copy_(reduced.expected.roll(shift))
        assert reduced.wrong() > reduced.count // 2, shift


@pytest.mark.parametrize("name,p,calls", [("float", 4, 101), ("float", 8, 25), ("bfloat16", 16, 25),
                                           ("half", 2, 4), ("float", 2, 200)])
def test_timed_all_reduce_sums_stay_finite_from_each_refill(name, p, calls):
    """An in-place sum grows p-fold a call, and every row of a size shared one buffer: the
    sums reached inf (int8 encodes inf about 6x faster than numbers). Each loop now starts
    from the input scaled to keep `calls` calls finite, its smallest value normal enough
    for int8's scales; simulated here call by call in the dtype, every rank's values."""
    dtype = DATATYPES[name]
    cases = [Case("all_reduce", p * 64 * dtype.itemsize, dtype, "sum", rank=r, ranks=p) for r in range(p)]
    refills = []
    for case in cases:
        case.fill()
        refills.append(case.refill_for(calls))
    tiny = torch.finfo(dtype).tiny
    for _ in range(2):   # a second loop starts from the same values again
        for refill in refills:
            refill()
        assert min(c.input[c.input != 0].abs().min().item() for c in cases) >= tiny * 2 ** 8
        for _ in range(calls):
            total = sum(c.input.double() for c in cases).to(dtype)
            for c in cases:
                c.input.copy_(total)
        assert torch.isfinite(total).all() and not cases[0].overflows


@pytest.mark.parametrize("name,p,calls", [("float", 8, 101), ("half", 2, 25), ("half", 4, 25)])
def test_sums_that_no_scale_keeps_finite_are_flagged(name, p, calls):
    case = Case("all_reduce", p * 64 * DATATYPES[name].itemsize, DATATYPES[name], "sum", rank=0, ranks=p)
    case.fill()
    case.refill_for(calls)
    assert case.overflows


def test_only_growing_calls_are_refilled():
    for collective, op, dtype in (("all_gather", "sum", torch.float32), ("reduce_scatter", "sum", torch.float32),
                                  ("all_reduce", "max", torch.float32), ("all_reduce", "avg", torch.float32),
                                  ("all_reduce", "sum", torch.int32)):
        case = Case(collective, 4 * 64 * 4, dtype, op, rank=0, ranks=4)
        case.fill()
        assert case.refill_for(100) is None, (collective, op, dtype)


def test_time_calls_refills_before_every_loop_untimed():
    """The refill comes before a loop's warm-up or switching call, and so before its clock."""
    world = SimpleNamespace(Barrier=lambda: None, allreduce=lambda value, op=None: value)
    log = []
    cli.time_calls([lambda: log.append("a"), lambda: log.append("b")], iters=2, warmup=1, repeats=2, world=world,
                   refill=lambda: log.append("refill"))
    assert "".join(x[0] for x in log) == "raaa" + "rbbb" + "raaa" + "rbbb"


def test_all_gather_expectation_is_every_ranks_input():
    cases = [Case("all_gather", 2 * 4 * 5, torch.float32, "sum", rank=r, ranks=2) for r in range(2)]
    for case in cases:
        case.fill()
    assert torch.equal(cases[0].expected, torch.cat([cases[0].input, cases[1].input]))


@pytest.mark.mpi
def test_two_rank_run_reports_every_algorithm_correct():
    if not os.path.exists(MPIEXEC):
        pytest.skip("no mpiexec next to the python interpreter")
    done = mpiexec(2, "-m pccl.tools.bench", "-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "-w", "1",
                   "--executors", "cpp,python", "--json", "-", timeout=120)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    for collective in ("all_gather", "reduce_scatter"):
        expected = {(e, a) for e in ("cpp", "python") for a in algorithms_for(collective) + ("auto",)}
        expected |= {("mpi", "native"), ("mpi", "native_nonblocking")}
        for size in (1024, 4096):
            mine = [r for r in rows if r["collective"] == collective and r["size"] == size]
            assert {(r["executor"], r["algorithm"]) for r in mine} == expected
            assert all(r["wrong"] == 0 and r["ranks"] == 2 and r["time_us"] > 0 for r in mine)


@pytest.mark.mpi
def test_compressed_rows_carry_their_error_against_the_exact_result():
    done = mpiexec(3, "-m pccl.tools.bench", "-b", "12K", "-e", "12K", "-n", "2", "-w", "1", "--executors", "cpp",
                   "--collectives", "all_reduce,all_gather", "--algorithms", "ring,native",
                   "--compression", "int8,bf16", "--json", "-", timeout=120)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    for collective in ("all_reduce", "all_gather"):
        mine = {(r["algorithm"], r["compression"]): r for r in rows if r["collective"] == collective}
        assert set(mine) == {("ring", "none"), ("ring", "int8"), ("ring", "bf16"), ("native", "none")}
        assert mine[("ring", "none")]["wrong"] == 0 and mine[("ring", "none")]["rms_error"] is None
        # the inputs are small integers: bf16 carries them exactly; int8 by 127 levels of the
        # group's largest, at most half a level off
        assert mine[("ring", "bf16")]["max_error"] == 0.0 and mine[("ring", "bf16")]["wrong"] is None
        assert 0 < mine[("ring", "int8")]["max_error"] <= 3 * 0.5 / 127 and mine[("ring", "int8")]["rms_error"] > 0
    bad = mpiexec(1, "-m pccl.tools.bench", "--compression", "int4", timeout=60)
    assert bad.returncode != 0 and "unknown codec" in bad.stderr


def test_auto_is_compared_with_the_fastest_of_native_and_every_algorithm_of_its_transport():
    from pccl.tools.bench import Row, auto_summary

    def row(executor, algorithm, us, size=64, picked=None):
        return Row("all_gather", size, size // 4, "float", "sum", executor, algorithm, picked or algorithm, us,
                   0.0, 0.0, 0, 4)
    rows = [row("cpp", "ring", 9.0), row("cpp", "bruck", 6.0), row("mpi", "native", 5.0),
            row("cpp", "auto", 5.5, picked="native"), row("python", "ring", 1.0),   # another executor's: no rival
            row("gloo", "native", 0.5), row("cpp", "ring", 0.1, size=4096)]         # another transport, size
    lines = auto_summary("all_gather", rows).splitlines()
    assert len(lines) == 3 and lines[2].split() == ["64", "cpp", "5.50", "5.00", "1.10", "native", "->", "native"]


def test_the_summary_marks_auto_s_pick_where_it_is_mpi_s_own_collective():
    """MPI's own collective is filed under the "mpi" executor, and auto's pick was looked
    up under its own executor only: a native pick, the commonest, was never marked."""
    from pccl.tools.bench import Row, summary

    def row(executor, algorithm, us, picked=None, compression="none"):
        return Row("all_gather", 64, 16, "float", "sum", executor, algorithm, picked or algorithm, us,
                   0.0, 0.0, 0, 4, compression)
    natively = [row("mpi", "native", 5.0), row("cpp", "ring", 9.0), row("cpp", "auto", 5.5, picked="native")]
    assert "native* 5.0us" in summary("all_gather", natively)
    # a compressed auto row's pick is not auto's (uncompressed) pick
    coded = [row("mpi", "native", 5.0), row("cpp", "ring", 4.0), row("cpp", "auto", 5.5, picked="native"),
             row("cpp", "auto", 3.0, picked="ring", compression="int8")]
    table = summary("all_gather", coded)
    assert "ring 4.0us" in table and "native* 5.0us" in table


# --------------------------------------------------------------- --device cuda
# What depends on a GPU is three small functions (visible_gpus, use_gpu, gpu_mpi) and
# where Case allocates; the choices (which executors and rows run, and why not), the
# timing around a synchronize and the check run here on CPU with stand-ins for them.

from dataclasses import replace  # noqa: E402

from pccl.core.topology import Topology  # noqa: E402
from pccl.tools import bench  # noqa: E402

ONE_GPU_TWO_RANKS = bench.Gpus("Stand-in GPU", per_node=1, ranks_per_node=2, kernels=True, gpu_aware=False, nccl=True)
GPU_PER_RANK = replace(ONE_GPU_TWO_RANKS, per_node=2)


def refuse(*args, **kwargs):
    raise AssertionError("nothing may be launched or probed")


def test_device_cuda_without_a_gpu_is_refused_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setattr(bench, "visible_gpus", lambda: 0)
    monkeypatch.setattr(bench, "probe_gpus", refuse)
    monkeypatch.setattr(bench.pccl, "init", refuse)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)   # main's, not for this test process
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cuda"])
    assert e.value.code == 2
    assert "--device cuda needs a GPU, and torch sees none" in capsys.readouterr().err


@pytest.mark.mpi
def test_device_cuda_without_a_visible_gpu_fails_with_the_reason(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")   # no GPU, here or on a GPU machine
    done = mpiexec(1, "-m pccl.tools.bench", "--device", "cuda", "-b", "4K", "-e", "4K", timeout=120)
    assert done.returncode == 2 and "--device cuda needs a GPU, and torch sees none" in done.stderr
    assert "# pccl-bench" not in done.stdout


def test_default_executors_follow_the_device(monkeypatch):
    assert bench.parse_args([]).executors == ["cpp", "python", "gloo"]
    assert bench.parse_args(["--executors", "cpp,nccl"]).executors == ["cpp", "nccl"]
    monkeypatch.setattr(bench, "visible_gpus", lambda: 1)
    assert bench.parse_args(["--device", "cuda"]).executors == ["cpp", "nccl"]
    assert bench.parse_args(["--device", "cuda", "--executors", "python"]).executors == ["python"]


def test_use_gpu_takes_the_local_rank_modulo_the_gpus(monkeypatch):
    selected = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"GPU{index}")
    assert [bench.use_gpu(r) for r in range(5)] == ["GPU0", "GPU1", "GPU0", "GPU1", "GPU0"]
    assert selected == [0, 1, 0, 1, 0]


def test_probe_agrees_on_the_fewest_gpus_and_the_most_ranks_per_node(monkeypatch):
    local = SimpleNamespace(rank=1, size=2, Free=lambda: None)
    other_node = ("Another GPU", 4, 3, True, True, False)    # a rank elsewhere: 4 GPUs, 3 ranks, no NCCL

    class World:
        rank = 1

        def Split_type(self, kind, key):
            return local

        def allgather(self, mine):
            return [mine, other_node]
    chosen = []
    monkeypatch.setattr(bench, "use_gpu", lambda local_rank: chosen.append(local_rank) or "Stand-in GPU")
    monkeypatch.setattr(bench, "visible_gpus", lambda: 1)
    monkeypatch.setattr(bench, "gpu_mpi", lambda: (True, False))
    monkeypatch.setattr(bench.dist, "is_nccl_available", lambda: True)
    assert bench.probe_gpus(World()) == bench.Gpus("Stand-in GPU", per_node=1, ranks_per_node=3, kernels=True,
                                                   gpu_aware=False, nccl=False)
    assert chosen == [1]


@pytest.mark.parametrize("executor,device,gpus,reason", [
    ("cpp", "cpu", None, None),
    ("python", "cpu", None, None),
    ("gloo", "cpu", None, None),
    ("nccl", "cpu", None, "NCCL carries GPU buffers only"),
    ("cpp", "cuda", ONE_GPU_TWO_RANKS, None),       # MPI ranks share a GPU
    ("nccl", "cuda", ONE_GPU_TWO_RANKS, "NCCL refuses two ranks on one GPU (ncclInvalidUsage), and 2 ranks share 1"),
    ("nccl", "cuda", GPU_PER_RANK, None),
    ("nccl", "cuda", replace(GPU_PER_RANK, nccl=False), "this torch has no NCCL"),
    ("cpp", "cuda", replace(GPU_PER_RANK, kernels=False), "pccl's native module has no GPU kernels"),
    ("python", "cuda", GPU_PER_RANK, "the Python executor runs on host buffers only"),
    ("gloo", "cuda", GPU_PER_RANK, "gloo carries host buffers only"),
])
def test_executors_that_cannot_take_the_devices_buffers_are_skipped(executor, device, gpus, reason):
    why = bench.executor_skip(executor, device, gpus)
    assert why == reason if reason is None else reason in why


F32 = torch.float32


@pytest.mark.parametrize("collective,executor,algorithm,codec,dtype,device,plan_devices,gpus,reason", [
    ("all_gather", "cpp", "ring", "none", F32, "cuda", ("cpu", "cuda"), GPU_PER_RANK, None),
    ("all_gather", "mpi", "native", "none", F32, "cuda", ("cpu", "cuda"), GPU_PER_RANK, None),
    ("all_gather", "cpp", "hierarchical", "none", F32, "cuda", ("cpu", "cuda"), GPU_PER_RANK, None),
    ("all_gather", "cpp", "hierarchical", "none", F32, "cuda", ("cpu",), GPU_PER_RANK,
     "the plans' levels (--intra/--inter) carry cpu buffers only"),
    ("all_gather", "cpp", "ring", "int8", F32, "cuda", ("cpu", "cuda"), GPU_PER_RANK,
     "the MPI executors compress host buffers only"),
    ("all_gather", "nccl", "ring", "int8", F32, "cuda", ("cuda",), GPU_PER_RANK, None),
    ("all_gather", "nccl", "ring", "zfp:8", F32, "cuda", ("cuda",), GPU_PER_RANK, "the native codecs only"),
    ("all_gather", "nccl", "ring", "int8", F32, "cuda", ("cuda",), replace(GPU_PER_RANK, kernels=False),
     "GPU codecs need pccl's native module built with GPU kernels"),
    ("all_gather", "nccl", "ho_ring", "int8", F32, "cuda", ("cuda",), GPU_PER_RANK, "HO-Ring's concurrent phases"),
    ("reduce_scatter", "nccl", "ho_ring", "int8", F32, "cuda", ("cuda",), GPU_PER_RANK, None),
    # on CPU: the rows that used to stop the whole run
    ("all_reduce", "cpp", "ho_ring", "int8", F32, "cpu", ("cpu",), None, "HO-Ring's concurrent phases"),
    ("all_reduce", "cpp", "ring", "int8", torch.int32, "cpu", ("cpu",), None, "integer data is never compressed"),
    ("all_reduce", "cpp", "ring", "zfp:8", F32, "cpu", ("cpu",), None, None),
    ("all_reduce", "python", "hierarchical", "int8", F32, "cpu", ("cpu",), None, None),
])
def test_rows_that_cannot_run_are_skipped_with_the_reason(collective, executor, algorithm, codec, dtype, device,
                                                          plan_devices, gpus, reason):
    why = bench.row_skip(collective, executor, algorithm, codec, dtype, device, plan_devices, gpus)
    assert why == reason if reason is None else reason in why


def fake_comms(device_of_plans: dict[str, tuple[str, ...]]) -> dict:
    """Communicators as runs() sees them: 2 nodes of 2 ranks, plan levels carrying these devices."""
    return {e: SimpleNamespace(topology=Topology.regular(4, 2), selector=SimpleNamespace(plan_devices=d))
            for e, d in device_of_plans.items()}


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_on_gpus_every_algorithm_and_plan_of_the_cpu_run_still_runs(collective):
    args = dict(algorithms=None, compression=["int8"], datatype="float")
    on_cpu, _ = bench.runs(collective, SimpleNamespace(**args, device="cpu"), fake_comms({"cpp": ("cpu",)}), None)
    on_gpu, skipped = bench.runs(collective, SimpleNamespace(**args, device="cuda"),
                                 fake_comms({"cpp": ("cpu", "cuda"), "nccl": ("cuda",)}), GPU_PER_RANK)
    plain = lambda rows, executors: {a for e, _, a, c in rows if e in executors and c == "none"}  # noqa: E731
    # MPI's nonblocking collective is MPI's alone
    assert plain(on_cpu, ("cpp", "mpi")) == plain(on_gpu, ("cpp", "mpi")) == plain(on_gpu, ("nccl",)) | {
        "native_nonblocking"}
    assert {"hierarchical", "ho_ring", "native", "auto", "ring"} <= plain(on_gpu, ("nccl",))
    # compression: over NCCL only, and never HO-Ring's all-gather or all-reduce
    compressed = {(e, a) for e, _, a, c in on_gpu if c == "int8"}
    assert {e for e, _ in compressed} == {"nccl"}
    assert (("nccl", "ho_ring") in compressed) == (collective == "reduce_scatter")
    (mpi_reason,) = [r for r in skipped if "MPI executors" in r]
    assert "cpp ring+int8" in skipped[mpi_reason] and "mpi native" not in skipped[mpi_reason]


def test_cpu_header_is_unchanged_and_the_gpu_header_names_the_device_and_the_mpi_path():
    args = bench.parse_args(["-b", "4", "-e", "64K"])
    assert bench.run_header(args, 4, Topology.regular(4, 4)) == (
        "# pccl-bench  ranks: 4  nodes: 1x4  type: float  op: sum  minBytes: 4  maxBytes: 65536  step: 2(factor)  "
        "warmup iters: 5  iters: 20  repeats: 1  validation: 1")
    assert bench.device_header(ONE_GPU_TWO_RANKS) == (
        "# device: cuda  gpu: Stand-in GPU  gpus per node: 1  ranks per node: 2  MPI: staged through pinned host "
        "memory")
    assert "MPI: GPU-aware (device pointers)" in bench.device_header(replace(ONE_GPU_TWO_RANKS, gpu_aware=True))
    assert "MPI: no GPU kernels" in bench.device_header(replace(ONE_GPU_TWO_RANKS, kernels=False))


class RecordingWorld:
    def __init__(self, events):
        self.events = events

    def Barrier(self):
        self.events.append("barrier")

    def allreduce(self, value, op):
        self.events.append("allreduce")
        return value


def test_gpu_timing_waits_for_the_device_around_the_timed_loop_only():
    events = []
    seconds = cli.time_per_call(lambda: events.append("call"), iters=3, warmup=2, repeats=2,
                                world=RecordingWorld(events), synchronize=lambda: events.append("sync"))
    loop = ["sync", "barrier", "call", "call", "call", "sync", "allreduce"]
    assert events == ["call", "call"] + loop + loop   # one call: no switch to pay for between its loops
    assert seconds >= 0


def test_the_rows_of_a_size_take_turns_and_each_later_loop_follows_an_untimed_call():
    events = []
    times = cli.time_calls([lambda: events.append("a"), lambda: events.append("b")], iters=2, warmup=3, repeats=2,
                           world=RecordingWorld(events), synchronize=lambda: events.append("sync"))

    def loop(call):
        return ["sync", "barrier", call, call, "sync", "allreduce"]
    assert events == (["a"] * 3 + loop("a") + ["b"] * 3 + loop("b")     # the first turn warms each up
                      + ["a"] + loop("a") + ["b"] + loop("b"))          # later turns: one untimed call each
    assert len(times) == 2 and min(times) >= 0


def test_gpu_outputs_are_checked_on_the_host_against_the_same_reference():
    case = Case("reduce_scatter", 4 * 4 * 6, torch.float32, "sum", rank=1, ranks=4, device="meta")
    host = Case("reduce_scatter", 4 * 4 * 6, torch.float32, "sum", rank=1, ranks=4)
    assert case.output.device.type == "meta"   # allocated on the device it names
    assert torch.equal(case.expected, host.expected) and case.expected.device.type == "cpu"
    copies = []
    case.output = SimpleNamespace(cpu=lambda: copies.append(1) or host.expected.clone())   # a device output
    assert case.wrong() == 0 and copies == [1]   # copied to the host once, then compared


STAND_IN = "-m tests.pccl.workers.run_bench_stand_in_gpu"


@pytest.mark.mpi
def test_cuda_run_on_a_stand_in_gpu_skips_what_cannot_run_and_checks_the_rest(tmp_path):
    path = tmp_path / "rows.json"
    done = mpiexec(2, STAND_IN, "1", "--device", "cuda", "-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "-w", "1",
                   "--collectives", "all_gather,all_reduce", "--executors", "cpp,python,gloo,nccl",
                   "--compression", "int8", "--json", str(path), timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "# device: cuda  gpu: Stand-in GPU  gpus per node: 1  ranks per node: 2  MPI: staged" in out
    assert "# skipped python: the Python executor runs on host buffers only" in out
    assert "# skipped gloo: gloo carries host buffers only" in out
    assert "# skipped nccl: NCCL refuses two ranks on one GPU (ncclInvalidUsage), and 2 ranks share 1 GPU" in out
    assert "cpp ring+int8" in out and "the MPI executors compress host buffers only" in out
    assert "chosen: [0, 0]" in done.stderr   # both ranks on GPU 0
    rows = json.loads(path.read_text())
    for collective in ("all_gather", "all_reduce"):
        mine = {(r["executor"], r["algorithm"]) for r in rows if r["collective"] == collective}
        assert mine == {("cpp", a) for a in algorithms_for(collective) + ("auto",)} | {("mpi", n) for n in NATIVES}
    assert all(r["device"] == "cuda" and r["wrong"] == 0 and r["compression"] == "none" for r in rows)
    # per row: around the timed loop (one repeat), and before the check
    assert f"synchronized: {3 * len(rows)}" in done.stderr


@pytest.mark.mpi
def test_cuda_run_where_no_executor_can_run_fails_before_sending_anything():
    done = mpiexec(2, STAND_IN, "1", "--device", "cuda", "--executors", "python,nccl", timeout=120)
    assert done.returncode == 1
    assert "no executor of python,nccl can run cuda buffers here" in done.stderr
    assert "NCCL refuses two ranks on one GPU" in done.stderr and "# pccl-bench" not in done.stdout


# The CPU run's table (2 ranks; times and bandwidths masked, and what auto ran, which the
# self-calibration measured in the run: auto(*)).
CPU_TABLE = """\
# pccl-bench  ranks: 2  nodes: 1x2  type: float  op: sum  minBytes: 1024  maxBytes: 4096  step: 4(factor)  warmup iters: 0  iters: 1  repeats: 1  validation: 1
#
# all_reduce
#-------------------------------------------------------------------------------------------------------------------------------------
#    size(B)        count     type executor                  algorithm    time(us) algbw(GB/s) busbw(GB/s)  #wrong    maxerr    rmserr
#-------------------------------------------------------------------------------------------------------------------------------------
1024 256 float cpp ring * * * 0 - -
1024 256 float mpi native * * * 0 - -
1024 256 float cpp auto(*) * * * 0 - -
1024 256 float python ring * * * 0 - -
1024 256 float python auto(*) * * * 0 - -
1024 256 float gloo ring * * * 0 - -
1024 256 float gloo native * * * 0 - -
1024 256 float gloo auto(*) * * * 0 - -
4096 1024 float cpp ring * * * 0 - -
4096 1024 float mpi native * * * 0 - -
4096 1024 float cpp auto(*) * * * 0 - -
4096 1024 float python ring * * * 0 - -
4096 1024 float python auto(*) * * * 0 - -
4096 1024 float gloo ring * * * 0 - -
4096 1024 float gloo native * * * 0 - -
4096 1024 float gloo auto(*) * * * 0 - -
#
# all_reduce: fastest algorithm per executor (* = auto's pick)
#    size(B)                          cpp                          mpi                       python                         gloo
#
# all_reduce: auto against the fastest of native and every algorithm
#    size(B) executor   auto(us)   best(us) auto/best  auto ran -> fastest"""  # noqa: E501
AUTO_NOTE = re.compile(r"# auto \((cpp|python|gloo)\): self-calibration (\S+\.json); figures for all_reduce/full; "
                       r"measured in this run: all_reduce/full (\d+\.\d\d) s, \3 s in all$")


@pytest.mark.mpi
def test_cpu_run_prints_its_table(monkeypatch, tmp_path):
    """As a new user runs it: no profile chosen and an empty cache, so every executor's auto
    measures its candidates in the run, within the self-calibration's real budget, into a
    file of its own (the executor is part of the key), says so, and runs one of them."""
    monkeypatch.delenv("PCCL_PROFILE", raising=False)
    monkeypatch.setenv("PCCL_CACHE_DIR", str(tmp_path))
    done = mpiexec(2, "-m pccl.tools.bench", "-b", "1K", "-e", "4K", "-f", "4", "-n", "1", "-w", "0",
                   "--collectives", "all_reduce", "--algorithms", "ring,native,auto", timeout=120)
    assert done.returncode == 0, done.stderr
    lines, picks, notes = [], set(), {}
    for line in done.stdout.splitlines():
        cells = line.split()
        if AUTO_NOTE.match(line):
            executor, path, seconds = AUTO_NOTE.match(line).groups()
            notes[executor] = (path, float(seconds))
        elif line.startswith("#") and not line.startswith("# auto ("):
            lines.append(line.rstrip())
        elif len(cells) == 11:   # a table row; the summaries' rows (timings) are left out
            if cells[4].startswith("auto("):
                picks.add(cells[4][5:-1])
                cells[4] = "auto(*)"
            lines.append(" ".join(cells[:5] + ["*"] * 3 + cells[8:]))
    assert "\n".join(lines) == CPU_TABLE
    assert picks <= set(algorithms_for("all_reduce") + NATIVES), picks
    assert notes.keys() == {"cpp", "python", "gloo"}, done.stdout[-2000:]
    assert len({path for path, _ in notes.values()}) == 3 == len(list(tmp_path.rglob("*.json")))
    assert all(0 < seconds < 3 for _, seconds in notes.values()), notes   # a budget of 0.4 s, and first calls


# ------------------------------------------------------ on a GPU (make test-gpu)


def gpu_rows(done, path) -> list[dict]:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(path.read_text())
    assert rows and all(r["device"] == "cuda" for r in rows)
    wrong = [(r["collective"], r["size"], r["executor"], r["algorithm"], r["wrong"]) for r in rows
             if r["compression"] == "none" and r["wrong"] != 0]
    assert not wrong, wrong[:20]
    return rows


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: torch.cuda.is_available() is False")
@pytest.mark.parametrize("gpu_aware", ["0", "1"])
@pytest.mark.parametrize("datatype,op", [("float", "sum"), ("bfloat16", "avg")])
def test_on_a_gpu_two_ranks_share_it_over_mpi_and_every_row_is_right(gpu_aware, datatype, op, monkeypatch, tmp_path):
    from tests.support.gpu import no_mpi_gpu_reason

    if no_mpi_gpu_reason():
        pytest.skip(no_mpi_gpu_reason())
    if gpu_aware == "1" and os.environ.get("PCCL_TEST_GPU_AWARE_MPI") != "1":
        pytest.skip("set PCCL_TEST_GPU_AWARE_MPI=1 where the MPI library is GPU-aware")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    monkeypatch.setenv("PCCL_GPU_AWARE_MPI", gpu_aware)
    path = tmp_path / "rows.json"
    done = mpiexec(2, "-m pccl.tools.bench", "--device", "cuda", "-b", "4", "-e", "1M", "-f", "16", "-n", "5",
                   "-w", "2", "-d", datatype, "-o", op, "--collectives", "all_gather,reduce_scatter,all_reduce",
                   "--compression", "int8", "--json", str(path), timeout=600)
    rows = gpu_rows(done, path)
    print(done.stdout)
    assert "# device: cuda  gpu: " in done.stdout and "gpus per node: 1  ranks per node: 2" in done.stdout
    assert ("MPI: GPU-aware" if gpu_aware == "1" else "MPI: staged through pinned host memory") in done.stdout
    assert "# skipped nccl: NCCL refuses two ranks on one GPU (ncclInvalidUsage), and 2 ranks share 1" in done.stdout
    assert "the MPI executors compress host buffers only" in done.stdout
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        mine = {(r["executor"], r["algorithm"]) for r in rows if r["collective"] == collective}
        assert mine == {("cpp", a) for a in algorithms_for(collective) + ("auto",)} | {("mpi", n) for n in NATIVES}


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: torch.cuda.is_available() is False")
def test_on_two_gpus_nccl_rows_are_right(tmp_path):
    from tests.support.gpu import no_gpu_reason, no_mpi_gpu_reason

    if no_gpu_reason(2):
        pytest.skip(no_gpu_reason(2))
    gpu_build = no_mpi_gpu_reason() is None
    executors = "cpp,nccl" if gpu_build else "nccl"
    path = tmp_path / "rows.json"
    done = mpiexec(2, "-m pccl.tools.bench", "--device", "cuda", "-b", "4", "-e", "1M", "-f", "16", "-n", "5",
                   "-w", "2", "--collectives", "all_gather,reduce_scatter,all_reduce", "--executors", executors,
                   "--compression", "int8", "--json", str(path), timeout=600)
    rows = gpu_rows(done, path)
    print(done.stdout)
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        mine = {(r["algorithm"], r["compression"]) for r in rows if r["collective"] == collective
                and r["executor"] == "nccl"}
        plain = {(a, "none") for a in algorithms_for(collective) + ("native", "auto")}
        compressed = {(a, "int8") for a in algorithms_for(collective) + ("auto",)} if gpu_build else set()
        assert mine == plain | compressed
    # int8: the bound the CPU test (3 ranks) holds to; 2 ranks round fewer times
    assert all(r["max_error"] <= 3 * 0.5 / 127 for r in rows if r["compression"] == "int8")


@pytest.mark.mpi
def test_auto_rows_name_what_their_calls_ran(tmp_path):
    """The label was the tuner's plain pick: MPI's own collective where a float max ran a
    schedule, and where an int8-compressed auto (which never runs MPI's own) ran another."""
    report = report_of({}, None, tmp_path, 2, "-m tests.pccl.workers.run_bench_auto_pick", timeout=180)
    assert "_launch" not in report, report.get("_launch")
    assert report["wrong"] == [], "\n".join(report["rows"])
