"""zCDP to (ε, δ)-DP, as the ledger converts it (sql/0019_zcdp_ledger.sql, docs/ledger.md "Two accountings").

Bun and Steinke (2016, Prop. 1.3): a ρ-zCDP answer is (ρ + 2√(ρ·ln(1/δ)), δ)-DP for every δ > 0. Inverting it at
a budget ε gives the most ρ a zcdp budget allows, ρ_max(ε, δ) = (√(ε + ln(1/δ)) − √ln(1/δ))².

The ledger's SQL decides what may be charged; these are the same formulas for what the proxy shows and for the
default accounting of a budget (:func:`default_accounting`, which the policy file resolves as the database does).
Computed in :class:`~decimal.Decimal` at 50 digits: the default rule must agree with the database's numeric one.
"""

from __future__ import annotations

from decimal import Decimal, localcontext
from typing import Literal

Accounting = Literal["basic", "zcdp"]
ACCOUNTINGS: tuple[Accounting, ...] = ("basic", "zcdp")
DEFAULT_EPSILON_PER_QUERY = Decimal("0.5")  # the proxy's per-query ε when a budget gives none (dp/answers.py)

_DIGITS = 50

Number = Decimal | int | float | str


def zcdp_epsilon(rho: Number, delta: Number) -> Decimal:
    """The ε of the (ε, δ)-DP guarantee that ρ-zCDP implies: ρ + 2√(ρ·ln(1/δ)); infinite at δ = 0 unless ρ = 0."""
    r, d = _decimal(rho), _decimal(delta)
    if not r.is_finite() or r < 0 or not d.is_finite() or not 0 <= d < 1:
        raise ValueError(f"need rho >= 0 and delta in [0, 1), got rho {rho}, delta {delta}")
    if r == 0:
        return Decimal(0)
    if d == 0:
        return Decimal("Infinity")
    with localcontext() as context:
        context.prec = _DIGITS
        return r + 2 * (r * -d.ln()).sqrt()


def zcdp_rho_max(epsilon: Number, delta: Number) -> Decimal:
    """The largest ρ whose conversion at δ is at most ε: (ε / (√(ε + L) + √L))² with L = ln(1/δ) (the same as
    (√(ε + L) − √L)², without the cancellation); 0 at δ = 0."""
    e, d = _decimal(epsilon), _decimal(delta)
    if not e.is_finite() or e < 0 or not d.is_finite() or not 0 <= d < 1:
        raise ValueError(f"need epsilon >= 0 and delta in [0, 1), got epsilon {epsilon}, delta {delta}")
    if e == 0 or d == 0:
        return Decimal(0)
    with localcontext() as context:
        context.prec = _DIGITS
        log = -d.ln()
        root = e / ((e + log).sqrt() + log.sqrt())
        return root * root


def default_accounting(epsilon: Number, delta: Number, epsilon_per_query: Number | None = None) -> Accounting:
    """zcdp when the budget affords more one-statistic answers at the per-query ε q under zCDP (a Gaussian answer
    at the noise of a Laplace one at q costs ρ = q²/4) than under basic composition (q each), else basic; basic
    at δ = 0, where zCDP gives no finite ε."""
    e, d = _decimal(epsilon), _decimal(delta)
    q = DEFAULT_EPSILON_PER_QUERY if epsilon_per_query is None else _decimal(epsilon_per_query)
    if not (e.is_finite() and d.is_finite() and q.is_finite()) or e <= 0 or not 0 < d < 1 or q <= 0:
        return "basic"
    with localcontext() as context:
        context.prec = _DIGITS
        return "zcdp" if zcdp_rho_max(e, d) / (q * q / 4) > e / q else "basic"


def _decimal(value: Number) -> Decimal:
    if isinstance(value, bool):
        raise TypeError("an amount of privacy budget is a number, not a bool")
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
