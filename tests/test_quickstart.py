"""The first hour: `./quickstart` installs once and then goes straight to `up`; two runs at once take turns at the
install; `up --pg-port` sets PostgreSQL's port; after a crash, the command `up` prints to stop the orphaned server
works (as root too, where pg_ctl refuses to run).

Real runs: the quickstart of a copy of this checkout (a real pip install into its own .venv, logged through PIP_LOG so
that a run that does not call pip can be told), and `anonproxy up` in child processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import Up, free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files git tracks in this checkout, as they are now (symlinks kept), in a directory of their own."""
    path = tmp_path_factory.mktemp("clone")
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    pack = subprocess.run(["tar", "-C", str(ROOT), "--null", "-T", "-", "-cf", "-"], input=tracked,
                          capture_output=True, check=True).stdout
    subprocess.run(["tar", "-C", str(path), "-xf", "-"], input=pack, check=True)
    return path


class QuickStart:
    """`./quickstart --port P` of ``clone``, read until `up` says it is ready."""

    def __init__(self, clone: Path, pip_log: Path) -> None:
        env = {**os.environ, "PIP_LOG": str(pip_log)}
        env.pop("VIRTUAL_ENV", None)
        self.process = subprocess.Popen(["./quickstart", "--port", str(free_port())], cwd=clone, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def ready(self) -> str:
        """Everything it printed until `up` was ready (or it stopped)."""
        assert self.process.stdout is not None
        lines = []
        for line in self.process.stdout:
            lines.append(line)
            if line.startswith("Press Ctrl-C"):
                break
        return "".join(lines)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)  # `up` itself: quickstart execs it
        self.process.communicate(timeout=60)


def run_once(clone: Path, pip_log: Path) -> str:
    quickstart = QuickStart(clone, pip_log)
    try:
        output = quickstart.ready()
    finally:
        quickstart.stop()
    assert "anonproxy is ready" in output, output
    return output


@pytest.mark.timeout(900)
def test_two_quickstarts_at_once_install_once_and_both_start(clone: Path, tmp_path: Path) -> None:
    logs = [tmp_path / "pip-1.log", tmp_path / "pip-2.log"]
    runs = [QuickStart(clone, log) for log in logs]
    try:
        outputs = [run.ready() for run in runs]
    finally:
        for run in runs:
            run.stop()
    for output in outputs:
        assert "anonproxy is ready" in output and "Traceback" not in output, output
    installing = [output for output in outputs if "quickstart: installing anonproxy into .venv" in output]
    assert len(installing) == 1, outputs
    waited = next(output for output in outputs if output is not installing[0])
    assert "another ./quickstart of this clone is installing: waiting for it" in waited, waited
    assert sum(log.exists() for log in logs) == 1  # pip ran for one of them only


@pytest.mark.timeout(900)
def test_a_second_quickstart_runs_no_pip(clone: Path, tmp_path: Path) -> None:
    run_once(clone, tmp_path / "first.log")  # installs, unless the test above did
    stamp = clone / ".venv" / ".quickstart-up"
    installed = stamp.stat().st_mtime_ns
    second = run_once(clone, tmp_path / "second.log")
    assert "quickstart: anonproxy in .venv is current" in second and "installing" not in second, second
    assert not (tmp_path / "second.log").exists()  # pip was not run at all
    assert stamp.stat().st_mtime_ns == installed


def test_up_pg_port_sets_postgresql_port() -> None:
    pg_port = free_port()
    up = Up("--port", str(free_port()), "--pg-port", str(pg_port))
    try:
        assert f"PostgreSQL on 127.0.0.1:{pg_port}," in up.text
        owner = psycopg.conninfo.conninfo_to_dict(up.urls["owner"])
        with psycopg.connect(host="127.0.0.1", port=pg_port, user=owner["user"], password=owner["password"],
                             dbname="postgres") as conn:  # PostgreSQL itself, not the proxy
            assert conn.execute("select inet_server_port()").fetchone() == (pg_port,)
    finally:
        up.stop()


def test_up_pg_port_taken_or_same_as_the_proxy_fails_before_postgresql_is_built() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = subprocess.run([sys.executable, "-m", "anonproxy", "up", "--port", str(free_port()),
                                "--pg-port", str(port)], capture_output=True, text=True, timeout=60, check=False)
    assert taken.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port} for PostgreSQL (--pg-port)" in taken.stderr
    same = subprocess.run([sys.executable, "-m", "anonproxy", "up", "--port", "7654", "--pg-port", "7654"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert same.returncode == 2
    assert "--pg-port and --port are both 7654" in same.stderr
    for result in (taken, same):
        assert "Traceback" not in result.stderr and "PostgreSQL on" not in result.stderr


@pytest.fixture
def data_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="anonproxy-crash-"))
    base.chmod(0o755)  # the postgres OS user must reach the data directory inside
    yield base / "data"
    shutil.rmtree(base, ignore_errors=True)


def test_after_a_crash_the_printed_command_stops_the_orphaned_server(data_dir: Path) -> None:
    crashed = subprocess.Popen([sys.executable, "-m", "anonproxy", "up", "--port", str(free_port()),
                                "--data-dir", str(data_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    assert crashed.stdout is not None
    for line in crashed.stdout:
        if line.startswith("Press Ctrl-C"):
            break
    os.killpg(crashed.pid, signal.SIGKILL)  # `up` and its proxy die; PostgreSQL, in a session of its own, lives on
    crashed.communicate()
    assert (data_dir / "postmaster.pid").exists()

    refused = subprocess.run([sys.executable, "-m", "anonproxy", "up", "--port", str(free_port()),
                              "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    hint = refused.stderr.strip().splitlines()[-1].split("stop it with: ", 1)[1]
    # As the user would: pasted into a shell, from a directory of theirs (root's home when we are root).
    stopped = subprocess.run(["sh", "-c", hint], cwd=Path.home(), capture_output=True, text=True, timeout=60,
                             check=False)
    assert stopped.returncode == 0, stopped.stderr
    assert not (data_dir / "postmaster.pid").exists()

    again = Up("--port", str(free_port()), "--data-dir", str(data_dir))
    assert "reusing" in again.stop()
