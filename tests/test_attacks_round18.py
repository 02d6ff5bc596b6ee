"""Red team round 18: the code merged in round 16/17 read by an attacker (fan-out keys as a linked table's distinct
(values, key) rows, [NOT] EXISTS over a reference table, the lexer's reading of ``$``, LIKE ... ESCAPE, concat()
folding, row IN lists, and the no-error proof's idea of a folded constant).

One leaked, now fixed: a reference table's unique key in the default collation joined on a protected column of a
nondeterministic (case-insensitive) collation. PostgreSQL compares the two under the latter, where 'rare', 'RARE'
and 'Rare' (three keys the index tells apart) are equal: each person's row met three reference rows, and the
suppression SQL, taking a reference join on a unique key for one row per person, released a kind of 4 people as
12 (``test_a_reference_key_matched_under_a_nondeterministic_collation_repeats_no_person`` failed before the fix in
anonproxy/plan/joins.py; the collations are read with the policy, anonproxy/policy/store.py). In dp mode the same
join was priced as one row per person.

Tried, and none leaked; kept as guards:

* Error channel of constants PostgreSQL computes per row (each shown failing in PostgreSQL itself only when someone
  meets a CASE condition): text cast to time, timetz, money, regclass, interval; the text of timezone(),
  date_trunc(..., zone), make_date(), extract(), width_bucket(), now() - now(), a date under upper() or
  coalesce() cast to a number or a date; concat() over a date; LIKE patterns ending in the escape character
  through ESCAPE '%', concat() and upper(). Through the proxy each has one outcome whatever the data: refused,
  or (concat('1', 'x')::int, which the proxy folds to a constant PostgreSQL reads when it parses) PostgreSQL's own
  error for everyone.
* The lexer: ``$$`` inside block and line comments, a nested block comment hiding a condition, a name ending in
  ``$``: the proxy answers what PostgreSQL answers; dollar-quoted and E''/U&'' strings are refused in WHERE.
* Distinct (values, key) derived tables: a WHERE that could fail on a row, a join on another column than the unit,
  a derived table reusing the outer table's alias, a date_trunc time dimension, a numeric column summed over the
  distinct rows, identifying columns selected or filtered (withheld as in the plain join).
* EXISTS over a reference table: LIMIT 0, a cast that could fail in its select list or conditions, an identifying
  column through a cast, a whole row, a comparison that converts one side; NULLs under NOT EXISTS and a
  correlation through to_char()/a cast to text answered as PostgreSQL.
* A LIMIT or OFFSET count bound at Bind (``$1::integer``): the outcome of the count written; a negative or NULL
  count refused; inside EXISTS refused whatever its value (decided at Parse with the representative 0).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import (Endpoint, attack_roles, database_of_its_own, reporter_through_own_proxy,
                      suppress_answers_as_postgresql, wait_for_current_policy)

from anonproxy.policy.model import ColumnPolicy, Policy, ProtectedTable, ReferenceTable
from anonproxy.policy.yaml_policy import demo_policy

reporter, analyst = attack_roles("dp_round18", epsilon=1000, scope="module")

K = 10
PLENTY = 1000  # a group this large passes every rule of the demo reporter
NOBODY = 3  # below adult's declared lower bound of age (15): no row has it
KINDS = "public.r18_kinds"

# {0}: a condition that holds for some rows or for none; each expression fails in PostgreSQL where a row reaches it.
REACHED_ONLY = [
    "select count(*) from adult where case when {0} then 'garbage'::text::time > localtime else false end",
    "select count(*) from adult where case when {0} then 'garbage'::varchar::time is not null else false end",
    "select count(*) from adult where case when {0} then 'garbage'::text::timetz is not null else false end",
    "select count(*) from adult where case when {0} then 'garbage'::text::money is not null else false end",
    "select count(*) from adult where case when {0} then 'garbage'::text::regclass is not null else false end",
    "select count(*) from adult where case when {0} then 'garbage'::text::interval is not null else false end",
    "select count(*) from adult where case when {0} then timezone('UTC', now())::text::int > 0 else false end",
    "select count(*) from adult where case when {0} then date_trunc('day', timestamptz '2025-01-01', 'UTC')::text::int "
    "> 0 else false end",
    "select count(*) from adult where case when {0} then upper((date '2025-01-01')::text)::int > 0 else false end",
    "select count(*) from adult where case when {0} then coalesce(null, (date '2025-01-01')::text)::int > 0 "
    "else false end",
    "select count(*) from adult where case when {0} then extract(year from date '2025-01-01')::text::date "
    "> current_date else false end",
    "select count(*) from adult where case when {0} then (now() - now())::text::int > 0 else false end",
    "select count(*) from adult where case when {0} then make_date(2025, 1, 1)::text::int > 0 else false end",
    "select count(*) from adult where case when {0} then width_bucket(5, 10, 0, 3)::text::date > current_date "
    "else false end",
    "select count(*) from adult where case when {0} then nullif('a', 'b')::text::date > current_date else false end",
    "select count(*) from adult where case when {0} then (date '2025-01-01' - date '2024-01-01')::text::date "
    "> current_date else false end",
    "select count(*) from adult where case when {0} then concat('a', date '2025-01-01')::int > 0 else false end",
    "select count(*) from adult where case when {0} then concat('1', 'x')::int > 0 else false end",
    "select count(*) from adult where case when {0} then length(to_char(now(), 'YYYY'))::text::date > current_date "
    "else false end",
    "select count(*) from adult where case when {0} then to_timestamp('2025', 'YYYY')::text::int > 0 else false end",
    # LIKE: a pattern ending in its escape character fails for the rows that reach it
    "select count(*) from adult where case when {0} then sex like 'M%' escape '%' else false end",
    "select count(*) from adult where case when {0} then sex like concat('M', '%', '\\') else false end",
    "select count(*) from adult where case when {0} then sex like upper('m#') escape '#' else false end",
]


def outcome(conn: psycopg.Connection[Any], sql: str) -> str:
    """"answered", or the SQLSTATE ``sql`` fails with ("refused" for the proxy's own refusal, which has a hint)."""
    try:
        conn.execute(sql).fetchall()
    except psycopg.Error as error:
        return "refused" if error.diag.message_hint is not None and error.sqlstate in ("0A000", "42501") \
            else str(error.sqlstate)
    return "answered"


@pytest.fixture(scope="module")
def someone(truth: psycopg.Connection[Any]) -> str:
    """A condition that holds for fewer than k = 10 people: an age few people have, with one income."""
    row = truth.execute("select age, income from adult group by age, income having count(*) between 1 and 9 "
                        "order by age limit 1").fetchone()
    assert row is not None
    age, income = row
    return f"age = {age} and income = '{income}'"


@pytest.mark.parametrize("sql", REACHED_ONLY)
@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_a_constant_postgresql_computes_per_row_is_no_oracle(request: pytest.FixtureRequest,
                                                             truth: psycopg.Connection[Any], someone: str,
                                                             sql: str, role: str) -> None:
    """PostgreSQL fails only when someone meets the condition; through the proxy the outcome is one whatever the
    data (a refusal, or an error for everyone)."""
    conn = request.getfixturevalue(role)
    assert outcome(truth, sql.format(f"age = {NOBODY}")) == "answered"
    assert outcome(truth, sql.format(someone)) not in ("answered", "refused")  # the channel, in PostgreSQL itself
    outcomes = {outcome(conn, sql.format(condition)) for condition in (f"age = {NOBODY}", someone)}
    assert len(outcomes) == 1 and outcomes != {"answered"}, (sql, outcomes)


# --- the lexer: what the proxy checks is what PostgreSQL reads ------------------------------------------------------

READ_AS_POSTGRESQL = [
    "select count(*) as n from adult where age > 20 /* /* */ and sex = 'Male' -- */",  # nested: all one comment
    "select count(*) as n from adult where age > 20 /* $$ */ and sex = 'Male'",
    "select count(*) as n from adult where age > 20 -- $$\n and sex = 'Male'",
    "select count(*) as n$ from adult where age > 20",
    "select count(*) as n from adult where (sex, age) in (('Male', 37), ('Female', null))",
]


@pytest.mark.parametrize("sql", READ_AS_POSTGRESQL)
def test_the_lexer_reads_comments_and_dollars_as_postgresql(reporter: psycopg.Connection[Any],
                                                           truth: psycopg.Connection[Any], sql: str) -> None:
    suppress_answers_as_postgresql(reporter, truth, sql)


@pytest.mark.parametrize("sql", [
    "select count(*) from adult where sex = $a$Male$a$",
    "select count(*) from adult where sex = $$ ' $$",
    "select count(*) from adult where sex = E'\\'$$'",
    "select count(*) from adult where sex = U&'$$'",
    "select count(*) from adult where sex = $1$",
])
@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_dollar_and_escape_strings_in_where_are_refused(request: pytest.FixtureRequest, sql: str,
                                                        role: str) -> None:
    assert outcome(request.getfixturevalue(role), sql) == "refused"


# --- distinct (values, key) derived tables ------------------------------------------------------------------------

DISTINCT_REFUSED = [
    ("select k.channel, count(*) from adult a join (select distinct v.channel, v.person_id from visits v where "
     "v.channel::int > 0) as k on k.person_id = a.id group by 1", "cast to INT"),
    ("select k.channel, count(*) from adult a left join (select distinct v.channel, v.person_id from visits v "
     "where case when v.amount < -5 then v.channel::int > 0 else false end) as k on k.person_id = a.id group by 1",
     "cast to INT"),
    ("select k.channel, count(*) from adult a join (select distinct v.channel, v.person_id from visits v) as k "
     "on k.person_id = a.age group by 1", "identifying column person_id"),
    ("select k.d, count(*) from adult a join (select distinct date_trunc('day', v.person_id) as d, v.person_id "
     "from visits v) as k on k.person_id = a.id group by 1", "person_id"),
    ("select k.channel, count(*) from adult a join (select distinct v.channel as person_id, v.person_id as p "
     "from visits v) as k on k.person_id = a.id group by 1", ""),
    ("select k.c, count(*) from adult a join (select distinct 'x' as c, v.person_id from visits v) as k "
     "on k.person_id = a.id group by 1", ""),
]


@pytest.mark.parametrize(("sql", "words"), DISTINCT_REFUSED)
@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_distinct_pairs_that_are_not_one_persons_rows_are_refused(request: pytest.FixtureRequest, sql: str,
                                                                  words: str, role: str) -> None:
    with pytest.raises(psycopg.Error) as refused:
        request.getfixturevalue(role).execute(sql).fetchall()
    assert refused.value.sqlstate in ("0A000", "42501"), refused.value
    assert refused.value.diag.message_hint is not None
    assert words in (refused.value.diag.message_primary or "")


DISTINCT_ANSWERED = [
    # the derived table's table alias is the outer protected table's: its own scope, as PostgreSQL reads it
    "select k.channel, count(*) as n from adult a join (select distinct a.channel, a.person_id from visits a) as k "
    "on k.person_id = a.id group by 1",
    "select k.d, count(*) as n from adult a join (select distinct date_trunc('month', v.visited_at) as d, "
    "v.person_id from visits v) as k on k.person_id = a.id group by 1",
    "select k.channel, count(*) as n from adult a join (select distinct v.channel, v.person_id from visits v "
    "where v.visit_id = 5) as k on k.person_id = a.id group by 1",
    "select k.visit_id, count(*) as n from adult a join (select distinct v.visit_id, v.person_id from visits v) "
    "as k on k.person_id = a.id group by 1",
]


@pytest.mark.parametrize("sql", DISTINCT_ANSWERED)
def test_distinct_pairs_answered_as_postgresql(reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any],
                                               sql: str) -> None:
    """Each released row is PostgreSQL's own, of at least k people (each row of the derived table is one person's
    (value, key) pair: a group's rows are its people)."""
    released_as_postgresql(reporter, truth, sql)


