"""`anonproxy trail --dsn DSN [--role R] [--since T] [--until T] [--limit N] [--html FILE]`: the audit trail.

Prints the statements of gated roles the proxy recorded in
``anonproxy.audit_trail`` (sql/0014_audit_trail.sql), oldest first, filtered by
login and time; with ``--html``, writes instead a self-contained page with each
dp role's privacy budget spent over time and the statements refused most
often (plots by matplotlib, embedded as PNG). Only the owner of the
``anonproxy`` schema and members of ``anonproxy_auditor`` may read the trail. docs/audit-trail.md.

Costs are stated as the budget counts them (sql/0025_one_currency.sql): what
each answer moved its budget's "ε spent" by and the ledger's ε spent after
it, with ρ under zCDP accounting, never a sum of answers' own ε (under zCDP
that sum is far above what the budget counts). Figures are rounded for
people (anonproxy.dp.amounts); the trail's columns keep the exact values.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import os
import sys
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import class_row

from anonproxy.dp import amounts

DEFAULT_LIMIT = 100
STATEMENT_WIDTH = 80  # characters of a statement shown per line of the table
TOP_REFUSED = 10


@dataclass(frozen=True)
class Entry:
    id: int
    at: datetime
    login: str | None
    client_addr: str | None
    mode: str | None
    decision: str
    sqlstate: str | None
    epsilon: Decimal | None
    delta: Decimal | None
    rho: Decimal | None
    epsilon_spent_delta: Decimal | None  # what the answer moved its budget's ε spent by (null before 0025)
    epsilon_spent_after: Decimal | None  # the budget's ε spent after it, as the ledger computed it
    relations: list[str]
    statement: str
    parameters: list[str | None] | None


@dataclass(frozen=True)
class Filters:
    role: str | None = None
    since: datetime | None = None
    until: datetime | None = None


def register(subparsers: Any) -> None:
    """Add the ``trail`` command to an ``argparse`` subparsers object."""
    trail = subparsers.add_parser("trail", help="print the audit trail of gated roles' statements, or an HTML page")
    trail.add_argument("--dsn", default=os.environ.get("ANONPROXY_DSN"),
                       help="libpq connection string of the anonproxy schema's owner or an auditor (default $ANONPROXY_DSN)")
    trail.add_argument("--role", help="only the statements of this login")
    trail.add_argument("--since", type=_timestamp, help="from this time on (ISO 8601: 2026-11-01 or 2026-11-01T09:00)")
    trail.add_argument("--until", type=_timestamp, help="before this time (ISO 8601)")
    trail.add_argument("--limit", type=_positive, default=DEFAULT_LIMIT,
                       help=f"print the latest N statements (default {DEFAULT_LIMIT})")
    trail.add_argument("--html", type=Path, metavar="FILE",
                       help="write a page of dp budgets spent over time and the most refused statements")
    trail.set_defaults(run=_trail)


def _timestamp(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 date or time: {text!r}") from exc
    return value if value.tzinfo is not None else value.astimezone()  # a time without zone is local time


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _trail(args: argparse.Namespace) -> int:
    if not args.dsn:
        print("anonproxy trail: give --dsn (or set ANONPROXY_DSN): a connection string of the anonproxy schema's "
              "owner or of a member of anonproxy_auditor", file=sys.stderr)
        return 2
    filters = Filters(args.role, args.since, args.until)
    try:
        with psycopg.connect(args.dsn) as conn:
            if args.html is not None:
                page = build_page(conn, filters)
            else:
                entries = latest(conn, filters, args.limit)
    except psycopg.errors.InsufficientPrivilege as exc:
        print(f"anonproxy trail: {str(exc).strip()}\nhint: the audit trail is readable by the owner of the anonproxy "
              "schema (the role that ran `anonproxy install`) and the members of anonproxy_auditor only; connect as "
              "one of them (the demo's `auditor`)", file=sys.stderr)
        return 1
    except psycopg.Error as exc:
        print(f"anonproxy trail: {str(exc).strip()}", file=sys.stderr)
        return 1
    if args.html is not None:
        args.html.write_text(page, encoding="utf-8")
        print(f"wrote {args.html}")
        return 0
    print("\n".join(format_table(entries)))
    return 0


_WHERE = """(%(role)s::name is null or login = %(role)s)
   and (%(since)s::timestamptz is null or at >= %(since)s)
   and (%(until)s::timestamptz is null or at < %(until)s)"""


def _params(filters: Filters) -> dict[str, Any]:
    return {"role": filters.role, "since": filters.since, "until": filters.until}


def latest(conn: psycopg.Connection, filters: Filters, limit: int) -> list[Entry]:
    """The latest ``limit`` records that pass ``filters``, oldest first."""
    with conn.cursor(row_factory=class_row(Entry)) as cur:
        cur.execute(f"""select * from (
                          select id, at, login, host(client_addr) as client_addr, mode, decision, sqlstate, epsilon,
                                 delta, rho, epsilon_spent_delta, epsilon_spent_after, relations, statement,
                                 parameters
                            from anonproxy.audit_trail where {_WHERE}
                           order by at desc, id desc limit %(limit)s) latest
                        order by at, id""", _params(filters) | {"limit": limit})
        return cur.fetchall()


def format_table(entries: list[Entry]) -> list[str]:
    """Plain-text lines: one per statement, with a header. A dp answer's cost as its budget counts it: what it moved
    ε spent by (+), ε spent after it, its ρ and δ."""
    lines = [(f"{'time':<19}  {'login':<12} {'client':<15} {'mode':<8} {'decision':<16} {'ε spent +':>9} "
              f"{'ε spent':>9} {'ρ':>9} {'δ':>9}  {'relations':<14} statement")]
    for e in entries:
        decision = f"{e.decision} {e.sqlstate}" if e.sqlstate else e.decision
        statement = " ".join(e.statement.split())
        if e.parameters:  # the values of one execution of a prepared statement
            statement += " -- " + ", ".join(f"${n}={'NULL' if value is None else repr(value)}"
                                             for n, value in enumerate(e.parameters, 1))
        if len(statement) > STATEMENT_WIDTH:
            statement = statement[:STATEMENT_WIDTH - 1] + "…"
        lines.append(f"{e.at.astimezone():%Y-%m-%d %H:%M:%S}  {e.login or '-':<12} {e.client_addr or '-':<15} "
                     f"{e.mode or '-':<8} {decision:<16} {_amount(e.epsilon_spent_delta):>9} "
                     f"{_amount(e.epsilon_spent_after):>9} {_amount(e.rho):>9} {_amount(e.delta):>9}  "
                     f"{','.join(e.relations) or '-':<14} {statement}")
    lines.append(f"({len(entries)} statement{'' if len(entries) == 1 else 's'})")
    return lines


def _amount(value: Decimal | None) -> str:
    return "-" if value is None else amounts.spent(value)


# -- the HTML page -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spending:
    """One dp budget (a login's, on a protected table) over time, as the ledger counted it at each charge."""

    login: str
    domain: str
    accounting: str | None
    budget: Decimal | None  # the budget's ε as configured now; None: the budget is gone
    points: list[tuple[datetime, Decimal]]  # (time of the charge, ε spent after it)


def budget_spent(conn: psycopg.Connection, filters: Filters) -> list[Spending]:
    """Per dp login and budget, the ledger's ε spent after each charge (recorded with the answer: what the budget
    counts, in its accounting), oldest first."""
    rows = conn.execute(f"""select t.login, t.budget_domain, t.accounting, b.epsilon, t.at, t.epsilon_spent_after
                              from anonproxy.audit_trail t
                              left join anonproxy.budgets b on b.role_name = t.login and b.domain = t.budget_domain
                             where t.mode = 'dp' and t.epsilon_spent_after is not null and {_WHERE}
                             order by t.login, t.budget_domain, t.at, t.id""", _params(filters)).fetchall()
    spent: dict[tuple[str, str], Spending] = {}
    for login, domain, accounting, budget, at, after in rows:
        spending = spent.setdefault((login, domain), Spending(login, domain, accounting, budget, []))
        spending.points.append((at, after))
    return list(spent.values())


def unrecorded_charges(conn: psycopg.Connection, filters: Filters) -> int:
    """Charged dp answers recorded before migration 0025, without the ledger's ε spent: not plotted."""
    row = conn.execute(f"""select count(*)::int from anonproxy.audit_trail
                            where mode = 'dp' and epsilon > 0 and epsilon_spent_after is null and {_WHERE}""",
                       _params(filters)).fetchone()
    return row[0] if row else 0


def most_refused(conn: psycopg.Connection, filters: Filters) -> list[tuple[str, str, int, int]]:
    """The statements refused most often: (statement, SQLSTATE, times, logins that sent it)."""
    return conn.execute(f"""select statement, sqlstate, count(*)::int, count(distinct login)::int
                              from anonproxy.audit_trail
                             where decision = 'refused' and {_WHERE}
                             group by statement, sqlstate
                             order by count(*) desc, statement limit {TOP_REFUSED}""", _params(filters)).fetchall()


def build_page(conn: psycopg.Connection, filters: Filters) -> str:
    spent = budget_spent(conn, filters)
    unrecorded = unrecorded_charges(conn, filters)
    refused = most_refused(conn, filters)
    scope = ", ".join(part for part in (
        f"login {filters.role}" if filters.role else "",
        f"since {filters.since:%Y-%m-%d %H:%M}" if filters.since else "",
        f"until {filters.until:%Y-%m-%d %H:%M}" if filters.until else "") if part) or "the whole trail"
    sections = [f"<p>From {html.escape(scope)}.</p>"]
    note = (f"<p>{unrecorded} charged answers were recorded before the trail kept the ledger's ε spent (migration "
            "0025); they are not plotted.</p>" if unrecorded else "")
    if spent:
        sections.append("<h2>Privacy budget spent by each dp role</h2>"
                        "<p>ε spent of each role's budget after each charge, as the ledger counts it (under zCDP "
                        "accounting the conversion of the ρ spent, not a sum of the answers' own ε), against the "
                        "budget (dashed). Answers already paid for cost nothing and do not appear.</p>" + note
                        + _budget_plot(spent)
                        + _table(["role", "table", "accounting", "ε spent", "budget ε", "charged answers",
                                  "last charge"],
                                 [(s.login, s.domain, s.accounting or "-", amounts.spent(s.points[-1][1]),
                                   "-" if s.budget is None else amounts.spent(s.budget), len(s.points),
                                   f"{s.points[-1][0]:%Y-%m-%d %H:%M}") for s in spent]))
    else:
        sections.append("<h2>Privacy budget spent by each dp role</h2><p>No dp role was charged.</p>" + note)
    if refused:
        sections.append("<h2>Statements refused most often</h2>" + _refused_plot(refused)
                        + _table(["#", "statement", "SQLSTATE", "times", "logins"],
                                 [(i, statement, sqlstate, times, logins)
                                  for i, (statement, sqlstate, times, logins) in enumerate(refused, 1)]))
    else:
        sections.append("<h2>Statements refused most often</h2><p>No statement was refused.</p>")
    title = "anonproxy audit trail"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; max-width: 60rem; margin: 2rem auto; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5rem 0 1rem; }}
