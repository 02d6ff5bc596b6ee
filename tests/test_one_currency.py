"""One currency (sql/0025_one_currency.sql, docs/ledger.md): a session of 30 mixed dp questions through the real
proxy, then every surface that states a privacy cost — each NOTICE, EXPLAIN (ANONPROXY), SHOW anonproxy.budget,
anonproxy.my_budget, the ledger, the audit trail's rows, `anonproxy trail` and its --html page — states the ledger's
ε spent (and ρ), and the figures "this answer moved ε spent by" add up to the ledger's total."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from collections.abc import Iterator
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import Endpoint, fresh_dp_role, wait_for_policy
from psycopg.rows import dict_row

from anonproxy.embedded import EmbeddedPostgres
from anonproxy.trail import Filters, budget_spent

D = Decimal
ADULT = "public.adult"

# 30 questions: different statistics, repeats (answered from the cache, free), a refused one, bound values.
QUESTIONS: list[tuple[str, list[Any] | None]] = [
    ("select count(*) from adult", None),
    ("select sex, count(*) from adult group by sex", None),
    ("select avg(age) from adult", None),
    ("select count(*) from adult", None),  # repeat
    ("select education, count(*) from adult group by education", None),
    ("select sum(hours_per_week) from adult where sex = 'Female'", None),
    ("select age from adult", None),  # refused: not an aggregate
    ("select count(*) from adult where age > %s", [40]),
    ("select count(*) from adult where age > %s", [40]),  # repeat, bound value
    ("select count(*) from adult where age > %s", [50]),
    ("select race, avg(hours_per_week) from adult group by race", None),
    ("select stddev(age) from adult", None),
    ("select sex, count(*) from adult group by sex", None),  # repeat
    ("select percentile_cont(0.5) within group (order by age) from adult", None),
    ("select count(*) from adult where hours_per_week >= 40", None),
    ("select marital_status, count(*) from adult group by 1 order by 2 desc", None),
    ("select avg(age) from adult", None),  # repeat
    ("select variance(hours_per_week) from adult", None),
    ("select count(*) from adult where education = 'Bachelors'", None),
    ("select sex, avg(age), count(*) from adult group by sex", None),
    ("select workclass, count(*) from adult group by workclass", None),
    ("select count(*) from adult where age < %s", [30]),
    ("select education, count(*) from adult group by education", None),  # repeat
    ("select sum(age) from adult", None),
    ("select count(*) from adult where race = 'White' and sex = 'Male'", None),
    ("select relationship, count(*) from adult group by relationship", None),
    ("select avg(hours_per_week) from adult where age > %s", [60]),
    ("select count(*) from adult where native_country = 'Mexico'", None),
    ("select stddev(age) from adult", None),  # repeat
    ("select occupation, count(*) from adult group by occupation", None),
]

MOVED = re.compile(r"this answer moved ε spent on public\.adult by ([0-9.]+): ε spent ([0-9.]+) of 10 \(ρ ([0-9.]+) "
                   r"spent\); left: ε ([0-9.]+), δ [0-9.]+, ρ ([0-9.]+)")
STATE = re.compile(r"ε spent ([0-9.]+) of 10 \(ρ ([0-9.]+) spent\); left: ε ([0-9.]+)")

_names = itertools.count(1)


@pytest.fixture
def zcdp_analyst(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[str]:
    """A fresh dp role with the demo analyst's budget: ε 10, δ 1e-5 on public.adult, zcdp, accuracy ε 0.5."""
    with fresh_dp_role(truth, gated_proxy, gated_database, f"currency_analyst_{next(_names)}") as role:
        truth.execute("select anonproxy.set_budget(%s, 'public.adult', 10, 0.00001, null, 0.5, 0.0000001, 'zcdp')",
                      [role])
        wait_for_policy(gated_proxy, gated_database, truth.execute("select version from anonproxy.policy_version"
                                                                   ).fetchone()[0])
        yield role


def shows(figure: str, exact: Decimal, up: bool = True) -> bool:
    """Whether ``figure`` is ``exact`` to 4 significant digits, rounded up (a spent figure) or down (what is left)."""
    quantum = D(1).scaleb(exact.adjusted() - 3) if exact else D(1)
    return D(figure) == exact.quantize(quantum, rounding=ROUND_CEILING if up else ROUND_FLOOR)


