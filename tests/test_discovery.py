"""Column discovery: statements that return no row whatever the data, answered with their columns and no row.

BI tools and drivers learn a query's columns by running it so that it returns no row. Through the gated proxy, the
suppress role (``reporter``) and a dp role (``analyst``) get what PostgreSQL gives the table's owner for the same
statement: the same columns (name, type, type modifier, and the table column each comes from), and no row; the dp
role is charged nothing. Near misses, whose outermost query may return rows, or which could fail on a value, stay
refused or are answered as before.

Each statement names where its shape comes from: read in the tool's source or documentation (through the search
tool), or written from memory of what the tool sends (said so). What the proxy runs for each, planned by PostgreSQL
(EXPLAIN), is a single Result stopped by a constant false: no table is scanned, no expression evaluated.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import psycopg
import pytest
from conftest import Endpoint, corpus_roles
from psycopg import sql

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.store import load_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite

reporter, analyst = corpus_roles("dp_discovery")

TABLEAU = "Tableau connector SDK docs, metadata-enumeration (read)"
DBT = "dbt-labs default__get_empty_subquery_sql (read): select * from (<sql>) as __dbt_sbq where false limit 0"
BRIEF = "the forms named in the task"
MEMORY = "from memory of the tool's probe"

DISCOVERY: dict[str, tuple[str, str]] = {
    "tableau where 1=0": (TABLEAU, "SELECT * FROM public.adult WHERE 1=0"),
    "tableau limit 0": (TABLEAU, "SELECT * FROM public.adult LIMIT 0"),
    "tableau where (1 = 0)": (TABLEAU, "SELECT * FROM public.adult WHERE (1 = 0)"),
    "dbt grouped model": (DBT, "select * from (\n    select age, count(*) as people from public.adult group by age\n"
                               ") as __dbt_sbq\nwhere false\nlimit 0\n"),
    "dbt model with a CTE": (DBT, "select * from (\n    with src as (select * from public.adult)\n"
                                  "    select workclass, avg(hours_per_week) as hours from src group by workclass\n"
                                  ") as __dbt_sbq\nwhere false\nlimit 0\n"),
    "dbt model of a join": (DBT, "select * from (\n    select a.sex, sum(v.amount) as spent from public.adult a "
                                 "join public.visits v on v.person_id = a.id group by a.sex\n) as __dbt_sbq\n"
                                 "where false\nlimit 0\n"),
    "where false": (BRIEF, "SELECT * FROM adult WHERE false"),
    "where 1 <> 1": (BRIEF, "SELECT * FROM adult WHERE 1 <> 1"),
    "derived table limit 0": (BRIEF, "SELECT * FROM (SELECT age, sex FROM public.adult) AS t LIMIT 0"),
    "grouped derived table where 0 = 1": (BRIEF, "SELECT * FROM (SELECT workclass, count(*) FROM adult "
                                                 "GROUP BY workclass) t WHERE 0 = 1"),
    "grouped limit 0": (BRIEF, "SELECT education, avg(age) FROM adult GROUP BY education LIMIT 0"),
    "tableau custom SQL": (MEMORY, 'SELECT * FROM (select sex, count(*) as people from public.adult group by sex) '
                                   '"Custom SQL Query" LIMIT 0'),
    "power bi native query": (MEMORY, 'select * from (select race, avg(age) as mean_age from public.adult '
                                      'group by race) "_" where 1 = 0'),
    "metabase native query": (MEMORY, 'SELECT * FROM (SELECT occupation, count(*) AS count FROM public.adult '
                                      'GROUP BY occupation) AS "source" LIMIT 0'),
    "superset virtual dataset": (MEMORY, "SELECT * FROM (SELECT marital_status, max(age) AS oldest FROM public.adult "
                                         "GROUP BY marital_status) AS virtual_table LIMIT 0"),
    "looker sql runner": (MEMORY, "SELECT * FROM (SELECT income, count(*) FROM public.adult GROUP BY income) "
                                  "AS looker_subquery WHERE 1=0"),
    "lightdash sql runner": (MEMORY, 'SELECT * FROM (SELECT channel, count(*) AS visits FROM "public"."visits" '
                                     'GROUP BY channel) AS "lightdash_sql_runner" LIMIT 0'),
    "linked table": (BRIEF, "SELECT * FROM public.visits WHERE false"),
    "join where 1 = 0": (BRIEF, "SELECT a.*, v.amount FROM public.adult a JOIN public.visits v "
                                "ON v.person_id = a.id WHERE 1 = 0"),
    "fetch first 0 rows": (BRIEF, "SELECT id, age FROM public.adult FETCH FIRST 0 ROWS ONLY"),
    "having false": (BRIEF, "SELECT sex, count(*) FROM adult GROUP BY sex HAVING false"),
    "where null": (BRIEF, "SELECT * FROM adult WHERE NULL"),
    "where false and a condition": (BRIEF, "SELECT * FROM adult WHERE false AND age > 30"),
    "where not true": (BRIEF, "SELECT * FROM adult WHERE NOT true"),
    "grouped where 1 = 0": (BRIEF, "SELECT workclass, count(*) AS n FROM adult WHERE 1 = 0 GROUP BY workclass"),
    "union all limit 0": (BRIEF, "select age, sex from public.adult union all select age, sex from public.adult "
                                 "limit 0"),
    "cast that would fail on every row": (BRIEF, "SELECT workclass::int FROM adult LIMIT 0"),
    "expressions limit 0": (BRIEF, "SELECT id, age * 2 AS double_age, upper(sex) FROM adult LIMIT 0"),
    "CTE where 1 = 0": (BRIEF, "WITH x AS (SELECT * FROM adult) SELECT * FROM x WHERE 1 = 0"),
    "order by limit 0": (BRIEF, "SELECT * FROM adult ORDER BY id LIMIT 0"),
    "left join where false": (BRIEF, "SELECT a.id, v.channel FROM public.adult a LEFT JOIN public.visits v "
                                     "ON v.person_id = a.id WHERE false"),
    "full join where 1 = 0": (BRIEF, "SELECT a.id, v.channel FROM public.adult a FULL JOIN public.visits v "
                                     "ON v.person_id = a.id WHERE 1 = 0"),
    "window function where false": (BRIEF, "SELECT id, count(*) OVER () FROM adult WHERE false"),
    "scalar subquery limit 0": (BRIEF, "SELECT (SELECT max(age) FROM adult) AS oldest, sex FROM adult LIMIT 0"),
}

# Near misses: the outermost query may return rows, or the statement holds something that could fail or change
# between runs. Refused as before, by the proxy (never by an error of PostgreSQL's evaluation).
REFUSED: dict[str, str] = {
    "where false or a column condition": "SELECT * FROM adult WHERE false OR age > 30",
    "limit 0 plus a subquery": "SELECT * FROM adult LIMIT 0 + (SELECT 1)",
    "where false in a subquery only": "SELECT * FROM (SELECT * FROM adult WHERE false) t",
    "union with one branch false": "SELECT age FROM adult WHERE false UNION ALL SELECT age FROM adult",
    "division that fails on a value": "SELECT 1/(age-39) FROM adult LIMIT 0",
    "volatile random()": "SELECT random(), age FROM adult LIMIT 0",
    "volatile clock_timestamp()": "SELECT clock_timestamp(), age FROM adult LIMIT 0",
    "a relation not in the policy": "SELECT * FROM adult, pg_catalog.pg_authid WHERE false",
    "limit null is no limit": "SELECT * FROM adult LIMIT NULL",
}


def described(conn: psycopg.Connection[Any], statement: str) -> tuple[list[tuple[Any, ...]], list[Any]]:
    """The columns PostgreSQL describes (name, type, type modifier, table and column of origin), and the rows; of
    the last statement, when there are several."""
    cursor = conn.execute(statement)
    while cursor.nextset():
        pass
    result = cursor.pgresult
    assert result is not None
    columns = [(result.fname(i), result.ftype(i), result.fmod(i), result.ftable(i), result.ftablecol(i))
               for i in range(result.nfields)]
    return columns, cursor.fetchall()


def charges(truth: psycopg.Connection[Any], role: str) -> int:
    return truth.execute("select count(*) from anonproxy.budget_ledger where role_name = %s", [role]).fetchone()[0]


@pytest.mark.parametrize("name", DISCOVERY)
def test_discovery_answered_with_the_owner_s_columns_and_no_row(
        name: str, reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
        truth: psycopg.Connection[Any]) -> None:
    _, statement = DISCOVERY[name]
    expected = described(truth, statement)
    assert expected[0] and expected[1] == [], "the owner's answer: columns, no row"
    before = charges(truth, analyst.info.user)
    for conn in (reporter, analyst):
        assert described(conn, statement) == expected, (conn.info.user, name)
    assert charges(truth, analyst.info.user) == before, "discovery charges nothing"


def test_the_corpus_is_large() -> None:
    assert len(DISCOVERY) >= 25


@pytest.mark.parametrize("name", REFUSED)
def test_near_misses_stay_refused(name: str, reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
                                  truth: psycopg.Connection[Any]) -> None:
    before = charges(truth, analyst.info.user)
    for conn in (reporter, analyst):
        with pytest.raises(psycopg.Error) as refused:
            conn.execute(REFUSED[name])
        error = refused.value
        # (not 22012: PostgreSQL's division_by_zero would tell that some row holds age 39)
        assert error.sqlstate in ("42501", "0A000"), (conn.info.user, error.sqlstate, error)
        assert "Traceback" not in str(error)
    assert charges(truth, analyst.info.user) == before


def test_division_by_zero_is_there_to_be_found(truth: psycopg.Connection[Any]) -> None:
    """The near miss's division fails on some row: evaluating it would have told that age 39 occurs."""
    with pytest.raises(psycopg.errors.DivisionByZero):
        truth.execute("SELECT 1/(age-39) FROM adult").fetchall()


