#!/usr/bin/env python3
"""What does TLS to PostgreSQL cost the proxy? The same proxy with sslmode=disable and sslmode=verify-full, side by
side in one run.

PostgreSQL (ssl = on, certificates made here) runs in a network namespace reached over a veth pair, as in
tests/test_upstream_tls.py; two ``anonproxy serve`` (one worker each) in front of it, one upstream in plaintext,
one in TLS with verification and a client certificate. The proxies take turns statement by statement, so that the
machine's load falls on both alike; p50 and p90 per proxy of:

- a relayed ``select 1`` (dba), and a relayed 5 000-row answer (dba);
- a seen suppress statement (reporter: its rewrite runs on a pooled service connection);
- a login (dba: a new upstream connection, with its TLS handshake, per login).

Run as root; everything made here is removed at exit. See README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import psycopg

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the namespace and certificates of the tests

from netns import hosts  # noqa: E402
from tls_network import certificates

from anonproxy import demo
from anonproxy.embedded import EmbeddedPostgres

DATABASE = "postgres"
SERVICE = "anonproxy_service"
NET = 202  # the server's LAN: 10.202.0.0/24 (tests/test_upstream_tls.py uses 10.201)
SUPPRESS = "select education, count(*), avg(hours_per_week) from adult where age > 30 group by 1"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=300, help="runs of each measurement per proxy")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    report = run(args.repeats)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def run(repeats: int) -> dict[str, Any]:
    with ExitStack() as stack:
        (space,) = stack.enter_context(hosts(NET, 1))
        certs = stack.enter_context(certificates(["db.anonproxy.test"], [space.inside], SERVICE))
        settings = {"ssl": "on", "ssl_cert_file": str(certs.server_cert), "ssl_key_file": str(certs.server_key)}
        server = stack.enter_context(EmbeddedPostgres(hba_extra=[f"host all all {space.network} scram-sha-256"],
                                                      settings=settings, host=space.inside, wrapper=space.command()))
        print(f"PostgreSQL at {space.inside}:{server.port} in namespace {space.namespace}", file=sys.stderr)
        _prepare(server)
        base = f"host={space.inside} port={server.port}"
        upstreams = {"plain": f"{base} sslmode=disable",
                     "tls": f"{base} sslmode=verify-full sslrootcert={certs.ca} sslcert={certs.client_cert} "
                            f"sslkey={certs.client_key}"}
        ports = {name: stack.enter_context(_proxy(upstream)) for name, upstream in upstreams.items()}
        report = {"repeats": repeats, "figures": _measure(ports, repeats)}
    _print(report)
    return report


def _prepare(server: EmbeddedPostgres) -> None:
    with psycopg.connect(server.conninfo(dbname=DATABASE)) as conn:
        demo.install_demo_database(conn, DATABASE, SERVICE, SERVICE)


@contextmanager
def _proxy(upstream: str) -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "ANONPROXY_LISTEN_PORT": str(port), "ANONPROXY_UPSTREAM": upstream,
           "ANONPROXY_SERVICE_DSN": f"user={SERVICE} password={SERVICE} dbname={DATABASE}",
           "ANONPROXY_WORKERS": "1", "ANONPROXY_LOG_LEVEL": "warning", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-m", "anonproxy.cli", "serve"], env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("anonproxy did not start") from None
                time.sleep(0.05)
        yield port
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(20)


def _dsn(port: int, user: str) -> str:
    return f"host=127.0.0.1 port={port} dbname={DATABASE} user={user} password={user} sslmode=disable"


def _measure(ports: dict[str, int], repeats: int) -> dict[str, dict[str, dict[str, float]]]:
    with ExitStack() as stack:
        dba = {name: stack.enter_context(psycopg.connect(_dsn(port, "dba"), autocommit=True))
               for name, port in ports.items()}
        reporter = {name: stack.enter_context(psycopg.connect(_dsn(port, "reporter"), autocommit=True))
                    for name, port in ports.items()}
        cases: dict[str, dict[str, Callable[[], object]]] = {
            "relayed select 1": {name: lambda c=conn: c.execute("select 1").fetchall() for name, conn in dba.items()},
            "relayed 5000 rows": {name: lambda c=conn: c.execute("select * from adult limit 5000").fetchall()
                                  for name, conn in dba.items()},
            "gated suppress (seen)": {name: lambda c=conn: c.execute(SUPPRESS).fetchall()
                                      for name, conn in reporter.items()},
            "login (dba)": {name: lambda p=port: psycopg.connect(_dsn(p, "dba")).close()
                            for name, port in ports.items()},
        }
        figures = {}
        for case, runs in cases.items():
            for run in runs.values():  # warm up: plans, caches, pooled service connections
                for _ in range(5):
                    run()
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(repeats):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run()
                    times[name].append((time.perf_counter() - start) * 1000)
            figures[case] = {name: {"p50_ms": statistics.median(values),
                                    "p90_ms": statistics.quantiles(values, n=10)[-1]}
                             for name, values in times.items()}
        return figures


def _print(report: dict[str, Any]) -> None:
    print(f"\n{report['repeats']} runs each, proxies in turn (ms)")
    print(f"{'':24} {'plain p50':>10} {'TLS p50':>10} {'added':>8} {'plain p90':>10} {'TLS p90':>10}")
    for case, by_proxy in report["figures"].items():
        plain, tls = by_proxy["plain"], by_proxy["tls"]
        print(f"{case:24} {plain['p50_ms']:10.3f} {tls['p50_ms']:10.3f} {tls['p50_ms'] - plain['p50_ms']:+8.3f} "
              f"{plain['p90_ms']:10.3f} {tls['p90_ms']:10.3f}")


if __name__ == "__main__":
    sys.exit(main())
