"""Privacy amounts as people read them (NOTICEs, EXPLAIN (ANONPROXY), SHOW, `anonproxy trail`).

Four significant digits, rounded on the safe side: what is spent or costs up, what is left down, so a figure shown
never flatters the budget. Short exact amounts stay as they are (0.5, 10, 0.00001). The exact values stay in the
database (the ledger, anonproxy.my_budget, the audit trail's columns).
"""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

SIGNIFICANT = 4

Amount = Decimal | int | float


def spent(amount: Amount) -> str:
    """A cost or an amount spent, rounded up: 4.728386 → 4.729."""
    return _rounded(amount, ROUND_CEILING)


def left(amount: Amount) -> str:
    """An amount left, rounded down: 5.271613 → 5.271."""
    return _rounded(amount, ROUND_FLOOR)


def _rounded(amount: Amount, rounding: str) -> str:
    value = Decimal(repr(amount)) if isinstance(amount, float) else Decimal(amount)
    if not value.is_finite():
        return "∞" if value > 0 else str(value)
    if value != 0:
        value = value.quantize(Decimal(1).scaleb(value.adjusted() - SIGNIFICANT + 1), rounding=rounding)
    return format(value.normalize(), "f")