def released_as_postgresql(reporter: psycopg.Connection[Any], truth: psycopg.Connection[Any], sql: str) -> None:
    """The rows ``reporter`` is given for ``sql`` (a key and a count of people) are PostgreSQL's own, each of at
    least k people; a group of fewer is withheld (in the rest row, its key NULL, if any)."""
    expected = set(truth.execute(sql).fetchall())
    released = [row for row in reporter.execute(sql).fetchall() if row[0] is not None]
    assert set(released) <= expected, (released, expected)
    assert all(n >= K for _, n in released), released
    assert {row for row in expected if row[1] >= PLENTY} <= set(released)  # large groups are not withheld


# --- EXISTS over a reference table --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kinds(truth: psycopg.Connection[Any], gated_proxy: Endpoint, gated_database: str) -> Iterator[None]:
    """A reference table of channels with a NULL column and a numeric past double precision's range."""
    truth.execute(f"create table {KINDS} (channel text primary key, kind text not null, replaced_by text, "
                  "weight numeric)")
    truth.execute(f"insert into {KINDS} values ('web', 'online', null, 1), ('app', 'online', null, 2), "
                  "('store', 'offline', null, 3), ('phone', 'offline', 'app', 1e400)")
    truth.execute(f"select anonproxy.declare_reference_table('{KINDS}')")
    wait_for_current_policy(truth, gated_proxy, gated_database)
    try:
        yield
    finally:
        truth.execute(f"select anonproxy.undeclare_reference_table('{KINDS}')")
        truth.execute(f"drop table {KINDS}")
        wait_for_current_policy(truth, gated_proxy, gated_database)


