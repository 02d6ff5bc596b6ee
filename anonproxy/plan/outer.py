"""The two nested shapes that stay nested: post-processing of released rows, and Superset's series limit.

**Outer query over an aggregate query** (:class:`Outer`): Superset's
``SELECT COUNT(*) AS rowcount FROM (<aggregate query>) AS rowcount_qry``, or
``SELECT * FROM (<aggregate query>) q WHERE ... ORDER BY ... LIMIT ...``, or
a stack of such levels (Power BI's TOPN filters the aggregate's rows in one
derived table and orders and limits them in the next; Lightdash computes a
percent of total with a window in a WITH query over its metrics query). The
inner query is gated like any other; the levels above it only post-process
the rows it released, as if the client had computed them on its result set.
So each level may read nothing but the output columns of the level below
(its ``*`` is those), and its expressions pass the allowlist of expressions
over aggregates (:class:`Checker` with ``released``: arithmetic, casts,
CASE, window functions over the rows): no subqueries, no joins, no functions
outside the allowlist. They need no no-error proof: an error there depends on
released values only. A division divides by ``NULLIF(divisor, 0)``, so a
released zero gives NULL. The rows the levels see are exactly the inner
query's answer, including the suppressed rest row when the role reports one:
``COUNT(*)`` counts the rows the client would have received, never the groups
withheld.

A set operation of aggregate queries (:mod:`anonproxy.plan.set_operations`),
alone or as a derived table of such a level, is an :class:`Outer` too: each
branch is read from its released rows (a WITH query with positional column
names, ``anonproxy_c1``...), and ``combines`` says so.

**Series limit** (:class:`Series`): Superset limits a chart to the top N
groups with ``... FROM t JOIN (SELECT k AS k__, <metric> FROM t GROUP BY k
ORDER BY <metric> DESC LIMIT N) AS series_limit ON t.k = series_limit.k__
GROUP BY ...``; Tableau's top-N filter joins the same way with ``ON (t.k IS
NOT DISTINCT FROM t0.k)``. That is two questions: the top-N aggregate
(gated, released groups only), then the outer query restricted to the keys
it released (:meth:`Series.question` builds ``key IN (<released values>)``
from the values, as constants, with ``OR key IS NULL`` when an IS NOT
DISTINCT FROM key released NULL). The joined aggregate may be read only
through the ON condition, which must be equalities (``=`` or IS NOT DISTINCT
FROM) between outer expressions and its output columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from sqlglot import exp

from anonproxy.plan import distinct_pairs, render, set_operations, spines
from anonproxy.plan.expressions import Checker, Scope, unparen
from anonproxy.plan.flatten import SAMPLE_MESSAGE, is_aggregate, over_released
from anonproxy.plan.joins import conjuncts
from anonproxy.plan.names import output_name, own_nodes, reference, sources
from anonproxy.plan.refusals import unsupported
from anonproxy.plan.tables import ResolvedTable, identifier
from anonproxy.policy.model import SuppressionParams

OUTER_HINT = ("An outer query over an aggregate query may select, filter (WHERE), group, order and limit the "
              "inner query's output columns: SELECT count(*) FROM (SELECT k, count(*) AS n FROM t GROUP BY k) AS q.")
SERIES_HINT = ("Superset's series limit: JOIN (SELECT k AS k__, <aggregate> FROM t GROUP BY k ORDER BY ... LIMIT n) "
               "AS series_limit ON t.k = series_limit.k__ (or t.k IS NOT DISTINCT FROM series_limit.k__), read "
               "only in ON.")
# TABLESAMPLE on released rows would drop some at random: PostgreSQL refuses it there, so does the proxy.
SAMPLE_HINT = ("Read all the aggregate query's released rows, or keep some with ORDER BY ... LIMIT n in the outer "
               "query: SELECT * FROM (SELECT k, count(*) AS n FROM t GROUP BY k) AS q ORDER BY n DESC LIMIT 10.")
_OUTER_ARGS = frozenset({"expressions", "from_", "joins", "where", "group", "having", "order", "limit", "offset",
                         "distinct"})
ROWS = "anonproxy_released"  # the name the outer query's FROM gives the released rows
_Row = TypeVar("_Row")  # a row of the released answer, whatever its values' form


@dataclass(frozen=True)
class Released:
    """A further aggregate query whose released rows the outer query reads, as the WITH query ``name``."""

    inner: exp.Select
    names: tuple[str, ...]  # its output column names
    name: str  # anonproxy_released_2, ...


@dataclass(frozen=True)
class Outer:
    """An outer query over the released rows of ``inner`` (an aggregate SELECT), and of ``more`` when it joins
    several aggregate queries' answers (MetricFlow)."""

    inner: exp.Select
    # Where it read ``inner``, it reads the table named ROWS (and each of ``more`` by its name); a set operation
    # when the client's statement is one (anonproxy.plan.set_operations).
    outer: exp.Select | exp.SetOperation
    names: tuple[str, ...]  # the inner query's output column names
    more: tuple[Released, ...] = ()  # each asked on its own, after ``inner``
    combines: bool = False  # whether a set operation combines some of the aggregate queries' rows

    def sql(self) -> str:
        """The outer query, reading the released rows from a WITH query named ROWS that the back-end defines."""
        return render.sql(self.outer)


