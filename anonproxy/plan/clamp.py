"""Columns read clamped into their declared bounds (dp mode; docs/dp.md, "Arithmetic on bounded columns").

In dp mode declared bounds are where values are clamped, and a value outside them is tolerated: the no-error proof
(:mod:`anonproxy.plan.bounds`) may trust a column's bounds only where the SQL reads the column clamped. An
expression the proof admits only with its columns' bounds (``age * 21000000``) has each bounded integer or numeric
column reference in it marked with the clamp (a meta entry of the sqlglot node, kept by copies); the proof then
takes the clamp's bounds as the column's facts, and rendering (:mod:`anonproxy.plan.render`) writes the marked
reference as

    CASE WHEN NOT col IS NULL THEN LEAST(GREATEST(col, CAST(lo AS t)), CAST(hi AS t)) END

(GREATEST and LEAST skip NULLs: the CASE keeps a NULL NULL; NaN, above every number, becomes hi; the bounds cast to
the column's own integer type, so that the expression keeps that type, and to numeric for numeric columns). The
mark is the one fact both sides read: nothing is trusted that is not rendered clamped.

Only integer and numeric columns are clamped: an integer column's bounds are rounded inwards to integers and cut
to its type's range (what the clamp can return), a numeric column's are exact; a float bound could not be written
exactly, so float columns keep being read as they are (their declared bounds are not facts in dp mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

from sqlglot import exp

from anonproxy.plan import bounds

_META = "anonproxy_clamp"


@dataclass(frozen=True)
class Clamp:
    """The bounds a column reference is clamped into, and the SQL type the clamped value has."""

    low: Decimal
    high: Decimal
    type: str  # as PostgreSQL writes it: "integer", "numeric"


def clamp_for(sql_type: str, lower: Decimal, upper: Decimal) -> Clamp | None:
    """The clamp of a column of ``sql_type`` declared within [lower, upper]; None when it cannot be written
    exactly (not an integer or numeric type), or no value of the type lies within the bounds."""
    kind = bounds.column_value(bounds.ColumnFacts("", sql_type)).type
    if kind in bounds.INTEGERS:
        smallest, largest = bounds.INTEGERS[kind]
        low, high = max(smallest, Decimal(math.ceil(lower))), min(largest, Decimal(math.floor(upper)))
        return Clamp(low, high, sql_type) if low <= high else None
    if kind == "numeric":
        return Clamp(lower, upper, "numeric") if lower <= upper else None
    return None


def mark(node: exp.Column, clamp: Clamp) -> None:
    node.meta[_META] = clamp


def unmark(node: exp.Column) -> None:
    node.meta.pop(_META, None)


def clamp_of(node: exp.Expression) -> Clamp | None:
    """The clamp a column reference is read with, or None: read as it is."""
    found = node.meta.get(_META) if node.meta else None
    return found if isinstance(found, Clamp) else None


def clamped(node: exp.Column) -> exp.Expression:
    """The expression a marked column reference is rendered as (the reference itself inside, unmarked)."""
    clamp = clamp_of(node)
    assert clamp is not None
    column = node.copy()
    unmark(column)
    low, high = (exp.cast(exp.Literal.number(f"{bound:f}"), exp.DataType.build(clamp.type, dialect="postgres"))
                 for bound in (clamp.low, clamp.high))
    least = exp.Least(this=exp.Greatest(this=column, expressions=[low]), expressions=[high])
    return exp.Case(ifs=[exp.If(this=exp.Not(this=exp.Is(this=column.copy(), expression=exp.Null())),
                                true=least)])
