"""The gate of a session whose role is in an anonymized mode: it takes the client's messages in, has each routed,
sends the routes on in order, and passes the answers back.

Each client message is routed (routing.py, reading the table of protocol
states of gate_states.py) to one of four owners (gate_routes.Owner):

* UPSTREAM — the client's own connection, for statements the rewriter lets
  pass (catalog queries, session settings…), and for those it relays with
  their privilege probes rewritten (``Relayed``: the rewritten text goes in
  the Query or Parse, with the client's parameter types; Bind, Describe and
  Execute follow unchanged, result formats included); the client's role has
  no privilege on protected tables, so PostgreSQL itself refuses what slips by;
* SERVICE — the proxy's service connection, for rewritten aggregate queries
  (service_side.py);
* LOCAL — answered by the gate: refusals and ``SHOW anonproxy.*``;
* PROXY — answered by the proxy after asynchronous work (the decisions
  anonproxy.route.reports says the proxy answers: differentially private
  answers, ``SHOW anonproxy.budget``, ``SET anonproxy.epsilon``,
  ``EXPLAIN (ANONPROXY)``): the gate asks with ``ask_proxy(ProxyRequest)``
  and the session replies with ``proxy_answered``, one request at a time.

Responses reach the client in the order of the requests: a message for
another owner waits until the owners with requests in flight have answered
(ReadyForQuery). When one batch (messages up to Sync) mixes owners, the
proxy closes the first owner's part with a Sync of its own and swallows its
ReadyForQuery. After an error the rest of the batch is skipped up to Sync,
as PostgreSQL does: also after an error from a part the proxy ended, the
message already routed for the next part being dropped (``_batch_error``).

Every ReadyForQuery the client gets carries the status of its own
connection, where its transaction lives. An error from elsewhere (a
refusal, the service connection, the proxy) inside a transaction block
fails that block there too: the ReadyForQuery is held back, the client's
connection fails its transaction (a Parse that cannot succeed, and a Sync;
its error hidden) and that connection's ReadyForQuery, 'E', goes to the
client (``_transaction_failed``). PostgreSQL then answers 25P02, COMMIT and
ROLLBACK TO SAVEPOINT itself, and the gate keeps no state that could drift
from it.

Statements are decided by the session (``decide``), which may answer "not
yet" (None) while the statement is analysed off the event loop; the gate then
holds that message, and those after it, until ``decided``. A Query or Parse
longer than ``max_statement_size`` is never buffered (BoundedMessageBuffer)
and is refused with 54000; one that is not valid UTF-8 with 22021.

Memory: the named prepared statements a session keeps here are capped
(``limits``, see prepared.py); a Parse over a limit is refused with 54000
and nothing of it is kept. A DEALLOCATE of a statement that does not live
on the client's connection is answered by the router, which forgets it;
once PostgreSQL completes a DEALLOCATE ALL or DISCARD ALL, every statement
kept here is forgotten too (docs/proxy.md, "Deallocating prepared
statements"). The cursors' caps are
cursors.py's. Past QUEUE_LIMIT bytes of client messages waiting here, the
session stops reading from the client (``pause_client``).

Service connections are borrowed: with ``acquire_service``, the gate asks
for one when a message must go to the service side and none is held, and
hands it back (``release_service``) when the service side answered
ReadyForQuery with nothing of the session's left on it (no request in
flight, no open batch part). The client's Parse of a rewritten statement is
answered here (ParseComplete); the statement is prepared on the service
connection just before a message uses it (service_side.py). A Query's
rewrite runs there as the connection's own prepared statement of its text
(service_statements.py); the client gets the answer of a Query.

A rewritten portal executed with a row limit, or in a later batch than its
Bind (its service-side portal ended at a Sync), is run again from its Bind
and run to completion there (proxy_portals.py; not one read to its end in
the batch of its Bind, which the router answers SELECT 0); the gate routes nothing
more until that answer is in (``Keeping``), keeps it, and the router serves
this and later Executes from it until the portal ends (its Close, a new
Bind of its name, a COMMIT, ROLLBACK or ROLLBACK TO SAVEPOINT that ends
PostgreSQL's portal, once routed: prepared.Prepared.transaction_control;
the end of the client's transaction: a ReadyForQuery with status I
reaching the client).

A connection is borrowed only while PostgreSQL works for the client. A
Describe of a statement sent alone (nothing else of the batch queued but
Flush: asyncpg's ``prepare()``) goes with a Sync of the gate's own, so the
connection goes back once it is answered. Another open batch (a portal does
not outlive a Sync) keeps its connection; once PostgreSQL owes no answer
there (all answered, or no Flush was sent), the gate tells the session
(``hold_timer(True)``), whose limits may end the batch
(``service_hold_expired``: a Sync of ours, then the error, and the rest of
the client's batch skipped up to its Sync).

The audit trail: with ``record`` given, a route that runs something for the
client or refuses it carries an ``Execution`` (a Query, each part of a
Script, a Bind with its values, a refused Parse); the gate asks for its row
and holds the route until ``recorded`` (a refusal in its place when the row
could not be written). The proxy's own answers are recorded by the session
when answered, so their requests carry the client's text.

A mode's report on its answers: a notice that a rewritten answer's SQL
raises and that anonproxy.route.reports reads as a report (today,
suppression's INFO on what it withheld) is never forwarded: after the
answer's CommandComplete (or its first PortalSuspended) the client gets the
NOTICE the report writes; an answer that fails says nothing. The gate knows
no mode: that hook is all it asks.

Time: when the session gives a ``time_limit`` (the policy's maximum for the
role's mode), the client's own statement_timeout capped by that limit
(client_timeout.py) is set on the service connection before a rewritten
statement and passed with every request for the proxy (``timeout_ms``), with
the followed settings (``settings``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace

from ..config import MAX_STATEMENT_SIZE
from ..plan.refusals import Reject
from ..route import reports
from ..route.decision import Decision, DeclareCursor
from ..wire import protocol as pg
from ..wire.framing import BoundedMessageBuffer, Piece, Rows, messages, offsets
from ..wire.results import EXPLAIN_COLUMNS, Result
from . import proxy_portals
from .client_timeout import ClientTimeout
from .cursors import FOLLOWED, Capture, Cursors, ScriptRun, follow
from .followed_settings import REPORTED_SETTINGS
from .gate_routes import (
    SYNC,
    WAIT,
    Description,
    Execution,
    Owner,
    Parameters,
    ProxyRequest,
    Reply,
    Route,
    row_count,
)
from .limits import DEFAULT_LIMITS, MemoryLimits
from .prepared import Prepared
from .proxy_portals import Keeping, ProxyPortal, keeping_room
from .routing import Now, Router
from .service_side import ServiceSide
from .service_statements import ServiceStatements

# The gate's public names: session.py, the audit trail, the dp answers and the tests import them from here.
__all__ = ["EXPLAIN_COLUMNS", "Description", "Execution", "Gate", "Owner", "Parameters", "ProxyRequest", "Reply"]

QUEUE_LIMIT = 1 << 20  # bytes of client messages waiting in the gate before the session stops reading
# What fails the client's transaction block on its own connection after an error from elsewhere: a Parse whose text
# is a syntax error (certain to fail, in any transaction state), of a statement of the proxy's name (a Parse of the
# unnamed statement would drop the client's), and a Sync whose ReadyForQuery the client gets.
_FAIL_TRANSACTION = pg.message(b"P", b"anonproxy.failed\0anonproxy failed the client's statement\0\0\0") + SYNC


class Gate:
    def __init__(
        self,
        decide: Callable[[str], Decision | None],
        settings: Callable[[], dict[str, str]],
        write_client: Callable[[bytes], None],
        send_upstream: Callable[[bytes], None],
        send_service: Callable[[bytes], None],
        ask_proxy: Callable[[ProxyRequest], None],
        version: Callable[[], int] = lambda: 0,
        time_limit: Callable[[], int] | None = None,
        max_statement_size: int = MAX_STATEMENT_SIZE,
        pause_client: Callable[[bool], None] = lambda pause: None,
        acquire_service: Callable[[], None] | None = None,
        release_service: Callable[[bool], None] = lambda clean: None,
        service_settings: dict[str, str] | None = None,
        reset_session: Callable[[], None] = lambda: None,
        record: Callable[[Execution], None] | None = None,
        hold_timer: Callable[[bool], None] = lambda start: None,
        limits: MemoryLimits = DEFAULT_LIMITS,
    ) -> None:
        self._client = write_client
        self._send = {Owner.UPSTREAM: send_upstream, Owner.SERVICE: send_service}
        self._ask_proxy = ask_proxy
        self._client_messages = BoundedMessageBuffer({b"Q": max_statement_size, b"P": max_statement_size},
                                                     MAX_STATEMENT_SIZE)
        self._queue: deque[tuple[bytes, bytes | None]] = deque()
        # Messages wait in the queue while others are answered or analysed: past QUEUE_LIMIT bytes, the session
        # stops reading from the client (``pause_client(True)``) until the queue is down to half.
        self._queued = 0
        self._pause_client = pause_client
        self._client_paused = False
        self._waiting = False  # for ``decided``
        self._hidden = {Owner.UPSTREAM: deque[bytes](), Owner.SERVICE: deque[bytes]()}
        self._prepared = Prepared()  # the client's statements and portals, where each belongs
        self._held: Route | None = None
        self._unsynced: Owner | None = None  # owner of batch messages sent since the last Sync
        # The owner of the client's batch's last part that the gate ended with a Sync of its own, until the client's
        # Sync is routed: an error there fails the client's batch (``_batch_error``).
        self._closed_part: Owner | None = None
        self.in_flight = {Owner.UPSTREAM: 0, Owner.SERVICE: 0, Owner.PROXY: 0}  # requests awaiting ReadyForQuery
        self._swallow = {Owner.UPSTREAM: 0, Owner.SERVICE: 0}  # ReadyForQuery of our own Syncs
        self._asking: tuple[str, bytes, int] | None = None  # what the PROXY request in flight is for
        self.transaction_status = b"I"
        self._erred = False  # an error from elsewhere than the client's connection reached the client since its RFQ
        # The client's statement_timeout, when the policy limits the mode's statement time.
        self._timeout = ClientTimeout(time_limit) if time_limit is not None else None
        # The service connection is borrowed from the worker's pool (``acquire_service``; the session answers
        # ``service_acquired`` or ``service_refused``) and handed back (``release_service``) once idle.
        # None: the connection is the session's own, always there.
        self._acquire_service = acquire_service
        self._release_service = release_service
        self._service = ServiceSide(acquire_service is not None, service_settings or {})
        # A borrowed connection held by an open batch (no Sync yet) while PostgreSQL owes no answer there (all
        # answered, or the client did not Flush: the answers wait for its Sync) is waiting for the client:
        # ``hold_timer(True)`` starts the session's hold limits, which end the batch (``service_hold_expired``);
        # ``hold_timer(False)`` stops them.
        self._hold_timer = hold_timer
        self._holding_idle = False
        # Cursors (see cursors.py): those the proxy holds, the gated DECLARE being answered, the message of
        # several statements being run one by one.
        self._cursors = Cursors(limits)
        self._capture: Capture | None = None
        self._declaring: DeclareCursor | None = None
        self._script: ScriptRun | None = None
        self._report: reports.AnswerReport | None = None  # on the rewritten answer the service is sending
        # A rewritten portal executed with a row limit or after a Sync, whose whole answer is being kept.
        self._keeping: Keeping | None = None
        self._limits = limits
        # RESET ALL / DISCARD ALL sent to the client's connection and not yet answered: when PostgreSQL completes
        # one, ``reset_session`` resets what the proxy keeps for the session (an error skips the rest: forgotten).
        self._reset_session = reset_session
        self._resets_expected = 0
        # The audit trail (None: off): a statement runs, or its refusal is sent, once ``recorded`` says its row is
        # written.
        self._record = record
        self._recording = False
        self._router = Router(decide, version, settings, max_statement_size, limits, self._prepared, self._cursors,
                              self._service)
        self._senders: dict[Owner, Callable[[Route], None]] = {
            Owner.LOCAL: lambda route: self._write_client(route.payload), Owner.PROXY: self._send_proxy,
            Owner.UPSTREAM: self._send_connection, Owner.SERVICE: self._send_connection,
        }

    # -- input ------------------------------------------------------------------

    def client_data(self, data: bytes) -> None:
        for message in self._client_messages.feed(data):
            self._queue.append(message)
            self._queued += len(message[1] or b"")
        self._pump()

    def decided(self, sql: str, decision: Decision, version: int) -> None:
        """The decision the session could not give at once (``decide`` returned None)."""
        self._router.decided(sql, decision, version)
        self._waiting = False
        self._pump()

    def recorded(self, refusal: Reject | None = None) -> None:
        """The audit trail holds the row ``record`` asked for; ``refusal``: it could not be written, so the
        statement is refused instead of run."""
        route = self._held
        assert self._recording
        self._recording = False
        if route is None:  # an error answered an earlier message of the batch meanwhile: this one is skipped
            self._pump()
            return
        assert route.record is not None
        self._held = replace(route, record=None) if refusal is None else \
            self._router.refuse(refusal, route.record.simple, self.transaction_status)
        self._pump()

    def upstream_piece(self, piece: Piece) -> None:
        """Part of a long message from the client's connection (a big row, COPY data): to the client as it comes.
        (The proxy's own queries there and the answers it hides are never long.)"""
        if piece.first:
            hidden = self._hide(Owner.UPSTREAM, piece.type_)  # a long ErrorResponse still ends what is hidden
            if piece.type_ == b"E":
                self._failed()
                if not hidden:
                    self._batch_error(Owner.UPSTREAM)
        self._client(piece.raw)

    def upstream_rows(self, rows: Rows) -> None:
        """DataRows from the client's connection: to the client as they are, unless the proxy is reading answers
        there itself (then message by message)."""
        if (self._timeout is not None and self._timeout.asking) or self._hidden[Owner.UPSTREAM]:
            for type_, body in messages(rows.raw):
                self.upstream_message(type_, body)
        else:
            self._client(rows.raw)  # (rows change neither cursors nor a Script's progress: see follow)

    def upstream_message(self, type_: bytes, body: bytes) -> None:
        if self._timeout is not None and self._timeout.asking:
            self._timeout_answer(self._timeout, type_, body)
            return
        if self._hide(Owner.UPSTREAM, type_):
            return
        if type_ == b"Z":
            self.transaction_status = body
            if self._timeout is not None:
                self._timeout.stale = True  # what ran may have changed it (SET, a function, a rollback)
            self._ready_for_query(Owner.UPSTREAM, body)
            return
        if type_ == b"C":
            tag = pg.read_cstring(body)[0].decode(errors="replace")
            self._cursors.command_complete(tag)
            if tag in ("RESET", "DISCARD ALL") and self._resets_expected:
                self._resets_expected -= 1
                self._reset_session()
            if tag in ("DEALLOCATE ALL", "DISCARD ALL"):
                self._prepared.deallocated(None)  # PostgreSQL dropped every named statement: the gated ones go too
        elif type_ == b"E":
            self._resets_expected = 0
            self._batch_error(Owner.UPSTREAM)
        elif type_ == b"S":
            name, offset = pg.read_cstring(body)
            if name.decode() in REPORTED_SETTINGS:
                self._service.follow(name.decode(), pg.read_cstring(body, offset)[0].decode())
        self._write_client(pg.message(type_, body), upstream=True)

    def service_message(self, type_: bytes, body: bytes) -> None:
        service = self._service
        if not service.silenced:
            service.answered(type_)
            if type_ == b"E":
                self._batch_error(Owner.SERVICE)
        keeping = self._keeping
        dropped = keeping is not None and type_ == b"E" and keeping.ahead > 0 and not service.silenced
        if dropped:
            keeping = self._keeping = None  # an earlier message failed: PostgreSQL skips ours, up to the Sync
        if service.silenced:
            # The answer to our own SET: not for the client.
            if type_ == b"Z":
                service.silenced -= 1
                self.in_flight[Owner.SERVICE] -= 1
                self._pump()
        elif keeping is not None and keeping.ours(type_):
            self._kept_answer(keeping, type_, body)
        elif (instead := service.replan(type_, body)) is not None:
            self._hidden[Owner.SERVICE].clear()  # (what was hidden answered the prepared statement)
            if instead:
                self._send[Owner.SERVICE](instead)
                service.sent(instead)
        elif self._hide(Owner.SERVICE, type_):
            return
        elif type_ == b"N" and (report := reports.read_notice(pg.parse_fields(body))) is not None:
            self._report = report  # told once the answer's rows are out
        elif self._capture is not None and type_ != b"Z":
            self._captured(self._capture, type_, body)
        elif type_ == b"Z":
            self._report = None
            # The client's transaction is the one on its own connection.
            self._ready_for_query(Owner.SERVICE, self.transaction_status)
            self._release(clean=body == b"I")
        elif type_ != b"S":  # the service session's settings are not the client's
            self._write_client(pg.message(type_, body))
            if self._report is not None and type_ in (b"C", b"s", b"E"):
                self._tell_report(self._report, type_, body)
        if dropped:
            self._pump()  # what waited for the portal's answer
        self._watch_hold()

    def _batch_error(self, owner: Owner) -> None:
        """An ErrorResponse from ``owner``'s connection. When it answers a message of the client's open batch (the
        part open there, or the part the gate ended with a Sync of its own, every Sync there still unanswered being
        ours), PostgreSQL skips the rest of the client's batch up to its Sync, on whatever connection it would run:
        the gate skips it as after a refusal, and the message already routed, waiting for that part's
        ReadyForQuery, is dropped, never sent."""
        if owner not in (self._unsynced, self._closed_part) or self.in_flight[owner] != self._swallow[owner]:
            return  # (an error of a batch the client already ended with its Sync: PostgreSQL skipped to that Sync)
        self._router.failed()
        held = self._held
        if held is not None and held.in_batch and not held.ends_batch and held.script is None:
            self._held = None

    def _kept_answer(self, keeping: Keeping, type_: bytes, body: bytes) -> None:
        """A message of the service connection's answer to a portal's Execute the gate keeps: the client gets its
        first ``max_rows`` rows once all is in, then the answer's report, as for an answer sent as it comes."""
        if type_ == b"N":
            report = reports.read_notice(pg.parse_fields(body))
            if report is None:
                self._write_client(pg.message(type_, body))
            else:
                self._report = report
            return
        if type_ == b"E":
            self._keeping = self._report = None
            self._write_batch_answer(pg.message(type_, body))
            self._pump()
            return
        if not keeping.feed(type_, body):
            return
        self._keeping = None
        kept = keeping.kept()
        if isinstance(kept, bytes):
            self._report = None
            self._write_batch_answer(kept)
        else:
            self._prepared.kept_portals[keeping.portal] = kept
            rows, end = proxy_portals.next_rows(kept, keeping.max_rows)
            self._write_client(rows + end)
            if self._report is not None:
                self._tell_report(self._report, end[:1], end[5:])
        self._pump()

    def service_hold_expired(self, error: bytes) -> None:
        """One of the session's hold limits (service_hold_timeout; service_yield_timeout, while another session
        waits) ran out while an open batch kept the service connection waiting for the client: the batch is ended
        (a Sync of ours, so that the connection goes back to the pool), the client gets ``error`` once the
        service side answered, and the rest of its batch is skipped, up to its Sync."""
        if not self._holding_idle:
            return
        self._close_batch_part(Owner.SERVICE)
        self._router.failed()
        self._held = Route(Owner.LOCAL, error)  # sent when our Sync is answered, after the batch's answers
        self._pump()

    def _tell_report(self, report: reports.AnswerReport, type_: bytes, body: bytes) -> None:
        """After an answer's CommandComplete (or PortalSuspended), the NOTICE of its report; an answer that failed
        (ErrorResponse) says nothing."""
        self._report = None
        if type_ != b"E":
            told = report.notice(row_count(body) if type_ == b"C" else None)
            if told:
                self._write_client(told)

    def service_acquired(self, statements: ServiceStatements) -> None:
        """The session borrowed a service connection (``acquire_service``; ``statements``: the named statements on
        it): what waited for it goes on."""
        self._service.acquired(statements)
        self._pump()

    def service_refused(self, error: bytes) -> None:
        """No service connection for the statement waiting for one: the server's ErrorResponse answers it."""
        self._service.acquiring = False
        route, self._held = self._held, None
        assert route is not None and route.owner is Owner.SERVICE
        if route.payload[:1] == b"Q":
            self._write_client(error + pg.ready_for_query(self.transaction_status))
        else:
            self._write_client(error)
            self._router.failed()  # the rest of the batch is skipped, up to Sync
        self._pump()

    def _release(self, clean: bool) -> None:
        """Hand a borrowed service connection back once nothing of this session is left on it."""
        service = self._service
        if not service.borrowed or not service.held:
            return
        if self.in_flight[Owner.SERVICE] or service.silenced or self._unsynced is Owner.SERVICE \
                or (self._held is not None and self._held.owner is Owner.SERVICE):
            return
        service.held = False
        self._release_service(clean)

    def proxy_answered(self, reply: Reply) -> None:
        """The session's reply to ``ask_proxy``."""
        assert self._asking is not None
        kind, portal, max_rows = self._asking
        self._asking = None
        self.in_flight[Owner.PROXY] -= 1
        if kind in ("declare", "declare portal"):
            declare, self._declaring = self._declaring, None
            assert declare is not None and not isinstance(reply, Description)
            answer = self._declared(declare, reply)
            if kind == "declare":
                self._write_client(answer + pg.ready_for_query(self.transaction_status))
            else:
                self._write_batch_answer(answer)
        elif kind == "query":
            assert not isinstance(reply, Description)
            self._write_client((reply.simple() if isinstance(reply, Result) else reply)
                               + pg.ready_for_query(self.transaction_status))
        elif isinstance(reply, bytes):  # an error: the rest of the batch is skipped, up to Sync
            self._router.failed()
            self._write_client(reply)
        elif isinstance(reply, Description) and kind == "describe statement":
            self._write_client(pg.parameter_description(list(reply.parameter_types))
                               + Result(reply.columns).description())
        else:
            self._portal_answered(self._prepared.proxy_portals[portal], kind, reply, max_rows)
        self._pump()

    def _portal_answered(self, portal: ProxyPortal, kind: str, reply: Result | Description, max_rows: int) -> None:
        """The answer to a Describe or Execute of a portal the proxy answers (no message was routed meanwhile: the
        portal is still there)."""
        if isinstance(reply, Description):
            self._write_batch_answer(proxy_portals.description(portal, reply.columns))
            return
        portal.result = reply
        if kind == "describe and answer":
            self._write_batch_answer(proxy_portals.description(portal, reply.columns))
        else:
            self._write_batch_answer(proxy_portals.rows(portal, max_rows))

    def _write_batch_answer(self, answer: bytes) -> None:
        """An answer to a message of the batch; an ErrorResponse skips the rest of it, up to Sync."""
        if answer[:1] == b"E":
            self._router.failed()
        self._write_client(answer)

    # -- what goes to the client -------------------------------------------------------------------------------

    def _write_client(self, data: bytes, upstream: bool = False) -> None:
        """Whole messages for the client (``upstream``: from its own connection), followed on their way (cursors'
        life time, a Script's ReadyForQuery)."""
        followed = offsets(data, FOLLOWED)  # the one walk over the messages' headers, for both steps
        data, followed = self._transaction_failed(data, followed, upstream)
        data, over = follow(data, followed, self._cursors, self._script)
        if over:
            self._end_script()
        if data:
            self._client(data)

    def _transaction_failed(self, data: bytes, followed: list[int], upstream: bool) -> tuple[bytes, list[int]]:
        """``data`` for the client, its ReadyForQuery (last, if any) carrying the status of the client's connection;
        ``followed``: the offsets of its ErrorResponse and ReadyForQuery messages, returned with what is returned.

        An error the client got from elsewhere (a refusal, the service connection, the proxy) inside a transaction
        block fails that transaction where it lives: the ReadyForQuery that follows is held back, the client's
        connection fails its transaction too (_FAIL_TRANSACTION, its error hidden) and that connection's own
        ReadyForQuery ('E') goes to the client. PostgreSQL then answers what follows as it answers any failed
        transaction (25P02, COMMIT reported as ROLLBACK, ROLLBACK TO SAVEPOINT recovering), and the status the
        gate follows is always the server's."""
        if not upstream:
            self._erred |= any(data[offset:offset + 1] == b"E" for offset in followed)
        if not followed or followed[-1] != len(data) - 6 or data[-6:-5] != b"Z":
            return data, followed  # not ending with a ReadyForQuery (a ReadyForQuery is 6 bytes)
        if not (self._erred and self.transaction_status == b"T"):
            self._erred = False
            return (data if upstream else data[:-6] + pg.ready_for_query(self.transaction_status)), followed
        self._erred = False
        self._send[Owner.UPSTREAM](_FAIL_TRANSACTION)
        self._hidden[Owner.UPSTREAM].append(b"E")
        self.in_flight[Owner.UPSTREAM] += 1
        return data[:-6], followed[:-1]

    def _failed(self) -> None:
        self._cursors.error()
        self._resets_expected = 0
        if self._script is not None:
            self._script.failed = True

    def _end_script(self) -> None:
        """The message run as a Script is answered: what is left of it (after an error) is skipped."""
        if self._script is None:
            return
        self._script = None
        while self._queue and self._queue[0][0] == b"q":
            self._queue.popleft()

    def _declared(self, declare: DeclareCursor, reply: Result | bytes) -> bytes:
        """The answer to a gated DECLARE, its query answered: the cursor is kept (or the error)."""
        if not isinstance(reply, Result):
            return reply
        # A single statement outside a transaction block runs in a transaction of its own, committed at once.
        return self._cursors.declare(declare, reply, self.transaction_status == b"I" and self._script is None)

    def _captured(self, capture: Capture, type_: bytes, body: bytes) -> None:
        """A message of the service connection's answer to a gated DECLARE's query."""
        answer = capture.feed(type_, body)
        if answer is None:
            return
        self._capture = None
        self._write_client(answer if isinstance(answer, bytes) else self._declared(capture.declare, answer))
        self._pump()  # the messages that waited for the cursor (a Sync among them, in the extended protocol)

    def _hide(self, owner: Owner, type_: bytes) -> bool:
        """Whether this is an answer to a statement prepared again, which the client must not see."""
        hidden = self._hidden[owner]
        if not hidden:
            return False
        if type_ == hidden[0]:
            hidden.popleft()
            return True
        if type_ in b"EZ":
            hidden.clear()  # an error: the server skips the rest, up to Sync
        return False

    def _timeout_answer(self, timeout: ClientTimeout, type_: bytes, body: bytes) -> None:
        """The answer to our query of the client's statement_timeout and the followed settings the server does
        not report (an error keeps the last values)."""
        if type_ == b"D":
            for name, value in timeout.row(body).items():
                if value != self._service.output_settings.get(name):
                    self._service.follow(name, value)
        elif type_ == b"E":
            timeout.error(body)
        elif type_ == b"Z":
            timeout.ready(body)
            self.in_flight[Owner.UPSTREAM] -= 1
            self._pump()

    def _ready_for_query(self, owner: Owner, status: bytes) -> None:
        self.in_flight[owner] -= 1
        if self._swallow[owner]:
            self._swallow[owner] -= 1  # it answers a Sync of ours
        else:
            if status == b"I":  # the client's transaction ended (COMMIT, ROLLBACK, a Sync outside a block)
                self._prepared.portals_ended()
            self._write_client(pg.ready_for_query(status), upstream=owner is Owner.UPSTREAM)
        self._pump()

    # -- dispatch -----------------------------------------------------------------

    def _pump(self) -> None:
        self._dispatch()
        self._flow()
        self._watch_hold()

    def _watch_hold(self) -> None:
        """Start or stop the session's hold timer as a borrowed connection starts or stops waiting for the client
        in an open batch."""
        service = self._service
        idle = (service.borrowed and service.held and self._unsynced is Owner.SERVICE
                and not service.answering()  # (unflushed answers wait for the client)
                and not self.in_flight[Owner.SERVICE] and not service.silenced
                and self._held is None and not self._waiting)
        if idle != self._holding_idle:
            self._holding_idle = idle
            self._hold_timer(idle)

    def _dispatch(self) -> None:
        """Route the queued messages and send their routes on, in order, as far as what is in flight allows."""
        while self._held is not None or self._queue:
            if self._waiting or self._recording:
                return  # a statement is being analysed, or its row written to the audit trail
            if self._held is None:
                if not self._route_next():
                    return
            elif not self._go(self._held):
                return

    def _route_next(self) -> bool:
        """Route the message at the head of the queue (held until it can go); False: it must wait."""
        if self.in_flight[Owner.PROXY]:
            return False  # route the next message once the proxy answered: an error skips the rest of the batch
        if self._queue[0][0] == b"q" and any(self.in_flight.values()):
            return False  # the parts of a Script run one after the other
        if self._capture is not None or self._declaring is not None:
            return False  # what follows a gated DECLARE may name its cursor: routed once the cursor is held
        if self._keeping is not None:
            return False  # what follows may read the portal being kept
        type_, body = self._queue.popleft()
        if type_ == b"S":
            self._closed_part = None  # the client's batch ends: an error of its parts skips nothing more
        now = Now(self.transaction_status, self._unsynced, self._queue[0] if self._queue else None, self._script)
        route = self._router.route(type_, body, now)
        if route is WAIT:
            self._queue.appendleft((type_, body))
            self._waiting = True
            return False
        self._queued -= len(body or b"")
        self._held = route
        return True

    def _go(self, route: Route) -> bool:
        """Send the held route on once nothing it must wait for is left; False: it waits."""
        if self._must_wait(route):
            return False
        self._held = None
        if route.script is not None:  # its parts go first, one by one; the client sees one ReadyForQuery
            self._script = ScriptRun(deque(route.script.parts), len(route.script.parts))
            self._queue.extendleft([(b"q", b"")] * len(route.script.parts))
            return True
        if route.declares is not None and route.owner is Owner.SERVICE:
            self._capture = self._cursors.capture(route.declares)
        elif route.declares is not None:
            self._declaring = route.declares
        self._senders[route.owner](route)
        return True

    def _must_wait(self, route: Route) -> bool:
        """Whether ``route`` waits: for its audit-trail row, for what is in flight elsewhere, for the client's
        statement_timeout, or for a service connection (each asked for here)."""
        if route.record is not None and self._record is not None:
            self._recording = True
            self._record(route.record)
            return True
        if route.in_batch and self._unsynced not in (None, route.owner):
            self._close_batch_part(self._unsynced)
        if any(count for owner, count in self.in_flight.items()
               if owner is not route.owner or route.declares is not None or route.script is not None):
            return True  # wait for the other owner's ReadyForQuery (gated DECLARE, Script: for every answer)
        if self._timeout is not None and self._needs_client_timeout(self._timeout, route):
            self._send[Owner.UPSTREAM](self._timeout.ask())
            self.in_flight[Owner.UPSTREAM] += 1
            return True
        if route.owner is Owner.SERVICE and self._service.running:
            return True  # a Query run as a prepared statement may run again as a plain one: nothing goes behind it
        if route.owner is Owner.SERVICE and not self._service.held:
            if not self._service.acquiring and self._acquire_service is not None:
                self._service.acquiring = True
                self._acquire_service()
            return True
        return False

    def _send_proxy(self, route: Route) -> None:
        assert route.request is not None
        self.in_flight[Owner.PROXY] += 1
        self._asking = route.asking
        request = replace(route.request, settings=tuple(self._service.output_settings.items()))
        if self._timeout is not None:
            request = replace(request, timeout_ms=self._timeout.milliseconds())
        self._ask_proxy(request)

    def _send_connection(self, route: Route) -> None:
        """A route to the client's connection or to the service connection."""
        owner = route.owner
        payload, hidden = route.payload, route.hidden
        if owner is Owner.SERVICE:
            alone = not self.in_flight[Owner.SERVICE] and self._unsynced is not Owner.SERVICE
            self._follow_on_service()
            payload, hidden = self._service.prepare_first(route, self._prepared, alone)
        if route.keeps is not None and not self._service.skipping:
            self._keeping = Keeping(*route.keeps, ahead=self._service.awaiting,
                                    room=keeping_room(self._prepared.kept_portals, self._limits))
        self._hidden[owner].extend(hidden)
        self._resets_expected += route.resets
        if payload:
            self._send[owner](payload)
        if owner is Owner.SERVICE:
            self._service.sent(payload)
        if route.describes and self._unsynced is not Owner.SERVICE and all(t == b"H" for t, _ in self._queue):
            # A Describe of a statement, alone, the client waiting for it (asyncpg's prepare()): a Sync of ours
            # ends it, so that the connection goes back to the pool; the statement stays prepared there.
            self._close_batch_part(Owner.SERVICE)
        elif route.ends_batch:
            self.in_flight[owner] += 1
            self._unsynced = None
        elif route.in_batch:
            self._unsynced = owner

    def _follow_on_service(self) -> None:
        """Before a route to the service connection: the client's statement_timeout (capped by the policy) and
        output settings, applied there by a query of ours if they changed."""
        if self._timeout is not None and self._unsynced is not Owner.SERVICE:
            self._service.follow_timeout(self._timeout.milliseconds())
        query = self._service.settings_query()
        if query:
            self._send[Owner.SERVICE](query)
            self.in_flight[Owner.SERVICE] += 1

    def _flow(self) -> None:
        """Stop reading from the client while too much of what it sent waits here; go on once half is gone."""
        if self._queued > QUEUE_LIMIT:  # again each time: the session's own flow control may have resumed it
            self._client_paused = True
            self._pause_client(True)
        elif self._client_paused and self._queued <= QUEUE_LIMIT // 2:
            self._client_paused = False
            self._pause_client(False)

    def _needs_client_timeout(self, timeout: ClientTimeout, route: Route) -> bool:
        """Whether the client's statement_timeout must be read before ``route`` runs something."""
        return (timeout.stale and route.owner in (Owner.SERVICE, Owner.PROXY) and self._unsynced is not route.owner
                and self.transaction_status != b"E")  # in a failed transaction the query would fail: keep the last

    def _close_batch_part(self, owner: Owner) -> None:
        self._closed_part = owner
        self._send[owner](SYNC)
        self.in_flight[owner] += 1
        self._swallow[owner] += 1
        self._unsynced = None
