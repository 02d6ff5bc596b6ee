"""Cursors the proxy holds for gated roles: their rows, position and life time (sans-I/O).

A ``DECLARE`` whose query the proxy answers (a suppression rewrite, a
differentially private answer) is answered once, when it is declared; the
rows — few, they are aggregates — stay here, and FETCH / MOVE / CLOSE of that
cursor are answered from them, never sent to PostgreSQL. A ``DECLARE`` whose
query passes goes to the client's own connection; its name is recorded here
(once PostgreSQL said ``DECLARE CURSOR``) so that names stay unique across
both kinds, as PostgreSQL keeps them.

Positions move exactly as PostgreSQL's portals do (``DoPortalRunFetch`` and
``PortalRunSelect`` in its pquery.c): :func:`run` is that arithmetic over a
materialised result, including which directions a cursor without SCROLL
refuses (55000 "cursor can only scan forward").

Memory: the rows a session's cursors hold are bounded (limits.py): per
cursor, all of the session's together, and the number of cursors; a DECLARE
over the limit is refused with 54000 and no cursor is made. The answer of a
gated DECLARE's query is kept only up to what the limits leave room for;
past that, its rows are counted and dropped as they come.

Life time follows the transaction, as PostgreSQL's: a cursor WITHOUT HOLD
ends with its transaction; one WITH HOLD survives COMMIT, and ends at a
ROLLBACK of the transaction that declared it. The gate reports what the
client's connection said (``command_complete``, ``error``, ``ready``).
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field, replace

from ..plan.refusals import Reject
from ..route.decision import CloseCursor, Decision, DeclareCursor, FetchCursor
from ..wire import protocol as pg
from ..wire.results import (
    BINARY,
    TEXT,
    Column,
    FormatError,
    Result,
    check_formats,
    result_formats,
)
from .limits import DEFAULT_LIMITS, MemoryLimits, size_text

MAX_CURSOR_ROWS = 100_000  # rows one cursor the proxy holds may keep
FOLLOWED = b"EZ"  # message types follow() looks at: ErrorResponse, ReadyForQuery

NO_SCROLL = Reject("55000", "cursor can only scan forward", "Declare it with SCROLL option to enable backward scan.")
ABORTED = Reject("25P02", "current transaction is aborted, commands ignored until end of transaction block",
                 "End the transaction with ROLLBACK (or roll back to a savepoint) first.")


@dataclass(frozen=True)
class Position:
    """A portal's position: rows read so far (``pos``), before the first row, past the last."""

    pos: int = 0
    at_start: bool = True
    at_end: bool = False


class NoScroll(Exception):
    """A backward move on a cursor declared without SCROLL."""


@dataclass
class Cursor:
    result: Result | None  # None: a cursor on the client's own connection, known here by name only
    binary: bool = False
    scroll: bool = False
    hold: bool = False
    committed: bool = False  # WITH HOLD and its transaction committed: a later ROLLBACK does not end it
    position: Position = field(default_factory=Position)
    size: int = 0  # bytes of its rows (rows_size)


def too_many_rows(count: int) -> Reject:
    return Reject("54000", f"the cursor's query returned {count} rows; anonproxy holds at most {MAX_CURSOR_ROWS} "
                           "rows per cursor", "Group by fewer or coarser keys, or send the query without a cursor.")


def row_size(values: tuple[bytes | None, ...]) -> int:
    """Bytes of a row as a DataRow carries it (the body): the count, then each value's length and bytes."""
    return 2 + sum(4 + len(value or b"") for value in values)


