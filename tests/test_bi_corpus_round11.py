"""Round 11 of the BI corpus: time spines and semi-joins, shapes of the generators that were refused although safe
(tests/test_bi_corpus_generated.py's survey).

* A time spine — ``generate_series`` of constants, a VALUES list, or a derived table over one (Cube's
  ``(SELECT date_from::timestamptz ... FROM (VALUES ...) AS dates (date_from, date_to))``) — LEFT JOINed to an
  aggregate query (Grafana's and MetricFlow's gap filling, Cube's time series): the spine holds constants only,
  so the outer query post-processes the released rows beside it (anonproxy.plan.spines).
* A ``generate_series`` spine joined to a table's rows and grouped by the spine (``FROM generate_series(...) d
  LEFT JOIN visits v ON date_trunc('day', v.visited_at) = d.day GROUP BY d.day``, and MetricFlow's offset metric
  ``ON date_trunc('day', visited_at) = spine.ds - interval '7 day'``, also inside a derived table): rewritten
  into the spine joined to the aggregate query of the rows grouped by the join's key. A spine row without a
  released group is left out, as a group of fewer than k people is.
* Django's filters on a reverse relation: ``EXISTS (SELECT 1 AS "a" FROM "visits" U1 WHERE (... AND
  U1."person_id" = ("adult"."id")) LIMIT 1)`` and ``"adult"."id" IN (SELECT U0."person_id" FROM "visits" U0
  WHERE ...)``: a semi-join on the privacy unit keeps or drops each person whole (anonproxy.plan.semi_joins).
* MetricFlow's offset metric as an aggregate LEFT JOINed to the same aggregate shifted by an interval on its time
  key (answered before this round: kept here).

Through the real gated proxy on the demo data: as ``reporter`` (suppress, k = 10) each answer is PostgreSQL's own
answer to the same statement (or, where marked, every released row is one of PostgreSQL's and groups of fewer
than k people are missing); as a dp role each is answered with PostgreSQL's column names. Then the attacks: a
spine day or a semi-join group of fewer than k people is withheld, and what is not a semi-join on the unit or a
constant spine stays refused with a SQLSTATE, a message and a hint — Cube's rolling window among them (each
visit in several windows: released overlapping windows would give away the days they are made of, see
docs/bi-tools.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from conftest import corpus_roles, dp_answers, suppress_answers_as_postgresql

K = 10  # the demo policy's k for reporter
MARCH = "generate_series('2025-03-01'::timestamptz, '2025-03-31'::timestamptz, interval '1 day')"
DAILY = ("SELECT date_trunc('day', visited_at) AS day, count(visit_id) AS visits FROM public.visits "
         "GROUP BY 1")


@dataclass(frozen=True)
class Shape:
    tool: str
    what: str
    sql: str
    complete: bool = True  # every group holds at least k people: suppression withholds nothing


CORPUS = [
    Shape("Grafana", "gap filling: a day spine LEFT JOIN the daily counts",
          f"SELECT d.day AS time, q.visits FROM {MARCH} AS d(day) LEFT JOIN ({DAILY}) AS q ON q.day = d.day "
          "ORDER BY 1"),
    Shape("MetricFlow", "fill nulls with a time spine: COALESCE(metric, 0) over the spine's days",
          "SELECT subq_5.metric_time__day, COALESCE(subq_3.visits, 0) AS visits FROM (SELECT ds AS metric_time__day "
          f"FROM {MARCH} AS time_spine_src(ds)) subq_5 LEFT OUTER JOIN (SELECT DATE_TRUNC('day', visited_at) AS "
          "metric_time__day, SUM(1) AS visits FROM public.visits visits_src_28000 GROUP BY 1) subq_3 ON "
          "subq_5.metric_time__day = subq_3.metric_time__day ORDER BY 1"),
    Shape("Cube", "time series from a VALUES list of month ranges, LEFT JOIN the monthly counts",
          "SELECT \"visits.visited_at_series\".\"date_from\" \"visits__visited_at_month\", \"visits__count\" FROM "
          "(SELECT date_from::timestamptz AS \"date_from\", date_to::timestamptz AS \"date_to\" FROM (VALUES "
          "('2025-01-01T00:00:00.000Z', '2025-01-31T23:59:59.999Z'), ('2025-02-01T00:00:00.000Z', "
          "'2025-02-28T23:59:59.999Z'), ('2027-01-01T00:00:00.000Z', '2027-01-31T23:59:59.999Z')) AS dates "
          "(date_from, date_to)) AS \"visits.visited_at_series\" LEFT JOIN (SELECT date_trunc('month', "
          "\"visits\".visited_at) \"visits__visited_at_month\", count(\"visits\".visit_id) \"visits__count\" FROM "
          "public.visits AS \"visits\" GROUP BY 1) AS \"q_0\" ON \"visits.visited_at_series\".\"date_from\" = "
          "\"q_0\".\"visits__visited_at_month\" ORDER BY 1 ASC LIMIT 10000"),
    Shape("Analyst", "a VALUES list of categories, one without rows, LEFT JOIN the counts",
          "SELECT s.channel, q.n FROM (VALUES ('web'), ('app'), ('store'), ('fax')) AS s(channel) LEFT JOIN "
          "(SELECT channel, count(*) AS n FROM public.visits GROUP BY channel) q ON q.channel = s.channel"),
    Shape("MetricFlow", "offset metric: the daily metric LEFT JOIN itself shifted by 7 days",
          "SELECT a.metric_time__day, a.visits, b.visits AS visits_7_days_ago FROM (SELECT date_trunc('day', "
          "visited_at) AS metric_time__day, SUM(1) AS visits FROM public.visits GROUP BY 1) a LEFT JOIN (SELECT "
          "date_trunc('day', visited_at) AS metric_time__day, SUM(1) AS visits FROM public.visits GROUP BY 1) b "
          "ON a.metric_time__day = b.metric_time__day + interval '7 day' ORDER BY 1"),
    Shape("Grafana", "a day spine LEFT JOIN the rows, grouped by the spine's day",
          f"SELECT d.day, count(v.visit_id) AS visits FROM {MARCH} AS d(day) LEFT JOIN public.visits v ON "
          "date_trunc('day', v.visited_at) = d.day GROUP BY d.day ORDER BY 1"),
    Shape("Analyst", "the spine joined to the rows, unnamed aggregates, a WHERE condition on the rows",
          f"SELECT d.day, count(v.visit_id), sum(v.amount), avg(v.amount) FROM {MARCH} AS d(day) LEFT JOIN "
          "public.visits v ON date_trunc('day', v.visited_at) = d.day WHERE v.channel = 'web' GROUP BY 1 ORDER BY 1"),
    Shape("Analyst", "an age spine LEFT JOIN the people: ages without k people are left out",
          "SELECT s.age, count(a.id) AS n FROM generate_series(17, 90) AS s(age) LEFT JOIN public.adult a ON a.age = "
          "s.age GROUP BY s.age ORDER BY 1", complete=False),
    Shape("MetricFlow", "offset metric: the time spine joined to the rows 7 days back",
          "SELECT spine.ds + interval '7 day' AS metric_time__day, SUM(1) AS visits_7_days_ago FROM "
          f"{MARCH} AS spine(ds) INNER JOIN public.visits v ON date_trunc('day', v.visited_at) = "
          "spine.ds - interval '7 day' GROUP BY 1 ORDER BY 1"),
    Shape("MetricFlow", "derived offset metric: the metric INNER JOIN its offset (a spine joined to the rows) "
          "in a derived table",
          "SELECT subq_a.metric_time__day, subq_a.visits - subq_b.visits_7_days_ago AS visits_growth FROM (SELECT "
          "date_trunc('day', visited_at) AS metric_time__day, SUM(1) AS visits FROM public.visits GROUP BY 1) subq_a "
          "INNER JOIN (SELECT spine.ds + interval '7 day' AS metric_time__day, SUM(1) AS visits_7_days_ago FROM "
          f"{MARCH} AS spine(ds) INNER JOIN public.visits v ON date_trunc('day', v.visited_at) = spine.ds - interval "
          "'7 day' GROUP BY 1) subq_b ON subq_a.metric_time__day = subq_b.metric_time__day ORDER BY 1"),
    Shape("Analyst", "a rolling 7-day sum over the released daily counts: the window's range in ON",
          f"SELECT d.day, sum(q.visits) AS visits_7d FROM {MARCH} AS d(day) LEFT JOIN ({DAILY}) AS q ON q.day >= "
          "d.day - interval '7 day' AND q.day < d.day GROUP BY d.day ORDER BY 1"),
    Shape("Django", "filter on a reverse relation: EXISTS(... LIMIT 1) beside the unit",
          "SELECT \"adult\".\"race\", COUNT(\"adult\".\"id\") AS \"n\" FROM \"adult\" WHERE EXISTS(SELECT 1 AS "
          "\"a\" FROM \"visits\" U1 WHERE (U1.\"channel\" = 'web' AND U1.\"person_id\" = (\"adult\".\"id\")) "
          "LIMIT 1) GROUP BY \"adult\".\"race\""),
    Shape("Django", "__in over a subquery of the reverse relation",
          "SELECT \"adult\".\"sex\", COUNT(*) AS \"n\" FROM \"adult\" WHERE \"adult\".\"id\" IN (SELECT "
          "U0.\"person_id\" FROM \"visits\" U0 WHERE U0.\"channel\" = 'store') GROUP BY \"adult\".\"sex\""),
    Shape("Django", "~Exists(...): people without a web visit, an average",
          "SELECT adult.sex, avg(adult.age) AS avg_age FROM public.adult WHERE NOT EXISTS (SELECT 1 FROM "
          "public.visits v WHERE v.person_id = adult.id AND v.channel = 'web') GROUP BY adult.sex"),
    Shape("SQLAlchemy", "the linked table filtered by its person's attributes: IN (SELECT id FROM adult ...)",
          "SELECT visits.channel, count(*) AS n, sum(visits.amount) AS revenue FROM public.visits WHERE "
          "visits.person_id IN (SELECT adult.id FROM public.adult WHERE adult.age > 40) GROUP BY visits.channel"),
    Shape("Power BI", "EXISTS inside a folded step: a derived table filtered by the semi-join",
          "SELECT t.sex, count(*) AS n FROM (SELECT * FROM public.adult WHERE EXISTS (SELECT 1 FROM public.visits v "
          "WHERE v.person_id = adult.id AND v.channel = 'web')) t GROUP BY 1"),
    Shape("Looker", "EXISTS on the joined person of the linked table's rows",
          "SELECT v.channel, count(*) AS n FROM public.visits v JOIN public.adult a ON a.id = v.person_id WHERE "
          "EXISTS (SELECT 1 FROM public.visits w WHERE w.person_id = a.id AND w.amount > 400) GROUP BY 1"),
    Shape("Analyst", "EXISTS beside a WHERE condition of the outer query",
          "SELECT a.education, count(*) AS n FROM public.adult a WHERE a.age >= 30 AND EXISTS (SELECT 1 FROM "
          "public.visits v WHERE v.person_id = a.id AND v.amount > 100) GROUP BY a.education"),
    Shape("Django", "a queryset wrapped in a subquery: EXISTS tied to the unit it passes through (*)",
          "SELECT s.sex, count(*) AS n FROM (SELECT * FROM public.adult a) s WHERE EXISTS (SELECT 1 FROM "
          "public.visits v WHERE v.person_id = s.id AND v.channel = 'web') GROUP BY s.sex"),
    Shape("SQLAlchemy", "IN on the unit column a subquery selects by name",
          "SELECT s.sex, count(*) AS n FROM (SELECT id, sex FROM public.adult) s WHERE s.id IN (SELECT person_id "
          "FROM public.visits WHERE channel = 'web') GROUP BY s.sex"),
    Shape("Analyst", "a derived table with its own WHERE, NOT EXISTS tied to its unit column",
          "SELECT s.sex, count(*) AS n, avg(s.age) AS avg_age FROM (SELECT a.id, a.sex, a.age FROM public.adult a "
          "WHERE a.age > 30) s WHERE NOT EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = s.id AND "
          "v.amount > 400) GROUP BY 1"),
    Shape("Analyst", "a WITH query of the linked table, EXISTS on its person's row",
          "WITH s AS (SELECT person_id, channel FROM public.visits) SELECT s.channel, count(*) AS n FROM s WHERE "
          "EXISTS (SELECT 1 FROM public.adult a WHERE a.id = s.person_id AND a.age > 40) GROUP BY 1"),
    Shape("Django", "EXISTS(... ORDER BY ... LIMIT 1): the order of the inner rows changes nothing",
          "SELECT a.sex, count(*) AS n FROM public.adult a WHERE EXISTS (SELECT 1 FROM public.visits v WHERE "
          "v.person_id = a.id AND v.channel = 'app' ORDER BY v.amount DESC, v.visited_at LIMIT 1) GROUP BY 1"),
    Shape("Analyst", "EXISTS with ORDER BY an expression and no LIMIT",
          "SELECT a.race, count(*) AS n FROM public.adult a WHERE EXISTS (SELECT 1 FROM public.visits v WHERE "
          "v.person_id = a.id ORDER BY v.amount * 2) GROUP BY 1"),
]


reporter, analyst = corpus_roles("dp_round11")


@pytest.mark.parametrize("shape", CORPUS, ids=[f"{shape.tool}: {shape.what}" for shape in CORPUS])
def test_suppress_answers_as_postgresql(shape: Shape, reporter: psycopg.Connection[Any],
                                        truth: psycopg.Connection[Any]) -> None:
    suppress_answers_as_postgresql(reporter, truth, shape.sql, shape.complete)


@pytest.mark.parametrize("shape", CORPUS, ids=[f"{shape.tool}: {shape.what}" for shape in CORPUS])
def test_dp_answers(shape: Shape, analyst: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:
    dp_answers(analyst, truth, shape.sql)


# Visits of at least 495 (amounts run from 5 to 500): a few a day, each of a person or two.
RARE_DAILY = ("SELECT date_trunc('day', visited_at) AS day, count(*) AS visits FROM public.visits WHERE amount >= "
              "495 GROUP BY 1")
PEOPLE_PER_DAY = ("SELECT date_trunc('day', visited_at), count(DISTINCT person_id) FROM public.visits WHERE amount "
                  ">= 495 AND visited_at >= '2025-03-01' AND visited_at < '2025-04-01' GROUP BY 1")


def test_a_spine_day_of_few_people_is_withheld(reporter: psycopg.Connection[Any],
                                               truth: psycopg.Connection[Any]) -> None:
    """The spine lists every day; a day whose visits are fewer than k people's shows NULL, not their count."""
    sql = f"SELECT d.day, q.visits FROM {MARCH} AS d(day) LEFT JOIN ({RARE_DAILY}) AS q ON q.day = d.day"
    small = {day for day, people in truth.execute(PEOPLE_PER_DAY).fetchall() if people < K}
    assert small, "the demo data has rare visits on some day of March"
    got = dict(reporter.execute(sql).fetchall())
    assert len(got) == 31
    assert all(got[day] is None for day in small)
    assert {day: n for day, n in got.items() if n is not None} == {
        day: n for day, n in truth.execute(sql).fetchall() if day not in small and n is not None}


