"""Exact discrete noise for differentially private answers (docs/design.md, principle 4).

Samplers (Canonne, Kamath, Steinke 2020, "The Discrete Gaussian for
Differential Privacy", Algorithms 1–3), on exact rationals, with every random
bit from :func:`anonproxy.dp.randomness.randbelow` (``os.urandom``, read in blocks):

* :func:`bernoulli_exp` — Bernoulli(exp(−γ)) for rational γ ≥ 0;
* :func:`discrete_laplace` — Pr[X = x] ∝ exp(−|x|/t) on the integers;
* :func:`discrete_gaussian` — Pr[X = x] ∝ exp(−x²/(2σ²)) on the integers.

No floating-point number enters a sampler: parameters are converted to
:class:`fractions.Fraction` exactly (a float is the binary rational it
represents) and the algorithms use integer arithmetic only. Floats appear in
the calibration and accuracy helpers, which only choose parameters and
describe the noise; they never touch a private value.

Calibration (docs/mechanisms.md has the derivations):

* ε-DP, L1 sensitivity Δ, integer query → discrete Laplace with t = Δ/ε
  (:func:`laplace_scale`);
* (ε, δ)-DP, L2 sensitivity Δ₂, integer query or vector of integer queries →
  discrete Gaussian with σ² = Δ₂²/(2ρ), ρ the largest zCDP parameter whose
  (ε, δ) conversion (CKS 2020, §3) meets δ (:func:`gaussian_sigma2`). The
  multivariate discrete Gaussian is (Δ₂²/2σ²)-zCDP for integer shifts (CKS 2020),
  so this is a valid guarantee for a whole GROUP BY vector, not just a scalar.

Non-integer statistics go through a fixed-point grid
(:func:`noisy_sum_fixed_point`): the exact value is rounded to the grid
r·ℤ, the noise is integer in grid units, so the released value is
``(k + noise)·r`` — no floating-point noise on raw values (Mironov 2012).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal, localcontext
from fractions import Fraction
from functools import lru_cache
from numbers import Rational

from anonproxy.dp.randomness import randbelow

__all__ = [
    "NoisyValue",
    "bernoulli_exp",
    "ceil_scaled_log",
    "combined_halfwidth",
    "discrete_gaussian",
    "discrete_gaussian_halfwidth",
    "discrete_gaussian_pmf",
    "discrete_gaussian_stddev",
    "discrete_gaussian_tail",
    "discrete_gaussian_variance",
    "discrete_laplace",
    "discrete_laplace_halfwidth",
    "discrete_laplace_pmf",
    "discrete_laplace_stddev",
    "discrete_laplace_variance",
    "discrete_noise_tail",
    "gaussian_mechanism",
    "gaussian_sigma2",
    "grid_sensitivity",
    "laplace_matched_sigma2",
    "laplace_mechanism",
    "laplace_scale",
    "noisy_sum_fixed_point",
    "to_grid",
    "zcdp_delta",
]

Number = int | float | Fraction | Decimal

#: The only source of randomness in this package's samplers (a CSPRNG:
#: ``os.urandom``, read in blocks; :mod:`anonproxy.dp.randomness` says why that is the same).
_randbelow = randbelow

CONFIDENCE = 0.95


# ---------------------------------------------------------------------------
# parameter validation


def as_rational(x: object, name: str) -> Fraction:
    """``x`` as an exact Fraction; a ValueError naming ``name`` if it is not a finite number."""
    # ValueError, not TypeError, for every bad parameter: callers catch one exception
    if isinstance(x, bool):
        raise ValueError(f"{name} must be a number, got {x!r}")  # noqa: TRY004
    if isinstance(x, Fraction):
        return x
    if isinstance(x, (int, Rational)):
        return Fraction(x)
    if isinstance(x, float) and not math.isfinite(x) or isinstance(x, Decimal) and not x.is_finite():
        raise ValueError(f"{name} must be finite, got {x!r}")
    if isinstance(x, (float, Decimal)):
        return Fraction(x)
    raise ValueError(f"{name} must be an int, Fraction, Decimal or float, got {type(x).__name__} {x!r}")


def as_decimal_rational(x: object, name: str) -> Fraction:
    """Like :func:`as_rational`, but a float is read as the decimal it prints as (0.01 → 1/100).

    For grid spacings and bounds, where the policy author means a decimal and
    any exact choice is equally private.
    """
    if isinstance(x, float) and math.isfinite(x):
        return Fraction(repr(x))
    return as_rational(x, name)


def as_positive(x: object, name: str) -> Fraction:
    value = as_rational(x, name)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {x!r}")
    return value


def _non_negative(x: object, name: str) -> Fraction:
    value = as_rational(x, name)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {x!r}")
    return value


def _delta(x: object) -> Fraction:
    value = as_rational(x, "delta")
    if not 0 <= value < 1:
        raise ValueError(f"delta must be in [0, 1), got {x!r}")
    return value


def _confidence(x: float) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x < 1:
        raise ValueError(f"confidence must be in (0, 1), got {x!r}")
    return float(x)


def _round_up(x: Fraction, digits: int = 12) -> Fraction:
    """``x`` if its denominator is small, else the smallest 12-significant-digit decimal ≥ x.

    Used on noise scales: a larger scale is always at least as private, and a
    short rational keeps the samplers' integers small.
    """
    if x.denominator <= 10**6:
        return x
    exponent = math.floor(math.log10(x)) if x > 0 else 0
    unit = Fraction(10) ** (exponent - digits + 1)
    return math.ceil(x / unit) * unit


# ---------------------------------------------------------------------------
# samplers (integer arithmetic only)


def _bernoulli_exp_at_most_one(num: int, den: int) -> bool:
    """Bernoulli(exp(−num/den)) for 0 ≤ num ≤ den (CKS Algorithm 1, first case).

    Draw A_k ~ Bernoulli(γ/k) for k = 1, 2, … until the first A_k = 0; the
    index K at which that happens satisfies Pr[K > k] = γ^k/k!, so
    Pr[K odd] = Σ_j (−γ)^j/j! = exp(−γ).
    """
    k = 1
    while _randbelow(den * k) < num:
        k += 1
    return k % 2 == 1


def _bernoulli_exp(num: int, den: int) -> bool:
    """Bernoulli(exp(−num/den)) for num ≥ 0, den ≥ 1 (CKS Algorithm 1).

    exp(−γ) = exp(−1)^⌊γ⌋ · exp(−(γ − ⌊γ⌋)): stop at the first failure. Each
    factor fails with probability 1 − 1/e, so the expected work is bounded
    whatever γ is.
    """
    if num <= den:
        return _bernoulli_exp_at_most_one(num, den)
    whole, rest = divmod(num, den)
    for _ in range(whole):
        if not _bernoulli_exp_at_most_one(1, 1):
            return False
    return _bernoulli_exp_at_most_one(rest, den)


def _discrete_laplace(t: int, s: int) -> int:
    """Discrete Laplace with scale t/s, integers t, s ≥ 1 (CKS Algorithm 2).

    U uniform on {0..t−1} kept with probability exp(−U/t), plus t·V with V
    geometric (Bernoulli(exp(−1)) trials), is geometric with ratio exp(−1/t);
    ⌊X/s⌋ is geometric with ratio exp(−s/t); a random sign, rejecting −0 so
    that zero is not counted twice, gives Pr[Z = z] ∝ exp(−|z|·s/t).
    """
    while True:
        u = _randbelow(t)
        if not _bernoulli_exp(u, t):
            continue
        v = 0
        while _bernoulli_exp_at_most_one(1, 1):
            v += 1
        y = (u + t * v) // s
        negative = _randbelow(2) == 1
        if negative and y == 0:
            continue
        return -y if negative else y


def _discrete_gaussian(p: int, q: int) -> int:
    """Discrete Gaussian with σ² = p/q, integers p, q ≥ 1 (CKS Algorithm 3).

    Rejection sampling from a discrete Laplace with integer scale
    t = ⌊σ⌋ + 1: accept Y with probability exp(−(|Y| − σ²/t)²/(2σ²)). The
    acceptance exponent is the rational (|Y|·q·t − p)² / (2·p·q·t²).
    """
    t = math.isqrt(p // q) + 1  # ⌊σ⌋ + 1, since ⌊√x⌋ = ⌊√⌊x⌋⌋
    den = 2 * p * q * t * t
    while True:
        y = _discrete_laplace(t, 1)
        if _bernoulli_exp((abs(y) * q * t - p) ** 2, den):
            return y


def bernoulli_exp(gamma: Number) -> bool:
    """True with probability exactly exp(−gamma), for a rational gamma ≥ 0."""
    g = _non_negative(gamma, "gamma")
    return _bernoulli_exp(g.numerator, g.denominator)


def discrete_laplace(scale: Number) -> int:
    """One draw X with Pr[X = x] = tanh(1/(2t))·exp(−|x|/t) for all integers x, t = scale > 0."""
    t = as_positive(scale, "scale")
    return _discrete_laplace(t.numerator, t.denominator)


def discrete_gaussian(sigma2: Number) -> int:
    """One draw X with Pr[X = x] ∝ exp(−x²/(2·sigma2)) for all integers x, sigma2 > 0."""
    s2 = as_positive(sigma2, "sigma2")
    return _discrete_gaussian(s2.numerator, s2.denominator)


# ---------------------------------------------------------------------------
# calibration


def laplace_scale(sensitivity: Number, epsilon: Number) -> Fraction:
    """The discrete Laplace scale t = Δ/ε for ε-DP with L1 sensitivity Δ.

    For integer queries whose value moves by at most Δ between neighbours,
    Pr[q(D)+X = y] / Pr[q(D')+X = y] = exp((|y−q(D')| − |y−q(D)|)/t) ≤ exp(Δ/t) = e^ε.
    Exact when Δ/ε has a small denominator, else rounded *up* to 12
    significant digits (more noise, never less).
    """
    delta1 = as_positive(sensitivity, "sensitivity")
    eps = as_positive(epsilon, "epsilon")
    return _round_up(delta1 / eps)


def _log_zcdp_delta(rho: float, epsilon: float, alpha: float) -> float:
    """log of exp((α−1)(αρ−ε)) · (1 − 1/α)^α / (α − 1), the CKS 2020 bound at α."""
    return (alpha - 1) * (alpha * rho - epsilon) + alpha * math.log1p(-1 / alpha) - math.log(alpha - 1)


def zcdp_delta(rho: float, epsilon: float) -> float:
    """A δ such that ρ-zCDP implies (ε, δ)-DP (Canonne–Kamath–Steinke 2020, §3).

    δ = inf_{α>1} exp((α−1)(αρ−ε)) · (1 − 1/α)^α / (α − 1). Every α gives a
    valid bound, so an imperfect numerical minimisation only errs on the safe
    side. (Derivation: max(0, 1 − e^{ε−L}) ≤ e^{(α−1)(L−ε)}·(1−1/α)^α/(α−1)
    for every privacy loss L, and E[e^{(α−1)L}] = e^{(α−1)D_α} ≤ e^{(α−1)αρ}.)
    """
    if not rho > 0:
        raise ValueError(f"rho must be > 0, got {rho!r}")
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    # search over log(α − 1): a coarse grid, then golden-section refinement
    lo, hi = -30.0, 30.0
    grid = [lo + (hi - lo) * i / 240 for i in range(241)]

    def f(z: float) -> float:
        return _log_zcdp_delta(rho, epsilon, 1 + math.exp(z))

    best = min(range(len(grid)), key=lambda i: f(grid[i]))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(100):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    log_delta = min(fc, fd, f(grid[best]))
    return min(1.0, math.exp(log_delta)) if log_delta < 700 else 1.0


@lru_cache(maxsize=1024)
def _gaussian_sigma2(l2: Fraction, epsilon: float, delta: float) -> Fraction:
    # The largest ρ with zcdp_delta(ρ, ε) ≤ δ, by bisection on log ρ (δ(ρ) increases with ρ).
    target = delta * (1 - 1e-9)  # margin for float rounding in zcdp_delta
    lo, hi = math.log(1e-16), math.log(max(epsilon, 1e-16)) + 2
    if zcdp_delta(math.exp(lo), epsilon) > target:
        raise ValueError(f"epsilon={epsilon!r}, delta={delta!r} are too small to calibrate a discrete Gaussian")
    for _ in range(100):
        mid = (lo + hi) / 2
        if zcdp_delta(math.exp(mid), epsilon) <= target:
            lo = mid
        else:
            hi = mid
    rho = math.exp(lo)
    sigma2 = _round_up(Fraction(l2) ** 2 / (2 * Fraction(rho)))
    # re-check at the σ² actually used (rounded up, so ρ only shrinks)
    if zcdp_delta(float(Fraction(l2) ** 2 / (2 * sigma2)), epsilon) > delta:  # pragma: no cover
        raise RuntimeError(f"discrete Gaussian calibration failed for epsilon={epsilon}, delta={delta}")
    return sigma2


def gaussian_sigma2(l2_sensitivity: Number, epsilon: Number, delta: Number) -> Fraction:
    """σ² of a discrete Gaussian giving (ε, δ)-DP for a query of L2 sensitivity Δ₂.

    The query may be a single integer or a vector of integers (one per group)
    whose difference between neighbours has Euclidean norm ≤ Δ₂; noise of this
    σ² is added to every coordinate independently, and ε, δ are for the whole
    vector. σ² = Δ₂²/(2ρ) with ρ the largest value for which ρ-zCDP implies
    (ε, δ)-DP by :func:`zcdp_delta` — valid because the multivariate discrete
    Gaussian is (Δ₂²/2σ²)-zCDP for integer shifts (CKS 2020). Rounded up to a short rational.
    """
    l2 = as_positive(l2_sensitivity, "l2_sensitivity")
    eps = as_positive(epsilon, "epsilon")
    dlt = _delta(delta)
    if dlt == 0:
        raise ValueError("delta must be > 0 for the discrete Gaussian; use the discrete Laplace for pure ε-DP")
    return _gaussian_sigma2(l2, float(eps), float(dlt))


# ---------------------------------------------------------------------------
# what the noise looks like (floats: these describe, they do not sample)


def _laplace_t(scale: Number) -> float:
    return float(as_positive(scale, "scale"))


def discrete_laplace_pmf(x: int, scale: Number) -> float:
    """Pr[X = x] = tanh(1/(2t))·exp(−|x|/t), i.e. (1−α)/(1+α)·α^|x| with α = exp(−1/t)."""
    t = _laplace_t(scale)
    return math.tanh(0.5 / t) * math.exp(-abs(x) / t)


def discrete_laplace_variance(scale: Number) -> float:
    """Var X = 2α/(1−α)² = 1/(2·sinh²(1/(2t))); ``inf`` past the float range (t ≳ 10¹⁵⁴)."""
    sd = discrete_laplace_stddev(scale)
    return sd * sd


def discrete_laplace_stddev(scale: Number) -> float:
    """√Var X = 1/(√2·sinh(1/(2t))), without squaring: finite for every float t."""
    x = 0.5 / _laplace_t(scale)
    if x > 300:  # sinh would overflow; then α = e^(−2x) < 1e−260 and √(2α)/(1−α) = √2·e^(−x) in doubles
        return math.sqrt(2) * math.exp(-x)
    return math.sqrt(0.5) / math.sinh(x)


def ceil_scaled_log(scale: Number, log_of_alpha: Callable[[Decimal], Decimal]) -> int:
    """⌈t·L⌉ with t = ``scale`` and L = ``log_of_alpha(α)``, α = e^(−1/t), evaluated in decimal arithmetic.

    The closed forms of the discrete Laplace's interval and of the partition-selection threshold are ⌈t·L⌉
    for a logarithm L. In doubles, t·L cannot resolve single integers once t ≳ 10¹⁵, and correcting a float
    estimate step by step never ends; here every operation carries 30 digits more than t·L has, so the
    result is the exact ceiling unless t·L is within ~10⁻²⁵ of an integer — for any t, tiny or huge.
    """
    t = as_positive(scale, "scale")
    with localcontext(prec=len(str(t.numerator // t.denominator)) + 30):
        exact_t = Decimal(t.numerator) / Decimal(t.denominator)
        product = exact_t * log_of_alpha((-1 / exact_t).exp())  # e^(−1/t) underflows to 0 for tiny t: right
        return int(product.to_integral_value(rounding=ROUND_CEILING))


def discrete_laplace_halfwidth(scale: Number, confidence: float = CONFIDENCE) -> int:
    """The smallest integer h with Pr[|X| ≤ h] ≥ confidence (exact, from the CDF).

    So ``value ± h`` covers the true integer value with probability at least
    ``confidence``, and ``value ± (h−1)`` would not.
    """
    level = Decimal(_confidence(confidence))  # exactly the float's value
    # Pr[|X| ≥ h+1] = 2α^(h+1)/(1+α) ≤ 1 − level  ⇔  h+1 ≥ t·ln(2/((1+α)·(1 − level)))
    return max(0, ceil_scaled_log(scale, lambda alpha: (2 / ((1 + alpha) * (1 - level))).ln()) - 1)


_DIRECT_SUM_SIGMA2 = 100.0  # σ² up to which normalising sums are done term by term
_DIRECT_CDF_SIGMA = 10_000.0  # σ up to which the interval is found by summing the pmf


def _gaussian_s2(sigma2: Number) -> float:
    return float(as_positive(sigma2, "sigma2"))


@lru_cache(maxsize=256)
def _gaussian_moments(s2: float) -> tuple[float, float]:
    """(Z, Σ x²·exp(−x²/2σ²)) with Z = Σ exp(−x²/2σ²) over the integers.

    Term by term for small σ; for larger σ by Poisson summation, which is an
    identity: Σ_x e^{−x²/2σ²} = √(2π)σ·Σ_k e^{−2π²σ²k²} (and likewise for the
    second moment); the k ≠ 0 terms are below 1e−800 once σ² ≥ 100.
    """
    if s2 <= _DIRECT_SUM_SIGMA2:
        z, m2 = 1.0, 0.0
        x = 1
        while True:
            w = math.exp(-x * x / (2 * s2))
            if w < 1e-300:
                break
            z += 2 * w
            m2 += 2 * x * x * w
            x += 1
        return z, m2
    sigma = math.sqrt(s2)
    root = math.sqrt(2 * math.pi) * sigma
    return root, root * s2


def discrete_gaussian_pmf(x: int, sigma2: Number) -> float:
    """Pr[X = x] = exp(−x²/(2σ²)) / Σ_y exp(−y²/(2σ²))."""
    s2 = _gaussian_s2(sigma2)
    z, _ = _gaussian_moments(s2)
    return math.exp(-x * x / (2 * s2)) / z


def discrete_gaussian_variance(sigma2: Number) -> float:
    """Var X; slightly below σ² for small σ, equal to σ² in double precision once σ ≥ 2."""
    s2 = _gaussian_s2(sigma2)
    z, m2 = _gaussian_moments(s2)
    return m2 / z


def discrete_gaussian_stddev(sigma2: Number) -> float:
    return math.sqrt(discrete_gaussian_variance(sigma2))


@lru_cache(maxsize=256)
def _gaussian_halfwidth(s2: float, confidence: float) -> int:
    sigma = math.sqrt(s2)
    if sigma <= _DIRECT_CDF_SIGMA:
        z, _ = _gaussian_moments(s2)
        target = confidence * z
        covered, h = 1.0, 0
        while covered < target:
            h += 1
            covered += 2 * math.exp(-h * h / (2 * s2))
        return h
    # Large σ: Σ_{|x|≤h} e^{−x²/2σ²} = ∫_{−h−½}^{h+½} e^{−x²/2σ²}dx to a relative error
    # far below 1e−9 (midpoint rule on a function that varies on the scale σ ≫ 1).
    def covers(h: int) -> bool:
        return math.erf((h + 0.5) / (sigma * math.sqrt(2))) >= confidence

    lo, hi = 0, math.ceil(10 * sigma)
    while lo < hi:
        mid = (lo + hi) // 2
        if covers(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def discrete_gaussian_halfwidth(sigma2: Number, confidence: float = CONFIDENCE) -> int:
    """The smallest integer h with Pr[|X| ≤ h] ≥ confidence, from the discrete Gaussian's own CDF."""
    return _gaussian_halfwidth(_gaussian_s2(sigma2), _confidence(confidence))


