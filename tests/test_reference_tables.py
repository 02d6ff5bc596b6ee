"""Star schemas: protected tables joined to declared reference tables (public dimension tables), through the proxy.

Through the real gated proxy (tests/conftest.py): `reporter` is in mode suppress (k = 10), `analyst`-like roles in
mode dp. The reference tables here are made for the test: countries (by adult's native_country), continents (by a
country's continent: a snowflake chain) and education levels. Expected answers are computed by the owner, a
superuser, on the same database.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role, wait_for_policy

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.lint import reference_warnings
from anonproxy.policy.model import ReferenceTable
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import (
    PolicyApplyError,
    PolicyError,
    apply_policy,
    dump_policy,
    parse_policy,
)

K = 10
DEMO_POLICY_TEXT = (Path(__file__).parents[1] / "anonproxy" / "data" / "demo_policy.yaml").read_text()
REFERENCES = ("public.continents", "public.countries", "public.education_levels")
STAR_POLICY_TEXT = DEMO_POLICY_TEXT + f"reference_tables: [{', '.join(REFERENCES)}]\n"

# Continents by country of adult's native_country column ("South" is as the data set spells it).
_CONTINENT = {
    "North America": ["United-States", "Canada", "Outlying-US(Guam-USVI-etc)"],
    "Latin America": ["Mexico", "Cuba", "Jamaica", "Puerto-Rico", "Honduras", "Haiti", "Dominican-Republic",
                      "Guatemala", "Nicaragua", "El-Salvador", "Trinadad&Tobago", "Peru", "Ecuador", "Columbia"],
    "Europe": ["England", "Germany", "Greece", "Italy", "Poland", "Portugal", "Ireland", "France", "Hungary",
               "Scotland", "Yugoslavia", "Holand-Netherlands"],
    "Asia": ["Cambodia", "India", "Japan", "South", "China", "Iran", "Philippines", "Vietnam", "Laos", "Taiwan",
             "Thailand", "Hong"],
}


@pytest.fixture(scope="module")
def owner(pg_server: EmbeddedPostgres, gated_database: str) -> Iterator[psycopg.Connection[Any]]:
    """The owner of the gated database's tables (a superuser), in autocommit mode."""
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as conn:
        yield conn


def apply_and_wait(owner: psycopg.Connection[Any], proxy: Endpoint, dbname: str, text: str) -> int:
    version = apply_policy(owner, parse_policy(text))
    wait_for_policy(proxy, dbname, version)
    return version


def reload(owner: psycopg.Connection[Any], proxy: Endpoint, dbname: str) -> None:
    """Make the proxies load the policy again (any change of the policy tables does)."""
    owner.execute("update anonproxy.reference_tables set table_name = table_name")
    wait_for_policy(proxy, dbname, owner.execute("select version from anonproxy.policy_version").fetchone()[0])


def create_reference_tables(owner: psycopg.Connection[Any]) -> None:
    owner.execute("create table public.continents (name text primary key, hemisphere text not null)")
    owner.execute("insert into public.continents values ('North America', 'north'), ('Latin America', 'south'), "
                  "('Europe', 'north'), ('Asia', 'north')")
    owner.execute("create table public.countries (name text primary key, continent text not null, "
                  "population bigint not null)")
    for continent, countries in _CONTINENT.items():
        for position, country in enumerate(countries):
            owner.execute("insert into public.countries values (%s, %s, %s)", (country, continent, 1000 * position))
    owner.execute("create table public.education_levels (level text primary key, stage text not null, "
                  "years integer not null)")
    owner.execute("insert into public.education_levels select distinct education, case when education_num <= 8 "
                  "then 'school' when education_num <= 10 then 'high school' else 'college' end, education_num "
                  "from public.adult")


