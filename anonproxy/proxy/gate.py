"""The gate of a session whose role is in an anonymized mode.

Each client message is routed to one of three owners:

* UPSTREAM — the client's own connection, for statements the rewriter lets
  pass (catalog queries, session settings…), and for those it relays with
  their privilege probes rewritten (``Relayed``: the rewritten text goes in
  the Query or Parse, with the client's parameter types; Bind, Describe and
  Execute follow unchanged, result formats included); the client's role has
  no privilege on protected tables, so PostgreSQL itself refuses what slips by;
* SERVICE — the proxy's service connection, for rewritten aggregate queries;
* LOCAL — answered by the proxy: refusals and ``SHOW anonproxy.*``;
* PROXY — answered by the proxy after asynchronous work (differentially
  private answers, ``SHOW anonproxy.budget``, ``SET anonproxy.epsilon``,
  ``EXPLAIN (ANONPROXY)``): the gate asks with ``ask_proxy(ProxyRequest)``
  and the session replies with ``proxy_answered``, one request at a time.

Extended-protocol messages follow their statement or portal. Responses reach
the client in the order of the requests: a message for another owner waits
until the owners with requests in flight have answered (ReadyForQuery).
When one batch (messages up to Sync) mixes owners, the proxy closes the
first owner's part with a Sync of its own and swallows its ReadyForQuery.

For statements the proxy answers, the gate plays the server's part of the
extended protocol: ParseComplete, BindComplete (keeping the bound values),
Describe (asking the session for the column types of a dp query, which
runs and charges nothing — unless an Execute of the same portal follows in
the batch: then the answer is asked for at once), Execute (asking for the
answer once per portal, then sending its rows in the portal's result
formats, ``max_rows`` at a time with PortalSuspended), CloseComplete; after
an error the rest of the batch is skipped up to Sync, as PostgreSQL does.

Statements are decided by the session (``decide``), which may answer "not
yet" (None) while the statement is analysed off the event loop; the gate then
holds that message, and those after it, until ``decided``. A Query or Parse
longer than ``max_statement_size`` is never buffered (BoundedMessageBuffer)
and is refused with 54000; one that is not valid UTF-8 with 22021.

Memory: the named prepared statements a session keeps here are capped
(``limits``, limits.py: their number and bytes); a Parse over a limit is
refused with 54000 and nothing of it is kept. A DEALLOCATE sent alone in a
Query forgets PostgreSQL's statements of that name here too. The cursors'
caps are cursors.py's.

Policy changes reach prepared statements: each remembers its text and the
policy version it was decided under. A Bind of a statement decided under an
older version decides it again; a refusal answers the Bind, and a new
decision prepares it again where it now belongs (a Close and a Parse with the
new rewrite, whose answers the client does not see, go before the Bind), so
SQL rewritten under the old policy never runs again. An Execute of a portal
bound under an older version runs only if the decision did not change.

Service connections are borrowed: with ``acquire_service``, the gate asks
for one when a message must go to the service side and none is held, and
hands it back (``release_service``) when the service side answered
ReadyForQuery with nothing of the session's left on it (no request in
flight, no open batch part). The service side never runs the client's
transaction (rewritten statements run one by one, autocommit), so nothing
ties a connection to a client transaction. On each connection borrowed, the
gate first clears what another session may have left (``RESET ALL``, which
keeps the connection's startup settings; ``DEALLOCATE ALL``), then applies
the session's output settings and statement_timeout. The client's Parse of
a rewritten statement is answered here (ParseComplete): the statement is
prepared on the service connection, from the rewrite kept here, just before
a message uses it, and again on each connection borrowed later.

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

Suppress mode's report: the SQL of a suppressed answer raises one INFO
(anonproxy.suppression_report) with what suppression withheld. The gate never
forwards it: after the answer's CommandComplete (or its first
PortalSuspended) it sends a NOTICE in the proxy's words
(anonproxy.suppress.explain); an answer that fails says nothing.

Time: when the session gives a ``time_limit`` (the policy's maximum for the
role's mode), the statement_timeout of the client's own session (read from
its connection with a query of the proxy's, after anything else ran there)
capped by that limit is set on the service connection before a rewritten
statement and passed with every request for the proxy (``timeout_ms``).
A read stopped by the client's own statement_timeout is made once more,
then taken as 1 ms (the limit is shorter than that query took).
The same query reads the followed settings the server does not report
(extra_float_digits; the list is :mod:`.followed_settings`), followed on the
service connection like DateStyle, and given with every request for the
proxy (``settings``).
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..config import MAX_STATEMENT_SIZE
from ..plan.refusals import Reject
from ..route.decision import (
    CloseCursor,
    CursorStatement,
    Deallocate,
    Decision,
    DeclareCursor,
    ExplainDP,
    ExplainSuppress,
    FetchCursor,
    Intercept,
    Noisy,
    Pass,
    Relayed,
    Rewrite,
    Script,
    SessionSetting,
)
from ..suppress.explain import SuppressionReport, notice, read_report
from ..wire import protocol as pg
from ..wire.framing import BoundedMessageBuffer, Piece, Rows, messages
from ..wire.results import Column, FormatError, Result, check_formats, result_formats
from .cursors import Capture, Cursors, ScriptRun, follow, unnamed_bind
from .followed_settings import REPORTED_SETTINGS, UNREPORTED_SETTINGS
from .limits import DEFAULT_LIMITS, MemoryLimits, size_text

SYNC = pg.message(b"S")
_EXECUTE_ALL = pg.message(b"E", b"\0\0\0\0\0")  # Execute the unnamed portal, all rows
QUEUE_LIMIT = 1 << 20  # bytes of client messages waiting in the gate before the session stops reading


class Owner(enum.Enum):
    UPSTREAM = enum.auto()
    SERVICE = enum.auto()
    LOCAL = enum.auto()
    PROXY = enum.auto()


@dataclass(frozen=True)
class Parameters:
    """The values a Bind gives a statement's $n parameters, as the client sent them."""

    types: tuple[int, ...] = ()  # declared by Parse (0: unspecified); may be fewer than the values
    formats: tuple[int, ...] = ()  # one per value: 0 text, 1 binary
    values: tuple[bytes | None, ...] = ()


@dataclass(frozen=True)
class Execution:
    """A statement about to run for the client, or refused: what the audit trail records before anything of it
    leaves (``record``; the gate holds the statement until ``recorded``)."""

    sql: str  # the client's text
    decision: Decision  # what runs (a Reject: refused)
    parameters: Parameters = Parameters()  # the values bound to it
    simple: bool = True  # a Query (else a message of the extended protocol)


@dataclass(frozen=True)
class Description:
    """The session's reply to a describing request: parameter types and result columns."""

    parameter_types: tuple[int, ...]
    columns: tuple[Column, ...]


@dataclass(frozen=True)
class ProxyRequest:
    """What the gate asks the session to answer: a proxy decision, with the bound parameters."""

    decision: Decision  # Noisy, ExplainDP, ExplainSuppress, SessionSetting, or Intercept of a PROXY_SETTINGS one
    describe: bool = False  # only the Description: nothing is run or charged
    parameters: Parameters = Parameters()
    timeout_ms: int = 0  # the statement_timeout for what it runs (0: none)
    settings: tuple[tuple[str, str], ...] = ()  # the client's followed settings (followed_settings), for printing
    sql: str = ""  # the client's text of the statement, for the audit trail


# The session's reply: a Result, a Description, or ready-made messages (an ErrorResponse in the extended protocol).
Reply = Result | Description | bytes


