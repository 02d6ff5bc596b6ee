#!/usr/bin/env python3
"""Can clients fill a worker's memory? The worker's RSS and an idle dba's ``select 1`` latency under two attacks.

Same set-up as run.py (a throwaway PostgreSQL like ``anonproxy up``, ``anonproxy
serve`` with one worker and default settings). Attacks, each in a process of
its own while the dba (direct mode, same worker) runs ``select 1`` in a loop:

* ``cursors``: a reporter (suppress mode) declares cursors WITH HOLD over an
  answer with a 200 kB text column, one after the other, and keeps them;
* ``cursors-many``: the same with 100 kB in a smaller answer, 20 cursors;
* ``unread``: ten reporters send a query whose answer is 45 MB and do not read
  it for ``--hold`` seconds; then they read it and check it is whole;
* ``unread-direct``: the same with ten dba sessions (relayed);
* ``pipelined``: a reporter pipelines 600 statements with a 200 kB literal
  (kept in their rewrites) and reads no answer for ``--hold`` seconds; then
  it reads them all.

Prints, per attack, what the attacker got, the dba's p50/p99/max and the
worker's peak VmRSS growth, then the targets: p99 at most 100 ms above the idle
p99, growth at most 50 MB. See README.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import select
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg
from psycopg import pq
from run import (  # the set-up, the dba's timing and the memory sampler of run.py (which puts REPO on the path)
    REPO,
    _connect,
    _MemorySampler,
    _prepare_database,
    _progress,
    _proxy,
    _summary,
    _timed,
)

from anonproxy.embedded import EmbeddedPostgres

TARGET_ADDED_P99_MS = 100.0
TARGET_GROWTH_MB = 50.0
SESSIONS = 10  # clients that do not read
DIRECT_QUERY = "select i, repeat('x', 100000) as pad, 1 from generate_series(1, 450) as i"


def _aggregate(pad: int, keys: str) -> str:
    """A suppressed aggregate whose rows each carry ``pad`` bytes of text."""
    return f"select {keys}, '{'x' * pad}' as pad, count(*) from adult group by {keys}"


def _cursors(port: int, pad: int, keys: str, count: int, hold: float, outcomes: Any) -> None:
    """One reporter declares ``count`` cursors WITH HOLD, keeps them ``hold`` seconds."""
    declared, refused = 0, []
    with _connect(port, "reporter") as conn:
        for number in range(count):
            try:
                conn.execute(f"declare c{number} cursor with hold for {_aggregate(pad, keys)}")
                declared += 1
            except psycopg.Error as exc:
                refused.append(exc.sqlstate)
        time.sleep(hold)
    outcomes.put(f"{declared} declared, {len(refused)} refused ({', '.join(sorted(set(filter(None, refused))))})")


def _unread(port: int, user: str, sql: str, hold: float, outcomes: Any) -> None:
    """SESSIONS clients send ``sql`` and read nothing for ``hold`` seconds; then they read their answers."""
    sessions = []
    for _ in range(SESSIONS):
        conn = psycopg.connect(f"host=127.0.0.1 port={port} dbname=postgres user={user} password={user}",
                               autocommit=True)
        conn.pgconn.send_query(sql.encode())
        while conn.pgconn.flush():
            time.sleep(0.01)
        sessions.append(conn)
    time.sleep(hold)
    sizes = []
    for conn in sessions:
        size = 0
        while (result := conn.pgconn.get_result()) is not None:
            size += sum(len(result.get_value(row, result.nfields - 2) or b"") for row in range(result.ntuples))
        sizes.append(size)
        conn.close()
    outcomes.put(f"{SESSIONS} sessions, each read {min(sizes) / 2**20:.0f} to {max(sizes) / 2**20:.0f} MB at the end")


def _pipelined(port: int, count: int, hold: float, outcomes: Any) -> None:
    """One reporter pipelines ``count`` statements (200 kB each, and 200 kB of answer) and reads nothing for
    ``hold`` seconds, sending all the proxy takes; then it reads every answer."""
    sql = f"select '{'x' * 200_000}' as pad, count(*) from adult".encode()
    with _connect(port, "reporter") as conn:
        pgconn = conn.pgconn
        pgconn.nonblocking = 1
        pgconn.enter_pipeline_mode()
        for _ in range(count):
            pgconn.send_query_params(sql, None)
        pgconn.pipeline_sync()
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline:
            pgconn.flush()
            time.sleep(0.05)
        answers = 0
        while True:
            pgconn.flush()
            select.select([pgconn.socket], [], [], 1)
            pgconn.consume_input()
            while not pgconn.is_busy():
                result = pgconn.get_result()
                if result is None:
                    continue
                if result.status == pq.ExecStatus.PIPELINE_SYNC:
                    pgconn.exit_pipeline_mode()
                    outcomes.put(f"{answers} of {count} answers read at the end")
                    return
                answers += result.status == pq.ExecStatus.TUPLES_OK


ATTACKS: dict[str, Callable[[int, float], tuple[Callable[..., None], tuple[Any, ...]]]] = {
    "cursors": lambda port, hold: (_cursors, (port, 200_000, "age, sex", 6, hold)),
    "cursors-many": lambda port, hold: (_cursors, (port, 100_000, "education, sex", 20, hold)),
    "unread": lambda port, hold: (_unread, (port, "reporter", _aggregate(100_000, "education, age"), hold)),
    "unread-direct": lambda port, hold: (_unread, (port, "dba", DIRECT_QUERY, hold)),
    "pipelined": lambda port, hold: (_pipelined, (port, 600, hold)),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default=",".join(ATTACKS), help=f"of {', '.join(ATTACKS)}")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds the attackers hold what they have (10)")
    parser.add_argument("--source", type=Path, default=REPO,
                        help="the checkout whose anonproxy package the proxy runs (default: this one)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    attacks = [attack.strip() for attack in args.attacks.split(",")]
    unknown = [attack for attack in attacks if attack not in ATTACKS]
    if unknown:
        parser.error(f"unknown attacks {unknown}")
    report: dict[str, Any] = {"source": str(args.source), "attacks": {}}
    with ExitStack() as stack:
        _progress("starting PostgreSQL")
        server = stack.enter_context(EmbeddedPostgres())
        service_dsn = _prepare_database(server)
        proxy, port = stack.enter_context(_proxy(server.port, service_dsn, args.source))
        dba = stack.enter_context(_connect(port, "dba"))
        with _connect(port, "reporter") as reporter:
            reporter.execute("select sex, count(*) from adult group by sex").fetchall()  # the gate works
        report["idle"] = _summary([_timed(dba) for _ in range(500)])
        _progress(f"idle dba: p50 {report['idle']['p50_ms']:.2f} ms, p99 {report['idle']['p99_ms']:.2f} ms")
        for attack in attacks:
            target, attack_args = ATTACKS[attack](port, args.hold)
            figures = _under_attack(proxy.pid, dba, target, attack_args)
            report["attacks"][attack] = figures
            _progress(f"{attack}: {figures['attacker']}; dba p99 {figures['dba']['p99_ms']:.2f} ms; "
                      f"worker +{figures['worker_growth_mb']:.1f} MB")
    _print(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _under_attack(pid: int, dba: psycopg.Connection[Any], target: Callable[..., None],
                  attack_args: tuple[Any, ...]) -> dict[str, Any]:
    context = multiprocessing.get_context("fork")
    outcomes = context.Queue()
    sampler = _MemorySampler(pid)
    sampler.start()
    before = sampler.worker_rss
    attacker = context.Process(target=target, args=(*attack_args, outcomes), daemon=True)
    attacker.start()
    latencies: list[float] = []
    while attacker.is_alive():
        latencies.append(_timed(dba))
    sampler.stop()
    attacker.join()
    outcome = outcomes.get() if not outcomes.empty() else f"failed (exit code {attacker.exitcode})"
    return {"attacker": outcome, "dba": _summary(latencies), "worker_rss_before_mb": before / 2**20,
            "worker_growth_mb": (sampler.worker_peak - before) / 2**20}


def _print(report: dict[str, Any]) -> None:
    idle = report["idle"]["p99_ms"]
    print(f"\nidle dba p99 {idle:.2f} ms\n")
    print(f"{'attack':>14}  {'dba answers':>11}  {'p50 ms':>8}  {'p99 ms':>8}  {'max ms':>9}  {'worker +MB':>10}  "
          "attacker")
    for attack, figures in report["attacks"].items():
        dba = figures["dba"]
        print(f"{attack:>14}  {dba['count']:>11}  {dba['p50_ms']:>8.2f}  {dba['p99_ms']:>8.2f}  {dba['max_ms']:>9.1f}  "
              f"{figures['worker_growth_mb']:>10.1f}  {figures['attacker']}")
    worst_p99 = max(figures["dba"]["p99_ms"] for figures in report["attacks"].values())
    worst_growth = max(figures["worker_growth_mb"] for figures in report["attacks"].values())
    print(f"\ntarget p99 <= idle + {TARGET_ADDED_P99_MS:g} ms: worst {worst_p99:.2f} ms "
          f"{'PASS' if worst_p99 <= idle + TARGET_ADDED_P99_MS else 'FAIL'}")
    print(f"target worker growth <= {TARGET_GROWTH_MB:g} MB: worst {worst_growth:.1f} MB "
          f"{'PASS' if worst_growth <= TARGET_GROWTH_MB else 'FAIL'}")


if __name__ == "__main__":
    sys.exit(main())
