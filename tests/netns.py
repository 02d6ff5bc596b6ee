"""Network namespaces as separate hosts on one LAN, for tests and benchmarks (needs root, as in CI).

:func:`hosts` makes a bridge on this machine with the address ``10.<net>.0.1/24`` and, for each host, a namespace
joined to the bridge by a veth pair, with the address ``10.<net>.0.<i + 1>/24``. A process run with
:meth:`Host.command` sees only its namespace's interfaces: it reaches this machine at ``outside`` and every other
host at its ``inside``, over real links rather than the loopback interface (no routing: one Ethernet segment).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    namespace: str
    outside: str  # this machine's address on the LAN
    inside: str  # the namespace's address

    @property
    def network(self) -> str:
        """The LAN's network, for pg_hba.conf lines."""
        return self.inside.rsplit(".", 1)[0] + ".0/24"

    def command(self) -> list[str]:
        """The prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.namespace]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def hosts(net: int, count: int) -> Iterator[list[Host]]:
    """``count`` hosts on one bridge; all removed on exit, even after a failure."""
    tag = f"{net}{os.getpid() % 10000}"
    bridge, outside = f"apb{tag}", f"10.{net}.0.1"
    made: list[Host] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{outside}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for index in range(1, count + 1):
            host = Host(f"anonproxy-{tag}-{index}", outside, f"10.{net}.0.{index + 1}")
            outer, inner = f"ap{tag}o{index}", f"ap{tag}i{index}"
            _ip("netns", "add", host.namespace)
            made.append(host)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.inside}/24", "dev", inner)
            _ip("-n", host.namespace, "link", "set", inner, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield made
    finally:
        for host in made:  # the veth pair goes with its namespace
            subprocess.run(["ip", "netns", "delete", host.namespace], capture_output=True)
        subprocess.run(["ip", "link", "delete", bridge], capture_output=True)
