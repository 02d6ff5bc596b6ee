#!/usr/bin/env python3
"""Does one hostile statement stall a worker? ``select 1`` latency of an idle dba while a reporter sends long ones.

A throwaway PostgreSQL set up like ``anonproxy up`` (adult table, demo roles,
service role, demo policy) and ``anonproxy serve`` with one worker, so the dba
(direct mode) and the reporter (suppress mode) share its event loop. For each
statement size, the reporter sends an aggregate with an IN list of that size,
``--rounds`` times, while the dba runs ``select 1`` in a loop; the worker's
resident memory (VmRSS, /proc) is sampled meanwhile. Prints, per size, the
reporter's outcome, the dba's p50/p99/max latency and the worker's memory
growth, then the targets: p99 <= 50 ms and growth <= 50 MB. See README.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import psycopg

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # this checkout's anonproxy sets the database up, whatever else is installed

from anonproxy import demo, sample_data, schema  # noqa: E402
from anonproxy.embedded import EmbeddedPostgres  # noqa: E402
from anonproxy.policy.yaml_policy import apply_policy, demo_policy  # noqa: E402

HOST = "127.0.0.1"
DATABASE = "postgres"  # as `anonproxy up`
TARGET_P99_MS = 50.0
TARGET_GROWTH_MB = 50.0
SIZES = {"256kB": 256_000, "1MB": 1 << 20, "10MB": 10 << 20}  # 256 kB: just under the default limit, analysed
SAMPLE_INTERVAL = 0.02  # seconds between memory samples


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through the ExitStack: servers stop
    try:
        report = run(args)
    except (RuntimeError, psycopg.Error) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"statement sizes, of {', '.join(SIZES)}")
    parser.add_argument("--rounds", type=int, default=3, help="statements of each size the reporter sends (3)")
    parser.add_argument("--wait", type=float, default=150.0,
                        help="seconds to wait for the reporter's answer before giving up on it (150)")
    parser.add_argument("--source", type=Path, default=REPO,
                        help="the checkout whose anonproxy package the proxy runs (default: this one)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [size.strip() for size in args.sizes.split(",")]
    unknown = [size for size in sizes if size not in SIZES]
    if unknown:
        raise RuntimeError(f"unknown sizes {unknown}; known: {', '.join(SIZES)}")
    report: dict[str, Any] = {"source": str(args.source), "rounds": args.rounds, "sizes": {}}
    with ExitStack() as stack:
        _progress("starting PostgreSQL")
        server = stack.enter_context(EmbeddedPostgres())
        service_dsn = _prepare_database(server)
        proxy, port = stack.enter_context(_proxy(server.port, service_dsn, args.source))
        dba = stack.enter_context(_connect(port, "dba"))
        reporter = stack.enter_context(_connect(port, "reporter"))
        reporter.execute("select sex, count(*) from adult group by sex").fetchall()  # the gate works
        idle = [_timed(dba) for _ in range(500)]
        report["idle"] = _summary(idle)
        _progress(f"idle dba: p50 {report['idle']['p50_ms']:.2f} ms, p99 {report['idle']['p99_ms']:.2f} ms")
        for size in sizes:
            statement = _statement(SIZES[size])
            figures = _under_attack(proxy, port, dba, statement, args.rounds, args.wait)
            report["sizes"][size] = figures
            _progress(f"{size}: reporter {figures['reporter']}; dba {figures['dba']['count']} answers, "
                      f"p50 {figures['dba']['p50_ms']:.2f} ms, p99 {figures['dba']['p99_ms']:.2f} ms, "
                      f"max {figures['dba']['max_ms']:.1f} ms; worker memory +{figures['worker_growth_mb']:.1f} MB "
                      f"(analysis process peak {figures['analysis_peak_mb']:.0f} MB)")
    _print(report)
    return report


def _prepare_database(server: EmbeddedPostgres) -> str:
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
def _proxy(upstream_port: int, service_dsn: str, source: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    with _free_socket() as port:
        pass  # free now; the proxy binds it next
    env = {**os.environ, "PYTHONPATH": str(source), "ANONPROXY_LISTEN_PORT": str(port), "ANONPROXY_WORKERS": "1",
           "ANONPROXY_UPSTREAM": f"host={HOST} port={upstream_port}", "ANONPROXY_SERVICE_DSN": service_dsn,
           "ANONPROXY_LOG_LEVEL": "warning"}
    process = subprocess.Popen([sys.executable, "-m", "anonproxy.cli", "serve"], env=env, cwd=source)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                psycopg.connect(f"host={HOST} port={port} dbname={DATABASE} user=dba password=dba").close()
                break
            except psycopg.OperationalError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("anonproxy did not start") from None
                time.sleep(0.1)
        yield process, port
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def _free_socket() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        yield sock.getsockname()[1]


@contextmanager
def _connect(port: int, user: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(f"host={HOST} port={port} dbname={DATABASE} user={user} password={user}",
                         autocommit=True) as conn:
        yield conn


def _statement(size: int) -> str:
    """A suppress-mode aggregate with an IN list: ``size`` bytes of text in all."""
    head, tail = "select sex, count(*) from adult where age in (", ") group by sex"
    values: list[str] = []
    length = len(head) + len(tail)
    number = 0
    while length + 4 < size:
        value = str(17 + number % 70)
        values.append(value)
        length += len(value) + 1
        number += 1
    return head + ",".join(values) + tail


def _timed(conn: psycopg.Connection[Any]) -> float:
    start = time.perf_counter()
    row = conn.execute("select 1", prepare=False).fetchone()
    elapsed = (time.perf_counter() - start) * 1000
    if row != (1,):
        raise RuntimeError(f"select 1 answered {row!r}")
    return elapsed


def _under_attack(proxy: subprocess.Popen[bytes], port: int, dba: psycopg.Connection[Any], statement: str,
                  rounds: int, wait: float) -> dict[str, Any]:
    # The reporter is a process of its own: building and sending megabytes in a thread of this one would hold
    # the GIL and show up as the dba's latency.
    context = multiprocessing.get_context("fork")
    outcomes = context.Queue()
    sampler = _MemorySampler(proxy.pid)
    sampler.start()
    before = sampler.worker_rss
    reporter = context.Process(target=_attack, args=(port, statement, rounds, outcomes), daemon=True)
    reporter.start()
    latencies: list[float] = []
    deadline = time.monotonic() + wait * rounds
    while reporter.is_alive() and time.monotonic() < deadline:
        latencies.append(_timed(dba))
    finished = not reporter.is_alive()
    sampler.stop()
    results = []
    while not outcomes.empty():
        results.append(outcomes.get())
    if not finished:
        reporter.kill()
        results.append(f"no answer in {wait * rounds:.0f} s")
    reporter.join()
    return {"reporter": ", ".join(results), "dba": _summary(latencies), "finished": finished,
            "worker_rss_before_mb": before / 2**20, "worker_peak_mb": sampler.worker_peak / 2**20,
            "worker_growth_mb": (sampler.worker_peak - before) / 2**20,
            "analysis_peak_mb": sampler.children_peak / 2**20}


def _attack(port: int, statement: str, rounds: int, outcomes: Any) -> None:
    """The reporter: ``rounds`` statements, each a new text (a comment numbers it), so each is analysed."""
    with _connect(port, "reporter") as conn:
        for round_ in range(rounds):
            start = time.perf_counter()
            try:
                conn.execute(f"/* round {round_} */ {statement}", prepare=False).fetchall()
                outcome = "answered"
            except psycopg.Error as exc:
                outcome = exc.sqlstate or type(exc).__name__
            outcomes.put(f"{outcome} in {time.perf_counter() - start:.2f} s")


class _MemorySampler(threading.Thread):
    """Peak VmRSS of the worker process and (together) of its child processes, sampled."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self._pid = pid
        self._stop_event = threading.Event()
        self.worker_rss = _rss(pid)
        self.worker_peak = self.worker_rss
        self.children_peak = 0

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.worker_peak = max(self.worker_peak, _rss(self._pid))
            self.children_peak = max(self.children_peak, sum(_rss(child) for child in _children(self._pid)))
            time.sleep(SAMPLE_INTERVAL)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass  # the process just ended
    return 0


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc/*/stat: the field after the parenthesised name)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies) or [float("nan")]

    def rank(q: float) -> float:  # nearest rank
        return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]

    return {"count": len(latencies), "p50_ms": rank(0.50), "p99_ms": rank(0.99), "max_ms": ordered[-1]}


def _print(report: dict[str, Any]) -> None:
    print()
    print(f"{'size':>6}  {'dba answers':>11}  {'p50 ms':>8}  {'p99 ms':>8}  {'max ms':>9}  {'worker +MB':>10}  "
          f"{'analysis MB':>11}  reporter")
    for size, figures in report["sizes"].items():
        dba = figures["dba"]
        print(f"{size:>6}  {dba['count']:>11}  {dba['p50_ms']:>8.2f}  {dba['p99_ms']:>8.2f}  {dba['max_ms']:>9.1f}  "
              f"{figures['worker_growth_mb']:>10.1f}  {figures['analysis_peak_mb']:>11.0f}  {figures['reporter']}")
    worst_p99 = max(figures["dba"]["p99_ms"] for figures in report["sizes"].values())
    worst_growth = max(figures["worker_growth_mb"] for figures in report["sizes"].values())
    unfinished = [size for size, figures in report["sizes"].items() if not figures["finished"]]
    print(f"\ntarget p99 <= {TARGET_P99_MS:g} ms: worst {worst_p99:.2f} ms "
          f"{'PASS' if worst_p99 <= TARGET_P99_MS and not unfinished else 'FAIL'}")
    print(f"target worker growth <= {TARGET_GROWTH_MB:g} MB: worst {worst_growth:.1f} MB "
          f"{'PASS' if worst_growth <= TARGET_GROWTH_MB else 'FAIL'}")
    if unfinished:
        print(f"the reporter got no answer within --wait for: {', '.join(unfinished)}")


def _progress(message: str) -> None:
    print(f"[hostile] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
