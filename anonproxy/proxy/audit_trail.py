"""The audit trail's writer: one per worker, off the client's path.

Sessions call :meth:`AuditTrail.decided` when the gate decides a statement
and :meth:`AuditTrail.answered` when the proxy has answered one itself (dp
mode, ``SHOW``/``SET anonproxy.*``, ``EXPLAIN (ANONPROXY)``). Both only build
an :class:`AuditRecord` and append it to a bounded in-memory buffer; a
background task writes the buffer in batches through
``anonproxy.audit_write`` (sql/0014_audit_trail.sql) on a connection of its
own, as the service role, at most every ``FLUSH_INTERVAL`` seconds or as soon
as a batch is full. Nothing on a client's path waits for the database.

When the buffer is full (the database is down or slower than the clients),
new records are dropped rather than blocking the worker's event loop, which
would stall every session of the worker. Drops are never silent: the next
write adds a row with decision ``lost`` saying how many, and logs a WARNING
with the number, so the gap shows in the trail itself.

The writer also calls ``anonproxy.audit_purge`` (rows older than the
retention) when it starts and then every ``PURGE_INTERVAL`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError

from ..rewrite.decision import (
    DeclareCursor,
    Decision,
    ExplainDP,
    ExplainSuppress,
    Intercept,
    Noisy,
    Pass,
    Reject,
    Relayed,
    Rewrite,
    SessionSetting,
)
from ..rewrite.statements import DIALECT
from ..wire.results import Result
from .gate import PROXY_SETTINGS

log = logging.getLogger("anonproxy.audit")

CAPACITY = 10_000  # records buffered per worker before new ones are dropped
BATCH = 500  # records per audit_write call; a full batch is written at once
FLUSH_INTERVAL = 1.0  # seconds: the longest a record waits in the buffer while the database is up
PURGE_INTERVAL = 3600.0  # seconds between two calls of anonproxy.audit_purge
WARNING_INTERVAL = 60.0  # seconds between two warnings that the trail cannot be written
STOP_TIMEOUT = 5.0  # seconds the last flush may take when the worker stops
MAX_STATEMENT = 16_384  # characters of a statement's text kept in its record
RELATIONS_CACHE_SIZE = 10_000
TEXTS_SIZE = 10_000


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
    rows_sent: int | None = None
    sqlstate: str | None = None  # set when it was refused
    message: str | None = None


@dataclass(frozen=True)
class AuditRecord:
    at: float  # seconds since the epoch
    who: Who
    mode: str
    statement: str
    decision: str  # answered, refused, passed, intercepted (lost: written by the writer only)
    sqlstate: str | None = None
    message: str | None = None
    relations: tuple[str, ...] = ()
    rewritten: str | None = None  # suppress mode: the SQL that ran; its relations are read at flush time
    epsilon: Decimal | float | None = None
    delta: Decimal | float | None = None
    rows_sent: int | None = None
    rho: Decimal | float | None = None
    delta_add: Decimal | float | None = None


class AuditTrail:
    def __init__(self, dsn: str, capacity: int = CAPACITY, batch: int = BATCH,
                 interval: float = FLUSH_INTERVAL) -> None:
        self._dsn = dsn
        self.capacity = capacity
        self._batch = batch
        self._interval = interval
        self._buffer: deque[AuditRecord] = deque()
        self._dropped = 0  # records dropped since the last 'lost' row was written
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._next_purge = 0.0  # time.monotonic() of the next audit_purge call
        self._quiet_until = 0.0  # time.monotonic() before which write failures are not logged again
        self._relations: dict[str, tuple[str, ...]] = {}
        # (session, decision) -> the client's text of a statement the proxy answers itself, from decided()
        self._texts: dict[tuple[str, Decision], str] = {}

    # -- what sessions call (no I/O) ------------------------------------------------

    def decided(self, who: Who, mode: str, sql: str, decision: Decision) -> None:
        """The gate's decision on a statement; those the proxy answers itself are recorded by ``answered``."""
        if isinstance(decision, DeclareCursor):
            decision = decision.query  # a cursor's query is answered (or passed) as a plain one
        if isinstance(decision, (Noisy, ExplainDP, ExplainSuppress, SessionSetting)) or (
                isinstance(decision, Intercept) and decision.setting in PROXY_SETTINGS):
            # Its decision holds the statement without the comments around it: keep the client's text for later.
            if len(self._texts) >= TEXTS_SIZE:
                self._texts.clear()
            self._texts[(who.session_id, decision)] = sql
            return
        if isinstance(decision, Reject):
            self._add(AuditRecord(time.time(), who, mode, sql, "refused", decision.sqlstate, decision.message))
        elif isinstance(decision, Rewrite):
            self._add(AuditRecord(time.time(), who, mode, sql, "answered", rewritten=decision.sql))
        elif isinstance(decision, Pass):
            self._add(AuditRecord(time.time(), who, mode, sql, "passed"))
        elif isinstance(decision, Relayed):  # run under the client's login, with its privilege probes rewritten
            self._add(AuditRecord(time.time(), who, mode, sql, "passed", rewritten=decision.sql))
        else:
            self._add(AuditRecord(time.time(), who, mode, sql, "intercepted"))

    def answered(self, who: Who, mode: str, decision: Decision, spent: Spent, reply: object) -> None:
        """A statement the proxy answered (or refused) itself, with what it read and was charged."""
        refused = spent.sqlstate is not None
        if isinstance(reply, Result):
            spent.rows_sent = len(reply.rows)
        text = self._texts.get((who.session_id, decision)) or statement_text(decision)
        self._add(AuditRecord(time.time(), who, mode, text, "refused" if refused else "answered",
                              spent.sqlstate, spent.message, spent.relations, epsilon=spent.epsilon,
                              delta=spent.delta, rows_sent=spent.rows_sent, rho=spent.rho,
                              delta_add=spent.delta_add))

    def _add(self, record: AuditRecord) -> None:
        if len(self._buffer) >= self.capacity:
            self._dropped += 1
            return
        self._buffer.append(record)
        if len(self._buffer) >= self._batch:
            self._wake.set()

    # -- the background writer ----------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop the background task, then write what is left (for at most ``STOP_TIMEOUT`` seconds)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_TIMEOUT):
                await self.flush()
        if self._buffer:
            log.warning("audit trail: %d records could not be written before the proxy stopped", len(self._buffer))
        if self._conn is not None:
            await self._conn.close()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)
            self._wake.clear()
            await self.flush()

    async def flush(self) -> None:
        """Write the buffered records, a batch at a time.

        While the database cannot be reached the records stay in the buffer for the next flush; a batch the
        database refuses (it could never be written) is counted as dropped, so that the records after it are not
        held up and the trail still says how many are missing."""
        batch = 0
        try:
            if self._conn is None or self._conn.closed:
                self._conn = await psycopg.AsyncConnection.connect(self._dsn, autocommit=True,
                                                                   application_name="anonproxy audit")
            if time.monotonic() >= self._next_purge:
                deleted = (await (await self._conn.execute("select anonproxy.audit_purge()")).fetchone() or (0,))[0]
                if deleted:
                    log.info("audit trail: %d records older than the retention deleted", deleted)
                self._next_purge = time.monotonic() + PURGE_INTERVAL
            while self._buffer or self._dropped:
                batch = min(self._batch, len(self._buffer))
                rows = [self._row(self._buffer[i]) for i in range(batch)]
                dropped = self._dropped
                if dropped:
                    rows.append(_lost_row(dropped))
                await self._conn.execute("select anonproxy.audit_write(%s)", (Jsonb(rows),))
                if dropped:
                    log.warning("audit trail: %d records were dropped (the buffer of %d was full, or the database "
                                "refused them); a row with decision 'lost' says so", dropped, self.capacity)
                self._dropped -= dropped
                for _ in range(batch):
                    self._buffer.popleft()
        except psycopg.OperationalError as exc:
            self._warn(f"audit trail: cannot write ({str(exc).strip()}); {len(self._buffer)} records wait in the "
                       "buffer")
            if self._conn is not None:
                await self._conn.close()
                self._conn = None
        except (psycopg.Error, TypeError, ValueError) as exc:
            self._warn(f"audit trail: the database refused a batch of {batch} records ({str(exc).strip()}); "
                       "they are counted as dropped")
            for _ in range(batch):
                self._buffer.popleft()
            self._dropped += batch

    def _warn(self, message: str) -> None:
        """A failure to write, logged at most once a minute: the database may stay down for long."""
        if time.monotonic() >= self._quiet_until:
            log.warning("%s", message)
            self._quiet_until = time.monotonic() + WARNING_INTERVAL

    def _row(self, record: AuditRecord) -> dict[str, Any]:
        who = record.who
        relations = record.relations if record.rewritten is None else self._relations_of(record.rewritten)
        statement = record.statement
        if len(statement) > MAX_STATEMENT:
            statement = f"{statement[:MAX_STATEMENT]}… ({len(statement) - MAX_STATEMENT} more characters)"
        return {"at": record.at, "login": who.login, "database": who.database, "client_addr": who.client_addr,
                "client_port": who.client_port, "session_id": who.session_id, "mode": record.mode,
                "statement": statement, "decision": record.decision, "sqlstate": record.sqlstate,
                "message": record.message, "relations": list(relations), "epsilon": _number(record.epsilon),
                "delta": _number(record.delta), "rho": _number(record.rho),
                "delta_add": _number(record.delta_add), "rows_sent": record.rows_sent}

    def _relations_of(self, sql: str) -> tuple[str, ...]:
        """The tables a rewritten query reads, from its tree (cached: a dashboard repeats its queries)."""
        relations = self._relations.get(sql)
        if relations is None:
            if len(self._relations) >= RELATIONS_CACHE_SIZE:
                self._relations.clear()
            relations = self._relations[sql] = tables_read(sql)
        return relations


def tables_read(sql: str) -> tuple[str, ...]:
    """``schema.table`` of every table ``sql`` reads (CTE names left out), sorted; () if it cannot be parsed."""
    try:
        tree = sqlglot.parse_one(sql, dialect=DIALECT)
    except SqlglotError:
        return ()
    ctes = {cte.alias for cte in tree.find_all(exp.CTE)}
    return tuple(sorted({f"{table.db}.{table.name}" if table.db else table.name
                         for table in tree.find_all(exp.Table) if table.db or table.name not in ctes}))


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


def _lost_row(count: int) -> dict[str, Any]:
    return {"at": time.time(), "decision": "lost",
            "statement": f"{count} audit record(s) dropped: the proxy's buffer was full or the database refused them"}


def _number(value: Decimal | float | None) -> str | None:
    """Exact in the database: a float as its shortest repr (as the ledger charges it), a Decimal as it is."""
    return None if value is None else str(value)
