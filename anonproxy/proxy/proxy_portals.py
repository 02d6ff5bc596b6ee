"""The result writer of the portals the proxy answers itself (dp answers, EXPLAIN (ANONPROXY), SHOW and SET of
the proxy's settings) in the extended protocol: their RowDescription in the Bind's result formats, and their rows,
``max_rows`` at a time with PortalSuspended, as PostgreSQL sends a portal's.

Pure functions on a :class:`ProxyPortal`: no I/O. A result format a column cannot take is answered with the
ErrorResponse PostgreSQL sends (the caller then skips the rest of the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..route.decision import Decision
from ..wire import protocol as pg
from ..wire.results import Column, FormatError, Result, check_formats, result_formats
from .gate_routes import Parameters


@dataclass
class ProxyPortal:
    decision: Decision
    parameters: Parameters
    formats: tuple[int, ...]  # the Bind's result-format codes, as sent
    result: Result | None = None  # the answer, once executed: later Executes continue it, for free
    sent: int = 0
    notified: bool = False  # the answer's notices went with its first rows


def description(portal: ProxyPortal, columns: tuple[Column, ...]) -> bytes:
    """The portal's RowDescription (or an ErrorResponse: a format its columns cannot take)."""
    try:
        formats = result_formats(portal.formats, len(columns))
        check_formats(columns, formats)
    except FormatError as exc:
        return pg.error_response(exc.sqlstate, str(exc))
    return Result(columns).description(formats)


def rows(portal: ProxyPortal, max_rows: int) -> bytes:
    """The next rows of an executed portal: all, or ``max_rows`` then PortalSuspended if more remain (the answer's
    notices come with its first rows); or an ErrorResponse."""
    result = portal.result
    assert result is not None
    try:
        formats = result_formats(portal.formats, len(result.columns))
        check_formats(result, formats)
        start = portal.sent
        stop = len(result.rows) if max_rows <= 0 else min(len(result.rows), start + max_rows)
        data = result.data_rows(formats, start, stop)
    except FormatError as exc:
        return pg.error_response(exc.sqlstate, str(exc))
    portal.sent = stop
    notices = b"" if portal.notified else result.notices
    portal.notified = True
    if stop < len(result.rows):
        return data + pg.message(b"s") + notices  # PortalSuspended
    return data + result.command_complete(stop - start) + notices
