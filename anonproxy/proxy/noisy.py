"""Differentially private answers for roles in mode ``dp`` (one per worker).

For one query: plan it (anonproxy.privacy.dp_plan) with the role's per-query
ε and δ from its budget, return the cached answer if the same question was
already paid for on the same data, else run the contribution-bounded SQL,
add noise, and charge the ledger — committed before a byte of the answer
leaves (anonproxy.privacy.ledger). The answer is the wire messages of a
simple query without its ReadyForQuery, which the gate adds.

Queries run on a psycopg connection of the service role, separate from the
sessions' read-only service connections because the ledger writes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from decimal import Decimal
from typing import Any

import psycopg

from ..policy.model import Policy, RolePolicy
from ..privacy import ledger
from ..privacy.dp_plan import DPParams, DPPlan, answer, plan_dp
from ..rewrite.decision import Reject
from ..wire import protocol as pg

log = logging.getLogger("anonproxy.dp")

# Used when a budget does not say what one query costs.
DEFAULT_EPSILON = 0.5
DEFAULT_DELTA = 1e-7

_TYPE_OIDS: dict[type, int] = {bool: 16, int: 20, Decimal: 1700, float: 701, str: 25}
_TYPE_BY_KIND = {"key": 25, "count": 20, "sum": 1700, "avg": 1700}


class NoisyAnswers:
    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock = asyncio.Lock()  # one connection, one question at a time

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()

    async def answer(self, sql: str, role: RolePolicy, policy: Policy) -> bytes:
        first = plan_dp(sql, role, policy, DPParams(DEFAULT_EPSILON, DEFAULT_DELTA))
        if isinstance(first, Reject):
            return _error(first.sqlstate, first.message, first.hint)
        try:
            async with self._lock:
                conn = await self._connection()
                budget = await ledger.remaining(conn, role.role, first.table)
                params = DPParams(float(budget.epsilon_per_query or DEFAULT_EPSILON),
                                  float(budget.delta_per_query or DEFAULT_DELTA))
                plan = plan_dp(sql, role, policy, params)
                if isinstance(plan, Reject):
                    return _error(plan.sqlstate, plan.message, plan.hint)
                return await self._answer(conn, plan, role.role, policy.version)
        except ledger.BudgetError as exc:
            return _error(exc.sqlstate, exc.message, exc.hint, exc.detail)
        except psycopg.OperationalError as exc:
            log.warning("dp connection failed: %s", str(exc).strip())
            self._conn = None
            return _error("08006", "anonproxy lost its connection to the PostgreSQL server", "Try again.")

    async def _answer(self, conn: psycopg.AsyncConnection[Any], plan: DPPlan, role: str, version: int) -> bytes:
        # The whole plan, post-processing (ORDER BY, LIMIT, output columns) included, and the policy it obeys:
        # the same question asked again, however it is spelled, gets the same answer at no cost.
        fingerprint = hashlib.sha256(f"{version}\0{plan!r}".encode()).hexdigest()
        data_version = await ledger.data_version(conn, [plan.table])
        cached = await ledger.cached_answer(conn, role, fingerprint, data_version)
        if cached is not None:
            return cached + _notice("anonproxy: the same question on the same data was answered before; "
                                    "this is that answer, at no cost")
        rows = await (await conn.execute(plan.sql)).fetchall()
        noisy_rows, _ = answer(plan, rows)
        messages = _result(plan, noisy_rows) + _notice(
            f"anonproxy: differentially private answer, ε={plan.epsilon:g}, δ={plan.delta:g}",
            "\n".join(plan.notices()))
        charged = await ledger.charge_and_store(conn, role, plan.table, plan.epsilon, plan.delta, fingerprint,
                                                data_version, messages)
        left = charged.remaining
        return charged.answer + _notice(f"anonproxy: budget left on {plan.table}: "
                                        f"ε={_plain(left.epsilon)}, δ={_plain(left.delta)}")

    async def budget(self, role: str) -> bytes:
        """``SHOW anonproxy.budget``: one row per protected table the role has a budget on."""
        try:
            async with self._lock:
                budgets = await ledger.remaining_all(await self._connection(), role)
        except psycopg.OperationalError:
            self._conn = None
            return _error("08006", "anonproxy lost its connection to the PostgreSQL server", "Try again.")
        values = [f"{b.domain}: epsilon {_plain(b.epsilon)} of {_plain(b.epsilon_budget)} left, "
                  f"delta {_plain(b.delta)} of {_plain(b.delta_budget)} left" for b in budgets]
        return (pg.row_description(["anonproxy.budget"]) + b"".join(pg.data_row([v]) for v in values)
                + pg.command_complete("SHOW"))

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(self._dsn, autocommit=True)
        return self._conn


def _result(plan: DPPlan, rows: list[tuple[Any, ...]]) -> bytes:
    """RowDescription, DataRows (text format) and CommandComplete for the noisy rows."""
    oids = []
    for index, column in enumerate(plan.columns):
        sample = next((row[index] for row in rows if row[index] is not None), None)
        oids.append(_TYPE_OIDS.get(type(sample), _TYPE_BY_KIND.get(column.kind, 25)))
    description = pg.row_description([column.name for column in plan.columns], oids)
    data = b"".join(pg.data_row([None if value is None else str(value) for value in row]) for row in rows)
    return description + data + pg.command_complete(f"SELECT {len(rows)}")


def _plain(amount: Decimal) -> str:
    """1.50 -> 1.5, 10 -> 10, 0.00001 -> 0.00001."""
    return format(amount.normalize(), "f")


def _notice(message: str, detail: str | None = None) -> bytes:
    return pg.error_response("00000", message, severity="NOTICE", detail=detail, type_=b"N")


def _error(sqlstate: str, message: str, hint: str | None, detail: str | None = None) -> bytes:
    return pg.error_response(sqlstate, message, hint=hint, detail=detail)
