"""Round 14 of the BI corpus: fan-out keys joined back to their table (Lightdash's fan-out CTEs, Cube's multiplied
measures), semi-joins on a reference table, and Cube's filters and measure queries, written over the demo tables
in the shape each generator gives.

Through the real gated proxy on the demo data: as ``reporter`` (suppress, k = 10) each answer is PostgreSQL's own
answer to the same statement; as a dp role each is answered with PostgreSQL's column names.

* Fan-out keys: ``SELECT DISTINCT <keys>, <table>.<unit> FROM <table> [LEFT] JOIN <linked> ...`` joined back to
  the table on its unit. The demo's ``public.adult`` has ``id`` as its primary key, which the policy reads from
  the catalog: the keys are then the table's rows, and the statement is answered as the aggregate over the table
  (``anonproxy/plan/fanout.py``). Everything stays refused once the catalog no longer proves ``id`` unique (keys
  of the joined table, a dimension of ``visits``, are answered since round 16).
* ``<column> [NOT] IN (SELECT <column> FROM <reference table> ...)``: a list of public values, answered in both
  modes exactly as PostgreSQL answers it (``anonproxy/plan/semi_joins.py``). The reference table is made here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, corpus_roles, dp_answers, suppress_answers_as_postgresql, wait_for_current_policy

# read: aggregateSubQuery, keysQuery/keysSelect (SELECT DISTINCT of the dimensions and the primary key, LEFT JOINed
# back to the cube on it as "keys"), joinFullKeyQueryAggregate (q_0 INNER JOIN q_1 on the dimensions or IS NULL,
# a comma join without dimensions), simpleQuery, groupByClause (GROUP BY 1, 2), orderBy (by position),
# groupByDimensionLimit (LIMIT 10000), timeRangeFilter/timeNotInRangeFilter/beforeDateFilter
CUBE = "cube-js/cube packages/cubejs-schema-compiler/src/adapter/BaseQuery.js (read)"
# read: equalsWhere/inWhere, notEqualsWhere (<> ... OR IS NULL), likeIgnoreCase (ILIKE '%' || ... || '%'),
# setWhere/notSetWhere, gtWhere
CUBE_FILTER = "cube-js/cube packages/cubejs-schema-compiler/src/adapter/BaseFilter.ts (read)"
# read in round 13: cte_keys_<table> joined back to the table in cte_metrics_<table>
LIGHTDASH = "lightdash/lightdash packages/backend/src/utils/QueryBuilder/MetricQueryBuilder.ts (read in round 13)"
# written from memory: a filter on a related lookup model, field__in=<queryset>, as IN (SELECT U0.<field> ...)
DJANGO = "django/django django/db/models/sql/query.py (from memory)"

_JOIN = ("FROM public.adult AS \"adult\"\nLEFT JOIN public.visits AS \"visits\" ON \"adult\".id = "
         "\"visits\".person_id")


def _keys_aggregate(dimensions: list[tuple[str, str]], measures: str, where: str = "") -> str:
    """Cube's aggregateSubQuery: the multiplied measures of adult over the DISTINCT keys (the dimensions, as
    (expression, alias), and adult's primary key) of the join, LEFT JOINed back to adult on its key."""
    keys = ", ".join([*(f"{expression} \"{alias}\"" for expression, alias in dimensions), "\"adult\".id \"adult__id\""])
    select = ", ".join([*(f"\"keys\".\"{alias}\"" for _, alias in dimensions), measures])
    group = " GROUP BY " + ", ".join(str(n + 1) for n in range(len(dimensions))) if dimensions else ""
    return (f"SELECT {select} FROM (SELECT DISTINCT {keys} {_JOIN} {where}) AS \"keys\"\nLEFT JOIN public.adult "
            "AS \"adult\" ON \"keys\".\"adult__id\" = \"adult\".id" + group)


