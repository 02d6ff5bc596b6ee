#!/usr/bin/env python3
"""BI statements at 30k, 300k and 3M rows: suppress and dp mode against the relayed owner, side by side.

One throwaway PostgreSQL set up like ``anonproxy up`` (adult, the demo roles,
the service role, the demo policy) plus a linked table ``public.visits`` (1 to
5 rows per person), and ``anonproxy serve`` in front of it. ``adult`` grows
from the shipped 30,162 rows to 10 and 100 copies with new ids. At each size,
a dozen statement shapes of the kind BI tools send run, interleaved, as:

- relayed: the database owner through the proxy (passed through; the reference);
- reporter: suppress mode, a statement the proxy has already seen;
- service: the SQL the proxy generates for the reporter, run directly on
  PostgreSQL as the service login with the service session's settings
  (reporter − service = the proxy's own share);
- analyst: dp mode, a new question at every run (charged, planned, noised).

Prints medians, p90s, ratios to relayed and verdicts against the targets.
See README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the anonproxy of the checkout this file sits in (a worktree measures "before")
sys.path.append(str(REPO / "benchmarks" / "passthrough"))

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo
from targets import (  # the pass-through benchmark's proxy runner
    HOST,
    AnonProxy,
    BenchmarkError,
)

import anonproxy
from anonproxy import demo, sample_data, schema
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import Budget, ColumnPolicy, LinkedTable, Policy
from anonproxy.policy.store import load_policy
from anonproxy.policy.yaml_policy import apply_policy, demo_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite

DATABASE = "postgres"  # as `anonproxy up`
COPIES = {"30k": 1, "300k": 10, "3m": 100}  # copies of the shipped rows (30,162 each) per size
ID_STRIDE = 100_000  # copy g of the row with id i gets id i + g * ID_STRIDE (the shipped ids are 1..30162)
SERIES = ("relayed", "reporter", "service", "analyst")
DEFAULT_RUNS = {"30k": 15, "300k": 15, "3m": 7}
QUICK_RUNS = 3
DEFAULT_TIMEOUT_MS = 60_000
SERVICE_OPTIONS = "-c default_transaction_read_only=on -c search_path=pg_catalog -c jit=off"  # proxy/service.py
SERVER_SETTINGS = {"shared_buffers": "1GB"}  # the 3M tables fit: runs measure the executor, not reads
READY_TIMEOUT = 60.0
VACUUM_PASSES = 3  # further VACUUMs of a table whose pages the first one left unmarked
TARGET_RATIO = 2.0  # reporter and analyst against relayed, every shape at every size
TARGET_RATIO_3M = 3.0  # and no shape above this at 3M
TARGET_SHARE_MS = 2.0  # the proxy's own share of a statement already seen (reporter - service)
# The analyst may ask thousands of new questions: the demo's per-query cost, a budget that does not run out.
ANALYST_BUDGET = Budget(epsilon=Decimal(100_000), delta=Decimal("0.001"), epsilon_per_query=Decimal("0.5"),
                        delta_per_query=Decimal("1E-7"), accounting="zcdp")
VISITS = LinkedTable("public.visits", "person_id", "public.adult", "id", {
    "person_id": ColumnPolicy("person_id", "identifier"),
    "visited": ColumnPolicy("visited", "quasi_identifier"),
    "minutes": ColumnPolicy("minutes", "sensitive", 0, 600),
})


@dataclass(frozen=True)
class Shape:
    id: str
    name: str
    template: str  # {n}: the alias number; 0 for the statement relayed and reporter repeat, new per analyst run

    def text(self, n: int, label: str) -> str:
        return f"/* suppress_scale {self.id} {label} */ " + self.template.format(n=n)


SHAPES = (
    Shape("s01", "count by one column", "select education, count(*) from adult t{n} group by education"),
    Shape("s02", "count by two columns", "select sex, race, count(*) from adult t{n} group by sex, race"),
    Shape("s03", "SUM and AVG by a category",
          "select occupation, sum(capital_gain), avg(hours_per_week) from adult t{n} group by occupation"),
    Shape("s04", "filtered (age range, sex)",
          "select education, count(*) from adult t{n} where age between 30 and 49 and sex = 'Female' "
          "group by education"),
    Shape("s05", "HAVING", "select native_country, count(*) from adult t{n} group by native_country "
                           "having count(*) > 100"),
    Shape("s06", "ORDER BY ... LIMIT", "select occupation, count(*) as n from adult t{n} group by occupation "
                                       "order by n desc limit 5"),
    Shape("s07", "window over groups", "select workclass, count(*), count(*) * 100.0 / sum(count(*)) over () "
                                       "as share from adult t{n} group by workclass"),
    Shape("s08", "total, no GROUP BY", "select count(*) from adult t{n} where age > 30"),
    Shape("s09", "post-aggregate expression",
          "select education, round(avg(hours_per_week), 1) from adult t{n} group by education"),
    Shape("s10", "binned age (Metabase)", "select age / 10 * 10 as decade, count(*) from adult t{n} "
                                          "group by 1 order by 1"),
    Shape("s11", "join to the linked table", "select a{n}.sex, count(*), sum(v{n}.minutes) from adult a{n} "
                                             "join visits v{n} on v{n}.person_id = a{n}.id group by 1"),
    Shape("s12", "linked table by month", "select date_trunc('month', visited) as month, count(*) "
                                          "from visits t{n} group by 1 order by 1"),
)


# -- set-up -------------------------------------------------------------------------------------------------------


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def bench_policy(timeout_ms: int) -> Policy:
    """The demo policy, plus visits as a linked table of adult, a budget the runs cannot exhaust, and the measured
    statements' timeout as the longest statement time of both modes (the client's statement_timeout is capped by
    it)."""
    policy = demo_policy()
    analyst = dataclasses.replace(policy.roles["analyst"], budgets={"public.adult": ANALYST_BUDGET})
    return dataclasses.replace(policy, links={VISITS.name: VISITS}, roles={**policy.roles, "analyst": analyst},
                               max_statement_ms={"suppress": timeout_ms, "dp": timeout_ms})


def visits_insert(first_copy: int, last_copy: int) -> str:
    """The visits of the people of copies first..last: 1 to 5 rows per person, dates and minutes derived from the
    id by arithmetic, so every run has the same rows."""
    return (f"insert into public.visits (person_id, visited, minutes) "
            f"select p, date '2023-01-01' + (p * 7 + n * 53) % 365, 5 + (p * 13 + n * 29) % 116 "
            f"from (select id + {ID_STRIDE} * g as p from public.adult0, generate_series({first_copy}, {last_copy}) g) "
            f"people, generate_series(1, 1 + p % 5) n")


def prepare_database(conn: psycopg.Connection[Any], policy: Policy) -> str:
    """As `anonproxy up` does, with visits and the source copy of adult; returns the service role's password."""
    schema.install(conn)
    sample_data.load_adult(conn)
    conn.execute("create table public.adult0 as table public.adult")  # the shipped rows, source of the copies
    conn.execute("create table public.visits (person_id integer not null, visited date not null, "
                 "minutes integer not null)")
    conn.execute(visits_insert(0, 0))
    conn.execute("create index on public.visits (person_id)")
    demo.create_demo_roles(conn, DATABASE)
    password = demo.reset_service_role(conn, policy.service_role)
    apply_policy(conn, policy)
    conn.commit()
    return password


