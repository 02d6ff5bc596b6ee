"""anonproxy.create_anonymized_view and friends: argument checks, quoting, the release cycle, the CLI.

Every refused call must leave nothing behind: no target table, no registry row,
no staging table. Levels of a created release are checked here by counting
the target's rows in Python, not by the SQL verification functions.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from collections import Counter
from decimal import Decimal
from fractions import Fraction

import psycopg
import pytest
from conftest import Endpoint
from psycopg import sql

from anonproxy.views.audit import release_groups
from anonproxy.views.progress import ProgressBar

ADULT_ROWS = 30162
QI = ["age", "sex", "race"]


def create(conn: psycopg.Connection, **arguments: object) -> tuple[object, ...]:
    """Call create_anonymized_view with named arguments; returns the summary row."""
    arguments = {"source": "public.adult", "target": "public.adult_k", "quasi_identifiers": QI, "k": 10,
                 **arguments}
    casts = {"source": "::regclass", "hierarchies": "::jsonb", "quasi_identifiers": "::text[]",
             "k": "::integer", "l": "::numeric", "c": "::numeric", "t": "::numeric", "suppression_limit": "::numeric"}
    query = sql.SQL("select * from anonproxy.create_anonymized_view({})").format(sql.SQL(", ").join(
        sql.SQL("{} => {}{}").format(sql.Identifier(name), sql.Placeholder(name), sql.SQL(casts.get(name, "::text")))
        for name in arguments))
    row = conn.execute(query, arguments).fetchone()
    assert row is not None
    return row


def leftovers(conn: psycopg.Connection) -> dict[str, object]:
    """What a refused call could have left: tables other than the demo's (adult, visits), registry rows, staging
    tables."""
    return {
        "tables": conn.execute("select array_agg(format('%I.%I', schemaname, tablename) order by 1) from pg_tables "
                               "where schemaname not in ('pg_catalog', 'information_schema', 'anonproxy') "
                               "and tablename not in ('adult', 'visits')").fetchone()[0],
        "releases": conn.execute("select count(*) from anonproxy.releases").fetchone()[0],
        "staging": conn.execute("select array_agg(relname::text) from pg_class "
                                "where relname like 'anonproxy\\_%' and relpersistence = 't'").fetchone()[0],
    }


NOTHING = {"tables": None, "releases": 0, "staging": None}

BAD_ARGUMENTS = [
    ({"quasi_identifiers": ["age", "nope"]}, "42703", "quasi-identifier column nope does not exist in public.adult"),
    ({"sensitive": "nope"}, "42703", "sensitive column nope does not exist"),
    ({"unit": "nope"}, "42703", "privacy-unit column nope does not exist"),
    ({"k": 1}, "22023", "k must be at least 2, not 1"),
    ({"k": None}, "22004", "k is required"),
    ({"k": 40000}, "22023", f"k = 40000 exceeds the {ADULT_ROWS} rows of public.adult"),
    ({"sensitive": "occupation", "t": 0, "t_distance": "equal"}, "22023", "t must be in (0, 1], not 0"),
    ({"sensitive": "occupation", "t": 1.5, "t_distance": "equal"}, "22023", "t must be in (0, 1], not 1.5"),
    ({"sensitive": "sex"}, "22023", "column sex is both a quasi-identifier and the sensitive column"),
    ({"method": "full_domain", "quasi_identifiers": ["age", "fnlwgt"]}, "42704",
     "full_domain needs a hierarchy for every quasi-identifier; fnlwgt has none"),
    ({"method": "full_domain", "hierarchies": {"age": None}}, "42704",
     "full_domain needs a hierarchy for every quasi-identifier; age has none"),
    ({"sensitive": "relationship", "t": 0.2, "t_distance": "hierarchical"}, "42704",
     "the hierarchical distance needs a hierarchy for the sensitive column relationship"),
    ({"method": "kmeans"}, "22023", "unknown method 'kmeans'"),
    ({"sensitive": "occupation", "l": 2, "l_kind": "shannon"}, "22023", "unknown l_kind 'shannon'"),
    ({"sensitive": "occupation", "t": 0.2, "t_distance": "manhattan"}, "22023", "unknown t_distance 'manhattan'"),
    ({"target": "public.adult"}, "42P07", "relation public.adult already exists"),
    ({"target": "adult"}, "42P07", "relation public.adult already exists"),
    ({"l": 2}, "22023", "l-diversity needs a sensitive column"),
    ({"t": 0.2}, "22023", "t-closeness needs a sensitive column"),
    ({"sensitive": "occupation", "t": 0.2, "t_distance": "ordered"}, "22023",
     "the ordered distance needs a numeric sensitive column; occupation is not numeric"),
    ({"sensitive": "occupation", "l": 1}, "22023", "l must be greater than 1, not 1"),
    ({"sensitive": "occupation", "l": "NaN"}, "22023", "l must be a finite number, not NaN"),
    ({"sensitive": "occupation", "l": "Infinity", "l_kind": "distinct"}, "22023",
     "l must be a finite number, not Infinity"),
    ({"sensitive": "occupation", "l": 2, "l_kind": "recursive", "c": "NaN"}, "22023",
     "c must be a finite number, not NaN"),
    ({"sensitive": "occupation", "t": "-Infinity", "t_distance": "equal"}, "22023",
     "t must be a finite number, not -Infinity"),
    ({"sensitive": "occupation", "l": Decimal("1e20"), "l_kind": "recursive", "c": 3}, "22023",
     "recursive l-diversity needs l of at most 2147483647"),
    ({"sensitive": "occupation", "l": 2.5, "l_kind": "distinct"}, "22023",
     "distinct l-diversity needs a whole number l, not 2.5"),
    ({"sensitive": "occupation", "l": 2, "c": 3}, "22023", "c applies only to recursive (c,l)-diversity"),
    ({"sensitive": "occupation", "l": 2, "l_kind": "recursive"}, "22023",
     "recursive (c,l)-diversity needs c > 0, not null"),
    ({"sensitive": "occupation", "l": 15, "l_kind": "distinct"}, "22023",
     "no release can be distinct l-diverse with l = 15: the whole table has distinct l = 14"),
    # income: 22,654 '<=50K' and 7,508 '>50K'; exp(entropy) = exp(-(p ln p + q ln q)) ≈ 1.75.
    ({"sensitive": "income", "l": 2}, "22023",
     "no release can be entropy l-diverse with l = 2: the whole table has entropy l = 1.7527"),
    # recursive (c,2) on income: r1 / r2 = 22654 / 7508 ≈ 3.0173, so c = 3 fails.
    ({"sensitive": "income", "l": 2, "l_kind": "recursive", "c": 3}, "22023",
     "no release can be recursive (3,2)-diverse: the whole table is so only for c above 3.0173"),
    ({"suppression_limit": 1}, "22023", "suppression_limit must be in [0, 1), not 1"),
    ({"suppression_limit": -0.1}, "22023", "suppression_limit must be in [0, 1), not -0.1"),
    ({"hierarchies": {"age": "no.such"}}, "42704", "hierarchy 'no.such', named for column age, does not exist"),
    ({"hierarchies": {"education": "adult.education"}}, "22023",
     "hierarchies names column education, which is neither a quasi-identifier nor the sensitive column"),
    ({"hierarchies": ["adult.age"]}, "22023", "hierarchies must be a JSON object"),
    ({"hierarchies": {"age": 3}}, "22023", "hierarchies: the value for age must be a hierarchy name or null"),
    ({"hierarchies": {"race": "adult.sex"}}, "22023",
     "values of column race are missing from hierarchy 'adult.sex': 'Amer-Indian-Eskimo'"),
    ({"quasi_identifiers": ["age", "age"]}, "42701", "quasi-identifier age is named twice"),
    ({"quasi_identifiers": []}, "22023", "quasi_identifiers must name at least one column"),
    ({"quasi_identifiers": None}, "22023", "quasi_identifiers must name at least one column"),
    ({"unit": "age"}, "22023", "the privacy-unit column age cannot also be a quasi-identifier"),
    ({"target": "my table; drop"}, "42602", "target my table; drop is not a valid table name"),
    ({"target": "a.b.c"}, "42602", "target a.b.c is not a schema.table name"),
    ({"target": "nope.adult_k"}, "3F000", "schema nope of target nope.adult_k does not exist"),
    ({"target": "pg_temp.adult_k"}, "22023", "target pg_temp.adult_k is in a system or temporary schema"),
    ({"target": "pg_catalog.adult_k"}, "22023", "target pg_catalog.adult_k is in a system or temporary schema"),
    ({"method": "tclose_first", "sensitive": "age", "quasi_identifiers": ["sex", "race"]}, "22023",
     "tclose_first needs t"),
]


@pytest.mark.parametrize(("arguments", "sqlstate", "message"), BAD_ARGUMENTS,
                         ids=[f"{code}-{i}" for i, (_, code, _) in enumerate(BAD_ARGUMENTS)])
def test_bad_arguments_fail_cleanly(postgresql: psycopg.Connection, arguments: dict[str, object], sqlstate: str,
                                    message: str) -> None:
    arguments = {name: psycopg.types.json.Jsonb(value) if name == "hierarchies" else value
                 for name, value in arguments.items()}
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql, **arguments)
    assert caught.value.sqlstate == sqlstate
    assert caught.value.diag.message_primary is not None
    assert message in caught.value.diag.message_primary
    postgresql.rollback()
    assert leftovers(postgresql) == NOTHING


def test_hints_say_what_to_do(postgresql: psycopg.Connection) -> None:
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql, quasi_identifiers=["age", "nope"])
    assert caught.value.diag.message_hint is not None
    assert "columns of public.adult: id, age, workclass" in caught.value.diag.message_hint
    postgresql.rollback()
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql, method="full_domain", quasi_identifiers=["age", "fnlwgt"])
    assert caught.value.diag.message_hint is not None
    assert 'hierarchies => \'{"fnlwgt": "…"}\'' in caught.value.diag.message_hint


def test_missing_privileges_fail_before_the_work(postgresql: psycopg.Connection) -> None:
    postgresql.execute("create role clerk; grant select on public.adult to clerk; "
                       "grant usage on schema anonproxy to clerk; revoke create on schema public from public")
    postgresql.execute("set role clerk")
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql)
    assert caught.value.sqlstate == "42501"
    assert caught.value.diag.message_primary == (
        "permission denied to create public.adult_k: no CREATE privilege on schema public")
    postgresql.rollback()
    postgresql.execute("create role clerk; grant select on public.adult to clerk; grant create on schema public to clerk")
    postgresql.execute(sql.SQL("revoke temporary on database {} from public").format(
        sql.Identifier(postgresql.info.dbname)))
    postgresql.execute("set role clerk")
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql)
    assert caught.value.sqlstate == "42501"
    assert caught.value.diag.message_primary == (
        f"permission denied to stage the source: no TEMPORARY privilege on database {postgresql.info.dbname}")
    postgresql.rollback()
    postgresql.execute("create role clerk; grant select on public.adult to clerk; grant create on schema public to clerk")
    postgresql.execute("set role clerk")
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql)
    assert caught.value.sqlstate == "42501"
    assert caught.value.diag.message_primary == (
        "permission denied to record a release: no INSERT privilege on anonproxy.releases")
    postgresql.rollback()
    postgresql.execute("create role clerk; grant select on public.adult to clerk; grant create on schema public to clerk; "
                       "grant select, insert on anonproxy.releases to clerk")
    postgresql.execute("set role clerk")
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql)
    assert caught.value.sqlstate == "42501"
    assert caught.value.diag.message_primary == (
        "permission denied to make a release: no SELECT privilege on anonproxy.hierarchies")


def test_a_role_with_the_documented_grants_can_release(postgresql: psycopg.Connection) -> None:
    """docs/views.md, Rights: no superuser, only these grants."""
    postgresql.execute("create role clerk; grant select on public.adult to clerk; "
                       "grant create on schema public to clerk; "
                       "grant select, insert, update, delete on anonproxy.releases to clerk; "
                       "grant select on anonproxy.hierarchies, anonproxy.hierarchy_nodes to clerk")
    postgresql.execute("set role clerk")
    create(postgresql, sensitive="occupation")
    postgresql.execute("select anonproxy.refresh_anonymized_view('adult_k')")
    postgresql.execute("select anonproxy.drop_release('adult_k')")
    assert leftovers(postgresql) == NOTHING


def test_functions_on_the_callers_search_path_are_not_called(postgresql: psycopg.Connection) -> None:
    """A role that may create in public defines look-alikes of pg_catalog's format and
    jsonb_build_object (an exact type match beats pg_catalog's variadic ones); creating,
    refreshing and dropping a release as a DBA whose search_path holds public runs none of them."""
    postgresql.execute("create table public.hijacked (by_role text); grant insert on public.hijacked to public; "
                       "create role mallory; grant create on schema public to mallory")
    postgresql.execute("set role mallory")
    postgresql.execute("""
        create function public.format(f text, a text) returns text language plpgsql as $$
        begin insert into public.hijacked values (current_user); return pg_catalog.format(f, a); end $$;
        create function public.format(f text, a text, b text) returns text language plpgsql as $$
        begin insert into public.hijacked values (current_user); return pg_catalog.format(f, a, b); end $$;
        create function public.jsonb_build_object(a text, b jsonb, c text, d jsonb, e text, f jsonb, g text,
            h jsonb, i text, j jsonb, k text, l jsonb, m text, n jsonb, o text, p jsonb) returns jsonb
        language plpgsql as $$
        begin
            insert into public.hijacked values (current_user);
            return pg_catalog.jsonb_build_object(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p);
        end $$""")
    postgresql.execute("reset role")
    postgresql.execute("set search_path = public")
    create(postgresql, target="adult_k", sensitive="occupation")
    postgresql.execute("select anonproxy.refresh_anonymized_view('adult_k')")
    postgresql.execute("select anonproxy.drop_release('adult_k')")
    assert postgresql.execute("select count(*) from public.hijacked").fetchone() == (0,)


def test_only_the_entry_points_keep_the_callers_search_path(postgresql: psycopg.Connection) -> None:
    """Every release, hierarchy, method and verification function pins search_path."""
    unpinned = postgresql.execute(
        "select array_agg(p.proname::text order by p.proname) from pg_proc p "
        "where p.pronamespace = 'anonproxy'::regnamespace "
        "and not exists (select from unnest(p.proconfig) s where s like 'search_path=%')").fetchone()[0]
    entry_points = ["create_anonymized_view", "drop_release", "refresh_anonymized_view"]
    # The privilege probes (sql/0015) resolve a table named by text under the caller's search_path, as
    # PostgreSQL's own functions do; they run with the caller's rights, so that path can lend them nothing.
    probes = ["attacl", "has_any_column_privilege", "has_column_privilege", "has_table_privilege", "probed_role",
              "proxy_answers", "proxy_grants", "relacl"]
    assert sorted(set(unpinned)) == sorted(entry_points + probes)  # (each probe with all its overloads)
    definers = postgresql.execute(
        "select array_agg(distinct proname::text) from pg_proc where proname = any (%s) and prosecdef "
        "and pronamespace = 'anonproxy'::regnamespace", (probes,)).fetchone()[0]
    assert definers is None, definers
    probe_bodies = postgresql.execute(
        "select string_agg(prosrc, ' ') from pg_proc where proname = any (%s) "
        "and pronamespace = 'anonproxy'::regnamespace", (probes,)).fetchone()[0]
    # Their bodies call schema-qualified functions only (COALESCE and friends are SQL syntax, not functions).
    called = set(re.findall(r"(\w+(?:\.\w+)?)\(", probe_bodies)) - {"coalesce", "nullif", "exists"}
    assert all("." in name for name in called), called
    body = postgresql.execute(
        "select string_agg(prosrc, ' ') from pg_proc where proname = any (%s) "
        "and pronamespace = 'anonproxy'::regnamespace", (entry_points,)).fetchone()[0]
    # Their bodies call schema-qualified functions only.
    assert set(re.findall(r"(\w+(?:\.\w+)?)\(", body)) == {
        "anonproxy.release_create", "anonproxy.release_refresh", "anonproxy.release_drop",
        "anonproxy.release_target_name", "pg_catalog.current_schema"}


def test_the_registry_is_not_readable_by_anonymized_roles(postgresql: psycopg.Connection) -> None:
    """It holds exact row counts and measurements of the source: no grant to PUBLIC."""
    create(postgresql)
    for role in ("reporter", "analyst"):
        postgresql.execute(sql.SQL("set role {}").format(sql.Identifier(role)))
        with pytest.raises(psycopg.Error) as caught:
            postgresql.execute("select * from anonproxy.releases")
        assert caught.value.sqlstate == "42501"
        postgresql.rollback()


def test_source_must_be_a_table(postgresql: psycopg.Connection) -> None:
    postgresql.execute("create sequence s")
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql, source="s")
    assert caught.value.sqlstate == "42809"


def test_null_quasi_identifier_values_are_refused(postgresql: psycopg.Connection) -> None:
    postgresql.execute("create view holes as select id, case when id % 100 = 0 then null else age end as age, sex, "
                       "race from public.adult")
    postgresql.commit()
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql, source="holes")
    assert caught.value.sqlstate == "22004"
    assert caught.value.diag.message_primary == "quasi-identifier column age of public.holes has 301 NULL value(s)"
    postgresql.rollback()
    assert leftovers(postgresql) == NOTHING


def test_nan_and_infinite_numbers_are_refused(postgresql: psycopg.Connection) -> None:
    postgresql.execute("create table public.odd (age float8, sex text, income numeric)")
    postgresql.execute("insert into public.odd select g % 50, 'F', g from generate_series(1, 40) g")
    for column, value in (("age", "NaN"), ("age", "-Infinity"), ("income", "Infinity")):
        with postgresql.transaction():
            postgresql.execute(sql.SQL("update public.odd set {} = %s where {} = 7").format(
                sql.Identifier(column), sql.Identifier("age")), (value,))
            with pytest.raises(psycopg.Error) as caught:
                create(postgresql, source="public.odd", quasi_identifiers=["age", "sex"], sensitive="income", k=2)
            assert caught.value.sqlstate == "22023"
            assert caught.value.diag.message_primary == f"column {column} of public.odd has NaN or infinite values"
            raise psycopg.Rollback()


def test_null_privacy_units_are_refused(postgresql: psycopg.Connection) -> None:
    postgresql.execute("create view orphans as select nullif(id % 50, 0) as person, age, sex, race from public.adult")
    postgresql.commit()
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql, source="orphans", unit="person")
    assert caught.value.sqlstate == "22004"
    # ids 50, 100, …, 30150: 603 rows
    assert caught.value.diag.message_primary == "privacy-unit column person of public.orphans has 603 NULL value(s)"
    assert caught.value.diag.message_hint == "every row must belong to a person"


def test_reserved_column_names_are_refused(postgresql: psycopg.Connection) -> None:
    postgresql.execute('create table t as select age as "_row", sex from public.adult')
    postgresql.commit()
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql, source="t", quasi_identifiers=["_row", "sex"])
    assert caught.value.sqlstate == "42939"


def test_k_is_counted_in_privacy_units(postgresql: psycopg.Connection) -> None:
    # Two rows per person: 15,081 people.
    postgresql.execute("create table stays as select (id + 1) / 2 as person, age, sex, race from public.adult")
    postgresql.commit()
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql, source="stays", unit="person", k=20000)
    assert caught.value.sqlstate == "22023"
    assert caught.value.diag.message_primary == "k = 20000 exceeds the 15081 privacy units of public.stays"


def test_k_l_and_t_of_a_release_count_privacy_units(postgresql: psycopg.Connection) -> None:
    """Each person has two identical rows, so a class of n rows holds n / 2 people: the measured k is half."""
    postgresql.execute("create table twice as select id as person, age, sex, race, occupation from public.adult "
                       "union all select id, age, sex, race, occupation from public.adult")
    postgresql.commit()
    summary = create(postgresql, source="twice", unit="person", sensitive="occupation")
    sizes = class_sizes(postgresql, sql.Identifier("adult_k"), QI)
    assert sum(sizes.values()) == 2 * ADULT_ROWS
    assert all(size % 2 == 0 for size in sizes.values())
    assert summary[3] == min(sizes.values()) // 2 >= 10
    assert postgresql.execute("select unit, (achieved ->> 'k')::int from anonproxy.releases").fetchone() == (
        "person", min(sizes.values()) // 2)


def test_a_method_that_misses_k_is_refused(postgresql: psycopg.Connection) -> None:
    """The dispatcher measures the output independently and refuses what misses the asked k."""
    postgresql.execute("""
        create or replace function anonproxy.anonymize_mdav(input regclass, spec jsonb) returns jsonb
        language plpgsql as $$
        begin
            execute format('create temp table %I as select _row, age::text as age, sex, race from %s',
                           spec ->> 'output', input);
            return '{}';
        end $$""")
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql, method="mdav")
    assert caught.value.sqlstate == "XX000"
    assert "is not k-anonymous for k = 10: its smallest class has 1 privacy units" in str(caught.value)
    postgresql.rollback()
    assert leftovers(postgresql) == NOTHING


def test_a_method_that_returns_rows_twice_is_refused(postgresql: psycopg.Connection) -> None:
    postgresql.execute("""
        create or replace function anonproxy.anonymize_mdav(input regclass, spec jsonb) returns jsonb
        language plpgsql as $$
        begin
            execute format('create temp table %I as select _row, ''*'' as age, ''*'' as sex, ''*'' as race from %s '
                           'union all select 1, ''*'', ''*'', ''*''', spec ->> 'output', input);
            return '{}';
        end $$""")
    with pytest.raises(psycopg.Error, match="is not one row per kept input row") as caught:
        create(postgresql, method="mdav")
    assert caught.value.sqlstate == "XX000"


# Created releases (Mondrian, sql/0006) ------------------------------------------------------------------


def class_sizes(conn: psycopg.Connection, table: sql.Composable, columns: list[str]) -> Counter[tuple[object, ...]]:
    return Counter(conn.execute(sql.SQL("select {} from {}").format(
        sql.SQL(", ").join(map(sql.Identifier, columns)), table)).fetchall())


def test_create_refresh_drop_cycle(postgresql: psycopg.Connection) -> None:
    summary = create(postgresql, sensitive="occupation")
    release_id, target, method, k, *_ = summary
    assert (target, method) == ("public.adult_k", "mondrian")
    # The table: the QIs in order, then the sensitive column with its type; nothing else.
    columns = postgresql.execute("select attname::text, format_type(atttypid, atttypmod) from pg_attribute "
                                 "where attrelid = 'public.adult_k'::regclass and attnum > 0 order by attnum").fetchall()
    assert columns == [("age", "text"), ("sex", "text"), ("race", "text"), ("occupation", "text")]
    sizes = class_sizes(postgresql, sql.Identifier("adult_k"), QI)
    assert min(sizes.values()) >= 10
    assert k == min(sizes.values())
    assert sum(sizes.values()) == ADULT_ROWS
    # The sensitive column is released unchanged: the same multiset of values as the source.
    assert Counter(postgresql.execute("select occupation from adult_k").fetchall()) == Counter(
        postgresql.execute("select occupation from adult").fetchall())

    row = postgresql.execute(
        "select id, source, target, method, quasi_identifiers, sensitive, unit, parameters ->> 'k', "
        "(achieved ->> 'k')::int, metrics ->> 'rows_released', refreshed_at from anonproxy.releases").fetchall()
    assert row == [(release_id, "public.adult", "public.adult_k", "mondrian", QI, "occupation", None, "10", k,
                    str(ADULT_ROWS), None)]
    postgresql.commit()

    postgresql.execute("delete from adult where id % 3 = 0")
    refreshed = postgresql.execute("select * from anonproxy.refresh_anonymized_view('adult_k')").fetchone()
    assert refreshed is not None and refreshed[0] == release_id
    sizes = class_sizes(postgresql, sql.Identifier("adult_k"), QI)
    assert sum(sizes.values()) == ADULT_ROWS - ADULT_ROWS // 3
    assert min(sizes.values()) >= 10
    assert postgresql.execute("select refreshed_at is not null, (metrics ->> 'rows_released')::int "
                              "from anonproxy.releases").fetchone() == (True, ADULT_ROWS - ADULT_ROWS // 3)
    postgresql.commit()

    postgresql.execute("select anonproxy.drop_release('public.adult_k')")
    assert leftovers(postgresql) == NOTHING
    with pytest.raises(psycopg.Error) as caught:
        postgresql.execute("select anonproxy.drop_release('public.adult_k')")
    assert caught.value.sqlstate == "42704"


def test_t_distance_defaults_to_equal_for_a_categorical_sensitive_column(postgresql: psycopg.Connection) -> None:
    create(postgresql, sensitive="occupation", t=0.4)
    assert postgresql.execute("select parameters ->> 't_distance', achieved ->> 't_distance', "
                              "(achieved ->> 't')::numeric <= 0.4 from anonproxy.releases").fetchone() == (
        "equal", "equal", True)


def test_full_domain_release_uses_one_level_per_column(postgresql: psycopg.Connection) -> None:
    """Dispatch to full_domain (sql/0007) with a suppression limit; checked against the hierarchies."""
    qi = ["age", "workclass", "education", "race", "sex"]
    summary = create(postgresql, quasi_identifiers=qi, sensitive="occupation", method="full_domain",
                     suppression_limit=0.02)
    sizes = class_sizes(postgresql, sql.Identifier("adult_k"), qi)
    assert summary[3] == min(sizes.values()) >= 10
    suppressed = ADULT_ROWS - sum(sizes.values())
    assert summary[8] == suppressed <= 603  # floor(0.02 * 30162)
    (levels,) = postgresql.execute("select method_facts -> 'levels' from anonproxy.releases").fetchone()
    for column in qi:
        released = {value for (value,) in postgresql.execute(
            sql.SQL("select distinct {} from adult_k").format(sql.Identifier(column)))}
        level_nodes = {node for (node,) in postgresql.execute(
            "select node from anonproxy.hierarchy_nodes where hierarchy = %s and level = %s",
            (f"adult.{column}", levels[column]))}
        assert released <= level_nodes, column


def test_mdav_release_keeps_column_totals(postgresql: psycopg.Connection) -> None:
    """Dispatch to mdav (sql/0008): centroids are class means, so each numeric column's total is unchanged."""
    postgresql.execute("create table small as select * from public.adult where id <= 2000")
    summary = create(postgresql, source="small", quasi_identifiers=["age", "education_num", "sex"], k=5,
                     sensitive="hours_per_week", method="mdav")
    sizes = class_sizes(postgresql, sql.Identifier("adult_k"), ["age", "education_num", "sex"])
    assert summary[3] == min(sizes.values()) >= 5
    assert sum(sizes.values()) == 2000
    released, original = postgresql.execute(
        "select (select array[sum(age), sum(education_num)] from adult_k), "
        "(select array[sum(age), sum(education_num)]::numeric[] from small)").fetchone()
    assert all(abs(r - o) < Decimal("1e-6") for r, o in zip(released, original, strict=True))
    assert summary[10] is not None and 0 < summary[10] < 1  # SSE/SST of a real grouping


def ordered_emd(part: Counter[int], whole: Counter[int]) -> Fraction:
    """Ordered EMD (Li, Li, Venkatasubramanian 2007): (1/(m-1)) * sum over sorted values of |cumulative (p - q)|."""
    values = sorted(whole)
    n_part, n_whole = sum(part.values()), sum(whole.values())
    cumulative, total = Fraction(0), Fraction(0)
    for value in values:
        cumulative += Fraction(part[value], n_part) - Fraction(whole[value], n_whole)
        total += abs(cumulative)
    return total / (len(values) - 1)


def test_tclose_first_release_is_t_close(postgresql: psycopg.Connection) -> None:
    """Dispatch to tclose_first (sql/0008); t checked with an EMD computed here."""
    postgresql.execute("create table small as select * from public.adult where id <= 2000")
    qi = ["age", "education_num"]
    summary = create(postgresql, source="small", quasi_identifiers=qi, k=5, sensitive="hours_per_week",
                     t=0.2, method="tclose_first")
    rows = postgresql.execute("select age, education_num, hours_per_week from adult_k").fetchall()
    whole = Counter(hours for *_, hours in rows)
    classes: dict[tuple[object, ...], Counter[int]] = {}
    for age, education, hours in rows:
        classes.setdefault((age, education), Counter())[hours] += 1
    worst = max(ordered_emd(part, whole) for part in classes.values())
    assert worst <= Fraction(1, 5)
    assert abs(summary[6] - Decimal(worst.numerator) / Decimal(worst.denominator)) < Decimal("1e-9")
    assert min(sum(part.values()) for part in classes.values()) >= 5


def test_refresh_keeps_grants_and_dependent_views(postgresql: psycopg.Connection) -> None:
    create(postgresql)
    postgresql.execute("create view adult_k_ages as select distinct age from adult_k")
    postgresql.execute("grant select on adult_k to reporter")
    postgresql.execute("delete from adult where age > 60")
    postgresql.execute("select anonproxy.refresh_anonymized_view('adult_k')")
    assert postgresql.execute("select has_table_privilege('reporter', 'adult_k', 'select')").fetchone() == (True,)
    assert postgresql.execute("select count(*) from adult_k").fetchone() == postgresql.execute(
        "select count(*) from adult").fetchone()
    assert postgresql.execute("select count(*) > 0 from adult_k_ages").fetchone() == (True,)
    with pytest.raises(psycopg.Error) as caught:  # the view depends on the release: drop it first
        postgresql.execute("select anonproxy.drop_release('adult_k')")
    assert caught.value.sqlstate == "2BP01"


def test_refresh_failure_keeps_the_old_rows(postgresql: psycopg.Connection) -> None:
    create(postgresql)
    postgresql.commit()
    before = postgresql.execute("select count(*) from adult_k").fetchone()
    postgresql.execute("delete from adult where id > 5")  # 5 rows left: fewer than k = 10
    with pytest.raises(psycopg.Error) as caught:
        postgresql.execute("select anonproxy.refresh_anonymized_view('adult_k')")
    assert caught.value.sqlstate == "22023"
    postgresql.rollback()
    assert postgresql.execute("select count(*) from adult_k").fetchone() == before


@pytest.mark.parametrize("method", ["mondrian", "mdav"])
def test_user_columns_named_like_internal_ones(postgresql: psycopg.Connection, method: str) -> None:
    """Columns named cluster, whole_table, part, … are the user's: the methods' own names start with _."""
    postgresql.execute('create table public.named as select age as "cluster", hours_per_week as part, '
                       'sex as side, occupation as whole_table from public.adult')
    summary = create(postgresql, source="public.named", target="public.named_k",
                     quasi_identifiers=["cluster", "part", "side"], sensitive="whole_table", k=10, l=2,
                     l_kind="distinct", method=method)
    sizes = class_sizes(postgresql, sql.Identifier("public", "named_k"), ["cluster", "part", "side"])
    assert min(sizes.values()) >= 10
    assert summary[3] == min(sizes.values())
    distinct = postgresql.execute('select min(n) from (select count(distinct whole_table) as n from public.named_k '
                                  'group by "cluster", part, side) c').fetchone()[0]
    assert distinct >= 2


def test_underscore_names_are_reserved(postgresql: psycopg.Connection) -> None:
    postgresql.execute('create table public.under as select age as "_cluster", sex from public.adult')
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql, source="public.under", quasi_identifiers=["_cluster", "sex"])
    assert caught.value.sqlstate == "42939"
    assert caught.value.diag.message_primary == (
        "column name _cluster is reserved: names starting with _ are the methods' own columns")


