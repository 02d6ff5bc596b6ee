"""Issue 24: N where each row is one person and the statement has a WHERE.

Over ``adult`` (its unit ``id`` is the primary key: one row per person), the suppression SQL no longer counts the
whole table for N: it adds to the answer's people the rows the WHERE leaves out, counted only up to k. Every rule
compares N minus some of the answer's people with 1..k-1, so the answers must be those of N itself. The WHEREs below
leave out of the table none, fewer than k, exactly k and more than k people (the lowest ids), or make the WHERE
NULL for them (NULL is not true: they are left out too). Each statement is asked as the demo ``reporter`` (k = 10)
through the proxy and compared with PostgreSQL's own answer, as the rules define it, and with the per-person SQL,
which counts N as the table's distinct units (the catalog fact turned off).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import psycopg
import pytest
from conftest import Endpoint
from service_sql import run_as_service, sorted_rows

from anonproxy.policy.model import Policy
from anonproxy.policy.store import load_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite

K = 10  # the demo reporter's k
LEFT_OUT = (0, 1, K - 1, K, K + 1, 40)  # people left out of the answer: ids 1..m
WHERES = ("id > %s", "id > %s OR NULL")  # the second one NULL, not false, for the people left out


def ask(proxy: Endpoint, dbname: str, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    with psycopg.connect(proxy.dsn(dbname, user="reporter"), autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def per_person(truth: psycopg.Connection, sql: str, m: int) -> list[tuple[Any, ...]]:
    """The answer of the per-person SQL (N: the distinct units of the table), run as the service session runs it."""
    policy = load_policy(truth)
    tables = {name: dataclasses.replace(table, unique_unit=False) for name, table in policy.tables.items()}
    slow = decide(sql.replace("%s", str(m)), policy.role("reporter"), dataclasses.replace(policy, tables=tables))
    assert isinstance(slow, Rewrite) and "anonproxy.one_row_per_person(" not in slow.runs
    rows, _, error = run_as_service(truth, slow.runs)
    assert error is None, error
    return rows


def _one_pass(policy: Policy, sql: str) -> bool:
    decision = decide(sql, policy.role("reporter"), policy)
    return isinstance(decision, Rewrite) and "anonproxy.one_row_per_person(" in decision.runs


@pytest.mark.parametrize("where", WHERES)
@pytest.mark.parametrize("m", LEFT_OUT)
def test_a_total_is_released_unless_the_where_leaves_out_1_to_k_minus_1_people(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection, where: str, m: int) -> None:
    sql = f"SELECT count(*) FROM adult WHERE {where}"
    assert _one_pass(load_policy(truth), sql.replace("%s", "0"))
    (answered,) = truth.execute(sql, [m]).fetchone()  # type: ignore[misc]
    outside = f"SELECT count(*) FROM adult WHERE ({where}) IS NOT TRUE"
    (left,) = truth.execute(outside, [m]).fetchone()  # type: ignore[misc]
    assert left == m  # the ids start at 1 with no gap
    rows = ask(gated_proxy, gated_database, sql, [m])
    # Query-set-size control: n >= k and n = N or n <= N - k, with N the people of the table.
    assert rows == ([] if 1 <= left <= K - 1 else [(answered,)])
    assert rows == per_person(truth, sql, m)


@pytest.mark.parametrize("where", WHERES)
@pytest.mark.parametrize("m", LEFT_OUT)
def test_groups_under_a_where_that_leaves_out_few_people_answer_as_with_n_counted(
        gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection, where: str, m: int) -> None:
    """Complementary suppression and the rest row compare N with the answer's people and its withheld groups'."""
    sql = f"SELECT sex, race, count(*), sum(hours_per_week) FROM adult WHERE {where} GROUP BY 1, 2"
    assert _one_pass(load_policy(truth), sql.replace("%s", "0"))
    rows = ask(gated_proxy, gated_database, sql, [m])
    assert sorted_rows(rows) == sorted_rows(per_person(truth, sql, m))
    # What PostgreSQL answers, for the groups released (the rest row aside): a group is never released with other
    # figures than its own.
    truth_rows = {(sex, race): (n, total) for sex, race, n, total in truth.execute(sql, [m]).fetchall()}
    released = [row for row in rows if row[:2] != (None, None)]
    assert released and all(truth_rows[row[:2]] == row[2:] for row in released)
    if 1 <= m <= K - 1:
        # The answer leaves out 1 to k - 1 people: the released rows must not add up to everyone it covers.
        assert sum(row[2] for row in rows) != sum(n for n, _ in truth_rows.values())
