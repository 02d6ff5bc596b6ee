"""Red team round 19: a linked table's key of another type than its unit, and this week's new paths.

Part A (anonproxy/plan/tables.py, ``_check_key``; the rule: anonproxy/policy/links.py, ``key_problem``). People of a
linked table are counted by its key, under the key's own equality. A key whose equality is finer than its unit's counts
one person several times: a ``text`` key of a ``citext`` unit tells 'm1' from 'M1', of a ``timestamptz`` unit two
spellings of one instant, of a ``numeric`` or ``integer`` unit '1001' from '1001.0' or '01001'; a ``numeric`` key of a
``double precision`` unit two numbers that round to one double; a ``bytea`` key of a ``text`` unit one name in two
encodings. Each linked table below holds the 9 people (k - 1) of the kind 'rare', each written two ways: counted by key,
'rare' was released as 18 (suppress) and dp answered, bounding each person's rows as two people's. Such a key is now
refused before anything runs or is charged, naming both types and hinting at the type the key needs; keys of the unit's
type (a modifier aside, varchar as text, a deterministic collation of their own) or a number for an integer unit are
answered.

Part B. Generated groups near k over distinct (channel, person) pairs joined back to the protected table, EXISTS
over a reference table, LIKE ... ESCAPE, a row IN list and a float(p) key, checked against PostgreSQL's own
count(DISTINCT) of the unit: no leak. Errors that would depend on one person (a condition one person meets, or
nobody): a cast to ``float(p)`` with p <= 24 is real, which the no-error proof took for double precision, so
``(age * 1e37)::float(24)`` failed exactly when the person existed (fixed in anonproxy/plan/bounds.py,
``_float_type``); the same over EXISTS and IN over a reference table, distinct pairs, LIKE patterns ending in their
escape character and row IN lists gave no leak. ``LIMIT $1::integer`` bound at Bind releases no small group, and dp
charges first. Re-attacks of the last external red team's findings: a withheld value read through HAVING (other
shapes than round 11's), and the service pool held by sessions left open after an answer (idle transactions,
cursors, prepared statements, suspended portals): no leak.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import asyncpg
import psycopg
import pytest
from conftest import database_of_its_own, lone_person, proxy_of_its_own, swap_sexes
from service_sql import reporter_sql, service_answer, sorted_rows

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import ColumnPolicy, LinkedTable, Policy, ProtectedTable, ReferenceTable
from anonproxy.policy.yaml_policy import demo_policy

DATABASE = "attacks_round19"
K = 10  # the demo reporter's k
BIG, MID, RARE = range(1, 301), range(401, 601), range(1001, 1001 + K - 1)
# Each linked table: its unit's type, its key's type, a person's unit from their number i, the key's spelling j (0,
# 1) of it, and the key read as the unit (PostgreSQL's own count of people). Keys finer than their unit:
FINER = {
    "v_citext_text": ("citext", "text", "'m' || i", "(array['m', 'M'])[j + 1] || i", "person::citext"),
    "v_instant_text": ("timestamp with time zone", "text",
                       "timestamptz '2020-01-01 00:00+00' + make_interval(hours => i)",
                       "to_char((timestamptz '2020-01-01 00:00+00' + make_interval(hours => i)) AT TIME ZONE "
                       "(array['UTC', 'Asia/Tokyo'])[j + 1], 'YYYY-MM-DD HH24:MI') || (array['+00', '+09'])[j + 1]",
                       "person::timestamptz"),
    "v_numeric_text": ("numeric", "text", "i::numeric", "round(i::numeric, j)::text", "person::numeric"),
    "v_integer_text": ("integer", "text", "i", "lpad(i::text, 4 + j, '0')", "person::integer"),
    "v_float_numeric": ("double precision", "numeric", "(i + 0.1)::float8", "(i + 0.1)::numeric + j * 1e-20",
                        "person::float8"),
    "v_text_bytea": ("text", "bytea", "'ré' || i", "convert_to('ré' || i, (array['UTF8', 'LATIN1'])[j + 1])",
                     "convert_from(person, CASE WHEN get_byte(person, 1) = 233 THEN 'LATIN1' ELSE 'UTF8' END)"),
}
# Keys whose equality is the unit's (each rare person's two spellings are one key): answered, 'rare' withheld.
SAME = {
    "v_citext_citext": ("citext", "citext", "'m' || i", "(array['m', 'M'])[j + 1] || i", "person"),
    "v_numeric_scaled": ("numeric", "numeric(12,2)", "i::numeric", "round(i::numeric, j)", "person"),
    "v_text_varchar_c": ("text", 'character varying(20) COLLATE "C"', "'t' || i", "'t' || i", "person"),
    "v_integer_bigint": ("integer", "bigint", "i", "i", "person"),
    "v_integer_float": ("integer", "double precision", "i", "i", "person"),
    "v_integer_domains": ("integer", "public.r19_id_twice", "i", "i", "person"),  # a domain over a domain of it
}
COUNT = "SELECT s.kind, count(*) AS n FROM public.{table} s GROUP BY 1"


def _unit_table(table: str) -> str:
    return f"public.{table}_people"


def _tables(conn: psycopg.Connection[Any]) -> Policy:
    """The demo policy, and per linked table of ``FINER`` and ``SAME`` a protected table of its unit's type (300
    people of 'big', 200 of 'mid', 9 of 'rare', one row each) and the linked table: one row per person of 'big' and
    'mid', two per 'rare' person (spellings 0 and 1)."""
    conn.execute("CREATE EXTENSION citext")
    conn.execute("CREATE DOMAIN public.r19_id AS integer")
    conn.execute("CREATE DOMAIN public.r19_id_twice AS public.r19_id CHECK (VALUE > 0)")
    policy = demo_policy()
    tables, links = dict(policy.tables), dict(policy.links)
    for table, (unit_type, key_type, unit, key, _) in {**FINER, **SAME}.items():
        people = _unit_table(table)
        conn.execute(f"CREATE TABLE {people} (id {unit_type} PRIMARY KEY, kind text NOT NULL)")
        conn.execute(f"CREATE TABLE public.{table} (person {key_type}, kind text NOT NULL, v integer NOT NULL)")
        for kind, numbers, spellings in (("big", BIG, 1), ("mid", MID, 1), ("rare", RARE, 2)):
            conn.execute(f"INSERT INTO {people} SELECT {unit}, '{kind}' FROM generate_series(%s::integer, %s) AS i",
                         (numbers.start, numbers.stop - 1))
            conn.execute(f"INSERT INTO public.{table} SELECT {key}, '{kind}', 5 "
                         "FROM generate_series(%s::integer, %s) AS i, generate_series(0, %s::integer) AS j",
                         (numbers.start, numbers.stop - 1, spellings - 1))
        conn.execute(f"ANALYZE {people}")
        conn.execute(f"ANALYZE public.{table}")
        tables[people] = ProtectedTable(people, "id", {"id": ColumnPolicy("id", "identifier"),
                                                       "kind": ColumnPolicy("kind", "quasi_identifier")})
        links[f"public.{table}"] = LinkedTable(f"public.{table}", "person", people, "id", {
            "person": ColumnPolicy("person", "identifier"),
            "kind": ColumnPolicy("kind", "quasi_identifier", domain=("big", "mid", "rare")),
            "v": ColumnPolicy("v", "sensitive", 0, 10)})
    _generated_tables(conn, tables, links)
    return dataclasses.replace(policy, tables=tables, links=links,
                               references={**policy.references, REGIONS: ReferenceTable(REGIONS),
                                           SEXES: ReferenceTable(SEXES)})


owner = database_of_its_own(DATABASE, _tables)


@pytest.fixture(scope="module")
def proxy(owner: psycopg.Connection, pg_server: EmbeddedPostgres,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A proxy of this database's own (one worker), the demo's analyst (dp) given a budget on every unit table."""
    for table in [*FINER, *SAME]:
        owner.execute("SELECT anonproxy.set_budget('analyst', %s::regclass, 1000, 0.5, null, 0.5, 0.0000001)",
                      (_unit_table(table),))
    with proxy_of_its_own(owner, pg_server, DATABASE, tmp_path_factory.mktemp(DATABASE) / "anonproxy.log") as started:
        yield started


