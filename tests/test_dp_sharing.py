"""Shared statistics in dp mode (issue 12): one noisy count serves count(*), count(x) of a NOT NULL column and the
denominators of avg/variance/stddev; a sum next to an average of the same argument is derived from its statistics;
the partition-selection count is reused. Planner, proxy, and a neighbouring-database audit of what is shared.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from fractions import Fraction

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role

from anonproxy.dp.finish import answer
from anonproxy.dp.mechanisms import (
    combined_halfwidth,
    discrete_gaussian_pmf,
    discrete_laplace_pmf,
)
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.policy.model import (
    ColumnPolicy,
    LinkedTable,
    Policy,
    ProtectedTable,
    RolePolicy,
)
from anonproxy.policy.store import load_policy

# age and occupation NOT NULL in the catalog; fnlwgt nullable (bounds declared so it can be averaged)
ADULT = ProtectedTable("public.adult", "id", {
    "id": ColumnPolicy("id", "identifier"),
    "age": ColumnPolicy("age", lower=17, upper=90),
    "fnlwgt": ColumnPolicy("fnlwgt", lower=0, upper=1000),
    "sex": ColumnPolicy("sex", domain=("Female", "Male")),
}, not_null=frozenset({"id", "age", "sex", "occupation"}))
VISITS = LinkedTable("public.visits", "person", "public.adult", "id", {
    "minutes": ColumnPolicy("minutes", lower=0, upper=60),
}, not_null=frozenset({"person", "minutes"}))
POLICY = Policy(version=1, tables={"public.adult": ADULT}, links={"public.visits": VISITS})
ROLE = RolePolicy("researcher", "dp")


def plan(sql: str, epsilon: float = 1.0, delta: float = 1e-6) -> DPPlan:
    result = plan_dp(sql, ROLE, POLICY, DPParams(epsilon, delta))
    assert isinstance(result, DPPlan), result
    return result


def noisy(p: DPPlan) -> list:
    return [s for s in p.statistics if s.kind != "values"]


# --- plans ------------------------------------------------------------------------


def test_count_and_avg_of_a_not_null_column_share_the_count() -> None:
    p = plan("select count(*), avg(age) from adult")
    assert [(s.kind, s.epsilon) for s in noisy(p)] == [("units", Fraction(1, 2)), ("sum", Fraction(1, 2))]
    count, avg = p.columns
    assert avg.denominator == count.statistic == p.statistics[0].name
    assert p.epsilon == 1.0


def test_count_star_and_count_of_a_not_null_column_are_one_statistic() -> None:
    p = plan("select count(*), count(age), count(1) from adult")
    assert len(noisy(p)) == 1 and p.statistics[0].epsilon == 1
    assert {c.statistic for c in p.columns} == {p.statistics[0].name}


def test_sum_next_to_avg_is_derived_from_its_statistics() -> None:
    p = plan("select sum(age), avg(age) from adult")
    assert [(s.kind, s.center) for s in noisy(p)] == [("units", 0), ("sum", 53)]
    total = p.columns[0]
    assert (total.statistic, total.denominator, total.center) == (p.statistics[1].name, p.statistics[0].name, 53)
    # sd of Σ(age − 53) + 53·n, each at ε/2: √(sd(74)² + 53²·sd(2)²); a sum alone at ε/3 (scale 270) is worse
    expected = math.hypot(math.sqrt(0.5) / math.sinh(1 / 148), 53 * math.sqrt(0.5) / math.sinh(1 / 4))
    assert total.noise.stddev == pytest.approx(expected, rel=1e-12)
    assert total.noise.stddev < math.sqrt(0.5) / math.sinh(1 / 540)
    # with a nullable argument: count(fnlwgt), Σ(fnlwgt − 500): sum derived all the same, 2 statistics
    p = plan("select sum(fnlwgt), avg(fnlwgt) from adult")
    assert [(s.kind, s.argument) for s in noisy(p)] == [("count", '"fnlwgt"'), ("sum", '"fnlwgt"')]


def test_sum_of_a_symmetric_range_is_avg_s_own_sum() -> None:
    policy = Policy(version=1, tables={"public.t": ProtectedTable("public.t", "id", {
        "v": ColumnPolicy("v", lower=-5, upper=5)}, not_null=frozenset({"v"}))})
    p = plan_dp("select sum(v), avg(v) from t", ROLE, policy, DPParams(1.0, 0))
    assert isinstance(p, DPPlan)
    assert [(s.kind, s.center) for s in noisy(p)] == [("sum", 0), ("units", 0)]
    assert p.columns[0].denominator is None and p.columns[0].statistic == p.columns[1].statistic


def test_selection_count_is_reused_as_count_of_a_not_null_column() -> None:
    p = plan("select occupation, count(age), avg(age) from adult group by occupation")
    assert len(noisy(p)) == 2
    assert p.columns[1].statistic == p.selection == p.columns[2].denominator
    assert p.statistics[0].epsilon == Fraction(1, 2)


def test_nullable_column_and_filter_keep_their_own_count() -> None:
    p = plan("select count(*), count(fnlwgt) from adult")
    assert [s.kind for s in noisy(p)] == ["units", "count"]
    p = plan("select count(*), count(age) filter (where sex = 'Male') from adult")
    assert [s.kind for s in noisy(p)] == ["units", "count"]
    p = plan("select count(*), avg(age) filter (where sex = 'Male') from adult")
    assert [s.kind for s in noisy(p)] == ["units", "count", "sum"]


def test_the_nullable_side_of_a_left_join_is_not_not_null() -> None:
    inner = plan("select count(*), count(v.minutes) from adult a join visits v on v.person = a.id")
    assert len(noisy(inner)) == 1
    left = plan("select count(*), count(v.minutes), avg(v.minutes) from adult a left join visits v on v.person = a.id")
    assert [s.kind for s in noisy(left)] == ["units", "count", "sum"]
    # the protected table's columns stay NOT NULL on the preserved side
    kept = plan("select count(*), count(a.age) from adult a left join visits v on v.person = a.id")
    assert len(noisy(kept)) == 1


def test_without_catalog_facts_nothing_is_shared() -> None:
    policy = Policy(version=1, tables={"public.adult": replace(ADULT, not_null=None)})
    p = plan_dp("select count(*), count(age) from adult", ROLE, policy, DPParams(1.0, 0))
    assert isinstance(p, DPPlan) and [s.kind for s in noisy(p)] == ["units", "count"]


def test_notices_list_each_statistic_once_with_its_uses() -> None:
    p = plan("select count(*), count(age) as n, sum(age), avg(age) from adult")
    lines = p.statistic_lines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"statistic {p.statistics[0].name}: number of people for count, n, sum's count, "
                               "avg's count, discrete Laplace, ε share 0.5, ρ=0.125, sd")
    assert 'sum("age" − 53) for sum, avg, discrete Laplace' in lines[1], lines


# --- neighbouring-database audit ----------------------------------------------------


def _audit(p: DPPlan, rows: list[tuple], neighbour: list[tuple], event, draws: int = 10_000) -> float:
    """ln(Pr[event | D] / Pr[event | D′]) estimated from the plan's own answers on both datasets."""
    here = sum(event(answer(p, rows)[0][0]) for _ in range(draws))
    there = sum(event(answer(p, neighbour)[0][0]) for _ in range(draws))
    return math.log(here / max(there, 1))


