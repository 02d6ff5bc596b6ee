"""The joins of an analytic query over protected data: which tables may be joined, how, and on what.

:mod:`anonproxy.plan.analysis` takes the FROM clause apart into :class:`Source` values and calls
:func:`check_joins` once the expression checker knows the query's tables. Two kinds of join are admitted, both
INNER or LEFT with the table that carries the privacy unit first and on the preserved side:

* a linked table, on its declared key (``linked.key = protected.unit``);
* a reference table (public data the policy declares, sql/0017_reference_tables.sql), many-to-one: the ON
  condition equates every column of one of its unique keys, read from the catalog with the policy, with a plain
  column of a table before it (protected, linked, or an earlier reference table: a snowflake chain). Each row
  then meets at most one reference row, so no person's rows, hence no contribution, are multiplied. The two
  columns of each equality have the same SQL type (type modifiers aside): a comparison that casts one side could
  make distinct key values equal (two bigints that round to one float). A reference key equated with an
  identifying column would make the reference row a label of one person: refused.

The protected table may itself be LEFT JOINed to a linked table that comes first (Cube, Looker, Metabase and
Lightdash join ``visits LEFT JOIN adult ON visits.person_id = adult.id``), joined on the declared key as any linked
table is. Then every row of the FROM clause is a row of the linked table, and its key names its person whether a
row of the protected table matches or not: the linked table's key is the privacy unit, as when it is queried alone
(:func:`anonproxy.plan.analysis.analyze` chooses it). No row lacks its person; a row matched by several rows of the
protected table (a unit that is not unique) stays that person's row each time, within the rows per person that dp
bounds, as in the inner join.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlglot import exp

from anonproxy.plan.expressions import Checker, unwrap
from anonproxy.plan.refusals import forbidden, unsupported
from anonproxy.plan.tables import ResolvedTable, identifier


@dataclass
class Source:
    table: ResolvedTable
    node: exp.Table
    reference: str  # the name the query's expressions use for it
    join: exp.Join | None  # None for the first FROM item
    # A linked table's distinct rows (anonproxy.plan.distinct_pairs): the derived table, ``node`` its table inside
    derived: exp.Subquery | None = None


JOIN_HINT = ("Join a linked table with [LEFT] JOIN <linked> ON <linked>.<key> = <protected>.<unit>, the protected "
             "table (or the first linked table) first; put other conditions in WHERE.")
REFERENCE_HINT = ("Join a reference table after the protected table with [LEFT] JOIN <reference> ON "
                  "<reference>.<key column> = <earlier table>.<column> [AND ...], one equality for every column of "
                  "one of its unique keys, between columns of the same type; put other conditions in WHERE.")


def check_joins(sources: list[Source], anchor: Source, checker: Checker) -> None:
    """Every joined table is joined to tables before it, with INNER or LEFT JOIN: a linked table on its declared
    key, a reference table on all the columns of one of its unique keys.

    Sources are protected, linked or reference tables only (check_relations). A condition next to the key is
    checked like WHERE and may not name an identifying column: in an outer join it filters nothing, it only decides
    which rows of the nullable side match, which turns every aggregate into a question about the rows it names. The
    table whose column is the privacy unit (``anchor``) is never on the nullable side, so no row lacks its person.
    """
    nullable: set[str] = set()
    for position, source in enumerate(sources):
        join = source.join
        if join is None:
            continue
        reference = source.table.kind == "reference"
        if join_side(join, REFERENCE_HINT if reference else JOIN_HINT) == "LEFT":
            nullable.add(source.reference)
        conditions = conjuncts(join.args["on"])
        if reference:
            keys = reference_key(sources, position, conditions, checker)
        else:
            keys = [c for c in conditions if source.reference in (key_equality(c, sources, position) or ())][:1]
            if not keys:
                for condition in conditions:
                    checker.join_condition(condition)  # an identifying column: 42501 before the shape's 0A000
                raise unsupported(f"{source.table.policy_name} must be joined on its declared key "
                                  "(linked_table.key_column = protected_table.unit_column)", JOIN_HINT)
        for condition in conditions:
            if not any(condition is key for key in keys):
                checker.join_condition(condition)
    if anchor.reference in nullable:
        raise unsupported(f"{anchor.table.policy_name} carries the privacy unit and cannot be on the nullable side "
                          "of an outer join: its rows would have no person", JOIN_HINT)


def reference_key(sources: list[Source], position: int, conditions: list[exp.Expression],
                  checker: Checker) -> list[exp.Expression]:
    """The conditions that equate every column of one unique key of the reference table at ``position`` with a
    column of a table before it; refuse the join when no key is matched entirely."""
    source = sources[position]
    table = source.table.reference
    assert table is not None
    if not table.keys:
        raise unsupported(f"reference table {table.name} has no usable unique key (a primary key or unique index "
                          "that is immediate, valid, not partial, on plain columns): a join to it could match a row "
                          "more than once and multiply a person's contribution", "Ask the DBA to give "
                          f"{table.name} a primary key; `anonproxy policy lint` lists reference tables without one.")
    equated: dict[str, exp.Expression] = {}  # reference column -> the first condition equating it
    for condition in conditions:
        found = _reference_equality(condition, sources, position, checker)
        if found is not None and found not in equated:
            equated[found] = condition
    for key in table.keys:
        if all(column in equated for column in key):
            return [equated[column] for column in key]
    for condition in conditions:
        checker.join_condition(condition)  # an identifying column: 42501 before the shape's 0A000
    keys = " or ".join(f"({', '.join(key)})" for key in table.keys)
    raise unsupported(f"reference table {table.name} must be joined on every column of one of its unique keys, "
                      f"{keys}, each equal to a column of a table before it: otherwise a row of the protected table "
                      "could match several of its rows and count several times", REFERENCE_HINT)


def _reference_equality(condition: exp.Expression, sources: list[Source], position: int,
                        checker: Checker) -> str | None:
    """The reference table's key column when ``condition`` is reference.column = earlier.column (either way round)
    between columns of the same type; None when it is not such an equality (then it is an extra condition)."""
    condition = unwrap(condition)
    if not isinstance(condition, exp.EQ):
        return None
    sides = [unwrap(condition.this), unwrap(condition.expression)]
    if not all(isinstance(c, exp.Column) and c.args.get("table") is not None and c.args.get("db") is None
               for c in sides):
        return None
    refs = {s.reference: s for s in sources[: position + 1]}
    ends = [(refs.get(identifier(c.args["table"]) or ""), identifier(c.this) or "") for c in sides]
    target = sources[position]
    assert target.table.reference is not None
    key_columns = {column for key in target.table.reference.keys for column in key}
    for (mine, column), (other, other_column) in (ends, ends[::-1]):
        if mine is not target or other is None or other is target or column not in key_columns:
            continue
        if checker.scope.is_identifier(other.reference, other_column):
            raise forbidden(f"reference table {target.table.policy_name} cannot be joined on identifying column "
                            f"{other.reference}.{other_column}: its rows would then describe one person each",
                            "Join reference tables on columns shared by many people (a region, a date, a product "
                            "code); a table about people must be linked, not declared a reference table.")
        mine_type, other_type = base_type(target.table, column), base_type(other.table, other_column)
        if mine_type is None or mine_type != other_type:
            raise unsupported(f"{target.reference}.{column} ({mine_type or 'type unknown'}) and "
                              f"{other.reference}.{other_column} ({other_type or 'type unknown'}) differ in type: a "
                              "comparison that converts one of them could make distinct keys equal",
                              REFERENCE_HINT)
        if collation(target.table, column) != collation(other.table, other_column):
            raise unsupported(f"{target.reference}.{column} and {other.reference}.{other_column} differ in collation, "
                              "and one of them is nondeterministic: PostgreSQL compares them under it, where distinct "
                              "keys may be equal ('r1' = 'R1'), so a row could meet several reference rows",
                              "Ask the DBA to give the reference key the collation of the column it is joined on.")
        return column
    return None


def collation(table: ResolvedTable, column: str) -> str | None:
    """The nondeterministic collation of ``column`` as read with the policy; None for a deterministic one (all of
    them compare by bytes) or when not read."""
    model = table.protected or table.linked or table.reference
    found = model.nondeterministic if model is not None else None
    return found.get(column) if found else None


def base_type(table: ResolvedTable, column: str) -> str | None:
    """``column``'s SQL type as read with the policy, without its type modifier; None when unknown."""
    model = table.protected or table.linked or table.reference
    types = model.types if model is not None else None
    sql_type = types.get(column) if types else None
    return _MODIFIER.sub("", sql_type) if sql_type is not None else None


