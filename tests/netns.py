"""Network namespaces as separate hosts on one machine, for tests (needs root, as in CI).

Each :class:`Host` is a namespace joined to this machine's own namespace by a veth pair: this side has
``10.<net>.<i>.1/24``, the namespace ``10.<net>.<i>.2/24``. A process run with :meth:`Host.command` sees only its
namespace's interfaces: it reaches this machine at ``outside`` and is reached at ``inside``, over a real link rather
than the loopback interface.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    namespace: str
    outside: str  # this machine's address on the link
    inside: str  # the namespace's address

    def command(self) -> list[str]:
        """The prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.namespace]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def host(net: int, index: int) -> Iterator[Host]:
    """One namespace and its link; removed on exit (the veth pair goes with it), even after a failure."""
    tag = f"{os.getpid() % 100000}{index}"
    namespace, outer, inner = f"anonproxy-{net}-{tag}", f"ap{tag}o", f"ap{tag}i"
    new = Host(namespace, f"10.{net}.{index}.1", f"10.{net}.{index}.2")
    _ip("netns", "add", namespace)
    try:
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", namespace)
        _ip("addr", "add", f"{new.outside}/24", "dev", outer)
        _ip("link", "set", outer, "up")
        _ip("-n", namespace, "addr", "add", f"{new.inside}/24", "dev", inner)
        _ip("-n", namespace, "link", "set", inner, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        yield new
    finally:
        subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)
        subprocess.run(["ip", "link", "delete", outer], capture_output=True)  # gone already, unless half made


@contextmanager
def hosts(net: int, count: int) -> Iterator[list[Host]]:
    with ExitStack() as stack:
        yield [stack.enter_context(host(net, index)) for index in range(1, count + 1)]
