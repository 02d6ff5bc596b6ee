"""95 % intervals of released dp values, computed from the released (noisy) values alone (docs/dp.md, "Intervals").

Everything here is post-processing of noisy statistics and of the plan (noise laws, bounds, threshold): it reads no
exact value, so it costs no privacy budget. Three constructions:

* a sum, or a count of a group that exists whatever the data (public keys, no GROUP BY): value ± the noise's exact
  95 % half-width (the statistic's ``ci95_halfwidth``), a count's lower end at least 0;
* a count whose noisy value also decided the group's release (partition selection, ``value ≥ τ``): the interval is
  built for the draws *that were released* (:func:`selected_count`), so it stays honest near the threshold, where
  the released counts are biased upward;
* an average c + S̃/Ñ (S = Σ(x − c)): its error is (e_S − μ·e_N)/Ñ exactly, μ = true average − c, so the interval is
  every candidate average a with |c + S̃/Ñ − a| ≤ q(a − c)/Ñ, q(w) the 95 % quantile of |e_S − w·e_N|
  (:func:`average`), not a worst case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from statistics import NormalDist

from anonproxy.dp.mechanisms import (
    CONFIDENCE,
    discrete_gaussian_halfwidth,
    discrete_laplace_halfwidth,
    discrete_noise_tail,
)

__all__ = ["Average", "Law", "Spread", "average", "average_value", "digits", "law", "outward",
           "selected_average", "selected_count", "spread", "sum_quantile"]

_DISCRETE_GAUSSIAN = "discrete_gaussian"


@dataclass(frozen=True)
class Spread:
    """One statistic's noise in its value units: its family and standard deviation."""

    gaussian: bool
    sd: float


def spread(mechanism: str, stddev: float | None) -> Spread:
    return Spread(mechanism == _DISCRETE_GAUSSIAN, float(stddev or 0.0))


def sum_quantile(first: Spread, second: Spread, weight: float, confidence: float = CONFIDENCE) -> float:
    """The ``confidence`` quantile of |A − weight·B|, A and B independent noises of these spreads.

    Two Gaussians: their sum is Gaussian. Otherwise each term is taken as a continuous Laplace of its standard
    deviation (a Gaussian term as a Laplace, whose tails are heavier: the interval can only widen), and the sum of
    two Laplaces of scales a, b has Pr[|X| > x] = (a²e^(−x/a) − b²e^(−x/b))/(a² − b²) (from the product of their
    characteristic functions 1/(1 + a²ω²)·1/(1 + b²ω²)), solved for x by bisection.
    """
    sds = [s for s in (first.sd, abs(weight) * second.sd) if s > 0]
    if not sds:
        return 0.0
    gaussian = all(part.gaussian for part, s in ((first, first.sd), (second, abs(weight) * second.sd)) if s > 0)
    if gaussian:
        return NormalDist().inv_cdf((1 + confidence) / 2) * math.hypot(*sds)
    scales = sorted((s / math.sqrt(2) for s in sds), reverse=True)
    a, b = scales[0], scales[1] if len(scales) > 1 else 0.0
    miss = 1 - confidence

    def tail(x: float) -> float:
        if b == 0:
            return math.exp(-x / a)
        if (a - b) <= 1e-9 * a:
            return math.exp(-x / a) * (1 + x / (2 * a))
        return (a * a * math.exp(-x / a) - b * b * math.exp(-x / b)) / (a * a - b * b)

    low, high = 0.0, 2 * a * math.log(2 / miss)  # Pr[|X| > x] ≤ 2e^(−x/(2a)) ≤ miss there
    if not math.isfinite(high):
        return math.inf
    for _ in range(100):
        middle = (low + high) / 2
        if tail(middle) > miss:
            low = middle
        else:
            high = middle
    return high


@dataclass(frozen=True)
class Average:
    value: Fraction  # the released average: c + S̃/max(Ñ, 1), clamped to [L, U]
    halfwidth: float  # q/max(Ñ, 1): what the digits are rounded to
    low: Fraction
    high: Fraction


_TABLE_STEPS = 64  # q(w) is tabulated at this many steps of w between 0 and the farther bound


@lru_cache(maxsize=256)
def _quantile_table(first: Spread, second: Spread, reach: float, confidence: float) -> tuple[float, ...]:
    return tuple(sum_quantile(first, second, reach * i / _TABLE_STEPS, confidence) for i in range(_TABLE_STEPS + 1))


def _quantile_at(table: tuple[float, ...], reach: float, weight: float) -> float:
    """q(weight) by linear interpolation in the table: q is convex in |w|, so the chord lies above it (wider)."""
    x = min(abs(weight), reach) / reach * _TABLE_STEPS if reach > 0 else 0.0
    i = min(int(x), _TABLE_STEPS - 1)
    return table[i] + (table[i + 1] - table[i]) * (x - i)


