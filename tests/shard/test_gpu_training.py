"""GPT training with the engine on GPUs, measured (worker: tests/shard/workers/run_gpu_training.py):

- a torch.profiler trace of one training step of gpt_125m (ZeRO-3, bf16) on all local GPUs
  over NCCL, and on 2 ranks over MPI (sharing one GPU where there is one), exported as a
  Chrome trace (tmp dir, and $PCCL_GPU_TRACE_DIR when set): at least one communication
  kernel (NCCL's, pccl's reduction kernels, or over MPI a staging copy between the GPU and
  pinned host memory on a lane's stream) runs while a compute kernel runs on the training
  loop's stream;
- the MFU of gpt_1p3b on one GPU (bf16, sequences of 2048) from the model's FLOPs per token
  and shard.planning.throughput's peak, printed and written to mfu.json (same places); a
  measurement, so only its sanity is asserted (0 < MFU < 1).

Skipped, with the reason, without a GPU (or fewer than 2 for the NCCL trace), without NCCL
in torch, without pccl's GPU build (the MPI trace), or (MFU) on a GPU whose peak
shard.planning.throughput does not know. The trace analysis itself is checked everywhere,
on a hand-made trace. make test-gpu runs these (docs/gpu.md, "GPU test suite").
"""
from __future__ import annotations

import json

import pytest

from tests.shard.workers.run_gpu_training import overlap_summary
from tests.support.gpu import GPUS, keep, no_gpu_reason, no_mpi_gpu_reason
from tests.support.mpirun import report_of

WORKER = "-m tests.shard.workers.run_gpu_training"

_reports: dict = {}


def kernel(name: str, start: float, dur: float, stream: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": start, "dur": dur,
            "args": {"device": 0, "stream": stream}}


def test_trace_analysis_finds_communication_under_compute():
    """Compute on stream 7, NCCL on stream 20: the second all-gather runs under the gemm."""
    trace = {"traceEvents": [
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 100.0, 50.0, 7),
        kernel("void at::native::vectorized_elementwise_kernel<4>", 150.0, 5.0, 7),
        kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 60.0, 30.0, 20),
        kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 140.0, 20.0, 20),
        kernel("void at::native::elementwise_kernel", 10.0, 2.0, 21),   # another stream, not compute
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 500.0, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0.0, "dur": 500.0, "pid": 1, "tid": 1},
    ]}
    summary = overlap_summary(trace)
    assert summary["kernels"] == 5 and summary["comm_kernels"] == 2 and summary["compute_kernels"] == 2
    assert summary["compute_stream"] == "(0, 7)"
    assert summary["overlapping_pairs"] == 2                    # the gemm (140-150) and the elementwise (150-155)
    assert summary["overlap_us"] == pytest.approx(15.0)
    assert summary["example"]["comm"].startswith("ncclDevKernel_AllGather")
    # The same kernels one after the other: no overlap.
    serial = {"traceEvents": [kernel("sm90_gemm", 0.0, 10.0, 7), kernel("ncclDevKernel_Send", 10.0, 5.0, 20),
                              kernel("pccl::gpu::(anonymous namespace)::combine<float>", 15.0, 1.0, 21)]}
    summary = overlap_summary(serial)
    assert summary["comm_kernels"] == 2 and summary["overlapping_pairs"] == 0


def copy(name: str, start: float, dur: float, stream: int) -> dict:
    return {**kernel(name, start, dur, stream), "cat": "gpu_memcpy"}


def test_trace_analysis_counts_staging_copies_off_the_compute_stream():
    """Over MPI without GPU-aware transport, what communication puts on the GPU is its
    staging copies on the lane's stream (and, for reductions of schedules, pccl's kernels;
    MPI's own collectives reduce on the host): those under compute overlap it. A copy on
    the compute stream (a loss read back) and a device-to-device copy are not communication."""
    trace = {"traceEvents": [
        kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 100.0, 50.0, 7),
        copy("Memcpy DtoH (Device -> Pinned)", 120.0, 10.0, 20),
        copy("Memcpy HtoD (Pinned -> Device)", 160.0, 10.0, 20),      # after the gemm: no overlap
        copy("Memcpy DtoH (Device -> Pageable)", 140.0, 5.0, 7),        # the loop's own, on its stream
        copy("Memcpy DtoD (Device -> Device)", 110.0, 5.0, 20),
    ]}
    summary = overlap_summary(trace)
    assert summary["kernels"] == 1 and summary["compute_kernels"] == 1 and summary["compute_stream"] == "(0, 7)"
    assert summary["comm_kernels"] == 2 and summary["comm_streams"] == ["(0, 20)"]
    assert summary["overlapping_pairs"] == 1 and summary["overlap_us"] == pytest.approx(10.0)
    assert summary["example"]["comm"] == "Memcpy DtoH (Device -> Pinned)"


def launched(tmp_path_factory, scenario: str, reason, ranks: int, timeout: float):
    """The worker's `scenario` on `ranks` ranks (skipped where `reason` says why it cannot
    run here): its directory and its report."""
    if reason:
        pytest.skip(reason)
    directory = tmp_path_factory.mktemp(scenario)
    report = report_of(_reports, scenario, directory, ranks, WORKER, scenario, str(directory), timeout=timeout)
    assert "_launch" not in report, report.get("_launch")
    return directory, report


def trace_launch(scenario: str):
    """(why it cannot run here or None, ranks): NCCL one rank per GPU, MPI 2 ranks."""
    if scenario == "trace-mpi":
        return no_mpi_gpu_reason(), 2
    return no_gpu_reason(2), GPUS


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("scenario", ["trace", "trace-mpi"])
def test_profiled_step_overlaps_communication_with_compute(tmp_path_factory, scenario):
    reason, ranks = trace_launch(scenario)
    directory, report = launched(tmp_path_factory, scenario, reason, ranks, timeout=900)
    assert report["world"] == ranks and len(report["ranks"]) == ranks
    kept = keep(*sorted(directory.glob("trace-rank*.json")), directory / "report.json")
    print(f"traces: {directory}" + (f", kept in {kept}" if kept else ""))
    first = report["ranks"][0]
    print(json.dumps({k: first[k] for k in ("comm_kernels", "compute_kernels", "overlapping_pairs", "overlap_us",
                                            "comm_us", "example")}, indent=1))
    if first["kernels"] == 0:
        pytest.skip("torch.profiler recorded no GPU kernels here (is CUPTI missing?), so overlap cannot be seen")
    assert first["comm_kernels"] > 0, \
        f"no communication on the GPU (NCCL or pccl kernels, staging copies) in rank 0's trace: {first}"
    assert first["compute_kernels"] > 0, f"no compute kernel in rank 0's trace: {first}"
    assert first["overlapping_pairs"] > 0, f"no communication kernel ran under compute on rank 0: {first}"


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.slow
def test_gpt_1p3b_mfu_on_one_gpu(tmp_path_factory):
    directory, report = launched(tmp_path_factory, "mfu", no_gpu_reason(1), ranks=1, timeout=1200)
    kept = keep(directory / "mfu.json")
    print(json.dumps(report, indent=1) + f"\nwritten to {directory / 'mfu.json'}" + (f" and {kept}" if kept else ""))
    assert all(loss == loss and 0 < loss < 20 for loss in report["losses"]), report["losses"]   # finite, sane
    assert report["tokens_per_s"] > 0
    if report["mfu"] is None:
        pytest.skip(f"MFU needs the device's peak: {report['peak_source']} (tokens/s {report['tokens_per_s']:.0f})")
    assert 0 < report["mfu"] < 1, report
