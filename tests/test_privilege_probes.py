"""Privilege probes through the gated proxy: BI tools see SELECT on the tables the proxy answers for.

`reporter` (suppress) and `analyst` (dp) hold only REFERENCES on public.adult; the proxy answers their
aggregate queries over it. has_table_privilege & co. and the information_schema privilege views, asked
through the proxy, must say SELECT for it, keep PostgreSQL's answer everywhere else (other privileges,
other tables) and its errors; direct SELECT stays denied inside PostgreSQL.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import psycopg
import pytest
from conftest import Endpoint
from psycopg import sql

from anonproxy.embedded import EmbeddedPostgres

ROLES = ("reporter", "analyst")
GATED = ("adult", "visits")  # the demo's protected table and its linked table, answered for the gated roles

# Metabase's postgres driver, sql-jdbc sync: the table-privileges query, as it sends it.
METABASE_TABLE_PRIVILEGES = """with table_privileges as (
 select
   NULL as role,
   t.schemaname as schema,
   t.objectname as table,
   pg_catalog.has_table_privilege(current_user, '"' || t.schemaname || '"' || '.' || '"' || t.objectname || '"',  'UPDATE') as update,
   pg_catalog.has_table_privilege(current_user, '"' || t.schemaname || '"' || '.' || '"' || t.objectname || '"',  'SELECT') as select,
   pg_catalog.has_table_privilege(current_user, '"' || t.schemaname || '"' || '.' || '"' || t.objectname || '"',  'INSERT') as insert,
   pg_catalog.has_table_privilege(current_user, '"' || t.schemaname || '"' || '.' || '"' || t.objectname || '"',  'DELETE') as delete
 from (
   select schemaname, tablename as objectname from pg_catalog.pg_tables
   union
   select schemaname, viewname as objectname from pg_catalog.pg_views
   union
   select schemaname, matviewname as objectname from pg_catalog.pg_matviews
 ) t
 where t.schemaname !~ '^pg_'
   and t.schemaname <> 'information_schema'
   and pg_catalog.has_schema_privilege(current_user, t.schemaname, 'USAGE')
)
select t.*
from table_privileges t"""  # noqa: E501


def through(proxy: Endpoint, dbname: str, role: str, **kwargs: object) -> psycopg.Connection:
    return psycopg.connect(proxy.dsn(dbname, user=role), autocommit=True, **kwargs)


def as_role(truth: psycopg.Connection, role: str, query: str, params: tuple[object, ...] = ()) -> list[tuple]:
    truth.execute(sql.SQL("set role {}").format(sql.Identifier(role)))
    try:
        return truth.execute(query, params).fetchall()
    finally:
        truth.execute("reset role")


def oid_of(truth: psycopg.Connection, role: str) -> int:
    return truth.execute("select oid from pg_roles where rolname = %s", [role]).fetchone()[0]


@pytest.mark.parametrize("role", ROLES)
def test_metabase_sync_lists_the_protected_table(gated_proxy: Endpoint, gated_database: str,
                                                 truth: psycopg.Connection, role: str) -> None:
    with through(gated_proxy, gated_database, role) as conn:
        got = conn.execute(METABASE_TABLE_PRIVILEGES).fetchall()
        names = [column.name for column in conn.execute(METABASE_TABLE_PRIVILEGES).description]
    assert names == ["role", "schema", "table", "update", "select", "insert", "delete"]
    expected = as_role(truth, role, METABASE_TABLE_PRIVILEGES)
    assert ("public", "adult") in {(row[1], row[2]) for row in expected}
    for table in GATED:  # what PostgreSQL says: Metabase would hide them
        assert [row for row in expected if row[1:3] == ("public", table)] == \
            [(None, "public", table, False, False, False, False)]
    wanted = [(None, *row[1:3], False, True, False, False) if row[1] == "public" and row[2] in GATED else row
              for row in expected]
    assert sorted(got, key=str) == sorted(wanted, key=str)


def _calls(role_oid: int) -> list[tuple[str, tuple[object, ...]]]:
    """Every overload of the three functions, by name or oid, with and without the role, on public.adult."""
    table = "public.adult"
    by_oid = "'public.adult'::regclass::oid"
    calls: list[tuple[str, tuple[object, ...]]] = []
    for schema in ("", "pg_catalog."):
        for role_arg in (None, "'{role}'::name", f"{role_oid}::oid"):
            for table_arg in ("%s::text", by_oid):
                prefix = "" if role_arg is None else role_arg + ", "
                for function in ("has_table_privilege", "has_any_column_privilege"):
                    calls.append((f"{schema}{function}({prefix}{table_arg}, %s)", (table,) * ("%s" in table_arg)))
                for column_arg in ("'age'", "2::smallint"):
                    calls.append((f"{schema}has_column_privilege({prefix}{table_arg}, {column_arg}, %s)",
                                  (table,) * ("%s" in table_arg)))
    return calls


@pytest.mark.parametrize("role", ROLES)
def test_every_overload_says_select_and_nothing_more(gated_proxy: Endpoint, gated_database: str,
                                                    truth: psycopg.Connection, role: str) -> None:
    calls = _calls(oid_of(truth, role))
    assert len(calls) == 2 * 3 * 2 * 4  # 24 overloads, unqualified and qualified with pg_catalog
    privileges = {"SELECT": True, "select": True, " Select , INSERT": True, "INSERT": False, "UPDATE": False,
                  "SELECT WITH GRANT OPTION": False, "REFERENCES": None}
    with through(gated_proxy, gated_database, role) as conn:
        for call, arguments in calls:
            text = "select " + call.replace("{role}", role)
            for privilege, answer in privileges.items():
                got = conn.execute(text, (*arguments, privilege)).fetchone()[0]
                postgres = as_role(truth, role, text, (*arguments, privilege))[0][0]
                if answer is None:
                    assert got is postgres is True, (text, privilege)  # REFERENCES is really granted
                else:
                    assert got is answer, (text, privilege, got)
                    assert postgres is False, (text, privilege)


@pytest.mark.parametrize("role", ROLES)
def test_other_tables_keep_postgresql_answers(gated_proxy: Endpoint, gated_database: str,
                                              truth: psycopg.Connection, role: str) -> None:
    """Every table of the database and every privilege type: the proxy changes only (adult, SELECT) and (visits,
    SELECT), the protected table and its linked table."""
    relations = "from pg_class c cross join (values {}) p (kind) where c.relkind in ('r', 'v', 'm', 'p', 'f') "
    table = ("select c.oid::regclass::text, p.kind, has_table_privilege(c.oid, p.kind) " + relations.format(
        "('SELECT'), ('INSERT'), ('UPDATE'), ('DELETE'), ('TRUNCATE'), ('REFERENCES'), ('TRIGGER')"))
    columns = ("select c.oid::regclass::text, p.kind, has_any_column_privilege(c.oid, p.kind) " + relations.format(
        "('SELECT'), ('INSERT'), ('UPDATE'), ('REFERENCES')"))
    query = f"{table} union all {columns} order by 1, 2, 3"
    with through(gated_proxy, gated_database, role) as conn:
        got = conn.execute(query).fetchall()
    expected = as_role(truth, role, query)
    assert len(got) == len(expected) > 100
    changed = [(a, b) for a, b in zip(got, expected, strict=True) if a != b]
    assert changed == [((table, "SELECT", True), (table, "SELECT", False)) for table in GATED for _ in range(2)]


@pytest.mark.parametrize("role", ROLES)
def test_errors_stay_errors(gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection, role: str) -> None:
    cases = [
        ("select has_table_privilege('public.no_such_table', 'select')", "42P01"),
        ("select pg_catalog.has_table_privilege('adult', 'selekt')", "22023"),
        ("select has_table_privilege('adult', 'select with grant')", "22023"),
        ("select has_table_privilege('no_such_role', 'adult', 'select')", "42704"),
        ("select has_column_privilege('adult', 'no_such_column', 'select')", "42703"),
        ("select has_any_column_privilege('adult', 'usage')", "22023"),
        ("select has_column_privilege('adult', 'age', 'delete')", "22023"),
        ("select * from information_schema.table_privileges where no_such_column", "42703"),
    ]
    with through(gated_proxy, gated_database, role) as conn:
        for query, sqlstate in cases:
            with pytest.raises(psycopg.Error) as raised:
                conn.execute(query)
            assert raised.value.sqlstate == sqlstate, query
            truth.execute(sql.SQL("set role {}").format(sql.Identifier(role)))
            try:
                with pytest.raises(psycopg.Error) as direct:
                    truth.execute(query)
            finally:
                truth.execute("reset role")
            assert direct.value.sqlstate == sqlstate, query
        # A missing oid or column number: NULL, as in PostgreSQL.
        assert conn.execute("select has_table_privilege(0::oid, 'select'), "
                            "has_column_privilege('adult', 999::smallint, 'select')").fetchone() == (None, None)


@pytest.mark.parametrize("role", ROLES)
def test_direct_select_stays_denied(pg_server: EmbeddedPostgres, gated_database: str, gated_proxy: Endpoint,
                                    role: str) -> None:
    with through(gated_proxy, gated_database, role) as conn:
        assert conn.execute("select has_table_privilege('adult', 'select')").fetchone() == (True,)
    # The same role straight to PostgreSQL: the probe says no (PostgreSQL's own), and so does SELECT.
    with psycopg.connect(pg_server.conninfo(dbname=gated_database, user=role, password=role),
                         autocommit=True) as conn:
        assert conn.execute("select has_table_privilege('adult', 'select')").fetchone() == (False,)
        assert conn.execute("select anonproxy.has_table_privilege('adult', 'select')").fetchone() == (True,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("select count(*) from adult")


@pytest.mark.parametrize("role", ROLES)
def test_information_schema_privilege_views(gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection,
                                            role: str) -> None:
    owner = truth.execute("select pg_get_userbyid(relowner) from pg_class where oid = 'public.adult'::regclass"
                          ).fetchone()[0]
    columns = [row[0] for row in truth.execute(
        "select attname from pg_attribute where attrelid = 'public.adult'::regclass and attnum > 0 "
        "and not attisdropped order by attnum")]
    with through(gated_proxy, gated_database, role) as conn:
        for view, table in ((view, table) for view in ("table_privileges", "role_table_grants") for table in GATED):
            query = (f"select grantor, grantee, table_catalog, table_schema, table_name, privilege_type, is_grantable, "
                     f"with_hierarchy from information_schema.{view} where table_name = %s "
                     "order by privilege_type")
            got = conn.execute(query, [table]).fetchall()
            assert got == [(owner, role, gated_database, "public", table, "REFERENCES", "NO", "NO"),
                           (owner, role, gated_database, "public", table, "SELECT", "NO", "YES")], view
            assert as_role(truth, role, query, (table,)) == got[:1], view  # PostgreSQL's own: REFERENCES only
        for view in ("column_privileges", "role_column_grants"):
            query = (f'select column_name, privilege_type from "information_schema"."{view}" '
                     "where table_schema = 'public' and table_name = 'adult' and grantee = %s "
                     "order by column_name, privilege_type")
            got = conn.execute(query, [role]).fetchall()
            assert got == sorted([(c, "REFERENCES") for c in columns] + [(c, "SELECT") for c in columns]), view
        # Other tables: exactly PostgreSQL's rows.
        other = ("select table_schema, table_name, privilege_type from information_schema.table_privileges "
                 "where table_name not in ('adult', 'visits') order by 1, 2, 3")
        assert conn.execute(other).fetchall() == as_role(truth, role, other)


@pytest.mark.parametrize("role", ROLES)
def test_extended_protocol_keeps_parameter_types_and_formats(gated_proxy: Endpoint, gated_database: str,
                                                             role: str) -> None:
    with through(gated_proxy, gated_database, role, prepare_threshold=0) as conn:
        for _ in range(3):  # prepared once, executed again
            assert conn.execute("select has_table_privilege(%s::name, %s, 'select'), has_column_privilege(%s, %s, "
                                "'select')", [role, "public.adult", "adult", "age"]).fetchone() == (True, True)
        with conn.cursor(binary=True) as cursor:
            cursor.execute("select has_table_privilege(%s::oid, 'select'), %s::int8",
                           [conn.execute("select 'public.adult'::regclass::oid").fetchone()[0], 7])
            assert cursor.fetchone() == (True, 7)
        # A parameter typed by the client (int2 column number) keeps its type: the smallint overload.
        with conn.cursor() as cursor:
            cursor.execute("select has_column_privilege('adult', %b, 'select')", [psycopg.types.numeric.Int2(2)])
            assert cursor.fetchone() == (True,)


def test_probes_in_a_multi_statement_message(gated_proxy: Endpoint, gated_database: str) -> None:
    with through(gated_proxy, gated_database, "reporter") as conn:
        cursor = conn.cursor()
        cursor.execute(b"select 1 as one; select has_table_privilege('adult', 'select') as probe; select 2")
        answers = []
        while True:
            answers.append(cursor.fetchall())
            if not cursor.nextset():
                break
        assert answers == [[(1,)], [(True,)], [(2,)]]


def test_linked_tables_are_answered_for(truth: psycopg.Connection) -> None:
    """The SQL side on its own: a linked table counts like the protected one (rolled back)."""
    with truth.transaction(force_rollback=True):
        truth.execute("create table public.probe_visits (person int, at date)")
        truth.execute("select anonproxy.link_table('public.probe_visits', 'person', 'public.adult')")
        truth.execute("select anonproxy.apply_grants()")
        truth.execute("set local role reporter")
        row = truth.execute("select anonproxy.has_table_privilege('public.probe_visits', 'select'), "
                            "pg_catalog.has_table_privilege('public.probe_visits', 'select'), "
                            "anonproxy.has_column_privilege('public.probe_visits', 'at', 'select'), "
                            "(select count(*) from anonproxy.table_privileges where table_name = 'probe_visits' "
                            "and privilege_type = 'SELECT')").fetchone()
        assert row == (True, False, True, 1)


def test_direct_and_denied_roles_keep_postgresql_answers(truth: psycopg.Connection) -> None:
    dba = truth.execute("select anonproxy.has_table_privilege('dba', 'public.adult', 'insert'), "
                        "pg_catalog.has_table_privilege('dba', 'public.adult', 'insert'), "
                        "anonproxy.has_table_privilege('public', 'public.adult', 'select')").fetchone()
    assert dba == (dba[1], dba[1], False)


def test_pgjdbc_metadata(gated_proxy: Endpoint, gated_database: str) -> None:
    """pgjdbc's DatabaseMetaData through the proxy as the reporter: getTables lists adult, and the
    privilege probes a JDBC application sends answer for it."""
    from test_clients import jdbc_jar

    java = shutil.which("java")
    assert java, "java is needed for the JDBC tests (Debian: default-jre-headless)"
    source = Path(__file__).parent / "clients" / "JdbcProbes.java"
    done = subprocess.run([java, "-cp", jdbc_jar(), str(source), gated_proxy.host, str(gated_proxy.port),
                           gated_database], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = set(done.stdout.split())
    assert "table|public|adult" in lines
    assert {"privilege|reporter|SELECT", "privilege|reporter|REFERENCES", "privilege|analyst|SELECT"} <= lines
    assert not {line for line in lines if line.startswith("privilege|reporter|") and
                line.split("|")[2] not in ("SELECT", "REFERENCES")}
    assert {"column|reporter|SELECT", "column|analyst|SELECT"} <= lines
    assert "probe|true" in lines
    assert "prepared|true|false" in lines


@pytest.mark.parametrize("role", ROLES)
def test_access_lists_show_the_select(gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection,
                                     role: str) -> None:
    """pg_class.relacl and pg_attribute.attacl, as tools that parse them read them: SELECT added for the roles
    the proxy answers, on the protected table and its linked table only."""
    query = ("select c.oid::regclass::text, c.relacl::text[] from pg_catalog.pg_class c "
             "where c.relkind in ('r', 'v') order by 1")
    owner = truth.execute("select pg_get_userbyid(relowner) from pg_class where oid = 'public.adult'::regclass"
                          ).fetchone()[0]
    with through(gated_proxy, gated_database, role) as conn:
        got = dict(conn.execute(query).fetchall())
        columns = conn.execute("select attname, attacl::text[] from pg_attribute "
                               "where attrelid = 'public.adult'::regclass and attname = 'age'").fetchall()
    expected = dict(as_role(truth, role, query))
    assert set(got) == set(expected)
    assert {name for name in got if got[name] != expected[name]} == set(GATED)
    for table in GATED:
        assert got[table] == (expected[table] or []) + [f"analyst=r/{owner}", f"reporter=r/{owner}"], table
    assert columns == [("age", [f"analyst=r/{owner}", f"reporter=r/{owner}"])]


def test_psql_dp_shows_the_select(gated_proxy: Endpoint, gated_database: str) -> None:
    psql = shutil.which("psql")
    assert psql, "psql is needed"
    done = subprocess.run([psql, "-X", "-c", r"\dp public.adult", gated_proxy.dsn(gated_database, user="reporter")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "reporter=r/" in done.stdout and "reporter=x/" in done.stdout, done.stdout


@pytest.mark.parametrize("role", ROLES)
def test_probes_open_no_way_to_protected_rows(gated_proxy: Endpoint, gated_database: str, role: str) -> None:
    """A probe next to protected data is not relayed: the statement is decided as a query over protected
    tables (refused here); a relayed probe still runs under the client's own login."""
    refused = {
        "select has_table_privilege('adult', 'select'), (select count(*) from adult)": "0A000",
        "select * from information_schema.table_privileges, adult": "42501",
        "select count(*) from adult where has_table_privilege('adult', 'select')": None,
        "select anonproxy.has_table_privilege('adult', 'select') from adult": None,
        # A label that swallows FROM: PostgreSQL's grammar refuses it, so does the proxy.
        "select count(*) as from adult": "0A000",
    }
    with through(gated_proxy, gated_database, role) as conn:
        for query, sqlstate in refused.items():
            with pytest.raises(psycopg.Error) as raised:
                conn.execute(query).fetchall()
            assert sqlstate is None or raised.value.sqlstate == sqlstate, (query, raised.value.sqlstate)
            assert raised.value.sqlstate in ("0A000", "42501"), (query, raised.value)
        # A probe view next to a protected table: a relation outside the policy, refused.
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("select has_table_privilege('adult', 'select') "
                         "from information_schema.table_privileges t, public.adult a").fetchall()


