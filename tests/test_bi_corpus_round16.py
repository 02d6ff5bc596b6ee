"""Round 16 of the BI corpus: Lightdash's fan-out CTEs whose keys hold a dimension of the joined table, and the
correlated ``[NOT] EXISTS`` over a reference table, written over the demo tables in the shape each generator gives.

Through the real gated proxy on the demo data: as ``reporter`` (suppress, k = 10) each answer is PostgreSQL's own
answer to the original statement; as a dp role each is answered with PostgreSQL's column names (its values are
noisy and bounded: a person's rows in at most the plan's groups per person, so no closeness is asserted).

* Fan-out keys ``SELECT DISTINCT "visits".channel, "adult".id FROM adult [LEFT] JOIN visits ...`` joined back to
  ``adult`` on its unique unit count each adult once per channel: ``anonproxy/plan/fanout.py`` rewrites them to
  ``adult [LEFT] JOIN (SELECT DISTINCT visits.channel, visits.person_id FROM visits WHERE ...) AS keys ON
  keys.person_id = adult.id``, which the analysis answers (``anonproxy/plan/distinct_pairs.py``).
* ``[NOT] EXISTS (SELECT 1 FROM <reference table> r WHERE r.<column> = <outer column> AND ...)``: the correlated
  form of ``<outer column> IN (SELECT r.<column> ...)`` (``anonproxy/plan/semi_joins.py``). The reference table
  is made here.

Attacks on both paths follow: each is refused with a SQLSTATE and a message naming the problem, or answered as
PostgreSQL answers it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, corpus_roles, dp_answers, suppress_answers_as_postgresql, \
    wait_for_current_policy

# read in round 13 (not again this round): cte_keys_<table> (SELECT DISTINCT <dimensions>, "<table>".<pk> AS
# "pk_<pk>" FROM ... <joins> <filters>), cte_metrics_<table> joined back on it, cte_unaffected, the final join on
# every dimension (= or both NULL)
LIGHTDASH = "lightdash/lightdash packages/backend/src/utils/QueryBuilder/MetricQueryBuilder.ts (read in round 13)"
# read in round 14: aggregateSubQuery / keysQuery (SELECT DISTINCT of the dimensions and the primary key, LEFT
# JOINed back to the cube as "keys")
CUBE = "cube-js/cube packages/cubejs-schema-compiler/src/adapter/BaseQuery.js (read in round 14)"
# written from memory: Exists(Model.objects.filter(field=OuterRef("field"))) as EXISTS(SELECT 1 AS "a" FROM ... U0
# WHERE (U0."field" = ("outer"."field") AND ...) LIMIT 1), ~Exists(...) as NOT EXISTS
DJANGO = "django/django django/db/models/expressions.py Exists (from memory)"
# written from memory: SQLAlchemy's exists().where(Ref.c.col == Outer.c.col) as EXISTS (SELECT * FROM ref WHERE ...)
SQLALCHEMY = "sqlalchemy/sqlalchemy lib/sqlalchemy/sql/selectable.py Exists (from memory)"
# written from memory: Looker's and Metabase's "period over period": one CTE per period grouped by the dimension,
# LEFT JOINed on it
PERIODS = "looker / metabase period-over-period SQL (from memory)"

# written here: the form the fan-out rewrite gives, as a person would write it
BY_HAND = "hand-written (the rewrite's own form)"

_JOIN = ("FROM public.adult AS \"adult\"\nLEFT JOIN public.visits AS \"visits\" ON \"adult\".id = "
         "\"visits\".person_id")


def _lightdash(dimensions: list[tuple[str, str]], metric: str, where: str = "") -> str:
    """Lightdash's fan-out CTEs: the keys (the dimensions and adult's key), the metric of adult joined back to it,
    the visits' own metric over the join, the two joined on every dimension (or both NULL)."""
    keys = ", ".join(f"{expression} AS \"{name}\"" for expression, name in dimensions)
    names = ", ".join(f"cte_keys_adult.\"{name}\"" for _, name in dimensions)
    plain = ", ".join(f"{expression} AS \"{name}\"" for expression, name in dimensions)
    group = ", ".join(str(n + 1) for n in range(len(dimensions)))
    on = " AND ".join(f"( cte_unaffected.\"{name}\" = cte_metrics_adult.\"{name}\" OR ( cte_unaffected.\"{name}\" "
                      f"IS NULL AND cte_metrics_adult.\"{name}\" IS NULL ) )" for _, name in dimensions)
    return (f"WITH cte_keys_adult AS (SELECT DISTINCT {keys}, \"adult\".id AS \"pk_id\" {_JOIN} {where}), "
            f"cte_metrics_adult AS (SELECT {names}, {metric} AS \"adult_metric\" FROM cte_keys_adult LEFT JOIN "
            f"\"public\".\"adult\" AS \"adult\" ON cte_keys_adult.\"pk_id\" = \"adult\".id GROUP BY {group}), "
            f"cte_unaffected AS (SELECT {plain}, COUNT(\"visits\".visit_id) AS \"visits_count\" {_JOIN} {where} "
            f"GROUP BY {group}) SELECT cte_unaffected.*, cte_metrics_adult.\"adult_metric\" AS \"adult_metric\" "
            f"FROM cte_unaffected INNER JOIN cte_metrics_adult ON {on} ORDER BY \"visits_count\" DESC LIMIT 500")


