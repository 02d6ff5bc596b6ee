"""Aggregate forms and post-aggregate expressions, in both modes (issue 11).

FILTER (WHERE ...), count(1), sum(1), sum/avg over CASE ... THEN constant, count(DISTINCT column) in suppress mode;
round(avg(x), 1), sum(x) / count(*), 100.0 * avg(CASE ...), coalesce(sum(x), 0), abs(0), 'label', casts and CASE
over aggregates, computed on released values only. Decisions first, then through the proxy for the `reporter`
(suppress, k = 10, dominance and p% rules, the suppressed-rest row) and a fresh dp role.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from decimal import Decimal
from fractions import Fraction

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role
from suppression_oracle import Magnitudes, Verdict, suppress
from test_dp_plan import POLICY as DP_POLICY
from test_dp_plan import ROLE as DP_ROLE
from test_dp_proxy import analyst, budget_left  # noqa: F401  (fixtures)
from test_rewrite import POLICY, SUPPRESS, suppress_role

from anonproxy.dp.finish import finish
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.plan.post_aggregate import output_name
from anonproxy.plan.refusals import Reject
from anonproxy.policy.yaml_policy import demo_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite

K = 10
PARAMS = DPParams(epsilon=1.0, delta=1e-6)


def rewritten(sql: str, role=SUPPRESS) -> str:
    decision = decide(sql, role, POLICY)
    assert isinstance(decision, Rewrite), decision
    return decision.sql


def dp_plan(sql: str) -> DPPlan:
    plan = plan_dp(sql, DP_ROLE, DP_POLICY, PARAMS)
    assert isinstance(plan, DPPlan), plan
    return plan


# --- decisions ------------------------------------------------------------------------------------------------


BASELINE = [
    "select round(avg(age), 1) from adult",
    "select sum(capital_gain) / count(*) from adult",
    "select 100.0 * avg(case when sex = 'Male' then 1 else 0 end) from adult",
    "select coalesce(sum(age), 0) from adult",
    "select abs(0), count(*) from adult",
    "select count(*) filter (where age > 40) from adult",
    "select sum(capital_gain)::float / nullif(count(*), 0) from adult",
    "select sex, greatest(sum(age), 0), least(avg(age), 50), trunc(avg(age)), ceil(avg(age)), floor(avg(age)), "
    "sign(sum(age) - 5), nullif(count(*), 0), case when count(*) > 100 then 'many' else 'few' end from adult "
    "group by sex",
]


@pytest.mark.parametrize("sql", BASELINE)
def test_refused_before_now_rewritten_in_suppress_mode(sql: str) -> None:
    rewritten(sql)


@pytest.mark.parametrize("sql", [*BASELINE[:3], BASELINE[4], BASELINE[5],
                                 "select count(1), sum(1) from adult",
                                 "select sum(case when age > 40 then 1 else 0 end) from adult"])
def test_refused_before_now_planned_in_dp_mode(sql: str) -> None:
    # test_dp_plan's policy: age and hours_per_week have bounds (capital_gain has none there: it is replaced)
    dp_plan(sql.replace("capital_gain", "hours_per_week"))


def test_post_aggregate_expressions_run_over_the_materialized_suppressed_result() -> None:
    sql = rewritten("select education, sum(capital_gain) / count(*) as r from adult group by education "
                    "having 1 / (count(*) - 37) > 0 order by r desc limit 3")
    inner, outer = sql.rsplit("\n)\nSELECT ", 1)  # the suppressed answer, then the client's select list over it
    assert "anonproxy_released AS MATERIALIZED (" in inner
    assert "1 /" not in inner and "37" not in inner, "HAVING is not evaluated before suppression"
    assert "(anonproxy_v1 / NULLIF(anonproxy_v2, 0)) AS \"r\"" in outer
    assert "WHERE ((1 / NULLIF(((anonproxy_v2 - 37)), 0)) > 0)" in outer
    assert outer.endswith("ORDER BY 2 DESC\nLIMIT 3")


def test_division_by_a_nonzero_constant_is_left_alone() -> None:
    sql = rewritten("select sum(age) / 2, sum(age) / 0, avg(age) / nullif(count(*), 0) from adult")
    assert "(anonproxy_v1 / 2)" in sql and "(anonproxy_v1 / NULLIF(0, 0))" in sql
    assert "(anonproxy_v2 / nullif(anonproxy_v3, 0))" in sql


def test_plain_queries_keep_their_shape() -> None:
    """Without post-aggregate expressions and with a magnitude rule on a sum, where rows are not known to be people
    (the per-person shape), nothing moves: the client's select list, HAVING and ORDER BY, rendered."""
    role = suppress_role(k=10, dominance_n=2, dominance_percent=80)
    sql = rewritten("select sex, count(*), sum(age)::bigint from adult group by sex having count(*) > 20 order by 2",
                    role)
    assert "MATERIALIZED" not in sql
    answer = sql.rsplit("\n)\n", 1)[1]  # the statement after the verdicts' CTEs
    assert answer == ('SELECT sex AS "sex", count(*) AS "count", CAST(sum(age) AS BIGINT) AS "sum"\n'
                      'FROM "public"."adult"\n'
                      "GROUP BY sex\n"
                      "HAVING (count(*) > 20)\n"
                      "   AND ARRAY[sex] IN (SELECT ARRAY[g1] FROM anonproxy_groups WHERE released)\n"
                      "ORDER BY 2")


