"""Install the ``anonproxy`` schema from the ordered SQL migrations shipped with the package.

The migrations are ``sql/NNNN_name.sql`` in the source tree. They are package
data of ``anonproxy.sql``: ``anonproxy/sql`` is a symlink to ``../sql``, so
setuptools' package discovery finds them for both wheels and editable installs.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from importlib.resources import files
from typing import NamedTuple

import psycopg
from psycopg.pq import TransactionStatus

_FILE_NAME = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")
# Serialises concurrent installers; the bytes spell "anonprxy".
_LOCK_KEY = 0x616E6F6E70727879


class SchemaError(RuntimeError):
    """The migrations are inconsistent or cannot be applied as asked."""


class Migration(NamedTuple):
    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    """Every shipped migration, sorted by version."""
    found: list[Migration] = []
    for entry in files("anonproxy.sql").iterdir():
        if not entry.name.endswith(".sql"):
            continue
        match = _FILE_NAME.fullmatch(entry.name)
        if match is None:
            raise SchemaError(f"migration file {entry.name!r} is not named NNNN_name.sql")
        found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    clashes = sorted(version for version, n in Counter(m.version for m in found).items() if n > 1)
    if clashes:
        raise SchemaError(f"several migration files share version(s) {clashes}")
    return sorted(found)


def installed_versions(conn: psycopg.Connection) -> list[int]:
    """Versions recorded in ``anonproxy.schema_migrations``; empty if the schema is not installed."""
    if conn.execute("select to_regclass('anonproxy.schema_migrations')").fetchone() == (None,):
        return []
    return [row[0] for row in conn.execute("select version from anonproxy.schema_migrations order by version")]


# From this version on the ledger is readable by every role (sql/0018): a service login that cannot read it
# is looking at a schema installed before that.
READABLE_FROM = 18
INSTALL_COMMAND = "anonproxy install --dsn DSN"  # DSN: a login that owns the anonproxy schema

_LEDGER = "select to_regclass('anonproxy.schema_migrations') is not null, " \
          "coalesce(has_schema_privilege(to_regnamespace('anonproxy'), 'usage') and has_table_privilege(" \
          "to_regclass('anonproxy.schema_migrations'), 'select'), false)"
_VERSIONS = "select version from anonproxy.schema_migrations"


def missing_versions(conn: psycopg.Connection) -> list[int]:
    """Shipped migrations this database lacks, as any login (the proxy's service login) can tell them."""
    row = conn.execute(_LEDGER).fetchone()
    assert row is not None
    installed = [r[0] for r in conn.execute(_VERSIONS)] if row[0] and row[1] else None
    return _missing(bool(row[0]), installed)


async def missing_versions_async(conn: psycopg.AsyncConnection) -> list[int]:
    """:func:`missing_versions` on an asynchronous connection."""
    row = await (await conn.execute(_LEDGER)).fetchone()
    assert row is not None
    installed = [r[0] for r in await (await conn.execute(_VERSIONS)).fetchall()] if row[0] and row[1] else None
    return _missing(bool(row[0]), installed)


def _missing(exists: bool, installed: list[int] | None) -> list[int]:
    shipped = [migration.version for migration in migrations()]
    if not exists:
        return shipped
    if installed is None:  # an unreadable ledger: installed before READABLE_FROM, which is missing with its successors
        return [version for version in shipped if version >= READABLE_FROM]
    return sorted(set(shipped) - set(installed))


def outdated_message(missing: list[int], database: str) -> str:
    """One line: which migrations ``database`` lacks and the command that installs them."""
    shipped = migrations()
    if len(missing) == len(shipped):
        return f"database {database!r} has no anonproxy schema; run `{INSTALL_COMMAND}` as a login that may create it"
    versions = ", ".join(f"{version:04d}" for version in missing)
    plural = "s" if len(missing) > 1 else ""
    return (f"the anonproxy schema of database {database!r} lacks migration{plural} {versions} "
            f"(this anonproxy ships {shipped[0].version:04d} to {shipped[-1].version:04d}); "
            f"run `{INSTALL_COMMAND}` as the schema's owner")


def install(conn: psycopg.Connection, progress: Callable[[int, int, str], None] | None = None) -> list[int]:
    """Apply the missing migrations, each in its own transaction; return the versions applied.

    ``progress(done, total, what)`` is called before each migration that is applied (``done`` counts the
    shipped migrations up to it, installed or not).

    Runs each file with ``search_path = pg_catalog, pg_temp`` so that an
    unqualified name fails instead of landing in whatever schema comes first.
    """
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise SchemaError(
            "install() commits each migration on its own: pass a connection that is not inside a transaction"
        )
    applied: list[int] = []
    shipped = migrations()
    for done, migration in enumerate(shipped, 1):
        with conn.transaction():
            conn.execute("select pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
            if migration.version in installed_versions(conn):
                continue
            if progress is not None:
                progress(done, len(shipped), f"migration {migration.version:04d} {migration.name}")
            conn.execute("select set_config('search_path', 'pg_catalog, pg_temp', true)")
            _apply(conn, migration)
        applied.append(migration.version)
    return applied


def _apply(conn: psycopg.Connection, migration: Migration) -> None:
    try:
        # Without parameters psycopg uses the simple query protocol, so a file
        # may hold many statements; bytes because the text is not a literal.
        conn.execute(migration.sql.encode())
    except psycopg.Error as exc:
        raise SchemaError(f"migration {migration.version:04d}_{migration.name} failed: {exc}") from exc
    conn.execute(
        "insert into anonproxy.schema_migrations (version, name) values (%s, %s)",
        (migration.version, migration.name),
    )
