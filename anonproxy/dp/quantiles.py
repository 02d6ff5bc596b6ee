"""DP quantiles: the exponential mechanism over a declared, finite grid (Smith 2011 style).

The output domain is the grid Y = {L + j·r : j = 0..m}, m = ⌊(U − L)/r⌋, fixed
by the policy's bounds [L, U] and a resolution r — never by the data. Each
value is clamped to [L, U] (a per-row map, which costs no privacy) and ranked
against the grid points *exactly*, without snapping it to the grid. For a grid
point y let

    lo(y) = #{x < y},  hi(y) = #{x ≤ y},  d(y) = max(0, lo(y) − q·n, q·n − hi(y))

— how far, in ranks, y is from being a q-quantile — and release y with
probability ∝ exp(−ε·d(y) / (2Δu)). (Snapping values to their nearest grid
point first, as an earlier version did, moved each value by up to r/2 before
ranking and gave the grid point nearest the true quantile less mass than it
should have; tests/test_quantile_grid.py measures it.)

Sensitivity. Neighbours differ by one privacy unit with at most c rows
(``max_contributions``). Adding its rows raises lo(y) and hi(y) by some
k ∈ [0, c] and q·n by c·q, so each of lo − q·n and q·n − hi moves by at most
c·max(q, 1 − q), and so does their maximum with 0: Δu = c·max(q, 1 − q)
(1/2 for the median with one row per unit). The exponential mechanism with
weights exp(ε·u/(2Δu)) on a data-independent domain is ε-DP (McSherry–Talwar
2007).

Accuracy. Let d* be the smallest d over the grid (0 unless the q-quantile lies
strictly between two grid points, with values between them). With probability
≥ 1 − β the output's d is within (2Δu/ε)·ln(|Y|/β) of d* (:func:`rank_halfwidth`).

Sampling. Grid points between two consecutive distinct data values share one
weight, so there are at most 2n + 1 blocks. Log-weights are computed in
floating point (each weight to a relative error below 1e−12), turned into
exact integers, and a block is chosen by inverse CDF with
:func:`secrets.randbelow` over their exact sum, then a point uniformly within
it. The released distribution is the ideal one up to a factor 1 ± 1e−12 per
output (privacy loss ≤ ε + 2e−12), except that blocks whose weight is below
e^−700 of the largest are never chosen (δ ≤ (2n + 1)·e^−700). The output is a
grid point: its bits depend on j alone, not on the data's floating-point
representation.
"""

from __future__ import annotations

import bisect
import math
import secrets
from collections import Counter
from collections.abc import Iterable, Sequence
from fractions import Fraction

from anonproxy.dp.mechanisms import (
    CONFIDENCE,
    NoisyValue,
    Number,
    as_decimal_rational,
    as_positive,
    as_rational,
    as_resolution,
)

__all__ = ["DEFAULT_GRID_POINTS", "dp_quantile", "quantile_mechanism", "quantile_probabilities", "rank_halfwidth"]

#: Default number of grid steps between the bounds when no resolution is declared.
DEFAULT_GRID_POINTS = 10_000

_CUTOFF = 700.0  # blocks lighter than e^-700 of the heaviest are dropped
_SCALE_BITS = 1100  # weights in [e^-700, 1] become exact integers after scaling by 2^1100


