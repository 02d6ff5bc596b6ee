"""Service connections recover after an upstream restart, and clients learn PostgreSQL's own reason when the
server refuses or ends them (53300 too many clients, 57P01...).

A PostgreSQL of this module's own (persistent data directory, so it can restart; few connection slots, so they
can run out) with a gated proxy of its own: the session server of the other tests is left alone.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import (
    SERVICE_ROLE,
    Endpoint,
    ProxyProcess,
    free_port,
    govern_by_demo_policy,
    start_proxy,
    stop_proxy,
)

from anonproxy import sample_data, schema
from anonproxy.embedded import EmbeddedPostgres

DATABASE = "recovery"
ANALYST = "recovery_analyst"
MAX_CONNECTIONS = 20
BY_SEX = "select sex, count(*) from adult group by sex"  # a rewritten statement (suppress mode)


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedPostgres]:
    base = Path(tempfile.mkdtemp(prefix="anonproxy-recovery-"))
    base.chmod(0o755)  # the postgres OS user must reach the data directory inside
    server = EmbeddedPostgres(data_dir=base / "data", port=free_port(),
                              settings={"max_connections": str(MAX_CONNECTIONS), "superuser_reserved_connections": "0"})
    try:
        with server:
            with psycopg.connect(server.conninfo(), autocommit=True) as conn:
                conn.execute(f"create database {DATABASE}")
            with psycopg.connect(server.conninfo(dbname=DATABASE)) as conn:
                schema.install(conn)
                sample_data.load_demo(conn)
                govern_by_demo_policy(conn, DATABASE)
                # A dp role with budget for many questions (ε 0.5 each).
                conn.execute(f"create role {ANALYST} login password '{ANALYST}'")
                conn.execute("select anonproxy.set_role_policy(%s, 'dp')", [ANALYST])
                conn.execute("select anonproxy.set_budget(%s, 'public.adult'::regclass, 100, 0.001, null, 0.5, "
                             "0.0000001)", [ANALYST])
                conn.commit()
            yield server
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def gated(server: EmbeddedPostgres, tmp_path: Path) -> Iterator[ProxyProcess]:
    """One worker: every dp question of the test goes through the same pool."""
    proxy = start_proxy(f"host={server.host} port={server.port}", tmp_path / "proxy.log", workers="1",
                        log_level="debug",
                        service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={DATABASE}")
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()


def dsn(endpoint: Endpoint, user: str) -> str:
    return endpoint.dsn(DATABASE, user=user, password=user)


def dp_question(conn: psycopg.Connection, number: int) -> list[tuple[object, ...]]:
    return conn.execute(f"select sex, count(*) from adult where age > {20 + number} group by sex").fetchall()


def test_the_first_ten_dp_questions_after_a_restart_succeed(server: EmbeddedPostgres, gated: ProxyProcess) -> None:
    # Fill the pool: four sessions asking at once (all distinct questions, so none is answered from the cache).
    def ask(number: int) -> None:
        with psycopg.connect(dsn(gated.endpoint, ANALYST), autocommit=True) as conn:
            assert len(dp_question(conn, number)) == 2

    threads = [threading.Thread(target=ask, args=(number,)) for number in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    with psycopg.connect(server.conninfo(dbname=DATABASE)) as admin:
        pooled = admin.execute("select count(*) from pg_stat_activity where usename = %s and application_name <> "
                               "'anonproxy service'", [SERVICE_ROLE]).fetchone()[0]
    assert pooled >= 2  # the policy watcher and at least one pooled dp connection

    server.stop()
    server.start()

    with psycopg.connect(dsn(gated.endpoint, ANALYST), autocommit=True) as conn:
        answers = [dp_question(conn, number) for number in range(10, 20)]
    assert all(len(rows) == 2 for rows in answers)
    assert "pooled dp connection was ended by the server; replacing it" in gated.log()


def _fill_slots(server: EmbeddedPostgres) -> list[psycopg.Connection]:
    """Direct connections until the server refuses one for lack of slots: the server is then full, whatever
    other backends (the proxy's policy watcher, its audit trail writer) came or went meanwhile."""
    fillers: list[psycopg.Connection] = []
    while True:
        try:
            fillers.append(psycopg.connect(server.conninfo(), autocommit=True))
        except psycopg.OperationalError as exc:
            if "too many clients" not in str(exc):
                raise
            return fillers
        assert len(fillers) <= MAX_CONNECTIONS, "the server accepted more connections than max_connections"


def _end_pooled_service_connections(admin: psycopg.Connection) -> None:
    """Terminate the service backends the proxy's pool holds, and wait until they are gone."""
    admin.execute("select pg_terminate_backend(pid) from pg_stat_activity where application_name = "
                  "'anonproxy service'")
    while admin.execute("select count(*) from pg_stat_activity where application_name = 'anonproxy service'"
                        ).fetchone()[0]:
        time.sleep(0.1)


def test_a_rewritten_statement_the_server_cannot_serve_gets_53300(server: EmbeddedPostgres,
                                                                  gated: ProxyProcess) -> None:
    """The reporter is logged in (its own backend), the service pool is empty and the server full: the statement
    is refused with the server's SQLSTATE, and the session works once a slot is free.
    (Gated sessions borrow service connections per statement: a login needs none.)"""
    with psycopg.connect(dsn(gated.endpoint, "reporter"), autocommit=True) as conn:
        conn.execute(BY_SEX)
        with psycopg.connect(server.conninfo(dbname=DATABASE), autocommit=True) as admin:
            _end_pooled_service_connections(admin)
        fillers = _fill_slots(server)
        try:
            with pytest.raises(psycopg.Error) as caught:
                conn.execute(BY_SEX)
            assert caught.value.sqlstate == "53300"
            assert "too many clients" in (caught.value.diag.message_primary or "")
            assert "service connection" in (caught.value.diag.message_detail or "")
        finally:
            for filler in fillers:
                filler.close()
        assert len(conn.execute(BY_SEX).fetchall()) == 2
    assert "lost its service connection" not in gated.log()


def test_a_dp_question_the_server_cannot_serve_gets_53300(server: EmbeddedPostgres, gated: ProxyProcess) -> None:
    """The analyst is logged in (its backend and its session's service connection), the dp pool is empty and the
    server is full: the question is refused with the server's SQLSTATE, and works once a slot is free."""
    with psycopg.connect(dsn(gated.endpoint, ANALYST), autocommit=True) as conn:
        fillers = _fill_slots(server)
        try:
            with pytest.raises(psycopg.Error) as caught:
                dp_question(conn, 30)
            assert caught.value.sqlstate == "53300"
            assert "too many clients" in (caught.value.diag.message_primary or "")
        finally:
            for filler in fillers:
                filler.close()
        assert len(dp_question(conn, 30)) == 2


def test_a_pooled_service_connection_ended_by_the_server_is_replaced(server: EmbeddedPostgres,
                                                                      gated: ProxyProcess) -> None:
    with psycopg.connect(dsn(gated.endpoint, "reporter"), autocommit=True) as conn, \
            psycopg.connect(server.conninfo(dbname=DATABASE), autocommit=True) as admin:
        conn.execute(BY_SEX)
        _end_pooled_service_connections(admin)
        assert len(conn.execute(BY_SEX).fetchall()) == 2
    assert "a pooled service connection was ended by the server; replacing it" in gated.log()


def test_a_service_connection_ended_during_a_statement_reports_the_servers_reason(server: EmbeddedPostgres,
                                                                                 gated: ProxyProcess) -> None:
    """The reporter's statement waits for a lock on its service backend, which the server then terminates."""
    failed: list[BaseException] = []

    def ask(conn: psycopg.Connection) -> None:
        try:
            conn.execute(BY_SEX)
        except psycopg.Error as exc:
            failed.append(exc)

    with psycopg.connect(dsn(gated.endpoint, "reporter"), application_name="recovery-reporter") as conn, \
            psycopg.connect(server.conninfo(dbname=DATABASE)) as locker, \
            psycopg.connect(server.conninfo(dbname=DATABASE), autocommit=True) as admin:
        locker.execute("lock table adult in access exclusive mode")
        asking = threading.Thread(target=ask, args=(conn,))
        asking.start()
        while True:
            row = admin.execute("select pid from pg_stat_activity where application_name = 'anonproxy service' "
                                "and wait_event_type = 'Lock'").fetchone()
            if row is not None:
                break
            time.sleep(0.05)
        admin.execute("select pg_terminate_backend(%s)", [row[0]])
        asking.join(30)
        locker.rollback()
    assert len(failed) == 1 and isinstance(failed[0], psycopg.OperationalError)
    assert "terminating connection due to administrator command" in str(failed[0])
    assert "the service connection was lost: terminating connection due to administrator command" in gated.log()


def test_a_refused_service_password_reaches_the_client_as_28P01(server: EmbeddedPostgres,
                                                                 gated: ProxyProcess) -> None:
    with psycopg.connect(dsn(gated.endpoint, "reporter"), autocommit=True) as conn, \
            psycopg.connect(server.conninfo(dbname=DATABASE), autocommit=True) as admin:
        conn.execute(BY_SEX)
        admin.execute(f"alter role {SERVICE_ROLE} password 'changed by the test'")
        try:
            _end_pooled_service_connections(admin)
            with pytest.raises(psycopg.Error) as caught:
                conn.execute(BY_SEX)
            assert caught.value.sqlstate == "28P01"
            assert f'password authentication failed for user "{SERVICE_ROLE}"' in str(caught.value)
            assert "service connection" in (caught.value.diag.message_detail or "")
        finally:
            admin.execute(f"alter role {SERVICE_ROLE} password '{SERVICE_ROLE}'")
        assert len(conn.execute(BY_SEX).fetchall()) == 2