@dataclass(frozen=True)
class Series:
    """Superset's series limit: first ``top``, then ``rest`` restricted to the keys ``top`` released."""

    top: exp.Select
    rest: exp.Select
    keys: tuple[tuple[exp.Expression, int], ...]  # an outer expression, and the top query's column it must equal
    names: tuple[str, ...]  # the top query's output column names
    shown: tuple[int | None, ...] = ()  # per key: the outer query's output column that shows it, if one does
    null_safe: tuple[bool, ...] = ()  # per key: joined with IS NOT DISTINCT FROM (a released NULL matches NULL)

    def released(self, row: tuple[str | None, ...], keys: set[tuple[str | None, ...]]) -> bool:
        """Whether a row of the second answer shows released keys (a back-end that lists a declared domain's every
        value, released or not, filters its rows with this; keys compare as the text PostgreSQL prints)."""
        shown = [(position, index) for index, position in enumerate(self.shown) if position is not None]
        return not shown or any(all(row[position] == key[index] for position, index in shown) for key in keys)

    def is_null_safe(self, index: int) -> bool:
        return index < len(self.null_safe) and self.null_safe[index]

    def restriction(self, released: list[tuple[str | None, ...]]) -> exp.Expr:
        """``key IN (values)`` (``(k1 = a AND k2 = b) OR ...`` for several keys) over the released key values,
        written as string constants (PostgreSQL gives them the key's type); a released NULL matches ``key IS
        NULL`` for a key joined with IS NOT DISTINCT FROM, and nothing for one joined with ``=``, as in the join;
        FALSE when nothing was released."""
        rows = [row for row in released
                if all(value is not None or self.is_null_safe(i) for i, value in enumerate(row))]
        if not rows:
            return exp.false()
        if len(self.keys) == 1:
            expression = self.keys[0][0]
            values = [row[0] for row in rows if row[0] is not None]
            found: list[exp.Expression] = []
            if values:
                found.append(exp.In(this=exp.paren(expression.copy(), copy=False),
                                    expressions=[exp.Literal.string(value) for value in values]))
            if len(values) < len(rows):
                found.append(_is_null(expression))
            return found[0] if len(found) == 1 else exp.or_(*found, copy=False)
        disjuncts = [exp.and_(*(_is_null(key) if value is None else
                                exp.EQ(this=exp.paren(key.copy(), copy=False), expression=exp.Literal.string(value))
                                for (key, _), value in zip(self.keys, row, strict=True)), copy=False)
                     for row in rows]
        return exp.or_(*(exp.paren(d, copy=False) for d in disjuncts), copy=False)

    def conditions(self) -> tuple[exp.Expression, ...]:
        """``(key) IS NULL`` for every ON key: what the outer query's analysis checks as WHERE conditions, which is
        what the keys are in the restriction. (Copies without positions: these index into the client's text, not
        into the rendered outer query's.)"""
        found = []
        for key, _ in self.keys:
            condition = _is_null(key)
            for node in condition.walk():
                node.meta.pop("start", None)
                node.meta.pop("end", None)
            found.append(condition)
        return tuple(found)

    def page(self, rows: tuple[_Row, ...]) -> tuple[_Row, ...]:
        """The outer query's OFFSET and LIMIT over the rows of :meth:`question` kept by :meth:`released` (in the
        question's ORDER BY), when the question left them out."""
        page = self._page()
        if page is None:
            return rows
        limit, offset = page
        return rows[offset:] if limit is None else rows[offset:offset + limit]

    def _page(self) -> tuple[int | None, int] | None:
        """The outer query's LIMIT (None: none) and OFFSET when both are absent or integer constants; None when
        one is anything else (left in the question, for the back-end to take or refuse)."""
        limit, offset = self.rest.args.get("limit"), self.rest.args.get("offset")
        count = _count(limit.expression) if isinstance(limit, exp.Limit) else None if limit is None else -1
        skip = _count(offset.expression) if isinstance(offset, exp.Offset) else 0 if offset is None else -1
        if count == -1 or skip is None or skip == -1:
            return None
        return count, skip

    def key_values(self, row: tuple[str | None, ...]) -> tuple[str | None, ...]:
        return tuple(row[position] for _, position in self.keys)

    def question(self, restriction: exp.Expr) -> exp.Select:
        """The outer query with ``restriction`` added to its WHERE clause, and without its LIMIT and OFFSET when
        :meth:`page` applies them instead (after :meth:`released`: a back-end that lists a declared domain's every
        value must not let unreleased keys take the places the LIMIT counts)."""
        rest = self.rest.copy()
        if self._page() is not None:
            rest.set("limit", None)
            rest.set("offset", None)
        where = rest.args.get("where")
        condition = restriction if where is None else exp.and_(exp.paren(where.this, copy=False),
                                                               exp.paren(restriction, copy=False), copy=False)
        rest.set("where", exp.Where(this=condition))
        return rest


