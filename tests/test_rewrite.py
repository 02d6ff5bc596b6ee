"""decide(): the fail-closed statement gate and the suppression rewrite.

The first half is pure: decide() on statement text, with a policy built here
(public.adult protected, unit id; public.visits linked through person_id). The
second half runs the rewritten SQL on a real PostgreSQL as superuser and checks
every answer against one computed independently (Python over the Adult rows as
shipped, or plain SQL without suppression).
"""

from __future__ import annotations

import re
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from decimal import Decimal

import psycopg
import pytest
from psycopg import pq
from suppression_oracle import Magnitudes, suppress

from anonproxy import sample_data
from anonproxy.dp.model import DPParams
from anonproxy.dp.plan import plan_dp
from anonproxy.plan.refusals import Reject
from anonproxy.policy.model import (
    LinkedTable,
    Policy,
    ProtectedTable,
    RolePolicy,
    SuppressionParams,
)
from anonproxy.route.decide import decide
from anonproxy.route.decision import Control, Deallocate, Intercept, Noisy, Pass, Rewrite, TransactionControl

ADULT = ProtectedTable("public.adult", "id")
VISITS = LinkedTable("public.visits", "person_id", "public.adult", "id")
POLICY = Policy(version=1, tables={"public.adult": ADULT}, links={"public.visits": VISITS})
SUPPRESS = RolePolicy("analyst", "suppress", SuppressionParams(k=10))
DP = RolePolicy("researcher", "dp")


def suppress_role(**params: object) -> RolePolicy:
    return RolePolicy("analyst", "suppress", SuppressionParams(**params))  # type: ignore[arg-type]


def rewritten(sql: str, role: RolePolicy = SUPPRESS, policy: Policy = POLICY) -> str:
    decision = decide(sql, role, policy)
    assert isinstance(decision, Rewrite), decision
    return decision.sql


def assert_reject(sql: str, sqlstate: str, *words: str, role: RolePolicy = SUPPRESS,
                  policy: Policy = POLICY) -> Reject:
    decision = decide(sql, role, policy)
    assert isinstance(decision, Reject), f"{sql!r} -> {decision}"
    assert decision.sqlstate == sqlstate, decision
    for word in words:
        assert word.lower() in decision.message.lower(), decision
    assert decision.hint, decision
    return decision


# --- Pass --------------------------------------------------------------------------

CATALOG_QUERIES = [
    "SELECT 1",
    "select version()",
    "",
    "  ;  ; ",
    "-- a comment only",
    ("SELECT n.nspname, c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.relkind IN ('r', 'v', 'm') AND n.nspname !~ '^pg_' ORDER BY 1, 2"),
    "SELECT table_schema, table_name FROM information_schema.tables WHERE table_schema = 'public'",
    "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'adult' ORDER BY ordinal_position",
    ("SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
    "WHERE a.attrelid = 'public.adult'::regclass AND a.attnum > 0 AND NOT a.attisdropped"),
    "SELECT t.oid, t.typname FROM pg_type t WHERE t.typname = ANY($1)",
    "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 3) SELECT * FROM r",
    "VALUES (1, 'a'), (2, 'b')",
    "SELECT current_setting('server_version_num'), current_schema(), now()::date",
    # pg_stats is a view: PostgreSQL only shows statistics of columns the role may SELECT, and anonymized roles
    # hold no SELECT on protected tables, so this returns no rows for them (tested against the database below).
    "SELECT attname, most_common_vals FROM pg_stats WHERE tablename = 'adult'",
    "select * from ad/**/ult",  # PostgreSQL reads this as table "ad" with alias "ult" (checked below)
    'select * from "Adult"',  # a quoted name keeps its case: another table
    'select * from "public"."Adult"',
    "select * from other_schema.adult",  # qualified names compare exactly
    "SELECT $$ select * from adult $$",  # text in a dollar quote, not a query
    "SELECT 'select * from adult; '",
    "SELECT E'\\' ; select * from adult; -- '",  # one E'' string
    "SELECT 1 # 2",  # an operator (xor) for PostgreSQL and sqlglot alike, not a comment
    "SELECT set_config('application_name', 'x', false)",
    "EXPLAIN SELECT * FROM pg_class",
    "EXPLAIN (VERBOSE, COSTS OFF) SELECT 1",
    "BEGIN; SELECT 1; COMMIT",
]

COMMANDS = [
    "SET search_path = hr, public",  # harmless: see test_search_path_cannot_hide_a_protected_table
    "SET SESSION search_path TO DEFAULT",
    "SET SCHEMA 'public'",
    "SET LOCAL statement_timeout = '5s'",
    "SET TIME ZONE 'UTC'",
    "SET extra_float_digits = 3",
    "SET application_name = 'Metabase'",
    "SET client_encoding = 'UTF8'",
    "SET NAMES 'utf8'",
    "SET standard_conforming_strings = on",
    "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED",
    "SET TRANSACTION READ ONLY",
    "RESET statement_timeout",
    "RESET ALL",
    "SHOW TRANSACTION ISOLATION LEVEL",
    "SHOW search_path",
    "SHOW ALL",
    "BEGIN",
    "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY",
    "START TRANSACTION READ ONLY",
    "COMMIT",
    "COMMIT AND NO CHAIN",
    "END",
    "ROLLBACK",
    "ABORT",
    "SAVEPOINT s1",
    "RELEASE SAVEPOINT s1",
    "RELEASE s1",
    "ROLLBACK TO SAVEPOINT s1",
    'rollback work to "S2"',
    "DISCARD ALL",
    "DEALLOCATE ALL",
    "DEALLOCATE PREPARE \"S_1\"",
    "deallocate S_2",
    "LISTEN channel",
    "UNLISTEN *",
]
# What a DEALLOCATE names, for the proxy to forget too: a quoted name as written, a bare one folded.
DEALLOCATED = {"DEALLOCATE ALL": Deallocate(None), "DEALLOCATE PREPARE \"S_1\"": Deallocate("S_1"),
               "deallocate S_2": Deallocate("s_2")}
# The transaction statements that end portals (the proxy's kept ones follow), with the savepoint each names.
_END = TransactionControl(Control.END)
TRANSACTIONS = {"COMMIT": _END, "COMMIT AND NO CHAIN": _END, "END": _END, "ROLLBACK": _END, "ABORT": _END,
                "SAVEPOINT s1": TransactionControl(Control.SAVEPOINT, "s1"),
                "RELEASE SAVEPOINT s1": TransactionControl(Control.RELEASE, "s1"),
                "RELEASE s1": TransactionControl(Control.RELEASE, "s1"),
                "ROLLBACK TO SAVEPOINT s1": TransactionControl(Control.ROLLBACK_TO, "s1"),
                'rollback work to "S2"': TransactionControl(Control.ROLLBACK_TO, "S2"),
                "BEGIN; SELECT 1; COMMIT": _END}  # several statements, transaction statements among them: all end


def passed(sql: str) -> Pass:
    return Pass(resets_session=sql in ("RESET ALL", "DISCARD ALL"), deallocates=DEALLOCATED.get(sql),
                transaction=TRANSACTIONS.get(sql))


@pytest.mark.parametrize("sql", CATALOG_QUERIES + COMMANDS)
def test_pass(sql: str) -> None:
    assert decide(sql, SUPPRESS, POLICY) == passed(sql)


@pytest.mark.parametrize("sql", CATALOG_QUERIES + COMMANDS)
def test_pass_in_dp_mode(sql: str) -> None:
    assert decide(sql, DP, POLICY) == passed(sql)


def test_direct_roles_always_pass() -> None:
    assert decide("select * from adult", RolePolicy("dba"), POLICY) == Pass()


# --- Intercept -------------------------------------------------------------------------


@pytest.mark.parametrize(("sql", "setting"), [
    ("SHOW anonproxy.k", "k"),
    ("show ANONPROXY.MODE", "mode"),
    ('SHOW "anonproxy.k";', "k"),
    ("  SHOW anonproxy.suppressed_rest ; ", "suppressed_rest"),
])
def test_intercept(sql: str, setting: str) -> None:
    assert decide(sql, SUPPRESS, POLICY) == Intercept(setting)


def test_intercept_only_alone() -> None:
    assert_reject("SHOW anonproxy.k; SELECT 1", "0A000", "on its own")


# --- Reject: statement kinds ---------------------------------------------------------------

REFUSED_STATEMENTS = [
    ("COPY adult TO STDOUT", "42501", "COPY"),
    ("COPY (SELECT * FROM adult) TO STDOUT", "42501", "COPY"),
    ("copy pg_class to stdout", "42501", "COPY"),
    ("DECLARE c CURSOR FOR SELECT * FROM adult", "42501", "SELECT *"),  # the query's own refusal
    ("EXPLAIN ANALYZE SELECT count(*) FROM adult", "42501", "EXPLAIN ANALYZE"),
    ("EXPLAIN ANALYZE SELECT 1", "42501", "EXPLAIN ANALYZE"),
    ("EXPLAIN (ANALYZE, BUFFERS) SELECT 1", "42501", "EXPLAIN ANALYZE"),
    ("EXPLAIN (analyse true) SELECT 1", "42501", "EXPLAIN ANALYZE"),
    ("EXPLAIN SELECT count(*) FROM adult WHERE age > 30", "42501", "EXPLAIN of a query over protected"),
    ("EXPLAIN DELETE FROM adult", "42501", "DELETE"),
    ("PREPARE p AS SELECT * FROM adult", "42501", "PREPARE"),
    ("PREPARE p AS SELECT 1", "42501", "PREPARE"),
    ("EXECUTE p", "42501", "EXECUTE"),
    ("DO $$ BEGIN PERFORM * FROM adult; END $$", "42501", "DO"),
    ("CALL p()", "42501", "CALL"),
    ("CREATE TEMP VIEW v AS SELECT * FROM adult", "42501", "CREATE TEMP VIEW"),
    ("CREATE TEMPORARY TABLE t AS SELECT * FROM adult", "42501", "CREATE TEMPORARY TABLE"),
    ("CREATE TABLE t (x int)", "42501", "CREATE TABLE"),
    ("CREATE FUNCTION f() RETURNS int LANGUAGE sql AS 'select 1'", "42501", "CREATE FUNCTION"),
    ("ALTER TABLE adult ADD COLUMN x int", "42501", "ALTER TABLE"),
    ("DROP TABLE adult", "42501", "DROP TABLE"),
    ("INSERT INTO t VALUES (1)", "42501", "INSERT"),
    ("UPDATE adult SET age = 1", "42501", "UPDATE"),
    ("DELETE FROM adult", "42501", "DELETE"),
    ("TRUNCATE adult", "42501", "TRUNCATE"),
    ("GRANT SELECT ON adult TO analyst", "42501", "GRANT"),
    ("VACUUM adult", "42501", "VACUUM"),
    ("ANALYZE adult", "42501", "ANALYZE"),
    ("LOCK TABLE adult", "42501", "LOCK"),
    ("NOTIFY channel", "42501", "NOTIFY"),
    ("COMMIT PREPARED 'x'", "42501", "two-phase"),
    ("PREPARE TRANSACTION 'x'", "42501", "PREPARE"),
    ("SELECT * INTO t FROM pg_class", "42501", "SELECT INTO"),
    # over a protected table: named SELECT INTO, not "relation t is not part of the privacy policy"
    ("SELECT sex, count(*) INTO TEMP t FROM adult GROUP BY 1", "42501", "SELECT INTO"),
    ("SELECT count(*) INTO public.adult_copy FROM adult", "42501", "SELECT INTO"),
    ("WITH d AS (DELETE FROM t RETURNING *) SELECT * FROM d", "42501", "DELETE"),
    ("WITH d AS (SELECT 1) DELETE FROM t", "42501", "DELETE"),
    ("SELECT * FROM pg_class FOR UPDATE", "42501", "FOR UPDATE"),
]