def test_filter_counts_the_contributors_of_the_filtered_rows() -> None:
    sql = rewritten("select sex, count(*) filter (where age > 40), sum(age) filter (where age = 90) from adult "
                    "group by sex")
    # Each person contributes to count(*) FILTER (WHERE c) when c holds for one of their rows, to
    # sum(x) FILTER (WHERE c) when x is not zero there: k such people per group, and in the withheld groups together
    assert "bool_or((CASE WHEN (age > 40) THEN 1 END) IS NOT NULL) AS n1" in sql
    assert "bool_or((CASE WHEN (age = 90) THEN (age) END) <> 0) AS n2" in sql
    assert ('count(DISTINCT "adult"."id") FILTER (WHERE (CASE WHEN (age > 40) THEN 1 END) IS NOT NULL) AS n1, '
            'count(DISTINCT "adult"."id") FILTER (WHERE (CASE WHEN (age = 90) THEN (age) END) <> 0) AS n2') in sql
    assert "AND s.n1 >= 10\n       AND s.n2 >= 10" in sql
    assert "AND contributors_n1 >= 10 AND contributors_n2 >= 10" in sql
    rules = suppress_role(k=5, dominance_n=2, dominance_percent=80, p_percent=10, suppressed_rest=True)
    cells = rewritten("select sex, sum(age) filter (where age > 40) from adult group by sex", rules)
    assert "sum(CASE WHEN (age > 40) THEN (age) END) AS s1" in cells, "magnitude rules see the filtered sums"


def test_filter_condition_is_checked_like_an_aggregate_argument() -> None:
    """count(*) FILTER (WHERE c) is count(CASE WHEN c THEN 1 END): an identifying column is refused there as inside
    any aggregate (next to count(*), FILTER (WHERE id <> 17) would say which group person 17 is in)."""
    for role, policy in ((SUPPRESS, POLICY), (DP_ROLE, DP_POLICY)):
        for condition in ("id = 17", "id <> 17"):
            decision = decide(f"select sex, count(*) filter (where {condition}) from adult group by sex", role, policy)
            if role.mode == "dp":
                decision = plan_dp(f"select sex, count(*) filter (where {condition}) from adult group by sex", role,
                                   policy, PARAMS)
            assert isinstance(decision, Reject) and decision.sqlstate == "42501", decision
            assert "identifying column id" in decision.message
    decision = decide("select count(*) filter (where age / 0 = 1) from adult", SUPPRESS, POLICY)
    assert isinstance(decision, Reject) and decision.sqlstate == "0A000" and "age / 0" in decision.message
    decision = decide("select count(*) filter (where count(*) > 1) from adult", SUPPRESS, POLICY)
    assert isinstance(decision, Reject) and "aggregate" in decision.message


