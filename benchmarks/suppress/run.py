#!/usr/bin/env python3
"""Latency anonproxy adds to a suppress-mode role's aggregate queries.

A throwaway PostgreSQL set up like ``anonproxy up`` (adult table, demo roles,
service role, demo policy) and ``anonproxy serve`` with a service login in
front of it. Each dashboard query of workload.py runs, interleaved, through
the proxy as ``reporter`` (a statement the proxy has seen: its decision is
cached), as its rewritten SQL directly against PostgreSQL as the service role
(the reference), and through the proxy as a text the proxy has never seen (a
unique comment per run). Prints p50/p99 of each and the latency the proxy
adds. Targets: <= 1 ms p50 added for a statement already seen, <= 10 ms for
one seen for the first time. A second proxy with the audit trail off runs
the seen statements too, side by side: the difference is the trail's cost.
See README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import psycopg
from workload import QUERIES, Query, first_sight_text

from anonproxy import demo, sample_data, schema
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import Policy, RolePolicy
from anonproxy.policy.yaml_policy import apply_policy, demo_policy
from anonproxy.route.decide import decide
from anonproxy.route.decision import Rewrite

PASSTHROUGH_DIR = Path(__file__).resolve().parents[1] / "passthrough"


def _load_passthrough() -> tuple[ModuleType, ModuleType]:
    """The pass-through benchmark's modules: its targets.py and its run.py (a name ours shadows)."""
    sys.path.append(str(PASSTHROUGH_DIR))  # its run.py imports ``targets`` as a top-level module
    import targets

    spec = importlib.util.spec_from_file_location("passthrough_run", PASSTHROUGH_DIR / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return targets, module


targets, passthrough = _load_passthrough()
HOST: str = targets.HOST
BenchmarkError: type[RuntimeError] = targets.BenchmarkError
percentile: Callable[[list[float], float], float] = passthrough._percentile  # nearest rank, of sorted values
machine_cpu_ticks: Callable[[], tuple[int, int]] = passthrough._machine_cpu_ticks
package_version: Callable[[str], str | None] = passthrough._package_version
progress: Callable[[str], None] = passthrough._progress
positive_int: Callable[[str], int] = passthrough._positive_int

DATABASE = "postgres"  # as `anonproxy up`
ROLE = "reporter"  # suppress mode, k = 10, dominance (2, 85 %), p % = 10, suppressed-rest row
SERVICE_APPLICATION = "anonproxy service"  # application_name of the proxy's service connections
# The session settings the proxy gives its service connections (anonproxy.proxy.service), also for the reference.
SERVICE_OPTIONS = "-c default_transaction_read_only=on -c search_path=pg_catalog"
# Every statement's server-side duration goes to the server log, one short line each ("12345|LOG:  duration: ...").
SERVER_SETTINGS = {"log_duration": "on", "log_line_prefix": "%p|"}
DURATION_LINE = re.compile(r"^(\d+)\|LOG:  duration: ([\d.]+) ms$", re.MULTILINE)
TARGET_SEEN_MS = 1.0
TARGET_FIRST_MS = 10.0
DEFAULT_REPEAT = 200
DEFAULT_WARMUP = 10
QUICK_REPEAT = 20
QUICK_WARMUP = 2
READY_TIMEOUT = 30.0
# The proxy clears its decision cache when it holds this many entries (anonproxy.proxy.session).
DECISION_CACHE_SIZE = 10_000
SERIES = ("proxy", "direct", "first", "off")  # off: seen, through the proxy with the audit trail off
CPU_ROUNDS = 40  # runs per query of the proxy-CPU phase (at most --repeat)
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20240601

Timings = dict[str, dict[str, list[float]]]  # query id -> series -> ms of each measured run, in run order


class GatedProxy(targets.AnonProxy):  # type: ignore[misc, name-defined]
    """The pass-through benchmark's ``anonproxy serve`` (1 worker), plus the service login that gates roles, and the
    audit trail on (the default) or off."""

    def __init__(self, upstream_port: int, service_dsn: str, audit_trail: bool = True) -> None:
        super().__init__(upstream_port, workers=1)
        self.name = f"anonproxy (1 worker, gated, audit trail {'on' if audit_trail else 'off'})"
        self._service_dsn = service_dsn
        self._audit_trail = audit_trail

    def _start(self, args: list[str], env: dict[str, str] | None = None, cwd: Path | str = "/") -> None:
        super()._start(args, env={**(env or {}), "ANONPROXY_SERVICE_DSN": self._service_dsn,
                                  "ANONPROXY_AUDIT_TRAIL": "on" if self._audit_trail else "off"}, cwd=cwd)


@dataclass
class Client:
    """One client connection, and the PostgreSQL backend that runs its statements.

    Through the proxy that backend is the session's service connection. ``sent`` labels every statement run,
    in order, so that the backend's n-th logged duration can be matched with it.
    """

    conn: psycopg.Connection[Any]
    backend_pid: int
    sent: list[tuple[str, str] | None] = field(default_factory=list)  # (query id, series); None: not measured

    def run(self, sql: str, label: tuple[str, str] | None = None) -> tuple[float, list[tuple[Any, ...]]]:
        """(ms from sending the Query to having every row, rows). No parameters: one simple-protocol Query."""
        self.sent.append(label)
        with self.conn.cursor() as cur:
            start = time.perf_counter_ns()
            cur.execute(sql, prepare=False)
            rows = cur.fetchall()
            elapsed = (time.perf_counter_ns() - start) / 1e6
        return elapsed, rows


@dataclass(frozen=True)
class Summary:
    """Percentiles of one series of timings, in ms."""

    p50: float
    p99: float
    mean: float
    min: float
    max: float


@dataclass(frozen=True)
class ServerSide:
    """The same runs seen from PostgreSQL's log: where the added latency goes (ms, p50s)."""

    direct: float  # server-side duration on the direct backend
    proxy: float  # on the seen session's service backend
    first: float  # on the first-sight session's service backend
    off: float  # on the service backend of the session through the proxy with the audit trail off
    outside_added_seen: float  # p50(client - server, through the proxy) - p50(client - server, direct)
    outside_added_first: float  # the same for first sight
    outside_trail_cost: float  # p50(client - server, seen, trail on) - p50(client - server, seen, trail off)


@dataclass(frozen=True)
class QueryResult:
    id: str
    kind: str
    sql: str
    rewritten_chars: int
    rows: int
    direct: Summary  # the rewritten SQL run directly as the service role
    proxy: Summary  # through the proxy as reporter, a statement already seen
    first: Summary  # through the proxy as reporter, a text never seen before
    off: Summary  # as proxy, through the second proxy, whose audit trail is off
    decide: Summary  # decide() alone, in-process, for each first-sight text
    added_seen_p50: float  # proxy.p50 - direct.p50
    added_seen_p99: float  # proxy.p99 - direct.p99
    added_first_p50: float  # first.p50 - direct.p50
    added_first_p99: float  # first.p99 - direct.p99
    added_seen_p50_ci: tuple[float, float]  # 95 % bootstrap interval of added_seen_p50
    added_first_p50_ci: tuple[float, float]  # 95 % bootstrap interval of added_first_p50
    trail_cost_p50: float  # proxy.p50 - off.p50: what the audit trail adds to a seen statement
    trail_cost_p50_ci: tuple[float, float]  # 95 % bootstrap interval of trail_cost_p50
    paired_seen_p50: float  # median over repetitions of (proxy - direct) of the same repetition
    paired_first_p50: float  # median over repetitions of (first - direct) of the same repetition
    server: ServerSide | None  # None when the server log could not be matched with the runs


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    default_repeat, default_warmup = (QUICK_REPEAT, QUICK_WARMUP) if args.quick else (DEFAULT_REPEAT, DEFAULT_WARMUP)
    args.repeat = default_repeat if args.repeat is None else args.repeat
    args.warmup = default_warmup if args.warmup is None else args.warmup
    signal.signal(signal.SIGTERM, passthrough._interrupt)  # stop the servers on SIGTERM as on Ctrl-C
    try:
        report = run(args)
    except (BenchmarkError, psycopg.Error) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--repeat",
        type=positive_int,
        help=f"measured runs per query and series (default {DEFAULT_REPEAT}, --quick {QUICK_REPEAT})",
    )
    parser.add_argument(
        "--warmup",
        type=_non_negative_int,
        help=f"unmeasured runs per query and series first (default {DEFAULT_WARMUP}, --quick {QUICK_WARMUP})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a short check that everything works: --repeat {QUICK_REPEAT} --warmup {QUICK_WARMUP} unless given",
    )
    parser.add_argument("--json", type=Path, help="also write settings, machine, every timing and the summary here")
    return parser


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def run(args: argparse.Namespace) -> dict[str, object]:
    policy = demo_policy()
    role = policy.role(ROLE)
    references = _check_workload(policy, role)
    with ExitStack() as stack:
        progress("starting PostgreSQL")
        server = stack.enter_context(EmbeddedPostgres(settings=SERVER_SETTINGS))
        progress("installing the schema, the adult table, the demo roles, the service role and the demo policy")
        service_password = _prepare_database(server, policy)
        service_dsn = psycopg.conninfo.make_conninfo(
            user=policy.service_role, password=service_password, dbname=DATABASE
        )
        proxy = stack.enter_context(GatedProxy(server.port, service_dsn))
        progress(f"{proxy.name} on {HOST}:{proxy.port}")
        proxy_off = stack.enter_context(GatedProxy(server.port, service_dsn, audit_trail=False))
        progress(f"{proxy_off.name} on {HOST}:{proxy_off.port}")
        admin = stack.enter_context(psycopg.connect(server.conninfo(dbname=DATABASE), autocommit=True))
        seen = _proxy_client(stack, admin, _wait_for_gate(proxy.port))
        first = _proxy_client(stack, admin, _connect(proxy.port, ROLE, ROLE), others=[seen])
        off = _proxy_client(stack, admin, _wait_for_gate(proxy_off.port), others=[seen, first])
        direct_conn = stack.enter_context(
            _connect(server.port, policy.service_role, service_password, options=SERVICE_OPTIONS)
        )
        direct = Client(direct_conn, direct_conn.info.backend_pid)
        clients = {"proxy": seen, "direct": direct, "first": first, "off": off}
        machine = _machine(admin)
        progress("machine: " + ", ".join(f"{key} {value}" for key, value in machine.items()))

        first_texts = {query.id: [first_sight_text(query, n) for n in range(1, args.repeat + 1)] for query in QUERIES}
        progress(f"timing decide() in-process on {args.repeat} first-sight texts per query")
        decide_ms = {
            query.id: _time_decide(first_texts[query.id], references[query.id], role, policy) for query in QUERIES
        }

        progress(f"warming up: {args.warmup} runs per query and series, and checking the proxy's answers")
        row_counts = _warm_up(references, args.warmup, clients)

        # Texts the proxy decides and caches: seen, first sight (check, warm-up, measured, CPU phase).
        unique = len(QUERIES) * (1 + 1 + args.warmup + args.repeat + min(args.repeat, CPU_ROUNDS))
        if unique >= DECISION_CACHE_SIZE:
            progress(
                f"note: {unique} distinct texts exceed the proxy's decision cache ({DECISION_CACHE_SIZE}); "
                "it is cleared when full, so a few 'seen' runs are decided again"
            )
        progress(f"measuring: {args.repeat} runs x {len(QUERIES)} queries x {len(SERIES)} series, interleaved")
        timings, machine_cpu_pct, elapsed = _measure(args.repeat, references, first_texts, clients)
        server_timings = _server_timings(server.log_file, clients)

        cpu_rounds = min(args.repeat, CPU_ROUNDS)
        progress(f"proxy CPU: {cpu_rounds} runs x {len(QUERIES)} queries, seen, then first sight")
        proxy_cpu = {
            "seen": _proxy_cpu_ms(proxy, seen, [[query.sql for query in QUERIES]] * cpu_rounds),
            "seen_trail_off": _proxy_cpu_ms(proxy_off, off, [[query.sql for query in QUERIES]] * cpu_rounds),
            "first": _proxy_cpu_ms(
                proxy, first, [[first_sight_text(query, 100_000 + n) for query in QUERIES] for n in range(cpu_rounds)]
            ),
        }
        time.sleep(2)  # the trail-on proxy writes its buffer at least every second
        audit_rows = admin.execute("select count(*) from anonproxy.audit_trail").fetchone()[0]
    results = [
        _result(
            query,
            references[query.id],
            row_counts[query.id],
            timings[query.id],
            server_timings[query.id] if server_timings else None,
            decide_ms[query.id],
        )
        for query in QUERIES
    ]
    summary = _summary(results) | {f"proxy_cpu_{key}_ms_per_statement": value for key, value in proxy_cpu.items()}
    summary["audit_trail_rows_written"] = audit_rows
    _print_report(results, summary, machine_cpu_pct, elapsed)
    settings = {
        "repeat": args.repeat,
        "warmup": args.warmup,
        "role": ROLE,
        "role_policy": asdict(role),
        "proxy_workers": 1,
        "audit_trail": "on for the proxy and first series, off for the off series",
        "protocol": "simple (psycopg, autocommit, no prepared statements)",
        "server_settings": SERVER_SETTINGS,
        "target_added_seen_p50_ms": TARGET_SEEN_MS,
        "target_added_first_p50_ms": TARGET_FIRST_MS,
    }
    machine |= {
        "machine_cpu_pct_during_measurement": round(machine_cpu_pct, 1),
        "measurement_seconds": round(elapsed, 1),
        "load_average_after": _load_average(),
    }
    return {
        "settings": settings,
        "machine": machine,
        "summary": summary,
        "queries": [asdict(result) for result in results],
        "timings_ms": _rounded(timings),
        "server_timings_ms": _rounded(server_timings) if server_timings else None,
    }


