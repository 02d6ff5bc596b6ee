"""Take an analytic SELECT over a protected table apart into the pieces the suppression rewrite needs.

The parse tree (sqlglot) decides what is allowed; the rewritten SQL is built
from the client's *original text* of each piece (select items, WHERE, GROUP BY
items, HAVING, ORDER BY items, LIMIT/OFFSET), cut at top-level token
boundaries. Every cut piece is parsed again and compared with the tree, so a
mistake in cutting is a refusal, never a different query. Keeping the client's
text means output column names and types, ``$n`` parameters, ``::`` casts and
function spellings are exactly what the client sent; only table names are
replaced, by their schema-qualified form. The one exception: post-aggregate
expressions (``round(avg(x), 1)``, ``sum(x) / count(*)``, a HAVING over them)
are compiled from the tree into SQL over the released values
(:mod:`anonproxy.rewrite.post_aggregate`, ``AnalyticQuery.outer``), with
PostgreSQL's column names, because every division gets a ``NULLIF``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError
from sqlglot.tokens import TokenType

from anonproxy.policy.model import SuppressionParams
from anonproxy.rewrite.decision import forbidden, unsupported
from anonproxy.rewrite.expressions import (
    Checker,
    Scope,
    contains_aggregate,
    has_post_aggregate,
    unwrap,
)
from anonproxy.rewrite.joins import REFERENCE_HINT, Source, check_joins
from anonproxy.rewrite.post_aggregate import Outer, compile_outer
from anonproxy.rewrite.names import PolicyIndex, ResolvedTable, fold, identifier, quote
from anonproxy.rewrite.relations import check_relations
from anonproxy.rewrite.statements import (
    PARSE_HINT,
    Statement,
    closing_paren,
    depth_zero,
    split_commas,
    token_at,
)

SHAPE_HINT = (
    "Supported over protected tables: SELECT <grouping expressions and aggregates> FROM <protected table> "
    "[[LEFT] JOIN <linked table> ON <linked>.<key> = <protected>.<unit> [AND ...]] [WHERE ...] [GROUP BY ...] "
    "[HAVING ...] [ORDER BY ...] [LIMIT ...] [OFFSET ...]."
)
ROW_LEVEL_HINT = "Aggregate instead: SELECT col, count(*), avg(x) FROM table GROUP BY col."

# "post": an expression over aggregates (or a post-aggregate function of constants), computed on released values.
ItemKind = Literal["aggregate", "group", "constant", "post"]
# A privacy unit contributes to count(x)/min/max when x is not null for one of its rows, to sum(x)/avg(x)
# when x is neither null nor zero: a cell needs k contributing units, not only k units in its group, or
# count(CASE WHEN id = 17 THEN 1 END) would single a person out.
Contribution = Literal["nonnull", "nonzero"]

_SELECT_ARGS = frozenset({"expressions", "from_", "joins", "where", "group", "having", "order", "limit", "offset",
                          "distinct"})
_SELECT_ARG_NAMES = {
    "with_": "WITH (common table expressions)", "into": "SELECT INTO", "locks": "FOR UPDATE/SHARE",
    "laterals": "LATERAL", "windows": "WINDOW", "sample": "TABLESAMPLE", "qualify": "QUALIFY",
}
_CLAUSES = (TokenType.FROM, TokenType.WHERE, TokenType.GROUP_BY, TokenType.HAVING, TokenType.ORDER_BY,
            TokenType.LIMIT, TokenType.OFFSET, TokenType.FETCH)
_TAIL = (TokenType.LIMIT, TokenType.OFFSET, TokenType.FETCH)
_ORDER_WORDS = {"ASC", "DESC"}


@dataclass(frozen=True)
class Item:
    text: str  # as written, alias included
    expression: str  # as written, without the alias
    kind: ItemKind
    alias: str | None
    aggregates: bool = False  # kind "post": whether it holds an aggregate (abs(0) does not)


@dataclass(frozen=True)
class OrderItem:
    text: str  # as written: expression [ASC|DESC] [NULLS FIRST|LAST]
    suffix: str  # the ASC/DESC/NULLS part as written ("" when absent)
    position: int | None  # 1-based select-list position when it names an output column


@dataclass(frozen=True)
class AggregateText:
    """One aggregate of the statement as written: ``count(*) FILTER (WHERE age > 40)``."""

    node: exp.Expression  # canonical: the aggregate, inside its exp.Filter when it has one
    text: str  # the whole call, FILTER included
    argument: str | None  # the argument as written (None: count(*)); DISTINCT left out
    filter: str | None  # the FILTER condition as written


@dataclass(frozen=True)
class AnalyticQuery:
    """An aggregate query over one protected table, as pieces of the client's own text."""

    table: str  # the protected table's policy name, for messages
    items: tuple[Item, ...]
    distinct: bool
    from_sql: str  # FROM clause body, table names schema-qualified
    where: str | None
    group_by: tuple[str, ...]  # GROUP BY items as written (ordinals and aliases kept)
    keys: tuple[str, ...]  # the grouping expressions themselves
    having: str | None
    order: tuple[OrderItem, ...]
    tail: str | None  # LIMIT / OFFSET / FETCH as written
    unit: str  # the privacy unit, e.g. "a"."id"
    universe: str  # SELECT count(DISTINCT unit) over the FROM clause (joins included, WHERE not)
    magnitudes: tuple[str, ...]  # arguments of SUM and AVG, as written
    contributors: tuple[tuple[Contribution, str], ...]  # per aggregate argument: who counts as contributing
    owner: str = ""  # policy name of the protected table whose privacy unit this is
    sources: tuple[tuple[str, ResolvedTable], ...] = ()  # FROM and JOIN tables: (reference, table)
    aggregates: tuple[AggregateText, ...] = ()  # every aggregate of the select list, HAVING and ORDER BY
    # Post-aggregate expressions in the select list, HAVING or ORDER BY: everything the client selects, computed
    # over the released values (None: the client's own select list, HAVING and ORDER BY run as written).
    outer: Outer | None = None
    having_outer: bool = False  # HAVING is part of `outer` (else it stays in the aggregate query, as written)

    def text_of(self, node: exp.Expression) -> AggregateText:
        """The written form of an aggregate (given as parsed anywhere: compared in canonical form)."""
        wanted = canonical(node)
        for aggregate in self.aggregates:
            if aggregate.node == wanted:
                return aggregate
        raise unsupported("could not locate an aggregate in the statement", PARSE_HINT)

    @property
    def grouped(self) -> bool:
        return bool(self.keys)


