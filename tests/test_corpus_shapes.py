"""Issue 11: the last aggregate shapes of the BI corpus, in both modes.

* Metabase's pivot groups by a constant (``GROUP BY sex, ABS(0)``): a key that reads no column and no ``$n``
  does not partition the rows, so it is proved not to raise and left out of the grouping (only constants: a
  whole-table total, query-set-size control included); the select item ``ABS(0)`` is computed on released rows.
* Power BI's ``count(distinct("rows"."id"))``: parentheses around the column are the column.
* Power BI's group-by step ``SELECT "_"."relationship" ... GROUP BY "relationship"``: the output alias and the
  input column of that name are the same column, so the name is not ambiguous.
* Tableau's top-N filter: a series limit joined ``ON (t.k IS NOT DISTINCT FROM t0.k)``, NULL-safe (a NULL key
  the top-N query released matches the NULL rows; the suppressed-rest row is no key).

Decide-level with tests/test_rewrite.py's policy; through the real gated proxy as `reporter` (suppress, k = 10,
rest row on) and a fresh dp role (test_dp_proxy's `analyst`), compared with the plain equivalents.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import psycopg
import pytest
from conftest import Endpoint
from test_dp_proxy import analyst, budget_left  # noqa: F401 - fixtures
from test_rewrite import POLICY, SUPPRESS
from test_shapes import dp_session

from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.plan.final_sql import check_final_sql
from anonproxy.plan.outer import Series
from anonproxy.plan.refusals import Reject
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy, Rewrite

DP = dataclasses.replace(SUPPRESS, mode="dp")
PARAMS = DPParams(epsilon=1, delta=1e-6)

PIVOT = ('SELECT "public"."adult"."sex" AS "sex", "public"."adult"."race" AS "race", ABS(0) AS "pivot-grouping", '
         'COUNT(*) AS "count" FROM "public"."adult" GROUP BY "public"."adult"."sex", "public"."adult"."race", ABS(0) '
         'ORDER BY "public"."adult"."sex" ASC, "public"."adult"."race" ASC, ABS(0) ASC')
GRAND_TOTAL = ('SELECT ABS(3) AS "pivot-grouping", COUNT(*) AS "count" FROM "public"."adult" GROUP BY ABS(3) '
               'ORDER BY ABS(3) ASC')
DISTINCT_COUNT = ('select "rows"."income" as "income", count(distinct("rows"."id")) as "a0" from (select '
                  '"_"."income", "_"."id" from "public"."adult" "_") "rows" group by "income" limit 1000001')
GROUP_STEP = ('select "_"."relationship", "_"."Count" from (select "_"."relationship", count(1) as "Count" '
              'from "public"."adult" "_" group by "relationship") "_"')
TOP_N = ('SELECT "adult"."native_country" AS "native_country", SUM(1) AS "sum:Number of Records:ok" '
         'FROM "public"."adult" "adult" INNER JOIN (SELECT "adult"."native_country" AS "native_country", '
         'SUM(1) AS "$__alias__0" FROM "public"."adult" "adult" GROUP BY 1 ORDER BY 2 DESC LIMIT 5) "t0" '
         'ON ("adult"."native_country" IS NOT DISTINCT FROM "t0"."native_country") GROUP BY 1')
# The same top-N over a key that is NULL for most rows (every man): the NULL group is among the top 2
NULL_TOP = ('SELECT nullif("adult"."sex", \'Male\') AS "s", SUM(1) AS "n" FROM "public"."adult" "adult" '
            'INNER JOIN (SELECT nullif("adult"."sex", \'Male\') AS "s", SUM(1) AS "$__alias__0" '
            'FROM "public"."adult" "adult" GROUP BY 1 ORDER BY 2 DESC LIMIT 2) "t0" '
            'ON (nullif("adult"."sex", \'Male\') IS NOT DISTINCT FROM "t0"."s") GROUP BY 1')
# Metabase's question on a saved question: the saved one nested as "source", its aggregates named count, sum, avg
# (PostgreSQL reads "source"."count" as the column, not as count("source"): the derived table has one)
SAVED_QUESTION = ('SELECT "source"."education" AS "education", "source"."count" AS "count", "source"."sum" AS "sum" '
                  'FROM (SELECT "public"."adult"."education" AS "education", COUNT(*) AS "count", '
                  'SUM("public"."adult"."hours_per_week") AS "sum" FROM "public"."adult" '
                  'GROUP BY "public"."adult"."education") AS "source" WHERE "source"."count" > 100 '
                  'ORDER BY "source"."count" DESC LIMIT 1048575')
ANSWERED = [PIVOT, GRAND_TOTAL, DISTINCT_COUNT, GROUP_STEP, TOP_N, NULL_TOP,
            "select count(*) from adult group by 1 + 1", "select count(*) from adult group by 'x'::text",
            "select sex, count(*) from adult group by sex, abs(0), 2 * 3"]


def _plan(sql: str) -> DPPlan:
    plan = plan_dp(sql, DP, POLICY, PARAMS)
    assert isinstance(plan, DPPlan), (sql, plan)
    return plan


def _refused(sql: str, role: Any) -> Reject:
    decision = decide(sql, role, POLICY)
    if isinstance(decision, Noisy):
        decision = plan_dp(sql, role, POLICY, PARAMS)
    assert isinstance(decision, Reject), (sql, decision)
    assert decision.hint and decision.sqlstate in ("0A000", "42501"), decision
    return decision


# --- decide level --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sql", ANSWERED)
def test_the_corpus_shapes_are_answered_in_both_modes(sql: str) -> None:
    rewrite = decide(sql, SUPPRESS, POLICY)
    assert isinstance(rewrite, Rewrite), rewrite
    check_final_sql(rewrite.sql, POLICY)
    assert isinstance(decide(sql, DP, POLICY), Noisy)
    _plan(sql)


def test_a_constant_grouping_key_does_not_partition() -> None:
    """Left out of the grouping: the same question as without it (dp: no partition selection, no group cap)."""
    for constant, plain in [
        (GRAND_TOTAL, 'SELECT ABS(3) AS "pivot-grouping", COUNT(*) AS "count" FROM "public"."adult"'),
        ("select sex, abs(0) as p, count(*) from adult group by sex, abs(0)",
         "select sex, abs(0) as p, count(*) from adult group by sex"),
    ]:
        mine, theirs = _plan(constant), _plan(plain)
        assert (mine.epsilon, mine.delta, mine.keys, mine.selection, len(mine.statistics)) == (
            theirs.epsilon, theirs.delta, theirs.keys, theirs.selection, len(theirs.statistics))
    assert _plan(GRAND_TOTAL).keys == 0 and _plan(GRAND_TOTAL).selection is None, "a whole-table total"


@pytest.mark.parametrize(("sql", "words"), [
    ("select count(*) from adult group by 'x'", "column expressions"),  # PostgreSQL: non-integer constant
    ("select count(*) from adult group by 1 / 0", "division"),
    ("select count(*) from adult group by abs($1)", "parameter"),
    ("select count(*) from adult group by random()", "function"),
    ("select count(*) from adult group by (select 1)", "subquer"),
    # a constant subquery of a number is not inlined there: GROUP BY (2) would group by the second select item
    ("select sex, age, count(*) from adult group by sex, (select 2)", "subquer"),
    ("select sex, count(*) from adult group by sex order by (select -1)", "subquer"),
    ("select sex, count(*) from adult group by abs(0)", "row-level"),  # no partition: sex is not grouped
    ("select count(*) from adult group by 0", "position 0"),  # an ordinal, not a constant
])
def test_constant_keys_that_fail_or_are_no_constants_are_refused(sql: str, words: str) -> None:
    for role in (SUPPRESS, DP):
        assert words in _refused(sql, role).message.lower()


def test_parenthesised_distinct_column_is_the_column() -> None:
    assert _plan(DISTINCT_COUNT).epsilon == _plan('select income, count(distinct id) as "a0" from adult '
                                                  'group by income limit 1000001').epsilon
    for role in (SUPPRESS, DP):  # an expression in parentheses stays an expression
        assert "takes a column" in _refused("select count(distinct((age + id))) from adult", role).message \
            or role is DP
    # dp counts distinct values of any column: (age) is age, one statistic of sensitivity c per group
    assert _plan("select count(distinct((age))) from adult").epsilon == _plan(
        "select count(distinct age) from adult").epsilon


@pytest.mark.parametrize("sql", [
    "select a.race as relationship, count(*) from adult a group by relationship",  # the alias is another column
    "select upper(a.race) as race, count(*) from adult a group by race",
    "select v.cost as age, count(*) from adult a join visits v on v.person_id = a.id group by age",
    'select a.relationship as "relationship", count(*) from adult a join visits v on v.person_id = a.id '
    "group by relationship",  # two tables: the bare name might be a column of either
])
def test_group_by_an_alias_of_another_column_stays_ambiguous(sql: str) -> None:
    for role in (SUPPRESS, DP):
        assert "ambiguous" in _refused(sql, role).message


def test_series_keys_are_null_safe_as_written() -> None:
    plan = _plan(NULL_TOP)
    series = plan.nested
    assert isinstance(series, Series) and series.null_safe == (True,)
    assert series.restriction([("Female",), (None,)]).sql(dialect="postgres") == (
        """(NULLIF("adult"."sex", 'Male')) IN ('Female') OR (NULLIF("adult"."sex", 'Male')) IS NULL""")
    assert series.restriction([(None,)]).sql(dialect="postgres") == """(NULLIF("adult"."sex", 'Male')) IS NULL"""
    plain = _plan(TOP_N.replace("IS NOT DISTINCT FROM", "="))
    assert isinstance(plain.nested, Series) and plain.nested.null_safe == (False,)
    assert plain.nested.restriction([(None,)]).sql(dialect="postgres") == "FALSE", "= never matches NULL"
    sql = decide(NULL_TOP, SUPPRESS, POLICY)
    assert isinstance(sql, Rewrite) and "IS NOT DISTINCT FROM anonproxy_top.anonproxy_c1" in sql.sql


@pytest.mark.parametrize("on", [
    # the ON key runs on the outer query's rows: an error there would say something about one person
    "CASE WHEN adult.id = 17 AND adult.income = '>50K' THEN adult.education::int ELSE 1 END IS NOT DISTINCT FROM t0.k",
    "CASE WHEN adult.id = 17 AND adult.income = '>50K' THEN adult.education::int ELSE 1 END = t0.k",
    "1 / (adult.age - 37) IS NOT DISTINCT FROM t0.k",
    "adult.age IS DISTINCT FROM t0.k",
    "adult.age IS NOT DISTINCT FROM t0.k OR adult.age = 3",
])
def test_series_on_keys_are_checked_like_where_conditions(on: str) -> None:
    sql = ("SELECT adult.education, count(*) FROM adult JOIN (SELECT age AS k, count(*) AS m FROM adult "
           f"GROUP BY age ORDER BY m DESC LIMIT 5) t0 ON {on} GROUP BY adult.education")
    suppress = decide(sql, SUPPRESS, POLICY)
    if isinstance(suppress, Rewrite):
        raise AssertionError(suppress.sql)
    _refused(sql, SUPPRESS)
    # dp: the keys are the second question's WHERE, asked once the top-N query released a key
    plan = plan_dp(sql, DP, POLICY, PARAMS)
    if isinstance(plan, DPPlan):
        assert isinstance(plan.nested, Series)
        second = plan.nested.question(plan.nested.restriction([("40",)])).sql(dialect="postgres")
        _refused(second, DP)
    else:
        _refused(sql, DP)


# --- through the proxy ---------------------------------------------------------------------------------------


@pytest.fixture
def reporter(gated_proxy: Endpoint, gated_database: str) -> Any:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        yield conn


def _names(cursor: psycopg.Cursor[Any]) -> list[str]:
    return [column.name for column in cursor.description or []]


def test_reporter_gets_the_plain_answers(reporter: psycopg.Connection[Any],
                                         truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    pairs = [
        (PIVOT, "select sex, race, 0, count(*) from adult group by sex, race order by sex, race"),
        (GRAND_TOTAL, "select 3, count(*) from adult"),
        (DISTINCT_COUNT, "select income, count(distinct id) from adult group by income"),
        (GROUP_STEP, "select relationship, count(*) from adult group by relationship"),
        (SAVED_QUESTION, "select education, count(*), sum(hours_per_week) from adult group by education "
                         "having count(*) > 100"),
    ]
    for sql, plain in pairs:
        got = reporter.execute(sql)
        assert _names(got) == _names(truth.execute(sql)), sql
        rows = got.fetchall()
        assert sorted(rows, key=repr) == sorted(reporter.execute(plain).fetchall(), key=repr), sql
        assert rows, sql
    # the total over everyone is answered (it is public: the sum of any GROUP BY's rows), as the plain total is
    notices: list[str] = []
    reporter.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    everyone = truth.execute("select count(*) from adult").fetchone()[0]
    assert reporter.execute(GRAND_TOTAL).fetchall() == [(3, everyone)]
    assert notices == []
    # query-set-size control withholds a total over nearly every row (all but one person), as it withholds the
    # plain total
    all_but_one = GRAND_TOTAL.replace('"public"."adult"', '"public"."adult" WHERE "public"."adult"."id" <> 17', 1)
    assert reporter.execute(all_but_one).fetchall() == []
    assert any("query-set-size" in notice for notice in notices), notices
    assert reporter.execute("select count(*) from adult where id <> 17").fetchall() == []
    assert reporter.execute(GRAND_TOTAL.replace('"public"."adult"', '"public"."adult" WHERE age > 40', 1)
                            .replace("GROUP BY", "GROUP BY", 1)).fetchall() == [
        (3, truth.execute("select count(*) from adult where age > 40").fetchone()[0])]


def test_reporter_top_n_is_null_safe(reporter: psycopg.Connection[Any],
                                     truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    chart = dict(reporter.execute("select native_country, sum(1) from adult group by 1").fetchall())
    released = sorted(((k, n) for k, n in chart.items() if k is not None), key=lambda r: -r[1])
    got = reporter.execute(TOP_N)
    assert _names(got) == _names(truth.execute(TOP_N))
    rows = got.fetchall()
    assert {k for k, _ in rows} == {k for k, _ in released[:5]}, "the five top released countries, no rest row"
    assert all(chart[k] == n for k, n in rows)
    # a released NULL key matches the NULL rows; with = it would not
    both = dict(reporter.execute(NULL_TOP).fetchall())
    exact = dict(truth.execute("select nullif(sex, 'Male'), count(*) from adult group by 1").fetchall())
    assert both == exact and None in both
    assert dict(reporter.execute(NULL_TOP.replace("IS NOT DISTINCT FROM", "=")).fetchall()) == {
        "Female": exact["Female"]}


def test_reporter_constant_key_gets_no_other_answer_than_without_it(reporter: psycopg.Connection[Any]) -> None:
    """A filter on one person: withheld exactly like the plain total (query-set-size control)."""
    for where in ("id = 17", "id < 5", "age > 30"):
        grouped = reporter.execute(f"select count(*) from adult where {where} group by abs(0)").fetchall()
        assert grouped == reporter.execute(f"select count(*) from adult where {where}").fetchall(), where
    assert reporter.execute("select count(*) from adult where id = 17 group by abs(0)").fetchall() in ([], [(None,)])


def test_constant_key_errors_do_not_depend_on_the_rows(reporter: psycopg.Connection[Any]) -> None:
    """A constant key that would overflow is left out of the grouping, so it never runs: no error for any filter
    (PostgreSQL would raise it when planning the statement, for every filter alike)."""
    for where in ("id = 17 and income = '>50K'", "false", "age > 30"):
        got = reporter.execute(f"select sex, count(*) from adult where {where} group by sex, 2147483647 + 1")
        assert got.fetchall() == reporter.execute(f"select sex, count(*) from adult where {where} "
                                                  "group by sex").fetchall(), where


def test_dp_role_answers_the_corpus_shapes(gated_proxy: Endpoint, gated_database: str, analyst: str,  # noqa: F811
                                           truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    with dp_session(gated_proxy, gated_database, analyst) as conn:
        both = dict(conn.execute(NULL_TOP).fetchall())
        exact_both = dict(truth.execute("select nullif(sex, 'Male'), count(*) from adult group by 1").fetchall())
        assert set(both) == {None, "Female"} and all(abs(both[k] - exact_both[k]) < 100 for k in both), both
        assert "epsilon 1 of 2 left" in budget_left(conn), "the top-N pays for both of its questions"
        total = conn.execute(GRAND_TOTAL)
        assert _names(total) == ["pivot-grouping", "count"]
        ((label, count),) = total.fetchall()
        exact = truth.execute("select count(*) from adult").fetchone()[0]
        assert label == 3 and abs(count - exact) < 100
        counts = dict(conn.execute(DISTINCT_COUNT).fetchall())
        assert set(counts) <= {"<=50K", ">50K"} and counts
        assert "epsilon 0 of 2 left" in budget_left(conn)


def test_dp_a_question_on_a_saved_question_reads_its_answer(gated_proxy: Endpoint, gated_database: str,
                                                             analyst: str) -> None:  # noqa: F811
    """Metabase's saved question, then a question on it (nested as "source", filtered and sorted on its count):
    the second is post-processing of the first's released rows, the same numbers at no further cost."""
    saved = ('SELECT "public"."adult"."education" AS "education", COUNT(*) AS "count", '
             'SUM("public"."adult"."hours_per_week") AS "sum" FROM "public"."adult" '
             'GROUP BY "public"."adult"."education"')
    with dp_session(gated_proxy, gated_database, analyst) as conn:
        first = {row[0]: row[1:] for row in conn.execute(saved).fetchall()}
        assert "epsilon 1.5 of 2 left" in budget_left(conn)
        cursor = conn.execute(SAVED_QUESTION)
        assert _names(cursor) == ["education", "count", "sum"]
        rows = cursor.fetchall()
        assert rows == sorted(rows, key=lambda row: -row[1]) and rows
        assert {row[0]: row[1:] for row in rows} == {k: v for k, v in first.items() if v[0] > 100}
        assert "epsilon 1.5 of 2 left" in budget_left(conn), "one measurement"