def test_one_group_over_no_rows_is_no_discovery(analyst: psycopg.Connection[Any],
                                                truth: psycopg.Connection[Any]) -> None:
    """An aggregate without GROUP BY answers one row for no input rows: WHERE false does not make it a discovery;
    the dp role's answer is a noisy count, charged as any."""
    assert truth.execute("SELECT count(*) FROM adult WHERE false").fetchall() == [(0,)]
    before = charges(truth, analyst.info.user)
    rows = analyst.execute("SELECT count(*) FROM adult WHERE false").fetchall()
    assert len(rows) == 1
    assert charges(truth, analyst.info.user) == before + 1


def owner(pg_server: EmbeddedPostgres, database: str) -> dict[str, Any]:
    """asyncpg's connection arguments for the owner, directly."""
    return {"host": pg_server.host, "port": pg_server.port, "user": pg_server.superuser,
            "password": pg_server.password, "database": database}


def through(proxy: Endpoint, database: str, role: str) -> dict[str, Any]:
    """asyncpg's connection arguments for ``role`` through the gated proxy."""
    return {"host": proxy.host, "port": proxy.port, "user": role, "password": role, "database": database}


async def _asyncpg_described(connection: dict[str, Any], statements: list[str]
                             ) -> list[tuple[list[tuple[str, int]], list[Any]]]:
    """Each statement prepared (Parse, Describe), its columns, then executed (Bind, Execute): its rows."""
    conn = await asyncpg.connect(**connection)
    try:
        answers = []
        for statement in statements:
            prepared = await conn.prepare(statement)
            columns = [(attribute.name, attribute.type.oid) for attribute in prepared.get_attributes()]
            answers.append((columns, await prepared.fetch()))
        return answers
    finally:
        await conn.close()