class Cursors:
    """The cursors of one gated session, by name."""

    def __init__(self, limits: MemoryLimits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._cursors: dict[str, Cursor] = {}
        self._declaring: list[DeclareCursor] = []  # passed DECLAREs awaiting PostgreSQL's "DECLARE CURSOR"
        self._rolled_back = False  # a ROLLBACK was answered since the last ReadyForQuery
        self._failed = False  # an error was answered since the last ReadyForQuery

    def held(self, name: str | None) -> bool:
        """Whether the proxy answers for cursor ``name`` (CLOSE ALL: whether it holds any)."""
        if name is None:
            return any(cursor.result is not None for cursor in self._cursors.values())
        cursor = self._cursors.get(name)
        return cursor is not None and cursor.result is not None

    def can_declare(self, name: str, hold: bool, status: bytes, block: bool) -> Reject | None:
        """PostgreSQL's checks on DECLARE (``block``: the statement runs in a transaction block, explicit or the
        implicit one of a message of several statements)."""
        if status == b"E":
            return ABORTED
        if name in self._cursors:
            return Reject("42P03", f'cursor "{name}" already exists', "CLOSE it first, or choose another name.")
        if not hold and status == b"I" and not block:
            return Reject("25P01", "DECLARE CURSOR can only be used in transaction blocks",
                          "Declare it after BEGIN, or declare it WITH HOLD.")
        held = sum(cursor.result is not None for cursor in self._cursors.values())
        if held >= self._limits.cursors:
            return Reject("54000", f"too many cursors: anonproxy holds at most {self._limits.cursors} cursors per "
                                   "session", "Close the cursors you no longer need (CLOSE name); the limit is the "
                                              "proxy's max_session_cursors setting.")
        return None

    def capture(self, declare: DeclareCursor) -> Capture:
        """What keeps the service connection's answer to ``declare``'s query, up to the room the limits leave."""
        return Capture(declare, self, min(self._limits.cursor_size, self._limits.session_cursor_size - self._size()))

    def too_big(self, count: int, size: int) -> Reject | None:
        """Why an answer of ``count`` rows and ``size`` bytes cannot be held as a new cursor (None: it can)."""
        if count > MAX_CURSOR_ROWS:
            return too_many_rows(count)
        if size > self._limits.cursor_size:
            return Reject("54000", f"the cursor's query returned {size_text(size)} of rows; anonproxy holds at most "
                                   f"{size_text(self._limits.cursor_size)} per cursor",
                          "Group by fewer or coarser keys, or send the query without a cursor; the limit is the "
                          "proxy's max_cursor_size setting.")
        held = self._size()
        if held + size > self._limits.session_cursor_size:
            return Reject("54000", f"the cursor's query returned {size_text(size)} of rows and this session's cursors "
                                   f"hold {size_text(held)}; anonproxy holds at most "
                                   f"{size_text(self._limits.session_cursor_size)} of cursors per session",
                          "Close the cursors you no longer need (CLOSE name); the limit is the proxy's "
                          "max_session_cursor_size setting.")
        return None

    def _size(self) -> int:
        return sum(cursor.size for cursor in self._cursors.values())

    def declare(self, declare: DeclareCursor, result: Result, committed: bool) -> bytes:
        """Keep a gated cursor's rows; its answer (or an error, over a limit). ``committed``: declared in a
        transaction of its own (a single statement outside a transaction block), which has committed."""
        size = sum(map(row_size, result.rows))
        reject = self.too_big(len(result.rows), size)
        if reject is not None:
            return pg.error_response(reject.sqlstate, reject.message, hint=reject.hint)
        self._cursors[declare.name] = Cursor(result, declare.binary, declare.scroll, declare.hold,
                                             committed=declare.hold and committed, size=size)
        return pg.command_complete("DECLARE CURSOR") + result.notices

    def passing(self, declare: DeclareCursor) -> None:
        """A DECLARE sent to the client's connection: its name counts once PostgreSQL confirms it."""
        self._declaring.append(declare)

    def fetch(self, command: FetchCursor, formats: tuple[int, ...] | None, status: bytes,
              describe: bool) -> bytes | Reject:
        """FETCH / MOVE of a held cursor: (RowDescription,) DataRows and CommandComplete. ``formats``: the Bind's
        result-format codes (None: the simple protocol, text unless DECLARE BINARY)."""
        if status == b"E":
            return ABORTED
        cursor = self._cursors[command.name]
        result = cursor.result
        assert result is not None
        try:
            position, indices, count = run(command, len(result.rows), cursor.scroll, cursor.position)
        except NoScroll:
            return NO_SCROLL
        cursor.position = position
        if command.move:
            return pg.command_complete(f"MOVE {count}")
        try:
            codes = (BINARY if cursor.binary else TEXT,) * len(result.columns) if formats is None \
                else result_formats(formats, len(result.columns))
            check_formats(result, codes)
            rows = Result(result.columns, tuple(result.rows[i] for i in indices)).data_rows(codes)
        except FormatError as exc:
            return Reject(exc.sqlstate, str(exc))
        head = result.description(codes) if describe else b""
        return head + rows + pg.command_complete(f"FETCH {count}")

    def describe(self, name: str) -> bytes:
        """RowDescription of a held cursor, for a Describe of the portal of its name (an SQL cursor is a portal)."""
        cursor = self._cursors[name]
        assert cursor.result is not None
        return cursor.result.description((BINARY if cursor.binary else TEXT,) * len(cursor.result.columns))

    def columns(self, name: str) -> tuple[Column, ...]:
        result = self._cursors[name].result
        assert result is not None
        return result.columns

    def close(self, command: CloseCursor, status: bytes) -> bytes | Reject:
        """CLOSE of a held cursor, or CLOSE ALL (which the gate also sends on to the client's connection)."""
        if status == b"E":
            return ABORTED
        if command.name is None:
            self._cursors.clear()
        else:
            del self._cursors[command.name]
        return pg.command_complete("CLOSE CURSOR")

    # -- what the client's connection said ----------------------------------------------------------

    def command_complete(self, tag: str) -> None:
        if tag == "DECLARE CURSOR" and self._declaring:
            declare = self._declaring.pop(0)
            self._cursors.setdefault(declare.name, Cursor(None, hold=declare.hold))
        elif tag == "COMMIT":
            self._end_transaction(committed=True)
        elif tag == "ROLLBACK":  # a ROLLBACK TO SAVEPOINT too: told apart by the status that follows
            self._rolled_back = True
        elif tag in ("DISCARD ALL", "CLOSE CURSOR ALL"):
            self._cursors.clear()

    def error(self) -> None:
        self._failed = True
        self._declaring.clear()  # PostgreSQL skips the rest of the message

    def ready(self, status: bytes) -> None:
        """ReadyForQuery reached the client: outside a transaction block, the transaction (explicit, or the
        implicit one of the message) has ended — rolled back if a ROLLBACK or an error came, else committed."""
        if status == b"I":
            self._end_transaction(committed=not (self._rolled_back or self._failed))
        self._rolled_back = self._failed = False
        self._declaring.clear()

    def _end_transaction(self, committed: bool) -> None:
        for name, cursor in list(self._cursors.items()):
            if cursor.hold and (committed or cursor.committed):
                cursor.committed = True
            else:
                del self._cursors[name]


# -- what the gate streams ------------------------------------------------------------------------------------


@dataclass
class Capture:
    """The service connection's answer to a gated DECLARE's query, kept for the cursor instead of sent: rows are
    kept up to ``room`` bytes (and MAX_CURSOR_ROWS); past either, only counted, for the error to say how many."""

    declare: DeclareCursor
    cursors: Cursors
    room: int
    columns: tuple[Column, ...] = ()
    rows: list[tuple[bytes | None, ...]] = field(default_factory=list)
    count: int = 0
    size: int = 0
    notices: list[bytes] = field(default_factory=list)

    def feed(self, type_: bytes, body: bytes) -> Result | bytes | None:
        """One message of the answer: None while it goes on, then the Result, or an error for the client."""
        if type_ == b"T":
            self.columns = tuple(map(Column.of, pg.parse_row_fields(body)))  # all PostgreSQL said of them
        elif type_ == b"D":
            self.count += 1
            self.size += len(body)
            if self.count <= MAX_CURSOR_ROWS and self.size <= self.room:
                self.rows.append(pg.parse_data_row(body))
            else:
                self.rows.clear()  # the cursor will not be made: keep nothing more
        elif type_ == b"N":
            self.notices.append(pg.message(type_, body))
        elif type_ == b"E":
            return pg.message(type_, body)
        elif type_ == b"C":
            reject = self.cursors.too_big(self.count, self.size)
            if reject is not None:
                return pg.error_response(reject.sqlstate, reject.message, hint=reject.hint)
            return Result(self.columns, tuple(self.rows), notices=b"".join(self.notices))
        return None  # ParseComplete, BindComplete of the extended protocol: not for the client


@dataclass
class ScriptRun:
    """A message of several statements run one by one (a Script): the parts still to route, the ReadyForQuery still
    to come (the client sees the last one only), and whether a part failed (then the rest is skipped, as PostgreSQL
    does, and that part's ReadyForQuery is the message's)."""

    parts: deque[tuple[str, Decision]]
    answers: int
    failed: bool = False


def follow(data: bytes, followed: list[int], cursors: Cursors, script: ScriptRun | None) -> tuple[bytes, bool]:
    """Whole messages on their way to the client: errors and ReadyForQuery tell the cursors' life time and a Script's
    progress. ``followed``: the offsets of those messages in ``data`` (``framing.offsets`` of FOLLOWED). Returns what
    the client gets (a part's ReadyForQuery dropped) and whether the Script is over."""
    start = 0
    kept: list[bytes] = []
    over = False
    for offset in followed:
        end = offset + 6  # of a ReadyForQuery: type, length, status
        if data[offset:offset + 1] == b"E":
            cursors.error()
            if script is not None:
                script.failed = True
        elif script is not None and not over and script.answers > 1 and not script.failed:
            script.answers -= 1
            kept.append(data[start:offset])
            start = end
        else:
            over = script is not None
            cursors.ready(data[offset + 5:end])
    if start:
        kept.append(data[start:])
        data = b"".join(kept)
    return data, over


def unnamed_bind(bind: pg.Bind) -> bytes:
    """The body of a Bind of the unnamed statement to the unnamed portal with ``bind``'s values, results in text."""
    values = b"".join(struct.pack("!i", -1) if value is None else struct.pack("!i", len(value)) + value
                      for value in bind.values)
    return (b"\0\0" + struct.pack(f"!h{len(bind.parameter_formats)}h", len(bind.parameter_formats),
                                   *bind.parameter_formats)
            + struct.pack("!h", len(bind.values)) + values + struct.pack("!h", 0))


# -- PostgreSQL's portal arithmetic over a materialised result ---------------------------------------------


def run(command: FetchCursor, size: int, scroll: bool, position: Position) -> tuple[Position, list[int], int]:
    """FETCH / MOVE on ``size`` rows from ``position``: the new position, the indices of the rows returned (in
    order) and the count of the command tag. Raises NoScroll as PostgreSQL raises 55000."""
    direction, count = command.direction, command.count
    p = position
    if direction == "forward" and count is not None and count < 0:
        direction, count = "backward", -count
    elif direction == "backward" and count is not None and count < 0:
        direction, count = "forward", -count
    elif direction == "absolute":
        assert count is not None
        if count > 0:
            if count - 1 <= p.pos // 2:
                p = _rewind(p, scroll)
                if count > 1:
                    p, _ = _select(p, True, count - 1, size, scroll)
            else:
                pos = p.pos + 1 if p.at_end else p.pos  # one extra step back when past the end
                if count <= pos:
                    p, _ = _select(p, False, pos - count + 1, size, scroll)
                elif count > pos + 1:
                    p, _ = _select(p, True, count - pos - 1, size, scroll)
            p, rows = _select(p, True, 1, size, scroll)
            return p, rows, len(rows)
        if count < 0:
            p, _ = _select(p, True, None, size, scroll)
            if count < -1:
                p, _ = _select(p, False, -count - 1, size, scroll)
            p, rows = _select(p, False, 1, size, scroll)
            return p, rows, len(rows)
        p = _rewind(p, scroll)
        return p, [], 0
    elif direction == "relative":
        assert count is not None
        if count > 0:
            if count > 1:
                p, _ = _select(p, True, count - 1, size, scroll)
            p, rows = _select(p, True, 1, size, scroll)
            return p, rows, len(rows)
        if count < 0:
            if count < -1:
                p, _ = _select(p, False, -count - 1, size, scroll)
            p, rows = _select(p, False, 1, size, scroll)
            return p, rows, len(rows)
        direction = "forward"  # RELATIVE 0 is FORWARD 0
    forward = direction == "forward"
    if count == 0:  # the current row again, if on one
        on_row = not p.at_start and not p.at_end
        if command.move:
            return p, [], int(on_row)
        if on_row:
            p, _ = _select(p, False, 1, size, scroll)
            count, forward = 1, True
    if not forward and count is None and command.move:  # MOVE BACKWARD ALL is a rewind
        moved = p.pos - 1 if p.pos > 0 and not p.at_end else p.pos
        return _rewind(p, scroll), [], moved
    p, rows = _select(p, forward, count, size, scroll)
    return p, rows, len(rows)


def _select(p: Position, forward: bool, count: int | None, size: int,
            scroll: bool) -> tuple[Position, list[int]]:
    """PortalRunSelect: up to ``count`` rows (None: all) forward or backward from ``p``."""
    if forward:
        if p.at_end or (count is not None and count <= 0):
            return p, []
        stop = size if count is None else min(size, p.pos + count)
        rows = list(range(p.pos, stop))
        at_end = count is None or len(rows) < count
        return Position(p.pos + len(rows), p.at_start and not rows, at_end), rows
    if not scroll:
        raise NoScroll
    if p.at_start or (count is not None and count <= 0):
        return p, []
    first = p.pos - 1 if p.at_end else p.pos - 2  # past the end, the last row read comes back first
    stop = -1 if count is None else max(-1, first - count)
    rows = list(range(first, stop, -1))
    pos, at_end = p.pos, p.at_end
    if rows and at_end:
        pos, at_end = pos + 1, False
    if count is None or len(rows) < count:
        return Position(0, True, at_end), rows
    return replace(p, pos=pos - len(rows), at_end=at_end), rows


def _rewind(p: Position, scroll: bool) -> Position:
    if p.at_start and not p.at_end:
        return p
    if not scroll:
        raise NoScroll
    return Position()