def analyze(statement: Statement, tree: exp.Expression, index: PolicyIndex, params: SuppressionParams,
            dp: bool = False, conditions: tuple[exp.Expression, ...] = ()) -> AnalyticQuery:
    """The pieces of ``tree``; ``dp`` also admits the aggregates only dp mode computes (expressions.DP_AGGREGATES).
    ``conditions`` filter the query's rows too, in SQL built around it (a series limit's ON keys,
    anonproxy.plan.outer): they are checked like WHERE."""
    check_relations(tree, index, dp)  # first: a relation outside the policy is refused as such, whatever else
    if isinstance(tree, exp.SetOperation):
        raise unsupported("UNION, INTERSECT and EXCEPT are not supported over protected tables", SHAPE_HINT)
    if not isinstance(tree, exp.Select):
        raise unsupported(f"{type(tree).__name__.upper()} is not supported over protected tables", SHAPE_HINT)
    for key in sorted(_set_args(tree) - _SELECT_ARGS):
        name = _SELECT_ARG_NAMES.get(key, key.upper())
        refusal = forbidden if key in ("into", "sample") else unsupported
        raise refusal(f"{name} is not allowed in a query over protected tables", SHAPE_HINT)
    for node in tree.expressions:
        if isinstance(unwrap(node), exp.Star) or (isinstance(unwrap(node), exp.Column)
                                                  and isinstance(unwrap(node).this, exp.Star)):
            raise forbidden("SELECT * is not allowed over protected tables: it returns row-level data",
                            ROW_LEVEL_HINT)
    if any(isinstance(node, exp.Lateral) for node in tree.walk()):
        raise unsupported("LATERAL is not allowed in a query over protected tables", SHAPE_HINT)
    for node in tree.walk():
        if node is not tree and isinstance(node, (exp.Select, exp.Subquery, exp.SetOperation, exp.Exists)):
            raise unsupported("subqueries are not allowed in a query over protected tables", SHAPE_HINT)
    distinct = tree.args.get("distinct")
    if distinct is not None and _set_args(distinct):
        raise unsupported("DISTINCT ON is not allowed over protected tables", SHAPE_HINT)

    sources = _sources(tree, index)
    anchor, unit, owner = _privacy_unit(sources, index)
    scope = Scope(
        references={source.reference: source.table for source in sources},
        unaliased={(s.table.schema, s.table.name): s.reference for s in sources if s.node.args.get("alias") is None},
        identifiers={source.reference: _identifier_columns(source.table) for source in sources},
    )
    checker = Checker(scope, params, anchor.table.policy_name, dp, statement.source)
    check_joins(sources, anchor, checker)

    layout = _Layout(statement, tree)
    items = _items(tree, layout, checker, dp)
    keys, group_by = _grouping(tree, layout, items, checker)

    aggregated = any(item.kind == "aggregate" or (item.kind == "post" and item.aggregates) for item in items) or (
        tree.args.get("having") is not None and contains_aggregate(tree.args["having"], checker.aggregates))
    if not keys:
        if distinct is not None and not aggregated:
            keys = group_by = tuple(item.expression for item in items if item.kind == "group")
        if not keys:
            loose = [item for item in items if item.kind == "group"]
            if loose:
                raise forbidden(f"{loose[0].expression} returns row-level data of protected table "
                                f"{anchor.table.policy_name}: select items must be aggregates or GROUP BY expressions",
                                ROW_LEVEL_HINT)
            if not aggregated:
                raise forbidden(f"a query over protected table {anchor.table.policy_name} must aggregate: "
                                "without GROUP BY or an aggregate it returns one row per person", ROW_LEVEL_HINT)

    where = tree.args.get("where")
    if where is not None:
        checker.row(where.this, "WHERE")
    for condition in conditions:
        checker.row(condition, "WHERE")
    having = tree.args.get("having")
    if having is not None:
        checker.grouped(having.this, "HAVING")
    order = _order(tree, layout, items, checker)
    _check_tail(tree)
    aggregates = _aggregate_texts(statement, tree, checker.aggregates)
    magnitudes, contributors = _aggregate_arguments(aggregates)
    outer, having_outer = _outer(tree, items, order, keys, checker, statement.source, dp)
    _check_tokens(statement, dp)  # last line of defence, after the tree gave its specific reasons
    from_sql = _from_sql(statement, layout, sources)

    return AnalyticQuery(
        table=anchor.table.policy_name,
        items=tuple(items),
        distinct=distinct is not None,
        from_sql=from_sql,
        where=layout.clause_text(TokenType.WHERE, where.this if where is not None else None),
        group_by=group_by,
        keys=keys,
        having=layout.clause_text(TokenType.HAVING, having.this if having is not None else None),
        order=order,
        tail=layout.tail(),
        unit=unit,
        # N, the people a query set must leave k of out: those of the FROM clause, whose totals are public (add
        # up the groups of any GROUP BY). A linked table alone, or joined, holds fewer people than the protected
        # table: with the protected table's N, `sum(cost) FROM visits [WHERE person <> 17]` was released.
        universe=f"SELECT count(DISTINCT {unit}) FROM {from_sql}",
        magnitudes=magnitudes,
        contributors=contributors,
        owner=owner,
        sources=tuple((source.reference, source.table) for source in sources),
        aggregates=aggregates,
        outer=outer,
        having_outer=having_outer,
    )


