"""Settings given at login (``options=-c ...``, ``PGOPTIONS``, startup parameters) through the real proxy.

A setting given with the login is honoured exactly as the same ``SET`` after login would be, or the login is
refused with the reason (SQLSTATE, the setting named, a hint): never ignored. Tried with psycopg, asyncpg and
psql, for a dp role (its own budget: ε 2 in all, 0.5 per query), the suppress role `reporter` and the direct
(relayed) role `dba`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess

import asyncpg
import psycopg
import pytest
from conftest import Endpoint
from test_dp_proxy import analyst, budget_left  # noqa: F401  (fixtures)


def connect(proxy: Endpoint, database: str, role: str, options: str) -> psycopg.Connection:
    return psycopg.connect(proxy.dsn(database, user=role), options=options, autocommit=True)


def refusal(proxy: Endpoint, database: str, role: str, options: str) -> str:
    """The message of the refused login (psycopg's connection error carries the server's text)."""
    with pytest.raises(psycopg.OperationalError) as refused:
        connect(proxy, database, role, options).close()
    return str(refused.value)


def test_psycopg_dp_session_takes_epsilon_from_the_login(gated_proxy: Endpoint, gated_database: str,
                                                         analyst: str) -> None:
    with connect(gated_proxy, gated_database, analyst, "-c anonproxy.epsilon=0.1") as conn:
        assert conn.execute("show anonproxy.epsilon").fetchone() == ("0.1",)
        notices: list[str] = []
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        conn.execute("select count(*) from adult").fetchone()
        assert "epsilon 1.9 of 2 left" in budget_left(conn), "charged the ε given at login"
        assert any("ε=0.1," in notice for notice in notices)
        conn.execute("set anonproxy.epsilon = 0.2")
        assert conn.execute("show anonproxy.epsilon").fetchone() == ("0.2",)
        conn.execute("reset anonproxy.epsilon")  # as in PostgreSQL: back to the value given at login
        assert conn.execute("show anonproxy.epsilon").fetchone() == ("0.1",)
    # Both settings, the long form, a backslash-escaped space in another setting's value.
    with connect(gated_proxy, gated_database, analyst,
                 r"--anonproxy.delta=0 -c application_name=two\ words -canonproxy.epsilon=0.25") as conn:
        assert conn.execute("show anonproxy.epsilon").fetchone() == ("0.25",)
        assert conn.execute("show anonproxy.delta").fetchone() == ("0",)
        assert conn.execute("show application_name").fetchone() == ("two words",)
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="δ > 0"):  # δ = 0 as SET would make it
            conn.execute("select age, count(*) from adult group by age")
        assert "epsilon 1.9 of 2 left" in budget_left(conn)


def test_psycopg_dp_login_refuses_what_set_refuses(gated_proxy: Endpoint, gated_database: str, analyst: str) -> None:
    message = refusal(gated_proxy, gated_database, analyst, "-c anonproxy.epsilon=0.6")
    assert "anonproxy.epsilon may only lower the policy's accuracy epsilon (accuracy_epsilon): at most 0.5" in message
    assert "given at login (options -c anonproxy.epsilon=0.6)" in message
    message = refusal(gated_proxy, gated_database, analyst, "-c anonproxy.epsilon=abc")
    assert 'invalid value for parameter "anonproxy.epsilon": "abc"' in message
    assert "takes a number of at least" in message  # the hint
    assert 'invalid value for parameter "anonproxy.delta"' in refusal(gated_proxy, gated_database, analyst,
                                                                       "-c anonproxy.delta=1")
    assert "at most 0.0000001" in refusal(gated_proxy, gated_database, analyst, "-c anonproxy.delta=0.001")
    assert "anonproxy.k is set by the anonproxy policy" in refusal(gated_proxy, gated_database, analyst,
                                                                   "-c anonproxy.k=2")
    # (PostgreSQL lets a role set itself; the proxy's rule, as for SET ROLE, refuses any role change.)
    assert "changing role is not allowed" in refusal(gated_proxy, gated_database, analyst, f"-c role={analyst}")
    assert "login option -e is not supported" in refusal(gated_proxy, gated_database, analyst, "-e")
    with connect(gated_proxy, gated_database, analyst, "") as conn:
        assert "epsilon 2 of 2 left" in budget_left(conn), "no refused login charged anything"
        assert conn.execute("show anonproxy.epsilon").fetchone() == ("0.5",)


def test_asyncpg_startup_parameters_and_options(gated_proxy: Endpoint, gated_database: str, analyst: str) -> None:
    async def main() -> tuple[str, str, str, str]:
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user=analyst, password=analyst,
                                     database=gated_database, server_settings={"anonproxy.epsilon": "0.125"})
        try:
            parameter = await conn.fetchval("show anonproxy.epsilon")
        finally:
            await conn.close()
        conn = await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user=analyst, password=analyst,
                                     database=gated_database, server_settings={"options": "-c anonproxy.epsilon=0.3"})
        try:
            options = await conn.fetchval("show anonproxy.epsilon")
        finally:
            await conn.close()
        with pytest.raises(asyncpg.exceptions.InvalidParameterValueError) as too_much:
            await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user=analyst, password=analyst,
                                  database=gated_database, server_settings={"anonproxy.epsilon": "5"})
        with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError) as reporter:
            await asyncpg.connect(host=gated_proxy.host, port=gated_proxy.port, user="reporter", password="reporter",
                                  database=gated_database, server_settings={"anonproxy.epsilon": "0.1"})
        return parameter, options, str(too_much.value), str(reporter.value)

    parameter, options, too_much, reporter = asyncio.run(main())
    assert (parameter, options) == ("0.125", "0.3")
    assert "at most 0.5" in too_much and "anonproxy.epsilon" in too_much
    assert "anonproxy.epsilon applies to roles in dp mode only" in reporter


def psql(proxy: Endpoint, database: str, role: str, options: str, sql: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PGOPTIONS": options, "PGPASSWORD": role, "PGCLIENTENCODING": "UTF8"}
    return subprocess.run(["psql", "-X", "-A", "-t", "-h", proxy.host, "-p", str(proxy.port), "-U", role,
                           "-d", database, "-c", sql], capture_output=True, text=True, timeout=30, env=env,
                          check=False)


def test_psql_pgoptions_for_dp_suppress_and_relayed_roles(gated_proxy: Endpoint, gated_database: str,
                                                          analyst: str) -> None:
    done = psql(gated_proxy, gated_database, analyst, "-c anonproxy.epsilon=0.1", "show anonproxy.epsilon")
    assert (done.returncode, done.stdout.strip()) == (0, "0.1"), done.stderr
    refused = psql(gated_proxy, gated_database, analyst, "-c anonproxy.epsilon=0.9", "show anonproxy.epsilon")
    assert refused.returncode != 0 and "FATAL" in refused.stderr and "at most 0.5" in refused.stderr
    assert "HINT" in refused.stderr
    # Suppress mode: SET anonproxy.epsilon is refused after login, so it is at login; ordinary settings are the
    # server's, applied as the SET would be.
    refused = psql(gated_proxy, gated_database, "reporter", "-c anonproxy.epsilon=0.1", "select 1")
    assert refused.returncode != 0 and "anonproxy.epsilon applies to roles in dp mode only" in refused.stderr
    done = psql(gated_proxy, gated_database, "reporter", "-c statement_timeout=1234", "show statement_timeout")
    assert (done.returncode, done.stdout.strip()) == (0, "1234ms"), done.stderr
    refused = psql(gated_proxy, gated_database, "reporter", "-c role=reporter", "select 1")
    assert refused.returncode != 0 and "changing role is not allowed" in refused.stderr
    # A relayed role: the server takes the custom setting, exactly as it takes SET anonproxy.epsilon after login.
    done = psql(gated_proxy, gated_database, "dba", "-c anonproxy.epsilon=0.1", "show anonproxy.epsilon")
    assert (done.returncode, done.stdout.strip()) == (0, "0.1"), done.stderr


def test_psycopg_suppress_and_relayed_roles(gated_proxy: Endpoint, gated_database: str) -> None:
    message = refusal(gated_proxy, gated_database, "reporter", "-c anonproxy.delta=0")
    assert "anonproxy.delta applies to roles in dp mode only" in message and "SHOW anonproxy.mode" in message
    assert "with standard_conforming_strings on" in refusal(gated_proxy, gated_database, "reporter",
                                                            "-c standard_conforming_strings=off")
    with connect(gated_proxy, gated_database, "reporter", "-c search_path=public,pg_catalog") as conn:
        assert conn.execute("show search_path").fetchone() == ("public,pg_catalog",)
    with connect(gated_proxy, gated_database, "dba", "-c anonproxy.epsilon=0.1") as conn:
        assert conn.execute("show anonproxy.epsilon").fetchone() == ("0.1",)
        conn.execute("set anonproxy.epsilon = 0.2")  # the same SET after login: the server's custom setting
        assert conn.execute("show anonproxy.epsilon").fetchone() == ("0.2",)