def _rounded(timings: Timings) -> Timings:
    return {
        query_id: {series: [round(value, 4) for value in values] for series, values in by_series.items()}
        for query_id, by_series in timings.items()
    }


def _check_workload(policy: Policy, role: RolePolicy) -> dict[str, str]:
    """The rewritten SQL of every query; fail unless the rewriter rewrites each one."""
    references: dict[str, str] = {}
    problems: list[str] = []
    for query in QUERIES:
        decision = decide(query.sql, role, policy)
        if isinstance(decision, Rewrite):
            references[query.id] = decision.sql
        else:
            problems.append(f"{query.id}: {query.sql}\n    -> {decision}")
    if problems:
        raise BenchmarkError(f"decide() does not rewrite these workload queries for {ROLE}:\n" + "\n".join(problems))
    return references


def _prepare_database(server: EmbeddedPostgres, policy: Policy) -> str:
    """As `anonproxy up` does; returns the service role's new password."""
    with psycopg.connect(server.conninfo(dbname=DATABASE)) as conn:
        schema.install(conn)
        sample_data.load_demo(conn)
        demo.create_demo_roles(conn, DATABASE)
        password = demo.reset_service_role(conn, policy.service_role)
        apply_policy(conn, policy)
        conn.commit()
    return password


def _connect(port: int, user: str, password: str, options: str = "") -> psycopg.Connection[Any]:
    """Autocommit, no TLS, never prepared: every execute() without parameters is one simple-protocol Query."""
    return psycopg.connect(
        host=HOST,
        port=port,
        dbname=DATABASE,
        user=user,
        password=password,
        sslmode="disable",
        gssencmode="disable",
        autocommit=True,
        prepare_threshold=None,
        options=options,
    )


