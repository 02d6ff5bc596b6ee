"""What the console reads from the database, as the login it was given (sql/0026_auditor.sql grants an auditor).

Every read is one function here; each raises psycopg's InsufficientPrivilege
when the login may not read what it needs, and the page says so. The trail's
cost columns are named in ``COST_COLUMNS`` only: those of them the table has
are shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from .flags import Budget, TrailRow

# The trail's per-answer cost columns, in the order shown, with their labels: (column, label).
COST_COLUMNS = (("rho", "ρ charged"), ("epsilon", "ε charged"), ("delta", "δ charged"))
PAGE_SIZE = 50
FLAG_ROWS = 20000  # the latest rows of the trail the flags are computed from


@dataclass(frozen=True)
class TrailSearch:
    login: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    table: str | None = None
    decision: str | None = None
    text: str | None = None
    ids: tuple[int, ...] = ()
    page: int = 1


@dataclass(frozen=True)
class TrailPage:
    rows: list[dict[str, Any]]
    total: int
    cost_columns: tuple[tuple[str, str], ...]


def connect(dsn: str) -> psycopg.Connection:
    """A connection that cannot write: every transaction of it is read-only unless one says otherwise."""
    conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    conn.execute("set default_transaction_read_only = on")
    return conn


def who(conn: psycopg.Connection) -> tuple[str, str]:
    row = conn.execute("select session_user::text, current_database()::text").fetchone()
    assert row is not None
    return row[0], row[1]


def _where(search: TrailSearch) -> tuple[sql.Composable, dict[str, Any]]:
    conditions = [sql.SQL("true")]
    params: dict[str, Any] = {}
    for field, condition in (("login", "login = %(login)s"), ("since", "at >= %(since)s"),
                             ("until", "at < %(until)s"), ("table", "%(table)s = any(relations)"),
                             ("decision", "decision = %(decision)s"),
                             ("text", "strpos(lower(statement), lower(%(text)s)) > 0")):
        value = getattr(search, field)
        if value:
            conditions.append(sql.SQL(condition))
            params[field] = value
    if search.ids:
        conditions.append(sql.SQL("id = any(%(ids)s)"))
        params["ids"] = list(search.ids)
    return sql.SQL(" and ").join(conditions), params


def trail_columns(conn: psycopg.Connection) -> tuple[tuple[str, str], ...]:
    """The cost columns of ``COST_COLUMNS`` that anonproxy.audit_trail has."""
    present = {name for (name,) in conn.execute(
        "select attname::text from pg_catalog.pg_attribute where attrelid = 'anonproxy.audit_trail'::regclass "
        "and attnum > 0 and not attisdropped")}
    return tuple((column, label) for column, label in COST_COLUMNS if column in present)


def trail_page(conn: psycopg.Connection, search: TrailSearch) -> TrailPage:
    """One page of the trail rows that match, newest first, and how many match in all."""
    where, params = _where(search)
    costs = trail_columns(conn)
    columns = sql.SQL(", ").join([sql.SQL("id, at, login, host(client_addr) as client_addr, mode, decision, "
                                          "sqlstate, message, relations, statement, parameters"),
                                  *(sql.Identifier(column) for column, _ in costs)])
    total_row = conn.execute(sql.SQL("select count(*) from anonproxy.audit_trail where {}").format(where),
                             params).fetchone()
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql.SQL("select {} from anonproxy.audit_trail where {} order by at desc, id desc "
                            "limit %(limit)s offset %(offset)s").format(columns, where),
                    params | {"limit": PAGE_SIZE, "offset": (max(search.page, 1) - 1) * PAGE_SIZE})
        rows = cur.fetchall()
    return TrailPage(rows, total_row[0] if total_row else 0, costs)


def trail_logins(conn: psycopg.Connection) -> list[str]:
    return [login for (login,) in conn.execute(
        "select distinct login::text from anonproxy.audit_trail where login is not null order by 1")]


def flag_rows(conn: psycopg.Connection, search: TrailSearch) -> list[TrailRow]:
    """The latest ``FLAG_ROWS`` trail rows that match ``search`` (its page and text aside), oldest first."""
    where, params = _where(TrailSearch(login=search.login, since=search.since, until=search.until))
    rows = conn.execute(sql.SQL("select id, at, login::text, decision, sqlstate, statement, relations "
                                "from anonproxy.audit_trail where {} order by at desc, id desc limit %(limit)s")
                        .format(where), params | {"limit": FLAG_ROWS}).fetchall()
    return [TrailRow(id_, at, login, decision, sqlstate, statement, tuple(relations))
            for id_, at, login, decision, sqlstate, statement, relations in reversed(rows)]


def identifying_columns(conn: psycopg.Connection) -> dict[str, frozenset[str]]:
    """Per table of the policy, the columns that name a person: identifier columns, the privacy unit, a link."""
    rows = conn.execute("""select table_name, column_name::text from anonproxy.column_policies
                            where kind = 'identifier'
                           union select table_name, unit_column::text from anonproxy.protected_tables
                           union select table_name, link_column::text from anonproxy.linked_tables""").fetchall()
    found: dict[str, set[str]] = {}
    for table, column in rows:
        found.setdefault(table, set()).add(column.lower())
    return {table: frozenset(columns) for table, columns in found.items()}


@dataclass(frozen=True)
class BudgetRow:
    role_name: str
    domain: str
    accounting: str | None
    epsilon_budget: Decimal
    epsilon_spent: Decimal
    epsilon_left: Decimal  # the lesser of the role's and the shared cap's
    delta_budget: Decimal
    delta_left: Decimal
    rho_spent: Decimal | None
    refresh_period: Any
    shared_epsilon_left: Decimal | None

    def as_flag_input(self) -> Budget:
        return Budget(self.role_name, self.domain, self.epsilon_budget, self.epsilon_spent)


def budgets(conn: psycopg.Connection) -> list[BudgetRow]:
    """Every budget, now, as the ledger counts it (anonproxy.audit_budgets, sql/0026)."""
    rows = conn.execute("""select role_name::text, domain, accounting, epsilon_budget, epsilon_spent, epsilon,
                                  delta_budget, delta, rho_spent, refresh_period, shared_epsilon
                             from anonproxy.audit_budgets()""").fetchall()
    return [BudgetRow(*row) for row in rows]


def spending_history(conn: psycopg.Connection, role: str, domain: str) -> list[tuple[datetime, Decimal]]:
    """After each charge of the role on the domain: the ε spent as its budget counts it."""
    return [(at, spent) for at, spent in conn.execute(
        "select charged_at, epsilon_spent from anonproxy.audit_budget_history(%s, %s)", (role, domain))]


def releases(conn: psycopg.Connection) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute("""select id, source, target, method, quasi_identifiers, sensitive, unit, parameters, achieved,
                              composition, forced, created_by, created_at, refreshed_at
                         from anonproxy.releases order by source, id""")
        return cur.fetchall()


def release_now(conn: psycopg.Connection, release_id: int) -> dict[str, Any]:
    """A release measured now (anonproxy.audit_release, sql/0026). The composition audit works in temporary tables,
    which a read-only transaction may not create: it runs in a read-write transaction that is rolled back."""
    with conn.transaction(force_rollback=True):
        conn.execute("set transaction read write")
        row = conn.execute("select anonproxy.audit_release(%s)", (release_id,)).fetchone()
    assert row is not None
    return row[0]


def policy_history(conn: psycopg.Connection) -> list[tuple[int, datetime, str, dict[str, Any]]]:
    """Every policy version, newest first: (version, when, by whom, the policy then)."""
    return [(version, at, by, policy) for version, at, by, policy in conn.execute(
        "select version, changed_at, changed_by::text, policy from anonproxy.policy_history order by version desc")]
