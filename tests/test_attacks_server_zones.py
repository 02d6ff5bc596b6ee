"""Red team: a time zone the proxy's host knows and the PostgreSQL server does not.

PostgreSQL looks a zone name up in its own tz database (AT TIME ZONE, timezone(), date_trunc(unit, x, zone)) and
fails on a name it does not know only when a row reaches the call: the error tells whether any row did (one
person's row, under a WHERE that isolates it). The proof used to accept the names of the PROXY host's tz database
(Python's zoneinfo, which also reads the ``tzdata`` package): a proxy on another host, or with another tzdata
version, admitted names the server then failed on, row by row. It now accepts only the names the server lists in
pg_timezone_names, read with the policy (Policy.zones).

Made real here: the proxy runs with PYTHONTZPATH naming a directory that holds one more zone (a copy of UTC as
``Mars/Olympus_Mons``), so its host knows a name the server's tz database lacks.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from psycopg import pq
from test_time_functions import BOUNDED, ZONES, admitted, refused

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.store import load_policy

HOST_ONLY = "Mars/Olympus_Mons"  # in the proxy host's tz database only
SYSTEM_ZONES = Path("/usr/share/zoneinfo")

# --- the proof, on a policy whose server lacks a zone the proxy host has -----------------------------------------
# (events' time columns with declared bounds: in dp mode a WHERE on a column without them may not shift it by a
# time zone at all, whatever the zone)

STATEMENTS = [
    "select count(*) from events where person_id = 17 and (at at time zone '{zone}') > now()",
    "select timezone('{zone}', at), count(*) from events group by 1",
    "select date_trunc('day', at, '{zone}'), count(*) from events group by 1",
    "select extract(hour from at at time zone '{zone}'), count(*) from events group by 1",
]


@pytest.mark.parametrize("sql", STATEMENTS)
def test_a_zone_the_server_lacks_is_refused_though_the_proxy_host_knows_it(sql: str) -> None:
    """Europe/Kyiv is in every recent tz database of the proxy's host (Python's zoneinfo here); a server with an older
    one (before 2022b) lacks it. The server's list decides."""
    without_kyiv = dataclasses.replace(BOUNDED, zones=ZONES - {"europe/kyiv"})
    refused(sql.format(zone="Europe/Kyiv"), "time zone", policy=without_kyiv)
    admitted(sql.format(zone="Europe/Kyiv"), dataclasses.replace(BOUNDED, zones=ZONES | {"europe/kyiv"}))
    admitted(sql.format(zone="europe/PARIS"), without_kyiv)  # PostgreSQL matches names in any ASCII case


@pytest.mark.parametrize("sql", STATEMENTS)
def test_without_the_server_s_list_only_utc_and_gmt_are_accepted(sql: str) -> None:
    """A policy built in memory (not read from a server) has no list: fail closed."""
    unread = dataclasses.replace(BOUNDED, zones=None)
    refused(sql.format(zone="Europe/Paris"), "time zone", policy=unread)
    admitted(sql.format(zone="UTC"), unread)
    admitted(sql.format(zone="GMT"), unread)


def test_the_policy_carries_the_server_s_zone_names(truth: psycopg.Connection[Any]) -> None:
    names = {row[0] for row in truth.execute("select name from pg_timezone_names").fetchall()}
    policy = load_policy(truth)
    assert policy.zones == {name.lower() for name in names}
    assert "europe/paris" in policy.zones and HOST_ONLY.lower() not in policy.zones


# --- through a proxy whose host knows one zone more than the server ----------------------------------------------