def test_a_semi_join_group_of_few_people_is_withheld(reporter: psycopg.Connection[Any],
                                                     truth: psycopg.Connection[Any]) -> None:
    """EXISTS singling out the people of one rare visit amount: every group of fewer than k people is withheld."""
    amount = truth.execute("SELECT amount FROM public.visits GROUP BY amount HAVING count(DISTINCT person_id) = 1 "
                           "ORDER BY amount LIMIT 1").fetchone()[0]
    sql = ("SELECT a.sex, count(*) AS n FROM public.adult a WHERE EXISTS (SELECT 1 FROM public.visits v WHERE "
           f"v.person_id = a.id AND v.amount = {amount}) GROUP BY a.sex")
    expected = truth.execute(sql).fetchall()
    assert sum(n for _, n in expected) == 1, "one person has a visit of this amount"
    got = [row for row in reporter.execute(sql).fetchall() if row[0] is not None]
    assert got == []


ROLLING_VALUES = ("SELECT \"visits.visited_at_series\".\"date_from\", count(\"visits\".visit_id) FROM (SELECT "
                  "date_from::timestamptz AS \"date_from\", date_to::timestamptz AS \"date_to\" FROM (VALUES "
                  "('2025-03-01T00:00:00.000Z', '2025-03-07T23:59:59.999Z'), ('2025-03-08T00:00:00.000Z', "
                  "'2025-03-14T23:59:59.999Z')) AS dates (date_from, date_to)) AS \"visits.visited_at_series\" LEFT "
                  "JOIN public.visits AS \"visits\" ON \"visits\".visited_at >= "
                  "\"visits.visited_at_series\".\"date_from\" - interval '6 day' AND \"visits\".visited_at <= "
                  "\"visits.visited_at_series\".\"date_to\" GROUP BY 1")


