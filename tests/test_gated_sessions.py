"""Gated roles inside transactions behave as PostgreSQL does.

A statement the proxy refuses, or one that fails on the service path (a rewritten query's error on the service
connection, a dp answer's error), inside a transaction block fails that transaction as any error does in
PostgreSQL: later statements get 25P02 until ROLLBACK, COMMIT reports ROLLBACK, ROLLBACK TO SAVEPOINT recovers,
and every ReadyForQuery carries the status of the client's own connection.

Each sequence runs twice: through the proxy as a gated role, and on a direct connection to PostgreSQL as the same
role, which has no privilege on the protected tables, so that there the same failing statement fails with
PostgreSQL's own 42501. The expectation is PostgreSQL's behaviour for the sequence, compared step by step: each
step's outcome (success and its command tag and rows, 25P02, or another error) and the transaction status after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role

REFUSED = "select age from public.adult"  # row-level data: the proxy refuses it
SERVICE_ERROR = "select count(*) from public.adult where age > 2147483647 + 1"  # 22003 where the answer is made
COUNT = "select count(*) from public.adult"  # a gated aggregate, answered where it is allowed

# Sequences of statements, F standing for the failing one.
SEQUENCES = {
    "commit": ["begin", "F", "select 1", "F", "commit", "select 1"],
    "rollback": ["begin", "select set_config('x11.mark', 'in the block', false)", "F", "rollback",
                 "select current_setting('x11.mark', true)"],
    "savepoint": ["begin", "savepoint s", "F", "select 1", "F", "rollback to savepoint s", "select 1",
                  "release savepoint s", "commit"],
    "work undone": ["begin", "select set_config('x11.mark', 'kept?', false)", "savepoint s",
                    "select set_config('x11.mark', 'after the savepoint', false)", "F", "rollback to savepoint s",
                    "select current_setting('x11.mark')", "commit", "select current_setting('x11.mark')"],
}

Outcome = tuple[object, ...]


def _steps(sequence: str, failing: str) -> list[str]:
    return [failing if step == "F" else step for step in SEQUENCES[sequence]]


def _psycopg_outcomes(dsn: str, steps: list[str], simple: bool) -> list[Outcome]:
    """Each step's outcome on a psycopg connection: the simple protocol (ClientCursor) or the extended one."""
    factory = psycopg.ClientCursor if simple else psycopg.Cursor
    outcomes: list[Outcome] = []
    with psycopg.connect(dsn, autocommit=True, cursor_factory=factory) as conn:
        for step in steps:
            try:
                cursor = conn.execute(step)
                outcome: Outcome = ("ok", cursor.statusmessage, cursor.fetchall() if cursor.description else None)
            except psycopg.Error as error:
                outcome = ("25P02",) if error.sqlstate == "25P02" else ("error",)
            outcomes.append((*outcome, conn.info.transaction_status.name))
    return outcomes


async def _asyncpg_outcomes(url: str, steps: list[str], simple: bool) -> list[Outcome]:
    """Each step's outcome on an asyncpg connection: execute() (the simple protocol) or fetch() (prepared and bound,
    the extended protocol) for the queries; transaction statements by execute(), for their command tags."""
    outcomes: list[Outcome] = []
    conn = await asyncpg.connect(url)
    try:
        for step in steps:
            try:
                if simple or not step.startswith("select"):
                    outcome: Outcome = ("ok", await conn.execute(step), None)
                else:
                    outcome = ("ok", None, [tuple(row) for row in await conn.fetch(step)])
            except asyncpg.PostgresError as error:
                outcome = ("25P02",) if error.sqlstate == "25P02" else ("error",)
            outcomes.append((*outcome, conn.is_in_transaction()))
    finally:
        await conn.close()
    return outcomes


