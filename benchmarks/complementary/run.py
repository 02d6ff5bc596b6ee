#!/usr/bin/env python3
"""What complementary suppression (issue 20) costs and gains, old code against new, in one run.

Two throwaway PostgreSQL servers, each set up like ``anonproxy up`` by its own
code (schema, Adult, demo roles, service role, demo policy), and two
``anonproxy serve`` proxies: the NEW code (this working tree) and the OLD
code (commit e6e9aae, the last one before the change, checked out with ``git
worktree add``; its proxy runs with that checkout first on PYTHONPATH and its
database stops at migration 0021). Every suppress-mode aggregate statement
of the corpus (the BI corpus' ``aggregate`` entries, the 25 queries of
benchmarks/suppress/workload.py, and this script's two-column GROUP BYs with
WHERE filters) runs as the demo ``reporter`` through both proxies, and:

1. utility: rows released by each code, the groups of the truth (the owner's
   raw GROUP BY with the same WHERE), the groups withheld, and how many of
   them complementary suppression withheld (from the new code's NOTICE, else
   derived from the two answers), with each code's own per-group verdicts
   read from the CTEs of its SQL as a cross-check, and an independent check
   of the count rules on the released groups; the whole-table totals and
   headline cards of the BI tools, answered old against new;
2. latency: p50 and p99 per statement already seen by each proxy, old and
   new interleaved.

Prints markdown tables; ``--json PATH`` writes every outcome. See README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1] / "passthrough"))
from targets import free_port, process_tree_cpu_seconds  # noqa: E402 - the pass-through benchmark's helpers

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OLD_COMMIT = "e6e9aae"  # the last commit before issue 20's change
DEFAULT_OLD_DIR = Path("/tmp/anonproxy-old")
HOST = "127.0.0.1"
DATABASE = "postgres"  # as `anonproxy up`
ROLE = "reporter"  # suppress mode: k = 10, dominance (2, 85 %), p % = 10, suppressed-rest row on
DEFAULT_RUNS = 15
QUICK_RUNS = 3
MIN_RUNS = 3  # latency runs of a statement, however slow
DEFAULT_BUDGET = 400.0  # seconds for the latency phase: slow statements get fewer runs (at least MIN_RUNS)
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0
TOP = 10  # statements listed as most affected

# The entries of the corpus that a BI tool shows as a headline number ("big number", "card", "stat").
HEADLINE_CARDS = {
    "mb-scalar-total": "Metabase scalar card",
    "ss-big-number": "Superset big number",
    "gf-builder-stat": "Grafana stat panel",
    "pbi-card": "Power BI card",
    "db-row-count": "DBeaver row count",
    "pga-count-rows": "pgAdmin count rows",
    "tb-total": "Tableau total",
    "total": "select count(*) from adult",
}

# Two-column GROUP BYs with WHERE filters over adult (own), and the two examples of README.md / docs (doc).
OWN_QUERIES = (
    ("o01", "SELECT education, sex, count(*) FROM adult WHERE age BETWEEN 20 AND 29 GROUP BY education, sex"),
    ("o02", "SELECT race, income, count(*) FROM adult WHERE sex = 'Female' GROUP BY race, income"),
    ("o03", "SELECT marital_status, relationship, count(*) FROM adult WHERE age >= 60 GROUP BY 1, 2"),
    ("o04", "SELECT workclass, sex, avg(hours_per_week) FROM adult WHERE income = '>50K' GROUP BY workclass, sex"),
    ("o05", "SELECT occupation, income, count(*) FROM adult WHERE race = 'Black' GROUP BY occupation, income"),
    ("o06", "SELECT native_country, sex, count(*) FROM adult WHERE age < 30 GROUP BY native_country, sex"),
    ("o07", "SELECT education, race, sum(capital_gain) FROM adult WHERE hours_per_week > 45 GROUP BY education, race"),
    ("o08", "SELECT age, sex, count(*) FROM adult WHERE native_country = 'Mexico' GROUP BY age, sex"),
    ("o09", "SELECT relationship, income, avg(age) FROM adult WHERE workclass = 'Self-emp-inc' "
            "GROUP BY relationship, income"),
    ("o10", "SELECT education_num, income, count(*) FROM adult WHERE marital_status = 'Never-married' GROUP BY 1, 2"),
    ("o11", "SELECT workclass, race, count(*) FROM adult WHERE education = 'Bachelors' GROUP BY workclass, race"),
    ("o12", "SELECT occupation, sex, sum(hours_per_week) FROM adult WHERE age BETWEEN 40 AND 49 "
            "AND income = '<=50K' GROUP BY occupation, sex"),
    ("d01", "select sex, count(*) from adult where id <> 17 group by 1"),
    ("d02", "select native_country, count(*) from adult group by 1"),
    ("total", "select count(*) from adult"),
)

NOTICE_GROUPS = re.compile(r"anonproxy: (\d+) groups? (?:was|were) suppressed"
                           r"(?: \((\d+|none) by the rules, (\d+) (?:more )?by complementary suppression\))?")
LIMIT = re.compile(r"\b(?:limit\s+(\d+)|fetch\s+(\d+)\s+in)\b", re.IGNORECASE)

# Run with the code under test first on PYTHONPATH: set up the database as `anonproxy up` does; prints the
# service role's new password. The superuser's connection string comes in BENCH_DSN.
PREPARE = """
import os, psycopg
from anonproxy import demo, sample_data, schema
from anonproxy.policy.yaml_policy import apply_policy, demo_policy
policy = demo_policy()
with psycopg.connect(os.environ["BENCH_DSN"]) as conn:
    schema.install(conn)
    sample_data.load_demo(conn)
    demo.create_demo_roles(conn, conn.info.dbname)
    password = demo.reset_service_role(conn, policy.service_role)
    apply_policy(conn, policy)
    conn.commit()
