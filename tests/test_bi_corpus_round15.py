"""Round 15 of the BI corpus: MetricFlow's PostgreSQL rendering (``subq_N`` chains, metrics combined with FULL
OUTER JOIN and COALESCE of the dimensions, ratio metrics as CAST / NULLIF DOUBLE PRECISION) and Django's ORM
(``Trunc``/``Extract`` at a time zone, ``FILTER (WHERE ...)``, ``aggregate()`` over an annotated queryset wrapped
in ``subquery``, ``Coalesce``, ``Cast``), written over the demo tables in the shape each generator gives.

Through the real gated proxy on the demo data: as ``reporter`` (suppress, k = 10) each answer is PostgreSQL's own
answer to the same statement; as a dp role each is answered with PostgreSQL's column names.

Lifted this round: MetricFlow's time spine as a derived table or WITH query selecting ``generate_series(...)``
without FROM, read as the same series in FROM (``anonproxy/plan/spines.py`` ``give_series_a_from``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from conftest import corpus_roles, dp_answers, suppress_answers_as_postgresql

# read: test_multi_metric_fill_null__plan0_optimized.sql (subq_N chains, "1 AS <metric>" summed, FULL OUTER JOIN of
# two metrics ON the time dimension, COALESCE of it, MAX of each side, GROUP BY the COALESCE) and
# test_measure_constraint_with_reused_measure__plan0_optimized.sql (the ratio CAST(a AS DOUBLE PRECISION) /
# CAST(NULLIF(b, 0) AS DOUBLE PRECISION) over the combined outputs, a filter "WHERE booking__is_instant" on the
# inner subquery)
METRICFLOW = "dbt-labs/metricflow tests_metricflow/snapshots/**/Postgres/*.sql (read)"
# read: the Trino snapshot test_conversion_metric_join_to_timespine_and_fill_nulls_with_0 (the time spine's derived
# table LEFT OUTER JOINed to the metric ON the day, EXTRACT(year FROM ...) as ds__extract_year, COALESCE(MAX(...), 0)
# of a filled metric); written here in PostgreSQL's spelling
METRICFLOW_TRINO = ("dbt-labs/metricflow tests_metricflow/snapshots/test_conversion_metrics_to_sql.py/"
                      "SqlQueryPlan/Trino (read)")
# written from memory: Trunc/Extract(tzinfo) as DATE_TRUNC('month', "t"."c" AT TIME ZONE 'UTC') and
# EXTRACT(YEAR FROM "t"."c" AT TIME ZONE 'UTC'), TruncDate as ("t"."c" AT TIME ZONE 'UTC')::date
DJANGO_TIME = "django/django django/db/backends/postgresql/operations.py (from memory)"
# written from memory: Count(..., filter=Q(...)) as COUNT(...) FILTER (WHERE ...), Coalesce(Sum(...), 0), Cast
# as (...)::double precision, Case/When as CASE WHEN ... THEN ... ELSE ... END
DJANGO_AGGREGATES = "django/django django/db/models/aggregates.py (from memory)"
# written from memory: aggregate() over an annotated or distinct queryset wraps it as SELECT ... FROM (...) subquery
DJANGO_COMPILER = "django/django django/db/models/sql/query.py get_aggregation (from memory)"
# written from memory: __year as BETWEEN the year's bounds, __icontains as UPPER(...::text) LIKE UPPER('%...%')
DJANGO_LOOKUPS = "django/django django/db/models/lookups.py (from memory)"


@dataclass(frozen=True)
class Shape:
    source: str  # the repository and file whose shape the statement follows, and whether it was read
    what: str
    sql: str


def _month(metric: str, value: str, where: str = "") -> str:
    """MetricFlow's simple metric by month: the read-elements subquery, then the aggregate by the dimension."""
    return ("SELECT metric_time__month, SUM(" + metric + ") AS " + metric + " FROM (SELECT DATE_TRUNC('month', "
            "visited_at) AS metric_time__month, visits_src_1.channel AS visit__channel, " + value + " AS " + metric
            + " FROM public.visits visits_src_1) subq_1 " + where + " GROUP BY metric_time__month")


_COMBINED = ("SELECT COALESCE(subq_3.metric_time__month, subq_6.metric_time__month) AS metric_time__month, "
             "MAX(subq_3.web_revenue) AS web_revenue, MAX(subq_6.revenue) AS revenue FROM ("
             + _month("web_revenue", "amount", "WHERE visit__channel = 'web'").replace("subq_1", "subq_2")
             + ") subq_3 FULL OUTER JOIN (" + _month("revenue", "amount").replace("subq_1", "subq_5")
             + ") subq_6 ON subq_3.metric_time__month = subq_6.metric_time__month GROUP BY "
             "COALESCE(subq_3.metric_time__month, subq_6.metric_time__month)")

