"""Read replicas: suppress rewrites and dp measurements on a hot standby, the rest on the primary (docs/replicas.md).

A real primary and two hot standbys (streaming replication from base backups, synchronous: the primary's
commits wait for one of them), every statement logged (log_statement = all), and the real proxy with both standbys.
Where a statement ran is read from the servers' own logs: each test's statements carry a number of their own.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import psycopg
import pytest
from conftest import Endpoint, ProxyProcess, start_proxy, stop_proxy
from replication import (
    DATABASE,
    new_server,
    prepare_database,
    service_dsn,
    set_synchronous,
    start_standby,
    wait_replayed,
)

from anonproxy.config import ConfigError, ProxyConfig, UpstreamAddress, load_config
from anonproxy.embedded import EmbeddedPostgres

LOGGED = {"log_statement": "all"}
MAX_LAG = 4 * 1024 * 1024  # bytes: the proxy's max_standby_lag here (a few hundred rows changed stay under it)
WORKERS = 2
_numbers = itertools.count(random.randrange(10_000_000, 90_000_000, 1000))


class Cluster:
    def __init__(self, primary: EmbeddedPostgres, standbys: list[EmbeddedPostgres]) -> None:
        self.primary = primary
        self.standbys = standbys

    def superuser(self, server: EmbeddedPostgres) -> psycopg.Connection:
        return psycopg.connect(server.conninfo(dbname=DATABASE), autocommit=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    primary = new_server(settings=LOGGED)
    primary.start()
    standbys: list[EmbeddedPostgres] = []
    try:
        prepare_database(primary)
        standbys = [start_standby(primary, settings=LOGGED) for _ in range(2)]
        set_synchronous(primary, True)
        for standby in standbys:
            wait_replayed(primary, standby)
        yield Cluster(primary, standbys)
    finally:
        for server in [*standbys, primary]:
            server.stop()


def proxy_for(cluster: Cluster, log_path: Path, **settings: str) -> ProxyProcess:
    standbys = ", ".join(f"127.0.0.1:{s.port}" for s in cluster.standbys)
    return start_proxy(f"host=127.0.0.1 port={cluster.primary.port}", log_path, workers=str(WORKERS),
                       log_level="debug", service_dsn=service_dsn(), standbys=standbys,
                       max_standby_lag=str(MAX_LAG), standby_check_interval="0.2", **settings)


@pytest.fixture(scope="module")
def replicated_proxy(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    proxy = proxy_for(cluster, tmp_path_factory.mktemp("replicas") / "anonproxy.log")
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()


def connect(proxy: Endpoint, role: str) -> psycopg.Connection:
    return psycopg.connect(proxy.dsn(DATABASE, user=role, password=role), autocommit=True)


def ran_on(server: EmbeddedPostgres, number: int) -> bool:
    """Whether a statement holding ``number`` ran on ``server`` (its log; an audit-trail row's parameters, which
    hold the client's statement, do not count)."""
    lines = server.log_file.read_text(errors="replace").splitlines()
    return any(str(number) in line and "parameters:" not in line for line in lines)


def wait_for_log(proxy: ProxyProcess, text: str, seen_before: int, timeout: float = 30) -> None:
    """Until every worker has logged ``text`` once more than the ``seen_before`` times it had."""
    deadline = time.monotonic() + timeout
    while proxy.log().count(text) < seen_before + WORKERS:
        assert time.monotonic() < deadline, f"the proxy did not log {text!r}:\n{proxy.log()[-3000:]}"
        time.sleep(0.05)


def charges(cluster: Cluster, role: str) -> int:
    with cluster.superuser(cluster.primary) as conn:
        return conn.execute("select count(*) from anonproxy.budget_ledger where role_name = %s", [role]).fetchone()[0]


def reporter_counts(proxy: Endpoint, number: int) -> dict[int, int]:
    with connect(proxy, "reporter") as conn:
        rows = conn.execute(f"select age, count(*) from adult where hours_per_week <> {number} group by age")
        return dict(rows.fetchall())


def analyst_count(proxy: Endpoint, number: int) -> tuple[float, list[str]]:
    with connect(proxy, "analyst") as conn:
        notices: list[str] = []
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        value = conn.execute(f"select count(*) from adult where hours_per_week <> {number}").fetchone()[0]
        return value, notices


SERVICE = "user=s password=p dbname=d"


def test_upstream_may_list_hosts_and_standbys_take_both_forms(tmp_path: Path) -> None:
    config = ProxyConfig(upstream="host=a,b port=5432,5433", service_dsn=SERVICE,
                         standbys="c:5434, [::1]:5435, d")
    assert config.upstream_addresses == (UpstreamAddress("a", 5432), UpstreamAddress("b", 5433))
    assert config.standby_addresses == (UpstreamAddress("c", 5434), UpstreamAddress("::1", 5435),
                                        UpstreamAddress("d", 5432))
    assert psycopg.conninfo.conninfo_to_dict(config.service_conninfo) == {
        "user": "s", "password": "p", "dbname": "d", "host": "a,b", "port": "5432,5433",
        "target_session_attrs": "read-write", "sslmode": "disable"}  # the upstream's TLS setting (its default)
    path = tmp_path / "anonproxy.yaml"
    path.write_text(f"service_dsn: {SERVICE}\nstandbys: [e:1, f:2]\naccept_async_ledger: on\n")
    loaded = load_config(path, environ={})
    assert loaded.standby_addresses == (UpstreamAddress("e", 1), UpstreamAddress("f", 2))
    assert loaded.accept_async_ledger
    assert ProxyConfig(standbys="host=g,h port=7", service_dsn=SERVICE).standby_addresses == (
        UpstreamAddress("g", 7), UpstreamAddress("h", 7))


@pytest.mark.parametrize(("settings", "words"), [
    ({"standbys": "a:1"}, "standbys and an upstream of several hosts need service_dsn"),
    ({"upstream": "host=a,b"}, "standbys and an upstream of several hosts need service_dsn"),
    ({"standbys": "a:x", "service_dsn": SERVICE}, "standbys port is not a number: 'x'"),
    ({"standbys": "host=a,b port=1,2,3", "service_dsn": SERVICE}, "standbys names 2 hosts but 3 ports"),
    ({"max_standby_lag": -1}, "max_standby_lag must be between 0"),
    ({"standby_check_interval": 0}, "standby_check_interval must be more than 0"),
])
def test_bad_replica_settings_are_named(settings: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ProxyConfig(**settings)  # type: ignore[arg-type]


def test_gated_reads_run_on_a_standby_while_direct_roles_ledger_and_trail_use_the_primary(
        cluster: Cluster, replicated_proxy: ProxyProcess) -> None:
    proxy = replicated_proxy.endpoint
    suppressed, measured, direct = next(_numbers), next(_numbers), next(_numbers)
    charged = charges(cluster, "analyst")
    assert reporter_counts(proxy, suppressed)
    analyst_count(proxy, measured)
    with connect(proxy, "dba") as conn:
        conn.execute(f"select count(*) from adult where hours_per_week <> {direct}").fetchone()
    assert any(ran_on(standby, suppressed) for standby in cluster.standbys)
    assert any(ran_on(standby, measured) for standby in cluster.standbys)
    assert not ran_on(cluster.primary, suppressed) and not ran_on(cluster.primary, measured)
    assert ran_on(cluster.primary, direct)
    assert not any(ran_on(standby, direct) for standby in cluster.standbys)
    # The charge and the trail rows were written on the primary (the standbys cannot be written).
    assert charges(cluster, "analyst") == charged + 1
    with cluster.superuser(cluster.primary) as conn:
        trail = conn.execute("select statement from anonproxy.audit_trail where statement like %s or statement like "
                             "%s", [f"%{suppressed}%", f"%{measured}%"]).fetchall()
    assert len(trail) == 2


def test_a_dp_measurement_on_a_standby_runs_in_the_clients_time_zone(cluster: Cluster,
                                                                     replicated_proxy: ProxyProcess) -> None:
    """The standby's read transaction sets the client's TimeZone (a bound value, in the standby's log)."""
    number = next(_numbers)
    with connect(replicated_proxy.endpoint, "analyst") as conn:
        conn.execute("set time zone 'Pacific/Chatham'")
        conn.execute(f"select count(*) from adult where hours_per_week <> {number}").fetchone()
    standby = next(standby for standby in cluster.standbys if ran_on(standby, number))
    assert "'Pacific/Chatham'" in standby.log_file.read_text(errors="replace")


def pause_replay(cluster: Cluster, pause: bool) -> None:
    for standby in cluster.standbys:
        with cluster.superuser(standby) as conn:
            conn.execute("select pg_wal_replay_pause()" if pause else "select pg_wal_replay_resume()")
    if not pause:
        for standby in cluster.standbys:
            wait_replayed(cluster.primary, standby)


@pytest.fixture
def stale_standbys(cluster: Cluster) -> Iterator[None]:
    """Both standbys stop replaying (still in rotation: what the primary writes next stays under max_standby_lag)."""
    pause_replay(cluster, True)
    try:
        yield
    finally:
        pause_replay(cluster, False)


def data_version(conn: psycopg.Connection) -> str:
    return conn.execute("select anonproxy.data_version(array['public.adult'])").fetchone()[0]


def test_a_dp_answer_measured_on_a_stale_standby_is_cached_under_the_version_it_read(
        cluster: Cluster, replicated_proxy: ProxyProcess, stale_standbys: None) -> None:
    proxy = replicated_proxy.endpoint
    number = next(_numbers)
    with cluster.superuser(cluster.standbys[0]) as conn:
        stale = data_version(conn)
    with cluster.superuser(cluster.primary) as conn:
        conn.execute("update adult set hours_per_week = hours_per_week where age = 90")  # a new data version
        current = data_version(conn)
        started = conn.execute("select now()").fetchone()[0]
    assert stale != current
    charged = charges(cluster, "analyst")

    _, notices = analyst_count(proxy, number)  # charged on the primary; measured on a standby that has not replayed it
    assert not any("answered before" in notice for notice in notices)
    assert charges(cluster, "analyst") == charged + 1
    with cluster.superuser(cluster.primary) as conn:
        versions = [row[0] for row in conn.execute(
            "select data_version from anonproxy.answer_cache where role_name = 'analyst' and created_at > %s",
            [started]).fetchall()]
    assert stale in versions and current not in versions
    # The primary's data is newer than the cached answer: asking again is a new question, charged again.
    _, notices = analyst_count(proxy, number)
    assert not any("answered before" in notice for notice in notices)
    assert charges(cluster, "analyst") == charged + 2

    pause_replay(cluster, False)  # caught up: measured on the current data, cached under its version, then free
    analyst_count(proxy, number)
    assert charges(cluster, "analyst") == charged + 3
    _, notices = analyst_count(proxy, number)
    assert any("answered before" in notice for notice in notices)
    assert charges(cluster, "analyst") == charged + 3


def test_suppression_on_a_stale_standby_answers_for_the_data_it_holds(
        cluster: Cluster, replicated_proxy: ProxyProcess, stale_standbys: None) -> None:
    proxy = replicated_proxy.endpoint
    with cluster.superuser(cluster.standbys[0]) as conn:
        stale = dict(conn.execute("select age, count(*) from adult group by age").fetchall())
    moved = max(age for age, n in stale.items() if 20 <= n <= 100)  # a group of a few pages' rows
    with cluster.superuser(cluster.primary) as conn:
        conn.execute("update adult set age = age + 100 where age = %s", [moved])
    try:
        answer = reporter_counts(proxy, next(_numbers))
    finally:
        with cluster.superuser(cluster.primary) as conn:
            conn.execute("update adult set age = age - 100 where age = %s", [moved + 100])
    # The answer is the suppressed answer on the standby's snapshot (the group not yet moved), a committed state of
    # the database: every released group is one of that snapshot, with its count, at least k = 10, and the groups
    # under k are released together as one (NULL) group.
    assert moved in answer and moved + 100 not in answer
    assert answer == {**{age: n for age, n in stale.items() if n >= 10},
                      None: sum(n for n in stale.values() if n < 10)}


def test_a_lagging_standby_leaves_the_rotation_and_comes_back(
        cluster: Cluster, replicated_proxy: ProxyProcess) -> None:
    proxy = replicated_proxy.endpoint
    lagging, other = cluster.standbys
    out, back = f"standby 127.0.0.1:{lagging.port} is out of rotation", f"standby 127.0.0.1:{lagging.port} is in rotation"
    seen_out, seen_back = replicated_proxy.log().count(out), replicated_proxy.log().count(back)
    with cluster.superuser(lagging) as conn:
        conn.execute("select pg_wal_replay_pause()")
    try:
        with cluster.superuser(cluster.primary) as conn:  # more WAL than max_standby_lag
            conn.execute("create table filler as select g, repeat('x', 100) as pad from generate_series(1, 60000) g")
            conn.execute("drop table filler")
        wait_for_log(replicated_proxy, out, seen_out)
        numbers = [next(_numbers) for _ in range(6)]
        for number in numbers[:3]:
            assert reporter_counts(proxy, number)  # none fails
        for number in numbers[3:]:
            analyst_count(proxy, number)
        assert not any(ran_on(lagging, number) for number in numbers)
        # On the other standby, or on the primary while the other one too was replaying the burst of WAL.
        assert all(ran_on(other, number) or ran_on(cluster.primary, number) for number in numbers)
    finally:
        with cluster.superuser(lagging) as conn:
            conn.execute("select pg_wal_replay_resume()")
    wait_for_log(replicated_proxy, back, seen_back)
    # Back in rotation: dp measurements pick the standby with the least lag, the first listed on a tie.
    deadline = time.monotonic() + 30
    while True:
        number = next(_numbers)
        analyst_count(proxy, number)
        if ran_on(lagging, number):
            break
        assert time.monotonic() < deadline, "no dp measurement ran on the standby after it caught up"


async def _login_error(proxy: Endpoint, role: str) -> asyncpg.PostgresError | None:
    try:
        conn = await asyncpg.connect(host=proxy.host, port=proxy.port, user=role, password=role, database=DATABASE)
    except asyncpg.PostgresError as exc:
        return exc
    await conn.close()
    return None


def test_dp_logins_are_refused_while_the_ledger_replicates_asynchronously_unless_accepted(
        cluster: Cluster, replicated_proxy: ProxyProcess, tmp_path: Path) -> None:
    proxy = replicated_proxy.endpoint
    seen = replicated_proxy.log().count("replicates asynchronously")
    set_synchronous(cluster.primary, False)
    try:
        wait_for_log(replicated_proxy, "replicates asynchronously", seen)
        refused = asyncio.run(_login_error(proxy, "analyst"))
        assert refused is not None and refused.sqlstate == "55000", refused
        assert "asynchronously" in str(refused)
        assert "synchronous_standby_names" in refused.hint and "accept_async_ledger" in refused.hint
        assert asyncio.run(_login_error(proxy, "reporter")) is None  # other modes are not at risk
        accepting = proxy_for(cluster, tmp_path / "accepting.log", accept_async_ledger="on")
        try:
            assert asyncio.run(_login_error(accepting.endpoint, "analyst")) is None
            analyst_count(accepting.endpoint, next(_numbers))
        finally:
            stop_proxy(accepting)
    finally:
        seen = replicated_proxy.log().count("replicates synchronously")
        set_synchronous(cluster.primary, True)
    wait_for_log(replicated_proxy, "replicates synchronously", seen)
    assert asyncio.run(_login_error(proxy, "analyst")) is None


def test_a_stopped_standby_leaves_the_rotation_without_failing_statements(
        cluster: Cluster, replicated_proxy: ProxyProcess) -> None:
    proxy = replicated_proxy.endpoint
    for number in (next(_numbers), next(_numbers)):  # pooled connections to both standbys, warm
        reporter_counts(proxy, number)
        analyst_count(proxy, number)
    stopped, other = cluster.standbys
    with connect(proxy, "reporter") as reporter, connect(proxy, "analyst") as analyst:
        stopped.stop()  # the last test of the module: the standby is gone for good
        numbers = [next(_numbers) for _ in range(8)]
        for number in numbers[:4]:  # at once, before a probe notices: each statement finds another server
            assert reporter.execute(f"select age, count(*) from adult where hours_per_week <> {number} "
                                    "group by age").fetchall()
        for number in numbers[4:]:
            assert analyst.execute(f"select count(*) from adult where hours_per_week <> {number}").fetchone()
    assert all(ran_on(other, number) or ran_on(cluster.primary, number) for number in numbers)
    assert f"standby 127.0.0.1:{stopped.port} is out of rotation" in replicated_proxy.log()
