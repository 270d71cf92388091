"""pccl-bench: size parsing and rounding, bandwidth formulas, test data, and one small run."""
import json
import os

import pytest
import torch

from pccl.algorithms import algorithms_for
from pccl.core.dtypes import DATATYPES
from pccl.tools.bench import Case, bandwidths, bus_factor, value_modulus
from pccl.tools.cli import round_size, size_sweep
from pccl.util.sizes import parse_size
from tests.support.mpirun import MPIEXEC, mpiexec


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
        expected.add(("mpi", "native"))
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
