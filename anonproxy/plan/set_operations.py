"""UNION [ALL], INTERSECT and EXCEPT of aggregate queries: post-processing of each branch's released rows.

Ibis's ``describe()`` (a UNION ALL of one aggregate query per column), a
hand-written total row (``SELECT region, sum(x) ... GROUP BY region UNION ALL
SELECT 'Total', sum(x) ...``) and dbt_utils.union_relations over aggregate
models combine aggregate queries with a set operation. When every branch is
an aggregate query (or reads only released rows, :mod:`anonproxy.plan.outer`),
each branch is gated on its own, exactly as if the client had sent it alone
(its own suppression, its own suppressed-rest row), and the set operation,
its ORDER BY (output column names or positions) and its LIMIT/OFFSET
(constants) only combine the released rows, as the client could on the
answers of the branches. A set operation with a branch reading rows stays a
plain statement, which the analysis refuses as before.

This module knows the shape only; :mod:`anonproxy.plan.outer` replaces each
branch by a read of its released rows.
"""

from __future__ import annotations

from sqlglot import exp

from anonproxy.plan.refusals import unsupported
from anonproxy.plan.tables import identifier

HINT = ("A UNION, INTERSECT or EXCEPT over protected tables combines aggregate queries, each one the proxy answers "
        "alone, and may order (by output column names or positions) and limit the result: SELECT sex, count(*) "
        "FROM adult GROUP BY sex UNION ALL SELECT 'Total', count(*) FROM adult ORDER BY 1.")
_ALLOWED = frozenset({"this", "expression", "distinct", "order", "limit", "offset"})
_COUNT_NODES = (exp.Limit, exp.Offset, exp.Fetch, exp.LimitOptions)  # a count clause's own nodes, around its number


def selects(node: exp.Expression) -> list[exp.Expression]:
    """The branches of a set operation, in order, parentheses looked through: SELECTs, or whatever else stands
    there (VALUES), for the caller to refuse."""
    if isinstance(node, exp.Subquery) and not node.args.get("alias"):
        return selects(node.this)
    if isinstance(node, exp.SetOperation):
        return selects(node.this) + selects(node.expression)
    return [node]


def operations(node: exp.Expression) -> list[exp.SetOperation]:
    """The set operations of ``node`` (itself, and those nested in its parenthesised branches)."""
    if isinstance(node, exp.Subquery) and not node.args.get("alias"):
        return operations(node.this)
    if isinstance(node, exp.SetOperation):
        return [node, *operations(node.this), *operations(node.expression)]
    return []


def _parentheses(node: exp.Expression) -> list[exp.Subquery]:
    """The parentheses :func:`selects` looks through, at every depth of ``node``."""
    if isinstance(node, exp.Subquery) and not node.args.get("alias"):
        return [node, *_parentheses(node.this)]
    if isinstance(node, exp.SetOperation):
        return _parentheses(node.this) + _parentheses(node.expression)
    return []


def check(node: exp.SetOperation, names: tuple[str, ...]) -> None:
    """The set operations of ``node`` use only what post-processes released rows: the operators, ORDER BY over
    the output columns (``names``, or positions), and constant LIMIT, OFFSET and FETCH FIRST counts; and no clause
    stands on the parentheses around a branch."""
    for parenthesis in _parentheses(node):
        # ((SELECT ...) ORDER BY ... LIMIT ...): clauses on the parentheses, outside the branch the gate answers
        extra = {key for key, value in parenthesis.args.items() if value not in (None, False, [], "")} - {"this"}
        if extra:
            raise unsupported(f"{', '.join(sorted(extra)).upper()} after a parenthesised branch is not supported in a "
                              "set operation of aggregate queries: write it inside the branch's parentheses", HINT)
    for operation in operations(node):
        extra = {key for key, value in operation.args.items() if value not in (None, False, [], "")} - _ALLOWED
        if extra:
            raise unsupported(f"{', '.join(sorted(extra)).upper()} is not supported in a set operation of aggregate "
                              "queries", HINT)
        order = operation.args.get("order")
        for ordered in order.expressions if order is not None else []:
            _check_order(ordered.this, names)
        for key in ("limit", "offset"):
            clause = operation.args.get(key)
            if not constant_count(clause):
                what = "FETCH FIRST" if isinstance(clause, exp.Fetch) else key.upper()
                raise unsupported(f"{what} of a set operation of aggregate queries takes a constant", HINT)


def constant_count(clause: exp.Expression | None) -> bool:
    """Whether a LIMIT, OFFSET or FETCH FIRST clause (or none) holds nothing but a number written as a constant
    (FETCH FIRST ROWS ONLY: none). Over released rows, the count is evaluated in the statement that reads them,
    with the service role's reach: a subquery there (FETCH FIRST (SELECT count(*) FROM public.adult WHERE ...)
    ROWS ONLY) would read the table, the rows answered counting its people."""
    return clause is None or all(
        isinstance(node, _COUNT_NODES) or (isinstance(node, exp.Literal) and not node.is_string)
        for node in clause.walk())


def _check_order(node: exp.Expression, names: tuple[str, ...]) -> None:
    if isinstance(node, exp.Literal) and not node.is_string and node.name.isdigit():
        return  # a position: PostgreSQL checks its range
    if isinstance(node, exp.Column) and isinstance(node.this, exp.Identifier) and node.args.get("table") is None \
            and (identifier(node.this) or "") in names:
        return
    raise unsupported(f"ORDER BY {node.sql(dialect='postgres')} of a set operation of aggregate queries must name "
                      "an output column (or its position)", HINT)
