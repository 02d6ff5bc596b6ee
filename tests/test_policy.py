"""The policy in the database: SQL functions, YAML files, NOTIFY, and the grants that make bypass useless."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy import commands
from anonproxy.policy.model import (
    Budget,
    ColumnPolicy,
    LinkedTable,
    Policy,
    ProtectedTable,
    PublishedRelation,
    RolePolicy,
    SharedBudget,
    SuppressionParams,
)
from anonproxy.policy.store import (
    POLICY_CHANNEL,
    load_policy,
    load_policy_async,
    service_role,
)
from anonproxy.policy.yaml_policy import (
    PolicyApplyError,
    PolicyError,
    apply_policy,
    demo_policy,
    dump_policy,
    parse_policy,
)
from anonproxy.sample_data import ADULT_COLUMNS, ADULT_ROW_COUNT

SERVICE = "anonproxy_service"
SCRATCH = "policy_scratch"  # a throwaway login role for tests that change cluster-wide memberships


# Fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def service_login(pg_server: EmbeddedPostgres) -> str:
    """The service role, created once per cluster (roles are cluster-wide); its password is its name."""
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        exists = conn.execute("select from pg_roles where rolname = %s", (SERVICE,)).fetchone() is not None
        verb = "alter" if exists else "create"
        conn.execute(f"{verb} role {SERVICE} login password '{SERVICE}'")
    return SERVICE


@pytest.fixture
def db(postgresql: psycopg.Connection[Any], service_login: str) -> psycopg.Connection[Any]:
    """A superuser connection in autocommit mode: each statement is its own transaction."""
    postgresql.commit()
    postgresql.autocommit = True
    return postgresql


@pytest.fixture
def scratch(db: psycopg.Connection[Any]) -> Iterator[str]:
    db.execute(f"drop role if exists {SCRATCH}")
    db.execute(f"create role {SCRATCH} login password '{SCRATCH}'")
    db.execute(f"grant usage on schema public to {SCRATCH}")
    yield SCRATCH
    db.execute(f"drop owned by {SCRATCH}")
    db.execute(f"drop role {SCRATCH}")


@pytest.fixture
def people(db: psycopg.Connection[Any]) -> None:
    """A protected-table candidate (people), a table linked to it (stays), a partitioned one (events), and an
    anonymized table to publish (visit_counts)."""
    db.execute("""
        create table public.people (id integer primary key, name text not null);
        create table public.stays (id integer primary key, person_id integer not null references public.people,
                                    cost numeric not null);
        create table public.events (person_id integer not null, year integer not null) partition by range (year);
        create table public.events_2024 partition of public.events for values from (2024) to (2025);
        insert into public.people values (1, 'Ada'), (2, 'Grace');
        insert into public.stays values (10, 1, 50.5), (11, 2, 20);
        insert into public.events values (1, 2024);
        create table public.visit_counts (year integer, stays integer);
        insert into public.visit_counts values (2024, 2);
    """)


def connect_as(pg_server: EmbeddedPostgres, dbname: str, role: str) -> psycopg.Connection[Any]:
    return psycopg.connect(pg_server.conninfo(user=role, password=role, dbname=dbname), autocommit=True)


def sql_error(conn: psycopg.Connection[Any], query: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(query)
    return caught.value


def version(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("select version from anonproxy.policy_version").fetchone()
    assert row is not None
    return int(row[0])


def without_version(policy: Policy) -> Policy:
    return dataclasses.replace(policy, version=0)


RICH_POLICY = Policy(
    service_role=SERVICE,
    tables={
        "public.people": ProtectedTable("public.people", "id", {
            "id": ColumnPolicy("id", "identifier"),
            "name": ColumnPolicy("name", "quasi_identifier", domain=("Ada", "Grace", "42")),
        }, SharedBudget(Decimal("3.5"), Decimal("0.000001"), "7 days")),
    },
    links={
        "public.stays": LinkedTable("public.stays", "person_id", "public.people", "id", {
            "cost": ColumnPolicy("cost", "sensitive", lower=0.5, upper=1000.25),
        }),
    },
    roles={
        "analyst": RolePolicy("analyst", "dp", budgets={
            "public.people": Budget(Decimal("1.25"), Decimal("0.00000001"), "1 day", Decimal("0.25"), Decimal(0),
                                    max_groups_per_person=4, max_rows_per_person_and_group=2)}),
        "reporter": RolePolicy("reporter", "suppress", SuppressionParams(
            k=5, dominance_n=3, dominance_percent=72.5, p_percent=2.5, suppressed_rest=True, allow_min_max=True)),
    },
    published={"public.visit_counts": PublishedRelation("public.visit_counts", ("reporter", "analyst"))},
)  # fmt: skip


# The demo policy ------------------------------------------------------------------


def test_demo_policy_applies_and_describes_adult(db: psycopg.Connection[Any]) -> None:
    applied = apply_policy(db, demo_policy())
    policy = load_policy(db)
    assert policy.version == applied == version(db) >= 1
    assert policy.service_role == SERVICE
    adult = policy.tables["public.adult"]
    assert adult.unit_column == "id"
    assert list(adult.columns) == list(ADULT_COLUMNS)  # every column declared, in table order
    assert adult.columns["age"] == ColumnPolicy("age", "quasi_identifier", 15.0, 100.0)
    assert adult.columns["hours_per_week"] == ColumnPolicy("hours_per_week", "public", 0.0, 100.0)
    assert adult.columns["sex"].domain == ("Female", "Male")
    assert policy.roles["reporter"] == RolePolicy("reporter", "suppress", SuppressionParams(
        k=10, dominance_n=2, dominance_percent=85.0, p_percent=10.0, suppressed_rest=True))  # fmt: skip
    assert policy.role("analyst").mode == "dp"
    assert policy.role("dba").mode == "direct"
    assert policy.role("someone_else").mode == "direct"
    assert policy.is_protected("public.adult") and not policy.is_protected("public.other")
    # The declared bounds and domains hold every row of the sample data.
    for column in adult.columns.values():
        if column.lower is not None and column.upper is not None:
            row = db.execute(f"select min({column.name}), max({column.name}) from adult").fetchone()
            assert row is not None and column.lower <= row[0] and row[1] <= column.upper, column
        if column.domain is not None:
            values = {v for (v,) in db.execute(f"select distinct {column.name} from adult")}
            assert values <= set(column.domain), column


def test_show_output_round_trips_through_apply(db: psycopg.Connection[Any], people: None) -> None:
    for policy in (demo_policy(), RICH_POLICY):
        apply_policy(db, policy)
        loaded = load_policy(db)
        assert without_version(loaded) == without_version(policy)
        text = dump_policy(loaded)
        assert text.startswith(f"# anonproxy policy, version {loaded.version}\n")
        reparsed = parse_policy(text)
        assert reparsed == without_version(loaded)
        apply_policy(db, reparsed)
        again = load_policy(db)
        assert again.version == loaded.version + 1
        assert dump_policy(without_version(again)) == dump_policy(without_version(loaded))


def test_apply_replaces_the_whole_policy(db: psycopg.Connection[Any], people: None) -> None:
    apply_policy(db, RICH_POLICY)
    apply_policy(db, demo_policy())
    policy = load_policy(db)
    assert set(policy.tables) == {"public.adult"} and set(policy.links) == {"public.visits"}
    assert set(policy.roles) == {"dba", "reporter", "analyst"}
    leftover = db.execute("select count(*) from anonproxy.column_policies where table_name not in ('public.adult', 'public.visits')")
    assert leftover.fetchone() == (0,)


def test_policy_without_the_schema_is_empty(db: psycopg.Connection[Any]) -> None:
    db.execute("drop schema anonproxy cascade")
    assert load_policy(db) == Policy()
    assert service_role(db) == SERVICE
    with pytest.raises(PolicyError, match="not installed"):
        apply_policy(db, demo_policy())


def test_async_loader_and_service_role_agree(pg_server: EmbeddedPostgres, db: psycopg.Connection[Any],
                                             dbname: str) -> None:
    apply_policy(db, demo_policy())

    async def load() -> Policy:
        async with await psycopg.AsyncConnection.connect(pg_server.conninfo(dbname=dbname)) as conn:
            return await load_policy_async(conn)

    assert asyncio.run(load()) == load_policy(db)
    # The proxy's service role (not a superuser) may read the policy, and a non-autocommit
    # connection is left idle, not inside a transaction.
    with psycopg.connect(pg_server.conninfo(user=SERVICE, password=SERVICE, dbname=dbname)) as conn:
        assert load_policy(conn) == load_policy(db)
        assert service_role(conn) == SERVICE
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


# NOTIFY -------------------------------------------------------------------------------


def test_a_committed_change_is_announced_once_with_its_version(pg_server: EmbeddedPostgres,
                                                               db: psycopg.Connection[Any], dbname: str) -> None:
    before = version(db)
    with connect_as_superuser(pg_server, dbname) as listener, connect_as_superuser(pg_server, dbname) as editor:
        listener.execute(f"listen {POLICY_CHANNEL}")
        with editor.transaction():
            applied = apply_policy(editor, demo_policy())  # many statements, one transaction
            assert list(listener.notifies(timeout=0.3)) == []  # nothing before commit
        received = list(listener.notifies(timeout=20, stop_after=1))
        assert [(n.channel, n.payload) for n in received] == [(POLICY_CHANNEL, str(applied))]
        assert applied == before + 1 == version(db)
        assert list(listener.notifies(timeout=0.3)) == []  # and only once

        # A rolled-back change announces nothing and leaves the version alone.
        with pytest.raises(psycopg.errors.UndefinedObject), editor.transaction():
            editor.execute("select anonproxy.set_column('adult', 'age', 'public')")
            editor.execute("select anonproxy.drop_role_policy('nobody')")
        assert list(listener.notifies(timeout=0.3)) == []
        assert version(db) == applied

        db.execute("select anonproxy.set_column('adult', 'age', 'sensitive', 18, 90)")
        received = list(listener.notifies(timeout=20, stop_after=1))
        assert [n.payload for n in received] == [str(applied + 1)]
        assert load_policy(db).tables["public.adult"].columns["age"] == ColumnPolicy("age", "sensitive", 18, 90)


def connect_as_superuser(pg_server: EmbeddedPostgres, dbname: str) -> psycopg.Connection[Any]:
    return psycopg.connect(pg_server.conninfo(dbname=dbname), autocommit=True)


# Validation by the SQL functions ---------------------------------------------------------

SQL_ERRORS = [
    ("select anonproxy.protect_table('adlt', 'id')", "42P01", 'relation "adlt" does not exist'),
    ("select anonproxy.protect_table('adult', 'idd')", "42703", 'column "idd" does not exist in table public.adult'),
    ("select anonproxy.protect_table('adult_pkey', 'id')", "42809",
     "public.adult_pkey is not a table, view or materialized view"),
    ("select anonproxy.protect_table('pg_class', 'oid')", "22023", "pg_catalog.pg_class is a system or temporary"),
    ("select anonproxy.protect_table('stays', 'id')", "22023", "table public.stays is a linked table"),
    ("select anonproxy.set_column('adult', 'agee', 'public')", "42703",
     'column "agee" does not exist in table public.adult'),
    ("select anonproxy.set_column('adult', 'age', 'quasi')", "22023",
     "unknown column kind 'quasi' for column public.adult.age"),
    ("select anonproxy.set_column('adult', 'age', 'public', 90, 17)", "22023",
     "lower bound 90 is greater than upper bound 17 for column public.adult.age"),
    ("select anonproxy.set_column('adult', 'age', 'public', lower_bound => 17)", "22023",
     "column public.adult.age needs both a lower and an upper bound, or neither"),
    ("select anonproxy.set_column('adult', 'sex', 'public', 0, 1)", "42804",
     "column public.adult.sex is of type text; bounds need a numeric column"),
    ("select anonproxy.set_column('adult', 'sex', 'public', domain => '{}')", "22023",
     "the domain of column public.adult.sex is empty"),
    ("select anonproxy.set_column('adult', 'sex', 'public', domain => array['Male', null])", "22004",
     "the domain of column public.adult.sex contains NULL"),
    ("select anonproxy.set_column('people', 'id', 'public')", "22023",
     "table public.people is not protected or linked"),
    ("select anonproxy.unset_column('adult', 'race')", "42704", "column public.adult.race has no policy"),
    ("select anonproxy.set_role_policy('nobody', 'suppress')", "42704", 'role "nobody" does not exist'),
    ("select anonproxy.set_role_policy('reporter', 'supress')", "22023",
     "unknown mode 'supress' for role \"reporter\""),
    ("select anonproxy.set_role_policy('reporter', 'suppress', 1)", "22023",
     'k for role "reporter" must be at least 2, got 1'),
    ("select anonproxy.set_role_policy('reporter', 'suppress', 10, 2)", "22023",
     'dominance rule for role "reporter" needs both dominance_n and dominance_percent'),
    ("select anonproxy.set_role_policy('reporter', 'suppress', 10, 0, 50)", "22023",
     'dominance_n for role "reporter" must be at least 1, got 0'),
    ("select anonproxy.set_role_policy('reporter', 'suppress', 10, 2, 150)", "22023",
     'dominance_percent for role "reporter" must be in (0, 100], got 150'),
    ("select anonproxy.set_role_policy('reporter', 'suppress', p_percent => 0)", "22023",
     'p_percent for role "reporter" must be greater than 0, got 0'),
    (f"select anonproxy.set_role_policy('{SERVICE}', 'dp')", "22023",
     f'role "{SERVICE}" is the service role; it must stay direct'),
    ("select anonproxy.drop_role_policy('scram_user')", "42704", 'role "scram_user" has no policy'),
    ("select anonproxy.set_service_role('ghost')", "42704", 'service role "ghost" does not exist'),
    ("select anonproxy.set_service_role('reporter')", "22023",
     'role "reporter" cannot be the service role: its mode is not direct'),
    ("select anonproxy.link_table('events', 'person_id', 'people')", "22023",
     "table public.people, referenced by linked table public.events, is not protected"),
    ("select anonproxy.link_table('events', 'personid', 'adult')", "42703",
     'column "personid" does not exist in table public.events'),
    ("select anonproxy.link_table('adult', 'id', 'adult')", "22023", "table public.adult cannot link to itself"),
    ("select anonproxy.link_table('adult', 'id', 'stays')", "22023",
     "table public.adult is protected, so it cannot also be a linked table"),
    ("select anonproxy.unprotect_table('public.people')", "42704", "table public.people is not protected"),
    ("select anonproxy.unprotect_table('adult')", "42704", "table adult is not protected"),
    ("select anonproxy.unlink_table('public.adult')", "42704", "table public.adult is not a linked table"),
    ("select anonproxy.publish_relation('adult', array['reporter'])", "22023",
     ("public.adult is protected data (a protected or linked table, or part of one); only anonymized data can be "
      "published")),
    ("select anonproxy.publish_relation('stays', array['reporter'])", "22023", "public.stays is protected data"),
    ("select anonproxy.publish_relation('visit_counts', array['dba'])", "22023",
     'role "dba" is in mode direct; published relations are for roles in mode suppress or dp'),
    ("select anonproxy.publish_relation('visit_counts', array['ghost'])", "42704", 'role "ghost" does not exist'),
    ("select anonproxy.publish_relation('visit_counts', '{}')", "22023",
     "published relation public.visit_counts needs at least one role"),
    ("select anonproxy.publish_relation('visit_counts', array['reporter', null])", "22004",
     "the roles of published relation public.visit_counts contain NULL"),
    ("select anonproxy.publish_relation('visit_counts', array['reporter', 'reporter'])", "22023",
     "the roles of published relation public.visit_counts list a role more than once"),
    ("select anonproxy.publish_relation('visit_countz', array['reporter'])", "42P01",
     'relation "visit_countz" does not exist'),
    ("select anonproxy.unpublish_relation('public.visit_counts')", "42704",
     "relation public.visit_counts is not published"),
]


@pytest.mark.parametrize(("statement", "sqlstate", "message"), SQL_ERRORS, ids=[s for s, _, _ in SQL_ERRORS])
def test_sql_functions_name_what_is_wrong(db: psycopg.Connection[Any], people: None, statement: str, sqlstate: str,
                                          message: str) -> None:
    apply_policy(db, demo_policy())
    db.execute("select anonproxy.link_table('stays', 'person_id', 'adult')")
    db.execute("select anonproxy.unset_column('adult', 'race')")
    before = load_policy(db)
    error = sql_error(db, statement)
    assert error.sqlstate == sqlstate, error
    assert (error.diag.message_primary or "").startswith(message), error
    assert load_policy(db) == before  # each call is a transaction: the previous policy stays


def test_errors_carry_hints(db: psycopg.Connection[Any], people: None) -> None:
    apply_policy(db, demo_policy())
    assert "id, age, workclass" in (sql_error(db, "select anonproxy.set_column('adult', 'agee', 'public')")
                                    .diag.message_hint or "")
    assert "identifier, quasi_identifier, sensitive, public" in (
        sql_error(db, "select anonproxy.set_column('adult', 'age', 'quasi')").diag.message_hint or "")
    assert "anonproxy.protect_table('public.people'" in (
        sql_error(db, "select anonproxy.link_table('stays', 'person_id', 'people')").diag.message_hint or "")
    assert "direct, suppress, dp, deny" in (
        sql_error(db, "select anonproxy.set_role_policy('reporter', 'x')").diag.message_hint or "")


def test_linked_tables_and_their_dependencies(db: psycopg.Connection[Any], people: None) -> None:
    db.execute("select anonproxy.protect_table('people', 'id')")
    db.execute("select anonproxy.link_table('stays', 'person_id', 'people')")
    db.execute("select anonproxy.set_column('stays', 'cost', 'sensitive', 0, 500)")
    policy = load_policy(db)
    assert policy.links == {"public.stays": LinkedTable("public.stays", "person_id", "public.people", "id", {
        "cost": ColumnPolicy("cost", "sensitive", 0.0, 500.0)})}  # fmt: skip
    error = sql_error(db, "select anonproxy.unprotect_table('public.people')")
    assert error.sqlstate == "2BP01"
    assert error.diag.message_primary == "table public.people is referenced by linked table public.stays"
    assert error.diag.message_hint == "unlink it first: select anonproxy.unlink_table('public.stays')"
    db.execute("select anonproxy.unlink_table('public.stays')")
    db.execute("select anonproxy.unprotect_table('public.people')")
    assert load_policy(db).tables == {} and load_policy(db).links == {}
    assert db.execute("select count(*) from anonproxy.column_policies").fetchone() == (0,)


def test_a_dropped_table_must_be_removed_from_the_policy(db: psycopg.Connection[Any], people: None) -> None:
    db.execute("select anonproxy.protect_table('people', 'id')")
    db.execute("drop table public.people cascade")
    error = sql_error(db, "select anonproxy.set_role_policy('reporter', 'suppress')")
    assert error.sqlstate == "42501"
    assert error.diag.message_primary == "protected or linked table public.people does not exist"
    db.execute("select anonproxy.unprotect_table('public.people')")  # by its stored name
    db.execute("select anonproxy.set_role_policy('reporter', 'suppress')")


# Validation of YAML files ---------------------------------------------------------------------

ADULT = "tables: {public.adult: {unit: id}}\n"
YAML_ERRORS = [
    ("roles: {reporter: {mode: suppress, k: 1}}", "roles.reporter.k: must be an integer ≥ 2, got 1"),
    ("roles: {reporter: {mode: suppress, k: ten}}", "roles.reporter.k: must be an integer ≥ 2, got 'ten'"),
    ("roles: {reporter: {mode: supress}}",
     "roles.reporter.mode: must be one of direct, suppress, dp, deny, got 'supress'"),
    ("roles: {reporter: {k: 5}}", "roles.reporter.mode: is required"),
    ("roles: {reporter: {mode: suppress, dominance: {n: 2}}}", "roles.reporter.dominance.percent: is required"),
    ("roles: {reporter: {mode: suppress, dominance: {n: 0, percent: 50}}}",
     "roles.reporter.dominance.n: must be an integer ≥ 1, got 0"),
    ("roles: {reporter: {mode: suppress, dominance: {n: 2, percent: 150}}}",
     "roles.reporter.dominance.percent: must be a number in (0, 100], got 150"),
    ("roles: {reporter: {mode: suppress, p_percent: 0}}", "roles.reporter.p_percent: must be a number > 0, got 0"),
    ("roles: {reporter: {mode: suppress, suppressed_rest: maybe}}",
     "roles.reporter.suppressed_rest: must be true or false, got 'maybe'"),
    ("roles: {reporter: {mode: suppress, kk: 5}}",
     ("roles.reporter: unknown key 'kk' (expected mode, k, dominance, p_percent, suppressed_rest, allow_min_max, "
      "budgets)")),
    ("roles: {reporter: suppress}",
     ("roles.reporter: must be a mapping with keys mode, k, dominance, p_percent, suppressed_rest, allow_min_max, "
     "budgets, got str")),
    ("tables: {adult: {unit: id}}", "tables.adult: table names must be schema-qualified, like public.adult"),
    ("tables: {public.adult: {columns: {}}}", "tables.public.adult.unit: is required"),
    ("tables: {public.adult: {unit: id, columns: {age: {kind: qi}}}}",
     "tables.public.adult.columns.age.kind: must be one of identifier, quasi_identifier, sensitive, public, got 'qi'"),
    ("tables: {public.adult: {unit: id, columns: {age: {lower: 1, upper: 2}}}}",
     "tables.public.adult.columns.age.kind: is required"),
    ("tables: {public.adult: {unit: id, columns: {age: {kind: public, lower: 90, upper: 17}}}}",
     "tables.public.adult.columns.age: lower bound 90 is greater than upper bound 17"),
    ("tables: {public.adult: {unit: id, columns: {age: {kind: public, lower: 17}}}}",
     "tables.public.adult.columns.age: give both lower and upper bounds, or neither"),
    ("tables: {public.adult: {unit: id, columns: {age: {kind: public, lower: seventeen, upper: 90}}}}",
     "tables.public.adult.columns.age.lower: must be a finite number, got 'seventeen'"),
    ("tables: {public.adult: {unit: id, columns: {age: {kind: public, lower: .nan, upper: 90}}}}",
     "tables.public.adult.columns.age.lower: must be a finite number, got nan"),
    ("tables: {public.adult: {unit: id, columns: {age: {kind: public, lowr: 17}}}}",
     "tables.public.adult.columns.age: unknown key 'lowr' (expected kind, lower, upper, domain, earliest, latest)"),
    ("tables: {public.adult: {unit: id, columns: {sex: {kind: public, domain: [Female, no]}}}}",
     ("tables.public.adult.columns.sex.domain[1]: must be a string or a number, got False "
     "(quote it: YAML reads yes/no/on/off as booleans)")),
    ("tables: {public.adult: {unit: id, columns: {sex: {kind: public, domain: []}}}}",
     "tables.public.adult.columns.sex.domain: must be a non-empty list of values, got []"),
    ("tables: {public.adult: {unit: id, columns: {sex: {kind: public, domain: [Male, Male]}}}}",
     "tables.public.adult.columns.sex.domain: lists a value more than once"),
    ("links: {public.stays: {column: person_id, references: public.people}}",
     ("links.public.stays.references: table public.people, referenced by linked table public.stays, is not protected "
      "(under tables of this file)")),
    ("links: {public.stays: {references: public.people}}\ntables: {public.people: {unit: id}}",
     "links.public.stays.column: is required"),
    ("tables: {public.people: {unit: id}}\nlinks: {public.people: {column: id, references: public.people}}",
     "links.public.people: table public.people is protected (under tables), so it cannot also be a linked table"),
    ("tabels: {}", "policy: unknown key 'tabels' (expected service_role, tables, links, roles, published, reference_tables, max_statement_time)"),
    ("service_role: ''", "service_role: must be a non-empty string, got ''"),
    ("tables: [public.adult]", "tables: must be a mapping of names, got list"),
    ("", "policy: must be a mapping with keys service_role, tables, links, roles, published, reference_tables, max_statement_time, got nothing"),
    ("roles: {reporter: {mode: dp}, reporter: {mode: direct}}", "found duplicate key 'reporter'"),
    ("roles: {reporter: {mode: dp}", "policy: not valid YAML"),
    (ADULT + "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 0}}}}",
     "roles.analyst.budgets.public.adult.epsilon: must be a number > 0, got 0"),
    (ADULT + "roles: {analyst: {mode: dp, budgets: {public.adult: {delta: 0.1}}}}",
     "roles.analyst.budgets.public.adult.epsilon: is required"),
    (ADULT + "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 1, delta: 1}}}}",
     "roles.analyst.budgets.public.adult.delta: must be a number in [0, 1), got 1"),
    (ADULT + "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 1, delta: -0.5}}}}",
     "roles.analyst.budgets.public.adult.delta: must be a number in [0, 1), got -0.5"),
    (ADULT + "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 1, epsilon_per_query: 2}}}}",
     "roles.analyst.budgets.public.adult.epsilon_per_query: must be a number in (0, 1], the budget's epsilon; got 2"),
    (ADULT + "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 1, epsilon_per_query: 0}}}}",
     "roles.analyst.budgets.public.adult.epsilon_per_query: must be a number in (0, 1], the budget's epsilon; got 0"),
    (ADULT + "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 1, accuracy_epsilon: 2}}}}",
     "roles.analyst.budgets.public.adult.accuracy_epsilon: must be a number in (0, 1], the budget's epsilon; got 2"),
    (ADULT + "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 1, accuracy_epsilon: 0.5, "
             "epsilon_per_query: 0.5}}}}",
     ("roles.analyst.budgets.public.adult.epsilon_per_query: is the old name of accuracy_epsilon: give "
      "accuracy_epsilon only")),
    (ADULT + "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 1, delta: 0.00001, "
     "delta_per_query: 0.001}}}}",
     ("roles.analyst.budgets.public.adult.delta_per_query: must be a number in [0, 0.00001], the budget's delta; "
      "got 0.001")),
    (ADULT + "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 1, delta: 1e-5}}}}",
     ("roles.analyst.budgets.public.adult.delta: must be a finite number, got '1e-5' (YAML reads 1e-5 as text: "
      "write 1.0e-5 or 0.00001)")),
    (ADULT + "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: .inf}}}}",
     "roles.analyst.budgets.public.adult.epsilon: must be a finite number, got inf"),
    (ADULT + "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 1, refresh_period: 7}}}}",
     "roles.analyst.budgets.public.adult.refresh_period: must be a non-empty string, got 7"),
    (ADULT + "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 1, eps: 1}}}}",
     ("roles.analyst.budgets.public.adult: unknown key 'eps' (expected epsilon, delta, refresh_period, "
      "accuracy_epsilon, delta_per_query, accounting, epsilon_per_query, max_groups_per_person, "
      "max_rows_per_person_and_group)")),
    ("roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 1}}}}",
     "roles.analyst.budgets.public.adult: public.adult is not a protected table of this file (under tables)"),
    (("tables: {public.people: {unit: id}}\nlinks: {public.stays: {column: person_id, references: public.people}}\n"
      "roles: {analyst: {mode: dp, budgets: {public.stays: {epsilon: 1}}}}"),
     ("roles.analyst.budgets.public.stays: public.stays is a linked table; budgets belong to the protected table it "
      "links to, public.people")),
    ("tables: {public.adult: {unit: id, shared_budget: {epsilon: 3, delta: 1.5}}}",
     "tables.public.adult.shared_budget.delta: must be a number in [0, 1), got 1.5"),
    ("tables: {public.adult: {unit: id, shared_budget: {epsilon: 3, epsilon_per_query: 1}}}",
     ("tables.public.adult.shared_budget: unknown key 'epsilon_per_query' (expected epsilon, delta, refresh_period, "
      "accounting)")),
    ("roles: {dba: {mode: direct}}\npublished: {public.release: {roles: [dba]}}",
     ("published.public.release.roles[0]: role dba is in mode direct in this file; published relations are for roles "
      "in mode suppress or dp")),
    ("roles: {reporter: {mode: suppress}}\npublished: {public.release: {roles: [reporter, nobody]}}",
     ("published.public.release.roles[1]: role nobody is in mode direct in this file; published relations are for "
      "roles in mode suppress or dp")),
    ("published: {public.release: {roles: []}}", "published.public.release.roles: must be a non-empty list of names, got []"),
    ("published: {public.release: {}}", "published.public.release.roles: is required"),
    ("published: {release: {roles: [reporter]}}",
     "published.release: table names must be schema-qualified, like public.adult"),
    (ADULT + "roles: {reporter: {mode: suppress}}\npublished: {public.adult: {roles: [reporter]}}",
     "published.public.adult: a protected or linked table cannot be published: publish an anonymized release of it"),
]


@pytest.mark.parametrize(("text", "problem"), YAML_ERRORS, ids=[p for _, p in YAML_ERRORS])
def test_yaml_problems_name_their_path(text: str, problem: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(text)
    assert any(line == problem or (problem in line and "YAML" in line) for line in caught.value.problems), \
        caught.value.problems


def test_accuracy_epsilon_is_read_under_its_old_name_too() -> None:
    """accuracy_epsilon (the ε that sets each answer's noise) was called epsilon_per_query: policies that still say so
    load as before, and are written back under the new name."""
    budgets = "roles: {analyst: {mode: dp, budgets: {public.adult: {epsilon: 2, delta: 0.00001, %s: 0.25}}}}"
    new, old = (parse_policy(ADULT + budgets % key) for key in ("accuracy_epsilon", "epsilon_per_query"))
    assert new == old and new.roles["analyst"].budgets["public.adult"].epsilon_per_query == Decimal("0.25")
    assert "accuracy_epsilon: 0.25" in dump_policy(old) and "epsilon_per_query" not in dump_policy(old)


def test_every_yaml_problem_is_reported_at_once() -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy("roles: {a: {mode: x}, b: {mode: dp, k: 1}}\ntables: {t: {unit: id}}")
    assert caught.value.problems == [
        "tables.t: table names must be schema-qualified, like public.adult",
        "roles.a.mode: must be one of direct, suppress, dp, deny, got 'x'",
        "roles.b.k: must be an integer ≥ 2, got 1",
    ]


@pytest.mark.parametrize(("change", "problem"), [
    (lambda text: text.replace("      hours_per_week:", "      hours_per_wek:"),
     ('tables.public.adult.columns.hours_per_wek: column "hours_per_wek" does not exist in table public.adult '
     "(SQLSTATE 42703)")),
    (lambda text: text.replace("public.adult:", "public.adlt:").replace("references: public.adult",
                                                                        "references: public.adlt"),
     'tables.public.adlt.unit: relation "public.adlt" does not exist (SQLSTATE 42P01)'),
    (lambda text: text.replace("  analyst:", "  analyts:"),
     'roles.analyts: role "analyts" does not exist (SQLSTATE 42704)'),
    (lambda text: text.replace("service_role: anonproxy_service", "service_role: nobody_here"),
     'service_role: service role "nobody_here" does not exist (SQLSTATE 42704)'),
    (lambda text: text.replace("workclass:\n        kind: quasi_identifier", "workclass:\n        kind: public\n"
                               "        lower: 0\n        upper: 1"),
     ("tables.public.adult.columns.workclass: column public.adult.workclass is of type text; bounds need a numeric "
     "column (SQLSTATE 42804)")),
    (lambda text: text.replace("{epsilon: 10,", "{epsilon: 10, refresh_period: -1 day,"),
     ('roles.analyst.budgets.public.adult: refresh_period for role "analyst" on public.adult must be positive, got '
      "-1 days (SQLSTATE 22023)")),
    (lambda text: text.replace("{epsilon: 10,", "{epsilon: 10, refresh_period: fortnight,"),
     ('roles.analyst.budgets.public.adult: invalid input syntax for type interval: "fortnight" (SQLSTATE 22007)')),
], ids=["column", "table", "role", "service role", "bounds on text", "negative refresh", "refresh syntax"])  # fmt: skip
def test_a_refused_apply_names_the_path_and_keeps_the_previous_policy(db: psycopg.Connection[Any], change: Any,
                                                                      problem: str) -> None:
    apply_policy(db, demo_policy())
    before = load_policy(db)
    text = (Path(__file__).parents[1] / "anonproxy" / "data" / "demo_policy.yaml").read_text()
    with pytest.raises(PolicyApplyError) as caught:
        apply_policy(db, parse_policy(change(text)))
    assert caught.value.problems[0] == problem
    assert load_policy(db) == before


# Grants: bypass yields nothing ------------------------------------------------------------


def test_restricted_roles_cannot_read_protected_rows_directly(pg_server: EmbeddedPostgres,
                                                              db: psycopg.Connection[Any], dbname: str) -> None:
    # Privileges a careless DBA might have left: all of them must go.
    db.execute("grant select on adult to public")
    db.execute("grant select (age, sex) on adult to reporter")
    db.execute("grant insert, update, delete on adult to analyst")
    db.execute("create statistics adult_age_sex (dependencies, mcv) on age, sex from adult")
    db.execute("create index adult_lower_workclass on adult (lower(workclass))")  # has statistics of its own
    db.execute("analyze adult")
    apply_policy(db, demo_policy())

    with connect_as(pg_server, dbname, "reporter") as reporter:
        for statement in [
            "select * from adult",
            "select count(*) from adult",
            "select age from adult",
            "select ctid, xmin from adult",
            "table adult",
            "explain analyze select * from adult",
            "explain select count(*) from adult",
            "select * from adult where id = 1 for update",
        ]:
            error = sql_error(reporter, statement)
            assert error.sqlstate == "42501", (statement, error)
            assert "permission denied for table adult" in str(error), statement
        assert sql_error(reporter, "copy adult to stdout").sqlstate == "42501"
        with pytest.raises(psycopg.errors.InsufficientPrivilege), reporter.transaction():
            reporter.execute("lock table adult in access share mode")
        with pytest.raises(psycopg.errors.InsufficientPrivilege), reporter.transaction():
            reporter.execute("declare c cursor for select * from adult")
        # Catalog browsing still works: BI tools list tables and columns from information_schema.
        columns = [name for (name,) in reporter.execute(
            "select column_name from information_schema.columns where table_schema = 'public' and table_name = 'adult' "
            "order by ordinal_position")]
        assert columns == list(ADULT_COLUMNS)
        assert reporter.execute(
            "select count(*) from information_schema.tables where table_name = 'adult'").fetchone() == (1,)
        # Statistics that hold values stay hidden: pg_stats and pg_stats_ext filter on SELECT.
        assert reporter.execute("select count(*) from pg_stats where tablename in ('adult', 'adult_lower_workclass')"
                                ).fetchone() == (0,)
        assert reporter.execute("select count(*) from pg_stats_ext where tablename = 'adult'").fetchone() == (0,)
        assert sql_error(reporter, "select * from pg_statistic").sqlstate == "42501"
        assert sql_error(reporter, "select * from pg_statistic_ext_data").sqlstate == "42501"
        # REFERENCES cannot be turned into a key probe: no table to hang a foreign key on.
        assert sql_error(reporter, "create table public.probe (id integer references public.adult)").sqlstate == "42501"
        assert sql_error(reporter, "create temp table probe (id integer references public.adult)").sqlstate in {
            "42P16",  # constraints on temporary tables may reference only temporary tables
            "42501",  # no TEMPORARY privilege on the database
        }
        # The policy may be read, not changed.
        assert reporter.execute(
            "select mode, k from anonproxy.role_policies where role_name = 'reporter'").fetchone() == ("suppress", 10)
        for statement in ["select anonproxy.protect_table('adult', 'id')",
                          "select anonproxy.set_role_policy('reporter', 'direct')",
                          "select anonproxy.apply_grants()",
                          "delete from anonproxy.role_policies"]:
            assert sql_error(reporter, statement).sqlstate == "42501", statement

    # The superuser sees the statistics the reporter does not: the checks above test something.
    assert db.execute("select count(distinct tablename) from pg_stats "
                      "where tablename in ('adult', 'adult_lower_workclass')").fetchone() == (2,)
    assert db.execute("select count(*) from pg_stats_ext where tablename = 'adult'").fetchone() == (1,)

    with connect_as(pg_server, dbname, "analyst") as analyst:
        assert sql_error(analyst, "insert into adult (id) values (0)").sqlstate == "42501"
        assert sql_error(analyst, "delete from adult").sqlstate == "42501"
    with connect_as(pg_server, dbname, SERVICE) as service:
        assert service.execute("select count(*) from adult").fetchone() == (ADULT_ROW_COUNT,)
    with connect_as(pg_server, dbname, "dba") as dba:  # direct: PostgreSQL's grants decide
        assert dba.execute("select count(*) from adult").fetchone() == (ADULT_ROW_COUNT,)


def test_psql_describes_a_protected_table_to_a_restricted_role(pg_server: EmbeddedPostgres,
                                                               db: psycopg.Connection[Any], dbname: str) -> None:
    apply_policy(db, demo_policy())
    url = pg_server.conninfo(user="reporter", password="reporter", dbname=dbname)
    described = subprocess.run(["psql", url, "-X", "-c", r"\d public.adult"], capture_output=True, text=True,
                               check=False, timeout=30)
    assert described.returncode == 0, described.stderr
    for column in ADULT_COLUMNS:
        assert f" {column} " in described.stdout
    selected = subprocess.run(["psql", url, "-X", "-c", "select * from adult limit 1"], capture_output=True,
                              text=True, check=False, timeout=30)
    assert "permission denied for table adult" in selected.stderr


def test_linked_tables_and_partitions_are_closed_too(pg_server: EmbeddedPostgres, db: psycopg.Connection[Any],
                                                     dbname: str, people: None) -> None:
    db.execute("grant select on public.stays, public.events_2024, public.people to reporter")
    db.execute("select anonproxy.protect_table('people', 'id')")
    db.execute("select anonproxy.link_table('stays', 'person_id', 'people')")
    db.execute("select anonproxy.protect_table('events', 'person_id')")
    db.execute("select anonproxy.set_role_policy('reporter', 'suppress')")
    with connect_as(pg_server, dbname, "reporter") as reporter:
        for table in ("people", "stays", "events", "events_2024"):
            assert sql_error(reporter, f"select count(*) from {table}").sqlstate == "42501", table
    with connect_as(pg_server, dbname, SERVICE) as service:
        for table, rows in (("people", 2), ("stays", 2), ("events", 1)):
            assert service.execute(f"select count(*) from {table}").fetchone() == (rows,), table


def test_unprotecting_gives_nothing_back(pg_server: EmbeddedPostgres, db: psycopg.Connection[Any], dbname: str,
                                         people: None) -> None:
    db.execute("grant select on public.people to reporter")
    db.execute("select anonproxy.protect_table('people', 'id')")
    db.execute("select anonproxy.set_role_policy('reporter', 'dp')")
    db.execute("select anonproxy.unprotect_table('public.people')")
    db.execute("select anonproxy.drop_role_policy('reporter')")
    with connect_as(pg_server, dbname, "reporter") as reporter:
        assert sql_error(reporter, "select count(*) from people").sqlstate == "42501"


@pytest.mark.parametrize(("setup", "problem"), [
    (f"grant pg_read_all_data to {SCRATCH}", f'role "{SCRATCH}" can read public.adult through role "pg_read_all_data"'),
    (f"grant {SERVICE} to {SCRATCH}", f'role "{SCRATCH}" can read public.adult through role "{SERVICE}"'),
    (f"alter role {SCRATCH} superuser", f'role "{SCRATCH}" is in mode suppress but has the SUPERUSER attribute'),
    (f"alter role {SCRATCH} createrole", f'role "{SCRATCH}" is in mode suppress but has the CREATEROLE attribute'),
    (f"grant pg_read_server_files to {SCRATCH}",
     f'role "{SCRATCH}" is in mode suppress but is a member of pg_read_server_files, which reads data files directly'),
    (f"alter table adult owner to {SCRATCH}", f'role "{SCRATCH}" owns public.adult (as "{SCRATCH}")'),
    (f"grant create on schema public to {SCRATCH}",
     (f'role "{SCRATCH}" may create tables in schema "public", so with REFERENCES on protected tables a foreign key '
     "could reveal which keys exist")),
    (f"create table public.scratch_own (x int); alter table public.scratch_own owner to {SCRATCH}",
     (f'role "{SCRATCH}" owns table public.scratch_own, so with REFERENCES on protected tables a foreign key could '
     "reveal which keys exist")),
    ((f"create view public.ages as select age from adult; create view public.ages2 as select * from public.ages; "
     f"grant select on public.ages2 to {SCRATCH}"),
     f'role "{SCRATCH}" can read view public.ages2, which reads public.adult'),
], ids=["pg_read_all_data", "service role member", "superuser", "createrole", "server files", "owner",
        "create on schema", "owns a table", "view over a view"])  # fmt: skip
def test_a_role_that_could_still_read_cannot_be_restricted(db: psycopg.Connection[Any], scratch: str, setup: str,
                                                           problem: str) -> None:
    apply_policy(db, demo_policy())
    before = load_policy(db)
    db.execute(setup)
    error = sql_error(db, f"select anonproxy.set_role_policy('{scratch}', 'suppress')")
    assert (error.sqlstate, error.diag.message_primary) == ("42501", problem)
    assert error.diag.message_hint
    assert load_policy(db) == before
    assert not db.execute("select * from anonproxy.isolation_problems()").fetchall()  # nobody restricted yet


def test_budgets_of_the_policy_file_reach_the_ledger(db: psycopg.Connection[Any], people: None) -> None:
    apply_policy(db, RICH_POLICY)
    # What the ledger charges against, read with its own functions (sql/0003_ledger.sql).
    budget = db.execute("select epsilon_budget, delta_budget, refresh_period::text, epsilon_per_query, delta_per_query "
                        "from anonproxy.remaining_budget('analyst', 'public.people')").fetchone()
    assert budget == (Decimal("1.25"), Decimal("0.00000001"), "1 day", Decimal("0.25"), Decimal(0))
    assert db.execute("select domain, epsilon, delta, refresh_period::text from anonproxy.shared_budgets").fetchall() \
        == [("public.people", Decimal("3.5"), Decimal("0.000001"), "7 days")]

    apply_policy(db, demo_policy())  # replaces budgets and caps too ...
    assert db.execute("select role_name, domain, epsilon, delta, refresh_period, epsilon_per_query, delta_per_query "
                      "from anonproxy.budgets").fetchall() == [
        ("analyst", "public.adult", Decimal(10), Decimal("0.00001"), None, Decimal("0.5"), Decimal("0.0000001"))]
    assert db.execute("select count(*) from anonproxy.shared_budgets").fetchone() == (0,)
    db.execute("select anonproxy.charge('analyst', 'public.adult', 0.5, 0, 'a query')")
    apply_policy(db, demo_policy())  # ... but never the ledger: what was spent stays spent
    # (the demo budget is zcdp by the default rule: what was spent is rho = 0.5²/2, docs/ledger.md)
    assert db.execute("select accounting, rho_spent from anonproxy.remaining_budget('analyst', 'public.adult')"
                      ).fetchone() == ("zcdp", Decimal("0.125"))


def test_a_published_relation_follows_the_mode_of_its_roles(db: psycopg.Connection[Any], people: None) -> None:
    apply_policy(db, RICH_POLICY)

    def readers() -> list[str]:
        return [role for role in ("reporter", "analyst", "dba", "public")
                if db.execute("select has_table_privilege(%s, 'public.visit_counts', 'SELECT')",
                              (role,)).fetchone() == (True,)]

    assert readers() == ["reporter", "analyst", "dba"]  # dba: pg_read_all_data
    db.execute("select anonproxy.set_role_policy('analyst', 'deny')")
    assert readers() == ["reporter", "dba"]
    db.execute("select anonproxy.set_role_policy('analyst', 'dp')")
    assert readers() == ["reporter", "analyst", "dba"]
    db.execute("select anonproxy.publish_relation('visit_counts', array['analyst'])")  # reporter no longer listed
    assert readers() == ["analyst", "dba"]
    db.execute("select anonproxy.unpublish_relation('public.visit_counts')")
    assert readers() == ["dba"]
    assert load_policy(db).published == {}


def test_a_published_relation_must_not_read_protected_rows(db: psycopg.Connection[Any], people: None) -> None:
    apply_policy(db, demo_policy())
    db.execute("""
        create view public.people_view as select name from public.people;
        create materialized view public.adult_ages as select age from public.adult;
        create table public.adult_parent (id integer);
        alter table public.adult inherit public.adult_parent;
    """)
    for relation, problem in [
        ("people_view", None),  # people is not protected: fine
        ("adult_ages", "published relation public.adult_ages reads protected table public.adult"),
        ("adult_parent", ("published relation public.adult_parent includes the rows of protected table public.adult "
                          "(a partition or inheritance child)")),
    ]:
        if problem is None:
            db.execute(f"select anonproxy.publish_relation('{relation}', array['reporter'])")
            continue
        error = sql_error(db, f"select anonproxy.publish_relation('{relation}', array['reporter'])")
        assert (error.sqlstate, error.diag.message_primary) == ("42501", problem), relation
        assert "create_anonymized_view" in (error.diag.message_hint or "")
    # A view published while harmless, changed afterwards: the next policy change finds it ...
    db.execute("create or replace view public.people_view as select age::text as name from public.adult")
    error = sql_error(db, "select anonproxy.set_role_policy('reporter', 'suppress', 11)")
    assert error.diag.message_primary == "published relation public.people_view reads protected table public.adult"
    # ... and so does protecting what a published view reads.
    db.execute("create or replace view public.people_view as select name from public.people")
    error = sql_error(db, "select anonproxy.protect_table('people', 'id')")
    assert error.diag.message_primary == "published relation public.people_view reads protected table public.people"
    # So does a published relation dropped since; it can be unpublished by its stored name.
    db.execute("select anonproxy.unpublish_relation('public.people_view')")
    db.execute("select anonproxy.publish_relation('visit_counts', array['reporter'])")
    db.execute("drop table public.visit_counts")
    assert db.execute("select problem from anonproxy.isolation_problems()").fetchall() == [
        ("published relation public.visit_counts does not exist",)]
    db.execute("select anonproxy.unpublish_relation('public.visit_counts')")
    db.execute("select anonproxy.apply_grants()")


def test_a_parent_of_a_protected_table_is_closed_too(pg_server: EmbeddedPostgres, db: psycopg.Connection[Any],
                                                     dbname: str) -> None:
    db.execute("create table public.adult_parent (id integer)")
    db.execute("alter table public.adult inherit public.adult_parent")
    db.execute("grant select on public.adult_parent to reporter")
    with connect_as(pg_server, dbname, "reporter") as reporter:  # the channel: a parent shows its children's rows
        assert reporter.execute("select count(*) from public.adult_parent").fetchone() == (ADULT_ROW_COUNT,)
    with pytest.raises(PolicyApplyError) as caught:
        apply_policy(db, demo_policy())
    assert caught.value.sqlstate == "42501"
    assert caught.value.problems[0].endswith(
        'role "reporter" can read public.adult_parent, which includes the rows of public.adult (a partition or '
        "inheritance child) (SQLSTATE 42501)")
    db.execute("revoke select on public.adult_parent from reporter")
    apply_policy(db, demo_policy())


def test_a_problem_arising_later_is_caught_at_the_next_change(db: psycopg.Connection[Any], scratch: str) -> None:
    apply_policy(db, demo_policy())
    db.execute(f"select anonproxy.set_role_policy('{scratch}', 'dp')")
    db.execute(f"grant select on adult to {scratch}")  # behind the policy's back
    assert db.execute("select role_name, problem from anonproxy.isolation_problems()").fetchall() == [
        (scratch, f'role "{scratch}" still holds privileges on public.adult')]
    db.execute("select anonproxy.apply_grants()")  # takes it away again
    assert db.execute("select * from anonproxy.isolation_problems()").fetchall() == []


def test_only_the_owner_of_a_table_may_protect_it(db: psycopg.Connection[Any], scratch: str) -> None:
    db.execute(f"grant execute on all functions in schema anonproxy to {scratch}")
    db.execute(f"grant insert, update, delete on all tables in schema anonproxy to {scratch}")
    db.execute(f"set role {scratch}")
    try:
        error = sql_error(db, "select anonproxy.protect_table('adult', 'id')")
    finally:
        db.execute("reset role")
    assert error.sqlstate == "42501"
    assert error.diag.message_primary == "must be owner of table public.adult to set its privileges"
    assert load_policy(db).tables == {}


def test_a_missing_service_role_is_named(db: psycopg.Connection[Any], scratch: str) -> None:
    db.execute(f"select anonproxy.set_service_role('{scratch}')")
    db.execute(f"drop owned by {scratch}")
    db.execute(f"drop role {scratch}")
    try:
        error = sql_error(db, "select anonproxy.protect_table('adult', 'id')")
        assert (error.sqlstate, error.diag.message_primary) == ("42704", f'service role "{scratch}" does not exist')
        assert "create role" in (error.diag.message_hint or "")
    finally:
        db.execute(f"create role {scratch}")  # for the fixture's teardown


# The command line ------------------------------------------------------------------------


def run_policy_command(*argv: str) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="anonproxy")
    commands.register(parser.add_subparsers(required=True))
    args = parser.parse_args(["policy", *argv])
    return int(args.run(args))


def test_policy_command_applies_and_shows(pg_server: EmbeddedPostgres, db: psycopg.Connection[Any], dbname: str,
                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dsn = pg_server.conninfo(dbname=dbname)
    demo_file = Path(__file__).parents[1] / "anonproxy" / "data" / "demo_policy.yaml"
    assert run_policy_command("apply", str(demo_file), "--dsn", dsn) == 0
    out = capsys.readouterr().out
    assert out == (f"policy version {version(db)} applied: 1 protected table(s), 1 linked table(s), 3 role(s), "
                   "0 published relation(s)\n")
    assert run_policy_command("show", "--dsn", dsn) == 0
    shown = capsys.readouterr().out
    assert ("  analyst:\n    mode: dp\n    budgets:\n      public.adult: {epsilon: 10, delta: 0.00001, "
            "accuracy_epsilon: 0.5, delta_per_query: 0.0000001, accounting: zcdp}\n") in shown
    assert parse_policy(shown) == without_version(load_policy(db))

    bad = tmp_path / "bad.yaml"
    bad.write_text("roles: {reporter: {mode: suppress, k: 1}}\n")
    assert run_policy_command("apply", str(bad), "--dsn", dsn) == 1
    assert capsys.readouterr().err == "anonproxy policy: roles.reporter.k: must be an integer ≥ 2, got 1\n"

    bad.write_text("roles: {reportr: {mode: suppress}}\n")
    assert run_policy_command("apply", str(bad), "--dsn", dsn) == 1
    err = capsys.readouterr().err
    assert err == 'anonproxy policy: roles.reportr: role "reportr" does not exist (SQLSTATE 42704)\n'

    assert run_policy_command("apply", str(tmp_path / "missing.yaml"), "--dsn", dsn) == 1
    assert capsys.readouterr().err == f"anonproxy policy: {tmp_path / 'missing.yaml'}: No such file or directory\n"

    assert run_policy_command("show", "--dsn", f"{dsn} user=nobody_at_all password=x") == 1
    err = capsys.readouterr().err
    assert err.startswith("anonproxy policy: ") and "Traceback" not in err
    assert parse_policy(shown) == without_version(load_policy(db))  # the refused files changed nothing