def _outer(tree: exp.Select, items: list[Item], order: tuple[OrderItem, ...], keys: tuple[str, ...],
           checker: Checker, source: str, dp: bool) -> tuple[Outer | None, bool]:
    """The post-aggregate form of the select list, HAVING and ORDER BY, when any of them needs one."""
    kinds = checker.aggregates
    having = tree.args.get("having")
    having_post = having is not None and has_post_aggregate(having.this, kinds)
    order_nodes = tree.args["order"].expressions if tree.args.get("order") is not None else []
    order_post = any(item.position is None and has_post_aggregate(node.this, kinds)
                     for item, node in zip(order, order_nodes, strict=True))
    # dp mode computes constant select items there too (its own SQL returns only keys and statistics).
    if not (any(item.kind == "post" or (dp and item.kind == "constant") for item in items) or having_post
            or order_post):
        return None, False
    nodes = [(node.this if isinstance(node, exp.Alias) else node) for node in tree.expressions]
    select = [(node, item.alias, item.kind in ("post", "aggregate", "constant"))
              for node, item in zip(nodes, items, strict=True)]
    ordering = [(node.this if item.position is None else None, item.position, item.suffix)
                for item, node in zip(order, order_nodes, strict=True)]
    key_nodes = [canonical(_expression(key)) for key in keys]
    outer = compile_outer(select, having.this if having_post else None, ordering, key_nodes, kinds, canonical,
                          source)
    return outer, having_post


def _expression(text: str) -> exp.Expression:
    node = sqlglot.parse_one(text, read="postgres")
    assert isinstance(node, exp.Expression)
    return node


# --- tables -----------------------------------------------------------------


def _sources(tree: exp.Select, index: PolicyIndex) -> list[Source]:
    from_ = tree.args.get("from_")
    if from_ is None:
        raise unsupported("a query over protected tables needs a FROM clause", SHAPE_HINT)
    if _set_args(from_) != {"this"}:
        raise unsupported("unsupported FROM clause", SHAPE_HINT)
    sources = [_source(from_.this, None, index)]
    for join in tree.args.get("joins") or []:
        sources.append(_source(join.this, join, index))
    seen: set[str] = set()
    for source in sources:
        if source.reference in seen:
            raise unsupported(f"table name {source.reference} appears twice in FROM", "Give each table its own alias.")
        seen.add(source.reference)
    return sources


def _source(node: exp.Expression, join: exp.Join | None, index: PolicyIndex) -> Source:
    if isinstance(node, exp.Lateral):
        raise unsupported("LATERAL is not allowed in a query over protected tables", SHAPE_HINT)
    if isinstance(node, exp.Subquery):
        raise unsupported("subqueries in FROM are not allowed in a query over protected tables", SHAPE_HINT)
    if not isinstance(node, exp.Table) or not isinstance(node.this, exp.Identifier):
        raise unsupported("functions and other table expressions in FROM are not allowed over protected tables",
                          SHAPE_HINT)
    extra = _set_args(node) - {"this", "db", "alias"}
    if "sample" in extra:
        raise forbidden("TABLESAMPLE is not allowed over protected tables", SHAPE_HINT)
    if extra:
        what = "ONLY" if "only" in extra else ("cross-database names" if "catalog" in extra else ", ".join(sorted(extra)))
        raise unsupported(f"{what} is not supported in FROM over protected tables", SHAPE_HINT)
    alias = node.args.get("alias")
    if alias is not None and _set_args(alias) != {"this"}:
        raise unsupported("column aliases on tables are not supported over protected tables", SHAPE_HINT)
    table = index.resolve(node)
    reference = (identifier(alias.this) if alias is not None else None) or table.name
    return Source(table, node, reference, join)


