"""``dp_interval_low(x)`` / ``dp_interval_high(x)`` select items of a dp statement (docs/dp.md, "Intervals").

Found on the parsed statement before it is analysed: each such item is replaced by its argument (an aggregate, or
the expression of the output column whose alias it names), so the statement is planned as if it asked for that
aggregate — the same statistics, no extra cost — and the plan then outputs an end of its interval instead of its
value. A call anywhere else (inside an expression, HAVING, ORDER BY, WHERE) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlglot import exp

from anonproxy.plan.interval_calls import FUNCTIONS, interval_call
from anonproxy.plan.refusals import unsupported
from anonproxy.plan.tables import identifier

__all__ = ["HINT", "IntervalItem", "unwrap"]

HINT = ("Write dp_interval_low(<aggregate>) or dp_interval_high(<aggregate>) as a select item of its own, the "
        "aggregate being count, sum or avg (FILTER allowed) or the alias of such an output column: e.g. "
        "SELECT sex, avg(age) AS a, dp_interval_low(a), dp_interval_high(a) FROM adult GROUP BY sex.")


@dataclass(frozen=True)
class IntervalItem:
    bound: str  # "low" or "high"
    function: str  # dp_interval_low / dp_interval_high, for messages
    name: str  # the output column's name, as PostgreSQL names the item


def unwrap(tree: exp.Expression) -> dict[int, IntervalItem]:
    """Replace each dp_interval_low/high select item of ``tree`` (changed in place) by the value it bounds; the
    items found, by position in the select list."""
    if not isinstance(tree, exp.Select):
        return {}
    aliases = {identifier(item.args.get("alias")): item.this for item in tree.expressions if isinstance(item, exp.Alias)}
    found: dict[int, IntervalItem] = {}
    for position, item in enumerate(tree.expressions):
        node = item.this if isinstance(item, exp.Alias) else item
        call = interval_call(node)
        if call is None:
            continue
        function, argument = call
        if argument is None:
            raise unsupported(f"{function}() takes one argument", HINT)
        if isinstance(argument, exp.Column) and argument.args.get("table") is None:
            aliased = aliases.get(identifier(argument.this))
            if aliased is not None:  # an output column's alias: the aggregate it names
                if interval_call(aliased) is not None:
                    raise unsupported(f"{function}() of another interval bound is not supported", HINT)
                argument = aliased.copy()
        alias = identifier(item.args.get("alias")) if isinstance(item, exp.Alias) else None
        node.replace(argument)
        found[position] = IntervalItem(FUNCTIONS[function], function, alias or function)
    for node in tree.walk():
        call = interval_call(node)
        if call is not None:
            raise unsupported(f"{call[0]}() is supported only as a select item of its own in dp mode", HINT)
    return found