print(password)
"""
CODE_CHECK = ("import anonproxy, anonproxy.suppress.rewrite as r; "
              "print(anonproxy.__file__, hasattr(r, '_complementary'))")


class BenchmarkError(RuntimeError):
    pass


# -- the statements -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Statement:
    id: str
    source: str  # "corpus: <tool>", "workload", "own", "doc"
    steps: tuple[str, ...]  # sent in order on one session
    protocol: str  # simple | extended
    params: tuple[Any, ...] | None
    text: str  # the aggregate query alone, parameters written as literals: what the plans and the truth read


def load_statements() -> list[Statement]:
    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO / "benchmarks" / "suppress"))
    from bi_corpus import replay  # noqa: PLC0415
    from workload import QUERIES  # noqa: PLC0415

    statements = []
    for entry in replay.load():
        if entry.kind != "aggregate" or entry.design_refusal("suppress"):
            continue  # min/max and percentiles are refused by design in suppress mode
        query = next(step for step in entry.steps if re.search(r"\bselect\b", step, re.IGNORECASE))
        statements.append(Statement(entry.id, f"corpus: {entry.tool}", entry.steps, entry.protocol, entry.params,
                                    _literal_params(query, entry.params)))
    statements += [Statement(q.id, "workload", (q.sql,), "simple", None, q.sql) for q in QUERIES]
    statements += [Statement(i, "doc" if i.startswith("d") or i == "total" else "own", (sql,), "simple", None, sql)
                   for i, sql in OWN_QUERIES]
    return statements


def _literal_params(sql: str, params: Sequence[Any] | None) -> str:
    for value in params or ():
        literal = str(value) if isinstance(value, (int, float)) else "'" + str(value).replace("'", "''") + "'"
        sql = sql.replace("%s", literal, 1)
    return sql


# -- plans: each code's own analysis and verdict CTEs (run in a subprocess, the code under test on PYTHONPATH) -----


def emit_plans(dsn: str) -> None:
    """For each statement text on stdin (a JSON list): the analysed aggregate query (keys, FROM, WHERE, unit, N)
    as the proxy's own code path builds it, and the CTEs of its suppression SQL up to the per-group verdicts
    (``anonproxy_groups``), so that the verdicts can be read as a table. JSON list on stdout."""
    import psycopg  # noqa: PLC0415

    import anonproxy.suppress.nested as nested  # noqa: PLC0415
    import anonproxy.suppress.rewrite as rewrite_module  # noqa: PLC0415
    from anonproxy.plan.outer import Outer  # noqa: PLC0415
    from anonproxy.plan.shape import Nested, prepare  # noqa: PLC0415
    from anonproxy.plan.statements import Statement as Parsed  # noqa: PLC0415
    from anonproxy.plan.statements import split  # noqa: PLC0415
    from anonproxy.plan.tables import PolicyIndex  # noqa: PLC0415
    from anonproxy.policy.store import load_policy  # noqa: PLC0415
    from anonproxy.route.commands import declare_cursor, is_query  # noqa: PLC0415
    from anonproxy.route.decide import parse_statement  # noqa: PLC0415

    with psycopg.connect(dsn) as conn:
        policy = load_policy(conn)  # with the column types the proxy reads from the database
    params = policy.role(ROLE).suppression
    index = PolicyIndex(policy)
    analyses: list[Any] = []
    cells: list[tuple[Any, str, str]] = []  # (query, its SQL, the statement after its CTEs)
    bodies: list[str] = []
    real_analyze, real_cells, real_parts = nested.analyze, rewrite_module._cells, rewrite_module._cells_parts

    def analyze(*args: Any, **kwargs: Any) -> Any:
        analyses.append(real_analyze(*args, **kwargs))
        return analyses[-1]

    def cells_parts(*args: Any) -> Any:
        ctes, body = real_parts(*args)
        bodies.append(body)
        return ctes, body

    def cells_sql(query: Any, *args: Any) -> str:
        text = real_cells(query, *args)
        cells.append((query, text, bodies[-1]))
        return text

    nested.analyze, rewrite_module._cells, rewrite_module._cells_parts = analyze, cells_sql, cells_parts
    plans = []
    for text in json.load(sys.stdin):
        analyses.clear()
        cells.clear()
        try:
            statement = next(s for s in split(text) if s.word(0) == "DECLARE" or is_query(s))
            if statement.word(0) == "DECLARE":
                statement = Parsed(statement.source, statement.tokens[declare_cursor(statement).query:])
            shape = prepare(statement, parse_statement(statement), index)
            nested.suppressed(shape, index, params)
            first = analyses[0]  # the chart's query (for a series limit, analysed before its top query)
            plan: dict[str, Any] = {
                "shape": ("series limit" if isinstance(shape, Nested) and not isinstance(shape.post, Outer)
                          else "outer query" if isinstance(shape, Nested)
                          else "post-aggregate" if first.outer is not None else "plain"),
                "grouped": first.grouped,
                "key_names": [item.name for item in first.items if item.kind == "group"],
                "post_filter": first.having is not None or (isinstance(shape, Nested) and isinstance(
                    shape.post, Outer) and shape.post.outer.args.get("where") is not None),
            }
            if first.grouped:
                query, sql, body = cells[-1]  # the query whose groups the answer releases
                if not sql.endswith("\n" + body):
                    raise BenchmarkError("the cells SQL does not end with its statement")
                plan |= {"keys": list(query.keys), "from_sql": query.from_sql, "where": query.where,
                         "unit": query.unit, "universe": query.universe,
                         "ctes": sql[:-len(body) - 1], "complementary": "anonproxy_chosen" in sql}
            plans.append(plan)
        except Exception as exc:  # noqa: BLE001  (reported per statement)
            plans.append({"error": f"{type(exc).__name__}: {exc}"})
    json.dump(plans, sys.stdout)


def load_plans(code: Path, dsn: str, statements: list[Statement]) -> list[dict[str, Any]]:
    result = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--emit-plans"],
                            input=json.dumps([s.text for s in statements]), capture_output=True, text=True,
                            env=_code_env(code) | {"BENCH_DSN": dsn}, cwd=code, check=False)
    if result.returncode != 0:
        raise BenchmarkError(f"the plans of {code} failed:\n{result.stderr}")
    return json.loads(result.stdout)


# -- servers and proxies ------------------------------------------------------------------------------------------


def _code_env(code: Path) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("ANONPROXY_", "PYTHON"))}
    return env | {"PYTHONPATH": str(code)}


class Proxy:
    """``anonproxy serve`` (1 worker) of the code in ``code``, with the service login that gates roles."""

    def __init__(self, name: str, code: Path, upstream_port: int, service_dsn: str) -> None:
        self.name, self.code, self.port = name, code, free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"bench-complementary-{name}-"))
        env = _code_env(code) | {
            "ANONPROXY_LISTEN_HOST": HOST, "ANONPROXY_LISTEN_PORT": str(self.port),
            "ANONPROXY_UPSTREAM": f"host={HOST} port={upstream_port}", "ANONPROXY_WORKERS": "1",
            "ANONPROXY_LOG_LEVEL": "warning", "ANONPROXY_SERVICE_DSN": service_dsn,
        }
        with (self.workdir / "output.log").open("wb") as log:
            # cwd: `python -m` puts it first on sys.path, before PYTHONPATH
            self.process = subprocess.Popen([sys.executable, "-m", "anonproxy.cli", "serve"], env=env, cwd=code,
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def log_tail(self) -> str:
        lines = (self.workdir / "output.log").read_text(errors="replace").splitlines()[-20:]
        return "\n".join(lines)

    def wait_for_gate(self) -> None:
        """Until a reporter login succeeds and SHOW anonproxy.mode says suppress."""
        import psycopg  # noqa: PLC0415

        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise BenchmarkError(f"the {self.name} proxy exited:\n{self.log_tail()}")
            try:
                with psycopg.connect(self.dsn(), autocommit=True) as conn:
                    mode = conn.execute("SHOW anonproxy.mode").fetchone()
                if mode is None or mode[0] != "suppress":
                    raise BenchmarkError(f"the {self.name} proxy puts {ROLE} in mode {mode}")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise BenchmarkError(f"the {self.name} proxy is not ready:\n{self.log_tail()}") from None
                time.sleep(0.3)

    def dsn(self) -> str:
        return f"host={HOST} port={self.port} dbname={DATABASE} user={ROLE} password={ROLE} sslmode=disable"

    def cpu_seconds(self) -> float:
        return sum(process_tree_cpu_seconds(self.process.pid))  # user and system

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def ensure_old_checkout(path: Path) -> str:
    """The old code: a ``git worktree add`` checkout of OLD_COMMIT at ``path`` (made if missing)."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", f"{OLD_COMMIT}^{{commit}}"], capture_output=True,
                            text=True, check=True).stdout.strip()
    if not path.exists():
        progress(f"git worktree add --detach {path} {OLD_COMMIT}")
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit], check=True,
                       capture_output=True)
    head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    if head != commit:
        raise BenchmarkError(f"{path} is at {head[:12]}, not {OLD_COMMIT}: remove it (git worktree remove {path})")
    return commit


