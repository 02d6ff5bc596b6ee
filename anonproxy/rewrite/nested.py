"""Suppression SQL for the nested shapes of :mod:`anonproxy.plan.outer`, from the inner query's suppression SQL.

* An outer query over an aggregate query runs over the inner query's
  suppressed answer, as a WITH query: ``WITH anonproxy_released AS
  (<inner suppression SQL>) <outer query>``. It sees exactly the rows the
  client would have received (the suppressed-rest row included).
* Superset's series limit: the outer query's own suppression SQL, its WHERE
  clause restricted to the keys the top-N query released:
  ``(key, ...) IN (SELECT <columns> FROM (<top-N suppression SQL>) AS anonproxy_top)``;
  each of the two questions is gated on its own, and the restriction reads
  only released keys.
"""

from __future__ import annotations

from dataclasses import replace

from anonproxy.plan.outer import ROWS, Outer, Series
from anonproxy.plan.shape import Nested, Parse, Single, render
from anonproxy.policy.model import SuppressionParams
from anonproxy.rewrite.analytic import analyze
from anonproxy.rewrite.names import PolicyIndex, quote
from anonproxy.rewrite.statements import DIALECT
from anonproxy.rewrite.suppress import rewrite

TOP = "anonproxy_top"


def suppressed(shape: Single | Nested, index: PolicyIndex, params: SuppressionParams, parse: Parse) -> str:
    """The suppression SQL of ``shape``; ``parse`` is the classifier's parser (to read the series' outer query)."""
    if isinstance(shape, Single):
        return rewrite(analyze(shape.statement, shape.tree, index, params), params)
    inner = rewrite(analyze(shape.inner.statement, shape.inner.tree, index, params), params)
    post = shape.post
    if isinstance(post, Outer):
        columns = ", ".join(quote(name) for name in post.names)
        return f"WITH {ROWS}({columns}) AS (\n{inner}\n)\n{post.sql()}"
    assert isinstance(post, Series)
    rest = render(post.rest, [], parse)
    query = analyze(rest.statement, rest.tree, index, params)
    names = post.names
    keys = ", ".join(f"({key.sql(dialect=DIALECT)})" for key, _ in post.keys)
    columns = ", ".join(quote(names[position]) for _, position in post.keys)
    restriction = f"({keys}) IN (SELECT {columns} FROM (\n{inner}\n) AS {TOP})"
    where = restriction if query.where is None else f"({query.where})\n  AND {restriction}"
    return rewrite(replace(query, where=where), params)