def _count(node: exp.Expression | None) -> int | None:
    """A LIMIT or OFFSET count: a non-negative integer constant; None for none (LIMIT ALL, NULL); -1 otherwise."""
    if node is None or isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Literal) and not node.is_string and node.name.isdigit():
        return int(node.name)
    return -1


def _is_null(key: exp.Expression) -> exp.Expression:
    return exp.Is(this=exp.paren(key.copy(), copy=False), expression=exp.Null())


def nested_aggregate(select: exp.Select) -> int | None:
    """The position among FROM and JOIN items of the derived table ``select`` reads that is an aggregate query or
    reads one's released rows (:func:`anonproxy.plan.flatten.over_released`), if any."""
    found = [i for i, item in enumerate(sources(select))
             if isinstance(item, exp.Subquery) and isinstance(item.this, exp.Select)
             and (is_aggregate(item.this) or over_released(item.this))
             and (i == 0 or distinct_pairs.body(item) is None)]  # a linked table's distinct rows: a joined table
    if len(found) > 1:
        raise unsupported("a query over protected tables may nest one aggregate query", OUTER_HINT)
    return found[0] if found else None


def inner_names(inner: exp.Select, source: str) -> tuple[str, ...]:
    return tuple(output_name(item, source) or "?column?" for item in inner.expressions)


def outer(select: exp.Select | exp.SetOperation, source: str) -> Outer:
    """``select`` reads only released rows (:func:`anonproxy.plan.flatten.over_released`): aggregate derived
    tables, or derived tables over them, stacked and joined at any depth; each level post-processes the rows of
    the levels below it. Or ``select`` is a set operation of such queries and aggregate queries
    (:func:`anonproxy.plan.flatten.released`). Each distinct aggregate query is one question (one read twice is
    asked once)."""
    rewritten = select.copy()
    found: list[tuple[exp.Select, tuple[str, ...], str]] = []
    if isinstance(rewritten, exp.SetOperation):
        _combine(rewritten, source, found)
    else:
        _level(rewritten, source, found)
    for division in list(rewritten.find_all(exp.Div, exp.Mod)):
        divisor = division.expression
        division.set("expression", exp.Nullif(this=divisor.copy(), expression=exp.Literal.number(0)))
    (inner, names, _), *more = found
    return Outer(inner=inner, outer=rewritten, names=names,
                 more=tuple(Released(body, columns, name) for body, columns, name in more),
                 combines=rewritten.find(exp.SetOperation) is not None)


def _combine(operation: exp.SetOperation, source: str, found: list[tuple[exp.Select, tuple[str, ...], str]],
             ) -> tuple[str, ...]:
    """Replace each branch of a set operation by a read of its released rows (``found`` collects the aggregate
    queries); its output column names (its first branch's)."""
    names: tuple[str, ...] | None = None
    for branch in set_operations.selects(operation):
        if not isinstance(branch, exp.Select):
            raise unsupported("VALUES is not supported in a set operation of aggregate queries", set_operations.HINT)
        if over_released(branch):
            columns = _level(branch, source, found)
        else:
            columns = inner_names(branch, source)
            name = _register(branch, _positions(len(columns)), found)
            branch.replace(_read(name, columns, [_untyped(item) for item in branch.expressions]))
        if names is not None and len(columns) != len(names):
            raise unsupported("each branch of a set operation must have as many columns as the first",
                              set_operations.HINT)
        names = names or columns
    assert names is not None
    set_operations.check(operation, names)
    return names


