"""Emulated nodes (launch/emulate/): network namespaces joined through a bridge, links
shaped with tc tbf, an MPICH job across them. The cluster tests build real namespaces, so
they skip (saying what is missing) where that cannot be done: not root, no `ip netns`, no
`unshare`, no tc tbf."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from functools import lru_cache

import pytest

from pccl.analysis import traffic
from pccl.core.topology import Topology
from tests.support.mpirun import ROOT, job_env

_spec = importlib.util.spec_from_file_location("emulate_cluster", ROOT / "launch" / "emulate" / "cluster.py")
emu = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emu)
RUN = ROOT / "launch" / "emulate" / "run.py"
CHECK = ROOT / "launch" / "emulate" / "check.py"


@lru_cache(maxsize=1)
def unavailable() -> str:
    """Why namespaces cannot be built here ("" when they can), found by trying."""
    try:
        emu.check_host()
    except emu.EmulationError as e:
        return str(e)
    ns = f"{emu.PREFIX}-{os.getpid()}-probe"
    try:
        probes = (("ip netns add", ["ip", "netns", "add", ns]),
                  ("tc tbf", ["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", *emu.tbf_args("1gbit")]),
                  ("unshare --uts in a namespace",
                   ["ip", "netns", "exec", ns, "unshare", "--uts", "hostname", "x"]))
        for what, cmd in probes:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                return f"{what} failed: {proc.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return ""


@pytest.fixture
def namespaces():
    """Skip, saying what is missing, where namespaces cannot be built."""
    if unavailable():
        pytest.skip(f"emulated nodes unavailable here: {unavailable()}")


def ours(name: str) -> list:
    """What is left of the cluster or run called `name`: namespaces and /etc/netns folders."""
    return [x for x in emu.leftovers() if os.path.basename(x).startswith(name + "-")]


def test_arguments():
    assert emu.rate_bits("1gbit") == 1e9 and emu.rate_bits("200mbit") == 2e8 and emu.rate_bits("1mbps") == 8e6
    for bad in ("fast", "1 gbit", "-1gbit", "0mbit", "10"):
        with pytest.raises(ValueError, match="rate must be"):
            emu.rate_bits(bad)
    with pytest.raises(ValueError, match="nodes"):
        emu.EmulatedCluster(0)
    with pytest.raises(ValueError, match="ranks_per_node"):
        emu.EmulatedCluster(2, ranks_per_node=0)
    with pytest.raises(ValueError, match="groups must be a positive divisor of the 3 nodes"):
        emu.EmulatedCluster(3, groups=2)
    with pytest.raises(ValueError, match="rate must be"):
        emu.EmulatedCluster(4, groups=2, uplink_rate="slow")
    assert emu.burst_bytes("1gbit") >= 64 * 1024 + 1500
    for args, message in ((["--rate", "fast", "--", "true"], "rate must be"),
                          (["--nodes", "0", "--", "true"], "expected an integer >= 1"), ([], "no command"),
                          # (a traceback after the job, its counts lost; a job killed at once)
                          (["--counters", "/nonexistent/x.json", "--", "true"], "its directory is not a writable"),
                          (["--timeout", "0", "--", "true"], "expected a number above 0")):
        proc = subprocess.run([sys.executable, str(RUN), *args], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    validate = RUN.parent / "validate.py"   # tracebacks, or an empty report with exit 0 (--launches 0)
    for args, message in ((["--rate", "bogus"], "rate must be"), (["--shapes", "0x2"], "shapes look like"),
                          (["--launches", "0"], "expected an integer >= 1"), (["--min-size", "abc"], "size"),
                          (["--groups", "3", "--shapes", "2x1"], "--groups 3 must divide the shapes' 2 nodes")):
        proc = subprocess.run([sys.executable, str(validate), *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


@pytest.mark.mpi
def test_collective_crosses_shaped_links(namespaces):
    """2 nodes x 2 ranks at 200mbit: pccl sees 2 nodes; the ring all-gather's inter-node
    bytes cross the links, no faster than the rate; intra-node pairs use shared memory."""
    rate, nbytes = "200mbit", 2 << 20
    with emu.EmulatedCluster(2, ranks_per_node=2, rate=rate) as c:
        name = c.name
        assert len(ours(name)) == 5  # 3 namespaces, 2 /etc/netns folders
        before, loopback = c.counters(), c.counters("lo")
        job = c.launch([sys.executable, str(CHECK), "--bytes", str(nbytes), "--algorithm", "ring"],
                       env=job_env(), capture=True, timeout=120, cwd=ROOT)
        moved, loopback = emu.delta(before, c.counters()), emu.delta(loopback, c.counters("lo"))
    assert ours(name) == []
    assert job.returncode == 0, f"{job.stdout[-3000:]}\n{job.stderr[-3000:]}"
    report = json.loads(job.stdout.strip().splitlines()[-1])
    assert report["hosts"] == ["node0", "node0", "node1", "node1"]
    assert report["nodes"] == [[0, 1], [2, 3]], "pccl did not detect the emulated nodes"
    assert report["ok"]

    topo, calls = Topology(tuple(map(tuple, report["nodes"]))), 1 + len(report["seconds"])
    out = {}  # bytes one call sends from each node to the others
    for node, ranks in enumerate(topo.nodes):
        out[node] = sum(b for r in ranks
                        for peer, b in traffic.sent("all_gather", "ring", topo, r, report["count"], 4).items()
                        if topo.node_of(peer) != node)
    assert out[0] > 0 and out[1] > 0
    # The ring's intra-node pairs (0->1, 2->3) move as much as its inter-node ones: through
    # shared memory, not TCP over the node's loopback.
    assert all(v["tx_bytes"] < out[0] // 4 for v in loopback.values()), (loopback, out)
    for node, host in enumerate(("node0", "node1")):
        expect = calls * out[node]
        assert expect <= moved[host]["tx_bytes"] <= 2 * expect + (1 << 20), (host, moved, expect)
        assert moved[host]["rx_bytes"] >= calls * out[1 - node], (host, moved)

    # Each call pushes max(out) bytes through one direction of a link: at the rate, less the
    # bucket that may pass at once, that takes at least this long (10% slack).
    fastest = (max(out.values()) - emu.burst_bytes(rate)) * 8 / emu.rate_bits(rate)
    assert min(report["seconds"]) >= 0.9 * fastest, (report["seconds"], fastest)


@pytest.mark.mpi
def test_groups_reach_each_other_through_their_shaped_uplinks(namespaces):
    """2 groups of 2 nodes: each group on its own switch, one uplink each to the core,
    shaped at the uplink rate; a ring all-gather across all four nodes works, and the
    bytes that leave a group pass its uplink."""
    with emu.EmulatedCluster(4, groups=2, rate="1gbit", uplink_rate="100mbit") as c:
        name = c.name
        assert len(ours(name)) == 11   # 4 nodes, the core and 2 group switches; 4 /etc/netns folders
        shaping = emu._run("tc", "-n", c.bridge, "qdisc", "show", "dev", "u0").stdout
        assert "tbf" in shaping and "100Mbit" in shaping, shaping
        read = lambda: emu._run("ip", "netns", "exec", c.bridge, "cat",   # noqa: E731
                                "/sys/class/net/u0/statistics/tx_bytes").stdout
        before = int(read())
        job = c.launch([sys.executable, str(CHECK), "--bytes", str(1 << 20), "--algorithm", "ring"],
                       env=job_env(), capture=True, timeout=120, cwd=ROOT)
        into_group0 = int(read()) - before
    assert ours(name) == []
    assert job.returncode == 0, f"{job.stdout[-3000:]}\n{job.stderr[-3000:]}"
    assert json.loads(job.stdout.strip().splitlines()[-1])["ok"]
    assert into_group0 > (1 << 20) // 4, into_group0   # node3 -> node0's blocks came in over the uplink


@pytest.mark.mpi
def test_job_exit_code_and_cleanup(namespaces):
    proc = subprocess.Popen([sys.executable, str(RUN), "--nodes", "2", "--", "sh", "-c", "exit 3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=job_env())
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert "node0: tx" in err and "node1: tx" in err
    assert emu.leftovers(f"{emu.PREFIX}-{proc.pid}") == []


@pytest.mark.mpi
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])   # HUP: a closed terminal left it all running
def test_a_signal_tears_down(namespaces, sig):
    proc = subprocess.Popen([sys.executable, str(RUN), "--nodes", "2", "--ranks-per-node", "2", "--", "sleep", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=job_env())
    name = f"{emu.PREFIX}-{proc.pid}"
    deadline = time.monotonic() + 30
    while len(emu.namespaces(name)) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1)  # the job has started
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert emu.leftovers(name) == []


def test_stale_runs_are_removed(namespaces):
    """Only a name of ours whose run's process is gone: a namespace someone named with our
    prefix, or another prefix's that starts alike (pccl-emu-... under pccl), was deleted
    too, a live run's among them."""
    dead = next(pid for pid in range(4_000_000, 3_000_000, -1) if not emu._alive(pid))
    stale = f"{emu.PREFIX}-{dead}-0-n0"
    others = [f"{emu.PREFIX}-mine", f"{emu.PREFIX}-{os.getpid()}-7-n0"]   # someone's; a live run's
    for name in (stale, *others):
        subprocess.run(["ip", "netns", "add", name], check=True)
    (emu.ETC_NETNS / stale).mkdir(parents=True, exist_ok=True)
    (emu.ETC_NETNS / stale / "hosts").write_text("127.0.0.1 localhost\n")
    try:
        assert emu.remove_stale("pccl") == []   # another prefix: pccl-emu-... is none of its runs
        with emu.EmulatedCluster(1) as c:
            assert stale not in emu.namespaces() and not (emu.ETC_NETNS / stale).exists()
            assert all(name in emu.namespaces() for name in others)
            ran = c.run(["hostname"], capture=True)
            assert ran.stdout.strip() == "node0"
        assert ours(c.name) == []
    finally:
        for name in others:
            subprocess.run(["ip", "netns", "del", name], check=False)