@pytest.fixture(scope="module")
def reporter(proxy: Any) -> Iterator[psycopg.Connection]:
    with psycopg.connect(proxy.endpoint.dsn(DATABASE, user="reporter"), autocommit=True) as conn:
        yield conn


@pytest.fixture(scope="module")
def analyst(proxy: Any) -> Iterator[psycopg.Connection]:
    with psycopg.connect(proxy.endpoint.dsn(DATABASE, user="analyst"), autocommit=True) as conn:
        yield conn


def _people(owner: psycopg.Connection, table: str, as_unit: str) -> tuple[int, int]:
    """The 'rare' people of a linked table: as its keys count them, and as its unit does (PostgreSQL's own)."""
    row = owner.execute(f"SELECT count(DISTINCT person), count(DISTINCT {as_unit}) FROM public.{table} "
                        "WHERE kind = 'rare'").fetchone()
    assert row is not None
    return row[0], row[1]


def _charges(owner: psycopg.Connection, table: str) -> int:
    """The analyst's charges on the unit table of ``table``, as the ledger holds them."""
    row = owner.execute("SELECT count(*) FROM anonproxy.budget_ledger WHERE role_name = 'analyst' AND domain = %s",
                        (_unit_table(table),)).fetchone()
    assert row is not None
    return int(row[0])