@pytest.mark.parametrize("sensitive_type", ["json", "point"])
def test_a_sensitive_column_without_ordering(postgresql: psycopg.Connection, sensitive_type: str) -> None:
    """json and point have no ordering operator; the release is still made, the values unchanged."""
    value = {"json": "json_build_object('o', occupation)", "point": "point(length(occupation), 0)"}[sensitive_type]
    postgresql.execute(f"create table public.typed as select age, sex, race, {value} as s from public.adult")
    create(postgresql, source="public.typed", sensitive="s")
    assert postgresql.execute("select format_type(atttypid, atttypmod) from pg_attribute "
                              "where attrelid = 'public.adult_k'::regclass and attname = 's'").fetchone() == (
        sensitive_type,)
    released = Counter(r[0] for r in postgresql.execute("select s::text from public.adult_k"))
    source = Counter(r[0] for r in postgresql.execute("select s::text from public.typed"))
    assert released == source


def test_hints_give_valid_json_for_any_column_name(postgresql: psycopg.Connection) -> None:
    name = "a\"b'c"
    postgresql.execute(sql.SQL("create table public.quoted as select age as {}, sex from public.adult").format(
        sql.Identifier(name)))
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql, source="public.quoted", quasi_identifiers=[name, "sex"], method="full_domain")
    hint = caught.value.diag.message_hint
    assert hint is not None and " => " in hint
    # The hint's argument, pasted into SQL as it is, is the JSON object it names.
    literal = hint.split(" => ", 1)[1]
    postgresql.rollback()
    assert postgresql.execute(sql.SQL("select {}::jsonb").format(sql.SQL(literal))).fetchone() == ({name: "…"},)


