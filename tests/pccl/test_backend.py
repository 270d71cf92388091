"""pccl as a torch.distributed backend (pccl.distributed): PyTorch's FSDP2, DDP and DTensor on
it, checked against a single-process reference and against gloo in the same launch
(worker tests/pccl/workers/run_backend.py), plus what needs no launch."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.support.gpu import GPUS, no_gpu_reason
from tests.support.mpirun import ROOT, job_env, mpiexec

RUNS = ("fsdp2_fp32", "fsdp2_bf16", "ddp")
# SGD, 3 steps: fp32 runs agree with the reference up to the order of fp32 sums. bf16
# parameters cannot follow an fp32 reference that closely (~2% here, the same for gloo);
# against gloo, whose bf16 runs round the same way, they agree to fp32 rounding.
FP32 = 2e-6
BF16_VS_REFERENCE = 5e-2


def launch(tmp_path, ranks: int, launcher: str = "mpiexec") -> dict:
    report = tmp_path / "report.json"
    args = ("-m tests.pccl.workers.run_backend", str(report), str(tmp_path / "dcp"))
    if launcher == "mpiexec":
        run = mpiexec(ranks, *args, timeout=600)
    else:
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                              str(ranks), *args[0].split(), *args[1:]], env=job_env(), capture_output=True,
                             text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0 and report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["transport"] == ("mpi" if launcher == "mpiexec" else "torch"), result["transport"]
    return result


def check(report: dict) -> None:
    assert report["backend"] == "pccl" and not report["failures"], report["failures"]
    for run in RUNS:
        r = report[run]
        calls = r["pccl_calls"]
        if run == "ddp":
            assert calls.get("all_reduce", 0) >= 3, calls          # one bucket a step at least
        else:
            assert calls.get("all_gather", 0) > 0 and calls.get("reduce_scatter", 0) > 0, calls
        assert r["pccl_vs_gloo"] <= FP32, (run, r)
        limit = BF16_VS_REFERENCE if run == "fsdp2_bf16" else FP32
        assert r["pccl_vs_reference"] <= limit and r["gloo_vs_reference"] <= limit, (run, r)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,kernels", [(2, None), (3, None), (4, None), (3, "avx2")],
                         ids=["2", "3", "4", "3-avx2-kernels"])
def test_fsdp2_ddp_dtensor_and_checkpoints_on_the_pccl_backend(tmp_path, monkeypatch, ranks, kernels):
    """FSDP2's reduce-scatters are ReduceOp.AVG. torch picks its CPU kernels by the CPU's
    instruction set, and the bf16 run's values with them: with the AVX2 kernels (CPUs without
    AVX-512), a one-ulp difference between pccl's avg and gloo's flips bf16 roundings of the
    parameters (1.3e-3 apart when the C++ executor multiplied by 1/3), with AVX-512's it
    happens not to. ATEN_CPU_CAPABILITY=avx2 runs those kernels here too."""
    if kernels:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", kernels)
    check(launch(tmp_path, ranks))


@pytest.mark.mpi
def test_under_torchrun_pccls_algorithms_run_over_gloo(tmp_path, monkeypatch):
    """No MPI job: the backend runs pccl's schedules over a gloo group of the same ranks, and
    auto (as shipped, from an empty cache) measured them against gloo's own collectives."""
    monkeypatch.setenv("PCCL_CACHE_DIR", str(tmp_path / "calibration"))
    report = launch(tmp_path, 3, launcher="torchrun")
    check(report)
    assert report["auto"].startswith(f"self-calibration {tmp_path / 'calibration'}") and \
        "measured in this run: all_gather" in report["auto"], report["auto"]


@pytest.mark.mpi
@pytest.mark.parametrize("launcher,algorithm", [("mpiexec", "hierarchical"), ("mpiexec", "ho_ring"),
                                                ("torchrun", "hierarchical")])
