#!/usr/bin/env python3
"""Wall time and information loss of anonproxy's anonymization methods, beside a reference Mondrian.

On ``adult`` (30,162 rows) and on ``adult_big`` (--rows rows, default
1,000,000, sampled from adult with the ages perturbed, by a seeded SQL
generator), for each method (mondrian, mondrian_relaxed, full_domain, mdav,
tclose_first) and each setting (k = 10; k = 10 and entropy ℓ = 2; k = 10 and
t = 0.2, sensitive column income), it times one
``anonproxy.create_anonymized_view`` call (and reads the time the method alone
took from the release registry's method_facts) and scores the release with
``anonproxy.utility`` (NCP, discernibility, EC count) and the verification
functions (k, entropy ℓ, t). Beside them, a reference strict Mondrian
(LeFevre, DeWitt, Ramakrishnan 2006), written here in plain Python/numpy and
run in memory on the same rows, its output loaded into a table and scored by
the same ``anonproxy.utility``. Prints the table and the PASS/MISS verdicts of
the targets in README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from anonproxy import sample_data, schema
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.views.hierarchies import load_adult_hierarchies

QI = ["age", "workclass", "education_num", "marital_status", "occupation", "race", "sex", "native_country"]
NUMERIC = ["age", "education_num"]
CATEGORICAL = [q for q in QI if q not in NUMERIC]
SENSITIVE = "income"
K = 10
METHODS = ("mondrian", "mondrian_relaxed", "full_domain", "mdav", "tclose_first")
SETTINGS: dict[str, dict[str, Any]] = {
    "k=10": {},
    "k=10 entropy-l=2": {"l": 2, "l_kind": "entropy"},
    "k=10 distinct-l=2": {"l": 2, "l_kind": "distinct"},
    "k=10 t=0.2": {"t": Decimal("0.2")},
}
SERVER_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
                   "shared_buffers": "256MB", "work_mem": "64MB", "max_wal_size": "4GB"}

# adult_big: --rows rows drawn uniformly (with replacement) from adult, each age moved by -2..2
# (kept within 17..90, the ages adult has), everything else as drawn. setseed makes it repeatable.
BIG_TABLE_SQL = """
create table adult_big as
with draws as materialized (
    select g as id, 1 + floor(random() * {adult_rows})::integer as pick, floor(random() * 5)::integer - 2 as shift
      from generate_series(1, {rows}) g)
select d.id, least(greatest(a.age + d.shift, 17), 90) as age, a.workclass, a.fnlwgt, a.education,
       a.education_num, a.marital_status, a.occupation, a.relationship, a.race, a.sex, a.capital_gain,
       a.capital_loss, a.hours_per_week, a.native_country, a.income
  from draws d join adult a on a.id = d.pick
"""


@dataclass
class Outcome:
    dataset: str
    method: str
    setting: str
    seconds: float | None = None  # the whole create_anonymized_view call, from the client
    method_seconds: float | None = None  # the method alone (its own clock; the reference: its partitioning)
    ncp: float | None = None
    sse_sst: float | None = None
    discernibility: int | None = None
    classes: int | None = None
    suppressed: int | None = None
    k: int | None = None
    l_distinct: int | None = None
    l_entropy: float | None = None
    t: float | None = None
    failure: str | None = None


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def hierarchies(method: str) -> dict[str, str | None]:
    """Categorical QIs and income use the adult ARX hierarchies; numeric QIs only for full_domain (else ranges)."""
    chosen: dict[str, str | None] = {c: f"adult.{c}" for c in [*CATEGORICAL, SENSITIVE]}
    chosen |= {c: f"adult.{c}" if method == "full_domain" else None for c in NUMERIC}
    return chosen


def measure(conn: psycopg.Connection, source: str, target: str, outcome: Outcome, method: str) -> None:
    """Fill outcome with the release's metrics, as anonproxy.utility and the verification functions compute them."""
    used = {c: h for c, h in hierarchies(method).items() if c in QI and h is not None}
    (metrics,) = one_row(conn, "select anonproxy.utility(%s, %s, %s, %s, %s)", (source, target, QI, Jsonb(used), K))
    outcome.ncp = metrics["ncp"]
    outcome.sse_sst = metrics["sse_sst"]
    outcome.discernibility = metrics["discernibility"]
    outcome.classes = metrics["equivalence_classes"]
    outcome.suppressed = metrics["suppressed_rows"]
    outcome.k, l_distinct, l_entropy, t = one_row(
        conn, "select anonproxy.k_anonymity(%(t)s, %(qi)s), anonproxy.l_diversity(%(t)s, %(qi)s, %(s)s, 'distinct'),"
        " anonproxy.l_diversity(%(t)s, %(qi)s, %(s)s, 'entropy'),"
        " anonproxy.t_closeness(%(t)s, %(qi)s, %(s)s, 'ordered')",
        {"t": target, "qi": QI, "s": SENSITIVE})
    outcome.l_distinct, outcome.l_entropy, outcome.t = int(l_distinct), float(l_entropy), float(t)


