"""The service login may read the protected tables, and nothing that widens what the catalogs show.

Rewritten statements run as the service role. If it were a superuser, or a
member of a predefined role such as pg_read_all_stats or pg_monitor, a
statement the rewriter let through could read other sessions' queries
(pg_stat_activity), the statistics of protected columns (pg_stats), settings
or server files. The proxy refuses to start with such a login, and each
worker stops serving (every login gets 57P03) if the login gains such powers
later (checked at every policy reload).
"""

from __future__ import annotations

from typing import Any

import psycopg

# Predefined roles that let a member see more than its own privileges allow (catalog views, statistics,
# settings, other sessions, server files) or do more than read. Roles this server does not have are ignored.
WIDENING_ROLES = (
    "pg_read_all_data", "pg_write_all_data", "pg_read_all_settings", "pg_read_all_stats", "pg_stat_scan_tables",
    "pg_monitor", "pg_read_server_files", "pg_write_server_files", "pg_execute_server_program",
    "pg_signal_backend", "pg_signal_autovacuum_worker", "pg_checkpoint", "pg_maintain", "pg_create_subscription",
    "pg_use_reserved_connections",
)  # fmt: skip

# Whether the login is a superuser, and which widening roles it is a member of, directly or through other roles.
_QUERY = """select r.rolname, r.rolsuper,
       array(select w.rolname::text from pg_catalog.pg_roles w
              where w.rolname = any(%s) and pg_catalog.pg_has_role(r.oid, w.oid, 'MEMBER') order by 1)
  from pg_catalog.pg_roles r where r.rolname = current_user"""
HINT = ("Log the proxy in as a role of its own with no special powers; anonproxy.apply_grants() gives it SELECT on "
        "the protected tables.")


def _problem(row: tuple[Any, ...] | None) -> str | None:
    if row is None:
        return "the service login's role could not be read from pg_roles"
    name, superuser, roles = row
    if superuser:
        return f'the service login "{name}" is a superuser'
    if roles:
        return f'the service login "{name}" is a member of {", ".join(roles)}'
    return None


def excess_privileges(conn: psycopg.Connection[Any]) -> str | None:
    """Why the login of ``conn`` may not be the service login, or None when it may."""
    return _problem(conn.execute(_QUERY, [list(WIDENING_ROLES)]).fetchone())


async def excess_privileges_async(conn: psycopg.AsyncConnection[Any]) -> str | None:
    """:func:`excess_privileges` on an async connection."""
    cursor = await conn.execute(_QUERY, [list(WIDENING_ROLES)])
    return _problem(await cursor.fetchone())
