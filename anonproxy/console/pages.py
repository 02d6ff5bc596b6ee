"""The console's HTML: server-rendered pages, every value escaped, charts as inline SVG, no script."""

from __future__ import annotations

import html
from collections.abc import Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any
from urllib.parse import urlencode

from .flags import BUDGET_SHARE, REFUSALS_THRESHOLD, REFUSALS_WINDOW, Flag
from .history import policy_changes
from .queries import PAGE_SIZE, BudgetRow, TrailPage, TrailSearch

NAV = (("/budgets", "Budgets"), ("/trail", "Trail"), ("/flags", "Flags"), ("/releases", "Releases"),
       ("/policy", "Policy history"))
LINKED_IDS = 500  # trail rows a flag's link names at most
DECISIONS = ("answered", "refused", "passed", "intercepted", "lost")
FLAG_TITLES = {
    "refusals": "Many refusals in a short time",
    "identifier": "Identifying columns in WHERE or GROUP BY",
    "differencing": "Statements that differ in one condition",
    "budget": "Budgets nearly spent, or refused for lack of budget",
}
STYLE = """
body { font-family: sans-serif; margin: 1.5rem 2rem; color: #222; }
nav a { margin-right: 1.2rem; }
nav a.here { font-weight: bold; text-decoration: none; color: #222; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; }
th, td { border: 1px solid #ccc; padding: 0.2rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f3f3f3; font-weight: normal; }
code { white-space: pre-wrap; }
.denied { color: #a00; }
.flagged { background: #fff3d6; }
form label { margin-right: 0.8rem; }
svg { display: block; margin: 0.3rem 0 1.2rem; }
"""


def e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def layout(path: str, title: str, login: str, database: str, body: str) -> str:
    nav = "".join(f'<a href="{href}"{" class=here" if href == path else ""}>{e(label)}</a>' for href, label in NAV)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(title)} — anonproxy console'
            f'</title><style>{STYLE}</style></head><body>'
            f'<p>anonproxy console · login <b>{e(login)}</b> · database <b>{e(database)}</b></p><nav>{nav}</nav>'
            f'<h1>{e(title)}</h1>{body}</body></html>\n')


def denied(what: str, message: str) -> str:
    return f'<p class="denied">this login may not read {e(what)} ({e(message)})</p>'


def table(header: Sequence[str], rows: Sequence[Sequence[str]], classes: Sequence[str] = ()) -> str:
    """A table of cells already in HTML; ``classes``: a CSS class per row (or none)."""
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join(f'<tr{f" class={classes[i]}" if i < len(classes) and classes[i] else ""}>'
                   + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for i, row in enumerate(rows))
    return f"<table><tr>{head}</tr>{body}</table>"


def number(value: Decimal | float | None) -> str:
    if value is None:
        return ""
    value = Decimal(str(value))
    return f"{value.normalize():f}" if value else "0"


# -- budgets ------------------------------------------------------------------------------------------


def budgets_body(rows: list[BudgetRow], histories: dict[tuple[str, str], list[tuple[datetime, Decimal]]]) -> str:
    if not rows:
        return "<p>No role has a privacy budget.</p>"
    summary = table(
        ["role", "table (domain)", "accounting", "ε budget", "ε spent", "ε left", "δ budget", "δ left", "ρ spent",
         "refresh period", "shared cap ε left"],
        [[e(r.role_name), e(r.domain), e(r.accounting), number(r.epsilon_budget),
          _spent(r), number(r.epsilon_left), number(r.delta_budget), number(r.delta_left), number(r.rho_spent),
          e(r.refresh_period), number(r.shared_epsilon_left)] for r in rows],
        ["flagged" if r.epsilon_spent >= BUDGET_SHARE * r.epsilon_budget else "" for r in rows])
    charts = "".join(f"<h2>{e(r.role_name)} on {e(r.domain)}</h2>"
                     + spending_chart(histories.get((r.role_name, r.domain), []), r.epsilon_budget)
                     for r in rows)
    return ("<p>ε spent is what the budget counts (sql/0019: the sum of ε under basic accounting; under zCDP the sum "
            "of ρ converted to ε at what is left of δ), read from the ledger now.</p>" + summary
            + "<h2>Spending over time</h2>" + charts)


def _spent(row: BudgetRow) -> str:
    """ε spent, marked with its role and domain (the tests find it by them)."""
    return (f'<span class="spent" data-role="{e(row.role_name)}" data-domain="{e(row.domain)}">'
            f"{number(row.epsilon_spent)}</span>")


