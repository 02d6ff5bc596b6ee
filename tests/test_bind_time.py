"""Parameters decided at Bind: ``$n`` where a statement needs a constant (a LIKE pattern, a date_trunc unit, a
to_char format, a cast's operand), bound by real drivers through the real proxy, in both modes.

Each bound statement is answered as if the client had written its values as constants: suppression's answers
equal PostgreSQL's own, dp answers are noisy within their bounds and charged at Execute only; a value that the
constant form would refuse is refused at Bind with the same SQLSTATE and message, and the batch is skipped to
its Sync; a decision made for one value is never served for another.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from decimal import Decimal
from typing import Any

import asyncpg
import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role
from psycopg import pq
from test_clients import NODE_DIR, ensure_node_modules, libpq_env, run
from test_rewrite import POLICY, SUPPRESS

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.plan.bind_values import Slot
from anonproxy.plan.refusals import Reject
from anonproxy.proxy.bind_time import class_text
from anonproxy.proxy.gate import Parameters
from anonproxy.route.decide import decide
from anonproxy.route.decision import AtBind, Rewrite

CONTAINS = "select count(*) from adult where occupation ilike %s"
MONTHLY = ("select date_trunc(%(unit)s::varchar, visited_at) as month, count(*) as n from visits "
           "group by date_trunc(%(unit)s::varchar, visited_at) order by 1")  # SQLAlchemy's, one $1 twice
YEARS = "select to_char(visited_at, %s) as y, count(*) from visits group by 1 order by 1"
OLDER = "select education, avg(hours_per_week) as h from adult where age >= %s::integer group by education order by 1"
# Django's Sum(Case(When(income='>50K', then=1), default=0)) with server-side binding: the value added up is bound
ADDED_UP = "select race, sum(case when income = '>50K' then %s else 0 end) as high from adult group by race order by 1"


def connect(proxy: Endpoint, database: str, role: str) -> psycopg.Connection[Any]:
    return psycopg.connect(proxy.dsn(database, user=role), autocommit=True)


def refusal(conn: psycopg.Connection[Any], sql: str, params: list[Any] | None = None,
            **options: Any) -> tuple[str | None, str]:
    with pytest.raises(psycopg.Error) as raised:
        conn.execute(sql, params, **options)
    return raised.value.sqlstate, raised.value.diag.message_primary or ""


def constant(sql: str, *values: str) -> str:
    """``sql`` with its %s written as the string constants ``values`` (test text only)."""
    return sql % tuple("'" + value.replace("'", "''") + "'" for value in values)


# -- the decision at Parse ---------------------------------------------------------------------------------------------


def test_parse_decides_with_representative_values() -> None:
    """decide() finds the parameters that stand where constants are needed (one per number, seen through casts
    to text and upper()), and decides the statement with a representative value in each."""
    sql = ("SELECT date_trunc(CAST($1 AS VARCHAR), visited_at), count(*) FROM visits WHERE channel ILIKE UPPER($2) "
           "AND visited_at >= $3 GROUP BY date_trunc(CAST($1 AS VARCHAR), visited_at)")
    decision = decide(sql, SUPPRESS, POLICY)
    assert isinstance(decision, AtBind) and isinstance(decision.described, Rewrite)
    assert decision.slots == (Slot(1, "unit", 1043), Slot(2, "pattern", 25))
    assert "$1" not in decision.representative and "$2" not in decision.representative
    assert "$3" in decision.representative  # a comparison's operand stays a parameter
    # A statement refused whatever the values is refused at Parse; without such a parameter, nothing changes.
    assert isinstance(decide("SELECT id FROM adult WHERE occupation LIKE $1", SUPPRESS, POLICY), Reject)
    assert isinstance(decide("SELECT count(*) FROM adult WHERE age > $1", SUPPRESS, POLICY), Rewrite)
    # No value to bind: a cursor's query and EXPLAIN (ANONPROXY) need the constant written.
    for sql in ("DECLARE c CURSOR FOR SELECT count(*) FROM adult WHERE occupation LIKE $1",
                "EXPLAIN (ANONPROXY) SELECT count(*) FROM adult WHERE occupation LIKE $1"):
        refused = decide(sql, SUPPRESS, POLICY)
        assert isinstance(refused, Reject) and "$1" in refused.message and refused.sqlstate == "0A000"


def test_values_added_up_are_decided_at_bind() -> None:
    """A value sum() or avg() adds up is a slot (its size decides the sum's overflow and what one person adds);
    one it compares is not (CASE WHEN income = $1: a comparison's operand is decided at Parse)."""
    sql = ('SELECT "adult"."race", SUM(CASE WHEN "adult"."income" = $1 THEN $2 ELSE $3 END) AS "high", '
           'AVG(CASE "adult"."sex" WHEN $4 THEN $5::numeric END) FROM "adult" GROUP BY 1')
    decision = decide(sql, SUPPRESS, POLICY)
    assert isinstance(decision, AtBind) and isinstance(decision.described, Rewrite)
    assert decision.slots == (Slot(2, "summed"), Slot(3, "summed"), Slot(5, "summed", 1700))
    assert "$1" in decision.representative and "$4" in decision.representative
    assert "$2" not in decision.representative and "$5" not in decision.representative


def test_each_value_is_its_own_text() -> None:
    """The text a Bind is decided on holds its values: two values never share a decision-cache key."""
    statement = decide("SELECT count(*) FROM adult WHERE occupation ILIKE $1::varchar", SUPPRESS, POLICY)
    assert isinstance(statement, AtBind)
    texts = {value: class_text(statement, Parameters((0,), (0,), (value,))) for value in (b"%a%", b"%b%", b"a\\")}
    assert len(set(texts.values())) == 3 and all(value.decode() in texts[value] for value in texts)
    assert class_text(statement, Parameters((0,), (1,), (b"%a%",))) == texts[b"%a%"]  # binary text: the same value
    assert isinstance(class_text(statement, Parameters((0,), (0,), (b"\xff",))), Reject)  # not UTF-8
    assert isinstance(class_text(statement, Parameters((600,), (0,), (b"(1,2)",))), Reject)  # a point: no constant


# -- suppress mode: answers equal PostgreSQL's own ------------------------------------------------------------------


def test_a_bound_like_pattern_is_answered_as_the_constant(gated_proxy: Endpoint, gated_database: str,
                                                          truth: psycopg.Connection[Any]) -> None:
    with connect(gated_proxy, gated_database, "reporter") as conn:
        for pattern in ("%sales%", "%tech%", "%sales%", "%craft%"):
            for prepare in (False, True):
                answer = conn.execute(CONTAINS, [pattern], prepare=prepare).fetchall()
                assert answer == truth.execute(CONTAINS, [pattern]).fetchall(), pattern
        # Django's icontains with server-side binding: UPPER(%s) around the parameter.
        django = 'SELECT COUNT(*) AS "__count" FROM "adult" WHERE UPPER("adult"."occupation"::text) LIKE UPPER(%s)'
        assert conn.execute(django, ["%sales%"]).fetchall() == truth.execute(django, ["%sales%"]).fetchall()


def test_a_bound_unit_and_format_are_answered_as_the_constants(gated_proxy: Endpoint, gated_database: str,
                                                               truth: psycopg.Connection[Any]) -> None:
    with connect(gated_proxy, gated_database, "reporter") as conn:
        for unit in ("month", "year", "quarter", "month"):
            answer = conn.execute(MONTHLY, {"unit": unit}, prepare=True).fetchall()
            assert answer == truth.execute(MONTHLY, {"unit": unit}).fetchall(), unit
        for pattern in ("YYYY", "YYYY-Q"):
            assert conn.execute(YEARS, [pattern]).fetchall() == truth.execute(YEARS, [pattern]).fetchall()


def test_a_cast_parameter_is_answered_as_the_constant(gated_proxy: Endpoint, gated_database: str,
                                                      truth: psycopg.Connection[Any]) -> None:
    """SQLAlchemy's %(age_1)s::INTEGER (psycopg declares the int as int2): released groups equal PostgreSQL's."""
    with connect(gated_proxy, gated_database, "reporter") as conn:
        for age in (40, 60):
            answer = {group: h for group, h in conn.execute(OLDER, [age]) if group is not None}  # None: the rest
            expected = dict(truth.execute(OLDER, [age]).fetchall())
            assert answer and all(answer[group] == expected[group] for group in answer)


def test_binary_parameters_and_null(gated_proxy: Endpoint, gated_database: str,
                                    truth: psycopg.Connection[Any]) -> None:
    with connect(gated_proxy, gated_database, "reporter") as conn:
        binary = conn.cursor(binary=True)
        assert binary.execute(CONTAINS, ["%sales%"]).fetchall() == truth.execute(CONTAINS, ["%sales%"]).fetchall()
        released = {group for group, _ in binary.execute(OLDER, [40])}
        assert released - {None} and released - {None} <= {group for group, _ in truth.execute(OLDER, [40])}
        # LIKE NULL matches no row and never fails: PostgreSQL counts 0.
        assert conn.execute(CONTAINS, [None]).fetchall() in ([(0,)], [])


def test_asyncpg_describes_before_binding(gated_proxy: Endpoint, gated_database: str,
                                          truth: psycopg.Connection[Any]) -> None:
    """asyncpg prepares and describes the statement before any value is bound, then binds in binary format: the
    description holds for every value class (the types do not depend on the values)."""
    async def run() -> None:
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user="reporter",
                                     password="reporter", database=gated_database)
        try:
            statement = await conn.prepare(MONTHLY.replace("%(unit)s", "$1"))
            assert [t.name for t in statement.get_parameters()] == ["varchar"]
            assert [(a.name, a.type.name) for a in statement.get_attributes()] == [("month", "timestamptz"),
                                                                                 ("n", "int8")]
            for unit in ("month", "year"):
                rows = [tuple(row) for row in await statement.fetch(unit)]
                assert rows == truth.execute(MONTHLY, {"unit": unit}).fetchall()
            with pytest.raises(asyncpg.PostgresError) as raised:
                await statement.fetch("fortnight")
            assert raised.value.sqlstate == "0A000"
            count = await conn.fetchval(CONTAINS.replace("%s", "$1"), "%sales%")
            assert count == truth.execute(CONTAINS, ["%sales%"]).fetchone()[0]
        finally:
            await conn.close()

    asyncio.run(run())


def test_asyncpg_prepares_values_added_up_in_dp_mode(pg_server: EmbeddedPostgres, gated_proxy: Endpoint,
                                                      gated_database: str,
                                                      truth: psycopg.Connection[Any]) -> None:
    """SQLAlchemy's ``func.sum(case((cond, 1), else_=0))`` over asyncpg binds both results (``THEN $1::INTEGER ELSE
    $2::INTEGER`` here) and prepares before it binds: the statement is described with a representative value in each
    slot, one dp accepts (a sum of zeros alone it refuses whatever the rows), and decided again with the bound
    values; those adding up only zeros are refused at Bind, as the constants are."""
    sql = ("SELECT adult.race, sum(CASE WHEN (adult.income = '>50K') THEN $1::INTEGER ELSE $2::INTEGER END) AS high "
           "FROM adult GROUP BY adult.race ORDER BY adult.race")
    exact = dict(truth.execute(sql.replace("$1", "1").replace("$2", "0")).fetchall())

    async def run(role: str) -> None:
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user=role, password=role,
                                     database=gated_database)
        try:
            statement = await conn.prepare(sql)
            assert [column.name for column in statement.get_attributes()] == ["race", "high"]
            rows = await statement.fetch(1, 0)
            assert {row["race"] for row in rows} <= set(exact)
            big = [row for row in rows if exact[row["race"]] >= 1000]  # noise of ε 0.5: a few units
            assert big and all(abs(row["high"] - exact[row["race"]]) < 0.05 * exact[row["race"]] for row in big)
            with pytest.raises(asyncpg.FeatureNotSupportedError, match="adds up only zeros"):
                await statement.fetch(0, 0)
        finally:
            await conn.close()

    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, "summed_analyst", epsilon=10) as role:
        asyncio.run(run(role))


