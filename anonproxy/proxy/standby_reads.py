"""psycopg connections of the service role to the standbys, kept per standby, where dp measurements run.

Each is opened to one server (``target_session_attrs=any``, a short connect timeout: a standby that is gone must
not hold a question that is already paid for) and kept while idle; one left inside a transaction or broken is closed.
"""

from __future__ import annotations

import contextlib
import select
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from psycopg import pq

from ..config import UpstreamAddress
from .servers import conninfo_at


class StandbyConnections:
    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._idle: dict[UpstreamAddress, list[psycopg.AsyncConnection[Any]]] = {}

    @contextlib.asynccontextmanager
    async def connection(self, address: UpstreamAddress) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """An idle connection to ``address`` that is still alive, else a new one (psycopg's errors pass)."""
        conn = None
        idle = self._idle.setdefault(address, [])
        while idle and conn is None:
            candidate = idle.pop()
            if alive(candidate):
                conn = candidate
            else:
                await candidate.close()
        if conn is None:
            conn = await psycopg.AsyncConnection.connect(
                conninfo_at(self._dsn, address, application_name="anonproxy dp"), autocommit=True)
        try:
            yield conn
        finally:
            if not conn.closed and conn.info.transaction_status == pq.TransactionStatus.IDLE:
                idle.append(conn)
            else:
                await conn.close()

    async def close(self) -> None:
        for idle in self._idle.values():
            while idle:
                await idle.pop().close()


def alive(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether an idle pooled connection can be used: one with bytes to read was ended by the server (a restart,
    pg_terminate_backend: an ErrorResponse and end of file). Checked without a round trip."""
    if conn.closed or conn.broken:
        return False
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return not poller.poll(0)
