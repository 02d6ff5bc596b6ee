"""Red team, round 12: the semi-joins on the privacy unit and the time spines of round 11 (anonproxy.plan.semi_joins,
anonproxy.plan.spines), attacked by a reader of their code.

Through the real gated proxy with a real driver, as ``reporter`` (suppress, k = 10) or a dp role of this module's
own, each attack asserts the safe outcome: a clear refusal with its SQLSTATE, or an answer that releases no group
of fewer than k people. Where PostgreSQL itself would give the data away (an error on one person's value, a row of
one person), the test shows that first on the superuser connection.

No attack released a person's data. Two gaps are fixed with this round (the tests on them failed before):

* A spine's values were checked only for queries and parameters: ``VALUES (query_to_xml('select age from adult
  where id = 1', ...))`` (or the same in a derived table over ``generate_series``) went to the final check, whose
  function allowlist refused it with 42501, the error that says the analysis let something through. A spine's
  values are now constants, its columns, casts and arithmetic only, refused with 0A000 by the analysis.
* A spine joined to the rows and grouped by its column moved by an interval of months (``GROUP BY d.day +
  interval '1 month'``) was answered with a row per spine day: four rows labelled 2025-02-28 where PostgreSQL
  merges January 28 to 31 into one group (no group smaller than k was released, but the answer was not
  PostgreSQL's). Moving by an integer or an interval without months is one value per spine row; anything else is
  refused.

A third gap, closed by the first fix: a spine's bound of 20,000 rows was passed by a set-returning function in the select list of a
derived table over a one-row spine (``SELECT generate_series(1, 1000000) AS n FROM generate_series(1, 1)``):
answered before, refused now with the other values that are not constants.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from conftest import answer, corpus_roles

reporter, analyst = corpus_roles("dp_round12")

AGE_OF_ONE = "query_to_xml('select age from public.adult where id = 1', true, true, '')"
COUNTS = "(SELECT count(*) AS n FROM public.adult) AS q"
DAYS = "generate_series('2025-01-27'::timestamp, '2025-01-31'::timestamp, interval '1 day') AS d(day)"
DAY_OF_VISIT = "date_trunc('day', v.visited_at)::timestamp = d.day"


def refused(conn: psycopg.Connection[Any], sql: str, sqlstate: str, message: str) -> None:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(sql).fetchall()
    assert caught.value.sqlstate == sqlstate, caught.value
    assert message in str(caught.value), caught.value


def postgresql_fails(truth: psycopg.Connection[Any], sql: str, sqlstate: str) -> None:
    """PostgreSQL's own answer to ``sql`` is an error raised by some person's value."""
    with pytest.raises(psycopg.Error) as caught:
        truth.execute(sql).fetchall()
    assert caught.value.sqlstate == sqlstate, caught.value


# --- spines: values that read data ---------------------------------------------------------------------------

SPINES_THAT_READ = [
    (f"SELECT s.x, q.n FROM (VALUES ({AGE_OF_ONE})) AS s(x), {COUNTS}",
     "a VALUES list beside aggregate queries holds at most 20000 rows of constants"),
    (f"SELECT s.x, q.n FROM (SELECT {AGE_OF_ONE}::text AS x FROM generate_series(1, 1) AS g(i)) AS s, {COUNTS}",
     "a derived table over a time spine may compute only over its constants"),
]


@pytest.mark.parametrize(("sql", "message"), SPINES_THAT_READ)
def test_a_spine_value_that_runs_a_query_is_refused_by_the_analysis(
        reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any], sql: str, message: str) -> None:
    """query_to_xml() runs the query in its text: PostgreSQL shows person 1's age. Refused with 0A000 by the
    analysis (before: 42501 from the final check, the backstop for what the analysis missed)."""
    assert "<age>" in truth.execute(sql).fetchone()[0]
    refused(reporter, sql, "0A000", message)


def test_a_spine_of_constants_with_casts_and_arithmetic_is_still_answered(
        reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    sql = ("SELECT s.age, q.n FROM (VALUES (-(-17)), (2 * 9), ('19'::int + 0)) AS s(age) LEFT JOIN (SELECT age, "
           "count(*) AS n FROM public.adult GROUP BY age) AS q ON q.age = s.age ORDER BY 1")
    assert answer(reporter, sql) == answer(truth, sql)


def test_a_set_returning_function_in_a_spine_is_refused(reporter: psycopg.Connection[Any],
                                                       truth: psycopg.Connection[Any]) -> None:
    """generate_series() in the select list of a derived table over a one-row spine gave a million rows, past the
    spine's bound of 20,000 (answered before); a spine's values are constants now."""
    sql = ("SELECT s.n, q.n FROM (SELECT generate_series(1, 1000000) AS n FROM generate_series(1, 1) AS g(i)) AS s "
           "LEFT JOIN (SELECT age, count(*) AS n FROM public.adult GROUP BY age) AS q ON q.age = s.n LIMIT 2")
    assert truth.execute(sql).fetchall() == [(1, None), (2, None)]
    refused(reporter, sql, "0A000", "a derived table over a time spine may compute only over its constants")


@pytest.mark.parametrize("arguments", ["1, (SELECT 3)", "1, $$3$$::int", "1, 3, 0",
                                       "now(), now() + interval '3 day', interval '1 day'"])
def test_a_series_of_arguments_that_are_not_constants_is_refused(reporter: psycopg.Connection[Any],
                                                                  arguments: str) -> None:
    sql = (f"SELECT d.n, q.n FROM generate_series({arguments}) AS d(n) LEFT JOIN (SELECT age, count(*) AS n "
           "FROM public.adult GROUP BY age) AS q ON q.age = d.n")
    refused(reporter, sql, "0A000", "generate_series beside aggregate queries takes constants")


# --- a spine joined to the rows ----------------------------------------------------------------------------------

def test_a_spine_grouped_by_its_day_moved_by_a_month_is_refused(reporter: psycopg.Connection[Any],
                                                                truth: psycopg.Connection[Any]) -> None:
    """January 28 to 31 plus a month are all February 28: PostgreSQL merges them into one group. Answered before
    with one row per spine day (four rows labelled February 28); refused now."""
    sql = (f"SELECT d.day + interval '1 month' AS m, count(*) AS n FROM {DAYS} JOIN public.visits v ON "
           f"{DAY_OF_VISIT} GROUP BY d.day + interval '1 month' ORDER BY 1")
    assert len(answer(truth, sql)[1]) == 2  # five spine days, two groups
    refused(reporter, sql, "0A000", "must be grouped by the spine's column")


def test_a_spine_grouped_by_its_day_moved_by_days_is_postgresqls_answer(reporter: psycopg.Connection[Any],
                                                                          truth: psycopg.Connection[Any]) -> None:
    sql = (f"SELECT d.day + interval '7 day' AS m, count(*) AS n FROM {DAYS} JOIN public.visits v ON "
           f"{DAY_OF_VISIT} GROUP BY d.day + interval '7 day' ORDER BY 1")
    assert answer(reporter, sql) == answer(truth, sql)


def test_a_semi_join_in_a_spine_joined_to_rows_is_postgresqls_answer(reporter: psycopg.Connection[Any],
                                                                       truth: psycopg.Connection[Any]) -> None:
    """The semi-join goes into the aggregate query of the rewrite, tied to the same person there."""
    sql = ("SELECT d.n, count(*) FROM generate_series(17, 19) AS d(n) LEFT JOIN public.adult a ON a.age = d.n "
           "WHERE EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = a.id AND v.amount > 400) GROUP BY d.n "
           "ORDER BY 1")
    assert answer(reporter, sql) == answer(truth, sql)


@pytest.mark.parametrize("join", ["JOIN public.adult a ON a.id = d.n", "JOIN public.visits v ON v.person_id = d.n"])
def test_a_spine_joined_to_one_persons_rows_releases_no_group(
        reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any],
        join: str) -> None:
    """Each spine row is one person's rows: PostgreSQL lists them; the spine reads an aggregate query grouped by
    the privacy unit (anonproxy/plan/unit_groups.py), each group one person, none releasable: refused in both modes
    (it released no group before: an empty answer that said nothing)."""
    sql = f"SELECT d.n, count(*) FROM generate_series(1, 3) AS d(n) {join} GROUP BY d.n"
    assert len(answer(truth, sql)[1]) == 3
    for conn in (reporter, analyst):
        refused(conn, sql, "0A000", "grouped by the privacy unit")


def test_a_join_key_that_fails_on_a_persons_value_is_refused(reporter: psycopg.Connection[Any],
                                                             truth: psycopg.Connection[Any]) -> None:
    """100 / (age - 39) fails for the people aged 39 only: the key goes into the aggregate query, whose analysis
    refuses it."""
    sql = "SELECT d.n, count(*) FROM generate_series(1, 3) AS d(n) JOIN public.adult a ON 100 / (a.age - 39) = d.n " \
          "GROUP BY d.n"
    postgresql_fails(truth, sql, "22012")
    refused(reporter, sql, "0A000", "division by (a.age - 39)")


@pytest.mark.parametrize(("sql", "message"), [
    ("SELECT d.n, count(*) FROM generate_series(1, 3) AS d(n) RIGHT JOIN public.adult a ON a.age = d.n "
     "GROUP BY d.n", "this join is not supported for a time spine joined to a table's rows"),
    ("SELECT d.n, count(*) FROM generate_series(1, 3) AS d(n) FULL JOIN public.adult a ON a.age = d.n "
     "GROUP BY d.n", "this join is not supported for a time spine joined to a table's rows"),
    ("SELECT d.n, count(*) FROM generate_series(1, 3) AS d(n) CROSS JOIN public.adult a GROUP BY d.n",
     "this join is not supported for a time spine joined to a table's rows"),
    ("SELECT d.n, count(*) FROM public.visits v LEFT JOIN generate_series(1, 3) AS d(n) ON v.amount::int = d.n "
     "GROUP BY d.n", "functions and other table expressions in FROM are not allowed over protected tables"),
    ("SELECT d.n, count(*) FROM generate_series(1, 3) AS d(n) JOIN public.adult a ON a.age / (d.n - 2) = 20 "
     "GROUP BY d.n", "takes one ON equality between an expression of the table and one of the spine"),
    ("SELECT d.n, count(*) FROM generate_series(1, 3) AS d(n) JOIN public.adult a ON a.age = d.n + 16 "
     "GROUP BY d.n HAVING count(*) > 400", "HAVING is not supported for a time spine joined to a table's rows"),
    ("SELECT d.n, (SELECT count(*) FROM public.adult) FROM generate_series(1, 3) AS d(n) JOIN public.adult a ON "
     "a.age = d.n GROUP BY d.n", "subqueries are not allowed in an outer query over an aggregate query"),
    ("SELECT d.day, count(*) FROM generate_series('2025-03-01'::timestamptz, '2025-03-03'::timestamptz, interval "
     "'1 day') AS d(day) JOIN public.visits v ON date_trunc('day', v.visited_at) = d.day JOIN public.adult a ON "
     "a.id = v.person_id GROUP BY d.day", "functions and other table expressions in FROM are not allowed"),
    # a spine that repeats a value would count each person of its group twice: only generate_series is joined
    ("SELECT s.age, count(*) FROM (SELECT 17 AS age FROM generate_series(1, 2) AS g(i)) AS s JOIN public.adult a "
     "ON a.age = s.age GROUP BY s.age",
     "a derived table over generate_series as a spine joined to a table's rows is not supported"),
    ("SELECT s.age, count(*) FROM (VALUES (17), (17)) AS s(age) JOIN public.adult a ON a.age = s.age GROUP BY s.age",
     "a VALUES spine joined to a table's rows is not supported"),
    ("SELECT count(*) FROM public.adult a JOIN (VALUES (17), (17)) AS s(age) ON a.age = s.age",
     "functions and other table expressions in FROM are not allowed"),
    ("SELECT d.n, count(*) FROM generate_series(17, 19) AS d(n) LEFT JOIN public.adult a ON a.age = d.n WHERE d.n "
     "IN (SELECT age FROM public.adult) GROUP BY d.n", "must read the spine or the table, not both"),
])
def test_spines_joined_other_ways_are_refused(reporter: psycopg.Connection[Any], sql: str, message: str) -> None:
    """Joins that let a person's row into several groups, or none, or outside the spine's groups."""
    refused(reporter, sql, "0A000", message)


# --- semi-joins ----------------------------------------------------------------------------------------------

FAILING_CONDITIONS = [
    ("NOT EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = a.id AND 1 / (v.amount - 5.00) > 0)", "22012",
     "division by (v.amount - 5.00)"),
    ("NOT EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = a.id AND (v.amount * 100)::int::smallint > 0)",
     "22003", "can overflow smallint"),
    ("a.id IN (SELECT v.person_id FROM public.visits v WHERE v.channel::int > 0)", "22P02", "cast to INT of"),
    ("EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = a.id AND 1 / (v.amount - 5.00) > 0 LIMIT 1)",
     "22012", "division by (v.amount - 5.00)"),
]


@pytest.mark.parametrize(("condition", "sqlstate", "message"), FAILING_CONDITIONS)
def test_an_inner_condition_that_fails_on_a_persons_value_is_refused(
        reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any], condition: str, sqlstate: str,
        message: str) -> None:
    """PostgreSQL evaluates the inner condition on every visit it reads: an error tells that some visit holds the
    value. The inner conditions pass the no-error proof of a WHERE condition."""
    sql = f"SELECT count(*) FROM public.adult a WHERE {condition}"
    postgresql_fails(truth, sql, sqlstate)
    refused(reporter, sql, "0A000", message)


def test_a_semi_join_that_picks_one_person_releases_nothing(
        reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    """A condition on the unit inside the subquery is a condition on one person: the answer is a group of one."""
    for inner in ("public.visits v WHERE v.person_id = a.id AND v.person_id = 7",
                  "public.adult b WHERE b.id = a.id AND b.id = 7"):
        sql = f"SELECT count(*) FROM public.adult a WHERE EXISTS (SELECT 1 FROM {inner})"
        assert truth.execute(sql).fetchall() == [(1,)]
        assert reporter.execute(sql).fetchall() == []


def test_a_self_exists_ties_the_same_person(reporter: psycopg.Connection[Any],
                                            truth: psycopg.Connection[Any]) -> None:
    """EXISTS on adult itself, tied by the unit, reads the same person's row: PostgreSQL's answer (35 people
    over 88), also when the derived table's alias is the inner table's (flattening must not untie it)."""
    for sql in ("SELECT count(*) FROM public.adult a WHERE EXISTS (SELECT 1 FROM public.adult WHERE adult.id = a.id "
                "AND adult.age > 88)",
                "SELECT count(*) FROM (SELECT * FROM public.visits WHERE EXISTS (SELECT 1 FROM public.visits w "
                "WHERE w.person_id = visits.person_id AND w.amount > 499)) w",
                "SELECT count(*) FROM public.adult \"A\" WHERE EXISTS (SELECT 1 FROM public.visits a WHERE "
                "a.person_id = \"A\".id AND a.amount > 400)"):
        assert answer(reporter, sql) == answer(truth, sql)


UNTIED = [
    # the condition reads the outer person, not the inner one
    ("EXISTS (SELECT 1 FROM public.adult b WHERE b.id = adult.id AND adult.age > 88)",
     "adult.age in a semi-join subquery must be a column of its table b"),
    ("EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = adult.id AND age > 30)",
     "age in a semi-join subquery must be a column of its table v"),
    ("EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = adult.id AND v.channel = adult.workclass)",
     "adult.workclass in a semi-join subquery must be a column of its table v"),
    # the inner table's alias is the outer table's name, or equals it once case-folded
    ("EXISTS (SELECT 1 FROM public.visits adult WHERE adult.person_id = adult.id)",
     "must tie adult.person_id to the outer query's privacy unit"),
    ("EXISTS (SELECT 1 FROM public.visits \"adult\" WHERE \"adult\".person_id = ADULT.id)",
     "must tie adult.person_id to the outer query's privacy unit"),
    # an unqualified outer column, and the tie written twice or by another column
    ("EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = id AND v.amount > 400)",
     "must tie v.person_id to the outer query's privacy unit"),
    ("EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = adult.id AND v.person_id = adult.id)",
     "must tie v.person_id to the outer query's privacy unit"),
    ("EXISTS (SELECT 1 FROM public.visits v WHERE adult.id = v.person_id AND v.visit_id = adult.id)",
     "adult.id in a semi-join subquery must be a column of its table v"),
    # IN of something else than the two units
    ("(adult.id, adult.age) IN (SELECT person_id, 30 FROM public.visits)", "must test the outer query's privacy unit"),
    ("adult.id::text IN (SELECT person_id::text FROM public.visits)", "must test the outer query's privacy unit"),
    ("adult.id IN (SELECT v.person_id + 0 FROM public.visits v)", "must select the privacy unit column person_id"),
    ("adult.id IN (SELECT adult.id FROM public.visits v)", "must select the privacy unit column person_id"),
    ("adult.id IN (SELECT person_id FROM public.visits WHERE amount > 499 LIMIT 1)", "LIMIT is not allowed"),
    # forms outside the semi-join
    ("EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = adult.id LIMIT 1 OFFSET 0)", "OFFSET is not allowed"),
    ("EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = adult.id FOR UPDATE)", "LOCKS is not allowed"),
    ("EXISTS (SELECT 1 FROM public.visits v TABLESAMPLE SYSTEM (50) WHERE v.person_id = adult.id)",
     "reads one table"),
    ("EXISTS (SELECT 1 FROM ONLY public.visits v WHERE v.person_id = adult.id)", "reads one table"),
    ("EXISTS (SELECT 1 WHERE adult.age > 88)", "reads one table"),
    ("EXISTS (SELECT v.amount FROM public.visits v WHERE v.person_id = adult.id)", "holds constants only"),
    ("EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = adult.id AND random() < 0.5)", "function random()"),
    # ORDER BY in EXISTS: its expressions are checked as the conditions are
    ("EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = adult.id ORDER BY adult.age)",
     "adult.age in a semi-join subquery must be a column of its table v"),
    ("EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = adult.id ORDER BY count(*))",
     "aggregate count() is not allowed in ORDER BY"),
    ("EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = adult.id ORDER BY row_number() OVER ())",
     "window functions"),
    ("EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = adult.id ORDER BY random())", "function random()"),
    ("EXISTS (SELECT 1 FROM public.adult x WHERE x.id = adult.id AND x.age > 80) OR adult.age > 85",
     "subqueries are not allowed in a query over protected tables"),
]


@pytest.mark.parametrize(("condition", "message"), UNTIED)
def test_a_semi_join_not_tied_to_the_same_person_is_refused(reporter: psycopg.Connection[Any], condition: str,
                                                            message: str) -> None:
    refused(reporter, f"SELECT count(*) FROM public.adult WHERE {condition}", "0A000", message)


@pytest.mark.parametrize("sql", [
    "SELECT count(*) FROM (SELECT visit_id AS person_id, person_id AS visit_id FROM public.visits) s WHERE EXISTS "
    "(SELECT 1 FROM public.adult a WHERE a.id = s.person_id AND a.age > 88)",
    "SELECT count(*) FROM (SELECT age AS id, id AS age FROM public.adult) s WHERE EXISTS (SELECT 1 FROM "
    "public.visits v WHERE v.person_id = s.id AND v.amount > 499)",
    "WITH s AS (SELECT age AS id, id AS age FROM public.adult) SELECT count(*) FROM s WHERE EXISTS (SELECT 1 FROM "
    "public.visits v WHERE v.person_id = s.id AND v.amount > 499)",
    # renamed by the alias's column list, computed from the unit, or the unit of the other side of a join
    "SELECT count(*) FROM (SELECT age, id FROM public.adult) s(id, age) WHERE EXISTS (SELECT 1 FROM public.visits v "
    "WHERE v.person_id = s.id AND v.amount > 499)",
    "SELECT count(*) FROM (SELECT a.id + 1 AS id FROM public.adult a) s WHERE EXISTS (SELECT 1 FROM public.visits v "
    "WHERE v.person_id = s.id AND v.amount > 499)",
    "SELECT count(*) FROM (SELECT v.visit_id AS id FROM public.adult a JOIN public.visits v ON v.person_id = a.id) s "
    "WHERE EXISTS (SELECT 1 FROM public.adult b WHERE b.id = s.id AND b.age > 88)",
    # the subquery's own table is named as the derived table: s.id is the inner row's, and ties nothing
    "SELECT count(*) FROM (SELECT * FROM public.adult a) s WHERE EXISTS (SELECT 1 FROM public.adult s WHERE s.id = "
    "s.id AND s.age > 88)",
])
def test_a_semi_join_on_a_renamed_column_is_refused(reporter: psycopg.Connection[Any], sql: str) -> None:
    """A derived table names another column as the unit (person_id is a visit's id, id a person's age, or the
    unit plus one): the tie would join one person's row to another person's. Only a column passed through under
    its own name is the unit (tests/test_bi_corpus_round11.py); anything else stays untied, refused."""
    refused(reporter, sql, "0A000", "to the outer query's privacy unit with one equality")


@pytest.mark.parametrize("derived", ["SELECT age AS id, id AS age FROM public.adult",
                                     "SELECT a.id + 1 AS id FROM public.adult a"])
def test_in_on_a_renamed_column_is_refused(reporter: psycopg.Connection[Any], derived: str) -> None:
    refused(reporter, f"SELECT count(*) FROM ({derived}) s WHERE s.id IN (SELECT v.person_id FROM public.visits v "
            "WHERE v.amount > 499)", "0A000", "must test the outer query's privacy unit column")


def test_in_with_limit_is_refused(reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    """IN (SELECT ... LIMIT n) keeps the people of the first n rows, which other people's rows decide: the two
    limits below pick sets of people that differ (by the person of the eleventh row), whose difference two
    answers would give away. Refused, with a hint to drop the LIMIT."""
    people = [truth.execute("SELECT array_agg(DISTINCT a.id) FROM public.adult a WHERE a.id IN (SELECT person_id "
                            f"FROM public.visits WHERE amount > 400 LIMIT {n})").fetchone()[0] for n in (10, 11)]
    assert set(people[0]) < set(people[1])
    for n in (10, 11):
        with pytest.raises(psycopg.Error) as caught:
            reporter.execute("SELECT sum(a.age) FROM public.adult a WHERE a.id IN (SELECT person_id FROM "
                             f"public.visits WHERE amount > 400 LIMIT {n})").fetchall()
        assert caught.value.sqlstate == "0A000"
        assert "LIMIT is not allowed in IN (SELECT ...)" in caught.value.diag.message_primary
        assert "Drop the LIMIT" in (caught.value.diag.message_hint or "")


def test_exists_with_order_by_is_postgresqls_answer(reporter: psycopg.Connection[Any],
                                                    truth: psycopg.Connection[Any]) -> None:
    """ORDER BY inside EXISTS (with LIMIT 1 or without) changes nothing: PostgreSQL's answer (formerly refused)."""
    sql = ("SELECT count(*) FROM public.adult WHERE EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = "
           "adult.id AND v.amount > 300 ORDER BY v.amount LIMIT 1)")
    assert answer(reporter, sql) == answer(truth, sql)


