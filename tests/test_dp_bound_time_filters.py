"""A time filter bound as a parameter narrows dp's public time domain exactly as the same constant does.

ORMs and BI tools send a daily series' range as parameters (``where visited_at >= $1 and visited_at < $2 group by
date_trunc('day', visited_at)``: Knex, Kysely, Peewee, SQLAlchemy, Django, JDBC). The proxy decides those
parameters at Bind (anonproxy/plan/bind_values.py, "time" slots): the bound series lists the buckets of the
constant series, charged the same; the same range asked again is free, another range is another question; a
value the constant form refuses is refused at Bind, charged nothing. Real drivers through the real proxy:
psycopg with server-side binding (text format, typed by Python's value), asyncpg (binary format, typed by the
proxy's description).

The gated database holds the demo's ``public.visits`` (visited_at timestamptz, bounded to 2025-01-01 .. 2026-12-31
23:59:59 UTC).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import struct
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any

import asyncpg
import psycopg
import pytest
from bi_corpus import replay
from conftest import Endpoint, fresh_dp_role
from test_clients import NODE_DIR, ensure_node_modules, libpq_env, run

from anonproxy.plan.bind_values import Slot
from anonproxy.plan.refusals import Reject
from anonproxy.proxy.bind_time import class_text
from anonproxy.proxy.gate import Parameters
from anonproxy.route.decision import AtBind, Rewrite

_names = itertools.count(1)
DAILY = ("select date_trunc('day', visited_at) as day, count(*) as n from visits "
         "where visited_at >= {0} and visited_at < {1} group by date_trunc('day', visited_at) order by 1")
BETWEEN = ("select date_trunc('month', v.visited_at) as month, count(*) as n from visits as v "
           "where v.visited_at between {0} and {1} group by 1 order by 1")
MARCH = [datetime(2025, 3, 1, tzinfo=UTC) + timedelta(days=d) for d in range(31)]
NOISE = 28  # count(*) at ε 0.5: |noise| > 28 has probability < 1e-20


@pytest.fixture
def roles(truth: psycopg.Connection[Any], gated_proxy: Endpoint,
          gated_database: str) -> Iterator[tuple[psycopg.Connection[Any], psycopg.Connection[Any]]]:
    """Two dp roles with a budget each (ε 20): one writes constants, the other binds the same values."""
    first, second = f"dp_bound_{next(_names)}", f"dp_bound_{next(_names)}"
    with fresh_dp_role(truth, gated_proxy, gated_database, first, epsilon=20), \
            fresh_dp_role(truth, gated_proxy, gated_database, second, epsilon=20), \
            psycopg.connect(gated_proxy.dsn(gated_database, user=first), autocommit=True) as constant, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=second), autocommit=True) as bound:
        for conn in (constant, bound):
            conn.execute("set timezone = 'UTC'")
        yield constant, bound


def spent(conn: psycopg.Connection[Any]) -> str:
    return str(conn.execute("show anonproxy.budget").fetchone()[0])


def written(sql: str, *values: str) -> str:
    """``sql`` with its places written as the string constants ``values`` (test text only)."""
    return sql.format(*("'" + value + "'" for value in values))


def counts(truth: psycopg.Connection[Any], sql: str) -> dict[datetime, int]:
    truth.execute("set timezone = 'UTC'")
    return {row[0]: row[1] for row in truth.execute(sql)}


@pytest.mark.parametrize("low, high", [
    ("2025-03-01", "2025-04-01"),  # text, undeclared type: read as the column's type
    (datetime(2025, 3, 1, tzinfo=UTC), datetime(2025, 4, 1, tzinfo=UTC)),  # timestamptz
    (datetime(2025, 3, 1), datetime(2025, 4, 1)),  # timestamp: widened to timestamptz in the session's zone
    (date(2025, 3, 1), date(2025, 4, 1)),  # date: the same
], ids=["text", "timestamptz", "timestamp", "date"])
def test_a_bound_daily_series_has_the_buckets_and_charge_of_the_constant_one(
        roles: tuple[psycopg.Connection[Any], psycopg.Connection[Any]], truth: psycopg.Connection[Any],
        low: object, high: object) -> None:
    constant, bound = roles
    expected = constant.execute(written(DAILY, "2025-03-01", "2025-04-01")).fetchall()
    assert [row[0] for row in expected] == MARCH
    notices: list[str] = []
    bound.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    rows = bound.execute(DAILY.format("%s", "%s"), [low, high], prepare=True).fetchall()
    assert [row[0] for row in rows] == MARCH  # not the 730 days of the declared range
    exact = counts(truth, written(DAILY, "2025-03-01 00:00+00", "2025-04-01 00:00+00"))
    assert all(abs(n - exact.get(day, 0)) <= NOISE for day, n in rows)
    assert spent(bound) == spent(constant)  # the same ε, the same buckets: the same charge
    assert notices and "it costs" in notices[0]


def test_the_same_range_replays_free_and_another_range_is_charged(
        roles: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    _, bound = roles
    sql = DAILY.format("%s", "%s")
    first = bound.execute(sql, ["2025-03-01", "2025-04-01"], prepare=True).fetchall()
    after_first = spent(bound)
    assert bound.execute(sql, ["2025-03-01", "2025-04-01"], prepare=True).fetchall() == first  # a replay
    assert spent(bound) == after_first
    april = bound.execute(sql, ["2025-04-01", "2025-05-01"], prepare=True).fetchall()
    assert [row[0] for row in april] == [datetime(2025, 4, 1, tzinfo=UTC) + timedelta(days=d) for d in range(30)]
    assert spent(bound) != after_first  # another range: another question


def test_between_with_an_alias(roles: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    constant, bound = roles
    expected = constant.execute(written(BETWEEN, "2025-03-15", "2025-06-01")).fetchall()
    rows = bound.execute(BETWEEN.format("%s", "%s"), ["2025-03-15", "2025-06-01"], prepare=True).fetchall()
    months = [datetime(2025, m, 1, tzinfo=UTC) for m in (3, 4, 5, 6)]
    assert [row[0] for row in rows] == [row[0] for row in expected] == months
    assert spent(bound) == spent(constant)


def test_a_value_the_constant_refuses_is_refused_and_charges_nothing(
        roles: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    constant, bound = roles
    with pytest.raises(psycopg.Error) as refused_constant:
        constant.execute(written(DAILY, "not a day", "2025-04-01"))
    before = spent(bound)
    with pytest.raises(psycopg.Error) as refused_bound:
        bound.execute(DAILY.format("%s", "%s"), ["not a day", "2025-04-01"], prepare=True)
    assert refused_constant.value.sqlstate == "22007"  # invalid_datetime_format, as PostgreSQL reads the constant
    assert refused_bound.value.sqlstate == refused_constant.value.sqlstate
    assert spent(bound) == before
    # the session goes on: a good value is answered
    assert [row[0] for row in bound.execute(DAILY.format("%s", "%s"), ["2025-03-01", "2025-04-01"],
                                            prepare=True)] == MARCH


def test_asyncpg_binds_the_range_in_binary(roles: tuple[psycopg.Connection[Any], psycopg.Connection[Any]],
                                           truth: psycopg.Connection[Any], gated_proxy: Endpoint,
                                           gated_database: str) -> None:
    """asyncpg describes before it binds (the parameters are the column's type), then binds in binary format."""
    constant, _ = roles
    expected = constant.execute(written(DAILY, "2025-03-01", "2025-04-01")).fetchall()

    async def run(role: str) -> tuple[list[tuple[object, ...]], str, str]:
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user=role, password=role,
                                     database=gated_database, server_settings={"timezone": "UTC"})
        try:
            statement = await conn.prepare(DAILY.format("$1", "$2"))
            assert [t.name for t in statement.get_parameters()] == ["timestamptz", "timestamptz"]
            march = (datetime(2025, 3, 1, tzinfo=UTC), datetime(2025, 4, 1, tzinfo=UTC))
            rows = [tuple(row) for row in await statement.fetch(*march)]
            charged = str(await conn.fetchval("show anonproxy.budget"))
            assert [tuple(row) for row in await statement.fetch(*march)] == rows  # the same range: free
            assert str(await conn.fetchval("show anonproxy.budget")) == charged
            return rows, charged, str(await conn.fetchval("show anonproxy.budget"))
        finally:
            await conn.close()

    with fresh_dp_role(truth, gated_proxy, gated_database, f"dp_bound_{next(_names)}", epsilon=20) as role:
        rows, charged, _ = asyncio.run(run(role))
    assert [row[0] for row in rows] == [row[0] for row in expected] == MARCH
    assert charged == spent(constant)


