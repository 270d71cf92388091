"""Machine profiles: the numbers the cost model needs, kept as data files with sources.

A profile describes one kind of node and its links:

  ranks_per_node, nics_per_node   the node's shape (ranks share NICs in consecutive groups)
  intra   alpha (s per message) and bandwidth (bytes/s, per direction) between two ranks
          of one node
  inter   alpha, and the bandwidth of one NIC (bytes/s, per direction); ranks that share a
          NIC share its bandwidth. `stream_bandwidth`, where given, caps what one rank
          reaches alone.
  network (optional) the tier above the node: groups of `nodes_per_group` consecutive
          nodes (a dragonfly group, a pod), the alpha of a message between groups, and the
          oversubscription of the links between groups: a group's bandwidth to the others
          is its nodes' NIC bandwidth divided by it (adaptive routing spreads a group's
          traffic over all of them)
  reduce  bytes/s of a local reduction (gamma = 1/bandwidth per byte reduced)
  copy    bytes/s of a local copy (the plans' shuffle)
  codecs  per codec (pccl.compression.codecs): bytes/s of values encoded, and of values
          decoded and reduced into a buffer, and the fixed seconds of each call (fixed-rate
          codecs: the compression ratio follows from the codec itself); a codec a profile
          lacks is never predicted
  native  what the transport's own collective ("native") runs, as its documentation
          says: the schedule per collective, one for every size or one per size band
          ([[below bytes, schedule], ..., [null, schedule]], the whole buffer's bytes, as
          MPICH's thresholds count them; default ring; a schedule may be a pair
          [on a power-of-two group, on any other], as MPICH's all-gather runs recursive
          doubling on the one and Bruck on the other), and whether it stripes each
          inter-node hop over all of a node's NICs, as NCCL's and RCCL's channels do
          (Cray MPICH sends a rank's traffic through one NIC)
  calibration  measured/predicted time of each algorithm auto chooses among (the
          native collectives too), per collective and reduction class (fp16/bf16, "half",
          apart from the rest, "full": pccl.core.dtypes.reduction_class) at sizes from
          4 B up, on the shape pccl-bench --calibrate or the self-calibration
          (pccl.tuning.self_calibration) ran on: the cost model multiplies its prediction
          by this ratio, interpolated in log(size) and held beyond the ends; "half" falls
          back to "full" where it was not measured (an all-gather reduces nothing). It
          carries what the link constants cannot: the fixed cost of a call, MPI's
          shared-memory and eager paths, a library's own tuned selection

Built-in profiles live beside this module, pccl/tuning/profiles/<name>.json; `pccl-bench --calibrate` writes one
for the machine it runs on. Every number carries its source in the file.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from pccl.algorithms import GENERATORS
from pccl.core.dtypes import REDUCTION_CLASSES
from pccl.core.topology import Topology, TopologyError
from runkit.files import write_atomic

BUILTIN_DIR = Path(__file__).resolve().parent  # the JSON files beside this module
DEFAULT = "generic"
RATIOS = {"full": "ratios", "half": "ratios_half"}   # the file's calibration field of each reduction class


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
class Network:
    nodes_per_group: int       # consecutive nodes per group
    alpha: float               # seconds per message between groups
    oversubscription: float    # the group's NIC bandwidth over its bandwidth to other groups
    source: str = ""


@dataclass(frozen=True)
class CodecRate:
    encode: float        # bytes/s of values encoded
    decode: float        # bytes/s of values decoded and reduced into a buffer
    call: float = 0.0    # seconds each encode or decode call costs besides its bytes
    source: str = ""


def for_group(schedule, size: int) -> str:
    """A native band's schedule for a group of `size` ranks: the name, or of a pair (on a
    power-of-two group, on any other) the one that applies."""
    if isinstance(schedule, str):
        return schedule
    return schedule[0] if size & (size - 1) == 0 else schedule[1]


def _finite(value, low: float, open_low: bool = False) -> bool:
    """Whether `value` is a finite number (not a bool) above `low` (or from it): an infinite
    latency made the predictions NaN, and shard-sim's replay of them never ended."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value > low if open_low else value >= low))


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
    network: Optional[Network] = None   # the tier above the node, where the machine has one
    # ((collective, ((below bytes, schedule), ..., (inf, schedule))), ...); a name alone
    # stands for every size; collectives not named: ring. A schedule may be a pair: (on
    # groups of a power-of-two size, on others)
    native_algorithms: tuple = ()
    codecs: tuple = ()              # ((codec name, CodecRate), ...)
    # ((collective, reduction class, algorithm name, ((bytes, measured/predicted), ...)), ...)
    calibration: tuple = ()
    description: str = ""
    sources: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("ranks_per_node", "nics_per_node"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"profile {self.name!r}: {name} must be a positive integer, got {value!r}")
        numbers = {"intra.alpha": self.intra.alpha, "inter.alpha": self.inter.alpha}
        positive = {"intra.bandwidth": self.intra.bandwidth, "inter.bandwidth": self.inter.bandwidth,
                    "reduce_bandwidth": self.reduce_bandwidth, "copy_bandwidth": self.copy_bandwidth}
        if self.inter.stream_bandwidth is not None:
            positive["inter.stream_bandwidth"] = self.inter.stream_bandwidth
        for name, value in numbers.items():
            if not _finite(value, 0):
                raise ValueError(f"profile {self.name!r}: {name} must be a finite number >= 0 seconds, "
                                 f"got {value!r}")
        for name, value in positive.items():
            if not _finite(value, 0, open_low=True):
                raise ValueError(f"profile {self.name!r}: {name} must be a finite positive number of bytes/s, "
                                 f"got {value!r}")
        if self.network is not None:
            net = self.network
            if not (isinstance(net.nodes_per_group, int) and net.nodes_per_group >= 1):
                raise ValueError(f"profile {self.name!r}: network.nodes_per_group must be a positive integer, "
                                 f"got {net.nodes_per_group!r}")
            if not _finite(net.alpha, 0):
                raise ValueError(f"profile {self.name!r}: network.alpha must be a finite number >= 0 seconds, "
                                 f"got {net.alpha!r}")
            if not _finite(net.oversubscription, 0, open_low=True):
                raise ValueError(f"profile {self.name!r}: network.oversubscription must be a finite positive number, "
                                 f"got {net.oversubscription!r}")
        for codec, rate in self.codecs:
            for name, value in (("encode", rate.encode), ("decode", rate.decode)):
                if not _finite(value, 0, open_low=True):
                    raise ValueError(f"profile {self.name!r}: codecs[{codec!r}].{name} must be a finite positive "
                                     f"number of bytes/s, got {value!r}")
            if not _finite(rate.call, 0):
                raise ValueError(f"profile {self.name!r}: codecs[{codec!r}].call must be a finite number >= 0 "
                                 f"seconds, got {rate.call!r}")
        object.__setattr__(self, "native_algorithms", tuple(sorted(
            (collective, self._bands(collective, bands)) for collective, bands in self.native_algorithms)))
        object.__setattr__(self, "calibration", tuple(sorted(self.calibration, key=lambda entry: entry[:3])))
        for collective, klass, algorithm, points in self.calibration:
            sizes = [b for b, _ in points]
            if klass not in REDUCTION_CLASSES:
                raise ValueError(f"profile {self.name!r}: calibration class {klass!r} is not one of "
                                 f"{REDUCTION_CLASSES}")
            if not points or sizes != sorted(set(sizes)) or any(not (0 < r < math.inf) for _, r in points):
                raise ValueError(f"profile {self.name!r}: calibration[{collective!r}][{algorithm!r}] must be "
                                 f"[bytes, ratio] pairs with sizes ascending and finite ratios > 0, got {points!r}")

    def _bands(self, collective: str, bands) -> tuple:
        """((below bytes, schedule), ...) of a native entry: a name (every size) or size bands
        ending in one for every larger size (inf; null in a file)."""
        if isinstance(bands, (list, tuple)) and len(bands) == 2 and all(isinstance(b, str) for b in bands):
            bands = ((math.inf, tuple(bands)),)   # a pair for every size
        bands = ((math.inf, bands),) if isinstance(bands, str) else tuple(
            (math.inf if below is None else below, name if isinstance(name, str) else tuple(name))
            for below, name in bands)
        where = f"profile {self.name!r}: native.algorithms[{collective!r}]"
        for _, schedule in bands:
            if not isinstance(schedule, str) and len(schedule) != 2:
                raise ValueError(f"{where}: {list(schedule)!r} is no schedule nor a pair [on a power-of-two "
                                 "group, on any other]")
            for algorithm in (schedule,) if isinstance(schedule, str) else schedule:
                if algorithm not in GENERATORS.get(collective, {}):
                    raise ValueError(f"{where} = {algorithm!r} is not a schedule of that collective; expected one "
                                     f"of {tuple(GENERATORS.get(collective, ()))}")
        limits = [below for below, _ in bands]
        if not bands or limits[-1] != math.inf or limits != sorted(set(limits)):
            raise ValueError(f"{where}: size bands must ascend and end with one for every larger size "
                             f"([null, schedule]), got {bands!r}")
        return bands

    def native_algorithm(self, collective: str, nbytes: float = 0):
        """The schedule the transport's own `collective` of `nbytes` (the whole buffer) is
        counted as: a name, or a pair (on a power-of-two group, on any other)."""
        for below, name in dict(self.native_algorithms).get(collective, ((math.inf, "ring"),)):
            if nbytes < below:
                return name
        raise AssertionError("the last band holds every size")

    def native_bands(self, sizes: np.ndarray) -> list[tuple[tuple, np.ndarray]]:
        """[(natives, indices), ...]: `sizes` grouped by the schedules the native collectives
        run for them, natives being ((collective, schedule), ...) as the cost model takes it."""
        groups: dict[tuple, list[int]] = {}
        for i, n in enumerate(np.asarray(sizes, float)):
            natives = tuple((c, self.native_algorithm(c, n)) for c, _ in self.native_algorithms)
            groups.setdefault(natives, []).append(i)
        return [(natives, np.array(index)) for natives, index in groups.items()]

    def efficiency(self, collective: str, algorithm: str, sizes: np.ndarray, klass: str = "full") -> np.ndarray:
        """The calibrated measured/predicted ratio of `algorithm` (a name: a flat schedule,
        "native", "hierarchical", "ho_ring") for `collective` of reduction class `klass` at
        `sizes` bytes: 1 where the profile has none."""
        points = self._calibration(collective, klass).get(algorithm)
        if points is None:
            return np.ones_like(np.asarray(sizes, float))
        at, ratio = zip(*points)
        return np.interp(np.log2(np.maximum(sizes, 1)), np.log2(np.maximum(at, 1)), ratio)

    def calibrated_for(self, collective: str, klass: str = "full") -> bool:
        """Whether `collective` of reduction class `klass` was measured."""
        return bool(self._calibration(collective, klass))

    def _calibration(self, collective: str, klass: str) -> dict:
        """{algorithm: points} measured for (collective, klass); "half" falls back to "full"."""
        for wanted in dict.fromkeys((klass, "full")):
            found = {name: points for c, k, name, points in self.calibration if c == collective and k == wanted}
            if found:
                return found
        return {}

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

    def group_beta(self, nodes_per_group: int) -> float:
        """Seconds per byte of a group's traffic to other groups (all its links at once);
        without a network tier, as fast as its nodes' NICs."""
        over = self.network.oversubscription if self.network else 1.0
        return over / (nodes_per_group * self.nics_per_node * self.inter.bandwidth)

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
                **({"network": {"nodes_per_group": self.network.nodes_per_group,
                                "alpha_us": self.network.alpha * 1e6,
                                "oversubscription": self.network.oversubscription,
                                "source": self.network.source}} if self.network else {}),
                "reduce": {"bandwidth_GBps": self.reduce_bandwidth / 1e9,
                           "source": self.sources.get("reduce", "")},
                "copy": {"bandwidth_GBps": self.copy_bandwidth / 1e9, "source": self.sources.get("copy", "")},
                "native": {"stripes_nics": self.native_stripes_nics,
                           "algorithms": {c: bands[0][1] if len(bands) == 1 and isinstance(bands[0][1], str) else
                                          [[None if b == math.inf else b, name if isinstance(name, str) else
                                            list(name)] for b, name in bands]
                                          for c, bands in self.native_algorithms},
                           "source": self.sources.get("native", "")},
                "codecs": {name: {"encode_GBps": r.encode / 1e9, "decode_GBps": r.decode / 1e9,
                                  "call_us": r.call * 1e6, "source": r.source} for name, r in self.codecs},
                **({"calibration": {"source": self.sources.get("calibration", ""), **{
                    RATIOS[klass]: {c: {name: [list(p) for p in points]
                                        for c2, k2, name, points in self.calibration if (c2, k2) == (c, klass)}
                                    for c in dict.fromkeys(c for c, k, _, _ in self.calibration if k == klass)}
                    for klass in REDUCTION_CLASSES if any(k == klass for _, k, _, _ in self.calibration)}}}
                   if self.calibration else {}),
                "sources": {k: v for k, v in self.sources.items()
                            if k not in ("reduce", "copy", "native", "calibration")}}

    @classmethod
    def from_dict(cls, data: dict, origin: str = "profile") -> "Profile":
        # Rounded (bytes/s to 1e-3, seconds to 1e-15) so that a file's number reads back as
        # itself after a round trip through to_dict.
        def number(value) -> float:
            if isinstance(value, str):   # (float() would take "1e9", and say of "fast" nothing of where)
                raise TypeError(f"{value!r} is a string, not a number")
            return float(value)

        def gbps(value) -> float:
            return round(number(value) * 1e9, 3)

        def us(value) -> float:
            return round(number(value) * 1e-6, 15)

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
            net = data.get("network")
            network = None if net is None else Network(net["nodes_per_group"], us(net["alpha_us"]),
                                                       float(net["oversubscription"]), net.get("source", ""))
            calibrated = data.get("calibration", {})
            if calibrated:
                sources["calibration"] = calibrated.get("source", "")
            return cls(name=data["name"], ranks_per_node=data["ranks_per_node"],
                       nics_per_node=data["nics_per_node"], intra=link(data["intra"]),
                       inter=link(data["inter"]), reduce_bandwidth=gbps(data["reduce"]["bandwidth_GBps"]),
                       copy_bandwidth=gbps(data["copy"]["bandwidth_GBps"]),
                       native_stripes_nics=bool(native.get("stripes_nics", False)), network=network,
                       native_algorithms=tuple(sorted((c, bands if isinstance(bands, str) else
                                                       tuple(tuple(band) for band in bands))
                                                      for c, bands in native.get("algorithms", {}).items())),
                       calibration=tuple((c, klass, name, tuple((int(b), float(r)) for b, r in points))
                                         for klass in REDUCTION_CLASSES
                                         for c, by_name in calibrated.get(RATIOS[klass], {}).items()
                                         for name, points in by_name.items()),
                       codecs=tuple(sorted((name, CodecRate(gbps(r["encode_GBps"]), gbps(r["decode_GBps"]),
                                                            us(r.get("call_us", 0.0)), r.get("source", "")))
                                           for name, r in data.get("codecs", {}).items())),
                       description=data.get("description", ""), sources=sources)
        except (KeyError, TypeError, AttributeError) as e:   # a field missing, or of another JSON type
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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"profile file {path} is not valid JSON: {e}") from None
    return Profile.from_dict(data, origin=str(path))


def from_environment() -> Profile:
    """The profile named by PCCL_PROFILE (a built-in name or a file), else the generic one."""
    return load(os.environ.get("PCCL_PROFILE") or DEFAULT)


def topology_for(ranks: int, prof: Profile, ranks_per_node: Optional[int],
                 nics_per_node: Optional[int], nodes_per_group: Optional[int] = None) -> Topology:
    """`ranks` in the profile's node shape and network groups (overrides where given;
    nodes_per_group 0: no groups); a world within one group has none."""
    per_node = ranks_per_node or prof.ranks_per_node
    if ranks < per_node:
        per_node = ranks  # less than a node: one partial node
    group = prof.network.nodes_per_group if nodes_per_group is None and prof.network else nodes_per_group
    nodes = ranks // per_node if ranks % per_node == 0 else 0
    if group and nodes > group and nodes % group:
        raise TopologyError(f"{nodes} nodes do not fill network groups of {group} nodes; expected a multiple of "
                            f"{group} (or --nodes-per-group)")
    return Topology.regular(ranks, per_node, nics_per_node or prof.nics_per_node,
                            group if group and nodes > group else None)
