"""The service connection as the gate uses it: whether one is held, the statements prepared on it, the settings it
must follow, and how many batch messages PostgreSQL has yet to answer there.

Service connections are borrowed from the worker's pool and never run the client's transaction (rewritten
statements run one by one, autocommit). On each connection borrowed, the gate first clears what another session
may have left (``RESET ALL``, which keeps the connection's startup settings; a Close of each statement it prepared
for its client), then applies the session's output settings and statement_timeout
(:meth:`ServiceSide.settings_query`, whose answers the client never sees). A client's prepared statement is
prepared there from the rewrite the gate keeps, just before the first message that uses it, and again on each
connection borrowed later (:meth:`ServiceSide.prepare_first`). The rewrite of a simple Query runs as the
connection's own prepared statement of that text, kept across sessions (service_statements.py); the client sees
the answer of a Query. Where PostgreSQL refuses to reuse it because its result type changed (DDL; 0A000 "cached
plan must not change result type"), the rewrite runs again as a plain Query, whose answer the client gets.

No I/O: the gate sends what these methods return.
"""

from __future__ import annotations

from ..route.decision import Rewrite
from ..wire import protocol as pg
from .gate_routes import Owner, Route, message_types
from .prepared import Prepared
from .service_statements import ServiceStatements, close_statement, name_of

# Batch messages the server answers (Parse, Bind, Describe, Execute, Close), once the batch is flushed or synced.
_REQUESTS = (b"P", b"B", b"D", b"E", b"C")