def _metrics(dimensions: list[tuple[str, str]], metric: str, where: str = "", join: str = "LEFT JOIN") -> str:
    """The metrics CTE alone over the keys (Lightdash's cte_metrics_<table> as the statement)."""
    keys = ", ".join(f"{expression} AS \"{name}\"" for expression, name in dimensions)
    names = ", ".join(f"k.\"{name}\"" for _, name in dimensions)
    group = ", ".join(str(n + 1) for n in range(len(dimensions)))
    body = _JOIN.replace("LEFT JOIN", join)
    return (f"WITH k AS (SELECT DISTINCT {keys}, \"adult\".id AS \"pk_id\" {body} {where}) SELECT {names}, {metric} "
            f"AS \"adult_metric\" FROM k LEFT JOIN public.adult AS \"adult\" ON k.\"pk_id\" = \"adult\".id "
            f"GROUP BY {group}")


def _cube(dimensions: list[tuple[str, str]], measures: str, where: str = "") -> str:
    """Cube's aggregateSubQuery: the measures of adult over the DISTINCT keys of the join, LEFT JOINed back."""
    keys = ", ".join([*(f"{expression} \"{alias}\"" for expression, alias in dimensions), "\"adult\".id \"adult__id\""])
    select = ", ".join([*(f"\"keys\".\"{alias}\"" for _, alias in dimensions), measures])
    group = ", ".join(str(n + 1) for n in range(len(dimensions)))
    return (f"SELECT {select} FROM (SELECT DISTINCT {keys} {_JOIN} {where}) AS \"keys\"\nLEFT JOIN public.adult "
            f"AS \"adult\" ON \"keys\".\"adult__id\" = \"adult\".id GROUP BY {group} ORDER BY 1 LIMIT 10000")


@dataclass(frozen=True)
class Shape:
    source: str  # the repository and file whose shape the statement follows, and whether it was read
    what: str
    sql: str
    complete: bool = True  # every group holds at least k people: suppression withholds nothing


_CHANNEL = [("\"visits\".channel", "visits_channel")]
_WEB_APP = "WHERE ((\"visits\".channel) IN ('web', 'app'))"
_H1 = ("WHERE (\"visits\".visited_at >= '2025-01-01T00:00:00.000'::timestamptz AND \"visits\".visited_at <= "
       "'2025-06-30T23:59:59.999'::timestamptz)")
_HOURS = "SUM(\"adult\".hours_per_week)"

