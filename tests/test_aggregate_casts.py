"""Aggregate arguments the BI corpus sends (issue 11), in both modes.

* widening casts of a column as the whole argument of an aggregate, as Tableau writes them:
  ``SUM(CAST("adult"."hours_per_week" AS BIGINT))``, ``AVG(CAST("adult"."age" AS DOUBLE PRECISION))``; decided on
  the column's SQL type, which the policy reads from the catalog; narrowing casts stay refused;
* ``count(id)`` on the privacy unit or another identifying column (Grafana's builder), bare only;
* variance and stddev in suppress mode (Metabase's "standard deviation"), with avg's contribution rule.

Decisions first (an in-memory policy that declares the column types), then through the proxy for the `reporter`
(suppress, k = 10) and a fresh dp role, then the attacks on the error and overflow side channels.
"""

from __future__ import annotations

import dataclasses

import psycopg
import pytest
from conftest import Endpoint
from test_dp_proxy import analyst  # noqa: F401  (fixtures)

from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.plan.refusals import Reject
from anonproxy.policy.model import (
    ColumnPolicy,
    Policy,
    ProtectedTable,
    RolePolicy,
    SuppressionParams,
)
from anonproxy.route.decide import decide
from anonproxy.route.decision import Noisy, Rewrite

K = 10
TYPES = {"id": "integer", "age": "integer", "hours_per_week": "integer", "capital_gain": "integer",
         "education": "text", "small": "smallint", "big": "bigint", "score": "numeric", "ratio": "numeric(10,2)",
         "weight": "real", "share": "double precision"}
COLUMNS = {"id": ColumnPolicy("id", "identifier"), "age": ColumnPolicy("age", lower=15, upper=100),
           "hours_per_week": ColumnPolicy("hours_per_week", lower=0, upper=100),
           "ratio": ColumnPolicy("ratio", lower=0, upper=1000)}
ADULT = ProtectedTable("public.adult", "id", COLUMNS, types=TYPES)
POLICY = Policy(version=1, tables={"public.adult": ADULT})
UNTYPED = Policy(version=1, tables={"public.adult": dataclasses.replace(ADULT, types=None)})
SUPPRESS = RolePolicy("reporter", "suppress", SuppressionParams(k=K))
DP = RolePolicy("analyst", "dp")
PARAMS = DPParams(epsilon=1.0, delta=1e-6)


def decided(sql: str, role: RolePolicy, policy: Policy = POLICY) -> Rewrite | Noisy | Reject:
    return decide(sql, role, policy)  # type: ignore[return-value]


def refused(sql: str, role: RolePolicy, *words: str, policy: Policy = POLICY) -> Reject:
    decision = decided(sql, role, policy)
    if isinstance(decision, Noisy):
        decision = plan_dp(decision.sql, role, policy, PARAMS)  # type: ignore[assignment]
    assert isinstance(decision, Reject), (sql, decision)
    assert decision.hint, decision
    for word in words:  # a|b: either (the first construct refused names the refusal)
        assert any(w.lower() in decision.message.lower() for w in word.split("|")), decision
    return decision


# --- decisions ------------------------------------------------------------------------------------------------

WIDENING = [
    'SELECT SUM(CAST("adult"."hours_per_week" AS BIGINT)) AS "sum:hours_per_week:ok" FROM "public"."adult" "adult"',
    'SELECT AVG(CAST("adult"."age" AS DOUBLE PRECISION)) FROM "public"."adult" "adult"',
    'SELECT CAST(SUM(CAST("adult"."hours_per_week" AS BIGINT)) AS DOUBLE PRECISION) / SUM(1) FROM adult',
    "select sum(age::numeric), avg(cast(age as real)), count(cast(age as bigint)) from adult",
    "select avg(ratio::float8), sum(ratio::numeric) from adult",
    "select stddev(cast(age as double precision)), var_pop(hours_per_week::int8) from adult",
    "select sum(cast(age as bigint)) filter (where hours_per_week > 40), count(hours_per_week) filter (where age > 40) "
    "from adult",
]


@pytest.mark.parametrize("sql", WIDENING)
def test_widening_casts_in_aggregates_are_rewritten_in_suppress_mode(sql: str) -> None:
    assert isinstance(decided(sql, SUPPRESS), Rewrite)


@pytest.mark.parametrize("sql", WIDENING)
def test_widening_casts_of_bounded_columns_are_planned_in_dp_mode(sql: str) -> None:
    decision = decided(sql, DP)
    assert isinstance(decision, Noisy), decision
    assert isinstance(plan_dp(decision.sql, DP, POLICY, PARAMS), DPPlan)