def test_asyncpg_binds_a_having_count_operand_in_dp_mode(pg_server: EmbeddedPostgres, gated_proxy: Endpoint,
                                                         gated_database: str,
                                                         truth: psycopg.Connection[Any]) -> None:
    """Tortoise's ``filter(n__gt=500)`` on ``annotate(n=Count('id'))``, over asyncpg: ``HAVING COUNT("id")>$1``. dp
    decides the operand at Bind; the statement must describe it as PostgreSQL does (bigint), since asyncpg encodes
    the value as the described type: described as text, asyncpg refused to send the integer 500."""
    sql = "SELECT education, count(id) AS n FROM adult GROUP BY education HAVING count(id) > $1 ORDER BY 1"
    counts = dict(truth.execute("select education, count(*) from adult group by education").fetchall())

    async def run(role: str) -> None:
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user=role, password=role,
                                     database=gated_database)
        try:
            statement = await conn.prepare(sql)
            assert [t.name for t in statement.get_parameters()] == ["int8"]
            kept = {row["education"] for row in await statement.fetch(1000)}
            # count at ε 0.5: the noise stays within ±28, so groups 100 away from 1,000 are decided alike
            assert {education for education, n in counts.items() if n > 1100} <= kept
            assert not kept & {education for education, n in counts.items() if n < 900}
        finally:
            await conn.close()

    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, "having_count_analyst", epsilon=10) as role:
        asyncio.run(run(role))


