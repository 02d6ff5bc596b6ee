"""What each client message of a gated session does: its route (gate_routes.Route), read from the table of
protocol states and transitions (gate_states.py), for the gate (gate.py) to send on in order.

A Query goes where its decision says; the extended protocol's messages follow their statement or portal
(prepared.py): a Parse is prepared where its decision belongs (on the client's connection, on the service
connection from the rewrite kept here, or answered by the gate or the proxy), and Bind, Describe, Execute and
Close go to the owner of what they name. For statements the proxy answers, the router plays the server's part:
ParseComplete, BindComplete (keeping the bound values), Describe (a request for the column types of a dp query
— unless an Execute of the same portal follows in the batch: then the answer is asked for at once), Execute (a
request for the answer, once per portal, then its rows: proxy_portals.py), CloseComplete. A rewritten portal
executed with a row limit, or in a later batch than its Bind, is run again from its Bind and kept (``_keep``;
proxy_portals.py; one read to its end in its Bind's batch is never run again: SELECT 0), then answered here, until
a transaction statement routed to the client's connection ends it as it ends PostgreSQL's portals
(prepared.Prepared.transaction_control); in a failed transaction it gets 25P02. Described in a later batch than
its Bind, before that, it is bound again on the service side and described there (``_describe_again``). A
DEALLOCATE of a statement not on the client's connection is answered here (``_deallocate``). Cursor statements are
routed by gate_cursors.py. A refusal of a batch's message skips the rest of the batch, up to Sync.

Policy changes reach prepared statements: each remembers its text and the policy version it was decided under.
A Bind of a statement decided under an older version decides it again; a refusal answers the Bind, and a new
decision prepares it again where it now belongs (a Close and a Parse with the new rewrite, whose answers the
client does not see, go before the Bind), so SQL rewritten under the old policy never runs again. An Execute of a
portal bound under an older version runs only if the decision did not change.

A statement with ``$n`` where the plan needs a constant (AtBind, anonproxy.plan.bind_values) is prepared with its
decision for representative values (what Parse and a Describe before Bind answer) and decided again at each Bind
for the values bound (bind_time.py: the statement written with them as constants, decided like any text, so a
value class is analysed once and found in the cache after); a decision that differs from the one prepared
prepares the statement again the same way, and a refusal answers the Bind.

No I/O: what the router needs of the gate's state comes with each message (``Now``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from ..plan.refusals import Reject
from ..route import reports
from ..route.decision import (
    AtBind,
    CloseCursor,
    Deallocate,
    Decision,
    DeclareCursor,
    FetchCursor,
    Intercept,
    Pass,
    Relayed,
    Rewrite,
    Script,
)
from ..route.reports import fixed_columns
from ..wire import protocol as pg
from ..wire.results import Result
from . import bind_time, gate_cursors, proxy_portals
from .cursors import Cursors, ScriptRun
from .gate_routes import (
    WAIT,
    Decided,
    Execution,
    Owner,
    Parameters,
    ProxyRequest,
    Route,
    bound_values,
    formats,
    parameter_types,
    recorded,
    text,
    text_or_empty,
    undecodable,
    with_text,
)
from .gate_states import AFTER_ERROR, Action, State, transition
from .limits import MemoryLimits
from .prepared import Prepared
from .proxy_portals import ProxyPortal
from .service_side import ServiceSide

_NOT_READ = "(not read: longer than the proxy's max_statement_size)"
_ABORTED = Reject("25P02", "current transaction is aborted, commands ignored until end of transaction block")


class Now(NamedTuple):
    """What the router needs of the gate's state when a message is routed (a tuple: made for every message)."""

    status: bytes = b"I"  # the client's transaction status
    unsynced: Owner | None = None  # the owner of the batch's open part (messages sent since the last Sync)
    following: tuple[bytes, bytes | None] | None = None  # the next client message waiting, if any
    script: ScriptRun | None = None  # the Query being run part by part, if any


