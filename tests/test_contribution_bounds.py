"""Contribution bounds a DBA declares per dp role and protected table (sql/0034, docs/dp.md "Contribution bounds"):
set in SQL and YAML, read by the plan, through the real proxy.

The gated database holds the demo's ``public.adult`` (one row per person: ``id`` is its primary key) and
``public.visits`` (1 to 5 visits per person, linked on person_id, visited_at bounded to 2025–2026); each test that
queries gets a dp role of its own (ε 20 in all, 0.5 and δ 1e-7 per query, zCDP).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role, wait_for_current_policy

from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import Policy
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import PolicyError, dump_policy, parse_policy

_names = itertools.count(1)
MONTHLY = ("select date_trunc('month', visited_at) as month, count(*) from visits "
           "group by date_trunc('month', visited_at) order by 1")
EXACT_MONTHLY = ("select date_trunc('month', visited_at), count(*) from visits "
                 "group by 1 order by 1")
ZCDP = DPParams(0.5, 1e-7, accounting="zcdp")  # what the proxy prices a question of these roles at


@contextmanager
def dp_role(truth: psycopg.Connection, proxy: Endpoint, database: str, groups: int | None = None,
            rows: int = 1) -> Iterator[str]:
    """A fresh dp role; with ``groups``, its declared bounds on public.adult, known to every worker."""
    with fresh_dp_role(truth, proxy, database, f"dp_bounds_{next(_names)}", epsilon=20) as role:
        if groups is not None:
            truth.execute("select anonproxy.set_contribution_bounds(%s, 'public.adult', %s, %s)", [role, groups, rows])
            wait_for_current_policy(truth, proxy, database)
        yield role


def plan_of(truth: psycopg.Connection, role: str, sql: str, params: DPParams = ZCDP) -> DPPlan:
    policy = load_policy(truth)
    plan = plan_dp(sql, policy.role(role), policy, params)
    assert isinstance(plan, DPPlan), plan
    return plan


def noisy_counts(proxy: Endpoint, database: str, role: str, sql: str) -> dict[datetime, int]:
    with psycopg.connect(proxy.dsn(database, user=role), autocommit=True) as conn:
        conn.execute("set timezone = 'UTC'")
        return {row[0]: row[1] for row in conn.execute(sql)}


def exact_counts(truth: psycopg.Connection, sql: str) -> dict[datetime, int]:
    truth.execute("set timezone = 'UTC'")
    return {row[0]: row[1] for row in truth.execute(sql)}


# Through the proxy ---------------------------------------------------------------------------------------------

def test_declared_bounds_count_the_visits_and_the_default_counts_people(truth: psycopg.Connection,
                                                                       gated_proxy: Endpoint,
                                                                       gated_database: str) -> None:
    exact = exact_counts(truth, EXACT_MONTHLY)
    assert len(exact) == 24 and max(truth.execute("select max(n) from (select count(*) as n from visits "
                                                  "group by person_id) x").fetchone()) <= 5
    # g = 5, c = 5: no person has more than 5 visits, so nothing is left out; the answer is PostgreSQL's, plus noise.
    with dp_role(truth, gated_proxy, gated_database, groups=5, rows=5) as role:
        (count,) = [s for s in plan_of(truth, role, MONTHLY).statistics]
        noisy = noisy_counts(gated_proxy, gated_database, role, MONTHLY)
    assert set(noisy) == set(exact)
    assert all(abs(noisy[month] - exact[month]) <= 6 * count.stddev for month in exact), (noisy, exact, count.stddev)
    # The default (1, 1): each person once, in one of their months: the months add up to the people, not the visits.
    with dp_role(truth, gated_proxy, gated_database) as role:
        default = noisy_counts(gated_proxy, gated_database, role, MONTHLY)
    people = truth.execute("select count(distinct person_id) from visits").fetchone()[0]
    assert abs(sum(default.values()) - people) < sum(exact.values()) * 0.05
    assert sum(default.values()) < 0.6 * sum(exact.values())


def test_a_change_of_bounds_is_a_new_decision(truth: psycopg.Connection, gated_proxy: Endpoint,
                                              gated_database: str) -> None:
    """The same text, asked again after the DBA changed the bounds, is planned with the new ones (a new policy
    version; one connection across the change, so that a cached decision would be found)."""
    exact = sum(exact_counts(truth, EXACT_MONTHLY).values())
    with dp_role(truth, gated_proxy, gated_database) as role, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        before = sum(row[1] for row in conn.execute(MONTHLY))
        truth.execute("select anonproxy.set_contribution_bounds(%s, 'public.adult', 5, 5)", [role])
        wait_for_current_policy(truth, gated_proxy, gated_database)
        after = sum(row[1] for row in conn.execute(MONTHLY))
    assert before < 0.6 * exact and abs(after - exact) < 0.05 * exact


def test_adult_alone_is_not_noisier_with_larger_bounds(truth: psycopg.Connection, gated_proxy: Endpoint,
                                                       gated_database: str) -> None:
    """Each row of adult is one person (its unit is its primary key): one row in one group, whatever is declared.
    Declaring g = 5, c = 5 leaves the noise of questions over adult alone as it was."""
    questions = ["select sex, count(*) from adult group by sex",
                 "select count(*), avg(age), sum(hours_per_week) from adult",
                 "select education, count(*) from adult group by education"]
    with dp_role(truth, gated_proxy, gated_database) as plain, \
            dp_role(truth, gated_proxy, gated_database, groups=5, rows=5) as declared:
        for sql in questions:
            one, five = plan_of(truth, plain, sql), plan_of(truth, declared, sql)
            assert [(s.scale, s.sigma2) for s in five.statistics] == [(s.scale, s.sigma2) for s in one.statistics]
            assert (five.max_groups_per_unit, five.max_rows_per_unit) == (1, 1)
        # over visits the same role's bounds hold
        visits = plan_of(truth, declared, MONTHLY)
        assert (visits.max_groups_per_unit, visits.max_rows_per_unit) == (5, 5)
        # and through the proxy: an answer over adult, noisy around PostgreSQL's
        with psycopg.connect(gated_proxy.dsn(gated_database, user=declared), autocommit=True) as conn:
            noisy = dict(conn.execute(questions[0]).fetchall())
        exact = dict(truth.execute("select sex, count(*) from adult group by sex").fetchall())
        (count,) = plan_of(truth, plain, questions[0]).statistics
        assert all(abs(noisy[sex] - exact[sex]) <= 6 * count.stddev for sex in exact)


def test_one_heavy_person_adds_at_most_c_rows_to_g_groups(truth: psycopg.Connection, gated_proxy: Endpoint,
                                                          gated_database: str, pg_server: EmbeddedPostgres) -> None:
    """A person with 1000 visits over all 24 months moves the per-group statistics PostgreSQL computes by at most c
    in each group and c·g in all, whatever the other rows (the plan's own SQL, run twice in one transaction)."""
    with dp_role(truth, gated_proxy, gated_database, groups=5, rows=5) as role:
        plan = plan_of(truth, role, MONTHLY)
    heavy = truth.execute("select max(id) + 1 from adult").fetchone()[0]

    def statistics(conn: psycopg.Connection) -> dict[datetime, int]:
        conn.execute("set local timezone = 'UTC'")
        return {row[0]: row[1] for row in conn.execute(plan.sql)}

    with psycopg.connect(pg_server.conninfo(dbname=gated_database)) as conn:  # one transaction, rolled back: nobody else sees the heavy person
        before = statistics(conn)
        conn.execute("insert into visits (visit_id, person_id, visited_at, channel, amount) "
                     "select 100000000 + i, %s, timestamptz '2025-01-01 00:00+00' + (i * 17) * interval '1 hour', "
                     "'web', 1 from generate_series(1, 1000) i", [heavy])
        assert conn.execute("select count(distinct date_trunc('month', visited_at at time zone 'UTC')) from visits "
                            "where person_id = %s", [heavy]).fetchone()[0] >= 23
        after = statistics(conn)
        conn.rollback()
    moved = {month: after[month] - before[month] for month in before}
    assert all(0 <= n <= 5 for n in moved.values()), moved
    assert sum(moved.values()) == 25  # others' rows are all kept (≤ 5 visits each): only the heavy person's 5 × 5


# The plan ------------------------------------------------------------------------------------------------------

def with_bounds(policy: Policy, role: str, groups: int, rows: int) -> Policy:
    budgets = policy.roles[role].budgets
    bounded = {table: replace(budget, max_groups_per_person=groups, max_rows_per_person_and_group=rows)
               for table, budget in budgets.items()}
    return replace(policy, roles={**policy.roles, role: replace(policy.roles[role], budgets=bounded)})


@pytest.mark.parametrize(("groups", "rows"), [(1, 1), (5, 1), (1, 5), (2, 3), (5, 5)])
def test_the_noise_scale_is_c_times_g_over_epsilon(truth: psycopg.Connection, groups: int, rows: int) -> None:
    """A count over visits by month (basic accounting: discrete Laplace): one person moves at most g groups by at
    most c each, so the scale is c·g/ε."""
    policy = with_bounds(load_policy(truth), "analyst", groups, rows)
    plan = plan_dp(MONTHLY, policy.role("analyst"), policy, DPParams(0.5, 1e-7))
    assert isinstance(plan, DPPlan), plan
    (count,) = plan.statistics
    assert count.sigma2 is None and count.scale == groups * rows * 2
    assert (plan.max_groups_per_unit, plan.max_rows_per_unit) == (groups, rows)
    if (groups, rows) == (1, 1):  # one random row per person
        assert "anonproxy_row_rank = 1" in plan.sql and "anonproxy_group_rank" not in plan.sql
    else:
        assert f"anonproxy_row_rank <= {rows}" in plan.sql and f"anonproxy_group_rank <= {groups}" in plan.sql


def test_parameters_given_by_the_caller_win_over_the_declared_bounds(truth: psycopg.Connection) -> None:
    policy = with_bounds(load_policy(truth), "analyst", 5, 1)
    plan = plan_dp(MONTHLY, policy.role("analyst"), policy, DPParams(0.5, 1e-7, max_groups_per_unit=2))
    assert isinstance(plan, DPPlan) and plan.statistics[0].scale == 4


# Declaring them ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("arguments", "sqlstate", "message"), [
    ("'analyst', 'public.adult', 0, 1", "22023",
     'max_groups_per_person for role "analyst" on public.adult must be an integer in [1, 1000], got 0'),
    ("'analyst', 'public.adult', 1001, 1", "22023",
     'max_groups_per_person for role "analyst" on public.adult must be an integer in [1, 1000], got 1001'),
    ("'analyst', 'public.adult', null, 1", "22023",
     'max_groups_per_person for role "analyst" on public.adult must be an integer in [1, 1000], got NULL'),
    ("'analyst', 'public.adult', 5, -1", "22023",
     'max_rows_per_person_and_group for role "analyst" on public.adult must be an integer in [1, 1000], got -1'),
    ("'reporter', 'public.adult', 5, 1", "42704", 'role "reporter" has no privacy budget on public.adult'),
    ("'analyst', 'public.visits', 5, 1", "22023", "public.visits"),
])
def test_bad_bounds_are_refused_in_sql(truth: psycopg.Connection, arguments: str, sqlstate: str,
                                       message: str) -> None:
    version = truth.execute("select version from anonproxy.policy_version").fetchone()[0]
    with pytest.raises(psycopg.Error) as caught:
        truth.execute(f"select anonproxy.set_contribution_bounds({arguments})")
    assert caught.value.sqlstate == sqlstate and message in str(caught.value), str(caught.value)
    assert truth.execute("select version from anonproxy.policy_version").fetchone()[0] == version