class _Setup:
    """Validated parameters of one quantile query."""

    def __init__(self, q: Number, lower: Number, upper: Number, epsilon: Number,
                 resolution: Number | None, max_contributions: int) -> None:
        self.q = as_rational(q, "q")
        if not 0 <= self.q <= 1:
            raise ValueError(f"q must be in [0, 1], got {q!r}")
        self.lower = as_decimal_rational(lower, "lower")
        self.upper = as_decimal_rational(upper, "upper")
        if not self.lower < self.upper:
            raise ValueError(f"lower must be < upper, got lower={lower!r}, upper={upper!r}")
        self.epsilon = as_positive(epsilon, "epsilon")
        if resolution is None:
            self.resolution = (self.upper - self.lower) / DEFAULT_GRID_POINTS
        else:
            self.resolution = as_resolution(resolution)
            if self.resolution > self.upper - self.lower:
                raise ValueError(f"resolution must be at most upper - lower, got {resolution!r}")
        if isinstance(max_contributions, bool) or not isinstance(max_contributions, int) or max_contributions < 1:
            raise ValueError(f"max_contributions must be an int >= 1, got {max_contributions!r}")
        self.c = max_contributions
        self.m = math.floor((self.upper - self.lower) / self.resolution)
        self.sensitivity = self.c * max(self.q, 1 - self.q)  # Δu

    def place(self, values: Iterable[object]) -> tuple[Counter[int], Counter[int]]:
        """Where each value sits among the grid points, exactly: (values equal to grid point j, by j; values
        strictly between grid points j − 1 and j, by j — j = m + 1 when above the last one). Values are clamped
        to [L, U]; None is skipped like SQL aggregates; NaN sorts last (as U)."""
        lower_f, step_f = float(self.lower), float(self.resolution)
        top = (self.upper - self.lower) / self.resolution  # U's position, in grid steps (maybe not an integer)
        top_f = float(top)
        # a float position this far from an integer is on the right side of it whatever the rounding error
        slack = 1e-6 + 1e-9 * (abs(lower_f) + abs(float(self.upper))) / step_f
        on: Counter[int] = Counter()
        between: Counter[int] = Counter()
        for x in values:
            if x is None:
                continue
            v = float(x)  # type: ignore[arg-type]
            if math.isnan(v) or v >= math.inf:
                u = top
            elif v <= -math.inf:
                u = Fraction(0)
            else:
                u_f = (v - lower_f) / step_f
                if slack < u_f < top_f - slack and abs(u_f - round(u_f)) > slack:
                    between[math.floor(u_f) + 1] += 1  # fast path: clearly between two grid points
                    continue
                exact = x if isinstance(x, (int, Fraction)) else Fraction(x)  # type: ignore[call-overload]
                u = min(max((exact - self.lower) / self.resolution, Fraction(0)), top)
            if u.denominator == 1:
                on[int(u)] += 1
            else:
                between[math.ceil(u)] += 1
        return on, between

    def blocks(self, placed: tuple[Counter[int], Counter[int]]) -> list[tuple[int, int, int]]:
        """(first grid index, number of grid points, d·den) for runs of equal weight; d = that / den.

        lo(g_j) = #{x < g_j} counts the values on grid points before j and those between grid points up to j;
        hi(g_j) = #{x ≤ g_j} adds those on g_j itself: the exact ranks of the exact values."""
        on, between = placed
        n = sum(on.values()) + sum(between.values())
        qn, den = self.q.numerator * n, self.q.denominator  # q·n = qn/den

        def dist(lo: int, hi: int) -> int:
            return max(0, lo * den - qn, qn - hi * den)

        out: list[tuple[int, int, int]] = []
        start, below = 0, 0  # first grid index not yet covered; values below it (x < g_start)
        for j in sorted(set(on) | set(between)):
            if j > self.m:
                break
            if j > start:
                out.append((start, j - start, dist(below, below)))
            below += between[j]
            out.append((j, 1, dist(below, below + on[j])))
            below += on[j]
            start = j + 1
        if start <= self.m:
            out.append((start, self.m + 1 - start, dist(below, below)))
        return out

    def log_weights(self, blocks: list[tuple[int, int, int]]) -> list[float]:
        a = float(self.epsilon / (2 * self.sensitivity * self.q.denominator))
        return [math.log(size) - a * d for _, size, d in blocks]

    def value(self, j: int) -> float:
        return float(self.lower + j * self.resolution)