# The shape of the table-privileges queries of administration tools such as pgAdmin: the access list of one
# table exploded in a subquery of pg_class (with outer joins to other catalogs), grouped by grantee.
ACL_BY_GRANTEE = """select coalesce(grantee_role.rolname, 'PUBLIC') as grantee,
       pg_catalog.array_agg(granted.letter order by granted.letter) as privileges
  from (select (item).grantee as grantee,
               case (item).privilege_type when 'SELECT' then 'r' when 'INSERT' then 'a' when 'UPDATE' then 'w'
                    when 'DELETE' then 'd' when 'TRUNCATE' then 'D' when 'REFERENCES' then 'x'
                    when 'TRIGGER' then 't' else '?' end as letter
          from (select pg_catalog.aclexplode(rel.relacl) as item
                  from pg_catalog.pg_class rel
                  left outer join pg_catalog.pg_namespace nsp on nsp.oid = rel.relnamespace
                 where nsp.nspname = 'public' and rel.relname = 'adult' and rel.relkind in ('r', 'p')) exploded
       ) granted
  left join pg_catalog.pg_roles grantee_role on grantee_role.oid = granted.grantee
 group by grantee_role.rolname"""


@pytest.mark.parametrize("role", ROLES)
def test_administration_tool_acl_query(gated_proxy: Endpoint, gated_database: str, truth: psycopg.Connection,
                                       role: str) -> None:
    """An access list exploded with aclexplode, as administration tools read it, shows the SELECT (r)."""
    with through(gated_proxy, gated_database, role) as conn:
        got = dict(conn.execute(ACL_BY_GRANTEE).fetchall())
    expected = dict(as_role(truth, role, ACL_BY_GRANTEE))
    assert expected["reporter"] == expected["analyst"] == ["x"]  # PostgreSQL's own: REFERENCES
    assert got == {**expected, "reporter": ["r", "x"], "analyst": ["r", "x"]}