def test_audit_finds_the_releases_of_a_source_however_it_is_named(postgresql: psycopg.Connection) -> None:
    create(postgresql, target="public.adult_a", sensitive="occupation")
    create(postgresql, target="public.adult_b", quasi_identifiers=["age", "sex"], sensitive="occupation")
    for name in ("public.adult", "adult", '"public"."adult"'):
        assert release_groups(postgresql, name) == [["public.adult_a", "public.adult_b"]], name


def test_weird_names_are_quoted(postgresql: psycopg.Connection) -> None:
    postgresql.execute('create table "Odd Source" as select age as "age; drop table adult", sex, race, occupation '
                       "from public.adult")
    postgresql.commit()
    qi = ["age; drop table adult", "sex", "race"]
    summary = create(postgresql, source='"Odd Source"', target='"my table; drop"', quasi_identifiers=qi,
                     sensitive="occupation")
    assert summary[1] == 'public."my table; drop"'
    assert postgresql.execute("select to_regclass('public.adult') is not null").fetchone() == (True,)
    sizes = class_sizes(postgresql, sql.Identifier("my table; drop"), qi)
    assert min(sizes.values()) >= 10
    assert postgresql.execute("select source, target from anonproxy.releases").fetchone() == (
        'public."Odd Source"', 'public."my table; drop"')
    postgresql.execute("""select anonproxy.drop_release('"my table; drop"')""")
    assert postgresql.execute("""select to_regclass('public."my table; drop"')""").fetchone() == (None,)