def test_output_names_are_postgresqls() -> None:
    import sqlglot
    names = {"round(avg(age), 1)": "round", "sum(x)::float": "sum", "(sum(x) * 2)::int": "int4",
             "case when count(*) > 1 then 1 end::text": "text", "100.0 * avg(x)": "?column?",
             "coalesce(sum(x), 0)": "coalesce", "count(*) filter (where a > 1)": "count", "'label'": "?column?",
             "true": "bool", "ceiling(avg(x))": "ceiling", "greatest(1, 2)": "greatest", "x": "x"}
    for text, name in names.items():
        assert output_name(sqlglot.parse_one(text, read="postgres"), text) == name, text


def test_dp_filter_is_charged_like_a_count_and_sum_1_like_a_count_of_sensitivity_1() -> None:
    plan = dp_plan("select count(*) filter (where age > 40), count(1), count(*), sum(1) from adult")
    by_kind = {stat.argument: stat for stat in plan.statistics}
    assert len(plan.statistics) == 3, "count(1) and count(*) are one statistic"
    filtered, total, ones = by_kind["CASE WHEN (age > 40) THEN 1 END"], by_kind[None], by_kind["1"]
    assert filtered.kind == "count" and filtered.sensitivity == 1
    assert ones.kind == "sum" and ones.sensitivity == 1 and ones.clamp == (1, 1)
    assert total.kind in ("units", "rows") and total.sensitivity == 1
    assert all(stat.epsilon == Fraction(1, 3) for stat in plan.statistics), "ε split evenly over 3 statistics"
    assert [column.kind for column in plan.columns] == ["count", "count", "count", "sum"]
    assert [column.name for column in plan.columns] == ["count", "count", "count", "sum"]


def test_dp_bounds_from_case_arms() -> None:
    plan = dp_plan("select sum(case when age > 40 then 1 else 0 end), avg(case when age > 40 then 5 when age > 30 "
                   "then -2 end), sum(case when age > 40 then age end) from adult")
    sums = [stat for stat in plan.statistics if stat.kind == "sum"]
    assert {stat.clamp for stat in sums} == {(0, 1), (-2, 5), (17, 90)}
    refused = plan_dp("select sum(case when age > 40 then fnlwgt else 0 end) from adult", DP_ROLE, DP_POLICY,
                      PARAMS)
    assert isinstance(refused, Reject) and "bounds" in refused.message
    refused = plan_dp("select count(distinct case when id = 1 then sex end) from adult", DP_ROLE, DP_POLICY, PARAMS)
    assert isinstance(refused, Reject) and "identifying column" in refused.message


def test_dp_post_process_merges_computed_columns_having_and_order() -> None:
    plan = dp_plan("select sex, round(avg(age), 1) as a, count(*) from adult group by sex having count(*) / 2 > 0 "
                   "order by 3 desc")
    assert plan.post is not None and plan.post.having and plan.post.computed == (1,)
    assert "unnest($1, $2" in plan.post.sql and "NULLIF" not in plan.post.sql.split("AS anonproxy_keep")[0]
    released = [("Female", None, 5, 40, 5), ("Male", None, 9, 41, 9)]  # key, post, count, hidden avg, hidden count
    released = [row[:len(plan.columns) + len(plan.hidden)] for row in released]
    computed = [(2, Decimal("41.0"), True), (1, Decimal("40.0"), False)]
    rows, _ = finish(plan, released, computed)
    assert rows == [("Male", Decimal("41.0"), 9)]


def test_dp_group_by_expressions_inside_expressions_over_aggregates_are_passed_as_released_keys() -> None:
    plan = dp_plan("select sex, case when sex = 'Male' then count(*) end from adult group by sex "
                   "having sex = 'Male' or sum(age) / count(*) > 3")
    assert plan.post is not None and "anonproxy_g1" in plan.post.sql and plan.having is None
    assert [column.kind for column in plan.hidden][:1] == ["key"]
    refused = plan_dp("select sex, round(avg(age), $1) from adult group by sex", DP_ROLE, DP_POLICY, PARAMS)
    assert isinstance(refused, Reject) and "$n" in refused.message and refused.hint