def test_node_postgres_named_and_unnamed(gated_proxy: Endpoint, gated_database: str,
                                        truth: psycopg.Connection[Any]) -> None:
    ensure_node_modules()
    node = shutil.which("node")
    assert node, "node is required for the node-postgres test"
    done = run([node, "bind.js"], libpq_env(gated_proxy, gated_database, user="reporter"), cwd=NODE_DIR)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    counts = [truth.execute(CONTAINS, [pattern]).fetchone()[0] for pattern in ("%sales%", "%tech%")]
    # node-postgres returns bigint as a string.
    assert out["contains"] == [{"rows": [{"n": str(counts[0])}]}, {"error": "0A000"}, {"rows": [{"n": str(counts[1])}]},
                               {"rows": [{"n": str(counts[0])}]}]
    monthly = ("select date_trunc(%(unit)s::varchar, visited_at)::text as d, count(*) as n from visits "
               "group by date_trunc(%(unit)s::varchar, visited_at) order by 1")
    expected = [[{"d": d, "n": str(n)} for d, n in truth.execute(monthly, {"unit": unit})] for unit in ("year",
                                                                                                      "quarter")]
    assert out["monthly"] == [{"rows": expected[0]}, {"error": "0A000"}, {"rows": expected[1]}]


# -- what is refused, and where ---------------------------------------------------------------------------------------


