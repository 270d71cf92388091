"""Measure a machine profile: alpha and bandwidth of the intra-node and inter-node links,
the bandwidth one NIC gives the ranks that share it, local reduce and copy speed, and each
codec's encoding and decoding speed.

Run by `pccl-bench --calibrate PATH` under mpiexec, on two or more nodes (real or
emulated) or on one (then there is no inter-node link to measure: the intra-node figures
stand in). Every link measurement is a ping-pong between pairs of ranks (or a local loop),
repeated, its median taken; alpha and 1/bandwidth come from one-way time against bytes
(see fit()).

  intra   every node's ranks in pairs (local 0-1, 2-3, ...), all pairs at once: the links
          as a collective loads them
  inter   rank 0 and the first rank of node 1 alone (alpha, one rank's stream bandwidth);
          then every rank of node 0 with its counterpart on node 1 at once: the bandwidth
          each NIC delivers when all its ranks send

Then pccl-bench times every algorithm auto chooses among, the MPI library's own
collectives too, through the Communicator (the fixed cost of a call included) as the
self-calibration does (pccl.tuning.self_calibration.measure) but with no time budget, per
reduction class, and cost_model.calibrated keeps each one's measured/predicted ratio in the
profile (Profile.calibration), so that auto's predictions equal what was measured at those
sizes.
"""
from __future__ import annotations

import socket
import statistics
import time
from datetime import datetime, timezone

import numpy as np
import torch
from mpi4py import MPI

from pccl.compression.codecs import CodecError, codec
from pccl.core.topology import Topology
from pccl.tuning.profiles import CodecRate, Link, Profile

SIZES = tuple(1 << k for k in range(10, 25, 2))   # 1 KiB .. 16 MiB
LOCAL_BYTES = 64 << 20   # local loops: larger than caches, like the buffers of big collectives
CODEC_BYTES = 16 << 20   # codec loops: fp32 values, larger than caches (zfp runs at ~0.2 GB/s)
CODECS = ("int8", "bf16", "fp16", "zfp:8", "zfp:16")
SMALL_BLOCK = 512        # bytes: a codec call dominated by its fixed cost
REPEATS = 5

# What the MPI library's own collectives run, by the whole buffer's bytes, from its
# selection code (the library name as MPI_Get_library_version reports it).
NATIVE_SELECTION = {
    "MPICH": ({"all_gather": [[81920, ["recursive_doubling", "bruck"]], [524288, ["recursive_doubling", "ring"]],
                              [None, "ring"]],
               "reduce_scatter": [[524288, "recursive_halving"], [None, "pairwise"]],
               "all_reduce": [[9, "recursive_doubling"], [None, "rabenseifner"]]},
              "MPICH's default selection (maint/tuning/coll/mpir/generic.json, compiled into "
              "src/mpi/coll/src/csel_json_autogen.c; sizes are the whole buffer's bytes, csel.c "
              "get_total_msgsize): MPI_Allgather recursive doubling below 512 KiB on a power-of-two "
              "communicator (Bruck below 80 KiB otherwise), the ring above; MPI_Reduce_scatter_block with a "
              "commutative op recursive halving below 512 KiB, pairwise exchange above; MPI_Allreduce "
              "recursive doubling up to 8 B, Rabenseifner's reduce-scatter + all-gather above. On one node "
              "ch4 runs MPI_Allreduce through shared memory (MPIDI_POSIX_mpi_allreduce_release_gather), which "
              "no schedule describes: the calibration carries it"),
}


def fit(sizes, seconds) -> tuple[float, float]:
    """(alpha, bandwidth) of seconds = alpha + bytes / bandwidth, as Hockney fits it: the
    bandwidth from the least-squares slope over the larger half of the sizes (small
    messages may ride on buffers, such as a shaper's burst, that large ones cannot), alpha
    from the smallest size, minus its bandwidth term."""
    sizes, seconds = np.asarray(sizes, float), np.asarray(seconds, float)
    large = sizes >= np.median(sizes)
    slope = np.polyfit(sizes[large], seconds[large], 1)[0]
    if slope <= 0:
        raise RuntimeError(f"calibration: time does not grow with size ({list(zip(sizes, seconds))}); "
                           f"the measurements are too noisy, run again with fewer other jobs")
    first = np.argmin(sizes)
    return max(float(seconds[first] - sizes[first] * slope), 0.0), 1.0 / float(slope)


def ping_pong(comm: MPI.Comm, partner, leader: bool, nbytes: int) -> float:
    """Median one-way seconds of `nbytes` between this rank and `partner` (None: idle, but
    still in the barriers)."""
    buf = np.zeros(nbytes, dtype=np.uint8)
    samples = []
    for i in range(REPEATS + 1):
        comm.Barrier()
        start = time.perf_counter()
        if partner is not None:
            if leader:
                comm.Send(buf, dest=partner)
                comm.Recv(buf, source=partner)
            else:
                comm.Recv(buf, source=partner)
                comm.Send(buf, dest=partner)
        if i:  # the first round warms up
            samples.append((time.perf_counter() - start) / 2)
    return statistics.median(samples)


def slowest(comm: MPI.Comm, seconds: float, active: bool) -> float:
    """The slowest active rank's time."""
    return comm.allreduce(seconds if active else 0.0, op=MPI.MAX)


def link_curve(comm: MPI.Comm, pairs: dict[int, int]) -> list[float]:
    """One-way seconds per size in SIZES with the ranks in `pairs` (rank -> partner) all
    ping-ponging at once; the slowest pair's time counts."""
    partner = pairs.get(comm.rank)
    leader = partner is not None and comm.rank < partner
    return [slowest(comm, ping_pong(comm, partner, leader, n), partner is not None) for n in SIZES]


