"""Opening connections to the upstream PostgreSQL server (TCP or Unix socket)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from ..config import UpstreamAddress

CONNECT_TIMEOUT = 10.0


async def open_upstream(
    address: UpstreamAddress, protocol_factory: Callable[[], asyncio.Protocol]
) -> tuple[asyncio.Transport, asyncio.Protocol]:
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(CONNECT_TIMEOUT):
        if address.is_unix:
            return await loop.create_unix_connection(protocol_factory, address.unix_path)  # type: ignore[return-value]
        transport, protocol = await loop.create_connection(protocol_factory, address.host, address.port)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return transport, protocol  # type: ignore[return-value]


async def open_upstream_stream(address: UpstreamAddress) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    async with asyncio.timeout(CONNECT_TIMEOUT):
        if address.is_unix:
            return await asyncio.open_unix_connection(address.unix_path)
        return await asyncio.open_connection(address.host, address.port)