@pytest.mark.parametrize("entry_id", ["pd-dbapi-daily-range", "kx-daily-bound-unit"])
def test_the_libraries_daily_ranges_list_the_range(roles: tuple[psycopg.Connection[Any], psycopg.Connection[Any]],
                                                   entry_id: str) -> None:
    """The statements pandas (over psycopg) and Knex (over node-postgres: each value text, no declared type) sent
    for a daily series over a bound range (tests/bi_corpus), bound on the server with the values they bound."""
    _, bound = roles
    (entry,) = [entry for entry in replay.load() if entry.id == entry_id]
    assert isinstance(entry.params, tuple) and len(entry.steps) == 1
    rows = bound.execute(entry.steps[0], [str(value) for value in entry.params], prepare=True).fetchall()
    assert [row[0] for row in rows] == MARCH


def test_suppress_answers_a_bound_range_as_the_constant_already(gated_proxy: Endpoint, gated_database: str) -> None:
    """Suppression lists no public time domain: its answer to the bound range already equals the constant's (the
    parameter stays one PostgreSQL binds, decided at Parse)."""
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        conn.execute("set timezone = 'UTC'")
        expected = conn.execute(written(DAILY, "2025-03-01", "2025-04-01")).fetchall()
        assert expected and {row[0] for row in expected} <= set(MARCH)
        assert conn.execute(DAILY.format("%s", "%s"), ["2025-03-01", "2025-04-01"], prepare=True).fetchall() \
            == expected