def test_shared_statistics_keep_the_privacy_loss_within_the_claimed_epsilon() -> None:
    """count(*), count(age), avg(age), sum(age) at ε 1: the count is drawn once (ε/2) and read four times, Σ(age − 53)
    once (ε/2). Removing a unit aged 90 moves the count by 1 and Σ(age − 53) by 37; on the event below every noise is
    at or above D's values, whose probability ratio is e^{1/2 + 37/74} = e^ε exactly: the audit sits at the claimed ε
    (standard error about 0.03). An implementation that drew count(age) apart from count(*) at the same scale (one
    statistic too few in the split) loses e^{1.5} on the same event, and the audit catches it."""
    p = plan("select count(*), count(age), avg(age), sum(age) from adult")
    assert [s.kind for s in p.statistics] == ["units", "sum"] and p.epsilon == 1.0
    n = 1000
    rows, neighbour = [(n, 0)], [(n - 1, -37)]

    def event(row: tuple) -> bool:
        count, count_age, _, total = row
        return count >= n and count_age >= n and total - 53 * count >= 0

    loss = _audit(p, rows, neighbour, event)
    assert loss <= p.epsilon + 0.15, loss
    # the wrong implementation: count(age) reads an independent copy of the count at the same scale
    copy = replace(p.statistics[0], name="anonproxy_copy")
    wrong = replace(p, statistics=(p.statistics[0], copy, p.statistics[1]),
                    columns=(p.columns[0], replace(p.columns[1], statistic="anonproxy_copy"), *p.columns[2:]))
    loss = _audit(wrong, [(n, n, 0)], [(n - 1, n - 1, -37)], event)
    assert loss > p.epsilon + 0.15, loss


