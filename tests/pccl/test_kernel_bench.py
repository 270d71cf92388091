"""pccl-kernel-bench: runs, checks the kernels and reports consistent figures (the
figures themselves are for benchmarks, not for tests)."""
import json

import pytest

from pccl.tools import kernel_bench


def test_kernel_bench_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    rows = kernel_bench.run(["--device", "cpu", "-d", "float,half,bfloat16", "-o", "sum,max", "-b", "4K",
                             "-e", "16K", "-n", "2", "-w", "1", "--repeats", "2", "--json", str(out)])
    assert [(r.datatype, r.op, r.nbytes) for r in rows] == [
        (d, o, n) for d in ("float", "half", "bfloat16") for o in ("sum", "max") for n in (4096, 16384)]
    for r in rows:
        assert r.wrong == 0 and r.device == "cpu"
        assert r.pccl_GBps == pytest.approx(3 * r.nbytes / (r.pccl_us * 1e3))
        assert r.copy_GBps == pytest.approx(2 * r.nbytes / (r.copy_us * 1e3))
        assert r.of_copy == pytest.approx(r.pccl_GBps / r.copy_GBps)
        assert r.of_torch == pytest.approx(r.pccl_GBps / r.torch_GBps)
    assert json.loads(out.read_text())[0]["nbytes"] == 4096
    table = capsys.readouterr().out
    assert "of copy" in table and "of torch" in table and len(table.splitlines()) == 2 + len(rows)


def test_kernel_bench_counts_wrong_elements(monkeypatch):
    # A kernel that leaves a unchanged must be reported, not timed as fast.
    monkeypatch.setattr(kernel_bench, "pccl_call", lambda a, b, op: (lambda: None))
    with pytest.raises(SystemExit, match="differ from torch"):
        kernel_bench.run(["--device", "cpu", "-d", "float", "-b", "1K", "-e", "1K", "-n", "1", "--repeats", "1"])


def test_kernel_bench_refuses_a_gpu_it_cannot_use():
    if kernel_bench.native_module().gpu_platform is not None:
        pytest.skip("this build has GPU kernels")
    with pytest.raises(SystemExit, match="GPU"):
        kernel_bench.run(["--device", "cuda"])


def test_kernel_bench_all_names_every_dtype_and_op():
    args = kernel_bench.parse_args(["-d", "all", "-o", "all"])
    assert args.datatypes == ["float", "double", "half", "bfloat16", "int32", "int64"]
    assert args.ops == ["sum", "max", "min"]


@pytest.mark.parametrize("argv,message", [
    (["-o", "avg"], "comma list"), (["-b", "1M", "-e", "1K"], "minbytes"), (["-f", "1"], "stepfactor")])
def test_kernel_bench_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        kernel_bench.parse_args(argv)
    assert message in capsys.readouterr().err