FANOUT = [
    Shape(LIGHTDASH, "by a dimension of visits, a filter on visits", _lightdash(_CHANNEL, _HOURS, _WEB_APP)),
    Shape(LIGHTDASH, "by a dimension of visits, no filter: every adult under the LEFT JOIN",
          _lightdash(_CHANNEL, "AVG(\"adult\".age)")),
    Shape(LIGHTDASH, "by a dimension of visits, a filter on adult only", _lightdash(
        _CHANNEL, _HOURS, "WHERE ((\"adult\".age) > (40))")),
    Shape(LIGHTDASH, "by a dimension of visits, filters on both tables (each over its own)", _lightdash(
        _CHANNEL, "COUNT(\"adult\".id)", "WHERE ((\"adult\".sex) = ('Female')) AND ((\"visits\".amount) > (20))")),
    Shape(LIGHTDASH, "by a dimension of each table: adult's sex and the visit's channel", _lightdash(
        [("\"adult\".sex", "adult_sex"), *_CHANNEL], _HOURS, _WEB_APP)),
    Shape(LIGHTDASH, "by a dimension of visits over a date range on visits", _lightdash(
        _CHANNEL, "AVG(\"adult\".hours_per_week)", _H1)),
    Shape(LIGHTDASH, "by a dimension of visits, an \"is not null\" filter on visits (false for no visit)", _lightdash(
        _CHANNEL, _HOURS, "WHERE ((\"visits\".channel) IS NOT NULL)")),
    Shape(LIGHTDASH, "by a dimension of visits, a \"does not start with\" filter on visits", _lightdash(
        _CHANNEL, _HOURS, "WHERE ((\"visits\".channel) NOT LIKE 'ph%')")),
    Shape(LIGHTDASH, "by a time dimension of visits (DATE_TRUNC by month) and a filter on visits", _lightdash(
        [("DATE_TRUNC('MONTH', \"visits\".visited_at)", "visits_visited_at_month")], _HOURS, _WEB_APP)),
    Shape(LIGHTDASH, "by a time dimension of visits (by year) and channel, no filter", _lightdash(
        [("DATE_TRUNC('YEAR', \"visits\".visited_at)", "visits_visited_at_year"), *_CHANNEL],
        "COUNT(\"adult\".id)")),
    Shape(LIGHTDASH, "the metrics CTE alone, a count of adults per channel", _metrics(
        _CHANNEL, "COUNT(\"adult\".id)")),
    Shape(LIGHTDASH, "the metrics CTE alone, the keys over an INNER JOIN", _metrics(
        _CHANNEL, _HOURS, join="INNER JOIN")),
    Shape(LIGHTDASH, "a key of visits that is its key to adult (person_id), counted",
          "WITH k AS (SELECT DISTINCT \"visits\".channel AS \"visits_channel\", \"visits\".person_id AS "
          "\"visits_person\", \"adult\".id AS \"pk_id\" " + _JOIN + ") SELECT k.\"visits_channel\", "
          "count(k.\"visits_person\") AS n, SUM(\"adult\".age) AS \"adult_metric\" FROM k LEFT JOIN public.adult AS "
          "\"adult\" ON k.\"pk_id\" = \"adult\".id GROUP BY 1"),
    Shape(LIGHTDASH, "a count distinct metric of adult over the keys by channel", _lightdash(
        _CHANNEL, "COUNT(DISTINCT \"adult\".id)", _WEB_APP)),
    Shape(LIGHTDASH, "a count distinct of a column of adult over the keys by channel", _metrics(
        _CHANNEL, "COUNT(DISTINCT \"adult\".education)")),
    Shape(LIGHTDASH, "the unaffected CTE's own count distinct of visits beside the keys", _lightdash(
        _CHANNEL, _HOURS, _WEB_APP).replace("COUNT(\"visits\".visit_id)", "COUNT(DISTINCT \"visits\".visit_id)")),
    Shape(CUBE, "multiplied measure by a dimension of the joined cube", _cube(
        [("\"visits\".channel", "visits__channel")], "sum(\"adult\".age) \"adult__total_age\"")),
    Shape(CUBE, "multiplied measure by a dimension of the joined cube, filtered on it", _cube(
        [("\"visits\".channel", "visits__channel")], "avg(\"adult\".hours_per_week) \"adult__avg_hours\"",
        "WHERE (\"visits\".channel <> 'phone')")),
    Shape(CUBE, "multiplied measure by dimensions of both cubes", _cube(
        [("\"adult\".sex", "adult__sex"), ("\"visits\".channel", "visits__channel")],
        "count(\"adult\".id) \"adult__count\"")),
    Shape(BY_HAND, "the linked table's distinct rows written directly, joined on the key",
          "SELECT k.channel, sum(\"adult\".age) AS total FROM public.adult AS \"adult\" JOIN (SELECT DISTINCT "
          "v.channel, v.person_id FROM public.visits v WHERE v.amount > 10) AS k ON k.person_id = \"adult\".id "
          "GROUP BY 1 ORDER BY 1"),
]

