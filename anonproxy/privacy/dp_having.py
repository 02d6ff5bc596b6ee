"""HAVING in dp mode: a filter evaluated in the proxy on the *noisy* values of each group (docs/dp.md).

Filtering released values is post-processing, so it costs no privacy. The
client's HAVING is compiled once, at planning, into a small tuple tree whose
leaves are output values (an aggregate or a grouping key of the answer row),
constants or NULL; :func:`holds` evaluates it on one answer row with SQL's
three-valued logic. Anything outside comparisons, AND/OR/NOT, BETWEEN,
IN (constants) and IS [NOT] NULL is refused: the filter must be computable
from the released values alone.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal, InvalidOperation

from sqlglot import exp

from anonproxy.rewrite.decision import unsupported

HAVING_HINT = ("HAVING in dp mode compares aggregates and GROUP BY expressions with constants: =, <>, <, <=, >, >=, "
               "BETWEEN, IN (constants), IS [NOT] NULL, combined with AND, OR, NOT.")

# A compiled HAVING: ("value", index) | ("const", value) | ("cmp", op, a, b) | ("and"|"or", a, b) | ("not", a)
#                    | ("null", a) (IS NULL)
Node = tuple
_COMPARISONS = {exp.EQ: "=", exp.NEQ: "<>", exp.GT: ">", exp.GTE: ">=", exp.LT: "<", exp.LTE: "<="}


def compile_having(node: exp.Expression, value_of: Callable[[exp.Expression], int | None]) -> Node:
    """The tree of ``node``; ``value_of`` gives the answer-row index of an aggregate or a grouping expression
    (None when ``node`` is neither)."""
    while isinstance(node, exp.Paren):
        node = node.this
    index = value_of(node)
    if index is not None:
        return ("value", index)
    if isinstance(node, exp.And):
        return ("and", compile_having(node.this, value_of), compile_having(node.expression, value_of))
    if isinstance(node, exp.Or):
        return ("or", compile_having(node.this, value_of), compile_having(node.expression, value_of))
    if isinstance(node, exp.Not):
        return ("not", compile_having(node.this, value_of))
    if type(node) in _COMPARISONS:
        return ("cmp", _COMPARISONS[type(node)], compile_having(node.this, value_of),
                compile_having(node.expression, value_of))
    if isinstance(node, exp.Between) and not node.args.get("symmetric"):
        value = compile_having(node.this, value_of)
        inside = ("and", ("cmp", ">=", value, compile_having(node.args["low"], value_of)),
                  ("cmp", "<=", value, compile_having(node.args["high"], value_of)))
        return ("not", inside) if node.args.get("negate") else inside
    if isinstance(node, exp.In) and node.expressions and not node.args.get("query"):
        value = compile_having(node.this, value_of)
        tree: Node = ("cmp", "=", value, _constant(node.expressions[0]))
        for item in node.expressions[1:]:
            tree = ("or", tree, ("cmp", "=", value, _constant(item)))
        return ("not", tree) if node.args.get("negate") else tree
    if isinstance(node, exp.Is) and isinstance(node.expression, exp.Null):
        tree = ("null", compile_having(node.this, value_of))
        return ("not", tree) if node.args.get("negate") else tree
    return _constant(node)


def _constant(node: exp.Expression) -> Node:
    while isinstance(node, exp.Paren):
        node = node.this
    sign = 1
    if isinstance(node, exp.Neg):
        sign, node = -1, node.this
    if isinstance(node, exp.Null):
        return ("const", None)
    if isinstance(node, exp.Boolean):
        return ("const", bool(node.this))
    if isinstance(node, exp.Literal):
        if node.is_string:
            if sign < 0:
                raise unsupported("unary minus on a string in HAVING", HAVING_HINT)
            return ("const", node.this)
        try:
            return ("const", sign * Decimal(node.this))
        except InvalidOperation:
            pass
    raise unsupported(f"HAVING in dp mode cannot evaluate {node.sql(dialect='postgres')}: the filter runs in the "
                      "proxy on the noisy values", HAVING_HINT)


def holds(tree: Node, row: tuple) -> bool:
    """Whether the group with answer row ``row`` passes (SQL: only TRUE passes, NULL does not)."""
    return _evaluate(tree, row) is True


def _evaluate(tree: Node, row: tuple) -> object:
    op = tree[0]
    if op == "value":
        return row[tree[1]]
    if op == "const":
        return tree[1]
    if op == "and":
        a, b = _evaluate(tree[1], row), _evaluate(tree[2], row)
        return False if a is False or b is False else (None if a is None or b is None else True)
    if op == "or":
        a, b = _evaluate(tree[1], row), _evaluate(tree[2], row)
        return True if a is True or b is True else (None if a is None or b is None else False)
    if op == "not":
        a = _evaluate(tree[1], row)
        return None if a is None else not a
    if op == "null":
        return _evaluate(tree[1], row) is None
    a, b = _evaluate(tree[2], row), _evaluate(tree[3], row)
    if a is None or b is None:
        return None
    pair = _comparable(a, b)
    if pair is None:
        return None
    a, b = pair
    return {"=": a == b, "<>": a != b, ">": a > b, ">=": a >= b, "<": a < b, "<=": a <= b}[tree[1]]


def _comparable(a: object, b: object) -> tuple | None:
    """Numbers compare as numbers: a string constant next to a number is read as one, as PostgreSQL would; one
    that is not a number makes the comparison unknown (PostgreSQL would raise an error)."""
    if isinstance(a, str) != isinstance(b, str):
        text, number = (a, b) if isinstance(a, str) else (b, a)
        try:
            converted = Decimal(text)
        except InvalidOperation:
            return None
        return (converted, number) if isinstance(a, str) else (number, converted)
    if isinstance(a, float) or isinstance(b, float):
        return float(a), float(b)  # type: ignore[arg-type]
    return a, b
