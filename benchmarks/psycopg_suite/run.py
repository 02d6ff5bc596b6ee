#!/usr/bin/env python3
"""psycopg's own test suite, once directly against PostgreSQL and once through anonproxy: which tests differ.

The suite comes from a checkout of psycopg's repository given on the command line (it is not part of this
project). Both runs use the same throwaway PostgreSQL, database and login (``dba``, a direct role of the demo
policy, made superuser so that the suite's tests that need it run in both); the proxy runs with a service
login, so the role goes through the policy's decision and is relayed. See README.md.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import psycopg

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # this checkout's anonproxy, the one whose proxy runs, not an installed copy
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # driver_suite, shared with the other driver's suite

import driver_suite  # noqa: E402
from anonproxy.embedded import EmbeddedPostgres  # noqa: E402

HOST = driver_suite.HOST
DATABASE = "psycopg_suite"
ROLE = driver_suite.ROLE
# The parts of the suite that talk to a server through the protocol the proxy relays (pool, CockroachDB,
# DNS, gevent and typing checks are left out: they test nothing the proxy touches, or need what is not here).
DEFAULT_TESTS = (
    "tests/pq", "tests/test_connection.py", "tests/test_connection_async.py", "tests/test_connection_info.py",
    "tests/test_cursor.py", "tests/test_cursor_async.py", "tests/test_cursor_common.py",
    "tests/test_cursor_common_async.py", "tests/test_cursor_client.py", "tests/test_cursor_client_async.py",
    "tests/test_cursor_raw.py", "tests/test_cursor_raw_async.py", "tests/test_cursor_server.py",
    "tests/test_cursor_server_async.py", "tests/test_copy.py", "tests/test_copy_async.py",
    "tests/test_notify.py", "tests/test_notify_async.py", "tests/test_pipeline.py", "tests/test_pipeline_async.py",
    "tests/test_prepared.py", "tests/test_prepared_async.py", "tests/test_transaction.py",
    "tests/test_transaction_async.py", "tests/test_tpc.py", "tests/test_tpc_async.py",
    "tests/test_concurrency.py", "tests/test_concurrency_async.py", "tests/test_errors.py",
    "tests/test_psycopg_dbapi20.py", "tests/test_typeinfo.py", "tests/test_generators.py",
)
SERVER_SETTINGS = {"max_connections": "200", "max_prepared_transactions": "10"}  # the tpc tests need the latter


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("psycopg_source", type=Path, help="a checkout of psycopg's repository (holds tests/)")
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS),
                        help="test paths relative to the checkout (default: the protocol-facing part)")
    parser.add_argument("--workers", type=int, default=2, help="anonproxy worker processes (default 2)")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per test before it counts as failed")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, to run fewer tests")
    parser.add_argument("-m", dest="markers", default="not slow",
                        help="pytest -m expression (default: 'not slow', psycopg's own mark for its long tests)")
    parser.add_argument("--json", type=Path, help="also write both runs' outcomes here")
    parser.add_argument("--direct-json", type=Path,
                        help="take the direct run from this earlier --json output instead of running it again")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the server and the proxy are stopped
    source = args.psycopg_source.resolve()
    if not (source / "tests" / "fix_db.py").is_file():
        print(f"{source} is not a checkout of psycopg's repository (no tests/fix_db.py)", file=sys.stderr)
        return 2
    print(f"psycopg {metadata.version('psycopg')} (libpq {psycopg.pq.version()}, {psycopg.pq.__impl__}); "
          f"suite from {source} ({_describe(source)})", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-psycopg-") as tmp, \
            EmbeddedPostgres(settings=SERVER_SETTINGS) as server:
        workdir = Path(tmp)
        driver_suite.prepare(server, DATABASE)
        direct_dsn = f"host={HOST} port={server.port} dbname={DATABASE} user={ROLE} password={ROLE}"
        direct = driver_suite.load_run(args.direct_json, "direct") if args.direct_json else \
            _run_suite("direct", direct_dsn, source, args, workdir)
        proxy, port = driver_suite.start_proxy(server, DATABASE, workdir, args.workers)
        try:
            via = _run_suite("anonproxy", f"host={HOST} port={port} dbname={DATABASE} user={ROLE} password={ROLE}",
                             source, args, workdir)
        finally:
            driver_suite.stop(proxy)
        proxy_log = (workdir / "anonproxy.log").read_text(errors="replace")
    driver_suite.report(direct, via)
    if "Traceback" in proxy_log:
        print("\nthe proxy's log holds a traceback:\n" + proxy_log[proxy_log.index("Traceback"):][:4000])
    if args.json:
        driver_suite.save_runs(args.json, (direct, via))
    return 0


def _describe(source: Path) -> str:
    """The checkout's tag or commit, when it is a git checkout."""
    found = subprocess.run(["git", "-C", str(source), "describe", "--tags", "--always"], capture_output=True,
                           text=True)
    return found.stdout.strip() if found.returncode == 0 else "not a git checkout"


def _run_suite(name: str, dsn: str, source: Path, args: argparse.Namespace, workdir: Path) -> driver_suite.Run:
    report = workdir / f"{name}.xml"
    command = [sys.executable, "-m", "pytest", *args.tests, "--test-dsn", dsn, f"--junitxml={report}", "-q",
               "-p", "no:randomly", "-o", f"cache_dir={workdir / (name + '-cache')}", f"--timeout={args.timeout}",
               "-m", args.markers]
    if args.keyword:
        command += ["-k", args.keyword]
    print(f"\n== {name}: {dsn.split(' user=')[0]}", flush=True)
    start = time.monotonic()
    done = subprocess.run(command, cwd=source, capture_output=True, text=True)
    seconds = time.monotonic() - start
    summary = [line for line in done.stdout.splitlines() if line.startswith("=") or " passed" in line]
    print(summary[-1] if summary else done.stdout[-2000:] + done.stderr[-2000:], flush=True)
    if not report.exists():
        raise RuntimeError(f"pytest wrote no report for the {name} run:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    return driver_suite.read_junit(name, report, seconds)


if __name__ == "__main__":
    sys.exit(main())
