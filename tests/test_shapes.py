"""Issue 11: the query shapes BI tools send, in both modes (anonproxy.plan).

Decide-level: derived tables and WITH queries that filter, project or rename are flattened into the SELECT
the back-ends already analyse; outer queries over aggregate queries and Superset's series limit are taken
apart; three-part names are normalised; everything else nested is refused with a hint.

Through the real gated proxy: `reporter` (suppress, k = 10, rest row on) gets exactly the rows of the
un-nested equivalent, under the column names PostgreSQL gives the client's statement (checked against the
statement run directly as superuser); a fresh dp role (test_dp_proxy's `analyst`: ε 2, 0.5 per query) gets
noisy answers, the outer query over a chart query costs nothing more, and the series limit is charged and
explained as two questions.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import Endpoint
from test_dp_proxy import analyst, budget_left  # noqa: F401 - fixtures
from test_rewrite import POLICY, SUPPRESS

from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.plan.refusals import Reject
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy, Rewrite

DP = dataclasses.replace(SUPPRESS, mode="dp")
PARAMS = DPParams(epsilon=1, delta=1e-6)

# (client's nested statement, its un-nested equivalent)
FLATTENED = [
    # Power BI: a visual over a navigation step, then nested steps with a filter and a rename
    ('select "rows"."education" as "education", count(*) as "a0" from (select "_"."education" from '
     '"public"."adult" "_") "rows" group by "education"',
     'select education as "education", count(*) as "a0" from adult group by education'),
    ('select "_"."education", count(*) from (select "_"."education" from (select "_"."education", "_"."age" '
     'from "public"."adult" "_" where "_"."age" > 30) "_") "_" group by "_"."education"',
     "select education, count(*) from adult where age > 30 group by education"),
    ('select "_"."Age", count(*) from (select "_"."age" as "Age" from "public"."adult" "_") "_" '
     'group by "_"."Age"', 'select age as "Age", count(*) from adult group by age'),
    # Superset's virtual dataset
    ("SELECT education AS education, count(*) AS count FROM (SELECT * FROM public.adult) AS virtual_table "
     "GROUP BY education ORDER BY count DESC LIMIT 10000",
     "SELECT education, count(*) AS count FROM adult GROUP BY education ORDER BY count DESC LIMIT 10000"),
    ("select sex, count(*) from (select * from adult where age between 20 and 40) v group by sex",
     "select sex, count(*) from adult where age between 20 and 40 group by sex"),
    # WITH queries, one using the other, and a column list on the alias
    ("with t as (select age, education from adult where age > 30) select education, count(*) from t "
     "group by education", "select education, count(*) from adult where age > 30 group by education"),
    ("with a as (select * from adult where sex = 'Male'), b as (select a.race as r from a where a.age < 50) "
     "select b.r, count(*) from b group by b.r",
     "select race as r, count(*) from adult where sex = 'Male' and age < 50 group by race"),
    ("select q.s, count(*) from (select sex, race from adult) as q(s) group by q.s",
     "select sex as s, count(*) from adult group by sex"),
    # a derived table that joins a linked table on its declared key
    ("select d.sex, count(*) from (select a.sex, v.cost from adult a join visits v on v.person_id = a.id "
     "where v.cost > 10) d group by d.sex",
     "select a.sex, count(*) from adult a join visits v on v.person_id = a.id where v.cost > 10 group by a.sex"),
    # a joined derived table: its WHERE moves into ON; an inner name the outer query uses is renamed
    ("select a.sex, count(v.cost) from adult a left join (select * from visits where cost > 10) v "
     "on v.person_id = a.id group by a.sex",
     "select a.sex, count(v.cost) from adult a left join visits v on v.person_id = a.id and v.cost > 10 "
     "group by a.sex"),
    ("select d.sex, count(*) from (select a.sex, a.id from adult a) d join visits a on a.person_id = d.id "
     "group by d.sex",
     "select b.sex, count(*) from adult b join visits a on a.person_id = b.id group by b.sex"),
    # an unaliased function is referable under PostgreSQL's name for it
    ("select d.upper, count(*) from (select upper(sex) from adult) d group by d.upper",
     "select upper(sex) as upper, count(*) from adult group by 1"),
    # three-part names
    ('select "public"."adult"."sex", avg("public"."adult"."age") from "public"."adult" '
     'group by "public"."adult"."sex"', "select sex, avg(age) from adult group by sex"),
]

# Power BI's DirectQuery visual: an outer query over the aggregate of a navigation step
POWER_BI = ('select "_"."education", "_"."a0" from (select "rows"."education" as "education", count(1) as "a0" '
            'from (select "_"."education" from "public"."adult" "_") "rows" group by "education") "_" '
            'where not "_"."a0" is null limit 1000001')
OUTER = [
    POWER_BI,
    "select count(*) as rowcount from (select education, count(*) from adult group by education) as rowcount_qry",
    "select * from (select education, count(*) as n from adult group by education) q where n > 100 "
    "order by n desc limit 3",
    "select education as e, n from (select education, count(*) as n from adult group by education) q order by e",
]
# Superset over a virtual dataset: the ON condition's names are bare (superset/models/helpers.py: gby == column(k__))
VIRTUAL_SERIES = ("SELECT education AS education, count(*) AS count FROM (SELECT * FROM public.adult) AS "
                  "virtual_table JOIN (SELECT education AS education__, count(*) AS mme_inner__ FROM (SELECT * FROM "
                  "public.adult) AS virtual_table GROUP BY education ORDER BY mme_inner__ DESC LIMIT 5) AS "
                  "series_limit ON education = education__ GROUP BY education ORDER BY count DESC LIMIT 10000")
SERIES = ("SELECT education AS education, count(*) AS count FROM public.adult JOIN (SELECT education AS "
          "education__, count(*) AS mme_inner__ FROM public.adult GROUP BY education ORDER BY mme_inner__ DESC "
          "LIMIT 5) AS series_limit ON education = series_limit.education__ GROUP BY education "
          "ORDER BY count DESC LIMIT 10000")

REFUSED = [
    ("select n, count(*) from (select age as n from adult limit 10) d group by n", "LIMIT inside a derived table"),
    ("select n, count(*) from (select age as n from adult order by age) d group by n", "ORDER BY inside"),
    ("select n, count(*) from (select row_number() over () as n from adult) d group by n", "window"),
    ("select x, count(*) from (select age as x from adult union select age from adult) d group by x", "UNION"),
    # a WITH query read twice is two copies of its body: here a self-join of the protected table
    ("with t as (select * from adult) select count(*) from t join t as u on true", "only one protected table"),
    ("with t as (select * from adult), u as (select * from adult) select count(*) from t", "never used"),
    # a WITH query read only inside a set operation's branches is used: refused for the set operation's branch
    # that reads rows (tests/test_set_operations.py answers set operations of aggregate queries)
    ("with t as (select age from adult) select * from (select count(*) as m from t union all "
     "(select age from t)) s", "UNION"),
    ("with recursive t as (select * from adult) select count(*) from t", "RECURSIVE"),
    ('select "_"."age", count(*) from (select "_"."age" from adult "_") "rows" group by 1', "FROM clause"),
    ("select public.adult.age, count(*) from (select sex from public.adult) d group by 1", "FROM clause"),
    ("select count(*) from (select a.*, v.* from adult a join visits v on v.person_id = a.id) d "
     "group by d.cost", "one *"),
    ("select d.x, count(*) from (select age as x, sex as x from adult) d group by d.x", "ambiguous"),
    ("select d.nope, count(*) from (select age from adult) d group by d.nope", "does not exist"),
    ("select count(*) from (select education, count(*) as n from adult group by 1) q "
     "join (select sex from adult) r on true", "cannot be joined"),
    ("select count(*) from (select education, count(*) as n from adult group by 1) q where q.age > 3",
     "not an output column"),
    ("select count(*) from (select education, count(*) as n from adult group by 1) q where n > $1",
     "parameters"),
    ("with t as (select education, count(*) as n from adult group by 1) select sex, count(*) from t group by sex",
     "not an output column"),
    ("select count(*) from (select x.* from adult) d", "names no table"),
    # Superset's "group others" variant joins the top groups with LEFT JOIN and labels the rest: not supported
    ("SELECT education, count(*) FROM adult LEFT OUTER JOIN (SELECT education AS education__, count(*) AS m "
     "FROM adult GROUP BY education ORDER BY m DESC LIMIT 5) AS series_limit ON education = education__ "
     "GROUP BY education", "[INNER] JOIN"),
    ("SELECT education, max(m) FROM adult JOIN (SELECT education AS education__, count(*) AS m FROM adult "
     "GROUP BY education ORDER BY m DESC LIMIT 5) AS series_limit ON education = education__ GROUP BY education",
     "only in its ON condition"),
]


def _plain_plan(sql: str) -> DPPlan:
    plan = plan_dp(sql, DP, POLICY, PARAMS)
    assert isinstance(plan, DPPlan), plan
    return plan


@pytest.mark.parametrize(("nested", "flat"), FLATTENED)
def test_flattened_statements_are_rewritten_like_their_plain_equivalent(nested: str, flat: str) -> None:
    assert isinstance(decide(nested, SUPPRESS, POLICY), Rewrite)
    assert isinstance(decide(nested, DP, POLICY), Noisy)
    if "avg" in flat:
        return  # dp: age has no declared bounds in this policy
    mine, theirs = _plain_plan(nested), _plain_plan(flat)
    assert [c.name for c in mine.columns] == [c.name for c in theirs.columns]
    assert (mine.epsilon, mine.delta, len(mine.statistics), mine.nested) == (theirs.epsilon, theirs.delta,
                                                                          len(theirs.statistics), None)


def test_outer_queries_and_series_limit_are_planned_in_both_modes() -> None:
    for sql in [*OUTER, SERIES, VIRTUAL_SERIES]:
        rewrite = decide(sql, SUPPRESS, POLICY)
        assert isinstance(rewrite, Rewrite), rewrite
        plan = _plain_plan(sql)
        assert plan.nested is not None
    inner = _plain_plan("select education, count(*) from adult group by education")
    outer = _plain_plan(OUTER[1])
    assert dataclasses.replace(outer, nested=None) == inner, "the outer query asks the chart's own question"


@pytest.mark.parametrize(("sql", "words"), REFUSED)
def test_other_nested_shapes_are_refused_with_a_hint(sql: str, words: str) -> None:
    for role in (SUPPRESS, DP):
        decision = decide(sql, role, POLICY)
        if isinstance(decision, Noisy):
            decision = plan_dp(sql, role, POLICY, PARAMS)
        assert isinstance(decision, Reject), (sql, decision)
        assert words.lower() in decision.message.lower(), decision
        assert decision.hint and decision.sqlstate in ("0A000", "42501")


def test_three_part_names_reach_dp_as_columns() -> None:
    sql = 'select avg("public"."adult"."hours_per_week"), count(*) from "public"."adult"'
    decision = plan_dp(sql, DP, POLICY, PARAMS)
    assert isinstance(decision, Reject) and "declared bounds" in decision.message, decision  # not "an expression"


def test_parse_count_benchmark_runs() -> None:
    """benchmarks/parses prints how many times sqlglot parses each statement (the figures of the report)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks" / "parses"))
    import count_parses  # type: ignore[import-not-found]

    figures = count_parses.measure()
    for mode in ("suppress", "dp"):  # flattening reads the rendered statement once more, no other parse
        assert 1 <= figures[f"power bi, {mode}"] <= figures[f"flat, {mode}"] + 1, figures


