"""The dp back-end's decisions around one question, without I/O.

The proxy (:mod:`anonproxy.proxy.noisy`) does the I/O of a dp answer: the
ledger's round trips, the bounded SQL on the service connection, the post
statement. What it asks this module:

* :func:`plan_checked`: the plan of a statement (:mod:`anonproxy.dp.plan`)
  and PostgreSQL's parser's reading of its SQL (the final SQL check), run
  in the worker's analysis process;
* :func:`fingerprint`: the key of the answer cache, taken from the plan;
* :func:`explained`: what EXPLAIN (ANONPROXY) says about a question;
* :func:`series_question`: the second question of Superset's series limit,
  once the first one's released keys are known;
* the per-query cost when a budget does not set one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import replace
from decimal import Decimal

from anonproxy.dp import ledger
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.plan import render
from anonproxy.plan.outer import Series
from anonproxy.policy.model import Policy, RolePolicy
from anonproxy.rewrite.decision import Refusal, Reject
from anonproxy.rewrite.final_sql import verify

# Used when a budget does not say what one query costs.
DEFAULT_EPSILON = Decimal("0.5")
DEFAULT_DELTA = Decimal("1e-7")
DEFAULT_COSTS = (DEFAULT_EPSILON, DEFAULT_DELTA)


def plan_checked(sql: str, role: RolePolicy, policy: Policy, params: DPParams) -> DPPlan | Reject:
    """``plan_dp``, then PostgreSQL's own parser reads the plan's SQL (and its post statement) again (the final SQL
    check); run in the analysis process, so a long statement's check does not hold up the event loop either."""
    plan = plan_dp(sql, role, policy, params)
    if isinstance(plan, DPPlan):
        try:
            verify(plan.sql, policy, role.role)
            if plan.post is not None:
                verify(plan.post.sql, policy, role.role)
        except Refusal as refusal:
            return refusal.reject
    return plan


def fingerprint(plan: DPPlan, policy_version: int, parameters: object) -> str:
    """The answer cache's key: the whole plan (post-processing and cost included), the policy it obeys and the
    bound values, so the same question asked again, however it is spelled, gets the same answer at no cost. What
    is done with the released rows next (``plan.nested``) is free post-processing: not part of the question."""
    return hashlib.sha256(f"{policy_version}\0{replace(plan, nested=None)!r}\0{parameters!r}".encode()).hexdigest()


def explained(plan: DPPlan, found: ledger.Lookup) -> list[str]:
    """What EXPLAIN (ANONPROXY) says about one question: its cost and noise, and whether it is cached."""
    if plan.free:
        return [f"the declared public domain, from the policy: reads no row of {plan.table}, costs nothing"]
    lines = [(f"differentially private answer on {plan.table}: costs ε={plan.epsilon:g}, δ={plan.delta:g} "
              f"(basic composition), or ρ={plan.rho:.4g}, δ={plan.delta_add:g} (zCDP)"),
             *(f"  {line}" for line in plan.notices())]
    if found.answer is not None:
        lines.append("cached: the same question was answered on the current data; asking it again costs nothing")
    elif found.data_version is None:
        lines.append(f"not cacheable: the data version of {', '.join(plan.tables)} is unknown; every run is charged")
    else:
        lines.append("not cached: running it charges the cost above")
    return lines


def series_question(series: Series, released: Iterable[tuple[bytes | None, ...]]) -> str:
    """The series limit's second question: its outer query restricted to the keys the first one released (rows
    in text format, as the answer holds them)."""
    keys = [series.key_values(row_texts(row)) for row in released]
    return render.sql(series.question(series.restriction(keys)))


def row_texts(row: tuple[bytes | None, ...]) -> tuple[str | None, ...]:
    return tuple(None if value is None else value.decode() for value in row)


def per_query(budget: ledger.Remaining, setting: str) -> Decimal:
    """What one query costs under ``budget``: ``setting`` is "epsilon" or "delta"."""
    return or_default(budget.epsilon_per_query if setting == "epsilon" else budget.delta_per_query, setting)


def or_default(value: Decimal | None, setting: str) -> Decimal:
    return value if value is not None else default_cost(setting)


def default_cost(setting: str) -> Decimal:
    return DEFAULT_EPSILON if setting == "epsilon" else DEFAULT_DELTA