def average_value(total: Fraction, count: int, center: Fraction, lower: Fraction, upper: Fraction,
                  sum_spread: Spread, count_spread: Spread, confidence: float = CONFIDENCE) -> tuple[Fraction, float]:
    """The released average c + S̃/max(Ñ, 1), clamped to [L, U], and the half-width q(value − c)/Ñ its digits are
    rounded to (the interval's width at the released value)."""
    n = max(count, 1)
    value = min(max(center + total / n, lower), upper)
    reach = float(max(upper - center, center - lower))
    table = _quantile_table(sum_spread, count_spread, reach, confidence)
    return value, _quantile_at(table, reach, float(value - center)) / n


def average(total: Fraction, count: int, center: Fraction, lower: Fraction, upper: Fraction,
            sum_spread: Spread, count_spread: Spread, confidence: float = CONFIDENCE) -> Average:
    """The released average of a group and its interval, from the noisy centred sum S̃ and noisy count Ñ.

    AVG − true = (e_S − μ·e_N)/Ñ exactly (Ñ ≥ 1, before clamping), μ = true − c. So a candidate true average a is
    accepted when |v − a| ≤ q(a − c)/Ñ, v = c + S̃/Ñ unclamped and q(w) the quantile of |e_S − w·e_N|: each
    candidate is judged with its own weight, and the interval (the accepted a in [L, U]; the true average lies
    there, values being clamped) covers the truth exactly when the truth's own error is within its quantile —
    95 % of answers, whatever the group's size. On each side of v, |v − a| − q(a − c)/Ñ is concave (q is convex
    in a), so each end is one bisection. The interval always contains the released value (clamped to [L, U]).
    """
    n = max(count, 1)
    unclamped = center + total / n
    value, half = average_value(total, count, center, lower, upper, sum_spread, count_spread, confidence)
    reach = float(max(upper - center, center - lower))
    table = _quantile_table(sum_spread, count_spread, reach, confidence)
    if not all(math.isfinite(q) for q in table):  # noise beyond the range of a double: nothing is known
        return Average(value, half, lower, upper)
    v, c, low_f, high_f = float(unclamped), float(center), float(lower), float(upper)

    def excess(a: float) -> float:  # ≤ 0: a is accepted
        return abs(v - a) - _quantile_at(table, reach, a - c) / n

    def first(lo: float, hi: float) -> float | None:  # the smallest accepted a in [lo, hi] (excess concave)
        if excess(lo) <= 0:
            return lo
        if excess(hi) > 0:
            return None
        for _ in range(60):
            middle = (lo + hi) / 2
            lo, hi = (middle, hi) if excess(middle) > 0 else (lo, middle)
        return hi

    def last(lo: float, hi: float) -> float | None:  # the largest accepted a in [lo, hi]
        if excess(hi) <= 0:
            return hi
        if excess(lo) > 0:
            return None
        for _ in range(60):
            middle = (lo + hi) / 2
            lo, hi = (middle, hi) if excess(middle) <= 0 else (lo, middle)
        return lo

    left = (low_f, min(v, high_f)) if v >= low_f else None  # the sides of v within [L, U]
    right = (max(v, low_f), high_f) if v <= high_f else None
    low_end = (first(*left) if left else None)
    if low_end is None and right:
        low_end = first(*right)
    high_end = (last(*right) if right else None)
    if high_end is None and left:
        high_end = last(*left)
    low = value if low_end is None else min(max(Fraction(low_end), lower), value)
    high = value if high_end is None else max(min(Fraction(high_end), upper), value)
    return Average(value, half, low, high)


def digits(halfwidth: float) -> int:
    """The decimal exponent a value with this 95 % half-width is rounded to: one place below the half-width's
    leading digit (±51: units, ±0.3: hundredths); 16 decimals when there is no finite, positive half-width."""
    if not (math.isfinite(halfwidth) and halfwidth > 0):
        return -16
    return math.floor(math.log10(halfwidth)) - 1


def outward(low: Fraction, high: Fraction, exponent: int) -> tuple[Decimal, Decimal]:
    """[low, high] widened to multiples of 10^exponent, as numerics (widening never loses coverage)."""
    step = Fraction(10) ** exponent
    return Decimal(math.floor(low / step)).scaleb(exponent), Decimal(math.ceil(high / step)).scaleb(exponent)


# --- counts released through partition selection ----------------------------------------------------------------