def check_code(code: Path, complementary: bool) -> None:
    """That a process started like the proxy imports anonproxy from ``code`` (and the right version of it)."""
    out = subprocess.run([sys.executable, "-c", CODE_CHECK], env=_code_env(code), cwd=code, capture_output=True,
                         text=True, check=True).stdout.split()
    if not out[0].startswith(str(code)) or out[1] != str(complementary):
        raise BenchmarkError(f"a process with {code} first on PYTHONPATH imports {out}")


def prepare_database(code: Path, superuser_dsn: str) -> str:
    result = subprocess.run([sys.executable, "-c", PREPARE], env=_code_env(code) | {"BENCH_DSN": superuser_dsn},
                            cwd=code, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BenchmarkError(f"setting up the database with {code} failed:\n{result.stderr}")
    return result.stdout.strip().splitlines()[-1]


# -- running statements -------------------------------------------------------------------------------------------


@dataclass
class Answer:
    error: str | None = None  # "SQLSTATE: message"
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # the last result's column names
    notices: list[str] = field(default_factory=list)  # anonproxy's NOTICE messages
    ms: float = 0.0


class Session:
    """One reporter session through a proxy; reopened when the proxy closes it, rolled back when left in a
    transaction (as tests/bi_corpus/replay.py)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.notices: list[str] = []
        self.conn = self._connect()

    def _connect(self) -> Any:
        import psycopg  # noqa: PLC0415

        conn = psycopg.connect(self.dsn, autocommit=True, prepare_threshold=None)
        conn.add_notice_handler(lambda diag: self.notices.append(diag.message_primary or ""))
        return conn

    def run(self, statement: Statement) -> Answer:
        import psycopg  # noqa: PLC0415
        from psycopg import pq  # noqa: PLC0415

        answer = Answer()
        self.notices.clear()
        start = time.perf_counter()
        try:
            for step in statement.steps:
                self._step(statement, step, answer)
        except psycopg.Error as error:
            answer.error = f"{error.sqlstate}: {error.diag.message_primary or error}"
        answer.ms = (time.perf_counter() - start) * 1000
        answer.notices = [text for text in self.notices if text.startswith("anonproxy:")]
        if self.conn.closed or self.conn.pgconn.status != pq.ConnStatus.OK:
            self.conn.close()
            self.conn = self._connect()
        elif self.conn.info.transaction_status != pq.TransactionStatus.IDLE:
            self.conn.execute("rollback")
        return answer

    def _step(self, statement: Statement, sql: str, answer: Answer) -> None:
        with self.conn.cursor() as cursor:
            if statement.protocol == "extended":
                with self.conn.pipeline():  # Parse/Bind/Describe/Execute of the unnamed statement, then Sync
                    cursor.execute(sql, statement.params)
                if cursor.description is not None:
                    answer.rows += cursor.fetchall()
                    answer.names = [column.name for column in cursor.description]
                return
            cursor.execute(sql, statement.params)
            while True:
                if cursor.description is not None:
                    answer.rows += cursor.fetchall()
                    answer.names = [column.name for column in cursor.description]
                if not cursor.nextset():
                    return

    def close(self) -> None:
        self.conn.close()


# -- per-statement figures ----------------------------------------------------------------------------------------


@dataclass
class Side:
    """One code's answer to one statement."""

    error: str | None
    rows: int  # rows received, the rest row included
    groups: int | None  # released groups (rows whose shown grouping columns are not all NULL); None: keys not shown
    rest_row: bool | None  # a row with NULL in every shown grouping column (the suppressed rest)
    notice: str | None
    notice_groups: int | None  # "N groups were suppressed"
    notice_complementary: int | None  # "(P by the rules, C more by complementary suppression)"; 0 when N is said
    withheld: int | None  # groups withheld: the notice's N, else truth - released groups (when no LIMIT/filter cut)
    withheld_from: str | None  # notice | rows
    value: str  # the answer, shortened (for the cards)
    shown_keys: list[list[Any]]  # the shown grouping columns of each released group
    # From the code's own verdict CTEs (anonproxy_groups), run directly on its database as the owner:
    cte_released: int | None = None
    cte_primary: int | None = None  # withheld alone (new: step 0; old: every withheld group)
    cte_complementary: int | None = None  # new only: withheld although they pass alone
    cte_margins: int | None = None  # new only: of those, withheld for a margin of a GROUP BY of several columns
    cte_rest: bool | None = None  # the rest row passes
    released_keys: list[list[Any]] = field(default_factory=list)
    check: dict[str, Any] | None = None  # the independent count check of the released groups
    plan_error: str | None = None


@dataclass
class Outcome:
    id: str
    source: str
    sql: str
    shape: str | None
    keys: list[str] | None
    truth_groups: int | None  # the owner's raw GROUP BY with the same WHERE (1 for a total)
    truth_people: int | None  # the people of the query set (WHERE applied)
    everyone: int | None  # N
    cut: bool  # a LIMIT (or FETCH) may have cut an answer, or a HAVING / outer WHERE drops rows
    new: Side
    old: Side
    complementary: int | None  # per the brief: the new NOTICE's C, else withheld new - withheld old
    complementary_from: str | None  # notice | derived | cte
    passing_alone: int | None  # groups of the truth that pass the rules alone (new code's primary verdict)
    new_not_old: list[dict[str, Any]]  # groups released by new, not by old (verdict CTEs), with their people
    new_not_old_shown: list[list[Any]]  # rows' shown keys released by new, not by old (answers, old not cut)
    old_vs_alone: list[dict[str, Any]]  # groups released by old xor passing alone under the new rules
    runs: int = 0  # latency runs of each code
    latency_ms: dict[str, list[float]] = field(default_factory=lambda: {"old": [], "new": []})


def _short(value: Any, width: int = 60) -> str:
    text = re.sub(r"\s+", " ", str(value)).strip()
    return text if len(text) <= width else text[: width - 1] + "…"


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def side_of(answer: Answer, plan: dict[str, Any], truth_groups: int | None, statement: Statement) -> Side:
    key_names = plan.get("key_names") or []
    positions = [i for i, name in enumerate(answer.names) if name in key_names]
    shown_keys: list[list[Any]] = []
    rest = None
    if positions:
        rest = False
        for row in answer.rows:
            keys = [row[i] for i in positions]
            if all(value is None for value in keys):
                rest = True
            else:
                shown_keys.append([_jsonable(value) for value in keys])
    groups = len(shown_keys) if positions else (len(answer.rows) if not plan.get("grouped") else None)
    notice = answer.notices[0] if answer.notices else None
    n_groups = n_comp = None
    if notice and (match := NOTICE_GROUPS.search(notice)):
        n_groups = int(match[1])
        n_comp = int(match[3]) if match[3] is not None else 0
    withheld, source = None, None
    if answer.error is None and plan.get("grouped"):
        if n_groups is not None:
            withheld, source = n_groups, "notice"
        elif groups is not None and truth_groups is not None and not _cut(statement, answer, plan):
            withheld, source = truth_groups - groups, "rows"
    value = answer.error or ("; ".join(_short(", ".join(str(v) for v in row), 40) for row in answer.rows[:3])
                             if answer.rows else "no row")
    return Side(answer.error, len(answer.rows), groups, rest, notice, n_groups, n_comp, withheld, source,
                _short(value, 70), shown_keys)


def _cut(statement: Statement, answer: Answer, plan: dict[str, Any]) -> bool:
    """Whether the answer may hold fewer released groups than were released: a LIMIT it reached, a FETCH that
    filled, a HAVING or an outer query's WHERE."""
    if plan.get("post_filter"):
        return True
    limits = [int(a or b) for a, b in LIMIT.findall(" ".join(statement.steps))]
    return bool(limits) and len(answer.rows) >= min(limits)


def read_verdicts(owner: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """Each group's verdict from the code's own CTEs, and the per-group people of the truth."""
    keys = plan["keys"]
    names = [f"g{i}" for i in range(1, len(keys) + 1)]
    if plan.get("complementary"):
        select = (f"SELECT {', '.join(names)}, released, step, step > (SELECT step FROM anonproxy_chosen) AS margin, "
                  "(SELECT released FROM anonproxy_rest) FROM anonproxy_groups")
    else:
        select = f"SELECT {', '.join(names)}, released, NULL, NULL, (SELECT released FROM anonproxy_rest) " \
                 "FROM anonproxy_groups"
    rows = owner.execute(plan["ctes"] + "\n" + select).fetchall()
    n = len(keys)
    return {"groups": [(tuple(row[:n]), row[n], row[n + 1], row[n + 2]) for row in rows],
            "rest": rows[0][n + 3] if rows else None}


def truth(owner: Any, plan: dict[str, Any]) -> tuple[dict[tuple[Any, ...], int], int, int]:
    """(people per group of the owner's raw GROUP BY with the same WHERE, people of the query set, N)."""
    keys = plan["keys"]
    where = f"WHERE {plan['where']}" if plan["where"] is not None else ""
    select = ", ".join(f"{key} AS g{i}" for i, key in enumerate(keys, 1))
    rows = owner.execute(f"SELECT {select}, count(DISTINCT {plan['unit']}) FROM {plan['from_sql']} {where} "
                         f"GROUP BY {', '.join(str(i) for i in range(1, len(keys) + 1))}").fetchall()
    people = owner.execute(f"SELECT count(DISTINCT {plan['unit']}) FROM {plan['from_sql']} {where}").fetchone()[0]
    everyone = owner.execute(plan["universe"]).fetchone()[0]
    return {tuple(row[:-1]): row[-1] for row in rows}, people, everyone


def count_check(groups: dict[tuple[Any, ...], int], released: set[tuple[Any, ...]], everyone: int, k: int,
                rest: bool | None, columns: int) -> dict[str, Any]:
    """Counts only (contributors and magnitude rules are not checked here): the withheld groups together hold 0
    or >= k people; the people in no released group (withheld, or left out by the WHERE) are 0 or >= k of N unless
    the rest row covers them; per margin of one grouping column, its withheld groups hold 0 or >= k people when
    the margin has a released group. Each person is in one group (one table: no join in this corpus)."""
    if not released:
        return {"released": 0, "withheld_people": None, "outside_people": None, "short_margins": [], "ok": True}
    withheld = sum(p for g, p in groups.items() if g not in released)
    outside = everyone - sum(p for g, p in groups.items() if g in released)
    short = []
    if columns > 1:
        for column in range(columns):
            margins: dict[Any, list[int]] = {}
            for g, p in groups.items():
                entry = margins.setdefault(g[column], [0, 0])
                entry[0 if g in released else 1] += p
            short += [[column + 1, _jsonable(value), people] for value, (kept, people) in margins.items()
                      if kept and 0 < people < k]
    problems = {"total": 0 < withheld < k, "outside": 0 < outside < k and not rest, "margins": bool(short)}
    return {"released": len(released), "withheld_people": withheld, "outside_people": outside,
            "short_margins": short, "problems": [name for name, bad in problems.items() if bad],
            "ok": not any(problems.values())}


# -- the run ------------------------------------------------------------------------------------------------------


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def plan_runs(costs_ms: list[float], most: int, least: int, budget_ms: float) -> list[int]:
    """Runs per statement: ``most`` each if that fits the budget; else as many as a common time cap per statement
    allows (cap / the statement's cost, from its first run of both codes), between ``least`` and ``most``."""
    def runs(cap: float) -> list[int]:
        return [min(most, max(least, int(cap // cost) if cost > 0 else most)) for cost in costs_ms]

    def total(cap: float) -> float:
        return sum(n * cost for n, cost in zip(runs(cap), costs_ms, strict=True))

    low, high = 0.0, max(costs_ms) * most
    if total(high) <= budget_ms:
        return runs(high)
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if total(middle) <= budget_ms else (low, middle)
    return runs(low)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import psycopg  # noqa: PLC0415

    from anonproxy.embedded import EmbeddedPostgres  # noqa: PLC0415
    from anonproxy.policy.yaml_policy import demo_policy  # noqa: PLC0415

    started = time.monotonic()
    old_dir = args.old.resolve()
    old_commit = ensure_old_checkout(old_dir)
    check_code(REPO, True)
    check_code(old_dir, False)
    statements = [s for s in load_statements() if args.only is None or re.search(args.only, s.id)]
    progress(f"{len(statements)} statements; old code {old_commit[:12]} in {old_dir}, new code in {REPO}")
    codes = {"old": old_dir, "new": REPO}
    with ExitStack() as stack:
        servers, owners, proxies, sessions, plans = {}, {}, {}, {}, {}
        for name, code in codes.items():
            progress(f"{name}: starting PostgreSQL, setting it up with the {name} code")
            server = stack.enter_context(EmbeddedPostgres(settings={"jit": args.jit} if args.jit else None))
            servers[name] = server
            password = prepare_database(code, server.conninfo(dbname=DATABASE))
            owners[name] = stack.enter_context(psycopg.connect(server.conninfo(dbname=DATABASE), autocommit=True))
            owners[name].execute("SET jit = off")  # the truth and the verdicts are not timed: no JIT compile time
            versions = owners[name].execute("select max(version) from anonproxy.schema_migrations").fetchone()[0]
            progress(f"{name}: database ready (schema version {versions})")
            service = psycopg.conninfo.make_conninfo(user="anonproxy_service", password=password, dbname=DATABASE)
            proxy = Proxy(name, code, server.port, service)
            stack.callback(proxy.stop)
            proxies[name] = proxy
        for name, proxy in proxies.items():
            proxy.wait_for_gate()
            progress(f"{name}: proxy ready on {HOST}:{proxy.port}")
            sessions[name] = Session(proxy.dsn())
            stack.callback(sessions[name].close)
            plans[name] = load_plans(codes[name], servers[name].conninfo(dbname=DATABASE), statements)
        k = int(demo_policy().role(ROLE).suppression.k)

        phases = {"setup": time.monotonic() - started}
        progress("utility: each statement through both proxies (first sight), the truth and the verdicts as owner")
        outcomes, first_ms = [], []
        for position, statement in enumerate(statements):
            order = ("old", "new") if position % 2 == 0 else ("new", "old")
            answers = {name: sessions[name].run(statement) for name in order}
            first_ms.append(answers["old"].ms + answers["new"].ms)
            outcomes.append(_outcome(statement, answers, plans["new"][position], plans["old"][position], owners, k))
        phases["utility"] = time.monotonic() - started - phases["setup"]

        runs = plan_runs(first_ms, args.runs, min(MIN_RUNS, args.runs), args.budget * 1000)
        for outcome, n in zip(outcomes, runs, strict=True):
            outcome.runs = n
        cpu_before = {name: proxy.cpu_seconds() for name, proxy in proxies.items()}
        progress(f"latency: {min(runs)} to {max(runs)} runs per statement and code (budget {args.budget:.0f} s, "
                 f"{sum(runs)} runs of each code), old and new alternating")
        latency_started = time.monotonic()
        for n in range(max(runs)):
            for position, (statement, outcome) in enumerate(zip(statements, outcomes, strict=True)):
                if n >= outcome.runs:
                    continue
                order = ("old", "new") if (n + position) % 2 == 0 else ("new", "old")
                for name in order:
                    answer = sessions[name].run(statement)
                    outcome.latency_ms[name].append(round(answer.ms, 3))
            progress(f"  round {n + 1}/{max(runs)}")
        latency_seconds = time.monotonic() - latency_started
        phases["latency"] = latency_seconds
        cpu = {name: proxy.cpu_seconds() - cpu_before[name] for name, proxy in proxies.items()}
        postgres_version = owners["new"].info.parameter_status("server_version")
    report = _report(outcomes, args, k)
    machine = {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
        "postgresql": postgres_version, "load_average_after": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "new_code": _head(REPO), "old_code": old_commit[:12],
        "proxy_cpu_seconds_during_latency": {name: round(value, 2) for name, value in cpu.items()},
        "phase_seconds": {name: round(value, 1) for name, value in phases.items()},
        "total_seconds": round(time.monotonic() - started, 1), "jit": args.jit or "PostgreSQL's default (on)",
    }
    print(f"\nmachine: {machine['cpu']}, {machine['cores']} cores, PostgreSQL {postgres_version} (jit: "
          f"{machine['jit']}); new code {machine['new_code']}, old code {machine['old_code']}; set-up "
          f"{phases['setup']:.0f} s, utility {phases['utility']:.0f} s, latency {latency_seconds:.0f} s, whole run "
          f"{machine['total_seconds']:.0f} s; load average at the end {machine['load_average_after']}")
    return {"settings": {"runs": args.runs, "min_runs": MIN_RUNS, "budget_seconds": args.budget, "role": ROLE,
                         "k": k, "old_dir": str(old_dir), "jit": args.jit}, "machine": machine,
            "summary": report, "outcomes": [asdict(outcome) for outcome in outcomes]}


def _head(repo: Path) -> str:
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", "anonproxy", "sql"],
                           capture_output=True, text=True).stdout.strip()
    return commit + (" +changes" if dirty else "")


def _cpu_model() -> str:
    match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    return match[1] if match else platform.machine()


def _outcome(statement: Statement, answers: dict[str, Answer], new_plan: dict[str, Any], old_plan: dict[str, Any],
             owners: dict[str, Any], k: int) -> Outcome:
    plan = new_plan if "error" not in new_plan else old_plan
    truth_groups = truth_people = everyone = None
    groups: dict[tuple[Any, ...], int] = {}
    if plan.get("grouped"):
        groups, truth_people, everyone = truth(owners["new"] if plan is new_plan else owners["old"], plan)
        truth_groups = len(groups)
    elif "error" not in plan:
        truth_groups = 1
    sides = {name: side_of(answers[name], p, truth_groups, statement)
             for name, p in (("new", new_plan), ("old", old_plan))}
    released: dict[str, set[tuple[Any, ...]]] = {}
    passing_alone = None
    alone: set[tuple[Any, ...]] = set()  # the groups that pass alone under the new rules
    for name, p in (("new", new_plan), ("old", old_plan)):
        side = sides[name]
        side.plan_error = p.get("error")
        if not p.get("grouped"):
            continue
        verdicts = read_verdicts(owners[name], p)
        # the people per group as this code's plan groups them (a series limit's top groups may differ)
        own_groups, _, own_everyone = (groups, truth_people, everyone) if p is plan else truth(owners[name], p)
        rows = verdicts["groups"]
        released[name] = {g for g, ok, _, _ in rows if ok}
        side.cte_released = len(released[name])
        side.cte_rest = verdicts["rest"]
        side.released_keys = [[_jsonable(v) for v in g] for g in sorted(released[name], key=repr)]
        if p.get("complementary"):
            side.cte_primary = sum(1 for _, ok, step, _ in rows if not ok and step == 0)
            side.cte_complementary = sum(1 for _, ok, step, _ in rows if not ok and step > 0)
            side.cte_margins = sum(1 for _, ok, step, margin in rows if not ok and step > 0 and margin)
            passing_alone = sum(1 for _, _, step, _ in rows if step > 0)
            alone = {g for g, _, step, _ in rows if step > 0}
        else:
            side.cte_primary = sum(1 for _, ok, _, _ in rows if not ok)
        # the owner's groups as the code's CTE keys them (the same expressions: the same values)
        side.check = count_check(own_groups, released[name], own_everyone, k, verdicts["rest"], len(p["keys"]))
    new, old = sides["new"], sides["old"]
    complementary, source = None, None
    if new.error is None and new.notice_groups is not None:
        complementary, source = new.notice_complementary, "notice"
    elif new.withheld is not None and old.withheld is not None and old.error is None:
        complementary, source = max(0, new.withheld - old.withheld), "derived"
    elif new.cte_complementary is not None:
        complementary, source = new.cte_complementary, "cte"
    new_not_old = [{"key": [_jsonable(v) for v in g], "people": groups.get(g)}
                   for g in sorted(released.get("new", set()) - released.get("old", set()), key=repr)] \
        if "new" in released and "old" in released else []
    # the old code's released groups against the groups that pass alone under the new rules (they differ only by
    # a group of everyone, n = N, which only the new rules release, or by a series limit's different top groups)
    old_vs_alone = [{"key": [_jsonable(v) for v in g], "people": groups.get(g), "released_by": "old" if g in
                     released.get("old", set()) else "passes alone (new)"}
                    for g in sorted(released.get("old", set()) ^ alone, key=repr)] \
        if "old" in released and new_plan.get("complementary") else []
    shown_new_not_old = []
    if new.error is None and old.error is None and not _cut(statement, Answer(rows=[()] * old.rows), plan):
        old_shown = {tuple(key) for key in old.shown_keys}
        shown_new_not_old = [key for key in new.shown_keys if tuple(key) not in old_shown]
    return Outcome(statement.id, statement.source, statement.text, plan.get("shape"), plan.get("keys"),
                   truth_groups, truth_people, everyone,
                   _cut(statement, Answer(rows=[()] * max(new.rows, old.rows)), plan), new, old,
                   complementary, source, passing_alone, new_not_old,
                   shown_new_not_old, old_vs_alone)


# -- the report ---------------------------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    return "–" if value is None else str(value)


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def _report(outcomes: list[Outcome], args: argparse.Namespace, k: int) -> dict[str, Any]:
    grouped = [o for o in outcomes if o.keys]
    scalar = [o for o in outcomes if not o.keys]
    print("\n## Utility: GROUP BY statements, new code against old\n")
    print(f"{len(outcomes)} statements: {len(grouped)} GROUP BYs, {len(scalar)} totals; reporter, k = {k}. "
          "Released: groups released (+R: and the rest row). Withheld: groups withheld (n = from the new NOTICE, "
          "r = truth − released rows). Compl.: groups withheld by complementary suppression (per the brief: the "
          "NOTICE's C, else new − old withheld; CTE: the new code's own verdicts; m: of them for a margin).\n")
    print("| id | source | truth | released old | released new | withheld old | withheld new | compl. | compl. CTE "
          "| notice (new) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for o in grouped:
        def released(side: Side) -> str:
            if side.error:
                return "error"
            return f"{_cell(side.groups)}{'+R' if side.rest_row else ''}"

        def withheld(side: Side) -> str:
            return "–" if side.withheld is None else f"{side.withheld} {side.withheld_from[0]}"

        compl = "–" if o.complementary is None else f"{o.complementary} ({o.complementary_from})"
        cte = _cell(o.new.cte_complementary) + (f" ({o.new.cte_margins} m)" if o.new.cte_margins else "")
        notice = _md(_short((o.new.notice or "").removeprefix("anonproxy: "), 70)) if o.new.notice else ""
        print(f"| {o.id} | {o.source} | {_cell(o.truth_groups)} | {released(o.old)} | {released(o.new)} "
              f"| {withheld(o.old)} | {withheld(o.new)} | {compl} | {cte} | {notice} |")

    # Summary figures: the brief's count where known, else the CTE's.
    complementary = {o.id: (o.complementary if o.complementary is not None else o.new.cte_complementary)
                     for o in grouped}
    affected = [o for o in grouped if (complementary[o.id] or 0) > 0]
    total_complementary = sum(v or 0 for v in complementary.values())
    passing = sum(o.passing_alone or 0 for o in grouped)
    cte_total = sum(o.new.cte_complementary or 0 for o in grouped)
    margins = sum(o.new.cte_margins or 0 for o in grouped)
    sources = Counter(o.complementary_from for o in grouped)
    mismatches = [o for o in grouped if o.complementary is not None and o.new.cte_complementary is not None
                  and o.complementary_from != "cte" and o.complementary != o.new.cte_complementary]
    released_mismatch = [
        (o.id, name, side.groups, side.cte_released) for o in grouped for name, side in (("new", o.new), ("old", o.old))
        if side.error is None and side.groups is not None and side.cte_released is not None and not o.cut
        and side.groups != side.cte_released]
    truth_total = sum(o.truth_groups or 0 for o in grouped)
    released_old = sum(o.old.cte_released or 0 for o in grouped)
    released_new = sum(o.new.cte_released or 0 for o in grouped)
    print("\n### Summary\n")
    print(f"- GROUP BY statements: {len(grouped)}; groups in the truth: {truth_total}; released by the old code "
          f"{released_old}, by the new {released_new} (verdict CTEs, before LIMIT/HAVING).")
    print(f"- statements that lose groups to complementary suppression: **{len(affected)} of {len(grouped)}**")
    share = f"{100 * total_complementary / passing:.1f} %" if passing else "–"
    print(f"- groups that pass the rules alone: {passing}; withheld by complementary suppression: "
          f"**{total_complementary} ({share})** (the brief's count: NOTICE {sources['notice']}, derived "
          f"{sources['derived']}, CTE only {sources['cte']} statements); by the new code's own verdicts {cte_total}, "
          f"of which {margins} for a margin of a GROUP BY of several columns")
    rests = {name: sum(1 for o in grouped if getattr(o, name).cte_rest) for name in ("old", "new")}
    print(f"- suppressed-rest row released (verdict CTEs): old code in {rests['old']} answers, new in "
          f"{rests['new']}")
    print("- NOTICE/derived count against the verdict CTEs: "
          + ("all agree" if not mismatches else "differ for " + ", ".join(
              f"{o.id} ({o.complementary} {o.complementary_from} vs {o.new.cte_complementary} CTE)"
              for o in mismatches)))
    print("- released rows against the verdict CTEs (answers not cut by LIMIT/HAVING): "
          + ("all agree" if not released_mismatch else ", ".join(
              f"{i} {n}: {g} rows vs {c} CTE" for i, n, g, c in released_mismatch)))
    most = sorted(affected, key=lambda o: (-(complementary[o.id] or 0), o.id))[:TOP]
    print("\n### Most affected\n")
    print("| id | statement | truth | pass alone | released old → new | complementary | share of passing |")
    print("|---|---|---|---|---|---|---|")
    for o in most:
        c = complementary[o.id] or 0
        print(f"| {o.id} | {_md(_short(o.sql, 80))} | {o.truth_groups} | {_cell(o.passing_alone)} "
              f"| {_cell(o.old.cte_released)} → {_cell(o.new.cte_released)} | {c} "
              f"| {f'{100 * c / o.passing_alone:.0f} %' if o.passing_alone else '–'} |")

    print("\n## Totals and headline cards\n")
    print("| id | card | statement | old answer | new answer | new notice |")
    print("|---|---|---|---|---|---|")
    cards = sorted(scalar, key=lambda o: (o.id not in HEADLINE_CARDS, o.id))
    for o in cards:
        print(f"| {o.id} | {HEADLINE_CARDS.get(o.id, '')} | {_md(_short(o.sql, 70))} | {_md(o.old.value)} "
              f"| {_md(o.new.value)} | {_md(_short(o.new.notice or '', 60))} |")
    headline = [o for o in scalar if o.id in HEADLINE_CARDS]
    answered = {name: sum(1 for o in headline if getattr(o, name).error is None and getattr(o, name).rows > 0)
                for name in ("old", "new")}
    print(f"\nheadline cards answered with a value: old {answered['old']}/{len(headline)}, new "
          f"{answered['new']}/{len(headline)}")

    # Surprises
    print("\n## Surprises\n")
    surprises: list[str] = []
    for o in outcomes:
        if o.new.error and not o.old.error:
            surprises.append(f"{o.id}: the new code refuses or fails ({o.new.error}); the old answered "
                             f"{o.old.rows} rows")
        elif o.old.error and not o.new.error:
            surprises.append(f"{o.id}: the old code refused or failed ({o.old.error}); the new answered")
        elif o.new.error:
            surprises.append(f"{o.id}: both codes fail: new {o.new.error}; old {o.old.error}")
        for name, side in (("new", o.new), ("old", o.old)):
            if side.plan_error:
                surprises.append(f"{o.id}: the {name} code's plan failed in this script: {side.plan_error}")
        if o.new_not_old:
            groups = ", ".join(f"{g['key']} ({g['people']} people{' = N' if g['people'] == o.everyone else ''})"
                               for g in o.new_not_old[:8])
            surprises.append(f"{o.id}: groups released by the new code and not by the old (verdict CTEs): {groups}"
                             f"{' …' if len(o.new_not_old) > 8 else ''}; N = {o.everyone}")
        if o.old_vs_alone:
            surprises.append(f"{o.id}: the old code's released groups differ from those that pass alone under the "
                             f"new rules: {o.old_vs_alone[:8]}; N = {o.everyone}")
        if o.new_not_old_shown:
            surprises.append(f"{o.id}: rows released by the new code and not by the old (answers): "
                             f"{o.new_not_old_shown[:8]}")
        if o.new.check and not o.new.check["ok"]:
            surprises.append(f"{o.id}: the new code's released groups fail the count check: {o.new.check}")
    for line in [s for s in surprises if s]:
        print(f"- {_md(line)}")
    if not [s for s in surprises if s]:
        print("- none")

    # Gains: the old answers the count check flags
    flagged_old = [o for o in grouped if o.old.check and not o.old.check["ok"]]
    flagged_new = [o for o in grouped if o.new.check and not o.new.check["ok"]]
    print("\n## Gains: answers from which a subtraction singles out fewer than k people\n")
    print("Count check on each code's released groups (people only; contributors and magnitude rules not checked "
          "here): withheld groups together hold 1 to k − 1 people (total), the people in no released group are "
          "1 to k − 1 without a rest row covering them (outside), or a one-column margin with a released group "
          "withholds 1 to k − 1 people (margins).\n")
    print(f"old code: {len(flagged_old)} of {len(grouped)} GROUP BY answers flagged; new code: {len(flagged_new)}\n")
    if flagged_old:
        print("| id | problems (old) | withheld people | outside people | short margins (column, value, people) |")
        print("|---|---|---|---|---|")
        for o in flagged_old:
            c = o.old.check
            print(f"| {o.id} | {', '.join(c['problems'])} | {c['withheld_people']} | {c['outside_people']} "
                  f"| {_md(_short(c['short_margins'], 90))} |")

    # Latency
    print(f"\n## Latency, statements already seen (up to {args.runs} runs each, old and new alternating)\n")
    print("Client-side time of the whole entry (all its steps), through each proxy. p99 is the nearest-rank "
          "percentile: with 15 runs or fewer, the slowest run. Statements too slow for the time budget get fewer "
          "runs (column runs).\n")
    print("| id | runs | p50 old ms | p50 new ms | new/old | p99 old ms | p99 new ms |")
    print("|---|---|---|---|---|---|---|")
    ratios = []
    latency = {}
    for o in outcomes:
        old, new = o.latency_ms["old"], o.latency_ms["new"]
        if not old or not new:
            continue
        p = {"old50": percentile(old, 0.5), "new50": percentile(new, 0.5), "old99": percentile(old, 0.99),
             "new99": percentile(new, 0.99)}
        latency[o.id] = p
        ratio = p["new50"] / p["old50"] if p["old50"] else math.nan
        ratios.append((ratio, o))
        print(f"| {o.id} | {o.runs} | {p['old50']:.1f} | {p['new50']:.1f} | {ratio:.2f} | {p['old99']:.1f} "
              f"| {p['new99']:.1f} |")
    grouped_ratios = [r for r, o in ratios if o.keys]
    scalar_ratios = [r for r, o in ratios if not o.keys]
    summary_latency = {
        "median_ratio_grouped": statistics.median(grouped_ratios) if grouped_ratios else None,
        "geomean_ratio_grouped": math.exp(statistics.fmean(math.log(r) for r in grouped_ratios))
        if grouped_ratios else None,
        "median_ratio_totals": statistics.median(scalar_ratios) if scalar_ratios else None,
        "p50_sum_old_ms": sum(p["old50"] for p in latency.values()),
        "p50_sum_new_ms": sum(p["new50"] for p in latency.values()),
    }
    worst = sorted(ratios, key=lambda item: -item[0])[:5]
    slowest = sorted(latency.items(), key=lambda item: -item[1]["new50"])[:5]
    print(f"\nGROUP BYs: median new/old p50 {summary_latency['median_ratio_grouped']:.2f}, geometric mean "
          f"{summary_latency['geomean_ratio_grouped']:.2f}; totals: median "
          f"{summary_latency['median_ratio_totals']:.2f}; "
          f"sum of p50s old {summary_latency['p50_sum_old_ms']:.0f} ms, new {summary_latency['p50_sum_new_ms']:.0f} ms")
    print("largest ratios: " + ", ".join(f"{o.id} {r:.2f} ({latency[o.id]['old50']:.0f} → "
                                         f"{latency[o.id]['new50']:.0f} ms)" for r, o in worst))
    print("slowest new p50: " + ", ".join(f"{i} {p['new50']:.0f} ms (old {p['old50']:.0f})" for i, p in slowest))
    return {
        "statements": len(outcomes), "grouped": len(grouped), "totals": len(scalar),
        "truth_groups": truth_total, "released_groups_old": released_old, "released_groups_new": released_new,
        "statements_losing_groups": len(affected), "passing_alone": passing,
        "complementary_withheld": total_complementary, "complementary_share": total_complementary / passing
        if passing else None, "complementary_cte": cte_total, "complementary_margins": margins,
        "complementary_sources": dict(sources), "mismatches": [o.id for o in mismatches],
        "released_mismatches": released_mismatch, "rest_row_released": rests, "most_affected": [o.id for o in most],
        "headline_answered": answered, "headline_cards": len(headline), "surprises": [s for s in surprises if s],
        "count_check_flagged_old": [o.id for o in flagged_old], "count_check_flagged_new": [o.id for o in flagged_new],
        "latency": summary_latency, "latency_per_statement": latency,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, help=f"latency runs per statement and code (default {DEFAULT_RUNS}, "
                                                 f"--quick {QUICK_RUNS})")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_RUNS} latency runs")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                        help=f"seconds for the latency phase (default {DEFAULT_BUDGET:.0f}): statements too slow for "
                             f"--runs runs in it get fewer, at least {MIN_RUNS}")
    parser.add_argument("--jit", choices=("on", "off"),
                        help="PostgreSQL's jit setting for both servers (default: PostgreSQL's default, on)")
    parser.add_argument("--json", type=Path, help="also write every outcome here")
    parser.add_argument("--old", type=Path, default=DEFAULT_OLD_DIR,
                        help=f"the old code's checkout (default {DEFAULT_OLD_DIR}; made with git worktree add)")
    parser.add_argument("--only", metavar="REGEX", help="only the statements whose id matches (a partial run)")
    parser.add_argument("--emit-plans", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.emit_plans:
        emit_plans(os.environ["BENCH_DSN"])
        return 0
    args.runs = args.runs or (QUICK_RUNS if args.quick else DEFAULT_RUNS)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        report = run(args)
    except BenchmarkError as exc:
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
