"""Cancel keys: clients see their real backend's process id and a secret key of the proxy's.

The client's BackendKeyData carries the process id of its upstream backend,
unchanged, so ``pg_backend_pid()``, notification senders and
``pg_terminate_backend`` agree with what the client knows. The secret key is
the proxy's own (random, as long as the server's: 4 bytes in protocol 3.0,
up to 256 in 3.2): a session may have more than one backend to cancel (a
gated one also the pooled service connection it holds at that moment), and
the server's key never leaves the proxy. A session may also stop work of
its own (``on_cancel``: a dp question the proxy computes), which no upstream
backend runs for it.

A client's CancelRequest arrives on a new connection, which the kernel may
give to any worker process (SO_REUSEPORT). A worker that does not hold the
(process id, secret key) pair asks every sibling over its Unix socket in the
run directory; the one that issued the key acts, and answers with one byte so
that an unknown key is logged once, by the worker the client reached.

Behind a load balancer the request may even reach another proxy than the
session's. With ``peers`` configured, a key that no worker here issued is
passed, as a CancelRequest of its own, to every peer proxy; a request that
comes from a peer is never passed on again, so it travels one hop at most.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import UpstreamAddress
from ..wire.protocol import cancel_request
from .upstream import open_upstream_stream

log = logging.getLogger("anonproxy.cancel")

CANCEL_TIMEOUT = 5.0
FOUND = b"Y"  # a sibling's answer: "the key was mine and the server acted"


@dataclass(frozen=True)
class UpstreamKey:
    address: UpstreamAddress
    process_id: int
    secret_key: bytes


@dataclass(frozen=True)
class ClientKey:
    """What the client's BackendKeyData says: its real backend's process id and the proxy's secret."""

    process_id: int
    secret_key: bytes


def cancel_socket_path(run_dir: Path, worker_index: int) -> Path:
    return run_dir / f"cancel-{worker_index}.sock"


class CancelRegistry:
    def __init__(self, worker_index: int = 0, run_dir: Path | None = None,
                 peers: tuple[tuple[str, int], ...] = ()) -> None:
        self.worker_index = worker_index
        self._run_dir = run_dir
        self._peers = peers
        # One entry per process id: a backend's id is unique while it lives, and a newer session
        # with a reused id replaces the entry of one whose backend has gone.
        self._keys: dict[int, tuple[bytes, list[UpstreamKey]]] = {}
        self._own: dict[int, Callable[[], Awaitable[None]]] = {}  # what a session stops itself, by process id

    def register(self, upstream: UpstreamKey, on_cancel: Callable[[], Awaitable[None]] | None = None) -> ClientKey:
        """The key for the client of ``upstream``: its process id, and a fresh secret of the same length.
        ``on_cancel``: what the session stops itself on a cancel with this key (awaited with the upstream cancels)."""
        key = ClientKey(upstream.process_id, secrets.token_bytes(len(upstream.secret_key)))
        self._keys[key.process_id] = (key.secret_key, [upstream])
        self._own.pop(key.process_id, None)
        if on_cancel is not None:
            self._own[key.process_id] = on_cancel
        return key

    def add(self, key: ClientKey, upstream: UpstreamKey) -> None:
        """Also cancel ``upstream`` (e.g. the session's service connection) with this key."""
        entry = self._keys.get(key.process_id)
        if entry is not None and entry[0] == key.secret_key:
            entry[1].append(upstream)

    def remove(self, key: ClientKey, upstream: UpstreamKey) -> None:
        """No longer cancel ``upstream`` with this key (a pooled service connection handed back)."""
        entry = self._keys.get(key.process_id)
        if entry is not None and entry[0] == key.secret_key and upstream in entry[1]:
            entry[1].remove(upstream)

    def unregister(self, key: ClientKey) -> None:
        entry = self._keys.get(key.process_id)
        if entry is not None and entry[0] == key.secret_key:
            del self._keys[key.process_id]
            self._own.pop(key.process_id, None)

    async def cancel(self, process_id: int, secret_key: bytes, *, from_peer: bool = False) -> None:
        """Act on a client's CancelRequest (or a peer proxy's, passing one on); wrong keys are ignored (and logged),
        as PostgreSQL does."""
        if await self.cancel_own(process_id, secret_key):
            return
        if self._run_dir is not None and await self._ask_siblings(process_id, secret_key):
            return
        if self._peers and not from_peer:
            log.debug("cancel request for process %d: not a key of this proxy's, passed to its peers", process_id)
            await asyncio.gather(*(_pass_to_peer(peer, process_id, secret_key) for peer in self._peers))
            return
        log.info("cancel request for process %d with an unknown key ignored", process_id)

    async def cancel_own(self, process_id: int, secret_key: bytes) -> bool:
        """Cancel if this worker issued the key; whether it did."""
        entry = self._keys.get(process_id)
        if entry is None or not hmac.compare_digest(entry[0], secret_key):
            return False
        own = self._own.get(process_id)
        await asyncio.gather(*(send_cancel(key) for key in list(entry[1])), *([own()] if own is not None else []))
        return True

    async def _ask_siblings(self, process_id: int, secret_key: bytes) -> bool:
        assert self._run_dir is not None
        siblings = [path for path in self._run_dir.glob("cancel-*.sock")
                    if path != cancel_socket_path(self._run_dir, self.worker_index)]
        answers = await asyncio.gather(*(_forward(path, process_id, secret_key) for path in siblings))
        return any(answers)