@pytest.mark.parametrize(("sql", "sqlstate", "word"), REFUSED_STATEMENTS)
def test_refused_statements(sql: str, sqlstate: str, word: str) -> None:
    assert_reject(sql, sqlstate, word)


@pytest.mark.parametrize("sql", [
    "SET ROLE postgres",
    "set role = 'postgres'",
    "SET LOCAL ROLE postgres",
    "SET SESSION ROLE postgres",
    'SET "role" TO postgres',
    "RESET ROLE",
    "SET SESSION AUTHORIZATION postgres",
    "SET SESSION AUTHORIZATION DEFAULT",
    "SET LOCAL SESSION AUTHORIZATION postgres",
    "RESET SESSION AUTHORIZATION",
    "SET session_authorization = 'postgres'",
    "SELECT set_config('role', 'postgres', false)",
    "SELECT set_config('ROLE', 'postgres', false)",
    "select pg_catalog.set_config('session_authorization', 'postgres', false)",
    "SELECT set_config(name, 'x', false) FROM pg_settings",
])
def test_identity_changes_refused(sql: str) -> None:
    assert_reject(sql, "42501")


@pytest.mark.parametrize(("sql", "word"), [
    ("SET anonproxy.k = 1", "anonproxy.k"),
    ("RESET anonproxy.k", "anonproxy.k"),
    ("SELECT set_config('anonproxy.k', '1', false)", "set_config"),
])
def test_policy_settings_are_read_only(sql: str, word: str) -> None:
    assert_reject(sql, "42501", word)


@pytest.mark.parametrize("sql", [
    "SET client_encoding = 'SJIS'",  # multi-byte encodings whose bytes contain \ or ' change how text splits
    "SET NAMES 'LATIN1'",
    "SET standard_conforming_strings = off",  # would make '\' an escape in '...' strings
])
def test_lexing_settings_refused(sql: str) -> None:
    assert_reject(sql, "0A000")


@pytest.mark.parametrize("sql", [
    "SELECT query_to_xml('select * from adult', true, false, '')",
    "SELECT table_to_xml('adult', true, false, '')",
    "SELECT * FROM dblink('dbname=x', 'select * from adult') AS t(x int)",
    "SELECT ts_stat('select to_tsvector(native_country) from adult')",
])
def test_functions_that_run_sql_text_refused(sql: str) -> None:
    assert_reject(sql, "42501", "runs SQL")


@pytest.mark.parametrize("role", [SUPPRESS, DP])
def test_a_schema_qualified_function_is_named_as_a_function(role: RolePolicy) -> None:
    decision = decide("select anonproxy.zcdp_rho_max(10, 1e-5), count(*) from adult", role, POLICY)
    if isinstance(decision, Noisy):  # dp: the planner decides
        decision = plan_dp(decision.sql, role, POLICY, DPParams(epsilon=1.0, delta=1e-6))
    assert isinstance(decision, Reject) and "function anonproxy.zcdp_rho_max()" in decision.message, decision
    where = decide("select sex, count(*) from adult where public.f(age) > 1 group by sex", role, POLICY)
    if isinstance(where, Noisy):
        where = plan_dp(where.sql, role, POLICY, DPParams(epsilon=1.0, delta=1e-6))
    assert isinstance(where, Reject) and "function public.f()" in where.message, where


def test_extended_statistics_refused() -> None:
    assert_reject("SELECT * FROM pg_stats_ext", "42501", "statistics")
    assert_reject("SELECT * FROM pg_catalog.pg_statistic", "42501", "statistics")


def test_dp_mode_hands_protected_queries_to_differential_privacy() -> None:
    """The DP planner (anonproxy.dp.plan) then decides what it supports."""
    assert decide("SELECT count(*) FROM adult", DP, POLICY) == Noisy("SELECT count(*) FROM adult")
    assert decide("/* c */ SELECT * FROM adult;", DP, POLICY) == Noisy("SELECT * FROM adult")


def test_deny_mode_refused() -> None:
    assert_reject("SELECT 1", "42501", "deny", role=RolePolicy("x", "deny"))


def test_mixed_messages_refused() -> None:
    assert_reject("SELECT 1; SELECT count(*) FROM adult", "0A000", "on its own")
    assert_reject("BEGIN; SELECT sex, count(*) FROM adult GROUP BY 1; COMMIT", "0A000")
    assert_reject("SELECT count(*) FROM adult; SELECT count(*) FROM adult", "0A000")
    # Any refused statement refuses the whole message, wherever it is.
    assert_reject("SELECT 1; SELECT * FROM adult", "42501", "SELECT *")
    assert_reject("SELECT 1; COPY adult TO STDOUT", "42501", "COPY")


# --- Reject: reading protected rows -------------------------------------------------------

ROW_LEVEL = [
    ("SELECT * FROM adult", "42501", "SELECT *"),
    ("TABLE adult", "42501", "SELECT *"),
    ("SELECT a.* FROM adult a", "42501", "row-level"),
    ("SELECT age FROM adult", "42501", "row-level"),
    ("SELECT 1 FROM adult", "42501", "must aggregate"),
    ("SELECT age, count(*) FROM adult", "42501", "row-level"),
    ("SELECT a FROM adult a GROUP BY a", "42501", "whole row"),
    ("SELECT count(DISTINCT adult) FROM adult", "42501", "whole row"),
    ("SELECT generate_series(1, age) FROM adult", "0A000", "set-returning"),
    ("SELECT count(*) FROM adult, generate_series(1, 3)", "0A000", "functions"),
    ("SELECT count(*) FROM adult, pg_class", "42501", "pg_catalog.pg_class"),
    ("SELECT count(*) FROM adult a, visits v", "0A000", "comma"),
    ("SELECT count(*) FROM adult a JOIN generate_series(1, 3) g ON true", "0A000", "functions"),
    ("SELECT unnest(ARRAY[age]) FROM adult", "0A000", "set-returning"),
    ("WITH x AS (SELECT * FROM adult LIMIT 5) SELECT count(*) FROM x", "0A000", "LIMIT inside a derived table"),
    ("WITH adult AS (SELECT 1 AS x) SELECT x FROM adult", "0A000", "WITH"),
    ("SELECT count(*) FROM (SELECT * FROM adult ORDER BY age) s", "0A000", "ORDER BY inside a derived table"),
    ("SELECT (SELECT age FROM adult LIMIT 1)", "0A000", "subqueries"),
    ("SELECT 1 WHERE EXISTS (SELECT 1 FROM adult WHERE id = 17 AND income = '>50K')", "0A000", "needs a FROM clause"),
    # (without the column types, a bare name in a semi-join subquery may be the outer table's: refused)
    ("SELECT count(*) FROM adult WHERE id IN (SELECT id FROM adult WHERE age > 90)", "0A000",
     "in a semi-join subquery must be a column of its table"),
    ("SELECT count(*) FROM adult a, LATERAL (SELECT a.age) x", "0A000", "LATERAL"),
    ("SELECT count(*) FROM adult a CROSS JOIN LATERAL (SELECT a.age) x", "0A000", "LATERAL"),
    ("SELECT age, count(*) OVER () FROM adult", "42501", "row-level"),  # a row per person, each with the total
    ("SELECT sex, row_number() OVER (ORDER BY age) FROM adult GROUP BY sex", "0A000", "window"),
    ("SELECT ctid, count(*) FROM adult GROUP BY 1", "42501", "system column ctid"),
    ("SELECT count(*) FROM adult WHERE xmin::text = '1'", "42501", "system column xmin"),
    ('SELECT count(*) FROM adult a GROUP BY a."tableoid"', "42501", "system column tableoid"),
    ("SELECT count(*) FROM adult TABLESAMPLE SYSTEM (1)", "42501", "TABLESAMPLE"),
    ("SELECT count(*) FROM adult UNION SELECT age FROM adult", "0A000", "UNION"),  # a branch reading rows
    ("SELECT DISTINCT ON (sex) sex, age FROM adult", "0A000", "DISTINCT ON"),
    ("SELECT string_agg(native_country, ',') FROM adult", "0A000", "group_concat"),
    ("SELECT array_agg(age) FROM adult", "0A000", "array_agg"),
    ("SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY age) FROM adult", "0A000", "ordered-set"),
    ("SELECT sex, count(*) FROM adult GROUP BY ROLLUP (sex)", "0A000", "ROLLUP"),
    ("SELECT min(age) FROM adult", "42501", "min()"),
    ("SELECT max(capital_gain) FROM adult GROUP BY sex", "42501", "max()"),
    ("SELECT sex, count(*) FROM adult GROUP BY sex HAVING max(age) > 80", "42501", "max()"),
    ("SELECT count(*) FROM adult a JOIN adult b ON a.id = b.id", "0A000", "one protected table"),
    # the unit table on the nullable side is joined on the link only (tests/test_nesting_shapes.py answers that)
    ("SELECT count(*) FROM visits v LEFT JOIN adult a ON v.cost = a.age", "0A000", "declared key"),
    ("SELECT count(*) FROM adult a LEFT JOIN visits v ON v.person_id = a.id AND a.id = 17", "42501", "JOIN condition"),
    ("SELECT count(*) FROM adult a JOIN visits v ON v.person_id = a.age", "42501", "identifying column person_id"),
    ("SELECT count(*) FROM adult a JOIN visits v ON v.cost = a.age", "0A000", "declared key"),
    ("SELECT count(*) FROM adult a JOIN visits v USING (id)", "0A000", "USING"),
    ("SELECT count(*) FROM adult NATURAL JOIN visits", "0A000", "NATURAL"),
    ("SELECT count(*) FROM adult a RIGHT JOIN countries c ON c.name = a.native_country", "42501", "public.countries"),
    ("SELECT count(*) FROM adult a RIGHT JOIN visits v ON v.person_id = a.id", "0A000", "RIGHT"),
    ("SELECT count(*) FROM ONLY adult", "0A000", "ONLY"),
]


@pytest.mark.parametrize(("sql", "sqlstate", "word"), ROW_LEVEL)
def test_row_level_access_refused(sql: str, sqlstate: str, word: str) -> None:
    assert_reject(sql, sqlstate, word)


