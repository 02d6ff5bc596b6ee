"""Red team of suppression's bounds first (anonproxy.suppress.one_pass, ``_bounded``; docs/suppression.md "Where
rows are not people: bounds first"): over a linked table, every group is released from bounds when they prove that
it passes the rules, without the exact per-person figures. Each attack below builds data where the bounds could be
wrong -- a person in two groups where the SQL assumes one, NULL units, values cancelling in ``|sum|``, a person
with many rows in one group, a WHERE that removes most of a person's rows, extreme values -- and asserts the safe
outcome: the rewritten statement answers exactly as the same SQL forced onto its exact path (``anonproxy_sure``
false), which computes each group's distinct people and each person's part, so that the bounds never release a
group or a value the exact figures would withhold, and never raise an error the exact path would not."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from conftest import govern_by_demo_policy

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import ColumnPolicy, LinkedTable
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import apply_policy, demo_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite

DATABASE = "attacks_bounds_first"
VISITS = "public.stays"
SURE = "SELECT NOT EXISTS (SELECT FROM (SELECT *, sum(unit_rows) OVER ()"  # the start of anonproxy_sure's body


@pytest.fixture(scope="module")
def owner(pg_server: EmbeddedPostgres, pg_template: Any) -> Iterator[psycopg.Connection]:
    """A database of its own: the demo policy (reporter: k 10, dominance (2, 85 %), p 10 %, a rest row), and
    ``stays`` linked to adult, empty (each attack fills it in a transaction it rolls back)."""
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {DATABASE}")
        conn.execute(f"create database {DATABASE} template {pg_template.template_dbname}")
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE)) as conn:
        govern_by_demo_policy(conn, DATABASE)
        conn.execute(f"create table {VISITS} (person integer, kind text not null, amount numeric not null)")
        link = LinkedTable(VISITS, "person", "public.adult", "id", {
            "person": ColumnPolicy("person", "identifier"),
            "kind": ColumnPolicy("kind", "quasi_identifier"),
            "amount": ColumnPolicy("amount", "sensitive")})
        apply_policy(conn, dataclasses.replace(demo_policy(), links={VISITS: link}))
        conn.commit()
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE), autocommit=True) as conn:
        yield conn
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database {DATABASE} with (force)")


def _rewrite(conn: psycopg.Connection[Any], statement: str) -> str:
    policy = load_policy(conn)
    decision = decide(statement, policy.roles["reporter"], policy)
    assert isinstance(decision, Rewrite), (statement, decision)
    assert decision.runs.count(SURE) == 1, decision.runs  # the bounds-first shape
    return decision.runs


def _exact(sql: str) -> str:
    """The same SQL forced onto its exact path: ``anonproxy_sure`` false."""
    return sql.replace(SURE, "SELECT false AND " + SURE.removeprefix("SELECT "))


def _run(conn: psycopg.Connection[Any], sql: str) -> tuple[list[tuple[Any, ...]], list[str]]:
    """Sorted rows (numeric as text) and the report's details, as the service session runs it."""
    details: list[str] = []

    def keep(notice: psycopg.errors.Diagnostic) -> None:
        details.append(notice.message_detail or "")

    conn.add_notice_handler(keep)
    try:
        with conn.transaction():
            conn.execute("SET LOCAL search_path = pg_catalog")
            rows = conn.execute(sql).fetchall()
    finally:
        conn.remove_notice_handler(keep)
    normal = [tuple(str(v) if isinstance(v, Decimal) else v for v in row) for row in rows]
    return sorted(normal, key=lambda row: tuple((v is None, str(v)) for v in row)), details


def _same_as_exact(conn: psycopg.Connection[Any], fill: str, statement: str) -> list[tuple[Any, ...]]:
    """Fill stays, rewrite ``statement`` and check that it answers as its exact path; the rows."""
    with conn.transaction(force_rollback=True):
        conn.execute(fill)
        sql = _rewrite(conn, statement)
        answer = _run(conn, sql)
        assert answer == _run(conn, _exact(sql)), statement
        return answer[0]


# A person in two groups where the SQL assumed one ------------------------------------------------------------------

# Everyone has a visit of amount 1 but the three first people; the first hundred have one of amount 2.
SPLIT = (f"insert into {VISITS} select id, 'small', 1 from public.adult where id > (select min(id) + 2 from "
         f"public.adult); insert into {VISITS} select id, 'large', 2 from public.adult order by id limit 100")


def test_a_left_join_condition_puts_a_person_in_two_groups(owner: psycopg.Connection) -> None:
    """``stays LEFT JOIN adult ON adult.id = stays.person AND stays.amount > 1``: the unit is stays.person, and
    a person's rows of amount 1 fall in the NULL group while those of amount 2 fall in their sex's group, although
    the grouping expression reads only adult. The NULL group holds everyone but three people: it leaves fewer than
    k of N out and is withheld; the bounds must not take the other groups' rows for people it leaves out."""
    rows = _same_as_exact(owner, SPLIT, ("SELECT a.sex, count(*) AS n, sum(v.amount) AS total FROM public.stays v "
                                         "LEFT JOIN public.adult a ON a.id = v.person AND v.amount > 1 GROUP BY 1"))
    # The NULL group is withheld, and with it both others (complementary suppression): the rest row alone.
    assert [row[0] for row in rows] == [None], rows