def _refused(conn: psycopg.Connection, statement: str, table: str, key_type: str) -> None:
    """``statement`` is refused (0A000) naming the linked table and the key's type, hinting at the unit's; were it
    answered, the failure shows the rows (what leaked)."""
    try:
        rows = conn.execute(statement).fetchall()
    except psycopg.errors.FeatureNotSupported as refused:
        assert f"public.{table} cannot be queried" in str(refused), statement
        assert f"of type {key_type}" in str(refused), str(refused)
        assert f"the type of {_unit_table(table)}.id" in (refused.diag.message_hint or ""), statement
    else:
        pytest.fail(f"{statement} answered: {sorted_rows(rows)}")


@pytest.mark.parametrize("table", sorted(FINER))
def test_a_key_finer_than_its_unit_type_is_refused_in_suppress(owner: psycopg.Connection,
                                                                reporter: psycopg.Connection, table: str) -> None:
    """9 people of 'rare', 18 keys: counted by key, 'rare' was released with 18 rows (k = 10). Every statement over
    the linked table is refused, with the types and the hint."""
    _, key_type, _, _, as_unit = FINER[table]
    assert _people(owner, table, as_unit) == (2 * (K - 1), K - 1)
    for statement in (COUNT.format(table=table), f"SELECT count(*) FROM public.{table}",
                      f"SELECT s.kind, sum(s.v) FROM public.{table} s WHERE s.v > 0 GROUP BY 1"):
        _refused(reporter, statement, table, key_type)


@pytest.mark.parametrize("table", sorted(FINER))
def test_a_key_finer_than_its_unit_type_is_refused_in_dp_before_any_charge(owner: psycopg.Connection,
                                                                           analyst: psycopg.Connection,
                                                                           table: str) -> None:
    """dp bounds each key's rows: a person written two ways contributed twice the bound. Refused, and the budget
    is not charged."""
    _, key_type, _, _, _ = FINER[table]
    before = _charges(owner, table)
    for statement in (COUNT.format(table=table), f"SELECT count(*) FROM public.{table}"):
        _refused(analyst, statement, table, key_type)
    assert _charges(owner, table) == before


@pytest.mark.parametrize("table", sorted(SAME))
def test_a_key_of_the_units_equality_is_answered(owner: psycopg.Connection, reporter: psycopg.Connection,
                                                 analyst: psycopg.Connection, table: str) -> None:
    """A key of the unit's own type (a modifier aside, varchar as text under a deterministic collation of its own, a
    domain over a domain over it) or a number for an integer unit: 'rare' (9 people as PostgreSQL counts them) withheld, the released kinds
    PostgreSQL's own rows; dp answers the total."""
    assert _people(owner, table, SAME[table][4])[1] == K - 1
    statement = COUNT.format(table=table)
    rows = sorted_rows(reporter.execute(statement).fetchall())
    own = dict(owner.execute(statement).fetchall())
    released = [row for row in rows if row[0] is not None]
    assert released and all(row[0] != "rare" and own[row[0]] == row[1] for row in released), rows
    before = _charges(owner, table)
    assert len(analyst.execute(f"SELECT count(*) FROM public.{table}").fetchall()) == 1
    assert _charges(owner, table) == before + 1