def test_pccl_algo_picks_the_plan_for_torchs_collectives(tmp_path, monkeypatch, launcher, algorithm):
    """4 ranks as 2 emulated nodes; the even ranks' sub-group and the 2x2 mesh's sub-meshes
    span both nodes or one, and run flat there."""
    monkeypatch.setenv("PCCL_ALGO", algorithm)
    monkeypatch.setenv("PCCL_RANKS_PER_NODE", "2")
    report = launch(tmp_path, 4, launcher)
    check(report)
    plan = "HORing" if algorithm == "ho_ring" else "Hierarchical"
    assert all(plan in spec for spec in report["resolved"].values()), report["resolved"]


def test_a_bad_timeout_is_refused_before_any_rendezvous():
    import pccl.distributed

    for bad in ("60", 0, -1, True):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds or a timedelta"):
            pccl.distributed.init_process_group(timeout=bad)


def test_importing_registers_the_backend_for_cpu_and_cuda():
    import pccl.distributed  # noqa: F401

    assert "pccl" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["pccl"] == ["cpu", "cuda"]
    assert dist.Backend.default_device_backend_map["cpu"] != "pccl", "the default CPU backend is left alone"


def test_unsupported_reduce_ops_are_named():
    from pccl.distributed import op_name

    assert [op_name(op) for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX,
                                   dist.ReduceOp.MIN)] == ["sum", "avg", "max", "min"]
    for op in (dist.ReduceOp.PRODUCT, dist.ReduceOp.BAND, dist.ReduceOp.BXOR):
        with pytest.raises(ValueError, match=rf"does not implement ReduceOp.{op.name}; it implements ReduceOp.SUM"):
            op_name(op)


def test_options_name_collectives_and_pick_per_collective():
    from pccl.distributed import Options

    options = Options(algorithm="hierarchical", algorithms={"all_reduce": "native"})
    assert options.algorithm_for("all_gather") == "hierarchical" and options.algorithm_for("all_reduce") == "native"
    with pytest.raises(ValueError, match=r"algorithms names collectives \['allgather'\]"):
        Options(algorithms={"allgather": "ring"})


def test_every_forwarded_operation_goes_to_the_companion_of_its_tensors_device():
    from pccl.distributed import FORWARDED, ProcessGroupPccl

    class Companion:
        def __getattr__(self, name):
            return lambda *args, **kwargs: (name, args)

    pg = ProcessGroupPccl.__new__(ProcessGroupPccl)
    pg._comms = {}   # no pccl work queued (barrier drains it first)
    seen = []
    pg.companion = lambda device: seen.append(device.type) or Companion()
    x = torch.ones(2)
    for name in FORWARDED:
        assert getattr(pg, name)([x], "opts") == (name, ([x], "opts"))
    assert seen == ["cpu"] * len(FORWARDED)
    assert getattr(pg, "broadcast")([], "opts")[0] == "broadcast"   # no tensor: the CPU companion
    # gloo reads a strided view as dense memory and writes outside it (measured: a broadcast
    # into b[:, 1::2] of a 6 x 4 tensor changed 6 elements outside the view). It was refused,
    # on the rank holding the view alone, and the others waited out the timeout: now the
    # companion gets a contiguous copy, written back into the view when the call completes,
    # for forwarded operations and for dtypes pccl leaves to the companion (int8 sums).
    class Dense:
        """Writes 7 over its tensors as dense memory (a view's would fail), then completes."""
        def __getattr__(self, name):
            def call(tensors, opts):
                for t in tensors:
                    t.view(-1).fill_(7)
                future = torch.futures.Future()
                future.set_result(tensors)
                return SimpleNamespace(get_future=lambda: future)
            return call
    pg.companion = lambda device: Dense()
    for name, dtype in (("broadcast", torch.float32), ("reduce", torch.float32), ("send", torch.float32),
                        ("allreduce", torch.int8), ("allreduce_coalesced", torch.bool)):
        base = torch.zeros(6, 4, dtype=dtype)
        assert getattr(pg, name)([base[:, 1::2]], "opts").wait()
        assert base[:, 1::2].eq(torch.tensor(7).to(dtype)).all() and not base[:, 0::2].any(), name