@pytest.fixture(scope="module")
def dp_role(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:
    with fresh_dp_role(truth, gated_proxy, gated_database, "x11_analyst", epsilon=20) as role:
        yield role


def _role(mode: str, dp_role: str) -> str:
    return "reporter" if mode == "suppress" else dp_role


@pytest.mark.parametrize("sequence", list(SEQUENCES))
@pytest.mark.parametrize("failing", [REFUSED, SERVICE_ERROR], ids=["refused", "service error"])
@pytest.mark.parametrize("mode", ["suppress", "dp"])
@pytest.mark.parametrize("simple", [True, False], ids=["simple", "extended"])
def test_psycopg_failed_transaction_as_postgresql(gated_proxy: Endpoint, direct: Endpoint, gated_database: str,
                                                  dp_role: str, sequence: str, failing: str, mode: str,
                                                  simple: bool) -> None:
    role = _role(mode, dp_role)
    steps = _steps(sequence, failing)
    expected = _psycopg_outcomes(direct.dsn(gated_database, user=role), steps, simple)
    assert ("error", "INERROR") in [(o[0], o[-1]) for o in expected]  # the statement fails in PostgreSQL too
    assert _psycopg_outcomes(gated_proxy.dsn(gated_database, user=role), steps, simple) == expected


@pytest.mark.parametrize("sequence", ["commit", "savepoint"])
@pytest.mark.parametrize("failing", [REFUSED, SERVICE_ERROR], ids=["refused", "service error"])
@pytest.mark.parametrize("mode", ["suppress", "dp"])
@pytest.mark.parametrize("simple", [True, False], ids=["simple", "extended"])
def test_asyncpg_failed_transaction_as_postgresql(gated_proxy: Endpoint, direct: Endpoint, gated_database: str,
                                                  dp_role: str, sequence: str, failing: str, mode: str,
                                                  simple: bool) -> None:
    role = _role(mode, dp_role)
    steps = _steps(sequence, failing)
    expected = asyncio.run(_asyncpg_outcomes(direct.url(gated_database, user=role), steps, simple))
    assert ("ROLLBACK" if sequence == "commit" else "RELEASE") in [o[1] for o in expected]
    assert asyncio.run(_asyncpg_outcomes(gated_proxy.url(gated_database, user=role), steps, simple)) == expected


@pytest.mark.parametrize("mode", ["suppress", "dp"])
def test_gated_answers_after_rollback_to_savepoint(gated_proxy: Endpoint, gated_database: str,
                                                   truth: psycopg.Connection, dp_role: str, mode: str) -> None:
    """Recovered with ROLLBACK TO SAVEPOINT, the transaction goes on: a gated aggregate is answered in it (suppress:
    the exact count, as PostgreSQL counts it), and COMMIT commits."""
    with psycopg.connect(gated_proxy.dsn(gated_database, user=_role(mode, dp_role))) as conn:
        conn.execute("select 1")  # psycopg opens the transaction block
        with pytest.raises(psycopg.Error):
            with conn.transaction():  # a savepoint, rolled back to when the block raises
                conn.execute(REFUSED)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        (count,) = conn.execute(COUNT).fetchone() or (None,)
        assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert conn.execute("commit").statusmessage == "COMMIT"
    if mode == "suppress":
        assert count == truth.execute(COUNT).fetchone()[0]
    else:
        assert isinstance(count, int)


def test_asyncpg_nested_transaction_recovers(gated_proxy: Endpoint, gated_database: str,
                                             truth: psycopg.Connection) -> None:
    """asyncpg's nested transaction (a savepoint) around a refused statement: rolled back to, the outer transaction
    answers a gated aggregate and commits."""
    async def scenario() -> tuple[int, str]:
        conn = await asyncpg.connect(gated_proxy.url(gated_database, user="reporter"))
        try:
            async with conn.transaction():
                with pytest.raises(asyncpg.PostgresError):
                    async with conn.transaction():
                        await conn.fetch(REFUSED)
                count = await conn.fetchval(COUNT)
                status = await conn.execute("select 1")
            return count, status
        finally:
            await conn.close()

    count, status = asyncio.run(scenario())
    assert count == truth.execute(COUNT).fetchone()[0]
    assert status == "SELECT 1"