METRICFLOW_SHAPES = [
    Shape(METRICFLOW, "simple metric by month: 1 AS visits summed over the read-elements subquery",
          _month("visits", "1")),
    Shape(METRICFLOW, "simple metric by month: a sum of a column",
          _month("revenue", "amount")),
    Shape(METRICFLOW, "filter on the read-elements subquery by a pass-through dimension",
          _month("web_revenue", "amount", "WHERE visit__channel = 'web'")),
    Shape(METRICFLOW, "two metrics combined: FULL OUTER JOIN on the dimension, COALESCE of it, MAX of each",
          _COMBINED),
    Shape(METRICFLOW, "ratio metric: CAST AS DOUBLE PRECISION over CAST(NULLIF(..., 0) AS DOUBLE PRECISION)",
          "SELECT metric_time__month, CAST(web_revenue AS DOUBLE PRECISION) / CAST(NULLIF(revenue, 0) AS DOUBLE "
          "PRECISION) AS web_revenue_share FROM (" + _COMBINED + ") subq_7"),
    Shape(METRICFLOW, "derived metric: an expression over the metric in a further subquery",
          "SELECT metric_time__month, 2 * visits AS twice_visits FROM (SELECT metric_time__month, "
          "COALESCE(visits, 0) AS visits FROM (" + _month("visits", "1") + ") subq_2) subq_3"),
    Shape(METRICFLOW, "a dimension of adult joined to the read-elements subquery, the metric summed by it",
          "SELECT subq_2.person__sex AS person__sex, SUM(subq_2.visits) AS visits FROM (SELECT "
          "visits_src_1.person_id AS person, 1 AS visits, adult_src_2.sex AS person__sex FROM public.visits "
          "visits_src_1 LEFT OUTER JOIN public.adult adult_src_2 ON visits_src_1.person_id = adult_src_2.id) subq_2 "
          "GROUP BY subq_2.person__sex"),
    Shape(METRICFLOW_TRINO, "EXTRACT(year FROM ...) as a dimension, COALESCE(MAX(...), 0) of the metric",
          "SELECT metric_time__extract_year, COALESCE(MAX(revenue), 0) AS revenue FROM (SELECT "
          "metric_time__extract_year, SUM(amount) AS revenue FROM (SELECT EXTRACT(year FROM visited_at) AS "
          "metric_time__extract_year, amount FROM public.visits visits_src_1) subq_1 GROUP BY "
          "metric_time__extract_year) subq_2 GROUP BY metric_time__extract_year"),
    Shape(METRICFLOW, "a metric of adult by two dimensions, the filter on the inner subquery",
          "SELECT person__sex, person__income, AVG(hours) AS average_hours FROM (SELECT adult_src_2.sex AS "
          "person__sex, adult_src_2.income AS person__income, adult_src_2.age AS person__age, "
          "adult_src_2.hours_per_week AS hours FROM public.adult adult_src_2) subq_1 WHERE person__age >= 30 "
          "GROUP BY person__sex, person__income"),
    Shape(METRICFLOW, "grain-to-date cumulative: a running SUM over the monthly sums, partitioned by year",
          "SELECT metric_time__month, SUM(revenue) OVER (PARTITION BY DATE_TRUNC('year', metric_time__month) ORDER "
          "BY metric_time__month ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS revenue_ytd FROM ("
          + _month("revenue", "amount") + ") subq_2"),
    Shape(METRICFLOW, "time constraint: BETWEEN on the truncated dimension in the read-elements subquery",
          "SELECT metric_time__month, SUM(revenue) AS revenue FROM (SELECT DATE_TRUNC('month', visited_at) AS "
          "metric_time__month, amount AS revenue FROM public.visits visits_src_1 WHERE DATE_TRUNC('month', "
          "visited_at) BETWEEN '2025-01-01' AND '2025-12-31') subq_1 GROUP BY metric_time__month"),
    Shape(METRICFLOW, "metrics of two tables by adult's sex: FULL OUTER JOIN, COALESCE of the dimension, MAX",
          "SELECT COALESCE(subq_3.person__sex, subq_6.person__sex) AS person__sex, MAX(subq_3.visits) AS visits, "
          "MAX(subq_6.people) AS people FROM (SELECT adult_src_2.sex AS person__sex, SUM(1) AS visits FROM "
          "public.visits visits_src_1 LEFT OUTER JOIN public.adult adult_src_2 ON visits_src_1.person_id = "
          "adult_src_2.id GROUP BY adult_src_2.sex) subq_3 FULL OUTER JOIN (SELECT sex AS person__sex, "
          "COUNT(DISTINCT id) AS people FROM public.adult adult_src_2 GROUP BY sex) subq_6 ON subq_3.person__sex = "
          "subq_6.person__sex GROUP BY COALESCE(subq_3.person__sex, subq_6.person__sex)"),
]