def _positions(count: int) -> tuple[str, ...]:
    """The column names of a branch's released rows (positions: a branch's own names may repeat)."""
    return tuple(f"anonproxy_c{i}" for i in range(1, count + 1))


def _read(name: str, names: tuple[str, ...], constants: list[exp.Expression | None]) -> exp.Select:
    """``SELECT anonproxy_c1 AS "<name 1>", ... FROM "<name>"``: a branch's released rows, under its names; an
    untyped constant is written again in place of its column (see :func:`_untyped`)."""
    return exp.Select(
        expressions=[exp.Alias(this=constant or exp.column(column), alias=exp.Identifier(this=alias, quoted=True))
                     for column, alias, constant in zip(_positions(len(names)), names, constants, strict=True)],
        from_=exp.From(this=exp.Table(this=exp.Identifier(this=name, quoted=True))))


def _untyped(item: exp.Expression) -> exp.Expression | None:
    """A copy of a select item that is a string constant or NULL. PostgreSQL types such a constant from the other
    branches of the set operation (NULL beside an integer column is an integer), but a WITH query's column has
    a type of its own (text): the branch's released rows hold the constant in every row (the suppressed-rest row
    too), so it is read from the statement, not from them, and the result's types are the client's statement's."""
    core = item.this if isinstance(item, exp.Alias) else item
    if isinstance(core, exp.Null) or (isinstance(core, exp.Literal) and core.is_string):
        return core.copy()
    return None


def _register(body: exp.Select, names: tuple[str, ...], found: list[tuple[exp.Select, tuple[str, ...], str]],
              ) -> str:
    """The name of the WITH query of ``body``'s released rows, its columns named ``names`` (one asked twice is
    asked once)."""
    text = render.sql(body)
    known = next((name for other, columns, name in found if columns == names and render.sql(other) == text), None)
    if known is not None:
        return known
    name = ROWS if not found else f"{ROWS}_{len(found) + 1}"
    found.append((body, names, name))
    return name


def _level(select: exp.Select, source: str, found: list[tuple[exp.Select, tuple[str, ...], str]],
           ) -> tuple[str, ...]:
    """Check one level over released rows, replace the aggregate queries it reads by the tables of their released
    rows (``found`` collects them); its output column names."""
    references: dict[str | None, tuple[str, ...]] = {}
    for item in sources(select):
        if spines.is_spine(item):  # constants beside the released rows
            name = spines.reference(item)
            if name in references:
                raise unsupported(f"derived table name {name} appears twice in FROM",
                                  "Give each derived table its own alias.")
            references[name] = spines.columns(item, source)
            continue
        if not isinstance(item, exp.Subquery) or not isinstance(item.this, (exp.Select, exp.SetOperation)):
            raise unsupported("an outer query over an aggregate query may read only aggregate queries and derived "
                              "tables over them", OUTER_HINT)
        if item.args.get("sample") is not None:
            raise unsupported(SAMPLE_MESSAGE, SAMPLE_HINT)
        alias, body = reference(item), item.this
        if alias in references:
            raise unsupported(f"derived table name {alias or '(none)'} appears twice in FROM",
                              "Give each derived table its own alias.")
        if isinstance(body, exp.SetOperation):
            references[alias] = _columns(item, _combine(body, source, found))
            continue
        if over_released(body):
            references[alias] = _columns(item, _level(body, source, found))
            continue
        names = _columns(item, inner_names(body, source))
        name = _register(body, names, found)
        label = item.args.get("alias")
        item.replace(exp.Table(this=exp.Identifier(this=name, quoted=True),
                               alias=exp.TableAlias(this=label.this.copy()) if label is not None and label.this
                               else None))
        references[alias] = names
    _check_level(select, references, source)
    return _level_names(select, references, source)


def _columns(item: exp.Expression, names: tuple[str, ...]) -> tuple[str, ...]:
    """The column names of derived table ``item`` whose select list gives ``names``: its alias's column list
    renames the first ones."""
    columns = item.args["alias"].args.get("columns") if item.args.get("alias") is not None else None
    if not columns:
        return names
    if len(columns) > len(names):
        raise unsupported("the derived table's column list names more columns than it has", OUTER_HINT)
    return tuple(identifier(column) or "" for column in columns) + names[len(columns):]