# --- through the proxy ---------------------------------------------------------------------------------------


def dp_session(proxy: Endpoint, dbname: str, role: str) -> psycopg.Connection[Any]:
    """A connection of a fresh dp role, once the worker that serves it knows the role (the fixture waits for one
    worker only, and the proxy runs two)."""
    deadline = time.monotonic() + 30
    while True:
        # A new connection each time: a session keeps the mode its worker knew at login.
        conn = psycopg.connect(proxy.dsn(dbname, user=role), autocommit=True)
        try:
            if conn.execute("show anonproxy.mode").fetchone() == ("dp",):
                return conn
        except psycopg.Error:
            pass
        conn.close()
        assert time.monotonic() < deadline, "the proxy did not learn the role's mode"
        time.sleep(0.05)


def _names(cursor: psycopg.Cursor[Any]) -> list[str]:
    assert cursor.description is not None
    return [column.name for column in cursor.description]


@pytest.fixture
def reporter(gated_proxy: Endpoint, gated_database: str) -> Any:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        yield conn


def test_reporter_gets_the_plain_equivalents_rows_under_postgres_names(
        reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    for nested, flat in [pair for pair in FLATTENED if "visits" not in pair[0]]:  # the demo has no linked table
        got = reporter.execute(nested)
        rows = sorted(got.fetchall(), key=repr)
        assert _names(got) == _names(truth.execute(nested)), nested
        assert rows == sorted(reporter.execute(flat).fetchall(), key=repr), nested
        assert rows, nested


def test_reporter_outer_queries_post_process_the_released_rows(
        reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    chart = reporter.execute("select education, count(*) from adult group by education").fetchall()
    visual = reporter.execute(POWER_BI)
    assert _names(visual) == ["education", "a0"]
    assert sorted(visual.fetchall(), key=repr) == sorted(((e, n) for e, n in chart if n is not None), key=repr)
    got = reporter.execute(OUTER[1])
    assert _names(got) == ["rowcount"]
    assert got.fetchall() == [(len(chart),)], "every released row, the rest row included"
    top = reporter.execute(OUTER[2])
    assert _names(top) == _names(truth.execute(OUTER[2]))
    released = sorted(((e, n) for e, n in chart if e is not None and n > 100), key=lambda r: -r[1])
    assert top.fetchall() == released[:3]
    zero = reporter.execute("select education, 100 / (n - n) as share, n * 2 / 4 as half from (select education, "
                            "count(*) as n from adult group by education) q").fetchall()
    assert zero and all(share is None for _, share, _ in zero), "a division by zero gives NULL, not an error"
    assert sorted((e, h) for e, _, h in zero if e) == sorted((e, n * 2 // 4) for e, n in chart if e)


def test_reporter_series_limit_is_the_top_groups_then_the_chart(
        reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    top = reporter.execute("SELECT education, count(*) FROM adult GROUP BY education ORDER BY 2 DESC LIMIT 5")
    keys = [education for education, _ in top.fetchall()]
    got = reporter.execute(SERIES)
    assert _names(got) == _names(truth.execute(SERIES))
    rows = got.fetchall()
    assert [education for education, _ in rows] == keys
    assert reporter.execute(VIRTUAL_SERIES).fetchall() == rows
    everything = dict(reporter.execute("select education, count(*) from adult group by education").fetchall())
    assert all(everything[education] == n for education, n in rows)


def test_dp_role_answers_the_shapes(gated_proxy: Endpoint, gated_database: str, analyst: str,  # noqa: F811
                                   truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    notices: list[str] = []
    with dp_session(gated_proxy, gated_database, analyst) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        visual = conn.execute(POWER_BI)
        assert _names(visual) == _names(truth.execute(POWER_BI)) == ["education", "a0"]
        counts = dict(visual.fetchall())
        exact = dict(truth.execute("select education, count(*) from adult group by education").fetchall())
        assert set(counts) == set(exact) and all(abs(counts[k] - exact[k]) <= 30 for k in exact)
        assert "epsilon 1.5 of 2 left" in budget_left(conn)
        chart = conn.execute("select education, count(*) from adult group by education").fetchall()
        rowcount = conn.execute(OUTER[1])
        assert _names(rowcount) == ["rowcount"] and rowcount.fetchall() == [(len(chart),)]
        assert "epsilon 1 of 2 left" in budget_left(conn), "the outer query reuses the chart's paid answer"
        explained = [row[0] for row in conn.execute("explain (anonproxy) " + SERIES)]
        assert sum("costs ε=0.5" in line for line in explained) == 2, explained
        moved = [line for line in explained if line.startswith("running it moves ε spent on public.adult by ")]
        assert len(moved) == 1 and moved[0].endswith(" of 2"), explained  # both questions, in one figure
        series = conn.execute(SERIES)
        assert _names(series) == ["education", "count"]
        rows = series.fetchall()
        assert 1 <= len(rows) <= 5 and {education for education, _ in rows} <= set(exact)
        # Its top-N question is the chart's measurement re-sorted and re-limited: already paid for (issue 12, cache by
        # meaning); its second question, restricted to the released keys, is a new one.
        assert "epsilon 0.5 of 2 left" in budget_left(conn), "the series limit pays for its new question only"


def test_bound_parameters_in_nested_shapes(gated_proxy: Endpoint, gated_database: str, analyst: str,  # noqa: F811
                                           reporter: psycopg.Connection[Any]) -> None:
    """The extended protocol (Parse, Describe, Bind, Execute) with $n in the inner query, as drivers send it."""
    rowcount = ("select count(*) as rowcount from (select education, count(*) from adult where age > %s "
                "group by education) q")
    flat = "select education, count(*) from adult where age > %s group by education"
    chart = reporter.execute(flat, [30], prepare=True).fetchall()
    got = reporter.execute(rowcount, [30], prepare=True)
    assert _names(got) == ["rowcount"] and got.fetchall() == [(len(chart),)]
    with dp_session(gated_proxy, gated_database, analyst) as conn:
        got = conn.execute(rowcount, [30], prepare=True)
        assert got.description is not None and got.description[0].type_code == 20  # bigint, as PostgreSQL says
        assert got.fetchone()[0] == len(conn.execute(flat, [30]).fetchall())
        assert "epsilon 1.5 of 2 left" in budget_left(conn), "one question, asked twice"


def test_dp_three_part_names_are_columns(gated_proxy: Endpoint, gated_database: str, analyst: str,  # noqa: F811
                                        truth: psycopg.Connection[Any]) -> None:  # noqa: F811
    """Metabase's spelling: before issue 11, dp refused AVG("public"."adult"."hours_per_week") as an expression."""
    sql = 'SELECT AVG("public"."adult"."hours_per_week") AS "avg" FROM "public"."adult"'
    exact = float(truth.execute(sql).fetchone()[0])
    with dp_session(gated_proxy, gated_database, analyst) as conn:
        got = conn.execute(sql)
        assert _names(got) == ["avg"]
        assert abs(float(got.fetchone()[0]) - exact) < 1.0
