"""`anonproxy policy lint --dsn …` on a real database: declared bounds that are values of fewer than k people.

The command runs as a child process against a fresh copy of the sample data.
The demo policy (bounds from the codebook, rounded outward) gets no warning;
a policy whose bounds are the data's exact extremes gets one warning per
bound that 1 to k − 1 people hold, with counts computed here in Python from
the rows themselves.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from conftest import Endpoint, ProxyProcess, wait_for_current_policy

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import (
    ColumnPolicy,
    LinkedTable,
    Policy,
    RolePolicy,
    SuppressionParams,
)
from anonproxy.policy.yaml_policy import apply_policy, demo_policy, dump_policy

_roles = itertools.count(1)
BOUNDED = ("age", "fnlwgt", "education_num", "capital_gain", "capital_loss", "hours_per_week")
WARNING = re.compile(r"^warning: (?P<table>\w+\.\w+)\.(?P<column>\w+): (?P<side>lower|upper) bound (?P<value>\S+) "
                     r"is a value (?P<count>\d+) (?:person holds|people hold) \(fewer than k = (?P<k>\d+)\)")


@pytest.fixture
def owner_dsn(pg_server: EmbeddedPostgres, dbname: str) -> str:
    return pg_server.conninfo(dbname=dbname)


@pytest.fixture
def service(postgresql: psycopg.Connection) -> Iterator[str]:
    """A service role of this test's own (the shared one's password must not change under the gated proxy)."""
    role = f"lint_svc_{next(_roles)}_{os.getpid()}"
    postgresql.execute(f"create role {role} login")
    postgresql.commit()
    yield role
    postgresql.rollback()
    postgresql.execute(f"drop owned by {role}")
    postgresql.execute(f"drop role {role}")
    postgresql.commit()


def lint(dsn: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "anonproxy.cli", "policy", "lint", "--dsn", dsn],
                          capture_output=True, text=True, timeout=120)


def findings(output: str) -> set[tuple[str, str, str, Decimal, int, int]]:
    found = set()
    for line in output.splitlines():
        if line.startswith("warning:"):
            match = WARNING.match(line)
            assert match, line
            found.add((match["table"], match["column"], match["side"], Decimal(match["value"]), int(match["count"]),
                       int(match["k"])))
    return found


def holders(rows: list[tuple[int, object]], value: Decimal) -> int:
    """Distinct people whose value is exactly ``value``, counted in Python."""
    return len({person for person, held in rows if held is not None and Decimal(str(held)) == value})


def test_the_demo_policy_gets_no_warning(postgresql: psycopg.Connection, owner_dsn: str, service: str) -> None:
    apply_policy(postgresql, replace(demo_policy(), service_role=service))
    postgresql.commit()
    done = lint(owner_dsn)
    assert done.returncode == 0, done.stdout + done.stderr
    assert findings(done.stdout) == set()
    assert "16 declared bound(s) checked against k = 10: 0 warning(s)" in done.stdout, done.stdout


def test_exact_extremes_are_reported_with_their_counts(postgresql: psycopg.Connection, owner_dsn: str,
                                                        service: str) -> None:
    # A linked table where people have several rows: counts are of people, not rows.
    postgresql.execute("create table public.stays (person_id integer, minutes integer)")
    postgresql.execute("insert into public.stays select id, case when id % 2991 = 0 then 500 else 10 + id % 7 end "
                       "from public.adult where id % 3 = 0")
    postgresql.execute("insert into public.stays select person_id, minutes from public.stays")  # every row twice
    extremes = {name: postgresql.execute(f"select min({name}), max({name}) from public.adult").fetchone()
                for name in BOUNDED}
    adult = demo_policy().tables["public.adult"]
    columns = {name: replace(column, lower=float(extremes[name][0]), upper=float(extremes[name][1]))
               if name in extremes else column for name, column in adult.columns.items()}
    stays = LinkedTable("public.stays", "person_id", "public.adult", "id",
                         columns={"minutes": ColumnPolicy("minutes", "sensitive", 10, 500)})
    roles = {"reporter": RolePolicy("reporter", "suppress", SuppressionParams(k=10)),
             "analyst": RolePolicy("analyst", "suppress", SuppressionParams(k=40))}  # the largest k counts
    policy = Policy(tables={"public.adult": replace(adult, columns=columns)}, links={"public.stays": stays},
                    roles=roles, service_role=service)
    apply_policy(postgresql, policy)
    postgresql.commit()

    expected = set()
    for table, column, unit, lower, upper in [
        *(("public.adult", name, "id", low, high) for name, (low, high) in extremes.items()),
        ("public.stays", "minutes", "person_id", 10, 500),
    ]:
        rows = postgresql.execute(f"select {unit}, {column} from {table}").fetchall()
        for side, value in (("lower", Decimal(lower)), ("upper", Decimal(upper))):
            count = holders(rows, value)
            if 0 < count < 40:
                expected.add((table, column, side, value, count, 40))
    # The data's extremes include values a single person holds (as the old demo policy's bounds were).
    assert any(count == 1 for *_, count, _ in expected), expected
    assert ("public.stays", "minutes", "upper", Decimal(500), holders(
        postgresql.execute("select person_id, minutes from public.stays").fetchall(), Decimal(500)), 40) in expected

    done = lint(owner_dsn)
    assert done.returncode == 1, done.stdout + done.stderr
    assert findings(done.stdout) == expected
    assert f"14 declared bound(s) checked against k = 40: {len(expected)} warning(s)" in done.stdout, done.stdout


def test_a_connection_error_is_one_line_without_a_traceback(pg_server: EmbeddedPostgres) -> None:
    done = lint(pg_server.conninfo(dbname="no_such_database_here"))
    assert done.returncode == 1
    assert done.stderr.startswith("anonproxy policy: ") and "Traceback" not in done.stderr, done.stderr


# -- tables every statement on which is refused at query time -----------------------------------------------------


@pytest.fixture
def refused_tables(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[None]:
    """In the gated database: a protected table whose unit is a point (no equality: PostgreSQL cannot count its
    distinct values), and a linked table of adult whose key is text (finer than adult's integer id)."""
    statements = ["create table public.lint_spots (id point, kind text)",
                  "insert into public.lint_spots values (point(1, 2), 'a')",
                  "create table public.lint_marks (person text, kind text)",
                  "insert into public.lint_marks select id::text, 'a' from public.adult",
                  "select anonproxy.protect_table('public.lint_spots', 'id')",
                  "select anonproxy.link_table('public.lint_marks', 'person', 'public.adult')"]
    for statement in statements:
        truth.execute(statement)
    wait_for_current_policy(truth, gated_proxy, gated_database)
    try:
        yield
    finally:
        truth.execute("select anonproxy.unlink_table('public.lint_marks')")
        truth.execute("select anonproxy.unprotect_table('public.lint_spots')")
        truth.execute("drop table public.lint_marks, public.lint_spots")
        wait_for_current_policy(truth, gated_proxy, gated_database)


def refusal(conn: psycopg.Connection, statement: str) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as raised:
        conn.execute(statement)
    return raised.value


def test_tables_refused_at_query_time_are_reported_with_the_refusal_s_reason(
        refused_tables: None, pg_server: EmbeddedPostgres, gated_proxy_process: ProxyProcess,
        gated_database: str) -> None:
    """The lint names each table every statement on which is refused, in the words the refusal itself gives to a
    gated role: the linked key's message and hint (0A000), PostgreSQL's own error for a point unit (42883). The
    proxy logged the linked key's warning when it loaded the policy."""
    gated_proxy = gated_proxy_process.endpoint
    with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as reporter:
        key = refusal(reporter, "select kind, count(*) from public.lint_marks group by kind")
        unit = refusal(reporter, "select kind, count(*) from public.lint_spots group by kind")
    assert key.sqlstate == "0A000" and unit.sqlstate == "42883", (key, unit)
    assert key.diag.message_primary == ("linked table public.lint_marks cannot be queried: its key person is of type "
                                        "text, the unit public.adult.id of type integer, so two keys it tells apart "
                                        "may be one person")
    done = lint(pg_server.conninfo(dbname=gated_database))
    assert done.returncode == 1, done.stdout + done.stderr
    warnings = [line for line in done.stdout.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        f"warning: protected table public.lint_spots cannot be queried: its unit id is of type point, by which "
        f"PostgreSQL cannot count people: {unit.diag.message_primary}. Ask the DBA to make the unit a column of a "
        "type with equality and ordering (an integer, text).",
        f"warning: {key.diag.message_primary}. {key.diag.message_hint}"], done.stdout
    assert done.stdout.endswith("16 declared bound(s) checked against k = 10: 2 warning(s)\n"), done.stdout
    logged = [line for line in gated_proxy_process.log().splitlines()
              if line.endswith(f"anonproxy.policy: {key.diag.message_primary}. {key.diag.message_hint}")]
    assert logged and all(" WARNING " in line for line in logged), logged


def test_policy_apply_warns_of_a_linked_key_the_queries_refuse(postgresql: psycopg.Connection, owner_dsn: str,
                                                                service: str, tmp_path: Path) -> None:
    """`policy apply` of a file linking a table by a key finer than its unit: applied (exit code 0), with the
    query-time refusal's words as a warning."""
    postgresql.execute("create table public.stays (person_id text, minutes integer)")
    postgresql.commit()
    stays = LinkedTable("public.stays", "person_id", "public.adult", "id")
    path = tmp_path / "policy.yaml"
    path.write_text(dump_policy(replace(demo_policy(), links={"public.stays": stays}, service_role=service)))
    done = subprocess.run([sys.executable, "-m", "anonproxy.cli", "policy", "apply", str(path), "--dsn", owner_dsn],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == (
        "warning: linked table public.stays cannot be queried: its key person_id is of type text, the unit "
        "public.adult.id of type integer, so two keys it tells apart may be one person. Ask the DBA to give "
        "public.stays.person_id the type of public.adult.id."), done.stdout
    assert done.stdout.splitlines()[1].startswith("policy version "), done.stdout
