"""A primary and hot standbys for the replica and fail-over tests (and benchmarks/failover).

Real PostgreSQL servers (anonproxy.embedded, as the ``postgres`` OS user when we are root) with streaming
replication from base backups, and durable settings: the embedded server's throwaway speed-ups (fsync and
synchronous_commit off) would make "the charge is on the standby when it returns" untrue, so they are turned back on.
The primary holds the demo database: the Adult table, the demo roles and policy, the service login.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping

import psycopg

from anonproxy import demo
from anonproxy.embedded import EmbeddedPostgres

DATABASE = "replicated"
SERVICE_ROLE = "anonproxy_service"
REPLICATION_HBA = "host replication postgres 127.0.0.1/32 scram-sha-256"
DURABLE = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on", "wal_log_hints": "on",
           "hot_standby_feedback": "on"}


def new_server(port: int = 0, settings: Mapping[str, str] | None = None) -> EmbeddedPostgres:
    """A server (not started) configured for replication, asynchronous until :func:`make_synchronous`."""
    return EmbeddedPostgres(port=port, hba_extra=[REPLICATION_HBA], settings={**DURABLE, **(settings or {})})


def start_standby(primary: EmbeddedPostgres, port: int = 0,
                  settings: Mapping[str, str] | None = None) -> EmbeddedPostgres:
    """A hot standby of ``primary``, streaming. Once promoted, its commits wait for a standby of its own
    (synchronous_standby_names = '*' in its configuration: a fail-over keeps the ledger synchronous)."""
    standby = new_server(port, {"synchronous_standby_names": "*", **(settings or {})})
    standby.start_standby_of(primary)
    return standby


def set_synchronous(server: EmbeddedPostgres, synchronous: bool, timeout: float = 30) -> None:
    """Whether ``server``'s commits wait for one standby (synchronous_standby_names = '*', ALTER SYSTEM); returns once
    a standby is synchronous (or none is). Set it once a standby streams: with none, every commit waits."""
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        conn.execute("alter system set synchronous_standby_names = %s" % ("'*'" if synchronous else "''"))
        conn.execute("select pg_reload_conf()")
        deadline = time.monotonic() + timeout
        while conn.execute("select count(*) > 0 from pg_stat_replication where sync_state = 'sync'").fetchone()[0] \
                != synchronous:
            assert time.monotonic() < deadline, f"server {server.port} did not become synchronous={synchronous}"
            time.sleep(0.05)


def prepare_database(primary: EmbeddedPostgres) -> None:
    """The demo database on ``primary``: Adult, the demo roles, the service login (password: its name), the demo
    policy."""
    with psycopg.connect(primary.conninfo(), autocommit=True) as conn:
        conn.execute(f"create database {DATABASE}")
    with psycopg.connect(primary.conninfo(dbname=DATABASE)) as conn:
        demo.install_demo_database(conn, DATABASE, SERVICE_ROLE, SERVICE_ROLE)
        conn.commit()


def create_dp_roles(primary: EmbeddedPostgres, roles: list[str], epsilon: float = 1e6) -> None:
    """Login roles (password: their name) in dp mode, each with a budget of ``epsilon`` on public.adult, 0.5 per
    query."""
    with psycopg.connect(primary.conninfo(dbname=DATABASE), autocommit=True) as conn:
        for role in roles:
            conn.execute(f"create role {role} login password '{role}'")
            conn.execute("select anonproxy.set_role_policy(%s, 'dp')", [role])
            conn.execute("select anonproxy.set_budget(%s, 'public.adult'::regclass, %s::numeric, 0.001, null, 0.5, "
                         "0.0000001)", [role, epsilon])


def wait_replayed(primary: EmbeddedPostgres, standby: EmbeddedPostgres, timeout: float = 30) -> None:
    """Until ``standby`` has replayed everything ``primary`` wrote so far."""
    with psycopg.connect(primary.conninfo(), autocommit=True) as conn:
        target = conn.execute("select pg_current_wal_lsn()").fetchone()[0]
    deadline = time.monotonic() + timeout
    with psycopg.connect(standby.conninfo(), autocommit=True) as conn:
        while not conn.execute("select pg_last_wal_replay_lsn() >= %s::pg_lsn", [target]).fetchone()[0]:
            assert time.monotonic() < deadline, f"standby {standby.port} did not replay up to {target}"
            time.sleep(0.05)


def service_dsn() -> str:
    return f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={DATABASE}"


def fail_over(primary: EmbeddedPostgres, standby: EmbeddedPostgres,
              settings: Mapping[str, str] | None = None) -> tuple[EmbeddedPostgres, EmbeddedPostgres]:
    """kill -9 ``primary``, promote ``standby``, and re-create the old primary as a standby of the new one (a base
    backup, on the old port, so the proxy's upstream list still names both). Until then the new primary's commits
    (the ledger's charges) wait. Returns (new primary, new standby)."""
    port = primary.port
    primary.kill()
    primary.stop()  # its throwaway directory goes
    standby.promote()
    return standby, start_standby(standby, port=port, settings=settings)


class Askers:
    """Threads asking dp questions through a proxy, one role each, every question a new one (its own charge),
    until stopped; they reconnect after any error. ``delivered[role]``: the answers each role received."""

    def __init__(self, host: str, port: int, roles: list[str]) -> None:
        self._dsns = {role: f"host={host} port={port} dbname={DATABASE} user={role} password={role} "
                            "connect_timeout=5" for role in roles}
        self.delivered = dict.fromkeys(roles, 0)
        self.errors = dict.fromkeys(roles, 0)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._ask, args=(role,), daemon=True) for role in roles]

    def __enter__(self) -> Askers:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def wait_for_more(self, answers: int, timeout: float = 180) -> None:
        """Until every role has received ``answers`` more answers than now."""
        target = {role: n + answers for role, n in self.delivered.items()}
        deadline = time.monotonic() + timeout
        while any(self.delivered[role] < n for role, n in target.items()):
            assert time.monotonic() < deadline, f"answers stopped coming: {self.delivered}, errors {self.errors}"
            time.sleep(0.05)

    def _ask(self, role: str) -> None:
        conn: psycopg.Connection | None = None
        for number in itertools.count(1000):
            if self._stop.is_set():
                break
            try:
                if conn is None:
                    conn = psycopg.connect(self._dsns[role], autocommit=True)
                conn.execute(f"select count(*) from adult where hours_per_week <> {number}").fetchone()
                self.delivered[role] += 1
            except psycopg.Error:
                self.errors[role] += 1
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.1)
        if conn is not None:
            conn.close()


def charges_by_role(server: EmbeddedPostgres, roles: list[str]) -> dict[str, int]:
    """The distinct questions each role was charged for, as ``server``'s ledger holds them."""
    with psycopg.connect(server.conninfo(dbname=DATABASE), autocommit=True) as conn:
        rows = conn.execute("select role_name, count(distinct fingerprint) from anonproxy.budget_ledger "
                            "where role_name = any(%s) group by role_name", [roles]).fetchall()
    return {role: dict(rows).get(role, 0) for role in roles}
