"""WHERE on declared public domains: the domain values a statement's WHERE lets through (docs/dp.md).

A GROUP BY key with a declared public domain is listed value by value, whatever the data. When the WHERE clause,
read as an AND of conditions, says which values the key column may take — ``col = 'v'``, ``col IN (...)``,
``col <> 'v'``, ``col NOT IN (...)``, ``col IS [NOT] NULL``, also inside OR and NOT of those on the same column —
the values that cannot pass are left out of the listing: their groups are empty in every database, and PostgreSQL
would not return them either. Decided on the statement's tree and the policy only, never on the data, so it is
free and sound whichever way it goes. It reads the checked WHERE node of the statement's one parse, never its
rendered text. Whatever is not understood (a function or cast of the column, a parameter,
another column) may be true for every value: the value stays in.

Values are compared as PostgreSQL compares them for the column's type: text types byte for byte (a deterministic
collation), integer and numeric types by their numeric value, floats as floats. Any other type, or a constant that
is not a number where a number is needed, is "maybe equal": the value stays in.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

from sqlglot import exp

from anonproxy.plan.analysis import AnalyticQuery
from anonproxy.plan.tables import ResolvedTable

_TEXT = ("text", "character varying", "varchar", "name")
_BLANK_PADDED = ("character", "bpchar")
_INTEGERS = ("smallint", "integer", "bigint")
_FLOATS = ("real", "double precision")


class _Equal(enum.Enum):
    YES = enum.auto()
    NO = enum.auto()
    MAYBE = enum.auto()


# Which GROUP BY key a column of the WHERE clause is (its index), or None: another column, or not a column.
KeyOf = Callable[[exp.Expression], int | None]
# A column reference -> (the table it reads, or None when unresolved; its name), or None when not a column.
ColumnTable = Callable[[exp.Expression], "tuple[ResolvedTable | None, str] | None"]


def restricted(query: AnalyticQuery, where: exp.Expression | None, domains: list[tuple[str, ...]],
               column_table: ColumnTable) -> list[tuple[str, ...]]:
    """``domains`` (one per GROUP BY key of ``query``, each key a column) without the values its WHERE clause
    (``where``: the checked condition, a node of the statement's tree) excludes; ``column_table`` resolves a
    column reference to its table and name, as the planner does."""
    if where is None:
        return domains
    keys = [column_table(node) for node in query.key_nodes]

    def key_of(node: exp.Expression) -> int | None:
        found = column_table(node)
        if found is None or found[0] is None:
            return None
        for index, key in enumerate(keys):
            if key is not None and key[0] is found[0] and key[1] == found[1]:
                return index
        return None

    types = [_type(key) for key in keys]
    return [tuple(value for value in domain if _can_pass(where, index, value, types[index], key_of))
            for index, domain in enumerate(domains)]


def _type(key: tuple[ResolvedTable | None, str] | None) -> str | None:
    """A key column's SQL type as the policy read it (None: not known)."""
    if key is None or key[0] is None:
        return None
    table = key[0].protected if key[0].protected is not None else key[0].linked
    return table.types.get(key[1]) if table is not None and table.types is not None else None


def _can_pass(node: exp.Expression, key: int, value: str, sql_type: str | None, key_of: KeyOf) -> bool:
    """Whether a row whose key ``key`` is ``value`` may make ``node`` true: False only when it certainly cannot."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.And):
        return all(_can_pass(side, key, value, sql_type, key_of) for side in (node.this, node.expression))
    if isinstance(node, exp.Or):
        return any(_can_pass(side, key, value, sql_type, key_of) for side in (node.this, node.expression))
    negated = isinstance(node, exp.Not)
    if negated:
        node = node.this
        while isinstance(node, exp.Paren):
            node = node.this
    if isinstance(node, exp.Is) and isinstance(node.expression, exp.Null) and _is_key(node.this, key, key_of):
        return negated != bool(node.args.get("negate"))  # only IS NOT NULL: a domain value is never NULL
    if isinstance(node, (exp.EQ, exp.NEQ)):
        column, constant = _sides(node, key, key_of)
        if column is None:
            return True
        # col <> v is NOT (col = v) with the same NULLs; NOT (col <> v) is col = v.
        return _matches(value, [constant], sql_type, negated != isinstance(node, exp.NEQ))
    if isinstance(node, exp.In) and _is_key(node.this, key, key_of) and not node.args.get("query") \
            and not node.args.get("unnest") and node.expressions:
        return _matches(value, list(node.expressions), sql_type, negated)
    return True  # anything else, or a NOT of it: may be true


def _is_key(node: exp.Expression, key: int, key_of: KeyOf) -> bool:
    while isinstance(node, exp.Paren):
        node = node.this
    return isinstance(node, exp.Column) and key_of(node) == key


def _sides(node: exp.Binary, key: int, key_of: KeyOf) -> tuple[exp.Expression | None, exp.Expression]:
    """(the key column, the other side) of a comparison, either way round; (None, ...) when neither side is it."""
    if _is_key(node.this, key, key_of):
        return node.this, node.expression
    if _is_key(node.expression, key, key_of):
        return node.expression, node.this
    return None, node.this


def _matches(value: str, constants: list[exp.Expression], sql_type: str | None, negated: bool) -> bool:
    """Whether ``col IN (constants)`` (``NOT IN`` when ``negated``) may be true for ``col = value``: SQL's rules,
    a NULL in the list included (col IN (a, NULL) is true only when col = a; col NOT IN (a, NULL) never is)."""
    answers = [_NULL if _is_null(constant) else _equal(value, constant, sql_type) for constant in constants]
    if not negated:
        return any(answer in (_Equal.YES, _Equal.MAYBE) for answer in answers)
    return all(answer in (_Equal.NO, _Equal.MAYBE) for answer in answers)


_NULL = None  # a NULL in the list: neither equal nor unequal


def _is_null(node: exp.Expression) -> bool:
    while isinstance(node, exp.Paren):
        node = node.this
    return isinstance(node, exp.Null)


def _equal(value: str, constant: exp.Expression, sql_type: str | None) -> _Equal:
    """Whether the domain value equals the constant, compared as the column's type."""
    while isinstance(constant, exp.Paren):
        constant = constant.this
    sign = ""
    if isinstance(constant, exp.Neg) and isinstance(constant.this, exp.Literal) and not constant.this.is_string:
        sign, constant = "-", constant.this
    if not isinstance(constant, exp.Literal) or sql_type is None:
        return _Equal.MAYBE
    text = sign + constant.this
    base = sql_type.split("(")[0].strip().lower()
    if constant.is_string and base in _TEXT:
        return _Equal.YES if value == text else _Equal.NO
    if constant.is_string and base in _BLANK_PADDED:
        return _Equal.YES if value.rstrip(" ") == text.rstrip(" ") else _Equal.NO
    if base in _INTEGERS or base == "numeric" or base in _FLOATS:
        return _numbers_equal(value, text, base)
    return _Equal.MAYBE


def _numbers_equal(value: str, text: str, base: str) -> _Equal:
    if "_" in value or "_" in text:  # Python reads 1_000, PostgreSQL 15 does not: leave it to doubt
        return _Equal.MAYBE
    try:
        left, right = Decimal(value.strip()), Decimal(text.strip())
    except InvalidOperation:
        return _Equal.MAYBE
    if not (left.is_finite() and right.is_finite()):
        return _Equal.MAYBE
    if base in _INTEGERS and (left != left.to_integral_value() or right != right.to_integral_value()):
        return _Equal.MAYBE  # not valid input for an integer: PostgreSQL would refuse the statement
    if base in _FLOATS:
        return _Equal.YES if float(left) == float(right) else _Equal.NO
    return _Equal.YES if left == right else _Equal.NO
