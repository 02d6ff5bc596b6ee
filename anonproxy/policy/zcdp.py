"""zCDP to (ε, δ)-DP, as the ledger converts it (sql/0025_one_currency.sql, docs/ledger.md "Two accountings").

The conversion is the one OpenDP uses: Canonne, Kamath and Steinke (2020, "The Discrete Gaussian for Differential
Privacy", Prop. 12 / Cor. 13). A ρ-zCDP answer is (ε, δ)-DP for every order α > 1 with

    ε_α(ρ, δ) = αρ + (ln(1/δ) + (α−1)·ln(1 − 1/α) − ln α) / (α − 1),

(which is their δ = exp((α−1)(αρ−ε)) / (α−1) · (1 − 1/α)^α solved for ε), so the tightest ε is the least of these
over α; and the most ρ a budget (ε, δ) allows is the largest ρ with ε_α(ρ, δ) ≤ ε for some α:
max over α of (ε − ε_α(0, δ)) / α. Every α gives a valid bound, so the search for the best α (Newton's steps kept
within a bracket, at most a fixed number) can only lose tightness, never validity. The result is also never looser than Bun and Steinke's
(2016, Prop. 1.3) ρ + 2√(ρ·ln(1/δ)), the conversion the ledger used before migration 0025: each ε_α is below that
bound's αρ + ln(1/δ)/(α−1), and the result is taken as the better of the two.

The ledger's SQL (the same steps in numeric) decides what may be charged; these are the same functions for what the
proxy shows and for the default accounting of a budget (:func:`default_accounting`, which the policy file resolves
as the database does). Computed in :class:`~decimal.Decimal` at 50 digits and rounded outwards at 30 decimals
(ε up, ρ down), as the database rounds: the two agree to 30 decimals.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from typing import Literal

Accounting = Literal["basic", "zcdp"]
ACCOUNTINGS: tuple[Accounting, ...] = ("basic", "zcdp")
DEFAULT_EPSILON_PER_QUERY = Decimal("0.5")  # the proxy's accuracy ε when a budget gives none (dp/answers.py)

_DIGITS = 50
_STEPS = 40  # steps for the best order α (Newton's, or bisection): its error enters the bound squared
_CLOSE = Decimal("1e-40")  # a step this small: the best order is found
_UNIT = Decimal("1e-30")  # results are rounded outwards to this, and one unit more (as the database does)

Number = Decimal | int | float | str


def zcdp_epsilon(rho: Number, delta: Number) -> Decimal:
    """The ε of the (ε, δ)-DP guarantee that ρ-zCDP implies (the least ε_α over α, and at least 0), rounded up;
    infinite at δ = 0 unless ρ = 0."""
    r, d = _decimal(rho), _decimal(delta)
    if not r.is_finite() or r < 0 or not d.is_finite() or not 0 <= d < 1:
        raise ValueError(f"need rho >= 0 and delta in [0, 1), got rho {rho}, delta {delta}")
    if r == 0:
        return Decimal(0)
    if d == 0:
        return Decimal("Infinity")
    with localcontext() as context:
        context.prec = _DIGITS
        log = -d.ln()
        # ε_α falls while φ(α) = ρ(α−1)² − ln(1/δ) + ln α < 0 and rises after; the root is below
        # 1 + √(ln(1/δ)/ρ), where the first term alone reaches ln(1/δ).
        alpha = _root(lambda a: r * (a - 1) ** 2 - log + a.ln(), lambda a: 2 * r * (a - 1) + 1 / a,
                      Decimal(1), 1 + (log / r).sqrt())
        tight = _up(_epsilon_at(r, log, alpha))
        # never looser than Bun and Steinke; and never below 0, where a tiny ρ at a large δ takes the formula
        return max(min(tight, _up(r + 2 * (r * log).sqrt())), Decimal(0))


def zcdp_rho_max(epsilon: Number, delta: Number) -> Decimal:
    """The largest ρ whose conversion at δ is at most ε (the most a zcdp budget (ε, δ) allows), rounded down; 0 at
    δ = 0."""
    e, d = _decimal(epsilon), _decimal(delta)
    if not e.is_finite() or e < 0 or not d.is_finite() or not 0 <= d < 1:
        raise ValueError(f"need epsilon >= 0 and delta in [0, 1), got epsilon {epsilon}, delta {delta}")
    if e == 0 or d == 0:
        return Decimal(0)
    with localcontext() as context:
        context.prec = _DIGITS
        log = -d.ln()
        # (ε − ε_α(0, δ)) / α is largest where s(α) = ε_α(0, δ) + α·(ln(1/δ) − ln α)/(α−1)² equals ε; s falls
        # with α (s' = −((α−1) + 2α(ln(1/δ) − ln α))/(α−1)³): double the order until s is at most ε, then solve.
        high = Decimal(2)
        while _stationary(log, high) > e:
            high *= 2
        alpha = _root(lambda a: e - _stationary(log, a),
                      lambda a: ((a - 1) + 2 * a * (log - a.ln())) / (a - 1) ** 3,
                      Decimal(1) if high == 2 else high / 2, high)
        tight = _down((e - _epsilon_at(Decimal(0), log, alpha)) / alpha)
        return max(tight, bun_steinke_rho_max(e, d))


def bun_steinke_rho_max(epsilon: Decimal, delta: Decimal) -> Decimal:
    """The largest ρ with ρ + 2√(ρ·ln(1/δ)) ≤ ε (Bun and Steinke's conversion, the ledger's before migration 0025):
    (ε / (√(ε + L) + √L))² with L = ln(1/δ), which loses no digits to cancellation; rounded down; 0 at δ = 0."""
    if epsilon == 0 or delta == 0:
        return Decimal(0)
    with localcontext() as context:
        context.prec = _DIGITS
        log = -delta.ln()
        return max(_down((epsilon / ((epsilon + log).sqrt() + log.sqrt())) ** 2), Decimal(0))


def _root(f: Callable[[Decimal], Decimal], slope: Callable[[Decimal], Decimal], low: Decimal,
          high: Decimal) -> Decimal:
    """The root of an increasing ``f`` between ``low`` (f < 0) and ``high`` (f ≥ 0): Newton's steps from ``high``,
    a bisection whenever a step would leave the bracket; at most ``_STEPS`` steps, or until a step is below
    ``_CLOSE``. The database takes the same steps (sql/0025_one_currency.sql)."""
    alpha = high
    for _ in range(_STEPS):
        value = f(alpha)
        if value < 0:
            low = alpha
        else:
            high = alpha
        rate = slope(alpha)
        following = alpha - value / rate if rate > 0 else high
        if abs(following - alpha) < _CLOSE:
            return following
        alpha = following if low < following < high else (low + high) / 2
    return alpha


def _epsilon_at(rho: Decimal, log: Decimal, alpha: Decimal) -> Decimal:
    """ε_α(ρ, δ) with log = ln(1/δ): αρ + (ln(1/δ) + (α−1)·ln(1 − 1/α) − ln α) / (α − 1)."""
    return alpha * rho + (log + (alpha - 1) * (1 - 1 / alpha).ln() - alpha.ln()) / (alpha - 1)


def _stationary(log: Decimal, alpha: Decimal) -> Decimal:
    """The budget ε at which α is the best order for ρ_max: ε_α(0, δ) + α·(ln(1/δ) − ln α)/(α−1)²."""
    return _epsilon_at(Decimal(0), log, alpha) + alpha * (log - alpha.ln()) / (alpha - 1) ** 2


def _up(value: Decimal) -> Decimal:
    """Rounded up to 30 decimals, and one unit more: the 50-digit value may itself be a little below the true one."""
    return value.quantize(_UNIT, rounding=ROUND_CEILING) + _UNIT


def _down(value: Decimal) -> Decimal:
    return value.quantize(_UNIT, rounding=ROUND_FLOOR) - _UNIT


def default_accounting(epsilon: Number, delta: Number, epsilon_per_query: Number | None = None) -> Accounting:
    """zcdp when the budget affords more one-statistic answers at the accuracy ε q (a Gaussian answer at the noise
    of a Laplace one at q costs ρ = q²/4) than under basic composition (q each), else basic; basic at δ = 0, where
    zCDP gives no finite ε.

    The answers zCDP affords are counted with Bun and Steinke's ρ_max, as before migration 0025, so that the rule
    decides every budget as it did: an upgrade never switches a budget's accounting (a switch to zcdp can raise the
    ε spent shown for the answers already charged). Where it says zcdp, zcdp affords even more answers under the
    ledger's tighter conversion; from ε 5.95 to 7.52 at δ 10⁻⁵ and q 0.5 it keeps basic where zcdp would afford
    a few more (give ``accounting: zcdp`` there)."""
    e, d = _decimal(epsilon), _decimal(delta)
    q = DEFAULT_EPSILON_PER_QUERY if epsilon_per_query is None else _decimal(epsilon_per_query)
    if not (e.is_finite() and d.is_finite() and q.is_finite()) or e <= 0 or not 0 < d < 1 or q <= 0:
        return "basic"
    with localcontext() as context:
        context.prec = _DIGITS
        return "zcdp" if bun_steinke_rho_max(e, d) / (q * q / 4) > e / q else "basic"


def _decimal(value: Number) -> Decimal:
    if isinstance(value, bool):
        raise TypeError("an amount of privacy budget is a number, not a bool")
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