def test_every_surface_states_the_ledgers_epsilon_spent(gated_proxy: Endpoint, gated_database: str,
                                                        zcdp_analyst: str, truth: psycopg.Connection,
                                                        pg_server: EmbeddedPostgres, tmp_path: Path) -> None:
    role = zcdp_analyst
    notices: list[list[str]] = []
    with psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
        conn.add_notice_handler(lambda diagnostic: notices[-1].append(diagnostic.message_primary or ""))
        refused = 0
        for sql, values in QUESTIONS:
            notices.append([])
            try:
                conn.execute(sql, values).fetchall()
            except psycopg.errors.InsufficientPrivilege:
                refused += 1
        assert refused == 1
        last = QUESTIONS[-1][0]
        explained = [line for (line,) in conn.execute(f"explain (anonproxy) {last}")]
        shown = conn.execute("show anonproxy.budget").fetchone()[0]
        mine = conn.execute("select * from anonproxy.my_budget").fetchall()

    # The ledger: one row per charged answer, in order, each with what it moved ε spent by.
    ledger = truth.execute("select epsilon, rho, epsilon_spent_after, epsilon_spent_delta from "
                           "anonproxy.budget_ledger where role_name = %s order by id", [role]).fetchall()
    total, rho_total = truth.execute("select epsilon_spent, rho_spent from anonproxy.remaining_budget(%s, %s)",
                                     [role, ADULT]).fetchone()
    assert len(ledger) == 30 - 6 - 1  # 6 repeats answered from the cache, 1 refused
    assert sum(row[3] for row in ledger) == ledger[-1][2] == total
    assert 0 < total < 10 and rho_total == sum(row[1] for row in ledger)
    assert sum(row[0] for row in ledger) > 10  # the answers' own ε add up to more than the whole budget

    # Each NOTICE: a charged answer says what it moved ε spent by, and the ledger's ε spent and ρ after it.
    charged = iter(ledger)
    rho_so_far = D(0)
    for (sql, _), said in zip(QUESTIONS, notices, strict=True):
        moved = [MOVED.search(text) for text in said if "this answer moved" in text]
        if sql == "select age from adult":
            assert not moved
            continue
        if any("did not move" in text for text in said):
            assert not moved and any("on its own" in text for text in said), said
            continue
        assert len(moved) == 1 and moved[0] is not None, said
        _, rho, after, delta = next(charged)
        rho_so_far += rho
        by, spent, rho_spent, left, _ = moved[0].groups()
        assert shows(by, delta) and shows(spent, after) and shows(rho_spent, rho_so_far), (said, after, delta)
        assert shows(left, 10 - after, up=False)
        assert any("costs ρ=" in text and "on its own it is (ε=" in text for text in said), said
    assert next(charged, None) is None

    # EXPLAIN (ANONPROXY) of the last question, SHOW anonproxy.budget, anonproxy.my_budget.
    state = [STATE.search(line) for line in explained if line.startswith("budget of public.adult: ")]
    assert len(state) == 1 and state[0] is not None, explained
    assert shows(state[0][1], total) and shows(state[0][2], rho_total) and shows(state[0][3], 10 - total, up=False)
    assert "cached" in " ".join(explained) and not [line for line in explained if line.startswith("running it")]
    listed = re.fullmatch(r"public\.adult: epsilon ([0-9.]+) of 10 left, delta 0\.00001 of 0\.00001 left; epsilon spent "
                        r"([0-9.]+) \(zCDP accounting: rho ([0-9.]+) spent, rho [0-9.]+ left\); accuracy epsilon 0\.5 "
                        r"per query", shown)
    assert listed is not None, shown
    assert shows(listed[1], 10 - total, up=False) and shows(listed[2], total) and shows(listed[3], rho_total), shown
    assert [(row[0], row[1], row[3], row[4]) for row in mine] == [(ADULT, "zcdp", total, 10 - total)]

    # The trail's rows: the same figure per answer, 0 for the cached ones, none for the refused one.
    with truth.cursor(row_factory=dict_row) as cur:
        rows = cur.execute("select statement, decision, budget_domain, accounting, epsilon, rho, epsilon_spent_delta, "
                           "epsilon_spent_after from anonproxy.audit_trail where login = %s order by at, id",
                           [role]).fetchall()
    asked = [row for row in rows if not row["statement"].lower().startswith(("explain", "show", "select *"))]
    assert len(asked) == 30
    paid = [row for row in asked if row["epsilon_spent_after"] is not None]
    assert [(r["epsilon_spent_after"], r["epsilon_spent_delta"]) for r in paid] == [(r[2], r[3]) for r in ledger]
    assert all(r["budget_domain"] == ADULT and r["accounting"] == "zcdp" for r in paid)
    assert sum(r["epsilon_spent_delta"] for r in asked if r["epsilon_spent_delta"] is not None) == total
    free = [row for row in asked if row["decision"] == "answered" and row["epsilon_spent_after"] is None]
    assert len(free) == 6 and all(r["epsilon_spent_delta"] == 0 and r["rho"] == 0 for r in free)

    # `anonproxy trail`: the text view's "ε spent" column is the ledger's, rounded; nowhere 17 digits.
    owner = pg_server.conninfo(dbname=gated_database)
    text = trail(owner, "--role", role)
    header, *lines = text.splitlines()
    assert "ε spent +" in header and "ε charged" not in header
    charged_lines = [line for line in lines if re.search(r" answered +[0-9.]+ +[0-9.]+ ", line)]
    assert len(charged_lines) == len(ledger)
    figures = [re.findall(r" answered +([0-9.]+) +([0-9.]+) ", line)[0] for line in charged_lines]
    assert all(shows(by, row[3]) and shows(after, row[2]) for (by, after), row in zip(figures, ledger, strict=True))
    assert not re.search(r"\d\.\d{8,}", text)

    # `anonproxy trail --html`: the budget table states the ledger's ε spent of the budget, not a sum of own ε.
    page = tmp_path / "trail.html"
    trail(owner, "--role", role, "--html", str(page))
    cells = Cells()
    cells.feed(page.read_text(encoding="utf-8"))
    row = cells.rows[cells.rows.index(["role", "table", "accounting", "ε spent", "budget ε", "charged answers",
                                       "last charge"]) + 1]
    assert row[:5] == [role, ADULT, "zcdp", row[3], "10"] and shows(row[3], total), row
    assert row[5] == str(len(ledger))
    # what the page plots: the ledger's ε spent after each charge, against the budget
    plotted = budget_spent(truth, Filters(role=role))
    assert [(s.login, s.domain, s.budget) for s in plotted] == [(role, ADULT, 10)]
    assert [after for _, after in plotted[0].points] == [row[2] for row in ledger]


def trail(dsn: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "anonproxy.cli", "trail", "--dsn", dsn, *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


class Cells(HTMLParser):
    """The rows of the page's tables, as text (header rows too)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, name: str, attrs: list[tuple[str, str | None]]) -> None:
        if name == "tr":
            self.rows.append([])
        elif name in ("td", "th"):
            self._cell = []

    def handle_endtag(self, name: str) -> None:
        if name in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