def _identifier_columns(table: ResolvedTable) -> frozenset[str]:
    """The unit column, a linked table's key, and the columns the policy marks as identifiers."""
    if table.protected is not None:
        policy_columns, key = table.protected.columns, table.protected.unit_column
    elif table.linked is not None:
        policy_columns, key = table.linked.columns, table.linked.column
    else:
        return frozenset()
    return frozenset({key, *(name for name, column in policy_columns.items() if column.kind == "identifier")})


def _privacy_unit(sources: list[Source], index: PolicyIndex) -> tuple[Source, str, str]:
    """The source that carries the privacy unit, the unit expression, and the policy name of the protected table
    the unit belongs to."""
    protected = [s for s in sources if s.table.kind == "protected"]
    linked = [s for s in sources if s.table.kind == "linked"]
    if sources[0].table.kind == "reference":
        # An inner join is the same either way round, but the join rules read FROM left to right: the table of
        # the privacy unit first, then what is joined to it.
        raise unsupported(f"reference table {sources[0].table.policy_name} cannot come first in FROM: the table "
                          "that carries the privacy unit comes first, and reference tables are joined to it",
                          REFERENCE_HINT)
    if len(protected) > 1:
        raise unsupported("a query may read only one protected table", SHAPE_HINT)
    if protected:
        anchor = protected[0]
        table = anchor.table.protected
        assert table is not None
        for source in linked:
            assert source.table.linked is not None
            if index.lookup(source.table.linked.references).policy_name != anchor.table.policy_name:
                raise unsupported(f"linked table {source.table.policy_name} belongs to "
                                  f"{source.table.linked.references}, not to {anchor.table.policy_name}", SHAPE_HINT)
        unit_column = table.unit_column
        owner = anchor.table
    else:
        # Linked tables without their protected table: the first one's key is the unit; the others must link to
        # the same protected table, and join on their keys (_check_joins).
        anchor = linked[0]
        link = anchor.table.linked
        assert link is not None
        for source in linked[1:]:
            assert source.table.linked is not None
            if source.table.linked.references != link.references:
                raise unsupported(f"linked tables {anchor.table.policy_name} and {source.table.policy_name} belong "
                                  "to different protected tables", SHAPE_HINT)
        owner = index.lookup(link.references)
        if owner.kind != "protected" or owner.protected is None:
            raise unsupported(f"linked table {anchor.table.policy_name} references {link.references}, "
                              "which the policy does not protect", SHAPE_HINT)
        unit_column = link.column
    unit = f"{quote(anchor.reference)}.{quote(unit_column)}"
    assert owner.protected is not None
    return anchor, unit, owner.policy_name


def _from_sql(statement: Statement, layout: _Layout, sources: list[Source]) -> str:
    first, stop = layout.range(TokenType.FROM)
    begin = statement.tokens[first].start
    end = statement.tokens[stop - 1].end + 1
    replacements = []
    for source in sources:
        parts = [source.node.args.get("db"), source.node.this]
        spans = [part.meta for part in parts if part is not None]
        if any("start" not in meta for meta in spans):
            raise unsupported("could not locate a table name in the statement", PARSE_HINT)
        start, finish = spans[0]["start"], spans[-1]["end"] + 1
        if not begin <= start < finish <= end:
            raise unsupported("could not locate a table name in the statement", PARSE_HINT)
        replacements.append((start, finish, source.table.qualified))
    text, cursor = [], begin
    for start, finish, name in sorted(replacements):
        if start < cursor:
            raise unsupported("could not locate a table name in the statement", PARSE_HINT)
        text += [statement.source[cursor:start], name]
        cursor = finish
    text.append(statement.source[cursor:end])
    return "".join(text)


# --- select list, GROUP BY, ORDER BY --------------------------------------------


def _items(tree: exp.Select, layout: _Layout, checker: Checker, dp: bool) -> list[Item]:
    pieces = layout.items()
    if len(pieces) != len(tree.expressions):
        raise unsupported("could not separate the select items", PARSE_HINT)
    items = []
    for node, (first, stop) in zip(tree.expressions, pieces, strict=True):
        text = layout.statement.span(first, stop)
        alias = None
        expression_node = node
        expression_stop = stop
        if isinstance(node, exp.Alias):
            alias_ident = node.args.get("alias")
            if not isinstance(alias_ident, exp.Identifier) or "start" not in alias_ident.meta:
                raise unsupported("could not locate a column alias", PARSE_HINT)
            alias = identifier(alias_ident)
            expression_stop = token_at(layout.statement.tokens, alias_ident.meta["start"])
            if layout.statement.tokens[expression_stop - 1].token_type == TokenType.ALIAS:
                expression_stop -= 1
            expression_node = node.this
        expression = layout.statement.span(first, expression_stop)
        _same(expression, expression_node)
        kind: ItemKind
        core = _cast_aggregate(expression_node, checker.aggregates)
        if core is not None:
            # A cast of an aggregate is computed only for groups that passed suppression (after HAVING); in dp mode
            # over the noisy value, like any post-aggregate expression.
            checker.grouped(expression_node, "the select list")  # the cast's target type too
            kind = "post" if dp and core is not unwrap(expression_node) else "aggregate"
        else:
            checker.grouped(expression_node, "the select list")
            bare = unwrap(expression_node)
            if isinstance(bare, exp.Filter):
                kind = "aggregate"  # count(*) FILTER (WHERE ...)
            elif contains_aggregate(expression_node, checker.aggregates) or has_post_aggregate(
                    expression_node, checker.aggregates):
                kind = "post"
            else:
                kind = "group" if any(isinstance(n, exp.Column) for n in expression_node.walk()) else "constant"
        items.append(Item(text, expression, kind, alias, contains_aggregate(expression_node, checker.aggregates)))
    return items