def test_dp_bounds_follow_the_column_through_the_cast() -> None:
    plain = plan_dp("select sum(hours_per_week) from adult", DP, POLICY, PARAMS)
    cast = plan_dp("select sum(cast(hours_per_week as bigint)) from adult", DP, POLICY, PARAMS)
    assert isinstance(plain, DPPlan) and isinstance(cast, DPPlan)
    assert [c.value_scale for c in cast.statistics] == [c.value_scale for c in plain.statistics]
    assert "CAST(hours_per_week AS BIGINT) AS anonproxy_a1" in cast.sql
    assert "LEAST(GREATEST(anonproxy_a1, 0), 100)" in cast.sql  # clamped to the column's declared bounds


# Columns without declared bounds: a cast that fails for some value of the column's type stays refused (the
# refusal names the cast and carries a hint).
NARROWING = [
    "select sum(cast(capital_gain as smallint)) from adult",
    "select sum(big::int) from adult",
    "select avg(cast(education as int)) from adult",
    "select avg(score::float8) from adult",  # a plain numeric may hold 1e-400, below double precision's range
    "select sum(share::bigint) from adult",  # NaN, Infinity, 1e300
    "select sum(weight::int8) from adult",
    "select sum(cast(capital_gain as numeric(3, 0))) from adult",
]


@pytest.mark.parametrize(("sql_type", "target", "widens"), [
    ("numeric(10,2)", "double precision", True), ("numeric(400,2)", "double precision", False),
    ("numeric(10,400)", "double precision", False), ("numeric(10,2)", "numeric", True),
    ("numeric(10,2)[]", "double precision", False), ("integer[]", "bigint", False), ("money", "numeric", False),
    ("smallint", "real", True), ("bigint", "integer", False), ("real", "double precision", True),
    ("double precision", "real", False), ("integer", "numeric(5,0)", False),
])
def test_widening_is_decided_on_the_columns_sql_type(sql_type: str, target: str, widens: bool) -> None:
    policy = Policy(version=1, tables={"public.adult": dataclasses.replace(ADULT, types={**TYPES, "x": sql_type})})
    decision = decided(f"select count(*), sum(cast(x as {target})) from adult", SUPPRESS, policy)
    assert isinstance(decision, Rewrite) is widens, decision


@pytest.mark.parametrize("sql", NARROWING)
def test_narrowing_casts_stay_refused_with_a_hint(sql: str) -> None:
    for role in (SUPPRESS, DP):
        refused(sql, role, "cast")


def test_casts_of_columns_of_unknown_type_are_refused() -> None:
    for role in (SUPPRESS, DP):
        refused("select sum(cast(capital_gain as bigint)) from adult", role, "cast", policy=UNTYPED)


@pytest.mark.parametrize("sql", ['select count(id) from adult', 'SELECT COUNT("adult"."id") FROM "public"."adult"',
                                 "select occupation, count(id) from adult where age >= 40 group by occupation",
                                 "select count(id) filter (where age > 40) from adult"])
def test_count_of_the_bare_unit_is_allowed_in_both_modes(sql: str) -> None:
    assert isinstance(decided(sql, SUPPRESS), Rewrite)
    decision = decided(sql, DP)
    assert isinstance(decision, Noisy) and isinstance(plan_dp(decision.sql, DP, POLICY, PARAMS), DPPlan)


@pytest.mark.parametrize("sql", ["select stddev_pop(age), stddev_samp(age), stddev(age), variance(age), "
                                 "var_pop(age), var_samp(age) from adult",
                                 "select sex, stddev_pop(hours_per_week) as s from adult group by sex"])
def test_spreads_are_rewritten_in_suppress_mode_with_avgs_contribution_rule(sql: str) -> None:
    decision = decided(sql, SUPPRESS)
    assert isinstance(decision, Rewrite), decision
    assert "count(DISTINCT CASE WHEN (age) <> 0" in decision.sql or "hours_per_week) <> 0" in decision.sql


@pytest.mark.parametrize(("sql", "allowed"), [
    ("select stddev(share) from adult", False),  # double precision, no bounds: 1e200 squared overflows
    ("select var_pop(weight::float8) from adult", False),
    ("select variance(case when age > 40 then score end) from adult", False),  # plain numeric, no bounds
    ("select stddev(case when education = 'Masters' then age end) from adult", True),  # compared text is not squared
    ("select stddev(big), variance(ratio) from adult", True),  # an integer type; bounds within 1e15
    ("select stddev(coalesce(share, 0)) from adult", False),
])
def test_spreads_in_suppress_mode_square_only_values_that_cannot_overflow(sql: str, allowed: bool) -> None:
    decision = decided(sql, SUPPRESS)
    assert isinstance(decision, Rewrite) is allowed, decision
    if not allowed:
        assert "squared" in decision.message and decision.hint  # type: ignore[union-attr]


# --- attacks: errors and overflows that would depend on one person's value ------------------------------------