def count(conn: psycopg.Connection[Any], sql: str) -> int:
    row = conn.execute(sql).fetchone()
    assert row is not None
    return int(row[0])


def grow(owner: psycopg.Connection[Any], copies: int) -> int:
    """Add copies to adult (and their visits) until it holds ``copies`` copies of the shipped rows; VACUUM ANALYZE.
    Returns adult's row count."""
    have = count(owner, "select count(*) from public.adult") // sample_data.ADULT_ROW_COUNT
    if copies > have:
        columns = ", ".join(sample_data.ADULT_COLUMNS[1:])
        with owner.transaction():
            owner.execute(f"insert into public.adult select id + {ID_STRIDE} * g, {columns} "
                          f"from public.adult0, generate_series({have}, {copies - 1}) g")
            owner.execute(visits_insert(have, copies - 1))
    # The server commits asynchronously (synchronous_commit off, as `anonproxy up`): until the WAL of the inserts is
    # flushed, VACUUM may not mark their pages all-visible, and every index-only scan would read the heap, which a
    # table under autovacuum never does. The checkpoint flushes it.
    owner.execute("checkpoint")
    owner.execute("vacuum analyze public.adult")
    owner.execute("vacuum analyze public.visits")
    # The first VACUUM of visits has been seen to leave its pages unmarked (0 % at 300k) where a second one marks
    # them all; as autovacuum would, vacuum again (a pass over an all-visible table skips its pages).
    for _ in range(VACUUM_PASSES):
        unmarked = [name for name, share in all_visible(owner).items() if share < 1.0]
        if not unmarked:
            break
        for name in unmarked:
            owner.execute(f"vacuum public.{name}")
    return count(owner, "select count(*) from public.adult")