def test_a_spine_joined_to_the_rows_leaves_out_small_days(reporter: psycopg.Connection[Any],
                                                         truth: psycopg.Connection[Any]) -> None:
    """A spine joined to the rows and grouped: a day whose rows are fewer than k people's is left out; every row
    released is PostgreSQL's."""
    sql = (f"SELECT d.day, count(v.visit_id) AS visits FROM {MARCH} AS d(day) LEFT JOIN public.visits v ON "
           "date_trunc('day', v.visited_at) = d.day WHERE v.amount >= 495 GROUP BY d.day")
    small = {day for day, people in truth.execute(PEOPLE_PER_DAY).fetchall() if people < K}
    assert small
    got = dict(reporter.execute(sql).fetchall())
    assert not set(got) & small
    expected = dict(truth.execute(sql).fetchall())
    assert got == {day: n for day, n in expected.items() if day not in small}


@pytest.mark.parametrize(("sql", "sqlstate", "message"), [
    # tied to the outer query by another column than the unit: one visit's id could pick one person
    ("SELECT a.sex, count(*) FROM public.adult a WHERE EXISTS (SELECT 1 FROM public.visits v WHERE v.visit_id = "
     "a.id) GROUP BY a.sex", "0A000", "an EXISTS subquery over protected tables must tie"),
    # the inner table's name shadows the outer one's: the "correlation" compares the inner rows with themselves,
    # and the EXISTS would say whether anyone's visit has this amount
    ("SELECT visits.channel, count(*) FROM public.visits WHERE EXISTS (SELECT 1 FROM public.visits WHERE "
     "visits.person_id = visits.person_id AND visits.amount = 123.45) GROUP BY visits.channel", "0A000",
     "an EXISTS subquery over protected tables must tie"),
    # a condition on the count of a person's rows: not a row condition
    ("SELECT a.sex, count(*) FROM public.adult a WHERE a.id IN (SELECT v.person_id FROM public.visits v GROUP BY "
     "v.person_id HAVING count(*) > 3) GROUP BY a.sex", "0A000", "GROUP, HAVING is not allowed in a semi-join"),
    ("SELECT a.sex, count(*) FROM public.adult a WHERE a.id NOT IN (SELECT v.person_id FROM public.visits v) "
     "GROUP BY a.sex", "0A000", "NOT IN (SELECT ...) is not allowed"),
    # IN over another column than the unit
    ("SELECT a.sex, count(*) FROM public.adult a WHERE a.age IN (SELECT v.person_id FROM public.visits v) GROUP BY "
     "a.sex", "0A000", "IN (SELECT ...) over protected tables must test the outer query's privacy unit"),
    # a bare name of the outer table inside the subquery (PostgreSQL resolves it to the outer query, unchecked)
    ("SELECT a.sex, count(*) FROM public.adult a WHERE EXISTS (SELECT 1 FROM public.visits v WHERE v.person_id = "
     "a.id AND age > 30) GROUP BY a.sex", "0A000", "age in a semi-join subquery must be a column of its table"),
    # a relation outside the policy in the subquery
    ("SELECT a.sex, count(*) FROM public.adult a WHERE EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = a.id) "
     "GROUP BY a.sex", "42501", "relation pg_catalog.pg_class is not part of the privacy policy"),
    # an OR around the semi-join: not a top-level conjunct
    ("SELECT a.sex, count(*) FROM public.adult a WHERE a.age > 80 OR EXISTS (SELECT 1 FROM public.visits v WHERE "
     "v.person_id = a.id) GROUP BY a.sex", "0A000", "subqueries are not allowed"),
    # a VALUES "spine" that reads a person's data
    ("SELECT s.c, q.n FROM (VALUES ((SELECT count(*) FROM public.adult WHERE id = 17))) AS s(c) LEFT JOIN (SELECT "
     "age, count(*) AS n FROM public.adult GROUP BY age) q ON q.age = s.c", "0A000",
     "a VALUES list beside aggregate queries holds at most 20000 rows of constants"),
    ("SELECT s.c, q.n FROM generate_series(1, (SELECT max(age) FROM public.adult)) AS s(c) LEFT JOIN (SELECT age, "
     "count(*) AS n FROM public.adult GROUP BY age) q ON q.age = s.c", "0A000",
     "generate_series beside aggregate queries takes constants"),
    # a spine too long
    ("SELECT d.day, q.visits FROM generate_series('2000-01-01'::timestamptz, '2030-01-01'::timestamptz, interval "
     f"'1 hour') AS d(day) LEFT JOIN ({DAILY}) AS q ON q.day = d.day", "0A000",
     "generate_series beside aggregate queries gives at most 20000 rows"),
    # a "spine" that reads the protected table is no spine
    ("SELECT d.day, q.visits FROM (SELECT visited_at AS day FROM public.visits) AS d LEFT JOIN "
     f"({DAILY}) AS q ON q.day = d.day", "0A000", None),
    # Cube's rolling window: each visit in seven windows; the released windows would give away the days
    (f"SELECT d.day, count(v.visit_id) FROM {MARCH} AS d(day) LEFT JOIN public.visits v ON v.visited_at >= d.day - "
     "interval '7 day' AND v.visited_at < d.day GROUP BY d.day", "0A000",
     "a time spine joined to a table's rows takes one ON equality"),
    (ROLLING_VALUES, "0A000", "a time spine joined to a table's rows takes one ON equality"),
    # groups coarser than the spine: a group would be many spine rows
    (f"SELECT date_trunc('month', d.day), count(v.visit_id) FROM {MARCH} AS d(day) LEFT JOIN public.visits v ON "
     "date_trunc('day', v.visited_at) = d.day GROUP BY 1", "0A000",
     "a time spine joined to a table's rows must be grouped by the spine's column"),
    # a row value beside the spine
    (f"SELECT d.day, v.amount FROM {MARCH} AS d(day) LEFT JOIN public.visits v ON date_trunc('day', "
     "v.visited_at) = d.day GROUP BY 1, 2", "0A000",
     "a time spine joined to a table's rows must be grouped by the spine's column"),
    (f"SELECT d.day, count(v.visit_id) FROM {MARCH} AS d(day) LEFT JOIN public.visits v ON date_trunc('day', "
     "v.visited_at) = d.day WHERE v.visited_at > d.day GROUP BY 1", "0A000",
     "a WHERE condition of a time spine joined to a table's rows must read the spine or the table, not both"),
])
def test_what_is_not_a_semi_join_or_a_spine_stays_refused(sql: str, sqlstate: str, message: str | None,
                                                          reporter: psycopg.Connection[Any],
                                                          analyst: psycopg.Connection[Any],
                                                          truth: psycopg.Connection[Any]) -> None:
    """PostgreSQL answers each; the proxy refuses each in both modes, with the SQLSTATE and a message naming it."""
    truth.execute(sql).fetchall()
    for conn in (reporter, analyst):
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(sql).fetchall()
        error = caught.value
        assert error.sqlstate == sqlstate, error
        assert message is None or message in (error.diag.message_primary or ""), error
        assert error.diag.message_hint, error


