"""Attacks a `reporter` (suppression mode, k = 10) might try, through the real proxy.

Each must be refused — by the proxy (42501 / 0A000 with a hint) or by
PostgreSQL (42501: the role holds no SELECT on protected tables) — or be
answered without revealing a group below k. Differencing and tracker queries
are not stopped by suppression (see docs/suppression.md); the last tests here
document that honestly instead of pretending otherwise.
"""

from __future__ import annotations

import psycopg
import pytest
from conftest import Endpoint

from anonproxy.embedded import EmbeddedPostgres

K = 10

REFUSED = [
    # row-level output
    "select * from adult",
    "select * from adult limit 1",
    "select id, age from adult",
    "select age from adult where id = 17",
    'select * from "public"."adult"',
    "select * from PUBLIC.ADULT",
    "select/**/*/**/from/**/adult",
    "select row_to_json(a) from adult a",
    "select (select age from adult where id = 17)",
    # COPY, cursors, prepared statements, temporary views, DO blocks
    "copy adult to stdout",
    "copy (select * from adult) to stdout",
    "declare c cursor with hold for select * from adult",
    "declare c cursor with hold for select age from adult where id = 17",
    "fetch all from c",
    "prepare p as select * from adult",
    "execute p",
    "create temp view v as select * from adult",
    "do $$ begin perform * from adult; end $$",
    # functions and set-returning functions over the table
    "select generate_series(1, age) from adult",
    "select string_agg(occupation, ',') from adult",
    "select array_agg(age) from adult group by sex",
    "select json_agg(a) from adult a",
    "select count(*) from adult where pg_sleep(case when id = 17 then 1 else 0 end) is not null",
    # CTEs and subqueries hiding row-level output
    "with t as (select * from adult) select * from t",
    "select x.age from (select 1) d, lateral (select age from adult where id = 17) x",
    # window functions, system columns, sampling
    "select age, count(*) over () from adult",
    "select ctid, xmin from adult",
    "select count(*) from adult where ctid = '(0,1)'",
    "select sex, count(*) from adult tablesample system (1) group by sex",
    # EXPLAIN
    "explain analyze select * from adult",
    "explain analyze select count(*) from adult where id = 17",
    "explain select count(*) from adult where id = 17",
    # error side channels on a person's value
    "select sex, count(*) from adult group by sex "
    "having count(case when id = 17 and income = '>50K' then 1/0 end) > 0",
    "select count(*) from adult where case when id = 17 and income = '>50K' then 1/0 else 1 end = 1",
    "select count(*) from adult where (case when id = 17 then occupation else '1' end)::int = 1",
    "select sex, sum(capital_gain * 100000000) from adult group by sex",
    # MIN/MAX reveal a person's value (not allowed by the demo policy)
    "select min(age), max(capital_gain) from adult",
    # role games
    "set role dba",
    "reset role",
    "set session authorization dba",
    "set local role dba",
    # mixing allowed and rewritten statements in one string
    "set search_path = pg_temp, public; select sex, count(*) from adult group by sex",
]


@pytest.fixture
def conn(gated_proxy: Endpoint, gated_database: str) -> psycopg.Connection:
    connection = psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True)
    yield connection
    connection.close()


@pytest.mark.parametrize("attack", REFUSED)
def test_attack_is_refused(conn: psycopg.Connection, attack: str) -> None:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(attack).fetchall()
    assert caught.value.sqlstate in ("42501", "0A000", "34000", "26000"), (caught.value.sqlstate, str(caught.value))
    assert caught.value.diag.message_primary
    if caught.value.sqlstate == "0A000" or "anonproxy" in (caught.value.diag.message_hint or ""):
        assert caught.value.diag.message_hint, "a refusal by the proxy says what is allowed"
    assert conn.execute("select 1").fetchone() == (1,)  # the session survives


