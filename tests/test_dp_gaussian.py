"""The discrete Gaussian under zCDP accounting (issue 12): which mechanism each statistic gets, its ρ, its standard
deviation (the discrete Laplace's at the same share of ε), the four costs of a plan, partition selection with the
Gaussian count, and the distribution of the noise the answer releases against the exact pmf.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from test_mechanisms import (
    ALPHA,
    SMALL_DRAWS,
    chi_square_p,
    confirmed_on_fresh_draws,
    gaussian_pmf,
)

from anonproxy.dp.finish import answer
from anonproxy.dp.mechanisms import (
    discrete_gaussian_pmf,
    discrete_gaussian_stddev,
    discrete_gaussian_tail,
    discrete_laplace_stddev,
    laplace_matched_sigma2,
)
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import gaussian_selection_threshold, plan_dp, selection_threshold
from anonproxy.policy.model import ColumnPolicy, Policy, ProtectedTable, RolePolicy

ADULT = ProtectedTable("public.adult", "id", {
    "id": ColumnPolicy("id", "identifier"),
    "age": ColumnPolicy("age", lower=17, upper=90),
    "hours_per_week": ColumnPolicy("hours_per_week", lower=0.5, upper=99.5),
    "sex": ColumnPolicy("sex", domain=("Female", "Male")),
}, not_null=frozenset({"id", "age", "sex", "hours_per_week", "occupation"}))
POLICY = Policy(version=1, tables={"public.adult": ADULT})
ROLE = RolePolicy("researcher", "dp")


def plan(sql: str, epsilon: float = 0.5, delta: float = 1e-7, accounting: str = "zcdp", groups: int = 1) -> DPPlan:
    result = plan_dp(sql, ROLE, POLICY, DPParams(epsilon, delta, max_groups_per_unit=groups,
                                                  accounting=accounting))  # type: ignore[arg-type]
    assert isinstance(result, DPPlan), result
    return result


def test_a_count_at_the_demo_epsilon() -> None:
    """count(*) at the demo's per-query ε 0.5: a discrete Laplace of scale 2 has variance 2α/(1 − α)², α = e^(−1/2),
    = 7.835396178…; the Gaussian of that variance has σ² = 7.83539617807 (rounded up to 12 digits) and costs
    ρ = 1/(2σ²) = 0.0638129… instead of the Laplace's ε²/2 = 0.125."""
    basic = plan("select count(*) from adult", accounting="basic")
    (laplace,) = basic.statistics
    assert laplace.mechanism == "discrete_laplace" and laplace.rho == Fraction(1, 8)
    assert (basic.epsilon, basic.delta, basic.rho, basic.delta_add) == (0.5, 0.0, 0.125, 0.0)

    zcdp = plan("select count(*) from adult")
    (gauss,) = zcdp.statistics
    assert gauss.mechanism == "discrete_gaussian" and gauss.sigma2 == Fraction("7.83539617807")
    assert gauss.rho == Fraction(100_000_000_000, 1_567_079_235_614)
    assert zcdp.rho == pytest.approx(0.063812983, rel=1e-8)
    assert gauss.stddev == pytest.approx(discrete_laplace_stddev(2), rel=1e-11)
    # its basic pair: ρ + 2√(ρ·ln(1/δ)) at the role's δ
    rho = 100_000_000_000 / 1_567_079_235_614
    assert zcdp.epsilon == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1e7)), rel=1e-12)
    assert (zcdp.delta, zcdp.delta_add) == (1e-7, 0.0)
    notice = zcdp.columns[0].noise.describe("count")
    assert notice.startswith("count: discrete Gaussian at the sd of a discrete Laplace with ε=0.5, ρ=0.06381, σ 2.79")


def test_two_statistics_and_the_l2_sensitivity_over_groups() -> None:
    p = plan("select sex, count(*), avg(age) from adult group by sex", epsilon=1.0, groups=2)
    count, linear = p.statistics
    # count: L1 2 (two groups), Laplace scale 2/(1/2) = 4; L2² = 1²·2. Σ(age − 53): per group 37, L1 74, scale 148,
    # L2² = 37²·2.
    for stat, scale, l2_squared in ((count, 4, 2), (linear, 148, 37 * 37 * 2)):
        assert stat.mechanism == "discrete_gaussian" and stat.scale == scale
        assert stat.sigma2 == laplace_matched_sigma2(scale)
        assert stat.rho == Fraction(l2_squared) / (2 * stat.sigma2)
        assert stat.stddev == pytest.approx(discrete_laplace_stddev(scale), rel=1e-11)
        # about a quarter of the Laplace's (1/2)²/2: ε²/(4·reach) for a large scale
        assert float(stat.rho) == pytest.approx(0.125 / 4, rel=0.01)
    exact = count.rho + linear.rho  # charged as the nearest float not below it: never under-counted
    assert Fraction(p.rho) >= exact and p.rho in (float(exact), math.nextafter(float(exact), math.inf))


def test_a_fixed_point_sum_uses_grid_units() -> None:
    p = plan("select sum(hours_per_week) from adult", epsilon=1.0)
    (total,) = p.statistics
    assert total.resolution == Fraction(1, 100) and total.sensitivity == Fraction(199, 2)
    # 99.5 is 9950 grid steps of 0.01: L1 9950, scale 9950; L2² = 9950²
    assert total.scale == 9950 and total.rho == Fraction(9950 * 9950) / (2 * total.sigma2)
    assert total.stddev == pytest.approx(discrete_laplace_stddev(9950) / 100, rel=1e-11)