@dataclass(frozen=True)
class Route:
    owner: Owner
    payload: bytes
    ends_batch: bool = False  # the owner will answer with ReadyForQuery
    in_batch: bool = True  # part of an extended-protocol batch (COPY data is not)
    request: ProxyRequest | None = None  # what a PROXY route asks the session to answer
    asking: tuple[str, bytes, int] = ("query", b"", 0)  # a PROXY route: (what for, portal, max rows)
    hidden: tuple[bytes, ...] = ()  # types of the owner's answers to drop (a statement prepared again)
    # On the service connection: the statement the payload uses or closes (see ``_on_service``).
    uses: bytes | None = None
    closes: bytes | None = None
    describes: bool = False  # a Describe of a statement on the service connection
    declares: DeclareCursor | None = None  # a cursor the proxy will hold: its query's answer is kept, not sent
    script: Script | None = None  # a message to run statement by statement, from when nothing is in flight
    resets: int = 0  # RESET ALL / DISCARD ALL statements among what it sends to the client's connection
    refusal: Reject | None = None  # what a LOCAL route refuses
    record: Execution | None = None  # to record in the audit trail before the route runs


@dataclass(frozen=True)
class _Decided:
    """What a prepared statement or a portal was decided on: its text, the decision, the policy version."""

    sql: str
    decision: Decision
    version: int
    rest: bytes = b""  # the Parse message after the text: parameter types


# _route's answer when the statement's decision is not known yet: the message waits at the head of the queue.
_WAIT = Route(Owner.LOCAL, b"")


@dataclass
class _ProxyPortal:
    decision: Decision
    parameters: Parameters
    formats: tuple[int, ...]  # the Bind's result-format codes, as sent
    result: Result | None = None  # the answer, once executed: later Executes continue it, for free
    sent: int = 0
    notified: bool = False  # the answer's notices went with its first rows