def test_all_to_all_runs_as_alltoall_base_where_the_companion_lacks_the_list_form():
    """gloo in torch 2.11 has no list-form alltoall: the group runs it as alltoall_base."""
    from datetime import timedelta

    from pccl.distributed import ProcessGroupPccl

    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))

    class Companion:   # gloo without the list form, as in torch 2.11
        def alltoall(self, *args):
            raise RuntimeError("Backend gloo does not support alltoall")

        def alltoall_base(self, *args):
            return gloo.alltoall_base(*args)

    pg = ProcessGroupPccl.__new__(ProcessGroupPccl)
    pg.companion = lambda device: Companion()
    out = [torch.empty(2, 3)]
    assert pg.alltoall(out, [torch.arange(6.0).view(2, 3)], dist.AllToAllOptions()).wait()
    assert torch.equal(out[0], torch.arange(6.0).view(2, 3)) and not pg._companion_has_alltoall


def test_a_pccl_timeout_reaches_the_waiter_as_torchs_error_after_every_work():
    from pccl.core.errors import CollectiveTimeout
    from pccl.distributed.backend import Completion, on_pccl

    class Work:
        def add_done_callback(self, fn):
            self.done = fn

    first, second, finished = Work(), Work(), []
    completion = Completion([first, None, second], ["result"], finish=lambda: finished.append(True))
    first.done(None)
    assert not completion.future.done() and not finished, "complete before its last work"
    second.done(None)
    assert completion.work().wait() and completion.future.wait() == ["result"] and finished == [True]

    late = Work()
    completion = Completion([late], [])
    late.done(CollectiveTimeout("rank 2 timed out waiting for peers 3"))
    with pytest.raises(dist.DistBackendError, match="waiting for peers 3"):
        completion.work().wait()

    def times_out():
        raise CollectiveTimeout("rank 0 timed out")
    with pytest.raises(dist.DistBackendError, match="rank 0 timed out"):
        on_pccl(times_out)


def test_copies_out_after_a_gpu_collective_run_on_the_callers_stream(monkeypatch):
    """A list all-gather's copy-out (or a non-contiguous output's copy-back) runs when the
    last work finishes, on pccl's worker thread, whose current stream is not the caller's:
    it must run on the stream the caller had when it made the call, as the collective
    does (on CPU, a stand-in that records which tensor's stream each finish is bound to,
    at the call, on the caller's thread)."""
    from pccl.distributed import backend

    bound = []

    def on_callers_stream(fn, like):
        bound.append((like, threading.current_thread()))
        return fn
    monkeypatch.setattr(backend, "on_callers_stream", on_callers_stream)

    class Work:
        def add_done_callback(self, fn):
            self.done = fn

    outputs = [[torch.empty(2), torch.empty(2)]]
    work, copied = Work(), []
    completion = backend.Completion([work], outputs, finish=lambda: copied.append(True))
    assert len(bound) == 1 and bound[0][0] is outputs[0][0] and bound[0][1] is threading.current_thread()
    worker = threading.Thread(target=work.done, args=(None,))
    worker.start()
    worker.join()
    assert copied == [True] and completion.work().wait()
    backend.Completion([Work()], [torch.empty(1)])   # nothing to finish: nothing bound
    assert len(bound) == 1


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(no_gpu_reason(2) is not None, reason=str(no_gpu_reason(2)))
def test_fsdp2_ddp_and_dtensor_on_gpus_on_the_pccl_backend(tmp_path, monkeypatch):
    """CUDA tensors: pccl over NCCL groups (or MPI's GPU path in a GPU build), against
    NCCL and the single-process reference, one GPU per rank."""
    monkeypatch.setenv("PCCL_TEST_DEVICE", "cuda")
    check(launch(tmp_path, min(GPUS, 4)))
