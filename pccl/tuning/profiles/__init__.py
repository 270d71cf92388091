"""Machine profiles: the numbers the cost model needs, kept as data files with sources.

A profile describes one kind of node and its links:

  ranks_per_node, nics_per_node   the node's shape (ranks share NICs in consecutive groups)
  intra   alpha (s per message) and bandwidth (bytes/s, per direction) between two ranks
          of one node
  inter   alpha, and the bandwidth of one NIC (bytes/s, per direction); ranks that share a
          NIC share its bandwidth. `stream_bandwidth`, where given, caps what one rank
          reaches alone.
  reduce  bytes/s of a local reduction (gamma = 1/bandwidth per byte reduced)
  copy    bytes/s of a local copy (the plans' shuffle)
  codecs  per codec (pccl.compression.codecs): bytes/s of values encoded, and of values
          decoded and reduced into a buffer, and the fixed seconds of each call (fixed-rate
          codecs: the compression ratio follows from the codec itself); a codec a profile
          lacks is never predicted
  native  what the transport's own collective ("native") runs: the schedule per
          collective (default ring; MPICH's long reduce-scatter is "pairwise"), and
          whether it stripes each inter-node hop over all of a node's NICs, as NCCL's
          and RCCL's channels do (Cray MPICH sends a rank's traffic through one NIC)

Built-in profiles live beside this module, pccl/tuning/profiles/<name>.json; `pccl-bench --calibrate` writes one
for the machine it runs on. Every number carries its source in the file.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pccl.algorithms import GENERATORS
from pccl.util.files import write_atomic

BUILTIN_DIR = Path(__file__).resolve().parent  # the JSON files beside this module
DEFAULT = "generic"


@dataclass(frozen=True)
class Link:
    alpha: float                              # seconds per message
    bandwidth: float                          # bytes/s per direction (inter: per NIC)
    stream_bandwidth: Optional[float] = None  # bytes/s one rank reaches alone (inter)
    source: str = ""

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth

    @property
    def stream_beta(self) -> float:
        return 1.0 / (self.stream_bandwidth or self.bandwidth)


@dataclass(frozen=True)
class CodecRate:
    encode: float        # bytes/s of values encoded
    decode: float        # bytes/s of values decoded and reduced into a buffer
    call: float = 0.0    # seconds each encode or decode call costs besides its bytes
    source: str = ""


@dataclass(frozen=True)
class Profile:
    name: str
    ranks_per_node: int
    nics_per_node: int
    intra: Link
    inter: Link
    reduce_bandwidth: float    # bytes/s
    copy_bandwidth: float      # bytes/s
    native_stripes_nics: bool = False
    native_algorithms: tuple = ()   # ((collective, schedule algorithm), ...); others: ring
    codecs: tuple = ()              # ((codec name, CodecRate), ...)
    description: str = ""
    sources: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("ranks_per_node", "nics_per_node"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"profile {self.name!r}: {name} must be a positive integer, got {value!r}")
        numbers = {"intra.alpha": self.intra.alpha, "inter.alpha": self.inter.alpha}
        positive = {"intra.bandwidth": self.intra.bandwidth, "inter.bandwidth": self.inter.bandwidth,
                    "reduce_bandwidth": self.reduce_bandwidth, "copy_bandwidth": self.copy_bandwidth}
        if self.inter.stream_bandwidth is not None:
            positive["inter.stream_bandwidth"] = self.inter.stream_bandwidth
        for name, value in numbers.items():
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"profile {self.name!r}: {name} must be a number >= 0 seconds, got {value!r}")
        for name, value in positive.items():
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"profile {self.name!r}: {name} must be a positive number of bytes/s, got {value!r}")
        for codec, rate in self.codecs:
            for name, value in (("encode", rate.encode), ("decode", rate.decode)):
                if not (isinstance(value, (int, float)) and value > 0):
                    raise ValueError(f"profile {self.name!r}: codecs[{codec!r}].{name} must be a positive number "
                                     f"of bytes/s, got {value!r}")
            if not (isinstance(rate.call, (int, float)) and rate.call >= 0):
                raise ValueError(f"profile {self.name!r}: codecs[{codec!r}].call must be a number >= 0 seconds, "
                                 f"got {rate.call!r}")
        for collective, algorithm in self.native_algorithms:
            if algorithm not in GENERATORS.get(collective, {}):
                raise ValueError(f"profile {self.name!r}: native.algorithms[{collective!r}] = {algorithm!r} is not a "
                                 f"schedule of that collective; expected one of "
                                 f"{tuple(GENERATORS.get(collective, ()))}")

    def native_algorithm(self, collective: str) -> str:
        """The schedule the transport's own `collective` is counted as."""
        return dict(self.native_algorithms).get(collective, "ring")

    def codec_rate(self, name: str) -> CodecRate:
        """The measured speed of codec `name`; a clear error where the profile lacks it."""
        rate = dict(self.codecs).get(name)
        if rate is None:
            raise ValueError(f"profile {self.name!r} has no speed for codec {name!r} (it has "
                             f"{[c for c, _ in self.codecs] or 'none'}): measure it with pccl-bench --calibrate")
        return rate

    @property
    def gamma(self) -> float:
        return 1.0 / self.reduce_bandwidth

    @property
    def copy_beta(self) -> float:
        return 1.0 / self.copy_bandwidth

    def to_dict(self) -> dict:
        """The file form: times in microseconds, bandwidths in GB/s (1e9 bytes/s)."""
        def link(l: Link) -> dict:
            out = {"alpha_us": l.alpha * 1e6, "bandwidth_GBps": l.bandwidth / 1e9}
            if l.stream_bandwidth is not None:
                out["stream_bandwidth_GBps"] = l.stream_bandwidth / 1e9
            out["source"] = l.source
            return out
        return {"name": self.name, "description": self.description,
                "ranks_per_node": self.ranks_per_node, "nics_per_node": self.nics_per_node,
                "intra": link(self.intra), "inter": link(self.inter),
                "reduce": {"bandwidth_GBps": self.reduce_bandwidth / 1e9,
                           "source": self.sources.get("reduce", "")},
                "copy": {"bandwidth_GBps": self.copy_bandwidth / 1e9, "source": self.sources.get("copy", "")},
                "native": {"stripes_nics": self.native_stripes_nics, "algorithms": dict(self.native_algorithms),
                           "source": self.sources.get("native", "")},
                "codecs": {name: {"encode_GBps": r.encode / 1e9, "decode_GBps": r.decode / 1e9,
                                  "call_us": r.call * 1e6, "source": r.source} for name, r in self.codecs},
                "sources": {k: v for k, v in self.sources.items() if k not in ("reduce", "copy", "native")}}

    @classmethod
    def from_dict(cls, data: dict, origin: str = "profile") -> "Profile":
        # Rounded (bytes/s to 1e-3, seconds to 1e-15) so that a file's number reads back as
        # itself after a round trip through to_dict.
        def gbps(value) -> float:
            return round(float(value) * 1e9, 3)

        def us(value) -> float:
            return round(float(value) * 1e-6, 15)

        try:
            def link(d: dict) -> Link:
                stream = d.get("stream_bandwidth_GBps")
                return Link(us(d["alpha_us"]), gbps(d["bandwidth_GBps"]),
                            None if stream is None else gbps(stream), d.get("source", ""))
            sources = dict(data.get("sources", {}))
            sources["reduce"] = data["reduce"].get("source", "")
            sources["copy"] = data["copy"].get("source", "")
            native = data.get("native", {})
            sources["native"] = native.get("source", "")
            return cls(name=data["name"], ranks_per_node=data["ranks_per_node"],
                       nics_per_node=data["nics_per_node"], intra=link(data["intra"]),
                       inter=link(data["inter"]), reduce_bandwidth=gbps(data["reduce"]["bandwidth_GBps"]),
                       copy_bandwidth=gbps(data["copy"]["bandwidth_GBps"]),
                       native_stripes_nics=bool(native.get("stripes_nics", False)),
                       native_algorithms=tuple(sorted(native.get("algorithms", {}).items())),
                       codecs=tuple(sorted((name, CodecRate(gbps(r["encode_GBps"]), gbps(r["decode_GBps"]),
                                                            us(r.get("call_us", 0.0)), r.get("source", "")))
                                           for name, r in data.get("codecs", {}).items())),
                       description=data.get("description", ""), sources=sources)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{origin}: not a valid profile ({type(e).__name__}: {e}); expected the "
                             f"fields of pccl/tuning/profiles/{DEFAULT}.json") from None

    def save(self, path) -> None:
        """Write the profile as JSON, atomically (a reader never sees a partial file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")


def builtin_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in BUILTIN_DIR.glob("*.json")))


def load(name_or_path) -> Profile:
    """A built-in profile by name (see builtin_names()) or a profile file by path."""
    text = str(name_or_path)
    path = BUILTIN_DIR / f"{text}.json" if text in builtin_names() else Path(text)
    if not path.is_file():
        raise ValueError(f"no profile {text!r}: expected a built-in name {builtin_names()} "
                         f"or the path of a profile file (pccl-bench --calibrate writes one)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"profile file {path} is not valid JSON: {e}") from None
    return Profile.from_dict(data, origin=str(path))


def from_environment() -> Profile:
    """The profile named by PCCL_PROFILE (a built-in name or a file), else the generic one."""
    return load(os.environ.get("PCCL_PROFILE") or DEFAULT)