def all_visible(owner: psycopg.Connection[Any]) -> dict[str, float]:
    """The share of each table's pages the visibility map marks all-visible (1.0 after a VACUUM that could)."""
    rows = owner.execute("select relname, relallvisible::float / greatest(relpages, 1) from pg_class "
                         "where oid in ('public.adult'::regclass, 'public.visits'::regclass)").fetchall()
    return {str(name): round(float(share), 3) for name, share in rows}


class GatedProxy(AnonProxy):  # type: ignore[misc]
    """The pass-through benchmark's ``anonproxy serve`` (1 worker) with the service login that gates roles."""

    def __init__(self, upstream_port: int, service_dsn: str) -> None:
        super().__init__(upstream_port, workers=1)
        self._service_dsn = service_dsn

    def _start(self, args: list[str], env: dict[str, str] | None = None, cwd: Path | str = "/") -> None:
        # The proxy imports anonproxy from this repository too (a worktree of an older commit measures "before").
        env = {**(env or {}), "ANONPROXY_SERVICE_DSN": self._service_dsn, "PYTHONPATH": str(REPO)}
        super()._start(args, env=env, cwd=cwd)


def connect(conninfo: str, options: str) -> psycopg.Connection[Any]:
    """Autocommit, no TLS, never prepared: every statement is one simple-protocol Query."""
    return psycopg.connect(make_conninfo(conninfo, sslmode="disable", gssencmode="disable", options=options),
                           autocommit=True, prepare_threshold=None)


def wait_for_gate(conninfo: str, options: str) -> psycopg.Connection[Any]:
    """A reporter connection through the proxy, once the proxy has loaded the policy and gates the role."""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            conn = connect(conninfo, options)
            break
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    mode = conn.execute("SHOW anonproxy.mode").fetchone()
    if mode is None or mode[0] != "suppress":
        raise BenchmarkError(f"the proxy puts reporter in mode {mode}, not suppress")
    return conn


# -- running statements -------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    ms: float
    rows: int = 0
    error: str | None = None  # "timeout", or "SQLSTATE: message"


def run_timed(conn: psycopg.Connection[Any], sql: str) -> Outcome:
    """Client-side wall time from sending the Query to having every row."""
    start = time.perf_counter()
    try:
        rows = conn.execute(sql).fetchall()
    except psycopg.Error as error:
        ms = (time.perf_counter() - start) * 1000
        if error.sqlstate == "57014":  # query_canceled: statement_timeout
            return Outcome(ms, error="timeout")
        return Outcome(ms, error=f"{error.sqlstate}: {error.diag.message_primary or error}")
    return Outcome((time.perf_counter() - start) * 1000, len(rows))