# --- through the proxy -------------------------------------------------------------------------------------------


SUPPRESS_QUERY = ("select education, round(avg(age), 1) as a, sum(capital_gain) / count(*) as r, "
                  "count(*) filter (where age > 40) as older, coalesce(sum(age), 0), "
                  "100.0 * avg(case when sex = 'Male' then 1 else 0 end) as pct, count(1), sum(1), "
                  "count(distinct race), abs(0), 'label' from adult group by education")


def reporter_verdict(truth: psycopg.Connection, key: str, contributors: dict[str, str],
                     sums: dict[str, str]) -> Verdict:
    """The demo reporter's verdict on ``GROUP BY key`` over adult, by the oracle, from the owner's rows (one row per
    person): ``contributors`` are SQL conditions that make a person a contributor to an aggregate, ``sums`` the SQL
    values a sum or avg adds up, whose contributions the dominance and p % rules look at."""
    params = demo_policy().role("reporter").suppression
    assert params is not None and params.dominance_n is not None and params.dominance_percent is not None
    columns = [key, *(f"({c})" for c in contributors.values()), *(f"({v})" for v in sums.values())]
    rows = truth.execute(f"select id, {', '.join(columns)} from adult").fetchall()
    everyone = truth.execute("select count(distinct id) from adult").fetchone()[0]
    groups: dict[object, set[int]] = defaultdict(set)
    helping: dict[str, dict[object, set[int]]] = {name: defaultdict(set) for name in contributors}
    parts: dict[str, dict[object, dict[int, object]]] = {name: defaultdict(dict) for name in sums}
    for person, group, *values in rows:
        groups[group].add(person)
        for name, flag in zip(contributors, values[:len(contributors)], strict=True):
            if flag:
                helping[name][group].add(person)
        for name, value in zip(sums, values[len(contributors):], strict=True):
            parts[name][group][person] = value or 0
    return suppress(groups, k=params.k, everyone=everyone, contributors=helping, sums=parts,
                    magnitudes=Magnitudes((params.dominance_n, params.dominance_percent), params.p_percent),
                    rest=params.suppressed_rest)


@pytest.fixture
def reporter(gated_proxy: Endpoint, gated_database: str):
    connection = psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True)
    yield connection
    connection.close()


def test_suppress_results_equal_the_direct_query_over_released_groups(reporter: psycopg.Connection,
                                                                      truth: psycopg.Connection) -> None:
    cursor = reporter.execute(SUPPRESS_QUERY)
    rows = cursor.fetchall()
    expected_cursor = truth.execute(SUPPRESS_QUERY)
    expected = {row[0]: row for row in expected_cursor.fetchall()}
    assert [(c.name, c.type_code) for c in cursor.description] == \
        [(c.name, c.type_code) for c in expected_cursor.description]
    released = [row for row in rows if row[0] is not None]
    # The oracle decides from each person's part of every aggregate the rules look at: contributors to the FILTER,
    # the sums and averages (non-zero values), count(1) and count(distinct race) (non-null values); magnitudes of
    # sum(capital_gain), avg(age), sum(age), avg(CASE ...) and sum(1).
    verdict = reporter_verdict(truth, "education", contributors={
        "older": "age > 40", "gain": "capital_gain <> 0", "age": "age <> 0", "male": "sex = 'Male'",
        "all": "true"}, sums={"gain": "capital_gain", "age": "age", "male": "case when sex = 'Male' then 1 else 0 end",
                              "one": "1"})
    assert {row[0] for row in released} == verdict.released and len(verdict.released) >= len(expected) // 2
    assert all(row == expected[row[0]] for row in released)
    rest = [row for row in rows if row[0] is None]
    assert [row[6] for row in rest] == ([sum(expected[e][6] for e in verdict.withheld)] if verdict.rest else [])
    assert all(row[3] >= K for row in released), "FILTER counts of released groups come from ≥ k contributors"
    assert reporter.execute(SUPPRESS_QUERY, prepare=True).fetchall() == rows  # extended protocol: same answer