# Part B: this week's paths, over data drawn near k. ``folks`` (protected, one row per person: region, band),
# ``acts`` (linked: 0 to 3 rows per person, channel, v) and ``regions`` (a reference table: region, zone).
FOLKS, ACTS, REGIONS = "public.r19_folks", "public.r19_acts", "public.r19_regions"
SEXES = "public.r19_sexes"  # a reference table of adult's sex, its labels text that no integer reads
DISTINCT_PAIRS = f"{FOLKS} f JOIN (SELECT DISTINCT a.channel, a.person FROM {ACTS} a{{}}) AS k ON k.person = f.id"
# Each statement, and the same FROM, WHERE and GROUP BY counting the people of each group as PostgreSQL does.
GENERATED = [
    (f"SELECT k.channel, count(*) AS n FROM {DISTINCT_PAIRS.format('')} GROUP BY 1",
     f"SELECT k.channel, count(DISTINCT f.id) FROM {DISTINCT_PAIRS.format('')} GROUP BY 1"),
    (f"SELECT k.channel, count(*) AS n, sum(f.band) AS b FROM {DISTINCT_PAIRS.format(' WHERE a.v > 3')} GROUP BY 1",
     f"SELECT k.channel, count(DISTINCT f.id) FROM {DISTINCT_PAIRS.format(' WHERE a.v > 3')} GROUP BY 1"),
    (f"SELECT k.channel, f.region, count(*) AS n FROM {DISTINCT_PAIRS.format('')} GROUP BY 1, 2",
     f"SELECT k.channel, f.region, count(DISTINCT f.id) FROM {DISTINCT_PAIRS.format('')} GROUP BY 1, 2"),
    (f"SELECT f.region, count(*) AS n, sum(f.band) AS b FROM {FOLKS} f WHERE EXISTS (SELECT 1 FROM {REGIONS} r "
     "WHERE r.region = f.region AND r.zone = 'north') GROUP BY 1",
     f"SELECT f.region, count(DISTINCT f.id) FROM {FOLKS} f WHERE EXISTS (SELECT 1 FROM {REGIONS} r "
     "WHERE r.region = f.region AND r.zone = 'north') GROUP BY 1"),
    (f"SELECT f.region, count(*) AS n FROM {FOLKS} f WHERE f.region LIKE 'r!_%' ESCAPE '!' GROUP BY 1",
     f"SELECT f.region, count(DISTINCT f.id) FROM {FOLKS} f WHERE f.region LIKE 'r!_%' ESCAPE '!' GROUP BY 1"),
    (f"SELECT f.region, f.band, count(*) AS n FROM {FOLKS} f WHERE (f.region, f.band) IN (('r_1', 1), ('r_2', 2), "
     "('rx1', 0), ('r_0', 3)) GROUP BY 1, 2",
     f"SELECT f.region, f.band, count(DISTINCT f.id) FROM {FOLKS} f WHERE (f.region, f.band) IN (('r_1', 1), "
     "('r_2', 2), ('rx1', 0), ('r_0', 3)) GROUP BY 1, 2"),
    (f"SELECT f.band::float(24) AS b, count(*) AS n FROM {FOLKS} f GROUP BY 1",
     f"SELECT f.band::float(24), count(DISTINCT f.id) FROM {FOLKS} f GROUP BY 1"),
    (f"SELECT a.channel, count(*) AS n, sum(a.v) AS total FROM {ACTS} a WHERE EXISTS (SELECT 1 FROM {REGIONS} r "
     "WHERE r.region = a.channel) GROUP BY 1",
     f"SELECT a.channel, count(DISTINCT a.person) FROM {ACTS} a WHERE EXISTS (SELECT 1 FROM {REGIONS} r "
     "WHERE r.region = a.channel) GROUP BY 1"),
]


def _generated_tables(conn: psycopg.Connection[Any], tables: dict[str, ProtectedTable],
                      links: dict[str, LinkedTable]) -> None:
    """``folks``, ``acts`` and ``regions`` (empty: each generated test fills them in a rolled-back transaction)."""
    conn.execute(f"CREATE TABLE {FOLKS} (id integer PRIMARY KEY, region text NOT NULL, band integer NOT NULL)")
    conn.execute(f"CREATE TABLE {ACTS} (person integer, channel text NOT NULL, v integer NOT NULL)")
    conn.execute(f"CREATE TABLE {REGIONS} (region text PRIMARY KEY, zone text NOT NULL)")
    conn.execute(f"CREATE TABLE {SEXES} (sex text PRIMARY KEY, label text NOT NULL)")
    conn.execute(f"INSERT INTO {SEXES} VALUES ('Male', 'm'), ('Female', 'f')")
    tables[FOLKS] = ProtectedTable(FOLKS, "id", {"id": ColumnPolicy("id", "identifier"),
                                                 "region": ColumnPolicy("region", "quasi_identifier"),
                                                 "band": ColumnPolicy("band", "sensitive", 0, 10)})
    links[ACTS] = LinkedTable(ACTS, "person", FOLKS, "id", {"person": ColumnPolicy("person", "identifier"),
                                                            "channel": ColumnPolicy("channel", "quasi_identifier"),
                                                            "v": ColumnPolicy("v", "sensitive", 0, 10)})