def test_prepared_row_level_statement_is_refused(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute("select age, occupation from adult where id = %s", [17], prepare=True)
    assert caught.value.sqlstate in ("42501", "0A000")


def test_pg_stats_shows_nothing_of_protected_tables(conn: psycopg.Connection) -> None:
    assert conn.execute("select count(*) from pg_stats where tablename = 'adult'").fetchone() == (0,)


def test_a_single_person_is_never_a_group(conn: psycopg.Connection) -> None:
    rows = conn.execute("select age, occupation, count(*) from adult where id = 17 group by 1, 2").fetchall()
    assert rows == []
    # issue 11: derived tables and WITH queries are flattened, then suppressed like the plain statement
    for nested in ("with t as (select age from adult where id = 17) select age, count(*) from t group by age",
                   "select count(*) from (select * from adult where id = 17) s"):
        assert conn.execute(nested).fetchall() == [], nested
    rows = conn.execute("select id, count(*) from adult group by id").fetchall()
    assert rows == [] or all(row[0] is None and row[1] >= K for row in rows)


def test_a_set_operation_releases_no_more_than_its_branches(conn: psycopg.Connection) -> None:
    """A UNION ALL of aggregate queries is answered branch by branch (docs/suppression.md, "Set operations of
    aggregate queries"): one person's count in a branch is withheld as it is when that branch is asked alone."""
    grouped = "select native_country, count(*) from adult group by 1"
    single = "select 'x', count(*) from adult where id = 17"
    assert conn.execute(single).fetchall() == []
    rows = conn.execute(f"{grouped} union all {single}").fetchall()
    assert sorted(rows, key=repr) == sorted(conn.execute(grouped).fetchall(), key=repr)
    assert all(row[0] != "x" for row in rows)


@pytest.mark.parametrize("condition", ["id = 17", "id <> 17", "id between 1 and 5"])
def test_query_set_size_control(conn: psycopg.Connection, condition: str) -> None:
    """A no-GROUP-BY aggregate is answered only if k ≤ |C| ≤ N − k."""
    assert conn.execute(f"select count(*), avg(age) from adult where {condition}").fetchall() == []


def test_large_subsets_are_answered_exactly(conn: psycopg.Connection, pg_server: EmbeddedPostgres,
                                            gated_database: str) -> None:
    query = "select count(*), sum(hours_per_week) from adult where age < 40"
    with psycopg.connect(pg_server.conninfo(dbname=gated_database)) as truth:
        expected = truth.execute(query).fetchall()
    assert conn.execute(query).fetchall() == expected


def test_no_released_group_is_below_k(conn: psycopg.Connection, pg_server: EmbeddedPostgres,
                                      gated_database: str) -> None:
    """Fine groupings that isolate people: every released group holds at least k people."""
    query = "select age, education, sex, count(*) from adult group by 1, 2, 3"
    rows = conn.execute(query).fetchall()
    with psycopg.connect(pg_server.conninfo(dbname=gated_database)) as truth:
        true_counts = {row[:3]: row[3] for row in truth.execute(query)}
    released = [row for row in rows if row[:3] != (None, None, None)]
    assert released and len(released) < len(true_counts)
    assert all(true_counts[row[:3]] >= K and row[3] == true_counts[row[:3]] for row in released)


def test_differencing_is_not_prevented_by_suppression(conn: psycopg.Connection, pg_server: EmbeddedPostgres,
                                                      gated_database: str) -> None:
    """Documented limit: two large, allowed totals differ by one person's value.

    Suppression mode is for trusted internal reporting; differential-privacy
    mode (noise plus a budget) is the answer to this attack.
    """
    everyone_but = "select sum(capital_gain) from adult where age between 30 and 60 and id <> 17"
    everyone = "select sum(capital_gain) from adult where age between 30 and 60"
    difference = conn.execute(everyone).fetchone()[0] - conn.execute(everyone_but).fetchone()[0]
    with psycopg.connect(pg_server.conninfo(dbname=gated_database)) as truth:
        person = truth.execute("select age, capital_gain from adult where id = 17").fetchone()
    assert difference == (person[1] if 30 <= person[0] <= 60 else 0)