@pytest.fixture(scope="module")
def star(owner: psycopg.Connection[Any], gated_proxy: Endpoint, gated_database: str) -> Iterator[None]:
    """The reference tables, declared in the demo policy; afterwards the demo policy alone, and no tables."""
    create_reference_tables(owner)
    try:
        apply_and_wait(owner, gated_proxy, gated_database, STAR_POLICY_TEXT)
        yield
    finally:
        apply_and_wait(owner, gated_proxy, gated_database, DEMO_POLICY_TEXT)
        owner.execute("drop table if exists public.continents, public.countries, public.education_levels")


def connect(proxy: Endpoint, dbname: str, user: str) -> psycopg.Connection[Any]:
    return psycopg.connect(proxy.dsn(dbname, user=user), autocommit=True)


def refusal(proxy: Endpoint, dbname: str, user: str, query: str) -> psycopg.Error:
    with connect(proxy, dbname, user) as conn, pytest.raises(psycopg.Error) as caught:
        conn.execute(query)
    return caught.value


def released(rows: list[tuple[Any, ...]], labels: int) -> list[tuple[Any, ...]]:
    """The rows of released groups (the suppressed-rest row has NULL labels)."""
    return [row for row in rows if any(value is not None for value in row[:labels])]


def k_anonymous(owner: psycopg.Connection[Any], query: str, labels: int) -> list[tuple[Any, ...]]:
    """What the reporter should see of ``query``, whose last column is count(DISTINCT a.id): its groups of k people
    or more, that column left out."""
    return [row[:-1] for row in owner.execute(query).fetchall() if row[-1] >= K
            and any(value is not None for value in row[:labels])]


# Declaring ------------------------------------------------------------------------------------------


def test_declaring_reads_the_usable_unique_keys_from_the_catalog(owner: psycopg.Connection[Any], star: None) -> None:
    policy = load_policy(owner)
    assert set(policy.references) == set(REFERENCES)
    assert policy.references["public.countries"] == ReferenceTable("public.countries", (("name",),))
    assert policy.references["public.countries"].types == {"name": "text", "continent": "text",
                                                           "population": "bigint"}
    # The service role may read them (the proxy runs the joined query as the service role); the reporter may not.
    for table in REFERENCES:
        assert owner.execute("select has_table_privilege('anonproxy_service', %s, 'SELECT'), "
                             "has_table_privilege('reporter', %s, 'SELECT')", (table, table)).fetchone() == (True, False)
    # The YAML form goes back and forth.
    assert "reference_tables:\n- public.continents\n- public.countries\n- public.education_levels\n" in \
        dump_policy(policy)
    assert set(parse_policy(dump_policy(policy)).references) == set(REFERENCES)
    assert reference_warnings(policy) == []