def outcome(conn: psycopg.Connection[Any], sql: str, params: list[Any] | None = None,
            **options: Any) -> list[tuple[Any, ...]] | tuple[str | None, str]:
    """The rows of an answer, or the SQLSTATE and message of its refusal."""
    try:
        return conn.execute(sql, params, **options).fetchall()
    except psycopg.Error as exc:
        return exc.sqlstate, exc.diag.message_primary or ""


@pytest.mark.parametrize(("sql", "value"), [
    (CONTAINS, "%sales%"), (CONTAINS, "sales\\"), (CONTAINS, "%\\%%"),
    ("select date_trunc(%s, visited_at) as d, count(*) from visits group by 1 order by 1", "year"),
    ("select date_trunc(%s, visited_at) as d, count(*) from visits group by 1 order by 1", "week"),
    ("select date_trunc(%s, visited_at) as d, count(*) from visits group by 1 order by 1", "fortnight"),
    ("select extract(%s from visited_at) as q, count(*) from visits group by 1 order by 1", "quarter"),
    ("select date_part(%s, visited_at) as q, count(*) from visits group by 1 order by 1", "hour"),
    ("select to_char(visited_at, %s) as m, count(*) from visits group by 1 order by 1", "YYYY-MM"),
    ("select to_char(visited_at, %s) as m, count(*) from visits group by 1 order by 1", "TZH"),
    ("select date_trunc('month', visited_at at time zone %s) as m, count(*) from visits group by 1 order by 1",
     "UTC"),
    ("select date_trunc('month', visited_at at time zone %s) as m, count(*) from visits group by 1 order by 1",
     "Mars/Olympus_Mons"),
    (OLDER, "40"), (OLDER, "forty"),
    (ADDED_UP, "1"), (ADDED_UP, "0.5"), (ADDED_UP, "-1"), (ADDED_UP, "one"),  # a value sum() adds up
])
def test_a_bound_value_decides_as_the_constant(gated_proxy: Endpoint, gated_database: str,
                                               sql: str, value: str) -> None:
    """Answered or refused, a statement with a value bound at Bind comes out as the same statement with the value
    written as a constant: the same rows (suppression is exact), or the same SQLSTATE and message."""
    with connect(gated_proxy, gated_database, "reporter") as conn:
        written = outcome(conn, constant(sql, value))
        assert outcome(conn, sql, [value]) == written
        assert outcome(conn, sql, [value], prepare=True) == written
        assert outcome(conn, sql, [value], binary=True) == written  # rows in binary format
        assert outcome(conn, sql.replace("%s", "%b"), [value]) == written  # the value in binary format, as text