def test_what_is_rewritten() -> None:
    """On the tree: PostgreSQL's functions (bare, pg_catalog-qualified, quoted) and the information_schema views
    are redirected; other schemas' functions, a CTE named like a view and unqualified view names are not."""
    import dataclasses

    from test_rewrite import POLICY, SUPPRESS

    from anonproxy.route.decide import decide
    from anonproxy.route.decision import Pass, Relayed

    for role in (SUPPRESS, dataclasses.replace(SUPPRESS, mode="dp")):
        metabase = decide(METABASE_TABLE_PRIVILEGES, role, POLICY)
        assert isinstance(metabase, Relayed)
        assert metabase.sql.count("anonproxy.has_table_privilege(") == 4 and "pg_catalog.has_table" not in metabase.sql
        assert "pg_catalog.has_schema_privilege(" in metabase.sql and "FROM table_privileges AS t" in metabase.sql
        quoted = decide('select "pg_catalog"."has_table_privilege"(\'adult\', \'select\')', role, POLICY)
        assert isinstance(quoted, Relayed) and "anonproxy.has_table_privilege(" in quoted.sql
        for text in ("select myschema.has_table_privilege('adult', 'select')",
                     "select * from table_privileges", "select * from myschema.column_privileges",
                     "select has_schema_privilege('public', 'usage')", "select relname from pg_class"):
            assert decide(text, role, POLICY) == Pass(), text
        assert decide("select * from information_schema.role_column_grants", role, POLICY) == Relayed(
            "SELECT * FROM anonproxy.role_column_grants")
        assert decide("select relacl from pg_catalog.pg_class", role, POLICY) == Relayed(
            'SELECT anonproxy.relacl("pg_class"."oid", "pg_class"."relacl") FROM pg_catalog.pg_class')
