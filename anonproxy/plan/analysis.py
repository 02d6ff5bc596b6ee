"""Take an analytic SELECT over a protected table apart into the pieces both back-ends build their SQL from.

The parse tree (sqlglot, the statement's one parse) decides what is allowed,
and every piece (select items, the FROM clause with its joins, WHERE, GROUP
BY keys, HAVING, ORDER BY items, LIMIT/OFFSET, aggregate arguments and
FILTER conditions) is kept twice: as the checked node, and as SQL rendered
from that node (:mod:`anonproxy.plan.render`). Nothing is cut from the
client's text, so what the service runs is what was checked. Tables are
rendered schema-qualified; a select item PostgreSQL names from the client's
spelling gets that name as an explicit alias, so output column names are
those of the client's statement. Post-aggregate expressions
(``round(avg(x), 1)``, ``sum(x) / count(*)``, a HAVING over them) are
compiled into SQL over the released values
(:mod:`anonproxy.plan.post_aggregate`, ``AnalyticQuery.outer``), because
every division gets a ``NULLIF``. Before the checks, two kinds of constants are
computed in the tree, so that what runs cannot fail only when a row reaches
it: ``||`` of string and integer constants becomes the string it gives, and
``(SELECT x)`` without FROM over constants and the clock becomes ``(x)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, localcontext
from typing import Literal

from sqlglot import exp

from anonproxy.plan import bounds, distinct_pairs, render, semi_joins
from anonproxy.plan import time_values as tv
from anonproxy.plan.expressions import (
    Checker,
    Scope,
    contains_aggregate,
    has_post_aggregate,
    unparen,
    unwrap,
    window_function,
)
from anonproxy.plan.joins import REFERENCE_HINT, Source, check_joins, join_side
from anonproxy.plan.names import output_name, own_nodes
from anonproxy.plan.names import sources as sources_of
from anonproxy.plan.post_aggregate import PostAggregate, compile_outer
from anonproxy.plan.refusals import Refusal, fanout_keys, forbidden, unsupported
from anonproxy.plan.relations import check_relations
from anonproxy.plan.render import sql
from anonproxy.plan.statements import PARSE_HINT, Statement
from anonproxy.plan.tables import PolicyIndex, ResolvedTable, fold, identifier, quote
from anonproxy.policy.model import SuppressionParams

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


@dataclass(frozen=True)
class Item:
    text: str  # rendered, with its output name: expression AS "name"
    expression: str  # rendered, without the alias
    kind: ItemKind
    alias: str | None  # the client's alias
    aggregates: bool = False  # kind "post": whether it holds an aggregate (abs(0) does not)
    node: exp.Expression | None = None  # the checked expression, without the alias
    name: str = "?column?"  # the output column's name, as PostgreSQL names it in the client's statement


@dataclass(frozen=True)
class OrderItem:
    text: str  # rendered: expression [ASC|DESC] [NULLS FIRST|LAST]
    suffix: str  # the ASC/DESC/NULLS part ("" for the default order)
    position: int | None  # 1-based select-list position when it names an output column
    written: str  # ``text`` as the client wrote it (a clamped column bare): for messages


@dataclass(frozen=True)
class Typed:
    """A row-level expression of the plan (a grouping key, an aggregate's argument) and what the analysis proved
    about it: it raises no error for any value of the columns it reads within their types and declared bounds,
    it derives from the rows of the FROM clause (so from the privacy unit of the query), and it has this SQL type
    and, for a number, these bounds (anonproxy.plan.bounds)."""

    sql: str  # rendered
    type: str  # int4, numeric, float8, text, date, ... (bounds.Value.type); unknown when the policy has no types
    low: Decimal | None = None  # the bounds of its finite values (numbers only; None: unbounded)
    high: Decimal | None = None

    def describe(self) -> str:
        if self.low is None or self.high is None:
            return f"{self.sql} ({self.type})"
        return f"{self.sql} ({self.type} in [{_number(self.low)}, {_number(self.high)}])"


@dataclass(frozen=True)
class AggregateText:
    """One aggregate of the statement, rendered: ``COUNT(*) FILTER(WHERE age > 40)``."""

    node: exp.Expression  # canonical: the aggregate, inside its exp.Filter when it has one
    text: str  # the whole call, FILTER included
    argument: str | None  # the argument (None: count(*)); DISTINCT left out
    filter: str | None  # the FILTER condition


@dataclass(frozen=True)
class AnalyticQuery:
    """An aggregate query over one protected table: its checked pieces, each as a node and as rendered SQL."""

    table: str  # the protected table's policy name, for messages
    items: tuple[Item, ...]
    distinct: bool
    from_sql: str  # FROM clause body, table names schema-qualified
    where: str | None
    group_by: tuple[str, ...]  # GROUP BY items (ordinals and aliases kept)
    keys: tuple[str, ...]  # the grouping expressions themselves
    having: str | None
    order: tuple[OrderItem, ...]
    tail: str | None  # LIMIT / OFFSET / FETCH
    unit: str  # the privacy unit, e.g. "a"."id"
    universe: str  # SQL: the distinct units of the FROM clause (joins included, WHERE not)
    magnitudes: tuple[str, ...]  # arguments of SUM and AVG
    contributors: tuple[tuple[Contribution, str], ...]  # per aggregate argument: who counts as contributing
    owner: str = ""  # policy name of the protected table whose privacy unit this is
    sources: tuple[tuple[str, ResolvedTable], ...] = ()  # FROM and JOIN tables: (reference, table)
    aggregates: tuple[AggregateText, ...] = ()  # every aggregate of the select list, HAVING and ORDER BY
    # Post-aggregate expressions in the select list, HAVING or ORDER BY: everything the client selects, computed
    # over the released values (None: the client's own select list, HAVING and ORDER BY run in the query).
    outer: PostAggregate | None = None
    having_outer: bool = False  # HAVING is part of `outer` (else it stays in the aggregate query)
    key_nodes: tuple[exp.Expression, ...] = ()  # the grouping expressions, canonical (as `keys`)
    having_node: exp.Expression | None = None  # the HAVING condition
    key_types: tuple[Typed, ...] = ()  # the grouping expressions, typed (as `keys`)
    argument_types: tuple[Typed, ...] = ()  # every aggregate argument (and FILTER folded in), typed, each once
    # Each row of the FROM clause is a different person: the protected table, whose unit column the catalog makes
    # unique and not null, joined only to reference tables (many-to-one). Then count(*) counts people.
    one_row_per_person: bool = False
    # The select list, HAVING and ORDER BY always computed over the released values (as `outer`, HAVING included),
    # for a back-end that computes every aggregate in one pass first; None where they cannot be written so.
    post: PostAggregate | None = None

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
    if not isinstance(tree, exp.Select):
        return _analyze(statement, tree, index, params, dp, conditions, [])
    with semi_joins.set_aside(tree) as semis:
        return _analyze(statement, tree, index, params, dp, conditions, semis)


def _analyze(statement: Statement, tree: exp.Expression, index: PolicyIndex, params: SuppressionParams, dp: bool,
             conditions: tuple[exp.Expression, ...], semis: list[semi_joins.SemiJoin]) -> AnalyticQuery:
    """analyze() of ``tree`` whose WHERE clause is without ``semis``, its semi-joins on the privacy unit."""
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
    nested = [node for node in tree.walk() if node is not tree and isinstance(node, _NESTED)]
    _compute_constants(nested)
    _expand_row_in(tree)
    # a linked table's distinct rows joined in FROM are checked as a source (distinct_pairs)
    pairs = {id(node) for item in sources_of(tree) if distinct_pairs.body(item) is not None for node in item.walk()}
    if any(isinstance(node, _QUERIES) and node.root() is tree and id(node) not in pairs
           for node in nested):  # not inlined
        raise unsupported("subqueries are not allowed in a query over protected tables", SHAPE_HINT)
    distinct = tree.args.get("distinct")
    if distinct is not None and _set_args(distinct):
        raise unsupported("DISTINCT ON is not allowed over protected tables", SHAPE_HINT)

    sources = _sources(tree, index)
    anchor, unit, owner = _privacy_unit(sources, index)
    scope = Scope(
        references={source.reference: source.table for source in sources},
        unaliased={(s.table.schema, s.table.name): s.reference for s in sources
                   if s.node.args.get("alias") is None and s.derived is None},
        identifiers={source.reference: identifier_columns(source.table) for source in sources},
    )
    checker = Checker(scope, params, anchor.table.policy_name, dp, statement.source, zones=index.policy.zones)
    nodes = list(own_nodes(tree))  # the two passes below change nodes in place, never the list's
    _qualify_bare_columns(tree, nodes, scope)
    _arrays_as_lists(nodes)
    check_joins(sources, anchor, checker)
    for source in sources:
        if source.derived is not None:
            distinct_pairs.check(source.derived, index, lambda table, name, node, clause: Checker(
                Scope(references={name: table}, identifiers={name: identifier_columns(table)}), params,
                table.policy_name, dp, statement.source, zones=index.policy.zones).row(node, clause))
    for semi in semis:
        semi_joins.check(semi, sources, owner, index, lambda table, name, node, clause: Checker(
            Scope(references={name: table}, identifiers={name: identifier_columns(table)}), params,
            table.policy_name, dp, statement.source, zones=index.policy.zones).row(node, clause),
            semi_joins.OuterChecks(checker.row, checker.scope.is_identifier))

    items = _items(tree, checker, dp, statement.source)
    key_nodes, group_by = _grouping(tree, items, checker)
    keys = tuple(sql(node) for node in key_nodes)

    aggregated = any(item.kind == "aggregate" or (item.kind == "post" and item.aggregates) for item in items) or (
        tree.args.get("having") is not None and contains_aggregate(tree.args["having"], checker.aggregates))
    if not keys:
        if distinct is not None and not aggregated:
            key_nodes = tuple(item.node for item in items if item.kind == "group" and item.node is not None)
            keys = group_by = tuple(sql(node) for node in key_nodes)
        if not keys:
            loose = [item for item in items if item.kind == "group"]
            if loose:
                raise forbidden(f"{loose[0].expression} returns row-level data of protected table "
                                f"{anchor.table.policy_name}: select items must be aggregates or GROUP BY expressions",
                                ROW_LEVEL_HINT)
            if not aggregated:
                raise forbidden(f"a query over protected table {anchor.table.policy_name} must aggregate: "
                                "without GROUP BY or an aggregate it returns one row per person", ROW_LEVEL_HINT)
    if not aggregated:
        _refuse_listing(key_nodes, scope, anchor.table.policy_name)

    where = tree.args.get("where")
    if where is not None:
        checker.row(where.this, "WHERE")
    for condition in conditions:
        checker.row(condition, "WHERE")
    having = tree.args.get("having")
    if having is not None:
        checker.grouped(having.this, "HAVING")
    order = _order(tree, items, checker)
    _check_tail(tree)
    aggregates = _aggregate_texts(tree, checker.aggregates)
    magnitudes, contributors = _aggregate_arguments(aggregates)
    outer, having_outer = _outer(tree, items, order, key_nodes, checker, statement.source, dp)
    post = outer if outer is not None and (having_outer or having is None) else _post(
        tree, items, order, key_nodes, checker, statement.source)
    from_sql = _from_sql(sources)

    return AnalyticQuery(
        table=anchor.table.policy_name,
        items=tuple(items),
        distinct=distinct is not None,
        from_sql=from_sql,
        where=_where_sql(where, semis, index),
        group_by=group_by,
        keys=keys,
        having=sql(having.this) if having is not None else None,
        order=order,
        tail=_tail(tree),
        unit=unit,
        # N, the people a query set must leave k of out: those of the FROM clause, whose totals are public (add
        # up the groups of any GROUP BY). A linked table alone, or joined, holds fewer people than the protected
        # table: with the protected table's N, `sum(cost) FROM visits [WHERE person <> 17]` was released.
        # Counted over a GROUP BY, which PostgreSQL may hash, where count(DISTINCT) always sorts every row.
        universe=(f"SELECT count(anonproxy_units.unit) FROM (SELECT {unit} AS unit FROM {from_sql} GROUP BY 1) "
                  "AS anonproxy_units"),
        magnitudes=magnitudes,
        contributors=contributors,
        owner=owner,
        sources=tuple((source.reference, source.table) for source in sources),
        aggregates=aggregates,
        outer=outer,
        having_outer=having_outer,
        key_nodes=tuple(canonical(node) for node in key_nodes),
        having_node=having.this if having is not None else None,
        key_types=tuple(_typed(node, checker) for node in key_nodes),
        argument_types=_argument_types(tree, checker),
        one_row_per_person=_one_row_per_person(sources, anchor),
        post=post,
    )


def _where_sql(where: exp.Where | None, semis: list[semi_joins.SemiJoin], index: PolicyIndex) -> str | None:
    """The WHERE condition rendered, the semi-joins set aside for the analysis back in it."""
    parts = ([sql(where.this)] if where is not None else []) + [semi_joins.render(semi, index) for semi in semis]
    if len(parts) <= 1:
        return parts[0] if parts else None
    return " AND ".join(f"({part})" for part in parts)


def _refuse_listing(keys: tuple[exp.Expression, ...], scope: Scope, table: str) -> None:
    """A grouping without any aggregate by an identifying column (Lightdash's results table: GROUP BY visit_id,
    visited_at) lists rows, one per group: refused as row-level, not answered with every group withheld."""
    for key in keys:
        node = unwrap(key)
        if isinstance(node, exp.Column) and isinstance(node.this, exp.Identifier) \
                and scope.is_identifier(identifier(node.args.get("table")), identifier(node.this) or ""):
            raise forbidden(f"{sql(node)} is an identifying column: grouped without an aggregate, it lists the rows "
                            f"of protected table {table} one by one", ROW_LEVEL_HINT)


def _one_row_per_person(sources: list[Source], anchor: Source) -> bool:
    """Whether each row of the FROM clause belongs to a different person: the anchor is a protected table whose
    unit is unique and not null, and every other table is a reference table, which check_joins admits only joined
    (INNER or LEFT) on one of its unique keys, so that no row of the anchor is repeated."""
    table = anchor.table.protected
    return (table is not None and table.unique_unit
            and all(source is anchor or source.table.kind == "reference" for source in sources))


def _outer(tree: exp.Select, items: list[Item], order: tuple[OrderItem, ...], keys: tuple[exp.Expression, ...],
           checker: Checker, source: str, dp: bool) -> tuple[PostAggregate | None, bool]:
    """The post-aggregate form of the select list, HAVING and ORDER BY, when any of them needs one."""
    kinds = checker.aggregates
    having = tree.args.get("having")
    having_post = having is not None and has_post_aggregate(having.this, kinds)
    order_nodes = tree.args["order"].expressions if tree.args.get("order") is not None else []
    order_post = any(item.position is None and has_post_aggregate(node.this, kinds)
                     for item, node in zip(order, order_nodes, strict=True))
    nodes = [(node.this if isinstance(node, exp.Alias) else node) for node in tree.expressions]
    key_nodes = [canonical(key) for key in keys]
    # dp mode computes there too constant select items and those over GROUP BY expressions that are not one
    # (to_char(date_trunc(...)) grouped by the date_trunc): its own SQL returns only keys and statistics.
    over_keys = [dp and item.kind == "group" and canonical(node) not in key_nodes
                 for node, item in zip(nodes, items, strict=True)]
    if not (any(item.kind == "post" or (dp and item.kind == "constant") for item in items) or any(over_keys)
            or having_post or order_post):
        return None, False
    select = [(node, item.alias, item.kind in ("post", "aggregate", "constant") or derived)
              for node, item, derived in zip(nodes, items, over_keys, strict=True)]
    ordering = [(node.this if item.position is None else None, item.position, item.suffix)
                for item, node in zip(order, order_nodes, strict=True)]
    post_having = having.this if having is not None and having_post else None
    outer = compile_outer(select, post_having, ordering, key_nodes, kinds, canonical, source)
    return outer, having_post


def _post(tree: exp.Select, items: list[Item], order: tuple[OrderItem, ...], keys: tuple[exp.Expression, ...],
          checker: Checker, source: str) -> PostAggregate | None:
    """The select list, HAVING and ORDER BY over the released values, whatever they hold; None when the compiler
    does not write one of them (the back-end then runs the client's own select list)."""
    having = tree.args.get("having")
    order_nodes = tree.args["order"].expressions if tree.args.get("order") is not None else []
    select = [(node.this if isinstance(node, exp.Alias) else node, item.alias,
               item.kind in ("post", "aggregate", "constant"))
              for node, item in zip(tree.expressions, items, strict=True)]
    ordering = [(node.this if item.position is None else None, item.position, item.suffix)
                for item, node in zip(order, order_nodes, strict=True)]
    try:
        return compile_outer(select, having.this if having is not None else None, ordering,
                             [canonical(key) for key in keys], checker.aggregates, canonical, source)
    except Refusal:
        return None


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
    if distinct_pairs.body(node) is not None and join is not None:
        assert isinstance(node, exp.Subquery)
        table = distinct_pairs.resolve(node, index)
        return Source(table, node.this.args["from_"].this, identifier(node.args["alias"].this) or "", join, node)
    if isinstance(node, exp.Subquery) and isinstance(node.this, exp.Select) and node.this.args.get("distinct"):
        raise fanout_keys()
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


def identifier_columns(table: ResolvedTable) -> frozenset[str]:
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
    if protected and protected[0].join is not None and join_side(protected[0].join) == "LEFT":
        # visits LEFT JOIN adult ON visits.person_id = adult.id: every row is a row of the linked table, whose key
        # names its person whether a row of the protected table matches or not (check_joins admits the protected
        # table there only on that key). The unit is the linked table's key, as without the join.
        protected = []  # (a linked table comes first: a reference table cannot, the protected one is joined)
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
        for source in sources:
            if source.table.kind == "protected" and source.table.policy_name != owner.policy_name:
                raise unsupported(f"linked table {anchor.table.policy_name} belongs to {link.references}, not to "
                                  f"{source.table.policy_name}", SHAPE_HINT)
        unit_column = link.column
    unit = f"{quote(anchor.reference)}.{quote(unit_column)}"
    assert owner.protected is not None
    return anchor, unit, owner.policy_name


def _from_sql(sources: list[Source]) -> str:
    """The FROM clause body with its joins, rendered, every table schema-qualified."""
    parts = []
    for source in sources:
        if source.derived is not None:
            assert source.join is not None
            join = source.join.copy()
            join.set("this", distinct_pairs.qualified(source.derived, source.table))
            parts.append(sql(join))
            continue
        table = source.node.copy()
        table.set("this", exp.Identifier(this=source.table.name, quoted=True))
        table.set("db", exp.Identifier(this=source.table.schema, quoted=True))
        if source.join is None:
            parts.append(sql(table))
        else:
            join = source.join.copy()
            join.set("this", table)
            parts.append(sql(join))
    return " ".join(parts)


# --- select list, GROUP BY, ORDER BY --------------------------------------------


def _items(tree: exp.Select, checker: Checker, dp: bool, source: str) -> list[Item]:
    items = []
    for node in tree.expressions:
        alias = None
        expression_node = node
        if isinstance(node, exp.Alias):
            alias = identifier(node.args.get("alias"))
            expression_node = node.this
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
        expression = sql(expression_node)
        # Named as PostgreSQL names it in the client's statement: the rendered spelling may differ (x ^ 2 is
        # rendered POWER(x, 2), which PostgreSQL would call "power").
        name = output_name(node, source) or "?column?"
        items.append(Item(f"{expression} AS {quote(name)}", expression, kind, alias,
                          contains_aggregate(expression_node, checker.aggregates), expression_node, name))
    return items


def _cast_aggregate(node: exp.Expression, kinds: tuple[type[exp.Expression], ...]) -> exp.Expression | None:
    """The aggregate when ``node`` is an aggregate, possibly inside casts and parentheses."""
    node = unwrap(node)
    while isinstance(node, exp.Cast) and _set_args(node) == {"this", "to"} and isinstance(node.args["to"],
                                                                                           exp.DataType):
        node = unwrap(node.this)
    return node if isinstance(node, kinds) else None


def _grouping(tree: exp.Select, items: list[Item],
              checker: Checker) -> tuple[tuple[exp.Expression, ...], tuple[str, ...]]:
    """The grouping expressions (an ordinal or an output alias stands for its select item) and the GROUP BY
    items, rendered (ordinals and aliases kept)."""
    group = tree.args.get("group")
    if group is None:
        return (), ()
    if _set_args(group) != {"expressions"}:
        raise unsupported("ROLLUP, CUBE, GROUPING SETS and GROUP BY ALL are not supported: totals next to "
                          "suppressed cells can reveal them", "GROUP BY plain expressions.")
    if any(isinstance(node, (exp.Rollup, exp.Cube, exp.GroupingSets)) for node in group.expressions):
        raise unsupported("ROLLUP, CUBE and GROUPING SETS are not supported: totals next to suppressed cells can "
                          "reveal them", "GROUP BY plain expressions.")
    aliases = {item.alias: position for position, item in enumerate(items) if item.alias is not None}
    keys: list[exp.Expression] = []
    written = []
    for node in group.expressions:
        written.append(sql(node))
        position = _ordinal(node)
        if position is None and isinstance(node, exp.Column) and node.args.get("table") is None:
            name = identifier(node.this)
            column = checker.input_column(name) if name in aliases else None
            if name in aliases and _same_column(tree, tree.expressions[aliases[name]].this, name):
                checker.key(node, "GROUP BY")
                keys.append(_node(items[aliases[name]]))  # the select item's column: "_"."relationship"
                continue
            if name in aliases and column is False:  # no table has that column: the output alias, as in PostgreSQL
                item = items[aliases[name]]
                if item.kind != "group":
                    raise unsupported(f"GROUP BY {name} must name a column expression, not {item.expression}",
                                      SHAPE_HINT)
                keys.append(_node(item))
                continue
            if name in aliases and column is None:
                raise unsupported(f"GROUP BY {name} is ambiguous: it is both an output alias and maybe a column",
                                  "Group by the expression itself or by its position (GROUP BY 1).")
            # Otherwise a column of a table, which PostgreSQL groups by even when an output alias has its name.
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
            keys.append(_node(item))
            continue
        if isinstance(node, exp.Literal):
            raise unsupported("GROUP BY needs column expressions", SHAPE_HINT)
        checker.key(node, "GROUP BY")
        if not any(isinstance(n, exp.Column) for n in node.walk()):
            raise unsupported("GROUP BY needs column expressions", SHAPE_HINT)
        keys.append(node)
    return tuple(keys), tuple(written)


def _typed(node: exp.Expression, checker: Checker) -> Typed:
    value = checker.typed(node)
    bounded = value.type in bounds.NUMBERS and value.low.is_finite() and value.high.is_finite()
    return Typed(sql(node), value.type, value.low if bounded else None, value.high if bounded else None)


def _argument_types(tree: exp.Select, checker: Checker) -> tuple[Typed, ...]:
    found: list[Typed] = []
    calls = tuple(kind for kind in checker.aggregates if kind is not exp.WithinGroup)
    for node in tree.find_all(*calls):
        if window_function(node):
            continue
        argument = node.this.expressions[0] if isinstance(node.this, exp.Distinct) else node.this
        if argument is None or isinstance(argument, exp.Star):
            continue
        typed = _typed(argument, checker)
        if typed not in found:
            found.append(typed)
    return tuple(found)


def _number(value: Decimal) -> str:
    """A bound as people write it: 10, 2.5, 1e+15 (15 significant digits at most)."""
    with localcontext() as context:
        context.prec = 15
        return format((+value).normalize(), "f") if abs(value) < Decimal("1e15") else f"{+value:.6e}"


def _node(item: Item) -> exp.Expression:
    assert item.node is not None
    return item.node


def _constant(node: exp.Expression) -> bool:
    """Whether ``node`` reads no column and no parameter (its value is the same for every row)."""
    return not any(isinstance(n, (exp.Column, exp.Parameter, exp.Placeholder, exp.Star, exp.Select))
                   for n in node.walk())


# Nodes of a nested query, and those _compute_constants computes (||, make_interval and scalar subqueries).
_QUERIES = (exp.Select, exp.Subquery, exp.SetOperation, exp.Exists)
_NESTED = (*_QUERIES, exp.DPipe, exp.Concat, exp.MakeInterval, exp.Extract)


def _compute_constants(nested: Sequence[exp.Expression]) -> None:
    """Constants PostgreSQL would compute only when a row needs them, computed here (one walk, inner ones first:
    a || b || c, ((SELECT x))): ``||`` of string and integer constants becomes the string it gives (Looker's
    (-6 || ' day')::INTERVAL: a cast of a string constant is checked when the statement is planned, whatever the
    data), and so does ``concat(...)`` of them (PRQL's ``LIKE CONCAT('%', 'x', '%')``), ``make_interval`` of
    number constants becomes the interval constant it gives (MetricFlow's ``make_interval(days => 14)``:
    ``'14 day'::interval``), the epoch of a constant interval becomes its number of seconds (Cube's ``/
    EXTRACT(EPOCH FROM INTERVAL '14 day')``: a constant divisor, as the final SQL check wants it), and ``(SELECT
    x)`` without FROM over constants and the clock becomes ``(x)``, the same value, which the expression allowlist
    then checks (a subquery with an aggregate is not one: (SELECT count(*)) counts its own row)."""
    for node in reversed(nested):  # (a walk's order: inner ones last)
        if isinstance(node, exp.DPipe):
            _fold_concatenation(node)
        elif type(node) is exp.Concat:  # not concat_ws (a subclass), whose first argument separates
            _fold_concat_call(node)
        elif isinstance(node, exp.MakeInterval):
            _fold_make_interval(node)
        elif isinstance(node, exp.Extract):
            _fold_interval_epoch(node)
        elif isinstance(node, exp.Subquery):
            _inline_subquery(node)


def _expand_row_in(tree: exp.Expression) -> None:
    """``(a, b) IN ((x, y), ...)`` (SQLAlchemy's ``tuple_(...).in_(...)``) as ``((a = x AND b = y) OR ...)``:
    PostgreSQL compares rows member by member, NULLs as that AND does, so the comparisons are what the checks read.
    Other row or array forms stay as they are (and are refused by the expression checks)."""
    for node in list(tree.find_all(exp.In)):
        row = node.this
        if not isinstance(row, exp.Tuple) or set(_set_args(node)) != {"this", "expressions"} or not all(
                isinstance(value, exp.Tuple) and len(value.expressions) == len(row.expressions)
                for value in node.expressions):
            continue
        matches = [exp.and_(*(exp.EQ(this=member.copy(), expression=part.copy())
                              for member, part in zip(row.expressions, value.expressions, strict=True)))
                   for value in node.expressions]
        node.replace(exp.Paren(this=exp.or_(*matches)))


def _fold_concatenation(node: exp.DPipe) -> None:
    parts = [_constant_text(node.this), _constant_text(node.expression)]
    if parts[0] is not None and parts[1] is not None and set(_set_args(node)) <= {"this", "expression", "safe"}:
        node.replace(exp.Literal.string(parts[0] + parts[1]))


def _fold_concat_call(node: exp.Concat) -> None:
    """concat() of string and integer constants (none NULL) as the string it gives."""
    parts = [_constant_text(argument) for argument in node.expressions]
    if parts and None not in parts and set(_set_args(node)) <= {"expressions", "safe", "coalesce"}:
        node.replace(exp.Literal.string("".join(part for part in parts if part is not None)))


# make_interval's arguments (sqlglot names them by the unit, which interval input reads as written).
_INTERVAL_UNITS = frozenset(exp.MakeInterval.arg_types)


def _fold_make_interval(node: exp.MakeInterval) -> None:
    parts: list[str] = []
    for name, value in node.args.items():
        if value is None:
            continue
        if name not in _INTERVAL_UNITS:
            return
        value = value.expression if isinstance(value, exp.Kwarg) else value
        text = _constant_text(value, strings=False)
        if text is None:
            return
        parts.append(f"{text} {name}")
    node.replace(exp.cast(exp.Literal.string(" ".join(parts) or "0 second"), exp.DataType.Type.INTERVAL))


def _fold_interval_epoch(node: exp.Extract) -> None:
    field, source = node.this, node.expression
    if not isinstance(field, exp.Var) or field.name.lower() != "epoch" or set(_set_args(node)) != {"this",
                                                                                                  "expression"}:
        return
    if isinstance(source, exp.Interval) and isinstance(source.this, exp.Literal) and source.this.is_string:
        unit = source.args.get("unit")
        text = f"{source.this.name} {unit.name}" if isinstance(unit, exp.Var) else source.this.name
    elif isinstance(source, exp.Cast) and source.to.is_type(exp.DataType.Type.INTERVAL) \
            and isinstance(source.this, exp.Literal) and source.this.is_string:
        text = source.this.name
    else:
        return
    interval = tv.parse_interval(text)
    if interval is not None:
        node.replace(exp.Literal.number(format(interval.epoch_seconds.quantize(Decimal("0.000001")), "f")))


def _constant_text(node: exp.Expression, *, strings: bool = True) -> str | None:
    """The text form of an integer constant (-6 included), or of a string constant unless ``strings`` is false (the
    interval proof reads integer-unit pairs only); None for anything else."""
    while isinstance(node, exp.Paren):
        node = node.this
    sign = ""
    if isinstance(node, exp.Neg):
        sign, node = "-", node.this
    if not isinstance(node, exp.Literal):
        return None
    text = str(node.this)
    if node.is_string:
        return text if strings and not sign else None
    return sign + text if text.isdigit() else None


def _inline_subquery(node: exp.Subquery) -> None:
    if _set_args(node) != {"this"}:
        return
    inner = node.this
    if isinstance(inner, exp.Select) and _set_args(inner) == {"expressions"} and len(inner.expressions) == 1 \
            and not isinstance(inner.expressions[0], exp.Alias):
        inner = inner.expressions[0]
    if isinstance(unparen(inner), (exp.Literal, exp.Neg)):
        return  # (SELECT 1) is no number: GROUP BY (1) or ORDER BY (1) would name a select item's position
    if not isinstance(inner, exp.Query) and not any(isinstance(part, _NOT_CONSTANT) for part in inner.walk()):
        node.replace(exp.Paren(this=inner))


# What a subquery's expression may not hold to be inlined: it must be a constant (or the clock).
_NOT_CONSTANT = (exp.Column, exp.Parameter, exp.Placeholder, exp.Query, exp.Star, exp.AggFunc, exp.Window)


def _qualify_bare_columns(tree: exp.Select, nodes: list[exp.Expression], scope: Scope) -> None:
    """Where a query names a column both bare and qualified (``select sex ... group by a.sex``), qualify the bare
    ones as PostgreSQL resolves them, so that every comparison that follows (GROUP BY keys, select items, ORDER
    BY, HAVING) sees one expression. Only a name exactly one table has, when every table's columns are known
    (else PostgreSQL decides); never a bare ORDER BY name of an output alias (it names that select item)."""
    columns = [node for node in nodes if isinstance(node, exp.Column) and isinstance(node.this, exp.Identifier)]
    qualified = {(identifier(node.args["table"]), identifier(node.this)) for node in columns
                 if node.args.get("table") is not None and node.args.get("db") is None}
    if not qualified:
        return
    aliases = {identifier(item.args["alias"]) for item in tree.expressions
               if isinstance(item, exp.Alias) and item.args.get("alias") is not None}
    order = tree.args.get("order")
    ordered = {id(node.this) for node in (order.expressions if order is not None else [])
               if isinstance(node, exp.Ordered) and isinstance(node.this, exp.Column)}
    for node in columns:
        name = identifier(node.this) or ""
        if node.args.get("table") is not None or (id(node) in ordered and name in aliases):
            continue
        owners = scope.owners(name)
        if owners is not None and len(owners) == 1 and (owners[0], name) in qualified:
            node.set("table", exp.Identifier(this=owners[0], quoted=True))


def _arrays_as_lists(nodes: list[exp.Expression]) -> None:
    """``x = ANY(ARRAY[a, b])`` is ``x IN (a, b)`` and ``x <> ALL(ARRAY[a, b])`` is ``x NOT IN (a, b)`` (SQL
    defines them so): rewritten to the lists, which the rules for IN then check. Other uses of ANY and ALL (an
    array parameter, other comparisons) stay as written, and are refused."""
    for node in nodes:
        if isinstance(node, exp.EQ) and isinstance(node.expression, exp.Any):
            values = _array_values(node.expression.this)
            if values is not None:
                node.replace(exp.In(this=node.this, expressions=values))
        elif isinstance(node, exp.NEQ) and isinstance(node.expression, exp.Anonymous) \
                and node.expression.name.lower() == "all" and len(node.expression.expressions) == 1:
            values = _array_values(node.expression.expressions[0])
            if values is not None:
                node.replace(exp.Not(this=exp.In(this=node.this, expressions=values)))


def _array_values(node: exp.Expression) -> list[exp.Expression] | None:
    """The elements of ``ARRAY[...]`` (in parentheses or not), if ``node`` is one of constants and parameters
    (an element over columns would give the array a common type that casts them: not quite the list)."""
    node = unwrap(node)
    if not isinstance(node, exp.Array) or not node.expressions or node.args.get("value_constructor"):
        return None
    return list(node.expressions) if all(_constant_element(element) for element in node.expressions) else None


def _constant_element(node: exp.Expression) -> bool:
    """A constant, a negative number or a $n parameter."""
    node = unwrap(node)
    if isinstance(node, exp.Neg):
        node = node.this
    return isinstance(node, (exp.Literal, exp.Parameter, exp.Null, exp.Boolean))


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


def _order(tree: exp.Select, items: list[Item], checker: Checker) -> tuple[OrderItem, ...]:
    order = tree.args.get("order")
    if order is None:
        return ()
    if _set_args(order) != {"expressions"}:
        raise unsupported("unsupported ORDER BY", SHAPE_HINT)
    aliases = {item.alias: position for position, item in enumerate(items, 1) if item.alias is not None}
    canonical_items: list[exp.Expression] = []  # made when an ORDER BY expression is matched to them
    result = []
    for node in order.expressions:
        if not isinstance(node, exp.Ordered) or _set_args(node) - {"this", "desc", "nulls_first"}:
            raise unsupported("unsupported ORDER BY item", SHAPE_HINT)
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
            canonical_items = canonical_items or [canonical(unwrap(node)) for node in tree.expressions]
            wanted = canonical(unwrap(target))
            matches = [i for i, item in enumerate(canonical_items, 1) if item == wanted]
            position = matches[0] if matches else None
        suffix = _order_suffix(node)
        result.append(OrderItem(f"{sql(target)} {suffix}".rstrip(), suffix, position,
                                f"{render.written(target)} {suffix}".rstrip()))
    return tuple(result)


def _order_suffix(node: exp.Ordered) -> str:
    """DESC and NULLS FIRST/LAST as PostgreSQL reads them; "" for its default (ascending, nulls last)."""
    descending = bool(node.args.get("desc"))
    words = ["DESC"] if descending else []
    if bool(node.args.get("nulls_first")) != descending:  # PostgreSQL puts nulls first only when descending
        words.append("NULLS FIRST" if node.args.get("nulls_first") else "NULLS LAST")
    return " ".join(words)


def _tail(tree: exp.Select) -> str | None:
    """LIMIT / FETCH and OFFSET, rendered (checked by _check_tail)."""
    parts = [sql(tree.args[key]) for key in ("limit", "offset") if tree.args.get(key) is not None]
    return " ".join(parts) or None


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


def _aggregate_texts(tree: exp.Select, kinds: tuple[type[exp.Expression], ...]) -> tuple[AggregateText, ...]:
    """Every aggregate call of the statement (quantiles WITHIN GROUP aside), each once."""
    found: list[AggregateText] = []
    calls = tuple(kind for kind in kinds if kind is not exp.WithinGroup)
    for node in tree.find_all(*calls):
        if isinstance(node.parent, exp.WithinGroup) or window_function(node):
            continue
        argument_node = node.this
        if isinstance(argument_node, exp.Distinct):
            argument_node = argument_node.expressions[0] if len(argument_node.expressions) == 1 else None
        if argument_node is None:
            raise unsupported("an aggregate needs one argument", SHAPE_HINT)
        argument = None if isinstance(node, exp.Count) and isinstance(argument_node, exp.Star) else sql(argument_node)
        whole: exp.Expression = node
        condition = None
        if isinstance(node.parent, exp.Filter) and node.parent.this is node:
            whole = node.parent
            condition = sql(whole.expression.this)
        entry = AggregateText(canonical(whole), sql(whole), argument, condition)
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
