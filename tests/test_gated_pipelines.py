"""A gated session's pipelined batch whose statement in the middle fails behaves as PostgreSQL: the rest of the batch,
up to the client's Sync, is skipped (run on no connection), the client gets one error, and the ReadyForQuery that
ends the batch carries the right transaction status.

A gated batch mixes owners: the failing statement is a rewritten aggregate that fails on the proxy's service
connection (22003: an integer overflow in the answer's SQL), or a dp answer that fails in the proxy; the statements
around it (``select 1``, ``nextval`` of a sequence, which no rollback undoes) go to the client's own connection;
and the other way round, an error on the client's connection (22012) before a gated aggregate. Each
sequence runs twice: through the proxy as a gated role, and straight to PostgreSQL as the same role, which has no
privilege on the protected table, so that there the same statement fails with PostgreSQL's own 42501. The
expectation is what PostgreSQL does: which statements ran (a ``nextval`` after the error draws nothing), what the
pipeline raised, the transaction status after it, and what the next statements get.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role

SERVICE_ERROR = "select count(*) from public.adult where age > 2147483647 + 1"  # 22003 where the answer is made
MARKS = "public.y12_marks"  # a sequence the batches draw from: a skipped nextval leaves it as it was
DRAW = f"select nextval('{MARKS}')"
COUNT = "select count(*) from public.adult"  # a gated aggregate, answered on the service connection

Outcome = list[object]


@pytest.fixture
def marks(truth: psycopg.Connection) -> Iterator[None]:
    truth.execute(f"drop sequence if exists {MARKS}")
    truth.execute(f"create sequence {MARKS}")
    truth.execute(f"grant usage on sequence {MARKS} to public")
    yield
    truth.execute(f"drop sequence {MARKS}")


@pytest.fixture(scope="module")
def dp_role(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:
    with fresh_dp_role(truth, gated_proxy, gated_database, "y12_analyst", epsilon=20) as role:
        yield role


def _role(mode: str, dp_role: str) -> str:
    return "reporter" if mode == "suppress" else dp_role


def _drawn(truth: psycopg.Connection) -> int:
    """How many values were drawn from the sequence, which starts again for the next run."""
    last_value, is_called = truth.execute(f"select last_value, is_called from {MARKS}").fetchone()
    truth.execute(f"alter sequence {MARKS} restart")
    return last_value if is_called else 0


def _error(error: Exception) -> str:
    """25P02 kept apart; any other error the same (the proxy's 22003 stands for PostgreSQL's 42501 here)."""
    return "25P02" if getattr(error, "sqlstate", None) == "25P02" else "error"


def _psycopg_pipeline(dsn: str, truth: psycopg.Connection, in_block: bool,
                      statements: tuple[str, ...] = ("select 1", SERVICE_ERROR, DRAW, "select 2")) -> Outcome:
    """One pipeline (one Sync at its end) of ``statements``, one of which fails (by default: a statement on the
    client's connection, the failing one, then a ``nextval`` and a ``select`` that PostgreSQL skips); what it
    raised, the transaction status, what the next statements get and the values drawn."""
    outcome: Outcome = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        if in_block:
            conn.execute("begin")
        try:
            with conn.pipeline():
                for statement in statements:
                    conn.execute(statement)
        except psycopg.Error as error:
            outcome.append(_error(error))
        outcome.append(conn.info.transaction_status.name)
        try:
            outcome.append(conn.execute("select 3").fetchall())
        except psycopg.Error as error:
            outcome.append(_error(error))
        if in_block:
            outcome.append(conn.execute("commit").statusmessage)
        outcome.append(conn.execute("select 4").fetchall())
    return [*outcome, _drawn(truth)]


@pytest.mark.parametrize("in_block", [False, True], ids=["autocommit", "transaction block"])
@pytest.mark.parametrize("mode", ["suppress", "dp"])
def test_psycopg_pipeline_skips_after_a_service_error(gated_proxy: Endpoint, direct: Endpoint,
                                                      gated_database: str, truth: psycopg.Connection, marks: None,
                                                      dp_role: str, mode: str, in_block: bool) -> None:
    role = _role(mode, dp_role)
    expected = _psycopg_pipeline(direct.dsn(gated_database, user=role), truth, in_block)
    assert expected[0] == "error" and expected[-1] == 0  # PostgreSQL: one error, the nextval skipped
    assert _psycopg_pipeline(gated_proxy.dsn(gated_database, user=role), truth, in_block) == expected


@pytest.mark.parametrize("in_block", [False, True], ids=["autocommit", "transaction block"])
def test_psycopg_pipeline_skips_a_gated_aggregate_after_an_error(gated_proxy: Endpoint, direct: Endpoint,
                                                                 gated_database: str, truth: psycopg.Connection,
                                                                 marks: None, in_block: bool) -> None:
    """The other way round: the error comes from the client's own connection (22012), whose part the gate ends
    with a Sync of its own when the gated aggregate comes; the aggregate and the ``nextval`` after it are skipped."""
    statements = ("select 1 / 0", COUNT, DRAW)
    expected = _psycopg_pipeline(direct.dsn(gated_database, user="reporter"), truth, in_block, statements)
    assert expected[0] == "error" and expected[-1] == 0
    assert _psycopg_pipeline(gated_proxy.dsn(gated_database, user="reporter"), truth, in_block,
                             statements) == expected


def _psycopg_two_parts(dsn: str, truth: psycopg.Connection) -> Outcome:
    """In a transaction block, a pipeline of two batches (``pipeline.sync()`` between them): the failing statement
    and a ``nextval`` that PostgreSQL skips, then a ``select 1`` that gets 25P02 in the failed block; then a
    ``nextval`` after the rollback."""
    outcome: Outcome = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("begin")
        try:
            with conn.pipeline() as pipeline:
                conn.execute(SERVICE_ERROR)
                conn.execute(DRAW)
                pipeline.sync()
                conn.execute("select 1")
        except psycopg.Error as error:
            outcome.append(_error(error))
        outcome.append(conn.info.transaction_status.name)
        outcome.append(conn.execute("rollback").statusmessage)
        conn.execute(DRAW)
    return [*outcome, _drawn(truth)]


def test_psycopg_pipeline_second_batch_after_a_service_error(gated_proxy: Endpoint, direct: Endpoint,
                                                              gated_database: str, truth: psycopg.Connection,
                                                              marks: None) -> None:
    """The error skips its own batch only: the next batch, after the client's Sync, gets 25P02 as PostgreSQL
    answers it in the failed block; the one value drawn is the one after the rollback."""
    expected = _psycopg_two_parts(direct.dsn(gated_database, user="reporter"), truth)
    assert expected[-1] == 1
    assert _psycopg_two_parts(gated_proxy.dsn(gated_database, user="reporter"), truth) == expected


async def _asyncpg_executemany(url: str) -> Outcome:
    """asyncpg's executemany: one batch of Bind/Execute per row of arguments, with one Sync at its end; the
    statement's first row fails on the service side (its value overflows there), so the others are skipped."""
    conn = await asyncpg.connect(url)
    outcome: Outcome = []
    try:
        try:
            await conn.executemany("select count(*) from public.adult where age > $1::int + 1",
                                   [(2147483647,), (1,), (2,)])
        except asyncpg.PostgresError as error:
            outcome.append(_error(error))
        outcome.append(conn.is_in_transaction())
        outcome.append(await conn.fetchval("select 5"))
    finally:
        await conn.close()
    return outcome


@pytest.mark.parametrize("mode", ["suppress", "dp"])
def test_asyncpg_executemany_after_a_service_error(gated_proxy: Endpoint, direct: Endpoint, gated_database: str,
                                                    dp_role: str, mode: str) -> None:
    role = _role(mode, dp_role)
    expected = asyncio.run(_asyncpg_executemany(direct.url(gated_database, user=role)))
    assert expected == ["error", False, 5]
    assert asyncio.run(_asyncpg_executemany(gated_proxy.url(gated_database, user=role))) == expected


async def _asyncpg_transaction(url: str) -> Outcome:
    """An asyncpg transaction whose statements fail one after the other: the failing one, then a ``nextval`` and a
    statement on the client's connection (25P02 there), then the transaction rolled back by asyncpg."""
    conn = await asyncpg.connect(url)
    outcome: Outcome = []
    try:
        try:
            async with conn.transaction():
                for statement in (SERVICE_ERROR, DRAW, "select 1"):
                    try:
                        outcome.append(await conn.fetch(statement))
                    except asyncpg.PostgresError as error:
                        outcome.append(_error(error))
                outcome.append(conn.is_in_transaction())
        except asyncpg.PostgresError as error:
            outcome.append(_error(error))
        outcome.append(conn.is_in_transaction())
    finally:
        await conn.close()
    return outcome


def test_asyncpg_transaction_after_a_service_error(gated_proxy: Endpoint, direct: Endpoint, gated_database: str,
                                                   truth: psycopg.Connection, marks: None) -> None:
    expected = asyncio.run(_asyncpg_transaction(direct.url(gated_database, user="reporter"))) + [_drawn(truth)]
    assert expected == ["error", "25P02", "25P02", True, False, 0]
    got = asyncio.run(_asyncpg_transaction(gated_proxy.url(gated_database, user="reporter"))) + [_drawn(truth)]
    assert got == expected