def _lightdash(dimension: str, name: str, where: str) -> str:
    """Lightdash's fan-out protection with a dimension of adult: the keys CTE, the metrics CTE joined back to adult,
    the visits' own metric over the join, the two joined on the dimension (or both NULL)."""
    return (f"WITH cte_keys_adult AS (SELECT DISTINCT {dimension} AS \"{name}\", \"adult\".id AS \"pk_id\" {_JOIN} "
            f"{where}), cte_metrics_adult AS (SELECT cte_keys_adult.\"{name}\", AVG(\"adult\".hours_per_week) AS "
            "\"adult_average_hours\" FROM cte_keys_adult LEFT JOIN \"public\".\"adult\" AS \"adult\" ON "
            "cte_keys_adult.\"pk_id\" = \"adult\".id GROUP BY 1), cte_unaffected AS (SELECT "
            f"{dimension} AS \"{name}\", SUM(\"visits\".amount) AS \"visits_total_amount\" {_JOIN} {where} GROUP BY 1) "
            "SELECT cte_unaffected.*, "
            "cte_metrics_adult.\"adult_average_hours\" AS \"adult_average_hours\" FROM cte_unaffected INNER JOIN "
            f"cte_metrics_adult ON ( cte_unaffected.\"{name}\" = cte_metrics_adult.\"{name}\" OR ( "
            f"cte_unaffected.\"{name}\" IS NULL AND cte_metrics_adult.\"{name}\" IS NULL ) ) ORDER BY "
            "\"visits_total_amount\" DESC LIMIT 500")


@dataclass(frozen=True)
class Shape:
    source: str  # the repository and file whose shape the statement follows, and whether it was read
    what: str
    sql: str
    complete: bool = True  # every group holds at least k people: suppression withholds nothing


_SEX = [("\"adult\".sex", "adult__sex")]
_WEB = "WHERE (\"visits\".channel = 'web')"
_H1 = ("WHERE (\"visits\".visited_at >= '2025-01-01T00:00:00.000'::timestamptz AND \"visits\".visited_at <= "
       "'2025-06-30T23:59:59.999'::timestamptz)")
_MAIN = ("SELECT \"adult\".sex \"adult__sex\", count(\"visits\".visit_id) \"visits__count\" " + _JOIN + " "
         + _WEB + " GROUP BY 1")

FANOUT = [
    Shape(CUBE, "multiplied measure alone: the keys aggregate by a dimension of the cube, a filter on the join",
          _keys_aggregate(_SEX, "sum(\"adult\".age) \"adult__total_age\"", _WEB)
          + " ORDER BY 2 DESC LIMIT 10000"),
    Shape(CUBE, "multiplied and regular measures: q_0 INNER JOIN q_1 on the dimension or both NULL",
          "SELECT q_0.\"adult__sex\", \"visits__count\", \"adult__total_age\" FROM (" + _MAIN + ") as q_0 INNER JOIN ("
          + _keys_aggregate(_SEX, "sum(\"adult\".age) \"adult__total_age\"", _WEB)
          + ") as q_1 ON (q_0.\"adult__sex\" = q_1.\"adult__sex\" OR (q_0.\"adult__sex\" IS NULL AND "
          "q_1.\"adult__sex\" IS NULL)) ORDER BY 3 DESC LIMIT 10000"),
    Shape(CUBE, "multiplied and regular measures without dimensions: a comma join of two one-row answers",
          "SELECT \"visits__count\", \"adult__average_age\" FROM (SELECT count(\"visits\".visit_id) \"visits__count\" "
          + _JOIN + " " + _WEB + ") as q_0 , (" + _keys_aggregate([], "avg(\"adult\".age) \"adult__average_age\"",
                                                                    _WEB) + ") as q_1 LIMIT 10000"),
    Shape(CUBE, "multiplied measure over an inDateRange filter on the joined cube, two dimensions of the cube",
          _keys_aggregate([*_SEX, ("\"adult\".income", "adult__income")],
                          "avg(\"adult\".hours_per_week) \"adult__average_hours\"", _H1)
          + " ORDER BY 3 DESC LIMIT 10000"),
    Shape(CUBE, "multiplied measure, a filter on the cube itself: the keys of every adult over 40",
          _keys_aggregate(_SEX, "count(\"adult\".id) \"adult__count\"",
                          "WHERE (\"adult\".age > 40)") + " ORDER BY 2 DESC LIMIT 10000"),
    Shape(LIGHTDASH, "fan-out CTEs by a dimension of the repeated table (adult's sex), a filter on visits",
          _lightdash("\"adult\".sex", "adult_sex", "WHERE ((\"visits\".channel) IN ('web', 'app'))")),
    # round 13's third statement, refused then
    Shape(LIGHTDASH, "fan-out CTEs without a dimension: the metrics CTE CROSS JOINed to the unaffected one",
          "WITH cte_keys_adult AS (SELECT DISTINCT \"adult\".id AS \"pk_id\" " + _JOIN + " WHERE "
          "((\"visits\".channel) = ('web'))), cte_metrics_adult AS (SELECT SUM(\"adult\".age) AS "
          "\"adult_total_age\" FROM cte_keys_adult LEFT JOIN \"public\".\"adult\" AS \"adult\" ON "
          "cte_keys_adult.\"pk_id\" = \"adult\".id), cte_unaffected AS (SELECT COUNT(\"visits\".visit_id) AS "
          "\"visits_count\" " + _JOIN + " WHERE ((\"visits\".channel) = ('web'))) SELECT "
          "cte_unaffected.*, cte_metrics_adult.\"adult_total_age\" AS \"adult_total_age\" FROM cte_unaffected CROSS "
          "JOIN cte_metrics_adult LIMIT 500"),
]

