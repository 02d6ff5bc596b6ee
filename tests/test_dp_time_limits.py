"""Time limits in dp mode: statement_timeout and a client's cancel stop a question; what it was charged stays.

Through the real proxy (one worker) with psycopg and asyncpg, on a database of its own under the demo policy whose
protected table is made sixty times larger, so that a dp question's SQL takes about a second on a quiet machine. Each test has
a dp role of its own; its charges are read back from the ledger (anonproxy.budget_ledger) and its statements from
the audit trail, as the superuser. A question stopped before its charge (a time limit already past when the proxy
would charge it, as a 1 ms one always is: planning and the ledger lookup take longer) costs nothing; one stopped
while its SQL runs (a cancel sent once the charge is in the ledger) stays charged.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from decimal import Decimal

import asyncpg
import psycopg
import pytest
from conftest import (
    SERVICE_ROLE,
    Endpoint,
    ProxyProcess,
    fresh_dp_role,
    start_proxy,
    stop_proxy,
)

from anonproxy import demo
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.yaml_policy import apply_policy, demo_policy

DATABASE = "anonproxy_dp_time"
COPIES = 60  # the demo table, this many times over (new ids): about 1.8 million rows
# About a second of SQL on the 60-fold table, quiet (more under load); ``question()`` is a new one each time (a new plan, a new charge).
QUESTION = ("select age, education, occupation, workclass, race, sex, count(*) from adult where age < {n} "
            "group by age, education, occupation, workclass, race, sex")
WAIT = 20.0  # seconds before a test gives up waiting for a charge or an audit record
_numbers = itertools.count(1)
_roles = itertools.count(1)


def question() -> str:
    return QUESTION.format(n=100 + next(_numbers))  # every age is below 100: all rows, each time


@pytest.fixture(scope="module")
def database(pg_server: EmbeddedPostgres, pg_template: object) -> str:
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {DATABASE}")
        conn.execute(f"create database {DATABASE} template {pg_template.template_dbname}")  # type: ignore[attr-defined]
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE)) as conn:
        demo.create_demo_roles(conn, DATABASE)
        demo.reset_service_role(conn, SERVICE_ROLE)
        conn.execute(f"alter role {SERVICE_ROLE} password '{SERVICE_ROLE}'")
        columns = [row[0] for row in conn.execute(
            "select column_name from information_schema.columns where table_schema = 'public' "
            "and table_name = 'adult' and column_name <> 'id' order by ordinal_position")]
        listed = ", ".join(f'"{column}"' for column in columns)
        conn.execute(f"insert into adult (id, {listed}) select id + n * 1000000, {listed} "
                     f"from adult, generate_series(1, {COPIES - 1}) n")
        apply_policy(conn, demo_policy())
        conn.commit()
    with psycopg.connect(pg_server.conninfo(dbname=DATABASE), autocommit=True) as conn:
        conn.execute("analyze adult")
    return DATABASE


@pytest.fixture(scope="module")
def proxy(pg_server: EmbeddedPostgres, database: str, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[ProxyProcess]:
    log_path = tmp_path_factory.mktemp("dptime") / "anonproxy.log"
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", log_path, workers="1", log_level="debug",
                        service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={database}")
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()
    assert proxy.process.returncode == 0, proxy.log()


@pytest.fixture(scope="module")
def endpoint(proxy: ProxyProcess) -> Endpoint:
    return proxy.endpoint


@pytest.fixture(scope="module")
def truth(pg_server: EmbeddedPostgres, database: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_server.conninfo(dbname=database), autocommit=True) as conn:
        yield conn


@pytest.fixture
def role(endpoint: Endpoint, truth: psycopg.Connection) -> Iterator[str]:
    """A dp role of the test's own, with budget for 200 questions (ε 0.5 each)."""
    with fresh_dp_role(truth, endpoint, DATABASE, f"dp_time_{next(_roles)}", epsilon=100) as name:
        yield name


def connect(endpoint: Endpoint, user: str) -> psycopg.Connection:
    return psycopg.connect(endpoint.dsn(DATABASE, user=user), autocommit=True)


def charges(truth: psycopg.Connection, role: str) -> list[Decimal]:
    """The ε of each charge of ``role`` in the ledger, oldest first."""
    return [row[0] for row in truth.execute(
        "select epsilon from anonproxy.budget_ledger where role_name = %s order by id", [role])]


def wait_for_charges(truth: psycopg.Connection, role: str, count: int) -> list[Decimal]:
    deadline = time.monotonic() + WAIT
    while len(found := charges(truth, role)) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def audit(truth: psycopg.Connection, role: str, count: int) -> list[tuple[str, str | None, str | None, Decimal]]:
    """The audit trail's (decision, sqlstate, message, ε) of ``role``'s answered or refused dp questions, once
    there are ``count`` (the proxy writes them within about a second)."""
    deadline = time.monotonic() + WAIT
    while True:
        rows = truth.execute("select decision, sqlstate, message, epsilon from anonproxy.audit_trail "
                             "where login = %s and decision in ('answered', 'refused') and statement like 'select%%'"
                             " order by id", [role]).fetchall()
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def reset_timeout(conn: psycopg.Connection, command: str = "reset statement_timeout") -> None:
    """``command`` (lifting a 1 ms statement_timeout): on a loaded machine the command itself can outlast the
    millisecond and be stopped, by PostgreSQL as by the proxy, so it is tried again (a few times at most)."""
    for _ in range(10):
        try:
            conn.execute(command)
            return
        except psycopg.errors.QueryCanceled:
            continue
    raise AssertionError(f"{command} was stopped ten times in a row")


