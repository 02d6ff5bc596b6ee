"""The command line: `anonproxy up` end to end, `serve` settings, `install`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import Up, free_port
from suppression_oracle import suppress

from anonproxy.config import ConfigError, ProxyConfig, UpstreamAddress, load_config
from anonproxy.embedded import EmbeddedPostgres


def psql(url: str, sql: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["psql", url, "-X", "-A", "-t", "-c", sql], capture_output=True, text=True, timeout=30)


def postgres_processes_for(data_dir: str) -> int:
    result = subprocess.run(["pgrep", "-f", f"postgres -D {data_dir}"], capture_output=True, text=True)
    return len(result.stdout.split())


def test_up_serves_the_demo_and_cleans_up() -> None:
    port = free_port()
    up = Up("--port", str(port))
    try:
        assert up.urls["dba"] == f"postgresql://dba:dba@127.0.0.1:{port}/postgres"
        assert psql(up.urls["dba"], "select count(*) from adult").stdout.strip() == "30162"
        noisy = psql(up.urls["analyst"], "select sex, count(*) from adult group by sex")
        assert noisy.returncode == 0 and "differentially private answer" in noisy.stderr
        budget_left = psql(up.urls["analyst"], "show anonproxy.budget").stdout  # zCDP, the demo's by the default rule
        assert "zCDP accounting" in budget_left and "epsilon 10 of 10 left" not in budget_left
        # The reporter's groups: exact counts, none below k = 10 (the dba computes the truth).
        query = "select native_country, count(*) from adult group by 1"
        truth = dict(line.split("|") for line in psql(up.urls["dba"], query).stdout.split())
        released = dict(line.split("|") for line in psql(up.urls["reporter"], query).stdout.split())
        rest = released.pop("", None)
        everyone = sum(int(n) for n in truth.values())
        verdict = suppress({country: int(n) for country, n in truth.items()}, k=10, everyone=everyone, rest=True)
        assert released == {country: truth[country] for country in verdict.released}
        # The withheld countries (primary and complementary suppression) together, in the rest row: the answer
        # covers everyone, whose total is public.
        assert verdict.rest and rest == str(sum(int(truth[country]) for country in verdict.withheld))
        assert "hours_per_week" in psql(up.urls["reporter"], r"\d adult").stdout
        assert psql(up.urls["dba"], "select count(*) from anonproxy.schema_migrations").stdout.strip() >= "1"
        server_line = next(line for line in up.output if "PostgreSQL on 127.0.0.1:" in line)
        server_port = int(server_line.split("127.0.0.1:")[1].split(",")[0])
        data_dir = server_line.split("data in ")[1].split(";")[0]
        # The embedded server itself demands passwords (scram-sha-256), and only on loopback.
        with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
            psycopg.connect(f"host=127.0.0.1 port={server_port} user=dba password=wrong dbname=postgres")
        with psycopg.connect(f"host=127.0.0.1 port={server_port} user=dba password=dba dbname=postgres") as conn:
            assert conn.execute("show listen_addresses").fetchone() == ("127.0.0.1",)
        # Bypassing the proxy yields nothing to the anonymized roles.
        for role in ("reporter", "analyst"):
            direct = psql(f"postgresql://{role}:{role}@127.0.0.1:{server_port}/postgres", "select * from adult limit 1")
            assert direct.returncode != 0 and "permission denied for table adult" in direct.stderr
        assert "trust" not in [line.split()[-1] for line in (Path(data_dir) / "pg_hba.conf").read_text().splitlines()
                               if line.strip() and not line.startswith("#")]
    finally:
        output = up.stop()
    assert up.process.returncode == 0, output
    assert "Traceback" not in output
    assert not Path(data_dir).exists(), "the throwaway data directory should be removed"
    assert postgres_processes_for(data_dir) == 0


@pytest.fixture
def data_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="anonproxy-up-"))
    base.chmod(0o755)  # the postgres OS user must reach the data directory inside
    yield base / "data"
    shutil.rmtree(base, ignore_errors=True)


def test_up_with_data_dir_keeps_and_reuses_it(data_dir: Path) -> None:
    port = free_port()
    first = Up("--port", str(port), "--data-dir", str(data_dir))
    try:
        assert psql(first.urls["dba"], "select count(*) from adult").stdout.strip() == "30162"
        marker = psql(first.urls["dba"], "select oid from pg_class where relname = 'adult'").stdout.strip()
    finally:
        first.stop()
    assert (data_dir / "PG_VERSION").exists()
    second = Up("--port", str(port), "--data-dir", str(data_dir))
    try:
        # The same table, not a reloaded copy.
        assert psql(second.urls["dba"], "select oid from pg_class where relname = 'adult'").stdout.strip() == marker
        assert psql(second.urls["dba"], "select count(*) from adult").stdout.strip() == "30162"
    finally:
        second.stop()
    assert second.process.returncode == 0


def test_up_refuses_a_busy_port() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = subprocess.run([sys.executable, "-m", "anonproxy", "up", "--port", str(busy.getsockname()[1])],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "address already in use" in result.stderr.lower()


# -- serve settings ----------------------------------------------------------------


def test_settings_come_from_file_then_environment(tmp_path: Path) -> None:
    path = tmp_path / "anonproxy.yaml"
    path.write_text("listen_port: 7000\nworkers: 3\nupstream: host=db.internal port=5433\nlog_format: json\n")
    config = load_config(path, environ={"ANONPROXY_WORKERS": "2", "ANONPROXY_LOG_LEVEL": "debug"})
    assert config == ProxyConfig(listen_port=7000, workers=2, upstream="host=db.internal port=5433",
                                 log_format="json", log_level="debug")
    assert config.upstream_address == UpstreamAddress("db.internal", 5433)
    assert load_config(None, environ={"ANONPROXY_UPSTREAM": "postgresql:///x?host=/run/pg&port=5999"}
                       ).upstream_address.unix_path == "/run/pg/.s.PGSQL.5999"


@pytest.mark.parametrize(
    ("text", "environ", "words"),
    [
        ("listen_port: 70000\n", {}, "listen_port must be between 0 and 65535"),
        ("workers: 0\n", {}, "workers must be between 1 and 64"),
        ("colour: blue\n", {}, "unknown setting 'colour'"),
        ("", {"ANONPROXY_LISTEN_PORT": "six"}, "setting listen_port has an invalid value 'six'"),
        ("tls_cert: /x.crt\n", {}, "tls_cert and tls_key must be given together"),
        ("log_format: xml\n", {}, "log_format must be one of text, json"),
        ("upstream: 'host=a,b port=1,2,3'\n", {}, "upstream names 2 hosts but 3 ports"),
        ("upstream: 'nonsense without equals'\n", {}, "upstream is not a valid PostgreSQL connection string"),
        ("- a list\n", {}, "must hold a mapping of settings"),
    ],
)
def test_bad_settings_are_named(tmp_path: Path, text: str, environ: dict[str, str], words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        load_config(path, environ=environ)


def test_serve_reports_a_bad_config_without_traceback(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("workers: many\n")
    result = subprocess.run([sys.executable, "-m", "anonproxy", "serve", "--config", str(path)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip() == ("anonproxy: configuration error: setting workers has an invalid value 'many': "
                                     "expected int")


def test_serve_with_json_logs_and_one_worker(pg_server: EmbeddedPostgres, dbname: str, tmp_path: Path) -> None:
    path = tmp_path / "anonproxy.yaml"
    port = free_port()
    path.write_text(f"listen_port: {port}\nupstream: host=127.0.0.1 port={pg_server.port}\n"
                    "log_format: json\nworkers: 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANONPROXY_")}
    process = subprocess.Popen([sys.executable, "-m", "anonproxy", "serve", "--config", str(path)], env=env,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        lines = [json.loads(process.stderr.readline()) for _ in range(2)]
        assert lines[0]["message"].startswith("no service_dsn: every role is forwarded unchanged")
        assert lines[1]["message"].startswith(f"listening on 127.0.0.1:{port}")
        with psycopg.connect(f"host=127.0.0.1 port={port} dbname={dbname} user=dba password=dba") as conn:
            assert conn.execute("select count(*) from adult").fetchone() == (30162,)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(15)
    assert process.returncode == 0


def _serve_env(pg_server: EmbeddedPostgres, port: int, **settings: str) -> dict[str, str]:
    """The environment of an `anonproxy serve` on ``port`` in front of ``pg_server``: none of the suite's own
    ANONPROXY_ settings, these ``settings`` (ANONPROXY_<NAME>) instead."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANONPROXY_")}
    env.update(ANONPROXY_LISTEN_PORT=str(port), ANONPROXY_UPSTREAM=f"host=127.0.0.1 port={pg_server.port}")
    env.update({f"ANONPROXY_{name.upper()}": value for name, value in settings.items()})
    return env


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.parametrize("cores", ["one", "all"])
def test_serve_runs_one_worker_per_core_by_default(pg_server: EmbeddedPostgres, dbname: str, tmp_path: Path,
                                                    cores: str) -> None:
    """No workers setting: as many worker processes as the cores the proxy may run on (its CPU affinity): pinned
    to one of this machine's cores, and free to use all of them."""
    allowed = os.sched_getaffinity(0)
    cpus = {min(allowed)} if cores == "one" else allowed
    port = free_port()
    env = _serve_env(pg_server, port)
    process = subprocess.Popen([sys.executable, "-m", "anonproxy", "serve"], env=env, stderr=subprocess.PIPE,
                               text=True, preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    try:
        assert process.stderr is not None
        listening = next(line for line in process.stderr if "listening on" in line)
        assert listening.rstrip().endswith(f"{len(cpus)} worker" + ("s" if len(cpus) > 1 else ""))
        # One worker runs in the supervisor's own process; more are its children.
        assert len(_children(process.pid)) == (0 if len(cpus) == 1 else len(cpus))
        with psycopg.connect(f"host=127.0.0.1 port={port} dbname={dbname} user=dba password=dba") as conn:
            assert conn.execute("select count(*) from adult").fetchone() == (30162,)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(15)
    assert process.returncode == 0


def test_a_killed_supervisor_takes_its_workers_with_it(pg_server: EmbeddedPostgres, dbname: str) -> None:
    """kill -9 of `anonproxy serve`: its workers stop too, so nothing keeps serving on the port with the old
    configuration and a restarted proxy can listen there again."""
    port = free_port()
    env = _serve_env(pg_server, port, workers="2")
    command = [sys.executable, "-m", "anonproxy", "serve"]
    first = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    assert first.stderr is not None
    next(line for line in first.stderr if "listening on" in line)
    workers = _children(first.pid)
    assert len(workers) == 2
    first.kill()
    first.wait(15)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
              for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived their supervisor"
        time.sleep(0.1)
    second = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert second.stderr is not None
        started = next(line for line in second.stderr if "listening on" in line or "cannot listen" in line)
        assert "listening on" in started, started
        with psycopg.connect(f"host=127.0.0.1 port={port} dbname={dbname} user=dba password=dba") as conn:
            assert conn.execute("select count(*) from adult").fetchone() == (30162,)
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(15)
    assert second.returncode == 0


def test_install_command_is_idempotent(postgresql: psycopg.Connection, pg_server: EmbeddedPostgres) -> None:
    dsn = pg_server.conninfo(dbname=postgresql.info.dbname)
    postgresql.execute("drop schema anonproxy cascade")
    postgresql.commit()
    first = subprocess.run([sys.executable, "-m", "anonproxy", "install", "--dsn", dsn],
                           capture_output=True, text=True, timeout=60)
    assert first.returncode == 0 and first.stdout.startswith("applied migrations [1"), first
    second = subprocess.run([sys.executable, "-m", "anonproxy", "install", "--dsn", dsn],
                            capture_output=True, text=True, timeout=60)
    assert second.stdout.strip() == "schema already up to date"
    bad = subprocess.run([sys.executable, "-m", "anonproxy", "install", "--dsn", dsn.replace("password=", "password=x")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "password authentication failed" in bad.stderr and "Traceback" not in bad.stderr
