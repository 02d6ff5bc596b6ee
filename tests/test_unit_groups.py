"""An outer query over an aggregate query grouped by the privacy unit is refused (anonproxy/plan/unit_groups.py).

Django's ``Adult.objects.annotate(n=Count('visits')).aggregate(Avg('n'))`` averages a per-person count: the outer
level reads the inner query's released rows, and grouped by the unit every group is one person. Answered, the
reporter got the average over the suppressed-rest row alone (all the visits, where PostgreSQL says about 3) and a dp
role NULL; now both are refused with 0A000, a message naming the unit column and a hint of what to ask instead
(a refusal costs the dp role nothing). Variants: AVG, SUM, MAX, COUNT over per-person figures, an outer WHERE, a
WITH query, a linked table's key, a join, the unit beside another key, a derived table's alias, an aggregate query
joined second, set operations. Through the real gated proxy with psycopg, as ``reporter`` (suppress, k = 10, a
rest row) and a dp role of the module's own. Near misses (grouped by a quasi-identifier, or by a column merely named
like an id) are answered as before: over the released rows of the inner query, which the same role gets when it
asks the inner query alone. The hint's own question and a plain ``GROUP BY id`` are answered.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg
import pytest
from conftest import attack_roles

reporter, analyst = attack_roles("dp_unit_groups", epsilon=100, scope="module")

DJANGO = ('SELECT AVG("n") AS "mean" FROM (SELECT COUNT("visits"."visit_id") AS "n" FROM "adult" LEFT OUTER JOIN '
          '"visits" ON ("adult"."id" = "visits"."person_id") GROUP BY "adult"."id") subquery')

# Each statement, and the unit column the refusal names.
GROUPED_BY_UNIT = [
    (DJANGO, "adult.id"),
    ("select avg(n) from (select id, count(*) as n from adult group by id) q", "adult.id"),
    ("select sum(n) from (select id, count(*) as n from adult group by id) q", "adult.id"),
    ("select max(n) from (select a.id, count(v.visit_id) as n from adult a left join visits v on v.person_id = a.id "
     "group by a.id) q", "a.id"),
    ("select count(*) from (select id, count(*) from adult group by id) q", "adult.id"),
    ("select count(*) from (select id, sum(capital_gain) as g from adult where id < 200 group by id) q "
     "where g > 5000", "adult.id"),
    ("with per_person as (select person_id, count(*) as n from visits group by person_id) "
     "select avg(n) from per_person", "visits.person_id"),
    ("select avg(total) from (select person_id, sum(amount) as total from visits group by 1) q", "visits.person_id"),
    ("select avg(n) from (select v.person_id, count(*) as n from adult a join visits v on v.person_id = a.id "
     "group by v.person_id) q", "v.person_id"),
    ("select sex, avg(n) from (select sex, id, count(*) as n from adult group by sex, id) q group by sex",
     "adult.id"),
    ("select avg(n) from (select p, count(*) as n from (select id as p from adult) d group by p) q", "adult.id"),
    ("select * from (select (id), count(*) as n from adult group by (id)) q order by n desc limit 5", "adult.id"),
    # a branch of a set operation an outer query reads, or the set operation alone (its branches are read as
    # released rows too)
    ("select count(*) from (select id, count(*) as n from adult group by id union all select 0, count(*) "
     "from adult) q", "adult.id"),
    ("select id, count(*) from adult group by id union all select 0, count(*) from adult", "adult.id"),
    # the aggregate query grouped by the unit is the second one the outer query joins
    ("select count(*) from (select sex, count(*) as n from adult group by 1) a join (select id, count(*) as m "
     "from adult group by id) b on a.n = b.m", "adult.id"),
]

# An outer query over an aggregate query grouped by something else, and that aggregate query alone.
NEAR_MISSES = [
    ("select avg(n) from (select education, count(*) as n from adult group by 1) q",
     "select education, count(*) as n from adult group by 1"),
    ("select avg(n) from (select education as id, count(*) as n from adult group by 1) q",
     "select education as id, count(*) as n from adult group by 1"),
    ("select avg(n) from (select channel as person_id, count(*) as n from visits group by 1) q",
     "select channel as person_id, count(*) as n from visits group by 1"),
]


def budget_left(conn: psycopg.Connection[Any]) -> str:
    return conn.execute("show anonproxy.budget").fetchone()[0]


def _refused(conn: psycopg.Connection[Any], sql: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(sql)
    error = caught.value
    assert error.sqlstate == "0A000", (sql, error.sqlstate, error.diag.message_primary)
    assert (error.diag.message_hint or "").startswith("Ask the statistic over people directly"), sql
    assert "count(DISTINCT <unit>)" in (error.diag.message_hint or ""), sql
    return error


@pytest.mark.parametrize(("sql", "unit"), GROUPED_BY_UNIT)
def test_reporter_refused_over_unit_groups(reporter: psycopg.Connection[Any], sql: str, unit: str) -> None:
    error = _refused(reporter, sql)
    assert error.diag.message_primary == (
        f"an outer query over an aggregate query grouped by the privacy unit {unit} is not supported: each group is "
        "one person, none can be released, so the outer query would read only the suppressed-rest row")


@pytest.mark.parametrize(("sql", "unit"), GROUPED_BY_UNIT)
def test_dp_refused_over_unit_groups_and_charged_nothing(analyst: psycopg.Connection[Any], sql: str,
                                                         unit: str) -> None:
    before = budget_left(analyst)
    error = _refused(analyst, sql)
    assert error.diag.message_primary == (
        f"an outer query over an aggregate query grouped by the privacy unit {unit} is not supported: each group "
        "is one person, partition selection releases almost none of them, so the outer query would read "
        "(almost) no row")
    assert budget_left(analyst) == before, "a refusal costs nothing"


def test_the_hints_own_question_is_answered(reporter: psycopg.Connection[Any], analyst: psycopg.Connection[Any],
                                            truth: psycopg.Connection) -> None:
    """The hint's example, asked directly: PostgreSQL's answer (about 3 visits per person) for the reporter, a
    noisy number for the dp role."""
    sql = ("SELECT count(visits.visit_id)::numeric / count(DISTINCT adult.id) FROM adult LEFT JOIN visits "
           "ON visits.person_id = adult.id")
    (expected,) = truth.execute(sql).fetchone()
    assert reporter.execute(sql).fetchone() == (expected,)
    assert Decimal(2) < expected < Decimal(4)
    (noisy,) = analyst.execute(sql).fetchone()
    assert noisy is not None and noisy > 0


def test_plain_group_by_unit_is_still_answered(reporter: psycopg.Connection[Any], truth: psycopg.Connection) -> None:
    """Not nested, the rows are the client's to read: every group withheld, the rest row counts everyone."""
    (everyone,) = truth.execute("select count(*) from adult").fetchone()
    assert reporter.execute("select id, count(*) from adult group by id").fetchall() == [(None, everyone)]


@pytest.mark.parametrize(("sql", "inner"), NEAR_MISSES)
def test_reporter_near_misses_answered_over_released_rows(reporter: psycopg.Connection[Any],
                                                          truth: psycopg.Connection, sql: str, inner: str) -> None:
    released = [n for _, n in reporter.execute(inner).fetchall()]
    assert len(released) > 1
    (got,) = reporter.execute(sql).fetchone()
    assert got == pytest.approx(Decimal(sum(released)) / len(released))
    # every group holds at least k people: PostgreSQL's own answer
    if len(released) == len(truth.execute(inner).fetchall()):
        assert got == truth.execute(sql).fetchone()[0]


@pytest.mark.parametrize(("sql", "inner"), NEAR_MISSES)
def test_dp_near_misses_answered(analyst: psycopg.Connection[Any], sql: str, inner: str) -> None:
    """Answered over the released noisy counts (a row, not NULL: the big groups pass partition selection)."""
    rows = analyst.execute(sql).fetchall()
    assert len(rows) == 1 and rows[0][0] is not None and rows[0][0] > 0