def test_declaration_errors(owner: psycopg.Connection[Any], star: None) -> None:
    def error(call: str, *params: object) -> psycopg.Error:
        with pytest.raises(psycopg.Error) as caught, owner.transaction():
            owner.execute(call, params)
        return caught.value

    declare = "select anonproxy.declare_reference_table(%s::regclass)"
    owner.execute("create table public.no_key (code text, label text)")
    owner.execute("create table public.partial_key (code text, label text)")
    owner.execute("create unique index on public.partial_key (code) where label is not null")
    owner.execute("create table public.deferred_key (code text unique deferrable initially immediate, label text)")
    owner.execute("create table public.expression_key (code text, label text)")
    owner.execute("create unique index on public.expression_key (lower(code))")
    owner.execute("create view public.country_names as select name from public.countries")
    owner.execute("create materialized view public.adult_ages as select distinct age from public.adult")
    owner.execute("create unique index on public.adult_ages (age)")
    # An index whose collation is not the column's: "equal" in the join is not "equal" in the index.
    owner.execute("create collation if not exists public.case_blind (provider = icu, locale = 'und-u-ks-level2', "
                  "deterministic = false)")
    owner.execute("create table public.collated_key (code text collate public.case_blind, label text)")
    owner.execute('create unique index on public.collated_key (code collate "C")')
    owner.execute("create table public.keyed_parent (code text primary key)")
    owner.execute("create table public.keyed_child () inherits (public.keyed_parent)")
    try:
        for table in ("public.no_key", "public.partial_key", "public.deferred_key", "public.expression_key",
                      "public.collated_key", "public.keyed_parent"):
            caught = error(declare, table)
            assert caught.sqlstate == "42830", (table, caught)
            assert f"table {table} has no unique key anonproxy can use" in str(caught)
            assert caught.diag.message_hint == f"add one: alter table {table} add primary key (<columns>)"
        caught = error(declare, "public.adult")
        assert caught.sqlstate == "22023" and "public.adult cannot be a reference table: public.adult is protected " \
            "data" in str(caught)
        caught = error(declare, "public.adult_ages")
        assert caught.sqlstate == "22023" and "reads protected table public.adult" in str(caught)
        caught = error(declare, "public.country_names")
        assert caught.sqlstate == "42809" and "is not a table or materialized view" in str(caught)
        caught = error("select anonproxy.undeclare_reference_table('public.no_key')")
        assert caught.sqlstate == "42704" and "table public.no_key is not a reference table" in str(caught)
        # A reference table cannot become protected or linked afterwards.
        caught = error("select anonproxy.protect_table('public.countries', 'name')")
        assert caught.sqlstate == "22023"
        assert "reference table public.countries cannot hold protected data" in str(caught)
        caught = error("select anonproxy.link_table('public.education_levels', 'level', 'public.adult')")
        assert caught.sqlstate == "22023" and "reference table public.education_levels" in str(caught)
        assert set(load_policy(owner).references) == set(REFERENCES)  # nothing changed
    finally:
        owner.execute("drop view public.country_names")
        owner.execute("drop materialized view public.adult_ages")
        owner.execute("drop table public.no_key, public.partial_key, public.deferred_key, public.expression_key, "
                      "public.collated_key, public.keyed_child, public.keyed_parent")
        owner.execute("drop collation public.case_blind")


def test_yaml_reference_tables_are_checked() -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(DEMO_POLICY_TEXT + "reference_tables: [public.adult, countries, public.adult]\n")
    assert caught.value.problems == [
        "reference_tables: lists a name more than once",
        "reference_tables[0]: public.adult is a protected or linked table; a reference table holds public data only",
        "reference_tables[1]: table names must be schema-qualified, like public.adult",
        "reference_tables[2]: public.adult is a protected or linked table; a reference table holds public data only",
    ]


def test_applying_a_reference_table_without_a_key_changes_nothing(owner: psycopg.Connection[Any],
                                                                   star: None) -> None:
    owner.execute("create table public.no_key (code text)")
    try:
        before = load_policy(owner)
        with pytest.raises(PolicyApplyError) as caught:
            apply_policy(owner, parse_policy(STAR_POLICY_TEXT.replace("]\n", ", public.no_key]\n")))
        assert caught.value.problems[0].startswith("reference_tables[3]: table public.no_key has no unique key")
        assert load_policy(owner) == before
    finally:
        owner.execute("drop table public.no_key")


# Suppress mode ------------------------------------------------------------------------------------