def test_suppress_having_and_order_over_released_values(reporter: psycopg.Connection,
                                                        truth: psycopg.Connection) -> None:
    query = ("select education, sum(capital_gain)::float / nullif(count(*), 0) as ratio from adult "
             "group by education having round(avg(age)) > 38 order by ratio desc, 1")
    rows = reporter.execute(query).fetchall()
    expected = truth.execute(query).fetchall()
    released = [row for row in rows if row[0] is not None]
    # The verdicts do not read the HAVING; it then drops released groups as the direct query drops them.
    verdict = reporter_verdict(truth, "education", contributors={"gain": "capital_gain <> 0", "age": "age <> 0"},
                               sums={"gain": "capital_gain", "age": "age"})
    assert released == [row for row in expected if row[0] in verdict.released], "ORDER BY as the direct query"
    assert released and len(released) < len(expected)


ONE_PERSON = "age = 90 and native_country = 'Philippines'"  # quasi-identifiers that single out a few people


def test_filter_on_a_few_people_is_suppressed_by_contribution_counting(reporter: psycopg.Connection,
                                                                       truth: psycopg.Connection) -> None:
    few = truth.execute(f"select count(*) from adult where {ONE_PERSON}").fetchone()[0]
    assert 1 <= few < K
    for query in (f"select sex, count(*) filter (where {ONE_PERSON}) from adult group by sex",
                  f"select sex, count(*), sum(capital_gain) filter (where {ONE_PERSON}) from adult group by sex",
                  f"select count(*) filter (where {ONE_PERSON}) from adult where age > 30"):
        assert reporter.execute(query).fetchall() == [], query


def test_dp_post_aggregate_expressions(gated_proxy: Endpoint, gated_database: str, analyst: str,  # noqa: F811
                                       truth: psycopg.Connection) -> None:  # noqa: F811
    query = ("select round(avg(age), 1) as a, sum(capital_gain) / count(*) as r, "
             "100.0 * avg(case when sex = 'Male' then 1 else 0 end) as pct, coalesce(sum(age), 0) as s, abs(0), "
             "'label', sum(hours_per_week)::float / nullif(count(*), 0) as h, count(*) filter (where age > 40) "
             "from adult")
    expected_cursor = truth.execute(query)
    (expected,) = expected_cursor.fetchall()
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        cursor = conn.execute(query)
        (row,) = cursor.fetchall()
        assert [(c.name, c.type_code) for c in cursor.description] == \
            [(c.name, c.type_code) for c in expected_cursor.description]
        assert "epsilon 1.5 of 2 left" in budget_left(conn), "one charge of the per-query ε"
        assert conn.execute(query).fetchall() == [row], "asked again: the same answer, free"
        assert "epsilon 1.5 of 2 left" in budget_left(conn)
        prepared = conn.execute(query, prepare=True).fetchall()  # Describe answers the same types
        assert prepared == [row]
        explained = [line for (line,) in conn.execute("explain (anonproxy) " + query).fetchall()]
        assert any("cached" in line for line in explained) and "nothing was run or charged" in explained[-1]
        assert any(line.strip().startswith("avg(age): noisy sum / noisy count") for line in explained), explained
    assert abs(row[0] - expected[0]) < 1 and row[0] == round(row[0], 1)
    assert abs(row[2] - expected[2]) < 2 and row[4] == 0 and row[5] == "label"
    assert abs(row[3] - expected[3]) < 20_000 and abs(row[7] - expected[7]) < 500


def test_dp_having_over_an_expression(gated_proxy: Endpoint, gated_database: str, analyst: str) -> None:  # noqa: F811
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        rows = conn.execute("select sex, count(*) from adult group by sex having count(*) / 2 > 100 "
                            "order by 2 desc").fetchall()
        assert [row[0] for row in rows] == ["Male", "Female"]
        assert conn.execute("select sex, count(*) from adult group by sex having count(*) * 0 > 1").fetchall() == []
        rows = conn.execute("select sex, case when sex = 'Male' then count(*) end as m from adult group by sex "
                            "having sex = 'Female' or sum(age) / count(*) > 0").fetchall()
        assert [row[0] for row in rows] == ["Female", "Male"] and rows[0][1] is None and rows[1][1] > 10_000