def _integer_weight(w: float) -> int:
    """w ∈ [e^-700, 1] times 2^1100, exactly (w is a binary fraction with exponent ≥ −1010)."""
    mantissa, exponent = math.frexp(w)
    return int(mantissa * (1 << 53)) << (exponent - 53 + _SCALE_BITS)


def _sample(setup: _Setup, values: Iterable[object]) -> int:
    blocks = setup.blocks(setup.place(values))
    logs = setup.log_weights(blocks)
    top = max(logs)
    cumulative: list[int] = []
    kept: list[tuple[int, int, int]] = []
    total = 0
    for block, lw in zip(blocks, logs):
        if lw - top >= -_CUTOFF:
            total += _integer_weight(math.exp(lw - top))
            cumulative.append(total)
            kept.append(block)
    u = secrets.randbelow(total)
    first, size, _ = kept[bisect.bisect_right(cumulative, u)]
    return first + secrets.randbelow(size)


def dp_quantile(values: Sequence[object], q: Number, lower: Number, upper: Number, epsilon: Number,
                *, resolution: Number | None = None, max_contributions: int = 1) -> float:
    """An ε-DP q-quantile of ``values`` on the grid lower + r·ℤ within [lower, upper].

    ``q`` = 0.5 is the median (percentile_cont/disc(0.5)). ``resolution`` r
    defaults to (upper − lower)/10 000. ``max_contributions`` is the most rows
    one privacy unit may have in ``values`` (the proxy's contribution bound).
    """
    setup = _Setup(q, lower, upper, epsilon, resolution, max_contributions)
    return setup.value(_sample(setup, values))


def rank_halfwidth(q: Number, lower: Number, upper: Number, epsilon: Number, *,
                   resolution: Number | None = None, max_contributions: int = 1,
                   confidence: float = CONFIDENCE) -> float:
    """R such that, with probability ≥ confidence, the output's distance d in ranks from q·n is within R of the
    best grid point's.

    R = (2Δu/ε)·ln(|Y|/(1 − confidence)), from Pr[d(y) ≥ d* + τ] ≤ |Y|·e^{−ετ/(2Δu)}.
    """
    if isinstance(confidence, bool) or not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    setup = _Setup(q, lower, upper, epsilon, resolution, max_contributions)
    return float(2 * setup.sensitivity / setup.epsilon) * math.log((setup.m + 1) / (1 - confidence))


def quantile_mechanism(values: Sequence[object], q: Number, lower: Number, upper: Number, epsilon: Number,
                       *, resolution: Number | None = None, max_contributions: int = 1) -> NoisyValue:
    """:func:`dp_quantile` with its accuracy statement, for the notice."""
    setup = _Setup(q, lower, upper, epsilon, resolution, max_contributions)
    return NoisyValue(
        value=setup.value(_sample(setup, values)), mechanism="exponential",
        scale=float(2 * setup.sensitivity / setup.epsilon), epsilon=float(setup.epsilon), delta=0.0,
        stddev=None, ci95_halfwidth=None, resolution=setup.resolution,
        rank_halfwidth95=rank_halfwidth(q, lower, upper, epsilon, resolution=setup.resolution,
                                        max_contributions=max_contributions),
    )


def quantile_probabilities(values: Sequence[object], q: Number, lower: Number, upper: Number, epsilon: Number,
                           *, resolution: Number | None = None, max_contributions: int = 1) -> list[float]:
    """The probability of each grid point lower + j·r, j = 0..m, as the sampler uses them.

    For tests and audits; O(m) memory.
    """
    setup = _Setup(q, lower, upper, epsilon, resolution, max_contributions)
    blocks = setup.blocks(setup.place(values))
    logs = setup.log_weights(blocks)
    top = max(logs)
    weights = [math.exp(lw - top) if lw - top >= -_CUTOFF else 0.0 for lw in logs]
    total = math.fsum(weights)
    out = [0.0] * (setup.m + 1)
    for (first, size, _), w in zip(blocks, weights):
        for j in range(first, first + size):
            out[j] = w / size / total
    return out