def test_reporter_groups_by_a_reference_column(owner: psycopg.Connection[Any], gated_proxy: Endpoint,
                                               gated_database: str, star: None) -> None:
    query = ("select c.continent, count(*), avg(a.age) from adult a join countries c on c.name = a.native_country "
             "group by c.continent order by c.continent")
    with connect(gated_proxy, gated_database, "reporter") as conn:
        seen = released(conn.execute(query).fetchall(), 1)
    truth = owner.execute(query.replace("avg(a.age)", "avg(a.age), count(distinct a.id)")).fetchall()
    assert seen == [row[:-1] for row in truth if row[-1] >= K]
    assert len(seen) == 4  # every continent has k people
    # Power BI's derived-table form of the same question is flattened into the same join.
    derived = ('select "rows"."continent", count(*), avg("rows"."age") from (select "_"."age", c.continent '
               'from "public"."adult" "_" join "public"."countries" c on c.name = "_"."native_country") "rows" '
               'group by "rows"."continent" order by "rows"."continent"')
    with connect(gated_proxy, gated_database, "reporter") as conn:
        assert released(conn.execute(derived).fetchall(), 1) == seen

    # A left join, a WHERE and a FILTER on reference columns, a key of both tables, a count of a reference column.
    query = ("select a.sex, c.continent, count(*) filter (where c.population > 2000), count(c.name), "
             "sum(a.hours_per_week) from adult a left join countries c on a.native_country = c.name "
             "where c.continent <> 'North America' and a.age > 30 group by a.sex, c.continent order by 1, 2")
    with connect(gated_proxy, gated_database, "reporter") as conn:
        seen = released(conn.execute(query).fetchall(), 2)
    assert seen == k_anonymous(owner, query.replace(" from adult", ", count(distinct a.id) from adult"), 2)
    assert seen


def test_reporter_follows_a_snowflake_chain(owner: psycopg.Connection[Any], gated_proxy: Endpoint,
                                            gated_database: str, star: None) -> None:
    query = ("select k.hemisphere, e.stage, count(*) from adult a join countries c on c.name = a.native_country "
             "join continents k on k.name = c.continent join education_levels e on e.level = a.education "
             "group by 1, 2 order by 1, 2")
    with connect(gated_proxy, gated_database, "reporter") as conn:
        seen = released(conn.execute(query).fetchall(), 2)
    assert seen == k_anonymous(owner, query.replace("count(*)", "count(*), count(distinct a.id)"), 2)
    assert {row[0] for row in seen} == {"north", "south"}


def test_reporter_explain_cursor_and_notice_with_a_join(owner: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                        gated_database: str, star: None) -> None:
    query = ("select c.name, count(*) from adult a join countries c on c.name = a.native_country where a.age > 50 "
             "group by c.name order by c.name")
    expected = k_anonymous(owner, query.replace("count(*)", "count(*), count(distinct a.id)"), 1)
    with connect(gated_proxy, gated_database, "reporter") as conn:
        notices: list[str] = []
        conn.add_notice_handler(lambda notice: notices.append(notice.message_primary or ""))
        assert released(conn.execute(query).fetchall(), 1) == expected
        assert len(notices) == 1 and notices[0].endswith("groups were suppressed; the row with NULL in c.name holds "
                                                         "them together"), notices
        plan = "\n".join(row[0] for row in conn.execute(f"explain (anonproxy) {query}").fetchall())
        assert '"public"."countries"' in plan and "k = 10" in plan, plan
        with conn.transaction():
            conn.execute(f"declare star cursor for {query}")
            fetched = conn.execute("fetch all in star").fetchall()
        assert released(fetched, 1) == expected


def test_reporter_series_limit_over_a_reference_column(owner: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                       gated_database: str, star: None) -> None:
    """Superset's series limit on a dimension column: the top-N question and the chart's question both join."""
    query = ("select c.continent, a.sex, count(*) as n from adult a join countries c on c.name = a.native_country "
             "join (select c.continent as continent__, count(*) as mme_inner__ from adult a join countries c "
             "on c.name = a.native_country group by c.continent order by mme_inner__ desc limit 2) as series_limit "
             "on c.continent = series_limit.continent__ group by c.continent, a.sex order by 1, 2")
    top = [row[0] for row in owner.execute(
        "select c.continent from adult a join countries c on c.name = a.native_country group by 1 "
        "order by count(*) desc limit 2").fetchall()]
    expected = [row for row in owner.execute(
        "select c.continent, a.sex, count(*) from adult a join countries c on c.name = a.native_country "
        "where c.continent = any(%s) group by 1, 2 order by 1, 2", (top,)).fetchall() if row[2] >= K]
    with connect(gated_proxy, gated_database, "reporter") as conn:
        assert released(conn.execute(query).fetchall(), 2) == expected


