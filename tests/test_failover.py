"""Fail-over that never under-counts (docs/replicas.md): no dp answer is ever delivered without its charge.

A real primary with a synchronous standby (synchronous_standby_names = '*', synchronous_commit on, fsync on: not
the embedded server's throwaway settings), the real proxy with both in its multi-host ``upstream`` and as
``standbys``, dp questions from eight threads (a role each, every question a new one); the primary's postmaster is
killed with SIGKILL while charges are in flight, the standby promoted, the old primary re-created as a standby of the
new one. Then the answers the clients received are compared with the charges the new primary holds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import ProxyProcess, start_proxy, stop_proxy
from replication import (
    DATABASE,
    Askers,
    charges_by_role,
    create_dp_roles,
    fail_over,
    new_server,
    prepare_database,
    service_dsn,
    set_synchronous,
    start_standby,
    wait_replayed,
)

from anonproxy.embedded import EmbeddedPostgres

ROLES = [f"asker_{i}" for i in range(8)]


@pytest.fixture
def pair() -> Iterator[list[EmbeddedPostgres]]:
    """[primary, synchronous standby]; whatever a test leaves running is stopped."""
    primary = new_server()
    primary.start()
    servers = [primary]
    try:
        prepare_database(primary)
        create_dp_roles(primary, ROLES)
        servers.append(start_standby(primary))
        set_synchronous(primary, True)
        wait_replayed(primary, servers[1])
        yield servers
    finally:
        for server in servers:
            server.stop()


def proxy_for(servers: list[EmbeddedPostgres], log_path: Path) -> ProxyProcess:
    ports = [server.port for server in servers]
    return start_proxy(f"host=127.0.0.1,127.0.0.1 port={ports[0]},{ports[1]}", log_path, workers="2",
                       service_dsn=service_dsn(), standbys=f"127.0.0.1:{ports[0]}, 127.0.0.1:{ports[1]}",
                       standby_check_interval="0.2")


def test_the_ledger_waits_for_the_standby(pair: list[EmbeddedPostgres]) -> None:
    with psycopg.connect(pair[0].conninfo(), autocommit=True) as conn:
        assert conn.execute("show synchronous_standby_names").fetchone() == ("*",)
        assert conn.execute("show fsync").fetchone() == ("on",)
        assert conn.execute("select sync_state from pg_stat_replication").fetchall() == [("sync",)]


@pytest.mark.timeout(600)
def test_no_answer_without_its_charge_across_a_fail_over(pair: list[EmbeddedPostgres], tmp_path: Path) -> None:
    proxy = proxy_for(pair, tmp_path / "anonproxy.log")
    try:
        with Askers(proxy.endpoint.host, proxy.endpoint.port, ROLES) as askers:
            askers.wait_for_more(3)  # every thread has questions under way
            primary, standby = pair
            pair[:] = fail_over(primary, standby)  # kill -9 while charges are in flight
            askers.wait_for_more(2)  # the proxy found the new primary: answers come again
        delivered, errors = dict(askers.delivered), dict(askers.errors)
        charged = charges_by_role(pair[0], ROLES)
    finally:
        stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()
    assert f"the primary is now 127.0.0.1:{pair[0].port}" in proxy.log()
    # Every answer a client received has its charge on the new primary. A question charged but not answered (cut
    # short by the crash: the client saw an error) is an over-count, never an under-count.
    assert all(delivered[role] <= charged[role] <= delivered[role] + errors[role] for role in ROLES), \
        (delivered, charged, errors)


def test_a_charge_whose_wait_for_the_standby_is_cancelled_is_not_answered(pair: list[EmbeddedPostgres],
                                                                          tmp_path: Path) -> None:
    """PostgreSQL commits locally, with a WARNING, when a commit's wait for the synchronous standby is cancelled (an
    administrator's pg_cancel_backend while the standby is down): such a charge is not on any standby, so the
    question it paid for must not be answered. The server's default here is synchronous_commit = off: the charge
    waits all the same (anonproxy.charge() commits with synchronous_commit on)."""
    proxy = proxy_for(pair, tmp_path / "anonproxy.log")
    primary, standby = pair
    role = ROLES[0]
    outcome: list[object] = []
    with psycopg.connect(primary.conninfo(), autocommit=True) as admin:
        admin.execute("alter system set synchronous_commit = off")
        admin.execute("select pg_reload_conf()")
    try:
        with psycopg.connect(proxy.endpoint.dsn(DATABASE, user=role, password=role), autocommit=True) as conn:
            conn.execute("select count(*) from adult where hours_per_week <> 101").fetchone()
            before = charges_by_role(primary, [role])[role]
            standby.stop()  # no synchronous standby left: every commit on the primary waits

            def ask() -> None:
                try:
                    outcome.append(conn.execute("select count(*) from adult where hours_per_week <> 102").fetchone())
                except psycopg.Error as exc:
                    outcome.append(exc)

            asking = threading.Thread(target=ask)
            asking.start()
            with psycopg.connect(primary.conninfo(), autocommit=True) as admin:
                while asking.is_alive():  # the charge's wait, then the audit trail's, are cancelled
                    admin.execute("select pg_cancel_backend(pid) from pg_stat_activity where wait_event = 'SyncRep'")
                    asking.join(0.2)
    finally:
        stop_proxy(proxy)
    assert isinstance(outcome[0], psycopg.Error), outcome
    assert outcome[0].sqlstate == "57014" and "synchronous standby was cancelled" in str(outcome[0])
    assert charges_by_role(primary, [role])[role] == before + 1  # charged on the primary, never answered