DJANGO_BOUND = ("SELECT \"adult\".\"sex\", COUNT(*) AS \"n\" FROM \"adult\" WHERE EXISTS(SELECT 1 AS \"a\" FROM "
                "\"visits\" U1 WHERE (U1.\"channel\" = %s AND U1.\"person_id\" = (\"adult\".\"id\")) LIMIT 1) "
                "GROUP BY \"adult\".\"sex\"")


def test_a_bound_parameter_in_a_semi_join(reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
                                          truth: psycopg.Connection[Any]) -> None:
    """Django's server-side binding sends the filter's value as $1 inside the EXISTS: answered as PostgreSQL
    answers it (reporter), and answered with its column names (dp)."""
    expected = truth.execute(DJANGO_BOUND, ["web"])
    expected_names, expected_rows = [column.name for column in expected.description], expected.fetchall()
    got = reporter.execute(DJANGO_BOUND, ["web"])
    assert [column.name for column in got.description] == expected_names
    assert sorted(got.fetchall()) == sorted(expected_rows)
    noisy = analyst.execute(DJANGO_BOUND, ["web"])
    assert [column.name for column in noisy.description] == expected_names
    assert noisy.fetchall()


def test_a_semi_join_filters_as_postgresql_in_dp(analyst: psycopg.Connection[Any],
                                                 truth: psycopg.Connection[Any]) -> None:
    """dp's noisy count of people with a store visit is near PostgreSQL's, far from the count of everyone."""
    sql = ("SELECT count(*) AS n FROM public.adult WHERE adult.id IN (SELECT visits.person_id FROM public.visits "
           "WHERE visits.channel = 'store' AND visits.amount > 450)")
    expected = truth.execute(sql).fetchone()[0]
    everyone = truth.execute("SELECT count(*) FROM public.adult").fetchone()[0]
    got = analyst.execute(sql).fetchone()[0]
    assert abs(got - expected) < (everyone - expected) / 2, (got, expected, everyone)