EXISTS_REFUSED = [
    "select channel, count(*) from visits where exists (select 1 from r18_kinds k where k.channel = visits.*::text) "
    "group by 1",
    "select channel, count(*) from visits where exists (select 1 from r18_kinds k where k.channel = visits.channel "
    "limit 0) group by 1",
    "select channel, count(*) from visits where exists (select 1 from r18_kinds k where k.channel = "
    "lower(visits.channel) and k.weight::int > 0) group by 1",
    "select channel, count(*) from visits where exists (select k.weight::int from r18_kinds k where k.channel = "
    "visits.channel) group by 1",
    "select channel, count(*) from visits where exists (select 1 from r18_kinds k where k.channel = "
    "visits.person_id::text) group by 1",
    "select channel, count(*) from visits where exists (select 1 from r18_kinds k where k.weight = "
    "visits.amount * 2) group by 1",
    "select a.sex, count(*) from adult a where exists (select 1 from r18_kinds k where k.weight = a.age) group by 1",
]


@pytest.mark.parametrize("sql", EXISTS_REFUSED)
@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_exists_over_a_reference_table_that_could_fail_or_pick_out_is_refused(
        request: pytest.FixtureRequest, kinds: None, sql: str, role: str) -> None:
    assert outcome(request.getfixturevalue(role), sql) == "refused"