# Error side channels: an expression that fails for some rows answers a yes/no question about them.
SIDE_CHANNELS = [
    (("SELECT count(*), sum(CASE WHEN age = 90 AND native_country = 'Philippines' AND income = '>50K' THEN 1/0 END) "
     "FROM adult"), "division"),
    (("SELECT sex, count(*) FROM adult WHERE CASE WHEN id = 17 AND income = '>50K' THEN 1/0 ELSE 1 END = 1 "
     "GROUP BY sex"), "division"),
    ("SELECT sex, count(*) FROM adult GROUP BY sex HAVING sum(CASE WHEN age = 90 THEN 1 % 0 END) > 0", "modulo"),
    ("SELECT count(*) FROM adult WHERE age * 100000000 > 1", "arithmetic"),
    ("SELECT sum(capital_gain + 2147483647) FROM adult", "arithmetic"),
    ("SELECT count(*) FROM adult WHERE -age < 0", "unary minus"),
    ("SELECT count(*) FROM adult WHERE native_country::int > 0", "cast to"),
    ("SELECT count(*) FROM adult WHERE CAST(CASE WHEN id = 17 THEN 'x' END AS int) = 1", "cast to"),
    ("SELECT count(*) FROM adult WHERE native_country ~ '('", "regular expressions"),
    ("SELECT count(*) FROM adult WHERE native_country SIMILAR TO 'x'", "regular expressions"),
    ("SELECT count(*) FROM adult WHERE native_country LIKE native_country", "constant"),
    ("SELECT count(*) FROM adult WHERE native_country LIKE 'ab\\'", "escape character"),
    # (a valid ESCAPE of one character is answered since round 17; one ending the pattern fails on the rows it meets)
    ("SELECT count(*) FROM adult WHERE native_country LIKE 'a%!' ESCAPE '!'", "escape character"),
    ("SELECT count(*) FROM adult WHERE native_country LIKE 'a!%' ESCAPE '!!'", "ESCAPE"),
    ("SELECT count(*) FROM adult WHERE octet_length(native_country) > 3", "octet_length"),
    ("SELECT count(*) FROM adult WHERE my_function(age) > 3", "my_function"),
    ("SELECT count(*) FROM adult WHERE pg_sleep(CASE WHEN id = 17 THEN 5 ELSE 0 END) IS NULL", "pg_sleep"),
    ("SELECT count(*) FROM adult WHERE native_country || 'x' = 'ax'", "concatenation"),
    ("SELECT width_bucket(age, 0, 100, 0), count(*) FROM adult GROUP BY 1", "width_bucket"),
    ("SELECT width_bucket(age, 10, 10, 5), count(*) FROM adult GROUP BY 1", "width_bucket"),
    ("SELECT width_bucket(CASE WHEN age = 17 THEN 'NaN' ELSE 1.5 END, 0, 10, 5), count(*) FROM adult GROUP BY 1",
     "width_bucket"),
    ("SELECT extract(hour FROM age), count(*) FROM adult GROUP BY 1", "hour"),
    ("SELECT date_trunc('fortnight', age), count(*) FROM adult GROUP BY 1", "date_trunc"),
    ("SELECT date_trunc('week', age), count(*) FROM adult GROUP BY 1", "date_trunc"),
    ("SELECT date_trunc('day', age, 'Mars/Olympus'), count(*) FROM adult GROUP BY 1", "zone"),
    ("SELECT count(*) FROM adult WHERE native_country = ANY (ARRAY[native_country || 'x'])", "ANY"),
    ("SELECT count(*) FROM adult WHERE native_country = ANY ($1)", "ANY"),
    ("SELECT count(*) FROM adult WHERE native_country COLLATE \"C\" = 'x'", "COLLATE"),
    ("SELECT count(*) FROM adult WHERE native_country = E'x'", "strings"),
]


@pytest.mark.parametrize(("sql", "word"), SIDE_CHANNELS)
def test_error_side_channels_refused(sql: str, word: str) -> None:
    assert_reject(sql, "0A000", word)


def test_the_issue_example_is_refused() -> None:
    # Refused twice over: id inside an aggregate can single a person out, and 1/0 is a side channel.
    assert_reject("SELECT count(*), sum(CASE WHEN id = 17 AND income = '>50K' THEN 1/0 END) FROM adult", "42501")
    assert_reject("SELECT count(*) FROM adult WHERE CASE WHEN id = 17 AND income = '>50K' THEN 1/0 END = 1",
                  "0A000", "division")


# --- names, quoting, lexing -------------------------------------------------------------


@pytest.mark.parametrize("sql", [
    'SELECT * FROM "public"."adult"',
    "SELECT * FROM PUBLIC.ADULT",
    "SELECT * FROM Adult",
    'SELECT * FROM public."adult"',
    "SELECT * FROM anonproxy_test.public.adult",
    "SELECT * FROM public . adult",
    "SELECT * FROM public/**/.adult",
    "select * from adult -- trailing comment",
    "/* leading */ select * from adult",
    "SELECT * FROM " + '"' + "adult" + '"',
])
def test_spellings_of_the_protected_table(sql: str) -> None:
    decision = decide(sql, SUPPRESS, POLICY)
    assert isinstance(decision, Reject), decision


def test_quoted_name_with_other_case_is_another_table() -> None:
    assert decide('SELECT * FROM "Adult"', SUPPRESS, POLICY) == Pass()
    assert decide('SELECT * FROM "ADULT"', SUPPRESS, POLICY) == Pass()


def test_protected_name_elsewhere_in_a_passed_query_refused() -> None:
    # Not a table reference, but the proxy does not pass statements that reuse a protected name.
    assert_reject("SELECT 1 AS adult", "42501", "'adult'")
    assert_reject('SELECT x FROM t AS "adult"', "42501", "'adult'")
    assert_reject("SELECT adult.x FROM t", "42501", "'adult'")


def test_search_path_cannot_hide_a_protected_table() -> None:
    policy = Policy(version=2, tables={"hr.people": ProtectedTable("hr.people", "person_id")})
    assert decide("SET search_path = hr", SUPPRESS, policy) == Pass()
    # Unqualified names match protected tables in any schema, whatever the client's search_path.
    assert_reject("SELECT * FROM people", "42501", "SELECT *", policy=policy)
    assert_reject("SELECT * FROM pg_temp.people, people", "42501", policy=policy)
    sql = rewritten("SELECT count(*) FROM people GROUP BY dept", policy=policy)
    assert 'FROM "hr"."people"' in sql
    assert 'SELECT "people"."person_id" AS unit FROM "hr"."people" GROUP BY 1' in sql
    # A table of that name in another schema, qualified, is another table.
    assert decide("SELECT * FROM public.people", SUPPRESS, policy) == Pass()


def test_ambiguous_unqualified_name_refused() -> None:
    policy = Policy(tables={"hr.people": ProtectedTable("hr.people", "id"),
                            "sales.people": ProtectedTable("sales.people", "id")})
    assert_reject("SELECT count(*) FROM people", "0A000", "ambiguous", policy=policy)
    assert "sales" in rewritten("SELECT count(*) FROM sales.people", policy=policy)


def test_long_names_are_truncated_like_postgresql() -> None:
    name = "t" * 63
    policy = Policy(tables={f"public.{name}": ProtectedTable(f"public.{name}", "id")})
    assert_reject(f"SELECT * FROM {name}xyz", "42501", "SELECT *", policy=policy)


@pytest.mark.parametrize("sql", [
    # PostgreSQL reads a$$b as one identifier; a dollar quote glued to a name is refused rather than guessed.
    "SELECT a$$b; SELECT * FROM adult; SELECT $$ $$",
    "SELECT x$$; SELECT * FROM adult; $$",
    # U&"..." identifiers with escapes: "\0061dult" is adult.
    'SELECT * FROM U&"\\0061dult"',
    'SELECT count(*) FROM U&"\\0061dult" GROUP BY 1',
    # A -- comment ends at a carriage return for PostgreSQL.
    "SELECT 1 --x\rFROM adult",
    "SELECT `x`",
    "SELECT 'unterminated",
    "SELECT /* unterminated",
    "SELECT $1$",
    "SELECT 1; SELEC 2",
    "SELECT ((1)",
])
def test_lexing_tricks_refused(sql: str) -> None:
    assert isinstance(decide(sql, SUPPRESS, POLICY), Reject)


def test_nested_comments_are_comments() -> None:
    assert decide("SELECT 1 /* a /* nested ; select * from adult */ still comment */", SUPPRESS, POLICY) == Pass()


def test_e_string_backslash_quote_keeps_one_statement() -> None:
    assert decide("SELECT E'it\\'s; select * from adult'", SUPPRESS, POLICY) == Pass()
    # In a standard string a backslash is an ordinary character: two statements.
    assert_reject("SELECT 'a\\'; SELECT * FROM adult; -- '", "42501", "SELECT *")


# --- Rewrite: shape -------------------------------------------------------------------------


def parts(sql: str) -> tuple[dict[str, str], str]:
    """The CTEs of a rewritten statement (name -> body) and the statement that follows them."""
    if not sql.startswith("WITH "):
        return {}, sql
    ctes = {name: body for name, body in re.findall(r"(?ms)^(?:WITH )?(anonproxy_\w+)(?:\([\w, ]+\))? AS \(\n(.*?)\n\),?$",
                                                   sql)}
    return ctes, sql.rsplit("\n)\n", 1)[1]


def test_rewrite_is_rendered_from_the_tree_with_the_client_names() -> None:
    sql = rewritten("select native_country, count(*) /* a comment */ from adult -- another\n group by 1")
    ctes, answer = parts(sql)
    # The client's comments are gone: every piece is rendered from the checked tree, not cut from the text.
    assert "a comment" not in sql and "another" not in sql and "/*" not in sql
    # The answer is the client's select list over the released groups, with the client's output names as explicit
    # aliases; one pass computes each group's aggregates, rows with a unit and buckets of people (no magnitude rule,
    # the unit not known to be unique: the bounds first; its type not read: the buckets by its type's hash), and each
    # group's distinct people only where the bounds do not settle the rules.
    assert answer == 'SELECT anonproxy_g1 AS "native_country", anonproxy_v1 AS "count"\nFROM anonproxy_released'
    assert ctes["anonproxy_rows"].endswith(
        'SELECT native_country AS anonproxy_g1, native_country AS anonproxy_c1, count(*) AS anonproxy_v1, '
        'count("adult"."id") AS unit_rows, coalesce(length(replace((bit_or(1::bigint << ((CASE WHEN "adult"."id" '
        'IS NOT NULL THEN hash_array(ARRAY["adult"."id"]) END) & 63)::int))::bit(64)::text, \'0\', \'\')), 0) '
        'AS unit_low\n'
        'FROM "public"."adult"\nGROUP BY native_country')
    assert ctes["anonproxy_group_people"].endswith(
        'SELECT native_country AS anonproxy_g1, count(DISTINCT "adult"."id") AS units\nFROM "public"."adult"\n'
        'WHERE NOT (SELECT sure FROM anonproxy_sure)\nGROUP BY native_country')
    # The verdicts count people (the unit), not rows, and compare with N, the people of the whole table: counted up to
    # k more than the largest group's rows when the bounds settle every group, whole otherwise.
    assert ctes["anonproxy_counted"].endswith(
        'SELECT count(*) FROM (SELECT "adult"."id" AS unit FROM "public"."adult" WHERE "adult"."id" IS NOT NULL '
        'GROUP BY 1 LIMIT (SELECT coalesce(max(unit_rows), 0) FROM anonproxy_rows) + 10) AS anonproxy_units')
    assert ctes["anonproxy_universe"].endswith(
        'SELECT CASE WHEN (SELECT sure FROM anonproxy_sure) THEN (SELECT n FROM anonproxy_counted) ELSE (SELECT '
        'count(unit) FROM (SELECT "adult"."id" AS unit FROM "public"."adult" GROUP BY 1) AS anonproxy_units) END')
    assert 'SELECT native_country AS anonproxy_g1, "adult"."id" AS unit\nFROM "public"."adult"' in \
        ctes["anonproxy_cells"]
    assert "s.units >= 10 AND (SELECT n FROM anonproxy_universe) - s.units NOT BETWEEN 1 AND 9" in \
        ctes["anonproxy_primary"]
    # A GROUP BY always gets complementary suppression.
    assert {"anonproxy_order", "anonproxy_people", "anonproxy_steps", "anonproxy_chosen", "anonproxy_groups",
            "anonproxy_withheld"} <= set(ctes)


def test_rewrite_without_group_by_applies_query_set_size_control() -> None:
    sql = rewritten("SELECT count(*) FROM adult WHERE age > 30")
    # The simple shape: k people, and nobody or at least k of N left out (a total over everyone is answered).
    assert sql == (
        'SELECT count(*) AS "count"\n'
        'FROM "public"."adult"\n'
        "WHERE age > 30\n"
        'HAVING count(DISTINCT "adult"."id") >= 10 AND (SELECT count(anonproxy_units.unit) FROM (SELECT "adult"."id" '
        'AS unit FROM "public"."adult" GROUP BY 1) AS anonproxy_units) - count(DISTINCT "adult"."id") NOT BETWEEN 1 '
        'AND 9'
    )