@pytest.mark.parametrize(("sql", "value"), [
    (CONTAINS, "sales\\"),  # a trailing escape fails only on the rows whose text reaches it
    ("select date_trunc(%s, visited_at), count(*) from visits group by 1", "fortnight"),
    ("select date_part(%s, visited_at), count(*) from visits group by 1", "weekday"),  # not a field PostgreSQL knows
    (OLDER, "40 or 1=1"),
])
@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_a_bound_value_is_refused_as_the_constant(gated_proxy: Endpoint, gated_database: str,
                                                  sql: str, value: str, role: str) -> None:
    with connect(gated_proxy, gated_database, role) as conn:
        written = refusal(conn, constant(sql, value))
        assert written[0] is not None and written[0] != "XX000"
        assert refusal(conn, sql, [value]) == written
        assert refusal(conn, sql, [value], prepare=True) == written
        assert conn.execute("select 1").fetchone() == (1,)  # the batch was skipped to its Sync; the session goes on


def test_a_decision_is_never_served_to_another_value(gated_proxy: Endpoint, gated_database: str,
                                                     truth: psycopg.Connection[Any]) -> None:
    """One named statement bound with a pattern that is answered, one that is refused, and the first again: each
    Bind is decided for its own values."""
    with connect(gated_proxy, gated_database, "reporter") as conn:
        pgconn = conn.pgconn
        sql = CONTAINS.replace("%s", "$1").encode()
        assert pgconn.prepare(b"contains", sql).status == pq.ExecStatus.COMMAND_OK
        for pattern, answered in ((b"%sales%", True), (b"sales\\", False), (b"%sales%", True), (b"sales\\", False)):
            result = pgconn.exec_prepared(b"contains", [pattern])
            if answered:
                assert result.status == pq.ExecStatus.TUPLES_OK
                assert int(result.get_value(0, 0)) == truth.execute(CONTAINS, [pattern.decode()]).fetchone()[0]
            else:
                assert result.status == pq.ExecStatus.FATAL_ERROR
                assert result.error_field(pq.DiagnosticField.SQLSTATE) == b"0A000"


def test_what_no_value_can_change_is_refused_at_parse(gated_proxy: Endpoint, gated_database: str) -> None:
    """A row-level statement is refused whatever the pattern: at Parse, before any value is bound."""
    with connect(gated_proxy, gated_database, "reporter") as conn:
        result = conn.pgconn.prepare(b"rows", b"select age from adult where occupation like $1")
        assert result.status == pq.ExecStatus.FATAL_ERROR
        assert result.error_field(pq.DiagnosticField.SQLSTATE) in (b"42501", b"0A000")


