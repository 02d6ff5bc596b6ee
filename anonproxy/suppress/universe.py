"""N and the most rows one person has, for the bounds-first shape (docs/suppression.md, "N on two cores").

Both come from one aggregation per person over the FROM clause, which PostgreSQL 15 finishes in one process while
the pass that answers the statement runs on every core. Where the unit is a column of integer type, the people
below a point (``anonproxy.unit_midpoint``, sql/0040) and those at or above it are counted in two branches of one
UNION ALL, which PostgreSQL runs side by side (a Parallel Append), and added up; a third branch holds the rows
without a unit, as the single aggregation did. Each person is in exactly one branch whatever the point, so N and
``most`` are those of the single aggregation. Other unit types keep the single aggregation.
"""

from __future__ import annotations

from anonproxy.plan.analysis import AnalyticQuery
from anonproxy.plan.tables import quote

# Unit column types (as format_type() writes them) that compare with the midpoint's bigint along their index.
_INTEGER_TYPES = frozenset({"smallint", "integer", "bigint"})
MIDPOINT = "anonproxy.unit_midpoint"


def universe_and_most(query: AnalyticQuery, condition: str | None) -> str:
    """SQL of one row (n, most): the distinct units of the FROM clause (WHERE not) and the most rows one unit has
    there (the rows without a unit counted as one unit's, as before), under ``condition`` (a check that reads no
    column) when given."""
    split = _integer_unit(query)
    if split is None:
        lines = ["SELECT count(unit), coalesce(max(unit_rows), 0)",
                 f"FROM ({_per_unit(query, None)}) AS anonproxy_units"]
    else:
        midpoint = f"{MIDPOINT}({_literal(split[0])}, {_literal(split[1])})"
        branches = [f"SELECT count(unit) AS n, max(unit_rows) AS most FROM ({_per_unit(query, test)}) "
                    "AS anonproxy_units" for test in (f"< {midpoint}", f">= {midpoint}", "IS NULL")]
        lines = ["SELECT coalesce(sum(n), 0)::bigint, coalesce(max(most), 0)",
                 "FROM (" + "\nUNION ALL\n".join(branches) + ") AS anonproxy_halves"]
    if condition is not None:
        lines.append(f"WHERE {condition}")
    return "\n".join(lines)


def _per_unit(query: AnalyticQuery, test: str | None) -> str:
    """Each unit of the FROM clause (those whose unit passes ``test``) with its rows."""
    where = f" WHERE {query.unit} {test}" if test is not None else ""
    return f"SELECT {query.unit} AS unit, count(*) AS unit_rows FROM {query.from_sql}{where} GROUP BY 1"


def _integer_unit(query: AnalyticQuery) -> tuple[str, str] | None:
    """The table (quoted, schema-qualified) and column of the query's unit when the catalog gave that column an
    integer type (read with the policy); None otherwise."""
    for reference, table in query.sources:
        if table.protected is not None:
            column, types = table.protected.unit_column, table.protected.types
        elif table.linked is not None:
            column, types = table.linked.column, table.linked.types
        else:
            continue
        if query.unit == f"{quote(reference)}.{quote(column)}":
            return (table.qualified, column) if (types or {}).get(column) in _INTEGER_TYPES else None
    return None


def _literal(text: str) -> str:
    """A standard SQL string constant (the service session keeps standard_conforming_strings on)."""
    return "'" + text.replace("'", "''") + "'"
