"""mpiexec worker: a GPT trained with the engine on GPUs, measured.

Usage: mpiexec -n P python -m tests.shard.workers.run_gpu_training SCENARIO DIR REPORT.json
  trace  P >= 2 GPUs over NCCL: gpt_125m (ZeRO-3, bf16), two warm-up steps, then one step
         under torch.profiler; each rank writes DIR/trace-rank{r}.json (Chrome trace) and
         the report holds every rank's overlap of communication and compute kernels
  trace-mpi  the same over the MPI transport, where ranks may share one GPU (the
         communication on the GPU is then the staging copies between it and pinned host
         memory on the lanes' streams, and pccl's reduction kernels)
  mfu    one GPU: gpt_1p3b (ZeRO-3 on one rank, bf16, sequences of 2048), tokens/s after
         warm-up, model TFLOP/s and MFU from the model's FLOPs per token and
         shard.planning.throughput's peak; also written to DIR/mfu.json
Each rank uses GPU (local rank) % device count. Importing this module starts nothing: the
trace analysis below is shared with tests/shard/test_gpu_training.py.
"""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

# Kernel names of communication: NCCL's (ncclDevKernel_*, ncclKernel_*) and pccl's own
# reduction and scaling kernels (csrc/gpu/reduce.cu, namespace pccl::gpu).
COMM_MARKERS = ("nccl", "pccl::gpu::")
# Copies between the GPU and host memory ("Memcpy DtoH (Device -> Pinned)"): over MPI without
# GPU-aware transport, the staging of messages; communication where they run off the
# training loop's stream (its own copies, such as a loss read back, run on it).
HOST_COPY_MARKERS = ("dtoh", "htod")


def is_comm(name: str) -> bool:
    lower = name.lower()
    return any(marker in lower for marker in COMM_MARKERS)


def is_compute(event: dict) -> bool:
    return event["kind"] == "kernel" and not is_comm(event["name"])


def is_host_copy(event: dict) -> bool:
    return event["kind"] == "gpu_memcpy" and any(m in event["name"].lower() for m in HOST_COPY_MARKERS)


def kernels(trace: dict) -> list[dict]:
    """The GPU kernels and copies of a Chrome trace as torch.profiler exports it: complete
    events ("ph": "X") of category "kernel" or "gpu_memcpy", each with its kind (the
    category), start and end (microseconds), stream and device."""
    out = []
    for e in trace.get("traceEvents", []):
        kind = str(e.get("cat", "")).lower()
        if e.get("ph") != "X" or kind not in ("kernel", "gpu_memcpy"):
            continue
        args = e.get("args") or {}
        start = float(e["ts"])
        out.append({"name": str(e.get("name", "")), "kind": kind, "start": start,
                    "end": start + float(e.get("dur", 0.0)),
                    "stream": (args.get("device", e.get("pid")), args.get("stream", e.get("tid")))})
    return out


def overlap_summary(trace: dict) -> dict:
    """How communication overlaps compute. The compute stream is the stream that ran the
    most time of kernels that are not communication (the training loop's); communication
    is NCCL's and pccl's kernels, and copies between the GPU and host memory on other
    streams (MPI's staging); each on another stream than compute is intersected with
    that stream's kernels."""
    found = kernels(trace)
    busy: dict = defaultdict(float)
    for k in filter(is_compute, found):
        busy[k["stream"]] += k["end"] - k["start"]
    main = max(busy, key=busy.get) if busy else None
    comm = [k for k in found if (k["kind"] == "kernel" and is_comm(k["name"]))
            or (is_host_copy(k) and k["stream"] != main)]
    compute = sorted((k for k in filter(is_compute, found) if k["stream"] == main), key=lambda k: k["start"])
    pairs, overlapped, example = 0, 0.0, None
    for c in comm:
        if c["stream"] == main:
            continue
        for k in compute:
            if k["start"] >= c["end"]:
                break
            both = min(c["end"], k["end"]) - max(c["start"], k["start"])
            if both > 0:
                pairs += 1
                overlapped += both
                if example is None:
                    example = {"comm": c["name"][:200], "compute": k["name"][:200], "overlap_us": both}
    return {"kernels": sum(k["kind"] == "kernel" for k in found), "comm_kernels": len(comm),
            "comm_us": sum(c["end"] - c["start"] for c in comm),
            "compute_kernels": len(compute), "compute_stream": str(main),
            "comm_streams": sorted({str(c["stream"]) for c in comm}), "overlapping_pairs": pairs,
            "overlap_us": overlapped, "example": example}


