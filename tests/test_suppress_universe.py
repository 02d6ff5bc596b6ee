"""Issue 24: N and the most rows one person has, counted in two halves of an integer unit.

The bounds-first suppression SQL (a GROUP BY over rows that are not people) counts N, the people of the FROM clause,
and ``most``, the most rows one person has there, in one aggregation per person, which PostgreSQL 15 finishes in one
process. Where the unit column is an integer, it now counts the people below ``anonproxy.unit_midpoint`` and those at
or above it in two branches of one UNION ALL that PostgreSQL runs side by side, plus the rows without a unit
(anonproxy.suppress.universe, sql/0040; docs/suppression.md, "N on two cores"). Any split point gives the same N and
``most``: checked here against the single aggregation on units at the ends of bigint, negative ones, one at the
split point itself, rows without a unit (as many as the person with the most rows, and more), and an empty table.
The answers over a linked table through this shape are compared with PostgreSQL's own and with the exact path in
tests/test_suppress_bounds.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import govern_by_demo_policy
from service_sql import run_as_service

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import ColumnPolicy, LinkedTable
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import apply_policy, demo_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite

DATABASE = "suppress_universe"
STAYS = "public.stays"
STATEMENT = "SELECT s.kind, count(*) AS n FROM public.stays s GROUP BY 1"
# The single aggregation the shape replaces: the reference for N and most (rows without a unit count as one unit's).
SINGLE = ("SELECT count(unit), coalesce(max(unit_rows), 0) FROM (SELECT person AS unit, count(*) AS unit_rows "
          "FROM public.stays GROUP BY 1) AS units")
LOW, HIGH = -(2**63), 2**63 - 1
# person -> rows; the split point of LOW and HIGH is -1 or 0 (half of each, added, rounded), both people here.
PEOPLE = {LOW: 3, HIGH: 2, -1: 4, 0: 1, -5: 2, 7: 6, 1_000_000: 1}


@pytest.fixture(scope="module")
def owner(pg_server: EmbeddedPostgres, pg_template: Any) -> Iterator[psycopg.Connection]:
    """A database of its own: the demo policy, and ``stays`` (a bigint key that may be NULL, indexed) linked to
    adult."""
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {DATABASE}")
        conn.execute(f"create database {DATABASE} template {pg_template.template_dbname}")
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE)) as conn:
        govern_by_demo_policy(conn, DATABASE)
        conn.execute(f"create table {STAYS} (person bigint, kind text not null)")
        conn.execute(f"create index on {STAYS} (person)")
        link = LinkedTable(STAYS, "person", "public.adult", "id", {
            "person": ColumnPolicy("person", "identifier"), "kind": ColumnPolicy("kind", "quasi_identifier")})
        apply_policy(conn, dataclasses.replace(demo_policy(), links={STAYS: link}))
        conn.commit()
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE), autocommit=True) as conn:
        yield conn
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database {DATABASE} with (force)")


def _universe(conn: psycopg.Connection[Any]) -> str:
    """The generated SQL's anonproxy_universe, as a statement of its own."""
    decision = decide(STATEMENT, load_policy(conn).roles["reporter"], load_policy(conn))
    assert isinstance(decision, Rewrite), decision
    head, _, rest = decision.runs.partition("WITH anonproxy_universe(n, most) AS (\n")
    assert head == "" and rest, decision.runs
    body = rest.split("\n),\n", 1)[0]
    return "\n".join(line for line in body.splitlines() if not line.startswith("--"))


def _fill(conn: psycopg.Connection[Any], people: dict[int | None, int]) -> None:
    conn.execute(f"truncate {STAYS}")
    for person, rows in people.items():
        conn.execute(f"insert into {STAYS} select %s, 'k' || n %% 2 from generate_series(1, %s) n", (person, rows))


def _n_and_most(conn: psycopg.Connection[Any], sql: str) -> tuple[Any, ...]:
    rows, _, error = run_as_service(conn, sql)
    assert error is None, error
    return rows[0]


def test_an_integer_unit_is_counted_in_two_halves(owner: psycopg.Connection) -> None:
    universe = _universe(owner)
    assert universe.count("anonproxy.unit_midpoint('\"public\".\"stays\"', 'person')") == 2
    assert universe.count("UNION ALL") == 2 and '"s"."person" IS NULL' in universe


@pytest.mark.parametrize("people", [
    pytest.param(PEOPLE, id="extremes and the split point"),
    pytest.param({**PEOPLE, None: 6}, id="rows without a unit, as many as the most"),
    pytest.param({**PEOPLE, None: 9}, id="rows without a unit, more than anyone"),
    pytest.param({None: 2}, id="only rows without a unit"),
    pytest.param({}, id="empty"),
])
def test_the_halves_give_the_single_aggregations_n_and_most(owner: psycopg.Connection,
                                                          people: dict[int | None, int]) -> None:
    _fill(owner, people)
    universe = _universe(owner)
    expected = _n_and_most(owner, SINGLE)
    assert _n_and_most(owner, universe) == expected
    assert expected[0] == len([person for person in people if person is not None])
    (midpoint,) = _n_and_most(owner, "SELECT anonproxy.unit_midpoint('public.stays', 'person')")
    units = [person for person in people if person is not None]
    assert (min(units) <= midpoint <= max(units)) if units else midpoint == 0
    if LOW in people:
        assert midpoint in PEOPLE  # a person at the split point itself (numeric rounding: -1 or 0)


def test_without_an_index_one_branch_reads_every_row(owner: psycopg.Connection) -> None:
    """No index leads with the unit column: the point is the smallest bigint (no scan to find the extremes), and
    N and most are still the single aggregation's."""
    _fill(owner, {**PEOPLE, None: 3})
    with owner.transaction(force_rollback=True):
        owner.execute("drop index public.stays_person_idx")
        assert _n_and_most(owner, "SELECT anonproxy.unit_midpoint('public.stays', 'person')") == (LOW,)
        assert _n_and_most(owner, _universe(owner)) == _n_and_most(owner, SINGLE)
