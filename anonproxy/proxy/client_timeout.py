"""The client's own statement_timeout, read from its connection, for what the proxy runs on its behalf.

When the session gives a ``time_limit`` (the policy's maximum for the role's mode), the gate reads the client's
statement_timeout with a query of the proxy's on the client's connection, after anything else ran there, and
caps it by that limit (:meth:`ClientTimeout.milliseconds`). A read stopped by the client's own statement_timeout
is made once more, then taken as 1 ms (the limit is shorter than that query took). The same query reads the
followed settings the server does not report (extra_float_digits, bytea_output; the list is
:mod:`.followed_settings`).

No I/O: the gate sends :data:`QUERY` and hands the answer's messages back here.
"""

from __future__ import annotations

from collections.abc import Callable

from ..wire import protocol as pg
from .followed_settings import UNREPORTED_SETTINGS


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


# pg_settings gives the value in milliseconds, whatever unit it was set in.
QUERY = pg.query_message(
    "select s.setting" + "".join(f", pg_catalog.current_setting({_literal(name)})" for name in UNREPORTED_SETTINGS)
    + " from pg_catalog.pg_settings s where s.name operator(pg_catalog.=) 'statement_timeout'")


class ClientTimeout:
    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit  # the policy's maximum statement time for the role's mode, in ms (0: none)
        self._timeout = 0  # the client's statement_timeout, in ms (0: none)
        self.stale = True  # to read again before the proxy runs something (something ran on the client's side)
        self.asking = 0  # our queries on the client's connection, not yet answered
        self._cancelled = False  # the last of them was stopped by the client's own statement_timeout
        self._reread = False  # ... and is being read once more

    def ask(self) -> bytes:
        """The query to send on the client's connection (its answer comes to ``row``, ``error``, ``ready``)."""
        self.stale = False
        self.asking += 1
        return QUERY

    def row(self, body: bytes) -> dict[str, str]:
        """The answer's DataRow: the statement_timeout kept; the followed settings it read, by name."""
        value, *unreported = pg.parse_data_row(body)
        if value is not None and value.isdigit():
            self._timeout = int(value)
        return {name: setting.decode() for name, setting in zip(UNREPORTED_SETTINGS, unreported, strict=True)
                if setting is not None}

    def error(self, body: bytes) -> None:
        """The query failed (the last values are kept)."""
        self._cancelled = pg.parse_fields(body).get("C") == "57014"

    def ready(self, status: bytes) -> None:
        """The query's ReadyForQuery. If the client's statement_timeout stopped it, that timeout is shorter than
        the query took (the first one of a new backend is the slowest): read once more; if that is stopped too (or
        the failure aborted the client's transaction), it is as short as 1 ms for what runs next."""
        self.asking -= 1
        cancelled, self._cancelled = self._cancelled, False
        if not cancelled:
            self._reread = False
        elif status == b"I" and not self._reread:
            self._reread = True
            self.stale = True
        else:
            self._reread = False
            self._timeout = 1

    def milliseconds(self) -> int:
        """The client's statement_timeout capped by the policy's limit for the mode, in ms (0: none)."""
        return min((t for t in (self._timeout, self._limit()) if t > 0), default=0)
