"""Attacks on star-schema joins: a reference table must never multiply a person's rows, label one person, or turn an
error into a question about one person's value.

The reference tables are declared in the gated database's policy for this module (the demo policy plus
reference_tables); decisions are taken on the policy as the proxy loads it (types and unique keys read from the
catalog), for `reporter` (suppress) and `analyst` (dp), and the main ones are also asked through the real proxy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role
from test_reference_tables import (
    DEMO_POLICY_TEXT,
    REFERENCES,
    apply_and_wait,
    connect,
    create_reference_tables,
    owner,  # noqa: F401 - fixture
    refusal,
    released,
)

from anonproxy.dp.model import DPParams
from anonproxy.dp.plan import plan_dp
from anonproxy.plan.refusals import Reject
from anonproxy.policy.model import Policy
from anonproxy.policy.store import load_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Decision

# pairs: a composite key (country, sex); labels: a primary key on id, a partial unique index on code and a unique
# index on lower(label) (neither usable); people: keyed by adult's privacy unit; ages: a bigint key next to adult's
# integer age.
ATTACK_TABLES = ("public.ref_pairs", "public.ref_labels", "public.ref_people", "public.ref_ages")
ATTACK_POLICY_TEXT = DEMO_POLICY_TEXT + f"reference_tables: [{', '.join(REFERENCES + ATTACK_TABLES)}]\n"
JOIN = "from adult a join countries c on c.name = a.native_country"


@pytest.fixture(scope="module")
def policy(owner: psycopg.Connection[Any], gated_proxy: Endpoint, gated_database: str) -> Iterator[Policy]:
    """The demo policy with the reference tables of both test modules declared, as the proxy loads it."""
    create_reference_tables(owner)
    owner.execute("create table public.ref_pairs (country text, sex text, label text not null, "
                  "primary key (country, sex))")
    owner.execute("insert into public.ref_pairs select distinct native_country, sex, native_country || '/' || sex "
                  "from public.adult")
    owner.execute("create table public.ref_labels (id integer primary key, code text, label text)")
    owner.execute("insert into public.ref_labels values (1, 'Male', 'Men'), (2, 'Female', 'Women'), "
                  "(3, 'Male', null)")
    owner.execute("create unique index on public.ref_labels (code) where label is not null")
    owner.execute("create unique index on public.ref_labels (lower(label))")
    owner.execute("create table public.ref_people (id integer primary key, nickname text not null)")
    owner.execute("insert into public.ref_people select id, 'person ' || id from public.adult")
    owner.execute("create table public.ref_ages (age bigint primary key, label text not null)")
    owner.execute("insert into public.ref_ages select distinct age, 'age ' || age from public.adult")
    try:
        apply_and_wait(owner, gated_proxy, gated_database, ATTACK_POLICY_TEXT)
        yield load_policy(owner)
    finally:
        apply_and_wait(owner, gated_proxy, gated_database, DEMO_POLICY_TEXT)
        owner.execute(f"drop table if exists {', '.join(REFERENCES + ATTACK_TABLES)}")


def decision(policy: Policy, role: str, sql: str) -> Decision | object:
    """The reporter's decision, or the analyst's dp plan (decide() only routes a dp statement to the planner)."""
    if role == "analyst":
        return plan_dp(sql, policy.role(role), policy, DPParams(epsilon=0.5, delta=1e-7))
    return decide(sql, policy.role(role), policy)


def rejection(policy: Policy, role: str, sql: str) -> Reject:
    decided = decision(policy, role, sql)
    assert isinstance(decided, Reject), (sql, decided)
    return decided


# (statement, SQLSTATE, a fragment of the message)
REFUSED = [
    # contribution multiplication: a join column that is not a whole unique key
    ("select count(*) from adult a join countries c on c.continent = a.native_country", "0A000",
     "reference table public.countries must be joined on every column of one of its unique keys, (name)"),
    ("select p.label, count(*) from adult a join ref_pairs p on p.country = a.native_country group by 1", "0A000",
     "must be joined on every column of one of its unique keys, (country, sex)"),
    ("select p.label, count(*) from adult a join ref_pairs p on p.country = a.native_country and p.sex <> a.sex "
     "group by 1", "0A000", "(country, sex)"),
    ("select count(*) from adult a join ref_pairs p on p.country = a.native_country and p.sex = 'Male'", "0A000",
     "(country, sex)"),
    # a partial unique index and an expression index are no keys: only the primary key (id) is
    ("select l.label, count(*) from adult a join ref_labels l on l.code = a.sex group by 1", "0A000",
     "reference table public.ref_labels must be joined on every column of one of its unique keys, (id)"),
    ("select l.code, count(*) from adult a join ref_labels l on l.label = a.sex group by 1", "0A000", "(id)"),
    ("select l.code, count(*) from adult a join ref_labels l on lower(l.label) = lower(a.sex) group by 1", "0A000",
     "(id)"),
    # OR, a constant, a computed side, a column of the reference table itself
    ("select count(*) from adult a join countries c on c.name = a.native_country or c.name = a.education", "0A000",
     "(name)"),
    ("select count(*) from adult a join countries c on (c.name = a.native_country or true)", "0A000", "(name)"),
    ("select count(*) from adult a join countries c on c.name = 'Mexico'", "0A000", "(name)"),
    ("select count(*) from adult a join countries c on c.name = a.native_country || ''", "0A000",
     "not allowed in a JOIN condition"),
    ("select count(*) from adult a join countries c on c.name = c.continent", "0A000", "(name)"),
    # IS NOT DISTINCT FROM matches every NULL: a unique key may hold several
    ("select count(*) from adult a join countries c on c.name is not distinct from a.native_country", "0A000",
     "(name)"),
    # a derived table is flattened first: a renamed column is still the column it renames
    ("select a.sex, count(*) from adult a join (select continent as name from countries) c "
     "on c.name = a.native_country group by 1", "0A000", "(name)"),
    # a reference table on the preserved side, or first
    ("select count(*) from adult a right join countries c on c.name = a.native_country", "0A000",
     "RIGHT JOIN is not supported"),
    ("select count(*) from adult a full join countries c on c.name = a.native_country", "0A000",
     "FULL JOIN is not supported"),
    ("select count(*) from countries c join adult a on a.native_country = c.name", "0A000",
     "reference table public.countries cannot come first in FROM"),
    ("select count(*) from countries c left join adult a on a.native_country = c.name", "0A000",
     "cannot come first in FROM"),
    ("select count(*) from adult a cross join countries c", "0A000", "joins without ON"),
    ("select count(*) from adult a, countries c where c.name = a.native_country", "0A000", "joins without ON"),
    ("select count(*) from adult a join countries c using (name)", "0A000", "USING"),
    # a snowflake link to a table that comes later
    ("select count(*) from adult a join continents k on k.name = c.continent join countries c "
     "on c.name = a.native_country", "0A000", "public.continents must be joined"),
    # reference tables in subqueries and set operations (IN over one is answered, round 14; not on an identifier)
    ("select count(*) from adult a where a.id in (select p.id from ref_people p where p.nickname = 'person 17')",
     "42501", "identifying column a.id cannot be tested against reference table public.ref_people"),
    ("select count(*) from adult a where a.native_country in (select c.name from countries c where c.population "
     "/ 0 > 1)", "0A000", "not allowed in WHERE"),
    # EXISTS correlated by equality is answered since round 16 (tests/test_bi_corpus_round16.py); uncorrelated, not
    ("select count(*) from adult a where exists (select 1 from countries c where c.population > 1000)",
     "0A000", "must tie one of its columns to the outer query"),
    ("select count(*) from adult union all select name from countries", "0A000", "UNION"),
    # a reference table keyed by the privacy unit labels one person
    ("select p.nickname, count(*) from adult a join ref_people p on p.id = a.id group by 1", "42501",
     "cannot be joined on identifying column a.id"),
    ("select count(*) from adult a left join countries c on c.name = a.native_country and a.id = 17", "42501",
     "identifying column id is not allowed in a JOIN condition"),
    # types that differ: a comparison that converts one side could make two keys equal
    ("select r.label, count(*) from adult a join ref_ages r on r.age = a.age group by 1", "0A000",
     "r.age (bigint) and a.age (integer) differ in type"),
    # error side channels: division, casts and overflow on reference values, anywhere a row expression goes
    (f"select count(*) {JOIN} where 100 / c.population > 1", "0A000", "not allowed in WHERE"),
    (f"select count(*) {JOIN} where c.name::integer > 0", "0A000", "not allowed in WHERE"),
    (f"select count(*) {JOIN} where c.population * c.population > 0", "0A000", "not allowed in WHERE"),
    (f"select count(*) {JOIN} where a.age + c.population > 0", "0A000", "not allowed in WHERE"),
    ("select count(*) from adult a left join countries c on c.name = a.native_country and 1 / c.population = 0",
     "0A000", "not allowed in a JOIN condition"),
    (f"select 1000000 / c.population, count(*) {JOIN} group by 1", "0A000", "not allowed"),
    (f"select count(*) filter (where c.population / (c.population - 1000) > 1) {JOIN}", "0A000", "not allowed"),
    (f"select count(case when c.name::integer = 1 then 1 end) {JOIN}", "0A000", "not allowed"),
    # reference values are not the person's: they are counted and compared, never added up or ranked
    (f"select sum(c.population) {JOIN}", "0A000", "sum() of c.population is not allowed: it is a value of reference "
     "table public.countries"),
    (f"select a.sex, avg(c.population) {JOIN} group by 1", "0A000", "value of reference table public.countries"),
    (f"select sum(a.capital_gain * c.population) {JOIN}", "0A000", "value of reference table"),
    (f"select sum(case when a.age > 40 then population end) {JOIN}", "0A000", "value of reference table"),
    # whole rows, row functions and system columns of a reference table
    (f"select count(*) {JOIN} where c.row_to_json::text like '%Asia%'", "42501",
     "PostgreSQL reads it as row_to_json(c)"),
    (f"select count(*) {JOIN} where c is not null", "42501", "whole-row references are not allowed"),
    (f"select count(*) {JOIN} where c.xmin::text <> ''", "42501", "system column xmin"),
]


@pytest.mark.parametrize(("sql", "sqlstate", "fragment"), REFUSED)
@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_refused(policy: Policy, role: str, sql: str, sqlstate: str, fragment: str) -> None:
    rejected = rejection(policy, role, sql)
    assert rejected.sqlstate == sqlstate, (sql, rejected)
    assert fragment in rejected.message, (sql, rejected)
    assert rejected.hint, rejected


def test_a_set_operation_with_a_reference_table_branch_is_refused(policy: Policy) -> None:
    """Each branch of a set operation is gated as if alone over protected data (tests/test_set_operations.py): an
    aggregate over a reference table alone is refused as such, in both modes (dp refuses set operations, but names a
    branch's own refusal first)."""
    sql = "select count(*) from adult union all select count(*) from countries"
    assert "cannot come first in FROM" in rejection(policy, "reporter", sql).message
    assert "cannot come first in FROM" in rejection(policy, "analyst", sql).message


ALLOWED = [
    # a whole composite key, either way round, with an extra condition; a snowflake chain; a LEFT join
    "select p.label, count(*) from adult a join ref_pairs p on a.native_country = p.country and p.sex = a.sex "
    "and p.label <> '' group by 1",
    "select k.hemisphere, count(*) from adult a join countries c on c.name = a.native_country "
    "left join continents k on k.name = c.continent group by 1",
    # the primary key of a table that also has unusable unique indexes
    "select l.label, count(*) from adult a join ref_labels l on l.id = a.education_num group by 1",
    # counting and comparing reference values
    f"select count(c.population), count(*) filter (where c.population > 2000) {JOIN}",
    f"select sum(case when c.continent = 'Asia' then 1 else 0 end) {JOIN}",
    f"select c.continent, count(*) {JOIN} where c.population between 1000 and 5000 group by 1",
    # derived tables (Power BI, Superset virtual datasets) are flattened into the same join
    'select "rows"."continent", count(*) from (select "_"."native_country", c.continent from "public"."adult" "_" '
    'join countries c on c.name = "_".native_country) "rows" group by 1',
    "select a.sex, count(c.name) from adult a left join (select * from countries where population > 1000) c "
    "on c.name = a.native_country group by 1",
    # a list of a reference table's values (round 14)
    "select count(*) from adult a where a.native_country in (select name from countries)",
    "select a.sex, count(*) from adult a where a.native_country not in (select c.name from countries c where "
    "c.continent = 'Europe') group by 1",
]


@pytest.mark.parametrize("sql", ALLOWED)
@pytest.mark.parametrize("role", ["reporter", "analyst"])
def test_allowed(policy: Policy, role: str, sql: str) -> None:
    decided = decision(policy, role, sql)
    assert not isinstance(decided, Reject), (sql, decided)


def test_a_reference_table_cannot_be_protected_or_linked_data(owner: psycopg.Connection[Any], policy: Policy) -> None:
    owner.execute("create table public.ref_visits (person integer not null, code text primary key)")
    try:
        owner.execute("select anonproxy.link_table('public.ref_visits', 'person', 'public.adult')")
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="public.ref_visits is protected data"), \
                owner.transaction():
            owner.execute("select anonproxy.declare_reference_table('public.ref_visits')")
        owner.execute("select anonproxy.unlink_table('public.ref_visits')")
        owner.execute("select anonproxy.declare_reference_table('public.ref_visits')")
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="reference table public.ref_visits cannot "
                           "hold protected data"), owner.transaction():
            owner.execute("select anonproxy.protect_table('public.ref_visits', 'person')")
        owner.execute("select anonproxy.undeclare_reference_table('public.ref_visits')")
    finally:
        owner.execute("drop table public.ref_visits")