def test_an_order_by_that_could_fail_in_exists_is_refused(reporter: psycopg.Connection[Any]) -> None:
    """An ORDER BY expression inside EXISTS passes the no-error proof of a WHERE condition, whether or not
    PostgreSQL's plan evaluates it."""
    refused(reporter, "SELECT count(*) FROM public.adult a WHERE EXISTS (SELECT 1 FROM public.visits v WHERE "
            "v.person_id = a.id ORDER BY 1 / (v.amount - 5.00))", "0A000", "division by (v.amount - 5.00)")


@pytest.mark.parametrize(("sql", "message"), [
    # a WITH query named as the inner table would be read in its place
    ("WITH visits AS (SELECT id AS person_id, age AS amount FROM public.adult) SELECT count(*) FROM public.adult a "
     "WHERE EXISTS (SELECT 1 FROM visits v WHERE v.person_id = a.id AND v.amount > 88)", "may not nest another query"),
    # a semi-join over released rows, and one in a join's ON
    ("SELECT s.age FROM (SELECT a.age, count(*) AS n FROM public.adult a GROUP BY a.age) s WHERE EXISTS (SELECT 1 "
     "FROM public.visits v WHERE v.person_id = s.age)", "subqueries are not allowed in an outer query"),
    ("SELECT count(*) FROM public.adult a JOIN public.visits v ON v.person_id = a.id AND EXISTS (SELECT 1 FROM "
     "public.visits w WHERE w.person_id = a.id)", "subqueries are not allowed in a query over protected tables"),
    # a semi-join in a branch of a set operation of rows
    ("SELECT count(*) FROM (SELECT a.id FROM public.adult a WHERE EXISTS (SELECT 1 FROM public.visits v WHERE "
     "v.person_id = a.id AND v.amount > 499) UNION ALL SELECT a.id FROM public.adult a WHERE a.age > 88) s",
     "UNION, INTERSECT, EXCEPT and VALUES are not supported as derived tables"),
])
def test_semi_joins_in_other_places_are_refused(reporter: psycopg.Connection[Any], sql: str, message: str) -> None:
    refused(reporter, sql, "0A000", message)