def _wait_for_gate(port: int) -> psycopg.Connection[Any]:
    """A reporter connection through the proxy, once the proxy has loaded the policy and gates the role."""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            conn = _connect(port, ROLE, ROLE)
        except psycopg.OperationalError as exc:
            if ("57P03" not in str(exc) and "policy" not in str(exc)) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        mode = conn.execute("SHOW anonproxy.mode", prepare=False).fetchone()  # answered by the proxy itself
        if mode is None or mode[0] != "suppress":
            conn.close()
            raise BenchmarkError(f"the proxy puts {ROLE} in mode {mode}, not suppress")
        return conn


def _proxy_client(
    stack: ExitStack, admin: psycopg.Connection[Any], conn: psycopg.Connection[Any], others: Sequence[Client] = ()
) -> Client:
    """A connection through the proxy; its backend is the service connection the proxy opened for it."""
    stack.enter_context(conn)
    rows = admin.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", (SERVICE_APPLICATION,))
    new = {pid for (pid,) in rows.fetchall()} - {client.backend_pid for client in others}
    if len(new) != 1:
        # The proxy's service connections are a pool shared by the worker's sessions, opened when first needed:
        # a session has no backend of its own, so its statements' server-side durations cannot be told apart.
        progress("note: no service connection of this session's own (shared pool); no server-side figures")
        return Client(conn, 0)
    return Client(conn, new.pop())


