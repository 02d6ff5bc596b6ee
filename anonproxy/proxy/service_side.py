"""The service connection as the gate uses it: whether one is held, the statements prepared on it, the settings it
must follow, and how many batch messages PostgreSQL has yet to answer there.

Service connections are borrowed from the worker's pool and never run the client's transaction (rewritten
statements run one by one, autocommit). On each connection borrowed, the gate first clears what another session
may have left (``RESET ALL``, which keeps the connection's startup settings; ``DEALLOCATE ALL``), then applies the
session's output settings and statement_timeout (:meth:`ServiceSide.settings_query`, whose answers the client
never sees). A rewritten statement is prepared there from the rewrite the gate keeps, just before the first
message that uses it, and again on each connection borrowed later (:meth:`ServiceSide.prepare_first`).

No I/O: the gate sends what these methods return.
"""

from __future__ import annotations

from ..route.decision import Rewrite
from ..wire import protocol as pg
from .gate_routes import Owner, Route, message_types
from .prepared import Prepared

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
        self._statements: set[bytes] = set()  # statements prepared on the connection held
        # The session's output settings (DateStyle…), all applied on each connection borrowed, and those the
        # client changed since they were last applied.
        self.output_settings = dict(output_settings)
        self._to_copy: dict[str, str] = {}
        self._timeout: int | None = None  # the statement_timeout last set on the connection
        self.silenced = 0  # our own SET queries, whose answers are dropped
        self.awaiting = 0  # batch messages sent and not yet answered
        self.flushed = False  # a Flush followed them: the server sends their answers without a Sync
        self.describing = False  # a Describe the gate closed with a Sync of its own is being answered
        self.skipping = False  # an error answered the batch: PostgreSQL ignores what comes, up to a Sync

    def acquired(self) -> None:
        """A connection was borrowed: nothing of the session is on it yet."""
        self.acquiring = False
        self.held = True
        self._reset = True
        self.skipping = False
        self._statements.clear()
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
        pinned search_path) and its prepared statements."""
        if not self._to_copy and not self._reset:
            return b""
        statements = "RESET ALL;DEALLOCATE ALL;" if self._reset else ""
        statements += "".join(f"SET {name} TO {_literal(value)};" for name, value in self._to_copy.items())
        self._to_copy.clear()
        self._reset = False
        self.silenced += 1
        return pg.query_message(statements)

    def prepare_first(self, route: Route, prepared: Prepared) -> tuple[bytes, tuple[bytes, ...]]:
        """What goes to the connection for ``route``, and the answers to hide: the statement it uses, prepared first
        if it is not there yet (a named one closed before, in case an older rewrite of it is there)."""
        payload, hidden = route.payload, route.hidden
        name = route.uses
        if name is not None and name not in self._statements and prepared.statements.get(name) is Owner.SERVICE:
            kept = prepared.texts[name]
            assert isinstance(kept.decision, Rewrite)
            payload = pg.parse_message(name, kept.decision.runs, kept.rest) + payload
            hidden = (b"1",) + hidden
            if name:
                payload = pg.message(b"C", b"S" + name + b"\0") + payload
                hidden = (b"3",) + hidden
            self._statements.add(name)
        if route.closes is not None:
            self._statements.discard(route.closes)
        return payload, hidden

    def has(self, name: bytes) -> bool:
        """Whether statement ``name`` is prepared on the connection held."""
        return name in self._statements

    def forget(self, name: bytes) -> None:
        """Statement ``name`` is prepared anew (or closed): not on the connection any more, as far as it matters."""
        self._statements.discard(name)

    def sent(self, payload: bytes) -> None:
        """Follow what PostgreSQL owes for ``payload``, sent to the connection."""
        types = message_types(payload)
        requests = sum(type_ in _REQUESTS for type_ in types)
        self.awaiting += requests
        self.flushed = types[-1:] == [b"H"] or (self.flushed and not requests)

    def answered(self, type_: bytes) -> bool:
        """Follow a message of the connection's answers; True: an error answered a Describe that the gate ended
        with a Sync of its own (the rest of the client's batch is then skipped)."""
        if type_ in _LAST_ANSWERS:
            self.awaiting = max(0, self.awaiting - 1)
            return False
        if type_ not in (b"E", b"Z"):
            return False
        self.awaiting = 0  # after an error the server skips the rest, up to Sync
        failed = type_ == b"E" and self.describing
        self.skipping = type_ == b"E"
        if type_ == b"Z":
            self.describing = False
        return failed

    def answering(self) -> bool:
        """Whether PostgreSQL owes answers it sends without waiting for the client (they were flushed)."""
        return bool(self.awaiting) and self.flushed