def _draw(rng: random.Random) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Folks (a region of 60 people, the others of k - 3 to k + 3; bands 0 to 3), their acts (0 to 2 a person,
    in 10 channels: their people near k) and regions (zones drawn; channels are region names too, so that EXISTS
    matches acts)."""
    names = ["r_0", "r_1", "r_2", "r_3", "rx1", "rx2"]
    folks: list[tuple[Any, ...]] = []
    for region in names:
        for _ in range(60 if region == "r_0" else rng.randint(K - 3, K + 3)):
            folks.append((len(folks) + 1, region, rng.randint(0, 3)))
    channels = [*names, "c_a", "c_b", "c_c", "c_d"]
    acts = [(person, rng.choice(channels), rng.randint(0, 10)) for person, _, _ in folks
            for _ in range(rng.choice([0, 1, 1, 2]))]
    regions = [(region, rng.choice(["north", "south"])) for region in names]
    return folks, acts, regions


def _group_people(owner: psycopg.Connection, people_sql: str, keys: int) -> dict[tuple[Any, ...], int]:
    """Each group's people (its first ``keys`` columns) as ``people_sql`` counts them."""
    return {tuple(row[:keys]): row[keys] for row in owner.execute(people_sql).fetchall()}


@pytest.mark.parametrize("seed", range(12))
def test_generated_groups_near_k_over_this_weeks_paths(owner: psycopg.Connection, seed: int) -> None:
    """Distinct (channel, person) pairs joined back, EXISTS over a reference table, LIKE ... ESCAPE, a row IN list,
    a float(p) key, over groups drawn near k: the rewritten SQL, as the proxy's service session runs it, releases
    only groups of k people as PostgreSQL counts them (count(DISTINCT) of the unit), each PostgreSQL's own row."""
    folks, acts, regions = _draw(random.Random(seed))
    with owner.transaction(force_rollback=True):
        with owner.cursor() as cursor:
            cursor.executemany(f"INSERT INTO {FOLKS} VALUES (%s, %s, %s)", folks)
            cursor.executemany(f"INSERT INTO {ACTS} VALUES (%s, %s, %s)", acts)
            cursor.executemany(f"INSERT INTO {REGIONS} VALUES (%s, %s)", regions)
        for table in (FOLKS, ACTS, REGIONS):
            owner.execute(f"ANALYZE {table}")
        for statement, people_sql in GENERATED:
            keys = statement[:statement.index(" count(")].count(",")
            rows = service_answer(owner, reporter_sql(owner, statement))[0]
            people = _group_people(owner, people_sql, keys)
            own = {tuple(row[:keys]): row for row in sorted_rows(owner.execute(statement).fetchall())}
            released = [row for row in rows if any(value is not None for value in row[:keys])]
            for row in released:
                assert people[tuple(row[:keys])] >= K and row == own[tuple(row[:keys])], (statement, row, rows)




# float(p) is real for p up to 24 (PostgreSQL's rule); sqlglot reads every float(p) as double precision, and so did
# the no-error proof (anonproxy/plan/bounds.py): each statement failed ("out of range for type real") exactly when a
# row met {0}. {0}: a condition one person meets (age 60 or more, one income), or nobody.
FLOAT_P = [
    "SELECT count(*) FROM public.adult a WHERE CASE WHEN {0} THEN (a.age * 1e37)::float(24) > 0 ELSE true END",
    "SELECT count(*) FROM public.adult a WHERE CASE WHEN {0} THEN cast(a.age * 1e37 AS float(1)) > 0 ELSE true END",
    "SELECT count(*) FROM public.adult a WHERE CASE WHEN {0} THEN a.age::float(24) * 1e37::float(24) > 0 "
    "ELSE true END",
    "SELECT count(*) FROM public.adult a WHERE CASE WHEN {0} THEN a.age::float(24) * '1e37'::float(24) > 0 "
    "ELSE true END",
    "SELECT count(*) FROM public.adult a WHERE (a.age * 1e37)::float(24) > 0 AND {0}",
    "SELECT a.sex, count(*) FROM public.adult a WHERE CASE WHEN {0} THEN (a.age * 1e37)::float(20) > 0 ELSE true END "
    "GROUP BY 1",
]


def _outcome(conn: psycopg.Connection, statement: str) -> str:
    """"answered", "refused" (the proxy's own refusal: 0A000 with a hint), or the SQLSTATE of another error."""
    try:
        conn.execute(statement).fetchall()
    except psycopg.Error as error:
        return "refused" if error.sqlstate == "0A000" and error.diag.message_hint else str(error.sqlstate)
    return "answered"