# The reference table of this module: channels and what kind each is (public facts about the shop, no one's data).
REFERENCE = "public.channel_kinds"

EXISTS = [
    Shape(DJANGO, "Exists() over a lookup model, LIMIT 1",
          "SELECT \"visits\".\"channel\", COUNT(\"visits\".\"visit_id\") AS \"n\" FROM \"visits\" WHERE EXISTS(SELECT "
          "1 AS \"a\" FROM \"channel_kinds\" U0 WHERE (U0.\"channel\" = (\"visits\".\"channel\") AND U0.\"kind\" = "
          "'online') LIMIT 1) GROUP BY \"visits\".\"channel\""),
    Shape(DJANGO, "~Exists(): NOT EXISTS",
          "SELECT \"visits\".\"channel\", SUM(\"visits\".\"amount\") AS \"total\" FROM \"visits\" WHERE NOT "
          "EXISTS(SELECT 1 AS \"a\" FROM \"channel_kinds\" U0 WHERE (U0.\"channel\" = (\"visits\".\"channel\") AND "
          "U0.\"kind\" = 'online') LIMIT 1) GROUP BY \"visits\".\"channel\""),
    Shape(DJANGO, "NOT EXISTS matching the column that holds a NULL: unlike NOT IN, not NULL for everyone",
          "SELECT \"visits\".\"channel\", COUNT(*) AS \"n\" FROM \"visits\" WHERE NOT EXISTS(SELECT 1 AS \"a\" FROM "
          "\"channel_kinds\" U0 WHERE U0.\"replaced_by\" = \"visits\".\"channel\") GROUP BY \"visits\".\"channel\""),
    Shape(SQLALCHEMY, "exists() with SELECT *, over a join of adult and visits, by adult's sex",
          "SELECT adult.sex, count(DISTINCT adult.id) AS people FROM adult JOIN visits ON visits.person_id = adult.id "
          "WHERE EXISTS (SELECT * FROM channel_kinds WHERE channel_kinds.channel = visits.channel AND "
          "channel_kinds.kind = 'offline') GROUP BY adult.sex"),
    Shape(SQLALCHEMY, "exists() correlated with an expression of the outer column (lower)",
          "SELECT visits.channel, count(*) AS n FROM visits WHERE EXISTS (SELECT 1 FROM channel_kinds k WHERE "
          "k.channel = lower(visits.channel) AND k.kind = 'online') GROUP BY 1"),
    Shape(DJANGO, "EXISTS beside another condition, the reference column bare",
          "SELECT \"visits\".\"channel\", AVG(\"visits\".\"amount\") AS \"avg\" FROM \"visits\" WHERE "
          "\"visits\".\"amount\" > 5 AND EXISTS(SELECT 1 FROM \"channel_kinds\" U0 WHERE kind = 'offline' AND "
          "U0.\"channel\" = \"visits\".\"channel\") GROUP BY 1"),
    Shape(SQLALCHEMY, "NOT EXISTS correlated by two equalities",
          "SELECT visits.channel, sum(visits.amount) AS total FROM visits WHERE NOT EXISTS (SELECT 1 FROM "
          "channel_kinds k WHERE k.channel = visits.channel AND k.replaced_by = visits.channel) GROUP BY 1"),
]