def test_quantiles_stay_exponential_at_rho_epsilon_squared_over_8() -> None:
    p = plan("select count(*), median(age) from adult", epsilon=1.0)
    assert [s.mechanism for s in p.statistics if s.kind != "values"] == ["discrete_gaussian"]
    quantile = p.columns[1].quantile
    assert quantile.share == Fraction(1, 2)
    assert p.rho == pytest.approx(float(p.statistics[0].rho) + 0.25 / 8, rel=1e-12)
    # basic pair: the quantile's pure ε plus the Gaussian's converted ρ
    rho = float(p.statistics[0].rho)
    assert p.epsilon == pytest.approx(0.5 + rho + 2 * math.sqrt(rho * math.log(1e7)), rel=1e-12)


def test_without_delta_zcdp_keeps_the_laplace() -> None:
    p = plan("select count(*) from adult", delta=0.0)
    assert p.statistics[0].mechanism == "discrete_laplace" and p.rho == 0.125 and p.epsilon == 0.5


def test_partition_selection_with_the_gaussian_count() -> None:
    p = plan("select occupation, count(*) from adult group by occupation", epsilon=0.5, delta=1e-7, groups=2)
    (count,) = p.statistics
    assert p.selection == count.name and count.mechanism == "discrete_gaussian"
    assert p.threshold == gaussian_selection_threshold(count.sigma2, 2, 1e-7)
    # δ of selection goes to both δs; the basic pair also pays the Gaussian's conversion δ
    assert p.delta_add == 1e-7 and p.delta == 2e-7
    basic = plan("select occupation, count(*) from adult group by occupation", 0.5, 1e-7, "basic", groups=2)
    # one statistic, reach 2: Laplace scale 2/0.5 = 4
    assert basic.threshold == selection_threshold(4, 2, 1e-7) and (basic.delta, basic.delta_add) == (1e-7, 1e-7)
    # the Gaussian's lighter tail: a lower threshold at the same sd (32 people instead of 66)
    assert (p.threshold, basic.threshold) == (32, 66)


def _brute_tail(k: int, sigma2: float) -> float:
    sigma = math.sqrt(sigma2)
    xs = np.arange(-int(60 * sigma) - 10, int(60 * sigma) + 11, dtype=np.float64)
    weights = np.exp(-xs * xs / (2 * sigma2))
    return float(weights[xs >= k].sum() / weights.sum())


@pytest.mark.parametrize(("sigma2", "reach", "delta"), [
    (0.5, 1, 1e-6), (7.83539617807, 1, 1e-7), (31.34, 2, 1e-7), (1000, 4, 1e-9), (2.5e8, 1, 1e-5), (4e8, 3, 1e-7)])
def test_gaussian_selection_threshold_against_brute_force_tails(sigma2: float, reach: int, delta: float) -> None:
    tau = gaussian_selection_threshold(sigma2, reach, delta)
    assert reach * _brute_tail(tau - 1, sigma2) <= delta  # a key only one unit holds passes with probability ≤ δ
    assert tau == 2 or reach * _brute_tail(tau - 2, sigma2) > delta * (1 + 1e-6)  # and τ is the smallest such
    if sigma2 < 1e6:
        for k in (tau - 2, tau - 1, tau):
            if k >= 0:
                assert discrete_gaussian_tail(k, sigma2) == pytest.approx(_brute_tail(k, sigma2), rel=1e-9)


@confirmed_on_fresh_draws
def test_released_noise_follows_the_exact_pmf() -> None:
    """Noise released by answer() for a zcdp count at ε 0.5 against the discrete Gaussian's pmf at σ² 7.835…: a
    chi-square that a correct sampler passes (false alarm 1e-4 per sample, confirmed on a second) and one 1.2× σ off fails."""
    p = plan("select count(*) from adult")
    sigma2 = p.statistics[0].sigma2
    n = 10_000
    draws = [answer(p, [(n,)])[0][0][0] - n for _ in range(SMALL_DRAWS)]
    assert chi_square_p(draws, gaussian_pmf(sigma2)) > ALPHA
    assert chi_square_p(draws, gaussian_pmf(sigma2 * Fraction(144, 100))) < ALPHA
    assert chi_square_p(draws, gaussian_pmf(sigma2 / Fraction(144, 100))) < ALPHA
    assert np.std(draws) == pytest.approx(discrete_gaussian_stddev(sigma2), rel=0.03)
    assert sum(discrete_gaussian_pmf(x, sigma2) for x in range(-60, 61)) == pytest.approx(1, rel=1e-12)


@pytest.mark.parametrize("epsilon", [1e-200, 1e-12, 50.0, 1e300])
def test_extreme_epsilons_plan_and_answer_under_zcdp(epsilon: float) -> None:
    """A variance past the largest double keeps the Laplace (basic plans those too); otherwise the Gaussian, whose
    ρ is below the Laplace's at every ε."""
    p = plan("select occupation, count(*), avg(age) from adult group by 1", epsilon=epsilon)
    laplace = plan("select occupation, count(*), avg(age) from adult group by 1", epsilon=epsilon, accounting="basic")
    assert all(s.rho <= l.rho for s, l in zip(p.statistics, laplace.statistics, strict=True))
    assert [s.mechanism for s in p.statistics] == (["discrete_laplace"] * 2 if epsilon == 1e-200
                                                   else ["discrete_gaussian"] * 2)
    rows, _ = answer(p, [("Sales", 1000, 500)])
    assert len(rows) <= 1
