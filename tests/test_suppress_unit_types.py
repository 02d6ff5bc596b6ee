"""Suppression's bounds over units of any type (anonproxy.suppress.one_pass, ``_unit_number``).

The bounds put each person in one of 64 buckets by their unit: an integer unit by its low bits, another by its
type's hash (``hash_array``). PostgreSQL has no hash function for some types that GROUP BY still sorts (bit, bit
varying, money, tsvector, tsquery, and composite or array types of them): there every person falls in one bucket,
the bounds settle nothing and the exact path answers (``hash_array`` failed there with an error, 42883). A type with
no equality at all (point) cannot be counted per person: refused, as PostgreSQL refuses to count its distinct
values. Rows without a unit fall in no bucket (``hash_array`` hashes a NULL too: their bucket counted as one more
person, and a group of k - 1 people was released). A role with k above 64 is answered by the exact path (64 buckets
never prove k people). Through a proxy of this module's own; each answer is the exact path's, and the groups it
releases are PostgreSQL's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import psycopg
import pytest
from conftest import database_of_its_own, reporter_through_own_proxy, unit_of_type
from service_sql import SURE, bounds_settle, exact_path, reporter_sql, rewritten, service_answer, sorted_rows

from anonproxy.policy.model import ColumnPolicy, LinkedTable, Policy, RolePolicy, SuppressionParams
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import demo_policy

DATABASE = "suppress_unit_types"
PEOPLE = "(select id from public.adult order by id limit 9)"  # the rare kind's people: k - 1
# Linked tables of adult's people (1 to 3 rows per person, three kinds, and 9 people of a rare kind), each keyed to
# a unit table of its own type: each unit's type, and a person's unit from adult.id.
UNITS = {
    "marks_bit": ("bit(16)", "id::bit(16)"),
    "marks_money": ("money", "id::numeric::money"),
    "marks_bits": ("bit varying[]", "array[id::bit(16)::varbit]"),
    "marks_pair": ("unit_pair", "row(id, (id % 16)::bit(4))::unit_pair"),
    "marks_point": ("point", "point(id, 0)"),
}
STATEMENTS = (
    "SELECT s.kind, count(*) AS n FROM public.{table} s GROUP BY 1",
    "SELECT s.kind, count(*) AS n, sum(s.v) AS total FROM public.{table} s GROUP BY 1",
    "SELECT s.kind, count(*) AS n, avg(s.v) AS mean FROM public.{table} s WHERE s.v > 2 GROUP BY 1",
)
WORDS = "public.marks_text"  # a text unit, rows without one


def _linked(table: str, unit: str) -> LinkedTable:
    return LinkedTable(table, "person", unit, "id", {
        "person": ColumnPolicy("person", "identifier"),
        "kind": ColumnPolicy("kind", "quasi_identifier"),
        "v": ColumnPolicy("v", "sensitive", 0, 10)})


def _marks(conn: psycopg.Connection[Any]) -> Policy:
    """The demo policy; the tables of ``UNITS``, ``marks_int`` (an integer unit, 1 to 3 rows per person) and
    ``marks_text``: 2000 people of kind 'big', 100 of 'other', and of 'small' 9 people in 9 buckets (not the bucket
    of a NULL's hash) and 3 rows without a unit."""
    conn.execute("create type public.unit_pair as (id integer, tag bit(4))")
    rows = ("select {unit}, (array['web', 'app', 'phone'])[(id + n) % 3 + 1], (id * 7 + n) % 10 "
            "from public.adult, generate_series(1, 1 + id % 3) n")
    for table, (unit_type, unit) in {**UNITS, "marks_int": ("integer", "id")}.items():
        conn.execute(f"create table public.{table} (person {unit_type}, kind text not null, v integer not null)")
        conn.execute(f"insert into public.{table} {rows.format(unit=unit)}")
        conn.execute(f"insert into public.{table} select {unit}, 'rare', 5 from public.adult where id in {PEOPLE}")
        conn.execute(f"analyze public.{table}")
    bucket = "hash_array(array[{}]) & 63"
    conn.execute(f"create table {WORDS} (person text, kind text not null, v integer not null)")
    conn.execute(f"insert into {WORDS} select 'b' || g, 'big', 1 from generate_series(1, 2000) g")
    conn.execute(f"insert into {WORDS} select 'o' || g, 'other', 1 from generate_series(1, 100) g")
    conn.execute(f"insert into {WORDS} select person, 'small', 1 from (select distinct on ({bucket.format('w')}) w "
                 f"as person from (select 's' || g as w from generate_series(1, 1000) g) words where "
                 f"{bucket.format('w')} <> {bucket.format('null::text')} order by {bucket.format('w')}, w limit 9) p")
    conn.execute(f"insert into {WORDS} select null, 'small', 1 from generate_series(1, 3)")
    conn.execute(f"analyze {WORDS}")
    policy = demo_policy()
    units = {f"public.{table}": unit_of_type(conn, f"public.{table}_people", unit_type)
             for table, (unit_type, _) in UNITS.items()}
    units[WORDS] = unit_of_type(conn, f"{WORDS}_people", "text")
    links = {table: _linked(table, unit.name) for table, unit in units.items()}
    links["public.marks_int"] = _linked("public.marks_int", "public.adult")
    return dataclasses.replace(policy, tables={**policy.tables, **{unit.name: unit for unit in units.values()}},
                               links=links)


owner = database_of_its_own(DATABASE, _marks)


reporter = reporter_through_own_proxy(DATABASE)


def _released_as_postgresql(owner: psycopg.Connection, statement: str, rows: list[tuple[Any, ...]]) -> None:
    """Each released group of ``statement`` (grouped by its first column; the rest row aside, its key NULL) is
    PostgreSQL's own row of that group."""
    own = {row[0]: row for row in sorted_rows(owner.execute(statement).fetchall())}
    released = [row for row in rows if row[0] is not None]
    assert released and all(row == own[row[0]] for row in released), (statement, rows)


@pytest.mark.parametrize("table", sorted(set(UNITS) - {"marks_point"}))
@pytest.mark.parametrize("shape", range(len(STATEMENTS)))
def test_a_unit_without_a_hash_function_is_answered_by_the_exact_path(owner: psycopg.Connection,
                                                                      reporter: psycopg.Connection, table: str,
                                                                      shape: int) -> None:
    """The type, read from the catalog, puts every person in one bucket: no ``hash_array``, and the answer through
    the proxy is the exact path's; the rare kind (9 people) is withheld, the groups released are PostgreSQL's."""
    statement = STATEMENTS[shape].format(table=table)
    sql = reporter_sql(owner, statement)
    assert "hash_array" not in sql and SURE in sql, sql
    rows = sorted_rows(reporter.execute(statement).fetchall())
    assert rows == service_answer(owner, exact_path(sql))[0]
    assert all("rare" not in row for row in rows), rows
    _released_as_postgresql(owner, statement, rows)


def test_a_unit_without_equality_is_refused_as_postgresql_refuses_to_count_it(owner: psycopg.Connection,
                                                                              reporter: psycopg.Connection) -> None:
    """Points have no equality: the exact path cannot count each group's people; the proxy refuses with the error
    PostgreSQL gives for counting distinct points, and the session goes on."""
    with pytest.raises(psycopg.Error) as own:
        owner.execute("SELECT count(DISTINCT person) FROM public.marks_point")
    with pytest.raises(psycopg.Error) as refused:
        reporter.execute(STATEMENTS[0].format(table="marks_point"))
    assert refused.value.sqlstate == own.value.sqlstate
    assert reporter.execute("SELECT 1").fetchone() == (1,)


def test_rows_without_a_unit_are_in_no_bucket(owner: psycopg.Connection, reporter: psycopg.Connection) -> None:
    """'small' holds 9 people in 9 buckets, and rows without a unit: were they in the bucket of a NULL's hash,
    the bounds would count 10 buckets, k, and release 'small' (the other groups leave k of N out). Withheld, as
    the exact path withholds it; the groups released are PostgreSQL's."""
    statement = f"SELECT s.kind, count(*) AS n FROM {WORDS} s GROUP BY 1"
    assert owner.execute(f"SELECT count(DISTINCT person) FROM {WORDS} WHERE kind = 'small'").fetchone() == (9,)
    rows = sorted_rows(reporter.execute(statement).fetchall())
    assert all("small" not in row for row in rows), rows
    assert rows == service_answer(owner, exact_path(reporter_sql(owner, statement)))[0]
    _released_as_postgresql(owner, statement, rows)


def _suppressing(k: int) -> RolePolicy:
    """A role of the demo reporter's rules but k."""
    return RolePolicy("wide", "suppress", SuppressionParams(k=k, dominance_n=2, dominance_percent=85, p_percent=10,
                                                            suppressed_rest=True))


@pytest.mark.parametrize("people", [69, 70])
def test_k_above_64_is_answered_by_the_exact_path(owner: psycopg.Connection, people: int) -> None:
    """k = 70 over an integer unit whose people fill all 64 buckets: the bounds, which settle the statement at
    k = 10, prove at most 64 people a group, never k, and the exact path answers: a kind of 69 people is withheld,
    one of 70 released, each as the exact path does, and the groups released are PostgreSQL's (the rare kind left
    out: withheld, it would take the smallest other kind with it, so that the rest row does not show it alone)."""
    policy = load_policy(owner)
    statement = ("SELECT s.kind, count(*) AS n, sum(s.v) AS total FROM public.marks_int s WHERE s.kind <> 'rare' "
                 "GROUP BY 1")
    with owner.transaction(force_rollback=True):
        owner.execute(f"insert into public.marks_int select id, 'few', 5 from public.adult order by id limit {people}")
        assert bounds_settle(owner, rewritten(statement, _suppressing(10), policy))
        sql = rewritten(statement, _suppressing(70), policy)
        assert not bounds_settle(owner, sql)
        rows, details = service_answer(owner, sql)
        assert (rows, details) == service_answer(owner, exact_path(sql))
        assert any("few" in row for row in rows) == (people >= 70), rows
        _released_as_postgresql(owner, statement, rows)