PERIOD = [
    Shape(PERIODS, "period over period: a CTE per half year grouped by channel, LEFT JOINed on it",
          "WITH cur AS (SELECT visits.channel, sum(visits.amount) AS total FROM visits WHERE visits.visited_at >= "
          "'2025-07-01'::timestamptz AND visits.visited_at < '2026-01-01'::timestamptz GROUP BY 1), prev AS (SELECT "
          "visits.channel, sum(visits.amount) AS total FROM visits WHERE visits.visited_at >= "
          "'2025-01-01'::timestamptz AND visits.visited_at < '2025-07-01'::timestamptz GROUP BY 1) SELECT cur.channel, cur.total, prev.total AS "
          "previous FROM cur LEFT JOIN prev ON cur.channel = prev.channel ORDER BY 1"),
    Shape(PERIODS, "period over period by a dimension of adult, a count of distinct people over the join",
          "WITH cur AS (SELECT adult.sex, count(DISTINCT adult.id) AS people FROM adult JOIN visits ON "
          "visits.person_id = adult.id WHERE visits.visited_at >= '2026-01-01'::timestamptz GROUP BY 1), prev AS "
          "(SELECT adult.sex, count(DISTINCT adult.id) AS people FROM adult JOIN visits ON visits.person_id = "
          "adult.id WHERE visits.visited_at < '2026-01-01'::timestamptz GROUP BY 1) SELECT cur.sex, cur.people, "
          "prev.people AS previous, cur.people - prev.people AS change FROM cur LEFT JOIN prev ON cur.sex = prev.sex "
          "ORDER BY 1"),
    Shape(PERIODS, "period over period with FULL OUTER JOIN and COALESCE of the dimension",
          "SELECT COALESCE(a.channel, b.channel) AS channel, a.n AS this_year, b.n AS last_year FROM (SELECT "
          "channel, count(*) AS n FROM visits WHERE visited_at >= '2026-01-01'::timestamptz GROUP BY 1) a FULL OUTER "
          "JOIN (SELECT channel, count(*) AS n FROM visits WHERE visited_at < '2026-01-01'::timestamptz GROUP BY 1) b "
          "ON a.channel = b.channel ORDER BY 1"),
]

reporter, analyst = corpus_roles("dp_round16")


@pytest.fixture(scope="module")
def reference(truth: psycopg.Connection[Any], gated_proxy: Endpoint, gated_database: str) -> Iterator[None]:
    """The module's reference table, declared; afterwards undeclared and dropped."""
    truth.execute(f"create table {REFERENCE} (channel text primary key, kind text not null, replaced_by text, "
                  "weight numeric)")
    truth.execute(f"insert into {REFERENCE} values ('web', 'online', null, 1), ('app', 'online', null, 2), "
                  "('store', 'offline', null, 3), ('phone', 'offline', 'app', 1e400)")
    truth.execute(f"select anonproxy.declare_reference_table('{REFERENCE}')")
    wait_for_current_policy(truth, gated_proxy, gated_database)
    try:
        yield
    finally:
        truth.execute(f"select anonproxy.undeclare_reference_table('{REFERENCE}')")
        truth.execute(f"drop table {REFERENCE}")
        wait_for_current_policy(truth, gated_proxy, gated_database)


def _ids(shapes: list[Shape]) -> list[str]:
    return [f"{shape.source.split()[0]}: {shape.what}" for shape in shapes]


@pytest.mark.parametrize("shape", FANOUT + PERIOD, ids=_ids(FANOUT + PERIOD))
def test_suppress_answers_as_postgresql(shape: Shape, reporter: psycopg.Connection[Any],
                                        truth: psycopg.Connection[Any]) -> None:
    suppress_answers_as_postgresql(reporter, truth, shape.sql, shape.complete)