def _level_names(level: exp.Select, references: dict[str | None, tuple[str, ...]],
                 source: str) -> tuple[str, ...]:
    """The output column names of a level over released rows (``*`` is all the columns it reads, ``t.*``
    those of ``t``)."""
    names: list[str] = []
    for item in level.expressions:
        core = item.this if isinstance(item, exp.Alias) else item
        if isinstance(core, exp.Star):
            names.extend(name for columns in references.values() for name in columns)
        elif isinstance(core, exp.Column) and isinstance(core.this, exp.Star):
            names.extend(references.get(identifier(core.args.get("table")), ()))
        else:
            names.append(output_name(item, source) or "?column?")
    return tuple(names)


def _check_level(select: exp.Select, references: dict[str | None, tuple[str, ...]], source: str) -> None:
    extra = {key for key, value in select.args.items() if value not in (None, False, [], "")} - _OUTER_ARGS
    if extra:
        raise unsupported(f"{', '.join(sorted(extra)).upper()} is not supported in an outer query over an aggregate "
                          "query", OUTER_HINT)
    for join in select.args.get("joins") or []:
        if join.args.get("using") or join.args.get("method"):
            raise unsupported("a join of aggregate queries' rows takes ON (not USING or NATURAL)", OUTER_HINT)
    _check_outer(select, references, source)


def _check_outer(select: exp.Select, references: dict[str | None, tuple[str, ...]], source: str) -> None:
    """The outer query reads only the columns of the released rows it reads (``references``: their names by
    alias), with allowlisted expressions."""
    outputs = {output_name(item, source) for item in select.expressions}
    clauses = [value for key, value in select.args.items() if key not in ("from_", "joins")]
    clauses += [join.args.get("on") for join in select.args.get("joins") or []]
    if any(isinstance(node, exp.Expression) and node.find(exp.Select, exp.Subquery, exp.SetOperation) is not None
           for value in clauses for node in (value if isinstance(value, list) else [value])):
        raise unsupported("subqueries are not allowed in an outer query over an aggregate query", OUTER_HINT)
    everything = [name for names in references.values() for name in names]
    for node in own_nodes(select):
        if isinstance(node, (exp.Parameter, exp.Placeholder)):
            raise unsupported("$n parameters are not allowed in an outer query over an aggregate query",
                              "Write the values as constants, or use parameters in the inner query.")
        if not isinstance(node, exp.Column) or not isinstance(node.this, exp.Identifier):
            continue
        table, name = identifier(node.args.get("table")), identifier(node.this) or ""
        if node.args.get("db") is not None or (table is not None and table not in references):
            raise unsupported(f"{node.sql(dialect='postgres')} is not a column of the aggregate query the outer "
                              "query reads", OUTER_HINT)
        names = references[table] if table is not None else tuple(everything)
        if names.count(name) != 1 and not (table is None and name in outputs and _in_order_by(node, select)):
            what = "is ambiguous in" if names.count(name) > 1 else "is not an output column of"
            raise unsupported(f"column {name} {what} the aggregate query the outer query reads", OUTER_HINT)
    # The released rows hold no identifying column that matters here: every value in them was released.
    scope = Scope(references={alias or ROWS: ResolvedTable("", alias or ROWS, "plain", columns=frozenset(names))
                              for alias, names in references.items()})  # "source"."count": a column
    checker = Checker(scope, SuppressionParams(k=1, allow_min_max=True), "the released rows", released=True)
    for join in select.args.get("joins") or []:
        if join.args.get("on") is not None:
            _arithmetic(join.args["on"], lambda node: checker.row(node, "JOIN ... ON"))
    for item in select.expressions:
        core = item.this if isinstance(item, exp.Alias) else item
        if isinstance(core, exp.Star) or (isinstance(core, exp.Column) and isinstance(core.this, exp.Star)):
            continue  # the inner query's columns, all released
        _arithmetic(core, lambda node: checker.grouped(node, "the outer select list"))
    where = select.args.get("where")
    if where is not None:
        _arithmetic(where.this, lambda node: checker.row(node, "WHERE"))
    group = select.args.get("group")
    if group is not None:
        if {k for k, v in group.args.items() if v} != {"expressions"}:
            raise unsupported("ROLLUP, CUBE and GROUPING SETS are not supported in an outer query", OUTER_HINT)
        for key in group.expressions:
            checker.key(key, "GROUP BY")
    having = select.args.get("having")
    if having is not None:
        checker.grouped(having.this, "HAVING")
    order = select.args.get("order")
    for ordered in order.expressions if order is not None else []:
        checker.grouped(ordered.this, "ORDER BY")
    for key in ("limit", "offset"):
        clause = select.args.get(key)
        if not set_operations.constant_count(clause):
            what = "FETCH FIRST" if isinstance(clause, exp.Fetch) else key.upper()
            raise unsupported(f"{what} of an outer query takes a constant", OUTER_HINT)