@pytest.fixture(scope="module")
def someone(owner: psycopg.Connection) -> str:
    """A condition that one to 9 people of adult meet: an age of 60 or more, with one income."""
    row = owner.execute("SELECT age, income FROM public.adult WHERE age >= 60 GROUP BY 1, 2 "
                        "HAVING count(*) BETWEEN 1 AND 9 ORDER BY 1 LIMIT 1").fetchone()
    assert row is not None
    return f"a.age = {row[0]} AND a.income = '{row[1]}'"


@pytest.mark.parametrize("statement", FLOAT_P)
def test_a_float_p_cast_that_overflows_real_is_refused_whoever_meets_it(
        owner: psycopg.Connection, reporter: psycopg.Connection, analyst: psycopg.Connection, someone: str,
        statement: str) -> None:
    """PostgreSQL itself fails for the person the condition finds (real's range), and not for nobody: through the
    proxy both are refused alike, for suppress and dp (it failed for the one and answered the other before)."""
    with pytest.raises(psycopg.errors.NumericValueOutOfRange):
        owner.execute(statement.format(someone)).fetchall()
    assert owner.execute(statement.format("a.age = 3")).fetchall()
    for conn in (reporter, analyst):
        assert [_outcome(conn, statement.format(condition)) for condition in (someone, "a.age = 3")] == \
            ["refused", "refused"], statement



# Errors that would depend on one person, over this week's paths: a condition inside EXISTS or IN over a reference
# table, in a distinct (values, key) derived table, a LIKE pattern ending in its escape character (written several
# ways), a row IN list. {0} as in FLOAT_P. PostgreSQL fails for the one and not for nobody where a row reaches the
# expression; through the proxy the outcome must not depend on it (all were refused or answered alike).
ONE_PERSONS_ERROR = [
    f"SELECT count(*) FROM public.adult a WHERE {{0}} AND EXISTS (SELECT 1 FROM {SEXES} s WHERE s.sex = a.sex "
    "AND s.label::int > 0)",
    f"SELECT count(*) FROM public.adult a WHERE {{0}} AND NOT EXISTS (SELECT 1 FROM {SEXES} s WHERE s.sex = a.sex "
    "AND s.label::int > 0)",
    f"SELECT count(*) FROM public.adult a WHERE {{0}} AND a.sex IN (SELECT s.sex FROM {SEXES} s "
    "WHERE s.label::int > 0)",
    f"SELECT count(*) FROM public.adult a WHERE {{0}} AND EXISTS (SELECT 1 FROM {SEXES} s WHERE s.sex = a.sex "
    "AND s.label LIKE 'm!' ESCAPE '!')",
    f"SELECT count(*) FROM public.adult a WHERE {{0}} AND EXISTS (SELECT 1 FROM {SEXES} s WHERE s.sex = a.sex "
    "AND s.label::float(24) > 0)",
    "SELECT k.channel, count(*) FROM public.adult a JOIN (SELECT DISTINCT v.channel, v.person_id FROM public.visits v "
    "WHERE v.channel::int > 0) AS k ON k.person_id = a.id WHERE {0} GROUP BY 1",
    "SELECT k.channel, count(*) FROM public.adult a JOIN (SELECT DISTINCT v.channel, v.person_id FROM public.visits v "
    "WHERE (v.amount * 1e37)::float(24) > 0) AS k ON k.person_id = a.id WHERE {0} GROUP BY 1",
    "SELECT k.channel, count(*) FROM public.adult a JOIN (SELECT DISTINCT v.channel, v.person_id FROM public.visits v "
    "WHERE v.channel LIKE 'w!' ESCAPE '!') AS k ON k.person_id = a.id WHERE {0} GROUP BY 1",
    "SELECT count(*) FROM public.adult a WHERE {0} AND a.sex LIKE 'M\\'",
    "SELECT count(*) FROM public.adult a WHERE {0} AND a.sex LIKE 'M' || '\\'",
    "SELECT count(*) FROM public.adult a WHERE {0} AND a.sex NOT ILIKE 'M\\'",
    "SELECT count(*) FROM public.adult a WHERE {0} AND a.sex ~~ 'M\\'",
    "SELECT count(*) FROM public.adult a WHERE {0} AND a.sex LIKE $$M\\$$",
    "SELECT count(*) FROM public.adult a WHERE {0} AND a.sex LIKE ANY (ARRAY['M\\'])",
    "SELECT count(*) FROM public.adult a WHERE (a.sex, CASE WHEN {0} THEN 1 / 0 ELSE 1 END) IN (('Male', 1), "
    "('Female', 1))",
    "SELECT count(*) FROM public.adult a WHERE (a.sex, a.age) IN (('Male', CASE WHEN {0} THEN 1 / 0 ELSE 1 END))",
]


