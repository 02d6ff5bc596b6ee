"""Suppression SQL for the nested shapes of :mod:`anonproxy.plan.outer`, from the inner query's suppression SQL.

* An outer query over an aggregate query runs over the inner query's
  suppressed answer, as a materialized WITH query: ``WITH anonproxy_released
  AS MATERIALIZED (<inner suppression SQL>) <outer query>``. It sees exactly
  the rows the client would have received (the suppressed-rest row
  included), and none of its conditions runs inside the suppression SQL.
  When it joins several aggregate queries' rows, each is suppressed on its
  own, as if sent alone (``anonproxy_released_2`` ...).
* Superset's series limit: the outer query's own suppression SQL, its WHERE
  clause restricted to the keys the top-N query released:
  ``(key, ...) IN (SELECT <columns> FROM (<top-N suppression SQL>) AS anonproxy_top)``;
  each of the two questions is gated on its own, and the restriction reads
  only released keys. Keys joined with IS NOT DISTINCT FROM (Tableau) match
  NULL to NULL: ``EXISTS (SELECT 1 FROM (<top-N suppression SQL>) AS
  anonproxy_top(c1, ...) WHERE (key) IS NOT DISTINCT FROM anonproxy_top.c1
  ...)``, with the top-N query's suppressed-rest row left out (its NULL keys
  are no released key). The keys are checked as WHERE conditions of the
  outer query: they run on its rows.
"""

from __future__ import annotations

from dataclasses import replace

from anonproxy.plan import unit_groups
from anonproxy.plan.analysis import analyze
from anonproxy.plan.outer import ROWS, Outer, Series
from anonproxy.plan.render import sql
from anonproxy.plan.shape import Nested, Single, named
from anonproxy.plan.tables import PolicyIndex, quote
from anonproxy.policy.model import SuppressionParams
from anonproxy.suppress.rewrite import rewrite

TOP = "anonproxy_top"


def suppressed(shape: Single | Nested, index: PolicyIndex, params: SuppressionParams) -> str:
    """The suppression SQL of ``shape``."""
    if isinstance(shape, Single):
        return rewrite(analyze(shape.statement, shape.tree, index, params), params)
    post = shape.post
    if isinstance(post, Outer):
        inputs = [(ROWS, post.names, shape.inner.tree), *((more.name, more.names, more.inner) for more in post.more)]
        analyses = [(name, names, analyze(shape.inner.statement, tree, index, params)) for name, names, tree in inputs]
        for _, _, query in analyses:
            unit_groups.check(query, dp=False)
        # MATERIALIZED: a fence. PostgreSQL would inline a WITH query read once and push the outer query's
        # conditions into it, into the HAVING of a total's suppression, ahead of its rules: an error there (an
        # overflow) would depend on a withheld value.
        released = ",\n".join(
            f"{name}({', '.join(quote(column) for column in names)}) AS MATERIALIZED (\n"
            f"{rewrite(query, params)}\n)" for name, names, query in analyses)
        return f"WITH {released}\n{post.sql()}"
    assert isinstance(post, Series)
    rest = named(post.rest, [], shape.inner.statement)
    # The ON keys run on the outer query's rows: they pass the checks of its WHERE condition (identifying
    # columns, the no-error proof), as in dp mode, where the restriction is the second question's WHERE.
    query = analyze(rest.statement, rest.tree, index, params, conditions=post.conditions())
    null_safe = any(post.null_safe)
    top = replace(params, suppressed_rest=False) if null_safe else params
    inner = rewrite(analyze(shape.inner.statement, shape.inner.tree, index, top), top)
    if null_safe:
        names = [f"anonproxy_c{i}" for i in range(1, len(post.names) + 1)]  # no bare key can mean these
        matches = " AND ".join(
            f"({sql(key)}) {'IS NOT DISTINCT FROM' if post.is_null_safe(i) else '='} "
            f"{TOP}.{names[position]}" for i, (key, position) in enumerate(post.keys))
        restriction = (f"EXISTS (SELECT 1 FROM (\n{inner}\n) AS {TOP}({', '.join(names)})\n"
                       f"  WHERE {matches})")
    else:
        keys = ", ".join(f"({sql(key)})" for key, _ in post.keys)
        columns = ", ".join(quote(post.names[position]) for _, position in post.keys)
        restriction = f"({keys}) IN (SELECT {columns} FROM (\n{inner}\n) AS {TOP})"
    where = restriction if query.where is None else f"({query.where})\n  AND {restriction}"
    return rewrite(replace(query, where=where), params)
