"""Red team round 15: suppression's bounds over 64 unit buckets (anonproxy.suppress.one_pass, ``_bounded``).

An attacker who reads ``_bounded`` knows that people are counted by the buckets of their unit (the low 6 bits of an
integer unit, the hash of others), that a person's part of a SUM/AVG is bounded by the total of one of 8 buckets,
and that N is counted only up to k more than what the bounds compare with it. The attacks build data where those
bounds are tight or could be wrong -- units that collide in buckets (multiples of 64, negative ids, bigint ids
that differ only above bit 6), NULL units, k - 1 people spread over many buckets beside rows without a unit, one
person whose many rows dominate a group, negative values that cancel in ``|sum|``, a WHERE that leaves out
exactly k - 1 or k people, HAVING -- and check each released group against two oracles: the same SQL forced onto
its exact path (``anonproxy_sure`` false), and an independent computation in Python over the rows PostgreSQL
returns for the statement's FROM and WHERE (a released group holds at least k distinct people, and passes
dominance (2, 85 %) and p 10 % over each person's part). A generated test draws small tables of that shape and
statements over them.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import govern_by_demo_policy
from service_sql import run_as_service, sorted_rows

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import ColumnPolicy, LinkedTable
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import apply_policy, demo_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite

DATABASE = "attacks_round15"
ACTS = "public.acts"
SURE = "SELECT NOT EXISTS (SELECT FROM (SELECT *"  # the start of anonproxy_sure's body
K = 10  # the demo reporter's rules: k, dominance (2, 85 %), p 10 %
BIG = 2**40  # bigint units that differ from small ones only above the bucket bits


@pytest.fixture(scope="module")
def owner(pg_server: EmbeddedPostgres, pg_template: Any) -> Iterator[psycopg.Connection]:
    """A database of its own: the demo policy, and ``acts`` (person bigint, nullable) linked to adult, empty."""
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {DATABASE}")
        conn.execute(f"create database {DATABASE} template {pg_template.template_dbname}")
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE)) as conn:
        govern_by_demo_policy(conn, DATABASE)
        conn.execute(f"create table {ACTS} (person bigint, kind text not null, v integer not null)")
        link = LinkedTable(ACTS, "person", "public.adult", "id", {
            "person": ColumnPolicy("person", "identifier"),
            "kind": ColumnPolicy("kind", "quasi_identifier"),
            "v": ColumnPolicy("v", "sensitive")})
        apply_policy(conn, dataclasses.replace(demo_policy(), links={ACTS: link}))
        conn.commit()
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE), autocommit=True) as conn:
        yield conn
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database {DATABASE} with (force)")


def _rewrite(conn: psycopg.Connection[Any], statement: str) -> str:
    policy = load_policy(conn)
    decision = decide(statement, policy.roles["reporter"], policy)
    assert isinstance(decision, Rewrite), (statement, decision)
    return decision.runs


def _run(conn: psycopg.Connection[Any], sql: str) -> tuple[list[tuple[Any, ...]], list[str], str | None]:
    rows, details, error = run_as_service(conn, sql)
    return sorted_rows(rows), details, error


def _fill(conn: psycopg.Connection[Any], rows: list[tuple[int | None, str, int]]) -> None:
    conn.execute(f"truncate {ACTS}")
    with conn.cursor() as cursor:
        cursor.executemany(f"insert into {ACTS} values (%s, %s, %s)", rows)
    conn.execute(f"analyze {ACTS}")


def _passes(parts: dict[Any, int], sums: bool) -> bool:
    """The oracle's verdict on one group: k distinct people (NULL units are nobody), and over each person's part
    (the rows without a unit one part) dominance (2, 85 %) and p 10 % where a SUM/AVG is asked."""
    if sum(1 for unit in parts if unit is not None) < K:
        return False
    if not sums:
        return True
    values = sorted((abs(part) for part in parts.values()), reverse=True) + [0, 0]
    total = sum(values)
    return 100 * (values[0] + values[1]) <= 85 * total and 100 * (total - values[0] - values[1]) >= 10 * values[0]


def _oracle(conn: psycopg.Connection[Any], where: str | None, sums: bool) -> set[str]:
    """The kinds that may be released: each kind's rows under ``where``, people and parts counted here."""
    groups: dict[str, dict[Any, int]] = defaultdict(lambda: defaultdict(int))
    condition = f" WHERE {where}" if where else ""
    for person, kind, v in conn.execute(f"SELECT a.person, a.kind, a.v FROM {ACTS} a{condition}").fetchall():
        groups[kind][person] += v
    return {kind for kind, parts in groups.items() if _passes(parts, sums)}