def _in_order_by(node: exp.Expr, select: exp.Select) -> bool:
    """Whether ``node`` stands in the ORDER BY clause of ``select`` (where a bare name means an output column)."""
    while node.parent is not None and node.parent is not select:
        node = node.parent
    return node.arg_key == "order"


_ARITHMETIC = (exp.Add, exp.Sub, exp.Mul, exp.Div, exp.Mod)


def _arithmetic(node: exp.Expression, check: Callable[[exp.Expression], None]) -> None:
    """Arithmetic on released values is allowed (its errors depend on released values only, and a division's
    divisor is wrapped in NULLIF): check its operands, and anything else with ``check``."""
    inner = unparen(node)
    if isinstance(inner, _ARITHMETIC):
        _arithmetic(inner.this, check)
        _arithmetic(inner.expression, check)
    elif isinstance(inner, exp.Neg):
        _arithmetic(inner.this, check)
    else:
        check(node)


def series(select: exp.Select, position: int, source: str) -> Series:
    """``select`` joins its tables to a top-N aggregate derived table (at ``position``) to restrict its groups."""
    join = select.args["joins"][position - 1]
    item = join.this
    alias = reference(item)
    top = item.this
    names = inner_names(top, source)
    if join.args.get("side") or join.args.get("kind") not in (None, "", "INNER") or join.args.get("using") \
            or join.args.get("method") or join.args.get("on") is None:
        raise unsupported("a joined aggregate query must be joined with [INNER] JOIN ... ON", SERIES_HINT)
    keys, null_safe = [], []
    for condition in conjuncts(join.args["on"]):
        if not isinstance(condition, (exp.EQ, exp.NullSafeEQ)):
            raise unsupported("the ON condition of a joined aggregate query must be equalities (= or IS NOT "
                              "DISTINCT FROM) with its columns", SERIES_HINT)
        null_safe.append(isinstance(condition, exp.NullSafeEQ))
        sides = [unparen(condition.this), unparen(condition.expression)]
        mine = [side for side in sides if _reads(side, alias, names)]
        if len(mine) != 1 or not isinstance(mine[0], exp.Column):
            raise unsupported("each ON equality of a joined aggregate query must compare one of its columns "
                              "with an expression of the other tables", SERIES_HINT)
        other = sides[1] if mine[0] is sides[0] else sides[0]
        name = identifier(mine[0].this) or ""
        if names.count(name) != 1:
            raise unsupported(f"column {name} is not an output column of the joined aggregate query", SERIES_HINT)
        keys.append((other.copy(), names.index(name)))
    rest = select.copy()
    joins = rest.args["joins"]
    del joins[position - 1]
    rest.set("joins", joins or None)
    for node in own_nodes(rest):
        if isinstance(node, exp.Column) and _reads(node, alias, names):
            raise unsupported("a joined aggregate query may be read only in its ON condition", SERIES_HINT)
    shown = tuple(_shown(rest, key) for key, _ in keys)
    return Series(top=top, rest=rest, keys=tuple(keys), names=names, shown=shown, null_safe=tuple(null_safe))


def _shown(select: exp.Select, key: exp.Expression) -> int | None:
    """The position of the select item that is ``key`` itself (parentheses, spelling and case aside)."""
    wanted = _canonical(key)
    for position, item in enumerate(select.expressions):
        if _canonical(item.this if isinstance(item, exp.Alias) else item) == wanted:
            return position
    return None


def _canonical(node: exp.Expression) -> exp.Expression:
    node = unparen(node).copy()
    for ident in node.find_all(exp.Identifier):
        ident.set("this", identifier(ident))
        ident.set("quoted", True)
    return node


def _reads(node: exp.Expression, alias: str | None, names: tuple[str, ...]) -> bool:
    """Whether ``node`` reads the joined aggregate query: ``alias.column``, or a bare name of one of its columns
    (Superset writes ``ON education = education__``)."""
    for column in node.find_all(exp.Column):
        table = column.args.get("table")
        if identifier(table) == alias if table is not None else identifier(column.this) in names:
            return True
    return False