EXISTS_ANSWERED = [
    "select channel, count(*) as n from visits where not exists (select 1 from r18_kinds k where k.replaced_by = "
    "visits.channel) group by 1",
    "select channel, count(*) as n from visits where exists (select 1 from r18_kinds k where k.weight = "
    "visits.amount) group by 1",
    "select channel, count(*) as n from visits where exists (select 1 from r18_kinds k where k.channel = "
    "to_char(visits.visited_at, 'YYYY')) group by 1",
    "select a.sex, count(*) as n from adult a where exists (select 1 from r18_kinds k where k.channel = a.sex "
    "and k.channel = a.race) group by 1",
]


@pytest.mark.parametrize("sql", EXISTS_ANSWERED)
def test_exists_over_a_reference_table_answered_as_postgresql(reporter: psycopg.Connection[Any],
                                                              truth: psycopg.Connection[Any], kinds: None,
                                                              sql: str) -> None:
    released_as_postgresql(reporter, truth, sql)


# --- a reference key matched under another collation than its own ------------------------------------------------

COLLATED = "attacks_round18"
CLUBS = "public.clubs"  # a protected table, its unit an integer primary key (each row one person), a kind of the
# nondeterministic collation public.ci ('rare' = 'RARE')
LABELS = "public.kind_labels"  # a reference table keyed in the default collation: 'rare', 'RARE' and 'Rare' apart
LABELS_CI = "public.kind_labels_ci"  # the same keyed in public.ci: one row per kind as clubs compares them


def _collated(conn: psycopg.Connection[Any]) -> Policy:
    """The demo policy and ``clubs``: 300 people of kind 'big', 4 of 'rare' (fewer than k); ``kind_labels`` holds
    one label for 'big' and the same label for three spellings of 'rare', which public.ci takes as one."""
    conn.execute("CREATE COLLATION public.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false)")
    conn.execute(f"CREATE TABLE {CLUBS} (id integer PRIMARY KEY, kind text COLLATE public.ci NOT NULL, v integer)")
    conn.execute(f"INSERT INTO {CLUBS} SELECT i, CASE WHEN i <= 4 THEN 'rare' ELSE 'big' END, 5 "
                 "FROM generate_series(1, 304) AS i")
    conn.execute(f"CREATE TABLE {LABELS} (kind text PRIMARY KEY, label text NOT NULL)")
    conn.execute(f"INSERT INTO {LABELS} VALUES ('big', 'common'), ('rare', 'scarce'), ('RARE', 'scarce'), "
                 "('Rare', 'scarce')")
    conn.execute(f"CREATE TABLE {LABELS_CI} (kind text COLLATE public.ci PRIMARY KEY, label text NOT NULL)")
    conn.execute(f"INSERT INTO {LABELS_CI} VALUES ('big', 'common'), ('rare', 'scarce')")
    for table in (CLUBS, LABELS, LABELS_CI):
        conn.execute(f"ANALYZE {table}")
    clubs = ProtectedTable(CLUBS, "id", {"id": ColumnPolicy("id", "identifier"),
                                          "kind": ColumnPolicy("kind", "quasi_identifier"),
                                          "v": ColumnPolicy("v", "sensitive", -100, 100)})
    policy = demo_policy()
    return dataclasses.replace(policy, tables={**policy.tables, CLUBS: clubs},
                               references={table: ReferenceTable(table) for table in (LABELS, LABELS_CI)})


