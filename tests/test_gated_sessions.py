"""Gated roles inside transactions and sessions behave as PostgreSQL does.

A statement the proxy refuses, or one that fails on the service path (a rewritten query's error on the service
connection, a dp answer's error), inside a transaction block fails that transaction as any error does in
PostgreSQL: later statements get 25P02 until ROLLBACK, COMMIT reports ROLLBACK, ROLLBACK TO SAVEPOINT recovers,
and every ReadyForQuery carries the status of the client's own connection.

Each sequence runs twice: through the proxy as a gated role, and on a direct connection to PostgreSQL as the same
role, which has no privilege on the protected tables, so that there the same failing statement fails with
PostgreSQL's own 42501. The expectation is PostgreSQL's behaviour for the sequence, compared step by step: each
step's outcome (success and its command tag and rows, 25P02, or another error) and the transaction status after it.

Session settings that shape how values print (IntervalStyle, DateStyle, TimeZone, extra_float_digits,
bytea_output) print gated answers, computed away from the client's connection, as PostgreSQL prints the same values.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role, wait_for_current_policy
from psycopg import sql
from psycopg.types.string import TextLoader

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
    "work undone": ["begin", "select set_config('x11.mark', 'before the savepoint', false)", "savepoint s",
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


def _pipeline_outcomes(dsn: str, failing: str) -> list[object]:
    """In a transaction block, one batch (psycopg's pipeline: one Sync at its end) whose second statement fails:
    what the pipeline raises, then the transaction's status and what the next statements get."""
    outcomes: list[object] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("begin")
        try:
            with conn.pipeline():
                conn.execute("select 1")
                conn.execute(failing)
                conn.execute("select 2")
        except psycopg.Error as error:
            outcomes.append("25P02" if error.sqlstate == "25P02" else "error")
        outcomes.append(conn.info.transaction_status.name)
        try:
            conn.execute("select 3")
        except psycopg.Error as error:
            outcomes.append(error.sqlstate)
        outcomes.append(conn.execute("commit").statusmessage)
    return outcomes


@pytest.mark.parametrize(("mode", "failing"), [("suppress", REFUSED), ("suppress", SERVICE_ERROR), ("dp", REFUSED),
                                               ("dp", SERVICE_ERROR)],
                         ids=["suppress-refused", "suppress-service error", "dp-refused", "dp-answer error"])
def test_psycopg_pipeline_failed_transaction_as_postgresql(gated_proxy: Endpoint, direct: Endpoint,
                                                           gated_database: str, dp_role: str, mode: str,
                                                           failing: str) -> None:
    """An error in the middle of a batch, the statements around it on the client's connection (more in
    test_gated_pipelines.py)."""
    role = _role(mode, dp_role)
    expected = _pipeline_outcomes(direct.dsn(gated_database, user=role), failing)
    assert expected[-1] == "ROLLBACK"
    assert _pipeline_outcomes(gated_proxy.dsn(gated_database, user=role), failing) == expected


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
        row = conn.execute(COUNT).fetchone()
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert conn.execute("commit").statusmessage == "COMMIT"
    assert row is not None
    if mode == "suppress":
        assert row == truth.execute(COUNT).fetchone()
    else:
        assert isinstance(row[0], int)  # a noisy count


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


# -- session settings that shape how answers print ---------------------------------------------------------------

SETTINGS = {"IntervalStyle": "iso_8601", "DateStyle": "SQL, DMY", "TimeZone": "Asia/Kolkata",
            "extra_float_digits": "-4", "bytea_output": "escape"}
KEYS = "select day, at, length, tag, count(*) from public.x11_kinds group by day, at, length, tag order by day"
MEAN = "select half, avg(score)::float8 from public.x11_kinds group by half order by half"


@pytest.fixture(scope="module")
def kinds(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str, dp_role: str) -> Iterator[None]:
    """A protected table with a key of each type whose printing a setting changes: 1000 people in two groups of
    500 (dp's partition selection releases both)."""
    truth.execute("create table public.x11_kinds (person int, half int, score float8, day date, at timestamptz, "
                  "length interval, tag bytea)")
    truth.execute("insert into public.x11_kinds select p, p % 2, p / 7.0, date '2024-03-01' + (p % 2) * 40, "
                  "timestamptz '2024-03-01 22:30:00+00' + (p % 2) * interval '1 day', "
                  "interval '1 day 02:03:04.5' * (1 + p % 2), "
                  "decode(case p % 2 when 0 then '615c62' else '00ff0a' end, 'hex') from generate_series(1, 1000) p")
    truth.execute("select anonproxy.protect_table('public.x11_kinds', 'person')")
    truth.execute("select anonproxy.set_column('public.x11_kinds', 'score', 'sensitive', 0, 200)")
    truth.execute("select anonproxy.apply_grants()")
    truth.execute("select anonproxy.set_budget(%s, 'public.x11_kinds', 100, 0.001, null, 1, 0.00001)", [dp_role])
    wait_for_current_policy(truth, gated_proxy, gated_database)
    yield
    truth.execute("select anonproxy.drop_budget(%s, 'public.x11_kinds')", [dp_role])
    truth.execute("select anonproxy.unprotect_table('public.x11_kinds')")
    truth.execute("drop table public.x11_kinds")


def _printed(conn: psycopg.Connection, query: str) -> list[tuple[str | None, ...]]:
    """The answer's values as the server (or the proxy) printed them."""
    for oid in ("float8", "date", "timestamptz", "interval", "bytea", "int8"):
        conn.adapters.register_loader(oid, TextLoader)
    return conn.execute(query).fetchall()


def _as_postgresql(truth: psycopg.Connection, query: str, settings: dict[str, str]) -> list[tuple[str | None, ...]]:
    """PostgreSQL's own printing of the answer under ``settings``."""
    with truth.transaction():
        for name, value in settings.items():
            truth.execute("select set_config(%s, %s, true)", [name, value])
        return _printed(truth, query)


@pytest.mark.parametrize("mode", ["suppress", "dp"])
def test_settings_print_gated_answers_as_postgresql(gated_proxy: Endpoint, gated_database: str,
                                                    truth: psycopg.Connection, dp_role: str, kinds: None,
                                                    mode: str) -> None:
    """IntervalStyle, DateStyle, TimeZone, extra_float_digits and bytea_output set in the session print a gated
    answer's keys (dates, timestamptz, intervals, bytea; suppress: also its exact float mean) as PostgreSQL prints
    the same values; a SET rolled back, and a SET LOCAL once its transaction is over, no longer apply."""
    with psycopg.connect(gated_proxy.dsn(gated_database, user=_role(mode, dp_role)), autocommit=True) as conn:
        for name, value in SETTINGS.items():
            conn.execute(sql.SQL("set {} = {}").format(sql.Identifier(name), sql.Literal(value)))
        keys = _printed(conn, KEYS)
        mean = _printed(conn, MEAN) if mode == "suppress" else None
        conn.execute("begin")
        conn.execute("set IntervalStyle = 'postgres_verbose'")
        conn.execute("set local bytea_output = 'hex'")
        in_block = _printed(conn, KEYS)
        conn.execute("rollback")
        after = _printed(conn, KEYS)
    expected = _as_postgresql(truth, KEYS, SETTINGS)
    assert expected != _as_postgresql(truth, KEYS, {})  # the settings matter for this answer

    def key_columns(rows: list[tuple[str | None, ...]]) -> list[tuple[str | None, ...]]:
        return rows if mode == "suppress" else [row[:-1] for row in rows]  # (dp: noisy counts)

    assert key_columns(keys) == key_columns(expected)
    assert key_columns(in_block) == key_columns(_as_postgresql(
        truth, KEYS, {**SETTINGS, "IntervalStyle": "postgres_verbose", "bytea_output": "hex"}))
    assert key_columns(after) == key_columns(expected)
    if mean is not None:
        assert mean == _as_postgresql(truth, MEAN, SETTINGS)