def test_dp_type_errors_of_post_expressions_are_refused_before_the_charge(gated_proxy: Endpoint,
                                                                          gated_database: str,
                                                                          analyst: str) -> None:  # noqa: F811
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as caught:
            conn.execute("select round(sum(hours_per_week)::float, 2) from adult").fetchall()
        assert caught.value.sqlstate == "42883"  # round(double precision, integer) does not exist, as in PostgreSQL
        assert "epsilon 2 of 2 left" in budget_left(conn)



SHAPES = [
    "select sex, count(*) from adult group by sex order by round(avg(age)) desc",
    "select distinct round(avg(age), -1) from adult group by sex",
    "select sex, -sum(age), -(count(*)) from adult group by sex",
    "select sex, case count(*) when 1 then 'one' else 'many' end from adult group by sex",
    "select sex, case when sum(age) > 10 and count(*) between 1 and 5 then 1 end from adult group by sex",
    "select sex, coalesce(sum(age), count(*), 0)::text from adult group by sex",
    "select sex, sum(age)::numeric(20,2), avg(age)::varchar(5) from adult group by sex",
    "select sex, count(*) filter (where age in (30, 31)) / nullif(count(*), 0)::float from adult group by sex",
    "select sex, 1 from adult group by sex having sum(age) / count(*) > 3 and sex = 'Male'",
    "select sex, sum(age) from adult group by sex having sum(age)::bigint > 0 order by 1 limit 1 offset 1",
    "select count(*) filter (where true) from adult where age > 30",
    "select sex, greatest(count(*), 5, null), least(sum(age), 0) from adult group by sex",
    "select sex, trunc(avg(age), -1), ceiling(avg(age)), sign(-sum(age)) from adult group by sex",
    "select sex, count(*) from adult group by sex having count(*) filter (where age > 40) / 2 > 1",
    "select sex, sum(case when age > 40 then -2 when age > 20 then 3 end) from adult group by sex",
    "select sex, count(null), count('x') from adult group by sex",
]


@pytest.fixture(scope="module")
def wide_analyst(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:  # noqa: F811
    """A dp role with budget for every shape (ε 100, 0.5 per query), on public.adult."""
    with fresh_dp_role(truth, gated_proxy, gated_database, "dp_shapes", epsilon=100, delta=0.001) as role:
        yield role


@pytest.mark.parametrize("sql", SHAPES)
def test_shapes_run_in_both_modes(reporter: psycopg.Connection, gated_proxy: Endpoint, gated_database: str,
                                  truth: psycopg.Connection, wide_analyst: str, sql: str) -> None:  # noqa: F811
    """Each shape is valid SQL for PostgreSQL in both back-ends; suppress releases the direct query's rows, with
    PostgreSQL's column names and types."""
    expected = truth.execute(sql)
    expected_rows = expected.fetchall()
    cursor = reporter.execute(sql)
    rows = [row for row in cursor.fetchall() if row[0] is not None or len(row) == 1 or "group by" not in sql]
    assert [(c.name, c.type_code) for c in cursor.description] == \
        [(c.name, c.type_code) for c in expected.description]
    assert all(row in expected_rows for row in rows), (rows, expected_rows)
    with psycopg.connect(gated_proxy.dsn(gated_database, user=wide_analyst), autocommit=True) as conn:
        try:
            dp = conn.execute(sql)
        except psycopg.Error as exc:  # a refusal of dp mode, with a reason; never an internal error
            assert exc.sqlstate in ("0A000", "42501", "53400"), (exc.sqlstate, str(exc))
            assert exc.diag.message_hint
        else:
            assert [c.name for c in dp.description] == [c.name for c in expected.description]
