"""The connection of a command that reads raw data: refused, before any statement, when anonproxy gates its login.

The commands of anonymized views (anonymize, release, verify, report, audit, hierarchy), of the policy and
`install` read source tables and the registry with plain SQL. Through anonproxy, a login in suppress or dp mode is
gated: its statements are refused, rewritten, or answered with noise and charged to its privacy budget. So each
command first sends ``SHOW anonproxy.mode``: the proxy answers it itself for a gated login (nothing reaches the
database, nothing is charged); for a login in direct mode the proxy relays it and PostgreSQL, which has no such
setting, refuses it (SQLSTATE 42704), as it does when the DSN names PostgreSQL itself.
"""

from __future__ import annotations

from typing import Any

import psycopg

# What PostgreSQL says of a setting it does not know: the login is not gated.
_UNKNOWN_SETTING = "42704"


class GatedLogin(Exception):
    """The login is gated by anonproxy: the command stops before sending anything that would be gated."""

    def __init__(self, command: str, login: str, mode: str) -> None:
        self.command = command
        super().__init__(
            f"login {login} is in {mode} mode at anonproxy ({_GATED.get(mode, 'its statements are gated')}), so this "
            "command cannot read raw data through it; run it as a login in direct mode (the demo's dba) or as the "
            "tables' owner")


# What the proxy does with a gated login's statements, by mode.
_GATED = {"dp": "its statements get noisy answers charged to its privacy budget",
          "suppress": "its statements get only k-anonymous aggregates"}


def connect(dsn: str, command: str, **options: Any) -> psycopg.Connection[Any]:
    """``psycopg.connect(dsn, **options)``, closed and refused with :class:`GatedLogin` when the login is gated."""
    conn = psycopg.connect(dsn, **options)
    try:
        mode = gated_mode(conn)
    except BaseException:
        conn.close()
        raise
    if mode is not None:
        login = conn.info.user
        conn.close()
        raise GatedLogin(command, login, mode)
    return conn


def gated_mode(conn: psycopg.Connection[Any]) -> str | None:
    """The login's mode when anonproxy gates it (suppress, dp), else None. Sent outside any transaction."""
    autocommit = conn.autocommit
    conn.autocommit = True  # no BEGIN before it, no transaction left open or aborted after it
    try:
        row = conn.execute("show anonproxy.mode").fetchone()
    except psycopg.Error as exc:
        if exc.sqlstate != _UNKNOWN_SETTING:
            raise
        return None
    finally:
        conn.autocommit = autocommit
    mode = None if row is None else str(row[0])
    return None if mode == "direct" else mode
