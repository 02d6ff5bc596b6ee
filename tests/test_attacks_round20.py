"""Red team round 20: last session's new paths, attacked by someone who reads the code.

Part A (anonproxy/route/discovery.py, column discovery). A statement whose outermost query returns no row by its
structure is answered with its columns and no row, run as ``SELECT * FROM (<statement>) AS anonproxy_discovery
WHERE false``. Statements generated (fixed seed) from select items, orderings, offsets and WITH queries that fail
on any row they are evaluated for (integer overflow, a zero step of generate_series, a negative OFFSET, a
MATERIALIZED WITH query, a scalar subquery, a window frame), each in every no-row form (LIMIT 0, FETCH FIRST 0
ROWS, WHERE false / NULL / 1 = 0 AND ..., HAVING false): answered with no row and the columns PostgreSQL describes
for the statement (name, type, type modifier), never an error, and the dp role charged nothing. Nothing is
evaluated per row: no leak. Finding: the condition folding negated a number by multiplying it by -1, which rounds
a Decimal to 28 digits, so ``-1.00000000000000000000000000000001 < -1`` (true for PostgreSQL) folded to false and a
grouped query under it was answered with no row where PostgreSQL answers its groups (a wrong answer, no leak);
fixed in ``_number`` (an exact sign flip). Finding: the columns of ``x AT TIME ZONE z`` (PostgreSQL: timezone), a
bare ``current_timestamp`` / ``localtimestamp`` and ``ARRAY[...]`` were named ``?column?``, in a discovery and (AT
TIME ZONE) in ordinary answers of both modes; fixed in anonproxy/plan/names.py and plan/post_aggregate.py.

Part A' (anonproxy/plan/bind_values.py, the ``summed`` slot). Values added up, bound at Bind: NaN, infinities and
huge values are refused (0A000). Finding: a tiny one (``sum(a.age * 1e-400)``, literal or bound) made dp's pricing
take math.log10 of a fraction a float holds as 0, and the dp role got XX000 "internal error in anonproxy while
analysing the statement" (no leak: it depends on the statement only); fixed in anonproxy/dp/plan.py (an exact
⌊log10⌋ of a fraction, for the sum's grid and a quantile's step).

Part B (anonproxy/plan/unit_groups.py). An outer query over an aggregate query grouped by ``visits.visit_id``, a
column the policy marks as an identifier (one visit, so one person per group), was answered: the outer level read
only the suppressed-rest row (the reporter's max over per-visit counts was the count of all visits) or, in dp,
almost nothing; no leak, but the answer was far from PostgreSQL's, the very case unit_groups refuses for the unit
(dbt's ``unique`` test on visit_id counted the rest row as 1 failure where PostgreSQL counts none).
Now refused in both modes (0A000, naming the column), the dp role charged nothing; the per-visit query alone is
answered as before and releases no group (each holds one person, as PostgreSQL's own count(DISTINCT) says).
Expressions of the unit (``id + 0``, ``id::text``, ``coalesce(person_id, 0)``) are refused in the inner query
already, and a derived table, a WITH query, parentheses or a join's other side renaming the unit are caught
(tests/test_unit_groups.py).

Part C (re-attack of the last external red team's HAVING finding). A withheld value asked through HAVING with the
value bound at Bind (psycopg's server-side binding), through one prepared statement run again with other values,
and through a server-side cursor: the answer (rows or SQLSTATE) does not change when the one person of an age has
their sex swapped with another's (each sex keeps its count). No leak.

Part D (the service-pool finding): clients that stop reading a 13 MB answer mid-way, more than the pool has
connections: another session is answered (service_hold_timeout gives their connections up). No hold.

Part E (the audit-trail finding): TRUNCATE, DELETE, UPDATE (also in a WITH query or DO), ALTER TABLE ... DISABLE
TRIGGER, a role rename, set_config and a read of the trail by the roles it records are refused (42501) and recorded;
a text over max_statement_size is refused (54000) and recorded; the rows before stay as they were. No gap.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from conftest import SERVICE_ROLE, attack_roles, lone_person, proxy_of_its_own, swap_sexes
from psycopg import pq
from service_sql import sorted_rows

from anonproxy.embedded import EmbeddedPostgres

reporter, analyst = attack_roles("dp_round20", epsilon=100, scope="module")

# Part A. Pieces that fail on any row they are evaluated for: a statement in which PostgreSQL evaluated one per row
# would fail (an error that would tell whether some row exists, or what it holds).
FAILING_ITEMS = [
    "a.age * 2147483647 AS x",  # integer out of range (every age is at least 17)
    "generate_series(1, 3, a.age - a.age) AS x",  # step size cannot equal zero
    "(SELECT b.age * 2147483647 FROM public.adult b ORDER BY b.id LIMIT 1) AS x",
    "sum(a.age) OVER (ORDER BY a.id ROWS BETWEEN (SELECT min(b.age) - 100 FROM public.adult b) PRECEDING "
    "AND CURRENT ROW) AS x",  # frame starting offset must not be negative
]
NO_ROW = [" LIMIT 0", " FETCH FIRST 0 ROWS ONLY", " WHERE false", " WHERE NULL", " WHERE 1 = 0 AND a.age > 20",
          " WHERE NOT (2 > 1)", " ORDER BY a.age * 2147483647 LIMIT 0",
          " LIMIT 0 OFFSET (SELECT min(b.age) - 100 FROM public.adult b)"]  # OFFSET must not be negative
OTHERS = [
    "WITH m AS MATERIALIZED (SELECT a.age * 2147483647 AS x FROM public.adult a) SELECT m.x FROM m LIMIT 0",
    "WITH m AS (SELECT a.age * 2147483647 AS x FROM public.adult a) SELECT m.x FROM m WHERE false",
    "SELECT a.sex, sum(a.age * 2147483647) AS s FROM public.adult a GROUP BY 1 HAVING false",
    "SELECT a.sex, sum(a.age * 2147483647) AS s FROM public.adult a GROUP BY 1 HAVING 1 = 0 AND sum(a.age) > 3",
    "SELECT x.sex FROM (SELECT a.sex, a.age * 2147483647 AS y FROM public.adult a) x WHERE x.y > 0 LIMIT 0",
    "SELECT DISTINCT ON (a.age * 2147483647) a.sex FROM public.adult a LIMIT 0",
    "SELECT a.sex, v.channel, sum(v.amount * 1e300 * 1e300) AS s FROM public.adult a JOIN public.visits v "
    "ON v.person_id = a.id GROUP BY 1, 2 LIMIT 0",
]


# The names, types and type modifiers the rendering must keep (PostgreSQL's FigureColname and the casts' typmods).
NAMED = [
    "SELECT a.sex::varchar(3), a.age::real, CAST(a.age AS float(10)), a.sex::char(3), a.age::numeric(5,1), "
    "a.age::int2, a.age::bigint, (a.age)::double precision FROM public.adult a LIMIT 0",
    "SELECT row_number() OVER (), count(*) OVER (PARTITION BY a.sex), rank() OVER (ORDER BY a.age), "
    "lag(a.age) OVER (ORDER BY a.id) FROM public.adult a LIMIT 0",
    "SELECT date_part('year', v.visited_at), EXTRACT(year FROM v.visited_at), date_trunc('month', v.visited_at), "
    "v.visited_at AT TIME ZONE 'UTC', to_char(v.visited_at, 'YYYY') FROM public.visits v LIMIT 0",
    "SELECT count(*) FILTER (WHERE a.age > 3), sum(a.age)::numeric(10,2), avg(a.age)::int, round(avg(a.age), 1), "
    "count(DISTINCT a.sex) FROM public.adult a GROUP BY a.sex LIMIT 0",
    'SELECT "a"."sex" AS "Sex", a.sex AS "SEX", a.age "Age" FROM public.adult a LIMIT 0',
    'SELECT a.sex::"varchar", a.age::pg_catalog.int4, a.age::"numeric"(4,0) FROM public.adult a WHERE false',
    "SELECT now(), current_date, current_timestamp, localtimestamp FROM public.adult a LIMIT 0",
    "SELECT a.age IN (1, 2), true, false, NULL, 1, 'x', 'x'::text, a.age::text::int, -a.age, "
    "a.age BETWEEN 1 AND 3 FROM public.adult a LIMIT 0",
    "SELECT ARRAY[a.age], ROW(a.age, a.sex), a.age IS NULL, a.sex LIKE 'M%', nullif(a.age, 3), coalesce(a.age, 0), "
    "CASE WHEN a.age > 3 THEN a.sex END, CASE WHEN a.age > 3 THEN 1 ELSE a.age END FROM public.adult a LIMIT 0",
]


def _generated() -> list[str]:
    """Every failing item in every no-row form (a fixed-seed sample of 16), and the other shapes."""
    pairs = [f"SELECT a.sex, {item} FROM public.adult a{form}"
             for item, form in itertools.product(FAILING_ITEMS, NO_ROW)]
    return sorted(random.Random(20).sample(pairs, 16)) + OTHERS + NAMED


DISCOVERIES = _generated()


def _described(conn: psycopg.Connection[Any], sql: str) -> list[tuple[str, int, int]]:
    """The columns (name, type OID, type modifier) PostgreSQL describes for ``sql``, parsed and never run."""
    name = b"round20_described"
    prepared = conn.pgconn.prepare(name, sql.encode())
    assert prepared.status == pq.ExecStatus.COMMAND_OK, (prepared.error_message or b"").decode()
    try:
        result = conn.pgconn.describe_prepared(name)
        return [((result.fname(i) or b"").decode(), result.ftype(i), result.fmod(i)) for i in range(result.nfields)]
    finally:
        conn.pgconn.exec_(b"DEALLOCATE " + name)


def _answered(conn: psycopg.Connection[Any], sql: str) -> tuple[list[tuple[str, int, int]], list[Any]]:
    """The columns and rows ``conn`` gets for ``sql``."""
    cursor = conn.execute(sql)
    assert cursor.description is not None, sql
    columns = [(column.name, column.type_code, cursor.pgresult.fmod(i) if cursor.pgresult is not None else -1)
               for i, column in enumerate(cursor.description)]
    return columns, cursor.fetchall()


def budget_left(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("show anonproxy.budget").fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.parametrize("sql", DISCOVERIES)
def test_a_discovery_evaluates_nothing(truth: psycopg.Connection, reporter: psycopg.Connection[Any],
                                       analyst: psycopg.Connection[Any], sql: str) -> None:
    """No row and PostgreSQL's own columns, for both roles, never the error an evaluated piece raises; the dp role
    is charged nothing."""
    expected = _described(truth, sql)
    before = budget_left(analyst)
    for conn in (reporter, analyst):
        assert _answered(conn, sql) == (expected, []), sql
    assert budget_left(analyst) == before, sql


# The same names in answers that are no discovery (the rewriting names the columns as the discovery does).
NAMED_ANSWERS = [
    "SELECT date_trunc('year', v.visited_at) AT TIME ZONE 'UTC', count(*) FROM public.visits v GROUP BY 1",
    "SELECT v.channel, v.visited_at AT TIME ZONE 'UTC', count(*) FROM public.visits v GROUP BY 1, 2",
    "SELECT date_trunc('day', v.visited_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', count(*) AS n "
    "FROM public.visits v GROUP BY 1 ORDER BY 1 LIMIT 3",
]


@pytest.mark.parametrize("sql", NAMED_ANSWERS)
def test_an_answer_names_its_columns_as_postgresql(truth: psycopg.Connection, reporter: psycopg.Connection[Any],
                                                   analyst: psycopg.Connection[Any], sql: str) -> None:
    expected = [name for name, _, _ in _described(truth, sql)]
    for conn in (reporter, analyst):
        cursor = conn.execute(sql)
        assert cursor.description is not None and [column.name for column in cursor.description] == expected, sql


# A condition PostgreSQL holds true, which exact arithmetic needs more than 28 digits to tell, and its false twin.
TRUE_BEYOND_28_DIGITS = ["-1.00000000000000000000000000000001 < -1", "NOT (-1.00000000000000000000000000000001 = -1)",
                         "-(-1.00000000000000000000000000000001) > 1"]
FALSE_BEYOND_28_DIGITS = ["-1.00000000000000000000000000000001 = -1", "-1 <= -1.00000000000000000000000000000001"]
GROUPED = "SELECT a.sex, count(*) FROM public.adult a{} GROUP BY 1"


@pytest.mark.parametrize("condition", TRUE_BEYOND_28_DIGITS)
def test_a_condition_true_beyond_28_digits_is_no_discovery(truth: psycopg.Connection,
                                                           reporter: psycopg.Connection[Any],
                                                           condition: str) -> None:
    """PostgreSQL keeps every row under the condition: the reporter gets the groups it gets without it (both sexes
    have thousands of people), not an empty answer."""
    rows = truth.execute(GROUPED.format(f" WHERE {condition}")).fetchall()
    assert sorted_rows(rows) == sorted_rows(truth.execute(GROUPED.format("")).fetchall())
    answered = reporter.execute(GROUPED.format(f" WHERE {condition}")).fetchall()
    assert len(answered) == 2 and sorted_rows(answered) == sorted_rows(rows), condition


@pytest.mark.parametrize("condition", FALSE_BEYOND_28_DIGITS)
def test_a_condition_false_beyond_28_digits_is_a_discovery(truth: psycopg.Connection,
                                                           reporter: psycopg.Connection[Any],
                                                           analyst: psycopg.Connection[Any], condition: str) -> None:
    sql = GROUPED.format(f" WHERE {condition}")
    assert truth.execute(sql).fetchall() == []
    before = budget_left(analyst)
    for conn in (reporter, analyst):
        assert _answered(conn, sql) == (_described(truth, sql), []), sql
    assert budget_left(analyst) == before


# Part A'. The ``summed`` slot (anonproxy/plan/bind_values.py): a value added up, bound at Bind. Huge, infinite and
# NaN values are refused (0A000); a tiny one (1e-400) made dp's pricing take math.log10 of a fraction that a float
# holds as 0: "math domain error", answered with XX000 "internal error in anonproxy". Literal or bound, dp answers.
TINY = [
    ("SELECT a.sex, sum(a.age * 1e-400) FROM public.adult a GROUP BY 1", ()),
    ("SELECT a.sex, avg(a.age * 1e-400) FROM public.adult a GROUP BY 1", ()),
    ("SELECT a.sex, sum(CASE WHEN a.income = %s THEN %s ELSE 0 END) FROM public.adult a GROUP BY 1",
     (">50K", Decimal("1e-400"))),
    ("SELECT a.sex, sum(a.age * %s) FROM public.adult a GROUP BY 1", (Decimal("1e-400"),)),
]


@pytest.mark.parametrize(("sql", "params"), TINY)
def test_dp_answers_a_sum_of_tiny_values(reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
                                         sql: str, params: tuple[Any, ...]) -> None:
    """Both sexes answered, each a number of the size PostgreSQL's own sums have (below 1e-390, not a grid 400
    orders of magnitude off), as the reporter is answered."""
    for conn in (reporter, analyst):
        rows = conn.execute(sql, params or None).fetchall()
        assert sorted(row[0] for row in rows) == ["Female", "Male"], (sql, rows)
        assert all(abs(row[1]) < Decimal("1e-390") for row in rows), (sql, rows)


# Part B. Grouped by an identifier column that is not the unit: one visit, one person.
PER_VISIT = [
    ("SELECT max(q.n) FROM (SELECT v.visit_id, count(*) AS n FROM public.visits v GROUP BY v.visit_id) q",
     "v.visit_id"),
    ("SELECT avg(q.s) FROM (SELECT visit_id, sum(amount) AS s FROM public.visits GROUP BY 1) q", "visits.visit_id"),
    ("SELECT count(*) FROM (SELECT v.visit_id, count(*) AS n FROM public.visits v JOIN public.adult a "
     "ON a.id = v.person_id GROUP BY 1) q WHERE q.n = 1", "v.visit_id"),
    ("WITH per_visit AS (SELECT v.visit_id AS k, sum(v.amount) AS top FROM public.visits v GROUP BY 1) "
     "SELECT avg(per_visit.top) FROM per_visit", "v.visit_id"),
    # dbt's unique test (tests/bi_corpus/dbt.yaml): the reporter was answered 1 failure, PostgreSQL counts none
    ("select count(*) as failures, count(*) != 0 as should_warn from (select visit_id as unique_field, "
     "count(*) as n_records from public.visits where visit_id is not null group by visit_id having count(*) > 1) "
     "dbt_internal_test", "visits.visit_id"),
]


@pytest.mark.parametrize(("sql", "column"), PER_VISIT)
def test_an_outer_query_over_per_visit_groups_is_refused(reporter: psycopg.Connection[Any],
                                                         analyst: psycopg.Connection[Any], sql: str,
                                                         column: str) -> None:
    before = budget_left(analyst)
    for conn, fate in ((reporter, "none can be released"), (analyst, "partition selection releases almost none")):
        with pytest.raises(psycopg.errors.FeatureNotSupported) as refused:
            conn.execute(sql)
        message = refused.value.diag.message_primary or ""
        assert message.startswith(f"an outer query over an aggregate query grouped by the identifier column {column} "
                                  "is not supported: each group is one person"), message
        assert fate in message, message
        assert (refused.value.diag.message_hint or "").startswith("Ask the statistic over people directly"), sql
    assert budget_left(analyst) == before, "a refusal costs nothing"


def test_per_visit_groups_alone_release_no_group(truth: psycopg.Connection,
                                                 reporter: psycopg.Connection[Any]) -> None:
    """The inner query alone is answered: every visit is one person (PostgreSQL's count(DISTINCT person_id) per
    visit is 1), so no visit is released, only the rest row (a NULL key) of all the visits."""
    people = truth.execute("SELECT max(n) FROM (SELECT count(DISTINCT person_id) AS n FROM public.visits "
                           "GROUP BY visit_id) q").fetchone()
    assert people == (1,)
    visits = truth.execute("SELECT count(*) FROM public.visits").fetchone()
    assert visits is not None
    rows = reporter.execute("SELECT v.visit_id, count(*) FROM public.visits v GROUP BY 1").fetchall()
    assert rows == [(None, visits[0])]


# Part C. Whether a group holds the one person of an age, asked with that age bound at Bind: each statement and its
# values, AGE standing for the lone age (each statement is also run with 40 in its place, an age many people have),
# LONE for the lone age in both runs (a WHERE that keeps both people whose sexes are swapped).
AGE, LONE = -1, -2
HAVING_BOUND = [
    ("SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 HAVING count(*) FILTER (WHERE a.age = %s) = 1", (AGE,)),
    ("SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 HAVING count(*) FILTER (WHERE a.age = %s::integer) "
     "= %s::integer", (AGE, 1)),
    ("SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 HAVING sum(CASE WHEN a.age = %s THEN 1 ELSE 0 END) "
     "= %s", (AGE, 1)),
    ("SELECT a.sex, count(*) FROM public.adult a WHERE a.age IN (%s, 40) GROUP BY 1 "
     "HAVING sum(CASE WHEN a.age = %s THEN 1 ELSE 0 END) > 0", (LONE, AGE)),
    ("SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 "
     "HAVING avg(CASE WHEN a.age = %s THEN 1000 ELSE 0 END) > %s", (AGE, 0)),
]


@pytest.fixture(scope="module")
def lone(truth: psycopg.Connection) -> tuple[int, int, int]:
    return lone_person(truth)


@pytest.fixture
def swapped(truth: psycopg.Connection, lone: tuple[int, int, int]) -> Iterator[Any]:
    """A callable that swaps the lone person's sex with the other person's; swapped back after the test."""
    swaps = []

    def swap() -> None:
        swap_sexes(truth, lone[1], lone[2])
        swaps.append(1)

    yield swap
    if len(swaps) % 2:
        swap_sexes(truth, lone[1], lone[2])


def _bound_answers(conn: psycopg.Connection[Any], sql: str, values: list[tuple[int, ...]]) -> list[Any]:
    """The answer (sorted rows, or the SQLSTATE) to ``sql`` for each tuple of values: one prepared statement run
    again with each, then each through a server-side cursor."""
    answers: list[Any] = []
    for params in values:
        try:
            answers.append(sorted_rows(conn.execute(sql, params, prepare=True).fetchall()))
        except psycopg.Error as error:
            answers.append(error.sqlstate)
    for params in values:
        try:
            with conn.transaction(), conn.cursor(name="round20_having") as cursor:
                cursor.execute(sql, params)
                answers.append(sorted_rows(cursor.fetchall()))
        except psycopg.Error as error:
            answers.append(error.sqlstate)
    return answers


@pytest.mark.parametrize(("sql", "template"), HAVING_BOUND)
def test_a_withheld_value_is_not_read_through_a_bound_having(reporter: psycopg.Connection[Any],
                                                             lone: tuple[int, int, int], swapped: Any, sql: str,
                                                             template: tuple[int, ...]) -> None:
    """The same answers, for the lone age and for 40, whichever sex the one person of the lone age has."""
    values = [tuple({AGE: age, LONE: lone[0]}.get(value, value) for value in template) for age in (lone[0], 40)]
    as_is = _bound_answers(reporter, sql, values)
    swapped()
    assert _bound_answers(reporter, sql, values) == as_is, sql


# Part D (re-attack of the last external red team's service-pool finding). Clients that stop reading mid-answer: each
# asks for an answer of about 13 MB (a 200,000-character constant beside each of the 67 released ages) and reads
# none of it, more of them than the pool has connections, so each keeps the service connection its answer comes
# from. Another session's statement is answered: past service_hold_timeout a session whose client reads nothing
# gives its connection up to a waiting statement (it is ended with 57014). No hold.
POOL = 2
PAD = "x" * 200_000
UNREAD = f"SELECT a.age, '{PAD}' AS pad, count(*) FROM public.adult a GROUP BY 1"
SEXES_COUNT = "SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 ORDER BY 1"


@pytest.fixture
def small_pool(truth: psycopg.Connection, pg_server: EmbeddedPostgres, gated_database: str,
               tmp_path: Any) -> Iterator[Any]:
    """A proxy of the gated database with a pool of ``POOL`` service connections, held at most 2 s by a client that
    reads nothing while a statement waits 30 s at most for one."""
    with proxy_of_its_own(truth, pg_server, gated_database, tmp_path / "anonproxy.log", service_pool_size=str(POOL),
                          service_hold_timeout="2", service_wait_timeout="30") as started:
        yield started


def _wait_for_blocked_service(truth: psycopg.Connection) -> None:
    """Wait until every service connection of the pool is blocked sending an answer no client reads."""
    for _ in range(600):
        row = truth.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = %s AND wait_event = 'ClientWrite'",
                            (SERVICE_ROLE,)).fetchone()
        if row is not None and row[0] >= POOL:
            return
        time.sleep(0.1)
    pytest.fail("the service connections never blocked on the unread answers")


def test_clients_that_stop_reading_mid_answer_hold_no_service_connection(truth: psycopg.Connection,
                                                                         small_pool: Any,
                                                                         gated_database: str) -> None:
    own = truth.execute(SEXES_COUNT).fetchall()
    holders = []
    try:
        for _ in range(POOL + 1):
            conn = psycopg.connect(small_pool.endpoint.dsn(gated_database, user="reporter"), autocommit=True)
            holders.append(conn)
            conn.pgconn.send_query(UNREAD.encode())  # sent; its answer never read
        _wait_for_blocked_service(truth)
        with psycopg.connect(small_pool.endpoint.dsn(gated_database, user="reporter"), autocommit=True) as victim:
            assert victim.execute(SEXES_COUNT).fetchall() == own
    finally:
        for conn in holders:
            conn.close()
    # the answer waited for holders: the connection it ran on was given up by one of them
    assert "read nothing of its answer for service_hold_timeout" in small_pool.log(), small_pool.log()


# Part E (re-attack of the last external red team's audit-trail finding). The trail emptied, edited or read by the
# roles it records, through the proxy: each statement is refused with 42501 (by the proxy, or by PostgreSQL's
# grants for a read, which passes to the client's own connection) and is itself a row of the trail; the trail
# only grows. A text longer than max_statement_size (256 KiB) is refused with 54000 and recorded too.
TRAIL_ATTACKS = [
    "TRUNCATE anonproxy.audit_trail",
    "DELETE FROM anonproxy.audit_trail",
    "UPDATE anonproxy.audit_trail SET statement = ''",
    "WITH d AS (DELETE FROM anonproxy.audit_trail RETURNING 1) SELECT count(*) FROM d",
    "ALTER ROLE reporter RENAME TO someone_else",
    "DO $$ BEGIN DELETE FROM anonproxy.audit_trail; END $$",
    "SELECT count(*) FROM anonproxy.audit_trail",
    "ALTER TABLE anonproxy.audit_trail DISABLE TRIGGER ALL",
    "SELECT set_config('anonproxy.audit', 'off', false)",
]


def _trail(truth: psycopg.Connection, login: str) -> list[tuple[Any, ...]]:
    return truth.execute("SELECT decision, sqlstate, statement FROM anonproxy.audit_trail WHERE login = %s "
                         "ORDER BY at", (login,)).fetchall()


@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_the_trail_is_not_emptied_edited_or_read_by_whom_it_records(truth: psycopg.Connection,
                                                                    reporter: psycopg.Connection[Any],
                                                                    analyst: psycopg.Connection[Any],
                                                                    role: str) -> None:
    conn = reporter if role == "reporter" else analyst
    login = conn.info.user
    total = truth.execute("SELECT count(*) FROM anonproxy.audit_trail").fetchone()
    before = _trail(truth, login)
    long_text = "SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 -- " + "x" * 300_000
    for statement in [*TRAIL_ATTACKS, long_text]:
        with pytest.raises(psycopg.Error) as refused:
            conn.execute(statement)
        expected = "54000" if statement is long_text else "42501"
        assert refused.value.sqlstate == expected, (statement, refused.value.sqlstate, str(refused.value))
    after = _trail(truth, login)
    assert after[:len(before)] == before, "the rows before are kept as they were"
    added = after[len(before):]
    assert [row[1] for row in added if row[0] == "refused"] == ["42501"] * (len(TRAIL_ATTACKS) - 1) + ["54000"], added
    assert [row[0] for row in added].count("passed") == 1, "the read passed to PostgreSQL, which refused it"
    now = truth.execute("SELECT count(*) FROM anonproxy.audit_trail").fetchone()
    assert total is not None and now is not None and now[0] >= total[0] + len(TRAIL_ATTACKS) + 1