# The answer that completes each of those messages (ParseComplete, BindComplete, a Describe's RowDescription or
# NoData, an Execute's CommandComplete, PortalSuspended or EmptyQueryResponse, CloseComplete).
_LAST_ANSWERS = (b"1", b"2", b"T", b"n", b"C", b"s", b"I", b"3")


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class ServiceSide:
    def __init__(self, borrowed: bool, output_settings: dict[str, str]) -> None:
        self.borrowed = borrowed  # from the worker's pool (else the session's own connection, always there)
        self.held = not borrowed
        self.acquiring = False
        self._reset = False  # a borrowed connection: clear what another session left first
        self._on = ServiceStatements()  # the named statements on the connection held
        self._left: set[bytes] = set()  # the statements another session prepared there for its client
        self._running: str | None = None  # the SQL of the Query run as a prepared statement, until its ReadyForQuery
        self._running_name = b""  # the name of that statement
        self._bound = False  # its Bind was answered: the client may have seen its answer's first messages
        self._retry = False  # PostgreSQL would not reuse its plan: run it as a plain Query after the ReadyForQuery
        # The session's output settings (DateStyle…), all applied on each connection borrowed, and those the
        # client changed since they were last applied.
        self.output_settings = dict(output_settings)
        self._to_copy: dict[str, str] = {}
        self._timeout: int | None = None  # the statement_timeout last set on the connection
        self.silenced = 0  # our own SET queries, whose answers are dropped
        self.awaiting = 0  # batch messages sent and not yet answered
        self.flushed = False  # a Flush followed them: the server sends their answers without a Sync
        self.skipping = False  # an error answered the batch: PostgreSQL ignores what comes, up to a Sync

    def acquired(self, statements: ServiceStatements) -> None:
        """A connection was borrowed (``statements``: the named statements on it): nothing of the session is on it
        yet."""
        self.acquiring = False
        self.held = True
        self._reset = True
        self.skipping = False
        self._on = statements
        self._left = set(statements.clients)
        statements.clients.clear()
        self._running = None
        self._to_copy = dict(self.output_settings)
        self._timeout = None

    def follow(self, name: str, value: str) -> None:
        """The client's session now has ``name`` = ``value``, a setting that shapes output: follow it."""
        self._to_copy[name] = self.output_settings[name] = value

    def follow_timeout(self, milliseconds: int) -> None:
        if milliseconds != self._timeout:
            self._to_copy["statement_timeout"] = f"{milliseconds}ms"
            self._timeout = milliseconds

    def settings_query(self) -> bytes:
        """Our own Query that applies what changed (b"": nothing did), its answers to drop. On a borrowed connection,
        what the previous session left goes first: its settings (back to the connection's own: read-only, the
        pinned search_path) and the statements it prepared for its client (Closed: no error where one is gone). The
        proxy's own statements stay."""
        if not self._to_copy and not self._reset:
            return b""
        closes = b"".join(close_statement(name) for name in sorted(self._left))
        statements = "RESET ALL;" if self._reset else ""
        statements += "".join(f"SET {name} TO {_literal(value)};" for name, value in self._to_copy.items())
        self._to_copy.clear()
        self._left.clear()
        self._reset = False
        self.silenced += 1
        return closes + pg.query_message(statements)

    def prepare_first(self, route: Route, prepared: Prepared, alone: bool) -> tuple[bytes, tuple[bytes, ...]]:
        """What goes to the connection for ``route``, and the answers to hide: the statement it uses, prepared first
        if it is not there yet (a named one closed before, in case an older rewrite of it is there). A rewritten
        Query runs as the connection's prepared statement of its text when it goes ``alone`` (no other answer of
        the session's is to come there first, no batch of the client's is open there); else as a plain Query."""
        if route.query is not None and alone:
            self._running, self._bound, self._retry = route.query, False, False
            self._running_name = name_of(route.query, self.output_settings)  # the settings the connection has
            return self._on.run(route.query, self._running_name)
        payload, hidden = route.payload, route.hidden
        name = route.uses
        if name is not None and name not in self._on.clients and prepared.statements.get(name) is Owner.SERVICE:
            kept = prepared.texts[name]
            assert isinstance(kept.decision, Rewrite)
            payload = pg.parse_message(name, kept.decision.runs, kept.rest) + payload
            hidden = (b"1",) + hidden
            if name:
                payload = close_statement(name) + payload
                hidden = (b"3",) + hidden
                self._on.forget(name)
            self._on.clients.add(name)
        if route.closes is not None:
            self._on.clients.discard(route.closes)
            self._on.forget(route.closes)
        return payload, hidden

    @property
    def running(self) -> bool:
        """Whether a Query run as a prepared statement is not answered yet."""
        return self._running is not None

    def has(self, name: bytes) -> bool:
        """Whether statement ``name`` is prepared on the connection held."""
        return name in self._on.clients

    def forget(self, name: bytes) -> None:
        """Statement ``name`` is prepared anew (or closed): not on the connection any more, as far as it matters."""
        self._on.clients.discard(name)

    def replan(self, type_: bytes, body: bytes) -> bytes | None:
        """Follow the answer of a Query run as a prepared statement. None: the message goes on; b"": it is dropped;
        a Query message: dropped, and that is sent in its place. PostgreSQL's refusal to reuse the statement's plan
        because its result type changed (0A000, at Bind: nothing of the answer was sent yet) and its
        ReadyForQuery are dropped, and the rewrite runs as a plain Query, as it did before it was prepared."""
        if self._running is None:
            return None
        if type_ == b"2":
            self._bound = True
        elif type_ == b"E":
            self._on.failed(self._running_name)
            if pg.parse_fields(body).get("C") == "0A000" and not self._bound:
                self._retry = True
                return b""
        elif type_ == b"Z":
            sql, self._running = self._running, None
            if self._retry:
                self._retry = False
                return pg.query_message(sql)
        return None

    def sent(self, payload: bytes) -> None:
        """Follow what PostgreSQL owes for ``payload``, sent to the connection."""
        types = message_types(payload)
        requests = sum(type_ in _REQUESTS for type_ in types)
        self.awaiting += requests
        self.flushed = types[-1:] == [b"H"] or (self.flushed and not requests)

    def answered(self, type_: bytes) -> None:
        """Follow a message of the connection's answers."""
        if type_ in _LAST_ANSWERS:
            self.awaiting = max(0, self.awaiting - 1)
        elif type_ in (b"E", b"Z"):
            self.awaiting = 0  # after an error the server skips the rest, up to Sync
            self.skipping = type_ == b"E"

    def answering(self) -> bool:
        """Whether PostgreSQL owes answers it sends without waiting for the client (they were flushed)."""
        return bool(self.awaiting) and self.flushed