def test_existing_registry_row_without_table(postgresql: psycopg.Connection) -> None:
    create(postgresql)
    postgresql.execute("drop table adult_k")
    with pytest.raises(psycopg.Error) as caught:
        create(postgresql)
    assert caught.value.sqlstate == "42710"
    assert caught.value.diag.message_hint == "forget it first: select anonproxy.drop_release('public.adult_k')"


# CLI ------------------------------------------------------------------------------------------------


def anonproxy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "anonproxy", *args], check=False, capture_output=True, text=True, timeout=120)


def test_cli_anonymize_refresh_drop(postgresql: psycopg.Connection, dbname: str, direct: Endpoint) -> None:
    dsn = direct.dsn(dbname)
    result = anonproxy("anonymize", "--dsn", dsn, "--source", "public.adult", "--target", "adult_cli",
                       "--qi", "age,sex,race", "--sensitive", "occupation", "--k", "10",
                       "--t", "0.4", "--t-distance", "equal")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("release 1: public.adult_cli (mondrian)\n")
    # Progress lines from the SQL notices: the dispatcher's five phases, in order.
    phases = [line for line in result.stderr.splitlines() if "/5 " in line]
    assert [line.split()[2] for line in phases] == ["1/5", "2/5", "3/5", "4/5", "5/5"]
    assert "Traceback" not in result.stderr
    k = postgresql.execute("select (achieved ->> 'k')::int, (achieved ->> 't')::numeric from anonproxy.releases"
                           ).fetchone()
    assert k is not None and k[0] >= 10 and k[1] <= 0.4
    assert f"  k                    {k[0]}\n" in result.stdout

    listing = anonproxy("release", "list", "--dsn", dsn)
    assert listing.returncode == 0 and "public.adult_cli" in listing.stdout
    refreshed = anonproxy("release", "refresh", "adult_cli", "--dsn", dsn)
    assert refreshed.returncode == 0, refreshed.stderr
    dropped = anonproxy("release", "drop", "adult_cli", "--dsn", dsn)
    assert dropped.returncode == 0
    assert leftovers(postgresql) == NOTHING


