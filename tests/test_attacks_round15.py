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

Through the real proxy (``attack_roles``): fan-out keys the rewrite could misread (aliases that shadow, a key
named as the unit, another schema's table of the same name, quoted names, conditions on both sides) answer as
PostgreSQL less withheld groups, or are refused; IN (SELECT ...) over what is not a reference table is refused,
and an error on the left side does not follow whether someone has a value; a statement name deallocated or in
use never runs another text, or a text the gate has no decision for (the last two failed before the fix in
anonproxy/proxy/routing.py: ``_bind``, ``_prepare``).
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, attack_roles, database_of_its_own, wait_for_current_policy
from service_sql import SURE, exact_path, reporter_sql, service_answer, sorted_rows
from test_attacks_round14 import SYNC, Raw, bind, errors, execute, parse, rows

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import ColumnPolicy, LinkedTable, Policy
from anonproxy.policy.yaml_policy import demo_policy
from anonproxy.wire import protocol as pg

DATABASE = "attacks_round15"
ACTS = "public.acts"
K = 10  # the demo reporter's rules: k, dominance (2, 85 %), p 10 %
BIG = 2**40  # bigint units that differ from small ones only above the bucket bits


def _acts(conn: psycopg.Connection[Any]) -> Policy:
    """The demo policy, and ``acts`` (person bigint, nullable) linked to adult, empty."""
    conn.execute(f"create table {ACTS} (person bigint, kind text not null, v integer not null)")
    link = LinkedTable(ACTS, "person", "public.adult", "id", {
        "person": ColumnPolicy("person", "identifier"),
        "kind": ColumnPolicy("kind", "quasi_identifier"),
        "v": ColumnPolicy("v", "sensitive")})
    return dataclasses.replace(demo_policy(), links={ACTS: link})


owner = database_of_its_own(DATABASE, _acts)


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
    sql = reporter_sql(conn, statement)
    rows, details = service_answer(conn, sql)
    if SURE in sql:
        assert (rows, details) == service_answer(conn, exact_path(sql)), statement
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
        assert reporter_sql(owner, statement).count(SURE) == 1, statement


# Through the real proxy: fan-out keys, reference semi-joins, DEALLOCATE ----------------------------------------------

reporter, analyst = attack_roles("dp_round15", scope="module")
REFERENCE = "public.r15_channels"
SHADOW = "r15_shadow"  # a schema whose tables share the names of public's


@pytest.fixture(scope="module")
def reference(truth: psycopg.Connection[Any], gated_proxy: Endpoint, gated_database: str) -> Iterator[None]:
    """A declared reference table of channels, and a schema of tables named as adult and it, readable by all."""
    truth.execute(f"create table {REFERENCE} (channel text primary key, kind text not null)")
    truth.execute(f"insert into {REFERENCE} values ('web', 'online'), ('app', 'online'), ('store', 'offline')")
    truth.execute(f"select anonproxy.declare_reference_table('{REFERENCE}')")
    truth.execute(f"create schema {SHADOW}")
    truth.execute(f"create table {SHADOW}.adult as select * from public.adult where id < 5")
    truth.execute(f"create table {SHADOW}.r15_channels as select id::text as channel, sex as kind from public.adult")
    truth.execute(f"grant usage on schema {SHADOW} to public")
    truth.execute(f"grant select on all tables in schema {SHADOW} to public")
    wait_for_current_policy(truth, gated_proxy, gated_database)
    try:
        yield
    finally:
        truth.execute(f"select anonproxy.undeclare_reference_table('{REFERENCE}')")
        truth.execute(f"drop table {REFERENCE}")
        truth.execute(f"drop schema {SHADOW} cascade")
        wait_for_current_policy(truth, gated_proxy, gated_database)


def _outcome(conn: psycopg.Connection[Any], sql: str) -> tuple[str, Any]:
    """("rows", the rows) or ("error", its SQLSTATE)."""
    try:
        return "rows", conn.execute(sql).fetchall()
    except psycopg.Error as error:
        return "error", error.sqlstate


def _keys(keys: str, outer: str = "public.adult", on: str = "k.pk = adult.id", select: str = "k.s, count(adult.age)",
          where: str = "") -> str:
    return (f"SELECT {select} FROM (SELECT DISTINCT {keys}) AS k JOIN {outer} ON {on} {where} GROUP BY 1")


FANOUT = {
    # the keys' alias is the joined table's too: PostgreSQL refuses the duplicate name
    "one alias for both": _keys("adult.sex s, adult.id pk FROM public.adult", "public.adult k", "k.pk = k.id"),
    # a DISTINCT key named as the unit that is another column
    "a key named as the unit": _keys("adult.age id, adult.sex s FROM public.adult", on="k.id = adult.id"),
    # the keys from another schema's table of the same name
    "keys of a shadow table": _keys(f"adult.sex s, adult.id pk FROM {SHADOW}.adult"),
    # joined back to another schema's table of the same name
    "joined back to a shadow table": _keys("adult.sex s, adult.id pk FROM public.adult", f"{SHADOW}.adult"),
    # quoted identifiers that differ from the key's name only in case
    "a key in another case": _keys('adult.sex s, adult.id "PK" FROM public.adult', on='k."PK" = adult.id'),
    "a key named in another case": _keys('adult.sex s, adult.id "PK" FROM public.adult', on="k.pk = adult.id"),
    # an outer WHERE on the unit through the keys: one person's group
    "an outer WHERE on the key": _keys("adult.sex s, adult.id pk FROM public.adult", where="WHERE k.pk = 17"),
    # the unit itself as the outer group: one person a group
    "grouped by the key": _keys("adult.sex s, adult.id pk FROM public.adult", select="k.pk, count(adult.age)"),
    # answered shapes with aliases that shadow: the keys' table named as the keys, the outer table renamed, and
    # conditions on both sides naming "adult" for different scopes
    "the keys' table named k": _keys("k.sex s, k.id pk FROM public.adult k WHERE k.age > 30"),
    "the outer table renamed": _keys("adult.sex s, adult.id pk FROM public.adult WHERE adult.age > 30",
                                     "public.adult a", "k.pk = a.id", "k.s, count(a.age), sum(a.age)"),
    "WHERE on both sides": _keys("adult.sex s, adult.id pk FROM public.adult WHERE adult.age > 30",
                                 where="WHERE adult.age < 40 AND k.s = 'Male'"),
    "LEFT JOIN to visits, filtered": _keys("adult.sex s, adult.id pk FROM public.adult LEFT JOIN public.visits v "
                                           "ON v.person_id = adult.id WHERE v.channel = 'web'",
                                           select="k.s, count(adult.age), avg(adult.age)"),
    # the keys' WHERE reads the outer table (PostgreSQL: not without LATERAL)
    "keys reading the outer query": _keys("a2.sex s, a2.id pk FROM public.adult a2 WHERE a2.age > adult.age"),
}


@pytest.mark.parametrize("sql", FANOUT.values(), ids=FANOUT.keys())
def test_fanout_keys_answer_as_postgresql_or_refuse(sql: str, reference: None, reporter: psycopg.Connection[Any],
                                                    truth: psycopg.Connection[Any]) -> None:
    """Each statement is refused, or answered with PostgreSQL's own rows less withheld groups (none of fewer than
    k people, by its count); where PostgreSQL refuses it, the proxy does too."""
    kind, expected = _outcome(truth, sql)
    got_kind, got = _outcome(reporter, sql)
    if kind == "error" or got_kind == "error":
        assert got_kind == "error", (sql, expected, got)
        return
    released = Counter(row for row in got if row[0] is not None)
    assert not released - Counter(expected), (sql, got, expected)  # PostgreSQL's rows, some withheld
    assert all(row[1] >= K for row in released), got  # none of fewer than k people


SEMI = {
    "a protected table": ("SELECT sex, count(*) FROM public.adult WHERE sex IN (SELECT sex FROM public.adult) "
                          "GROUP BY 1"),
    "a linked table": ("SELECT channel, count(*) FROM public.visits WHERE channel IN (SELECT channel FROM "
                       "public.visits) GROUP BY 1"),
    "a shadow table of the same name": (f"SELECT channel, count(*) FROM public.visits WHERE channel IN (SELECT channel "
                                        f"FROM {SHADOW}.r15_channels) GROUP BY 1"),
    "a function": ("SELECT channel, count(*) FROM public.visits WHERE channel IN (SELECT channel FROM "
                   "pg_catalog.generate_series(1, 2) AS channel) GROUP BY 1"),
    "a view over the protected table": ("SELECT channel, count(*) FROM public.visits WHERE channel IN (SELECT "
                                        "table_name FROM information_schema.tables) GROUP BY 1"),
    "the unit against a list": ("SELECT sex, count(*) FROM public.adult WHERE id::text IN (SELECT channel FROM "
                                f"{SHADOW}.r15_channels) GROUP BY 1"),
}


@pytest.mark.parametrize("sql", SEMI.values(), ids=SEMI.keys())
def test_semi_joins_on_what_is_not_a_reference_table_are_refused(sql: str, reference: None,
                                                                 reporter: psycopg.Connection[Any],
                                                                 analyst: psycopg.Connection[Any]) -> None:
    for conn in (reporter, analyst):
        kind, sqlstate = _outcome(conn, sql)
        assert kind == "error" and sqlstate in ("0A000", "42501", "42P01"), (sql, kind, sqlstate)


# Errors that would depend on one person's value: the left side fails only for an age some person has. (The
# subquery reads only the reference table, public: its errors follow public values.)
FAILING = {
    "a cast of the left side": ("SELECT sex, count(*) FROM public.adult WHERE (CASE WHEN age = {age} THEN 'x'::int "
                                "ELSE 0 END)::text IN (SELECT channel FROM public.r15_channels) GROUP BY 1"),
    "a division on the left side": ("SELECT sex, count(*) FROM public.adult WHERE (100 / (age - {age}))::text IN "
                                    "(SELECT channel FROM public.r15_channels) GROUP BY 1"),
}


@pytest.mark.parametrize("sql", FAILING.values(), ids=FAILING.keys())
def test_an_error_does_not_tell_whether_someone_has_a_value(sql: str, reference: None,
                                                            reporter: psycopg.Connection[Any],
                                                            analyst: psycopg.Connection[Any],
                                                            truth: psycopg.Connection[Any]) -> None:
    """With an age some person has (90) and one nobody has (-5), the proxy's outcome (refused, an error, rows) is the
    same: whatever SQLSTATE it gives does not follow the data."""
    present, absent = (sql.format(age=age) for age in (90, -5))
    assert truth.execute("SELECT count(*) FROM public.adult WHERE age = 90").fetchone()[0] > 0
    for conn in (reporter, analyst):
        with_someone, without = _outcome(conn, present), _outcome(conn, absent)
        assert with_someone[0] == without[0], (sql, with_someone, without)
        if with_someone[0] == "error":
            assert with_someone == without, sql


# DEALLOCATE and a statement of the same name prepared again, in one batch ------------------------------------------

def _steps(session: Raw, *steps: bytes) -> list[list[tuple[bytes, bytes]]]:
    """Each step's messages up to its ReadyForQuery."""
    answers = []
    for step in steps:
        session.send(step)
        answers.append(session.until(b"Z"))
    return answers


def _steps_on_both(gated_proxy: Endpoint, pg_server: EmbeddedPostgres, gated_database: str,
                   *steps: bytes) -> dict[str, list[list[tuple[bytes, bytes]]]]:
    """The answers of :func:`_steps` in a session of the reporter through the proxy, and of the superuser on
    PostgreSQL itself."""
    answers = {}
    for who, dsn in (("proxy", gated_proxy.dsn(gated_database, user="reporter")),
                     ("postgresql", pg_server.conninfo(dbname=gated_database))):
        session = Raw(dsn)
        try:
            answers[who] = _steps(session, *steps)
        finally:
            session.close()
    return answers


ALLOWED = "select count(*) from public.adult"
IDS = "select id, age from public.adult"  # refused to the reporter: person by person


@pytest.mark.parametrize("drop", ["deallocate s1", "DEALLOCATE PREPARE S1", 'deallocate "s1"',
                                  "select 1; deallocate s1", "deallocate s1; select 1/0", "discard all",
                                  "deallocate all"])
def test_a_name_prepared_again_after_deallocate_runs_under_its_own_decision(drop: str, gated_proxy: Endpoint,
                                                                             gated_database: str) -> None:
    """One batch: an allowed count prepared as s1 and run, ``drop`` as a Query, s1 prepared again as the ids of
    every person, bound and run. PostgreSQL would answer it to its owner; through the proxy its Parse is refused
    and no row of it comes back, whatever dropped s1 (and whether it did)."""
    session = Raw(gated_proxy.dsn(gated_database, user="reporter"))
    try:
        session.send(parse(ALLOWED, b"s1") + bind(statement=b"s1") + execute() + SYNC, pg.query_message(drop),
                     parse(IDS, b"s1") + bind(statement=b"s1") + execute() + SYNC)
        first, dropped, again = session.until(b"Z"), session.until(b"Z"), session.until(b"Z")
    finally:
        session.close()
    assert len(rows(first)) == 1 and not errors(first), first
    assert dropped  # answered, as PostgreSQL answers it or with its error
    assert rows(again) == [] and errors(again), again


def test_a_name_in_use_keeps_its_statement_and_its_decision(gated_proxy: Endpoint, pg_server: EmbeddedPostgres,
                                                            gated_database: str) -> None:
    """s1 on the wire is "S1": ``deallocate S1`` (folded to s1) drops nothing; "S1" prepared again as the ids of
    every person, then as another count, is refused both times; "S1" still runs the first count. As PostgreSQL
    answers (the first error aside: the proxy refuses the ids before PostgreSQL would find the name in use)."""
    steps = (parse(ALLOWED, b"S1") + SYNC, pg.query_message("deallocate S1"), parse(IDS, b"S1") + SYNC,
             parse(ALLOWED + " where age > 50", b"S1") + SYNC, bind(statement=b"S1") + execute() + SYNC)
    answers = _steps_on_both(gated_proxy, pg_server, gated_database, *steps)
    for who, (prepared, dropped, ids, other, run) in answers.items():
        assert not errors(prepared) and errors(dropped) == ["26000"], (who, dropped)
        assert rows(ids) == [] and errors(ids) == (["42501"] if who == "proxy" else ["42P05"]), (who, ids)
        assert errors(other) == ["42P05"], (who, other)
        assert not errors(run), (who, run)
    assert rows(answers["proxy"][-1]) == rows(answers["postgresql"][-1])


def test_a_name_the_gate_forgot_binds_nothing_after_the_policy_changed(truth: psycopg.Connection[Any],
                                                                       gated_proxy: Endpoint,
                                                                       gated_database: str) -> None:
    """s9 reads a declared reference table (answered on the client's connection); prepared again as the ids of
    every person, refused, the gate forgot s9 while the connection kept it. The table then stops being a reference
    table, which the reporter may no longer read. Bound, s9 must not run its old text without a decision under the
    policy in force: no row comes back."""
    truth.execute("create table public.r15_secret (x integer primary key)")
    truth.execute("insert into public.r15_secret values (1), (2)")
    truth.execute("select anonproxy.declare_reference_table('public.r15_secret')")
    wait_for_current_policy(truth, gated_proxy, gated_database)
    session = Raw(gated_proxy.dsn(gated_database, user="reporter"))
    try:
        prepared, again = _steps(session, parse("select x from public.r15_secret", b"s9") + SYNC,
                                 parse(IDS, b"s9") + SYNC)
        assert not errors(prepared) and errors(again), (prepared, again)
        truth.execute("select anonproxy.undeclare_reference_table('public.r15_secret')")
        wait_for_current_policy(truth, gated_proxy, gated_database)
        assert errors(session.query("select x from public.r15_secret"))  # the policy now refuses it
        bound, = _steps(session, bind(statement=b"s9") + execute() + SYNC)
        assert rows(bound) == [] and errors(bound), bound
    finally:
        session.close()
        truth.execute("drop table public.r15_secret")
        wait_for_current_policy(truth, gated_proxy, gated_database)


def test_deallocate_of_a_gated_statement_that_took_a_relayed_name(gated_proxy: Endpoint, pg_server: EmbeddedPostgres,
                                                                  gated_database: str) -> None:
    """s8 prepared as ``select 1`` (on the client's connection), then as a gated count (PostgreSQL: 42P05, s8
    unchanged), then DEALLOCATE s8: bound afterwards, s8 is gone through the proxy as in PostgreSQL (26000) -- the
    connection's old s8 never runs without the gate's decision."""
    steps = (parse("select 1", b"s8") + SYNC, parse(ALLOWED, b"s8") + SYNC, pg.query_message("deallocate s8"),
             bind(statement=b"s8") + execute() + SYNC)
    for who, answers in _steps_on_both(gated_proxy, pg_server, gated_database, *steps).items():
        bound = answers[-1]
        assert rows(bound) == [] and errors(bound) == ["26000"], (who, bound)


@pytest.mark.parametrize("again", ["select count(*) from pg_catalog.pg_class", ALLOWED])
def test_a_name_whose_parse_failed_on_the_connection_can_be_prepared_again(again: str, gated_proxy: Endpoint,
                                                                          pg_server: EmbeddedPostgres,
                                                                          gated_database: str) -> None:
    """s7's first Parse goes to the client's connection (a catalog query) and fails there (42703): the name is free,
    and prepared again (relayed, or a gated count) it runs, as in PostgreSQL -- the gate does not take a name whose
    Parse it did not answer itself for one in use."""
    steps = (parse("select nosuchcolumn from pg_catalog.pg_class", b"s7") + SYNC, parse(again, b"s7") + SYNC,
             bind(statement=b"s7") + execute() + SYNC)
    answers = _steps_on_both(gated_proxy, pg_server, gated_database, *steps)
    for who, (failed, prepared, run) in answers.items():
        assert errors(failed) == ["42703"] and not errors(prepared) and not errors(run), (who, prepared, run)
    assert rows(answers["proxy"][-1]) == rows(answers["postgresql"][-1])
