"""Which columns of a statement a bound time filter narrows: the dp side of the "time" slots decided at Bind.

A WHERE condition ``col >= $n`` on a time column with declared bounds narrows a calendar key's public domain
(anonproxy.dp.time_domains) exactly as ``col >= 'constant'`` does, once the value is known: the parameter is
decided at Bind (anonproxy.plan.bind_values, kind "time"). :func:`time_columns` tells that slot finder which
column references are such columns, and their type (the OID the parameter gets when the client declares none:
what PostgreSQL infers when it compares the column with a parameter).

A reference is resolved among the tables named in the statement's own FROM and JOIN clauses: qualified by one of
their names or aliases, or unqualified and declared by exactly one of them. Anything else is no time column here
(its parameter stays one decided at Parse, as before). :func:`column_types` resolves a reference the same way,
to the column's SQL type: what types a bare HAVING operand compared with sum() or avg() of it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

from sqlglot import exp

from anonproxy.plan.tables import PolicyIndex, ResolvedTable, identifier

_T = TypeVar("_T")

# A time column's SQL type (format_type's name, without a precision) -> the OID of that type.
_OIDS = {"date": 1082, "timestamp without time zone": 1114, "timestamp with time zone": 1184}


def time_columns(tree: exp.Expression, index: PolicyIndex) -> Callable[[exp.Column], int | None]:
    """For a column reference of ``tree``'s top-level SELECT: the type OID of the bounded time column it reads,
    else None."""
    return _reader(_tables(tree, index), _type)


def column_types(tree: exp.Expression, index: PolicyIndex) -> Callable[[exp.Column], str | None]:
    """For a column reference of ``tree``'s top-level SELECT: the SQL type (format_type's name) of the protected or
    linked table's column it reads, as the policy read it, else None (the type of a bare HAVING operand compared
    with an aggregate of it: anonproxy.plan.bind_values)."""
    return _reader(_tables(tree, index), _sql_type)


def _reader(tables: list[tuple[str, ResolvedTable]],
            read: Callable[[ResolvedTable, str], _T | None]) -> Callable[[exp.Column], _T | None]:
    """A column reference -> ``read`` of the one table among ``tables`` it can name that ``read`` knows it of."""

    def value(column: exp.Column) -> _T | None:
        if column.args.get("db") is not None:
            return None
        name = identifier(column.this) if isinstance(column.this, exp.Identifier) else None
        qualifier = identifier(column.args.get("table"))
        found = [table for alias, table in tables
                 if (qualifier is None or qualifier == alias) and name is not None and read(table, name)]
        return read(found[0], name) if len(found) == 1 and name is not None else None

    return value


def _tables(tree: exp.Expression, index: PolicyIndex) -> list[tuple[str, ResolvedTable]]:
    """The plain tables of the top-level FROM and JOINs, each with the name it is referred to by."""
    if not isinstance(tree, exp.Select):
        return []
    sources = [tree.args.get("from_"), *(tree.args.get("joins") or [])]
    found = []
    for source in sources:
        table = source.this if source is not None else None
        if isinstance(table, exp.Table) and isinstance(table.this, exp.Identifier):
            alias = table.args.get("alias")
            name = identifier(alias.this) if isinstance(alias, exp.TableAlias) and alias.this else None
            found.append((name or identifier(table.this) or "", index.resolve(table)))
    return found


def _sql_type(table: ResolvedTable, name: str) -> str | None:
    """The SQL type of column ``name`` of a protected or linked ``table``, as the policy read it."""
    model = table.protected if table.protected is not None else table.linked
    return model.types.get(name) if model is not None and model.types is not None else None


def _type(table: ResolvedTable, name: str) -> int | None:
    """The OID of column ``name`` of ``table`` when it is a date or timestamp column with declared bounds."""
    model = table.protected if table.protected is not None else table.linked
    if model is None or model.types is None:
        return None
    policy = model.columns.get(name)
    if policy is None or policy.earliest is None or policy.latest is None:
        return None
    return _OIDS.get(re.sub(r"\(\d+\)", "", model.types.get(name, "")))  # timestamp(3) with time zone