@pytest.mark.parametrize("statement", ONE_PERSONS_ERROR)
def test_no_error_depends_on_one_person_over_this_weeks_paths(reporter: psycopg.Connection,
                                                              analyst: psycopg.Connection, someone: str,
                                                              statement: str) -> None:
    """The same outcome whether one person or nobody meets {0}, for suppress and dp, and no PostgreSQL error
    (a proxy's refusal or an answer)."""
    for conn in (reporter, analyst):
        outcomes = [_outcome(conn, statement.format(condition)) for condition in (someone, "a.age = 3")]
        assert outcomes[0] == outcomes[1] and outcomes[0] in ("refused", "answered"), (statement, outcomes)


@pytest.mark.parametrize("limit", [0, 1, 2, 3])
def test_a_limit_bound_at_bind_releases_no_small_group_and_dp_is_charged_first(
        owner: psycopg.Connection, reporter: psycopg.Connection, analyst: psycopg.Connection, limit: int) -> None:
    """``LIMIT $1::integer`` (bound at Bind): suppress releases at most ``limit`` rows, never 'rare' (9 people), each
    released kind PostgreSQL's own row; dp charges the budget once, but not when the limit is 0 (then the statement is
    a column discovery, anonproxy/route/discovery.py: no row whatever the data, nothing run, nothing charged)."""
    table = "v_citext_citext"
    statement = f"SELECT s.kind, count(*) AS n FROM public.{table} s GROUP BY 1 ORDER BY 2 LIMIT %s::integer"
    rows = reporter.execute(statement, (limit,)).fetchall()
    own = dict(owner.execute(COUNT.format(table=table)).fetchall())
    assert len(rows) <= limit and all(kind is None or (kind != "rare" and own[kind] == n) for kind, n in rows), rows
    before = _charges(owner, table)
    assert len(analyst.execute(f"SELECT count(*) FROM public.{table} s LIMIT %s::integer", (limit,)).fetchall()) \
        == min(limit, 1)
    assert _charges(owner, table) == before + (1 if limit else 0)


# The last external red team read a withheld value through HAVING; round 11 tries the shapes it used. Other ways to
# ask whether a group holds the one person of an age ({0}): the answer (rows or SQLSTATE) must not change when that
# person's sex is swapped with another's (each sex keeps its count).
HAVING = [
    "SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 HAVING bool_or(a.age = {0})",
    "SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 HAVING every(a.age <> {0})",
    "SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 HAVING count(DISTINCT a.age) FILTER (WHERE a.age = {0}) > 0",
    "SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 HAVING sum(CASE WHEN a.age = {0} THEN 1 END) IS NULL",
    "SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 HAVING avg(CASE WHEN a.age = {0} THEN 1000 ELSE 0 END) > 0",
    "SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 "
    "HAVING coalesce(nullif(count(*) FILTER (WHERE a.age = {0}), 0), -1) = 1",
    "SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 HAVING count(*) FILTER (WHERE a.age = {0}) IN (1, 2)",
    "SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 HAVING (count(*) FILTER (WHERE a.age = {0}))::boolean",
    "SELECT a.sex, a.race, count(*) FROM public.adult a GROUP BY 1, 2 HAVING count(*) FILTER (WHERE a.age = {0}) = 1",
    "SELECT a.sex, count(*) FROM public.adult a GROUP BY ROLLUP (a.sex) HAVING count(*) FILTER (WHERE a.age = {0}) = 1",
    "SELECT q.sex FROM (SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 "
    "HAVING count(*) FILTER (WHERE a.age = {0}) = 1) AS q",
    "WITH q AS (SELECT a.sex, count(*) FILTER (WHERE a.age = {0}) AS m FROM public.adult a GROUP BY 1) "
    "SELECT q.sex FROM q WHERE q.m = 1",
    "SELECT a.sex, count(*) FROM public.adult a WHERE a.age IN ({0}, 40) GROUP BY 1 HAVING min(a.age) = {0}",
    "SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 HAVING count(*) FILTER (WHERE a.age = {0}) = 1 "
    "ORDER BY 1 LIMIT 1",
    "SELECT k.channel, count(*) FROM public.adult a JOIN (SELECT DISTINCT v.channel, v.person_id FROM public.visits v) "
    "AS k ON k.person_id = a.id GROUP BY 1 HAVING count(*) FILTER (WHERE a.age = {0}) = 1",
    f"SELECT a.sex, count(*) FROM public.adult a WHERE EXISTS (SELECT 1 FROM {SEXES} s WHERE s.sex = a.sex) "
    "GROUP BY 1 HAVING count(*) FILTER (WHERE a.age = {0}) = 1",
]