def test_rewrite_keeps_parameters_casts_and_aliases() -> None:
    sql = rewritten("SELECT sex AS \"Sex\", count(*) AS n, avg(hours_per_week)::numeric(6,2) AS h FROM adult "
                    "WHERE age > $1 AND workclass = $2::text GROUP BY 1 ORDER BY n DESC LIMIT $3")
    assert "count(*) AS anonproxy_v1, avg(hours_per_week) AS anonproxy_v2" in sql  # computed in one pass
    assert 'anonproxy_g1 AS "Sex", anonproxy_v1 AS "n", CAST(anonproxy_v2 AS DECIMAL(6, 2)) AS "h"' in sql
    assert "WHERE age > $1 AND workclass = CAST($2 AS TEXT)" in sql
    assert "LIMIT $3" in sql


def test_metabase_style_query() -> None:
    sql = rewritten(
        'SELECT "public"."adult"."education" AS "education", count(*) AS "count", '
        'sum("public"."adult"."hours_per_week") AS "sum" FROM "public"."adult" '
        "WHERE (\"public\".\"adult\".\"age\" > 30) AND (\"public\".\"adult\".\"sex\" = 'Male') "
        'GROUP BY "public"."adult"."education" ORDER BY "count" DESC, "public"."adult"."education" ASC LIMIT 2000')
    ctes, answer = parts(sql)
    assert ctes["anonproxy_universe"].endswith(
        'ELSE (SELECT count(unit) FROM (SELECT "adult"."id" AS unit FROM "public"."adult" GROUP BY 1) '
        'AS anonproxy_units) END')
    assert 'count(DISTINCT "adult"."id") AS units' in ctes["anonproxy_group_people"]
    assert "s.units >= 10 AND (SELECT n FROM anonproxy_universe) - s.units NOT BETWEEN 1 AND 9" in \
        ctes["anonproxy_primary"]
    # the sum needs k people with a non-zero value, in each group and in the withheld groups together
    assert 'count(DISTINCT "adult"."id") FILTER (WHERE ("adult"."hours_per_week") <> 0) AS n1' in \
        ctes["anonproxy_group_people"]
    assert ('bit_or(1::bigint << ((CASE WHEN "adult"."id" IS NOT NULL THEN hash_array(ARRAY["adult"."id"]) END) '
            '& 63)::int) FILTER (WHERE ("adult"."hours_per_week") <> 0))::bit(64)::text, \'0\', \'\')), 0) '
            'AS unit_low_n1') in \
        ctes["anonproxy_rows"]
    assert 'bool_or(("adult"."hours_per_week") <> 0) AS n1' in ctes["anonproxy_cells"]
    assert "s.n1 >= 10" in ctes["anonproxy_primary"]
    assert "contributors_n1 >= 10" in ctes["anonproxy_chosen"]
    # issue 11: three-part names are normalised to the table's reference before analysis (anonproxy.plan.names)
    assert '"public"."adult"."' not in sql
    assert ctes["anonproxy_rows"].startswith(
        '-- one pass: each group\'s answer, its rows with a unit, the buckets of people it holds (per aggregate those '
        'that contribute), and per SUM/AVG the bounds of its contributions\n'
        'SELECT "adult"."education" AS anonproxy_g1, "adult"."education" AS anonproxy_c1, count(*) AS anonproxy_v1, '
        'sum("adult"."hours_per_week") AS anonproxy_v2, ')
    assert ctes["anonproxy_rows"].endswith('\nFROM "public"."adult"\n'
                                           'WHERE (("adult"."age" > 30) AND ("adult"."sex" = \'Male\'))\n'
                                           'GROUP BY "adult"."education"')
    assert 'WHERE ("adult"."age" > 30) AND ("adult"."sex" = \'Male\')' in ctes["anonproxy_cells"]
    assert answer == ('SELECT anonproxy_g1 AS "education", anonproxy_v1 AS "count", anonproxy_v2 AS "sum"\n'
                      'FROM anonproxy_released\nORDER BY 2 DESC, 1\nLIMIT 2000')


def test_linked_table_join_uses_the_protected_unit() -> None:
    sql = rewritten("SELECT a.sex, count(*) FROM visits v JOIN adult a ON v.person_id = a.id GROUP BY a.sex")
    assert 'FROM "public"."visits" AS v JOIN "public"."adult" AS a ON v.person_id = a.id' in sql
    ctes, _ = parts(sql)
    # N is the people of the join, and each group counts the protected table's people
    assert ctes["anonproxy_universe"].endswith(
        'ELSE (SELECT count(unit) FROM (SELECT "a"."id" AS unit FROM "public"."visits" AS v JOIN '
        '"public"."adult" AS a ON v.person_id = a.id GROUP BY 1) AS anonproxy_units) END')
    assert 'SELECT a.sex AS anonproxy_g1, "a"."id" AS unit\n' in ctes["anonproxy_cells"]
    assert 'count(DISTINCT "a"."id") AS units' in ctes["anonproxy_group_people"]
    only_linked = rewritten("SELECT count(*) FROM visits WHERE cost > 100")
    assert only_linked.endswith(
        'HAVING count(DISTINCT "visits"."person_id") >= 10 AND (SELECT count(anonproxy_units.unit) FROM (SELECT '
        '"visits"."person_id" AS unit FROM "public"."visits" GROUP BY 1) AS anonproxy_units) - '
        'count(DISTINCT "visits"."person_id") NOT BETWEEN 1 AND 9')


def test_join_to_an_ordinary_table_is_refused() -> None:
    """Issue 10: a table outside the policy is no longer joined to protected data (it was, with JOIN/LEFT JOIN)."""
    assert_reject("SELECT c.region, count(*) FROM adult a JOIN countries c ON c.name = a.native_country "
                  "GROUP BY c.region", "42501", "relation public.countries")


def test_left_join_to_a_linked_table_on_its_key() -> None:
    sql = rewritten("SELECT a.sex, count(v.cost) FROM adult a LEFT JOIN visits v ON v.person_id = a.id "
                    "AND v.cost > 10 GROUP BY a.sex")
    assert 'FROM "public"."adult" AS a LEFT JOIN "public"."visits" AS v ON v.person_id = a.id AND v.cost > 10' in sql


def test_distinct_becomes_a_grouped_query() -> None:
    sql = rewritten("SELECT DISTINCT native_country FROM adult ORDER BY 1")
    ctes, answer = parts(sql)
    assert answer == 'SELECT DISTINCT anonproxy_g1 AS "native_country"\nFROM anonproxy_released\nORDER BY 1'
    assert 'SELECT native_country AS anonproxy_g1, "adult"."id" AS unit' in ctes["anonproxy_cells"]
    assert 'count(DISTINCT "adult"."id") AS units' in ctes["anonproxy_group_people"]
    assert "s.units >= 10 AND (SELECT n FROM anonproxy_universe) - s.units NOT BETWEEN 1 AND 9" in \
        ctes["anonproxy_primary"]


def test_group_by_alias_that_may_be_a_column_is_refused() -> None:
    assert_reject("SELECT age AS sex, count(*) FROM adult GROUP BY sex", "0A000", "ambiguous")


def test_rest_row_needs_orderable_output_columns() -> None:
    """The per-person shape (a magnitude rule on a sum) orders the rest row's UNION by output positions; the
    one-pass shape orders over the released rows, by any expression of the select list or its aggregates."""
    role = suppress_role(k=10, suppressed_rest=True)
    assert "ORDER BY anonproxy_v2" in rewritten("SELECT sex, count(*) FROM adult GROUP BY sex ORDER BY sum(age)",
                                                role=role)
    magnitudes = suppress_role(k=10, dominance_n=2, dominance_percent=80, suppressed_rest=True)
    assert_reject("SELECT sex, sum(age) FROM adult GROUP BY sex ORDER BY count(*)", "0A000", "output column",
                  role=magnitudes)
    assert "ORDER BY 2 DESC" in rewritten("SELECT sex, count(*) AS n FROM adult GROUP BY sex ORDER BY n DESC",
                                          role=role)


def test_incomplete_suppression_policy_fails_closed() -> None:
    assert_reject("SELECT sum(age) FROM adult", "0A000", "dominance", role=suppress_role(dominance_n=2))
    assert_reject("SELECT count(*) FROM adult", "0A000", "k", role=suppress_role(k=0))


@pytest.mark.parametrize(("sql", "word"), [
    ("SELECT income, count(*), count(nullif(id, 17)) FROM adult GROUP BY income", "identifying column id"),
    ("SELECT income, sum(CASE WHEN id = 17 THEN 1 ELSE 0 END) FROM adult GROUP BY income", "identifying column id"),
    ("SELECT income, avg(CASE WHEN a.id = 17 THEN age ELSE 40 END) FROM adult a GROUP BY income", "identifying"),
    ("SELECT v.visit_month, count(CASE WHEN v.person_id = 17 THEN 1 END) FROM visits v GROUP BY 1", "person_id"),
    ("SELECT sex FROM adult GROUP BY sex HAVING count(CASE WHEN id = 17 AND income = '>50K' THEN 1 END) > 0",
     "identifying"),
])
def test_identifying_columns_inside_aggregates_refused(sql: str, word: str) -> None:
    assert_reject(sql, "42501", word)


def test_identifier_kind_from_the_policy() -> None:
    from anonproxy.policy.model import ColumnPolicy
    policy = Policy(tables={"public.adult": ProtectedTable("public.adult", "id", {
        "fnlwgt": ColumnPolicy("fnlwgt", "identifier")})})
    assert_reject("SELECT sex, sum(CASE WHEN fnlwgt = 77516 THEN 1 ELSE 0 END) FROM adult GROUP BY sex", "42501",
                  "fnlwgt", policy=policy)
    rewritten("SELECT sex, count(DISTINCT fnlwgt) FROM adult WHERE fnlwgt > 100000 GROUP BY sex", policy=policy)


def test_count_distinct_takes_a_column() -> None:
    assert_reject("SELECT sex, count(DISTINCT CASE WHEN age = 90 THEN 'x' ELSE 'y' END) FROM adult GROUP BY sex",
                  "0A000", "count(DISTINCT")
    assert "count(DISTINCT id)" in rewritten("SELECT sex, count(DISTINCT id) FROM adult GROUP BY sex")


def test_casts_of_aggregates_in_having_run_over_released_groups() -> None:
    assert "CAST(anonproxy_v1 AS BIGINT)" in rewritten("SELECT sex, sum(capital_gain)::bigint FROM adult GROUP BY sex")
    # Issue 11: HAVING and arithmetic over aggregates are computed outside the materialized suppressed result.
    outer = rewritten("SELECT sex FROM adult GROUP BY sex HAVING sum(capital_gain)::smallint > 0")
    inner, after = outer.rsplit("\n)\nSELECT ", 1)
    assert "anonproxy_released AS MATERIALIZED (" in inner
    assert "SMALLINT" not in inner and "WHERE (CAST(anonproxy_v1 AS SMALLINT) > 0)" in after
    assert "(anonproxy_v1 + 1)" in rewritten("SELECT sex, count(*) + 1 FROM adult GROUP BY sex")


def test_decide_is_pure() -> None:
    sql = "SELECT sex, count(*), sum(capital_gain) FROM adult WHERE age > $1 GROUP BY sex"
    role = suppress_role(k=5, dominance_n=2, dominance_percent=80, p_percent=10, suppressed_rest=True)
    first = decide(sql, role, POLICY)
    assert first == decide(sql, role, POLICY)
    assert hash(first) == hash(decide(sql, role, POLICY))


# --- timing -------------------------------------------------------------------------------