def test_setting_bounds_is_a_policy_change_that_set_budget_keeps(truth: psycopg.Connection, gated_proxy: Endpoint,
                                                                 gated_database: str) -> None:
    with dp_role(truth, gated_proxy, gated_database) as role:
        version = truth.execute("select version from anonproxy.policy_version").fetchone()[0]
        truth.execute("select anonproxy.set_contribution_bounds(%s, 'public.adult', 7, 3)", [role])
        assert truth.execute("select version from anonproxy.policy_version").fetchone()[0] > version
        budget = load_policy(truth).roles[role].budgets["public.adult"]
        assert (budget.max_groups_per_person, budget.max_rows_per_person_and_group) == (7, 3)
        truth.execute("select anonproxy.set_budget(%s, 'public.adult', 30, 0.00001, null, 0.5, 0.0000001)", [role])
        budget = load_policy(truth).roles[role].budgets["public.adult"]
        assert (budget.epsilon, budget.max_groups_per_person, budget.max_rows_per_person_and_group) == (30, 7, 3)
        with pytest.raises(psycopg.Error) as caught:  # the table's constraint holds too, for a direct UPDATE
            truth.execute("update anonproxy.budgets set max_rows_per_person_and_group = 0 where role_name = %s",
                          [role])
        assert caught.value.sqlstate == "23514"