def test_a_simple_query_with_a_parameter(gated_proxy: Endpoint, gated_database: str) -> None:
    with connect(gated_proxy, gated_database, "reporter") as conn:
        conn.pgconn.send_query(b"select count(*) from adult where occupation like $1")
        result = conn.pgconn.get_result()
        while conn.pgconn.get_result() is not None:
            pass
        assert result.error_field(pq.DiagnosticField.SQLSTATE) == b"42P02"


# -- dp mode ---------------------------------------------------------------------------------------------------------


def budget(conn: psycopg.Connection[Any]) -> str:
    return str(conn.execute("show anonproxy.budget").fetchone())


HAVING_COUNT = "select education, count(*) as n from adult group by education having count(*) > %s order by 1"


def test_dp_reads_a_bound_having_operand_as_the_constant(pg_server: EmbeddedPostgres, gated_proxy: Endpoint,
                                                         gated_database: str,
                                                         truth: psycopg.Connection[Any]) -> None:
    """dp evaluates HAVING on the noisy values, in the proxy: a parameter there (Peewee with psycopg 3 binds
    ``HAVING COUNT(id) > 100``) is read at Bind as the constant it stands for, whatever type the client declares;
    a value that is no number of that type is refused as PostgreSQL refuses it (22P02)."""
    counts = dict(truth.execute("select education, count(*) from adult group by education").fetchall())
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, "having_analyst", epsilon=10) as role, \
            connect(gated_proxy, gated_database, role) as conn:
        for value in (1000, "1000", Decimal(1000)):  # bound as smallint, as text, as numeric
            rows = conn.execute(HAVING_COUNT, [value]).fetchall()
            assert rows and all(n > 1000 for _, n in rows)  # the filter ran on the released (noisy) counts
            kept = {education for education, _ in rows}
            # count(*) at ε 0.5: the noise stays within ±28 (2·ln(1e6)), so groups 100 away are decided alike
            assert {education for education, n in counts.items() if n > 1100} <= kept
            assert not kept & {education for education, n in counts.items() if n < 900}
        assert refusal(conn, HAVING_COUNT, ["a thousand"])[0] == "22P02"
        with pytest.raises(psycopg.errors.InvalidTextRepresentation):
            truth.execute(HAVING_COUNT.replace("%s", "%s::int"), ["1000.5"])
        assert refusal(conn, HAVING_COUNT.replace("%s", "%s::int"), ["1000.5"])[0] == "22P02"


def test_dp_answers_a_bound_pattern_and_charges_at_execute_only(pg_server: EmbeddedPostgres, gated_proxy: Endpoint,
                                                                gated_database: str,
                                                                truth: psycopg.Connection[Any]) -> None:
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner, \
            fresh_dp_role(owner, gated_proxy, gated_database, "bind_analyst") as role, \
            connect(gated_proxy, gated_database, role) as conn:
        before = budget(conn)
        pgconn = conn.pgconn
        assert pgconn.prepare(b"contains", CONTAINS.replace("%s", "$1").encode()).status == pq.ExecStatus.COMMAND_OK
        assert pgconn.describe_prepared(b"contains").status == pq.ExecStatus.COMMAND_OK
        refused = pgconn.exec_prepared(b"contains", [b"sales\\"])
        assert refused.error_field(pq.DiagnosticField.SQLSTATE) == b"0A000"
        assert budget(conn) == before  # Parse, Describe and a refused Bind charge nothing
        for pattern in (b"%sales%", b"%tech%", b"%sales%"):  # each value class measured as its own statement
            noisy = int(pgconn.exec_prepared(b"contains", [pattern]).get_value(0, 0))
            # count(*) at ε 0.5: scale 2, 2·ln(1e6) < 28.
            assert abs(noisy - truth.execute(CONTAINS, [pattern.decode()]).fetchone()[0]) <= 28
        assert "epsilon 1 of 2 left" in budget(conn)  # two questions charged; the third, asked again, is free
        assert before != budget(conn)
