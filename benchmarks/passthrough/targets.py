"""The proxies under test, each a child process listening on a free 127.0.0.1 port.

``PgBouncer`` runs the Debian package's binary with a generated ini (session
pooling, SCRAM against an auth_file); ``AnonProxy`` runs ``anonproxy serve``
configured through ANONPROXY_* environment variables. Both are context
managers: entering starts the process and waits until its port accepts
connections, leaving stops it and removes its temporary directory.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

HOST = "127.0.0.1"
PGBOUNCER = Path("/usr/sbin/pgbouncer")
REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_OS_USER = "postgres"  # pgbouncer refuses to run as root, PostgreSQL too
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
LOG_TAIL_LINES = 20


class BenchmarkError(RuntimeError):
    """A program of the benchmark could not be started or failed."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class Service:
    """A server process started by us; its output goes to a log file in its own temp dir."""

    def __init__(self, name: str, account: pwd.struct_passwd | None = None) -> None:
        self.name = name
        self.port = free_port()
        self.account = account
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-passthrough-"))
        if account is not None:
            os.chown(self.workdir, account.pw_uid, account.pw_gid)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log_file(self) -> Path:
        return self.workdir / "output.log"

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU time (user, system) used so far by the process and its descendants (e.g. workers)."""
        assert self.process is not None
        return process_tree_cpu_seconds(self.process.pid)

    def _start(self, args: list[str], env: dict[str, str] | None = None, cwd: Path | str = "/") -> None:
        account = self.account
        with self.log_file.open("wb") as log:
            self.process = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                user=account.pw_uid if account else None,
                group=account.pw_gid if account else None,
                extra_groups=[] if account else None,
            )
        self._wait_until_listening()

    def _wait_until_listening(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if self.process.poll() is not None:
                raise BenchmarkError(f"{self.name} exited with code {self.process.returncode}{self._log_tail()}")
            try:
                socket.create_connection((HOST, self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise BenchmarkError(
                        f"{self.name} does not accept connections on {HOST}:{self.port} "
                        f"after {READY_TIMEOUT:.0f} s{self._log_tail()}"
                    ) from None
                time.sleep(0.1)

    def _log_tail(self) -> str:
        lines = self.log_file.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        return "\n--- last lines of its output ---\n" + "\n".join(lines)

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and remove the temp dir. Idempotent."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class PgBouncer(Service):
    """pgbouncer in session mode in front of ``database`` on the upstream server."""

    def __init__(self, upstream_port: int, database: str, user: str, password: str, pool_size: int) -> None:
        account = pwd.getpwnam(SERVER_OS_USER) if os.geteuid() == 0 else None
        super().__init__("pgbouncer", account)
        self._upstream_port = upstream_port
        self._database = database
        self._user = user
        self._password = password
        self._pool_size = pool_size

    def __enter__(self) -> Self:
        try:
            auth_file = self.workdir / "userlist.txt"
            self._write_private(auth_file, f'"{self._user}" "{self._password}"\n')
            ini = self.workdir / "pgbouncer.ini"
            self._write_private(ini, self._ini(auth_file))
            self._start([str(PGBOUNCER), str(ini)])
        except BaseException:
            self.stop()
            raise
        return self

    def _ini(self, auth_file: Path) -> str:
        return f"""\
[databases]
{self._database} = host={HOST} port={self._upstream_port} dbname={self._database}

[pgbouncer]
listen_addr = {HOST}
listen_port = {self.port}
unix_socket_dir =
auth_type = scram-sha-256
auth_file = {auth_file}
pool_mode = session
default_pool_size = {self._pool_size}
max_client_conn = {self._pool_size + 20}
log_connections = 0
log_disconnections = 0
log_stats = 0
"""

    def _write_private(self, path: Path, text: str) -> None:
        """Write a file only the pgbouncer account can read (the auth_file holds a password)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            if self.account is not None:
                os.fchown(f.fileno(), self.account.pw_uid, self.account.pw_gid)
            f.write(text)


class AnonProxy(Service):
    """``anonproxy serve`` with ``workers`` worker processes in front of the upstream server, run from the source
    tree ``tree`` (another checkout: the code before a change, side by side with this one)."""

    def __init__(self, upstream_port: int, workers: int, tree: Path = REPO_ROOT, label: str = "anonproxy") -> None:
        super().__init__(f"{label} ({workers} worker{'s' if workers > 1 else ''})")
        self.label = label
        self.workers = workers
        self._upstream_port = upstream_port
        self._tree = tree

    def __enter__(self) -> Self:
        env = {name: value for name, value in os.environ.items() if not name.startswith("ANONPROXY_")}
        env |= {
            "ANONPROXY_LISTEN_HOST": HOST,
            "ANONPROXY_LISTEN_PORT": str(self.port),
            "ANONPROXY_UPSTREAM": f"host={HOST} port={self._upstream_port}",
            "ANONPROXY_WORKERS": str(self.workers),
            "ANONPROXY_LOG_LEVEL": "warning",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(self._tree), env.get("PYTHONPATH")])),
        }
        try:
            self._start([sys.executable, "-m", "anonproxy.cli", "serve"], env=env, cwd=self._tree)
        except BaseException:
            self.stop()
            raise
        return self


def process_tree_cpu_seconds(root: int) -> tuple[float, float]:
    """User and system CPU time of ``root`` and all its living descendants, from /proc."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, tuple[int, int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # the process has just ended
        # Fields after "pid (comm) ": state ppid ... utime (14th field) stime (15th).
        fields = text[text.rindex(")") + 2 :].split()
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = (int(fields[11]), int(fields[12]))
    user = system = 0
    pending = [root]
    while pending:
        pid = pending.pop()
        user_ticks, system_ticks = ticks.get(pid, (0, 0))
        user, system = user + user_ticks, system + system_ticks
        pending.extend(children.get(pid, ()))
    hertz = os.sysconf("SC_CLK_TCK")
    return user / hertz, system / hertz