def test_extended_protocol_discovery_as_the_owner(reporter: psycopg.Connection[Any],
                                                  analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any],
                                                  gated_proxy: Endpoint, gated_database: str,
                                                  pg_server: EmbeddedPostgres) -> None:
    """asyncpg prepares each statement (Describe before any Execute), then runs it: the owner's columns, no row."""
    statements = [statement for _, statement in DISCOVERY.values()]
    expected = asyncio.run(_asyncpg_described(owner(pg_server, gated_database), statements))
    before = charges(truth, analyst.info.user)
    for role in (reporter.info.user, analyst.info.user):
        got = asyncio.run(_asyncpg_described(through(gated_proxy, gated_database, role), statements))
        assert got == expected, role
    assert all(rows == [] for _, rows in expected)
    assert charges(truth, analyst.info.user) == before


def test_described_but_never_executed(gated_proxy: Endpoint, gated_database: str, pg_server: EmbeddedPostgres,
                                      truth: psycopg.Connection[Any], analyst: psycopg.Connection[Any]) -> None:
    """A prepared aggregate statement described and never executed: the owner's columns, nothing charged."""
    statement = "SELECT sex, count(*) AS people FROM public.adult GROUP BY sex"

    async def columns(connection: dict[str, Any]) -> list[tuple[str, int]]:
        conn = await asyncpg.connect(**connection)
        try:
            prepared = await conn.prepare(statement)
            return [(attribute.name, attribute.type.oid) for attribute in prepared.get_attributes()]
        finally:
            await conn.close()

    expected = asyncio.run(columns(owner(pg_server, gated_database)))
    before = charges(truth, analyst.info.user)
    for role in ("reporter", analyst.info.user):
        assert asyncio.run(columns(through(gated_proxy, gated_database, role))) == expected, role
    assert charges(truth, analyst.info.user) == before


