#!/usr/bin/env python3
"""The "ssh" that hydra's mpiexec uses to reach an emulated node.

mpiexec ... -launcher ssh -launcher-exec launch/emulate/rsh.py calls, once per node:

    rsh.py -x <host> "<path>/hydra_pmi_proxy" --control-port node0:<port> ... --proxy-id <k>

(ssh's -x, the host, then the remote command as words that a remote shell would join and
parse; the proxy's path arrives with literal double quotes). Like ssh, we join the words
and hand them to sh, but inside the node's network namespace and with its host name:
``ip netns exec <ns> unshare --uts sh -c 'hostname <host> && exec <command>'``.
The host -> namespace map comes from PCCL_EMU_HOSTS ("node0=ns0,node1=ns1,...").
"""
import os
import shlex
import sys

HOSTS_ENV = "PCCL_EMU_HOSTS"


def main(argv: list) -> None:
    while argv and argv[0].startswith("-"):  # ssh options (hydra passes -x)
        argv = argv[1:]
    if len(argv) < 2:
        sys.exit("usage: rsh.py [-x] HOST COMMAND...")
    host, command = argv[0], " ".join(argv[1:])
    hosts = dict(item.split("=", 1) for item in os.environ.get(HOSTS_ENV, "").split(",") if "=" in item)
    if host not in hosts:
        sys.exit(f"rsh.py: unknown emulated host {host!r}; {HOSTS_ENV} lists {sorted(hosts)}")
    script = f"hostname {shlex.quote(host)} && exec {command}"
    os.execvp("ip", ["ip", "netns", "exec", hosts[host], "unshare", "--uts", "sh", "-c", script])


if __name__ == "__main__":
    main(sys.argv[1:])