@pytest.fixture(scope="module")
def host_zones(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PYTHONTZPATH: a directory with the extra zone, then the system's tz database."""
    directory = tmp_path_factory.mktemp("tz")
    (directory / "Mars").mkdir()
    shutil.copyfile(SYSTEM_ZONES / "UTC", directory / HOST_ONLY)
    return f"{directory}{os.pathsep}{SYSTEM_ZONES}"


@pytest.fixture(scope="module")
def wider_proxy(pg_server: EmbeddedPostgres, gated_database: str, host_zones: str,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    """The gated proxy, run with the wider tz database."""
    log_path = tmp_path_factory.mktemp("zones") / "anonproxy.log"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONTZPATH", host_zones)
        proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", log_path, workers="1",
                            service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={gated_database}")
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()


def test_the_proxy_host_knows_the_extra_zone(host_zones: str) -> None:
    """The premise: with that PYTHONTZPATH, Python's zoneinfo (what the proof read before) lists the zone."""
    program = f"import zoneinfo; print({HOST_ONLY!r} in zoneinfo.available_timezones())"
    listed = subprocess.run([sys.executable, "-c", program], env={**os.environ, "PYTHONTZPATH": host_zones},
                            capture_output=True, text=True, check=True)
    assert listed.stdout.strip() == "True"


@pytest.fixture(scope="module")
def person(truth: psycopg.Connection[Any]) -> int:
    return int(truth.execute("select min(person_id) from public.visits").fetchone()[0])


TEMPLATE = "select count(*) from visits where person_id = {person} and (visited_at at time zone '{zone}') > now()"


def test_postgresql_reveals_the_row_through_the_zone_it_lacks(truth: psycopg.Connection[Any], person: int) -> None:
    """The leak the refusal keeps closed: answered when no row reaches the call, 22023 when one does."""
    truth.execute(TEMPLATE.format(person=-1, zone=HOST_ONLY))
    with pytest.raises(psycopg.Error) as caught, truth.transaction():
        truth.execute(TEMPLATE.format(person=person, zone=HOST_ONLY))
    assert caught.value.sqlstate == "22023", caught.value


@pytest.fixture(params=["suppress", "dp"])
def attacker(request: pytest.FixtureRequest, wider_proxy: ProxyProcess, gated_database: str,
             truth: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    proxy: Endpoint = wider_proxy.endpoint
    if request.param == "suppress":
        with psycopg.connect(proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
            yield conn
        return
    with fresh_dp_role(truth, proxy, gated_database, "rt_server_zones") as role, \
            psycopg.connect(proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        yield conn


def budget(conn: psycopg.Connection[Any]) -> Any:
    return conn.execute("show anonproxy.budget").fetchone() if conn.info.user != "reporter" else None


def test_the_proxy_refuses_a_zone_only_its_host_knows(attacker: psycopg.Connection[Any], person: int) -> None:
    before = budget(attacker)
    for who in (-1, person):
        with pytest.raises(psycopg.Error) as caught:
            attacker.execute(TEMPLATE.format(person=who, zone=HOST_ONLY))
        assert caught.value.sqlstate == "0A000", caught.value
        assert "pg_timezone_names" in str(caught.value), caught.value
    assert budget(attacker) == before  # refused before anything is charged


def test_a_zone_the_server_knows_is_answered(attacker: psycopg.Connection[Any], person: int) -> None:
    attacker.execute(TEMPLATE.format(person=person, zone="europe/PARIS")).fetchall()


def test_a_zone_bound_at_bind_is_checked_against_the_server_s_list(attacker: psycopg.Connection[Any],
                                                                   person: int) -> None:
    sql = (b"select count(*) from visits where person_id = $1::integer "
           b"and (visited_at at time zone $2) > timestamp '2000-01-01'")
    pgconn = attacker.pgconn
    assert pgconn.prepare(b"zoned", sql).status == pq.ExecStatus.COMMAND_OK
    before = budget(attacker)
    result = pgconn.exec_prepared(b"zoned", [str(person).encode(), HOST_ONLY.encode()])
    assert result.status == pq.ExecStatus.FATAL_ERROR
    assert result.error_field(pq.DiagnosticField.SQLSTATE) == b"0A000", result.error_message
    assert budget(attacker) == before
    pgconn.exec_(b"deallocate zoned")