class Router:
    def __init__(self, decide: Callable[[str], Decision | None], version: Callable[[], int],
                 settings: Callable[[], dict[str, str]], max_statement_size: int, limits: MemoryLimits,
                 prepared: Prepared, cursors: Cursors, service: ServiceSide) -> None:
        self._decide = decide  # None: being analysed, ``decided`` follows
        self._version = version  # of the policy in force
        self._settings = settings
        self._max_statement_size = max_statement_size
        self._limits = limits
        self._prepared = prepared
        self._cursors = cursors
        self._service = service
        self._state = State.IDLE
        self._now = Now()
        self._analysed: tuple[str, Decision, int] | None = None  # the decision ``decided`` brought
        self._bound_in_batch: set[bytes] = set()  # portals bound on the service side since the client's last Sync
        self._actions: dict[Action, Callable[[bytes, bytes | None], Route | None]] = {
            Action.QUERY: self._route_query, Action.PARSE: self._route_parse, Action.BIND: self._route_bind,
            Action.BY_NAME: self._route_by_name, Action.SYNC: self._route_sync, Action.FLUSH: self._route_flush,
            Action.SCRIPT_PART: self._route_part, Action.REFUSE_FUNCTION_CALL: self._refuse_function_call,
            Action.RELAY: self._relay, Action.PROTOCOL_ERROR: self._relay, Action.SKIP: lambda type_, body: None,
        }

    def route(self, type_: bytes, body: bytes | None, now: Now) -> Route | None:
        """The route of one client message (None: nothing to send; WAIT: its decision is not known yet), the
        protocol state moved on by the table."""
        self._now = now
        action, self._state = transition(self._state, type_)
        return self._actions[action](type_, body)

    def decided(self, sql: str, decision: Decision, version: int) -> None:
        """The decision the session could not give at once: used when the message that waited is routed again."""
        self._analysed = (sql, decision, version)

    def failed(self) -> None:
        """An ErrorResponse answered a message of the batch: the rest of it is skipped, up to Sync."""
        self._state = AFTER_ERROR

    def refuse(self, reject: Reject, simple: bool, status: bytes) -> Route:
        """The route of a refusal: with ReadyForQuery (``simple``: of a Query), else of a batch's message, whose
        rest is then skipped."""
        error = pg.error_response(reject.sqlstate, reject.message, hint=reject.hint)
        if simple:
            return Route(Owner.LOCAL, error + pg.ready_for_query(status), refusal=reject)
        self.failed()
        return Route(Owner.LOCAL, error, refusal=reject)

    def _route_sync(self, type_: bytes, body: bytes | None) -> Route:
        self._bound_in_batch.clear()
        if self._now.status == b"I":
            self._prepared.transaction_ended()
        if self._now.unsynced is not None:
            return Route(self._now.unsynced, pg.message(type_, body or b""), ends_batch=True)
        return Route(Owner.LOCAL, pg.ready_for_query(self._now.status))

    def _route_flush(self, type_: bytes, body: bytes | None) -> Route:
        return Route(self._now.unsynced or Owner.LOCAL, pg.message(type_, body or b"") if self._now.unsynced else b"")

    def _refuse_function_call(self, type_: bytes, body: bytes | None) -> Route:
        return self._refuse(Reject("42501", "function calls by the fast-path protocol are not allowed",
                                   "Call functions in a SELECT statement."), simple=True)

    def _relay(self, type_: bytes, body: bytes | None) -> Route:
        """COPY data, Terminate, and anything else: the client's own connection (and its checks)."""
        assert body is not None
        return Route(Owner.UPSTREAM, pg.message(type_, body), in_batch=False)

    def _too_long(self, simple: bool) -> Route:
        """The refusal of a Query or Parse longer than max_statement_size, dropped unread."""
        mode = self._settings().get("mode", "an anonymized")
        refusal = Reject("54000", f"statement too long: anonproxy accepts statements of up to "
                                  f"{self._max_statement_size} bytes from roles in {mode} mode",
                         "Shorten the statement (a long list of values is the usual cause); the limit is the "
                         "proxy's max_statement_size setting.")
        return replace(self._refuse(refusal, simple=simple), record=Execution(_NOT_READ, refusal, simple=simple))

    def _bound_too_long(self) -> Reject:
        """The refusal of a Bind whose values, written into its statement as constants, make a text longer than
        max_statement_size: the analysis reads no longer text than a client may send."""
        mode = self._settings().get("mode", "an anonymized")
        return Reject("54000", f"statement too long with its bound values: anonproxy accepts statements of up to "
                               f"{self._max_statement_size} bytes from roles in {mode} mode, values bound where a "
                               f"constant is needed (a LIKE pattern, a unit, a format) included",
                      "Bind a shorter value; the limit is the proxy's max_statement_size setting.")

    def _decision(self, sql: str) -> Decided | None:
        """The decision on ``sql`` under the policy in force; None: being analysed (``decided`` follows)."""
        version = self._version()
        if self._analysed is not None and self._analysed[0] == sql:
            _, decision, decided_under = self._analysed
            self._analysed = None
            if decided_under == version:
                return Decided(sql, decision, version)
        fresh = self._decide(sql)
        return None if fresh is None else Decided(sql, fresh, version)

    def _route_query(self, type_: bytes, body: bytes | None) -> Route:
        self._prepared.deallocated(b"")  # PostgreSQL drops the unnamed statement at every Query, before anything
        if body is None:
            return self._too_long(simple=True)
        sql = text(body[:-1])
        if isinstance(sql, Reject):
            return replace(self._refuse(sql, simple=True), record=Execution(undecodable(body[:-1]), sql))
        decided = self._decision(sql)
        if decided is None:
            return WAIT
        return recorded(self._query_route(pg.message(type_, body), decided.decision), sql, decided.decision)

    def _query_route(self, raw: bytes, decision: Decision) -> Route:
        """Where a Query goes, by its decision."""
        if isinstance(decision, Pass):
            return self._pass_query(raw, decision)
        if isinstance(decision, Relayed):
            return Route(Owner.UPSTREAM, pg.query_message(decision.sql), ends_batch=True)
        if isinstance(decision, Script):
            return gate_cursors.script_route(raw, decision, self._cursors)
        if isinstance(decision, (DeclareCursor, FetchCursor, CloseCursor)):
            return self._or_refused(gate_cursors.query_route(raw, decision, self._cursors, self._now.status,
                                                             block=False), simple=True)
        if isinstance(decision, Reject):
            return self._refuse(self._failed_first(decision), simple=True)
        if isinstance(decision, AtBind):  # $n in a Query: PostgreSQL's own refusal
            return self._refuse(Reject("42P02", f"there is no parameter ${decision.slots[0].number}"), simple=True)
        if isinstance(decision, Rewrite) or reports.answered_by_proxy(decision):
            if self._now.status == b"E":
                return self._refuse(_ABORTED, simple=True)
            if isinstance(decision, Rewrite):
                return Route(Owner.SERVICE, pg.query_message(decision.runs), ends_batch=True,
                             query=None if decision.reads_clock else decision.runs)
            return Route(Owner.PROXY, b"", ends_batch=True, request=ProxyRequest(decision))
        assert isinstance(decision, Intercept)
        answer = self._show(decision.setting)
        if isinstance(answer, Reject):
            return self._refuse(answer, simple=True)
        return Route(Owner.LOCAL, b"".join(answer) + pg.ready_for_query(self._now.status))

    def _pass_query(self, raw: bytes, decision: Pass) -> Route:
        if decision.deallocates is not None and self._deallocate(decision.deallocates):
            return Route(Owner.LOCAL, pg.command_complete("DEALLOCATE") + pg.ready_for_query(self._now.status))
        self._transaction_control(decision)
        return Route(Owner.UPSTREAM, raw, ends_batch=True, resets=decision.resets_session)

    def _deallocate(self, deallocate: Deallocate) -> bool:
        """A DEALLOCATE of one statement about to run: the statement of that name is forgotten here. True: it is
        one the client's connection does not hold (rewritten, answered by the proxy or the gate), which the gate
        deallocates itself, answering as PostgreSQL (CommandComplete DEALLOCATE). False: it goes to the client's
        connection, which deallocates its own or answers 26000, and in a failed transaction 25P02 for any name.
        (DEALLOCATE ALL is followed when PostgreSQL completes it: Gate.upstream_message.)"""
        if deallocate.name is None or self._now.status == b"E":
            return False
        name = deallocate.name.encode()
        gated = self._prepared.statements.get(name, Owner.UPSTREAM) is not Owner.UPSTREAM
        self._prepared.deallocated(name)  # a rollback does not undo it, in PostgreSQL either
        return gated

    def _transaction_control(self, decision: Pass) -> None:
        """A statement passed to the client's connection that ends rewritten portals (COMMIT, ROLLBACK TO…): they
        end here when it is sent, so that no message after it, in the same batch or later, reads them."""
        if decision.transaction is not None:
            self._prepared.transaction_control(decision.transaction, failed=self._now.status == b"E")

    def _route_part(self, type_: bytes, body: bytes | None) -> Route:
        """The next statement of a Query run part by part (a Script)."""
        assert self._now.script is not None
        sql, decision = self._now.script.parts.popleft()
        raw = pg.query_message(sql)
        if isinstance(decision, Pass):
            self._transaction_control(decision)
            route = Route(Owner.UPSTREAM, raw, ends_batch=True, resets=decision.resets_session)
        else:
            route = self._or_refused(gate_cursors.query_route(raw, decision, self._cursors, self._now.status,
                                                              block=True), simple=True)
        return recorded(route, sql, decision)

    def _route_parse(self, type_: bytes, body: bytes | None) -> Route:
        if body is None:
            return self._too_long(simple=False)
        name, offset = pg.read_cstring(body)
        raw_text, offset = pg.read_cstring(body, offset)
        sql = text(raw_text)
        if isinstance(sql, Reject):
            return recorded(self._prepare(name, Decided("", sql, self._version()), pg.message(type_, body)),
                            undecodable(raw_text), sql, simple=False)
        decided = self._decision(sql)
        if decided is None:
            return WAIT
        route = self._prepare(name, replace(decided, rest=body[offset:]), pg.message(type_, body))
        # Only a refusal is recorded at Parse: what runs is recorded at each Bind, with its values.
        return route if route.refusal is None else recorded(route, sql, route.refusal, simple=False)

    def _prepare(self, name: bytes, decided: Decided, raw: bytes | None) -> Route:
        """Where statement ``name`` now belongs, and the route of its Parse (``raw``: the client's; None: ours)."""
        decision = decided.decision
        prepared = self._prepared
        if isinstance(decision, Script):  # PostgreSQL checks it first, after the syntax
            decision = Reject("42601", "cannot insert multiple commands into a prepared statement")
        if self._now.status == b"E" and not isinstance(decision, (Pass, Relayed, Intercept, Reject)):
            return self._refuse(_ABORTED)  # as PostgreSQL: the statement of that name, if any, stays
        if raw is not None and name and prepared.statements.get(name) in (Owner.SERVICE, Owner.PROXY, Owner.LOCAL):
            # A name in use, the gate's own (it answered that Parse, so the statement surely exists): PostgreSQL
            # refuses the Parse (the statement's own error, else 42P05) and keeps the statement of that name, and so
            # does the gate with its decision. A name whose Parse went to the client's connection may have failed
            # there: that connection answers, as PostgreSQL (and a Bind of a name the gate forgot gets 26000).
            in_use = Reject("42P05", f'prepared statement "{name.decode(errors="replace")}" already exists')
            return self._refuse(self._failed_first(decision if isinstance(decision, Reject) else in_use))
        if name and name not in prepared.texts and not isinstance(decision, Reject):
            reject = prepared.no_room(name, decided, self._limits)
            if reject is not None:
                return self._refuse(reject)
        prepared.replacing(name)
        if raw is not None:
            prepared.templates.pop(name, None)  # the client prepares it anew
        if isinstance(decision, AtBind):  # decided at each Bind; described, until then, with representative values
            prepared.templates[name] = decided
            decided = Decided(decided.sql, decision.described, decided.version,
                              bind_time.service_rest(decision, decided.rest), decision.representative)
            decision = decided.decision
        if isinstance(decision, (DeclareCursor, FetchCursor, CloseCursor)):
            if gate_cursors.for_cursors(decision, self._cursors):
                prepared.texts[name] = decided
                prepared.statements[name] = Owner.LOCAL
                prepared.cursor_statements[name] = decision
                return Route(Owner.LOCAL, pg.message(b"1"))  # ParseComplete
            decided = replace(decided, decision=Pass())  # a cursor on the client's own connection
            decision = decided.decision
        if isinstance(decision, Reject):
            prepared.statements.pop(name, None)
            prepared.texts.pop(name, None)
            return self._refuse(self._failed_first(decision))
        prepared.texts[name] = decided
        return self._parse_route(name, decided, decision, raw)

    def _parse_route(self, name: bytes, decided: Decided, decision: Decision, raw: bytes | None) -> Route:
        """The route of the Parse of statement ``name``, kept as ``decided``, where its decision belongs."""
        prepared = self._prepared
        if isinstance(decision, Pass):
            prepared.statements[name] = Owner.UPSTREAM
            return Route(Owner.UPSTREAM, raw or pg.parse_message(name, decided.sql, decided.rest))
        if isinstance(decision, Relayed):  # the client's parameter types go with the rewritten text
            prepared.statements[name] = Owner.UPSTREAM
            return Route(Owner.UPSTREAM, pg.parse_message(name, decision.sql, decided.rest))
        if isinstance(decision, Rewrite):
            # Prepared on the service connection when a message first uses it (ServiceSide.prepare_first): a Parse
            # alone borrows no connection.
            prepared.statements[name] = Owner.SERVICE
            self._service.forget(name)
        elif reports.answered_by_proxy(decision):
            prepared.statements[name] = Owner.PROXY
            prepared.proxy_statements[name] = (decision, parameter_types(decided.rest))
        else:
            assert isinstance(decision, Intercept)
            prepared.statements[name] = Owner.LOCAL
            prepared.statement_settings[name] = decision.setting
        return Route(Owner.LOCAL, pg.message(b"1"))  # ParseComplete

    def _route_bind(self, type_: bytes, body: bytes | None) -> Route:
        """A Bind: one execution of a statement, recorded in the audit trail with its values (the proxy's own
        answers are recorded when answered)."""
        assert body is not None
        route = self._bind(pg.message(type_, body), body)
        statement = pg.read_cstring(body, pg.read_cstring(body)[1])[0]
        bound = self._prepared.texts.get(statement)
        if route is WAIT or route.owner is Owner.PROXY or (bound is None and route.refusal is None):
            return route
        if route.refusal is None and bound is not None and (statement in self._prepared.proxy_statements or (
                isinstance(bound.decision, DeclareCursor) and reports.answered_by_proxy(bound.decision.query))):
            return route  # recorded when the proxy answers it
        if bound is None:
            return recorded(route, "", Pass(), simple=False)  # refused: no such statement
        return recorded(route, bound.sql, bound.decision, bound_values(body, parameter_types(bound.rest)),
                        simple=False)

    def _bind(self, raw: bytes, body: bytes) -> Route:
        portal, offset = pg.read_cstring(body)
        statement, values = pg.read_cstring(body, offset)
        if statement not in self._prepared.statements:
            # Every statement of the client's connection was prepared through the gate (SQL PREPARE is refused):
            # one it does not know has no decision, even where that connection still holds the name (prepared
            # again and refused, or taken over by a gated statement since deallocated). PostgreSQL's own error.
            return self._refuse(_no_statement(statement))
        if self._now.status == b"E" and self._prepared.statements.get(statement) in (Owner.SERVICE, Owner.PROXY):
            return self._refuse(_ABORTED)  # as PostgreSQL (the failed transaction is on the client's connection)
        # The statement prepared again: for the value class of this Bind's values, or under a new policy.
        again = self._decide_at_bind(statement, body)
        if again is WAIT or again is not None and again.refusal is not None:
            return again
        owner = self._prepared.binding(portal, statement)
        if owner is Owner.PROXY:
            return self._bind_proxy(body)
        if owner is Owner.SERVICE:  # its values, to run it again where the service side's portal is gone
            self._prepared.service_bound(portal, body[values:])
            self._bound_in_batch.add(portal)
        if owner is Owner.SERVICE or (owner is not Owner.LOCAL and again is None):
            return Route(owner, raw, uses=statement)  # (prepared again on the service side: prepare_first)
        if owner is not Owner.LOCAL:
            # Close the old statement (a named one would clash), prepare the new one, bind it: the client sees
            # only the BindComplete.
            assert again is not None
            close = pg.message(b"C", b"S" + statement + b"\0") if statement else b""
            return Route(owner, close + again.payload + raw, hidden=(b"3",) * bool(close) + (b"1",))
        if statement in self._prepared.cursor_statements:
            self._prepared.cursor_portals[portal] = (self._prepared.cursor_statements[statement], pg.parse_bind(body))
        else:
            self._prepared.portal_settings[portal] = self._prepared.statement_settings[statement]
        return Route(Owner.LOCAL, pg.message(b"2"))  # BindComplete

    def _decide_at_bind(self, statement: bytes, body: bytes) -> Route | None:
        """A statement decided at each Bind (AtBind): the decision for the value class of this Bind's values (its
        slots' values written as constants). None: the decision it is prepared with stands; else WAIT, a refusal,
        or the route of its Parse with that decision. Other statements: ``_decide_again``."""
        template = self._prepared.templates.get(statement)
        if template is None:
            return self._decide_again(statement)
        if template.version != self._version():
            fresh = self._decision(template.sql)
            if fresh is None:
                return WAIT
            fresh = replace(fresh, rest=template.rest)
            if not isinstance(fresh.decision, AtBind):  # the new policy decides it at Parse
                del self._prepared.templates[statement]
                return self._refuse(fresh.decision) if isinstance(fresh.decision, Reject) else \
                    self._prepare(statement, fresh, None)
            self._prepared.templates[statement] = template = fresh
        assert isinstance(template.decision, AtBind)
        parameters = bound_values(body, parameter_types(template.rest))
        text_of_class = bind_time.class_text(template.decision, parameters)
        if isinstance(text_of_class, Reject):
            return self._refuse(text_of_class)
        if len(text_of_class.encode()) > self._max_statement_size:
            return self._refuse(self._bound_too_long())  # the values are written into the text analysed
        fresh = self._decision(text_of_class)
        if fresh is None:
            return WAIT
        if isinstance(fresh.decision, Reject):
            return self._refuse(fresh.decision)  # as if the client had written these constants
        current = self._prepared.texts[statement]
        if current.decision == fresh.decision and current.version == fresh.version:
            return None
        return self._prepare(statement, Decided(template.sql, fresh.decision, fresh.version,
                                                bind_time.service_rest(template.decision, template.rest),
                                                text_of_class), None)

    def _decide_again(self, statement: bytes) -> Route | None:
        """A statement decided under an older policy, bound: decided again. None: its decision stands (or no such
        statement); else WAIT, a refusal, or the route of its Parse where it now belongs."""
        prepared = self._prepared.texts.get(statement)
        if prepared is None or prepared.version == self._version():
            return None
        fresh = self._decision(prepared.sql)
        if fresh is None:
            return WAIT
        fresh = replace(fresh, rest=prepared.rest)
        if fresh.decision == prepared.decision:
            self._prepared.texts[statement] = fresh
            return None
        if isinstance(fresh.decision, Reject):
            return self._refuse(fresh.decision)  # and again at the next Bind, while the policy says so
        return self._prepare(statement, fresh, None)  # (refused in a failed transaction)

    def _bind_proxy(self, body: bytes) -> Route:
        bind = pg.parse_bind(body)
        decision, types = self._prepared.proxy_statements[bind.statement]
        self._prepared.proxy_portals[bind.portal] = ProxyPortal(decision, Parameters(types, formats(bind),
                                                                                     bind.values),
                                                                bind.result_formats)
        return Route(Owner.LOCAL, pg.message(b"2"))  # BindComplete

    def _route_by_name(self, type_: bytes, body: bytes | None) -> Route:
        """Describe, Close, Execute: to the owner of the statement or portal they name."""
        assert body is not None
        prepared = self._prepared
        if type_ == b"E":
            kind, (name, _) = b"P", pg.read_cstring(body)
        else:
            kind, (name, _) = body[:1], pg.read_cstring(body, 1)
        if kind == b"P" and type_ != b"C" and self._now.status == b"E" and (
                name in prepared.service_binds or name in prepared.proxy_portals):
            return self._refuse(_ABORTED)  # a portal answered elsewhere than on the client's connection
        if type_ == b"E":
            stale = self._bound_under_old_policy(name)
            if stale is not None:
                return stale
        names = prepared.statements if kind == b"S" else prepared.portals
        if type_ == b"D" and kind == b"P" and name not in names and self._cursors.held(text_or_empty(name)):
            return Route(Owner.LOCAL, self._cursors.describe(text_or_empty(name)))  # psycopg's named cursors
        owner = names.get(name, Owner.UPSTREAM)
        if type_ == b"C":
            names.pop(name, None)
            (prepared.texts if kind == b"S" else prepared.bound).pop(name, None)
            if kind == b"P" and name not in prepared.kept_portals:
                prepared.forget_portal(name)
            if kind == b"S":
                prepared.templates.pop(name, None)
        if kind == b"P" and name in prepared.kept_portals:
            return self._kept_by_name(type_, name, body)
        decided = (prepared.texts if kind == b"S" else prepared.bound).get(name)
        if owner is Owner.PROXY:
            route = self._proxy_by_name(type_, kind, name, body)
            return route if decided is None else with_text(route, decided.sql)
        if owner is not Owner.LOCAL:
            return self._connection_by_name(type_, kind, name, owner, pg.message(type_, body))
        if name in (prepared.cursor_statements if kind == b"S" else prepared.cursor_portals) and type_ != b"C":
            route = self._or_refused(gate_cursors.by_name_route(type_, kind, name, prepared, self._cursors,
                                                                self._now.status))
            return route if decided is None else with_text(route, decided.sql)
        return self._local_by_name(type_, kind, name)

    def _bound_under_old_policy(self, portal: bytes) -> Route | None:
        """The Execute of a portal bound under an older policy: WAIT for its decision, or a refusal if the decision
        changed; None: it runs."""
        bound = self._prepared.bound.get(portal)
        if bound is None or bound.version == self._version():
            return None
        fresh = self._decision(bound.on or bound.sql)
        if fresh is None:
            return WAIT
        if fresh.decision != bound.decision:
            return self._refuse(fresh.decision if isinstance(fresh.decision, Reject) else Reject(
                "55000", f'the privacy policy changed after portal "{portal.decode(errors="replace")}" was bound',
                "Bind the statement again: it is then decided under the new policy."))
        self._prepared.bound[portal] = replace(bound, version=fresh.version)
        return None

    def _connection_by_name(self, type_: bytes, kind: bytes, name: bytes, owner: Owner, raw: bytes) -> Route:
        """Describe, Close or Execute of a statement or portal on the client's or the service connection."""
        if type_ == b"C" and owner is Owner.SERVICE and not (
                self._service.held and (kind == b"P" or self._service.has(name))):
            self._service.forget(name)
            return Route(Owner.LOCAL, pg.message(b"3"))  # CloseComplete: not on the connection held, if any
        on_statement = name if kind == b"S" else None
        bound = self._prepared.bound.get(name) if type_ == b"E" else None
        if type_ == b"E" and owner is Owner.SERVICE:
            kept = self._keep(name, pg.parse_execute(raw[5:])[1])
            if kept is not None:
                return kept
        if type_ == b"D" and kind == b"P" and owner is Owner.SERVICE and name not in self._bound_in_batch:
            described = self._describe_again(name)
            if described is not None:
                return described
        resets = bound is not None and isinstance(bound.decision, Pass) and bound.decision.resets_session
        if bound is not None and isinstance(bound.decision, Pass) and owner is Owner.UPSTREAM:
            deallocates = bound.decision.deallocates
            if deallocates is not None and self._deallocate(deallocates):
                return Route(Owner.LOCAL, pg.command_complete("DEALLOCATE"))  # (psycopg's, of an evicted statement)
            self._transaction_control(bound.decision)
        return Route(owner, raw, uses=on_statement if type_ == b"D" else None,
                     closes=on_statement if type_ == b"C" else None, resets=resets,
                     describes=type_ == b"D" and kind == b"S" and owner is Owner.SERVICE)

    def _keep(self, portal: bytes, max_rows: int) -> Route | None:
        """The Execute of a rewritten portal with a row limit, or in a later batch than its Bind (the service
        side's portal is gone): run again from its Bind and kept (proxy_portals.py); or, once it was read to its
        end, PostgreSQL's answer to an Execute of a portal at its end: no row. None: sent as it is."""
        bind = self._prepared.service_binds.get(portal)
        bound = self._prepared.bound.get(portal)
        if bind is None or bound is None or not isinstance(bound.decision, Rewrite):
            return None
        if portal in self._prepared.read_to_end:
            return Route(Owner.LOCAL, proxy_portals.AT_END)  # never run again: its answer went out once
        if max_rows <= 0 and portal in self._bound_in_batch:
            self._prepared.read_to_end.add(portal)  # the service side runs it to its end
            return None
        return Route(Owner.SERVICE, proxy_portals.keep_payload(bound.decision.runs, bound.rest, bind),
                     keeps=(portal, max_rows))

    def _describe_again(self, portal: bytes) -> Route | None:
        """The Describe of a rewritten portal bound in an earlier batch (the service side's portal is gone): bound
        again there from its Bind and described, as PostgreSQL describes its portal. None: not such a portal."""
        bind = self._prepared.service_binds.get(portal)
        bound = self._prepared.bound.get(portal)
        if bind is None or bound is None or not isinstance(bound.decision, Rewrite):
            return None
        return Route(Owner.SERVICE, proxy_portals.describe_payload(bound.decision.runs, bound.rest, bind),
                     hidden=proxy_portals.DESCRIBE_HIDDEN)

    def _kept_by_name(self, type_: bytes, name: bytes, body: bytes) -> Route:
        """Describe, Execute or Close of a rewritten portal whose answer the gate keeps (proxy_portals.py)."""
        if type_ == b"C":
            self._prepared.forget_portal(name)
            return Route(Owner.LOCAL, pg.message(b"3"))  # CloseComplete
        kept = self._prepared.kept_portals[name]
        if type_ == b"D":
            return Route(Owner.LOCAL, kept.description)
        rows, end = proxy_portals.next_rows(kept, pg.parse_execute(body)[1])
        return Route(Owner.LOCAL, rows + end)

    def _local_by_name(self, type_: bytes, kind: bytes, name: bytes) -> Route:
        """Describe, Close or Execute of a statement or portal the gate answers: a SHOW anonproxy.*, or (Close) a
        cursor statement."""
        prepared = self._prepared
        settings = prepared.statement_settings if kind == b"S" else prepared.portal_settings
        if type_ == b"C":
            settings.pop(name, None)
            (prepared.cursor_statements if kind == b"S" else prepared.cursor_portals).pop(name, None)
            return Route(Owner.LOCAL, pg.message(b"3"))  # CloseComplete
        answer = self._show(settings[name])
        if isinstance(answer, Reject):
            return self._refuse(answer)
        description, rows = answer
        if type_ == b"E":
            return Route(Owner.LOCAL, rows)
        no_parameters = pg.parameter_description([]) if kind == b"S" else b""
        return Route(Owner.LOCAL, no_parameters + description)

    def _proxy_by_name(self, type_: bytes, kind: bytes, name: bytes, body: bytes) -> Route:
        """Describe, Close or Execute of a statement or portal the proxy answers."""
        prepared = self._prepared
        if type_ == b"C":
            (prepared.proxy_statements if kind == b"S" else prepared.proxy_portals).pop(name, None)
            return Route(Owner.LOCAL, pg.message(b"3"))  # CloseComplete
        if kind == b"S":
            decision, types = prepared.proxy_statements[name]
            columns = fixed_columns(decision)
            if columns is None:
                return Route(Owner.PROXY, b"", request=ProxyRequest(decision, True, Parameters(types)),
                             asking=("describe statement", name, 0))
            return Route(Owner.LOCAL, pg.parameter_description(list(types)) + Result(columns).description())
        portal = prepared.proxy_portals.get(name)
        if portal is None:  # ended with its transaction
            return self._refuse(Reject("34000", f'portal "{name.decode(errors="replace")}" does not exist'))
        if type_ == b"E":
            return self._execute_proxy_portal(name, portal, pg.parse_execute(body)[1])
        return self._describe_proxy_portal(name, portal)

    def _execute_proxy_portal(self, name: bytes, portal: ProxyPortal, max_rows: int) -> Route:
        if portal.result is not None:  # a suspended portal goes on; a finished one has no more rows
            return Route(Owner.LOCAL, self._batch_answer(proxy_portals.rows(portal, max_rows)))
        return Route(Owner.PROXY, b"", request=ProxyRequest(portal.decision, parameters=portal.parameters),
                     asking=("execute", name, max_rows))

    def _describe_proxy_portal(self, name: bytes, portal: ProxyPortal) -> Route:
        columns = portal.result.columns if portal.result is not None else fixed_columns(portal.decision)
        if columns is not None:
            return Route(Owner.LOCAL, self._batch_answer(proxy_portals.description(portal, columns)))
        following = self._now.following
        if following is not None and following[0] == b"E" and following[1] is not None \
                and pg.parse_execute(following[1])[0] == name:
            # Execute follows in the same batch (libpq, pgjdbc): one trip for both; the Execute sends the rows.
            return Route(Owner.PROXY, b"", request=ProxyRequest(portal.decision, parameters=portal.parameters),
                         asking=("describe and answer", name, 0))
        return Route(Owner.PROXY, b"", request=ProxyRequest(portal.decision, True, portal.parameters),
                     asking=("describe portal", name, 0))

    def _batch_answer(self, answer: bytes) -> bytes:
        """An answer the gate makes to a message of the batch; an ErrorResponse skips the rest, up to Sync."""
        if answer[:1] == b"E":
            self.failed()
        return answer

    def _show(self, setting: str) -> tuple[bytes, bytes] | Reject:
        """RowDescription, then DataRow + CommandComplete, answering SHOW anonproxy.<setting>."""
        values = self._settings()
        if setting not in values:
            return Reject("42704", f'unrecognized configuration parameter "anonproxy.{setting}"',
                          f"anonproxy settings: {', '.join('anonproxy.' + s for s in sorted(values))}")
        return (pg.row_description([f"anonproxy.{setting}"]),
                pg.data_row([values[setting]]) + pg.command_complete("SHOW"))

    def _failed_first(self, reject: Reject) -> Reject:
        """A statement's refusal, or 25P02 in a failed transaction, as PostgreSQL answers: it checks for a failed
        transaction before anything but the syntax (whose errors, 42601, come first)."""
        return _ABORTED if self._now.status == b"E" and reject.sqlstate != "42601" else reject

    def _or_refused(self, route: Route | Reject, simple: bool = False) -> Route:
        return self._refuse(route, simple) if isinstance(route, Reject) else route

    def _refuse(self, reject: Reject, simple: bool = False) -> Route:
        return self.refuse(reject, simple, self._now.status)


def _no_statement(name: bytes) -> Reject:
    """PostgreSQL's error for a Bind of a statement that does not exist."""
    if not name:
        return Reject("26000", "unnamed prepared statement does not exist")
    return Reject("26000", f'prepared statement "{name.decode(errors="replace")}" does not exist')
