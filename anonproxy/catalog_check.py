"""The run-time check of a catalog fact both back-ends rely on: each row of a table is one person (its unit column is
unique and not null, sql/0023_one_row_per_person.sql). The suppress and dp SQL both write it; a leaf module, so that
neither back-end imports the other."""

from __future__ import annotations

FUNCTION = "anonproxy.one_row_per_person"


def one_row_per_person(relation: str, unit: str) -> str:
    """The check as a condition that reads no column. A scalar subquery: PostgreSQL evaluates it once, in the leader,
    and hands its value to parallel workers; called directly, each worker (a new process per statement) would call,
    and first compile, the function again."""
    return f"(SELECT {FUNCTION}({_literal(relation)}, {_literal(unit)}))"


def _literal(text: str) -> str:
    """A standard SQL string constant (the service session keeps standard_conforming_strings on)."""
    return "'" + text.replace("'", "''") + "'"