def test_a_role_s_own_tables_only(truth: psycopg.Connection[Any], reporter: psycopg.Connection[Any]) -> None:
    """A table outside the policy that the role may not read stays PostgreSQL's to refuse: discovery runs nothing
    on the service connection for it (the statement reads no protected table, so it goes to the role's own
    connection, where PostgreSQL answers as it answers the role)."""
    truth.execute("create table if not exists public.discovery_secret (x int)")
    truth.execute("revoke all on public.discovery_secret from public")
    try:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            reporter.execute("SELECT * FROM public.discovery_secret WHERE false")
        with pytest.raises(psycopg.Error) as refused:
            reporter.execute("SELECT * FROM public.adult a, public.discovery_secret s WHERE false")
        assert refused.value.sqlstate in ("42501", "0A000")
    finally:
        truth.execute("drop table public.discovery_secret")


def _plan_nodes(plan: dict[str, Any]) -> list[str]:
    return [plan["Node Type"], *(kind for child in plan.get("Plans", []) for kind in _plan_nodes(child))]


@pytest.mark.parametrize("name", DISCOVERY)
def test_what_runs_reads_no_table(name: str, truth: psycopg.Connection[Any]) -> None:
    """The statement the proxy runs for a discovery, planned by PostgreSQL: one Result that a constant false stops,
    no scan of any table, nothing below it."""
    decision = decide(DISCOVERY[name][1], load_policy(truth).roles["reporter"], load_policy(truth))
    assert isinstance(decision, Rewrite)
    (plan,) = truth.execute(sql.SQL("explain (format json) {}").format(sql.SQL(decision.sql))).fetchone()[0]
    assert _plan_nodes(plan["Plan"]) == ["Result"], plan
    assert plan["Plan"]["One-Time Filter"] == "false"


def test_explain_anonproxy_says_discovery(reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
                                          truth: psycopg.Connection[Any]) -> None:
    """EXPLAIN (ANONPROXY) of a discovery says what is answered, in both modes, and runs and charges nothing."""
    before = charges(truth, analyst.info.user)
    for conn in (reporter, analyst):
        lines = [row[0] for row in conn.execute("EXPLAIN (ANONPROXY) SELECT education, avg(age) FROM adult "
                                                "GROUP BY education LIMIT 0").fetchall()]
        assert lines[0].startswith("column discovery: the statement returns no row"), lines
        assert lines[-1] == "nothing was run"
    assert charges(truth, analyst.info.user) == before


def test_discovery_in_a_cursor(reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
                               truth: psycopg.Connection[Any]) -> None:
    """psycopg's server-side cursor (DECLARE ... CURSOR FOR the discovery, then FETCH): the owner's column names
    and types, no row, nothing charged."""
    statement = DISCOVERY["dbt grouped model"][1]

    def fetched(conn: psycopg.Connection[Any]) -> tuple[list[tuple[str, int]], list[Any]]:
        with conn.transaction(), conn.cursor(name="discovery_cursor") as cursor:
            cursor.execute(statement)
            rows = cursor.fetchall()
            return [(column.name, column.type_code) for column in cursor.description or []], rows

    expected = fetched(truth)
    assert expected[0] and expected[1] == []
    before = charges(truth, analyst.info.user)
    for conn in (reporter, analyst):
        assert fetched(conn) == expected, conn.info.user
    assert charges(truth, analyst.info.user) == before


def test_discovery_through_psqlodbc_s_cursor(reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
                                             truth: psycopg.Connection[Any]) -> None:
    """Tableau's metadata probe as psqlODBC (UseDeclareFetch=1) wraps it: one Query message of BEGIN, DECLARE ...
    WITH HOLD FOR the probe and FETCH, then CLOSE and COMMIT (the message's shape as docs/bi-tools.md describes
    it): the owner's column names and types, no row. (A cursor the proxy holds describes its columns by name and
    type only, without the table of origin or a type modifier: anonproxy/proxy/cursors.py.)"""
    script = ('BEGIN;declare "SQL_CUR0x1" cursor with hold for SELECT * FROM public.adult WHERE 1=0;'
              'fetch 2048 in "SQL_CUR0x1"')

    def fetched(conn: psycopg.Connection[Any]) -> tuple[list[tuple[Any, ...]], list[Any]]:
        try:
            columns, rows = described(conn, script)
            return [(name, type_oid) for name, type_oid, *_ in columns], rows
        finally:
            conn.execute('close "SQL_CUR0x1"')
            conn.execute("COMMIT")

    expected = fetched(truth)
    assert expected[0] and expected[1] == [], "the owner: adult's columns, no row"
    for conn in (reporter, analyst):
        assert fetched(conn) == expected, conn.info.user