DASHBOARD_QUERIES = [
    ('SELECT "public"."adult"."education" AS "education", count(*) AS "count" FROM "public"."adult" '
    'GROUP BY "public"."adult"."education" ORDER BY "public"."adult"."education" ASC'),
    ('SELECT "public"."adult"."sex" AS "sex", "public"."adult"."race" AS "race", count(*) AS "count" '
    'FROM "public"."adult" GROUP BY "public"."adult"."sex", "public"."adult"."race" '
    'ORDER BY "public"."adult"."sex" ASC, "public"."adult"."race" ASC'),
    ('SELECT "public"."adult"."workclass" AS "workclass", avg("public"."adult"."hours_per_week") AS "avg" '
    'FROM "public"."adult" WHERE "public"."adult"."age" >= 18 GROUP BY "public"."adult"."workclass" '
    'ORDER BY "avg" DESC LIMIT 10'),
    'SELECT sum("public"."adult"."capital_gain") AS "sum" FROM "public"."adult" WHERE "public"."adult"."sex" = \'Female\'',
    'SELECT count(*) AS "count" FROM "public"."adult" WHERE "public"."adult"."income" = \'>50K\'',
    "SELECT native_country, count(*) FROM adult GROUP BY 1 ORDER BY 2 DESC",
    "SELECT width_bucket(age, 0, 100, 10) AS bucket, count(*) FROM adult GROUP BY 1 ORDER BY 1",
    ("SELECT CASE WHEN age < 30 THEN 'young' WHEN age < 60 THEN 'middle' ELSE 'old' END AS band, count(*), "
    "avg(hours_per_week) FROM adult GROUP BY 1"),
    "SELECT occupation, count(DISTINCT native_country) FROM adult GROUP BY occupation HAVING count(*) > 100",
    "SELECT lower(marital_status), sex, count(*) FROM adult WHERE age BETWEEN 25 AND 65 GROUP BY 1, 2",
    "SELECT income, avg(age), avg(education_num), sum(capital_gain), sum(capital_loss) FROM adult GROUP BY income",
    ("SELECT relationship, count(*) FROM adult WHERE workclass IN ('Private', 'Self-emp-inc') AND "
    "native_country LIKE 'United%' GROUP BY relationship ORDER BY count(*) DESC"),
    "SELECT coalesce(occupation, 'unknown') AS occ, count(*) FROM adult GROUP BY 1",
    "SELECT sex, count(*) FROM adult WHERE hours_per_week > $1 AND age < $2 GROUP BY sex",
    "SELECT education, education_num, count(*) FROM adult GROUP BY education, education_num ORDER BY 2",
    ("SELECT a.sex, count(*), count(DISTINCT v.person_id) FROM visits v JOIN adult a ON v.person_id = a.id "
    "GROUP BY a.sex"),
    "SELECT DISTINCT native_country FROM adult ORDER BY 1 LIMIT 1000",
    ("SELECT t.typname, t.oid FROM pg_catalog.pg_type t JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace "
    "WHERE n.nspname <> 'pg_toast' AND (t.typrelid = 0 OR (SELECT c.relkind = 'c' FROM pg_catalog.pg_class c "
    "WHERE c.oid = t.typrelid))"),
    ("SELECT c.relname, a.attname, a.atttypid FROM pg_catalog.pg_class c JOIN pg_catalog.pg_attribute a "
    "ON a.attrelid = c.oid WHERE c.relnamespace = 'public'::regnamespace AND a.attnum > 0 ORDER BY 1, a.attnum"),
    "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED",
]


def test_decide_timing_for_dashboard_queries() -> None:
    """Every dashboard query is decided; the timings are printed, not asserted (benchmarks/suppress measures them)."""
    role = suppress_role(k=10, dominance_n=2, dominance_percent=80, p_percent=10, suppressed_rest=True)
    decide("SELECT 0", role, POLICY)  # imports and sqlglot's lazy tables
    timings = []
    for sql in DASHBOARD_QUERIES:
        start = time.perf_counter()
        decision = decide(sql, role, POLICY)
        timings.append((time.perf_counter() - start) * 1000)
        assert isinstance(decision, (Pass, Rewrite)), (sql, decision)
    print(f"\ndecide() first sight, {len(timings)} dashboard queries: median {statistics.median(timings):.2f} ms, "
          f"max {max(timings):.2f} ms, all: {', '.join(f'{t:.1f}' for t in timings)}")


# --- real database --------------------------------------------------------------------------

_ADULT: list[dict[str, object]] | None = None


def adult() -> list[dict[str, object]]:
    """The Adult rows as shipped, read in Python: the independent side of every comparison."""
    global _ADULT
    if _ADULT is None:
        _ADULT = [dict(zip(sample_data.ADULT_COLUMNS, row, strict=True)) for row in sample_data.adult_rows()]
    return _ADULT


def run(conn: psycopg.Connection, sql: str, params: Iterable[object] = ()) -> list[tuple[str | None, ...]]:
    """Execute with server-side parameters ($1 ...) exactly as the proxy would; values as text."""
    result = conn.pgconn.exec_params(sql.encode(), [None if p is None else str(p).encode() for p in params])
    if result.status != pq.ExecStatus.TUPLES_OK:
        message = (result.error_message or b"").decode()
        raise AssertionError(f"{message}\n{sql}")
    return [tuple(None if (v := result.get_value(r, c)) is None else v.decode() for c in range(result.nfields))
            for r in range(result.ntuples)]


def describe(conn: psycopg.Connection, sql: str) -> tuple[list[tuple[str, int, int]], list[int]]:
    """RowDescription (name, type oid, typmod) and ParameterDescription of a statement, as a client would see them."""
    name = f"s{abs(hash(sql))}".encode()
    prepared = conn.pgconn.prepare(name, sql.encode())
    assert prepared.status == pq.ExecStatus.COMMAND_OK, (prepared.error_message or b"").decode() + sql
    result = conn.pgconn.describe_prepared(name)
    columns = [(result.fname(i).decode(), result.ftype(i), result.fmod(i)) for i in range(result.nfields)]
    params = [result.param_type(i) for i in range(result.nparams)]
    conn.pgconn.exec_(b"DEALLOCATE " + name)
    return columns, params


@pytest.fixture
def db(postgresql: psycopg.Connection) -> psycopg.Connection:
    postgresql.autocommit = True
    return postgresql


def people_by(rows: Iterable[dict[str, object]], key: Callable[[dict[str, object]], object],
              where: Callable[[dict[str, object]], bool] = lambda row: True) -> dict[object, set[object]]:
    """The people (ids) of each group of ``key`` over the rows ``where`` keeps: what the oracle decides from."""
    groups: dict[object, set[object]] = defaultdict(set)
    for row in rows:
        if where(row):
            groups[key(row)].add(row["id"])
    return dict(groups)


def test_group_by_country_k10(db: psycopg.Connection) -> None:
    rows = run(db, rewritten("select native_country, count(*) from adult group by 1"))
    counts = Counter(row["native_country"] for row in adult())
    verdict = suppress(counts, k=10, everyone=len(adult()))
    assert {country: int(n) for country, n in rows} == {country: counts[country] for country in verdict.released}
    # The one person from the Netherlands fails alone; the next smallest country is withheld with them, so that the
    # released rows subtracted from the public total leave k people (docs/suppression.md, complementary suppression)
    assert counts["Holand-Netherlands"] == 1 and min(n for c, n in counts.items() if n >= 10) == counts["Scotland"]
    assert verdict.primary == {"Holand-Netherlands"}
    assert verdict.withheld == {"Holand-Netherlands", "Scotland"}
    assert {c for c, _ in rows} == set(counts) - {"Holand-Netherlands", "Scotland"}


def test_groups_of_everyone_and_of_all_but_a_few(db: psycopg.Connection) -> None:
    """docs/suppression.md's examples: a group of everyone is released, a group of all but a few is not, and then
    neither is the few's group, even when it is large enough alone."""
    n = len(adult())
    everyone = people_by(adult(), lambda row: int(row["age"]) > 16)  # type: ignore[call-overload]
    assert suppress(everyone, k=10, everyone=n).released == {True}
    assert run(db, rewritten("SELECT age > 16 AS adult, count(*) FROM adult GROUP BY 1")) == [("t", str(n))]
    dutch = people_by(adult(), lambda row: row["native_country"] == "Holand-Netherlands")
    assert suppress(dutch, k=10, everyone=n).released == set()
    assert run(db, rewritten("SELECT native_country = 'Holand-Netherlands', count(*) FROM adult GROUP BY 1")) == []
    # GROUP BY sex without person 17: the released rows would add up to the total minus person 17, so only the
    # larger group is released (the smaller one holds thousands of people)
    sex = people_by(adult(), lambda row: row["sex"], lambda row: row["id"] != 17)
    verdict = suppress(sex, k=10, everyone=n)
    assert verdict.primary == set() and verdict.released == {"Male"} and len(sex["Female"]) > 1000
    assert run(db, rewritten("SELECT sex, count(*) FROM adult WHERE id <> 17 GROUP BY sex")) == [
        ("Male", str(len(sex["Male"])))]
    # Leaving k people out instead, both are released and add up to a total the scalar query answers too.
    sex = people_by(adult(), lambda row: row["sex"], lambda row: int(row["id"]) > 10)  # type: ignore[call-overload]
    assert suppress(sex, k=10, everyone=n).released == {"Male", "Female"}
    got = run(db, rewritten("SELECT sex, count(*) FROM adult WHERE id > 10 GROUP BY sex ORDER BY 1"))
    assert got == [(s, str(len(sex[s]))) for s in ("Female", "Male")]
    assert run(db, rewritten("SELECT count(*) FROM adult WHERE id > 10")) == [(str(n - 10),)]


def test_two_column_group_by_with_avg(db: psycopg.Connection) -> None:
    sql = rewritten("SELECT sex, race, count(*), avg(hours_per_week) FROM adult GROUP BY sex, race",
                    role=suppress_role(k=200))
    groups: dict[tuple[object, object], list[int]] = defaultdict(list)
    for row in adult():
        groups[(row["sex"], row["race"])].append(int(row["hours_per_week"]))  # type: ignore[arg-type]
    key = lambda row: (row["sex"], row["race"])  # noqa: E731
    verdict = suppress(people_by(adult(), key), k=200, everyone=len(adult()),
                       contributors={"avg": people_by(adult(), key, lambda row: row["hours_per_week"] != 0)})
    expected = {key: (len(v), Decimal(sum(v)) / len(v)) for key, v in groups.items() if key in verdict.released}
    got = {(sex, race): (int(n), Decimal(avg)) for sex, race, n, avg in run(db, sql)}
    assert got.keys() == expected.keys() and len(got) < len(groups)
    for key, (n, avg) in got.items():
        assert n == expected[key][0]
        assert abs(avg - expected[key][1]) < Decimal("1e-12")
    # The four groups of fewer than 200 people hold 517 together, but only 194 women (87 + 107): in the margin of
    # the women (what GROUP BY sex adds up) the smallest released group of women is withheld with them.
    assert verdict.primary == {key for key, v in groups.items() if len(v) < 200}
    assert sum(len(groups[key]) for key in verdict.primary if key[0] == "Female") < 200
    assert verdict.withheld - verdict.primary == {("Female", "Asian-Pac-Islander")}


def test_sum_and_avg_by_category(db: psycopg.Connection) -> None:
    sql = rewritten("SELECT workclass, sum(hours_per_week), avg(capital_gain), sum(capital_gain) FROM adult "
                    "WHERE age >= $1 GROUP BY workclass ORDER BY 2 DESC", role=suppress_role(k=50))
    older = lambda row: int(row["age"]) >= 30  # type: ignore[call-overload]  # noqa: E731
    workclass = lambda row: row["workclass"]  # noqa: E731
    groups: dict[object, list[dict[str, object]]] = defaultdict(list)
    for row in adult():
        if older(row):
            groups[row["workclass"]].append(row)
    # k people, and k of them with non-zero hours (the first sum) and with a gain (the avg and the other sum)
    verdict = suppress(people_by(adult(), workclass, older), k=50, everyone=len(adult()), contributors={
        "hours": people_by(adult(), workclass, lambda row: older(row) and row["hours_per_week"] != 0),
        "gain": people_by(adult(), workclass, lambda row: older(row) and row["capital_gain"] != 0)})
    expected = {}
    for key, members in groups.items():
        gains = [int(m["capital_gain"]) for m in members]  # type: ignore[call-overload]
        if key in verdict.released:
            expected[key] = (sum(int(m["hours_per_week"]) for m in members),  # type: ignore[call-overload]
                             Decimal(sum(gains)) / len(gains), sum(gains))
    rows = run(db, sql, [30])
    assert [int(r[1]) for r in rows] == sorted((e[0] for e in expected.values()), reverse=True)  # ORDER BY kept
    for workclass_, hours, avg_gain, gain in rows:
        assert (int(hours), int(gain)) == (expected[workclass_][0], expected[workclass_][2])
        assert abs(Decimal(avg_gain) - expected[workclass_][1]) < Decimal("1e-12")
    assert {r[0] for r in rows} == set(expected)
    assert 0 < len(rows) < len(groups)