ATTACKS = [
    ("select sum(cast(capital_gain as smallint)) from adult", "cast"),  # fails past 32767
    ("select avg(cast(education as int)) from adult", "cast"),  # fails on the first non-number
    ("select count(cast(id as text)) from adult", "identifying column id"),
    ("select count(id + 0) from adult", "arithmetic|identifying column id"),
    ("select count(id) filter (where id = 17) from adult", "identifying column id"),
    ("select stddev(case when id = 17 then age else 0 end) from adult", "identifying column id"),
    ("select variance(case when age = 90 then 9e307 else 0 end) from adult", "constant"),
    ("select count(cast(id as bigint)) from adult", "identifying column id"),
    ("select sum(cast(capital_gain * 100000 as bigint)) from adult", "cast|arithmetic|overflow"),
    ("select sum(cast(case when age > 40 then capital_gain end as smallint)) from adult", "cast"),
]


@pytest.mark.parametrize(("sql", "word"), ATTACKS)
def test_side_channels_are_refused_in_both_modes(sql: str, word: str) -> None:
    for role in (SUPPRESS, DP):
        refused(sql, role, word)


# --- through the proxy ----------------------------------------------------------------------------------------

SUPPRESS_QUERY = ('SELECT "adult"."education" AS "education", SUM(CAST("adult"."hours_per_week" AS BIGINT)) AS h, '
                  'AVG(CAST("adult"."age" AS DOUBLE PRECISION)) AS a, COUNT("adult"."id") AS n, COUNT(id), '
                  'STDDEV_POP("adult"."hours_per_week") AS s, VAR_SAMP(CAST(age AS numeric)) AS v, '
                  'CAST(SUM(CAST("adult"."capital_gain" AS BIGINT)) AS DOUBLE PRECISION) / SUM(1) AS r '
                  'FROM "public"."adult" "adult" GROUP BY 1')


@pytest.fixture
def reporter(gated_proxy: Endpoint, gated_database: str):
    connection = psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True)
    yield connection
    connection.close()


def test_suppress_results_equal_the_direct_query_over_released_groups(reporter: psycopg.Connection,
                                                                      truth: psycopg.Connection) -> None:  # noqa: F811
    cursor = reporter.execute(SUPPRESS_QUERY)
    rows = cursor.fetchall()
    expected_cursor = truth.execute(SUPPRESS_QUERY)
    expected = {row[0]: row for row in expected_cursor.fetchall()}
    assert [(c.name, c.type_code) for c in cursor.description] == \
        [(c.name, c.type_code) for c in expected_cursor.description]
    released = [row for row in rows if row[0] is not None]
    assert len(expected) // 2 <= len(released) < len(expected), (rows, expected)
    assert all(row == expected[row[0]] for row in released)
    assert all(row[3] >= K and row[3] == row[4] for row in released)
    assert reporter.execute(SUPPRESS_QUERY, prepare=True).fetchall() == rows  # extended protocol: same answer


def test_suppress_refusals_reach_the_client_with_sqlstate_and_hint(reporter: psycopg.Connection) -> None:
    for sql, word in ATTACKS[:6]:
        with pytest.raises(psycopg.Error) as caught:
            reporter.execute(sql)
        assert caught.value.sqlstate in ("0A000", "42501"), (sql, caught.value.sqlstate)
        assert any(w in str(caught.value).lower() for w in word.split("|")) and caught.value.diag.message_hint


def test_dp_casts_count_and_spreads_through_the_proxy(gated_proxy: Endpoint, gated_database: str,
                                                      analyst: str, truth: psycopg.Connection) -> None:  # noqa: F811
    query = ('SELECT SUM(CAST("adult"."hours_per_week" AS BIGINT)) AS h, AVG(CAST("adult"."age" AS DOUBLE '
             'PRECISION)) AS a, COUNT("adult"."id") AS n, STDDEV_POP(CAST(hours_per_week AS DOUBLE PRECISION)) AS s '
             'FROM "public"."adult" "adult"')
    expected_cursor = truth.execute(query)
    (expected,) = expected_cursor.fetchall()
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        cursor = conn.execute(query)
        (row,) = cursor.fetchall()
        # dp types avg and stddev as PostgreSQL does: double precision of a double precision argument
        assert [(c.name, c.type_code) for c in cursor.description] == [("h", 1700), ("a", 701), ("n", 20),
                                                                       ("s", 701)]
        assert [c.type_code for c in expected_cursor.description] == [1700, 701, 20, 701]
        with pytest.raises(psycopg.Error) as caught:
            conn.execute("select sum(cast(education as integer)) from adult")
        assert caught.value.sqlstate == "0A000" and caught.value.diag.message_hint
    assert abs(row[0] - expected[0]) < expected[0] / 100
    assert abs(float(row[1]) - expected[1]) < 1
    assert abs(row[2] - expected[2]) < expected[2] / 100
    assert abs(float(row[3]) - expected[3]) < 2
