"""The final SQL check (anonproxy.plan.final_sql): PostgreSQL's parser reads the generated SQL again.

First half, pure: hand-made SQL shaped like the generators' output, with one
thing in it that the policy does not allow (a relation, a function, an
operator, a cast, a construct), and the SQL the generators actually produce
for many queries, which must pass. Second half: through the real gated proxy,
ordinary suppress and dp queries still work, and a statement that reads a
catalog next to a protected table is refused with 42501 naming the catalog.
Last, the service login: the proxy refuses to start when it is a superuser
or a member of a role that widens what it reads, and stops serving when it
becomes one later.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from conftest import Endpoint, ProxyProcess, start_proxy, stop_proxy

from anonproxy.demo import reset_service_role
from anonproxy.dp.model import DPParams, DPPlan
from anonproxy.dp.plan import plan_dp
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.plan.final_sql import FinalCheckRefusal, check_final_sql, verify
from anonproxy.policy.model import (
    ColumnPolicy,
    LinkedTable,
    Policy,
    ProtectedTable,
    RolePolicy,
    SuppressionParams,
)
from anonproxy.policy.yaml_policy import apply_policy, demo_policy
from anonproxy.proxy.service_role import WIDENING_ROLES
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite

ADULT = ProtectedTable("public.adult", "id")
VISITS = LinkedTable("public.visits", "person_id", "public.adult", "id")
POLICY = Policy(version=1, tables={"public.adult": ADULT}, links={"public.visits": VISITS})

# A shape the suppression rewrite produces: CTEs, a hashed IN over arrays, a universe subquery.
BASE = """WITH anonproxy_cells AS (
  SELECT sex AS g1, "a"."id" AS unit, sum(capital_gain) AS s1 FROM "public"."adult" a GROUP BY 1, 2
)
SELECT sex, count(*) FROM "public"."adult" a {join}
WHERE {where}
GROUP BY sex
HAVING count(DISTINCT "a"."id") BETWEEN 10 AND (SELECT count(DISTINCT "id") FROM "public"."adult") - 10
   AND ARRAY[sex] IN (SELECT ARRAY[g1] FROM anonproxy_cells)"""


def sql(where: str = "a.age > 30", join: str = "") -> str:
    return BASE.format(where=where, join=join)


def refused(text: str, *words: str) -> FinalCheckRefusal:
    with pytest.raises(FinalCheckRefusal) as caught:
        check_final_sql(text, POLICY)
    refusal = caught.value
    assert refusal.reject.sqlstate == "42501", refusal.reject
    assert refusal.reject.hint
    for word in words:
        assert word in refusal.reject.message, refusal.reject.message
        assert word in refusal.name, refusal.name
    return refusal


def test_the_base_shape_passes() -> None:
    check_final_sql(sql(), POLICY)
    check_final_sql(sql(join='JOIN "public"."visits" v ON v.person_id = a.id'), POLICY)
    # The date functions the expression allowlist admits (the demo table has no date column to query them on).
    check_final_sql(sql(where="date_trunc('year', v.at) = DATE '2000-01-01' AND extract(year FROM v.at) > 1990 "
                        "AND pg_catalog.date_part('dow', v.at) = 1 AND v.at > TIMESTAMP '2000-01-01' - "
                        "INTERVAL '1 day'", join='JOIN "public"."visits" v ON v.person_id = a.id'), POLICY)


@pytest.mark.parametrize(("join", "name"), [
    ("JOIN pg_catalog.pg_stats s ON s.tablename = 'adult'", "pg_catalog.pg_stats"),
    ("LEFT JOIN pg_catalog.pg_database d ON a.id = 1146 AND d.oid = 1", "pg_catalog.pg_database"),
    ("LEFT JOIN pg_stat_activity s ON true", "pg_stat_activity"),
    ("RIGHT JOIN information_schema.tables t ON true", "information_schema.tables"),
    ('FULL JOIN "public"."countries" c ON c.name = a.native_country', "public.countries"),
    ('JOIN "public"."adult_view" w ON w.id = a.id', "public.adult_view"),
    ('JOIN other_db.public.adult o ON o.id = a.id', "other_db.public.adult"),
    ("JOIN adult b ON b.id = a.id", "adult"),  # the generators qualify every table: an unqualified name is no CTE
    ("JOIN (SELECT oid FROM pg_catalog.pg_class) c ON true", "pg_catalog.pg_class"),
])  # fmt: skip
def test_relations_outside_the_policy_are_refused(join: str, name: str) -> None:
    refused(sql(join=join), name)


@pytest.mark.parametrize(("where", "name"), [
    ("a.id IN (SELECT oid FROM pg_catalog.pg_authid)", "pg_catalog.pg_authid"),
    ("EXISTS (SELECT FROM pg_catalog.pg_statistic s WHERE s.stadistinct > 0)", "pg_catalog.pg_statistic"),
    ("a.age = (SELECT max(x) FROM public.secrets)", "public.secrets"),
    # The guard's catalogs are allowed only in the top-level CTE anonproxy_guard, not in one a subquery names so.
    ("a.id IN (WITH anonproxy_guard AS (SELECT oid FROM pg_catalog.pg_class) SELECT oid FROM anonproxy_guard)",
     "pg_catalog.pg_class"),
])  # fmt: skip
def test_subqueries_over_other_relations_are_refused(where: str, name: str) -> None:
    refused(sql(where=where), name)


@pytest.mark.parametrize(("where", "name"), [
    ("pg_read_file('/etc/passwd') <> ''", "pg_read_file()"),
    ("pg_catalog.pg_sleep(1) IS NULL", "pg_catalog.pg_sleep()"),
    ("current_setting('anonproxy.secret') = 'x'", "current_setting()"),
    ("dblink('dbname=postgres', 'select 1') IS NULL", "dblink()"),
    ("set_config('role', 'dba', false) = 'dba'", "set_config()"),
    ("public.lower(a.sex) = 'male'", "public.lower()"),  # allowed names, in pg_catalog only
    ("pg_catalog.lower(a.sex) = 'male' AND has_table_privilege('public.adult', 'select')", "has_table_privilege()"),
    ("query_to_xml('select 1', true, true, '') IS NULL", "query_to_xml()"),
    ("lower(VARIADIC ARRAY['a']) = 'a'", "lower()"),
])  # fmt: skip
def test_functions_off_the_allowlist_are_refused(where: str, name: str) -> None:
    refused(sql(where=where), name)


@pytest.mark.parametrize(("where", "name"), [
    ("a.sex || 'x' = 'Malex'", "operator ||"),
    ("a.sex ~ '^M'", "operator ~"),
    ("a.age ^ 2 = 1", "operator ^"),
    ("a.age OPERATOR(public.=) 30", "operator public.="),
    ("ARRAY[a.age] @> ARRAY[30]", "operator @>"),
    ("a.age = ANY(ARRAY[30, 31])", "OP_ANY"),
    ("a.sex SIMILAR TO 'M%'", "SIMILAR"),
    ("a.sex::regclass IS NOT NULL", "type regclass"),  # outside the guard CTE
    ("a.age::public.secret_type IS NOT NULL", "type public.secret_type"),
    ("a.sex::xml IS NOT NULL", "type xml"),
])  # fmt: skip
def test_operators_and_casts_off_the_allowlist_are_refused(where: str, name: str) -> None:
    refused(sql(where=where), name)


@pytest.mark.parametrize(("text", "name"), [
    ('SELECT count(*) INTO TEMP t FROM "public"."adult"', "IntoClause"),
    ('SELECT count(*) FROM "public"."adult" FOR UPDATE', "LockingClause"),
    ('SELECT count(*) FROM "public"."adult" TABLESAMPLE SYSTEM (1)', "RangeTableSample"),
    ("SELECT count(*) FROM XMLTABLE('/a' PASSING '<a/>' COLUMNS x int)", "RangeTableFunc"),
    ('SELECT count(*) FROM "public"."adult" a, LATERAL (SELECT a.id) l', "LATERAL"),
    ('WITH RECURSIVE r AS (SELECT 1) SELECT count(*) FROM "public"."adult"', "WITH RECURSIVE"),
    ('SELECT count(*) FROM "public"."adult" a WHERE a.sex COLLATE "C" = \'Male\'', "CollateClause"),
    ('SELECT current_user, count(*) FROM "public"."adult"', "SQLValueFunction"),
    ('DELETE FROM "public"."adult"', "(not one SELECT)"),
    ('SELECT 1; SELECT count(*) FROM "public"."adult"', "(not one SELECT)"),
    ('SELECT count(* FROM "public"."adult"', "(unparseable)"),
])  # fmt: skip
def test_constructs_off_the_allowlist_are_refused(text: str, name: str) -> None:
    refusal = refused(text)
    assert name in refusal.name, refusal.name


def test_sql_too_deep_to_walk_is_refused_not_crashed() -> None:
    deep = "coalesce(" * 3000 + "a.age" + ")" * 3000 + " > 30"
    refusal = refused(sql(where=deep))
    assert refusal.name == "(too deep)", refusal.name


@pytest.mark.parametrize("depth", [1200, 2000])
def test_a_parse_tree_too_deep_to_read_is_refused_not_crashed(depth: int) -> None:
    """The JSON reader stops at 1024 levels of nesting: a refusal too, never an internal error."""
    deep = "(a.age + " * depth + "1" + ")" * depth + " > 30"
    refusal = refused(sql(where=deep))
    assert refusal.name in ("(too deep)", "(unparseable)"), refusal.name


def test_the_guard_cte_may_read_its_catalogs_and_nothing_else() -> None:
    guard = ("WITH anonproxy_guard AS (SELECT count(DISTINCT i.indrelid) = 1 AS single FROM pg_catalog.pg_index AS i "
             "JOIN pg_catalog.pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] "
             "JOIN pg_catalog.pg_class AS c ON c.oid = i.indrelid {extra}"
             "WHERE (i.indrelid, a.attname) IN (('\"public\".\"adult\"'::regclass::oid, 'id'::name))) "
             'SELECT count(*) FROM "public"."adult" HAVING (SELECT single FROM anonproxy_guard)')
    check_final_sql(guard.format(extra=""), POLICY)
    refused(guard.format(extra="JOIN pg_catalog.pg_authid AS r ON true "), "pg_catalog.pg_authid")


def test_a_refusal_is_logged_with_the_role_and_the_name(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="anonproxy.final_sql"), pytest.raises(FinalCheckRefusal):
        verify(sql(where="pg_sleep(1) IS NULL"), POLICY, "reporter")
    lines = [record for record in caplog.records if record.name == "anonproxy.final_sql"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "reporter" in lines[0].getMessage() and "pg_sleep()" in lines[0].getMessage()


# --- what the generators produce passes --------------------------------------------------------------------

SUPPRESS_QUERIES = [
    "SELECT sex, count(*) FROM adult GROUP BY sex",
    "SELECT count(*), sum(capital_gain), avg(age) FROM adult WHERE age BETWEEN 20 AND 30",
    "SELECT lower(sex), count(*) FROM adult GROUP BY 1",
    "SELECT width_bucket(age, 0, 100, 10) AS band, count(*) FROM adult GROUP BY 1 HAVING count(*) > 20 "
    "ORDER BY 2 DESC LIMIT 5",
    "SELECT CASE WHEN age < 30 THEN 'young' ELSE 'old' END AS band, count(DISTINCT id) FROM adult "
    "WHERE sex ILIKE 'm%' AND native_country IS NOT NULL AND coalesce(workclass, '?') <> '?' GROUP BY 1",
    "SELECT upper(v.kind), count(*) FROM adult a JOIN visits v ON v.person_id = a.id "
    "WHERE a.age::text NOT LIKE '1%' AND nullif(a.sex, '') IN ('Male', 'Female') GROUP BY 1",
    "SELECT sex, count(*) FROM adult WHERE age > $1 AND hours_per_week >= -5 GROUP BY sex",
    "SELECT DISTINCT native_country FROM adult ORDER BY 1",
]
ROLES = [
    RolePolicy("reporter", "suppress", SuppressionParams(k=10)),
    RolePolicy("reporter", "suppress", SuppressionParams(k=10, dominance_n=2, dominance_percent=85, p_percent=10,
                                                         suppressed_rest=True)),
]


@pytest.mark.parametrize("role", ROLES, ids=["simple", "cells"])
@pytest.mark.parametrize("query", SUPPRESS_QUERIES)
def test_suppression_rewrites_pass(query: str, role: RolePolicy) -> None:
    decision = decide(query, role, POLICY)
    assert isinstance(decision, Rewrite), decision  # decide() ran the final check on it


BOUNDED = Policy(version=1, tables={"public.adult": ProtectedTable("public.adult", "id", columns={
    "age": ColumnPolicy("age", lower=0, upper=100), "sex": ColumnPolicy("sex", domain=("Female", "Male"))})},
    links={"public.visits": VISITS})
DP_QUERIES = [
    "SELECT sex, count(*), avg(age), sum(age) FROM adult GROUP BY sex",
    "SELECT education, count(*) FROM adult WHERE lower(sex) = 'male' GROUP BY 1 HAVING count(*) > 5",
    "SELECT median(age), percentile_disc(0.9) WITHIN GROUP (ORDER BY age), stddev(age) FROM adult",
    "SELECT sex FROM adult GROUP BY sex",
    "SELECT count(*) FROM adult a JOIN visits v ON v.person_id = a.id WHERE a.age > 40",
]


@pytest.mark.parametrize("caps", [(1, 1), (3, 2)])
@pytest.mark.parametrize("query", DP_QUERIES)
def test_dp_plans_pass(query: str, caps: tuple[int, int]) -> None:
    plan = plan_dp(query, RolePolicy("analyst", "dp"), BOUNDED, DPParams(0.5, 1e-6, *caps))
    assert isinstance(plan, DPPlan), plan
    check_final_sql(plan.sql, BOUNDED)


# --- through the real proxy ---------------------------------------------------------------------------------


def test_ordinary_queries_pass_and_a_catalog_join_is_refused(gated_proxy: Endpoint, gated_database: str) -> None:
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
        rows = conn.execute("select sex, count(*) from adult group by sex order by 1").fetchall()
        assert [row[0] for row in rows] == ["Female", "Male"]
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as caught:
            conn.execute("select a.sex, sum(case when d.oid is not null then a.capital_gain else 10 end) "
                         "from adult a left join pg_catalog.pg_database d on a.id = 1146 and d.oid = 1 "
                         "group by a.sex")
        assert "pg_catalog.pg_database" in (caught.value.diag.message_primary or "")
        assert caught.value.diag.message_hint
        assert conn.execute("select count(*) from adult where age > 30").fetchone()[0] > 0  # the session goes on
    with psycopg.connect(gated_proxy.dsn(gated_database, user="analyst"), autocommit=True) as conn:
        # A dp plan that lists a declared public domain: checked like any other, and free (no budget is spent).
        rows = conn.execute("select sex from adult group by sex").fetchall()
        assert sorted(row[0] for row in rows) == ["Female", "Male"]


# --- the service login has no powers beyond its grants ------------------------------------------------------


@pytest.fixture
def service_role(postgresql: psycopg.Connection, dbname: str) -> Iterator[str]:
    """A fresh service login (password = name) for the demo policy on this test's database."""
    role = f"svc_{next(_roles)}_{os.getpid()}"
    postgresql.execute(f"create role {role} login password '{role}'")
    apply_policy(postgresql, replace(demo_policy(), service_role=role))
    postgresql.commit()
    yield role
    postgresql.rollback()
    postgresql.execute(f"drop owned by {role}")
    postgresql.execute("drop role if exists widening_group")
    postgresql.execute(f"drop role {role}")
    postgresql.commit()


