"""Issue 24: dp's contribution bounding on a linked table, streamed rather than materialized, with its meaning kept.

Where a person may have several rows (``public.visits``: one to five per person), the bounded SQL keeps at most c
rows per person and group and g groups per person, chosen at random (docs/dp.md, "The rewrite"). Its rows are read
by subqueries, not by a CTE that holds a random number: PostgreSQL materializes a CTE with a volatile function (all
the rows written out, to disk past ``work_mem``), and the subquery lets the unit's index order the window. These
tests run the plan's SQL on the gated database and compare it with what PostgreSQL computes from the rows: the plan
materializes none of the rows, bounds that drop nothing give PostgreSQL's own figures, and the rows kept are drawn
with the probabilities the bounding defines (mean and spread over repeated runs).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.policy.store import load_policy

BY_CHANNEL = "select channel, count(*) from visits group by channel"
MONTHLY = "select date_trunc('month', visited_at) as month, count(*) from visits group by 1"
JOINED = ("select a.sex, count(*), sum(v.amount) from adult a join visits v on v.person_id = a.id "
          "group by a.sex")
BOUNDED_CTES = {"anonproxy_rows", "anonproxy_cells", "anonproxy_bounded"}
RUNS = 40  # repeated runs of one plan for the mean and spread of its random choice


def _plan(truth: psycopg.Connection, sql: str, groups: int, rows: int) -> DPPlan:
    policy = load_policy(truth)
    params = DPParams(0.5, 1e-7, max_groups_per_unit=groups, max_rows_per_unit=rows)
    plan = plan_dp(sql, policy.role("analyst"), policy, params)
    assert isinstance(plan, DPPlan), plan
    assert (plan.max_groups_per_unit, plan.max_rows_per_unit) == (groups, rows)
    return plan


def _run(truth: psycopg.Connection, sql: str) -> list[tuple[Any, ...]]:
    """The plan's SQL with the service session's search_path, as the proxy sends it."""
    with truth.transaction():
        truth.execute("SET LOCAL search_path = pg_catalog")
        return truth.execute(sql).fetchall()


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from _nodes(child)


def _counts(truth: psycopg.Connection, plan: DPPlan) -> dict[str, int]:
    """The channel question's count of bounded rows per channel (with c = 1 a count of people: the same rows)."""
    kinds = [stat.kind for stat in plan.statistics]
    index = kinds.index("rows" if "rows" in kinds else "units")
    return {row[0]: row[1 + index] for row in _run(truth, plan.sql)}


@pytest.mark.parametrize("sql", [BY_CHANNEL, MONTHLY, JOINED])
@pytest.mark.parametrize(("groups", "rows"), [(1, 1), (5, 1), (2, 3)])
def test_the_bounded_rows_are_streamed_not_materialized(truth: psycopg.Connection, sql: str, groups: int,
                                                        rows: int) -> None:
    plan = _plan(truth, sql, groups, rows)
    ((explained,),) = _run(truth, f"EXPLAIN (FORMAT JSON) {plan.sql}")
    nodes = list(_nodes(explained[0]["Plan"]))  # psycopg loads the json column
    materialized = {node.get("CTE Name") for node in nodes if node["Node Type"] == "CTE Scan"}
    assert not materialized & BOUNDED_CTES, materialized
    assert any(node["Node Type"] == "WindowAgg" for node in nodes)  # visits.person_id is not unique: it bounds


@pytest.mark.parametrize("sql", [BY_CHANNEL, JOINED])
@pytest.mark.parametrize(("groups", "rows"), [(1, 1), (2, 3)])
def test_the_branch_the_guard_rules_out_is_never_started(truth: psycopg.Connection, sql: str, groups: int,
                                                         rows: int) -> None:
    """visits.person_id is not unique: the guard is false, so the branch over the rows as they are (one row per
    person) must not run, nor launch parallel workers (each a process that competes with the bounding for the
    cores). Parallel plans are made free here so that PostgreSQL plans workers for that branch whatever the test
    tables' size. The answer still lists every group PostgreSQL sees in the rows."""
    plan = _plan(truth, sql, groups, rows)
    with truth.transaction():
        truth.execute("SET LOCAL search_path = pg_catalog")
        for setting in ("parallel_setup_cost", "parallel_tuple_cost", "min_parallel_table_scan_size"):
            truth.execute(f"SET LOCAL {setting} = 0")
        ((explained,),) = truth.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {plan.sql}").fetchall()
        answered = truth.execute(plan.sql).fetchall()
    (append,) = [node for node in _nodes(explained[0]["Plan"]) if node["Node Type"] == "Append"]
    plain, bounded = append["Plans"]  # the UNION ALL's two branches
    below = [node for child in plain["Plans"] if child["Parent Relationship"] != "InitPlan" for node in _nodes(child)]
    assert any(node["Node Type"] in ("Gather", "Gather Merge") for node in below), "no parallel plan to check"
    assert all(node["Actual Loops"] == 0 and node.get("Workers Launched", 0) == 0 for node in below), below
    windows = [node for node in _nodes(bounded) if node["Node Type"] == "WindowAgg"]
    assert windows and all(node["Actual Loops"] == 1 for node in windows)  # the bounding ran
    seen = {row[0] for row in truth.execute(sql.replace("count(*), sum(v.amount)", "count(*)"))}
    assert {row[0] for row in answered} == seen


@pytest.mark.parametrize("rows", [1, 2])
def test_bounds_that_drop_no_group_count_what_postgresql_counts(truth: psycopg.Connection, rows: int) -> None:
    """g = 5: nobody has visits in more than five channels (four exist), so each person keeps every channel and
    min(c, their visits there) rows of it."""
    expected = dict(truth.execute("select channel, sum(least(%s, n))::int from (select person_id, channel, "
                                  "count(*) as n from visits group by 1, 2) as per_person group by 1",
                                  [rows]).fetchall())
    assert _counts(truth, _plan(truth, BY_CHANNEL, 5, rows)) == expected


@pytest.mark.parametrize("rows", [1, 2])
def test_each_person_keeps_a_group_drawn_in_proportion_to_their_rows(truth: psycopg.Connection, rows: int) -> None:
    """g = 1: a person keeps one channel, each with probability (their visits there) / (their visits), and
    min(c, their visits there) rows of it (c = 1 takes the one-random-row form, c = 2 the general one). Over repeated
    runs each channel's mean is PostgreSQL's expectation from the rows, and its variance the draws' variance: a
    choice that was not random (the first row of each person, say) would not vary at all."""
    moments = truth.execute(
        "select channel, sum(q * k), sum(q * (1 - q) * k * k) from (select channel, n::float8 / "
        "sum(n) over (partition by person_id) as q, least(%s, n) as k from (select person_id, channel, count(*) as n "
        "from visits group by 1, 2) as per_person) as chances group by 1", [rows]).fetchall()
    plan = _plan(truth, BY_CHANNEL, 1, rows)
    runs = [_counts(truth, plan) for _ in range(RUNS)]
    ratios = []
    for channel, mean, variance in moments:
        values = [run[channel] for run in runs]
        average = sum(values) / RUNS
        assert abs(average - mean) <= 5 * math.sqrt(variance / RUNS), (channel, average, mean, variance)
        ratios.append(sum((v - average) ** 2 for v in values) / (RUNS - 1) / variance)
    assert 0.5 <= sum(ratios) / len(ratios) <= 1.7, ratios