def main() -> None:
    scenario, directory, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    import torch
    from mpi4py import MPI

    import pccl
    from shard import Engine, ShardedAdamW
    from shard.models import GPT, GPTConfig
    from shard.planning.throughput import Throughput, peak_tflops

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    torch.cuda.set_device(node.rank % torch.cuda.device_count())   # before any NCCL group exists
    node.Free()
    device = torch.device("cuda", torch.cuda.current_device())
    comm = pccl.init(transport="mpi" if scenario == "trace-mpi" else "nccl", timeout=600)
    rank = comm.rank

    def batches(cfg: GPTConfig, micro: int, size: int, seq: int, seed: int) -> list:
        g = torch.Generator(device=device).manual_seed(seed)
        tokens = [torch.randint(0, cfg.vocab, (size, seq + 1), device=device, generator=g) for _ in range(micro)]
        return [(t[:, :-1], t[:, 1:]) for t in tokens]

    def train_step(optimizer, data) -> torch.Tensor:
        engine, total = optimizer.engine, torch.zeros((), device=device)
        for x, y in data:
            loss = engine(x, targets=y)
            engine.backward(loss)
            total += loss.detach()
        optimizer.step()
        return total / len(data)

    directory.mkdir(parents=True, exist_ok=True)
    if scenario in ("trace", "trace-mpi"):
        from torch.profiler import ProfilerActivity, profile

        cfg = GPTConfig.preset("gpt_125m")
        with torch.device(device):
            model = GPT(cfg)
        engine = Engine(model, comm, strategy="zero3", precision="bf16")
        optimizer = ShardedAdamW(engine)
        data = batches(cfg, micro=2, size=8, seq=512, seed=rank)
        for _ in range(2):   # NCCL set-up, and the unit orders prefetch follows
            train_step(optimizer, data)
        torch.cuda.synchronize()
        engine.comm_report(reset=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loss = train_step(optimizer, data)
            torch.cuda.synchronize()
        path = directory / f"trace-rank{rank}.json"
        prof.export_chrome_trace(str(path))
        summary = overlap_summary(json.loads(path.read_text()))
        summary.update(rank=rank, trace=str(path), loss=loss.item(), device=torch.cuda.get_device_name(device),
                       engine=engine.comm_report())
        engine.close()
        summaries = world.gather(summary, root=0)
        report = {"world": comm.size, "ranks": summaries}
    elif scenario == "mfu":
        cfg = GPTConfig.preset("gpt_1p3b")
        seq, size, warmup, steps = 2048, 2, 3, 10
        total_memory = torch.cuda.get_device_properties(device).total_memory
        checkpointing = total_memory < 60 * 2 ** 30   # 40 GB parts: recompute activations to fit
        with torch.device("meta"):
            model = GPT(cfg)   # materialized one unit at a time on the GPU by the engine
        engine = Engine(model, comm, device=device, strategy="zero3", precision="bf16",
                        activation_checkpointing=checkpointing)
        optimizer = ShardedAdamW(engine)
        data = batches(cfg, micro=1, size=size, seq=seq, seed=rank)
        losses = [train_step(optimizer, data) for _ in range(warmup)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        losses += [train_step(optimizer, data) for _ in range(steps)]
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak, peak_source = peak_tflops(device, "bf16")
        flops_per_token = cfg.flops_per_token(seq)
        measured = Throughput(flops_per_token, comm.size, peak).measure(steps * size * seq * comm.size, seconds)
        report = {"model": "gpt_1p3b", "num_params": cfg.num_params(), "flops_per_token": flops_per_token,
                  "device": torch.cuda.get_device_name(device), "peak_tflops": peak, "peak_source": peak_source,
                  "world": comm.size, "strategy": "zero3", "precision": "bf16",
                  "activation_checkpointing": checkpointing, "micro_batch": size, "seq_len": seq,
                  "warmup_steps": warmup, "steps": steps, "seconds": seconds,
                  "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2 ** 30,
                  "losses": [t.item() for t in losses], **measured}
        engine.close()
        if rank == 0:
            (directory / "mfu.json").write_text(json.dumps(report, indent=1))
            print(f"MFU gpt_1p3b on {report['device']}: {report['mfu']} ({report['tokens_per_s']:.0f} tokens/s, "
                  f"{report['tflops_per_rank']:.1f} TFLOP/s, peak {peak_source})", flush=True)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}; expected trace, trace-mpi or mfu")
    if rank == 0:
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