_roles = itertools.count(1)


def start_gated(pg_server: EmbeddedPostgres, dbname: str, role: str, log: Path) -> ProxyProcess:
    return start_proxy(f"host={pg_server.host} port={pg_server.port}", log,
                       service_dsn=f"user={role} password={role} dbname={dbname}")


def test_reset_service_role_revokes_widening_memberships(postgresql: psycopg.Connection, service_role: str) -> None:
    postgresql.execute(f"grant pg_monitor, pg_read_all_stats, pg_read_server_files to {service_role}")
    reset_service_role(postgresql, service_role)
    members = postgresql.execute("select w.rolname from pg_roles w where w.rolname = any(%s) "
                                 "and pg_has_role(%s, w.oid, 'MEMBER')", [list(WIDENING_ROLES), service_role])
    assert members.fetchall() == []


@pytest.mark.parametrize(("grant", "reason"), [
    ("alter role {role} superuser", "is a superuser"),
    ("grant pg_read_all_stats to {role}", "is a member of pg_read_all_stats"),
    ("grant pg_monitor to {role}", "pg_monitor"),
    # through a group of the DBA's own: pg_has_role follows the chain
    ("create role widening_group; grant pg_read_all_data to widening_group; grant widening_group to {role}",
     "is a member of pg_read_all_data"),
])  # fmt: skip
def test_the_proxy_refuses_to_start_with_a_widened_service_login(
        postgresql: psycopg.Connection, pg_server: EmbeddedPostgres, dbname: str, service_role: str, grant: str,
        reason: str, tmp_path: Path) -> None:
    for statement in grant.format(role=service_role).split(";"):
        postgresql.execute(statement)
    postgresql.commit()
    with pytest.raises(RuntimeError, match="did not start"):
        start_gated(pg_server, dbname, service_role, tmp_path / "proxy.log")
    log = (tmp_path / "proxy.log").read_text()
    assert reason in log and "refusing to start" in log and service_role in log, log
    assert "Traceback" not in log, log


