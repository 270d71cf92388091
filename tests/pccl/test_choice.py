"""Communicator.choose: a call's choice decided once, and what it sends."""
import torch

from pccl.compression.codecs import codec
from pccl.core.topology import Topology
from pccl.runtime.dry_run import DryRunCommunicator
from pccl.tuning import profiles


def test_a_choice_knows_its_algorithm_and_what_each_peer_receives():
    comm = DryRunCommunicator(Topology.regular(4, 2), profiles.load("frontier"), rank=1)
    buffer = torch.empty(4096, dtype=torch.bfloat16)
    ring = comm.choose("all_gather", "ring", buffer)
    assert (ring.algorithm, ring.kind, ring.nbytes) == ("ring", "schedule", 8192)
    # a ring all-gather: 3 steps, each one block (a quarter, 2048 bytes) to the next rank
    assert dict(ring.sent()) == {2: 3 * 2048}
    plan = comm.choose("reduce_scatter", "hierarchical", buffer)
    assert plan.kind == "plan" and sum(plan.sent().values()) > 0
    auto = comm.choose("all_reduce", "auto", buffer)
    assert auto.kind in ("native", "schedule", "plan") and auto.algorithm != "auto"
    assert auto.algorithm == comm.selector.resolve("all_reduce", "auto", 8192, dtype=torch.bfloat16)
    # int8 blocks: each byte count times the codec's encoded size over the exact one
    int8 = codec("int8")
    coded = comm.choose("all_gather", "ring", torch.empty(4096), int8)
    ratio = int8.encoded_nbytes(4096, torch.float32) / (4096 * 4)
    assert dict(coded.sent()) == {2: round(3 * 4096 * ratio)}
