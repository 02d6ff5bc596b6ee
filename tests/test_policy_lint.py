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

import psycopg
import pytest

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import (
    ColumnPolicy,
    LinkedTable,
    Policy,
    RolePolicy,
    SuppressionParams,
)
from anonproxy.policy.yaml_policy import apply_policy, demo_policy

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