def _cast_aggregate(node: exp.Expression, kinds: tuple[type[exp.Expression], ...]) -> exp.Expression | None:
    """The aggregate when ``node`` is an aggregate, possibly inside casts and parentheses."""
    node = unwrap(node)
    while isinstance(node, exp.Cast) and _set_args(node) == {"this", "to"} and isinstance(node.args["to"],
                                                                                           exp.DataType):
        node = unwrap(node.this)
    return node if isinstance(node, kinds) else None


def _grouping(tree: exp.Select, layout: _Layout, items: list[Item], checker: Checker) -> tuple[tuple[str, ...], tuple[str, ...]]:
    group = tree.args.get("group")
    if group is None:
        return (), ()
    if _set_args(group) != {"expressions"}:
        raise unsupported("ROLLUP, CUBE, GROUPING SETS and GROUP BY ALL are not supported: totals next to "
                          "suppressed cells can reveal them", "GROUP BY plain expressions.")
    if any(isinstance(node, (exp.Rollup, exp.Cube, exp.GroupingSets)) for node in group.expressions):
        raise unsupported("ROLLUP, CUBE and GROUPING SETS are not supported: totals next to suppressed cells can "
                          "reveal them", "GROUP BY plain expressions.")
    pieces = layout.pieces(TokenType.GROUP_BY)
    if len(pieces) != len(group.expressions):
        raise unsupported("could not separate the GROUP BY items", PARSE_HINT)
    aliases = {item.alias: position for position, item in enumerate(items) if item.alias is not None}
    keys, written = [], []
    for node, (first, stop) in zip(group.expressions, pieces, strict=True):
        text = layout.statement.span(first, stop)
        _same(text, node)
        written.append(text)
        position = _ordinal(node)
        if position is None and isinstance(node, exp.Column) and node.args.get("table") is None:
            name = identifier(node.this)
            if name in aliases:
                if not _same_column(tree, tree.expressions[aliases[name]].this, name):
                    raise unsupported(f"GROUP BY {name} is ambiguous: it is both an output alias and maybe a column",
                                      "Group by the expression itself or by its position (GROUP BY 1).")
                checker.key(node, "GROUP BY")
                keys.append(items[aliases[name]].expression)  # the select item's spelling: "_"."relationship"
                continue
        if position is None and not isinstance(node, exp.Literal) and _constant(node):
            # Metabase's pivot groups by ABS(0): a value that reads no row puts every row in one group, so it does
            # not partition them. Proved not to raise (no error that says whether any row passed WHERE), then left
            # out: the query is decided, and answered, as without it (only constants: a whole-table total).
            checker.key(node, "GROUP BY")
            written.pop()
            continue
        if position is not None:
            if not 1 <= position <= len(items):
                raise unsupported(f"GROUP BY position {position} is not in the select list", SHAPE_HINT)
            item = items[position - 1]
            if item.kind != "group":
                raise unsupported(f"GROUP BY {position} must name a column expression, not {item.expression}",
                                  SHAPE_HINT)
            keys.append(item.expression)
            continue
        if isinstance(node, exp.Literal):
            raise unsupported("GROUP BY needs column expressions", SHAPE_HINT)
        checker.key(node, "GROUP BY")
        if not any(isinstance(n, exp.Column) for n in node.walk()):
            raise unsupported("GROUP BY needs column expressions", SHAPE_HINT)
        keys.append(text)
    return tuple(keys), tuple(written)


def _constant(node: exp.Expression) -> bool:
    """Whether ``node`` reads no column and no parameter (its value is the same for every row)."""
    return not any(isinstance(n, (exp.Column, exp.Parameter, exp.Placeholder, exp.Star, exp.Select))
                   for n in node.walk())


def _same_column(tree: exp.Select, target: exp.Expression, name: str) -> bool:
    """Whether the output alias ``name`` stands for the column PostgreSQL groups by when ``name`` is read as an
    input column: the same bare column, or ``t.name`` when ``t`` is the only table the query reads (Power BI's
    ``SELECT "_"."relationship" ... GROUP BY "relationship"``)."""
    if not isinstance(target, exp.Column) or target.args.get("db") is not None or identifier(target.this) != name:
        return False
    table = target.args.get("table")
    if table is None:
        return True
    source = tree.args.get("from_")
    only = source.this if source is not None and not tree.args.get("joins") else None
    if not isinstance(only, exp.Table):
        return False
    alias = only.args.get("alias")
    return identifier(table) == identifier(alias.this if alias is not None else only.this)


