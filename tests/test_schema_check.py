"""The proxy checks that the database has every migration it ships: at start, and before each policy load.

A database set up by an older anonproxy lacks the newer migrations (0016 creates
anonproxy.suppression_report, which every suppress answer calls, and 0022 replaces it with the
8-argument function the answers call now). The proxy must not start in front of it (one line
naming the missing versions and `anonproxy install`), and a running proxy whose database loses a
migration refuses logins until it is installed again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from conftest import (
    SERVICE_ROLE,
    free_port,
    govern_by_demo_policy,
    start_proxy,
    stop_proxy,
)

from anonproxy import schema
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.store import POLICY_CHANNEL

SUPPRESSED = "select sex, count(*) from adult group by sex order by sex"
# The report function every suppress answer calls (sql/0022), and the one of sql/0016 it replaced.
REPORT = "anonproxy.suppression_report(integer, text, text[], bigint, bigint, text, boolean, boolean)"
REPORT_0016 = "anonproxy.suppression_report(integer, text, text[], bigint, text, boolean, boolean)"


@pytest.fixture
def governed(postgresql: psycopg.Connection, dbname: str) -> psycopg.Connection:
    """A fresh database under the demo policy; the superuser connection that owns its schema (autocommit)."""
    govern_by_demo_policy(postgresql, dbname)
    postgresql.commit()
    postgresql.autocommit = True
    return postgresql


def serve(pg_server: EmbeddedPostgres, dbname: str) -> subprocess.CompletedProcess[str]:
    """`anonproxy serve` in front of ``dbname``, expected to give up on its own."""
    env = {**os.environ, "ANONPROXY_LISTEN_PORT": str(free_port()),
           "ANONPROXY_UPSTREAM": f"host={pg_server.host} port={pg_server.port}",
           "ANONPROXY_SERVICE_DSN": f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={dbname}"}
    return subprocess.run([sys.executable, "-m", "anonproxy.cli", "serve"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def drop_suppression_report(conn: psycopg.Connection) -> None:
    """A database that lacks the report function and the two migrations that made it, 0016 (which created it) and
    0022 (which replaced it with the function the answers call now): their ledger rows too, as in a database whose
    install stopped before 0016 and went on later. Dropping the 0022 function but only 0016's row would not do:
    `install` would then re-create 0016's function, which no answer calls, and never apply 0022 again. Only these
    two: the objects of 0017 to 0021 stay, so `install` must not apply them again."""
    conn.execute(f"drop function {REPORT}")
    conn.execute("delete from anonproxy.schema_migrations where version in (16, 22)")


def report_functions(conn: psycopg.Connection) -> tuple[bool, bool]:
    """Whether the database has the report function of 0022, and the one of 0016."""
    row = conn.execute("select to_regprocedure(%s) is not null, to_regprocedure(%s) is not null",
                       [REPORT, REPORT_0016]).fetchone()
    assert row is not None
    return row[0], row[1]


def test_a_database_without_the_last_migrations_stops_the_start(pg_server: EmbeddedPostgres, dbname: str,
                                                                  governed: psycopg.Connection) -> None:
    drop_suppression_report(governed)
    done = serve(pg_server, dbname)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    last = schema.migrations()[-1].version
    assert last >= 22
    assert lines[0] == (f"anonproxy: the anonproxy schema of database {dbname!r} lacks migrations 0016, 0022 (this "
                        f"anonproxy ships 0001 to {last:04d}); run `anonproxy install --dsn DSN` as the schema's "
                        "owner; refusing to start")


def test_a_ledger_the_service_login_cannot_read_predates_0018(pg_server: EmbeddedPostgres, dbname: str,
                                                              governed: psycopg.Connection) -> None:
    """Before 0018 only the schema's owner could read the ledger: that alone says 0018 is missing."""
    governed.execute("revoke select on anonproxy.schema_migrations from public")
    governed.execute("delete from anonproxy.schema_migrations where version >= 18")
    done = serve(pg_server, dbname)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "lacks migration 0018 " in done.stderr or "lacks migrations 0018," in done.stderr, done.stderr
    assert "anonproxy install --dsn" in done.stderr and "Traceback" not in done.stderr


def test_a_database_without_the_schema_stops_the_start(pg_server: EmbeddedPostgres, dbname: str,
                                                        governed: psycopg.Connection) -> None:
    """The service login exists (``governed`` made it), but this database never had `anonproxy install`."""
    bare = f"{dbname}_bare"
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {bare}")
        conn.execute(f"create database {bare}")
    try:
        done = serve(pg_server, bare)
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stderr.strip() == (f"anonproxy: database {bare!r} has no anonproxy schema; run `anonproxy install "
                                       "--dsn DSN` as a login that may create it; refusing to start"), done.stderr
    finally:
        with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
            conn.execute(f"drop database if exists {bare}")


def test_install_brings_an_old_database_up_to_date(pg_server: EmbeddedPostgres, dbname: str,
                                                   governed: psycopg.Connection) -> None:
    drop_suppression_report(governed)
    assert report_functions(governed) == (False, False)
    installed = subprocess.run([sys.executable, "-m", "anonproxy.cli", "install", "--dsn",
                                pg_server.conninfo(dbname=dbname)], capture_output=True, text=True, timeout=60,
                               check=False)
    assert installed.returncode == 0, installed.stderr
    assert schema.missing_versions(governed) == []
    # 0016 created its function and 0022, applied after it, replaced it: the answers' function, and only it.
    assert report_functions(governed) == (True, False)


def test_a_running_proxy_refuses_logins_while_a_migration_is_missing(
        pg_server: EmbeddedPostgres, dbname: str, governed: psycopg.Connection, tmp_path: Path) -> None:
    """The policy database is read again on every reload: a migration missing then drops the policy (every login
    refused, one log line), and installing it brings the proxy back without a restart."""
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", tmp_path / "proxy.log", workers="1",
                        service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={dbname}")
    try:
        with psycopg.connect(proxy.endpoint.dsn(dbname, user="reporter"), autocommit=True) as conn:
            assert conn.execute(SUPPRESSED).fetchall()
        drop_suppression_report(governed)
        governed.execute("select pg_notify(%s, '')", [POLICY_CHANNEL])
        deadline = time.monotonic() + 60
        while True:
            try:
                psycopg.connect(proxy.endpoint.dsn(dbname, user="reporter")).close()
            except psycopg.OperationalError as exc:
                assert "anonproxy has not loaded its privacy policy yet" in str(exc)
                break
            assert time.monotonic() < deadline, "the proxy kept its policy"
            time.sleep(0.1)
        assert "lacks migrations 0016, 0022 " in proxy.log() and "anonproxy install --dsn DSN" in proxy.log()
        schema.install(governed)
        governed.execute("select pg_notify(%s, '')", [POLICY_CHANNEL])
        deadline = time.monotonic() + 60
        while True:
            try:
                with psycopg.connect(proxy.endpoint.dsn(dbname, user="reporter"), autocommit=True) as conn:
                    assert conn.execute(SUPPRESSED).fetchall()
                break
            except psycopg.OperationalError:
                assert time.monotonic() < deadline, "the proxy did not load the policy again"
                time.sleep(0.1)
    finally:
        stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()
    assert proxy.log().count("lacks migrations 0016, 0022 ") == 1, proxy.log()  # said once, not at every retry