async def _forward(path: Path, process_id: int, secret_key: bytes) -> bool:
    """Pass a CancelRequest to the sibling listening on ``path``; whether it held the key."""
    try:
        async with asyncio.timeout(CANCEL_TIMEOUT):
            reader, writer = await asyncio.open_unix_connection(str(path))
            writer.write(cancel_request(process_id, secret_key))
            await writer.drain()
            answer = await reader.read()  # the sibling hangs up once the server has acted
            writer.close()
            return answer == FOUND
    except (OSError, TimeoutError) as exc:
        log.warning("cannot forward a cancel request to %s: %s", path.name, exc)
        return False


async def _pass_to_peer(peer: tuple[str, int], process_id: int, secret_key: bytes) -> None:
    """Send a CancelRequest to a peer proxy and wait until it hangs up: it has acted, if the key was its own."""
    try:
        async with asyncio.timeout(CANCEL_TIMEOUT):
            reader, writer = await asyncio.open_connection(*peer)
            writer.write(cancel_request(process_id, secret_key))
            await writer.drain()
            await reader.read()
            writer.close()
    except (OSError, TimeoutError) as exc:
        log.warning("cannot pass a cancel request to the peer proxy %s:%d: %s", *peer, exc)


async def cancel_then_hang_up(registry: CancelRegistry, process_id: int, secret_key: bytes,
                              transport: asyncio.BaseTransport, *, from_peer: bool = False) -> None:
    """Act on a CancelRequest, then close its connection.

    Clients take the hang-up as "the cancel is done" (libpq waits for it), so
    it must come after the server acted; else a late cancel hits their next query.
    """
    try:
        await registry.cancel(process_id, secret_key, from_peer=from_peer)
    finally:
        transport.close()


async def answer_sibling(registry: CancelRegistry, process_id: int, secret_key: bytes,
                         transport: asyncio.WriteTransport) -> None:
    """A sibling's forwarded CancelRequest: act if the key is ours, say so, hang up."""
    try:
        if await registry.cancel_own(process_id, secret_key):
            transport.write(FOUND)
    finally:
        transport.close()


async def send_cancel(key: UpstreamKey) -> None:
    """Send a CancelRequest to the upstream backend and wait until it hangs up (in TLS as the upstream setting
    asks, as libpq does: PostgreSQL reads a CancelRequest after an SSLRequest)."""
    try:
        async with asyncio.timeout(CANCEL_TIMEOUT):
            reader, writer = await open_upstream_stream(key.address)
            writer.write(cancel_request(key.process_id, key.secret_key))
            await writer.drain()
            await reader.read()  # the server closes the connection when done
            writer.close()
    except (OSError, TimeoutError) as exc:
        log.warning("cannot send cancel request to upstream %s: %s", key.address, exc)