def test_query_set_size_control(db: psycopg.Connection) -> None:
    n = len(adult())
    assert run(db, rewritten("SELECT count(*), sum(capital_gain) FROM adult WHERE id = 17")) == []
    assert run(db, rewritten("SELECT count(*) FROM adult WHERE id <> 17")) == []  # N - 1: one person left out
    # The grand total over everyone (|C| = N) is answered: it is public anyway (the sum of any GROUP BY's rows)
    total_gain = sum(int(r["capital_gain"]) for r in adult())  # type: ignore[call-overload]
    assert run(db, rewritten("SELECT count(*), sum(capital_gain) FROM adult")) == [(str(n), str(total_gain))]
    assert run(db, rewritten("SELECT count(*) FROM adult WHERE age >= 0")) == [(str(n),)]  # everyone passes
    assert run(db, rewritten("SELECT count(*) FROM adult WHERE id > $1"), [0]) == [(str(n),)]
    # A total over N - 1 to N - k + 1 people is withheld: a subtraction from the grand total gives the others
    sql = rewritten("SELECT count(*), sum(capital_gain) FROM adult WHERE id > $1")
    for left_out in range(1, 10):
        assert run(db, sql, [left_out]) == [], left_out
    assert run(db, rewritten("SELECT sum(capital_gain) FROM adult WHERE id <> $1"), [17]) == []
    assert run(db, rewritten("SELECT count(*) FROM adult WHERE id > $1"), [n - 10]) == [("10",)]  # |C| = k
    assert run(db, rewritten("SELECT count(*) FROM adult WHERE id > $1"), [n - 9]) == []
    assert run(db, rewritten("SELECT count(*) FROM adult WHERE id > $1"), [10]) == [(str(n - 10),)]  # k left out
    older = [row for row in adult() if int(row["age"]) > 40]  # type: ignore[call-overload]
    assert run(db, rewritten("SELECT count(*), sum(capital_gain) FROM adult WHERE age > 40")) == [
        (str(len(older)), str(sum(int(r["capital_gain"]) for r in older)))]  # type: ignore[call-overload]


def test_distinct_values_for_filter_dropdowns(db: psycopg.Connection) -> None:
    rows = run(db, rewritten("SELECT DISTINCT native_country FROM adult ORDER BY 1", role=suppress_role(k=100)))
    counts = Counter(row["native_country"] for row in adult())
    verdict = suppress(counts, k=100, everyone=len(adult()))
    assert [r[0] for r in rows] == sorted(verdict.released)  # type: ignore[type-var]
    assert 0 < len(rows) < len(counts)


def test_suppressed_rest_row(db: psycopg.Connection) -> None:
    young = lambda row: int(row["age"]) < 60  # type: ignore[call-overload]  # noqa: E731
    race = lambda row: row["race"]  # noqa: E731
    assert len(adult()) - sum(1 for row in adult() if young(row)) >= 1000  # the WHERE leaves >= k people out
    counts = Counter(row["race"] for row in adult() if young(row))
    sql = "SELECT race, count(*) AS n FROM adult WHERE age < 60 GROUP BY race ORDER BY n DESC"
    verdicts = {}
    for k in (300, 600, 1000):
        verdict = suppress(people_by(adult(), race, young), k=k, everyone=len(adult()), rest=True)
        expected = [(r, counts[r]) for r in verdict.released]
        if verdict.rest:
            expected.append((None, sum(counts[r] for r in verdict.withheld)))
        expected.sort(key=lambda item: -item[1])
        rows = run(db, rewritten(sql, role=suppress_role(k=k, suppressed_rest=True)))
        assert [(r, int(n)) for r, n in rows] == expected, k
        verdicts[k] = verdict
    # With k = 300 two groups fail alone (226 and 275 people): together they pass, and come back as one row. With
    # k = 600 they are not enough together: the smallest group that passes alone (842 people) is withheld with
    # them, and the rest row holds all three.
    assert sorted(n for n in counts.values() if n < 600) == [226, 275]
    assert verdicts[300].withheld == verdicts[300].primary and len(verdicts[300].rest_people) == 226 + 275
    assert verdicts[600].withheld - verdicts[600].primary == {"Asian-Pac-Islander"} == {
        r for r, n in counts.items() if n == min(n for n in counts.values() if n >= 600)}
    assert all(v.rest for v in verdicts.values())
    # Over the whole table the released rows and the rest row add up to the grand total, which is answered too
    # (|C| = N): the rest row is released.
    everyone = Counter(row["race"] for row in adult())
    verdict = suppress(everyone, k=300, everyone=len(adult()), rest=True)
    expected = sorted([*((r, everyone[r]) for r in verdict.released),
                       *([(None, sum(everyone[r] for r in verdict.withheld))] if verdict.rest else [])],
                      key=lambda item: -item[1])
    whole = run(db, rewritten("SELECT race, count(*) AS n FROM adult GROUP BY race ORDER BY n DESC",
                              role=suppress_role(k=300, suppressed_rest=True)))
    assert [(r, int(n)) for r, n in whole] == expected
    assert verdict.rest and sum(n for _, n in expected) == len(adult())


def test_rest_row_respects_client_having_and_where(db: psycopg.Connection) -> None:
    """HAVING is never evaluated on a withheld group: the rest row holds them all, then HAVING keeps or drops it."""
    role = suppress_role(k=50, suppressed_rest=True)
    woman = lambda row: row["sex"] == "Female"  # noqa: E731
    country = lambda row: row["native_country"]  # noqa: E731
    women = [row for row in adult() if woman(row)]
    counts = Counter(row["native_country"] for row in women)
    verdict = suppress(people_by(adult(), country, woman), k=50, everyone=len(adult()), rest=True)
    assert verdict.rest
    released = {c: counts[c] for c in verdict.released}
    rest_count = sum(counts[c] for c in verdict.withheld)
    ages = [int(r["age"]) for r in women if r["native_country"] in verdict.withheld]  # type: ignore[call-overload]
    assert rest_count == len(ages)
    # The withheld groups the HAVING below would drop (fewer than 20 women) are in the rest row all the same.
    assert any(counts[c] < 20 for c in verdict.withheld) and rest_count > sum(
        counts[c] for c in verdict.withheld if counts[c] >= 20)

    def answer(having: str) -> list[tuple[str | None, ...]]:
        return run(db, rewritten("SELECT native_country, count(*), avg(age) FROM adult WHERE sex = 'Female' "
                                 f"GROUP BY 1 HAVING {having} ORDER BY 2 DESC, 1", role=role))

    rows = answer("count(*) >= 20")
    assert {r[0]: int(r[1]) for r in rows if r[0] is not None} == released  # every released group has >= 50
    rest = [r for r in rows if r[0] is None]
    assert len(rest) == 1 and int(rest[0][1]) == rest_count
    assert abs(Decimal(rest[0][2]) - Decimal(sum(ages)) / len(ages)) < Decimal("1e-12")
    order = sorted([*released.items(), (None, rest_count)], key=lambda item: (-item[1], item[0] is None, item[0]))
    assert [(r[0], int(r[1])) for r in rows] == order  # ORDER BY 2 DESC, 1: the rest row sorts by its count
    # The same HAVING on the rest row's own count: it keeps the rest row when its count qualifies, and drops it
    # (and the released groups alike) when it does not; the verdicts do not change.
    kept = answer(f"count(*) <= {rest_count}")
    assert [(r[0], int(r[1])) for r in kept] == [item for item in order if item[1] <= rest_count]
    assert (None, rest_count) in [(r[0], int(r[1])) for r in kept]
    dropped = answer(f"count(*) > {rest_count}")
    assert [(r[0], int(r[1])) for r in dropped] == [item for item in order if item[1] > rest_count]
    assert all(r[0] is not None for r in dropped)
    # Without a HAVING, the same rows as the HAVING that keeps everything
    assert answer("true") == run(db, rewritten("SELECT native_country, count(*), avg(age) FROM adult "
                                               "WHERE sex = 'Female' GROUP BY 1 ORDER BY 2 DESC, 1", role=role))


def _create_visits(conn: psycopg.Connection) -> list[tuple[int, str, int]]:
    """public.visits, linked to adult through person_id, with cells whose fate is known by hand."""
    rows: list[tuple[int, str, int]] = []
    rows += [(p, "A", 100) for p in range(1, 13)]  # 12 people, 100 each: nobody dominates
    rows += [(1, "B", 5000), (1, "B", 5000)] + [(p, "B", 10) for p in range(2, 13)]  # person 1: 10000 of 10110
    rows += [(13, "C", 500), (14, "C", 450)] + [(p, "C", 5) for p in range(15, 25)]  # top two: 950 of 1000
    rows += [(25, "D", 600), (26, "D", 300)] + [(p, "D", 10) for p in range(27, 37)]  # T - x1 - x2 = 100
    rows += [(37, "E", 1000), (37, "E", -900), (38, "E", -100)] + [(p, "E", 100) for p in range(39, 49)]
    rows += [(p, "F", 1) for p in range(49, 54)]  # only 5 people
    conn.execute("DROP TABLE public.visits")  # the demo's, in the template: this test's policy has its own
    conn.execute("CREATE TABLE public.visits (person_id int REFERENCES public.adult (id), visit_month text, "
                 "cost int)")
    with conn.cursor() as cursor:
        cursor.executemany("INSERT INTO public.visits VALUES (%s, %s, %s)", rows)
    return rows


def _verdicts(rows: list[tuple[int, str, int]], k: int, dominance: tuple[int, float] | None,
              p: float | None) -> dict[str, bool]:
    """Released or not, per month, from per-person contributions computed in Python."""
    per_person: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for person, month, cost in rows:
        per_person[month][person] += cost
    verdict = {}
    for month, people in per_person.items():
        contributions = sorted((abs(v) for v in people.values()), reverse=True)
        total = sum(contributions)
        ok = len(people) >= k
        if dominance is not None:
            n, percent = dominance
            ok = ok and sum(contributions[:n]) <= percent / 100 * total
        if p is not None:
            x1, x2 = (contributions + [0, 0])[:2]
            ok = ok and total - x1 - x2 >= p / 100 * x1
        verdict[month] = ok
    return verdict


def _visit_facts(rows: Iterable[tuple[int, str, int]]) -> tuple[
        dict[str, set[int]], dict[str, dict[str, set[int]]], dict[str, dict[str, dict[int, int]]]]:
    """Per month: its people, the contributors to sum(cost) (a non-zero cost), each person's part of the sum."""
    people: dict[str, set[int]] = defaultdict(set)
    contributors: dict[str, set[int]] = defaultdict(set)
    parts: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for person, month, cost in rows:
        people[month].add(person)
        parts[month][person] += cost
        if cost != 0:
            contributors[month].add(person)
    return dict(people), {"sum": dict(contributors)}, {"sum": {m: dict(v) for m, v in parts.items()}}


def _magnitudes(params: dict[str, object]) -> Magnitudes:
    dominance = (params["dominance_n"], params["dominance_percent"]) if "dominance_n" in params else None
    return Magnitudes(dominance, params.get("p_percent"))  # type: ignore[arg-type]