def _time_decide(texts: list[str], reference: str, role: RolePolicy, policy: Policy) -> list[float]:
    timings = []
    for text in texts:
        start = time.perf_counter_ns()
        decision = decide(text, role, policy)
        timings.append((time.perf_counter_ns() - start) / 1e6)
        if not isinstance(decision, Rewrite) or decision.sql != reference:
            raise BenchmarkError(
                f"decide() of the first-sight text {text!r} is not the rewrite of the query "
                f"without its comment: {decision}"
            )
    return timings


def _warm_up(references: dict[str, str], warmup: int, clients: dict[str, Client]) -> dict[str, int]:
    """Run each query in every series (the proxy now holds the decisions); the proxy must answer as the reference."""
    rows: dict[str, int] = {}
    for query in QUERIES:
        try:
            _, expected = clients["direct"].run(references[query.id])
            for label, client, text in (
                ("seen", clients["proxy"], query.sql),
                ("seen, trail off", clients["off"], query.sql),
                ("first-sight", clients["first"], first_sight_text(query, 0)),
            ):
                _, answer = client.run(text)
                if answer != expected:
                    raise BenchmarkError(
                        f"{query.id}: the proxy's answer ({label}) differs from the rewritten SQL's run directly\n"
                        f"  query: {text}\n  proxy:  {answer}\n  direct: {expected}"
                    )
        except psycopg.Error as exc:
            raise BenchmarkError(
                f"{query.id} failed: {type(exc).__name__}: {str(exc).strip()}\n  query: {query.sql}"
            ) from exc
        rows[query.id] = len(expected)
    for n in range(warmup):
        for query in QUERIES:
            clients["proxy"].run(query.sql)
            clients["off"].run(query.sql)
            clients["direct"].run(references[query.id])
            clients["first"].run(first_sight_text(query, -1 - n))
    return rows


