"""Generated suppression SQL run as the proxy's service session runs it, for tests that compare two shapes' SQL (or
one shape's two paths) on the same data: rows, the suppression report's details, and the error, if any; and the SQL
itself, as the proxy writes it for a role, and forced onto its exact path."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg

from anonproxy.policy.model import Policy, RolePolicy
from anonproxy.policy.store import load_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite

SURE = "SELECT NOT EXISTS (SELECT FROM (SELECT *"  # the start of anonproxy_sure's body (bounds first)


def run_as_service(conn: psycopg.Connection[Any], sql: str) -> tuple[list[tuple[Any, ...]], list[str], str | None]:
    """Rows, the report's details (its notices), and the error (SQLSTATE and message), as the service session would
    see them: in a transaction of their own, ``search_path = pg_catalog``, no JIT."""
    details: list[str] = []

    def keep(notice: psycopg.errors.Diagnostic) -> None:
        details.append(notice.message_detail or "")

    conn.add_notice_handler(keep)
    try:
        with conn.transaction():
            conn.execute("SET LOCAL search_path = pg_catalog")
            conn.execute("SET LOCAL jit = off")
            return conn.execute(sql).fetchall(), details, None
    except psycopg.Error as error:
        return [], details, f"{error.sqlstate} {error.diag.message_primary}"
    finally:
        conn.remove_notice_handler(keep)


def sorted_rows(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Rows in a fixed order, numeric values as text (so that the same scale is compared too)."""
    normal = [tuple(str(v) if isinstance(v, Decimal) else v for v in row) for row in rows]
    return sorted(normal, key=lambda row: tuple((v is None, str(v)) for v in row))


def rewritten(statement: str, role: RolePolicy, policy: Policy) -> str:
    """The SQL the proxy runs for ``statement`` of ``role`` (which it must rewrite)."""
    decision = decide(statement, role, policy)
    assert isinstance(decision, Rewrite), (statement, decision)
    return decision.runs


def reporter_sql(conn: psycopg.Connection[Any], statement: str) -> str:
    """The SQL the proxy runs for ``statement`` of the demo's ``reporter`` under the policy of ``conn``'s database."""
    policy = load_policy(conn)
    return rewritten(statement, policy.roles["reporter"], policy)


def exact_path(sql: str) -> str:
    """Bounds-first SQL (one ``anonproxy_sure``) forced onto its exact path: ``anonproxy_sure`` false."""
    assert sql.count(SURE) == 1, sql
    return sql.replace(SURE, "SELECT false AND " + SURE.removeprefix("SELECT "))


def service_answer(conn: psycopg.Connection[Any], sql: str) -> tuple[list[tuple[Any, ...]], list[str]]:
    """Sorted rows (numeric as text: the same scale too) and the report's details, as the service session runs
    ``sql``, which must not fail."""
    rows, details, error = run_as_service(conn, sql)
    assert error is None, error
    return sorted_rows(rows), details


def bounds_settle(conn: psycopg.Connection[Any], sql: str) -> bool:
    """Whether the bounds of bounds-first SQL settle every group: its CTEs up to ``anonproxy_sure``, and its value."""
    end = sql.index("\n)", sql.index(SURE)) + 2
    rows, _, error = run_as_service(conn, sql[:end] + "\nSELECT sure FROM anonproxy_sure")
    assert error is None, error
    return bool(rows[0][0])