@lru_cache(maxsize=1024)
def _gaussian_tail(s2: float, k: int) -> float:
    z, _ = _gaussian_moments(s2)
    sigma = math.sqrt(s2)
    if sigma > _DIRECT_CDF_SIGMA:
        # e^{−x²/2σ²} decreases for x ≥ k ≥ 0, so Σ_{x≥k} ≤ f(k) + ∫_k^∞ f: an upper bound, within one term.
        integral = sigma * math.sqrt(math.pi / 2) * math.erfc(k / (sigma * math.sqrt(2)))
        return (math.exp(-k * k / (2 * s2)) + integral) / z
    total, x = 0.0, k
    while True:
        term = math.exp(-x * x / (2 * s2))
        total += term
        if term <= total * 1e-18:
            return total / z
        x += 1


def discrete_gaussian_tail(k: int, sigma2: Number) -> float:
    """Pr[X ≥ k] for the discrete Gaussian of parameter σ² and an integer k ≥ 0: summed term by term up to
    σ = 10⁴ (to double precision), beyond that bounded above by one term plus the integral of the rest."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")
    return _gaussian_tail(_gaussian_s2(sigma2), k)


def discrete_noise_tail(mechanism: str, parameter: Number, k: int) -> float:
    """Pr[X ≥ k] for any integer k: X a discrete Laplace of scale ``parameter`` (``mechanism``
    "discrete_laplace") or a discrete Gaussian of parameter σ² (else). For describing noise, not for privacy: past
    σ = 50 the Gaussian's sum is its continuity-corrected integral."""
    if k <= 0:
        return 1 - discrete_noise_tail(mechanism, parameter, 1 - k)
    if mechanism == "discrete_laplace":
        t = _laplace_t(parameter)
        return math.exp(-k / t) / (1 + math.exp(-1 / t))
    s2 = _gaussian_s2(parameter)
    if s2 <= 2500:
        return _gaussian_tail(s2, k)
    return 0.5 * math.erfc((k - 0.5) / math.sqrt(2 * s2))