# --- through the proxy --------------------------------------------------------------

_names = itertools.count(1)


@pytest.fixture
def analyst(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str):
    with fresh_dp_role(truth, gated_proxy, gated_database, f"dp_sharing_{next(_names)}") as role:
        yield role


def test_the_catalog_s_not_null_facts_are_read_with_the_policy(truth: psycopg.Connection) -> None:
    policy = load_policy(truth)
    adult = policy.tables["public.adult"]
    assert adult.not_null is not None and {"id", "age", "hours_per_week"} <= adult.not_null


def test_answers_through_the_proxy_are_consistent(gated_proxy: Endpoint, gated_database: str, analyst: str,
                                                 truth: psycopg.Connection) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user=analyst), autocommit=True) as conn:
        explained = "\n".join(row[0] for row in conn.execute(
            "EXPLAIN (ANONPROXY) select count(*), count(age), sum(age), avg(age) from adult"))
        assert explained.count("statistic anonproxy_s") == 2, explained
        assert "ε share 0.25" in explained, explained
        count, count_age, total, avg = conn.execute(
            "select count(*), count(age), sum(age), avg(age) from adult").fetchone()
        assert count == count_age
        # sum = Σ(age − 53) + 53·n and avg = 53 + Σ(age − 53)/n from the same noisy values: sum = n·avg up to avg's
        # rounding to the digits its interval supports (hundredths here: ±0.005 per person)
        assert abs(total - count * avg) <= count * 0.005 + 1e-9, (total, count, avg)
        exact = truth.execute("select count(*), sum(age) from adult").fetchone()
        assert abs(count - exact[0]) <= 60 and abs(total - exact[1]) <= 60 * 90
        by_sex = conn.execute("select sex, count(*), count(sex), avg(hours_per_week) from adult group by sex")
        for _, n, n_sex, _ in by_sex.fetchall():
            assert n == n_sex


# --- the derived sum's interval ---------------------------------------------------


@pytest.mark.parametrize(("x", "y"), [
    (("discrete_laplace", Fraction(3), Fraction(1)), ("discrete_laplace", Fraction(2), Fraction(5))),
    (("discrete_gaussian", Fraction(30), Fraction(1, 10)), ("discrete_laplace", Fraction(1), Fraction(53, 2))),
    (("discrete_laplace", Fraction(7), Fraction(2)), ("discrete_gaussian", Fraction(9, 4), Fraction(3)))])
def test_combined_halfwidth_is_the_exact_quantile_of_the_sum_of_two_noises(x: tuple, y: tuple) -> None:
    """Against the pmf of a·X + b·Y by brute-force convolution: h covers 95 %, the lattice point below does not."""
    def pmf(kind: str, parameter: Fraction, value: int) -> float:
        return discrete_laplace_pmf(value, parameter) if kind == "discrete_laplace" else discrete_gaussian_pmf(
            value, parameter)

    support = range(-400, 401)
    mass: dict[Fraction, float] = {}
    for i in support:
        for j in range(-60, 61):
            z = abs(x[2] * i + y[2] * j)
            mass[z] = mass.get(z, 0.0) + pmf(x[0], x[1], i) * pmf(y[0], y[1], j)
    h = combined_halfwidth(x, y)
    assert h is not None
    assert math.fsum(p for z, p in mass.items() if z <= h) >= 0.95
    below = max(z for z in mass if z < h)
    assert math.fsum(p for z, p in mass.items() if z <= below) < 0.95


def test_the_derived_sum_s_interval_covers_95_percent_of_answers() -> None:
    p = plan("select sum(age), avg(age) from adult", epsilon=0.5)
    half = p.columns[0].noise.ci95_halfwidth
    n, exact = 1000, 45_000  # Σ(age − 53) = 45,000 − 53·1000 = −8,000
    hits = sum(abs(answer(p, [(n, exact - 53 * n)])[0][0][0] - exact) <= half for _ in range(4000))
    assert 0.93 * 4000 <= hits <= 0.97 * 4000, hits  # 95 % ± 4.6 binomial sd
