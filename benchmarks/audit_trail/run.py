#!/usr/bin/env python3
"""What does the synchronous audit trail cost? Seen suppress statements and a 200-client mixed load, side by side.

A throwaway PostgreSQL set up like ``anonproxy up`` (adult table, demo roles, service role, demo policy) and up
to three ``anonproxy serve`` in front of it: this checkout with the trail on, the same with the trail off, and,
with ``--baseline DIR``, another checkout (e.g. a worktree of the commit before the synchronous trail, whose trail
was written asynchronously) with the trail on.

1. Latency: one reporter session per proxy runs the same eight seen suppress statements, the proxies taking
   turns statement by statement (so the machine's load falls on all alike); p50 and p90 per proxy.
2. Load: ``--clients`` sessions (a third each dba, reporter, analyst) run statements in a loop for
   ``--seconds`` on one proxy, then on the next, ``--rounds`` times in turn; statements per second and p50/p99
   per role, and, for the trail-on proxies, the rows the trail holds against the statements answered.
See README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # this checkout's anonproxy sets the database up, whatever else is installed

from anonproxy import demo, sample_data, schema  # noqa: E402
from anonproxy.embedded import EmbeddedPostgres  # noqa: E402
from anonproxy.policy.yaml_policy import apply_policy, demo_policy  # noqa: E402

HOST = "127.0.0.1"
DATABASE = "postgres"
SUPPRESS = [f"select education, count(*), avg(hours_per_week) from adult where age > {n} group by 1"
            for n in (20, 25, 30, 35, 40, 45, 50, 55)]
DIRECT = "select count(*) from adult where age > {n}"
DP = "select sex, count(*) from adult group by 1"  # one question, answered from the cache after the first
ROLES = ("dba", "reporter", "analyst")


@dataclass(frozen=True)
class Proxy:
    name: str
    source: Path
    trail: bool
    port: int
    pid: int


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, help="another checkout to run with the trail on, for comparison")
    parser.add_argument("--repeats", type=int, default=60, help="runs of each seen statement per proxy (part 1)")
    parser.add_argument("--clients", type=int, default=200, help="sessions of the mixed load (part 2)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of one load run")
    parser.add_argument("--rounds", type=int, default=2, help="load runs per proxy, in turn")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    report = run(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"latency": {}, "load": {}}
    with ExitStack() as stack:
        progress("starting PostgreSQL")
        server = stack.enter_context(EmbeddedPostgres(settings={"max_connections": str(args.clients * 2 + 100)}))
        service_dsn = prepare_database(server)
        owner = stack.enter_context(psycopg.connect(server.conninfo(dbname=DATABASE), autocommit=True))
        sources = [("trail on", REPO, True), ("trail off", REPO, False)]
        if args.baseline is not None:
            sources.append(("baseline, trail on", args.baseline.resolve(), True))
        proxies = [stack.enter_context(start_proxy(name, source, trail, server.port, service_dsn))
                   for name, source, trail in sources]
        report["latency"] = _latency(proxies, args.repeats)
        for proxy in proxies:
            report["load"][proxy.name] = []
        for _ in range(args.rounds):
            for proxy in proxies:
                figures = _load(proxy, owner, args.clients, args.seconds)
                report["load"][proxy.name].append(figures)
                progress(f"{proxy.name}: {figures['per_second']:.0f} statements/s, "
                          + ", ".join(f"{role} p99 {figures[role]['p99_ms']:.0f} ms" for role in ROLES))
    _print(report)
    return report


def _latency(proxies: list[Proxy], repeats: int) -> dict[str, dict[str, float]]:
    times: dict[str, list[float]] = {proxy.name: [] for proxy in proxies}
    with ExitStack() as stack:
        conns = {proxy.name: stack.enter_context(connect(proxy.port, "reporter")) for proxy in proxies}
        for conn in conns.values():
            for statement in SUPPRESS:
                conn.execute(statement).fetchall()  # seen from now on
        for repeat in range(repeats):
            for i, statement in enumerate(SUPPRESS):
                turn = (repeat + i) % len(proxies)
                for proxy in proxies[turn:] + proxies[:turn]:
                    start = time.perf_counter()
                    conns[proxy.name].execute(statement).fetchall()
                    times[proxy.name].append((time.perf_counter() - start) * 1000)
    return {name: {"p50_ms": rank(values, 0.5), "p90_ms": rank(values, 0.9), "count": len(values)}
            for name, values in times.items()}


def _load(proxy: Proxy, owner: psycopg.Connection[Any], clients: int, seconds: float) -> dict[str, Any]:
    latencies: dict[str, list[float]] = {role: [] for role in ROLES}
    errors: list[str] = []
    stop = threading.Event()
    started = threading.Barrier(clients + 1)
    since = owner.execute("select now()").fetchone()[0]

    def client(number: int) -> None:
        role = ROLES[number % 3]
        try:
            conn = open_session(proxy.port, role)
        except psycopg.Error as exc:
            errors.append(str(exc).strip())
            started.wait()
            return
        with conn:
            started.wait()
            n = number
            while not stop.is_set():
                n += 1
                text = DIRECT.format(n=n % 60 + 17) if role == "dba" else SUPPRESS[n % 8] if role == "reporter" \
                    else DP
                begin = time.perf_counter()
                try:
                    conn.execute(text).fetchall()
                except psycopg.Error as exc:
                    errors.append(str(exc).strip())
                    continue
                latencies[role].append((time.perf_counter() - begin) * 1000)

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
    for thread in threads:
        thread.start()
    started.wait()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(60)
    answered = sum(len(values) for role, values in latencies.items() if role != "dba")
    figures: dict[str, Any] = {"per_second": sum(len(v) for v in latencies.values()) / seconds,
                               "errors": len(errors), "first_error": errors[0] if errors else None,
                               "gated_answered": answered}
    for role, values in latencies.items():
        figures[role] = {"count": len(values), "p50_ms": rank(values, 0.5), "p99_ms": rank(values, 0.99)}
    if proxy.trail:
        time.sleep(2.0)  # an asynchronous trail writes within a second
        figures["trail_rows"] = owner.execute(
            "select count(*) from anonproxy.audit_trail where at >= %s and login in ('reporter', 'analyst') "
            "and decision = 'answered'", [since]).fetchone()[0]
    return figures


def prepare_database(server: EmbeddedPostgres) -> str:
    """As `anonproxy up` does; returns the service login's DSN."""
    policy = demo_policy()
    with psycopg.connect(server.conninfo(dbname=DATABASE)) as conn:
        schema.install(conn)
        sample_data.load_demo(conn)
        demo.create_demo_roles(conn, DATABASE)
        password = demo.reset_service_role(conn, policy.service_role)
        apply_policy(conn, policy)
        conn.commit()
    return psycopg.conninfo.make_conninfo(user=policy.service_role, password=password, dbname=DATABASE)