class Gate:
    def __init__(
        self,
        decide: Callable[[str], Decision],
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
        self._decide = decide  # None: being analysed, ``decided`` follows
        self._version = version  # of the policy in force
        self._time_limit = time_limit  # the policy's maximum statement time for the role's mode, in ms
        self._settings = settings
        self._client = write_client
        self._send = {Owner.UPSTREAM: send_upstream, Owner.SERVICE: send_service}
        self._ask_proxy = ask_proxy
        self._max_statement_size = max_statement_size
        self._client_messages = BoundedMessageBuffer({b"Q": max_statement_size, b"P": max_statement_size},
                                                     MAX_STATEMENT_SIZE)
        self._queue: deque[tuple[bytes, bytes | None]] = deque()
        # Messages wait in the queue while others are answered or analysed: past QUEUE_LIMIT bytes, the session
        # stops reading from the client (``pause_client(True)``) until the queue is down to half.
        self._queued = 0
        self._pause_client = pause_client
        self._client_paused = False
        self._analysed: tuple[str, Decision, int] | None = None  # the decision ``decided`` brought
        self._waiting = False  # for ``decided``
        self._hidden = {Owner.UPSTREAM: deque[bytes](), Owner.SERVICE: deque[bytes]()}
        self._texts: dict[bytes, _Decided] = {}  # prepared statements, by name
        self._bound: dict[bytes, _Decided] = {}  # portals, by name
        self._held: Route | None = None
        self._unsynced: Owner | None = None  # owner of batch messages sent since the last Sync
        self.in_flight = {Owner.UPSTREAM: 0, Owner.SERVICE: 0, Owner.PROXY: 0}  # requests awaiting ReadyForQuery
        self._swallow = {Owner.UPSTREAM: 0, Owner.SERVICE: 0}  # ReadyForQuery of our own Syncs
        self._statements: dict[bytes, Owner] = {}
        self._portals: dict[bytes, Owner] = {}
        # Settings shown by the statements and portals the proxy owns (SHOW anonproxy.*).
        self._statement_settings: dict[bytes, str] = {}
        self._portal_settings: dict[bytes, str] = {}
        # Statements and portals the proxy answers after asynchronous work (owner PROXY).
        self._proxy_statements: dict[bytes, tuple[Decision, tuple[int, ...]]] = {}
        self._proxy_portals: dict[bytes, _ProxyPortal] = {}
        self._asking: tuple[str, bytes, int] | None = None  # what the PROXY request in flight is for
        self._skipping = False  # after a refusal, the rest of the batch is ignored, as PostgreSQL does
        self.transaction_status = b"I"
        # Output-shaping settings the client changed, to repeat on the service connection.
        self._settings_to_copy: dict[str, str] = {}
        self._silenced = 0  # our own SET queries whose answers are dropped
        # The client's statement_timeout (ms, 0: none), read again after the client ran something upstream.
        self._client_timeout = 0
        self._client_timeout_stale = True
        self._asking_timeout = 0  # our own queries on the client's connection, answered to us
        self._timeout_cancelled = False  # the last of them was stopped by the client's own statement_timeout
        self._timeout_reread = False  # ... and is being read once more
        self._service_timeout: int | None = None  # the statement_timeout last set on the service connection
        # The service connection is borrowed from the worker's pool (``acquire_service``; the session answers
        # ``service_acquired`` or ``service_refused``) and handed back (``release_service``) once idle.
        # None: the connection is the session's own, always there.
        self._acquire_service = acquire_service
        self._release_service = release_service
        self._service_held = acquire_service is None
        self._acquiring = False
        self._reset_service = False  # a borrowed connection: clear what another session left first
        # The session's output settings (DateStyle…), all applied on each connection borrowed.
        self._output_settings: dict[str, str] = dict(service_settings or {})
        self._service_statements: set[bytes] = set()  # statements prepared on the service connection held
        # A borrowed connection held by an open batch (no Sync yet) while PostgreSQL owes no answer there (all
        # answered, or the client did not Flush: the answers wait for its Sync) is waiting for the client:
        # ``hold_timer(True)`` starts the session's hold limits, which end the batch (``service_hold_expired``);
        # ``hold_timer(False)`` stops them.
        self._hold_timer = hold_timer
        self._holding_idle = False
        self._service_awaiting = 0  # batch messages sent to the service connection and not yet answered
        self._service_flushed = False  # a Flush followed them: the server sends their answers without a Sync
        self._describing = False  # a Describe the gate closed with a Sync of its own is being answered
        # Cursors (see cursors.py): those the proxy holds, the gated DECLARE being answered, the message of
        # several statements being run one by one.
        self._limits = limits
        self._cursors = Cursors(limits)
        self._capture: Capture | None = None
        self._declaring: DeclareCursor | None = None
        self._script: ScriptRun | None = None
        self._cursor_statements: dict[bytes, CursorStatement] = {}
        self._cursor_portals: dict[bytes, tuple[CursorStatement, pg.Bind]] = {}
        self._report: SuppressionReport | None = None  # of the suppressed answer the service is sending
        # RESET ALL / DISCARD ALL sent to the client's connection and not yet answered: when PostgreSQL completes
        # one, ``reset_session`` resets what the proxy keeps for the session (an error skips the rest: forgotten).
        self._reset_session = reset_session
        self._resets_expected = 0
        # The audit trail (None: off): a statement runs, or its refusal is sent, once ``recorded`` says its row is
        # written.
        self._record = record
        self._recording = False

    # -- input ------------------------------------------------------------------

    def client_data(self, data: bytes) -> None:
        for message in self._client_messages.feed(data):
            self._queue.append(message)
            self._queued += len(message[1] or b"")
        self._pump()

    def decided(self, sql: str, decision: Decision, version: int) -> None:
        """The decision the session could not give at once (``decide`` returned None)."""
        self._analysed = (sql, decision, version)
        self._waiting = False
        self._pump()

    def recorded(self, refusal: Reject | None = None) -> None:
        """The audit trail holds the row ``record`` asked for; ``refusal``: it could not be written, so the
        statement is refused instead of run."""
        route = self._held
        assert self._recording and route is not None and route.record is not None
        self._recording = False
        self._held = replace(route, record=None) if refusal is None else \
            self._refuse(refusal, simple=route.record.simple)
        self._pump()

    def upstream_piece(self, piece: Piece) -> None:
        """Part of a long message from the client's connection (a big row, COPY data): to the client as it comes.
        (The proxy's own queries there and the answers it hides are never long.)"""
        if piece.first:
            self._hide(Owner.UPSTREAM, piece.type_)  # a long ErrorResponse still ends what is hidden
            if piece.type_ == b"E":
                self._failed()
        self._client(piece.raw)

    def upstream_rows(self, rows: Rows) -> None:
        """DataRows from the client's connection: to the client as they are, unless the proxy is reading answers
        there itself (then message by message)."""
        if self._asking_timeout or self._hidden[Owner.UPSTREAM]:
            for type_, body in messages(rows.raw):
                self.upstream_message(type_, body)
        else:
            self._client(rows.raw)  # (rows change neither cursors nor a Script's progress: see follow)

    def upstream_message(self, type_: bytes, body: bytes) -> None:
        if self._asking_timeout:
            self._timeout_answer(type_, body)
            return
        if self._hide(Owner.UPSTREAM, type_):
            return
        if type_ == b"Z":
            self.transaction_status = body
            self._client_timeout_stale = True  # what ran may have changed it (SET, a function, a rollback)
            self._ready_for_query(Owner.UPSTREAM, body)
            return
        if type_ == b"C":
            tag = pg.read_cstring(body)[0].decode(errors="replace")
            self._cursors.command_complete(tag)
            if tag in ("RESET", "DISCARD ALL") and self._resets_expected:
                self._resets_expected -= 1
                self._reset_session()
        elif type_ == b"E":
            self._resets_expected = 0
        if type_ == b"S":
            name, offset = pg.read_cstring(body)
            if name.decode() in REPORTED_SETTINGS:
                value = pg.read_cstring(body, offset)[0].decode()
                self._settings_to_copy[name.decode()] = self._output_settings[name.decode()] = value
        self._write_client(pg.message(type_, body))

    def service_message(self, type_: bytes, body: bytes) -> None:
        if not self._silenced:
            self._service_answered(type_)
        if self._silenced:
            # The answer to our own SET: not for the client.
            if type_ == b"Z":
                self._silenced -= 1
                self.in_flight[Owner.SERVICE] -= 1
                self._pump()
        elif self._hide(Owner.SERVICE, type_):
            return
        elif type_ == b"N" and (report := read_report(pg.parse_fields(body))) is not None:
            self._report = report  # what suppression withheld: told once the answer's rows are out
        elif self._capture is not None and type_ != b"Z":
            self._captured(type_, body)
        elif type_ == b"Z":
            self._report = None
            # The client's transaction is the one on its own connection.
            self._ready_for_query(Owner.SERVICE, self.transaction_status)
            self._release(clean=body == b"I")
        elif type_ != b"S":  # the service session's settings are not the client's
            self._write_client(pg.message(type_, body))
            if self._report is not None and type_ in (b"C", b"s", b"E"):
                self._tell_report(type_, body)
        self._watch_hold()

    def _service_answered(self, type_: bytes) -> None:
        """Follow how many batch messages sent to the service connection PostgreSQL has yet to answer."""
        if type_ in _LAST_ANSWERS:
            self._service_awaiting = max(0, self._service_awaiting - 1)
        elif type_ == b"E" or type_ == b"Z":  # after an error the server skips the rest, up to Sync
            self._service_awaiting = 0
            if type_ == b"E" and self._describing:
                self._skipping = True  # the Sync was ours: the rest of the client's batch is skipped here
            if type_ == b"Z":
                self._describing = False

    def service_hold_expired(self, error: bytes) -> None:
        """One of the session's hold limits (service_hold_timeout; service_yield_timeout, while another session
        waits) ran out while an open batch kept the service connection waiting for the client: the batch is ended
        (a Sync of ours, so that the connection goes back to the pool), the client gets ``error`` once the
        service side answered, and the rest of its batch is skipped, up to its Sync."""
        if not self._holding_idle:
            return
        self._close_batch_part(Owner.SERVICE)
        self._skipping = True
        self._held = Route(Owner.LOCAL, error)  # sent when our Sync is answered, after the batch's answers
        self._pump()

    def _tell_report(self, type_: bytes, body: bytes) -> None:
        """After an answer's CommandComplete (or PortalSuspended), the NOTICE of what suppression withheld; an
        answer that failed (ErrorResponse) says nothing."""
        report, self._report = self._report, None
        assert report is not None
        if type_ == b"E":
            return
        rows = _rows(body) if type_ == b"C" else None
        told = notice(report, rows)
        if told is not None:
            self._write_client(pg.error_response("00000", told.message, severity="NOTICE", detail=told.detail,
                                                 hint=told.hint, type_=b"N"))

    def service_acquired(self) -> None:
        """The session borrowed a service connection (``acquire_service``): what waited for it goes on."""
        self._acquiring = False
        self._service_held = True
        self._reset_service = True
        self._service_statements.clear()
        self._settings_to_copy = dict(self._output_settings)
        self._service_timeout = None
        self._pump()

    def service_refused(self, error: bytes) -> None:
        """No service connection for the statement waiting for one: the server's ErrorResponse answers it."""
        self._acquiring = False
        route, self._held = self._held, None
        assert route is not None and route.owner is Owner.SERVICE
        if route.payload[:1] == b"Q":
            self._write_client(error + pg.ready_for_query(self.transaction_status))
        else:
            self._write_client(error)
            self._skipping = True  # the rest of the batch is skipped, up to Sync
        self._pump()

    def _release(self, clean: bool) -> None:
        """Hand a borrowed service connection back once nothing of this session is left on it."""
        if self._acquire_service is None or not self._service_held:
            return
        if self.in_flight[Owner.SERVICE] or self._silenced or self._unsynced is Owner.SERVICE \
                or (self._held is not None and self._held.owner is Owner.SERVICE):
            return
        self._service_held = False
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
                self._write_client(answer)
                self._skipping = answer[:1] == b"E"
        elif kind == "query":
            assert not isinstance(reply, Description)
            self._write_client((reply.simple() if isinstance(reply, Result) else reply)
                               + pg.ready_for_query(self.transaction_status))
        elif isinstance(reply, bytes):
            self._write_client(reply)
            self._skipping = True  # an error: the rest of the batch is skipped, up to Sync
        elif isinstance(reply, Description) and kind == "describe statement":
            self._write_client(pg.parameter_description(list(reply.parameter_types))
                               + Result(reply.columns).description())
        else:
            state = self._proxy_portals[portal]  # no message was routed meanwhile: it is still there
            if isinstance(reply, Description):
                self._write_client(self._portal_description(state, reply.columns))
            else:
                assert isinstance(reply, Result)
                state.result = reply
                if kind == "describe and answer":
                    self._write_client(self._portal_description(state, reply.columns))
                else:
                    self._write_client(self._portal_rows(state, max_rows))
        self._pump()

    # -- cursors (see cursors.py) ----------------------------------------------------------

    def _write_client(self, data: bytes) -> None:
        """Whole messages for the client, followed on their way (cursors' life time, a Script's ReadyForQuery)."""
        data, over = follow(data, self._cursors, self._script)
        if over:
            self._end_script()
        if data:
            self._client(data)

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

    def _route_script(self, raw: bytes, script: Script) -> Route:
        """Several statements in one Query with cursor statements among them: as they are to the client's connection
        when the proxy holds none of their cursors, else one by one (parts queued as b"q")."""
        if not any(self._for_cursors(decision) for _, decision in script.parts):
            for _, decision in script.parts:
                if isinstance(decision, DeclareCursor):
                    self._cursors.passing(decision)
            resets = sum(isinstance(decision, Pass) and decision.resets_session for _, decision in script.parts)
            return Route(Owner.UPSTREAM, raw, ends_batch=True, resets=resets)
        return Route(Owner.LOCAL, b"", in_batch=False, script=script)

    def _for_cursors(self, decision: Decision) -> bool:
        """Whether a statement needs the proxy's cursors (else it goes to the client's connection as it is)."""
        if isinstance(decision, DeclareCursor):
            return not isinstance(decision.query, Pass) or self._cursors.held(decision.name)
        return isinstance(decision, (FetchCursor, CloseCursor)) and self._cursors.held(decision.name)

    def _route_part(self) -> Route:
        assert self._script is not None
        text, decision = self._script.parts.popleft()
        raw = pg.query_message(text)
        if isinstance(decision, Pass):
            route = Route(Owner.UPSTREAM, raw, ends_batch=True, resets=decision.resets_session)
        else:
            route = self._route_cursor(raw, decision, block=True)
        return _recorded(route, text, decision)

    def _route_cursor(self, raw: bytes, decision: Decision, block: bool) -> Route:
        """DECLARE, FETCH, MOVE or CLOSE in a Query (``block``: inside the implicit block of a Script)."""
        status = self.transaction_status
        if not self._for_cursors(decision):
            if isinstance(decision, DeclareCursor):
                self._cursors.passing(decision)
            return Route(Owner.UPSTREAM, raw, ends_batch=True)
        if isinstance(decision, DeclareCursor):
            reject = self._cursors.can_declare(decision.name, decision.hold, status, block)
            if reject is not None:
                return self._refuse(reject, simple=True)
            if isinstance(decision.query, Rewrite):
                return Route(Owner.SERVICE, pg.query_message(decision.query.sql), ends_batch=True, declares=decision)
            return Route(Owner.PROXY, b"", ends_batch=True, request=ProxyRequest(decision.query),
                         asking=("declare", b"", 0), declares=decision)
        if isinstance(decision, FetchCursor):
            answer = self._cursors.fetch(decision, None, status, describe=True)
        else:
            assert isinstance(decision, CloseCursor)
            answer = self._cursors.close(decision, status)
            if decision.name is None and not isinstance(answer, Reject):
                return Route(Owner.UPSTREAM, raw, ends_batch=True)  # PostgreSQL closes its own and answers
        if isinstance(answer, Reject):
            return self._refuse(answer, simple=True)
        return Route(Owner.LOCAL, answer + pg.ready_for_query(status))

    def _cursor_by_name(self, type_: bytes, kind: bytes, name: bytes) -> Route:
        """Describe or Execute of a cursor statement (or its portal) the proxy answers, in the extended protocol."""
        if kind == b"S":
            decision, bind = self._cursor_statements[name], None
        else:
            decision, bind = self._cursor_portals[name]
        fetch = isinstance(decision, FetchCursor) and not decision.move
        if not isinstance(decision, DeclareCursor) and not self._cursors.held(decision.name):
            return self._refuse(Reject("34000", f'cursor "{decision.name}" does not exist',
                                       "A cursor WITHOUT HOLD ends with its transaction; declare it again."))
        if type_ == b"D":
            columns = self._cursors.columns(decision.name) if fetch else ()
            if kind == b"S":
                types = _parameter_types(self._texts[name].rest) if isinstance(decision, DeclareCursor) else ()
                return Route(Owner.LOCAL, pg.parameter_description(list(types)) + Result(columns).description())
            assert bind is not None
            if not fetch:
                return Route(Owner.LOCAL, pg.message(b"n"))  # NoData
            try:
                formats = result_formats(bind.result_formats, len(columns))
                check_formats(columns, formats)
            except FormatError as exc:
                return self._refuse(Reject(exc.sqlstate, str(exc)))
            return Route(Owner.LOCAL, Result(columns).description(formats))
        assert bind is not None
        status = self.transaction_status
        if isinstance(decision, DeclareCursor):
            reject = self._cursors.can_declare(decision.name, decision.hold, status, block=False)
            if reject is not None:
                return self._refuse(reject)
            if isinstance(decision.query, Rewrite):
                # Prepared, bound with the client's values, described and run, unnamed: the answer is kept (and
                # what follows waits for it: it may name the cursor).
                payload = (pg.parse_message(b"", decision.query.sql, self._texts[bind.statement].rest)
                           + pg.message(b"B", unnamed_bind(bind)) + pg.message(b"D", b"P\0") + _EXECUTE_ALL
                           + pg.message(b"H"))  # Flush: the server sends the answer now, before the client's Sync
                return Route(Owner.SERVICE, payload, declares=decision)
            types = _parameter_types(self._texts[bind.statement].rest)
            return Route(Owner.PROXY, b"", request=ProxyRequest(decision.query, parameters=Parameters(
                types, _formats(bind), bind.values)), asking=("declare portal", name, 0), declares=decision)
        if isinstance(decision, FetchCursor):
            answer = self._cursors.fetch(decision, bind.result_formats, status, describe=False)
        else:
            answer = self._cursors.close(decision, status)
            if decision.name is None and not isinstance(answer, Reject):
                # PostgreSQL closes its own and answers (CLOSE CURSOR ALL); its ParseComplete and BindComplete are ours.
                return Route(Owner.UPSTREAM, pg.parse_message(b"", "CLOSE ALL", b"\0\0")
                             + pg.message(b"B", unnamed_bind(bind)) + _EXECUTE_ALL, hidden=(b"1", b"2"))
        if isinstance(answer, Reject):
            return self._refuse(answer)
        return Route(Owner.LOCAL, answer)

    def _declared(self, declare: DeclareCursor, reply: Result | bytes) -> bytes:
        """The answer to a gated DECLARE, its query answered: the cursor is kept (or the error)."""
        if not isinstance(reply, Result):
            return reply
        # A single statement outside a transaction block runs in a transaction of its own, committed at once.
        return self._cursors.declare(declare, reply, self.transaction_status == b"I" and self._script is None)

    def _captured(self, type_: bytes, body: bytes) -> None:
        """A message of the service connection's answer to a gated DECLARE's query."""
        assert self._capture is not None
        answer = self._capture.feed(type_, body)
        if answer is None:
            return
        declare, self._capture = self._capture.declare, None
        self._write_client(answer if isinstance(answer, bytes) else self._declared(declare, answer))
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

    def _timeout_answer(self, type_: bytes, body: bytes) -> None:
        """The answer to our query of the client's statement_timeout and the followed settings the server does
        not report (an error keeps the last values, but see ``_timeout_cancelled``)."""
        if type_ == b"D":
            value, *unreported = pg.parse_data_row(body)
            if value is not None and value.isdigit():
                self._client_timeout = int(value)
            for name, setting in zip(UNREPORTED_SETTINGS, unreported, strict=True):
                if setting is not None and setting.decode() != self._output_settings.get(name):
                    self._settings_to_copy[name] = self._output_settings[name] = setting.decode()
        elif type_ == b"E":
            self._timeout_cancelled = pg.parse_fields(body).get("C") == "57014"
        elif type_ == b"Z":
            self._asking_timeout -= 1
            self.in_flight[Owner.UPSTREAM] -= 1
            self._timeout_was_cancelled(body)
            self._pump()

    def _timeout_was_cancelled(self, status: bytes) -> None:
        """The client's statement_timeout stopped our query of it: it is shorter than that query took (the first
        one of a new backend is the slowest). Read it once more; if that is stopped too (or the failure aborted
        the client's transaction), it is as short as 1 ms for what runs next: any statement would be stopped."""
        cancelled, self._timeout_cancelled = self._timeout_cancelled, False
        if not cancelled:
            self._timeout_reread = False
        elif status == b"I" and not self._timeout_reread:
            self._timeout_reread = True
            self._client_timeout_stale = True
        else:
            self._timeout_reread = False
            self._client_timeout = 1

    def _ready_for_query(self, owner: Owner, status: bytes) -> None:
        self.in_flight[owner] -= 1
        if self._swallow[owner]:
            self._swallow[owner] -= 1  # it answers a Sync of ours
        else:
            self._write_client(pg.ready_for_query(status))
        self._pump()

    # -- dispatch -----------------------------------------------------------------

    def _pump(self) -> None:
        self._dispatch()
        self._flow()
        self._watch_hold()

    def _watch_hold(self) -> None:
        """Start or stop the session's hold timer as a borrowed connection starts or stops waiting for the client
        in an open batch."""
        answering = self._service_awaiting and self._service_flushed  # (unflushed answers wait for the client)
        idle = (self._acquire_service is not None and self._service_held and self._unsynced is Owner.SERVICE
                and not answering and not self.in_flight[Owner.SERVICE] and not self._silenced
                and self._held is None and not self._waiting)
        if idle != self._holding_idle:
            self._holding_idle = idle
            self._hold_timer(idle)

    def _dispatch(self) -> None:
        while self._held is not None or self._queue:
            if self._waiting or self._recording:
                return  # a statement is being analysed, or its row written to the audit trail
            if self._held is None:
                if self.in_flight[Owner.PROXY]:
                    return  # route the next message once the proxy answered: an error skips the rest of the batch
                if self._queue[0][0] == b"q" and any(self.in_flight.values()):
                    return  # the parts of a Script run one after the other
                if self._capture is not None or self._declaring is not None:
                    return  # what follows a gated DECLARE may name its cursor: routed once the cursor is held
                type_, body = self._queue.popleft()
                self._held = self._route(type_, body)
                if self._held is _WAIT:
                    self._held = None
                    self._queue.appendleft((type_, body))
                    self._waiting = True
                    return
                self._queued -= len(body or b"")
                if self._held is None:
                    continue
            route = self._held
            if route.record is not None and self._record is not None:
                self._recording = True
                self._record(route.record)
                return
            if route.in_batch and self._unsynced not in (None, route.owner):
                self._close_batch_part(self._unsynced)
            if any(count for owner, count in self.in_flight.items()
                   if owner is not route.owner or route.declares is not None or route.script is not None):
                return  # wait for the other owner's ReadyForQuery (gated DECLARE, Script: for every answer)
            if self._needs_client_timeout(route):
                self._ask_client_timeout()
                return
            if route.owner is Owner.SERVICE and not self._service_held:
                if not self._acquiring:
                    self._acquiring = True
                    self._acquire_service()  # type: ignore[misc]
                return
            self._held = None
            if route.script is not None:  # its parts go first, one by one; the client sees one ReadyForQuery
                self._script = ScriptRun(deque(route.script.parts), len(route.script.parts))
                self._queue.extendleft([(b"q", b"")] * len(route.script.parts))
                continue
            if route.declares is not None and route.owner is Owner.SERVICE:
                self._capture = self._cursors.capture(route.declares)
            elif route.declares is not None:
                self._declaring = route.declares
            if route.owner is Owner.LOCAL:
                self._write_client(route.payload)
                continue
            if route.owner is Owner.PROXY:
                assert route.request is not None
                self.in_flight[Owner.PROXY] += 1
                self._asking = route.asking
                request = replace(route.request, settings=tuple(self._output_settings.items()))
                if self._time_limit is not None:
                    request = replace(request, timeout_ms=self._statement_timeout())
                self._ask_proxy(request)
                continue
            if route.owner is Owner.SERVICE and self._time_limit is not None and self._unsynced is not Owner.SERVICE:
                timeout = self._statement_timeout()
                if timeout != self._service_timeout:
                    self._settings_to_copy["statement_timeout"] = f"{timeout}ms"
                    self._service_timeout = timeout
            if route.owner is Owner.SERVICE and (self._settings_to_copy or self._reset_service):
                self._copy_settings()
            payload, hidden = self._on_service(route) if route.owner is Owner.SERVICE else (route.payload,
                                                                                           route.hidden)
            self._hidden[route.owner].extend(hidden)
            self._resets_expected += route.resets
            if payload:
                self._send[route.owner](payload)
            if route.owner is Owner.SERVICE:
                types = _types(payload)
                requests = sum(type_ in _REQUESTS for type_ in types)
                self._service_awaiting += requests
                self._service_flushed = types[-1:] == [b"H"] or (self._service_flushed and not requests)
            if route.describes and self._unsynced is not Owner.SERVICE and all(t == b"H" for t, _ in self._queue):
                # A Describe of a statement, alone, the client waiting for it (asyncpg's prepare()): a Sync of
                # ours ends it, so that the connection goes back to the pool; the statement stays prepared there.
                self._close_batch_part(Owner.SERVICE)
                self._describing = True
            elif route.ends_batch:
                self.in_flight[route.owner] += 1
                self._unsynced = None
            elif route.in_batch:
                self._unsynced = route.owner

    def _flow(self) -> None:
        """Stop reading from the client while too much of what it sent waits here; go on once half is gone."""
        if self._queued > QUEUE_LIMIT:  # again each time: the session's own flow control may have resumed it
            self._client_paused = True
            self._pause_client(True)
        elif self._client_paused and self._queued <= QUEUE_LIMIT // 2:
            self._client_paused = False
            self._pause_client(False)

    def _needs_client_timeout(self, route: Route) -> bool:
        """Whether the client's statement_timeout must be read before ``route`` runs something."""
        return (self._time_limit is not None and self._client_timeout_stale
                and route.owner in (Owner.SERVICE, Owner.PROXY) and self._unsynced is not route.owner
                and self.transaction_status != b"E")  # in a failed transaction the query would fail: keep the last

    def _ask_client_timeout(self) -> None:
        self._client_timeout_stale = False
        self._send[Owner.UPSTREAM](_CLIENT_TIMEOUT_QUERY)
        self.in_flight[Owner.UPSTREAM] += 1
        self._asking_timeout += 1

    def _statement_timeout(self) -> int:
        """The client's statement_timeout capped by the policy's limit for the mode, in ms (0: none)."""
        assert self._time_limit is not None
        return min((t for t in (self._client_timeout, self._time_limit()) if t > 0), default=0)

    def _on_service(self, route: Route) -> tuple[bytes, tuple[bytes, ...]]:
        """What goes to the service connection for ``route``, and the answers to hide.

        A statement is prepared there, from the rewrite kept here, just before the first message that uses it
        (the client's Parse was answered here), and again on each connection borrowed later; a named one is
        closed first, in case an older rewrite of it is there. The client sees neither answer.
        """
        payload, hidden = route.payload, route.hidden
        name = route.uses
        if name is not None and name not in self._service_statements and self._statements.get(name) is Owner.SERVICE:
            decision = self._texts[name].decision
            assert isinstance(decision, Rewrite)
            payload = pg.parse_message(name, decision.runs, self._texts[name].rest) + payload
            hidden = (b"1",) + hidden
            if name:
                payload = pg.message(b"C", b"S" + name + b"\0") + payload
                hidden = (b"3",) + hidden
            self._service_statements.add(name)
        if route.closes is not None:
            self._service_statements.discard(route.closes)
        return payload, hidden

    def _copy_settings(self) -> None:
        """The client changed a setting that shapes output (SET DateStyle…): follow it on the service side.
        On a borrowed connection, what the previous session left goes first: its settings (back to the
        connection's own: read-only, the pinned search_path) and its prepared statements."""
        statements = "RESET ALL;DEALLOCATE ALL;" if self._reset_service else ""
        statements += "".join(f"SET {name} TO {_literal(value)};" for name, value in self._settings_to_copy.items())
        self._settings_to_copy.clear()
        self._reset_service = False
        self._send[Owner.SERVICE](pg.query_message(statements))
        self.in_flight[Owner.SERVICE] += 1
        self._silenced += 1

    def _close_batch_part(self, owner: Owner) -> None:
        self._send[owner](SYNC)
        self.in_flight[owner] += 1
        self._swallow[owner] += 1
        self._unsynced = None

    def _route(self, type_: bytes, body: bytes | None) -> Route | None:
        if body is None:  # a Query or Parse longer than max_statement_size, dropped unread
            if self._skipping and type_ == b"P":
                return None
            refusal = self._too_long()
            return replace(self._refuse(refusal, simple=type_ == b"Q"),
                           record=Execution(_NOT_READ, refusal, simple=type_ == b"Q"))
        raw = pg.message(type_, body)
        if type_ == b"S":
            self._skipping = False
            self._describing = False  # the client's batch is over: a failing Describe of ours skips nothing more
            if self.transaction_status == b"I":
                # The implicit transaction ends: its portals go, as in PostgreSQL.
                self._proxy_portals.clear()
                self._bound.clear()
            if self._unsynced is not None:
                return Route(self._unsynced, raw, ends_batch=True)
            return Route(Owner.LOCAL, pg.ready_for_query(self.transaction_status))
        if self._skipping and type_ in b"PBDECH":
            return None
        if type_ == b"q":
            return self._route_part()
        if type_ == b"Q":
            sql = _text(body[:-1])
            if isinstance(sql, Reject):
                return replace(self._refuse(sql, simple=True), record=Execution(_undecodable(body[:-1]), sql))
            decided = self._decision(sql)
            if decided is None:
                return _WAIT
            return _recorded(self._route_query(raw, decided.decision), sql, decided.decision)
        if type_ == b"P":
            return self._route_parse(raw, body)
        if type_ == b"B":
            return self._route_bind(raw, body)
        if type_ == b"D" or type_ == b"C" or type_ == b"E":
            return self._route_by_name(type_, body, raw)
        if type_ == b"H":
            return Route(self._unsynced or Owner.LOCAL, raw if self._unsynced else b"")
        if type_ == b"F":
            return self._refuse(Reject("42501", "function calls by the fast-path protocol are not allowed",
                                       "Call functions in a SELECT statement."), simple=True)
        # COPY data, Terminate, and anything else: the client's own connection (and its checks).
        return Route(Owner.UPSTREAM, raw, in_batch=False)

    def _decision(self, sql: str) -> _Decided | None:
        """The decision on ``sql`` under the policy in force; None: being analysed (``decided`` follows)."""
        version = self._version()
        if self._analysed is not None and self._analysed[0] == sql:
            _, decision, decided_under = self._analysed
            self._analysed = None
            if decided_under == version:
                return _Decided(sql, decision, version)
        decision = self._decide(sql)
        return None if decision is None else _Decided(sql, decision, version)

    def _too_long(self) -> Reject:
        mode = self._settings().get("mode", "an anonymized")
        return Reject("54000", f"statement too long: anonproxy accepts statements of up to "
                               f"{self._max_statement_size} bytes from roles in {mode} mode",
                      "Shorten the statement (a long list of values is the usual cause); the limit is the "
                      "proxy's max_statement_size setting.")

    def _route_query(self, raw: bytes, decision: Decision) -> Route:
        if isinstance(decision, Pass):
            if decision.deallocates is not None:
                self._deallocated(decision.deallocates)
            return Route(Owner.UPSTREAM, raw, ends_batch=True, resets=decision.resets_session)
        if isinstance(decision, Relayed):
            return Route(Owner.UPSTREAM, pg.query_message(decision.sql), ends_batch=True)
        if isinstance(decision, Script):
            return self._route_script(raw, decision)
        if isinstance(decision, (DeclareCursor, FetchCursor, CloseCursor)):
            return self._route_cursor(raw, decision, block=False)
        if isinstance(decision, Rewrite):
            if self.transaction_status == b"E":
                return self._refuse(_ABORTED, simple=True)
            return Route(Owner.SERVICE, pg.query_message(decision.runs), ends_batch=True)
        if _for_proxy(decision):
            if self.transaction_status == b"E":
                return self._refuse(_ABORTED, simple=True)
            return Route(Owner.PROXY, b"", ends_batch=True, request=ProxyRequest(decision))
        if isinstance(decision, Intercept):
            answer = self._show(decision.setting)
            if isinstance(answer, Reject):
                return self._refuse(answer, simple=True)
            return Route(Owner.LOCAL, b"".join(answer) + pg.ready_for_query(self.transaction_status))
        assert isinstance(decision, Reject)
        return self._refuse(decision, simple=True)

    def _route_parse(self, raw: bytes, body: bytes) -> Route:
        name, offset = pg.read_cstring(body)
        text, offset = pg.read_cstring(body, offset)
        sql = _text(text)
        if isinstance(sql, Reject):
            return _recorded(self._prepare(name, _Decided("", sql, self._version()), raw), _undecodable(text), sql,
                             simple=False)
        decided = self._decision(sql)
        if decided is None:
            return _WAIT
        route = self._prepare(name, replace(decided, rest=body[offset:]), raw)
        # Only a refusal is recorded at Parse: what runs is recorded at each Bind, with its values.
        return route if route.refusal is None else _recorded(route, sql, route.refusal, simple=False)

    def _prepare(self, name: bytes, decided: _Decided, raw: bytes | None) -> Route:
        """Where statement ``name`` now belongs, and the route of its Parse (``raw``: the client's; None: ours)."""
        decision = decided.decision
        if self.transaction_status == b"E" and not isinstance(decision, (Pass, Relayed, Intercept, Reject)):
            return self._refuse(_ABORTED)  # as PostgreSQL: the statement of that name, if any, stays
        if name and name not in self._texts and not isinstance(decision, Reject):
            reject = self._no_room(name, decided)
            if reject is not None:
                return self._refuse(reject)
        self._statement_settings.pop(name, None)
        self._proxy_statements.pop(name, None)
        self._cursor_statements.pop(name, None)
        if isinstance(decision, Script):
            decision = Reject("42601", "cannot insert multiple commands into a prepared statement")
        elif isinstance(decision, (DeclareCursor, FetchCursor, CloseCursor)):
            if not self._for_cursors(decision):
                decided = replace(decided, decision=Pass())  # a cursor on the client's own connection
                decision = decided.decision
            else:
                self._texts[name] = decided
                self._statements[name] = Owner.LOCAL
                self._cursor_statements[name] = decision
                return Route(Owner.LOCAL, pg.message(b"1"))  # ParseComplete
        if isinstance(decision, Reject):
            self._statements.pop(name, None)
            self._texts.pop(name, None)
            return self._refuse(decision)
        self._texts[name] = decided
        if isinstance(decision, Pass):
            self._statements[name] = Owner.UPSTREAM
            return Route(Owner.UPSTREAM, raw or pg.parse_message(name, decided.sql, decided.rest))
        if isinstance(decision, Relayed):  # the client's parameter types go with the rewritten text
            self._statements[name] = Owner.UPSTREAM
            return Route(Owner.UPSTREAM, pg.parse_message(name, decision.sql, decided.rest))
        if isinstance(decision, Rewrite):
            # Prepared on the service connection when a message first uses it (``_on_service``): a Parse alone
            # borrows no connection.
            self._statements[name] = Owner.SERVICE
            self._service_statements.discard(name)
            return Route(Owner.LOCAL, pg.message(b"1"))  # ParseComplete
        if _for_proxy(decision):
            self._statements[name] = Owner.PROXY
            self._proxy_statements[name] = (decision, _parameter_types(decided.rest))
            return Route(Owner.LOCAL, pg.message(b"1"))  # ParseComplete
        assert isinstance(decision, Intercept)
        self._statements[name] = Owner.LOCAL
        self._statement_settings[name] = decision.setting
        return Route(Owner.LOCAL, pg.message(b"1"))

    def _no_room(self, name: bytes, decided: _Decided) -> Reject | None:
        """Why a new named statement cannot be kept (too many, or too many bytes, for the session's limits)."""
        limits = self._limits
        named = [(key, kept) for key, kept in self._texts.items() if key]
        if len(named) >= limits.statements:
            return Reject("54000", f"too many prepared statements: anonproxy keeps at most {limits.statements} per "
                                   "session", "Close (or DEALLOCATE) the statements you no longer need; the limit is "
                                              "the proxy's max_prepared_statements setting.")
        size = sum(_statement_size(key, kept) for key, kept in named) + _statement_size(name, decided)
        if size > limits.statement_size:
            return Reject("54000", f"prepared statements too large: this session's would take {size_text(size)}; "
                                   f"anonproxy keeps at most {size_text(limits.statement_size)} of them per session",
                          "Close (or DEALLOCATE) the statements you no longer need; the limit is the proxy's "
                          "max_prepared_size setting.")
        return None

    def _deallocated(self, deallocate: Deallocate) -> None:
        """A DEALLOCATE that goes to the client's connection: PostgreSQL's statements of that name (or all of them)
        are forgotten here too, so that they no longer count against the session's limits (not in a failed
        transaction, where PostgreSQL refuses it; elsewhere it is not undone by a rollback)."""
        if self.transaction_status == b"E":
            return
        if deallocate.name is None:
            names = [key for key, owner in self._statements.items() if owner is Owner.UPSTREAM]
        else:
            names = [deallocate.name.encode()]
        for key in names:
            if self._statements.get(key) is Owner.UPSTREAM:
                del self._statements[key]
                self._texts.pop(key, None)

    def _route_bind(self, raw: bytes, body: bytes) -> Route:
        """A Bind: one execution of a statement, recorded in the audit trail with its values (the proxy's own
        answers are recorded when answered)."""
        route = self._bind(raw, body)
        statement = pg.read_cstring(body, pg.read_cstring(body)[1])[0]
        bound = self._texts.get(statement)
        if route is _WAIT or route.owner is Owner.PROXY or (bound is None and route.refusal is None):
            return route
        if route.refusal is None and bound is not None and (statement in self._proxy_statements or (
                isinstance(bound.decision, DeclareCursor) and _for_proxy(bound.decision.query))):
            return route  # recorded when the proxy answers it
        if bound is None:
            return _recorded(route, "", Pass(), simple=False)  # refused: no such statement
        return _recorded(route, bound.sql, bound.decision, _bound_values(body, _parameter_types(bound.rest)),
                         simple=False)

    def _bind(self, raw: bytes, body: bytes) -> Route:
        portal, offset = pg.read_cstring(body)
        statement, _ = pg.read_cstring(body, offset)
        again: Route | None = None  # the statement prepared again under a new policy
        prepared = self._texts.get(statement)
        if prepared is not None and prepared.version != self._version():
            fresh = self._decision(prepared.sql)
            if fresh is None:
                return _WAIT
            fresh = replace(fresh, rest=prepared.rest)
            if fresh.decision == prepared.decision:
                self._texts[statement] = fresh
            elif isinstance(fresh.decision, Reject):
                return self._refuse(fresh.decision)  # and again at the next Bind, while the policy says so
            else:
                again = self._prepare(statement, fresh, None)
                if self._skipping:
                    return again  # refused (a failed transaction)
        owner = self._portals[portal] = self._statements.get(statement, Owner.UPSTREAM)
        self._proxy_portals.pop(portal, None)
        self._cursor_portals.pop(portal, None)
        bound = self._texts.get(statement)
        if bound is not None:
            self._bound[portal] = bound
        else:
            self._bound.pop(portal, None)
        if owner is Owner.PROXY:
            return self._bind_proxy(body)
        if owner is Owner.SERVICE or (owner is not Owner.LOCAL and again is None):
            return Route(owner, raw, uses=statement)  # (prepared again on the service side: ``_on_service``)
        if owner is not Owner.LOCAL:
            # Close the old statement (a named one would clash), prepare the new one, bind it: the client sees
            # only the BindComplete.
            assert again is not None
            close = pg.message(b"C", b"S" + statement + b"\0") if statement else b""
            return Route(owner, close + again.payload + raw, hidden=(b"3",) * bool(close) + (b"1",))
        if statement in self._cursor_statements:
            bind = pg.parse_bind(body)
            self._cursor_portals[portal] = (self._cursor_statements[statement], bind)
        else:
            self._portal_settings[portal] = self._statement_settings[statement]
        return Route(Owner.LOCAL, pg.message(b"2"))  # BindComplete

    def _route_by_name(self, type_: bytes, body: bytes, raw: bytes) -> Route:
        """Describe, Close, Execute: to the owner of the statement or portal they name."""
        if type_ == b"E":
            kind, (name, _) = b"P", pg.read_cstring(body)
            bound = self._bound.get(name)
            if bound is not None and bound.version != self._version():
                fresh = self._decision(bound.sql)
                if fresh is None:
                    return _WAIT
                if fresh.decision != bound.decision:
                    return self._refuse(fresh.decision if isinstance(fresh.decision, Reject) else Reject(
                        "55000", f'the privacy policy changed after portal "{name.decode(errors="replace")}" '
                                 "was bound", "Bind the statement again: it is then decided under the new policy."))
                self._bound[name] = replace(bound, version=fresh.version)
        else:
            kind, (name, _) = body[:1], pg.read_cstring(body, 1)
        names, settings = (self._statements, self._statement_settings) if kind == b"S" else \
            (self._portals, self._portal_settings)
        if type_ == b"D" and kind == b"P" and name not in names and self._cursors.held(_text_or_empty(name)):
            return Route(Owner.LOCAL, self._cursors.describe(_text_or_empty(name)))  # psycopg's named cursors
        owner = names.get(name, Owner.UPSTREAM)
        if type_ == b"C":
            names.pop(name, None)
            (self._texts if kind == b"S" else self._bound).pop(name, None)
        decided = (self._texts if kind == b"S" else self._bound).get(name)
        if owner is Owner.PROXY:
            route = self._proxy_by_name(type_, kind, name, body)
            return route if decided is None else _with_text(route, decided.sql)
        if type_ == b"C" and owner is Owner.SERVICE and not (
                self._service_held and (kind == b"P" or name in self._service_statements)):
            self._service_statements.discard(name)
            return Route(Owner.LOCAL, pg.message(b"3"))  # CloseComplete: not on the connection held, if any
        if owner is not Owner.LOCAL:
            on_statement = name if kind == b"S" else None
            bound = self._bound.get(name) if type_ == b"E" else None
            resets = bound is not None and isinstance(bound.decision, Pass) and bound.decision.resets_session
            return Route(owner, raw, uses=on_statement if type_ == b"D" else None,
                         closes=on_statement if type_ == b"C" else None, resets=resets,
                         describes=type_ == b"D" and kind == b"S" and owner is Owner.SERVICE)
        if type_ == b"C":
            settings.pop(name, None)
            (self._cursor_statements if kind == b"S" else self._cursor_portals).pop(name, None)
            return Route(Owner.LOCAL, pg.message(b"3"))  # CloseComplete
        if name in (self._cursor_statements if kind == b"S" else self._cursor_portals):
            route = self._cursor_by_name(type_, kind, name)
            return route if decided is None else _with_text(route, decided.sql)
        answer = self._show(settings[name])
        if isinstance(answer, Reject):
            return self._refuse(answer)
        description, rows = answer
        if type_ == b"E":
            return Route(Owner.LOCAL, rows)
        no_parameters = pg.message(b"t", struct.pack("!h", 0)) if kind == b"S" else b""
        return Route(Owner.LOCAL, no_parameters + description)

    def _bind_proxy(self, body: bytes) -> Route:
        bind = pg.parse_bind(body)
        decision, types = self._proxy_statements[bind.statement]
        self._proxy_portals[bind.portal] = _ProxyPortal(decision, Parameters(types, _formats(bind), bind.values),
                                                        bind.result_formats)
        return Route(Owner.LOCAL, pg.message(b"2"))  # BindComplete

    def _proxy_by_name(self, type_: bytes, kind: bytes, name: bytes, body: bytes) -> Route:
        """Describe, Close or Execute of a statement or portal the proxy answers."""
        if type_ == b"C":
            (self._proxy_statements if kind == b"S" else self._proxy_portals).pop(name, None)
            return Route(Owner.LOCAL, pg.message(b"3"))  # CloseComplete
        if kind == b"S":
            decision, types = self._proxy_statements[name]
            columns = fixed_columns(decision)
            if columns is None:
                return Route(Owner.PROXY, b"", request=ProxyRequest(decision, True, Parameters(types)),
                             asking=("describe statement", name, 0))
            return Route(Owner.LOCAL, pg.parameter_description(list(types)) + Result(columns).description())
        state = self._proxy_portals.get(name)
        if state is None:  # ended with its transaction
            return self._refuse(Reject("34000", f'portal "{name.decode(errors="replace")}" does not exist'))
        if type_ == b"E":
            max_rows = pg.parse_execute(body)[1]
            if state.result is not None:  # a suspended portal goes on; a finished one has no more rows
                return Route(Owner.LOCAL, self._portal_rows(state, max_rows))
            return Route(Owner.PROXY, b"", request=ProxyRequest(state.decision, parameters=state.parameters),
                         asking=("execute", name, max_rows))
        columns = state.result.columns if state.result is not None else fixed_columns(state.decision)
        if columns is None and self._queue and self._queue[0][0] == b"E" \
                and pg.parse_execute(self._queue[0][1])[0] == name:
            # Execute follows in the same batch (libpq, pgjdbc): one trip for both; the Execute sends the rows.
            return Route(Owner.PROXY, b"", request=ProxyRequest(state.decision, parameters=state.parameters),
                         asking=("describe and answer", name, 0))
        if columns is None:
            return Route(Owner.PROXY, b"", request=ProxyRequest(state.decision, True, state.parameters),
                         asking=("describe portal", name, 0))
        return Route(Owner.LOCAL, self._portal_description(state, columns))

    def _portal_description(self, state: _ProxyPortal, columns: tuple[Column, ...]) -> bytes:
        try:
            formats = result_formats(state.formats, len(columns))
            check_formats(columns, formats)
        except FormatError as exc:
            self._skipping = True
            return pg.error_response(exc.sqlstate, str(exc))
        return Result(columns).description(formats)

    def _portal_rows(self, state: _ProxyPortal, max_rows: int) -> bytes:
        """The next rows of an executed portal: all, or ``max_rows`` then PortalSuspended if more remain
        (the answer's notices come with its first rows)."""
        result = state.result
        assert result is not None
        try:
            formats = result_formats(state.formats, len(result.columns))
            check_formats(result, formats)
            start = state.sent
            stop = len(result.rows) if max_rows <= 0 else min(len(result.rows), start + max_rows)
            rows = result.data_rows(formats, start, stop)
        except FormatError as exc:
            self._skipping = True
            return pg.error_response(exc.sqlstate, str(exc))
        state.sent = stop
        notices = b"" if state.notified else result.notices
        state.notified = True
        if stop < len(result.rows):
            return rows + pg.message(b"s") + notices  # PortalSuspended
        return rows + result.command_complete(stop - start) + notices

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
            return Route(Owner.LOCAL, error + pg.ready_for_query(self.transaction_status), refusal=reject)
        self._skipping = True
        return Route(Owner.LOCAL, error, refusal=reject)


def _text(sql: bytes) -> str | Reject:
    """A statement's text; not valid UTF-8 is refused as PostgreSQL does, never read with replacement characters."""
    try:
        return sql.decode("utf-8")
    except UnicodeDecodeError as exc:
        first = sql[exc.start]
        # Like PostgreSQL, show the bytes of the character the first byte announces.
        length = 2 if first >> 5 == 0b110 else 3 if first >> 4 == 0b1110 else 4 if first >> 3 == 0b11110 else 1
        shown = " ".join(f"0x{byte:02x}" for byte in sql[exc.start: exc.start + length])
        return Reject("22021", f'invalid byte sequence for encoding "UTF8": {shown}',
                      "anonproxy reads the statements of anonymized roles as UTF-8; send them in UTF-8.")


def _recorded(route: Route, sql: str, decision: Decision, parameters: Parameters = Parameters(),
              simple: bool = True) -> Route:
    """``route`` with the audit trail's record of the statement, unless the proxy answers it (recorded when
    answered) or it is run part by part (each part is recorded)."""
    if route is _WAIT or route.script is not None:
        return route
    if route.owner is Owner.PROXY:
        return _with_text(route, sql)
    return replace(route, record=Execution(sql, route.refusal or decision, parameters, simple))


def _with_text(route: Route, sql: str) -> Route:
    """A PROXY route whose request carries the client's text of its statement (for the audit trail)."""
    return route if route.request is None else replace(route, request=replace(route.request, sql=sql))


def _bound_values(body: bytes, types: tuple[int, ...]) -> Parameters:
    """A Bind's parameter values, with one format code each and the types its statement declared."""
    bind = pg.parse_bind(body)
    return Parameters(types, _formats(bind), bind.values)


def _formats(bind: pg.Bind) -> tuple[int, ...]:
    """One format code per parameter value (a Bind may give one for all, or none: text)."""
    if len(bind.parameter_formats) == 1:
        return bind.parameter_formats * len(bind.values)
    return bind.parameter_formats or (0,) * len(bind.values)


def _undecodable(sql: bytes) -> str:
    """A statement's text that is not valid UTF-8, for the audit trail: invalid bytes replaced."""
    return sql.decode("utf-8", errors="replace")


def _types(payload: bytes) -> list[bytes]:
    """The types of the messages in ``payload``, in order."""
    types, offset = [], 0
    while offset < len(payload):
        types.append(payload[offset:offset + 1])
        offset += 1 + struct.unpack_from("!i", payload, offset + 1)[0]
    return types


# Batch messages the server answers (Parse, Bind, Describe, Execute, Close), once the batch is flushed or synced.
_REQUESTS = (b"P", b"B", b"D", b"E", b"C")


# The answer that completes each of those messages (ParseComplete, BindComplete, a Describe's RowDescription or
# NoData, an Execute's CommandComplete, PortalSuspended or EmptyQueryResponse, CloseComplete).
_LAST_ANSWERS = (b"1", b"2", b"T", b"n", b"C", b"s", b"I", b"3")


def _statement_size(name: bytes, decided: _Decided) -> int:
    """About the bytes a prepared statement holds here: its name, text and parameter types, and its rewrite."""
    decision = decided.decision
    rewrite = len(decision.runs) if isinstance(decision, Rewrite) else 0
    return len(name) + len(decided.sql) + len(decided.rest) + rewrite


def _text_or_empty(name: bytes) -> str:
    try:
        return name.decode()
    except UnicodeDecodeError:
        return ""


def _parameter_types(rest: bytes) -> tuple[int, ...]:
    """The parameter type OIDs of a Parse message, from what follows its text."""
    return pg.parse_parse(b"\0\0" + rest).parameter_types  # an unnamed statement with an empty text


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


# SHOW anonproxy.<these> need the ledger or the session's dp settings: answered by the session.
PROXY_SETTINGS = frozenset({"budget", "epsilon", "delta"})
EXPLAIN_COLUMNS = (Column("QUERY PLAN", 25),)
_NOT_READ = "(not read: longer than the proxy's max_statement_size)"
_ABORTED = Reject("25P02", "current transaction is aborted, commands ignored until end of transaction block")
# pg_settings gives the value in milliseconds, whatever unit it was set in.
_CLIENT_TIMEOUT_QUERY = pg.query_message(
    "select s.setting" + "".join(f", pg_catalog.current_setting({_literal(name)})" for name in UNREPORTED_SETTINGS)
    + " from pg_catalog.pg_settings s where s.name operator(pg_catalog.=) 'statement_timeout'")


def _for_proxy(decision: Decision) -> bool:
    return isinstance(decision, (Noisy, ExplainDP, ExplainSuppress, SessionSetting)) or (
        isinstance(decision, Intercept) and decision.setting in PROXY_SETTINGS)


def fixed_columns(decision: Decision) -> tuple[Column, ...] | None:
    """The result columns of a proxy decision, when they do not depend on the query (None: a dp query's)."""
    if isinstance(decision, Intercept):
        return (Column(f"anonproxy.{decision.setting}", 25),)
    if isinstance(decision, SessionSetting):
        return ()
    if isinstance(decision, (ExplainDP, ExplainSuppress)):
        return EXPLAIN_COLUMNS
    return None


def _rows(command_complete: bytes) -> int | None:
    """The row count a CommandComplete tag ends with (SELECT 3, FETCH 3), if any."""
    words = command_complete.rstrip(b"\0").split()
    return int(words[-1]) if len(words) >= 2 and words[-1].isdigit() else None