# MetricFlow's spine of a time dimension is a derived table selecting generate_series without FROM (the demo has
# no time spine table; the snapshots read one). Refused before this round ("needs a FROM clause"); now the same
# statement with generate_series in FROM (anonproxy/plan/spines.py give_series_a_from).
_SPINE = ("SELECT generate_series('2025-01-01'::timestamptz, '2026-12-01'::timestamptz, interval '1 month') AS "
          "metric_time__month")
SPINE_SHAPES = [
    Shape(METRICFLOW_TRINO, "join to time spine: the FROM-less spine LEFT OUTER JOIN the metric, COALESCE(..., 0)",
          "SELECT subq_6.metric_time__month AS metric_time__month, COALESCE(subq_3.revenue, 0) AS revenue FROM ("
          + _SPINE + ") subq_6 LEFT OUTER JOIN (" + _month("revenue", "amount") + ") subq_3 ON "
          "subq_6.metric_time__month = subq_3.metric_time__month"),
    Shape(METRICFLOW_TRINO, "join to time spine: generate_series unaliased, read as its own name",
          "SELECT subq_6.generate_series AS metric_time__month, subq_3.visits FROM ("
          + _SPINE.removesuffix(" AS metric_time__month") + ") subq_6 LEFT OUTER JOIN (" + _month("visits", "1")
          + ") subq_3 ON subq_6.generate_series = subq_3.metric_time__month"),
    Shape(METRICFLOW_TRINO, "the FROM-less spine as a WITH query, LEFT OUTER JOINed to the metric",
          "WITH spine AS (" + _SPINE + ") SELECT spine.metric_time__month, COALESCE(subq_3.revenue, 0) AS revenue "
          "FROM spine LEFT OUTER JOIN (" + _month("revenue", "amount") + ") subq_3 ON spine.metric_time__month = "
          "subq_3.metric_time__month"),
    Shape(METRICFLOW_TRINO, "the FROM-less spine joined to the table's rows, grouped by the spine",
          "SELECT subq_6.metric_time__month, SUM(visits_src_1.amount) AS revenue FROM (" + _SPINE + ") subq_6 LEFT "
          "OUTER JOIN public.visits visits_src_1 ON DATE_TRUNC('month', visits_src_1.visited_at) = "
          "subq_6.metric_time__month GROUP BY subq_6.metric_time__month"),
]

