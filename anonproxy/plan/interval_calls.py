"""Recognise a call of ``dp_interval_low`` / ``dp_interval_high``, the select items that ask for an end of a dp
answer's interval.

The expression checker refuses them outside dp mode's select list, and the dp planner
(:mod:`anonproxy.dp.interval_items`) replaces them by the aggregate they bound; both recognise them here.
"""

from __future__ import annotations

from sqlglot import exp

from anonproxy.plan.tables import identifier

FUNCTIONS = {"dp_interval_low": "low", "dp_interval_high": "high"}


def interval_call(node: exp.Expr) -> tuple[str, exp.Expression | None] | None:
    """(function name, its one argument or None) when ``node`` calls dp_interval_low/high, plain or qualified
    with the anonproxy schema; else None."""
    if isinstance(node, exp.Dot) and isinstance(node.this, exp.Identifier) and identifier(node.this) == "anonproxy":
        node = node.expression
    if not isinstance(node, exp.Anonymous):
        return None
    name = identifier(node.this) if isinstance(node.this, exp.Identifier) else str(node.this).lower()
    if name not in FUNCTIONS:
        return None
    arguments = node.expressions
    return name, (arguments[0] if len(arguments) == 1 else None)