def test_dominance_and_p_percent_rules(db: psycopg.Connection) -> None:
    rows = _create_visits(db)
    everyone = len({r[0] for r in rows})  # N: the 53 people of visits
    sql = "SELECT visit_month, count(*), sum(cost) FROM visits GROUP BY visit_month ORDER BY 1"
    cases = [
        # (role parameters, months that pass alone: worked out by hand in _create_visits' comments, months released
        # after complementary suppression, worked out by hand below)
        # F (5 people) fails alone; with A (the smallest month, 12 people, ties broken by name) the withheld months
        # hold 17 people, but B's people are A's, so the released B, C, D, E would leave out only F's 5: B goes too.
        ({"k": 10}, {"A", "B", "C", "D", "E"}, {"C", "D", "E"}),
        # B, C, D, F together: person 1's 10000 and 600 are 87.5 % of 12115; with A, 10700 of 13315 (80.4 %);
        # only with E too (everything: 10700 of 14515) do they pass. Nothing is released.
        ({"k": 10, "dominance_n": 2, "dominance_percent": 80}, {"A", "E"}, set()),
        # B and F: 10010 of 10115; with A: 10210 of 11315 (90.2 %) passes, and 17 people are left out of C, D, E.
        ({"k": 10, "dominance_n": 2, "dominance_percent": 95}, {"A", "C", "D", "E"}, {"C", "D", "E"}),
        ({"k": 10, "p_percent": 10}, {"A", "C", "D", "E"}, {"C", "D", "E"}),
        # B, C, D, F: 12115 - 10000 - 600 < 20 % of 10000; with A: 13315 - 10100 - 600 >= 2020.
        ({"k": 10, "p_percent": 20}, {"A", "E"}, {"E"}),
        ({"k": 10, "dominance_n": 2, "dominance_percent": 95, "p_percent": 20}, {"A", "E"}, {"E"}),
    ]
    totals: dict[str, tuple[int, int]] = {}
    for _, month, cost in rows:
        count, total = totals.get(month, (0, 0))
        totals[month] = (count + 1, total + cost)
    groups, contributors, sums = _visit_facts(rows)
    for params, alone, released in cases:
        python = _verdicts(rows, params["k"], (params["dominance_n"], params["dominance_percent"])
                           if "dominance_n" in params else None, params.get("p_percent"))
        assert {m for m, ok in python.items() if ok} == alone, params  # the hand reasoning holds
        verdict = suppress(groups, k=params["k"], everyone=everyone, contributors=contributors, sums=sums,
                           magnitudes=_magnitudes(params))
        assert set(groups) - verdict.primary == alone and verdict.released == released, params  # the oracle agrees
        got = run(db, rewritten(sql, role=suppress_role(**params)))
        assert [(m, int(c), int(s)) for m, c, s in got] == [(m, *totals[m]) for m in sorted(released)], params


def test_dominance_on_a_sum_without_group_by(db: psycopg.Connection) -> None:
    # The capital gains of the 35 people aged 90: 8 have any, and the three largest hold 62% of the total.
    gains = sorted((int(r["capital_gain"]) for r in adult() if r["age"] == 90), reverse=True)  # type: ignore
    assert len(gains) == 35 and sum(1 for g in gains if g) == 8
    assert 0.5 < sum(gains[:3]) / sum(gains) < 0.7
    sql = "SELECT count(*), sum(capital_gain) FROM adult WHERE age = 90"
    assert run(db, rewritten(sql, role=suppress_role(k=5, dominance_n=3, dominance_percent=50))) == []
    assert run(db, rewritten(sql, role=suppress_role(k=5, dominance_n=3, dominance_percent=70))) == [
        ("35", str(sum(gains)))]
    # Fewer than k people with a gain: the SUM cell has too few contributors, whatever the group size.
    assert run(db, rewritten(sql, role=suppress_role(k=10))) == []
    assert run(db, rewritten("SELECT count(*) FROM adult WHERE age = 90", role=suppress_role(k=10))) == [("35",)]


def test_dominance_by_category_on_adult(db: psycopg.Connection) -> None:
    params = {"k": 10, "dominance_n": 2, "dominance_percent": 60, "p_percent": 25}
    sql = rewritten("SELECT occupation, sum(capital_gain) AS gains, count(*) FROM adult GROUP BY occupation",
                    role=suppress_role(**params))
    cells: dict[object, list[int]] = defaultdict(list)
    parts: dict[object, dict[object, int]] = defaultdict(dict)
    for row in adult():
        cells[row["occupation"]].append(abs(int(row["capital_gain"])))  # type: ignore[call-overload]
        parts[row["occupation"]][row["id"]] = int(row["capital_gain"])  # type: ignore[call-overload]
    occupation = lambda row: row["occupation"]  # noqa: E731
    alone = set()
    for key, values in cells.items():
        values.sort(reverse=True)
        total = sum(values)
        x1, x2 = (values + [0, 0])[:2]
        contributors = sum(1 for v in values if v)
        if len(values) >= 10 and contributors >= 10 and x1 + x2 <= 0.6 * total and total - x1 - x2 >= 0.25 * x1:
            alone.add(key)
    verdict = suppress(people_by(adult(), occupation), k=10, everyone=len(adult()),
                       contributors={"gains": people_by(adult(), occupation, lambda row: row["capital_gain"] != 0)},
                       sums={"gains": parts}, magnitudes=_magnitudes(params))
    assert set(cells) - verdict.primary == alone  # the oracle's primary verdicts are the rules written out here
    expected = {key: (sum(cells[key]), len(cells[key])) for key in verdict.released}
    got = {key: (int(g), int(n)) for key, g, n in run(db, sql)}
    assert got == expected
    assert 0 < len(got) < len(alone) < len(cells), "primary and complementary suppression both withheld groups"


def test_rest_row_obeys_the_same_rules(db: psycopg.Connection) -> None:
    rows = _create_visits(db)
    everyone = len({r[0] for r in rows})  # N is the FROM clause's people: visits holds 53, not adult's 30,162
    assert everyone == 53
    months = "SELECT visit_month, count(*), sum(cost) FROM visits {where} GROUP BY visit_month ORDER BY 1"

    def expected(keep: Callable[[tuple[int, str, int]], bool], k: int,
                 params: dict[str, object]) -> list[tuple[str | None, str, str]]:
        """The oracle's answer: the released months, then (ORDER BY 1: NULL last) the rest row if released."""
        kept = [r for r in rows if keep(r)]
        groups, contributors, sums = _visit_facts(kept)
        verdict = suppress(groups, k=k, everyone=everyone, contributors=contributors, sums=sums,
                           magnitudes=_magnitudes(params), rest=True)
        answer: list[tuple[str | None, str, str]] = [
            (m, str(sum(1 for r in kept if r[1] == m)), str(sum(r[2] for r in kept if r[1] == m)))
            for m in sorted(verdict.released)]
        if verdict.rest:
            withheld = [r for r in kept if r[1] in verdict.withheld]
            answer.append((None, str(len(withheld)), str(sum(r[2] for r in withheld))))
        return answer

    grand_total = [(str(len(rows)), str(sum(r[2] for r in rows)))]
    # Dominance (2, 80%) withholds B, C, D and F alone; person 1 dominates them together, with A too, and only
    # everything together passes (test_dominance_and_p_percent_rules): no month is released, and the rest row is
    # the total over all 53 people of visits, which the scalar query answers too.
    params: dict[str, object] = {"k": 10, "dominance_n": 2, "dominance_percent": 80}
    role = suppress_role(**params, suppressed_rest=True)
    got = run(db, rewritten(months.format(where=""), role=role))
    assert got == expected(lambda r: True, 10, params) == [(None, *grand_total[0])]
    assert run(db, rewritten("SELECT count(*), sum(cost) FROM visits", role=role)) == grand_total
    # Without person 1, the p% rule (20%) withholds C and D, k withholds F; together (29 people, largest
    # contributions 600 and 500 of 2005) they pass, but the released rows and the rest row would cover 52 of the
    # 53 people of visits, a total the scalar query withholds: no rest row.
    params = {"k": 10, "p_percent": 20}
    role = suppress_role(**params, suppressed_rest=True)
    got = run(db, rewritten(months.format(where="WHERE person_id <> 1"), role=role))
    assert got == expected(lambda r: r[0] != 1, 10, params) == [
        ("A", "11", "1100"), ("B", "11", "110"), ("E", "13", "1000")]
    assert run(db, rewritten("SELECT count(*), sum(cost) FROM visits WHERE person_id <> 1", role=role)) == []
    # Leaving 11 people out (1 and 39 to 48): E keeps 2 people and is withheld by k too; the rest (C, D, E, F:
    # 31 people, 32 visits, 2005 in total, largest contributions 600 and 500: 2205 - 1100 >= 0.2 * 600) is
    # released, and the answer covers 42 <= 43 people.
    where = "WHERE person_id <> 1 AND person_id NOT BETWEEN 39 AND 48"
    got = run(db, rewritten(months.format(where=where), role=role))
    assert got == expected(lambda r: r[0] != 1 and not 39 <= r[0] <= 48, 10, params) == [
        ("A", "11", "1100"), ("B", "11", "110"), (None, "32", "2005")]
    # k = 13 withholds every month (12 people each at most): the rest row is the total over all 53 people of
    # visits, released as the scalar query is; without person 1 it would cover 52 of them, and neither is.
    role = suppress_role(k=13, suppressed_rest=True)
    assert run(db, rewritten(months.format(where=""), role=role)) == expected(lambda r: True, 13, {}) == [
        (None, *grand_total[0])]
    assert run(db, rewritten("SELECT count(*), sum(cost) FROM visits", role=role)) == grand_total
    assert run(db, rewritten(months.format(where="WHERE person_id <> 1"), role=role)) == expected(
        lambda r: r[0] != 1, 13, {}) == []
    assert run(db, rewritten("SELECT count(*), sum(cost) FROM visits WHERE person_id <> 1", role=role)) == []


def test_join_along_the_declared_key(db: psycopg.Connection) -> None:
    rows = _create_visits(db)
    sql = rewritten("SELECT a.sex, count(*), count(DISTINCT v.person_id), sum(v.cost) "
                    "FROM visits v JOIN adult a ON v.person_id = a.id GROUP BY a.sex ORDER BY 1",
                    role=suppress_role(k=3))
    sex = {int(r["id"]): r["sex"] for r in adult()}  # type: ignore[call-overload]
    visits: dict[object, list[tuple[int, int]]] = defaultdict(list)
    for person, _, cost in rows:
        visits[sex[person]].append((person, cost))
    everyone = len({person for person, _, _ in rows})  # N: the people of the join, 53
    people = {s: {p for p, _ in v} for s, v in visits.items()}
    contributors = {"count_distinct": people,  # count(DISTINCT person_id): the non-null ids
                    "sum": {s: {p for p, c in v if c != 0} for s, v in visits.items()}}
    verdict = suppress(people, k=3, everyone=everyone, contributors=contributors)
    expected = sorted((s, len(v), len(people[s]), sum(c for _, c in v))
                      for s, v in visits.items() if s in verdict.released)
    assert [(s, int(n), int(d), int(c)) for s, n, d, c in run(db, sql)] == expected
    assert len(expected) == 2  # 50 men and 3 women: both 3 or more, and both leave 3 or more of the 53 out
    # With k = 20 the men are too many people of the 53: their total is the whole join's but 3 women's.
    assert suppress(people, k=20, everyone=everyone, contributors=contributors).released == set()
    assert run(db, rewritten("SELECT a.sex, count(*), count(DISTINCT v.person_id), sum(v.cost) "
                             "FROM visits v JOIN adult a ON v.person_id = a.id GROUP BY a.sex ORDER BY 1",
                             role=suppress_role(k=20))) == []