def one_row(conn: psycopg.Connection, query: str, params: Any) -> tuple[Any, ...]:
    row = conn.execute(query, params).fetchone()
    assert row is not None  # a select without FROM returns one row
    return row


def run_method(conn: psycopg.Connection, dataset: str, method: str, setting: str, timeout: int,
               suppression_limit: Decimal) -> Outcome:
    outcome = Outcome(dataset, method, setting)
    target = f"public.bench_{dataset}_{method}"
    options = {"source": f"public.{dataset}", "target": target, "quasi_identifiers": QI, "sensitive": SENSITIVE,
               "k": K, "method": method, "hierarchies": Jsonb(hierarchies(method)),
               "suppression_limit": suppression_limit, **SETTINGS[setting]}
    call = sql.SQL("select * from anonproxy.create_anonymized_view({})").format(
        sql.SQL(", ").join(sql.SQL("{} => {}").format(sql.Identifier(name), sql.Placeholder(name))
                           for name in options))
    conn.execute("select set_config('statement_timeout', %s, false)", (f"{timeout}s",))
    try:
        started = time.perf_counter()
        conn.execute(call, options)
        outcome.seconds = time.perf_counter() - started
    except psycopg.errors.QueryCanceled:
        outcome.failure = f"cancelled after {timeout} s"
    except psycopg.Error as exc:
        outcome.failure = (exc.diag.message_primary or str(exc)).splitlines()[0]
    finally:
        conn.execute("set statement_timeout = 0")
    if outcome.failure is None:
        (facts,) = one_row(conn, "select method_facts from anonproxy.releases where target = %s", (target,))
        outcome.method_seconds = float(facts["elapsed"]) if "elapsed" in facts else None
        measure(conn, f"public.{dataset}", target, outcome, method)
        conn.execute("select anonproxy.drop_release(%s)", (target,))
    return outcome


# --- reference: strict Mondrian, in memory ------------------------------------------------------------------------


@dataclass
class Tree:
    """A categorical QI over integer codes: ancestors[level][code] is the code of the value's ancestor at level."""

    labels: list[list[str]]  # labels[level][node code]
    ancestors: np.ndarray  # shape (levels + 1, values)
    covered: list[np.ndarray]  # covered[level][node code]: data values under the node


def load_tree(conn: psycopg.Connection, hierarchy: str, values: list[str]) -> Tree:
    rows = conn.execute("select leaf, level, node from anonproxy.hierarchy_nodes where hierarchy = %s",
                        (hierarchy,)).fetchall()
    top = max(level for _, level, _ in rows)
    node_of = {(leaf, level): node for leaf, level, node in rows}
    labels, ancestors, covered = [], np.zeros((top + 1, len(values)), dtype=np.int64), []
    for level in range(top + 1):
        names = sorted({node_of[(v, level)] for v in values})
        code = {name: i for i, name in enumerate(names)}
        ancestors[level] = [code[node_of[(v, level)]] for v in values]
        labels.append(names)
        covered.append(np.bincount(ancestors[level], minlength=len(names)))
    return Tree(labels, ancestors, covered)


