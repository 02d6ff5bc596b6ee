"""`anonproxy policy lint`: declared bounds must be public facts, not somebody's value.

Every gated role can read the policy (``anonproxy.column_policies``), so a
bound equal to the largest value in the data, held by one person, tells them
that person's value. For every declared bound of every protected or linked
column, :func:`lint` counts the distinct privacy units holding exactly that
value and reports the bounds that fewer than k of them hold (none at all is
fine: then the bound says nothing about anybody). k is the largest k of the
policy's roles in suppress mode, or the default k when there is none.

It also warns about every declared reference table that has no usable unique
key (dropped, made partial or deferrable since it was declared; or the table
is gone): it stays declared, but every join to it is refused until it has one.

The SQL is built from identifiers (psycopg.sql), never from spliced text;
bound values are parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

import psycopg
from psycopg import sql

from .model import ColumnPolicy, Policy, SuppressionParams, split_policy_name


@dataclass(frozen=True)
class Finding:
    """A bound held by ``count`` privacy units, 0 < count < k."""

    table: str  # policy name, "public.adult"
    column: str
    side: Literal["lower", "upper"]
    value: float
    count: int
    k: int

    def __str__(self) -> str:
        people = "person holds" if self.count == 1 else "people hold"
        return (f"{self.table}.{self.column}: {self.side} bound {_plain(self.value)} is a value {self.count} "
                f"{people} (fewer than k = {self.k}); declare a public bound, rounded outward")


def lint_k(policy: Policy) -> int:
    """The largest k of the roles in suppress mode; the default k when no role is in that mode."""
    ks = [role.suppression.k for role in policy.roles.values() if role.mode == "suppress"]
    return max(ks, default=SuppressionParams().k)


def lint(conn: psycopg.Connection[Any], policy: Policy) -> tuple[int, list[Finding]]:
    """How many bounds were checked, and the findings, in policy order."""
    k = lint_k(policy)
    checked, findings = 0, []
    sources = [(table.name, table.unit_column, table.columns) for table in policy.tables.values()]
    sources += [(link.name, link.column, link.columns) for link in policy.links.values()]
    for name, unit, columns in sources:
        for column in columns.values():
            sides = _bounds(column)
            if not sides:
                continue
            counts = _holders(conn, name, unit, column.name, [value for _, value in sides])
            checked += len(sides)
            findings += [Finding(name, column.name, side, value, count, k)
                         for (side, value), count in zip(sides, counts, strict=True) if 0 < count < k]
    return checked, findings


def reference_warnings(policy: Policy) -> list[str]:
    """One warning per declared reference table without a usable unique key (read with the policy)."""
    return [f"reference table {reference.name} has no usable unique key (a primary key or unique index that is "
            "immediate, valid, not partial, on plain columns), or no longer exists: every join to it is refused"
            for reference in policy.references.values() if not reference.keys]


def _bounds(column: ColumnPolicy) -> list[tuple[Literal["lower", "upper"], float]]:
    sides: list[tuple[Literal["lower", "upper"], float]] = []
    if column.lower is not None:
        sides.append(("lower", column.lower))
    if column.upper is not None:
        sides.append(("upper", column.upper))
    return sides


def _holders(conn: psycopg.Connection[Any], table: str, unit: str, column: str, values: list[float]) -> list[int]:
    """Distinct units whose ``column`` equals each value, in one scan of the table."""
    counts = sql.SQL(", ").join(
        sql.SQL("count(DISTINCT {unit}) FILTER (WHERE {column} = {value})").format(
            unit=sql.Identifier(unit), column=sql.Identifier(column), value=sql.Placeholder())
        for _ in values)
    query = sql.SQL("SELECT {counts} FROM {table}").format(counts=counts,
                                                            table=sql.Identifier(*split_policy_name(table)))
    row = conn.execute(query, [Decimal(repr(value)) for value in values]).fetchone()
    assert row is not None  # an aggregate without GROUP BY returns one row
    return [int(count) for count in row]


def _plain(value: float) -> str:
    return format(Decimal(repr(value)).normalize(), "f")