@pytest.mark.parametrize("user", ["reporter", "analyst"])
def test_through_the_proxy(owner: psycopg.Connection[Any], gated_proxy: Endpoint, gated_database: str,
                           policy: Policy, user: str) -> None:
    multiplying = "select p.label, count(*) from adult a join ref_pairs p on p.country = a.native_country group by 1"
    dividing = f"select c.continent, count(*) {JOIN} where 100 / c.population > 1 group by 1"
    labelling = "select p.nickname, count(*) from adult a join ref_people p on p.id = a.id group by 1"
    role = "reporter"
    with fresh_dp_role(owner, gated_proxy, gated_database, "ref_attacker") if user == "analyst" else \
            nullcontext() as fresh:
        role = fresh or role
        for sql, sqlstate in ((multiplying, "0A000"), (dividing, "0A000"), (labelling, "42501")):
            error = refusal(gated_proxy, gated_database, role, sql)
            assert error.sqlstate == sqlstate, (sql, error)
            assert error.diag.message_hint, error
        if user == "reporter":  # the whole key: exact, k-suppressed counts
            query = ("select p.label, count(*) from adult a join ref_pairs p on p.country = a.native_country "
                     "and p.sex = a.sex group by 1 order by 1")
            with connect(gated_proxy, gated_database, role) as conn:
                seen = released(conn.execute(query).fetchall(), 1)
            truth = owner.execute(query.replace("count(*)", "count(*), count(distinct a.id)")).fetchall()
            assert seen == [row[:-1] for row in truth if row[-1] >= 10]


def test_dp_bounds_every_unit_when_a_reference_table_is_joined(policy: Policy) -> None:
    """The key was read with the policy; if it is dropped and duplicates added before the next load, a unit's row
    could match twice: the dp plan never skips per-unit bounding for a question that joins a reference table. (The
    table read alone needs none: each row is one unit, which its SQL checks in the catalog when it runs.)"""
    params = DPParams(epsilon=0.5, delta=1e-7)
    joined = plan_dp(f"select c.continent, count(*) {JOIN} group by 1", policy.role("analyst"), policy, params)
    plain = plan_dp("select sex, count(*) from adult group by 1", policy.role("analyst"), policy, params)
    assert not isinstance(joined, Reject) and not isinstance(plain, Reject)
    assert "SELECT false AS single" in joined.sql
    assert "AS single" not in plain.sql and "anonproxy.one_row_per_person" in plain.sql
