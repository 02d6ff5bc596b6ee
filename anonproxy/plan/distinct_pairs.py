"""A linked table's distinct (dimensions, key) rows as a FROM item: ``(SELECT DISTINCT v.channel, v.person_id FROM
visits v WHERE ...) AS k`` joined to the protected table on ``k.person_id = adult.id``.

Lightdash's fan-out keys with a dimension of the joined table (``SELECT DISTINCT visits.channel, adult.id FROM
adult LEFT JOIN visits ...``, joined back to ``adult``) count each person once per value of that dimension:
:mod:`anonproxy.plan.fanout` rewrites them to this join, which means the same. Each row of the derived table is one
(values, person) pair of the linked table's rows that pass its WHERE: a row of that person's, with fewer columns,
and no more of them than the linked table holds. Joined on the declared key, it is then a linked table to the
checks and the back-ends: suppression counts the people of each group, dp bounds each person's rows and groups
over the FROM clause as written, whatever it holds.

Admitted by form (:func:`body`): ``SELECT DISTINCT`` of plain columns, unaliased, of one table, an optional WHERE,
no other clause, its alias without column names. The analysis then requires (:func:`resolve`, :func:`check`): a
linked table; its key column among the columns (the join names it); the WHERE conditions over its own columns,
passing the checks of a WHERE over that table (the allowlist, the no-error proof), without nested queries. The
outer query sees only the selected columns (the table's column types are cut to them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from sqlglot import exp

from anonproxy.plan.joins import conjuncts
from anonproxy.plan.refusals import unsupported
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
    if not all(isinstance(column, exp.Column) and isinstance(column.this, exp.Identifier)
               for column in select.expressions):
        return None
    return select


def resolve(item: exp.Subquery, index: PolicyIndex) -> ResolvedTable:
    """The linked table ``item`` reads, its columns cut to those it selects; refused when not a linked table, or when
    its key column is not selected."""
    select = item.this
    table = select.args["from_"].this
    resolved = index.resolve(table)
    link = resolved.linked
    if link is None or _extra(table, {"this", "db", "alias"}) or (
            table.args.get("alias") is not None and table.args["alias"].args.get("columns")):
        raise unsupported(f"a SELECT DISTINCT derived table joined in FROM must read one linked table, not "
                          f"{resolved.policy_name}", HINT)
    own = _reference(table, resolved)
    names = []
    for column in select.expressions:
        qualifier = identifier(column.args.get("table"))
        if column.args.get("db") is not None or qualifier not in (None, own):
            raise unsupported(f"{sql(column)} in a SELECT DISTINCT derived table must be a column of its table "
                              f"{own}", HINT)
        names.append(identifier(column.this) or "")
    if link.column not in names:
        raise unsupported(f"a SELECT DISTINCT derived table of {resolved.policy_name} must select its key column "
                          f"{link.column}, on which it is joined", HINT)
    types = link.types
    known = {name: types[name] for name in names if name in types} if types is not None else None
    if known is not None and len(known) != len(set(names)):
        missing = sorted(set(names) - set(known))
        raise unsupported(f"{resolved.policy_name} has no column {missing[0]}", HINT)
    not_null = link.not_null & frozenset(names) if link.not_null is not None else None
    return replace(resolved, linked=replace(link, types=known, not_null=not_null))


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