def _measure(
    repeat: int, references: dict[str, str], first_texts: dict[str, list[str]], clients: dict[str, Client]
) -> tuple[Timings, float, float]:
    """Every series of every query, one repetition at a time; returns timings, machine CPU % and seconds taken.

    Within a repetition the three series of a query run back to back, their order rotated from one query and
    repetition to the next, so that each series goes first, second and third equally often.
    """
    timings: Timings = {query.id: {series: [] for series in SERIES} for query in QUERIES}
    busy_before, total_before = machine_cpu_ticks()
    started = time.monotonic()
    for n in range(repeat):
        for position, query in enumerate(QUERIES):
            texts = {"proxy": query.sql, "direct": references[query.id], "first": first_texts[query.id][n],
                     "off": query.sql}
            shift = (n + position) % len(SERIES)
            for series in SERIES[shift:] + SERIES[:shift]:
                elapsed, _ = clients[series].run(texts[series], (query.id, series))
                timings[query.id][series].append(elapsed)
        if (n + 1) % max(1, repeat // 10) == 0:
            progress(f"  {n + 1}/{repeat}")
    elapsed_s = time.monotonic() - started
    busy_after, total_after = machine_cpu_ticks()
    return timings, 100 * (busy_after - busy_before) / (total_after - total_before), elapsed_s


def _server_timings(log_file: Path, clients: dict[str, Client]) -> Timings | None:
    """Each measured run's duration as PostgreSQL logged it (log_duration), matched by backend and order.

    None, with a note, when a backend logged a different number of statements than its client sent.
    """
    time.sleep(0.5)  # PostgreSQL logs a statement's duration after sending its result
    durations: dict[int, list[float]] = {}
    for pid, ms in DURATION_LINE.findall(log_file.read_text(errors="replace")):
        durations.setdefault(int(pid), []).append(float(ms))
    timings: Timings = {query.id: {series: [] for series in SERIES} for query in QUERIES}
    for series, client in clients.items():
        logged = durations.get(client.backend_pid, [])
        if len(logged) != len(client.sent):
            progress(
                f"note: backend {client.backend_pid} ({series}) logged {len(logged)} durations for "
                f"{len(client.sent)} statements; no server-side figures"
            )
            return None
        for label, ms in zip(client.sent, logged, strict=True):
            if label is not None:
                timings[label[0]][label[1]].append(ms)
    return timings


def _proxy_cpu_ms(proxy: Any, client: Client, rounds: list[list[str]]) -> float:
    """CPU time (user + system, supervisor and worker, from /proc) the proxy spends per statement, in ms.

    /proc counts in clock ticks (10 ms), hence many statements per figure.
    """
    before = proxy.cpu_seconds()
    statements = 0
    for texts in rounds:
        for text in texts:
            client.run(text)
            statements += 1
    return 1000 * (proxy.cpu_seconds() - before) / statements


def _stats(values: list[float]) -> Summary:
    ordered = sorted(values)
    return Summary(
        p50=percentile(ordered, 0.50),
        p99=percentile(ordered, 0.99),
        mean=statistics.fmean(ordered),
        min=ordered[0],
        max=ordered[-1],
    )


def _p50(values: list[float]) -> float:
    return percentile(sorted(values), 0.50)


def _result(
    query: Query,
    reference: str,
    rows: int,
    timings: dict[str, list[float]],
    server: dict[str, list[float]] | None,
    decide_ms: list[float],
) -> QueryResult:
    direct, proxy, first, off = (_stats(timings[series]) for series in ("direct", "proxy", "first", "off"))
    server_side = None
    if server is not None:
        outside = {
            series: [client - logged for client, logged in zip(timings[series], server[series], strict=True)]
            for series in SERIES
        }
        server_side = ServerSide(
            direct=_p50(server["direct"]),
            proxy=_p50(server["proxy"]),
            first=_p50(server["first"]),
            off=_p50(server["off"]),
            outside_added_seen=_p50(outside["proxy"]) - _p50(outside["direct"]),
            outside_added_first=_p50(outside["first"]) - _p50(outside["direct"]),
            outside_trail_cost=_p50(outside["proxy"]) - _p50(outside["off"]),
        )
    return QueryResult(
        id=query.id,
        kind=query.kind,
        sql=query.sql,
        rewritten_chars=len(reference),
        rows=rows,
        direct=direct,
        proxy=proxy,
        first=first,
        off=off,
        decide=_stats(decide_ms),
        added_seen_p50=proxy.p50 - direct.p50,
        added_seen_p99=proxy.p99 - direct.p99,
        added_first_p50=first.p50 - direct.p50,
        added_first_p99=first.p99 - direct.p99,
        added_seen_p50_ci=_p50_difference_interval(timings["proxy"], timings["direct"]),
        added_first_p50_ci=_p50_difference_interval(timings["first"], timings["direct"]),
        trail_cost_p50=proxy.p50 - off.p50,
        trail_cost_p50_ci=_p50_difference_interval(timings["proxy"], timings["off"]),
        paired_seen_p50=statistics.median(p - d for p, d in zip(timings["proxy"], timings["direct"], strict=True)),
        paired_first_p50=statistics.median(f - d for f, d in zip(timings["first"], timings["direct"], strict=True)),
        server=server_side,
    )


def _p50_difference_interval(series: list[float], reference: list[float]) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of p50(series) - p50(reference).

    Resamples repetitions, keeping each repetition's two timings together (they ran back to back, so they share
    the machine's load of that moment); p50 is the nearest-rank one, as in the table.
    """
    a, b = np.asarray(series), np.asarray(reference)
    n = len(a)
    rank = max(0, -(-n // 2) - 1)  # nearest rank of the 50th percentile, 0-based: ceil(0.5 n) - 1
    picks = np.random.default_rng(BOOTSTRAP_SEED).integers(0, n, size=(BOOTSTRAP_RESAMPLES, n))
    differences = np.sort(a[picks], axis=1)[:, rank] - np.sort(b[picks], axis=1)[:, rank]
    low, high = np.quantile(differences, [0.025, 0.975])
    return float(low), float(high)


def _summary(results: list[QueryResult]) -> dict[str, Any]:
    worst_seen = max(results, key=lambda result: result.added_seen_p50)
    worst_first = max(results, key=lambda result: result.added_first_p50)
    summary: dict[str, Any] = {
        "added_seen_p50_max_ms": worst_seen.added_seen_p50,
        "added_seen_p50_max_query": worst_seen.id,
        "added_seen_p50_median_ms": statistics.median(result.added_seen_p50 for result in results),
        "seen_passed": worst_seen.added_seen_p50 <= TARGET_SEEN_MS,
        "added_first_p50_max_ms": worst_first.added_first_p50,
        "added_first_p50_max_query": worst_first.id,
        "added_first_p50_median_ms": statistics.median(result.added_first_p50 for result in results),
        "first_passed": worst_first.added_first_p50 <= TARGET_FIRST_MS,
        "added_seen_p50_clearly_above_target": [
            result.id for result in results if result.added_seen_p50_ci[0] > TARGET_SEEN_MS
        ],
        "added_first_p50_clearly_above_target": [
            result.id for result in results if result.added_first_p50_ci[0] > TARGET_FIRST_MS
        ],
        "decide_p50_max_ms": max(result.decide.p50 for result in results),
        "decide_p50_median_ms": statistics.median(result.decide.p50 for result in results),
        "paired_seen_p50_max_ms": max(result.paired_seen_p50 for result in results),
        "paired_first_p50_max_ms": max(result.paired_first_p50 for result in results),
        "trail_cost_p50_median_ms": statistics.median(result.trail_cost_p50 for result in results),
        "trail_cost_p50_max_ms": max(result.trail_cost_p50 for result in results),
        "trail_cost_p50_clearly_positive": [result.id for result in results if result.trail_cost_p50_ci[0] > 0],
    }
    servers = [(result.id, result.server) for result in results if result.server is not None]
    if servers:
        worst = max(servers, key=lambda item: item[1].outside_added_seen)
        worst_first_outside = max(servers, key=lambda item: item[1].outside_added_first)
        summary |= {
            "outside_added_seen_p50_max_ms": worst[1].outside_added_seen,
            "outside_added_seen_p50_max_query": worst[0],
            "outside_added_seen_p50_median_ms": statistics.median(s.outside_added_seen for _, s in servers),
            "outside_added_first_p50_max_ms": worst_first_outside[1].outside_added_first,
            "outside_added_first_p50_max_query": worst_first_outside[0],
            "outside_added_first_p50_median_ms": statistics.median(s.outside_added_first for _, s in servers),
            "outside_seen_passed": worst[1].outside_added_seen <= TARGET_SEEN_MS,
            "outside_first_passed": worst_first_outside[1].outside_added_first <= TARGET_FIRST_MS,
            "outside_trail_cost_p50_median_ms": statistics.median(s.outside_trail_cost for _, s in servers),
        }
    return summary


def _print_report(results: list[QueryResult], summary: dict[str, Any], machine_cpu_pct: float, elapsed: float) -> None:
    width = 40
    print()
    print(
        f"{'':<4} {'':<{width}} {'direct ms':>13}  {'proxy, seen ms':>13}  {'added, seen ms':>13}  "
        f"{'first sight':>11}  {'decide()':>8}"
    )
    print(
        f"{'id':<4} {'query':<{width}} {'p50':>6} {'p99':>6}  {'p50':>6} {'p99':>6}  {'p50':>6} {'p99':>6}  "
        f"{'added p50':>11}  {'p50 ms':>8}"
    )
    for r in results:
        print(
            f"{r.id:<4} {_short(r.sql, width):<{width}} {r.direct.p50:6.2f} {r.direct.p99:6.2f}  "
            f"{r.proxy.p50:6.2f} {r.proxy.p99:6.2f}  {r.added_seen_p50:+6.2f} {r.added_seen_p99:+6.2f}  "
            f"{r.added_first_p50:+11.2f}  {r.decide.p50:8.2f}"
        )
    print()
    print("where the added p50 goes: PostgreSQL's own duration per backend (log_duration), and the rest")
    print(f"{'':<4} {'added, seen p50 ms':>22}  {'PostgreSQL p50 ms':>26}  {'added outside PostgreSQL':>24}")
    print(
        f"{'id':<4} {'p50':>6} {'95% CI':>15}  {'direct':>8} {'service':>8} {'diff':>8}  {'seen p50':>11} "
        f"{'first p50':>12}"
    )
    for r in results:
        low, high = r.added_seen_p50_ci
        s = r.server
        server = (
            f"{s.direct:8.2f} {s.proxy:8.2f} {s.proxy - s.direct:+8.2f}  {s.outside_added_seen:+11.2f} "
            f"{s.outside_added_first:+12.2f}"
            if s is not None
            else f"{'-':>8} {'-':>8} {'-':>8}  {'-':>11} {'-':>12}"
        )
        print(f"{r.id:<4} {r.added_seen_p50:+6.2f} {f'[{low:+.2f},{high:+.2f}]':>15}  {server}")
    print()
    print("the audit trail's cost: seen statements through the proxy with the trail on and the one with it off")
    print(f"{'id':<4} {'on p50':>8} {'off p50':>8} {'on - off':>9} {'95% CI':>15} {'outside PostgreSQL':>19}")
    for r in results:
        low, high = r.trail_cost_p50_ci
        outside = f"{r.server.outside_trail_cost:+19.2f}" if r.server is not None else f"{'-':>19}"
        print(f"{r.id:<4} {r.proxy.p50:8.2f} {r.off.p50:8.2f} {r.trail_cost_p50:+9.2f} "
              f"{f'[{low:+.2f},{high:+.2f}]':>15} {outside}")
    print()
    print(f"measured in {elapsed:.0f} s; machine CPU busy {machine_cpu_pct:.0f}% (all cores, everything running)")
    print("added = a percentile of the proxy series - the same percentile of the direct series (nearest rank)")
    print(
        f"added latency, seen statement:  max p50 {summary['added_seen_p50_max_ms']:+.2f} ms "
        f"({summary['added_seen_p50_max_query']}), median over queries {summary['added_seen_p50_median_ms']:+.2f} ms"
        f"  target <= {TARGET_SEEN_MS:g} ms: {'PASS' if summary['seen_passed'] else 'MISS'}"
    )
    print(
        f"added latency, first sight:     max p50 {summary['added_first_p50_max_ms']:+.2f} ms "
        f"({summary['added_first_p50_max_query']}), median over queries "
        f"{summary['added_first_p50_median_ms']:+.2f} ms  target <= {TARGET_FIRST_MS:g} ms: "
        f"{'PASS' if summary['first_passed'] else 'MISS'}"
    )
    for key, target in (("seen", TARGET_SEEN_MS), ("first", TARGET_FIRST_MS)):
        clearly = summary[f"added_{key}_p50_clearly_above_target"]
        print(
            f"  {key + ':':<7} queries whose whole 95% interval is above {target:g} ms: "
            f"{', '.join(clearly) if clearly else 'none'}"
        )
    if "outside_added_seen_p50_max_ms" in summary:
        print(
            f"added outside PostgreSQL:       seen max p50 {summary['outside_added_seen_p50_max_ms']:+.2f} ms "
            f"({summary['outside_added_seen_p50_max_query']}), median {summary['outside_added_seen_p50_median_ms']:+.2f}"
            f" ms  (<= {TARGET_SEEN_MS:g} ms: {'yes' if summary['outside_seen_passed'] else 'no'})"
        )
        print(
            f"                                first sight max p50 {summary['outside_added_first_p50_max_ms']:+.2f} ms "
            f"({summary['outside_added_first_p50_max_query']}), median "
            f"{summary['outside_added_first_p50_median_ms']:+.2f} ms  (<= {TARGET_FIRST_MS:g} ms: "
            f"{'yes' if summary['outside_first_passed'] else 'no'})"
        )
    print(
        f"decide() alone, in-process:     max p50 {summary['decide_p50_max_ms']:.2f} ms, "
        f"median over queries {summary['decide_p50_median_ms']:.2f} ms"
    )
    print(
        f"proxy CPU per statement (own phase, supervisor + worker): seen "
        f"{summary['proxy_cpu_seen_ms_per_statement']:.2f} ms, first sight "
        f"{summary['proxy_cpu_first_ms_per_statement']:.2f} ms; seen with the audit trail off "
        f"{summary['proxy_cpu_seen_trail_off_ms_per_statement']:.2f} ms"
    )
    clearly = summary["trail_cost_p50_clearly_positive"]
    print(
        f"audit trail cost, seen p50 (on - off): median over queries {summary['trail_cost_p50_median_ms']:+.2f} ms, "
        f"max {summary['trail_cost_p50_max_ms']:+.2f} ms; queries whose whole 95% interval is above 0: "
        f"{', '.join(clearly) if clearly else 'none'}"
        + (f"; outside PostgreSQL median {summary['outside_trail_cost_p50_median_ms']:+.2f} ms"
           if "outside_trail_cost_p50_median_ms" in summary else "")
        + f"; rows in anonproxy.audit_trail at the end: {summary['audit_trail_rows_written']}"
    )
    print(
        f"cross-check, median of paired differences (same repetition): seen max "
        f"{summary['paired_seen_p50_max_ms']:+.2f} ms, first sight max {summary['paired_first_p50_max_ms']:+.2f} ms"
    )


def _short(sql: str, width: int) -> str:
    text = re.sub(r"^SELECT ", "", re.sub(r"\s+", " ", sql))
    text = text.replace(" FROM adult", "").replace("count(*)", "n")
    return text if len(text) <= width else text[: width - 1] + "…"


def _load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def _machine(admin: psycopg.Connection[Any]) -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return {
        "cpu": model[1] if model else platform.machine(),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "postgresql": admin.info.parameter_status("server_version"),
        "psycopg": f"{psycopg.__version__} ({psycopg.pq.__impl__})",
        "sqlglot": package_version("sqlglot"),
        "uvloop": package_version("uvloop"),
        "load_average_before": _load_average(),
        "anonproxy_code": _code_version(),
    }


def _code_version() -> str | None:
    """The commit of the working tree, with "+changes" when anonproxy/ differs from it."""
    repo = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "anonproxy"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + (" +changes" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())