def local_bandwidth(comm: MPI.Comm, reduce: bool) -> float:
    """Bytes/s of a local sum (bytes reduced) or copy on every rank at once, the slowest rank's."""
    n = LOCAL_BYTES // 4
    a, b = torch.ones(n), torch.ones(n)
    return n * 4 / timed(comm, (lambda: a.add_(b)) if reduce else (lambda: a.copy_(b)))


def timed(comm: MPI.Comm, work) -> float:
    """The slowest rank's median seconds of `work()`, run on every rank at once."""
    samples = []
    for i in range(REPEATS + 1):
        comm.Barrier()
        start = time.perf_counter()
        work()
        if i:
            samples.append(time.perf_counter() - start)
    return comm.allreduce(statistics.median(samples), op=MPI.MAX)


def codec_rates(comm: MPI.Comm, where: str) -> tuple:
    """((name, CodecRate), ...): bytes/s of fp32 values encoded, and decoded-and-summed
    into a buffer, on every rank at once (the slowest rank's), and the fixed cost of a call
    (a small block's encode and decode, less their bytes' time, halved); codecs that
    cannot run here (zfp without zfpy) are left out."""
    values = torch.rand(CODEC_BYTES // 4, generator=torch.Generator().manual_seed(comm.rank)) * 2 - 1
    out = torch.zeros_like(values)
    rates = []
    for name in CODECS:
        try:
            c = codec(name)
        except CodecError:
            continue
        encoded = torch.empty(c.encoded_nbytes(values.numel(), values.dtype), dtype=torch.uint8)
        encode = CODEC_BYTES / timed(comm, lambda: c.encode(values, encoded))
        decode = CODEC_BYTES / timed(comm, lambda: c.decode(encoded, out, "sum"))
        small, calls = values[:SMALL_BLOCK // 4], 100
        packed = encoded[:c.encoded_nbytes(small.numel(), small.dtype)]

        def round_trips():
            for _ in range(calls):
                c.encode(small, packed)
                c.decode(packed, out[:small.numel()], "sum")

        call = max(timed(comm, round_trips) / calls - SMALL_BLOCK / encode - SMALL_BLOCK / decode, 0.0) / 2
        rates.append((name, CodecRate(encode, decode, call,
                                      f"{where}: {CODEC_BYTES} B of fp32 values in [-1, 1] on every rank at once; "
                                      f"call: {calls} round trips of {SMALL_BLOCK} B")))
    return tuple(rates)


def calibrate(comm: MPI.Comm, topology: Topology, name: str) -> Profile:
    """The profile of this machine, measured; collective over `comm`."""
    if not topology.is_uniform or topology.size < 2:
        raise ValueError(f"calibration needs two or more ranks and nodes with the same number of ranks, got "
                         f"{topology.describe()}")
    L = topology.ranks_per_node
    if L >= 2:
        intra_pairs = {}
        for node in topology.nodes:
            for i in range(0, L - 1, 2):
                intra_pairs[node[i]], intra_pairs[node[i + 1]] = node[i + 1], node[i]
        intra = fit(SIZES, link_curve(comm, intra_pairs))
    else:
        intra = (0.0, float("inf"))
    where = (f"measured by pccl-bench --calibrate on {socket.gethostname()} "
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {topology.describe()}")
    if topology.num_nodes >= 2:
        first, second = topology.nodes[0], topology.nodes[1]
        inter = fit(SIZES, link_curve(comm, {first[0]: second[0], second[0]: first[0]}))
        loaded = {r: s for a, b in zip(first, second) for r, s in ((a, b), (b, a))}
        nic_bandwidth = fit(SIZES, link_curve(comm, loaded))[1] * topology.ranks_per_nic()
        inter_source = (f"{where}: alpha and stream bandwidth from one pair across nodes; NIC bandwidth "
                        f"from all {L} local ranks at once ({topology.ranks_per_nic()} per NIC)")
    else:
        inter, nic_bandwidth = intra, intra[1]
        inter_source = f"{where}: one node, no inter-node link to measure: the intra-node figures stand in"
    reduce_bw, copy_bw = local_bandwidth(comm, reduce=True), local_bandwidth(comm, reduce=False)
    library = next((name for name in NATIVE_SELECTION if name.lower() in MPI.Get_library_version().lower()), None)
    natives, native_source = NATIVE_SELECTION.get(library, ({}, "not known for this MPI library: counted as rings"))
    return Profile(
        name=name, ranks_per_node=L, nics_per_node=topology.nics_per_node,
        intra=Link(intra[0], intra[1] if L >= 2 else 1e12,
                   source=f"{where}: ping-pong of every local pair at once, {SIZES[0]}-{SIZES[-1]} B"),
        inter=Link(inter[0], nic_bandwidth, stream_bandwidth=inter[1], source=inter_source),
        reduce_bandwidth=reduce_bw, copy_bandwidth=copy_bw, codecs=codec_rates(comm, where),
        description=f"calibrated: {topology.describe()} on {socket.gethostname()}",
        sources={"reduce": f"{where}: torch add_ of {LOCAL_BYTES} B on every rank at once",
                 "copy": f"{where}: torch copy_ of {LOCAL_BYTES} B on every rank at once",
                 "native": native_source},
        native_algorithms=tuple((c, tuple(tuple(band) for band in bands)) for c, bands in natives.items()))
