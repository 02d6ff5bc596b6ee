"""The values of the gate (gate.py): who answers a client message, the route the gate gives it, and what the gate
asks the session (a proxy answer, an audit-trail row) and hears back.

Pure data and small functions on it: no I/O.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, replace

from ..plan.refusals import Reject
from ..route.decision import Decision, DeclareCursor, Rewrite, Script
from ..wire import protocol as pg
from ..wire.results import Column, Result

SYNC = pg.message(b"S")


class Owner(enum.Enum):
    UPSTREAM = enum.auto()  # the client's own connection
    SERVICE = enum.auto()  # the proxy's service connection, for rewritten queries
    LOCAL = enum.auto()  # the gate, at once
    PROXY = enum.auto()  # the session, after asynchronous work (``ask_proxy``)


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

    decision: Decision  # one that anonproxy.route.reports.answered_by_proxy says the proxy answers
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
    # On the service connection: the statement the payload uses or closes (see ``ServiceSide.prepare_first``).
    uses: bytes | None = None
    closes: bytes | None = None
    query: str | None = None  # a Query's rewritten SQL, run as the service connection's prepared statement of it
    describes: bool = False  # a Describe of a statement on the service connection
    keeps: tuple[bytes, int] | None = None  # an Execute (portal, max rows) whose answer the gate keeps
    declares: DeclareCursor | None = None  # a cursor the proxy will hold: its query's answer is kept, not sent
    script: Script | None = None  # a message to run statement by statement, from when nothing is in flight
    resets: int = 0  # RESET ALL / DISCARD ALL statements among what it sends to the client's connection
    refusal: Reject | None = None  # what a LOCAL route refuses
    record: Execution | None = None  # to record in the audit trail before the route runs


# The route of a message whose statement's decision is not known yet: the message waits at the head of the queue.
WAIT = Route(Owner.LOCAL, b"")


@dataclass(frozen=True)
class Decided:
    """What a prepared statement or a portal was decided on: its text, the decision, the policy version."""

    sql: str
    decision: Decision
    version: int
    rest: bytes = b""  # the Parse message after the text: parameter types
    on: str = ""  # the text decided, when not ``sql``: the statement with values bound at Bind as constants


def recorded(route: Route, sql: str, decision: Decision, parameters: Parameters = Parameters(),
             simple: bool = True) -> Route:
    """``route`` with the audit trail's record of the statement, unless the proxy answers it (recorded when
    answered) or it is run part by part (each part is recorded)."""
    if route is WAIT or route.script is not None:
        return route
    if route.owner is Owner.PROXY:
        return with_text(route, sql)
    return replace(route, record=Execution(sql, route.refusal or decision, parameters, simple))


def with_text(route: Route, sql: str) -> Route:
    """A PROXY route whose request carries the client's text of its statement (for the audit trail)."""
    return route if route.request is None else replace(route, request=replace(route.request, sql=sql))


def text(sql: bytes) -> str | Reject:
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


def undecodable(sql: bytes) -> str:
    """A statement's text that is not valid UTF-8, for the audit trail: invalid bytes replaced."""
    return sql.decode("utf-8", errors="replace")


def text_or_empty(name: bytes) -> str:
    try:
        return name.decode()
    except UnicodeDecodeError:
        return ""


def bound_values(body: bytes, types: tuple[int, ...]) -> Parameters:
    """A Bind's parameter values, with one format code each and the types its statement declared."""
    bind = pg.parse_bind(body)
    return Parameters(types, formats(bind), bind.values)


def formats(bind: pg.Bind) -> tuple[int, ...]:
    """One format code per parameter value (a Bind may give one for all, or none: text)."""
    if len(bind.parameter_formats) == 1:
        return bind.parameter_formats * len(bind.values)
    return bind.parameter_formats or (0,) * len(bind.values)


def parameter_types(rest: bytes) -> tuple[int, ...]:
    """The parameter type OIDs of a Parse message, from what follows its text."""
    return pg.parse_parse(b"\0\0" + rest).parameter_types  # an unnamed statement with an empty text


def statement_size(name: bytes, decided: Decided) -> int:
    """About the bytes a prepared statement holds here: its name, text and parameter types, and its rewrite."""
    decision = decided.decision
    rewrite = len(decision.runs) if isinstance(decision, Rewrite) else 0
    return len(name) + len(decided.sql) + len(decided.rest) + rewrite


def message_types(payload: bytes) -> list[bytes]:
    """The types of the messages in ``payload``, in order."""
    types, offset = [], 0
    while offset < len(payload):
        types.append(payload[offset:offset + 1])
        offset += 1 + struct.unpack_from("!i", payload, offset + 1)[0]
    return types


def row_count(command_complete: bytes) -> int | None:
    """The row count a CommandComplete tag ends with (SELECT 3, FETCH 3), if any."""
    words = command_complete.rstrip(b"\0").split()
    return int(words[-1]) if len(words) >= 2 and words[-1].isdigit() else None
