"""The routes of cursor statements (DECLARE, FETCH, MOVE, CLOSE) and of a Query of several statements with cursor
statements among them (a Script): which go to the client's own connection as they are, which the proxy answers
from the cursors it holds (cursors.py).

Functions of the gate's state, given explicitly; a refusal comes back as a ``Reject`` for the gate to send.
"""

from __future__ import annotations

from ..plan.refusals import Reject
from ..route.decision import (
    CloseCursor,
    Decision,
    DeclareCursor,
    FetchCursor,
    Pass,
    Rewrite,
    Script,
)
from ..wire import protocol as pg
from ..wire.results import FormatError, Result, check_formats, result_formats
from .cursors import Cursors, unnamed_bind
from .gate_routes import (
    Owner,
    Parameters,
    ProxyRequest,
    Route,
    formats,
    parameter_types,
)
from .prepared import Prepared

_EXECUTE_ALL = pg.message(b"E", b"\0\0\0\0\0")  # Execute the unnamed portal, all rows


def for_cursors(decision: Decision, cursors: Cursors) -> bool:
    """Whether a statement needs the proxy's cursors (else it goes to the client's connection as it is)."""
    if isinstance(decision, DeclareCursor):
        return not isinstance(decision.query, Pass) or cursors.held(decision.name)
    return isinstance(decision, (FetchCursor, CloseCursor)) and cursors.held(decision.name)


def script_route(raw: bytes, script: Script, cursors: Cursors) -> Route:
    """Several statements in one Query with cursor statements among them: as they are to the client's connection
    when the proxy holds none of their cursors, else one by one (the gate queues the parts)."""
    if not any(for_cursors(decision, cursors) for _, decision in script.parts):
        for _, decision in script.parts:
            if isinstance(decision, DeclareCursor):
                cursors.passing(decision)
        resets = sum(isinstance(decision, Pass) and decision.resets_session for _, decision in script.parts)
        return Route(Owner.UPSTREAM, raw, ends_batch=True, resets=resets)
    return Route(Owner.LOCAL, b"", in_batch=False, script=script)


def query_route(raw: bytes, decision: Decision, cursors: Cursors, status: bytes, block: bool) -> Route | Reject:
    """DECLARE, FETCH, MOVE or CLOSE in a Query (``block``: inside the implicit block of a Script)."""
    if not for_cursors(decision, cursors):
        if isinstance(decision, DeclareCursor):
            cursors.passing(decision)
        return Route(Owner.UPSTREAM, raw, ends_batch=True)
    if isinstance(decision, DeclareCursor):
        reject = cursors.can_declare(decision.name, decision.hold, status, block)
        if reject is not None:
            return reject
        if isinstance(decision.query, Rewrite):
            return Route(Owner.SERVICE, pg.query_message(decision.query.sql), ends_batch=True, declares=decision)
        return Route(Owner.PROXY, b"", ends_batch=True, request=ProxyRequest(decision.query),
                     asking=("declare", b"", 0), declares=decision)
    if isinstance(decision, FetchCursor):
        answer = cursors.fetch(decision, None, status, describe=True)
    else:
        assert isinstance(decision, CloseCursor)
        answer = cursors.close(decision, status)
        if decision.name is None and not isinstance(answer, Reject):
            return Route(Owner.UPSTREAM, raw, ends_batch=True)  # PostgreSQL closes its own and answers
    if isinstance(answer, Reject):
        return answer
    return Route(Owner.LOCAL, answer + pg.ready_for_query(status))


def by_name_route(type_: bytes, kind: bytes, name: bytes, prepared: Prepared, cursors: Cursors,
                  status: bytes) -> Route | Reject:
    """Describe or Execute of a cursor statement (or its portal) the proxy answers, in the extended protocol."""
    if kind == b"S":
        decision, bind = prepared.cursor_statements[name], None
    else:
        decision, bind = prepared.cursor_portals[name]
    if not isinstance(decision, DeclareCursor) and not cursors.held(decision.name):
        return Reject("34000", f'cursor "{decision.name}" does not exist',
                      "A cursor WITHOUT HOLD ends with its transaction; declare it again.")
    if type_ == b"D":
        return _describe(decision, bind, name, prepared, cursors)
    assert bind is not None
    if isinstance(decision, DeclareCursor):
        return _declare(decision, bind, name, prepared, cursors, status)
    if isinstance(decision, FetchCursor):
        answer = cursors.fetch(decision, bind.result_formats, status, describe=False)
    else:
        answer = cursors.close(decision, status)
        if decision.name is None and not isinstance(answer, Reject):
            # PostgreSQL closes its own and answers (CLOSE CURSOR ALL); its ParseComplete and BindComplete are ours.
            return Route(Owner.UPSTREAM, pg.parse_message(b"", "CLOSE ALL", b"\0\0")
                         + pg.message(b"B", unnamed_bind(bind)) + _EXECUTE_ALL, hidden=(b"1", b"2"))
    return answer if isinstance(answer, Reject) else Route(Owner.LOCAL, answer)


def _describe(decision: DeclareCursor | FetchCursor | CloseCursor, bind: pg.Bind | None, name: bytes,
              prepared: Prepared, cursors: Cursors) -> Route | Reject:
    fetch = decision if isinstance(decision, FetchCursor) and not decision.move else None
    columns = cursors.columns(fetch.name) if fetch is not None else ()
    if bind is None:  # the statement
        types = parameter_types(prepared.texts[name].rest) if isinstance(decision, DeclareCursor) else ()
        return Route(Owner.LOCAL, pg.parameter_description(list(types)) + Result(columns).description())
    if fetch is None:
        return Route(Owner.LOCAL, pg.message(b"n"))  # NoData
    try:
        codes = result_formats(bind.result_formats, len(columns))
        check_formats(columns, codes)
    except FormatError as exc:
        return Reject(exc.sqlstate, str(exc))
    return Route(Owner.LOCAL, Result(columns).description(codes))


def _declare(decision: DeclareCursor, bind: pg.Bind, name: bytes, prepared: Prepared, cursors: Cursors,
             status: bytes) -> Route | Reject:
    reject = cursors.can_declare(decision.name, decision.hold, status, block=False)
    if reject is not None:
        return reject
    rest = prepared.texts[bind.statement].rest
    if isinstance(decision.query, Rewrite):
        # Prepared, bound with the client's values, described and run, unnamed: the answer is kept (and what
        # follows waits for it: it may name the cursor).
        payload = (pg.parse_message(b"", decision.query.sql, rest) + pg.message(b"B", unnamed_bind(bind))
                   + pg.message(b"D", b"P\0") + _EXECUTE_ALL
                   + pg.message(b"H"))  # Flush: the server sends the answer now, before the client's Sync
        return Route(Owner.SERVICE, payload, declares=decision)
    parameters = Parameters(parameter_types(rest), formats(bind), bind.values)
    return Route(Owner.PROXY, b"", request=ProxyRequest(decision.query, parameters=parameters),
                 asking=("declare portal", name, 0), declares=decision)

