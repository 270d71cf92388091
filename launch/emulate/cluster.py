"""An emulated cluster on one machine: N nodes as Linux network namespaces.

Each node is a network namespace ``<prefix>-<pid>-<k>-n<i>`` holding one veth end
(``eth0``, address 10.213.0.<i+1>/24) and its own /etc/hosts (``/etc/netns/<ns>/hosts``,
which ``ip netns exec`` bind-mounts over /etc/hosts). The other veth ends (``v<i>``) are
ports of a bridge ``br0`` in a namespace of its own (``...-br``), so nothing is added to
the host's namespace: no interface, address or route of the host is touched. Commands
run on a node through ``ip netns exec <ns> unshare --uts``, with the node's host name.

Both directions of every node's link are shaped with ``tc ... tbf`` at the given rate:
the node's ``eth0`` egress (node -> switch) and the bridge port's ``v<i>`` egress
(switch -> node). netem is not needed (and not available here), so no latency is added.

Two tiers (``groups=K``): the nodes form K groups of consecutive nodes, each on a bridge of
its own (namespace ``...-g<j>``), and each group bridge reaches the core bridge (``...-br``)
through one uplink (``uplink`` in the group, ``u<j>`` in the core), shaped both ways at
``uplink_rate``: the group's nodes share it, as a dragonfly group's nodes share its global
links or a leaf's share its uplinks. One subnet spans them all.

MPI jobs start with hydra's ``mpiexec`` inside node 0, which reaches the other nodes
through ``launch/emulate/rsh.py`` (``-launcher ssh -launcher-exec``).

The pid in the names tells whose the namespaces are: at start, namespaces and
/etc/netns folders with our prefix whose process is gone are removed.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Optional

PREFIX = "pccl-emu"
SUBNET = "10.213.0"          # a private test network; it only exists inside our namespaces
ETC_NETNS = Path("/etc/netns")
RSH = Path(__file__).resolve().with_name("rsh.py")
ROOT = Path(__file__).resolve().parents[2]
HOSTS_ENV = "PCCL_EMU_HOSTS"  # "host=namespace,..." for rsh.py

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(" + "|".join(_UNITS) + r")$")
_serial = count()


class EmulationError(RuntimeError):
    """The emulated cluster cannot be built here (what is missing is in the message)."""


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as "1gbit", "200mbit" or "100mbps" (bytes)."""
    m = _RATE.match(str(rate).strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate must be a positive number with a tc unit ({', '.join(_UNITS)}), "
                         f"e.g. '1gbit' or '200mbit'; got {rate!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def burst_bytes(rate: str) -> int:
    """The tbf bucket for a link of `rate`: it must hold the largest packet the stack hands
    to veth (a 64 KiB GSO super-packet; a smaller bucket makes tbf cut every one of them
    up, in software), and 1 ms of traffic at high rates so that timer granularity does not
    cap the rate. A bigger bucket would let short transfers beat the rate: 128 KiB is 1 ms
    at 1gbit, 5 ms at 200mbit."""
    return max(128 * 1024, int(rate_bits(rate) / 8 / 1000))


def tbf_args(rate: str) -> list:
    """tc tbf arguments for one direction of a link of `rate`. latency 20ms: the queue
    holds 20 ms of traffic, so TCP's bursts wait instead of being dropped (drops make TCP
    back off well below the rate), yet a queue that never drains cannot grow unbounded."""
    return ["tbf", "rate", f"{int(rate_bits(rate))}bit", "burst", str(burst_bytes(rate)), "latency", "20ms"]


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise EmulationError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def check_host() -> None:
    """Raise EmulationError naming what this machine lacks for an emulated cluster."""
    if os.geteuid() != 0:
        raise EmulationError("emulated nodes need root (network namespaces, veth, tc); run as root")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            raise EmulationError(f"'{tool}' not found on PATH (package {package})")


def venv_bin() -> Path:
    """Where the job's python and mpiexec are: this interpreter's bin/ when it has an
    mpiexec (the project's venv), else the repository's .venv/bin."""
    for candidate in (Path(sys.executable).parent, ROOT / ".venv" / "bin"):
        if (candidate / "mpiexec").exists():
            return candidate
    return Path(sys.executable).parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _owner(name: str, prefix: str) -> Optional[int]:
    """The pid in a name a Cluster of `prefix` makes (`<prefix>-<pid>-<serial>-` and n<i>,
    br or g<j>), or None when it is not one: another prefix's that starts alike
    (pccl-emu-... under the prefix pccl), or a name someone chose."""
    m = re.fullmatch(re.escape(prefix) + r"-(\d+)-\d+-(n\d+|br|g\d+)", name)
    return int(m.group(1)) if m else None


def namespaces(prefix: str = PREFIX) -> list:
    """Network namespaces whose name starts with `prefix`-."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


def leftovers(prefix: str = PREFIX) -> list:
    """Namespaces and /etc/netns folders with our prefix (for checks after teardown)."""
    files = sorted(str(p) for p in ETC_NETNS.glob(prefix + "-*")) if ETC_NETNS.is_dir() else []
    return namespaces(prefix) + files


def _kill_in(ns: str) -> None:
    """Kill every process in namespace `ns` (ours: the job's ranks, proxies, mpiexec)."""
    for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _remove_namespace(ns: str) -> None:
    """Kill what still runs in `ns`, delete it and its /etc/netns folder."""
    _kill_in(ns)
    _run("ip", "netns", "del", ns, check=False)
    shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)


def remove_stale(prefix: str = PREFIX) -> list:
    """Remove the namespaces and /etc/netns folders of runs whose process is gone."""
    names = set(namespaces(prefix))
    if ETC_NETNS.is_dir():
        names |= {p.name for p in ETC_NETNS.glob(prefix + "-*")}
    stale = sorted(n for n in names if (pid := _owner(n, prefix)) is not None and not _alive(pid))
    for ns in stale:
        _remove_namespace(ns)
    return stale


@dataclass(frozen=True)
class Node:
    index: int
    namespace: str
    hostname: str
    address: str
    interface: str = "eth0"   # the node's end of its link
    port: str = ""            # the bridge's end of its link (in the bridge namespace)


class EmulatedCluster:
    """``with EmulatedCluster(2, ranks_per_node=4, rate="1gbit") as c: c.launch([...])``.

    Builds the namespaces on entry and removes everything on exit, on an exception, and
    on SIGINT/SIGTERM/SIGHUP (turned into exceptions while the cluster is up)."""

    def __init__(self, nodes: int, ranks_per_node: int = 1, rate: str = "1gbit", prefix: str = PREFIX,
                 groups: int = 1, uplink_rate: Optional[str] = None):
        if not (isinstance(nodes, int) and 1 <= nodes <= 250):
            raise ValueError(f"nodes must be an integer from 1 to 250, got {nodes!r}")
        if not (isinstance(ranks_per_node, int) and ranks_per_node >= 1):
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,15}", prefix):
            raise ValueError(f"prefix must be 1-16 lowercase letters, digits or '-', got {prefix!r}")
        if not (isinstance(groups, int) and groups >= 1 and nodes % groups == 0):
            raise ValueError(f"groups must be a positive divisor of the {nodes} nodes, got {groups!r}")
        rate_bits(rate)  # a bad rate fails here, before anything is built
        rate_bits(uplink_rate or rate)
        self.rate, self.groups, self.uplink_rate = rate, groups, uplink_rate or rate
        self.ranks_per_node, self.prefix = ranks_per_node, prefix
        self.name = f"{prefix}-{os.getpid()}-{next(_serial)}"
        self.bridge = f"{self.name}-br"
        self.nodes = [Node(i, f"{self.name}-n{i}", f"node{i}", f"{SUBNET}.{i + 1}", port=f"v{i}")
                      for i in range(nodes)]
        # The bridge each node's link ends on: the core's, or its group's.
        self.group_bridges = [f"{self.name}-g{j}" for j in range(groups)] if groups > 1 else []
        self.switch_of = [self.group_bridges[i * groups // nodes] if groups > 1 else self.bridge
                          for i in range(nodes)]
        self._handlers: dict = {}

    # -- setup and teardown ------------------------------------------------------------

    def __enter__(self) -> "EmulatedCluster":
        check_host()
        remove_stale(self.prefix)
        self._trap_signals()
        try:
            self.setup()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for sig in self._handlers:  # a second Ctrl-C must not cut the teardown short
            signal.signal(sig, signal.SIG_IGN)
        try:
            self.teardown()
        finally:
            self._restore_signals()

    def setup(self) -> None:
        try:
            _run("ip", "netns", "add", self.bridge)
        except EmulationError as e:
            raise EmulationError(f"cannot create a network namespace: {e}") from None
        for switch in [self.bridge] + self.group_bridges:
            if switch != self.bridge:
                _run("ip", "netns", "add", switch)
            _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", switch, "link", "set", "br0", "up")
        for j, switch in enumerate(self.group_bridges):   # each group's uplink to the core
            core = ("ip", "-n", self.bridge)
            _run(*core, "link", "add", f"u{j}", "type", "veth", "peer", "name", "uplink", "netns", switch)
            _run(*core, "link", "set", f"u{j}", "master", "br0", "up")
            _run("ip", "-n", switch, "link", "set", "dev", "uplink", "master", "br0", "up")
            for where, dev in ((switch, "uplink"), (self.bridge, f"u{j}")):
                self._shape(where, dev, self.uplink_rate)
        hosts = "127.0.0.1 localhost\n" + "".join(f"{n.address} {n.hostname}\n" for n in self.nodes)
        for n in self.nodes:
            br = ("ip", "-n", self.switch_of[n.index])
            _run("ip", "netns", "add", n.namespace)
            (ETC_NETNS / n.namespace).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / n.namespace / "hosts").write_text(hosts)
            # Both ends are created inside our namespaces, never in the host's.
            _run(*br, "link", "add", n.port, "type", "veth", "peer", "name", n.interface, "netns", n.namespace)
            _run(*br, "link", "set", n.port, "master", "br0", "up")
            ns = ("ip", "-n", n.namespace)
            _run(*ns, "link", "set", "lo", "up")
            _run(*ns, "addr", "add", f"{n.address}/24", "dev", n.interface)
            _run(*ns, "link", "set", n.interface, "up")
            for where, dev in ((n.namespace, n.interface), (self.switch_of[n.index], n.port)):
                self._shape(where, dev, self.rate)

    @staticmethod
    def _shape(namespace: str, device: str, rate: str) -> None:
        proc = _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf_args(rate), check=False)
        if proc.returncode != 0:
            raise EmulationError(f"tc tbf is not available (kernel module sch_tbf?): {proc.stderr.strip()}")

    def teardown(self) -> None:
        for ns in [n.namespace for n in self.nodes] + [self.bridge] + self.group_bridges:
            _remove_namespace(ns)

    def _trap_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def stop(signum, frame):
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

        # SIGHUP too: a closed terminal or ssh session left the namespaces and the job running
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._handlers[sig] = signal.signal(sig, stop)

    def _restore_signals(self) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers.clear()

    # -- running things ----------------------------------------------------------------

    def on_node(self, node: int, argv: list) -> list:
        """The command line that runs `argv` on node `node` (its namespace and host name)."""
        n = self.nodes[node]
        return ["ip", "netns", "exec", n.namespace, "unshare", "--uts",
                "sh", "-c", 'hostname "$0" && exec "$@"', n.hostname, *argv]

    def env(self, base: Optional[dict] = None) -> dict:
        """The environment of a job: the venv's bin/ first on PATH, MPI over TCP on eth0."""
        outer = ("PMI_", "PMIX_", "HYDRA_", "HYDI_")  # of an MPI job this may run inside
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(outer)}
        env["PATH"] = str(venv_bin()) + os.pathsep + env.get("PATH", "/usr/bin:/bin")
        env[HOSTS_ENV] = ",".join(f"{n.hostname}={n.namespace}" for n in self.nodes)
        env.update(mpi_env(self.nodes[0].interface))
        return env

    def mpi_command(self, argv: list, mpiexec: Optional[str] = None) -> list:
        """mpiexec (run on node 0) starting `argv` on ranks_per_node ranks of every node."""
        mpiexec = mpiexec or str(venv_bin() / "mpiexec")
        if shutil.which(mpiexec) is None:
            raise EmulationError(f"no mpiexec at {mpiexec}; build the project's venv (make) or pass mpiexec=")
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout
        if "HYDRA" not in version:
            raise EmulationError(f"{mpiexec} is not MPICH's hydra mpiexec; emulated nodes need hydra "
                                 "(-launcher ssh -launcher-exec); Open MPI is not supported here yet")
        hosts = ",".join(f"{n.hostname}:{self.ranks_per_node}" for n in self.nodes)
        return [mpiexec, "-hosts", hosts, "-launcher", "ssh", "-launcher-exec", str(RSH),
                "-n", str(len(self.nodes) * self.ranks_per_node), *argv]

    def run(self, argv: list, node: int = 0, env: Optional[dict] = None, timeout: Optional[float] = None,
            capture: bool = False, **kw) -> subprocess.CompletedProcess:
        """Run `argv` on one node; on timeout or interrupt everything it started is killed."""
        cmd = self.on_node(node, argv)
        out = subprocess.PIPE if capture else None
        proc = subprocess.Popen(cmd, env=self.env(env), stdout=out, stderr=out, text=True,
                                start_new_session=True, **kw)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:
            self._kill(proc)
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)

    def launch(self, argv: list, **kw) -> subprocess.CompletedProcess:
        """Run `argv` on every rank (an MPI job across the nodes); see run() for options."""
        return self.run(self.mpi_command(argv), **kw)

    def _kill(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        for n in self.nodes:  # the proxies and ranks rsh.py started on the other nodes
            _kill_in(n.namespace)

    # -- traffic -----------------------------------------------------------------------

    def counters(self, interface: Optional[str] = None) -> dict:
        """{hostname: {"tx_bytes": .., "rx_bytes": ..}} of each node's link (or of another
        interface of the nodes, e.g. "lo"), read from /sys/class/net/<if>/statistics inside
        the node's namespace."""
        out = {}
        for n in self.nodes:
            stats = f"/sys/class/net/{interface or n.interface}/statistics"
            text = _run("ip", "netns", "exec", n.namespace, "cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes").stdout
            tx, rx = (int(v) for v in text.split())
            out[n.hostname] = {"tx_bytes": tx, "rx_bytes": rx}
        return out


def delta(before: dict, after: dict) -> dict:
    """Per-node counter differences between two counters() snapshots."""
    return {host: {k: after[host][k] - before[host][k] for k in after[host]} for host in after}


def mpi_env(interface: str) -> dict:
    """What MPICH needs so that ranks on different namespace-nodes talk over TCP on
    `interface`, with either netmod (see launch/README.md)."""
    return {
        # UCX would otherwise pick shared memory (the namespaces share /dev/shm) for
        # ranks on other "nodes"; MPICH's own shared memory still serves ranks of a node.
        "UCX_TLS": "tcp,self",
        "UCX_NET_DEVICES": interface,
        # MPICH's OFI netmod, if chosen: the tcp provider on our interface.
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": interface,
    }