@contextmanager
def start_proxy(name: str, source: Path, trail: bool, upstream_port: int, service_dsn: str,
                workers: int | None = None) -> Iterator[Proxy]:
    """``anonproxy serve`` from ``source`` (default workers; 1: it serves in its own process), until it has loaded
    the policy; a Proxy whose ``pid`` is its process."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]
    env = {key: value for key, value in os.environ.items() if not key.startswith("ANONPROXY_")}
    env |= {"PYTHONPATH": str(source), "ANONPROXY_LISTEN_PORT": str(port),
            "ANONPROXY_UPSTREAM": f"host={HOST} port={upstream_port}", "ANONPROXY_SERVICE_DSN": service_dsn,
            "ANONPROXY_LOG_LEVEL": "warning", "ANONPROXY_AUDIT_TRAIL": "on" if trail else "off"}
    if workers is not None:
        env["ANONPROXY_WORKERS"] = str(workers)
    process = subprocess.Popen([sys.executable, "-m", "anonproxy.cli", "serve"], env=env, cwd=source)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with connect(port, "reporter") as conn:
                    conn.execute("select sex, count(*) from adult group by 1").fetchall()  # the policy is loaded
                break
            except psycopg.OperationalError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"anonproxy ({name}) did not start") from None
                time.sleep(0.2)
        yield Proxy(name, source, trail, port, process.pid)
    finally:
        process.terminate()  # (a benchmark may have killed it already)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def open_session(port: int, user: str) -> psycopg.Connection[Any]:
    return psycopg.connect(f"host={HOST} port={port} dbname={DATABASE} user={user} password={user}",
                           autocommit=True, connect_timeout=60)


@contextmanager
def connect(port: int, user: str) -> Iterator[psycopg.Connection[Any]]:
    with open_session(port, user) as conn:
        yield conn


def rank(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile (NaN if there are none)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


def _print(report: dict[str, Any]) -> None:
    print("\nSeen suppress statements (one reporter session per proxy, in turn):")
    latency = report["latency"]
    for name, figures in latency.items():
        print(f"  {name:<20} p50 {figures['p50_ms']:7.2f} ms  p90 {figures['p90_ms']:7.2f} ms  ({figures['count']})")
    if "trail off" in latency:
        off = latency["trail off"]["p50_ms"]
        for name, figures in latency.items():
            if name != "trail off":
                print(f"  {name} − trail off, p50: {figures['p50_ms'] - off:+.2f} ms (target: ≤ +1 ms)")
    print("\nMixed load (medians over the rounds):")
    for name, runs in report["load"].items():
        rate = statistics.median(run["per_second"] for run in runs)
        parts = [f"{role} p50 {statistics.median(r[role]['p50_ms'] for r in runs):.0f} / p99 "
                 f"{statistics.median(r[role]['p99_ms'] for r in runs):.0f} ms" for role in ROLES]
        rows = [f"{r.get('trail_rows', '-')}/{r['gated_answered']}" for r in runs]
        print(f"  {name:<20} {rate:6.0f} statements/s; {'; '.join(parts)}; trail rows/answered {', '.join(rows)}; "
              f"errors {sum(r['errors'] for r in runs)}")


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
