"""Run the front end's passes on the one parse of a gated query and say which shape it has.

:func:`prepare` takes the statement and its tree (parsed once by the
classifier), drops the connected database from table names, inlines WITH
queries, normalises column names and flattens derived tables
(:mod:`anonproxy.plan.names`, :mod:`anonproxy.plan.flatten`), then returns
one of:

* :class:`Single`: one SELECT for the back-ends, the tree of the client's
  statement (changed in place by the passes; never parsed again). When a
  pass changed the select list, every item whose name PostgreSQL would have
  derived from the client's spelling gets it as an explicit alias, so the
  output columns keep the names the client's statement gives them.
* :class:`Nested`: an aggregate query (its :class:`Single`) and what is done
  with its released rows (:class:`anonproxy.plan.outer.Outer`, which may join
  the released rows of further aggregate queries, or
  :class:`anonproxy.plan.outer.Series`). A set operation of aggregate queries
  (:mod:`anonproxy.plan.set_operations`) is an :class:`anonproxy.plan.outer.Outer`
  too: the set operation combines the branches' released rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlglot import exp

from anonproxy.plan import fanout, spines
from anonproxy.plan import outer as outer_shapes
from anonproxy.plan.flatten import (
    flatten,
    flatten_branches,
    inline_ctes,
    over_released,
    released,
)
from anonproxy.plan.names import drop_database, normalize, output_name, sources
from anonproxy.plan.refusals import fanout_keys, unsupported
from anonproxy.plan.statements import Statement
from anonproxy.plan.tables import PolicyIndex


@dataclass(frozen=True)
class Single:
    statement: Statement
    tree: exp.Expression


@dataclass(frozen=True)
class Nested:
    inner: Single  # the aggregate query, gated like any other
    post: outer_shapes.Outer | outer_shapes.Series


Shape = Single | Nested
_NESTING = (exp.Subquery, exp.With, exp.CTE, exp.SetOperation)  # what the passes take apart (with three-part column names)


def prepare(statement: Statement, tree: exp.Expression, index: PolicyIndex) -> Shape:
    """The shape of ``tree`` (which is changed in place)."""
    drop_database(tree, index.policy.database)
    spines.give_series_a_from(tree)  # MetricFlow's FROM-less spine: now generate_series in FROM
    spines.rewrite_joined(tree, statement.source)  # a spine joined to rows: now the spine beside an aggregate query
    if not any(isinstance(node, _NESTING) or (isinstance(node, exp.Column) and node.args.get("db") is not None)
               for node in tree.walk()):
        return Single(statement, tree)  # the usual case: nothing for the passes to do
    names = [output_name(item, statement.source) for item in tree.expressions] \
        if isinstance(tree, exp.Select) else []
    changed = inline_ctes(tree)
    changed = normalize(tree, index) or changed
    changed = fanout.rewrite(tree, index) or changed  # before flatten: the keys table is still whole
    if isinstance(tree, exp.SetOperation):
        changed = flatten_branches(tree, statement.source) or changed
        if released(tree):
            return _nested(outer_shapes.outer(tree, statement.source), statement)
    if not isinstance(tree, exp.Select):
        return Single(statement, tree) if not changed else named(tree, [], statement)
    changed = flatten(tree, statement.source) or changed
    if over_released(tree):
        post = outer_shapes.outer(tree, statement.source)
        assert isinstance(post.outer, exp.Select)
        _name_items(post.outer, names)
        return _nested(post, statement)
    position = outer_shapes.nested_aggregate(tree)
    if position is None:
        return Single(statement, tree) if not changed else named(tree, names, statement)
    if position == 0 and _joins_distinct_keys(tree):
        raise fanout_keys()
    if position == 0:
        raise unsupported("an aggregate query nested in FROM cannot be joined to other tables (except as "
                          "Superset's series limit)", outer_shapes.SERIES_HINT)
    series = outer_shapes.series(tree, position, statement.source)
    _name_items(series.rest, names)
    return Nested(named(series.top, [output_name(item, statement.source) for item in series.top.expressions],
                        statement), series)


def _joins_distinct_keys(tree: exp.Select) -> bool:
    """Whether some SELECT in ``tree`` joins a SELECT DISTINCT derived table to another FROM item: the keys CTE
    Lightdash joins back to the table whose rows a one-to-many join repeats."""
    return any(len(items) > 1 and any(isinstance(item, exp.Subquery) and isinstance(item.this, exp.Select)
                                      and item.this.args.get("distinct") is not None for item in items)
               for items in (sources(select) for select in tree.find_all(exp.Select)))


def _nested(post: outer_shapes.Outer, statement: Statement) -> Nested:
    for more in post.more:
        named(more.inner, list(more.names), statement)
    return Nested(named(post.inner, list(post.names), statement), post)


def named(tree: exp.Expression, names: list[str | None], statement: Statement) -> Single:
    """``tree`` for the back-ends; its select items get the names PostgreSQL gave them in the client's statement."""
    if isinstance(tree, exp.Select):
        _name_items(tree, names)
    return Single(statement, tree)


def _name_items(select: exp.Select, names: list[str | None]) -> None:
    """Alias the first ``len(names)`` items with their names (None: PostgreSQL's ``?column?``)."""
    items = []
    for position, item in enumerate(select.expressions):
        if position >= len(names) or isinstance(item, (exp.Alias, exp.Star)) \
                or (isinstance(item, exp.Column) and isinstance(item.this, exp.Star)):
            items.append(item)
        else:
            items.append(exp.Alias(this=item, alias=exp.Identifier(this=names[position] or "?column?", quoted=True)))
    select.set("expressions", items)