def _order(tree: exp.Select, layout: _Layout, items: list[Item], checker: Checker) -> tuple[OrderItem, ...]:
    order = tree.args.get("order")
    if order is None:
        return ()
    if _set_args(order) != {"expressions"}:
        raise unsupported("unsupported ORDER BY", SHAPE_HINT)
    pieces = layout.pieces(TokenType.ORDER_BY)
    if len(pieces) != len(order.expressions):
        raise unsupported("could not separate the ORDER BY items", PARSE_HINT)
    aliases = {item.alias: position for position, item in enumerate(items, 1) if item.alias is not None}
    canonical_items = [canonical(unwrap(node)) for node in tree.expressions]
    result = []
    statement = layout.statement
    for node, (first, stop) in zip(order.expressions, pieces, strict=True):
        if not isinstance(node, exp.Ordered) or _set_args(node) - {"this", "desc", "nulls_first"}:
            raise unsupported("unsupported ORDER BY item", SHAPE_HINT)
        expression_stop = stop
        words = [statement.word(i) for i in range(first, stop)]
        if len(words) >= 2 and words[-2] == "NULLS" and words[-1] in ("FIRST", "LAST"):
            expression_stop -= 2
        if expression_stop - first >= 2 and words[expression_stop - first - 1] in _ORDER_WORDS:
            expression_stop -= 1
        expression = statement.span(first, expression_stop)
        suffix = statement.source[statement.tokens[expression_stop - 1].end + 1 : statement.tokens[stop - 1].end + 1]
        _same(expression, node.this)
        target = node.this
        position = _ordinal(target)
        if position is not None:
            if not 1 <= position <= len(items):
                raise unsupported(f"ORDER BY position {position} is not in the select list", SHAPE_HINT)
        elif isinstance(target, exp.Column) and target.args.get("table") is None \
                and (identifier(target.this) or "") in aliases:
            position = aliases[identifier(target.this) or ""]
        else:
            checker.grouped(target, "ORDER BY")
            wanted = canonical(unwrap(target))
            matches = [i for i, item in enumerate(canonical_items, 1) if item == wanted]
            position = matches[0] if matches else None
        result.append(OrderItem(statement.span(first, stop), suffix.strip(), position))
    return tuple(result)


def _check_tail(tree: exp.Select) -> None:
    for key in ("limit", "offset"):
        node = tree.args.get(key)
        if node is None:
            continue
        if isinstance(node, exp.Fetch):
            options = node.args.get("limit_options")
            if (options is not None and options.args.get("percent")) or _set_args(node) - {
                    "direction", "count", "limit_options"}:
                raise unsupported("unsupported FETCH clause", SHAPE_HINT)
            value = node.args.get("count")
        else:
            if _set_args(node) - {"expression"}:
                raise unsupported(f"unsupported {key.upper()} clause", SHAPE_HINT)
            value = node.args.get("expression")
        if value is None:
            continue
        if isinstance(value, exp.Var) and value.name.upper() == "ALL":
            continue
        if isinstance(value, exp.Parameter) or (isinstance(value, exp.Literal) and not value.is_string):
            continue
        raise unsupported(f"{key.upper()} takes a constant or a $n parameter", SHAPE_HINT)


def _aggregate_texts(statement: Statement, tree: exp.Select,
                     kinds: tuple[type[exp.Expression], ...]) -> tuple[AggregateText, ...]:
    """Every aggregate call of the statement as written (quantiles WITHIN GROUP aside), each once."""
    found: list[AggregateText] = []
    calls = tuple(kind for kind in kinds if kind is not exp.WithinGroup)
    for node in tree.find_all(*calls):
        if isinstance(node.parent, exp.WithinGroup):
            continue
        start = node.meta.get("start")
        if start is None:
            raise unsupported("could not locate an aggregate in the statement", PARSE_HINT)
        tokens = statement.tokens
        name_index = token_at(tokens, start)
        if name_index + 1 >= len(tokens) or tokens[name_index + 1].token_type != TokenType.L_PAREN:
            raise unsupported("could not locate an aggregate's argument", PARSE_HINT)
        close = closing_paren(tokens, name_index + 1)
        first = name_index + 2
        argument_node = node.this
        if isinstance(argument_node, exp.Distinct):
            if tokens[first].token_type != TokenType.DISTINCT:
                raise unsupported("could not locate an aggregate's argument", PARSE_HINT)
            first += 1
            argument_node = argument_node.expressions[0]
        argument = None
        if not (isinstance(node, exp.Count) and isinstance(argument_node, exp.Star)):
            argument = statement.span(first, close)
            _same(argument, argument_node)
        elif close != first + 1 or tokens[first].token_type != TokenType.STAR:
            raise unsupported("could not locate an aggregate's argument", PARSE_HINT)
        whole: exp.Expression = node
        condition = None
        stop = close + 1
        if isinstance(node.parent, exp.Filter) and node.parent.this is node:
            whole = node.parent
            if not (stop + 2 < len(tokens) and statement.word(stop) == "FILTER"
                    and tokens[stop + 1].token_type == TokenType.L_PAREN and statement.word(stop + 2) == "WHERE"):
                raise unsupported("could not locate an aggregate's FILTER clause", PARSE_HINT)
            filter_close = closing_paren(tokens, stop + 1)
            condition = statement.span(stop + 3, filter_close)
            _same(condition, whole.expression.this)
            stop = filter_close + 1
        # The name token is the aggregate's (its spelling checked by the Checker), the argument and the condition
        # were compared with the tree, and the tokens between them are fixed: the whole text needs no new parse.
        text = statement.span(name_index, stop)
        entry = AggregateText(canonical(whole), text, argument, condition)
        if entry not in found:
            found.append(entry)
    return tuple(found)


