"""The joins of an analytic query over protected data: which tables may be joined, how, and on what.

Moved out of :mod:`anonproxy.rewrite.analytic`, which takes the FROM clause apart into :class:`Source` values
and calls :func:`check_joins` once the expression checker knows the query's tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlglot import exp

from anonproxy.rewrite.decision import unsupported
from anonproxy.rewrite.expressions import Checker, unwrap
from anonproxy.rewrite.names import ResolvedTable, identifier


@dataclass
class Source:
    table: ResolvedTable
    node: exp.Table
    reference: str  # the name the query's expressions use for it
    join: exp.Join | None  # None for the first FROM item


JOIN_HINT = ("Join a linked table with [LEFT] JOIN <linked> ON <linked>.<key> = <protected>.<unit>, the protected "
             "table (or the first linked table) first; put other conditions in WHERE.")


def check_joins(sources: list[Source], anchor: Source, checker: Checker) -> None:
    """Every joined table is joined on its declared key to a table before it, with INNER or LEFT JOIN.

    Sources are protected or linked tables only (check_relations). A condition next to the key is checked like
    WHERE and may not name an identifying column: in an outer join it filters nothing, it only decides which rows
    of the nullable side match, which turns every aggregate into a question about the rows it names. The table
    that carries the privacy unit is never on the nullable side, so no row lacks its person.
    """
    nullable: set[str] = set()
    for position, source in enumerate(sources):
        join = source.join
        if join is None:
            continue
        if join_side(join) == "LEFT":
            nullable.add(source.reference)
        conditions = conjuncts(join.args["on"])
        keys = [c for c in conditions if source.reference in (key_equality(c, sources, position) or ())]
        if not keys:
            for condition in conditions:
                checker.join_condition(condition)  # an identifying column: 42501 before the shape's 0A000
            raise unsupported(f"{source.table.policy_name} must be joined on its declared key "
                              "(linked_table.key_column = protected_table.unit_column)", JOIN_HINT)
        for condition in conditions:
            if condition is not keys[0]:
                checker.join_condition(condition)
    if anchor.reference in nullable:
        raise unsupported(f"{anchor.table.policy_name} carries the privacy unit and cannot be on the nullable side "
                          "of an outer join: its rows would have no person", JOIN_HINT)


def join_side(join: exp.Join) -> str:
    """"" for an inner join, "LEFT" for a left outer join; every other kind of join is refused."""
    if join.args.get("method"):
        raise unsupported(f"{join.args['method'].upper()} JOIN is not supported over protected tables", JOIN_HINT)
    if join.args.get("using"):
        raise unsupported("JOIN ... USING is not supported over protected tables", JOIN_HINT)
    side = (join.args.get("side") or "").upper()
    kind = (join.args.get("kind") or "").upper()
    if side in ("RIGHT", "FULL"):
        raise unsupported(f"{side} JOIN is not supported over protected tables: the table that carries the privacy "
                          "unit must be on the preserved side of every outer join", JOIN_HINT)
    if kind == "CROSS" or join.args.get("on") is None:
        raise unsupported("joins without ON (comma, CROSS JOIN) are not supported over protected tables", JOIN_HINT)
    extra = _set_args(join) - {"this", "on", "side", "kind"}
    if extra or kind not in ("", "INNER", "OUTER") or (kind == "OUTER" and side != "LEFT"):
        raise unsupported(f"{' '.join(filter(None, (side, kind)))} JOIN is not supported over protected tables",
                          JOIN_HINT)
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