def reference_mondrian(columns: dict[str, np.ndarray], trees: dict[str, Tree], k: int) -> Iterator[np.ndarray]:
    """Yield the row indexes of each final partition of strict Mondrian.

    A partition is cut on the QI of widest normalized extent that has an
    allowable cut (both sides, or every child, with at least k rows): a numeric
    QI at its (lower) median, the rows equal to it on the side that balances
    better; a categorical QI into the children of its values' lowest common
    ancestor.
    """
    spans = {q: float(columns[q].max() - columns[q].min()) or 1.0 for q in NUMERIC}
    stack = [np.arange(len(columns[QI[0]]))]
    while stack:
        rows = stack.pop()
        parts = None
        for width, q in sorted(((extent(columns[q][rows], q, trees, spans), q) for q in QI), reverse=True):
            if width == 0:
                break
            parts = cut(columns[q][rows], q, trees, k)
            if parts is not None:
                break
        if parts is None:
            yield rows
        else:
            stack.extend(rows[part] for part in parts)


def lowest_common_ancestor(values: np.ndarray, tree: Tree) -> tuple[int, int]:
    for level, ancestors in enumerate(tree.ancestors):
        nodes = ancestors[values]
        if (nodes == nodes[0]).all():
            return level, int(nodes[0])
    raise AssertionError("a hierarchy has one top")


def extent(values: np.ndarray, q: str, trees: dict[str, Tree], spans: dict[str, float]) -> float:
    if q in NUMERIC:
        return float(values.max() - values.min()) / spans[q]
    tree = trees[q]
    level, node = lowest_common_ancestor(values, tree)
    total = len(tree.labels[0])
    return (tree.covered[level][node] - 1) / (total - 1) if total > 1 else 0.0


