"""HAVING in dp mode: a filter evaluated in the proxy on the *noisy* values of each group (docs/dp.md).

Filtering released values is post-processing, so it costs no privacy. The
client's HAVING is compiled once, at planning, into a small tuple tree whose
leaves are output values (an aggregate or a grouping key of the answer row),
constants or NULL (a parameter of HAVING is bound at Bind and arrives here as a constant:
anonproxy/plan/bind_values.py); :func:`holds` evaluates it on one answer row with SQL's
three-valued logic. Anything outside comparisons, AND/OR/NOT, BETWEEN,
IN (constants) and IS [NOT] NULL is refused: the filter must be computable
from the released values alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any, cast

from sqlglot import exp

from anonproxy.plan.refusals import (
    INVALID_PARAMETER_VALUE,
    INVALID_TEXT_REPRESENTATION,
    NUMERIC_VALUE_OUT_OF_RANGE,
    Refusal,
    unsupported,
)

HAVING_HINT = ("HAVING in dp mode compares aggregates and GROUP BY expressions with constants: =, <>, <, <=, >, >=, "
               "BETWEEN, IN (constants), IS [NOT] NULL, combined with AND, OR, NOT.")

# A compiled HAVING: ("value", index) | ("const", value) | ("cmp", op, a, b) | ("and"|"or", a, b) | ("not", a)
#                    | ("null", a) (IS NULL)
Node = tuple[Any, ...]
# PostgreSQL's integer types: the name its error gives and the bound of their range, [-bound, bound).
_INTEGER_RANGES = {exp.DataType.Type.SMALLINT: ("smallint", 2 ** 15), exp.DataType.Type.INT: ("integer", 2 ** 31),
                   exp.DataType.Type.BIGINT: ("bigint", 2 ** 63)}
_COMPARISONS: dict[type[exp.Expr], str] = {
    exp.EQ: "=", exp.NEQ: "<>", exp.GT: ">", exp.GTE: ">=", exp.LT: "<", exp.LTE: "<="}


def compile_having(node: exp.Expression, value_of: Callable[[exp.Expression], int | None],
                   numeric: Callable[[int], bool]) -> Node:
    """The tree of ``node``; ``value_of`` gives the answer-row index of an aggregate or a grouping expression
    (None when ``node`` is neither), ``numeric`` whether the value at an index is an aggregate (a number)."""

    def walk(node: exp.Expression) -> Node:
        while isinstance(node, exp.Paren):
            node = node.this
        index = value_of(node)
        if index is not None:
            return ("value", index)
        if isinstance(node, exp.And):
            return ("and", walk(node.this), walk(node.expression))
        if isinstance(node, exp.Or):
            return ("or", walk(node.this), walk(node.expression))
        if isinstance(node, exp.Not):
            return ("not", walk(node.this))
        if type(node) in _COMPARISONS:
            return compare(_COMPARISONS[type(node)], walk(node.this), walk(node.expression), node)
        if isinstance(node, exp.Between) and not node.args.get("symmetric"):
            value = walk(node.this)
            inside = ("and", compare(">=", value, walk(node.args["low"]), node),
                      compare("<=", value, walk(node.args["high"]), node))
            return ("not", inside) if node.args.get("negate") else inside
        if isinstance(node, exp.In) and node.expressions and not node.args.get("query"):
            value = walk(node.this)
            tree: Node = compare("=", value, _constant(node.expressions[0]), node)
            for item in node.expressions[1:]:
                tree = ("or", tree, compare("=", value, _constant(item), node))
            return ("not", tree) if node.args.get("negate") else tree
        if isinstance(node, exp.Is) and isinstance(node.expression, exp.Null):
            tree = ("null", walk(node.this))
            return ("not", tree) if node.args.get("negate") else tree
        return _constant(node)

    def compare(op: str, a: Node, b: Node, node: exp.Expression) -> Node:
        # An aggregate compared with a string constant: read the string as a number now, as PostgreSQL would.
        return ("cmp", op, _as_number(a, b, numeric, node), _as_number(b, a, numeric, node))

    return walk(node)


def _as_number(side: Node, other: Node, numeric: Callable[[int], bool], node: exp.Expression) -> Node:
    if side[0] != "const" or not isinstance(side[1], str) or other[0] != "value" or not numeric(other[1]):
        return side
    try:
        number = Decimal(side[1].strip())
    except InvalidOperation:
        raise Refusal(INVALID_TEXT_REPRESENTATION, f"HAVING {node.sql(dialect='postgres')}: invalid input syntax for type "
                      f"numeric: {side[1]!r}", HAVING_HINT) from None
    return ("const", _finite(number, node))


def _finite(number: Decimal, node: exp.Expression) -> Decimal:
    """Refuse NaN and ±Infinity: comparisons with them are not total orders (Decimal raises on NaN)."""
    if not number.is_finite():
        raise Refusal(INVALID_PARAMETER_VALUE, f"HAVING {node.sql(dialect='postgres')}: dp mode compares the noisy values "
                      f"with finite numbers only, not {number}", HAVING_HINT)
    return number


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
    if isinstance(node, exp.Cast) and _is_typed_number(node):
        return ("const", sign * _typed_number(node))
    if isinstance(node, exp.Literal):
        if node.is_string:
            if sign < 0:
                raise unsupported("unary minus on a string in HAVING", HAVING_HINT)
            return ("const", node.this)
        try:
            number = sign * Decimal(node.this)
        except InvalidOperation:
            pass
        else:
            return ("const", _finite(number, node))
    raise unsupported(f"HAVING in dp mode cannot evaluate {node.sql(dialect='postgres')}: the filter runs in the "
                      "proxy on the noisy values", HAVING_HINT)


def _is_typed_number(node: exp.Cast) -> bool:
    """A constant cast to a numeric type: a string or a number (``500::integer``), or such a cast cast again (a
    value bound at Bind to a parameter of its own numeric type, cast by the SQL: psycopg's smallint under
    SQLAlchemy's ``$1::INTEGER`` is ``CAST(CAST('500' AS SMALLINT) AS INT)``)."""
    inner = node.this
    constant = isinstance(inner, exp.Literal) or (isinstance(inner, exp.Cast) and _is_typed_number(inner))
    return constant and node.to.is_type(*exp.DataType.NUMERIC_TYPES)


def _typed_number(node: exp.Cast) -> Decimal:
    """The number a constant cast to a numeric type stands for; refused where PostgreSQL's cast would fail, and
    where it would round (a fraction cast to an integer type: refused rather than rounded here)."""
    inner = node.this
    text = inner.this.strip() if isinstance(inner, exp.Literal) else None
    try:
        number = Decimal(text) if text is not None else _typed_number(inner)
    except InvalidOperation:
        number = None
    if number is None or (node.to.is_type(*exp.DataType.INTEGER_TYPES) and number != number.to_integral_value()):
        if isinstance(inner, exp.Literal) and inner.is_string:
            raise Refusal(INVALID_TEXT_REPRESENTATION, f"HAVING {node.sql(dialect='postgres')}: invalid input syntax "
                          f"for type {node.to.sql(dialect='postgres').lower()}: {text!r}", HAVING_HINT)
        raise unsupported(f"HAVING in dp mode does not round {node.sql(dialect='postgres')}: write the integer",
                          HAVING_HINT)
    name, limit = _INTEGER_RANGES.get(node.to.this, ("", None))
    if limit is not None and not -limit <= number < limit:  # PostgreSQL's cast fails, whatever the data
        raise Refusal(NUMERIC_VALUE_OUT_OF_RANGE, f"HAVING {node.sql(dialect='postgres')}: {name} out of range",
                      HAVING_HINT)
    return _finite(number, node)



def holds(tree: Node, row: tuple[object, ...]) -> bool:
    """Whether the group with answer row ``row`` passes (SQL: only TRUE passes, NULL does not)."""
    return _evaluate(tree, row) is True


def _evaluate(tree: Node, row: tuple[object, ...]) -> object:
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
    if _is_nan(a) or _is_nan(b):  # a NaN key of a float or numeric column: unknown
        return None
    try:
        return {"=": a == b, "<>": a != b, ">": a > b, ">=": a >= b, "<": a < b, "<=": a <= b}[tree[1]]
    except (ArithmeticError, TypeError):  # values of unlike types: unknown, never an error
        return None


def _comparable(a: object, b: object) -> tuple[Any, Any] | None:
    """Numbers compare as numbers: a string constant next to a number is read as one, as PostgreSQL would; one
    that is not a number makes the comparison unknown (planning refuses it next to an aggregate, and PostgreSQL
    next to a grouping key, when it checks the plan's SQL)."""
    if isinstance(a, str) != isinstance(b, str):
        text, number = (a, b) if isinstance(a, str) else (b, a)
        try:
            converted = Decimal(cast(str, text))
        except InvalidOperation:
            return None
        return (converted, number) if isinstance(a, str) else (number, converted)
    if isinstance(a, float) or isinstance(b, float):
        return float(a), float(b)  # type: ignore[arg-type]
    return a, b


def _is_nan(value: object) -> bool:
    return (isinstance(value, float) and math.isnan(value)) or (isinstance(value, Decimal) and value.is_nan())