CUBE_SHAPES = [
    Shape(CUBE, "simple query: aliases without AS, GROUP BY 1, ORDER BY 2 DESC, LIMIT 10000",
          "SELECT \"visits\".channel \"visits__channel\", count(\"visits\".visit_id) \"visits__count\" FROM "
          "public.visits AS \"visits\"  GROUP BY 1 ORDER BY 2 DESC LIMIT 10000"),
    Shape(CUBE_FILTER, "equals with several values: IN",
          "SELECT \"adult\".sex \"adult__sex\", count(\"adult\".id) \"adult__count\" FROM public.adult AS \"adult\"  "
          "WHERE (\"adult\".race IN ('White', 'Black')) GROUP BY 1 ORDER BY 2 DESC LIMIT 10000"),
    Shape(CUBE_FILTER, "notEquals: <> or IS NULL",
          "SELECT \"visits\".channel \"visits__channel\", sum(\"visits\".amount) \"visits__amount\" FROM public.visits "
          "AS \"visits\"  WHERE (\"visits\".channel <> 'web' OR \"visits\".channel IS NULL) GROUP BY 1 ORDER BY 2 DESC "
          "LIMIT 10000"),
    Shape(CUBE_FILTER, "contains: ILIKE '%' || value || '%'",
          "SELECT \"adult\".sex \"adult__sex\", count(\"adult\".id) \"adult__count\" FROM public.adult AS \"adult\"  "
          "WHERE (\"adult\".education ILIKE '%' || 'grad' || '%') GROUP BY 1 ORDER BY 2 DESC LIMIT 10000"),
    Shape(CUBE_FILTER, "set: IS NOT NULL, gt on a number",
          "SELECT \"adult\".income \"adult__income\", avg(\"adult\".age) \"adult__average_age\" FROM public.adult AS "
          "\"adult\"  WHERE (\"adult\".workclass IS NOT NULL) AND (\"adult\".hours_per_week > 20) GROUP BY 1 ORDER BY "
          "2 DESC LIMIT 10000"),
    Shape(CUBE, "notInDateRange: < from OR > to",
          "SELECT \"visits\".channel \"visits__channel\", count(\"visits\".visit_id) \"visits__count\" FROM "
          "public.visits AS \"visits\"  WHERE (\"visits\".visited_at < '2025-03-01T00:00:00.000'::timestamptz OR "
          "\"visits\".visited_at > '2025-03-31T23:59:59.999'::timestamptz) GROUP BY 1 ORDER BY 2 DESC LIMIT 10000"),
    Shape(CUBE, "beforeDate on the time dimension, measure filter in HAVING",
          "SELECT \"visits\".channel \"visits__channel\", count(\"visits\".visit_id) \"visits__count\" FROM "
          "public.visits AS \"visits\"  WHERE (\"visits\".visited_at < '2026-01-01T00:00:00.000'::timestamptz) GROUP "
          "BY 1 HAVING (count(\"visits\".visit_id) > 100) ORDER BY 2 DESC LIMIT 10000"),
    Shape(CUBE, "countDistinct of the joined cube's key by a dimension of the joined cube",
          "SELECT \"visits\".channel \"visits__channel\", count(distinct \"adult\".id) \"adult__count\" " + _JOIN
          + "  GROUP BY 1 ORDER BY 2 DESC LIMIT 10000"),
]


