"""Least privilege: the relations a statement over protected data may read.

A gated statement runs on the service connection, which can read more than
the client's own login: catalog views such as ``pg_stats`` or
``pg_stat_activity`` show the service role what they hide from the client, and
any relation joined to protected rows becomes a side channel (a ``LEFT JOIN``
whose condition singles out one person turns every aggregate into a question
about that person). So a statement that reads a protected or linked table may
read nothing else: every relation anywhere in it (FROM, joins, subqueries,
CTE bodies, set operations) must be one the policy declares as protected,
linked, or a reference table (public data, joined many-to-one on a unique key:
:mod:`anonproxy.plan.joins` checks how). Anything else is refused with 42501 and named as PostgreSQL would
resolve it under the default search path (``pg_database`` is
``pg_catalog.pg_database``).

Statements that read no protected table never come here: they pass under the
client's own login (see :mod:`anonproxy.route.decide`).
"""

from __future__ import annotations

from sqlglot import exp

from anonproxy.plan.refusals import forbidden
from anonproxy.plan.tables import PolicyIndex, identifier

_SCOPE = ("a query over protected data may read only the protected table and its linked tables, and the "
          "reference tables the policy declares")


def check_relations(tree: exp.Expression, index: PolicyIndex, dp: bool) -> None:
    """Refuse (42501) the first relation in ``tree`` that the policy does not declare protected, linked or reference."""
    ctes = {identifier(cte.args["alias"].this) for cte in tree.find_all(exp.CTE)
            if isinstance(cte.args.get("alias"), exp.TableAlias)}
    for table in tree.find_all(exp.Table):
        if not isinstance(table.this, exp.Identifier):
            continue  # a function in FROM: not a relation; analyze() refuses it
        if isinstance(table.parent, exp.Into):
            continue  # the table SELECT INTO would create, not a relation read: analyze() refuses SELECT INTO
        if table.args.get("db") is None and identifier(table.this) in ctes:
            continue  # a CTE's name, not a relation; analyze() refuses WITH, and the CTE's body is walked
        resolved = index.resolve(table)
        if resolved.kind == "plain":
            raise forbidden(f"relation {resolved.policy_name} is not part of the privacy policy: {_SCOPE}",
                            _hint(resolved.policy_name, dp))


def _hint(name: str, dp: bool) -> str:
    alone = f"Query {name} in a statement of its own (statements without protected tables run under your own login)"
    reference = ("; a public dimension table can be joined once the DBA declares it a reference table "
                 "(anonproxy.declare_reference_table)")
    if dp:
        return (f"{alone}. In dp mode a query reads one protected table and its linked tables, joined on their "
                f"declared keys, so that every row belongs to one person{reference}.")
    return f"{alone}; join a protected table only to its linked tables, on the declared key{reference}."