_MODIFIER = re.compile(r"\([^)]*\)")


def join_side(join: exp.Join, hint: str = JOIN_HINT) -> str:
    """"" for an inner join, "LEFT" for a left outer join; every other kind of join is refused (with ``hint``)."""
    if join.args.get("method"):
        raise unsupported(f"{join.args['method'].upper()} JOIN is not supported over protected tables", hint)
    if join.args.get("using"):
        raise unsupported("JOIN ... USING is not supported over protected tables", hint)
    side = (join.args.get("side") or "").upper()
    kind = (join.args.get("kind") or "").upper()
    if side in ("RIGHT", "FULL"):
        raise unsupported(f"{side} JOIN is not supported over protected tables: the table that carries the privacy "
                          "unit must be on the preserved side of every outer join", hint)
    if kind == "CROSS" or join.args.get("on") is None:
        raise unsupported("joins without ON (comma, CROSS JOIN) are not supported over protected tables", hint)
    extra = _set_args(join) - {"this", "on", "side", "kind"}
    if extra or kind not in ("", "INNER", "OUTER") or (kind == "OUTER" and side != "LEFT"):
        raise unsupported(f"{' '.join(filter(None, (side, kind)))} JOIN is not supported over protected tables",
                          hint)
    return side


def conjuncts(node: exp.Expression) -> list[exp.Expression]:
    """The operands of a top-level AND chain (parentheses around it or its operands ignored)."""
    node = unwrap(node)
    if isinstance(node, exp.And):
        return conjuncts(node.this) + conjuncts(node.expression)
    return [node]