DJANGO_SHAPES = [
    Shape(DJANGO_TIME, "Trunc('visited_at', 'month', tzinfo=UTC) in values() and annotate(Count)",
          "SELECT DATE_TRUNC('month', \"visits\".\"visited_at\" AT TIME ZONE 'UTC') AS \"month\", "
          "COUNT(\"visits\".\"visit_id\") AS \"n\" FROM \"visits\" GROUP BY 1 ORDER BY 1 ASC"),
    Shape(DJANGO_TIME, "ExtractYear at a time zone, Sum",
          "SELECT EXTRACT(YEAR FROM \"visits\".\"visited_at\" AT TIME ZONE 'UTC') AS \"year\", "
          "SUM(\"visits\".\"amount\") AS \"total\" FROM \"visits\" GROUP BY 1 ORDER BY 1 ASC"),
    Shape(DJANGO_TIME, "TruncQuarter with the channel, ordered by both",
          "SELECT \"visits\".\"channel\", DATE_TRUNC('quarter', \"visits\".\"visited_at\" AT TIME ZONE 'UTC') AS "
          "\"quarter\", SUM(\"visits\".\"amount\") AS \"total\" FROM \"visits\" GROUP BY \"visits\".\"channel\", 2 "
          "ORDER BY \"visits\".\"channel\" ASC, \"quarter\" ASC"),
    Shape(DJANGO_AGGREGATES, "Count(filter=Q(...)) as COUNT(...) FILTER (WHERE ...) by a dimension",
          "SELECT \"adult\".\"sex\", COUNT(\"adult\".\"id\") FILTER (WHERE \"adult\".\"income\" = '>50K') AS "
          "\"rich\", COUNT(\"adult\".\"id\") AS \"n\" FROM \"adult\" GROUP BY \"adult\".\"sex\""),
    Shape(DJANGO_AGGREGATES, "Coalesce(Sum(...), 0) by a dimension",
          "SELECT \"visits\".\"channel\", COALESCE(SUM(\"visits\".\"amount\"), 0) AS \"total\" FROM \"visits\" "
          "GROUP BY \"visits\".\"channel\""),
    Shape(DJANGO_AGGREGATES, "Cast(Avg(...), FloatField()) as (...)::double precision",
          "SELECT \"adult\".\"race\", (AVG(\"adult\".\"age\"))::double precision AS \"average_age\" FROM \"adult\" "
          "GROUP BY \"adult\".\"race\""),
    Shape(DJANGO_AGGREGATES, "Sum(Case(When(..., then=1), default=0)) by a dimension",
          "SELECT \"adult\".\"sex\", SUM(CASE WHEN \"adult\".\"income\" = '>50K' THEN 1 ELSE 0 END) AS \"rich\" "
          "FROM \"adult\" GROUP BY \"adult\".\"sex\""),
    Shape(DJANGO_AGGREGATES, "aggregate() without values(): one row of Avg and Count",
          "SELECT AVG(\"adult\".\"hours_per_week\") AS \"hours_per_week__avg\", COUNT(\"adult\".\"id\") AS "
          "\"id__count\" FROM \"adult\""),
    Shape(DJANGO_AGGREGATES, "Count('person_id', distinct=True) by a dimension",
          "SELECT \"visits\".\"channel\", COUNT(DISTINCT \"visits\".\"person_id\") AS \"people\" FROM \"visits\" "
          "GROUP BY \"visits\".\"channel\""),
    Shape(DJANGO_AGGREGATES, "annotate over a reverse relation: LEFT OUTER JOIN on the key, Count of the related",
          "SELECT \"adult\".\"sex\", COUNT(\"visits\".\"visit_id\") AS \"visits\" FROM \"adult\" LEFT OUTER JOIN "
          "\"visits\" ON (\"adult\".\"id\" = \"visits\".\"person_id\") GROUP BY \"adult\".\"sex\""),
    Shape(DJANGO_COMPILER, "aggregate() over annotate().values(): SUM of the groups' sums FROM (...) subquery",
          "SELECT SUM(\"total\") FROM (SELECT \"visits\".\"channel\" AS \"col1\", SUM(\"visits\".\"amount\") AS "
          "\"total\" FROM \"visits\" GROUP BY 1) subquery"),
    Shape(DJANGO_COMPILER, "aggregate() over a filtered, annotated queryset: AVG of the groups' counts",
          "SELECT AVG(\"n\") FROM (SELECT \"adult\".\"education\" AS \"col1\", COUNT(\"adult\".\"id\") AS \"n\" "
          "FROM \"adult\" WHERE \"adult\".\"age\" >= 30 GROUP BY 1) subquery"),
    Shape(DJANGO_COMPILER, ".values('sex', 'race').distinct().count(): COUNT(*) FROM (SELECT DISTINCT ...) subquery",
          "SELECT COUNT(*) FROM (SELECT DISTINCT \"adult\".\"sex\" AS \"col1\", \"adult\".\"race\" AS \"col2\" "
          "FROM \"adult\") subquery"),
    Shape(DJANGO_LOOKUPS, "filter(visited_at__year=2025): BETWEEN the year's bounds",
          "SELECT \"visits\".\"channel\", COUNT(\"visits\".\"visit_id\") AS \"n\" FROM \"visits\" WHERE "
          "\"visits\".\"visited_at\" BETWEEN '2025-01-01T00:00:00+00:00'::timestamptz AND "
          "'2025-12-31T23:59:59.999999+00:00'::timestamptz GROUP BY \"visits\".\"channel\""),
    Shape(DJANGO_TIME, "filter on ExtractMonth: EXTRACT(MONTH FROM ... AT TIME ZONE 'UTC') = 3",
          "SELECT \"visits\".\"channel\", SUM(\"visits\".\"amount\") AS \"total\" FROM \"visits\" WHERE "
          "EXTRACT(MONTH FROM \"visits\".\"visited_at\" AT TIME ZONE 'UTC') = 3 GROUP BY \"visits\".\"channel\""),
    Shape(DJANGO_AGGREGATES, "StdDev and Variance as STDDEV_POP and VAR_POP",
          "SELECT \"adult\".\"sex\", STDDEV_POP(\"adult\".\"age\") AS \"sd\", "
          "VAR_POP(\"adult\".\"hours_per_week\") AS \"var\" FROM \"adult\" GROUP BY \"adult\".\"sex\""),
    Shape(DJANGO_LOOKUPS, "icontains: UPPER(...::text) LIKE UPPER('%...%')",
          "SELECT \"adult\".\"sex\", COUNT(\"adult\".\"id\") AS \"n\" FROM \"adult\" WHERE "
          "UPPER(\"adult\".\"education\"::text) LIKE UPPER('%grad%') GROUP BY \"adult\".\"sex\""),
    Shape(DJANGO_TIME, "TruncDate at a time zone filtered to a range, LIMIT 21 of a repr",
          "SELECT (\"visits\".\"visited_at\" AT TIME ZONE 'UTC')::date AS \"day\", COUNT(\"visits\".\"visit_id\") AS "
          "\"n\" FROM \"visits\" WHERE \"visits\".\"visited_at\" >= '2025-03-01T00:00:00+00:00'::timestamptz AND "
          "\"visits\".\"visited_at\" < '2025-03-08T00:00:00+00:00'::timestamptz GROUP BY 1 ORDER BY 1 ASC LIMIT 21"),
]

