"""The CPUs this process may run on: its affinity (the cores a Slurm job, a container or
taskset gave it), not every CPU of the node as os.cpu_count() counts them."""
import os


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