def key_equality(on: exp.Expression, sources: list[Source], position: int) -> tuple[str, str] | None:
    """The two references when ``on`` is exactly linked.key = protected.unit, or linked.key = linked.key of two
    tables linked to the same protected table."""
    on = unwrap(on)
    if not isinstance(on, exp.EQ):
        return None
    columns = [unwrap(on.this), unwrap(on.expression)]
    if not all(isinstance(c, exp.Column) and c.args.get("table") is not None and c.args.get("db") is None
               for c in columns):
        return None
    refs = {s.reference: s for s in sources[: position + 1]}
    ends = []
    for column in columns:
        source = refs.get(identifier(column.args["table"]) or "")
        if source is None:
            return None
        ends.append((source, identifier(column.this)))
    for (a, a_col), (b, b_col) in (ends, ends[::-1]):
        if a.table.kind == "linked" and b.table.kind == "protected":
            link, protected = a.table.linked, b.table.protected
            assert link is not None and protected is not None
            if (link.column == a_col and protected.unit_column == b_col
                    and link.references_column == protected.unit_column):
                return (a.reference, b.reference)
        if a.table.kind == "linked" and b.table.kind == "linked" and a is not b:
            first, second = a.table.linked, b.table.linked
            assert first is not None and second is not None
            if (first.column == a_col and second.column == b_col and first.references == second.references
                    and first.references_column == second.references_column):
                return (a.reference, b.reference)
    return None


def _set_args(node: exp.Expression) -> set[str]:
    return {key for key, value in node.args.items() if value not in (None, False, [], "")}