# -- statement_timeout -------------------------------------------------------------------------------------------


def test_a_1ms_statement_timeout_stops_new_and_cached_dp_questions_and_charges_nothing(
        endpoint: Endpoint, truth: psycopg.Connection, role: str) -> None:
    cached = question()
    with connect(endpoint, role) as conn:
        assert len(conn.execute(cached).fetchall()) > 100  # charged once; the same question again is free
    assert len(charges(truth, role)) == 1
    # A new session, as an attacker's: its first statement sets the limit (the proxy's first read of it, on a
    # backend whose caches are cold, is itself stopped by it).
    with connect(endpoint, role) as conn:
        conn.execute("set statement_timeout = '1ms'")
        for sql in [cached] * 8 + [question() for _ in range(8)]:
            with pytest.raises(psycopg.errors.QueryCanceled, match="canceling statement due to statement timeout"):
                conn.execute(sql)
        reset_timeout(conn)
        assert len(conn.execute(question()).fetchall()) > 100  # the session goes on
    stopped = audit(truth, role, 18)[1:17]
    assert [record[:3] for record in stopped] == [("refused", "57014",
                                                   "canceling statement due to statement timeout")] * 16
    # A cached question is never charged. A new one is stopped before its charge when the millisecond has passed by
    # then (planning and the ledger lookup usually take longer); on a quick round trip it is charged and PostgreSQL
    # stops its SQL: the trail then says what it cost, and the ledger holds exactly what the trail says.
    assert [record[3] for record in stopped[:8]] == [0] * 8
    assert_ledger_matches_trail(truth, role, 18)


def test_a_question_past_its_time_limit_when_the_charge_would_come_costs_nothing(
        endpoint: Endpoint, truth: psycopg.Connection, role: str, pg_server: EmbeddedPostgres, database: str) -> None:
    """The ledger's lookup is held up (its table locked by another transaction for 1.5 s) past a 300 ms limit: the
    question is stopped before its charge, whatever the machine's speed."""
    with connect(endpoint, role) as conn, psycopg.connect(pg_server.conninfo(dbname=database)) as locker:
        conn.execute("set statement_timeout = '300ms'")
        locker.execute("lock table anonproxy.budgets in access exclusive mode")
        release = threading.Timer(1.5, locker.commit)
        release.start()
        try:
            with pytest.raises(psycopg.errors.QueryCanceled, match="canceling statement due to statement timeout"):
                conn.execute(question())
        finally:
            release.join()
        conn.execute("reset statement_timeout")
        assert len(conn.execute(question()).fetchall()) > 100
    assert len(charges(truth, role)) == 1  # the second question only
    stopped = audit(truth, role, 2)[0]
    assert stopped == ("refused", "57014", "canceling statement due to statement timeout", 0)


def assert_ledger_matches_trail(truth: psycopg.Connection, role: str, count: int) -> None:
    """Every charge of ``role`` in the ledger is one the audit trail records on one of its ``count`` dp questions."""
    recorded = [record[3] for record in audit(truth, role, count) if record[3]]
    assert sorted(charges(truth, role)) == sorted(recorded)


def test_a_statement_timeout_reached_while_the_sql_runs(endpoint: Endpoint, truth: psycopg.Connection,
                                                        role: str) -> None:
    """What is left of the limit when the SQL starts is PostgreSQL's statement_timeout there: of 200 ms, against a
    second of SQL. Charged when the limit came after the charge (as it does unless planning took 200 ms)."""
    with connect(endpoint, role) as conn:
        conn.execute("set statement_timeout = '200ms'")
        with pytest.raises(psycopg.errors.QueryCanceled, match="canceling statement due to statement timeout"):
            conn.execute(question())
        conn.execute("reset statement_timeout")
        assert len(conn.execute(question()).fetchall()) > 100
    stopped, answered = audit(truth, role, 2)
    assert stopped[:3] == ("refused", "57014", "canceling statement due to statement timeout")
    assert sum(charges(truth, role)) == stopped[3] + answered[3]


def test_the_statement_timeout_of_the_extended_protocol_and_a_prepared_statement(
        endpoint: Endpoint, truth: psycopg.Connection, role: str) -> None:
    cached = question()
    with connect(endpoint, role) as conn:
        conn.execute(cached, prepare=True).fetchall()
        conn.execute("set statement_timeout = 1")
        with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
            conn.execute(cached, prepare=True)
        with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
            conn.execute("select count(*) from adult where age > %s", [40])
        reset_timeout(conn, "set statement_timeout = 0")
        assert conn.execute(cached, prepare=True).fetchall()
    # the new question is charged only if the proxy reached its charge within the millisecond (the trail says so)
    assert_ledger_matches_trail(truth, role, 4)


