"""Statistical and exact tests of anonproxy.dp (docs/mechanisms.md, "Test design").

Pure Python, no database. Every statistical assertion is a hypothesis test
with false-alarm rate ALPHA = 1e-4 on one sample. A test whose draws reject
is run again on a fresh, independent sample and fails only if that one
rejects too (`confirmed_on_fresh_draws`), so a correct implementation fails
one of the 48 assertions on random draws with probability about 1e-8 each;
with the 15 accuracy checks at 1e-6 the whole file fails spuriously less than
once in 50,000 runs. A wrong sampler fails both stages: the power tests below
show that one sample already rejects each of them. The draws come from the real samplers and the real `secrets`
source (nothing is seeded), so a green run says something about the code that
ships. The deliberately wrong samplers that show the tests' power use a seeded
numpy generator, so those rejections are reproducible.
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from decimal import Decimal, localcontext
from fractions import Fraction
from functools import cache
from statistics import NormalDist
from typing import ParamSpec

import numpy as np
import pytest

from anonproxy.dp import NoisyValue, dp_quantile
from anonproxy.dp import mechanisms as m
from anonproxy.dp import quantiles as qm

try:  # scipy is used when present, as a cross-check of our own chi-square tail
    from scipy import stats as scipy_stats
except ImportError:  # pragma: no cover - depends on the environment
    scipy_stats = None

P = ParamSpec("P")
ALPHA = 1e-4  # false-alarm rate of every statistical assertion
Z_CRIT = NormalDist().inv_cdf(1 - ALPHA / 2)  # 3.89: two-sided z threshold at ALPHA
DRAWS = 100_000  # per distribution and parameter for the samplers
SMALL_DRAWS = 20_000  # for the Bernoulli, fixed-point and quantile samplers


def confirmed_on_fresh_draws(test: Callable[P, None]) -> Callable[P, None]:
    """A two-stage test: a rejection on the first sample is confirmed on a second, independent one.

    The test fails only if both samples reject, so its false-alarm rate is ALPHA² while a wrong sampler,
    which each sample rejects with probability near 1, still fails it."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            test(*args, **kwargs)
        except AssertionError:
            laplace_draws.cache_clear()
            gaussian_draws.cache_clear()
            test(*args, **kwargs)

    return run


# ---------------------------------------------------------------------------
# test statistics