def test_a_statement_over_reference_tables_alone_is_not_gated(owner: psycopg.Connection[Any],
                                                               gated_proxy: Endpoint, gated_database: str,
                                                               star: None) -> None:
    query = "select name, continent from countries order by name"
    error = refusal(gated_proxy, gated_database, "reporter", query)
    assert error.sqlstate == "42501" and "permission denied for table countries" in str(error)  # its own login
    owner.execute("grant select on public.countries to reporter")
    try:
        with connect(gated_proxy, gated_database, "reporter") as conn:
            assert conn.execute(query).fetchall() == owner.execute(query).fetchall()  # row by row: public data
    finally:
        owner.execute("revoke select on public.countries from reporter")


@pytest.mark.parametrize("user", ["reporter", "analyst"])
def test_an_undeclared_table_stays_refused(owner: psycopg.Connection[Any], gated_proxy: Endpoint,
                                           gated_database: str, star: None, user: str) -> None:
    owner.execute("create table public.regions (name text primary key, label text)")
    try:
        error = refusal(gated_proxy, gated_database, user, "select r.label, count(*) from adult a join regions r "
                        "on r.name = a.native_country group by r.label")
        assert error.sqlstate == "42501", error
        assert "relation public.regions is not part of the privacy policy" in str(error)
        assert error.diag.message_hint is not None and "anonproxy.declare_reference_table" in error.diag.message_hint
    finally:
        owner.execute("drop table public.regions")