def combined_halfwidth(first: tuple[str, Number, Fraction], second: tuple[str, Number, Fraction],
                       confidence: float = CONFIDENCE) -> Fraction | None:
    """The smallest h with Pr[|a·X + b·Y| ≤ h] ≥ ``confidence``, for independent discrete noises X, Y given as
    (mechanism, parameter, weight), as :func:`discrete_noise_tail` reads them, with rational weights a > 0, b ≥ 0:
    a·X + b·Y lies on the lattice g·ℤ, g = gcd(a, b), and h is found on it. Summed over Y's values up to a tail of
    10⁻¹²; None when that is more than 4,001 values (the caller then bounds it otherwise)."""
    level = 1 - _confidence(confidence)
    (x_kind, x_parameter, a), (y_kind, y_parameter, b) = first, second
    if y_kind == "discrete_laplace":
        reach = math.ceil(_laplace_t(y_parameter) * math.log(1e12))
    else:
        reach = math.ceil(7.5 * math.sqrt(_gaussian_s2(y_parameter))) + 1
    if reach > 2000 or not a > 0 or b < 0:
        return None
    weights = [(y, discrete_noise_tail(y_kind, y_parameter, y) - discrete_noise_tail(y_kind, y_parameter, y + 1))
               for y in range(-reach, reach + 1)]
    grid = Fraction(math.gcd(a.numerator * b.denominator, b.numerator * a.denominator), a.denominator * b.denominator)
    steps_a, steps_b = int(a / grid), int(b / grid)  # a = A·g, b = B·g: integer arithmetic below

    def outside(m: int) -> float:  # Pr[|aX + bY| > m·g] = Σ_y p(y)·(Pr[X > (m − By)/A] + Pr[X > (m + By)/A])
        return math.fsum(p * (discrete_noise_tail(x_kind, x_parameter, (m - steps_b * y) // steps_a + 1)
                              + discrete_noise_tail(x_kind, x_parameter, (m + steps_b * y) // steps_a + 1))
                         for y, p in weights)

    low, high = 0, max(1, math.ceil((a + b) / grid))
    while outside(high) > level:
        low, high = high, high * 2
    while low < high:
        middle = (low + high) // 2
        if outside(middle) > level:
            low = middle + 1
        else:
            high = middle
    return high * grid


@lru_cache(maxsize=256)  # a few scales recur (per ε share and bounds); the bisection costs ms per new question
def laplace_matched_sigma2(scale: Number) -> Fraction:
    """The σ² of the discrete Gaussian whose variance equals that of the discrete Laplace of scale t (never
    less), rounded up to a short rational: the Gaussian a statistic uses for the accuracy a Laplace at the same
    ε share would give it. For σ ≥ 10 the discrete Gaussian's variance is σ² in double precision; below, it is
    slightly less than σ², and σ² is found by bisection."""
    target = discrete_laplace_variance(scale)
    if not math.isfinite(target):
        raise OverflowError("the discrete Laplace's variance is beyond the range of a double")
    if target >= _DIRECT_SUM_SIGMA2:
        return _round_up(Fraction(target))
    low, high = target, target + 1  # Var(σ²) ≤ σ², and Var(σ² + 1) ≥ σ² for every σ²
    for _ in range(80):
        middle = (low + high) / 2
        if discrete_gaussian_variance(middle) >= target:
            high = middle
        else:
            low = middle
    return _round_up(Fraction(high))


# ---------------------------------------------------------------------------
# mechanisms: a value plus noise, and what to tell the analyst


@dataclass(frozen=True, slots=True)
class NoisyValue:
    """A released value and what the accuracy notice needs to say about it.

    ``scale`` is the discrete Laplace t or the discrete Gaussian σ, and
    ``stddev`` / ``ci95_halfwidth`` the noise's standard deviation and the
    half-width of a two-sided interval that holds the true value with
    probability ≥ 95 %, all in the units of ``value``. For the exponential
    mechanism (quantiles) no value interval can be stated without looking at
    the data again; ``rank_halfwidth95`` gives the 95 % bound on how far the
    released value's rank is from the requested one instead.
    """

    value: int | Fraction | float
    mechanism: str  # "discrete_laplace" | "discrete_gaussian" | "exponential"
    scale: float
    epsilon: float
    delta: float
    stddev: float | None
    ci95_halfwidth: float | None
    resolution: Fraction | None = None  # grid spacing of a fixed-point value
    rank_halfwidth95: float | None = None

    def describe(self, column: str) -> str:
        """One line for a NoticeResponse."""
        names = {"discrete_laplace": "discrete Laplace", "discrete_gaussian": "discrete Gaussian",
                 "exponential": "exponential mechanism"}
        parts = [f"{column}: {names.get(self.mechanism, self.mechanism)}, ε={self.epsilon:g}"]
        if self.delta:
            parts.append(f"δ={self.delta:g}")
        if self.mechanism == "discrete_laplace":
            parts.append(f"scale {self.scale:g}")
        elif self.mechanism == "discrete_gaussian":
            parts.append(f"σ {self.scale:g}")
        if self.stddev is not None:
            parts.append(f"sd {self.stddev:.3g}")
        if self.ci95_halfwidth is not None:
            parts.append(f"95% interval ±{self.ci95_halfwidth:g}")
        if self.rank_halfwidth95 is not None:
            parts.append(f"95% rank error ≤ {self.rank_halfwidth95:.3g}")
        return ", ".join(parts)


def _integer(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")  # noqa: TRY004
    return value


def laplace_mechanism(value: int, sensitivity: Number, epsilon: Number) -> NoisyValue:
    """``value`` + discrete Laplace(Δ/ε): ε-DP for an integer query of L1 sensitivity Δ."""
    x = _integer(value, "value")
    t = laplace_scale(sensitivity, epsilon)
    return NoisyValue(
        value=x + discrete_laplace(t), mechanism="discrete_laplace", scale=float(t),
        epsilon=float(epsilon), delta=0.0, stddev=discrete_laplace_stddev(t),
        ci95_halfwidth=float(discrete_laplace_halfwidth(t)),
    )


def gaussian_mechanism(value: int, l2_sensitivity: Number, epsilon: Number, delta: Number) -> NoisyValue:
    """``value`` + discrete Gaussian calibrated by :func:`gaussian_sigma2`.

    For a vector (e.g. one count per group), call it once per coordinate with
    the vector's L2 sensitivity and the (ε, δ) of the whole vector.
    """
    x = _integer(value, "value")
    s2 = gaussian_sigma2(l2_sensitivity, epsilon, delta)
    return NoisyValue(
        value=x + discrete_gaussian(s2), mechanism="discrete_gaussian", scale=math.sqrt(s2),
        epsilon=float(epsilon), delta=float(delta), stddev=discrete_gaussian_stddev(s2),
        ci95_halfwidth=float(discrete_gaussian_halfwidth(s2)),
    )


def as_resolution(x: object) -> Fraction:
    r = as_decimal_rational(x, "resolution")
    if r <= 0:
        raise ValueError(f"resolution must be > 0, got {x!r}")
    return r


def to_grid(value: Number, resolution: Number) -> int:
    """k with k·r nearest to value, ties upwards: ⌊value/r + ½⌋, exactly.

    Half-up rounding is ⌊x + c⌋ for a constant c, so for |a − b| ≤ Δ/r the
    rounded values differ by an integer < Δ/r + 1, i.e. by at most ⌈Δ/r⌉
    (:func:`grid_sensitivity`). Round-half-even would not keep that bound
    (3.5 → 4, 2.5 → 2).
    """
    r = as_resolution(resolution)
    return math.floor(as_rational(value, "value") / r + Fraction(1, 2))


def grid_sensitivity(sensitivity: Number, resolution: Number) -> int:
    """⌈Δ/r⌉: the sensitivity, in grid units, of ``to_grid(q(D), r)`` when q has sensitivity Δ."""
    return math.ceil(as_positive(sensitivity, "sensitivity") / as_resolution(resolution))


def noisy_sum_fixed_point(value: Number, sensitivity: Number, epsilon: Number, resolution: Number,
                          *, delta: Number = 0) -> NoisyValue:
    """A non-integer statistic released on the grid r·ℤ with integer noise.

    ``value`` is the exact statistic (e.g. a SUM over values clamped to
    declared bounds, ideally computed as ``numeric`` by PostgreSQL), with
    sensitivity Δ (L1 for δ = 0, L2 for δ > 0) in the value's own units.
    The released value is ``(to_grid(value, r) + N)·r`` with N a discrete
    Laplace of scale ⌈Δ/r⌉/ε (δ = 0) or a discrete Gaussian calibrated for
    (ε, δ) and L2 sensitivity ⌈Δ/r⌉ (δ > 0): ε-DP resp. (ε, δ)-DP, and every
    output is a multiple of r whatever the input, so the low-order bits carry
    nothing (Mironov 2012). The interval adds r/2 for the rounding to the grid.
    """
    r = as_resolution(resolution)
    k = to_grid(value, r)
    units = grid_sensitivity(sensitivity, r)
    if _delta(delta) == 0:
        t = laplace_scale(units, epsilon)
        noise, scale = discrete_laplace(t), float(t * r)
        sd, h = discrete_laplace_stddev(t), discrete_laplace_halfwidth(t)
        mechanism = "discrete_laplace"
    else:
        s2 = gaussian_sigma2(units, epsilon, delta)
        noise, scale = discrete_gaussian(s2), math.sqrt(s2) * float(r)
        sd, h = discrete_gaussian_stddev(s2), discrete_gaussian_halfwidth(s2)
        mechanism = "discrete_gaussian"
    return NoisyValue(
        value=(k + noise) * r, mechanism=mechanism, scale=scale, epsilon=float(epsilon),
        delta=float(delta), stddev=sd * float(r), ci95_halfwidth=float((h + Fraction(1, 2)) * r),
        resolution=r,
    )
