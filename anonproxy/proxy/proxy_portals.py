"""The result writer of the portals the proxy answers itself (dp answers, EXPLAIN (ANONPROXY), SHOW and SET of
the proxy's settings) in the extended protocol: their RowDescription in the Bind's result formats, and their rows,
``max_rows`` at a time with PortalSuspended, as PostgreSQL sends a portal's.

Pure functions on a :class:`ProxyPortal`: no I/O. A result format a column cannot take is answered with the
ErrorResponse PostgreSQL sends (the caller then skips the rest of the batch).

Also the rewritten (suppress) portals the proxy keeps because their service connection's portal ends at a Sync
(:class:`KeptPortal`, below): what is sent to run one again from its Bind, how its answer is kept (up to the
session's limits: 54000 past them), and its rows served as PostgreSQL serves them; and what is sent to describe
one bound in an earlier batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..route.decision import Decision
from ..wire import protocol as pg
from ..wire.results import Column, FormatError, Result, check_formats, result_formats
from .gate_routes import Parameters
from .limits import MemoryLimits, size_text


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


# -- rewritten portals read with a row limit, or after a Sync: kept ------------------------------------------------
#
# A rewritten (suppress) portal runs on a borrowed service connection, whose portals end with the batch. When the
# client executes one with a row limit (JDBC's fetch size, asyncpg's cursors), or in a later batch than its Bind,
# the proxy runs it to completion there instead, from the statement and values it was bound with (under names of
# its own, closed at once), keeps the answer — released groups: few rows — and serves this and later Executes from
# it, as PostgreSQL serves a portal: ``max_rows`` rows then PortalSuspended, until CommandComplete.

KEPT = b"anonproxy_kept"  # the statement and portal names the proxy runs a kept portal under, on the service side
# PostgreSQL's answer to an Execute of a portal already read to its end (a rewritten statement is a query: SELECT).
AT_END = pg.command_complete("SELECT 0")


@dataclass
class KeptPortal:
    """A rewritten portal's whole answer as PostgreSQL sent it, and how far the client has read it."""

    description: bytes  # the RowDescription (or NoData) of the portal, in its Bind's result formats
    rows: list[bytes]  # DataRow messages
    verb: str  # of the CommandComplete tag (SELECT)
    size: int  # bytes of the rows
    sent: int = 0
    at_end: bool = False  # an Execute found fewer rows than it asked for (PostgreSQL's portal->atEnd)


def keep_payload(runs: str, parameter_types: bytes, bind: bytes) -> bytes:
    """What goes to the service connection in place of the client's Execute: the portal's statement prepared and
    bound again (``parameter_types``: a Parse's part after the text; ``bind``: the client's Bind after the names),
    described, executed to completion and closed, then a Flush (nothing else of the client's is sent until all
    this is answered). The statement is closed first too: after an error, PostgreSQL skipped the last Close."""
    named = KEPT + b"\0"
    return _bound_again(runs, parameter_types, bind, pg.message(b"E", named + b"\0\0\0\0")) + pg.message(b"H")


def describe_payload(runs: str, parameter_types: bytes, bind: bytes) -> bytes:
    """What goes to the service connection in place of the client's Describe of a rewritten portal bound in an
    earlier batch: the portal bound again as for :func:`keep_payload`, described (its RowDescription, in the Bind's
    result formats, is the client's answer; the others are hidden: DESCRIBE_HIDDEN) and closed, nothing run."""
    return _bound_again(runs, parameter_types, bind, b"")


# The service connection's answers to describe_payload that the client does not see: CloseComplete, ParseComplete,
# BindComplete before the RowDescription, two CloseComplete after it.
DESCRIBE_HIDDEN = (b"3", b"1", b"2", b"3", b"3")


def _bound_again(runs: str, parameter_types: bytes, bind: bytes, execute: bytes) -> bytes:
    """The statement closed, prepared again and bound, the portal described, ``execute`` (or nothing), then the
    portal and the statement closed."""
    named = KEPT + b"\0"
    return (pg.message(b"C", b"S" + named) + pg.parse_message(KEPT, runs, parameter_types)
            + pg.message(b"B", named + named + bind) + pg.message(b"D", b"P" + named) + execute
            + pg.message(b"C", b"P" + named) + pg.message(b"C", b"S" + named))


def next_rows(portal: KeptPortal, max_rows: int) -> tuple[bytes, bytes]:
    """The next rows of a kept portal and the message that ends this Execute: PortalSuspended when ``max_rows``
    rows were sent (PostgreSQL does not look further), else CommandComplete with this Execute's row count."""
    start = portal.sent
    stop = start if portal.at_end else len(portal.rows) if max_rows <= 0 else min(len(portal.rows), start + max_rows)
    portal.sent = stop
    if max_rows > 0 and stop - start == max_rows:
        return b"".join(portal.rows[start:stop]), pg.message(b"s")
    portal.at_end = True
    return b"".join(portal.rows[start:stop]), pg.command_complete(f"{portal.verb} {stop - start}")


@dataclass
class Keeping:
    """The service connection's answers to :func:`keep_payload`, after ``ahead`` answers still owed to earlier
    messages of the batch (they go their usual way). Rows are kept up to ``room`` bytes; past it, only counted.
    ``max_rows``: of the client's Execute (0: all)."""

    portal: bytes
    max_rows: int
    ahead: int
    room: int
    description: bytes = b""
    rows: list[bytes] = field(default_factory=list)
    size: int = 0
    tag: bytes = b""  # the CommandComplete's, once it came
    closed: int = 0  # the statement's, before; the portal's and the statement's, after

    def ours(self, type_: bytes) -> bool:
        """Whether a message of the service connection answers our messages (else an earlier one: counted)."""
        if not self.ahead:
            return True
        if type_ in (b"1", b"2", b"3", b"T", b"n", b"C", b"s", b"I"):
            self.ahead -= 1
        return False

    def feed(self, type_: bytes, body: bytes) -> bool:
        """One message of our answer; True once all is in (the Close answered)."""
        if type_ in (b"T", b"n"):
            self.description = pg.message(type_, body)
        elif type_ == b"D":
            self.size += len(body) + 5
            if self.size <= self.room:
                self.rows.append(pg.message(type_, body))
            else:
                self.rows.clear()  # over the limit: the portal will not be kept
        elif type_ == b"C":
            self.tag = body
        elif type_ == b"3":
            self.closed += 1
        return self.closed == 3  # (ParseComplete, BindComplete: not for the client)

    def kept(self) -> KeptPortal | bytes:
        """The portal kept, or the error (54000) that answers the client's Execute."""
        if self.size > self.room:
            return pg.error_response(
                "54000", f"the portal's answer is {size_text(self.size)} of rows; anonproxy keeps at most "
                         f"{size_text(self.room)} more of the rows of portals read with a row limit in this session",
                hint="Read the statement without a row limit (fetch size 0, or fetch all rows at once); the limits "
                     "are the proxy's max_cursor_size and max_session_cursor_size settings.")
        verb = pg.read_cstring(self.tag)[0].split(b" ")[0].decode()
        return KeptPortal(self.description, self.rows, verb, self.size)


def keeping_room(kept: dict[bytes, KeptPortal], limits: MemoryLimits) -> int:
    """Bytes of rows a new kept portal may hold: one at most ``cursor_size``, all of the session's together at most
    ``session_cursor_size``."""
    return max(0, min(limits.cursor_size, limits.session_cursor_size - sum(p.size for p in kept.values())))
