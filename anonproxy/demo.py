"""Demo login roles for `anonproxy up`; each one's password is its name.

- ``dba`` reads everything (``pg_read_all_data``) and uses the proxy in direct
  mode (pass-through); it is not a superuser. It may create tables in schema
  ``public`` and write the release registry and the hierarchies, so it can
  build anonymized releases (docs/views.md, "Rights").
- ``reporter`` and ``analyst`` may connect and browse the catalogs but hold no
  privilege on any table of schema ``public``, so every statement that reaches
  PostgreSQL as them fails with ``permission denied`` (SQLSTATE 42501), whether
  they connect directly or through the proxy: bypass yields nothing. The
  privacy policy (``anonproxy.apply_grants``) then grants them REFERENCES on
  protected tables, so catalog browsing lists their columns.

They may not create objects either (no CREATE on schema ``public``, no
TEMPORARY on the database): a table of their own with a foreign key to a
protected table would probe its keys through that REFERENCES privilege.

- ``auditor`` is a member of ``anonproxy_auditor`` (sql/0026_auditor.sql): it
  reads the audit trail, the budgets, the ledger, the release registry and the
  policy's history, for ``anonproxy console``, and no row of ``adult``.
"""

from __future__ import annotations

import secrets

import psycopg
from psycopg import sql

from . import sample_data, schema
from .policy.yaml_policy import apply_policy, demo_policy
from .proxy.service_role import WIDENING_ROLES

DEMO_ROLES = ("dba", "reporter", "analyst", "auditor")
DIRECT_ROLES = ("dba",)
AUDITOR_LOGIN = "auditor"
AUDITOR_GROUP = "anonproxy_auditor"  # created by sql/0026_auditor.sql
RESTRICTED_ROLES = tuple(role for role in DEMO_ROLES if role not in (*DIRECT_ROLES, AUDITOR_LOGIN))


class DemoSetupError(RuntimeError):
    """The demo roles cannot be set up as asked."""


def create_demo_roles(conn: psycopg.Connection, dbname: str) -> None:
    """Create (or reset) the demo roles and their privileges on ``dbname``; idempotent.

    ``conn`` must be a superuser (or CREATEROLE + owner) connection to ``dbname``
    itself, because schema and table privileges are per database.
    """
    if conn.info.dbname != dbname:
        raise DemoSetupError(
            f"connect to database {dbname!r} to set up its demo roles (connected to {conn.info.dbname!r})"
        )
    database = sql.Identifier(dbname)
    direct = sql.SQL(", ").join(map(sql.Identifier, DIRECT_ROLES))
    restricted = sql.SQL(", ").join(map(sql.Identifier, RESTRICTED_ROLES))
    statements: list[sql.SQL | sql.Composed] = [
        sql.SQL("grant connect, temporary on database {} to {}").format(database, direct),
        sql.SQL("grant pg_read_all_data to {}").format(direct),
        sql.SQL("revoke temporary on database {} from public").format(database),
        sql.SQL("grant connect on database {} to {}").format(database, restricted),
        sql.SQL("revoke create on schema public from public"),
        sql.SQL("grant create on schema public to {}").format(direct),
        sql.SQL("grant insert, update, delete on anonproxy.releases, anonproxy.hierarchies, "
                "anonproxy.hierarchy_nodes to {}").format(direct),
        sql.SQL("grant usage on schema public to {}").format(restricted),
        sql.SQL("revoke all on all tables in schema public from public, {}").format(restricted),
    ]
    with conn.transaction():
        for role in (*DIRECT_ROLES, *RESTRICTED_ROLES):
            _ensure_login_role(conn, role, password=role)
        for statement in statements:
            conn.execute(statement)
        ensure_auditor(conn, dbname)


def ensure_auditor(conn: psycopg.Connection, dbname: str) -> None:
    """Create (or reset) the ``auditor`` login, a member of anonproxy_auditor that may connect to ``dbname``.

    `up` calls it on a reused data directory too, made before the auditor existed.
    """
    with conn.transaction():
        _ensure_login_role(conn, AUDITOR_LOGIN, password=AUDITOR_LOGIN)
        conn.execute(sql.SQL("grant connect on database {} to {}").format(sql.Identifier(dbname),
                                                                          sql.Identifier(AUDITOR_LOGIN)))
        conn.execute(sql.SQL("grant {} to {}").format(sql.Identifier(AUDITOR_GROUP), sql.Identifier(AUDITOR_LOGIN)))


def _ensure_login_role(conn: psycopg.Connection, role: str, password: str) -> None:
    """Create the role or reset an existing one: login, no special powers, this password."""
    exists = conn.execute("select 1 from pg_roles where rolname = %s", (role,)).fetchone() is not None
    # Hashed here so the clear-text password never reaches the server's logs.
    verifier = conn.pgconn.encrypt_password(password.encode(), role.encode(), b"scram-sha-256").decode()
    conn.execute(
        sql.SQL(
            "{} role {} login nosuperuser nocreatedb nocreaterole noreplication nobypassrls password {}"
        ).format(sql.SQL("alter" if exists else "create"), sql.Identifier(role), sql.Literal(verifier))
    )


def reset_service_role(conn: psycopg.Connection, role: str) -> str:
    """Create or reset the proxy's service login with a new random password; return it.

    The policy's grants (``anonproxy.apply_grants``) give it SELECT on the
    protected tables; a new password at every ``up`` means none lives on disk.
    Its memberships in predefined roles that widen what it reads (pg_monitor,
    pg_read_all_stats, ...) are revoked: the proxy refuses such a login.
    """
    password = secrets.token_urlsafe(24)
    with conn.transaction():
        _ensure_login_role(conn, role, password)
        granted = conn.execute(
            "select g.rolname from pg_catalog.pg_auth_members m join pg_catalog.pg_roles g on g.oid = m.roleid "
            "join pg_catalog.pg_roles u on u.oid = m.member where u.rolname = %s and g.rolname = any(%s)",
            (role, list(WIDENING_ROLES))).fetchall()
        for (widening,) in granted:
            conn.execute(sql.SQL("revoke {} from {}").format(sql.Identifier(widening), sql.Identifier(role)))
    return password


def govern_by_demo_policy(conn: psycopg.Connection, dbname: str, service_role: str, service_password: str) -> None:
    """The demo roles, the service login ``service_role`` with ``service_password`` and the demo policy in
    ``dbname`` (whose tables are already there); the caller commits."""
    create_demo_roles(conn, dbname)
    reset_service_role(conn, service_role)
    conn.execute(sql.SQL("alter role {} password {}").format(sql.Identifier(service_role),
                                                             sql.Literal(service_password)))
    apply_policy(conn, demo_policy())


def install_demo_database(conn: psycopg.Connection, dbname: str, service_role: str, service_password: str) -> None:
    """An empty ``dbname`` made as ``anonproxy up`` makes it: the anonproxy schema, the demo data, then
    `govern_by_demo_policy`. For test and benchmark servers, whose service login needs a known password; the
    caller commits."""
    schema.install(conn)
    sample_data.load_demo(conn)
    govern_by_demo_policy(conn, dbname, service_role, service_password)
