"""Refuse an outer query over an aggregate query grouped by the privacy unit.

Django's ``Adult.objects.annotate(n=Count('visits')).aggregate(Avg('n'))``
sends ``SELECT AVG(n) FROM (SELECT COUNT(visits.visit_id) AS n FROM adult
LEFT JOIN visits ON ... GROUP BY adult.id) subquery``: a figure per person,
then a statistic over people. The outer level reads only the rows the inner
query releases (:mod:`anonproxy.plan.outer`), and grouped by the unit each
group is one person: suppression withholds every group (the outer query reads
the suppressed-rest row alone, the total of everyone), partition selection
releases almost none (it reads almost no row). Nothing leaks, but the answer
is far from PostgreSQL's; so such a statement is refused, in both modes.

A grouping key is the unit when it is only a column (in parentheses at most)
that is a protected table's unit column or a linked table's key (its person);
a column the policy marks as an identifier (``visits.visit_id``: one visit, so
one person) makes groups of one person too, and is refused the same way.
Derived tables and WITH queries are flattened before this, so their aliases
name these columns again; any other expression of such a column is refused in
the inner query already. Every aggregate query whose released rows a
statement reads is checked: those a level joins, and the branches of a set
operation. A plain ``GROUP BY id`` is not concerned: the client sees its rows
as they are.
"""

from __future__ import annotations

from sqlglot import exp

from anonproxy.plan.analysis import AnalyticQuery, identifier_columns
from anonproxy.plan.refusals import Refusal, unsupported
from anonproxy.plan.tables import ResolvedTable, identifier

UNIT_GROUPS_HINT = ("Ask the statistic over people directly, without the per-person query: count(*) or "
                    "count(DISTINCT <unit>) per group, or a ratio of them, e.g. the average number of visits per "
                    "person as SELECT count(visits.visit_id)::numeric / count(DISTINCT adult.id) FROM adult LEFT "
                    "JOIN visits ON visits.person_id = adult.id. An outer query may read an aggregate query grouped "
                    "by other columns.")


def check(query: AnalyticQuery, dp: bool) -> None:
    """Refuse ``query``, an aggregate query an outer level reads, when one of its grouping keys is the unit or
    another identifier column."""
    found = _unit_key(query)
    if found is not None:
        raise _refusal(*found, dp)


def _unit_key(query: AnalyticQuery) -> tuple[str, str] | None:
    """The first grouping key of ``query`` that is a privacy unit or identifier column: what it is ("the privacy
    unit", "the identifier column") and ``table.column``; None if none is."""
    for key in query.key_nodes:
        column = _column(key)
        if column is None:
            continue
        name, written = identifier(column.this), identifier(column.args.get("table"))
        # A bare name that is a column of one of the tables is that column (were it also a column of another
        # table, PostgreSQL would refuse it as ambiguous).
        for reference, table in query.sources:
            if written not in (None, reference) or name not in identifier_columns(table):
                continue
            what = "the privacy unit" if name == _unit_column(table) else "the identifier column"
            return what, f"{reference}.{name}"
    return None


def _refusal(what: str, key: str, dp: bool) -> Refusal:
    """The refusal of an outer query over an aggregate query grouped by ``key``, ``what`` it is."""
    fate = ("partition selection releases almost none of them, so the outer query would read (almost) no row"
            if dp else "none can be released, so the outer query would read only the suppressed-rest row")
    return unsupported(f"an outer query over an aggregate query grouped by {what} {key} is not supported: "
                       f"each group is one person, {fate}", UNIT_GROUPS_HINT)


def _column(key: exp.Expression) -> exp.Column | None:
    """``key`` if it is a column (the key nodes are canonical: without parentheses). Any other expression of an
    identifying column is refused in the inner query already."""
    return key if isinstance(key, exp.Column) and isinstance(key.this, exp.Identifier) else None


def _unit_column(table: ResolvedTable) -> str | None:
    """The column of ``table`` whose value is the person: a protected table's unit, a linked table's key."""
    if table.protected is not None:
        return table.protected.unit_column
    if table.linked is not None:
        return table.linked.column
    return None
