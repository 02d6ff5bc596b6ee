"""What the drivers' own test suites (psycopg_suite, node_pg_suite, asyncpg_suite) share: the demo database on a
throwaway PostgreSQL, ``anonproxy serve`` in front of it relaying the suite's login, and for the suites pytest runs
(psycopg's, asyncpg's) the outcomes read from its JUnit XML and the comparison of the two runs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psycopg

from anonproxy import demo
from anonproxy.embedded import EmbeddedPostgres

HOST = "127.0.0.1"
ROLE = "dba"  # a direct role of the demo policy: its sessions are relayed
SERVICE_ROLE = "anonproxy_service"
REPO_ROOT = Path(__file__).resolve().parents[1]


def prepare(server: EmbeddedPostgres, database: str) -> None:
    """``database`` with the anonproxy schema and the demo policy; ``dba`` made superuser for the suite."""
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        conn.execute(f"create database {database}")
    with psycopg.connect(server.conninfo(dbname=database)) as conn:
        demo.install_demo_database(conn, database, SERVICE_ROLE, SERVICE_ROLE)
        conn.execute(f"alter role {ROLE} superuser")
        conn.commit()


def start_proxy(server: EmbeddedPostgres, database: str, workdir: Path, workers: int,
                tls: tuple[Path, Path] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """``anonproxy serve`` (this checkout's) on a free port, plain TCP to the server; ``tls``: the certificate and
    key it offers its clients. Returns the process and its port once it accepts connections."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "ANONPROXY_LISTEN_PORT": str(port), "ANONPROXY_WORKERS": str(workers),
           "ANONPROXY_UPSTREAM": f"host={HOST} port={server.port}",
           "ANONPROXY_SERVICE_DSN": f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={database}"}
    if tls is not None:
        env["ANONPROXY_TLS_CERT"], env["ANONPROXY_TLS_KEY"] = map(str, tls)
    with (workdir / "anonproxy.log").open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "anonproxy.cli", "serve"], env=env, cwd=REPO_ROOT,
                                   stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return process, port
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("anonproxy did not start:\n" + (workdir / "anonproxy.log").read_text()) from None
            time.sleep(0.1)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()


@dataclass(frozen=True)
class Run:
    """One run of a pytest suite: each test's outcome, the first line of each failure, the run's duration."""
    name: str
    outcomes: dict[str, str]  # test id -> passed | failed | error | skipped
    messages: dict[str, str]  # test id -> first line of its failure
    seconds: float


def read_junit(name: str, path: Path, seconds: float) -> Run:
    """The outcomes of pytest's ``--junitxml`` report at ``path``."""
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                text = (child.get("message") or child.text or "").strip()
                messages[test] = text.splitlines()[0][:200] if text else ""
                break
        # A test can report twice (a failure in the call, an error at teardown): the worse outcome counts.
        if outcomes.get(test) not in ("failed", "error"):
            outcomes[test] = outcome
    return Run(name, outcomes, messages, seconds)


def load_run(path: Path, name: str) -> Run:
    """Run ``name`` from an earlier ``--json`` output (``save_runs``)."""
    saved = json.loads(path.read_text())[name]
    return Run(name, saved["outcomes"], saved["messages"], saved["seconds"])


def save_runs(path: Path, runs: tuple[Run, ...]) -> None:
    path.write_text(json.dumps({run.name: {"seconds": run.seconds, "outcomes": run.outcomes,
                                           "messages": run.messages} for run in runs}, indent=1))


def report(direct: Run, via: Run) -> None:
    """Both runs' counts, then every test whose outcome differs, with its failure's first line."""
    print("\n| run | tests | passed | failed | error | skipped | seconds |\n|---|---|---|---|---|---|---|")
    for run in (direct, via):
        counts = Counter(run.outcomes.values())
        print(f"| {run.name} | {len(run.outcomes)} | {counts['passed']} | {counts['failed']} | {counts['error']} | "
              f"{counts['skipped']} | {run.seconds:.0f} |")
    tests = sorted(set(direct.outcomes) | set(via.outcomes))
    differ = [test for test in tests if direct.outcomes.get(test) != via.outcomes.get(test)]
    print(f"\n{len(differ)} tests differ (direct -> through anonproxy):")
    for test in differ:
        message = via.messages.get(test) or direct.messages.get(test) or ""
        print(f"  {test}: {direct.outcomes.get(test, 'absent')} -> {via.outcomes.get(test, 'absent')}"
              f"{'  | ' + message if message else ''}")