@pytest.fixture(scope="module")
def lone(owner: psycopg.Connection) -> tuple[int, int, int]:
    return lone_person(owner)


def _answer(conn: psycopg.Connection, statement: str) -> Any:
    try:
        return sorted_rows(conn.execute(statement).fetchall())
    except psycopg.Error as error:
        return error.sqlstate


@pytest.mark.parametrize("shape", HAVING)
def test_a_withheld_value_is_not_read_through_having(owner: psycopg.Connection, reporter: psycopg.Connection,
                                                     lone: tuple[int, int, int], shape: str) -> None:
    """The same answer whichever sex the one person of their age has."""
    age, person, other = lone
    statement = shape.format(age)
    as_is = _answer(reporter, statement)
    swap_sexes(owner, person, other)
    try:
        assert _answer(reporter, statement) == as_is, statement
    finally:
        swap_sexes(owner, person, other)



# The last external red team held the service pool with batches never synced (tests/test_service_hold.py). Other
# ways a session may keep what it was answered from open: a transaction left idle after an answer, a server-side
# cursor fetched in part, a prepared statement run in a transaction, a portal suspended by a row limit (asyncpg's
# cursor: Execute with a maximum of rows). More such sessions than the pool has connections; another session's
# statement is answered (it would fail with 53300 after service_wait_timeout were the pool held).
POOL = 2
HOLDERS = POOL + 3
SEXES_COUNT = "SELECT a.sex, count(*) FROM public.adult a GROUP BY 1 ORDER BY 1"


@pytest.fixture(scope="module")
def small_pool(owner: psycopg.Connection, pg_server: EmbeddedPostgres,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A proxy of this database's own with a pool of ``POOL`` service connections; a statement waits 10 s at most
    for one."""
    with proxy_of_its_own(owner, pg_server, DATABASE, tmp_path_factory.mktemp(f"{DATABASE}_pool") / "anonproxy.log",
                          service_pool_size=str(POOL), service_wait_timeout="10") as started:
        yield started


def _holder(small_pool: Any, kind: str) -> psycopg.Connection:
    """A reporter's session left in a transaction after ``kind``, its first row read."""
    conn = psycopg.connect(small_pool.endpoint.dsn(DATABASE, user="reporter"))
    if kind == "cursor":
        cursor = conn.cursor(name="held")
        cursor.execute(SEXES_COUNT)
        assert cursor.fetchone() is not None
    else:
        assert conn.execute(SEXES_COUNT, prepare=kind == "prepared").fetchone() is not None
    return conn


async def _suspended_portals(small_pool: Any) -> list[Any]:
    """Rows of a statement answered while ``HOLDERS`` sessions each keep a portal suspended after one row."""
    holders = []
    try:
        for _ in range(HOLDERS):
            conn = await asyncpg.connect(host=small_pool.endpoint.host, port=small_pool.endpoint.port,
                                         user="reporter", password="reporter", database=DATABASE)
            holders.append(conn)
            transaction = conn.transaction()
            await transaction.start()
            cursor = await conn.cursor(SEXES_COUNT)
            assert len(await cursor.fetch(1)) == 1
        with psycopg.connect(small_pool.endpoint.dsn(DATABASE, user="reporter"), autocommit=True) as victim:
            return victim.execute(SEXES_COUNT).fetchall()
    finally:
        for conn in holders:
            await conn.close()


@pytest.mark.parametrize("kind", ["idle", "cursor", "prepared", "suspended"])
def test_sessions_left_open_after_an_answer_hold_no_service_connection(owner: psycopg.Connection, small_pool: Any,
                                                                       kind: str) -> None:
    own = owner.execute(SEXES_COUNT).fetchall()
    if kind == "suspended":
        assert asyncio.run(_suspended_portals(small_pool)) == own
        return
    holders = [_holder(small_pool, kind) for _ in range(HOLDERS)]
    try:
        with psycopg.connect(small_pool.endpoint.dsn(DATABASE, user="reporter"), autocommit=True) as victim:
            assert victim.execute(SEXES_COUNT).fetchall() == own
    finally:
        for conn in holders:
            conn.close()