def _check(conn: psycopg.Connection[Any], statement: str, where: str | None, sums: bool) -> tuple[set[str], bool]:
    """``statement`` rewritten answers as its exact path (where it takes the bounds-first shape), releases only
    groups the oracle passes, and their values are PostgreSQL's own; the released kinds, and whether the
    suppressed-rest row is released."""
    sql = _rewrite(conn, statement)
    fast = _run(conn, sql)
    if SURE in sql:
        assert fast == _run(conn, sql.replace(SURE, "SELECT false AND " + SURE.removeprefix("SELECT "))), statement
    rows, _, error = fast
    assert error is None, (statement, error)
    released = {row[0] for row in rows if row[0] is not None}
    assert released <= _oracle(conn, where, sums), statement
    own = {row[0]: row for row in sorted_rows(conn.execute(statement).fetchall())}
    assert all(row == own[row[0]] for row in rows if row[0] is not None), statement
    return released, any(row[0] is None for row in rows)


def _people(ids: list[int], kind: str, v: int = 5, rows: int = 1) -> list[tuple[int | None, str, int]]:
    return [(person, kind, v) for person in ids for _ in range(rows)]


# Units that collide in buckets -------------------------------------------------------------------------------------

COUNT = "SELECT a.kind, count(*) AS n FROM public.acts a GROUP BY 1"
SUM = "SELECT a.kind, count(*) AS n, sum(a.v) AS total FROM public.acts a GROUP BY 1"


@pytest.mark.parametrize("ids", [
    [64 * i for i in range(1, K)],  # k - 1 people in one bucket
    [-64 * i for i in range(1, K)],  # negative multiples of 64: bucket 0 too
    [-i for i in range(1, K)],  # negative ids: buckets 63, 62, ...
    [BIG * i + 3 for i in range(1, K)],  # bigint ids equal in their low bits
    [BIG + i for i in range(K - 1)],  # bigint ids in k - 1 buckets
], ids=["multiples of 64", "negative multiples", "negative", "bigint alike", "bigint spread"])
def test_k_minus_one_people_whatever_their_buckets_are_withheld(owner: psycopg.Connection, ids: list[int]) -> None:
    """A kind of k - 1 people (each with 30 rows, more rows than k) beside a large kind: withheld, whichever buckets
    the ids fall in (the large kind then too: complementary suppression)."""
    with owner.transaction(force_rollback=True):
        _fill(owner, _people(ids, "small", rows=30) + _people(list(range(1000, 1200)), "large"))
        for statement in (COUNT, SUM):
            assert "small" not in _check(owner, statement, None, statement is SUM)[0], statement


def test_k_minus_one_people_over_many_buckets_and_rows_without_a_unit(owner: psycopg.Connection) -> None:
    """k - 1 people in k - 1 buckets and a hundred rows without a unit: the NULL rows are nobody, the kind is
    withheld."""
    with owner.transaction(force_rollback=True):
        _fill(owner, _people(list(range(1, K)), "small") + [(None, "small", 5)] * 100
              + _people(list(range(1000, 1200)), "large"))
        for statement in (COUNT, SUM):
            assert "small" not in _check(owner, statement, None, statement is SUM)[0]


def test_k_people_that_collide_are_released_by_the_exact_path(owner: psycopg.Connection) -> None:
    """k people whose ids are multiples of 64 hold one bucket: the bounds settle nothing, the exact path releases
    them (the buckets cost time, never a verdict)."""
    with owner.transaction(force_rollback=True):
        _fill(owner, _people([64 * i for i in range(1, K + 1)], "tight") + _people(list(range(1000, 1200)), "large"))
        assert "tight" in _check(owner, COUNT, None, False)[0]


def test_one_person_spread_over_many_rows_dominates(owner: psycopg.Connection) -> None:
    """One person's 400 rows of 50 in a kind of 60 people of 1 each: dominance withheld it; the bounds cannot
    miss it, the person's rows all fall in their one bucket."""
    with owner.transaction(force_rollback=True):
        _fill(owner, _people([7], "dominated", 50, rows=400) + _people(list(range(100, 160)), "dominated", 1)
              + _people(list(range(1000, 1200)), "large"))
        assert "dominated" not in _check(owner, SUM, None, True)[0]


