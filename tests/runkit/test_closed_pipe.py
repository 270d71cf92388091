"""A tool whose reader goes away (`pccl-sim | head -3`) ends quietly; other broken pipes
are still errors."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(sys.executable).parent


def read_a_line_then_go(cmd: list[str]) -> tuple[int, str]:
    """What `cmd | head -1` sees: one line read, the pipe closed; (status, stderr)."""
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert job.stdout.readline()
    job.stdout.close()
    err = job.stderr.read()
    return job.wait(timeout=60), err


def test_a_tool_piped_into_head_ends_quietly():
    """shard-sim prints a row as each is simulated: it died with a BrokenPipeError
    traceback at the second (every tool's `main` is wrapped alike)."""
    if not shutil.which("shard-sim", path=str(TOOLS)):
        pytest.skip("shard-sim is not installed in this environment")
    status, err = read_a_line_then_go([str(TOOLS / "shard-sim")])
    assert (status, err) == (1, "")


WRITER = """
import os, socket, sys
from runkit.closed_pipe import quiet_when_its_reader_goes

@quiet_when_its_reader_goes
def main():
    print("started", flush=True)
    if sys.argv[1] == "socket":   # a broken pipe that is not standard output's
        mine, theirs = socket.socketpair()
        theirs.close()
        mine.sendall(b"x")
    while True:
        print("x" * 1000)

main()
"""


def test_only_standard_outputs_lost_reader_is_quiet():
    status, err = read_a_line_then_go([sys.executable, "-c", WRITER, "stdout"])
    assert (status, err) == (1, "")
    # (its standard output read to the end: the reader is there when the socket fails)
    done = subprocess.run([sys.executable, "-c", WRITER, "socket"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "BrokenPipeError" in done.stderr and "Traceback" in done.stderr


def test_every_tool_but_training_is_wrapped():
    """shard-train is left as it is: Hydra reports its task's exceptions itself, and a
    training run that loses its log's reader should stop, not go on unseen."""
    import importlib
    import re

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    section = pyproject.split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    scripts = re.findall(r'^([\w-]+) = "([\w.]+):(\w+)"$', section, re.M)
    assert len(scripts) >= 12
    unwrapped = []
    for name, module, function in scripts:
        if not hasattr(getattr(importlib.import_module(module), function), "__wrapped__"):
            unwrapped.append(name)
    assert unwrapped == ["shard-train"]
