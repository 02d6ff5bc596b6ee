"""Issue 24, item 4: dp's bounded SQL uses the catalog fact that each row is one person, read with the policy.

Where the policy as read says the protected table's unit column is unique and not null (``adult.id``, its primary
key) and the statement reads that table alone, each person contributes one row to one group: the measurement SQL
is the statistics over the client's rows, with no per-person window, no run-time guard and no second branch, and
it checks the fact once with ``anonproxy.one_row_per_person`` (sql/0023). Elsewhere (the fact off, a linked table
joined) the SQL keeps the guard and the bounding window. Both give the same exact statistics where both apply; a
key dropped after the policy was read stops the shortcut with SQLSTATE 55000 until the policy is read again.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role

from anonproxy.dp.plan import DPParams, DPPlan, plan_dp
from anonproxy.policy.model import LinkedTable, Policy, RolePolicy
from anonproxy.policy.store import load_policy

CHECK = "anonproxy.one_row_per_person("  # the shortcut's catalog check (sql/0023)
WINDOW = "row_number() OVER"  # contribution bounding
GUARD = "anonproxy_guard"  # the run-time catalog guard of the general shape
ROLE = RolePolicy("researcher", "dp")
PARAMS = DPParams(0.5, 1e-7, accounting="zcdp")
STATEMENTS = 40
KEYS = ("education", "sex", "race", "occupation", "native_country", "(age / 10) * 10", "income")
AGGREGATES = ("count(*)", "sum(hours_per_week)", "avg(age)", "count(capital_gain)", "sum(capital_gain)",
              "avg(hours_per_week)", "stddev(age)")
WHERES = (None, "age > 60", "sex = 'Female'", "hours_per_week BETWEEN 20 AND 40", "capital_gain > 0")


def _draw(rng: random.Random) -> str:
    keys = rng.sample(KEYS, rng.choice((0, 1, 1, 2)))
    items = [*keys, *rng.sample(AGGREGATES, rng.choice((1, 2, 3)))]
    parts = [f"select {', '.join(items)} from adult"]
    where = rng.choice(WHERES)
    if where is not None:
        parts.append(f"where {where}")
    if keys:
        parts.append(f"group by {', '.join(str(i) for i in range(1, len(keys) + 1))}")
    return " ".join(parts)


def _without_fact(policy: Policy) -> Policy:
    tables = {name: dataclasses.replace(table, unique_unit=False) for name, table in policy.tables.items()}
    return dataclasses.replace(policy, tables=tables)


def _plan(sql: str, policy: Policy) -> DPPlan:
    plan = plan_dp(sql, ROLE, policy, PARAMS)
    assert isinstance(plan, DPPlan), (sql, plan)
    return plan


def _rows(conn: psycopg.Connection[Any], sql: str) -> list[tuple[Any, ...]]:
    with conn.transaction():
        conn.execute("SET LOCAL search_path = pg_catalog")
        rows = conn.execute(sql).fetchall()
    return sorted(rows, key=lambda row: tuple((value is None, str(value)) for value in row))


def test_the_unique_unit_sql_measures_what_the_bounded_sql_measures(truth: psycopg.Connection) -> None:
    policy = load_policy(truth)
    assert policy.tables["public.adult"].unique_unit
    general = _without_fact(policy)
    rng = random.Random("issue 24 dp")
    for _ in range(STATEMENTS):
        statement = _draw(rng)
        fast, slow = _plan(statement, policy), _plan(statement, general)
        assert CHECK in fast.sql and WINDOW not in fast.sql and GUARD not in fast.sql, statement
        assert CHECK not in slow.sql and WINDOW in slow.sql and GUARD in slow.sql, statement
        assert fast.columns == slow.columns and fast.epsilon == slow.epsilon, statement
        assert _rows(truth, fast.sql) == _rows(truth, slow.sql), statement
    # With the guard forced off, the general SQL bounds every person's rows to one: adult has one row per
    # person, so bounding drops nothing and the answers agree too.
    statement = "select education, count(*), sum(hours_per_week), avg(age) from adult where age > 30 group by 1"
    bounded = _plan(statement, general).sql.replace(" AS single", " AND false AS single")
    assert _rows(truth, _plan(statement, policy).sql) == _rows(truth, bounded)


def test_without_the_fact_or_with_a_linked_table_the_window_stays(truth: psycopg.Connection) -> None:
    policy = load_policy(truth)
    statement = "select sex, count(*) from adult group by 1"
    assert WINDOW in _plan(statement, _without_fact(policy)).sql
    # a linked table joined: a person may have several rows; bounding stays whatever adult's key says
    truth.execute("create table public.stays (person integer not null, nights integer not null)")
    try:
        link = LinkedTable("public.stays", "person", "public.adult", "id")
        linked = dataclasses.replace(policy, links={**policy.links, link.name: link})
        plan = _plan("select a.sex, count(*) from adult a join stays s on s.person = a.id group by 1", linked)
        assert CHECK not in plan.sql and WINDOW in plan.sql and GUARD in plan.sql
    finally:
        truth.execute("drop table public.stays")


def test_a_key_dropped_after_the_policy_was_read_stops_the_shortcut(
        truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> None:
    """The cached policy says adult.id is unique; with the primary key dropped, a person's duplicated rows would
    count as several people. The measurement SQL fails with 55000 before any row; once the policy is read again
    (a change to it makes every proxy read it), the bounded SQL answers."""
    with fresh_dp_role(truth, gated_proxy, gated_database, "dp_unique_unit", epsilon=10) as role, \
            psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        conn.execute("select sex, count(*) from adult group by 1").fetchall()
        truth.execute("alter table adult drop constraint adult_pkey")
        try:
            with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as raised:
                conn.execute("select race, count(*) from adult group by 1").fetchall()
            assert raised.value.diag.message_primary == ('anonproxy: "public"."adult".id is no longer unique and not '
                                                         'null in the catalog, as it was when the policy was read')
            with fresh_dp_role(truth, gated_proxy, gated_database, "dp_unique_unit_probe"):
                pass  # a policy change: every worker reads the catalog again
            # the policy read again says adult.id is not unique: the bounded SQL runs, and answers
            rows = conn.execute("select income, count(*) from adult group by 1").fetchall()
            assert {income for income, _ in rows} == {"<=50K", ">50K"}
        finally:
            truth.execute("alter table adult add constraint adult_pkey primary key (id)")
            with fresh_dp_role(truth, gated_proxy, gated_database, "dp_unique_unit_probe"):
                pass
