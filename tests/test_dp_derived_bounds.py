"""dp bounds that follow from the expression an aggregate adds up (issue 11: "bounds when they follow from the plan").

``sum(hours_per_week::numeric * 52)``, ``avg(capital_gain::numeric - capital_loss)``, ``avg(age / 10)``: the
bounds of the argument follow from the declared bounds of its columns through the interpreter of the no-error proof
(anonproxy.plan.bounds); the bounded SQL clamps every value of the argument into them before adding up, so the
noise is calibrated to them whatever the data holds. A number without declared bounds gives no bound: refused.
Integer arithmetic that could overflow for a value outside the declared bounds (``hours_per_week * 52``) reads
its columns clamped into their bounds, which the no-error proof then trusts (tests/test_dp_clamped_columns.py).
Decisions on an in-memory policy first, then through the proxy for a fresh dp role: answers close to the truth,
and the noise scale that the derived bounds give.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import psycopg
import pytest
from conftest import Endpoint
from test_aggregate_casts import ADULT, DP, PARAMS, POLICY
from test_dp_proxy import analyst  # noqa: F401  (fixtures)

from anonproxy.dp.model import DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.plan.refusals import Reject
from anonproxy.policy.model import Policy

# (query, the clamp of its one sum statistic): bounds of age [15, 100], hours_per_week [0, 100], ratio [0, 1000]
DERIVED = [
    ("select sum(hours_per_week::numeric * 52) from adult", (0, 5200)),
    ("select sum(age::numeric * 2) from adult", (30, 200)),
    ("select sum(age::numeric - 17) from adult", (-2, 83)),
    ("select sum(abs(age::numeric - 40)) from adult", (0, 60)),
    ("select sum(age / 10) from adult", (1, 10)),
    ("select sum(hours_per_week::numeric - age) from adult", (-100, 85)),
    ("select sum(floor(age / 10.0) * 10) from adult", (10, 100)),
    ("select sum(case when education = 'Masters' then hours_per_week else 0 end) from adult", (0, 100)),
    ("select sum(age::numeric / 4) from adult", (Fraction(15, 4), 25)),
    ("select sum(ratio * 0.5) from adult", (0, 500)),
    ("select sum(coalesce(hours_per_week, 40)) from adult", (0, 100)),
]


@pytest.mark.parametrize(("sql", "clamp"), DERIVED)
def test_the_clamp_is_the_bound_that_follows_from_the_declared_bounds(sql: str, clamp: tuple[Fraction, Fraction]
                                                                      ) -> None:
    plan = plan_dp(sql, DP, POLICY, PARAMS)
    assert isinstance(plan, DPPlan), plan
    (statistic,) = plan.statistics
    assert statistic.clamp == (Fraction(clamp[0]), Fraction(clamp[1]))
    assert "LEAST(GREATEST(anonproxy_a1, " in plan.sql  # every value is clamped before it is added up


def test_avg_of_a_derived_value_uses_the_derived_bounds() -> None:
    plan = plan_dp("select avg(hours_per_week::numeric * 52) from adult", DP, POLICY, PARAMS)
    assert isinstance(plan, DPPlan), plan
    assert [s.clamp for s in plan.statistics if s.kind == "sum"] == [(Fraction(0), Fraction(5200))]


@pytest.mark.parametrize("sql", [
    "select sum(capital_gain::numeric * 2) from adult",  # capital_gain has no declared bounds
    "select sum(age * capital_gain::numeric) from adult",
    "select avg(small + 1) from adult",
    "select sum(case when age > 30 then capital_gain else 0 end) from adult",
])
def test_a_number_without_declared_bounds_gives_no_bound(sql: str) -> None:
    plan = plan_dp(sql, DP, POLICY, PARAMS)
    assert isinstance(plan, Reject), plan
    assert "declared bounds" in plan.message and plan.hint


def test_without_column_types_nothing_is_derived() -> None:
    untyped = Policy(version=1, tables={"public.adult": dataclasses.replace(ADULT, types=None)})
    assert isinstance(plan_dp("select sum(hours_per_week::numeric * 52) from adult", DP, untyped, PARAMS), Reject)


# --- through the proxy ----------------------------------------------------------------------------------------


def test_derived_sums_and_averages_are_answered_close_to_the_truth(gated_proxy: Endpoint, gated_database: str,
                                                                   analyst: str,  # noqa: F811
                                                                   truth: psycopg.Connection) -> None:  # noqa: F811
    queries = ["select avg(hours_per_week::numeric * 52) from adult",
               "select avg(capital_gain::numeric - capital_loss) from adult",
               "select sum(age / 10) from adult"]
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        for sql in queries:
            true = float(truth.execute(sql).fetchone()[0])
            noisy = float(conn.execute(sql).fetchone()[0])
            assert noisy == pytest.approx(true, rel=0.05), sql  # 30,162 people: the noise is far below 5 %


def test_the_noise_scale_follows_the_derived_bounds(gated_proxy: Endpoint, gated_database: str,
                                                    analyst: str) -> None:  # noqa: F811
    """One person adds at most 5,200 to sum(hours_per_week::numeric * 52) (hours_per_week clamped into its declared
    [0, 100] times 52): at the per-query ε 0.5, EXPLAIN (ANONPROXY) states the Laplace scale 5200 / 0.5 = 10400."""
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        lines = [row[0] for row in conn.execute("explain (anonproxy) select sum(hours_per_week::numeric * 52) "
                                                "from adult")]
        plain = [row[0] for row in conn.execute("explain (anonproxy) select sum(hours_per_week) from adult")]
    assert any("ε=0.5, scale 10400," in line for line in lines), lines
    assert any("ε=0.5, scale 200," in line for line in plain), plain


@pytest.mark.parametrize("sql", [
    "select sum(age / (hours_per_week - 40)) from adult",  # division by zero for some rows: an error side channel
    "select sum(age / nullif(hours_per_week, 0)) from adult",  # a divisor that is not a non-zero constant
    "select sum(age * 2147483647) from adult",  # integer overflow for some values within the bounds
])
def test_the_no_error_proof_still_decides_first(sql: str) -> None:
    plan = plan_dp(sql, DP, POLICY, PARAMS)
    assert isinstance(plan, Reject), plan
    assert plan.hint


def test_a_quantile_ranks_a_column_not_an_expression() -> None:
    plan = plan_dp("select percentile_cont(0.5) within group (order by age::numeric * 2) from adult", DP, POLICY,
                   PARAMS)
    assert isinstance(plan, Reject), plan
    assert "not an expression" in plan.message and plan.hint