def test_the_policys_max_statement_time_stops_a_dp_question_before_its_charge(
        endpoint: Endpoint, truth: psycopg.Connection, role: str) -> None:
    with connect(endpoint, role) as conn:
        set_dp_limit(truth, conn, "1 ms")
        try:
            conn.execute("set statement_timeout = '10min'")  # the client's own does not lift the policy's
            with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
                conn.execute(question())
        finally:
            set_dp_limit(truth, conn, "30 s")
        assert conn.execute(question()).fetchall()
    assert_ledger_matches_trail(truth, role, 2)  # the first was charged only if reached within the millisecond


def set_dp_limit(truth: psycopg.Connection, conn: psycopg.Connection, limit: str) -> None:
    """Change the policy's max_statement_time for mode dp; wait until ``conn``'s worker has loaded it."""
    truth.execute("select anonproxy.set_max_statement_time('dp', %s)", [limit])
    version = truth.execute("select version from anonproxy.policy_version").fetchone()[0]
    deadline = time.monotonic() + WAIT
    while int(conn.execute("show anonproxy.policy_version").fetchone()[0]) < version:
        assert time.monotonic() < deadline, "the proxy did not reload the policy"
        time.sleep(0.05)


# -- Cancel ------------------------------------------------------------------------------------------------------


def test_a_cancel_stops_a_running_dp_question_which_stays_charged(
        endpoint: Endpoint, truth: psycopg.Connection, role: str) -> None:
    with connect(endpoint, role) as conn:
        outcome: list[object] = []

        def ask() -> None:
            try:
                outcome.append(conn.execute(question()).fetchall())
            except psycopg.Error as exc:
                outcome.append(exc)

        asking = threading.Thread(target=ask)
        asking.start()
        charged = wait_for_charges(truth, role, 1)  # committed before the SQL reads a row: the SQL runs now
        assert len(charged) == 1
        conn.cancel_safe()
        asking.join(WAIT)
        assert not asking.is_alive()
        assert isinstance(outcome[0], psycopg.errors.QueryCanceled), outcome[0]
        assert "canceling statement due to user request" in str(outcome[0])
        assert len(conn.execute(question()).fetchall()) > 100  # the session goes on
    assert len(charges(truth, role)) == 2  # the cancelled question stayed charged; the next one was charged
    assert audit(truth, role, 2)[0] == ("refused", "57014", "canceling statement due to user request", charged[0])


def test_a_cancel_when_nothing_runs_does_nothing(endpoint: Endpoint, truth: psycopg.Connection, role: str) -> None:
    with connect(endpoint, role) as conn:
        conn.cancel_safe()
        assert len(conn.execute(question()).fetchall()) > 100
        conn.cancel_safe()  # after an answer: it does not reach the next question
        assert len(conn.execute(question()).fetchall()) > 100
    assert [row[:2] for row in audit(truth, role, 2)] == [("answered", None)] * 2


def test_asyncpgs_timeout_cancels_a_dp_question(endpoint: Endpoint, truth: psycopg.Connection, role: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(host=endpoint.host, port=endpoint.port, user=role, password=role,
                                     database=DATABASE)
        try:
            statement = await conn.prepare(question())  # described, not run: nothing charged yet
            with pytest.raises(TimeoutError):
                await statement.fetch(timeout=0.2)  # asyncpg sends a CancelRequest, then waits for the answer
            assert len(await conn.fetch("select sex, count(*) from adult group by sex")) == 2
        finally:
            await conn.close()

    asyncio.run(run())
    rows = audit(truth, role, 2)  # the trail's writer may record the next statement first: matched by decision
    [stopped] = [row for row in rows if row[0] == "refused"]
    [answered] = [row for row in rows if row[0] == "answered"]
    assert stopped[:3] == ("refused", "57014", "canceling statement due to user request")
    assert answered[:2] == ("answered", None)
    # Charged if the cancel came once the question was charged, else not: the ledger and the trail agree.
    assert sum(charges(truth, role)) == stopped[3] + answered[3]



def test_a_client_gone_mid_question_stops_it(endpoint: Endpoint, truth: psycopg.Connection, role: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(host=endpoint.host, port=endpoint.port, user=role, password=role,
                                     database=DATABASE)
        asking = asyncio.ensure_future(conn.fetch(question()))
        assert len(await asyncio.to_thread(wait_for_charges, truth, role, 1)) == 1
        conn.terminate()  # the socket is closed mid-question
        with pytest.raises(asyncpg.ConnectionDoesNotExistError):
            await asking

    asyncio.run(run())
    assert audit(truth, role, 1) == [("refused", "57014", "canceling statement due to user request",
                                      charges(truth, role)[0])]