def spending_chart(points: list[tuple[datetime, Decimal]], budget: Decimal, width: int = 640,
                   height: int = 200) -> str:
    """A step line of ε spent after each charge, under a dashed line at the budget: inline SVG."""
    if not points:
        return "<p>No charge yet.</p>"
    left, right, top, bottom = 60, 20, 15, 30
    top_value = max(float(budget), max(float(spent) for _, spent in points)) or 1.0
    start, end = points[0][0].timestamp(), points[-1][0].timestamp()
    span = (end - start) or 1.0

    def x(at: datetime) -> float:
        return left + (width - left - right) * ((at.timestamp() - start) / span if end > start else 0.5)

    def y(value: float) -> float:
        return top + (height - top - bottom) * (1 - value / top_value)

    path, previous = [], y(0)
    for at, spent in points:
        path.append(f"{x(at):.1f},{previous:.1f} {x(at):.1f},{y(float(spent)):.1f}")
        previous = y(float(spent))
    path.append(f"{width - right:.1f},{previous:.1f}")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">'
            f"<title>ε spent over time, budget {number(budget)}</title>"
            f'<line x1="{left}" y1="{y(0):.1f}" x2="{width - right}" y2="{y(0):.1f}" stroke="#888"/>'
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{y(0):.1f}" stroke="#888"/>'
            f'<line x1="{left}" y1="{y(float(budget)):.1f}" x2="{width - right}" y2="{y(float(budget)):.1f}" '
            f'stroke="#c44" stroke-dasharray="6 4"/>'
            f'<text x="{left + 4}" y="{y(float(budget)) - 4:.1f}" font-size="11" fill="#c44">budget ε '
            f"{number(budget)}</text>"
            f'<polyline fill="none" stroke="#1f6fb4" stroke-width="2" points="{" ".join(path)}"/>'
            f'<text x="{left - 6}" y="{y(0) + 4:.1f}" font-size="11" text-anchor="end">0</text>'
            f'<text x="{left - 6}" y="{y(top_value) + 4:.1f}" font-size="11" text-anchor="end">'
            f"{top_value:g}</text>"
            f'<text x="{left}" y="{height - 8}" font-size="11">{points[0][0]:%Y-%m-%d %H:%M:%S}</text>'
            f'<text x="{width - right}" y="{height - 8}" font-size="11" text-anchor="end">'
            f"{points[-1][0]:%Y-%m-%d %H:%M:%S}</text>"
            f'<text x="{width - right}" y="{y(float(points[-1][1])) - 6:.1f}" font-size="11" text-anchor="end">'
            f"spent {number(points[-1][1])}</text></svg>")


# -- the trail -----------------------------------------------------------------------------------------


def search_form(search: TrailSearch, logins: list[str]) -> str:
    def option(value: str, chosen: str | None) -> str:
        return f'<option value="{e(value)}"{" selected" if value == chosen else ""}>{e(value) or "any"}</option>'

    return ('<form method="get" action="/trail">'
            f'<label>login <select name="login">{option("", None)}'
            f'{"".join(option(login, search.login) for login in logins)}</select></label>'
            f'<label>from <input name="since" value="{e(_iso(search.since))}" placeholder="2026-11-01T09:00">'
            f'</label><label>until <input name="until" value="{e(_iso(search.until))}"></label>'
            f'<label>table <input name="table" value="{e(search.table)}" placeholder="public.adult"></label>'
            f'<label>decision <select name="decision">{option("", None)}'
            f'{"".join(option(d, search.decision) for d in DECISIONS)}</select></label>'
            f'<label>statement contains <input name="text" value="{e(search.text)}"></label>'
            '<button type="submit">search</button></form>')


def _iso(value: datetime | None) -> str:
    return value.isoformat(timespec="minutes") if value else ""


def trail_body(page: TrailPage, search: TrailSearch, logins: list[str]) -> str:
    header = ["#", "time", "login", "client", "mode", "decision", "relations", "statement",
              *(label for _, label in page.cost_columns)]
    rows = []
    for r in page.rows:
        decision = f"{r['decision']} {r['sqlstate']}" if r["sqlstate"] else r["decision"]
        statement = f"<code>{e(r['statement'])}</code>"
        if r["parameters"]:
            statement += "<br>parameters: " + e(", ".join(f"${n}={'NULL' if v is None else v}"
                                                          for n, v in enumerate(r["parameters"], 1)))
        if r["message"]:
            statement += f"<br><small>{e(r['message'])}</small>"
        rows.append([str(r["id"]), e(f"{r['at'].astimezone():%Y-%m-%d %H:%M:%S}"),
                     f'<span class="login">{e(r["login"])}</span>', e(r["client_addr"]), e(r["mode"]), e(decision),
                     e(", ".join(r["relations"])), statement,
                     *(number(r[column]) for column, _ in page.cost_columns)])
    shown = f"{len(page.rows)} of {page.total} matching statement{'' if page.total == 1 else 's'}, newest first"
    return (search_form(search, logins) + (f"<p>showing the statements {', '.join(map(str, search.ids))}</p>"
                                           if search.ids else "")
            + f'<p class="count">{e(shown)}</p>' + table(header, rows) + _pager(search, page.total))