# The reference table of this module: channels and what kind each is (public facts about the shop, no one's data).
# replaced_by is NULL for every channel but one: a NOT IN over it is NULL for every row, as PostgreSQL answers.
REFERENCE = "public.channel_kinds"

REFERENCE_SHAPES = [
    Shape(DJANGO, "a filter on a lookup model: IN (SELECT U0.<field> FROM <reference> U0 WHERE ...)",
          "SELECT \"visits\".\"channel\", COUNT(\"visits\".\"visit_id\") AS \"n\" FROM \"visits\" WHERE "
          "\"visits\".\"channel\" IN (SELECT U0.\"channel\" FROM \"channel_kinds\" U0 WHERE U0.\"kind\" = 'online') "
          "GROUP BY \"visits\".\"channel\""),
    Shape(DJANGO, "exclude() over a lookup model: NOT IN (SELECT ...) over a column without NULLs",
          "SELECT \"visits\".\"channel\", SUM(\"visits\".\"amount\") AS \"total\" FROM \"visits\" WHERE NOT "
          "(\"visits\".\"channel\" IN (SELECT U0.\"channel\" FROM \"channel_kinds\" U0 WHERE U0.\"kind\" = 'online')) "
          "GROUP BY \"visits\".\"channel\""),
    Shape(DJANGO, "the lookup beside a fan-out join: a dimension of adult, IN over the reference on visits",
          "SELECT \"adult\".\"sex\", COUNT(DISTINCT \"adult\".\"id\") AS \"people\" FROM \"adult\" INNER JOIN "
          "\"visits\" ON \"visits\".\"person_id\" = \"adult\".\"id\" WHERE \"visits\".\"channel\" IN (SELECT DISTINCT "
          "\"channel_kinds\".\"channel\" FROM \"public\".\"channel_kinds\") GROUP BY \"adult\".\"sex\""),
]

reporter, analyst = corpus_roles("dp_round14")


@pytest.fixture(scope="module")
def reference(truth: psycopg.Connection[Any], gated_proxy: Endpoint, gated_database: str) -> Iterator[None]:
    """The module's reference table, declared; afterwards undeclared and dropped."""
    truth.execute(f"create table {REFERENCE} (channel text primary key, kind text not null, replaced_by text)")
    truth.execute(f"insert into {REFERENCE} values ('web', 'online', null), ('app', 'online', null), "
                  "('store', 'offline', null), ('phone', 'offline', 'app')")
    truth.execute(f"select anonproxy.declare_reference_table('{REFERENCE}')")
    wait_for_current_policy(truth, gated_proxy, gated_database)
    try:
        yield
    finally:
        truth.execute(f"select anonproxy.undeclare_reference_table('{REFERENCE}')")
        truth.execute(f"drop table {REFERENCE}")
        wait_for_current_policy(truth, gated_proxy, gated_database)


CORPUS = FANOUT + CUBE_SHAPES


def _ids(shapes: list[Shape]) -> list[str]:
    return [f"{shape.source.split()[0]}: {shape.what}" for shape in shapes]


@pytest.mark.parametrize("shape", CORPUS, ids=_ids(CORPUS))
def test_suppress_answers_as_postgresql(shape: Shape, reporter: psycopg.Connection[Any],
                                        truth: psycopg.Connection[Any]) -> None:
    suppress_answers_as_postgresql(reporter, truth, shape.sql, shape.complete)