owner = database_of_its_own(COLLATED, _collated)


club_reporter = reporter_through_own_proxy(COLLATED, name="club_reporter")


@pytest.mark.parametrize("sql", [
    f"select l.label, count(*) as n from {CLUBS} c join {LABELS} l on l.kind = c.kind group by 1",
    f"select l.label, count(*) as n from {CLUBS} c left join {LABELS} l on c.kind = l.kind group by 1",
])
def test_a_reference_key_matched_under_a_nondeterministic_collation_repeats_no_person(
        owner: psycopg.Connection, club_reporter: psycopg.Connection, sql: str) -> None:
    """PostgreSQL compares the default-collation key with the case-insensitive kind under public.ci: each of the 4
    'rare' people meets three reference rows, 12 rows of 4 people. Taken for one row per person (a reference table
    joined on a unique key), 'scarce' was released as 12 (before the fix in anonproxy/plan/joins.py); the join is
    now refused, naming the collations."""
    assert ("scarce", 12) in owner.execute(sql).fetchall()  # three rows per person, in PostgreSQL itself
    assert owner.execute(f"select count(DISTINCT c.id) from {CLUBS} c join {LABELS} l on l.kind = c.kind "
                         "where l.label = 'scarce'").fetchone() == (4,)
    with pytest.raises(psycopg.errors.FeatureNotSupported) as refused:
        club_reporter.execute(sql).fetchall()
    assert "differ in collation" in (refused.value.diag.message_primary or "")
    assert "collation of the column it is joined on" in (refused.value.diag.message_hint or "")


def test_a_reference_key_of_the_columns_own_collation_is_joined(owner: psycopg.Connection,
                                                                 club_reporter: psycopg.Connection) -> None:
    """Keyed in public.ci, the reference table holds one row per kind as clubs compares kinds: the join is answered,
    'scarce' (4 people) withheld, and with it 'common' (complementary suppression: the total would give 'scarce'
    away), both in the rest row."""
    sql = f"select l.label, count(*) as n from {CLUBS} c join {LABELS_CI} l on l.kind = c.kind group by 1"
    assert sorted(owner.execute(sql).fetchall()) == [("common", 300), ("scarce", 4)]
    rows = club_reporter.execute(sql).fetchall()
    assert rows == [(None, 304)], rows


# --- a LIMIT or OFFSET count bound at Bind ------------------------------------------------------------------------

@pytest.mark.parametrize(("sql", "value"), [
    ("select sex, count(*) as n from adult group by 1 order by 1 limit %s::integer", 1),
    ("select sex, count(*) as n from adult group by 1 order by 1 offset %s::bigint", 1),
    ("select sex, count(*) as n from adult group by 1 order by 1 limit %s::smallint", 0),
])
def test_a_bound_count_is_decided_as_the_constant_written(reporter: psycopg.Connection[Any], sql: str,
                                                          value: int) -> None:
    """A count bound at Bind (server-side binding) has the outcome of the same count written in the statement."""
    written = outcome(reporter, re.sub(r"%s::\w+", str(value), sql))
    try:
        reporter.execute(sql, [value], prepare=True).fetchall()
        bound = "answered"
    except psycopg.Error as error:
        bound = "refused" if error.diag.message_hint is not None and error.sqlstate in ("0A000", "42501") \
            else str(error.sqlstate)
    assert bound == written, (sql, value, bound, written)


@pytest.mark.parametrize("value", [0, 2])
def test_a_bound_count_inside_exists_is_refused_whatever_its_value(reporter: psycopg.Connection[Any],
                                                                  value: int) -> None:
    """Inside EXISTS a count must be a positive constant; a bound one is decided at Parse with the representative
    0 and refused, whether its value would be accepted written (2) or not (0): one outcome, whatever the data."""
    sql = ("select count(*) as n from adult where exists (select 1 from visits v where v.person_id = adult.id "
           "limit %s::integer)")
    with pytest.raises(psycopg.errors.FeatureNotSupported):
        reporter.execute(sql, [value], prepare=True).fetchall()


@pytest.mark.parametrize("value", [-1, None])
def test_a_bound_count_that_is_not_a_row_count_is_refused(reporter: psycopg.Connection[Any],
                                                          value: int | None) -> None:
    with pytest.raises(psycopg.Error) as refused:
        reporter.execute("select sex, count(*) as n from adult group by 1 order by 1 limit %s::integer", [value],
                         prepare=True).fetchall()
    assert refused.value.sqlstate == "0A000" and refused.value.diag.message_hint is not None, refused.value
