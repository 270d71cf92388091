"""Throughput and model FLOPs utilization (MFU), as torchtitan and nanoGPT report them:
achieved model FLOPs (flops per token x tokens per second) over the device's peak.

Peak dense TFLOP/s per device (one rank), from the vendors' data sheets:
  MI250X GCD  191.5 bf16/fp16, 47.9 fp32 matrix  (AMD: 383 and 95.7 per MI250X, 2 GCDs)
  A100 SXM    312 bf16/fp16, 156 tf32, 19.5 fp32
  H100 SXM    989 bf16/fp16, 495 tf32, 67 fp32   (H100 PCIe: 756, 378, 51)
  H200        989 bf16/fp16, 495 tf32, 67 fp32   (same GH100 compute as H100 SXM)
  H100 NVL, H200 NVL  835.5 bf16/fp16, 417.5 tf32, 60 fp32   (the PCIe cards at 400 and 600 W:
              half the sheets' 1,671 and 835 "with sparsity")
On CPUs there is no peak to compare with: MFU is not meaningful and reported as null.
"""
from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Optional

import torch

# Compute efficiency of forward and backward alone, what the planner and shard-sim assume
# where nothing is measured: of the order of the 32-38% of peak measured for 22B-1T GPT
# training on Frontier (Dash et al., arXiv:2312.12705)
DEFAULT_MFU = 0.35

PEAK_TFLOPS = {
    "MI250X GCD": {"bf16": 191.5, "fp16": 191.5, "tf32": 47.9, "fp32": 47.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100 SXM": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
}

# The device each built-in machine profile describes, and its memory per rank (HBM per GCD
# or GPU, from the same data sheets; Perlmutter's GPU nodes are mostly the 40 GB A100).
PROFILE_DEVICES = {"frontier": "MI250X GCD", "perlmutter": "A100", "dgx-h100": "H100 SXM"}
DEVICE_MEMORY_GIB = {"MI250X GCD": 64, "A100": 40, "H100 SXM": 80, "H100 PCIe": 80, "H200": 141,
                     "H100 NVL": 94, "H200 NVL": 141}


def device_kind(name: str) -> Optional[str]:
    """The PEAK_TFLOPS entry of a device by its reported name, or None if unknown."""
    upper = name.upper()
    if "MI250X" in upper:
        return "MI250X GCD"
    nvl = " NVL" if "NVL" in upper.split() else ""
    if "H200" in upper:
        return "H200" + nvl
    if "H100" in upper:
        return "H100" + nvl if nvl else "H100 PCIe" if "PCIE" in upper else "H100 SXM"
    if "A100" in upper:
        return "A100"
    return None


def peak_tflops(device: torch.device, precision: str) -> tuple[Optional[float], str]:
    """(peak TFLOP/s of one rank at this precision, or None; what it is)."""
    if device.type != "cuda":
        return None, f"{device.type}: MFU is not meaningful (no peak-FLOPs figure for CPUs)"
    name = torch.cuda.get_device_name(device)
    kind = device_kind(name)
    if kind is None:
        return None, f"{name}: unknown peak; set train.peak_tflops for MFU"
    column = "tf32" if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32 else precision
    return PEAK_TFLOPS[kind][column], f"{kind} {column}"


class Throughput:
    """Tokens per second, model TFLOP/s per rank and MFU over an interval of steps."""

    def __init__(self, flops_per_token: int, world: int, peak: Optional[float]):
        self.flops_per_token, self.world, self.peak = flops_per_token, world, peak

    def measure(self, tokens: int, seconds: float) -> dict:
        """`tokens` processed by all ranks together in `seconds`."""
        per_s = tokens / seconds
        tflops = per_s * self.flops_per_token / self.world / 1e12
        return {"tokens_per_s": per_s, "tokens_per_s_per_rank": per_s / self.world, "tflops_per_rank": tflops,
                "mfu": tflops / self.peak if self.peak else None}


def peak_rss_bytes() -> int:
    """This process's peak resident set: Linux's VmHWM (which shard-train resets per interval),
    elsewhere ru_maxrss (the peak since the process started)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024   # kB
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024   # bytes on macOS, KiB on Linux
