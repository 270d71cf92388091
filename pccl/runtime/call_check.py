"""PCCL_CHECK_CALLS=1 (or check_calls=True): before each all-gather, reduce-scatter and
all-reduce, the ranks compare what they are about to call, so that a call another rank
makes otherwise (another collective, algorithm, op, codec, dtype or size, or a call more
or fewer) stops every rank with a CallMismatch naming each rank's call, instead of matching
messages of different calls: a wrong result on some ranks, a timeout or MPI's error on
others. It costs an 8-byte all-gather per call; as torch's TORCH_DISTRIBUTED_DEBUG=DETAIL,
it is for finding a bug, not for training."""
from __future__ import annotations

import zlib
from contextlib import contextmanager

import torch

from pccl.core import environment

ENV = "PCCL_CHECK_CALLS"


class CallMismatch(ValueError):
    """The ranks called different collectives, or the same with different arguments."""


def wanted(given) -> bool:
    """check_calls as given, else PCCL_CHECK_CALLS=1."""
    return bool(given) if given is not None else environment.switch(ENV, False)


def codec_name(compression) -> str:
    """A compression argument as every rank can compare it: a codec's name however it was
    given ("int8", " INT8", codecs.codec("int8")), per level for a dict."""
    if isinstance(compression, dict):
        return "{" + ", ".join(f"{level}: {codec_name(c)}" for level, c in sorted(compression.items(), key=str)) + "}"
    if isinstance(compression, str):
        return compression.strip().lower()
    return getattr(compression, "name", None) or repr(compression)


class CallCheck:
    def __init__(self, comm):
        self.comm, self.calls, self.busy = comm, 0, False

    @contextmanager
    def paused(self):
        """Calls the communicator makes itself (the self-calibration's timed loops, which
        the exchange would slow) go unchecked: every rank makes them alike."""
        was, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = was

    def agree(self, collective: str, algorithm, op, buffer: torch.Tensor, compression=None) -> None:
        """Every rank's next call is this one (collective: every rank calls it alike)."""
        if self.busy or self.comm.size == 1 or not isinstance(buffer, torch.Tensor):
            return   # its own exchange is not checked; what is not a tensor, validation names
        self.calls += 1
        said = (f"call {self.calls}: {collective}(algorithm={algorithm!r}"
                + (f", op={op!r}" if op is not None else "")
                + (f", compression={codec_name(compression)}" if compression is not None else "")
                + f") of {buffer.numel()} {str(buffer.dtype).removeprefix('torch.')} elements")
        device = buffer.device if buffer.device.type in self.comm.devices else torch.device("cpu")
        mine = torch.tensor([zlib.crc32(said.encode())], dtype=torch.int64, device=device)
        every = torch.empty(self.comm.size, dtype=torch.int64, device=device)
        self.busy = True
        try:
            self.comm.all_gather(every, mine, algorithm="native")
            if bool((every == mine).all()):
                return
            calls = [self.comm.broadcast_object(said, root=r) for r in range(self.comm.size)]
        finally:
            self.busy = False
        raise CallMismatch("pccl: the ranks do not call the same collective (" + ENV + "): "
                           + "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls)))