def test_suppression_counts_people_not_rows(db: psycopg.Connection) -> None:
    rows = _create_visits(db)
    # Seven more people in F, so that every month holds 12 people and none is withheld for another's sake.
    more = [(p, "F", 1) for p in range(54, 61)]
    with db.cursor() as cursor:
        cursor.executemany("INSERT INTO public.visits VALUES (%s, %s, %s)", more)
    rows += more
    groups, _, _ = _visit_facts(rows)
    visits = Counter(month for _, month, _ in rows)
    assert {m: len(p) for m, p in groups.items()} == dict.fromkeys("ABCDEF", 12)
    assert visits["B"] == visits["E"] == 13  # person 1 visited twice in B, person 37 twice in E
    sql = rewritten("SELECT visit_month, count(*) FROM visits GROUP BY 1 ORDER BY 1", role=suppress_role(k=12))
    assert suppress(groups, k=12, everyone=60).released == set("ABCDEF")
    assert run(db, sql) == [(m, str(visits[m])) for m in "ABCDEF"]
    # B and E have 13 visits but 12 people: with k = 13 they are withheld although count(*) = 13.
    assert suppress(groups, k=13, everyone=60).released == set()
    assert run(db, rewritten("SELECT visit_month, count(*) FROM visits GROUP BY 1 ORDER BY 1",
                             role=suppress_role(k=13))) == []


def test_linked_table_alone_uses_the_people_count_for_query_set_size(db: psycopg.Connection) -> None:
    rows = _create_visits(db)
    expensive = [r for r in rows if r[2] >= 100]
    people = {r[0] for r in expensive}
    assert len(people) >= 10
    assert run(db, rewritten("SELECT count(*) FROM visits WHERE cost >= $1"), [100]) == [(str(len(expensive)),)]
    assert run(db, rewritten("SELECT count(*) FROM visits WHERE cost >= $1"), [1000]) == []


def test_parameters_bind_on_the_server(db: psycopg.Connection) -> None:
    role = suppress_role(k=10, dominance_n=2, dominance_percent=90, suppressed_rest=True)
    sql = rewritten("SELECT sex, count(*), sum(hours_per_week) FROM adult WHERE age > $1 AND workclass = $2 "
                    "GROUP BY sex ORDER BY 1 LIMIT $3", role=role)
    assert sql.count("$1") >= 3 and "$2" in sql and "LIMIT $3" in sql  # every copy of WHERE keeps them
    chosen = lambda r: int(r["age"]) > 60 and r["workclass"] == "State-gov"  # type: ignore  # noqa: E731
    selected = [r for r in adult() if chosen(r)]
    sex = lambda r: r["sex"]  # noqa: E731
    hours = {s: {r["id"]: int(r["hours_per_week"]) for r in selected if r["sex"] == s}  # type: ignore
             for s in {r["sex"] for r in selected}}
    verdict = suppress(people_by(adult(), sex, chosen), k=10, everyone=len(adult()),
                       contributors={"sum": people_by(adult(), sex, lambda r: chosen(r) and r["hours_per_week"] != 0)},
                       sums={"sum": hours}, magnitudes=Magnitudes((2, 90)), rest=True)
    expected = [(s, str(len(hours[s])), str(sum(hours[s].values()))) for s in sorted(verdict.released)]
    if verdict.rest:  # ORDER BY 1: the rest row's NULL comes last
        withheld = [r for r in selected if r["sex"] in verdict.withheld]
        expected.append((None, str(len(withheld)), str(sum(int(r["hours_per_week"]) for r in withheld))))
    assert len(expected) >= 2
    assert run(db, sql, [60, "State-gov", 5]) == expected
    assert run(db, sql, [60, "State-gov", 1]) == expected[:1]


ROW_DESCRIPTION_QUERIES = [
    "SELECT native_country, count(*) FROM adult GROUP BY 1",
    ('SELECT sex AS "Sex", race, count(*) AS n, avg(hours_per_week), sum(capital_gain), sum(age)::int AS s, '
    "count(DISTINCT education) FROM adult WHERE age > $1 GROUP BY sex, race ORDER BY n DESC LIMIT $2"),
    "SELECT width_bucket(age, 0, 100, 10), extract(year FROM date '2020-01-01'), count(*) FROM adult GROUP BY 1",
    ("SELECT CASE WHEN age < 40 THEN 'young' ELSE 'old' END, coalesce(workclass, '?') AS w, "
    "'constant' AS c, $1::text AS label, avg(capital_loss)::numeric(10,2) FROM adult GROUP BY 1, 2"),
    "SELECT count(*), avg(age), sum(fnlwgt) FROM adult WHERE native_country = $1",
    "SELECT DISTINCT lower(sex) FROM adult",
    "SELECT date_trunc('month', DATE '2024-05-17') AS m, upper(income), count(*) FROM adult GROUP BY 2",
    "SELECT count(*)::int AS n, sum(capital_gain)::bigint, (avg(age))::float4 FROM adult WHERE age > 30",
    "SELECT $1 AS label, sex, count(*) FROM adult WHERE age BETWEEN $2 AND $3 GROUP BY 2",
]


@pytest.mark.parametrize("sql", ROW_DESCRIPTION_QUERIES)
@pytest.mark.parametrize("params", [{"k": 10}, {"k": 10, "dominance_n": 2, "dominance_percent": 85, "p_percent": 5,
                                                     "suppressed_rest": True}])
def test_row_description_is_unchanged(db: psycopg.Connection, sql: str, params: dict[str, object]) -> None:
    """The names, types and typmods of the result, and the parameter types, are those of the client's query."""
    new = rewritten(sql, role=suppress_role(**params))
    assert describe(db, new) == describe(db, sql)


def test_rewritten_sql_runs_for_every_dashboard_query(db: psycopg.Connection) -> None:
    _create_visits(db)
    role = suppress_role(k=10, dominance_n=2, dominance_percent=80, p_percent=10, suppressed_rest=True)
    for sql in DASHBOARD_QUERIES:
        decision = decide(sql, role, POLICY)
        text = decision.sql if isinstance(decision, Rewrite) else sql
        if "$" in text:
            describe(db, text)
        elif not text.startswith("SET"):
            run(db, text)


def test_released_groups_are_a_hashed_lookup(db: psycopg.Connection) -> None:
    """The cells shape stays linear in the number of groups: the IN over ARRAY[key] is a hashed subplan."""
    role = suppress_role(k=10, dominance_n=2, dominance_percent=80, p_percent=10, suppressed_rest=True)
    sql = rewritten("SELECT education, sex, count(*), sum(capital_gain) FROM adult GROUP BY 1, 2", role=role)
    plan = "\n".join(row[0] for row in db.execute("EXPLAIN " + sql).fetchall())
    assert "hashed SubPlan" in plan, plan
    start = time.perf_counter()
    rows = run(db, sql)
    elapsed = time.perf_counter() - start
    print(f"\ncells shape with dominance, p% and rest row over 30,162 rows: {len(rows)} rows in {elapsed * 1000:.0f} ms")
    assert rows


def test_postgresql_agrees_with_the_classifier_on_names(db: psycopg.Connection) -> None:
    """What the Pass cases above rely on, checked against PostgreSQL itself."""
    with pytest.raises(psycopg.errors.UndefinedTable, match='relation "ad" does not exist'):
        db.execute("select * from ad/**/ult")
    with pytest.raises(psycopg.errors.UndefinedTable, match='relation "Adult" does not exist'):
        db.execute('select * from "Adult"')
    assert db.execute("SELECT a$$b FROM (SELECT 1 AS a$$b) AS t").fetchone() == (1,)  # one identifier
    assert db.execute("SELECT E'it\\'s; x'").fetchone() == ("it's; x",)
    assert db.execute("SELECT 1 /* a /* b */ c */").fetchone() == (1,)


def test_pg_stats_hides_protected_columns(db: psycopg.Connection) -> None:
    """Passing pg_stats is safe because PostgreSQL filters it by column privilege."""
    db.execute("ANALYZE public.adult")
    db.execute("DROP ROLE IF EXISTS rewrite_analyst")
    db.execute("CREATE ROLE rewrite_analyst")
    db.execute("GRANT REFERENCES ON public.adult TO rewrite_analyst")
    try:
        db.execute("SET ROLE rewrite_analyst")
        rows = db.execute("SELECT attname FROM pg_stats WHERE tablename = 'adult'").fetchall()
        db.execute("RESET ROLE")
        assert rows == []
        assert db.execute("SELECT count(*) FROM pg_stats WHERE tablename = 'adult'").fetchone()[0] > 0  # type: ignore
    finally:
        db.execute("RESET ROLE")
        db.execute("REVOKE ALL ON public.adult FROM rewrite_analyst")
        db.execute("DROP ROLE rewrite_analyst")


def test_select_list_is_computed_only_for_groups_that_pass_having(db: psycopg.Connection) -> None:
    """Why a cast of an aggregate may stand in the select list: PostgreSQL projects only groups HAVING keeps."""
    rows = db.execute("SELECT g, 1 / (count(*) - 1) FROM (VALUES ('a'), ('b'), ('b')) AS t(g) GROUP BY g "
                      "HAVING count(*) > 1").fetchall()
    assert rows == [("b", 1)]


def test_the_division_side_channel_is_real(db: psycopg.Connection) -> None:
    """Why 1/0 is refused: PostgreSQL raises only when the hidden condition holds for some row."""
    probe = "SELECT count(*) FROM adult WHERE CASE WHEN id = 17 AND income = %s THEN 1/(age - age) ELSE 1 END = 1"
    income = next(r["income"] for r in adult() if r["id"] == 17)
    other = ">50K" if income == "<=50K" else "<=50K"
    db.execute(probe, (other,))
    with pytest.raises(psycopg.errors.DivisionByZero):
        db.execute(probe, (income,))


def test_targeted_aggregates_are_suppressed(db: psycopg.Connection) -> None:
    """An aggregate that only one person feeds is withheld, in every group, so its absence tells nothing."""
    person = next(r for r in adult() if r["age"] == 90 and r["native_country"] == "Philippines")
    assert sum(1 for r in adult() if r["age"] == 90 and r["native_country"] == "Philippines") == 1
    target = "age = 90 AND native_country = 'Philippines'"
    for item in (f"count(CASE WHEN {target} THEN 1 END)", f"avg(CASE WHEN {target} THEN hours_per_week END)",
                 f"sum(CASE WHEN {target} THEN capital_gain ELSE 0 END)"):
        assert run(db, rewritten(f"SELECT income, count(*), {item} FROM adult GROUP BY income")) == [], item
    assert person["income"] in {"<=50K", ">50K"}


def test_known_limit_differencing(db: psycopg.Connection) -> None:
    """Suppression is not a guarantee: two released answers that differ by one person reveal that person.

    Kept as a test so that docs/suppression.md stays true: this attack works and is documented, not fixed.
    """
    # Within one answer, complementary suppression covers the plain form: over everyone but person 17, the
    # released rows would add up to the public total minus that person, so only the larger group is released.
    incomes = Counter(r["income"] for r in adult())
    without_17 = dict(run(db, rewritten("SELECT income, count(*) FROM adult WHERE id <> 17 GROUP BY income")))
    assert set(without_17) == {max(incomes, key=lambda income: incomes[income])}
    # Across two answers it does not: each of these leaves at least k people out (10 and 11 of them), both
    # release both groups, and the two differ by person 17 alone.
    everyone = dict(run(db, rewritten("SELECT income, count(*) FROM adult WHERE id > 10 GROUP BY income")))
    without_17 = dict(run(db, rewritten("SELECT income, count(*) FROM adult WHERE id > 10 AND id <> 17 "
                                        "GROUP BY income")))
    assert set(everyone) == set(without_17) == set(incomes)
    differs = [income for income in everyone if everyone[income] != without_17[income]]
    assert differs == [next(r["income"] for r in adult() if r["id"] == 17)]
    assert int(everyone[differs[0]]) - int(without_17[differs[0]]) == 1
