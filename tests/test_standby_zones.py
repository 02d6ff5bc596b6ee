"""A standby whose tz database lacks a zone the primary knows stays out of the rotation (anonproxy.proxy.servers).

The proof admits the time zones the policy read on the primary (pg_timezone_names). Time zone files are the
server host's own, not replicated: a standby on another host, or with another tzdata version, may lack one, and a
gated statement naming it would fail there only for the rows that reach the call. Made real here: one standby runs
in a mount namespace where /usr/share/zoneinfo is a copy without Europe/Kyiv (and the links to it); the other has
the host's. The narrow one is listed first (on a tie of lag, the first listed serves).
"""

from __future__ import annotations

import itertools
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import ProxyProcess, start_proxy, stop_proxy
from replication import (
    DATABASE,
    DURABLE,
    REPLICATION_HBA,
    new_server,
    prepare_database,
    service_dsn,
    wait_replayed,
)

from anonproxy.embedded import EmbeddedPostgres

SYSTEM_ZONES = Path("/usr/share/zoneinfo")
MISSING = "Europe/Kyiv"
LOGGED = {"log_statement": "all"}
_numbers = itertools.count(random.randrange(10_000_000, 90_000_000, 1000))


def narrow_zones(directory: Path) -> Path:
    """A copy of the host's tz database without ``MISSING`` and the links to it (PostgreSQL's pg_timezone_names
    fails on a dangling link)."""
    copy = directory / "zoneinfo"
    shutil.copytree(SYSTEM_ZONES, copy, symlinks=True)
    (copy / MISSING).unlink()
    subprocess.run(["find", str(copy), "-xtype", "l", "-delete"], check=True)
    copy.chmod(0o755)
    return copy


def standby(primary: EmbeddedPostgres, wrapper: list[str]) -> EmbeddedPostgres:
    server = EmbeddedPostgres(hba_extra=[REPLICATION_HBA], settings={**DURABLE, **LOGGED}, wrapper=wrapper)
    server.start_standby_of(primary)
    return server


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedPostgres, ...]]:
    assert shutil.which("unshare"), "unshare (util-linux) is required, run as root, for a standby in a mount namespace"
    zones = narrow_zones(tmp_path_factory.mktemp("tz"))
    inside = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
              f'mount --bind "$0" {SYSTEM_ZONES} && exec "$@"', str(zones)]
    primary = new_server(settings=LOGGED)
    primary.start()
    started: list[EmbeddedPostgres] = [primary]
    try:
        prepare_database(primary)
        narrow, same = standby(primary, inside), None
        started.append(narrow)
        same = standby(primary, [])
        started.append(same)
        for server in (narrow, same):
            wait_replayed(primary, server)
        yield primary, narrow, same
    finally:
        for server in reversed(started):
            server.stop()


@pytest.fixture(scope="module")
def proxy(servers: tuple[EmbeddedPostgres, ...], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    primary, narrow, same = servers
    process = start_proxy(f"host=127.0.0.1 port={primary.port}", tmp_path_factory.mktemp("zones") / "anonproxy.log",
                          workers="1", log_level="debug", service_dsn=service_dsn(),
                          standbys=f"127.0.0.1:{narrow.port}, 127.0.0.1:{same.port}",
                          standby_check_interval="0.2", accept_async_ledger="on")
    yield process
    stop_proxy(process)
    assert "Traceback" not in process.log(), process.log()


def ran_on(server: EmbeddedPostgres, number: int) -> bool:
    return any(str(number) in line and "parameters:" not in line
               for line in server.log_file.read_text(errors="replace").splitlines())


def test_the_narrow_standby_lacks_the_zone(servers: tuple[EmbeddedPostgres, ...]) -> None:
    """The premise: the primary knows the zone, the narrow standby does not, and fails on it only for a row."""
    primary, narrow, same = servers
    for server, knows in ((primary, True), (narrow, False), (same, True)):
        with psycopg.connect(server.conninfo(dbname=DATABASE), autocommit=True) as conn:
            found = conn.execute("select count(*) from pg_timezone_names where name = %s", [MISSING]).fetchone()
            assert found == (int(knows),), server.port
    with psycopg.connect(narrow.conninfo(dbname=DATABASE), autocommit=True) as conn:
        row_zone = f"((now() + age * interval '1 second') at time zone '{MISSING}') > now()"
        conn.execute(f"select count(*) from adult where age < 0 and {row_zone}")
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(f"select count(*) from adult where age > 0 and {row_zone}")
        assert caught.value.sqlstate == "22023"


def test_gated_reads_skip_a_standby_with_other_time_zones(servers: tuple[EmbeddedPostgres, ...],
                                                          proxy: ProxyProcess) -> None:
    _, narrow, same = servers  # the proxy probed them before it took clients
    for role in ("reporter", "analyst"):
        number = next(_numbers)
        with psycopg.connect(proxy.endpoint.dsn(DATABASE, user=role, password=role), autocommit=True) as conn:
            conn.execute(f"select education, count(*) from adult where hours_per_week <> {number} "
                         f"and (now() at time zone '{MISSING}') > timestamp '2000-01-01' group by 1").fetchall()
        assert ran_on(same, number), role
        assert not ran_on(narrow, number), role
    assert "kept out of rotation: its time zone names" in proxy.log()