CORPUS = METRICFLOW_SHAPES + SPINE_SHAPES + DJANGO_SHAPES

reporter, analyst = corpus_roles("dp_round15")


def _ids(shapes: list[Shape]) -> list[str]:
    return [f"{shape.source.split()[0]}: {shape.what}" for shape in shapes]


@pytest.mark.parametrize("shape", CORPUS, ids=_ids(CORPUS))
def test_suppress_answers_as_postgresql(shape: Shape, reporter: psycopg.Connection[Any],
                                        truth: psycopg.Connection[Any]) -> None:
    suppress_answers_as_postgresql(reporter, truth, shape.sql)


@pytest.mark.parametrize("shape", CORPUS, ids=_ids(CORPUS))
def test_dp_answers(shape: Shape, analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    dp_answers(analyst, truth, shape.sql)


# Stay refused, in both modes, each with a message naming what is not answered.
REFUSED = {
    # MetricFlow's cumulative metric over a window: each visit is summed into several months of the spine
    "a spine joined on a range (cumulative window)": (
        "SELECT subq_6.metric_time__month, SUM(visits_src_1.amount) AS trailing_revenue FROM (" + _SPINE + ") subq_6 "
        "INNER JOIN public.visits visits_src_1 ON visits_src_1.visited_at <= subq_6.metric_time__month AND "
        "visits_src_1.visited_at > subq_6.metric_time__month - INTERVAL '3 month' GROUP BY subq_6.metric_time__month",
        "a range, as in a rolling window, is not answered"),
    # a FROM-less series whose bound is read from the data: not a spine of constants
    "a FROM-less series bounded by the data": (
        "SELECT s.m, q.n FROM (SELECT generate_series(1, (SELECT max(age) FROM adult)) AS m) s LEFT JOIN (SELECT "
        "age, count(*) AS n FROM adult GROUP BY age) q ON q.age = s.m",
        "generate_series beside aggregate queries takes constants"),
}


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
def test_refused_with_what_is_allowed(case: tuple[str, str], reporter: psycopg.Connection[Any],
                                      analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    sql, words = case
    truth.execute(sql).fetchall()  # PostgreSQL answers it
    for conn in (reporter, analyst):
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(sql).fetchall()
        error = caught.value
        assert error.sqlstate == "0A000", error
        assert words in (error.diag.message_primary or ""), error
        assert "generate_series(" in (error.diag.message_hint or ""), error


def test_a_from_less_spine_on_the_unit_releases_no_one(reporter: psycopg.Connection[Any],
                                                       truth: psycopg.Connection[Any]) -> None:
    """The FROM-less spine is the generate_series spine, also when its values are adults' ids: each group is one
    adult, none releasable, so the spine would read an aggregate query grouped by the privacy unit: refused in
    either spelling (anonproxy/plan/unit_groups.py; suppression released none before), where PostgreSQL answers
    all 30."""
    rows = "SELECT s.x, SUM(adult.capital_gain) FROM {spine} LEFT JOIN public.adult ON adult.id = s.x GROUP BY s.x"
    from_less = rows.format(spine="(SELECT generate_series(1, 30) AS x) s")
    in_from = rows.format(spine="generate_series(1, 30) AS s(x)")
    assert len(truth.execute(from_less).fetchall()) == 30
    for sql in (from_less, in_from):
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="grouped by the privacy unit adult.id"):
            reporter.execute(sql).fetchall()
