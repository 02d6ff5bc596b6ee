"""Column discovery: a query over protected tables that returns no row, whatever the data, answered with its columns.

BI tools and drivers learn a query's columns by running it so that it returns no row: ``SELECT * FROM t WHERE
1 = 0`` (Tableau), ``... LIMIT 0``, dbt's ``select * from (<query>) as __dbt_sbq where false limit 0``. Read from
the statement's tree (never its text), the outermost query returns no row when it has

* a LIMIT (or FETCH FIRST) of the constant 0;
* a HAVING that is constant false or NULL;
* a WHERE that is constant false or NULL, in a query that is not one group whatever its input (an aggregate
  without GROUP BY, GROUP BY () or ROLLUP / CUBE / GROUPING SETS answer one row for no input rows; a function
  this module cannot name might be an aggregate).

"Constant" is folded here from boolean, NULL and number literals, NOT, AND, OR and comparisons of numbers, nothing
else. Such a statement is answered by running, on the service connection, ``SELECT * FROM (<the statement>) AS
anonproxy_discovery WHERE false``, rendered from the tree with every table qualified (and without the statement's
own constant WHERE, which the wrapper's stands for). PostgreSQL's planner makes a relation under a constant-false
condition a dummy: the plan is one Result stopped by the constant, with no scan and no node below it
(tests/test_discovery.py checks with EXPLAIN). So PostgreSQL describes the columns, with the names and types it
gives the statement itself, and returns no row, evaluating nothing that depends on the data.

The statement must still pass the final check (:mod:`anonproxy.plan.final_sql`): it names only the policy's
tables, with the functions, operators, casts and constructs of its allowlist (so no division by a column, which
could fail on a value); random(), the one volatile function there, is left out too. A statement with ``$n``
parameters is not a discovery here (``LIMIT $1`` bound to 0 included): it takes the ordinary path.

Not a discovery: the statement goes on to the ordinary decision, which answers or refuses it as before.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

from sqlglot import exp
from sqlglot.tokenizer_core import TokenType

from anonproxy.plan.final_sql import FinalCheckRefusal, check_final_sql
from anonproxy.plan.flatten import is_zero
from anonproxy.plan.names import drop_database, output_name, own_nodes
from anonproxy.plan.render import sql as render
from anonproxy.plan.shape import named
from anonproxy.plan.statements import Statement
from anonproxy.plan.tables import PolicyIndex, identifier
from anonproxy.route.decision import Rewrite

ALIAS = "anonproxy_discovery"
_COMPARISONS: dict[type[exp.Expression], Callable[[Decimal, Decimal], bool]] = {
    exp.EQ: operator.eq, exp.NEQ: operator.ne, exp.LT: operator.lt, exp.LTE: operator.le, exp.GT: operator.gt,
    exp.GTE: operator.ge}


def discovery(statement: Statement, tree: exp.Expression, index: PolicyIndex) -> Rewrite | None:
    """The answer to ``statement`` (parsed as ``tree``, which is not changed) when it is a column discovery: its
    columns and no row; None when it is not one."""
    if any(token.token_type == TokenType.PARAMETER for token in statement.tokens):
        return None
    if not returns_no_row(tree) or any(isinstance(node, exp.Rand) for node in tree.walk()):
        return None
    query = tree.copy()
    drop_database(query, index.policy.database)
    _qualify(query, index)
    where = query.args.get("where")
    if where is not None and _false_or_null(where.this):
        # The wrapper's WHERE false stands for it: pulled up beside it, "false AND false" is a filter PostgreSQL
        # puts above a scan, where a single false makes the relation a dummy with no scan at all.
        query.set("where", None)
    if isinstance(query, exp.Select):  # the names PostgreSQL gives the client's spelling, kept by the rendering
        named(query, [output_name(item, statement.source) for item in query.expressions], statement)
    sql = f"SELECT * FROM ({render(query)}) AS {ALIAS} WHERE false"
    try:
        relations = check_final_sql(sql, index.policy)
    except FinalCheckRefusal:
        return None
    return Rewrite(sql, relations=relations, discovery=True)


def returns_no_row(tree: exp.Expression) -> bool:
    """Whether the outermost query of ``tree`` returns no row, whatever the data, by its structure."""
    if isinstance(tree, (exp.Select, exp.SetOperation)) and _limit_zero(tree.args.get("limit")):
        return True
    if not isinstance(tree, exp.Select):
        return False
    having = tree.args.get("having")
    if having is not None and _false_or_null(having.this):
        return True
    where = tree.args.get("where")
    return where is not None and _false_or_null(where.this) and not _one_group(tree)


def _limit_zero(limit: exp.Expression | None) -> bool:
    """LIMIT 0 or FETCH FIRST 0 ROWS, as PostgreSQL reads the constant (a NULL limit is no limit)."""
    if isinstance(limit, exp.Limit):
        count = limit.expression
    elif isinstance(limit, exp.Fetch):
        count = limit.args.get("count")
    else:
        return False
    while isinstance(count, exp.Paren):
        count = count.this
    return count is not None and is_zero(count)


_UNKNOWN = object()  # not a constant


def _false_or_null(node: exp.Expression) -> bool:
    """Whether the condition is constant and false or NULL: it lets no row through."""
    value = _fold(node)
    return value is False or value is None


def _fold(node: exp.Expression) -> object:
    """A condition folded as PostgreSQL evaluates it (three-valued), or _UNKNOWN when it is not a constant here."""
    if isinstance(node, exp.Paren):
        return _fold(node.this)
    if isinstance(node, exp.Boolean):
        return bool(node.this)
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Not):
        inner = _fold(node.this)
        return inner if inner is _UNKNOWN or inner is None else not inner
    if isinstance(node, (exp.And, exp.Or)):
        return _connective(node)
    compare = _COMPARISONS.get(type(node))
    if compare is not None:
        left, right = _number(node.this), _number(node.expression)
        if left is None or right is None:
            return _UNKNOWN
        return compare(left, right)
    return _UNKNOWN


def _connective(node: exp.And | exp.Or) -> object:
    """AND / OR of two folded operands, three-valued: an unknown operand decides nothing unless the other one does
    (false AND x is false, true OR x is true)."""
    left, right = _fold(node.this), _fold(node.expression)
    decisive = isinstance(node, exp.Or)  # the value that decides the connective alone
    if left is decisive or right is decisive:
        return decisive
    if left is _UNKNOWN or right is _UNKNOWN:
        return _UNKNOWN
    return None if left is None or right is None else not decisive


def _number(node: exp.Expression) -> Decimal | None:
    """A number literal, possibly negated or parenthesized; None otherwise. Exact, as PostgreSQL's numeric: a
    negation flips the sign only (``-1 * x`` would round x to 28 digits, and ``-1.00000000000000000000000000000001
    < -1`` would fold to false)."""
    negated = False
    while isinstance(node, (exp.Paren, exp.Neg)):
        negated ^= isinstance(node, exp.Neg)
        node = node.this
    if not isinstance(node, exp.Literal) or node.is_string:
        return None
    try:
        number = Decimal(node.this)
    except InvalidOperation:
        return None
    return number.copy_negate() if negated else number


def _one_group(select: exp.Select) -> bool:
    """Whether ``select`` may answer one row for no input rows: one group of all rows (an aggregate or HAVING
    without GROUP BY), an empty grouping set, or a function that might be an aggregate."""
    group = select.args.get("group")
    if group is not None:
        return any(group.args.get(kind) for kind in ("grouping_sets", "cube", "rollup")) or not group.expressions \
            or any(isinstance(item, (exp.Rollup, exp.Cube, exp.GroupingSets))
                   or (isinstance(item, exp.Tuple) and not item.expressions) for item in group.expressions)
    if select.args.get("having") is not None:
        return True
    return any(_maybe_aggregate(node) for node in own_nodes(select))


def _maybe_aggregate(node: exp.Expression) -> bool:
    if isinstance(node, exp.Anonymous):
        return True  # a function sqlglot does not know: a user-defined aggregate, perhaps
    if not isinstance(node, exp.AggFunc):
        return False
    parent = node.parent.parent if isinstance(node.parent, exp.Filter) else node.parent
    return not isinstance(parent, exp.Window)  # a window function's aggregate groups nothing


def _qualify(query: exp.Expression, index: PolicyIndex) -> None:
    """Qualify every table name with its schema, as the policy resolves it (the final check reads only qualified
    names). A name some CTE of the statement carries is left alone: the final check accepts it only where that CTE
    is in scope."""
    ctes = {identifier(cte.args["alias"].this) for cte in query.find_all(exp.CTE)
            if isinstance(cte.args.get("alias"), exp.TableAlias)}
    for table in query.find_all(exp.Table):
        if table.args.get("db") is not None or not isinstance(table.this, exp.Identifier):
            continue
        if identifier(table.this) in ctes:
            continue
        table.set("db", exp.Identifier(this=index.resolve(table).schema, quoted=True))