th, td {{ border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: left; vertical-align: top; }}
th {{ background: #f3f3f3; font-weight: normal; }}
td code {{ white-space: pre-wrap; }}
img {{ display: block; max-width: 100%; height: auto; margin: 0.5rem 0 1.5rem; }}
</style></head>
<body><h1>{title}</h1>
{"".join(f"<section>{s}</section>" for s in sections)}
</body></html>
"""


def _table(header: list[str], rows: list[tuple[Any, ...]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any) -> str:
    text = html.escape(str(value))
    return f"<code>{text}</code>" if isinstance(value, str) and " " in value else text


def _figure(width: float, height: float) -> tuple[Any, Any]:
    """A matplotlib figure and axes (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def _png(fig: Any, alt: str) -> str:
    """The figure as an <img> with the PNG inline (base64): the page needs no other file."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _budget_plot(spent: list[Spending]) -> str:
    fig, ax = _figure(7, 3.5)
    for spending in spent:
        label = f"{spending.login} on {spending.domain}"
        line, = ax.step([at for at, _ in spending.points], [float(after) for _, after in spending.points],
                        where="post", marker="o", markersize=3, label=label)
        if spending.budget is not None:
            ax.axhline(float(spending.budget), color=line.get_color(), linestyle="--", linewidth=1)
    ax.set_xlabel("time of the charge")
    ax.set_ylabel("ε spent (as the budget counts it)")
    ax.set_ylim(bottom=0)
    ax.set_title("Privacy budget spent over time")
    ax.legend()
    fig.autofmt_xdate()
    return _png(fig, "privacy budget spent over time per dp role")


def _refused_plot(refused: list[tuple[str, str, int, int]]) -> str:
    fig, ax = _figure(7, 0.5 + 0.4 * len(refused))
    labels = [f"#{i} ({sqlstate})" for i, (_, sqlstate, _, _) in enumerate(refused, 1)]
    ax.barh(labels[::-1], [times for _, _, times, _ in refused][::-1], color="#c44e52")
    ax.set_xlabel("times refused")
    ax.set_title("Statements refused most often (numbers as in the table below)")
    return _png(fig, "statements refused most often")