@pytest.mark.parametrize("shape", CORPUS, ids=_ids(CORPUS))
def test_dp_answers(shape: Shape, analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    dp_answers(analyst, truth, shape.sql)


@pytest.mark.parametrize("shape", REFERENCE_SHAPES, ids=_ids(REFERENCE_SHAPES))
def test_reference_semi_joins_answered(shape: Shape, reference: None, reporter: psycopg.Connection[Any],
                                       analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    suppress_answers_as_postgresql(reporter, truth, shape.sql, shape.complete)
    dp_answers(analyst, truth, shape.sql)


def test_not_in_a_list_holding_null_is_empty_as_in_postgresql(reference: None, reporter: psycopg.Connection[Any],
                                                              analyst: psycopg.Connection[Any],
                                                              truth: psycopg.Connection[Any]) -> None:
    """replaced_by holds a NULL: NOT IN is NULL for every row, so PostgreSQL gives no group, nor does suppression.
    dp mode answers every channel of the policy's public domain, the empty ones too (which groups are empty is not
    released): four noisy counts of no one."""
    sql = ("SELECT \"visits\".\"channel\", COUNT(*) FROM \"visits\" WHERE \"visits\".\"channel\" NOT IN (SELECT "
           f"\"replaced_by\" FROM {REFERENCE}) GROUP BY 1")
    assert truth.execute(sql).fetchall() == []
    assert reporter.execute(sql).fetchall() == []
    assert sorted(channel for channel, _ in analyst.execute(sql).fetchall()) == ["app", "phone", "store", "web"]


def _refused(conn: psycopg.Connection[Any], sql: str, sqlstate: str, words: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(sql).fetchall()
    error = caught.value
    assert error.sqlstate == sqlstate, error
    assert words in (error.diag.message_primary or ""), error
    return error


FANOUT_MESSAGE = "SELECT DISTINCT subquery joined in FROM"

# Fan-out keys the catalog and the statement do not prove to be adult's rows: each stays refused in both modes.
# (Keys with a dimension of the joined table are answered since round 16: tests/test_bi_corpus_round16.py.)
FANOUT_REFUSED = {
    # the key joined back is not the unit: rows of several adults share an age
    "a key that is not the unit": "SELECT \"keys\".s, sum(\"adult\".capital_gain) FROM (SELECT DISTINCT "
    "\"adult\".sex s, \"adult\".age k " + _JOIN + ") AS \"keys\" LEFT JOIN public.adult AS \"adult\" ON "
    "\"keys\".k = \"adult\".id GROUP BY 1",
    # under a LEFT JOIN, IS NULL keeps the adults without a visit: not a semi-join on visits
    "a condition on visits true without a visit": _keys_aggregate(
        _SEX, "sum(\"adult\".age) \"adult__total_age\"", "WHERE (\"visits\".channel IS NULL)"),
    # a condition over both tables: no semi-join of visits alone
    "a condition over both tables": _keys_aggregate(
        _SEX, "sum(\"adult\".age) \"adult__total_age\"",
        "WHERE (\"visits\".amount > \"adult\".age)"),
    # the keys joined back with FULL JOIN: adults without keys would come back too
    "joined back with a FULL JOIN": _keys_aggregate(_SEX,
                                                    "sum(\"adult\".age) \"adult__total_age\"", _WEB).replace(
        "\nLEFT JOIN public.adult", "\nFULL JOIN public.adult"),
}


@pytest.mark.parametrize("sql", FANOUT_REFUSED.values(), ids=FANOUT_REFUSED.keys())
def test_fanout_keys_not_proved_stay_refused(sql: str, reporter: psycopg.Connection[Any],
                                             analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    truth.execute(sql).fetchall()  # PostgreSQL answers it
    for conn in (reporter, analyst):
        error = _refused(conn, sql, "0A000", FANOUT_MESSAGE)
        assert "count(DISTINCT" in (error.diag.message_hint or ""), error


def test_fanout_keys_refused_once_the_unit_is_not_unique(reference: None, reporter: psycopg.Connection[Any],
                                                         analyst: psycopg.Connection[Any],
                                                         truth: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                         gated_database: str) -> None:
    """Without adult's primary key the catalog no longer proves id unique: the answered statement is refused after
    the policy is read again, and answered again once the key is back."""
    sql = FANOUT[0].sql
    name = truth.execute("select conname from pg_constraint where conrelid = 'public.adult'::regclass "
                         "and contype = 'p'").fetchone()[0]
    truth.execute(f"alter table public.adult drop constraint {name}")
    try:
        truth.execute("update anonproxy.reference_tables set table_name = table_name")  # the policy is read again
        wait_for_current_policy(truth, gated_proxy, gated_database)
        for conn in (reporter, analyst):
            _refused(conn, sql, "0A000", FANOUT_MESSAGE)
    finally:
        truth.execute(f"alter table public.adult add constraint {name} primary key (id)")
        truth.execute("update anonproxy.reference_tables set table_name = table_name")
        wait_for_current_policy(truth, gated_proxy, gated_database)
    suppress_answers_as_postgresql(reporter, truth, sql)


# Semi-joins on the reference table that stay refused: each names what is not allowed.
REFERENCE_REFUSED = {
    "LIMIT": ("SELECT channel, count(*) FROM visits WHERE channel IN (SELECT channel FROM channel_kinds LIMIT 2) "
              "GROUP BY 1", "LIMIT is not allowed in IN (SELECT ... FROM <reference table>)"),
    "correlated": ("SELECT channel, count(*) FROM visits WHERE channel IN (SELECT k.channel FROM channel_kinds k "
                   "WHERE k.kind = visits.channel) GROUP BY 1", "must be a column of its table k"),
    "an expression": ("SELECT channel, count(*) FROM visits WHERE channel IN (SELECT upper(channel) FROM "
                      "channel_kinds) GROUP BY 1", "must select one of its columns"),
    "a nested query": ("SELECT channel, count(*) FROM visits WHERE channel IN (SELECT channel FROM channel_kinds "
                       "WHERE kind IN (SELECT kind FROM channel_kinds)) GROUP BY 1", "may not nest another query"),
    "a condition that could fail": ("SELECT channel, count(*) FROM visits WHERE channel IN (SELECT channel FROM "
                                    "channel_kinds WHERE length(kind) / 0 > 1) GROUP BY 1", "division by 0"),
    "a subquery tested": ("SELECT channel, count(*) FROM visits WHERE (SELECT max(v2.channel) FROM visits v2) IN "
                          "(SELECT channel FROM channel_kinds) GROUP BY 1", "subqueries"),
    "NOT IN over visits": ("SELECT sex, count(*) FROM adult WHERE id NOT IN (SELECT person_id FROM visits) GROUP BY 1",
                           "NOT IN (SELECT ...) is not allowed over protected tables"),
}


@pytest.mark.parametrize("case", REFERENCE_REFUSED.values(), ids=REFERENCE_REFUSED.keys())
def test_reference_semi_joins_refused(case: tuple[str, str], reference: None, reporter: psycopg.Connection[Any],
                                      analyst: psycopg.Connection[Any]) -> None:
    sql, words = case
    for conn in (reporter, analyst):
        _refused(conn, sql, "0A000", words)


def test_an_identifying_column_against_a_reference_list_is_refused(reference: None,
                                                                   reporter: psycopg.Connection[Any],
                                                                   analyst: psycopg.Connection[Any]) -> None:
    """A list of a public table's values tested against a person's key picks people out, as a reference table
    joined on one would: refused as insufficient privilege, whatever wraps the column."""
    sql = ("SELECT channel, count(*) FROM visits WHERE person_id::text IN (SELECT channel FROM channel_kinds) "
           "GROUP BY 1")
    for conn in (reporter, analyst):
        _refused(conn, sql, "42501", "identifying column person_id cannot be tested against reference table")