def _pager(search: TrailSearch, total: int) -> str:
    pages = max(1, -(-total // PAGE_SIZE))
    links = []
    for number_, label in ((search.page - 1, "← newer"), (search.page + 1, "older →")):
        if 1 <= number_ <= pages:
            links.append(f'<a href="/trail?{e(trail_query(search, page=number_))}">{label}</a>')
    return f"<p>page {search.page} of {pages} {' '.join(links)}</p>"


def trail_query(search: TrailSearch, **changes: Any) -> str:
    values = {"login": search.login, "since": _iso(search.since), "until": _iso(search.until),
              "table": search.table, "decision": search.decision, "text": search.text,
              "ids": ",".join(map(str, search.ids)), "page": search.page} | changes
    return urlencode({k: v for k, v in values.items() if v})


# -- flags ---------------------------------------------------------------------------------------------


def flags_body(flags: list[Flag], rows_read: int, limit: int) -> str:
    minutes = int(REFUSALS_WINDOW.total_seconds() // 60)
    intro = (f"<p>Computed from the latest {rows_read} statements of the trail (at most {limit}). Thresholds: "
             f"{REFUSALS_THRESHOLD} refusals of one login within {minutes} minutes; a budget "
             f"{BUDGET_SHARE * 100:.0f} % spent. docs/console.md says what each flag means.</p>")
    sections = []
    for kind, title in FLAG_TITLES.items():
        own = [f for f in flags if f.kind == kind]
        rows = [[f'<span class="login">{e(f.login)}</span>', e(f.summary), _statements_link(f.ids)] for f in own]
        sections.append(f'<section class="flag-{kind}"><h2>{e(title)} ({len(own)})</h2>'
                        + (table(["login", "what", "behind it"], rows) if rows else "<p>None.</p>") + "</section>")
    return intro + "".join(sections)


def _statements_link(ids: tuple[int, ...]) -> str:
    """A link to the trail rows behind a flag (the latest ``LINKED_IDS`` of them: an address has a length limit)."""
    if not ids:
        return ""
    shown = ids[-LINKED_IDS:]
    label = f"{len(ids)} statement{'' if len(ids) == 1 else 's'}" + (f" (the latest {len(shown)})"
                                                                      if len(shown) < len(ids) else "")
    return f'<a class="statements" href="/trail?{e(urlencode({"ids": ",".join(map(str, shown))}))}">{label}</a>'


# -- releases ------------------------------------------------------------------------------------------


def releases_body(releases: list[dict[str, Any]], measured: dict[int, dict[str, Any] | str]) -> str:
    if not releases:
        return "<p>No release is registered.</p>"
    rows = []
    for r in releases:
        now = measured.get(r["id"])
        rows.append([str(r["id"]), e(r["target"]), e(r["source"]), e(r["method"]),
                     e(", ".join(r["quasi_identifiers"])), e(r["sensitive"]),
                     e(r["parameters"].get("k")), e(r["achieved"].get("k")), _verification(r, now),
                     _composition(now), e(f"{r['refreshed_at'] or r['created_at']:%Y-%m-%d %H:%M}"),
                     e(r["created_by"]) + (" (forced)" if r["forced"] else "")])
    return ("<p>k asked is the release's parameter, k built what it achieved when made, k now its smallest class "
            "today; the composition risk is the intersection attack of this release with every other release of "
            "the same source and sensitive column (docs/composition.md), measured now.</p>"
            + table(["id", "release", "source", "method", "quasi-identifiers", "sensitive", "k asked", "k built",
                     "verification now", "composition risk now", "built", "by"], rows))


def _verification(release: dict[str, Any], now: dict[str, Any] | str | None) -> str:
    if isinstance(now, str):  # the login may not measure it
        return f'<span class="denied">{e(now)}</span>'
    if now is None or "k_now" not in now:  # its table is gone
        return e(now and now.get("problem"))
    if release["unit"] is not None:
        return e(f"not judged: built with privacy unit {release['unit']}")
    asked, k_now = release["parameters"].get("k"), now["k_now"]
    if k_now is None:
        return "empty table"
    verdict = "meets k" if asked is None or k_now >= int(asked) else "FAILS k"
    return f'<span class="verification">k now {e(k_now)}: {verdict}</span>'


def _composition(now: dict[str, Any] | str | None) -> str:
    if not isinstance(now, dict) or "k_now" not in now:
        return ""
    risk = now.get("risk")
    if risk:
        pvp = risk.get("pvp", {})
        return (f'<span class="risk">with {e(", ".join(now.get("others") or []))}: PVP {e(pvp.get("100"))} % '
                f"certain, {e(pvp.get('50'))} % at 50 %; {e(risk.get('located'))} of {e(risk.get('overlap'))} "
                f"people located, average drop in anonymity {e(risk.get('avg_drop'))}</span>")
    if now.get("problem"):
        return e(f"not measured: {now['problem']}")
    return "no other release of this source and sensitive column"


# -- policy history ------------------------------------------------------------------------------------


def policy_body(history: list[tuple[int, datetime, str, dict[str, Any]]]) -> str:
    if not history:
        return "<p>No policy version is recorded.</p>"
    rows = []
    for i, (version, at, by, policy) in enumerate(history):
        before = history[i + 1][3] if i + 1 < len(history) else None
        rows.append([str(version), e(f"{at.astimezone():%Y-%m-%d %H:%M:%S}"), e(by),
                     "<br>".join(e(line) for line in policy_changes(before, policy))])
    return ("<p>Each version of the policy, newest first, with what changed from the one before "
            "(recorded since migration 0026).</p>" + table(["version", "when", "by", "changes"], rows))