def test_negative_values_that_cancel_do_not_hide_a_dominant_person(owner: psycopg.Connection) -> None:
    """A person of +10,000 and another of -10,000 beside 40 people of 1: ``|sum|`` is small, so the bounds
    cannot prove dominance holds; the exact parts withhold the kind."""
    with owner.transaction(force_rollback=True):
        _fill(owner, [(1, "cancel", 10000), (2, "cancel", -10000)] + _people(list(range(100, 140)), "cancel", 1)
              + _people(list(range(1000, 1200)), "large"))
        for statement in (SUM, "SELECT a.kind, avg(a.v) AS mean FROM public.acts a GROUP BY 1"):
            assert "cancel" not in _check(owner, statement, None, True)[0], statement


@pytest.mark.parametrize("left_out", [K - 1, K, 0])
def test_a_where_that_leaves_out_k_minus_one_people(owner: psycopg.Connection, left_out: int) -> None:
    """A WHERE that leaves out k - 1 people (each of a row of -1) of N: the people the answer covers (its released
    kinds', everyone under the WHERE with the rest row) leave out of N nobody or at least k. With k or none left
    out, every kind is released."""
    people = list(range(1, 301))
    with owner.transaction(force_rollback=True):
        _fill(owner, [(person, "abc"[person % 3], -1 if person <= left_out else 5) for person in people])
        where = "a.v > 0"
        for statement in (f"SELECT a.kind, count(*) AS n FROM public.acts a WHERE {where} GROUP BY 1",
                          f"SELECT a.kind, sum(a.v) AS s FROM public.acts a WHERE {where} GROUP BY 1 "
                          "HAVING count(*) > 95"):
            released, rest = _check(owner, statement, where, "sum" in statement)
            covered = {person for person in people if person > left_out and ("abc"[person % 3] in released or rest)}
            assert len(people) - len(covered) not in range(1, K), (statement, released, rest)
            if left_out != K - 1:
                assert released == {"a", "b", "c"}, statement


# Generated: small tables of the linked shape, random statements ---------------------------------------------------

WHERES = (None, "a.v > 0", "a.person IS NOT NULL", "a.v <> 3")
AGGREGATES = ("count(*)", "sum(a.v)", "avg(a.v)", "count(a.v)", "count(DISTINCT a.v)")


def _draw(rng: random.Random) -> list[tuple[int | None, str, int]]:
    """People of four id styles (small, multiples of 64, negative, bigint alike in their low bits), each in one to
    three kinds of five, 1 to 4 rows each, values mostly small with a few heavy or negative; some NULL units."""
    style = rng.choice([lambda i: i, lambda i: 64 * i, lambda i: -i, lambda i: BIG * i + 5, lambda i: BIG + i])
    rows: list[tuple[int | None, str, int]] = []
    for i in range(1, rng.randint(20, 70)):
        person = style(i) if rng.random() > 0.2 else i  # mostly one style, some small ids mixed in
        for kind in rng.sample("abcde", rng.randint(1, 3)):
            value = rng.choice([1, 2, 3, 5, 8, -4, rng.randint(-1000, 5000)])
            rows += [(person, kind, value)] * rng.randint(1, 4)
    rows += [(None, rng.choice("abcde"), rng.randint(-50, 50)) for _ in range(rng.randint(0, 15))]
    return rows


@pytest.mark.parametrize("seed", range(8))
def test_generated_tables_release_only_what_the_oracles_release(owner: psycopg.Connection, seed: int) -> None:
    rng = random.Random(seed)
    with owner.transaction(force_rollback=True):
        _fill(owner, _draw(rng))
        for _ in range(6):
            aggregates = rng.sample(AGGREGATES, rng.randint(1, 2))
            where = rng.choice(WHERES)
            having = rng.choice(["", " HAVING count(*) > 3"])
            statement = (f"SELECT a.kind, {', '.join(aggregates)} FROM public.acts a"
                         + (f" WHERE {where}" if where else "") + f" GROUP BY 1{having}")
            _check(owner, statement, where, any(a.startswith(("sum", "avg")) for a in aggregates))


def test_the_oracle_counts_people_not_rows() -> None:
    """The oracle itself: k - 1 people with many rows fail; k people pass; one dominant part fails."""
    assert not _passes({i: 5 for i in range(K - 1)} | {None: 500}, False)
    assert _passes({i: 5 for i in range(K)}, True)
    assert not _passes({i: 1 for i in range(K)} | {99: 1000}, True)


def test_the_attacked_statements_take_the_bounds_first_shape(owner: psycopg.Connection) -> None:
    """The attacks above reach ``_bounded``: their rewritten SQL holds ``anonproxy_sure``."""
    for statement in (COUNT, SUM, "SELECT a.kind, count(*) AS n FROM public.acts a WHERE a.v > 0 GROUP BY 1"):
        assert _rewrite(owner, statement).count(SURE) == 1, statement
