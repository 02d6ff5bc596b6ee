"""What the drivers' own test suites (psycopg_suite, node_pg_suite) share: the demo database on a throwaway
PostgreSQL, and ``anonproxy serve`` in front of it relaying the suite's login."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
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