def test_a_login_widened_later_closes_the_proxy_until_it_is_fixed(
        postgresql: psycopg.Connection, pg_server: EmbeddedPostgres, dbname: str, service_role: str,
        tmp_path: Path) -> None:
    proxy = start_gated(pg_server, dbname, service_role, tmp_path / "proxy.log")
    dsn = proxy.endpoint.dsn(dbname, user="reporter")

    def reload_policy() -> None:  # any policy change notifies the proxy, which reloads at once
        postgresql.execute("select anonproxy.set_role_policy('reporter', 'suppress', 10)")
        postgresql.commit()

    def wait_until(refused: bool) -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                psycopg.connect(dsn, connect_timeout=5).close()
                outcome = False
            except psycopg.OperationalError as exc:
                assert "has not loaded its privacy policy" in str(exc), exc
                outcome = True
            if outcome == refused:
                return
            assert time.monotonic() < deadline, proxy.log()
            time.sleep(0.2)

    try:
        wait_until(refused=False)
        postgresql.execute(f"grant pg_read_all_stats to {service_role}")
        reload_policy()
        wait_until(refused=True)
        # logged once by each worker that noticed (the proxy runs one per core), not once per retry
        noticed = [line.split("[", 1)[1].split("]", 1)[0] for line in proxy.log().splitlines()
                   if "is a member of pg_read_all_stats" in line]
        assert noticed and len(noticed) == len(set(noticed)), proxy.log()
        postgresql.execute(f"revoke pg_read_all_stats from {service_role}")
        reload_policy()
        wait_until(refused=False)
    finally:
        stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()