@pytest.mark.parametrize("shape", FANOUT + PERIOD, ids=_ids(FANOUT + PERIOD))
def test_dp_answers(shape: Shape, analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    dp_answers(analyst, truth, shape.sql)


@pytest.mark.parametrize("shape", EXISTS, ids=_ids(EXISTS))
def test_reference_exists_answered(shape: Shape, reference: None, reporter: psycopg.Connection[Any],
                                   analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    suppress_answers_as_postgresql(reporter, truth, shape.sql, shape.complete)
    dp_answers(analyst, truth, shape.sql)


def test_fanout_counts_each_adult_once_per_channel(reporter: psycopg.Connection[Any],
                                                   truth: psycopg.Connection[Any]) -> None:
    """The keys by channel count distinct adults, not visits: the proxy's count per channel is PostgreSQL's
    count(DISTINCT person_id) per channel, below the visits' count (people have several visits on a channel)."""
    sql = _metrics(_CHANNEL, "COUNT(\"adult\".id)")
    got = dict(reporter.execute(sql).fetchall())
    people = dict(truth.execute("SELECT channel, count(DISTINCT person_id) FROM visits GROUP BY 1").fetchall())
    visits = dict(truth.execute("SELECT channel, count(*) FROM visits GROUP BY 1").fetchall())
    assert got == people
    assert any(people[channel] < visits[channel] for channel in people)


def _refused(conn: psycopg.Connection[Any], sql: str, sqlstate: str, words: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(sql).fetchall()
    error = caught.value
    assert error.sqlstate == sqlstate, error
    assert words in (error.diag.message_primary or ""), error
    return error


FANOUT_MESSAGE = "SELECT DISTINCT subquery joined in FROM"

# Attacks on the fan-out rewrite: keys that are not what the rewrite assumes stay refused, both modes.
FANOUT_REFUSED = {
    # visits joined on a column that is not its declared key: the pairs would not be the person's
    "visits joined on visit_id": (_metrics(_CHANNEL, _HOURS).replace("\"adult\".id = \"visits\".person_id",
                                                                     "\"adult\".id = \"visits\".visit_id"),
                                  "0A000", FANOUT_MESSAGE),
    # a condition over both tables cannot go into the linked table's distinct rows
    "a condition over both tables": (_metrics(_CHANNEL, _HOURS, "WHERE \"visits\".amount > \"adult\".age"),
                                     "0A000", FANOUT_MESSAGE),
    # IS NULL under the LEFT JOIN keeps adults without a visit: not a filter of visits' rows
    "IS NULL on visits under the LEFT JOIN": (_metrics(_CHANNEL, _HOURS, "WHERE \"visits\".channel IS NULL"),
                                              "0A000", FANOUT_MESSAGE),
    # NOT (... IS NOT NULL) is IS NULL: it keeps the adults without a visit
    "NOT IS NOT NULL on visits under the LEFT JOIN": (
        _metrics(_CHANNEL, _HOURS, "WHERE NOT (\"visits\".channel IS NOT NULL)"), "0A000", FANOUT_MESSAGE),
    # the key joined back is a column of visits, not adult's unit
    "joined back on a key of visits": (
        "WITH k AS (SELECT DISTINCT \"visits\".channel AS c, \"visits\".person_id AS p " + _JOIN + ") SELECT k.c, "
        "sum(\"adult\".age) FROM k LEFT JOIN public.adult AS \"adult\" ON k.p = \"adult\".id GROUP BY 1",
        "0A000", FANOUT_MESSAGE),
    # a computed key named as visits' key: the join would compare a month with a person
    "a computed key named person_id": (_metrics([("DATE_TRUNC('MONTH', \"visits\".visited_at)", "person_id")],
                                                _HOURS), "0A000", FANOUT_MESSAGE),
    # a time dimension computed from a column of both tables: only the linked table's own columns
    "a computed key of adult's column beside visits' keys": (
        _metrics([("DATE_TRUNC('MONTH', \"visits\".visited_at)", "m"), ("\"visits\".channel", "c")], _HOURS)
        .replace("\"visits\".visited_at)", "\"adult\".id::timestamptz)"), "0A000", FANOUT_MESSAGE),
    # the linked table's distinct rows without its key: not joined on the person
    "distinct rows without the key": (
        "SELECT k.channel, sum(adult.age) FROM adult JOIN (SELECT DISTINCT channel FROM visits) AS k ON k.channel = "
        "adult.sex GROUP BY 1", "0A000", "must select its key column person_id"),
    # the protected table's distinct rows joined to itself: only a linked table's are a joined table
    "adult's own distinct rows": (
        "SELECT k.sex, count(*) FROM visits JOIN (SELECT DISTINCT a.sex, a.id FROM adult a) AS k ON k.id = "
        "visits.person_id GROUP BY 1", "0A000", "must read one linked table"),
    # a condition that could fail inside the distinct rows: the error would tell that some row reaches it
    "a failing condition inside": (
        "SELECT k.channel, sum(adult.age) FROM adult JOIN (SELECT DISTINCT v.channel, v.person_id FROM visits v "
        "WHERE v.amount / 0 > 1) AS k ON k.person_id = adult.id GROUP BY 1", "0A000", "division"),
    # a unit date_trunc does not know: PostgreSQL's error would come only when a row reaches it
    "date_trunc of an unknown unit inside": (
        "SELECT k.m, sum(adult.age) FROM adult JOIN (SELECT DISTINCT DATE_TRUNC('fortnight', v.visited_at) AS m, "
        "v.person_id FROM visits v) AS k ON k.person_id = adult.id GROUP BY 1", "0A000", "date_trunc unit FORTNIGHT"),
    # a time dimension computed from an identifying column: refused as such, before its type is looked at
    "date_trunc of an identifying column inside": (
        "SELECT k.m, sum(adult.age) FROM adult JOIN (SELECT DISTINCT DATE_TRUNC('MONTH', v.visit_id) AS m, "
        "v.person_id FROM visits v) AS k ON k.person_id = adult.id GROUP BY 1", "42501", "identifying column"),
    # a nested query inside the distinct rows
    "a nested query inside": (
        "SELECT k.channel, sum(adult.age) FROM adult JOIN (SELECT DISTINCT v.channel, v.person_id FROM visits v "
        "WHERE v.person_id IN (SELECT a2.id FROM adult a2 WHERE a2.age > 90)) AS k ON k.person_id = adult.id "
        "GROUP BY 1", "0A000", "may not nest another query"),
}


@pytest.mark.parametrize("case", FANOUT_REFUSED.values(), ids=FANOUT_REFUSED.keys())
def test_fanout_attacks_refused(case: tuple[str, str, str], reporter: psycopg.Connection[Any],
                                analyst: psycopg.Connection[Any]) -> None:
    sql, sqlstate, words = case
    for conn in (reporter, analyst):
        _refused(conn, sql, sqlstate, words)


def test_distinct_rows_grouped_by_the_person_release_no_group(reporter: psycopg.Connection[Any],
                                                              truth: psycopg.Connection[Any]) -> None:
    """The linked table's distinct rows grouped by its key: each group is one person, and suppression withholds
    every one of them (as it does grouped by visits.person_id over visits itself)."""
    sql = ("SELECT k.person_id, count(*) AS n FROM adult JOIN (SELECT DISTINCT v.channel, v.person_id FROM visits v) "
           "AS k ON k.person_id = adult.id GROUP BY 1")
    assert truth.execute(sql).fetchall()
    assert [row for row in reporter.execute(sql).fetchall() if row[0] is not None] == []


def test_a_bare_column_the_rewrite_would_reveal_errs_as_in_postgresql(reporter: psycopg.Connection[Any],
                                                                      truth: psycopg.Connection[Any]) -> None:
    """The keys name channel "c"; a bare ``channel`` names no column of the statement and PostgreSQL refuses it.
    The rewrite would make visits' channel visible under that name: it is not made, and the statement errs."""
    sql = ("WITH k AS (SELECT DISTINCT \"visits\".channel AS c, \"adult\".id AS pk " + _JOIN + ") SELECT channel, "
           "sum(\"adult\".age) FROM k LEFT JOIN public.adult AS \"adult\" ON k.pk = \"adult\".id GROUP BY 1")
    with pytest.raises(psycopg.Error):
        truth.execute(sql)
    with pytest.raises(psycopg.Error):
        reporter.execute(sql).fetchall()


# Attacks on the EXISTS path: each refused with its SQLSTATE and words.
EXISTS_REFUSED = {
    "a protected table inside": (
        "SELECT channel, count(*) FROM visits WHERE EXISTS (SELECT 1 FROM adult a WHERE a.sex = visits.channel) "
        "GROUP BY 1", "0A000", "EXISTS subquery over protected tables must tie"),
    "a protected table nested in the reference subquery": (
        "SELECT channel, count(*) FROM visits WHERE EXISTS (SELECT 1 FROM channel_kinds k WHERE k.channel = "
        "visits.channel AND EXISTS (SELECT 1 FROM adult a WHERE a.id = 17)) GROUP BY 1", "0A000",
        "may not nest another query"),
    "uncorrelated": (
        "SELECT channel, count(*) FROM visits WHERE EXISTS (SELECT 1 FROM channel_kinds WHERE kind = 'online') "
        "GROUP BY 1", "0A000", "must tie one of its columns to the outer query"),
    "the outer name shadowed by the reference table's alias": (
        "SELECT channel, count(*) FROM visits WHERE EXISTS (SELECT 1 FROM channel_kinds visits WHERE "
        "visits.channel = visits.channel) GROUP BY 1", "0A000", "must tie one of its columns"),
    "a condition that could fail": (
        "SELECT channel, count(*) FROM visits WHERE EXISTS (SELECT 1 FROM channel_kinds k WHERE k.channel = "
        "visits.channel AND length(k.kind) / 0 > 1) GROUP BY 1", "0A000", "division by 0"),
    "a condition over both": (
        "SELECT channel, count(*) FROM visits WHERE EXISTS (SELECT 1 FROM channel_kinds k WHERE k.channel = "
        "visits.channel AND k.kind < visits.channel) GROUP BY 1", "0A000", "must be a column of its table k"),
    "a function in the select list": (
        "SELECT channel, count(*) FROM visits WHERE EXISTS (SELECT generate_series(1, 3) FROM channel_kinds k WHERE "
        "k.channel = visits.channel) GROUP BY 1", "0A000", "holds constants or its columns"),
    "GROUP BY inside": (
        "SELECT channel, count(*) FROM visits WHERE EXISTS (SELECT 1 FROM channel_kinds k WHERE k.channel = "
        "visits.channel GROUP BY k.kind) GROUP BY 1", "0A000", "GROUP is not allowed in EXISTS"),
    "an outer expression that could fail": (
        "SELECT channel, count(*) FROM visits WHERE EXISTS (SELECT 1 FROM channel_kinds k WHERE k.channel = "
        "(visits.amount / 0)::text) GROUP BY 1", "0A000", "division by 0"),
    # numeric compared with a person's integer: a comparison that converts one side could fail on some value
    "a comparison across types": (
        "SELECT channel, count(*) FROM visits WHERE EXISTS (SELECT 1 FROM channel_kinds k WHERE k.weight = "
        "visits.amount::float8) GROUP BY 1", "0A000", "whose type it may not have"),
    "an identifying column": (
        "SELECT channel, count(*) FROM visits WHERE EXISTS (SELECT 1 FROM channel_kinds k WHERE k.channel = "
        "visits.person_id::text) GROUP BY 1", "42501", "identifying column"),
    "an identifying column under NOT EXISTS": (
        "SELECT sex, count(*) FROM adult WHERE NOT EXISTS (SELECT 1 FROM channel_kinds k WHERE k.channel = "
        "adult.id::text) GROUP BY 1", "42501", "identifying column"),
}


@pytest.mark.parametrize("case", EXISTS_REFUSED.values(), ids=EXISTS_REFUSED.keys())
def test_reference_exists_attacks_refused(case: tuple[str, str, str], reference: None,
                                          reporter: psycopg.Connection[Any],
                                          analyst: psycopg.Connection[Any]) -> None:
    sql, sqlstate, words = case
    for conn in (reporter, analyst):
        error = _refused(conn, sql, sqlstate, words)
        assert error.diag.message_hint, error


def test_dp_answers_the_keys_as_the_distinct_rows_joined(analyst: psycopg.Connection[Any]) -> None:
    """In dp mode the fan-out keys by channel are the same question as visits' distinct (channel, person) rows
    joined to adult, written by hand: the answer cache's key is the measurement (the bounded SQL), so the second is
    answered from the first's cached noisy values, equal to them."""
    keys = _metrics(_CHANNEL, _HOURS)
    joined = ("SELECT \"k\".\"channel\" AS \"visits_channel\", SUM(\"adult\".hours_per_week) AS \"adult_metric\" FROM "
              "public.adult AS \"adult\" LEFT JOIN (SELECT DISTINCT \"visits\".\"channel\", \"visits\".\"person_id\" "
              "FROM public.visits AS \"visits\") AS \"k\" ON \"k\".\"person_id\" = \"adult\".\"id\" GROUP BY 1")
    assert sorted(analyst.execute(keys).fetchall()) == sorted(analyst.execute(joined).fetchall())