def filtered(argument: str | None, condition: str | None) -> str | None:
    """The argument an aggregate FILTER (WHERE condition) is equivalent to: CASE WHEN condition THEN argument END
    (count(*) FILTER ... counts CASE WHEN condition THEN 1 END). Aggregates skip NULLs, so the two agree."""
    if condition is None:
        return argument
    return f"CASE WHEN ({condition}) THEN {'1' if argument is None else f'({argument})'} END"


def _aggregate_arguments(aggregates: tuple[AggregateText, ...]) -> tuple[tuple[str, ...],
                                                                         tuple[tuple[Contribution, str], ...]]:
    """The argument of every SUM and AVG, and of every aggregate with a contribution rule, each once; a FILTER is
    folded into the argument (:func:`filtered`), so the contributors are those of the filtered rows."""
    magnitudes: list[str] = []
    contributors: list[tuple[Contribution, str]] = []
    for aggregate in aggregates:
        node = aggregate.node.this if isinstance(aggregate.node, exp.Filter) else aggregate.node
        text = filtered(aggregate.argument, aggregate.filter)
        if text is None:
            continue  # count(*): every unit of the group contributes
        if isinstance(node, (exp.Sum, exp.Avg, exp.Variance, exp.VariancePop, exp.Stddev, exp.StddevSamp,
                             exp.StddevPop)):  # a spread like avg: k units with nonzero values
            if text not in magnitudes:
                magnitudes.append(text)
            rule: Contribution = "nonzero"
        else:
            rule = "nonnull"
        if (rule, text) not in contributors:
            contributors.append((rule, text))
    return tuple(magnitudes), tuple(contributors)


# Words that are never part of the supported subset: if sqlglot ever parsed one of them without keeping it in
# the tree, the client's text (which is what runs) would still contain it. Refuse them on the tokens.
_FOREIGN_WORDS = frozenset({
    "UNION", "INTERSECT", "EXCEPT", "INTO", "FOR", "WINDOW", "OVER", "WITHIN", "LATERAL", "TABLESAMPLE",
    "COLLATE", "ESCAPE", "SIMILAR", "USING", "NATURAL", "CROSS", "RIGHT", "FULL", "EXISTS", "ANY", "SOME", "ARRAY",
    "RETURNING", "VARIADIC", "ORDINALITY", "GROUPING", "ROLLUP", "CUBE", "SETS", "WITH", "ONLY", "OPERATOR",
})  # fmt: skip
_FETCH_WORDS = frozenset({"WITH", "ONLY"})  # FETCH FIRST n ROWS ONLY / WITH TIES
_PUNCTUATION = frozenset({
    TokenType.COMMA, TokenType.L_PAREN, TokenType.R_PAREN, TokenType.DOT, TokenType.DCOLON, TokenType.EQ,
    TokenType.NEQ, TokenType.LT, TokenType.LTE, TokenType.GT, TokenType.GTE, TokenType.STAR, TokenType.DASH,
    TokenType.PARAMETER, TokenType.NUMBER, TokenType.STRING, TokenType.IDENTIFIER,
    TokenType.PLUS, TokenType.SLASH, TokenType.MOD,  # arithmetic, admitted by the no-error proof
})  # fmt: skip


def _check_tokens(statement: Statement, dp: bool) -> None:
    fetch = False
    words_seen = [statement.word(i) for i in range(len(statement.tokens))]
    substring = _substring_arguments(statement, words_seen)
    for position, token in enumerate(statement.tokens):
        raw = statement.raw(position)
        if token.token_type in _PUNCTUATION:
            continue
        words = raw.upper().split()
        if not words or not all(_WORD.fullmatch(word) for word in words):
            raise unsupported(f"{raw!r} is not allowed in a query over protected tables", SHAPE_HINT)
        fetch = fetch or words[0] == "FETCH"
        time_zone = words_seen[position + 1:position + 3] == ["TIME", "ZONE"]  # timestamp WITH TIME ZONE
        for word in words:
            if word in _FOREIGN_WORDS and not (fetch and word in _FETCH_WORDS) and not (word == "WITH" and time_zone) \
                    and not (dp and word == "WITHIN") \
                    and not (word == "FOR" and position in substring) \
                    and not (word == "RIGHT" and _calls(statement, position)):  # percentile_cont WITHIN GROUP: dp
                raise unsupported(f"{word} is not allowed in a query over protected tables", SHAPE_HINT)