ADULT = "tables: {public.adult: {unit: id}}\n"
BUDGET = "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 1, %s}}}}"


@pytest.mark.parametrize(("given", "problem"), [
    ("max_groups_per_person: 0",
     "roles.analyst.budgets.public.adult.max_groups_per_person: must be an integer in [1, 1000], got 0"),
    ("max_groups_per_person: 1001",
     "roles.analyst.budgets.public.adult.max_groups_per_person: must be an integer in [1, 1000], got 1001"),
    ("max_rows_per_person_and_group: 2.5",
     "roles.analyst.budgets.public.adult.max_rows_per_person_and_group: must be an integer in [1, 1000], got 2.5"),
    ("max_rows_per_person_and_group: true",
     "roles.analyst.budgets.public.adult.max_rows_per_person_and_group: must be an integer in [1, 1000], got True"),
    ("max_groups_per_person: five",
     "roles.analyst.budgets.public.adult.max_groups_per_person: must be an integer in [1, 1000], got 'five'"),
])
def test_bad_bounds_are_refused_in_yaml(given: str, problem: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(ADULT + BUDGET % given)
    assert problem in caught.value.problems, caught.value.problems


def test_yaml_bounds_round_trip() -> None:
    policy = parse_policy(ADULT + BUDGET % "max_groups_per_person: 5, max_rows_per_person_and_group: 2")
    budget = policy.roles["analyst"].budgets["public.adult"]
    assert (budget.max_groups_per_person, budget.max_rows_per_person_and_group) == (5, 2)
    text = dump_policy(policy)
    assert "max_groups_per_person: 5" in text and "max_rows_per_person_and_group: 2" in text
    assert parse_policy(text) == policy
    default = parse_policy(ADULT + BUDGET % "delta: 0")
    assert default.roles["analyst"].budgets["public.adult"].max_groups_per_person == 1
    assert "max_groups_per_person" not in dump_policy(default)  # the default is not written out

