"""Generated suppression SQL run as the proxy's service session runs it, for tests that compare two shapes' SQL (or
one shape's two paths) on the same data: rows, the suppression report's details, and the error, if any."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg


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
