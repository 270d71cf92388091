"""A call's choice, decided once (Communicator.choose): what runs it and what it sends.

The engine asks for one per call site, records what it sends in its communication
report, traces it, and issues the call with its algorithm, which the communicator then
runs as chosen (a chosen algorithm resolves to itself).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pccl import vocabulary
from pccl.analysis.traffic import sent
from pccl.core.topology import Topology


@dataclass(frozen=True)
class Choice:
    collective: str
    algorithm: Any            # a schedule's name, "native" or "native_nonblocking", or a plan spec
    count: int                # elements of the full buffer (the all-gather output, the reduce-scatter input)
    dtype: torch.dtype
    topology: Topology        # of the communicator that runs it
    rank: int                 # this rank's place in it
    codec: Optional[Any] = None   # the codec its blocks travel in
    _sent: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def kind(self) -> str:
        """"native", "schedule" or "plan" (pccl.vocabulary)."""
        return vocabulary.kind(self.algorithm)

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def sent(self) -> Counter:
        """{peer: bytes this rank sends}: the schedule's or plan's messages (a native
        collective's counted as the ring's), as their encodings where a codec is given."""
        if "peers" not in self._sent:
            ratio = 1.0 if self.codec is None or not self.count else \
                self.codec.encoded_nbytes(self.count, self.dtype) / self.nbytes
            exact = sent(self.collective, self.algorithm, self.topology, self.rank, self.count, self.dtype.itemsize)
            self._sent["peers"] = Counter({peer: round(nbytes * ratio) for peer, nbytes in exact.items()})
        return self._sent["peers"]