def test_cli_errors_print_message_and_hint(dbname: str, direct: Endpoint) -> None:
    result = anonproxy("anonymize", "--dsn", direct.dsn(dbname), "--source", "public.adult", "--target", "x",
                       "--qi", "age,sex", "--k", "10", "--method", "full_domain", "--hierarchy", "age=")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines()[-2:] == [
        "anonproxy anonymize: full_domain needs a hierarchy for every quasi-identifier; age has none (SQLSTATE 42704)",
        ("anonproxy anonymize: hint: load or build one (anonproxy hierarchy load|build-intervals|build-prefix) "
         "and name it: hierarchies => '{\"age\": \"…\"}'"),
    ]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_redraws_one_line_on_a_terminal() -> None:
    stream = FakeTerminal()
    bar = ProgressBar(stream, "anonproxy anonymize")
    bar.update(3, 12, "round 4")
    bar.update(12, 12, "final")
    bar.close()
    assert stream.getvalue() == ("\r[" + "#" * 8 + "-" * 22 + "] 3/12 round 4\x1b[K"
                                 "\r[" + "#" * 30 + "] 12/12 final\x1b[K\n")


def test_progress_bar_reads_notices_and_shows_warnings(postgresql: psycopg.Connection) -> None:
    stream = io.StringIO()
    postgresql.add_notice_handler(ProgressBar(stream, "anonproxy anonymize").notice)
    postgresql.execute("""do $$ begin
        raise notice 'anonproxy progress % of %: %', 2, 7, 'round 2';
        raise notice 'table "x" does not exist, skipping';
        raise warning 'composition risk' using detail = 'PVP 12 %', hint = 'generalize further';
    end $$""")
    assert stream.getvalue() == ("anonproxy anonymize: 2/7 round 2\n"
                                 "anonproxy anonymize: warning: composition risk\n"
                                 "anonproxy anonymize: detail: PVP 12 %\n"
                                 "anonproxy anonymize: hint: generalize further\n")