class Texts:
    """The text each series sends for a shape: relayed and reporter the same one every run, the service its
    rewrite, the analyst a new question every run (a new table alias: see comment_check)."""

    def __init__(self, rewrites: dict[str, str]) -> None:
        self.rewrites = rewrites
        self.questions: Iterator[int] = itertools.count(1)

    def next(self, shape: Shape, series: str) -> str:
        if series == "service":
            return self.rewrites[shape.id]
        if series == "analyst":
            n = next(self.questions)
            return shape.text(n, f"run {n}")
        return shape.text(0, "seen")


def ledger_charges(owner: psycopg.Connection[Any]) -> int:
    return count(owner, "select count(*) from anonproxy.budget_ledger where role_name = 'analyst'")


def comment_check(owner: psycopg.Connection[Any], analyst: psycopg.Connection[Any], texts: Texts) -> dict[str, Any]:
    """Whether dp mode charges a question again when only its leading comment changes, and when only the table
    alias does: the analyst's runs must be new questions, not answers from the cache."""
    shape = SHAPES[0]
    n = next(texts.questions)
    charged = []
    for text in (shape.text(n, "comment A"), shape.text(n, "comment B"), shape.text(next(texts.questions), "A")):
        before = ledger_charges(owner)
        outcome = run_timed(analyst, text)
        if outcome.error:
            raise BenchmarkError(f"the analyst's {shape.id} failed: {outcome.error}")
        charged.append(ledger_charges(owner) - before)
    result = {"first_question_charged": charged[0], "comment_changed_charged": charged[1],
              "alias_changed_charged": charged[2]}
    if charged[2] != 1:
        raise BenchmarkError(f"a new table alias is not a new question in dp mode: {result}")
    return result


def rewrites(owner: psycopg.Connection[Any], shapes: Sequence[Shape]) -> dict[str, str | None]:
    """The SQL the proxy runs for the reporter's text of each shape (None: refused), with the policy as the proxy
    loads it."""
    policy = load_policy(owner)
    role = policy.roles["reporter"]
    out: dict[str, str | None] = {}
    for shape in shapes:
        decision = decide(shape.text(0, "seen"), role, policy)
        out[shape.id] = decision.runs if isinstance(decision, Rewrite) else None
    return out


def verify(conns: dict[str, psycopg.Connection[Any]], texts: Texts, shapes: Sequence[Shape],
           rewritten: dict[str, str | None]) -> tuple[list[Shape], dict[str, dict[str, str]]]:
    """Each shape once as relayed, reporter and analyst (the reporter's run makes it a statement the proxy has
    seen). Returns the shapes every mode answers, and the refusals of the others."""
    kept, refused = [], {}
    for shape in shapes:
        errors = {}
        for series in ("relayed", "reporter", "analyst"):
            outcome = run_timed(conns[series], texts.next(shape, series))
            if outcome.error:
                errors[series] = outcome.error
        if rewritten[shape.id] is None and "reporter" not in errors:
            errors["reporter"] = "decide() did not return a Rewrite"
        if errors:
            refused[shape.id] = errors
            progress(f"  {shape.id} dropped: {errors}")
        else:
            kept.append(shape)
    return kept, refused


# -- measuring ----------------------------------------------------------------------------------------------------


@dataclass
class Cell:
    """One shape at one size: every measured run of each series."""

    ms: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SERIES})
    rows: dict[str, int] = field(default_factory=dict)  # rows of the warm-up answer
    errors: dict[str, str] = field(default_factory=dict)  # a series that failed or timed out is not run again


def measure_size(conns: dict[str, psycopg.Connection[Any]], texts: Texts, shapes: Sequence[Shape],
                 runs: int) -> dict[str, Cell]:
    """One unmeasured run of each series (warm caches; a timeout there skips the series), then ``runs`` rounds:
    every shape, the four series in an order that rotates with the round and the shape."""
    cells = {shape.id: Cell() for shape in shapes}
    for shape in shapes:
        for series in SERIES:
            outcome = run_timed(conns[series], texts.next(shape, series))
            cells[shape.id].rows[series] = outcome.rows
            if outcome.error:
                cells[shape.id].errors[series] = outcome.error
        progress(f"  warm-up {shape.id}: " + ", ".join(
            f"{s} {cells[shape.id].errors.get(s) or f'{cells[shape.id].rows[s]} rows'}" for s in SERIES))
    for round_ in range(runs):
        for position, shape in enumerate(shapes):
            cell = cells[shape.id]
            shift = (round_ + position) % len(SERIES)
            for series in SERIES[shift:] + SERIES[:shift]:
                if series in cell.errors:
                    continue
                outcome = run_timed(conns[series], texts.next(shape, series))
                if outcome.error:
                    cell.errors[series] = outcome.error
                else:
                    cell.ms[series].append(round(outcome.ms, 3))
        progress(f"  round {round_ + 1}/{runs}")
    return cells


