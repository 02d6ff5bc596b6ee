"""Gated sessions end to end: a `reporter` (suppression mode, k = 10) through the real proxy.

Expected answers are computed in the test from a superuser connection to the
same database, never copied from the proxy's output.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import asyncpg
import psycopg
import pytest
from conftest import (
    Endpoint,
    wait_for_current_policy,
    wait_for_policy,
    wait_for_version,
)
from suppression_oracle import suppress

from anonproxy.embedded import EmbeddedPostgres

K = 10


def reporter(proxy: Endpoint, dbname: str, **kwargs: object) -> psycopg.Connection:
    return psycopg.connect(proxy.dsn(dbname, user="reporter"), autocommit=True, **kwargs)


@pytest.fixture(scope="module")
def truth(pg_server: EmbeddedPostgres, gated_database: str) -> psycopg.Connection:
    """A superuser connection to the gated database, to compute expected answers."""
    conn = psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True)
    yield conn
    conn.close()


def test_group_counts_are_exact_and_small_groups_suppressed(gated_proxy: Endpoint, gated_database: str,
                                                            truth: psycopg.Connection) -> None:
    with reporter(gated_proxy, gated_database) as conn:
        rows = conn.execute("select native_country, count(*) from adult group by 1").fetchall()
    true_counts = Counter(country for (country,) in truth.execute("select native_country from adult"))
    released = {country: count for country, count in rows if country is not None}
    verdict = suppress(true_counts, k=K, everyone=sum(true_counts.values()), rest=True)
    assert verdict.primary, "the test needs some countries below k"
    assert released == {c: true_counts[c] for c in verdict.released}
    assert all(true_counts[c] >= K for c in released)
    rest = [count for country, count in rows if country is None]
    assert rest == ([sum(true_counts[c] for c in verdict.withheld)] if verdict.rest else [])


def test_two_column_groups_with_filter_and_order(gated_proxy: Endpoint, gated_database: str,
                                                 truth: psycopg.Connection) -> None:
    query = ("select race, sex, count(*) as n, avg(hours_per_week) from adult where age between 30 and 40 "
             "group by race, sex order by n desc")
    with reporter(gated_proxy, gated_database) as conn:
        cur = conn.execute(query)
        rows = [row for row in cur.fetchall() if row[0] is not None]
        names = [column.name for column in cur.description]
    assert names == ["race", "sex", "n", "avg"]
    expected = truth.execute(query).fetchall()
    assert rows == [row for row in expected if row[2] >= K]
    assert [row[2] for row in rows] == sorted((row[2] for row in rows), reverse=True)


def test_result_types_match_the_unrewritten_query(gated_proxy: Endpoint, gated_database: str,
                                                  truth: psycopg.Connection) -> None:
    query = "select education, count(*), sum(capital_gain), avg(age), count(distinct occupation) from adult group by 1"
    with reporter(gated_proxy, gated_database) as conn:
        gated = conn.execute(query).description
    direct = truth.execute(query).description
    assert [(c.name, c.type_code) for c in gated] == [(c.name, c.type_code) for c in direct]


def test_extended_protocol_with_parameters(gated_proxy: Endpoint, gated_database: str,
                                           truth: psycopg.Connection) -> None:
    query = "select sex, count(*) from adult where age > %s group by sex order by sex"
    with reporter(gated_proxy, gated_database, prepare_threshold=0) as conn:
        for age in (20, 50, 70):
            assert conn.execute(query, [age]).fetchall() == truth.execute(query, [age]).fetchall()
        binary = conn.cursor(binary=True)
        binary.execute(query, [30])
        assert binary.fetchall() == truth.execute(query, [30]).fetchall()


def test_asyncpg_prepared_rewritten_statement(gated_proxy: Endpoint, gated_database: str,
                                              truth: psycopg.Connection) -> None:
    query = "select workclass, count(*) from adult where hours_per_week >= $1 group by workclass"

    async def run() -> list[tuple[str, int]]:
        conn = await asyncpg.connect(gated_proxy.url(gated_database, user="reporter"))
        try:
            statement = await conn.prepare(query)
            assert [a.type.name for a in statement.get_attributes()] == ["text", "int8"]
            return [tuple(r) for r in await statement.fetch(40)]
        finally:
            await conn.close()

    rows = asyncio.run(run())
    expected = dict(truth.execute(query.replace("$1", "%s"), [40]).fetchall())
    verdict = suppress(expected, k=K, everyone=truth.execute("select count(*) from adult").fetchone()[0], rest=True)
    assert sorted(r for r in rows if r[0] is not None) == sorted((c, expected[c]) for c in verdict.released)


def test_show_anonproxy_settings(gated_proxy: Endpoint, gated_database: str) -> None:
    with reporter(gated_proxy, gated_database) as conn:
        assert conn.execute("show anonproxy.k").fetchone() == (str(K),)
        assert conn.execute("show anonproxy.mode").fetchone() == ("suppress",)
        with pytest.raises(psycopg.errors.UndefinedObject, match="anonproxy.nope"):
            conn.execute("show anonproxy.nope")
    with reporter(gated_proxy, gated_database, prepare_threshold=0) as conn:
        assert conn.execute("show anonproxy.role", prepare=True).fetchone() == ("reporter",)


def test_row_level_queries_are_refused_with_a_hint(gated_proxy: Endpoint, gated_database: str) -> None:
    with reporter(gated_proxy, gated_database) as conn:
        with pytest.raises(psycopg.Error) as caught:
            conn.execute("select * from adult limit 1")
        assert caught.value.sqlstate in ("42501", "0A000")
        assert caught.value.diag.message_hint
        assert conn.execute("select 1").fetchone() == (1,)  # the session goes on


def test_catalog_browsing_lists_protected_columns(gated_proxy: Endpoint, gated_database: str) -> None:
    with reporter(gated_proxy, gated_database) as conn:
        columns = [r[0] for r in conn.execute(
            "select column_name from information_schema.columns where table_name = 'adult' order by ordinal_position")]
    assert columns[:3] == ["id", "age", "workclass"] and len(columns) == 16


def test_psql_describe_through_the_proxy(gated_proxy: Endpoint, gated_database: str) -> None:
    import subprocess

    result = subprocess.run(["psql", gated_proxy.url(gated_database, user="reporter"), "-X", "-c", r"\d adult"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "native_country" in result.stdout and "hours_per_week" in result.stdout


def test_bypassing_the_proxy_yields_nothing(pg_server: EmbeddedPostgres, gated_database: str) -> None:
    dsn = pg_server.conninfo(user="reporter", password="reporter", dbname=gated_database)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for query in ("select * from adult limit 1", "select count(*) from adult",
                      "explain analyze select * from adult", "copy adult to stdout"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(query)
        assert conn.execute("select count(*) from pg_stats where tablename = 'adult'").fetchone() == (0,)


def test_transactions_around_rewritten_queries(gated_proxy: Endpoint, gated_database: str) -> None:
    with reporter(gated_proxy, gated_database) as conn:
        conn.execute("begin")
        assert conn.execute("select sex, count(*) from adult group by sex").rowcount == 2
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("select 1/0")
        with pytest.raises(psycopg.errors.InFailedSqlTransaction):
            conn.execute("select sex, count(*) from adult group by sex")
        conn.execute("rollback")
        assert conn.execute("select count(*) from adult where sex = 'Female'").fetchone()[0] > K


def test_mixed_multi_statement_strings_are_refused(gated_proxy: Endpoint, gated_database: str) -> None:
    with reporter(gated_proxy, gated_database) as conn:
        with pytest.raises(psycopg.errors.FeatureNotSupported):
            conn.execute("select 1; select sex, count(*) from adult group by sex")


def test_roles_outside_the_governed_database_are_refused(gated_proxy: Endpoint, dbname: str) -> None:
    with pytest.raises(psycopg.OperationalError, match="may only use the database"):
        psycopg.connect(gated_proxy.dsn(dbname, user="reporter"))


def test_policy_changes_apply_without_restart(gated_proxy: Endpoint, gated_database: str,
                                              truth: psycopg.Connection) -> None:
    with reporter(gated_proxy, gated_database) as conn:
        try:
            truth.execute("select anonproxy.set_role_policy('reporter', 'suppress', 25000)")
            version = truth.execute("select version from anonproxy.policy_version").fetchone()[0]
            wait_for_version(conn, version)
            assert conn.execute("show anonproxy.k").fetchone() == ("25000",)
            assert [r for r in conn.execute("select sex, count(*) from adult group by sex") if r[0]] == []
        finally:
            truth.execute("select anonproxy.set_role_policy('reporter', 'suppress', 10, 2, 85, 10, true)")
        wait_for_version(conn, version + 1)
        assert conn.execute("show anonproxy.k").fetchone() == ("10",)
    wait_for_current_policy(truth, gated_proxy, gated_database)  # for the tests after this one


def test_denied_role_cannot_log_in(gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:
    truth.execute("drop role if exists blocked")
    truth.execute("create role blocked login password 'blocked'")
    try:
        truth.execute("select anonproxy.set_role_policy('blocked', 'deny')")
        wait_for_policy(gated_proxy, gated_database,
                        truth.execute("select version from anonproxy.policy_version").fetchone()[0])
        with pytest.raises(psycopg.OperationalError, match='role "blocked" may not connect through anonproxy'):
            psycopg.connect(gated_proxy.dsn(gated_database, user="blocked"))
    finally:
        truth.execute("select anonproxy.drop_role_policy('blocked')")
        truth.execute("drop owned by blocked")
        truth.execute("drop role blocked")


def test_anonymized_roles_must_speak_utf8(gated_proxy: Endpoint, gated_database: str) -> None:
    with pytest.raises(psycopg.OperationalError, match="must use client_encoding UTF8"):
        psycopg.connect(gated_proxy.dsn(gated_database, user="reporter") + " client_encoding=LATIN1")


def test_jdbc_reporter_session(gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection) -> None:
    """pgjdbc batches BEGIN with the first query and switches to named statements after 5 runs."""
    import shutil
    import subprocess
    from pathlib import Path

    from test_clients import jdbc_jar

    java = shutil.which("java")
    assert java, "java is needed for the JDBC tests (Debian: default-jre-headless)"
    source = Path(__file__).parent / "clients" / "JdbcReporter.java"
    done = subprocess.run([java, "-cp", jdbc_jar(), str(source), gated_proxy.host, str(gated_proxy.port),
                           gated_database], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line.split("|") for line in done.stdout.split()]
    for round_ in range(7):
        got = [(key, int(value)) for label, key, value in lines if label == f"round{round_}"]
        expected = truth.execute("select sex, count(*) from adult where age > %s group by sex order by sex",
                                 [20 + 5 * round_]).fetchall()
        assert got == [row for row in expected if row[1] >= K]
    assert ["k", "k", str(K)] in lines
    assert ["star", "refused", "42501"] in lines


def test_a_direct_session_ends_when_the_policy_anonymizes_its_role(gated_proxy: Endpoint, gated_database: str,
                                                                   truth: psycopg.Connection) -> None:
    truth.execute("drop role if exists switcher")
    truth.execute("create role switcher login password 'switcher'")
    truth.execute("grant select on all tables in schema public to switcher")
    conn = psycopg.connect(gated_proxy.dsn(gated_database, user="switcher"), autocommit=True)
    try:
        assert conn.execute("select count(*) from pg_class where relname = 'adult'").fetchone() == (1,)
        truth.execute("select anonproxy.set_role_policy('switcher', 'suppress')")
        deadline = time.monotonic() + 60
        with pytest.raises(psycopg.OperationalError, match='now puts role "switcher" in suppress mode'):
            while time.monotonic() < deadline:
                conn.execute("select 1")
                time.sleep(0.05)
        wait_for_current_policy(truth, gated_proxy, gated_database)  # the other worker, too
        with psycopg.connect(gated_proxy.dsn(gated_database, user="switcher"), autocommit=True) as again:
            assert again.execute("show anonproxy.mode").fetchone() == ("suppress",)
    finally:
        conn.close()
        truth.execute("select anonproxy.drop_role_policy('switcher')")
        truth.execute("drop owned by switcher")
        truth.execute("drop role switcher")
