"""The audit trail's writer: one per worker, on the client's path by group commit.

The gate asks for a row (``Execution``) before a gated statement runs or its
refusal is sent — once per Query, once per Bind of a prepared statement,
with its values — and the session waits for :meth:`AuditTrail.write` before
letting it go on; statements the proxy answers itself (dp mode,
``SHOW``/``SET anonproxy.*``, ``EXPLAIN (ANONPROXY)``) are written, with their
charge, by :meth:`AuditTrail.answered` before their answer is sent. So no
answer leaves without its row committed, and a crash loses nothing answered.

Writes are group-committed: while one ``anonproxy.audit_write`` call
(sql/0014_audit_trail.sql, sql/0024, sql/0025) runs on the writer's own connection,
the rows asked for meanwhile, from every session of the worker, wait and go
together in the next call (up to ``BATCH``). A session waits for its own row
only, so a client that floods statements slows itself, not the others, and
nothing is dropped: the rows waiting are at most one per session.

A row the database refuses fails only that row (the batch is written again
without it); when the database cannot be reached or does not answer within
``WRITE_TIMEOUT``, the rows waiting fail with :class:`TrailUnavailable` and
their statements are refused — a statement is recorded or not answered.
Nothing a client sends can make a row unwritable: a NUL (which PostgreSQL's
text cannot hold) is written as U+2400, and a text over ``MAX_STATEMENT``
characters is kept in part with the digest of the whole.

The writer also calls ``anonproxy.audit_purge`` (rows older than the
retention) when it starts and then every ``PURGE_INTERVAL`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import struct
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from ..config import MAX_STATEMENT_SIZE
from ..plan.refusals import Reject
from ..route.decision import (
    Decision,
    DeclareCursor,
    ExplainDP,
    Intercept,
    Noisy,
    Pass,
    Relayed,
    Rewrite,
    Script,
    SessionSetting,
)
from ..wire.results import Result
from .gate import Execution, Parameters

log = logging.getLogger("anonproxy.audit")

BATCH = 500  # rows per audit_write call at most
WRITE_TIMEOUT = 10.0  # seconds one audit_write call may take before its statements are refused
PURGE_INTERVAL = 3600.0  # seconds between two calls of anonproxy.audit_purge
WARNING_INTERVAL = 60.0  # seconds between two warnings that the trail cannot be written
STOP_TIMEOUT = 5.0  # seconds the last rows may take when the worker stops
MAX_STATEMENT = MAX_STATEMENT_SIZE  # characters of a statement's text kept in full (beyond: a part and a digest)
NUL_STANDIN = "\u2400"  # SYMBOL FOR NULL: PostgreSQL's text cannot hold U+0000

UNAVAILABLE = Reject("58030", "the audit trail cannot be written, so the statement was not run",
                     "Try again; if it persists, the proxy's log says why (the trail's database is down or refuses "
                     "the proxy's rows).")


class TrailUnavailable(Exception):
    """The row could not be written: the statement it records must not be answered."""


@dataclass(frozen=True)
class Who:
    """The client a session serves."""

    login: str
    database: str
    session_id: str
    client_addr: str | None = None
    client_port: int | None = None


@dataclass
class Spent:
    """What a statement the proxy answered itself read and cost; filled in as the answer is made."""

    relations: tuple[str, ...] = ()
    epsilon: Decimal | float | None = None  # charged: 0 for an answer already paid for or read from the policy
    delta: Decimal | float | None = None
    rho: Decimal | float | None = None  # the same charge's zCDP cost (sql/0019)
    delta_add: Decimal | float | None = None
    budget_domain: str | None = None  # the protected table whose budget it was charged to (sql/0025)
    accounting: str | None = None  # that budget's: basic or zcdp
    epsilon_spent_delta: Decimal | None = None  # what it moved that budget's ε spent by (0: not charged)
    epsilon_spent_after: Decimal | None = None  # the budget's ε spent right after the charge; None: not charged
    rows_sent: int | None = None
    sqlstate: str | None = None  # set when it was refused
    message: str | None = None


@dataclass(frozen=True)
class AuditRecord:
    at: float  # seconds since the epoch
    who: Who
    mode: str
    statement: str
    decision: str  # answered, refused, passed, intercepted
    sqlstate: str | None = None
    message: str | None = None
    relations: tuple[str, ...] = ()
    epsilon: Decimal | float | None = None
    delta: Decimal | float | None = None
    rows_sent: int | None = None
    rho: Decimal | float | None = None
    delta_add: Decimal | float | None = None
    parameters: tuple[str | None, ...] = ()
    budget_domain: str | None = None
    accounting: str | None = None
    epsilon_spent_delta: Decimal | None = None
    epsilon_spent_after: Decimal | None = None


def execution_record(who: Who, mode: str, execution: Execution) -> AuditRecord:
    """The row of a statement the gate runs or refuses."""
    decision = execution.decision
    if isinstance(decision, DeclareCursor):
        decision = decision.query  # a cursor's query is answered (or passed) as a plain one
    parameters = parameter_texts(execution.parameters)
    if isinstance(decision, Reject):
        return AuditRecord(time.time(), who, mode, execution.sql, "refused", decision.sqlstate, decision.message,
                           parameters=parameters)
    # Relayed statements run under the client's login (their privilege probes rewritten): they read no protected
    # table, and PostgreSQL's grants decide the rest.
    kind = "answered" if isinstance(decision, Rewrite) else "passed" if isinstance(
        decision, (Pass, Relayed, Script)) else "intercepted"
    relations = decision.relations if isinstance(decision, Rewrite) else ()
    return AuditRecord(time.time(), who, mode, execution.sql, kind, relations=relations, parameters=parameters)


def answered_record(who: Who, mode: str, sql: str, decision: Decision, parameters: Parameters, spent: Spent,
                    reply: object) -> AuditRecord:
    """The row of a statement the proxy answered (or refused) itself, with what it read and was charged."""
    if isinstance(reply, Result):
        spent.rows_sent = len(reply.rows)
    return AuditRecord(time.time(), who, mode, sql or statement_text(decision),
                       "refused" if spent.sqlstate is not None else "answered", spent.sqlstate, spent.message,
                       spent.relations, epsilon=spent.epsilon, delta=spent.delta, rows_sent=spent.rows_sent,
                       rho=spent.rho, delta_add=spent.delta_add, parameters=parameter_texts(parameters),
                       budget_domain=spent.budget_domain, accounting=spent.accounting,
                       epsilon_spent_delta=spent.epsilon_spent_delta, epsilon_spent_after=spent.epsilon_spent_after)


def parameter_texts(parameters: Parameters) -> tuple[str | None, ...]:
    """Bound values as text: text-format ones as sent, binary ones as PostgreSQL would print them for the common
    types (integers, floats, booleans, text), else in hex (``\\x…``); SQL NULL as None."""
    types = parameters.types + (0,) * (len(parameters.values) - len(parameters.types))
    return tuple(None if value is None else value.decode(errors="replace") if form == 0 else _binary_text(value, oid)
                 for value, form, oid in zip(parameters.values, parameters.formats, types, strict=False))


def _binary_text(value: bytes, oid: int) -> str:
    with contextlib.suppress(struct.error, UnicodeDecodeError):
        if oid in _BINARY_NUMBERS and len(value) == struct.calcsize(_BINARY_NUMBERS[oid]):
            return str(struct.unpack(_BINARY_NUMBERS[oid], value)[0])
        if oid == 16 and value in (b"\0", b"\1"):
            return "true" if value == b"\1" else "false"
        if oid in _TEXT_TYPES:
            return value.decode()
    return "\\x" + value.hex()


_BINARY_NUMBERS = {20: "!q", 21: "!h", 23: "!i", 26: "!I", 700: "!f", 701: "!d"}  # int8, int2, int4, oid, floats
_TEXT_TYPES = frozenset({18, 19, 25, 1042, 1043})  # char, name, text, bpchar, varchar: binary is the text


class AuditTrail:
    def __init__(self, dsn: str, batch: int = BATCH, timeout: float = WRITE_TIMEOUT) -> None:
        self._dsn = dsn
        self._batch = batch
        self._timeout = timeout
        self._waiting: list[tuple[AuditRecord, asyncio.Future[None]]] = []
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._next_purge = 0.0  # time.monotonic() of the next audit_purge call
        self._quiet_until = 0.0  # time.monotonic() before which write failures are not logged again

    async def write(self, record: AuditRecord) -> None:
        """Once ``record`` is committed; TrailUnavailable if it cannot be."""
        if self._task is None or self._task.done():
            raise TrailUnavailable("the audit trail's writer is not running")
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((record, written))
        self._wake.set()
        await written

    # -- the writer ---------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop the writer once the rows still waiting are written (for at most ``STOP_TIMEOUT`` seconds)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_TIMEOUT):
                await self._write_waiting()
        for _, written in self._waiting:
            if not written.done():
                written.set_exception(TrailUnavailable("the proxy is stopping"))
        if self._conn is not None:
            await self._conn.close()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._write_waiting()

    async def _write_waiting(self) -> None:
        """Write the rows waiting, a batch per call: those asked for during one call go in the next."""
        while self._waiting:
            batch, self._waiting = self._waiting[:self._batch], self._waiting[self._batch:]
            try:
                await self._write_batch(batch)
            except TrailUnavailable as exc:
                self._warn(f"audit trail: cannot write ({exc}); {len(batch)} rows are missing: their statements "
                           "were not run (refusals were sent as they were)")
                for _, written in batch:
                    if not written.done():
                        written.set_exception(TrailUnavailable(str(exc)))

    async def _write_batch(self, batch: list[tuple[AuditRecord, asyncio.Future[None]]]) -> None:
        rows = [self._row(record) for record, _ in batch]
        try:
            await self._call(rows)
        except psycopg.OperationalError:
            raise
        except psycopg.Error as exc:  # one row the database will not take: write the others, fail that one
            if len(batch) == 1:
                log.error("audit trail: the database refused a row (%s)", str(exc).strip())
                raise TrailUnavailable(f"the database refused the row: {str(exc).strip()}") from None
            for one in batch:
                try:
                    await self._write_batch([one])
                except TrailUnavailable as single:
                    if not one[1].done():
                        one[1].set_exception(single)
            return
        for _, written in batch:
            if not written.done():
                written.set_result(None)

    async def _call(self, rows: list[dict[str, Any]]) -> None:
        """One audit_write call (and audit_purge when due); TrailUnavailable if the database does not answer.
        A connection that was open before the call and fails is opened again once (the server restarted)."""
        stale = self._conn is not None and not self._conn.closed
        while True:
            try:
                async with asyncio.timeout(self._timeout):
                    if self._conn is None or self._conn.closed:
                        self._conn = await psycopg.AsyncConnection.connect(self._dsn, autocommit=True,
                                                                           application_name="anonproxy audit")
                    await self._purge_when_due(self._conn)
                    await self._conn.execute("select anonproxy.audit_write(%s)", (Jsonb(rows),))
                return
            except (psycopg.OperationalError, TimeoutError) as exc:
                if self._conn is not None:
                    await self._conn.close()
                    self._conn = None
                if stale and isinstance(exc, psycopg.OperationalError):
                    stale = False
                    continue
                reason = str(exc).strip() or f"no answer within {self._timeout:g} s"
                raise TrailUnavailable(reason) from None

    async def _purge_when_due(self, conn: psycopg.AsyncConnection[Any]) -> None:
        if time.monotonic() < self._next_purge:
            return
        self._next_purge = time.monotonic() + PURGE_INTERVAL
        deleted = (await (await conn.execute("select anonproxy.audit_purge()")).fetchone() or (0,))[0]
        if deleted:
            log.info("audit trail: %d records older than the retention deleted", deleted)

    def _warn(self, message: str) -> None:
        """A failure to write, logged at most once a minute: the database may stay down for long."""
        if time.monotonic() >= self._quiet_until:
            log.warning("%s", message)
            self._quiet_until = time.monotonic() + WARNING_INTERVAL

    def _row(self, record: AuditRecord) -> dict[str, Any]:
        who = record.who
        statement, digest = record.statement, None
        if len(statement) > MAX_STATEMENT:
            digest = hashlib.sha256(statement.encode(errors="surrogatepass")).hexdigest()
            statement = f"{statement[:MAX_STATEMENT]}… ({len(statement) - MAX_STATEMENT} more characters)"
        return {"at": record.at, "login": who.login, "database": who.database, "client_addr": who.client_addr,
                "client_port": who.client_port, "session_id": who.session_id, "mode": record.mode,
                "statement": _storable(statement), "statement_sha256": digest, "decision": record.decision,
                "sqlstate": record.sqlstate, "message": _storable(record.message), "relations": list(record.relations),
                "epsilon": _number(record.epsilon), "delta": _number(record.delta), "rho": _number(record.rho),
                "delta_add": _number(record.delta_add), "rows_sent": record.rows_sent,
                "budget_domain": record.budget_domain, "accounting": record.accounting,
                "epsilon_spent_delta": _number(record.epsilon_spent_delta),
                "epsilon_spent_after": _number(record.epsilon_spent_after),
                "parameters": [_storable(value) for value in record.parameters] if record.parameters else None}


def statement_text(decision: Decision) -> str:
    """The text of a statement the proxy answers itself, when the client's was not kept: its canonical form."""
    if isinstance(decision, Noisy):
        return decision.sql
    if isinstance(decision, ExplainDP):
        return f"EXPLAIN (ANONPROXY) {decision.sql}"
    if isinstance(decision, SessionSetting):
        if decision.value is None:
            return f"RESET anonproxy.{decision.setting}"
        return f"SET anonproxy.{decision.setting} TO {decision.value}"
    if isinstance(decision, Intercept):
        return f"SHOW anonproxy.{decision.setting}"
    return type(decision).__name__


def session_id(number: int) -> str:
    """A session's id in the trail: the worker's process id and the session's number in it."""
    return f"{os.getpid()}.{number}"


def _storable(text: str | None) -> str | None:
    """Text PostgreSQL can store: a NUL becomes U+2400 (a lone surrogate, which no client text decodes to, too)."""
    if text is None:
        return None
    text = text.replace("\0", NUL_STANDIN)
    return text.encode("utf-8", errors="replace").decode("utf-8")


def _number(value: Decimal | float | None) -> str | None:
    """Exact in the database: a float as its shortest repr (as the ledger charges it), a Decimal as it is."""
    return None if value is None else str(value)