def cut(values: np.ndarray, q: str, trees: dict[str, Tree], k: int) -> list[np.ndarray] | None:
    if q in NUMERIC:
        # Rows equal to the median all go to one side (strict); take the side that balances better.
        median = np.partition(values, (len(values) - 1) // 2)[(len(values) - 1) // 2]
        lefts = [left for left in (values <= median, values < median) if k <= left.sum() <= len(values) - k]
        if not lefts:
            return None
        left = min(lefts, key=lambda left: abs(2 * int(left.sum()) - len(values)))
        return [left, ~left]
    tree = trees[q]
    level, _ = lowest_common_ancestor(values, tree)
    children = tree.ancestors[level - 1][values]
    codes, counts = np.unique(children, return_counts=True)
    if counts.min() < k:
        return None
    return [children == code for code in codes]


def run_reference(conn: psycopg.Connection, dataset: str) -> Outcome:
    outcome = Outcome(dataset, "reference strict Mondrian (Python)", "k=10")
    fetched = conn.execute(sql.SQL("select {}, {} from {} order by id").format(
        sql.SQL(", ").join(map(sql.Identifier, QI)), sql.Identifier(SENSITIVE), sql.Identifier(dataset))).fetchall()
    started = time.perf_counter()
    columns, domains, trees = {}, {}, {}
    for i, q in enumerate(QI):
        raw = [row[i] for row in fetched]
        if q in NUMERIC:
            columns[q] = np.array(raw, dtype=np.int64)
        else:
            domains[q] = sorted(set(raw))
            code = {v: j for j, v in enumerate(domains[q])}
            columns[q] = np.array([code[v] for v in raw], dtype=np.int64)
            trees[q] = load_tree(conn, f"adult.{q}", domains[q])
    cells = {q: np.empty(len(fetched), dtype=object) for q in QI}
    for rows in reference_mondrian(columns, trees, K):
        for q in QI:
            values = columns[q][rows]
            if q in NUMERIC:
                low, high = int(values.min()), int(values.max())
                cells[q][rows] = str(low) if low == high else f"{low}-{high}"
            else:
                level, node = lowest_common_ancestor(values, trees[q])
                cells[q][rows] = trees[q].labels[level][node]
    outcome.seconds = outcome.method_seconds = time.perf_counter() - started
    target = f"public.reference_{dataset}"
    conn.execute(sql.SQL("create table {} ({}, {} text)").format(
        sql.Identifier("reference_" + dataset), sql.SQL(", ").join(sql.SQL("{} text").format(sql.Identifier(q))
                                                                    for q in QI), sql.Identifier(SENSITIVE)))
    with conn.cursor().copy(sql.SQL("copy {} from stdin").format(sql.Identifier("reference_" + dataset))) as copy:
        for i, row in enumerate(fetched):
            copy.write_row([*(cells[q][i] for q in QI), row[-1]])
    measure(conn, f"public.{dataset}", target, outcome, "mondrian")
    return outcome


# --- set-up, report ----------------------------------------------------------------------------------------------


def prepare(conn: psycopg.Connection, rows: int, seed: float) -> None:
    schema.install(conn)
    sample_data.load_adult(conn)
    load_adult_hierarchies(conn)
    conn.commit()
    if rows:
        conn.execute("select setseed(%s)", (seed,))
        conn.execute(BIG_TABLE_SQL.format(adult_rows=sample_data.ADULT_ROW_COUNT, rows=int(rows)))
        conn.execute("alter table adult_big add primary key (id)")
        conn.execute("analyze adult_big")
        conn.commit()


def table_row(o: Outcome) -> tuple[str, ...]:
    seconds = "-" if o.seconds is None else f"{o.seconds:.2f}"
    method = "-" if o.method_seconds is None else f"{o.method_seconds:.2f}"
    if o.ncp is None:
        return (o.dataset, o.method, o.setting, seconds, method, *("-",) * 9)
    sse_sst = "-" if o.sse_sst is None else f"{o.sse_sst:.4f}"
    return (o.dataset, o.method, o.setting, seconds, method, f"{100 * o.ncp:.2f}", sse_sst, str(o.discernibility),
            str(o.classes), str(o.suppressed), str(o.k), str(o.l_distinct), f"{o.l_entropy:.3f}", f"{o.t:.4f}")


def report(outcomes: list[Outcome], rows: int) -> list[tuple[str, bool | None, str]]:
    header = ("data", "method", "setting", "call s", "method s", "NCP %", "SSE/SST", "DM", "ECs", "supp.", "k", "dist. l",
              "entr. l", "t")
    table: list[tuple[str, ...]] = [header, *map(table_row, outcomes)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for o, r in zip([None, *outcomes], table, strict=True):
        line = "  ".join(value.ljust(width) for value, width in zip(r, widths, strict=True)).rstrip()
        print(line + (f"  ({o.failure})" if o is not None and o.failure else ""))

    def find(dataset: str, method: str) -> Outcome | None:
        return next((o for o in outcomes if o.dataset == dataset and o.method == method and o.setting == "k=10"), None)

    def within(o: Outcome | None, limit: float, method_alone: bool = False) -> bool | None:
        """None when not run or refused; a run cancelled at the timeout is a MISS."""
        if o is None or (o.failure is not None and not o.failure.startswith("cancelled")):
            return None
        seconds = o.method_seconds if method_alone else o.seconds
        return seconds is not None and seconds <= limit

    def timed(o: Outcome | None) -> str:
        if o is None or o.seconds is None:
            return ""
        return f"(method {o.method_seconds or 0:.2f} s, whole call {o.seconds:.2f} s)"

    mondrian, reference = find("adult", "mondrian"), find("adult", "reference strict Mondrian (Python)")
    ncp_verdict, ncp_detail = None, ""
    if mondrian is not None and reference is not None and reference.ncp is not None:
        ncp_verdict = mondrian.ncp is not None and mondrian.ncp <= reference.ncp
        ncp_detail = f"{100 * (mondrian.ncp or 0):.2f} % vs {100 * reference.ncp:.2f} %"
    big = find("adult_big", "mondrian")
    verdicts = [
        ("Mondrian k=10 on adult: the method <= 0.5 s", within(mondrian, 0.5, method_alone=True), timed(mondrian)),
        ("Mondrian k=10 on adult: NCP <= the reference's", ncp_verdict, ncp_detail),
        (f"Mondrian k=10 on {rows:,} rows: the method <= 15 s", within(big, 15, method_alone=True), timed(big)),
        ("full_domain k=10 on adult <= 10 s", within(find("adult", "full_domain"), 10), ""),
        ("mdav k=10 on adult <= 30 s", within(find("adult", "mdav"), 30), ""),
    ]
    print()
    for name, verdict, detail in verdicts:
        print(f"{'-' if verdict is None else 'PASS' if verdict else 'MISS':<4} {name}  {detail}".rstrip())
    return verdicts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of adult_big (0: adult only)")
    parser.add_argument("--seed", type=float, default=0.42, help="setseed() for adult_big, in [-1, 1]")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods to run")
    parser.add_argument("--big-methods", default=",".join(METHODS), help="methods to run on adult_big")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated settings (see the table)")
    parser.add_argument("--big-settings", default="k=10", help="settings run on adult_big")
    parser.add_argument("--timeout", type=int, default=300, help="seconds before a method run is cancelled")
    parser.add_argument("--suppression-limit", type=Decimal, default=Decimal(0),
                        help="share of rows a method may suppress (create_anonymized_view's suppression_limit)")
    parser.add_argument("--no-reference-big", action="store_true", help="skip the reference Mondrian on adult_big")
    parser.add_argument("--json", type=Path, help="also write every outcome as JSON")
    args = parser.parse_args()
    settings, big_settings = args.settings.split(","), args.big_settings.split(",")
    if unknown := [s for s in settings + big_settings if s not in SETTINGS]:
        parser.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")

    outcomes: list[Outcome] = []
    with ExitStack() as stack:
        server = stack.enter_context(EmbeddedPostgres(settings=SERVER_SETTINGS))
        conn = stack.enter_context(psycopg.connect(server.conninfo()))
        progress(f"installing the schema, adult, its hierarchies and adult_big ({args.rows:,} rows)")
        prepare(conn, args.rows, args.seed)
        conn.autocommit = True
        datasets = [("adult", args.methods, settings),
                    *([("adult_big", args.big_methods, big_settings)] if args.rows else [])]
        for dataset, methods, dataset_settings in datasets:
            if dataset == "adult" or not args.no_reference_big:
                progress(f"{dataset}: reference strict Mondrian")
                outcomes.append(run_reference(conn, dataset))
            for method in filter(None, methods.split(",")):
                # tclose_first is t-closeness by construction: it needs t.
                for setting in [s for s in dataset_settings if method != "tclose_first" or "t" in SETTINGS[s]]:
                    progress(f"{dataset}: {method}, {setting}")
                    outcomes.append(run_method(conn, dataset, method, setting, args.timeout, args.suppression_limit))
                    if outcomes[-1].failure:
                        progress(f"  {outcomes[-1].failure}")
        (version,) = one_row(conn, "show server_version", None)
    print(f"PostgreSQL {version}, Python {platform.python_version()}, {platform.machine()}, "
          f"{len(os.sched_getaffinity(0))} CPUs visible; k = {K}, sensitive {SENSITIVE}, QIs {', '.join(QI)}")
    verdicts = report(outcomes, args.rows)
    if args.json:
        args.json.write_text(json.dumps({"outcomes": [asdict(o) for o in outcomes],
                                         "verdicts": verdicts}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
