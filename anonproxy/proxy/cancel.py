"""Cancel keys: the proxy hands clients its own keys and maps them to upstream backends.

A client's CancelRequest arrives on a new connection, which the kernel may
give to any worker process (SO_REUSEPORT). The worker index is therefore
encoded in the top bits of the process id we hand out; a worker that
receives a key it does not own forwards the request to its owner over a
Unix socket in the run directory.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

from ..config import UpstreamAddress
from ..wire.protocol import cancel_request
from .upstream import open_upstream_stream

log = logging.getLogger("anonproxy.cancel")

WORKER_SHIFT = 24  # process id = worker index (7 bits) << 24 | serial (24 bits)
SERIAL_MASK = (1 << WORKER_SHIFT) - 1
CANCEL_TIMEOUT = 5.0


@dataclass(frozen=True)
class UpstreamKey:
    address: UpstreamAddress
    process_id: int
    secret_key: int


def cancel_socket_path(run_dir: Path, worker_index: int) -> Path:
    return run_dir / f"cancel-{worker_index}.sock"


class CancelRegistry:
    def __init__(self, worker_index: int = 0, run_dir: Path | None = None) -> None:
        self.worker_index = worker_index
        self._run_dir = run_dir
        self._keys: dict[int, tuple[int, list[UpstreamKey]]] = {}
        self._serials = itertools.cycle(range(1, SERIAL_MASK + 1))

    def register(self, upstream: UpstreamKey) -> tuple[int, int]:
        """Issue a (process id, secret key) pair for the client of ``upstream``."""
        while True:
            process_id = (self.worker_index << WORKER_SHIFT) | next(self._serials)
            if process_id not in self._keys:
                break
        secret_key = secrets.randbits(32) - (1 << 31)  # a signed int32, as on the wire
        self._keys[process_id] = (secret_key, [upstream])
        return process_id, secret_key

    def add(self, process_id: int, upstream: UpstreamKey) -> None:
        """Also cancel ``upstream`` (e.g. the session's service connection) with this key."""
        self._keys[process_id][1].append(upstream)

    def unregister(self, process_id: int) -> None:
        self._keys.pop(process_id, None)

    async def cancel(self, process_id: int, secret_key: int) -> None:
        """Act on a client's CancelRequest; wrong keys are ignored, as PostgreSQL does."""
        owner = process_id >> WORKER_SHIFT
        if owner != self.worker_index and self._run_dir is not None:
            await self._forward(owner, process_id, secret_key)
            return
        entry = self._keys.get(process_id)
        if entry is None or not _same_secret(entry[0], secret_key):
            log.info("cancel request with an unknown key ignored")
            return
        await asyncio.gather(*(send_cancel(key) for key in entry[1]))

    async def _forward(self, owner: int, process_id: int, secret_key: int) -> None:
        assert self._run_dir is not None
        path = cancel_socket_path(self._run_dir, owner)
        try:
            async with asyncio.timeout(CANCEL_TIMEOUT):
                reader, writer = await asyncio.open_unix_connection(str(path))
                writer.write(cancel_request(process_id, secret_key))
                await writer.drain()
                await reader.read()  # the owner hangs up once the server has acted
                writer.close()
        except (OSError, TimeoutError) as exc:
            log.warning("cannot forward cancel request to worker %d: %s", owner, exc)


async def cancel_then_hang_up(registry: CancelRegistry, process_id: int, secret_key: int,
                              transport: asyncio.BaseTransport) -> None:
    """Act on a CancelRequest, then close its connection.

    Clients take the hang-up as "the cancel is done" (libpq waits for it), so
    it must come after the server acted; else a late cancel hits their next query.
    """
    try:
        await registry.cancel(process_id, secret_key)
    finally:
        transport.close()


def _same_secret(a: int, b: int) -> bool:
    return hmac.compare_digest(a.to_bytes(4, "big", signed=True), b.to_bytes(4, "big", signed=True))


async def send_cancel(key: UpstreamKey) -> None:
    """Send a CancelRequest to the upstream backend and wait until it hangs up."""
    try:
        async with asyncio.timeout(CANCEL_TIMEOUT):
            reader, writer = await open_upstream_stream(key.address)
            writer.write(cancel_request(key.process_id, key.secret_key))
            await writer.drain()
            await reader.read()  # the server closes the connection when done
            writer.close()
    except (OSError, TimeoutError) as exc:
        log.warning("cannot send cancel request to upstream %s: %s", key.address, exc)