def _gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x): series below a + 1, continued fraction above."""
    if x <= 0:
        return 1.0
    log_prefix = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1 / a
        n = 0
        while abs(term) > abs(total) * 1e-16:
            n += 1
            term *= x / (a + n)
            total += term
        return max(0.0, 1 - total * math.exp(log_prefix))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        step = d * c
        h *= step
        if abs(step - 1) < 1e-16:
            break
    return math.exp(log_prefix) * h


def chi2_sf(stat: float, df: int) -> float:
    """Pr[χ²_df ≥ stat]."""
    if scipy_stats is not None:
        return float(scipy_stats.chi2.sf(stat, df))
    return _gamma_q(df / 2, stat / 2)


def binomial_p_value(k: int, n: int, p: float) -> float:
    """Exact two-sided binomial test (outcomes no more likely than k)."""
    if p in (0.0, 1.0):
        return 1.0 if k == n * p else 0.0
    log_pmf = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
               + i * math.log(p) + (n - i) * math.log1p(-p) for i in range(n + 1)]
    limit = log_pmf[k] + 1e-7
    return min(1.0, math.fsum(math.exp(v) for v in log_pmf if v <= limit))


def chi_square_p(samples: list[int], pmf: Callable[[int], float], min_expected: float = 10) -> float:
    """Goodness of fit of integer samples to a pmf symmetric about 0.

    Cells: each integer with |x| < K, and the two tails x ≤ −K, x ≥ K, with K
    as large as possible while every cell expects at least ``min_expected``
    draws. When only "0" and "not 0" are left (tiny scales), the exact
    binomial test on the count of non-zero draws.
    """
    n = len(samples)
    k = 1
    while n * pmf(k) >= min_expected:
        k += 1

    def tail(k: int) -> float:  # Pr[X ≥ k] for k ≥ 1
        return max(0.0, (1 - math.fsum(pmf(x) for x in range(-k + 1, k))) / 2)

    while k > 1 and n * tail(k) < min_expected:
        k -= 1
    counts = Counter(samples)
    low = sum(c for x, c in counts.items() if x <= -k)
    high = sum(c for x, c in counts.items() if x >= k)
    if n * tail(k) < min_expected:  # k = 1: zero against non-zero
        return binomial_p_value(low + high, n, 2 * tail(1))
    cells = [(counts.get(x, 0), n * pmf(x)) for x in range(-k + 1, k)]
    cells += [(low, n * tail(k)), (high, n * tail(k))]
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return chi2_sf(stat, len(cells) - 1)


def moments(pmf: Callable[[int], float], limit: int) -> tuple[float, float]:
    """(E X², E X⁴) from the pmf over |x| ≤ limit."""
    xs = range(-limit, limit + 1)
    return (math.fsum(x * x * pmf(x) for x in xs), math.fsum(x ** 4 * pmf(x) for x in xs))


def variance_z(samples: list[int], var: float, fourth: float) -> float:
    """z statistic of the mean of X² (the mean is known to be 0) against Var X."""
    n = len(samples)
    mean_sq = math.fsum(x * x for x in samples) / n
    return (mean_sq - var) / math.sqrt((fourth - var * var) / n)


# ---------------------------------------------------------------------------
# draws from the real samplers, shared by the tests of one distribution

LAPLACE_SCALES = [Fraction(1, 10), Fraction(1, 2), Fraction(1), Fraction(7, 3), Fraction(20)]
GAUSSIAN_SIGMA2 = [Fraction(1, 4), Fraction(1), Fraction(5, 2), Fraction(400)]


@cache
def laplace_draws(scale: Fraction) -> list[int]:
    return [m.discrete_laplace(scale) for _ in range(DRAWS)]


@cache
def gaussian_draws(sigma2: Fraction) -> list[int]:
    return [m.discrete_gaussian(sigma2) for _ in range(DRAWS)]


def laplace_pmf(scale: Fraction) -> Callable[[int], float]:
    return lambda x: m.discrete_laplace_pmf(x, scale)


def gaussian_pmf(sigma2: Fraction) -> Callable[[int], float]:
    return lambda x: m.discrete_gaussian_pmf(x, sigma2)


def laplace_limit(scale: Fraction) -> int:
    return int(60 * scale) + 10


def gaussian_limit(sigma2: Fraction) -> int:
    return int(40 * math.sqrt(sigma2)) + 10


# ---------------------------------------------------------------------------
# the test statistics themselves


def test_own_chi_square_tail_matches_reference() -> None:
    for df, stat in [(1, 0.5), (1, 15.1), (4, 3.0), (10, 40.0), (37, 30.0), (37, 80.0), (120, 200.0)]:
        ours = _gamma_q(df / 2, stat / 2)
        if scipy_stats is not None:
            assert ours == pytest.approx(float(scipy_stats.chi2.sf(stat, df)), rel=1e-9, abs=1e-300)
    # df = 2: the tail is exactly exp(−x/2); df = 1: erfc(√(x/2))
    for stat in [0.1, 2.0, 9.0, 30.0]:
        assert _gamma_q(1.0, stat / 2) == pytest.approx(math.exp(-stat / 2), rel=1e-12)
        assert _gamma_q(0.5, stat / 2) == pytest.approx(math.erfc(math.sqrt(stat / 2)), rel=1e-9)


# ---------------------------------------------------------------------------
# Bernoulli(exp(−γ))


@pytest.mark.parametrize("gamma", [Fraction(1, 10), Fraction(1, 2), Fraction(1), Fraction(3, 2),
                                   Fraction(7, 3), Fraction(5), 0.75])
@confirmed_on_fresh_draws
def test_bernoulli_exp_frequency(gamma: Fraction | float) -> None:
    hits = sum(m.bernoulli_exp(gamma) for _ in range(SMALL_DRAWS))
    assert binomial_p_value(hits, SMALL_DRAWS, math.exp(-float(gamma))) > ALPHA


@confirmed_on_fresh_draws
def test_bernoulli_exp_edges() -> None:
    assert all(m.bernoulli_exp(0) for _ in range(1000))
    assert not any(m.bernoulli_exp(10**6) for _ in range(1000))  # Pr[True] = e^−1000000
    # huge numerator and denominator: γ = 1 + 10^−30, a probability of about 1/e
    hits = sum(m.bernoulli_exp(Fraction(10**30 + 1, 10**30)) for _ in range(SMALL_DRAWS))
    assert binomial_p_value(hits, SMALL_DRAWS, math.exp(-1)) > ALPHA


# ---------------------------------------------------------------------------
# discrete Laplace


@pytest.mark.parametrize("scale", LAPLACE_SCALES, ids=str)
@confirmed_on_fresh_draws
def test_discrete_laplace_fits_its_pmf(scale: Fraction) -> None:
    assert chi_square_p(laplace_draws(scale), laplace_pmf(scale)) > ALPHA


@pytest.mark.parametrize("scale", LAPLACE_SCALES, ids=str)
@confirmed_on_fresh_draws
def test_discrete_laplace_variance(scale: Fraction) -> None:
    var, fourth = moments(laplace_pmf(scale), laplace_limit(scale))
    assert var == pytest.approx(m.discrete_laplace_variance(scale), rel=1e-9)
    assert abs(variance_z(laplace_draws(scale), var, fourth)) < Z_CRIT


@pytest.mark.parametrize("scale", LAPLACE_SCALES, ids=str)
@confirmed_on_fresh_draws
def test_discrete_laplace_symmetry(scale: Fraction) -> None:
    draws = laplace_draws(scale)
    positive, negative = sum(x > 0 for x in draws), sum(x < 0 for x in draws)
    assert binomial_p_value(positive, positive + negative, 0.5) > ALPHA


def test_discrete_laplace_pmf_sums_to_one() -> None:
    for scale in LAPLACE_SCALES + [Fraction(300)]:
        total = math.fsum(m.discrete_laplace_pmf(x, scale) for x in range(-laplace_limit(scale), laplace_limit(scale) + 1))
        assert total == pytest.approx(1, abs=1e-12)


@confirmed_on_fresh_draws
def test_discrete_laplace_with_float_and_huge_rational_scale() -> None:
    # 0.3 is the binary fraction 5404319552844595/18014398509481984: the sampler works on it exactly
    draws = [m.discrete_laplace(0.3) for _ in range(SMALL_DRAWS)]
    assert chi_square_p(draws, laplace_pmf(Fraction(0.3))) > ALPHA


# ---------------------------------------------------------------------------
# discrete Gaussian


@pytest.mark.parametrize("sigma2", GAUSSIAN_SIGMA2, ids=str)
@confirmed_on_fresh_draws
def test_discrete_gaussian_fits_its_pmf(sigma2: Fraction) -> None:
    assert chi_square_p(gaussian_draws(sigma2), gaussian_pmf(sigma2)) > ALPHA


@pytest.mark.parametrize("sigma2", GAUSSIAN_SIGMA2, ids=str)
@confirmed_on_fresh_draws
def test_discrete_gaussian_variance(sigma2: Fraction) -> None:
    var, fourth = moments(gaussian_pmf(sigma2), gaussian_limit(sigma2))
    assert var == pytest.approx(m.discrete_gaussian_variance(sigma2), rel=1e-9)
    assert var <= sigma2 * (1 + 1e-12)  # CKS: the discrete Gaussian's variance is at most σ²
    assert abs(variance_z(gaussian_draws(sigma2), var, fourth)) < Z_CRIT


@pytest.mark.parametrize("sigma2", GAUSSIAN_SIGMA2, ids=str)
@confirmed_on_fresh_draws
def test_discrete_gaussian_symmetry(sigma2: Fraction) -> None:
    draws = gaussian_draws(sigma2)
    positive, negative = sum(x > 0 for x in draws), sum(x < 0 for x in draws)
    assert binomial_p_value(positive, positive + negative, 0.5) > ALPHA


def test_discrete_gaussian_normaliser_both_ways() -> None:
    # term-by-term below σ² = 100, Poisson summation above: they agree where both apply
    for s2 in [1.0, 4.0, 99.0, 100.0, 101.0, 2500.0]:
        direct = math.fsum(math.exp(-x * x / (2 * s2)) for x in range(-int(40 * math.sqrt(s2)), int(40 * math.sqrt(s2)) + 1))
        assert m.discrete_gaussian_pmf(0, s2) == pytest.approx(1 / direct, rel=1e-12)


@confirmed_on_fresh_draws
def test_discrete_gaussian_large_sigma() -> None:
    # σ = 10^6: the sampler stays fast and the mean and spread are right
    draws = [m.discrete_gaussian(10**12) for _ in range(2000)]
    mean = sum(draws) / len(draws)
    assert abs(mean) < Z_CRIT * 10**6 / math.sqrt(len(draws))
    assert abs(variance_z(draws, 1e12, 3e24)) < Z_CRIT


# ---------------------------------------------------------------------------
# the tests have power: the same checks reject plausible wrong samplers

_wrong = np.random.default_rng(20240601)  # seeded: these rejections are reproducible


def _geometric(alpha: float, n: int) -> np.ndarray:
    """Failures before the first success, success probability 1 − alpha (numpy counts trials)."""
    return _wrong.geometric(1 - alpha, n) - 1


def _laplace_by_geometrics(scale: float, n: int) -> list[int]:
    """A correct discrete Laplace in floating point: the difference of two geometrics."""
    alpha = math.exp(-1 / scale)
    return (_geometric(alpha, n) - _geometric(alpha, n)).tolist()


@confirmed_on_fresh_draws
def test_harness_accepts_an_independent_correct_sampler() -> None:
    # control: a different, correct construction passes the same check
    for scale in [Fraction(1, 2), Fraction(20)]:
        assert chi_square_p(_laplace_by_geometrics(float(scale), DRAWS), laplace_pmf(scale)) > ALPHA


def test_chi_square_rejects_rounded_continuous_laplace() -> None:
    for scale in [Fraction(1, 2), Fraction(1)]:
        draws = np.rint(_wrong.laplace(0, float(scale), DRAWS)).astype(int).tolist()
        assert chi_square_p(draws, laplace_pmf(scale)) < ALPHA


def test_chi_square_rejects_laplace_scale_off_by_20_percent() -> None:
    for scale in [Fraction(1), Fraction(20)]:
        assert chi_square_p(_laplace_by_geometrics(1.2 * float(scale), DRAWS), laplace_pmf(scale)) < ALPHA
        assert chi_square_p(_laplace_by_geometrics(0.8 * float(scale), DRAWS), laplace_pmf(scale)) < ALPHA


def test_chi_square_rejects_laplace_that_counts_zero_twice() -> None:
    # forgetting CKS Algorithm 2's "reject −0" step
    scale = Fraction(7, 3)
    magnitude = _geometric(math.exp(-1 / float(scale)), DRAWS)
    sign = _wrong.integers(0, 2, DRAWS) * 2 - 1
    assert chi_square_p((magnitude * sign).tolist(), laplace_pmf(scale)) < ALPHA


def test_variance_check_rejects_laplace_scale_off_by_5_percent() -> None:
    scale = Fraction(20)
    var, fourth = moments(laplace_pmf(scale), laplace_limit(scale))
    assert abs(variance_z(_laplace_by_geometrics(1.05 * 20, DRAWS), var, fourth)) > Z_CRIT


def test_chi_square_rejects_rounded_continuous_gaussian_and_wrong_sigma() -> None:
    small = Fraction(1, 4)  # rounding N(0, 1/4) puts 68 % on 0; the discrete Gaussian puts 79 %
    draws = np.rint(_wrong.normal(0, 0.5, DRAWS)).astype(int).tolist()
    assert chi_square_p(draws, gaussian_pmf(small)) < ALPHA
    for sigma in [0.8 * 20, 1.2 * 20]:  # σ off by 20 % (rounded normals ≈ discrete Gaussian at σ ≥ 2)
        draws = np.rint(_wrong.normal(0, sigma, DRAWS)).astype(int).tolist()
        assert chi_square_p(draws, gaussian_pmf(Fraction(400))) < ALPHA


def test_bernoulli_check_rejects_a_wrong_exponent() -> None:
    # e.g. handling γ > 1 as if it were γ − ⌊γ⌋ + 1 for γ = 7/3: 4/3 instead of 7/3
    hits = int(_wrong.binomial(SMALL_DRAWS, math.exp(-4 / 3)))
    assert binomial_p_value(hits, SMALL_DRAWS, math.exp(-7 / 3)) < ALPHA


# ---------------------------------------------------------------------------
# 95 % intervals: exact from the CDF, and they cover


def _coverage(pmf: Callable[[int], float], h: int) -> float:
    return math.fsum(pmf(x) for x in range(-h, h + 1))


@pytest.mark.parametrize("scale", LAPLACE_SCALES + [Fraction(3, 1000), Fraction(150)], ids=str)
def test_discrete_laplace_halfwidth_is_the_exact_quantile(scale: Fraction) -> None:
    h = m.discrete_laplace_halfwidth(scale)
    assert _coverage(laplace_pmf(scale), h) >= 0.95
    assert h == 0 or _coverage(laplace_pmf(scale), h - 1) < 0.95
    for level in [0.5, 0.99]:
        h = m.discrete_laplace_halfwidth(scale, level)
        assert _coverage(laplace_pmf(scale), h) >= level
        assert h == 0 or _coverage(laplace_pmf(scale), h - 1) < level


def test_discrete_laplace_halfwidth_large_scale() -> None:
    # the continuous Laplace quantile t·ln 20 is the limit for large t
    for t in [10**4, 10**7]:
        assert abs(m.discrete_laplace_halfwidth(t) - t * math.log(20)) <= 2


def _laplace_halfwidth_oracle(t: Fraction, confidence: float) -> int:
    """h + 1 = ⌈t·ln(2/((1+α)(1−c)))⌉, α = e^(−1/t), from Pr[|X| ≥ k] = 2α^k/(1+α).

    In decimal arithmetic with 80 digits more than t has."""
    with localcontext(prec=80 + len(str(t.numerator // t.denominator))):
        exact_t = Decimal(t.numerator) / Decimal(t.denominator)
        alpha = (-1 / exact_t).exp()
        bound = exact_t * (2 / ((1 + alpha) * (1 - Decimal(confidence)))).ln()
        return max(0, math.ceil(bound) - 1)


@pytest.mark.parametrize("epsilon", [Fraction(1, 10**12), Fraction(1, 10**15), 1e-15, Fraction(1, 10**40)], ids=str)
def test_discrete_laplace_halfwidth_for_a_tiny_epsilon(epsilon: Fraction | float) -> None:
    # t = 1/ε up to 10^40: past 2^53 a float cannot tell h from h + 1; the answer is still the exact quantile
    t = m.laplace_scale(1, epsilon)
    assert 1 / Fraction(epsilon) <= t <= (1 / Fraction(epsilon)) * (1 + Fraction(1, 10**11))  # rounded up only
    for level in (0.95, 0.5):
        assert m.discrete_laplace_halfwidth(t, level) == _laplace_halfwidth_oracle(t, level)
    # Var = 2α/(1−α)² ≈ 2t² for large t
    assert m.discrete_laplace_stddev(t) == pytest.approx(math.sqrt(2) * float(t), rel=1e-9)
    # P(|X| > 3t) ≈ e^-3: 199 of 4,000 expected, sd 13.8, so [120, 290] fails a right scale ~1e-8 of the time
    # (200 draws and ≥ 180 within failed about one run in 250); a scale 20 % off expects 328 or 109, outside
    draws = [m.discrete_laplace(t) for _ in range(4000)]
    assert 120 <= sum(abs(x) > 3 * float(t) for x in draws) <= 290


@pytest.mark.parametrize("epsilon", [10**15, 1e300, 1.7e308])
def test_discrete_laplace_for_a_huge_epsilon_is_exact(epsilon: float) -> None:
    # t ≤ 10^-15: α = e^(−1/t) is 0 in any precision that matters, so Pr[X = 0] = (1−α)/(1+α) = 1
    t = m.laplace_scale(1, epsilon)
    assert 0 < t <= Fraction(1, 10**15)
    assert m.discrete_laplace_halfwidth(t) == 0
    assert m.discrete_laplace_stddev(t) == 0.0 and m.discrete_laplace_variance(t) == 0.0
    assert m.discrete_laplace_pmf(0, t) == 1.0
    assert [m.discrete_laplace(t) for _ in range(50)] == [0] * 50


def test_discrete_laplace_spread_beyond_the_float_square() -> None:
    # t = 10^200: the variance 2t² is past the largest double, the standard deviation √2·t is not
    t = Fraction(10**200)
    assert m.discrete_laplace_stddev(t) == pytest.approx(math.sqrt(2) * 1e200, rel=1e-12)
    assert m.discrete_laplace_variance(t) == math.inf


@pytest.mark.parametrize("sigma2", GAUSSIAN_SIGMA2 + [Fraction(1, 100), Fraction(10**6)], ids=str)
def test_discrete_gaussian_halfwidth_is_the_exact_quantile(sigma2: Fraction) -> None:
    h = m.discrete_gaussian_halfwidth(sigma2)
    assert _coverage(gaussian_pmf(sigma2), h) >= 0.95
    assert h == 0 or _coverage(gaussian_pmf(sigma2), h - 1) < 0.95


def test_discrete_gaussian_halfwidth_beyond_direct_summation() -> None:
    # σ above 10^4 uses the midpoint-rule CDF; compare with summing the pmf at σ = 2·10^4
    s2 = 4 * 10**8
    h = m.discrete_gaussian_halfwidth(s2)
    z = math.sqrt(2 * math.pi * s2)
    covered = lambda k: (1 + 2 * math.fsum(math.exp(-x * x / (2 * s2)) for x in range(1, k + 1))) / z
    assert covered(h) >= 0.95 > covered(h - 1)


@pytest.mark.parametrize("kind,param", [("laplace", Fraction(1, 2)), ("laplace", Fraction(20)),
                                        ("gaussian", Fraction(1)), ("gaussian", Fraction(400))])
@confirmed_on_fresh_draws
def test_intervals_cover_the_right_fraction_of_draws(kind: str, param: Fraction) -> None:
    if kind == "laplace":
        draws, h, pmf = laplace_draws(param), m.discrete_laplace_halfwidth(param), laplace_pmf(param)
    else:
        draws, h, pmf = gaussian_draws(param), m.discrete_gaussian_halfwidth(param), gaussian_pmf(param)
    covered = sum(abs(x) <= h for x in draws)
    assert binomial_p_value(covered, len(draws), _coverage(pmf, h)) > ALPHA


# ---------------------------------------------------------------------------
# calibration


def test_laplace_scale() -> None:
    assert m.laplace_scale(1, Fraction(1, 2)) == 2
    assert m.laplace_scale(3, Fraction(1, 3)) == 9
    assert m.laplace_scale(2, 4) == Fraction(1, 2)
    t = m.laplace_scale(1, 0.1)  # 0.1 is a binary fraction slightly above 1/10
    assert 1 / Fraction(0.1) <= t <= 10  # rounded up, never down
    # the privacy condition itself: pmf(x)/pmf(x − Δ) ≤ e^ε for integer Δ
    for sens, eps in [(1, 0.5), (3, 1.0), (2, 0.1)]:
        scale = m.laplace_scale(sens, eps)
        worst = max(math.log(m.discrete_laplace_pmf(x, scale) / m.discrete_laplace_pmf(x - sens, scale))
                    for x in range(-50, 50))
        assert worst <= eps * (1 + 1e-12)


def _analytic_gaussian_delta(sigma: float, sens: float, eps: float) -> float:
    """Balle & Wang 2018, Theorem 8: the exact δ of the continuous Gaussian mechanism."""
    phi = NormalDist().cdf
    return phi(sens / (2 * sigma) - eps * sigma / sens) - math.exp(eps) * phi(-sens / (2 * sigma) - eps * sigma / sens)


def _analytic_gaussian_sigma(sens: float, eps: float, delta: float) -> float:
    lo, hi = 1e-3, 1e6
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if _analytic_gaussian_delta(mid, sens, eps) > delta else (lo, mid)
    return hi


def _discrete_gaussian_delta(sigma2: float, shift: np.ndarray, eps: float) -> float:
    """The exact δ(ε) of adding independent discrete Gaussians to an integer vector moved by ``shift``.

    δ = Σ_y max(0, p(y) − e^ε p(y − shift)) over the integer lattice, by brute force.
    """
    sigma = math.sqrt(sigma2)
    span = int(40 * sigma) + int(np.abs(shift).max()) + 2
    axis = np.arange(-span, span + 1, dtype=float)
    log_z = math.log(np.exp(-axis ** 2 / (2 * sigma2)).sum())
    if len(shift) == 1:
        y = axis
        loss = ((y - shift[0]) ** 2 - y ** 2) / (2 * sigma2)  # ln p(y)/p(y − shift)
        log_p = -y ** 2 / (2 * sigma2) - log_z
    else:
        y1, y2 = np.meshgrid(axis, axis, indexing="ij")
        loss = ((y1 - shift[0]) ** 2 + (y2 - shift[1]) ** 2 - y1 ** 2 - y2 ** 2) / (2 * sigma2)
        log_p = -(y1 ** 2 + y2 ** 2) / (2 * sigma2) - 2 * log_z
    mask = loss > eps
    return float((np.exp(log_p[mask]) * -np.expm1(eps - loss[mask])).sum())


@pytest.mark.parametrize("eps,delta", [(1.0, 1e-5), (0.1, 1e-6), (0.5, 1e-9), (4.0, 1e-6)])
def test_gaussian_sigma_meets_epsilon_delta(eps: float, delta: float) -> None:
    for sens in [1, 3]:
        s2 = m.gaussian_sigma2(sens, eps, delta)
        sigma = math.sqrt(s2)
        # the discrete Gaussian's own privacy profile, every integer shift up to Δ
        for shift in range(1, sens + 1):
            assert _discrete_gaussian_delta(float(s2), np.array([shift]), eps) <= delta
        # the continuous Gaussian at the same σ (analytic Gaussian) is within δ too
        assert _analytic_gaussian_delta(sigma, sens, eps) <= delta
        # and the price of the zCDP route: at most 12 % more σ than the analytic calibration
        assert sigma <= 1.12 * _analytic_gaussian_sigma(sens, eps, delta)
        # the zCDP guarantee that the calibration rests on
        assert m.zcdp_delta(sens ** 2 / (2 * float(s2)), eps) <= delta


@pytest.mark.parametrize("shift", [(1, 1), (2, 1)])
def test_gaussian_sigma_meets_epsilon_delta_for_a_vector(shift: tuple[int, int]) -> None:
    # two groups change at once (e.g. a unit in two GROUP BY cells): L2 sensitivity √2 or √5
    eps, delta = 1.0, 1e-5
    s2 = m.gaussian_sigma2(math.sqrt(shift[0] ** 2 + shift[1] ** 2), eps, delta)
    assert _discrete_gaussian_delta(float(s2), np.array(shift), eps) <= delta


def test_gaussian_calibration_is_not_loose_by_much() -> None:
    # the exact δ at the calibrated σ is not orders of magnitude below the target
    s2 = m.gaussian_sigma2(1, 1.0, 1e-5)
    assert _discrete_gaussian_delta(float(s2), np.array([1]), 1.0) > 1e-7


def test_zcdp_delta_known_values() -> None:
    # never worse than the classical conversion δ = exp(−(ε − ρ)²/(4ρ)) (Bun & Steinke 2016)
    for rho, eps in [(0.01, 1.0), (0.1, 1.0), (0.5, 3.0), (0.001, 0.2)]:
        assert m.zcdp_delta(rho, eps) <= math.exp(-((eps - rho) ** 2) / (4 * rho))
    assert m.zcdp_delta(10.0, 0.1) > 0.99  # ρ ≫ ε: no meaningful guarantee


# ---------------------------------------------------------------------------
# mechanisms and the record for the notice


def test_laplace_and_gaussian_mechanisms() -> None:
    out = m.laplace_mechanism(1000, 1, 0.5)
    assert isinstance(out.value, int) and out.mechanism == "discrete_laplace"
    assert (out.scale, out.epsilon, out.delta) == (2.0, 0.5, 0.0)
    assert out.ci95_halfwidth == m.discrete_laplace_halfwidth(2) == 6
    assert out.stddev == pytest.approx(math.sqrt(2 * math.exp(-0.5)) / (1 - math.exp(-0.5)))
    text = out.describe("count")
    assert "ε=0.5" in text and "±6" in text and "scale 2" in text
    out = m.gaussian_mechanism(1000, 1, 1, 1e-6)
    assert isinstance(out.value, int) and out.mechanism == "discrete_gaussian" and out.delta == 1e-6
    assert out.scale == pytest.approx(math.sqrt(m.gaussian_sigma2(1, 1, 1e-6)))
    assert "δ=1e-06" in out.describe("count")
    with pytest.raises(ValueError, match="value"):
        m.laplace_mechanism(1.5, 1, 1)  # type: ignore[arg-type]


def test_noisy_value_is_a_frozen_record() -> None:
    out = NoisyValue(value=3, mechanism="discrete_laplace", scale=1.0, epsilon=1.0, delta=0.0,
                     stddev=1.3, ci95_halfwidth=3.0)
    with pytest.raises(AttributeError):
        out.value = 4  # type: ignore[misc]


@pytest.mark.parametrize("call,name", [
    (lambda: m.bernoulli_exp(-1), "gamma"),
    (lambda: m.bernoulli_exp(float("nan")), "gamma"),
    (lambda: m.bernoulli_exp("1"), "gamma"),  # type: ignore[arg-type]
    (lambda: m.bernoulli_exp(True), "gamma"),
    (lambda: m.discrete_laplace(0), "scale"),
    (lambda: m.discrete_laplace(float("inf")), "scale"),
    (lambda: m.discrete_gaussian(-2), "sigma2"),
    (lambda: m.discrete_gaussian(None), "sigma2"),  # type: ignore[arg-type]
    (lambda: m.laplace_scale(0, 1), "sensitivity"),
    (lambda: m.laplace_scale(1, -1), "epsilon"),
    (lambda: m.gaussian_sigma2(1, 1, 0), "delta"),
    (lambda: m.gaussian_sigma2(1, 1, 1.5), "delta"),
    (lambda: m.gaussian_sigma2(-1, 1, 1e-6), "l2_sensitivity"),
    (lambda: m.discrete_laplace_halfwidth(1, 1.0), "confidence"),
    (lambda: m.noisy_sum_fixed_point(1.5, 1, 1, 0), "resolution"),
    (lambda: m.noisy_sum_fixed_point(float("nan"), 1, 1, 0.1), "value"),
])
def test_bad_parameters_are_named(call: Callable[[], object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        call()


# ---------------------------------------------------------------------------
# fixed point


def test_to_grid_rounds_half_up_exactly() -> None:
    assert m.to_grid(Fraction(5, 2), 1) == 3 and m.to_grid(Fraction(7, 2), 1) == 4
    assert m.to_grid(-0.5, 1) == 0 and m.to_grid(-0.51, 1) == -1
    # a value is taken exactly (the float 0.015 is a little below 3/200), a resolution as the decimal it prints as
    assert m.to_grid(0.015, 0.01) == 1
    assert m.to_grid(Fraction(3, 200), Fraction(1, 100)) == 2


def test_grid_sensitivity_holds_for_the_rounded_values() -> None:
    rng = random.Random(7)
    for sens, res in [(Fraction(1), Fraction(1, 10)), (Fraction(5, 2), Fraction(1)), (Fraction(1, 3), Fraction(1, 4))]:
        units = m.grid_sensitivity(sens, res)
        assert units == math.ceil(sens / res)
        for _ in range(2000):
            a = Fraction(rng.randint(-10**6, 10**6), 1000)
            b = a + sens * Fraction(rng.randint(-1000, 1000), 1000)
            assert abs(m.to_grid(a, res) - m.to_grid(b, res)) <= units
        # the bound is reached: a just below a rounding edge, b = a + Δ
        a = res / 2 - Fraction(1, 10**9)
        assert m.to_grid(a + sens, res) - m.to_grid(a, res) == units
    # banker's rounding would break the bound: 3.5 − 2.5 = 1 but round() gives 4 − 2 = 2
    assert round(Fraction(7, 2)) - round(Fraction(5, 2)) == 2 > m.grid_sensitivity(1, 1)


@confirmed_on_fresh_draws
def test_noisy_sum_fixed_point_releases_grid_values_with_discrete_laplace_noise() -> None:
    value, sens, eps, res = Fraction(123456789, 1000), Fraction(5, 2), 1.0, Fraction(1, 10)
    base = m.to_grid(value, res)  # 1234568
    scale = m.laplace_scale(m.grid_sensitivity(sens, res), eps)  # 25 grid steps
    outs = [m.noisy_sum_fixed_point(value, sens, eps, res) for _ in range(SMALL_DRAWS)]
    assert all(isinstance(o.value, Fraction) and (o.value / res).denominator == 1 for o in outs)
    noise = [int(o.value / res) - base for o in outs]
    assert chi_square_p(noise, laplace_pmf(scale)) > ALPHA
    first = outs[0]
    assert first.ci95_halfwidth is not None
    assert first.scale == pytest.approx(2.5) and first.resolution == res
    assert first.stddev == pytest.approx(m.discrete_laplace_stddev(scale) * 0.1)
    assert first.ci95_halfwidth == pytest.approx((m.discrete_laplace_halfwidth(scale) + 0.5) * 0.1)
    # the interval is for the unrounded value: it covers at least 95 %
    half = Fraction(first.ci95_halfwidth)
    covered = sum(abs(Fraction(o.value) - value) <= half for o in outs)
    assert binomial_p_value(covered, len(outs), _coverage(laplace_pmf(scale), m.discrete_laplace_halfwidth(scale))) > ALPHA


def test_noisy_sum_fixed_point_gaussian() -> None:
    out = m.noisy_sum_fixed_point(10.25, 1, 1, 0.01, delta=1e-6)
    s2 = m.gaussian_sigma2(100, 1, 1e-6)
    assert out.mechanism == "discrete_gaussian" and out.resolution == Fraction(1, 100)
    assert out.scale == pytest.approx(math.sqrt(s2) / 100)
    assert isinstance(out.value, Fraction) and (out.value * 100).denominator == 1


# ---------------------------------------------------------------------------
# quantiles (exponential mechanism)


def _brute_force_probabilities(values: Sequence[float], q: Fraction, grid: list[Fraction], eps: float,
                               sensitivity: float) -> list[float]:
    """The exponential mechanism written out point by point (values already on the grid)."""
    n = len(values)
    weights = []
    for y in grid:
        lo, hi = sum(v < y for v in values), sum(v <= y for v in values)
        d: Fraction = max(Fraction(0), lo - q * n, q * n - hi)
        weights.append(math.exp(-eps * float(d) / (2 * sensitivity)))
    total = math.fsum(weights)
    return [w / total for w in weights]


QUANTILE_CASES = [([1, 2, 2, 7], Fraction(1, 2), 1), ([0, 3, 3, 3, 9, 10], Fraction(9, 10), 1),
                  ([4, 4, 5, 8, 8, 8, 2], Fraction(1, 4), 2), ([], Fraction(1, 2), 1)]


@pytest.mark.parametrize("values,q,c", QUANTILE_CASES)
def test_quantile_probabilities_match_brute_force(values: list[int], q: Fraction, c: int) -> None:
    probs = qm.quantile_probabilities(values, q, 0, 10, 1.0, resolution=1, max_contributions=c)
    grid = [Fraction(j) for j in range(11)]
    expected = _brute_force_probabilities(values, q, grid, 1.0, c * float(max(q, Fraction(1) - q)))
    assert probs == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("values,q,c", QUANTILE_CASES[:3])
@confirmed_on_fresh_draws
def test_quantile_sampler_matches_its_probabilities(values: list[int], q: Fraction, c: int) -> None:
    probs = qm.quantile_probabilities(values, q, 0, 10, 1.0, resolution=1, max_contributions=c)
    draws = Counter(dp_quantile(values, q, 0, 10, 1.0, resolution=1, max_contributions=c) for _ in range(SMALL_DRAWS))
    assert set(draws) <= {float(j) for j in range(11)}
    stat = sum((draws.get(float(j), 0) - SMALL_DRAWS * p) ** 2 / (SMALL_DRAWS * p) for j, p in enumerate(probs))
    assert chi2_sf(stat, len(probs) - 1) > ALPHA


def test_quantile_mechanism_is_epsilon_dp_on_neighbours() -> None:
    # every output's probability moves by at most e^ε when one unit (c rows) is added
    rng = random.Random(11)
    eps = 0.7
    for _ in range(150):
        q = Fraction(rng.choice([1, 2, 5, 9, 10, 0]), 10)
        c = rng.choice([1, 2])
        base = [rng.randint(0, 12) for _ in range(rng.randint(0, 8))]
        extra = [rng.randint(0, 12) for _ in range(rng.randint(1, c))]
        p = qm.quantile_probabilities(base, q, 0, 12, eps, resolution=1, max_contributions=c)
        p2 = qm.quantile_probabilities(base + extra, q, 0, 12, eps, resolution=1, max_contributions=c)
        worst = max(abs(math.log(a / b)) for a, b in zip(p, p2))
        assert worst <= eps * (1 + 1e-9)


def test_quantile_sensitivity_is_needed() -> None:
    # with half the declared utility sensitivity the same neighbour check fails: the check has teeth
    grid = [Fraction(j) for j in range(13)]
    q, eps = Fraction(1, 2), 1.0
    worst = 0.0
    for base in ([3, 3, 9], [0, 1, 2, 10, 11, 12], [5], []):
        for extra in range(13):
            p = _brute_force_probabilities(base, q, grid, eps, 0.25)
            p2 = _brute_force_probabilities(base + [extra], q, grid, eps, 0.25)
            worst = max(worst, max(abs(math.log(a / b)) for a, b in zip(p, p2)))
    assert worst > eps


def test_quantile_outputs_stay_in_bounds_on_the_grid() -> None:
    values = [-1e9, float("inf"), float("-inf"), float("nan"), None, 3.3, 12.0, 7]
    for _ in range(300):
        y = dp_quantile(values, 0.5, 2.5, 10.0, 0.2, resolution=0.5)
        assert 2.5 <= y <= 10.0 and (y - 2.5) / 0.5 == int((y - 2.5) / 0.5)
    # bounds not a whole number of steps apart: the grid stops at the last step below U
    assert all(0 <= dp_quantile([5], 0.5, 0, 1, 0.1, resolution=0.3) <= 0.9 for _ in range(200))


def test_quantile_close_to_the_true_median() -> None:
    # Accuracy of the exponential mechanism: Pr[rank error > (2Δu/ε)·ln(|Y|/β)] ≤ β. With
    # values 0..10000 on a unit grid, ε = 1 and Δu = 1/2, β = 1e−6 per draw gives ±24 ranks,
    # i.e. |y − 5000| ≤ 24 (each grid point holds one value).
    values = list(range(10_001))
    bound = qm.rank_halfwidth(0.5, 0, 10_000, 1.0, resolution=1, confidence=1 - 1e-6)
    assert 23 < bound < 24
    for _ in range(10):
        assert abs(dp_quantile(values, 0.5, 0, 10_000, 1.0, resolution=1) - 5000) <= math.ceil(bound)


def test_quantile_close_to_the_true_quantile_of_skewed_data() -> None:
    # 50 000 log-normal values on [0, 100] with the default 10 000-step grid, q = 0.9: the
    # output lies between the order statistics at ranks q·n ∓ (bound + 1), widened by half a step
    rng = random.Random(3)
    values = [min(100.0, rng.lognormvariate(2.5, 0.8)) for _ in range(50_000)]
    ordered = sorted(values)
    n, q, eps = len(values), 0.9, 0.5
    bound = qm.rank_halfwidth(q, 0, 100, eps, confidence=1 - 1e-6)
    lo = ordered[max(0, math.floor(q * n - bound) - 1)] - 0.005
    hi = ordered[min(n - 1, math.ceil(q * n + bound) + 1)] + 0.005
    for _ in range(5):
        assert lo <= dp_quantile(values, q, 0, 100, eps) <= hi


def test_quantile_rank_bound_is_conservative() -> None:
    # the notice's 95 % rank bound holds for at least 95 % of draws (one-sided)
    values = list(range(200))
    eps = 0.5
    out = qm.quantile_mechanism(values, 0.5, 0, 199, eps, resolution=1)
    assert out.mechanism == "exponential" and out.rank_halfwidth95 is not None and out.ci95_halfwidth is None
    draws = [dp_quantile(values, 0.5, 0, 199, eps, resolution=1) for _ in range(2000)]
    misses = sum(max(0.0, abs(y - 99.5) - 0.5) > out.rank_halfwidth95 for y in draws)
    # Pr[Bin(2000, 0.05) ≥ 139] < 1e-4
    assert misses < 139
    assert "rank error" in out.describe("p50")


@pytest.mark.parametrize("kwargs,name", [
    ({"q": 1.5}, "q"), ({"q": -0.1}, "q"), ({"lower": 5, "upper": 5}, "lower"),
    ({"epsilon": 0}, "epsilon"), ({"resolution": 0}, "resolution"), ({"resolution": 100}, "resolution"),
    ({"max_contributions": 0}, "max_contributions"), ({"upper": float("inf")}, "upper"),
])
def test_quantile_bad_parameters(kwargs: dict[str, object], name: str) -> None:
    args: dict[str, object] = {"q": 0.5, "lower": 0, "upper": 10, "epsilon": 1.0}
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        dp_quantile([1, 2, 3], **args)  # type: ignore[arg-type]
