"""A linked table's distinct (dimensions, key) rows as a FROM item: ``(SELECT DISTINCT v.channel, v.person_id FROM
visits v WHERE ...) AS k`` joined to the protected table on ``k.person_id = adult.id``.

Lightdash's fan-out keys with a dimension of the joined table (``SELECT DISTINCT visits.channel, adult.id FROM
adult LEFT JOIN visits ...``, joined back to ``adult``) count each person once per value of that dimension:
:mod:`anonproxy.plan.fanout` rewrites them to this join, which means the same. Each row of the derived table is one
(values, person) pair of the linked table's rows that pass its WHERE: a row of that person's, with fewer columns,
and no more of them than the linked table holds. Joined on the declared key, it is then a linked table to the
checks and the back-ends: suppression counts the people of each group, dp bounds each person's rows and groups
over the FROM clause as written, whatever it holds.

Admitted by form (:func:`body`): ``SELECT DISTINCT`` of plain columns, unaliased, or ``date_trunc('<unit>',
<column>) AS <name>`` (a BI tool's time dimension), of one table, an optional WHERE, no other clause, its alias
without column names. The analysis then requires (:func:`resolve`, :func:`check`): a linked table; its key column
among the columns (the join names it); the WHERE conditions over its own columns, passing the checks of a WHERE over
that table (the allowlist, the no-error proof), without nested queries; a ``date_trunc`` of a column that is not
identifying, checked as a grouping expression. The outer query sees only the selected columns (the table's column
types are cut to them; a ``date_trunc`` has its column's timestamp type, and no column policy: dp mode selects its
groups as for any undeclared key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from sqlglot import exp

from anonproxy.plan.joins import conjuncts
from anonproxy.plan.refusals import forbidden, unsupported
from anonproxy.plan.render import sql
from anonproxy.plan.tables import PolicyIndex, ResolvedTable, identifier

HINT = ("A SELECT DISTINCT derived table over a linked table may be joined on its key: [LEFT] JOIN (SELECT DISTINCT "
        "<linked>.<column>, ..., <linked>.<key> FROM <linked> [WHERE <conditions on its columns>]) AS <alias> ON "
        "<alias>.<key> = <protected>.<unit>.")
_ARGS = frozenset({"expressions", "from_", "where", "distinct"})


def body(item: exp.Expression) -> exp.Select | None:
    """The SELECT of ``item`` when it is a derived table of this form (see the module's doc), else None."""
    if not isinstance(item, exp.Subquery) or not isinstance(item.this, exp.Select) \
            or _extra(item, {"this", "alias"}) or item.args.get("alias") is None \
            or item.args["alias"].args.get("columns"):
        return None
    select = item.this
    distinct = select.args.get("distinct")
    from_ = select.args.get("from_")
    if not isinstance(distinct, exp.Distinct) or distinct.args.get("on") or _extra(select, _ARGS) \
            or from_ is None or not isinstance(from_.this, exp.Table):
        return None
    if not all((isinstance(item, exp.Column) and isinstance(item.this, exp.Identifier))
               or (isinstance(item, exp.Alias) and truncated(item.this, None)) for item in select.expressions):
        return None
    return select


def truncated(node: exp.Expression, table: str | None) -> bool:
    """Whether ``node`` is ``date_trunc('<unit>', <column>)`` (a BI tool's time dimension), its column qualified
    with ``table`` (None: any name or none)."""
    column = node.this if isinstance(node, exp.TimestampTrunc) and not _extra(node, {"this", "unit"}) else None
    return isinstance(column, exp.Column) and isinstance(column.this, exp.Identifier) \
        and column.args.get("db") is None and isinstance(node.args.get("unit"), exp.Var) \
        and (table is None or identifier(column.args.get("table")) == table)


def resolve(item: exp.Subquery, index: PolicyIndex) -> ResolvedTable:
    """The linked table ``item`` reads, its columns cut to those it selects; refused when not a linked table, when
    its key column is not selected, or when two columns have one name."""
    select = item.this
    table = select.args["from_"].this
    resolved = index.resolve(table)
    link = resolved.linked
    if link is None or _extra(table, {"this", "db", "alias"}) or (
            table.args.get("alias") is not None and table.args["alias"].args.get("columns")):
        raise unsupported(f"a SELECT DISTINCT derived table joined in FROM must read one linked table, not "
                          f"{resolved.policy_name}", HINT)
    own = _reference(table, resolved)
    outputs: dict[str, tuple[str, bool]] = {}  # output name -> (the column it reads, whether computed)
    for output in select.expressions:
        column = output.this.this if isinstance(output, exp.Alias) else output
        qualifier = identifier(column.args.get("table"))
        if column.args.get("db") is not None or qualifier not in (None, own):
            raise unsupported(f"{sql(column)} in a SELECT DISTINCT derived table must be a column of its table "
                              f"{own}", HINT)
        name = identifier(output.args["alias"] if isinstance(output, exp.Alias) else column.this) or ""
        if name in outputs:
            raise unsupported(f"a SELECT DISTINCT derived table joined in FROM names two columns {name}", HINT)
        outputs[name] = (identifier(column.this) or "", isinstance(output, exp.Alias))
    if outputs.get(link.column) != (link.column, False):
        raise unsupported(f"a SELECT DISTINCT derived table of {resolved.policy_name} must select its key column "
                          f"{link.column}, on which it is joined", HINT)
    return replace(resolved, linked=replace(link, types=_types(outputs, link.types), not_null=(
        frozenset(name for name, (column, computed) in outputs.items() if not computed and column in link.not_null)
        if link.not_null is not None else None)))


def _types(outputs: dict[str, tuple[str, bool]], types: dict[str, str] | None) -> dict[str, str] | None:
    """The types of the derived table's columns: a column's own; date_trunc's, its column's timestamp type (of a
    date: with time zone, the function PostgreSQL chooses). Refused when the table has no such column."""
    if types is None:
        return None
    found = {}
    for name, (column, computed) in outputs.items():
        if column not in types:
            raise unsupported(f"the linked table has no column {column}", HINT)
        found[name] = "timestamp with time zone" if computed and types[column] == "date" else types[column]
    return found


def check(item: exp.Subquery, index: PolicyIndex,
          row_check: Callable[[ResolvedTable, str, exp.Expression, str], None]) -> None:
    """Refuse a WHERE condition of ``item`` that names another table's column, nests a query, or fails the row
    checks of a WHERE over its table, all of whose columns it may read (``row_check(table, reference, condition,
    clause)``)."""
    select = item.this
    inner = select.args["from_"].this
    table = index.resolve(inner)
    own = _reference(inner, table)
    where = select.args.get("where")
    for condition in conjuncts(where.this) if where is not None else []:
        if any(isinstance(node, (exp.Select, exp.Subquery, exp.Exists, exp.Lateral)) for node in condition.walk()):
            raise unsupported("a SELECT DISTINCT derived table joined in FROM may not nest another query", HINT)
        for column in condition.find_all(exp.Column):
            qualifier = identifier(column.args.get("table"))
            if column.args.get("db") is not None or qualifier not in (None, own):
                raise unsupported(f"{sql(column)} in a SELECT DISTINCT derived table must be a column of its table "
                                  f"{own}", HINT)
        row_check(table, own, condition, "WHERE")
    link = table.linked
    assert link is not None  # resolve() admitted the derived table
    identifying = {link.column, *(name for name, column in link.columns.items() if column.kind == "identifier")}
    for item in select.expressions:
        if isinstance(item, exp.Alias):  # a computed time dimension: checked as a grouping expression over the table
            if identifier(item.this.this.this) in identifying:
                raise forbidden(f"{sql(item.this)} in a SELECT DISTINCT derived table computes from identifying "
                                f"column {sql(item.this.this)}", HINT)
            row_check(table, own, item.this, "GROUP BY")


def qualified(item: exp.Subquery, table: ResolvedTable) -> exp.Subquery:
    """A copy of ``item``, its table schema-qualified."""
    copy = item.copy()
    inner = copy.this.args["from_"].this
    if inner.args.get("alias") is None:
        inner.set("alias", exp.TableAlias(this=exp.Identifier(this=_reference(inner, table), quoted=True)))
    inner.set("this", exp.Identifier(this=table.name, quoted=True))
    inner.set("db", exp.Identifier(this=table.schema, quoted=True))
    return copy


def _reference(table: exp.Table, resolved: ResolvedTable) -> str:
    """The name the derived table's columns use for its table: its alias, else its name."""
    alias = table.args.get("alias")
    return (identifier(alias.this) if alias is not None else None) or resolved.name


def _extra(node: exp.Expression, allowed: set[str] | frozenset[str]) -> set[str]:
    return {key for key, value in node.args.items() if value not in (None, False, [], "")} - set(allowed)