@pytest.mark.parametrize("user", ["reporter", "analyst"])
def test_a_dropped_unique_key_refuses_every_join_after_a_reload(owner: psycopg.Connection[Any],
                                                                 gated_proxy: Endpoint, gated_database: str,
                                                                 star: None, user: str) -> None:
    query = ("select e.stage, count(*) from adult a join education_levels e on e.level = a.education "
             "group by e.stage")
    with connect(gated_proxy, gated_database, "reporter") as conn:
        assert released(conn.execute(query).fetchall(), 1)
    owner.execute("alter table public.education_levels drop constraint education_levels_pkey")
    try:
        reload(owner, gated_proxy, gated_database)
        policy = load_policy(owner)
        assert policy.references["public.education_levels"].keys == ()  # still declared, no key
        assert reference_warnings(policy) == [
            "reference table public.education_levels has no usable unique key (a primary key or unique index that "
            "is immediate, valid, not partial, on plain columns), or no longer exists: every join to it is refused"]
        done = subprocess.run([sys.executable, "-m", "anonproxy.cli", "policy", "lint", "--dsn",
                               owner.info.dsn + " password=" + (owner.info.password or "")],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done.stderr
        assert "warning: reference table public.education_levels has no usable unique key" in done.stdout
        assert "16 declared bound(s) checked against k = 10: 1 warning(s)" in done.stdout, done.stdout
        with fresh_dp_role(owner, gated_proxy, gated_database, "star_analyst") if user == "analyst" else \
                nullcontext("reporter") as role:
            error = refusal(gated_proxy, gated_database, role, query)
        assert error.sqlstate == "0A000", error
        assert "reference table public.education_levels has no usable unique key" in str(error)
        assert error.diag.message_hint is not None and "primary key" in error.diag.message_hint
    finally:
        owner.execute("alter table public.education_levels add primary key (level)")
        reload(owner, gated_proxy, gated_database)


# dp mode ---------------------------------------------------------------------------------------------


def test_dp_answers_over_a_star_join_are_within_the_noise(owner: psycopg.Connection[Any], gated_proxy: Endpoint,
                                                           gated_database: str, star: None) -> None:
    query = ("select c.continent, count(*), sum(a.hours_per_week) from adult a "
             "join countries c on c.name = a.native_country group by c.continent")
    truth = {row[0]: row[1:] for row in owner.execute(query).fetchall()}
    with fresh_dp_role(owner, gated_proxy, gated_database, "star_dp") as role, \
            connect(gated_proxy, gated_database, role) as conn:
        seen = conn.execute(query).fetchall()
        plan = "\n".join(row[0] for row in conn.execute(f"explain (anonproxy) {query}").fetchall())
        with conn.transaction():
            conn.execute(f"declare star cursor for {query}")
            assert conn.execute("fetch all in star").fetchall() == seen  # the same question: the cached answer
    # The keys come from a reference column without a declared domain: partition selection releases the big ones.
    assert "groups released only if their noisy count of people reaches" in plan, plan
    assert "cached: the same question was answered on the current data" in plan, plan  # countries' version too
    released_keys = {row[0] for row in seen}
    assert released_keys <= set(truth) and "North America" in released_keys
    for continent, count, hours in seen:
        true_count, true_hours = truth[continent]
        assert abs(count - true_count) <= 200, (continent, count, true_count)
        assert abs(float(hours) - float(true_hours)) <= 100 * 200, (continent, hours, true_hours)


def test_dp_snowflake_and_left_join(owner: psycopg.Connection[Any], gated_proxy: Endpoint, gated_database: str,
                                    star: None) -> None:
    query = ("select a.sex, count(*), avg(a.age) from adult a left join countries c on c.name = a.native_country "
             "left join continents k on k.name = c.continent where k.hemisphere = 'north' group by a.sex")
    truth = {row[0]: row[1:] for row in owner.execute(query).fetchall()}
    with fresh_dp_role(owner, gated_proxy, gated_database, "star_dp2") as role, \
            connect(gated_proxy, gated_database, role) as conn:
        seen = conn.execute(query).fetchall()
    assert {row[0] for row in seen} == {"Female", "Male"}  # a declared domain: every key, no selection
    for sex, count, age in seen:
        assert abs(count - truth[sex][0]) <= 200
        assert abs(float(age) - float(truth[sex][1])) <= 5


def test_a_reference_table_in_another_schema(owner: psycopg.Connection[Any], gated_proxy: Endpoint,
                                             gated_database: str, star: None) -> None:
    """Declaring gives the service role USAGE on the schema too; an unqualified name finds the one declared table
    of that name, as for protected tables."""
    owner.execute("create schema dims")
    owner.execute("create table dims.sexes (code text primary key, label text not null)")
    owner.execute("insert into dims.sexes values ('Female', 'women'), ('Male', 'men')")
    try:
        assert not owner.execute("select has_schema_privilege('anonproxy_service', 'dims', 'USAGE')").fetchone()[0]
        apply_and_wait(owner, gated_proxy, gated_database, STAR_POLICY_TEXT.replace("]\n", ", dims.sexes]\n"))
        assert owner.execute("select has_schema_privilege('anonproxy_service', 'dims', 'USAGE'), "
                             "has_table_privilege('anonproxy_service', 'dims.sexes', 'SELECT')").fetchone() == (True, True)
        expected = owner.execute("select s.label, count(*) from adult a join dims.sexes s on s.code = a.sex "
                                 "group by 1 order by 1").fetchall()
        with connect(gated_proxy, gated_database, "reporter") as conn:
            for query in ("select s.label, count(*) from adult a join dims.sexes s on s.code = a.sex group by 1 "
                          "order by 1",
                          "select sexes.label, count(*) from adult join sexes on sexes.code = adult.sex group by 1 "
                          "order by 1"):
                assert released(conn.execute(query).fetchall(), 1) == expected, query
    finally:
        apply_and_wait(owner, gated_proxy, gated_database, STAR_POLICY_TEXT)
        owner.execute("drop schema dims cascade")
