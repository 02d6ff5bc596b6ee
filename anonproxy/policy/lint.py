"""`anonproxy policy lint`: declared bounds must be public facts, not somebody's value.

Every gated role can read the policy (``anonproxy.column_policies``), so a
bound equal to the largest value in the data, held by one person, tells them
that person's value. For every declared bound of every protected or linked
column, :func:`lint` counts the distinct privacy units holding exactly that
value and reports the bounds that fewer than k of them hold (none at all is
fine: then the bound says nothing about anybody). k is the largest k of the
policy's roles in suppress mode, or the default k when there is none.

A time bound (``earliest``, ``latest`` of a date or timestamp column) is rarely
anybody's exact value, so it is counted differently: the people whose value is
at or before the earliest bound, and at or after the latest. A bound that 1 to
k − 1 people reach is the data's own extreme, or leaves a few people outside
the declared range (their rows fall out of dp's calendar buckets): either way
it is reported. A bound beyond every value (none reaches it) is fine.

It also warns about every declared reference table that has no usable unique
key (dropped, made partial or deferrable since it was declared; or the table
is gone): it stays declared, but every join to it is refused until it has one.
And about every table each statement on which is refused at query time: a
linked table whose key may count one person several times (the refusal's own
words, :func:`anonproxy.policy.links.key_problem`), and a protected table whose
unit PostgreSQL cannot count people by (a type without equality, such as
``point``: PostgreSQL's own error, from planning the count of distinct units).

The SQL is built from identifiers (psycopg.sql), never from spliced text;
bound values are parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Literal

import psycopg
from psycopg import sql

from .links import key_problem
from .model import ColumnPolicy, Policy, SuppressionParams, split_policy_name

Side = Literal["lower", "upper", "earliest", "latest"]


@dataclass(frozen=True)
class Finding:
    """A bound held (a time bound: reached) by ``count`` privacy units, 0 < count < k."""

    table: str  # policy name, "public.adult"
    column: str
    side: Side
    value: float | datetime
    count: int
    k: int

    def __str__(self) -> str:
        if isinstance(self.value, datetime):
            people = "person has" if self.count == 1 else "people have"
            where = "before" if self.side == "earliest" else "after"
            return (f"{self.table}.{self.column}: {self.side} bound {_moment(self.value)}: {self.count} {people} a "
                    f"value at or {where} it (fewer than k = {self.k}); declare a public bound beyond every value, "
                    "rounded outward")
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
            counts = _holders(conn, name, unit, column.name, sides)
            checked += len(sides)
            findings += [Finding(name, column.name, side, value, count, k)
                         for (side, value), count in zip(sides, counts, strict=True) if 0 < count < k]
    return checked, findings


def reference_warnings(policy: Policy) -> list[str]:
    """One warning per declared reference table without a usable unique key (read with the policy)."""
    return [f"reference table {reference.name} has no usable unique key (a primary key or unique index that is "
            "immediate, valid, not partial, on plain columns), or no longer exists: every join to it is refused"
            for reference in policy.references.values() if not reference.keys]


def link_warnings(policy: Policy) -> list[str]:
    """One warning per linked table whose key may count one person several times: the query-time refusal's message
    and hint (from the types and collations read with the policy)."""
    problems = [key_problem(link, policy.tables.get(link.references)) for link in policy.links.values()]
    return [f"{problem.message}. {problem.hint}" for problem in problems if problem is not None]


def unit_warnings(conn: psycopg.Connection[Any], policy: Policy) -> list[str]:
    """One warning per protected table whose unit PostgreSQL cannot count people by: every statement over it is
    refused at query time with PostgreSQL's error (42883), which planning count(DISTINCT unit) gives (nothing is
    run)."""
    warnings = []
    for table in policy.tables.values():
        query = sql.SQL("EXPLAIN SELECT count(DISTINCT {unit}) FROM {table}").format(
            unit=sql.Identifier(table.unit_column), table=sql.Identifier(*split_policy_name(table.name)))
        try:
            with conn.transaction():
                conn.execute(query)
        except psycopg.errors.UndefinedFunction as exc:
            unit_type = (table.types or {}).get(table.unit_column, "unknown")
            warnings.append(f"protected table {table.name} cannot be queried: its unit {table.unit_column} is of "
                            f"type {unit_type}, by which PostgreSQL cannot count people: "
                            f"{exc.diag.message_primary}. Ask the DBA to make the unit a column of a type with "
                            "equality and ordering (an integer, text).")
    return warnings


def _bounds(column: ColumnPolicy) -> list[tuple[Side, float | datetime]]:
    sides: list[tuple[Side, float | datetime]] = []
    if column.lower is not None:
        sides.append(("lower", column.lower))
    if column.upper is not None:
        sides.append(("upper", column.upper))
    if column.earliest is not None:
        sides.append(("earliest", column.earliest))
    if column.latest is not None:
        sides.append(("latest", column.latest))
    return sides


# How a side's value is compared with the column's: held exactly (numbers), reached (time).
_TESTS = {"lower": "=", "upper": "=", "earliest": "<=", "latest": ">="}


def _holders(conn: psycopg.Connection[Any], table: str, unit: str, column: str,
             sides: list[tuple[Side, float | datetime]]) -> list[int]:
    """Distinct units holding (or reaching) each bound, in one scan of the table."""
    counts = sql.SQL(", ").join(
        sql.SQL("count(DISTINCT {unit}) FILTER (WHERE {column} {test} {value})").format(
            unit=sql.Identifier(unit), column=sql.Identifier(column), test=sql.SQL(_TESTS[side]),
            value=sql.Placeholder())
        for side, _ in sides)
    query = sql.SQL("SELECT {counts} FROM {table}").format(counts=counts,
                                                            table=sql.Identifier(*split_policy_name(table)))
    values = [value if isinstance(value, datetime) else Decimal(repr(value)) for _, value in sides]
    row = conn.execute(query, values).fetchone()
    assert row is not None  # an aggregate without GROUP BY returns one row
    return [int(count) for count in row]


def _moment(value: datetime) -> str:
    return value.isoformat(" ").replace("+00:00", "+00")


def _plain(value: float) -> str:
    return format(Decimal(repr(value)).normalize(), "f")
