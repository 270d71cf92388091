"""pccl's environment variables (pccl/core/environment.py): unset or empty is the default,
a bad value names the variable; PCCL_TIMEOUT is read when a communicator is made, not at
import; PCCL_NICS_PER_NODE holds with emulated nodes too."""
import os
import subprocess
import sys

import pytest
from mpi4py import MPI

from pccl.core import environment
from pccl.runtime.transport import DEFAULT_TIMEOUT, Transport


def test_values_and_their_errors():
    assert environment.count("X", {}) is None and environment.count("X", {"X": " "}) is None
    assert environment.count("X", {"X": "4"}) == 4
    for bad in ("0", "-2", "four", "1.5"):
        with pytest.raises(ValueError, match=f"X must be a positive integer, got '{bad}'"):
            environment.count("X", {"X": bad})
    assert environment.seconds("T", 300.0, {"T": ""}) == 300.0 and environment.seconds("T", 1, {"T": "2.5"}) == 2.5
    for bad in ("abc", "0", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match=f"T must be a positive number of seconds, got '{bad}'"):
            environment.seconds("T", 300.0, {"T": bad})
    assert environment.switch("S", True, {}) and not environment.switch("S", True, {"S": "0"})
    for bad in ("true", "yes", "on", "2"):   # PCCL_CHECK_CALLS=true left checking off
        with pytest.raises(ValueError, match=f"S must be 0 or 1, got '{bad}'"):
            environment.switch("S", False, {"S": bad})


def test_a_bad_timeout_in_the_environment_breaks_a_communicator_not_the_import():
    script = ("import pccl\nfrom mpi4py import MPI\nprint(pccl.Communicator(MPI.COMM_SELF, timeout=60).timeout)\n"
              "pccl.Communicator(MPI.COMM_SELF)")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PCCL_TIMEOUT": "abc"})
    assert run.stdout.strip() == "60.0", run.stderr   # `import pccl` raised while importing
    assert "PCCL_TIMEOUT must be a positive number of seconds, got 'abc'" in run.stderr


def test_nics_per_node_hold_with_emulated_nodes(monkeypatch):
    """The sbatch scripts export PCCL_NICS_PER_NODE=4 and pass comm.ranks_per_node: the NICs
    were read only where the nodes were detected, and such jobs were modelled with one."""
    monkeypatch.setenv("PCCL_NICS_PER_NODE", "4")
    transport = Transport(MPI.COMM_SELF)
    assert transport.timeout == DEFAULT_TIMEOUT
    assert transport.topology(None, 1, None).nics_per_node == 4   # emulated nodes
    assert transport.topology(None, None, None).nics_per_node == 4   # detected
    assert transport.topology(None, 1, 2).nics_per_node == 2   # given wins
    monkeypatch.setenv("PCCL_RANKS_PER_NODE", "")
    assert transport.topology(None, None, None).ranks_per_node == 1   # empty: unset, not int("")
    monkeypatch.setenv("PCCL_NODES_PER_GROUP", "x")
    with pytest.raises(ValueError, match="PCCL_NODES_PER_GROUP must be a positive integer, got 'x'"):
        transport.topology(None, None, None)


def test_pccl_compression_is_checked_when_a_communicator_is_made_and_leaves_integers_alone(monkeypatch):
    """An unknown codec failed every call instead; int8 as the default failed every integer
    collective (a counter all-reduced); given on the call, it still refuses them."""
    import torch

    import pccl
    from pccl.compression.codecs import CodecError

    monkeypatch.setenv("PCCL_COMPRESSION", "bogus")
    with pytest.raises(ValueError, match="PCCL_COMPRESSION=bogus: "):
        pccl.Communicator(MPI.COMM_SELF, timeout=60)
    monkeypatch.setenv("PCCL_COMPRESSION", "int8")
    comm = pccl.Communicator(MPI.COMM_SELF, timeout=60)
    try:
        assert comm.default_compression == "int8"
        counts, values = torch.ones(4, dtype=torch.int64), torch.ones(4)
        assert comm.selector.codecs(None, counts, "all_reduce", "ring", default="int8") == ({}, "ring")
        assert set(comm.selector.codecs(None, values, "all_reduce", "ring", default="int8")[0]) == {"flat", "inter"}
        with pytest.raises(CodecError, match="integer data is never compressed"):
            comm.selector.codecs("int8", counts, "all_reduce", "ring")
        # the default compresses sums and averages, not max and min (their NaN and zero-sign
        # rules hold exact only); named on the call, a codec applies
        for op, compressed in (("sum", True), ("avg", True), ("max", False), ("min", False)):
            assert bool(comm._codecs(None, values, "all_reduce", "ring", op)[0]) == compressed, op
        assert comm._codecs("int8", values, "all_reduce", "ring", "max")[0]
    finally:
        comm.close()


def test_pccl_self_calibration_is_checked_when_a_communicator_is_made(monkeypatch):
    """One rank measures nothing, and a bad value went unnoticed there."""
    import pccl

    monkeypatch.setenv("PCCL_SELF_CALIBRATION", "2")
    with pytest.raises(ValueError, match="PCCL_SELF_CALIBRATION must be 0 or 1, got '2'"):
        pccl.Communicator(MPI.COMM_SELF, timeout=60)