@dataclass(frozen=True)
class Law:
    """The integer noise of one count: discrete Laplace of scale t, or discrete Gaussian of variance σ²."""

    gaussian: bool
    scale: float  # t, or σ

    def sf(self, k: int) -> float:
        """Pr[e ≥ k]."""
        return _tail(self.gaussian, self.scale, k)


@lru_cache(maxsize=4096)
def _tail(gaussian: bool, scale: float, k: int) -> float:
    """Pr[e ≥ k], kept: the interval of every released group asks for the same few tails of one law."""
    if gaussian:
        return discrete_noise_tail(_DISCRETE_GAUSSIAN, scale * scale, k)
    return discrete_noise_tail("discrete_laplace", scale, k)


def law(mechanism: str, scale: float) -> Law:
    return Law(mechanism == _DISCRETE_GAUSSIAN, float(scale))


def selected_count(value: int, noise: Law, threshold: int, halfwidth: int,
                   confidence: float = CONFIDENCE) -> tuple[int, int]:
    """The interval of a count that was released because its noisy value reached ``threshold``.

    Among released draws, Y = N + e is conditioned on Y ≥ τ. For each true count N, the acceptance set is the most
    likely part of that conditional law: A(N) = {y ≥ τ : |y − N| ≤ k(N)}, k(N) the smallest with
    Pr[Y ∈ A(N) | Y ≥ τ] ≥ 95 % (never more than the unconditional half-width h). The interval is every N ≥ 1 whose
    A(N) holds the released value (its ends: the first N with N + k(N) ≥ value and the last with N − k(N) ≤
    value), so it covers the true count in ≥ 95 % of the released draws, for every N. Far above τ it is value ± h;
    near τ it reaches far down (for Laplace noise, every N < τ has the same conditional law: a count that barely
    passed cannot tell 3 people from τ − 1).
    """

    def reach(n: int) -> int:
        below = threshold - n  # e ≥ below: the release condition
        if not noise.gaussian and below > 1:
            below = 1  # Laplace: memoryless, every N < τ has the law of N = τ − 1
        released = noise.sf(below)
        if released <= 0:
            return max(0, threshold - n)  # all the conditional mass sits at τ
        low_k, high_k = 0, halfwidth + max(0, threshold - n)
        while low_k < high_k:
            k = (low_k + high_k) // 2
            start = max(-k, below)
            inside = noise.sf(start) - noise.sf(k + 1) if start <= k else 0.0
            if inside >= confidence * released:
                high_k = k
            else:
                low_k = k + 1
        return low_k if noise.gaussian or threshold - n <= 1 else low_k + (threshold - n - 1)

    first, last = 1, value  # smallest N with N + k(N) ≥ value (N = value qualifies)
    while first < last:
        n = (first + last) // 2
        if n + reach(n) >= value:
            last = n
        else:
            first = n + 1
    low = first
    first, last = value, value + halfwidth  # largest N with N − k(N) ≤ value
    while first < last:
        n = (first + last + 1) // 2
        if n - reach(n) <= value:
            first = n
        else:
            last = n - 1
    return low, first


def selected_average(total: Fraction, count: int, center: Fraction, lower: Fraction, upper: Fraction,
                     sum_noise: Law, sum_step: Fraction | None, count_noise: Law, threshold: int,
                     confidence: float = CONFIDENCE) -> tuple[Fraction, Fraction] | None:
    """The interval of an average whose noisy count also decided its group's release (the count is shared with
    partition selection), or None when that selection leaves the count's interval as it is (far above τ: the
    interval of :func:`average` holds).

    Near τ the released count is biased upward, which :func:`average`'s law does not know. Here each part gets an
    interval at (1 + confidence)/2: the centred sum's noise, which the selection does not see, and the true count
    from :func:`selected_count`, which covers it among released groups; both hold with probability ≥ confidence,
    and the true average c + S/N lies between the ratios of the box's corners (clamped to [L, U]). Conservative."""
    each = (1 + confidence) / 2
    count_half = _halfwidth(count_noise, each)
    first, last = selected_count(count, count_noise, threshold, count_half, each)
    if first >= count - count_half:
        return None
    grid = sum_step or Fraction(1)
    sum_half = _halfwidth(sum_noise, each) * grid + (grid / 2 if sum_step is not None else 0)
    ratios = [s / n for s in (total - sum_half, total + sum_half) for n in (max(first, 1), max(last, 1))]
    return max(lower, center + min(ratios)), min(upper, center + max(ratios))


def _halfwidth(noise: Law, confidence: float) -> int:
    """The smallest h with Pr[|e| ≤ h] ≥ ``confidence`` (mechanisms' exact half-widths)."""
    if noise.gaussian:
        return discrete_gaussian_halfwidth(noise.scale * noise.scale, confidence)
    return discrete_laplace_halfwidth(noise.scale, confidence)
