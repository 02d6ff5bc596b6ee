"""Opening connections to the upstream PostgreSQL server (TCP or Unix socket), in TLS as the upstream setting asks.

Over TCP, unless sslmode=disable, the connection first negotiates TLS
(upstream_tls.py); only then does the caller's protocol see it, and whatever
it writes (a StartupMessage, a CancelRequest) goes inside TLS. As in libpq,
TLS is never tried over a Unix socket. TCP_NODELAY needs no call here: asyncio
and uvloop both set it on every TCP transport they make.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from ..config import UpstreamAddress
from .upstream_tls import SSLAnswer, negotiate

CONNECT_TIMEOUT = 10.0

P = TypeVar("P", bound=asyncio.Protocol)


async def open_upstream(address: UpstreamAddress, protocol_factory: Callable[[], P]) -> tuple[asyncio.Transport, P]:
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(CONNECT_TIMEOUT):
        if address.is_unix:
            return await loop.create_unix_connection(protocol_factory, address.unix_path)  # type: ignore[return-value]
        if address.tls.mode == "disable":
            transport, protocol = await loop.create_connection(protocol_factory, address.host, address.port)
            return transport, protocol  # type: ignore[return-value]
        transport, answer = await loop.create_connection(SSLAnswer, address.host, address.port)
        try:
            transport = await negotiate(transport, answer, address)  # type: ignore[arg-type]
        except BaseException:
            transport.abort()
            raise
    protocol = protocol_factory()
    transport.set_protocol(protocol)
    protocol.connection_made(transport)
    for data in answer.early:  # (the server speaks only when spoken to: normally none)
        protocol.data_received(data)
    return transport, protocol


async def open_upstream_stream(address: UpstreamAddress) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The same connection as streams (cancel requests)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, protocol = await open_upstream(address, lambda: asyncio.StreamReaderProtocol(reader))
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)
