"""A primary and hot standbys for the replica and fail-over tests (and benchmarks/failover).

Real PostgreSQL servers (anonproxy.embedded, as the ``postgres`` OS user when we are root) with streaming
replication from base backups, and durable settings: the embedded server's throwaway speed-ups (fsync and
synchronous_commit off) would make "the charge is on the standby when it returns" untrue, so they are turned back on.
The primary holds the demo database: the Adult table, the demo roles and policy, the service login.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import psycopg

from anonproxy import demo, sample_data, schema
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.yaml_policy import apply_policy, demo_policy

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
    """A hot standby of ``primary``, streaming; it inherits the primary's ALTER SYSTEM settings (a promoted standby
    of a synchronous primary is synchronous too)."""
    standby = new_server(port, settings)
    standby.start_standby_of(primary)
    return standby


def set_synchronous(server: EmbeddedPostgres, synchronous: bool) -> None:
    """Whether ``server``'s commits wait for one standby (synchronous_standby_names = '*', ALTER SYSTEM). Set it once
    a standby streams: with none, every commit waits."""
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        conn.execute("alter system set synchronous_standby_names = %s" % ("'*'" if synchronous else "''"))
        conn.execute("select pg_reload_conf()")


def prepare_database(primary: EmbeddedPostgres) -> None:
    """The demo database on ``primary``: Adult, the demo roles, the service login (password: its name), the demo
    policy."""
    with psycopg.connect(primary.conninfo(), autocommit=True) as conn:
        conn.execute(f"create database {DATABASE}")
    with psycopg.connect(primary.conninfo(dbname=DATABASE)) as conn:
        schema.install(conn)
        sample_data.load_adult(conn)
        demo.create_demo_roles(conn, DATABASE)
        demo.reset_service_role(conn, SERVICE_ROLE)
        conn.execute(f"alter role {SERVICE_ROLE} password '{SERVICE_ROLE}'")
        apply_policy(conn, demo_policy())
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