def _calls(statement: Statement, position: int) -> bool:
    """Whether the word at ``position`` is a function name: right(x, 2), not RIGHT JOIN."""
    return position + 1 < len(statement.tokens) and statement.tokens[position + 1].token_type == TokenType.L_PAREN


def _substring_arguments(statement: Statement, words: list[str | None]) -> set[int]:
    """Positions of the tokens inside substring( ... ), where FOR is part of the call (substring(x FROM 1 FOR 3))."""
    inside: set[int] = set()
    for position, word in enumerate(words):
        if word == "SUBSTRING" and position + 1 < len(words) \
                and statement.tokens[position + 1].token_type == TokenType.L_PAREN:
            inside.update(range(position + 2, closing_paren(statement.tokens, position + 1)))
    return inside


_WORD = re.compile(r"[A-Z_\x80-\U0010ffff][A-Z0-9_$\x80-\U0010ffff]*")


# --- token layout -----------------------------------------------------------------


class _Layout:
    """Where the top-level clauses of a SELECT start and end in its token list."""

    def __init__(self, statement: Statement, tree: exp.Select) -> None:
        self.statement = statement
        tokens = statement.tokens
        if tokens[0].token_type != TokenType.SELECT:
            raise unsupported("a query over protected tables must start with SELECT", SHAPE_HINT)
        self.starts: dict[TokenType, int] = {}
        order = []
        for i in depth_zero(tokens, 1):
            kind = tokens[i].token_type
            if kind not in _CLAUSES:
                continue
            if kind == TokenType.FROM and tokens[i - 1].token_type == TokenType.DISTINCT:
                continue  # IS [NOT] DISTINCT FROM
            if kind in self.starts:
                raise unsupported(f"{tokens[i].text.upper()} appears twice", SHAPE_HINT)
            self.starts[kind] = i
            order.append(i)
        if order != sorted(order):
            raise unsupported("clauses are out of order", SHAPE_HINT)
        self.boundaries = sorted(self.starts.values()) + [len(tokens)]
        first = 1
        if tokens[1].token_type in (TokenType.DISTINCT, TokenType.ALL):
            first = 2
        if TokenType.FROM not in self.starts:
            raise unsupported("a query over protected tables needs a FROM clause", SHAPE_HINT)
        self.select = (first, self.starts[TokenType.FROM])
        expected = {TokenType.WHERE: "where", TokenType.GROUP_BY: "group", TokenType.HAVING: "having",
                    TokenType.ORDER_BY: "order"}
        for kind, key in expected.items():
            if (kind in self.starts) != (tree.args.get(key) is not None):
                raise unsupported("could not locate the clauses of the statement", PARSE_HINT)

    def range(self, kind: TokenType) -> tuple[int, int]:
        start = self.starts[kind]
        stop = next(b for b in self.boundaries if b > start)
        return start + 1, stop

    def items(self) -> list[tuple[int, int]]:
        return split_commas(self.statement.tokens, *self.select)

    def pieces(self, kind: TokenType) -> list[tuple[int, int]]:
        return split_commas(self.statement.tokens, *self.range(kind))

    def clause_text(self, kind: TokenType, node: exp.Expression | None) -> str | None:
        if node is None:
            return None
        text = self.statement.span(*self.range(kind))
        _same(text, node)
        return text

    def tail(self) -> str | None:
        starts = [self.starts[kind] for kind in _TAIL if kind in self.starts]
        if not starts:
            return None
        return self.statement.span(min(starts), len(self.statement.tokens))


# --- helpers ------------------------------------------------------------------------


def _set_args(node: exp.Expression) -> set[str]:
    return {key for key, value in node.args.items() if value not in (None, False, [], "")}


def _ordinal(node: exp.Expression) -> int | None:
    if isinstance(node, exp.Literal) and not node.is_string and node.this.isdigit():
        return int(node.this)
    return None


def canonical(node: exp.Expression) -> exp.Expression:
    """A copy that compares equal to any spelling PostgreSQL would treat as the same expression."""
    copy = node.copy()
    for ident in list(copy.find_all(exp.Identifier)):
        ident.set("this", fold(ident.this, bool(ident.args.get("quoted"))))
        ident.set("quoted", True)
    for paren in list(copy.find_all(exp.Paren)):
        if paren is copy:
            continue
        paren.replace(paren.this)
    while isinstance(copy, exp.Paren):
        copy = copy.this
    return copy


def _same(text: str, node: exp.Expression) -> None:
    """Refuse unless ``text`` parses to the same expression as ``node``."""
    try:
        parsed = sqlglot.parse_one(text, read="postgres")
    except SqlglotError:
        raise unsupported("could not isolate a part of the statement", PARSE_HINT) from None
    if not isinstance(parsed, exp.Expression) or canonical(parsed) != canonical(node):
        raise unsupported("could not isolate a part of the statement", PARSE_HINT)
