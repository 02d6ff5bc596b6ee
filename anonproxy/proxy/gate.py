"""The gate of a session whose role is in an anonymized mode.

Each client message is routed to one of three owners:

* UPSTREAM — the client's own connection, for statements the rewriter lets
  pass (catalog queries, session settings…); the client's role has no
  privilege on protected tables, so PostgreSQL itself refuses what slips by;
* SERVICE — the proxy's service connection, for rewritten aggregate queries;
* LOCAL — answered by the proxy: refusals and ``SHOW anonproxy.*``;
* PROXY — answered by the proxy after asynchronous work (differentially
  private answers, ``SHOW anonproxy.budget``): the gate asks with
  ``ask_proxy(decision)`` and the session replies with ``proxy_answered``.

Extended-protocol messages follow their statement or portal. Responses reach
the client in the order of the requests: a message for another owner waits
until the owners with requests in flight have answered (ReadyForQuery).
When one batch (messages up to Sync) mixes owners, the proxy closes the
first owner's part with a Sync of its own and swallows its ReadyForQuery.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..rewrite.decision import Decision, Intercept, Noisy, Pass, Reject, Rewrite
from ..wire import protocol as pg
from ..wire.framing import MessageBuffer

SYNC = pg.message(b"S")
# Settings the server reports (ParameterStatus) that change how values print.
FOLLOWED_SETTINGS = ("DateStyle", "TimeZone", "IntervalStyle", "client_encoding")


class Owner(enum.Enum):
    UPSTREAM = enum.auto()
    SERVICE = enum.auto()
    LOCAL = enum.auto()
    PROXY = enum.auto()


@dataclass(frozen=True)
class Route:
    owner: Owner
    payload: bytes
    ends_batch: bool = False  # the owner will answer with ReadyForQuery
    in_batch: bool = True  # part of an extended-protocol batch (COPY data is not)
    request: Decision | None = None  # what a PROXY route asks the session to answer


class Gate:
    def __init__(
        self,
        decide: Callable[[str], Decision],
        settings: Callable[[], dict[str, str]],
        write_client: Callable[[bytes], None],
        send_upstream: Callable[[bytes], None],
        send_service: Callable[[bytes], None],
        ask_proxy: Callable[[Decision], None],
    ) -> None:
        self._decide = decide
        self._settings = settings
        self._write_client = write_client
        self._send = {Owner.UPSTREAM: send_upstream, Owner.SERVICE: send_service}
        self._ask_proxy = ask_proxy
        self._client_messages = MessageBuffer()
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._held: Route | None = None
        self._unsynced: Owner | None = None  # owner of batch messages sent since the last Sync
        self.in_flight = {Owner.UPSTREAM: 0, Owner.SERVICE: 0, Owner.PROXY: 0}  # requests awaiting ReadyForQuery
        self._swallow = {Owner.UPSTREAM: 0, Owner.SERVICE: 0}  # ReadyForQuery of our own Syncs
        self._statements: dict[bytes, Owner] = {}
        self._portals: dict[bytes, Owner] = {}
        # Settings shown by the statements and portals the proxy owns (SHOW anonproxy.*).
        self._statement_settings: dict[bytes, str] = {}
        self._portal_settings: dict[bytes, str] = {}
        self._skipping = False  # after a refusal, the rest of the batch is ignored, as PostgreSQL does
        self.transaction_status = b"I"
        # Output-shaping settings the client changed, to repeat on the service connection.
        self._settings_to_copy: dict[str, str] = {}
        self._silenced = 0  # our own SET queries whose answers are dropped

    # -- input ------------------------------------------------------------------

    def client_data(self, data: bytes) -> None:
        self._queue.extend(self._client_messages.feed(data))
        self._pump()

    def upstream_message(self, type_: bytes, body: bytes) -> None:
        if type_ == b"Z":
            self.transaction_status = body
            self._ready_for_query(Owner.UPSTREAM, body)
            return
        if type_ == b"S":
            name, offset = pg.read_cstring(body)
            if name.decode() in FOLLOWED_SETTINGS:
                self._settings_to_copy[name.decode()] = pg.read_cstring(body, offset)[0].decode()
        self._write_client(pg.message(type_, body))

    def service_message(self, type_: bytes, body: bytes) -> None:
        if self._silenced:
            # The answer to our own SET: not for the client.
            if type_ == b"Z":
                self._silenced -= 1
                self.in_flight[Owner.SERVICE] -= 1
                self._pump()
        elif type_ == b"Z":
            # The client's transaction is the one on its own connection.
            self._ready_for_query(Owner.SERVICE, self.transaction_status)
        elif type_ != b"S":  # the service session's settings are not the client's
            self._write_client(pg.message(type_, body))

    def proxy_answered(self, answer: bytes) -> None:
        """The session's reply to ``ask_proxy``: the messages of one simple query, ReadyForQuery excluded."""
        self._write_client(answer + pg.ready_for_query(self.transaction_status))
        self.in_flight[Owner.PROXY] -= 1
        self._pump()

    def _ready_for_query(self, owner: Owner, status: bytes) -> None:
        self.in_flight[owner] -= 1
        if self._swallow[owner]:
            self._swallow[owner] -= 1  # it answers a Sync of ours
        else:
            self._write_client(pg.ready_for_query(status))
        self._pump()

    # -- dispatch -----------------------------------------------------------------

    def _pump(self) -> None:
        while self._held is not None or self._queue:
            if self._held is None:
                self._held = self._route(*self._queue.popleft())
                if self._held is None:
                    continue
            route = self._held
            if route.in_batch and self._unsynced not in (None, route.owner):
                self._close_batch_part(self._unsynced)
            if any(count for owner, count in self.in_flight.items() if owner is not route.owner):
                return  # wait for the other owner's ReadyForQuery
            self._held = None
            if route.owner is Owner.LOCAL:
                self._write_client(route.payload)
                continue
            if route.owner is Owner.PROXY:
                assert route.request is not None
                self.in_flight[Owner.PROXY] += 1
                self._unsynced = None
                self._ask_proxy(route.request)
                continue
            if route.owner is Owner.SERVICE and self._settings_to_copy:
                self._copy_settings()
            if route.payload:
                self._send[route.owner](route.payload)
            if route.ends_batch:
                self.in_flight[route.owner] += 1
                self._unsynced = None
            elif route.in_batch:
                self._unsynced = route.owner

    def _copy_settings(self) -> None:
        """The client changed a setting that shapes output (SET DateStyle…): follow it on the service side."""
        statements = "".join(f"SET {name} TO {_literal(value)};" for name, value in self._settings_to_copy.items())
        self._settings_to_copy.clear()
        self._send[Owner.SERVICE](pg.query_message(statements))
        self.in_flight[Owner.SERVICE] += 1
        self._silenced += 1

    def _close_batch_part(self, owner: Owner) -> None:
        self._send[owner](SYNC)
        self.in_flight[owner] += 1
        self._swallow[owner] += 1
        self._unsynced = None

    def _route(self, type_: bytes, body: bytes) -> Route | None:
        raw = pg.message(type_, body)
        if type_ == b"S":
            self._skipping = False
            if self._unsynced is not None:
                return Route(self._unsynced, raw, ends_batch=True)
            return Route(Owner.LOCAL, pg.ready_for_query(self.transaction_status))
        if self._skipping and type_ in b"PBDECH":
            return None
        if type_ == b"Q":
            return self._route_query(raw, body[:-1].decode("utf-8", "replace"))
        if type_ == b"P":
            return self._route_parse(raw, body)
        if type_ == b"B":
            portal, offset = pg.read_cstring(body)
            statement, _ = pg.read_cstring(body, offset)
            owner = self._portals[portal] = self._statements.get(statement, Owner.UPSTREAM)
            if owner is not Owner.LOCAL:
                return Route(owner, raw)
            self._portal_settings[portal] = self._statement_settings[statement]
            return Route(Owner.LOCAL, pg.message(b"2"))  # BindComplete
        if type_ == b"D" or type_ == b"C" or type_ == b"E":
            return self._route_by_name(type_, body, raw)
        if type_ == b"H":
            return Route(self._unsynced or Owner.LOCAL, raw if self._unsynced else b"")
        if type_ == b"F":
            return self._refuse(Reject("42501", "function calls by the fast-path protocol are not allowed",
                                       "Call functions in a SELECT statement."), simple=True)
        # COPY data, Terminate, and anything else: the client's own connection (and its checks).
        return Route(Owner.UPSTREAM, raw, in_batch=False)

    def _route_query(self, raw: bytes, sql: str) -> Route:
        decision = self._decide(sql)
        if isinstance(decision, Pass):
            return Route(Owner.UPSTREAM, raw, ends_batch=True)
        if isinstance(decision, Rewrite):
            if self.transaction_status == b"E":
                return self._refuse(_ABORTED, simple=True)
            return Route(Owner.SERVICE, pg.query_message(decision.sql), ends_batch=True)
        if isinstance(decision, Noisy) or decision == BUDGET:
            if self.transaction_status == b"E":
                return self._refuse(_ABORTED, simple=True)
            return Route(Owner.PROXY, b"", ends_batch=True, request=decision)
        if isinstance(decision, Intercept):
            answer = self._show(decision.setting)
            if isinstance(answer, Reject):
                return self._refuse(answer, simple=True)
            return Route(Owner.LOCAL, b"".join(answer) + pg.ready_for_query(self.transaction_status))
        return self._refuse(decision, simple=True)

    def _route_parse(self, raw: bytes, body: bytes) -> Route:
        name, offset = pg.read_cstring(body)
        sql, offset = pg.read_cstring(body, offset)
        decision = self._decide(sql.decode("utf-8", "replace"))
        self._statement_settings.pop(name, None)
        if isinstance(decision, Pass):
            self._statements[name] = Owner.UPSTREAM
            return Route(Owner.UPSTREAM, raw)
        if isinstance(decision, Rewrite):
            if self.transaction_status == b"E":
                return self._refuse(_ABORTED)
            self._statements[name] = Owner.SERVICE
            return Route(Owner.SERVICE, pg.parse_message(name, decision.sql, body[offset:]))
        if isinstance(decision, Noisy) or decision == BUDGET:
            return self._refuse(_SIMPLE_ONLY)
        if isinstance(decision, Intercept):
            self._statements[name] = Owner.LOCAL
            self._statement_settings[name] = decision.setting
            return Route(Owner.LOCAL, pg.message(b"1"))
        self._statements.pop(name, None)
        return self._refuse(decision)

    def _route_by_name(self, type_: bytes, body: bytes, raw: bytes) -> Route:
        """Describe, Close, Execute: to the owner of the statement or portal they name."""
        if type_ == b"E":
            kind, (name, _) = b"P", pg.read_cstring(body)
        else:
            kind, (name, _) = body[:1], pg.read_cstring(body, 1)
        names, settings = (self._statements, self._statement_settings) if kind == b"S" else \
            (self._portals, self._portal_settings)
        owner = names.get(name, Owner.UPSTREAM)
        if type_ == b"C":
            names.pop(name, None)
        if owner is not Owner.LOCAL:
            return Route(owner, raw)
        if type_ == b"C":
            settings.pop(name, None)
            return Route(Owner.LOCAL, pg.message(b"3"))  # CloseComplete
        answer = self._show(settings[name])
        if isinstance(answer, Reject):
            return self._refuse(answer)
        description, rows = answer
        if type_ == b"E":
            return Route(Owner.LOCAL, rows)
        no_parameters = pg.message(b"t", struct.pack("!h", 0)) if kind == b"S" else b""
        return Route(Owner.LOCAL, no_parameters + description)

    def _show(self, setting: str) -> tuple[bytes, bytes] | Reject:
        """RowDescription, then DataRow + CommandComplete, answering SHOW anonproxy.<setting>."""
        values = self._settings()
        if setting not in values:
            return Reject("42704", f'unrecognized configuration parameter "anonproxy.{setting}"',
                          f"anonproxy settings: {', '.join('anonproxy.' + s for s in sorted(values))}")
        return (pg.row_description([f"anonproxy.{setting}"]),
                pg.data_row([values[setting]]) + pg.command_complete("SHOW"))

    def _refuse(self, reject: Reject, simple: bool = False) -> Route:
        error = pg.error_response(reject.sqlstate, reject.message, hint=reject.hint)
        if simple:
            return Route(Owner.LOCAL, error + pg.ready_for_query(self.transaction_status))
        self._skipping = True
        return Route(Owner.LOCAL, error)


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


BUDGET = Intercept("budget")  # answered from the ledger, asynchronously
_SIMPLE_ONLY = Reject("0A000", "differentially private answers and SHOW anonproxy.budget use the simple query "
                      "protocol for now", "Send the query without parameters (e.g. psql, or a driver's simple mode).")
_ABORTED = Reject("25P02", "current transaction is aborted, commands ignored until end of transaction block")