def percentile(values: list[float], fraction: float) -> float:
    """Nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def figures(cell: Cell) -> dict[str, Any]:
    """p50 and p90 of each series, the ratios to relayed and the proxy's own share; None where a series failed or
    timed out (in any run: its other runs are no median of the runs asked for)."""
    done = {s: v for s, v in cell.ms.items() if v and s not in cell.errors}
    p50 = {s: statistics.median(done[s]) if s in done else None for s in SERIES}
    p90 = {s: percentile(done[s], 0.9) if s in done else None for s in SERIES}

    def ratio(series: str) -> float | None:
        value, reference = p50[series], p50["relayed"]
        return value / reference if value is not None and reference else None

    share = p50["reporter"] - p50["service"] if p50["reporter"] is not None and p50["service"] is not None else None
    return {"p50": p50, "p90": p90, "reporter_ratio": ratio("reporter"), "analyst_ratio": ratio("analyst"),
            "share_ms": share}


# -- the report ---------------------------------------------------------------------------------------------------


def _ms(value: float | None, error: str | None = None) -> str:
    if error:
        return "timeout" if error == "timeout" else "error"
    return "–" if value is None else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def print_size(size: str, rows: int, shapes: Sequence[Shape], cells: dict[str, Cell], runs: int) -> None:
    print(f"\n## {size}: adult {rows:,} rows, {runs} runs\n")
    print("| id | shape | rows rel/rep/ana | relayed p50 | p90 | reporter p50 | p90 | ×rel | service p50 | share ms "
          "| analyst p50 | p90 | ×rel |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        cell, f = cells[shape.id], figures(cells[shape.id])
        e = cell.errors
        counts = "/".join(str(cell.rows.get(s, "–")) for s in ("relayed", "reporter", "analyst"))
        print(f"| {shape.id} | {shape.name} | {counts} "
              f"| {_ms(f['p50']['relayed'], e.get('relayed'))} | {_ms(f['p90']['relayed'], e.get('relayed'))} "
              f"| {_ms(f['p50']['reporter'], e.get('reporter'))} | {_ms(f['p90']['reporter'], e.get('reporter'))} "
              f"| {_x(f['reporter_ratio'])} | {_ms(f['p50']['service'], e.get('service'))} | {_x(f['share_ms'])} "
              f"| {_ms(f['p50']['analyst'], e.get('analyst'))} | {_ms(f['p90']['analyst'], e.get('analyst'))} "
              f"| {_x(f['analyst_ratio'])} |")
    for shape in shapes:
        for series, error in cells[shape.id].errors.items():
            print(f"- {shape.id} {series}: {error}")


def verdicts(results: dict[str, dict[str, Cell]]) -> list[dict[str, Any]]:
    """The targets, each with the shapes (size:id) that miss it; a series without figures misses."""
    checks: dict[str, list[str]] = {
        f"reporter p50 <= {TARGET_RATIO:g}x relayed at every size": [],
        f"analyst p50 <= {TARGET_RATIO:g}x relayed at every size": [],
        f"at 3m no shape above {TARGET_RATIO_3M:g}x relayed (reporter or analyst)": [],
        f"proxy's own share (reporter p50 - service p50) <= {TARGET_SHARE_MS:g} ms": [],
    }
    names = list(checks)
    for size, cells in results.items():
        for shape_id, cell in cells.items():
            f, where = figures(cell), f"{size}:{shape_id}"
            for name, ratio in ((names[0], f["reporter_ratio"]), (names[1], f["analyst_ratio"])):
                if ratio is None or ratio > TARGET_RATIO:
                    checks[name].append(f"{where} ({_x(ratio)})")
            ratios = (f["reporter_ratio"], f["analyst_ratio"])
            worst = None if None in ratios else max(ratios)  # a series without figures misses
            if size == "3m" and (worst is None or worst > TARGET_RATIO_3M):
                checks[names[2]].append(f"{where} ({_x(worst)})")
            if f["share_ms"] is None or f["share_ms"] > TARGET_SHARE_MS:
                checks[names[3]].append(f"{where} ({_x(f['share_ms'])})")
    if "3m" not in results:
        del checks[names[2]]
    return [{"target": name, "met": not misses, "misses": misses} for name, misses in checks.items()]


def print_verdicts(checks: list[dict[str, Any]]) -> None:
    print("\n## Verdicts\n")
    for check in checks:
        misses = ", ".join(check["misses"])
        print(f"- {check['target']}: {'MET' if check['met'] else 'MISSED'}" + (f" — {misses}" if misses else ""))


# -- the run ------------------------------------------------------------------------------------------------------


def code_version() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], check=False, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (" +changes" if git("status", "--porcelain", "--", "anonproxy",
                                                                      "sql") else "")


def machine(owner: psycopg.Connection[Any]) -> dict[str, Any]:
    match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    return {"cpu": match[1] if match else platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "postgresql": owner.info.parameter_status("server_version"),
            "load_average": " ".join(f"{v:.2f}" for v in os.getloadavg()), "code": code_version()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    policy = bench_policy(args.timeout_ms)
    timeout = f"-c statement_timeout={args.timeout_ms}"
    with ExitStack() as stack:
        progress("starting PostgreSQL; schema, adult, visits, demo roles, service role, policy")
        server = stack.enter_context(EmbeddedPostgres(settings=SERVER_SETTINGS))
        with psycopg.connect(server.conninfo(dbname=DATABASE)) as setup:
            password = prepare_database(setup, policy)
        owner = stack.enter_context(connect(server.conninfo(dbname=DATABASE), "-c jit=off"))
        service_dsn = make_conninfo(user=policy.service_role, password=password, dbname=DATABASE)
        proxy = stack.enter_context(GatedProxy(server.port, service_dsn))
        through_proxy = {"port": proxy.port, "host": HOST}
        reporter = wait_for_gate(make_conninfo(dbname=DATABASE, user="reporter", password="reporter",
                                               **through_proxy), timeout)
        conns = {
            "relayed": connect(make_conninfo(server.conninfo(dbname=DATABASE), **through_proxy),
                               f"{timeout} -c jit={args.jit}"),
            "reporter": reporter,
            "analyst": connect(make_conninfo(dbname=DATABASE, user="analyst", password="analyst", **through_proxy),
                               timeout),
            "service": connect(server.conninfo(user=policy.service_role, password=password, dbname=DATABASE),
                               f"{SERVICE_OPTIONS} {timeout}"),
        }
        for conn in conns.values():
            stack.callback(conn.close)
        progress(f"proxy ready on {HOST}:{proxy.port}")

        chosen = [shape for shape in SHAPES if args.shapes is None or shape.id in args.shapes]
        rewritten = rewrites(owner, chosen)
        texts = Texts({k: v for k, v in rewritten.items() if v is not None})
        sizes = sorted(args.sizes, key=COPIES.__getitem__)
        results: dict[str, dict[str, Cell]] = {}
        report: dict[str, Any] = {"sizes": {}}
        shapes: list[Shape] = chosen
        for index, size in enumerate(sizes):
            progress(f"{size}: loading adult ({COPIES[size]} copies) and visits, VACUUM ANALYZE")
            rows = grow(owner, COPIES[size])
            visible = all_visible(owner)
            progress(f"{size}: pages all-visible {visible}")
            if index == 0:
                report["comment_check"] = comment_check(owner, conns["analyst"], texts)
                progress(f"dp mode, charges: {report['comment_check']}")
                progress("checking that reporter and analyst answer every shape")
                shapes, report["refused"] = verify(conns, texts, shapes, rewritten)
            runs = args.repeat or (QUICK_RUNS if args.quick else DEFAULT_RUNS[size])
            progress(f"{size}: {rows:,} rows; {len(shapes)} shapes x {runs} runs, series interleaved")
            charges = ledger_charges(owner)
            results[size] = measure_size(conns, texts, shapes, runs)
            print_size(size, rows, shapes, results[size], runs)
            report["sizes"][size] = {
                "adult_rows": rows, "runs": runs, "all_visible": visible, "analyst_charges": ledger_charges(owner) - charges,
                "shapes": {s.id: dataclasses.asdict(results[size][s.id]) | figures(results[size][s.id])
                           for s in shapes}}
        checks = verdicts(results)
        print_verdicts(checks)
        info = machine(owner)
    refused = report["refused"]
    if refused:
        print("\n## Refused shapes (dropped)\n")
        for shape_id, errors in refused.items():
            print(f"- {shape_id}: " + "; ".join(f"{series}: {error}" for series, error in errors.items()))
    info["seconds"] = round(time.monotonic() - started)
    print(f"\nmachine: {info['cpu']}, {info['cores']} cores, PostgreSQL {info['postgresql']}, code {info['code']} "
          f"({Path(anonproxy.__file__).parent}); owner jit {args.jit}; load average at the end "
          f"{info['load_average']}; {info['seconds']} s")
    return {"settings": {"sizes": sizes, "shapes": [s.id for s in chosen], "repeat": args.repeat, "quick": args.quick,
                         "timeout_ms": args.timeout_ms, "jit": args.jit, "server_settings": SERVER_SETTINGS},
            "machine": info, "shapes": {s.id: {"name": s.name, "reporter_text": s.text(0, "seen"),
                                               "reporter_sql": rewritten[s.id]} for s in chosen},
            "verdicts": checks, **report}


def parse_sizes(text: str) -> list[str]:
    sizes = [size.strip().lower() for size in text.split(",") if size.strip()]
    unknown = [size for size in sizes if size not in COPIES]
    if unknown or not sizes:
        raise argparse.ArgumentTypeError(f"sizes are among {', '.join(COPIES)}, got {text!r}")
    return sizes


def parse_shapes(text: str) -> list[str]:
    ids = [shape.strip().lower() for shape in text.split(",") if shape.strip()]
    known = [shape.id for shape in SHAPES]
    unknown = [shape for shape in ids if shape not in known]
    if unknown or not ids:
        raise argparse.ArgumentTypeError(f"shapes are among {', '.join(known)}, got {text!r}")
    return ids


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_sizes, default=list(COPIES), help="comma-separated, among 30k, 300k, "
                                                                               "3m (default: all three)")
    parser.add_argument("--shapes", type=parse_shapes, help="comma-separated shape ids, e.g. s11,s12 (default: all)")
    parser.add_argument("--repeat", type=int, help="measured runs per shape and series at every size (default: "
                                                   + ", ".join(f"{k} {v}" for k, v in DEFAULT_RUNS.items()) + ")")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_RUNS} runs at every size")
    parser.add_argument("--timeout-ms", type=int, default=DEFAULT_TIMEOUT_MS,
                        help=f"statement timeout of every measured statement (default {DEFAULT_TIMEOUT_MS})")
    parser.add_argument("--jit", choices=("on", "off"), default="off",
                        help="jit of the owner's relayed session (default off, as the proxy's service sessions)")
    parser.add_argument("--json", type=Path, help="also write every sample and figure here")
    args = parser.parse_args(argv)
    print(f"anonproxy source: {Path(anonproxy.__file__).resolve().parent}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # clean up as on Ctrl-C
    try:
        report = run(args)
    except (BenchmarkError, psycopg.Error) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"\nresults written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
