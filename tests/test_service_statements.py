"""A seen suppress Query's rewrite runs as the service connection's prepared statement: parsed once per connection,
answers as the plain Query of the same SQL.

A proxy of this module's own (one worker, one service connection) on a database of its own, whose service login
logs every protocol step (``log_min_duration_statement = 0``: "parse NAME", "bind NAME", "execute NAME" lines in
the server's log), so that what PostgreSQL was sent is read from PostgreSQL. Expected answers and errors come from
the same generated SQL sent as a plain Query by the service login directly.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import (
    SERVICE_ROLE,
    ProxyProcess,
    govern_by_demo_policy,
    start_proxy,
    stop_proxy,
    wait_for_current_policy,
)
from pytest_postgresql.executors.noop import NoopExecutor

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import apply_policy, demo_policy
from anonproxy.proxy.service_statements import LIMIT, ServiceStatements, close_statement, name_of
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite

DATABASE = "anonproxy_statements"
STEP = re.compile(r"LOG:  duration: [0-9.]+ ms  (parse|bind|execute) (anonproxy_[0-9a-f]+)")


@pytest.fixture(scope="module")
def database(pg_server: EmbeddedPostgres, pg_template: NoopExecutor) -> str:
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {DATABASE}")
        conn.execute(f"create database {DATABASE} template {pg_template.template_dbname}")
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE)) as conn:
        govern_by_demo_policy(conn, DATABASE)
        conn.execute(f"alter role {SERVICE_ROLE} in database {DATABASE} set log_min_duration_statement = 0")
        conn.commit()
    return DATABASE


@pytest.fixture(scope="module")
def proxy(pg_server: EmbeddedPostgres, database: str, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[ProxyProcess]:
    log_path: Path = tmp_path_factory.mktemp("statements") / "anonproxy.log"
    process = start_proxy(f"host={pg_server.host} port={pg_server.port}", log_path, workers="1",
                          service_pool_size="1",
                          service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={database}")
    yield process
    stop_proxy(process)
    assert "Traceback" not in process.log(), process.log()


@pytest.fixture(scope="module")
def owner(pg_server: EmbeddedPostgres, database: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_server.conninfo(dbname=database), autocommit=True) as conn:
        yield conn


@pytest.fixture(scope="module")
def service(pg_server: EmbeddedPostgres, database: str) -> Iterator[psycopg.Connection]:
    """The service login directly, with the service connections' settings: the plain Query's answers."""
    with psycopg.connect(pg_server.conninfo(user=SERVICE_ROLE, password=SERVICE_ROLE, dbname=database),
                         autocommit=True, options="-c default_transaction_read_only=on -c search_path=pg_catalog "
                                                  "-c jit=off") as conn:
        yield conn


@pytest.fixture()
def reporter(proxy: ProxyProcess) -> Iterator[psycopg.Connection]:
    """Simple-protocol Queries (psycopg's execute without parameters, never prepared by the client)."""
    with psycopg.connect(proxy.endpoint.dsn(DATABASE, user="reporter"), autocommit=True,
                         prepare_threshold=None) as conn:
        yield conn


def rewrite(owner: psycopg.Connection, sql: str) -> str:
    """The SQL the proxy runs for the reporter's ``sql``, under the policy in force."""
    policy = load_policy(owner)
    decision = decide(sql, policy.roles["reporter"], policy)
    assert isinstance(decision, Rewrite)
    return decision.runs


def answer(conn: psycopg.Connection, sql: str) -> tuple[list[tuple[object, ...]], list[int]]:
    """Rows and the result columns' type OIDs."""
    cursor = conn.execute(sql)
    return cursor.fetchall(), [column.type_code for column in cursor.description or ()]


def outcome(conn: psycopg.Connection, sql: str) -> tuple[list[tuple[object, ...]], list[int]] | str:
    """The answer, or the SQLSTATE of the error."""
    try:
        return answer(conn, sql)
    except psycopg.Error as error:
        assert error.sqlstate is not None
        return error.sqlstate


class ServerLog:
    """The lines the server logged from now on."""

    def __init__(self, server: EmbeddedPostgres) -> None:
        self._path = server.log_file
        self._start = self._path.stat().st_size

    def text(self) -> str:
        with self._path.open("rb") as log:
            log.seek(self._start)
            return log.read().decode(errors="replace")

    def steps(self) -> list[tuple[str, str]]:
        """(parse|bind|execute, statement name) of the proxy's own statements, in order."""
        return STEP.findall(self.text())


def test_a_seen_query_is_parsed_once_on_the_connection_and_answers_as_the_plain_query(
        pg_server: EmbeddedPostgres, owner: psycopg.Connection, service: psycopg.Connection,
        reporter: psycopg.Connection) -> None:
    sql = "select education, count(*), avg(hours_per_week) from adult where age > 31 group by education"
    expected = answer(service, rewrite(owner, sql))
    log = ServerLog(pg_server)
    answers = [answer(reporter, sql) for _ in range(3)]
    assert answers == [expected] * 3 and expected[0]
    steps = log.steps()
    names = {name for _, name in steps}
    assert len(names) == 1 and [step for step, _ in steps] == ["parse"] + ["bind", "execute"] * 3, steps
    # Another session borrowing the same connection runs the same statement without parsing it again.
    log = ServerLog(pg_server)
    with psycopg.connect(reporter.info.dsn, password="reporter", autocommit=True, prepare_threshold=None) as other:
        assert answer(other, sql) == expected
    assert log.steps() == [("bind", *names), ("execute", *names)]


def test_a_client_statement_of_the_same_name_is_its_own(
        pg_server: EmbeddedPostgres, owner: psycopg.Connection, service: psycopg.Connection,
        reporter: psycopg.Connection) -> None:
    """A client's extended-protocol statement named as the proxy's own: each name runs its own SQL."""
    seen = "select sex, count(*) from adult where age > 32 group by sex"
    other = "select race, count(*) from adult where age > 32 group by race"
    expected_seen, expected_other = answer(service, rewrite(owner, seen)), answer(service, rewrite(owner, other))
    log = ServerLog(pg_server)
    assert answer(reporter, seen) == expected_seen
    (name,) = {name for _, name in log.steps()}

    def run_named() -> list[tuple[str, ...]]:
        result = reporter.pgconn.exec_prepared(name.encode(), [])
        assert result.status == psycopg.pq.ExecStatus.TUPLES_OK, result.error_message
        return [tuple(str(result.get_value(row, column), "utf-8") for column in range(result.nfields))
                for row in range(result.ntuples)]

    as_text = [(str(race), str(count)) for race, count in expected_other[0]]
    assert reporter.pgconn.prepare(name.encode(), other.encode()).status == psycopg.pq.ExecStatus.COMMAND_OK
    assert run_named() == as_text
    assert answer(reporter, seen) == expected_seen  # (closes the client's statement on the connection)
    assert run_named() == as_text  # prepared again there before its Bind


def test_a_client_statement_left_under_the_proxys_name_is_not_run_for_the_next_session(
        pg_server: EmbeddedPostgres, owner: psycopg.Connection, service: psycopg.Connection,
        reporter: psycopg.Connection) -> None:
    """Red team (round 11): a session prepares, under the name of the proxy's own statement of a seen Query (read
    here from the server's log; an attacker computes it from the code), the rewrite of another statement, runs it
    on the one service connection and leaves. The next session's seen Query runs its own SQL there, not the
    statement left behind."""
    seen = "select sex, count(*) from adult where age > 39 group by sex"
    other = "select race, count(*) from adult where age > 39 group by race"
    expected = answer(service, rewrite(owner, seen))
    log = ServerLog(pg_server)
    assert answer(reporter, seen) == expected
    (name,) = {name for _, name in log.steps()}
    with psycopg.connect(reporter.info.dsn, password="reporter", autocommit=True) as attacker:
        assert attacker.pgconn.prepare(name.encode(), other.encode()).status == psycopg.pq.ExecStatus.COMMAND_OK
        result = attacker.pgconn.exec_prepared(name.encode(), [])
        assert result.status == psycopg.pq.ExecStatus.TUPLES_OK and result.ntuples == len(answer(service, rewrite(
            owner, other))[0])
    with psycopg.connect(reporter.info.dsn, password="reporter", autocommit=True, prepare_threshold=None) as next_:
        assert answer(next_, seen) == expected


def test_ddl_between_runs_changes_nothing_of_the_answers(
        pg_server: EmbeddedPostgres, owner: psycopg.Connection, service: psycopg.Connection,
        reporter: psycopg.Connection) -> None:
    sql = "select sex, sum(hours_per_week), count(*) from adult where age > 33 group by sex"
    owner.execute("create index adult_age_statements on adult (age)")
    assert answer(reporter, sql) == answer(service, rewrite(owner, sql))
    owner.execute("drop index adult_age_statements")  # PostgreSQL plans the statement again
    assert answer(reporter, sql) == answer(service, rewrite(owner, sql))
    owner.execute("alter table adult add column statements_note text")
    assert answer(reporter, sql) == answer(service, rewrite(owner, sql))
    # The type of an answer's column changes (sum of bigint is numeric): PostgreSQL refuses to reuse the plan
    # (0A000 "cached plan must not change result type"); the client gets the plain Query's answer instead.
    log = ServerLog(pg_server)
    owner.execute("alter table adult alter column hours_per_week type bigint")
    try:
        expected = answer(service, rewrite(owner, sql))
        assert answer(reporter, sql) == expected and expected[1][1] == 1700  # numeric
        assert "cached plan must not change result type" in log.text()
        assert answer(reporter, sql) == expected  # prepared anew
    finally:
        owner.execute("alter table adult alter column hours_per_week type integer")
        owner.execute("alter table adult drop column statements_note")
    assert answer(reporter, sql) == answer(service, rewrite(owner, sql))


def test_the_catalog_check_of_one_row_per_person_runs_at_every_execution_of_the_prepared_statement(
        owner: psycopg.Connection, service: psycopg.Connection) -> None:
    """The suppress SQL checks, as it runs, that each row of adult is one person (a STABLE function call, which a
    generic plan keeps): PostgreSQL evaluates it again at each execution of the prepared statement, so a primary
    key dropped after the statement was prepared fails it as it fails the plain Query (55000)."""
    runs = rewrite(owner, "select relationship, count(*) from adult where age > 36 group by relationship")
    assert "one_row_per_person" in runs
    service.execute(f"prepare one_row_check as {runs}")
    try:
        assert service.execute("execute one_row_check").fetchall() == answer(service, runs)[0]
        key = owner.execute("select conname from pg_constraint where conrelid = 'public.adult'::regclass "
                            "and contype = 'p'").fetchone()[0]
        owner.execute(f"alter table adult drop constraint {key}")
        try:
            assert outcome(service, runs) == "55000"
            assert outcome(service, "execute one_row_check") == "55000"
        finally:
            owner.execute(f"alter table adult add constraint {key} primary key (id)")
        assert service.execute("execute one_row_check").fetchall() == answer(service, runs)[0]
    finally:
        service.execute("deallocate one_row_check")


def test_an_error_of_the_prepared_statement_is_the_plain_querys(
        owner: psycopg.Connection, service: psycopg.Connection, reporter: psycopg.Connection) -> None:
    sql = "select workclass, count(*) from adult where age > 34 group by workclass"
    runs = rewrite(owner, sql)
    assert answer(reporter, sql) == answer(service, runs)
    owner.execute(f"revoke select on adult from {SERVICE_ROLE}")
    try:
        refused = outcome(service, runs)
        assert refused == "42501"
        assert outcome(reporter, sql) == refused
    finally:
        owner.execute(f"grant select on adult to {SERVICE_ROLE}")
    assert answer(reporter, sql) == answer(service, runs)


def test_a_new_policy_runs_its_own_statement(
        pg_server: EmbeddedPostgres, proxy: ProxyProcess, owner: psycopg.Connection, service: psycopg.Connection,
        reporter: psycopg.Connection) -> None:
    """A policy change that changes the rewrite changes its text, hence its name: the statement prepared under the
    old policy is not run again."""
    sql = "select education, count(*) from adult where age > 38 group by education"
    log = ServerLog(pg_server)
    before = answer(reporter, sql)
    assert before == answer(service, rewrite(owner, sql))
    policy = demo_policy()
    reporter_policy = policy.roles["reporter"]
    stricter = dataclasses.replace(reporter_policy, suppression=dataclasses.replace(reporter_policy.suppression, k=500))
    apply_policy(owner, dataclasses.replace(policy, roles={**policy.roles, "reporter": stricter}))
    try:
        wait_for_current_policy(owner, proxy.endpoint, DATABASE)
        after = answer(reporter, sql)
        assert after == answer(service, rewrite(owner, sql)) and after != before
        parsed = [name for step, name in log.steps() if step == "parse"]
        assert len(parsed) == 2 and parsed[0] != parsed[1]
    finally:
        apply_policy(owner, policy)
        wait_for_current_policy(owner, proxy.endpoint, DATABASE)
    assert answer(reporter, sql) == before


def test_a_replaced_connection_prepares_the_statement_again(
        pg_server: EmbeddedPostgres, owner: psycopg.Connection, service: psycopg.Connection,
        reporter: psycopg.Connection) -> None:
    sql = "select marital_status, count(*) from adult where age > 35 group by marital_status"
    expected = answer(service, rewrite(owner, sql))
    assert answer(reporter, sql) == expected
    ended = owner.execute("select pg_terminate_backend(pid) from pg_stat_activity where datname = %s "
                          "and application_name = 'anonproxy service'", [DATABASE]).fetchall()
    assert ended == [(True,)]
    log = ServerLog(pg_server)
    assert answer(reporter, sql) == expected
    assert [step for step, _ in log.steps()] == ["parse", "bind", "execute"]


def test_at_most_limit_statements_are_kept_per_connection_and_the_oldest_is_closed() -> None:
    statements = ServiceStatements()
    texts = [f"select {n}" for n in range(LIMIT + 1)]

    def run(sql: str) -> tuple[bytes, tuple[bytes, ...]]:
        return statements.run(sql, name_of(sql, {}))

    for sql in texts[:LIMIT]:
        payload, _ = run(sql)
        assert payload[:1] == b"C"  # Close, then Parse: new on the connection
    payload, hidden = run(texts[0])
    assert payload[:1] == b"B" and hidden == (b"2",)  # still there: the most recently used now
    payload, hidden = run(texts[LIMIT])  # one too many: the least recently used (texts[1]) goes
    assert payload.startswith(close_statement(name_of(texts[1], {}))) and hidden == (b"3", b"3", b"1", b"2")
    assert run(texts[1])[0][:1] == b"C"  # prepared anew
    assert run(texts[0])[0][:1] == b"B"