@pytest.mark.parametrize("oid, raw, written_as", [
    (1082, struct.pack("!i", 9191), "CAST('2025-03-01' AS DATE)"),  # days since 2000-01-01
    (1114, struct.pack("!q", 794_102_400_000_000), "CAST('2025-03-01 00:00:00' AS TIMESTAMP)"),  # microseconds
    (1184, struct.pack("!q", 794_102_400_000_001), "CAST('2025-03-01 00:00:00.000001+00' AS TIMESTAMPTZ)"),
    (1184, struct.pack("!q", 2**63 - 1), "CAST('infinity' AS TIMESTAMPTZ)"),
    (1082, struct.pack("!i", -(2**31)), "CAST('-infinity' AS DATE)"),
])
def test_binary_times_are_read_as_postgresql_prints_them(oid: int, raw: bytes, written_as: str) -> None:
    sql = "select count(*) from visits where visited_at >= $1"
    statement = AtBind(sql, (Slot(1, "time", 1184),), Rewrite(sql), sql)  # (the decision at Parse is not read)
    text = class_text(statement, Parameters((oid,), (1,), (raw,)))
    assert isinstance(text, str) and text.endswith(f"WHERE visited_at >= {written_as}")


def test_a_binary_time_past_python_s_years_asks_for_text() -> None:
    sql = "select count(*) from visits where visited_at >= $1"
    statement = AtBind(sql, (Slot(1, "time", 1184),), Rewrite(sql), sql)
    refused = class_text(statement, Parameters((1114,), (1,), (struct.pack("!q", -(2**62)),)))
    assert isinstance(refused, Reject) and refused.sqlstate == "0A000"


def test_node_postgres_binds_the_range_as_untyped_text(truth: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                       gated_database: str) -> None:
    ensure_node_modules()
    node = shutil.which("node")
    assert node, "node is required for the node-postgres test"
    with fresh_dp_role(truth, gated_proxy, gated_database, f"dp_bound_{next(_names)}", epsilon=20) as role:
        done = run([node, "bound_range.js"], libpq_env(gated_proxy, gated_database, user=role), cwd=NODE_DIR)
    assert done.returncode == 0, done.stderr
    march = [day.date().isoformat() for day in MARCH]
    assert json.loads(done.stdout) == [march, march]  # strings, then Dates
