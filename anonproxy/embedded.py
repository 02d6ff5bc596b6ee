"""A private PostgreSQL server for `anonproxy up` and the test suite.

The server listens on 127.0.0.1 only (or the one address it is given) and asks
everyone for a SCRAM password (no trust); its Unix sockets live in the data
directory, not /var/run.
PostgreSQL refuses to run as root, so when we are root the server binaries run
as the ``postgres`` OS user, which then owns the data directory.

Files we own inside the data directory, rewritten at every start:

- ``pg_hba.conf``: ``hba_extra`` lines first, then SCRAM for 127.0.0.1 and local.
- ``anonproxy.conf`` (included at the end of ``postgresql.conf``): port,
  listen address, socket directory, the throwaway speed-ups, then ``settings``,
  so ``settings`` win over our defaults (``ALTER SYSTEM`` still wins over both).

``anonproxy-superuser.password`` (mode 0600) keeps the superuser password
chosen at initdb, so a reused data directory knows it.

Replication (tests and benchmarks of read replicas and fail-over):
``start_standby_of(primary)`` starts a hot standby from a base backup of a
running server (pg_basebackup -R: streaming replication as the superuser; the
primary needs a ``host replication`` line in ``hba_extra``), ``promote()``
makes a standby the primary, ``kill()`` ends the postmaster with SIGKILL.

A start that fails removes every directory it created (a persistent data
directory included, with its missing parents), so nothing is left behind;
``discard()`` does the same after a start whose follow-up set-up failed.
"""

from __future__ import annotations

import math
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from psycopg.conninfo import make_conninfo

SERVER_OS_USER = "postgres"
PASSWORD_FILE = "anonproxy-superuser.password"
CONF_FILE = "anonproxy.conf"
LOG_FILE = "anonproxy-server.log"
_SERVER_PROGRAMS = ("initdb", "pg_ctl", "postgres")  # pg_basebackup too, for a standby (same directory)
# sun_path holds 108 bytes; PostgreSQL appends "/.s.PGSQL.<port>" to the directory.
_MAX_SOCKET_DIR_LEN = 107 - len("/.s.PGSQL.65535")
_SETTING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_LOG_TAIL_LINES = 20


class EmbeddedPostgresError(RuntimeError):
    """The embedded server could not be found, initialised, started or stopped."""


def find_pg_bindir() -> Path:
    """The directory holding initdb, pg_ctl and postgres.

    Tried in order: ``pg_config --bindir``, the directory of ``postgres`` on
    PATH, the newest ``/usr/lib/postgresql/*/bin`` (Debian's layout).
    """
    tried: list[str] = []
    pg_config = shutil.which("pg_config")
    if pg_config is None:
        tried.append("pg_config (not on PATH)")
    else:
        result = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        candidate = Path(result.stdout.strip())
        if result.returncode == 0 and _has_server_programs(candidate):
            return candidate
        tried.append(f"pg_config --bindir ({candidate})")

    on_path = shutil.which("postgres")
    if on_path is None:
        tried.append("postgres on PATH (not found)")
    else:
        candidate = Path(on_path).resolve().parent
        if _has_server_programs(candidate):
            return candidate
        tried.append(f"postgres on PATH ({candidate})")

    debian_dirs = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    for candidate in debian_dirs:
        if _has_server_programs(candidate):
            return candidate
    found = f"{len(debian_dirs)} without all programs" if debian_dirs else "none"
    tried.append(f"/usr/lib/postgresql/*/bin ({found})")
    raise EmbeddedPostgresError(
        f"PostgreSQL server programs ({', '.join(_SERVER_PROGRAMS)}) not found; tried: {'; '.join(tried)}"
    )


def _has_server_programs(bindir: Path) -> bool:
    return all(os.access(bindir / name, os.X_OK) for name in _SERVER_PROGRAMS)


def _version_key(bindir: Path) -> tuple[int, ...]:
    """'/usr/lib/postgresql/9.6/bin' -> (9, 6), so 15 sorts above 9.6."""
    return tuple(int(part) for part in re.findall(r"\d+", bindir.parent.name))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_account() -> pwd.struct_passwd | None:
    """The OS account the server runs as: ``postgres`` when we are root, else ourselves (None)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SERVER_OS_USER)
    except KeyError:
        raise EmbeddedPostgresError(
            f"running as root, but there is no {SERVER_OS_USER!r} OS user to run PostgreSQL as"
        ) from None


def _conf_literal(value: str) -> str:
    """A postgresql.conf quoted value: backslashes and quotes escaped."""
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


class EmbeddedPostgres:
    """One PostgreSQL server in a throwaway (``data_dir=None``) or persistent data directory.

    ``port=0`` picks a free loopback port at every start. ``hba_extra`` lines are
    placed before the default SCRAM rules of pg_hba.conf; ``settings`` go to
    ``anonproxy.conf`` (see the module docstring). ``host``: the address it
    listens on; ``wrapper``: a command the server programs run under, as root,
    before becoming the server's OS account (``ip netns exec NAME``: the
    tests' network namespaces).
    """

    superuser: str = "postgres"
    host: str = "127.0.0.1"  # where it listens unless told otherwise (``host=``)

    def __init__(
        self,
        data_dir: Path | None = None,
        port: int = 0,
        hba_extra: Sequence[str] = (),
        settings: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        wrapper: Sequence[str] = (),
    ) -> None:
        for name in settings or {}:
            if not _SETTING_NAME.fullmatch(name):
                raise EmbeddedPostgresError(f"invalid PostgreSQL setting name {name!r}")
        self.throwaway = data_dir is None
        self.data_dir: Path | None = None if data_dir is None else Path(data_dir).absolute()
        self.host = host
        self.port = port
        self.password = ""  # known once start() has run
        self.created = False  # True when start() ran initdb: the data directory is new
        self._requested_port = port
        self._hba_extra = tuple(hba_extra)
        self._wrapper = tuple(wrapper)
        self._settings = {name: str(value) for name, value in (settings or {}).items()}
        self._bindir = find_pg_bindir()
        self._account = _server_account()
        self._temp_dirs: list[Path] = []  # created by us, removed by stop()
        # A persistent data directory this start fills from empty, and the directories it made for it.
        self._fresh_dir: Path | None = None
        self._created_dirs: list[Path] = []
        self._socket_dir: Path | None = None
        self._running = False

    # -- public API -----------------------------------------------------------

    def start(self, timeout: float = 30) -> None:
        """Initialise the data directory if needed and start the server; wait until it accepts connections."""
        with self._starting():
            data_dir = self._prepare_data_dir()
            self.created = not (data_dir / "PG_VERSION").exists()
            if self.created:
                self._initdb(data_dir)
            self.password = self._read_password(data_dir)
            self.port = self._requested_port or _free_port()
            self._write_config(data_dir)
            self._pg_ctl_start(data_dir, timeout)

    def start_standby_of(self, primary: EmbeddedPostgres, timeout: float = 60) -> None:
        """Start as a hot standby of the running ``primary``: a base backup of it (which brings its superuser and
        password), then streaming replication, named ``standby_<port>`` in its pg_stat_replication."""
        with self._starting():
            data_dir = self._prepare_data_dir()
            self.port = self._requested_port or _free_port()
            source = make_conninfo(primary.conninfo(), application_name=f"standby_{self.port}")
            result = self._run([self._bin("pg_basebackup"), "-D", str(data_dir), "-R", "-X", "stream", "-c", "fast",
                                "-d", source], timeout=timeout)
            if result.returncode != 0:
                raise EmbeddedPostgresError(f"pg_basebackup from port {primary.port} failed: {result.stderr.strip()}")
            # The backup copies the primary's socket lock files (its sockets live in its data directory, and its own
            # backup may hold its primary's): stale here, and one naming this port would stop the server starting.
            self._run(["find", str(data_dir), "-maxdepth", "1", "-name", ".s.PGSQL.*.lock", "-delete"])
            self.password = self._read_password(data_dir)
            self._write_config(data_dir)
            self._pg_ctl_start(data_dir, timeout)

    def promote(self, timeout: float = 60) -> None:
        """End recovery: this standby becomes a primary (pg_ctl promote, waiting until it accepts writes)."""
        assert self.data_dir is not None
        result = self._run([self._bin("pg_ctl"), "promote", "-D", str(self.data_dir), "-w", "-t",
                            str(math.ceil(timeout)), "-s"], timeout=timeout + 10)
        if result.returncode != 0:
            raise EmbeddedPostgresError(f"pg_ctl promote failed in {self.data_dir}: {result.stderr.strip()}")

    def kill(self) -> None:
        """SIGKILL the postmaster (a crash: nothing is flushed or shut down); ``stop()`` then removes what is
        temporary."""
        assert self.data_dir is not None
        pid = int((self.data_dir / "postmaster.pid").read_text().splitlines()[0])
        os.kill(pid, signal.SIGKILL)
        self._running = False

    def stop(self) -> None:
        """Stop the server (fast shutdown) and remove the temporary directories we made. Idempotent."""
        try:
            if self._running:
                self._running = False
                assert self.data_dir is not None
                result = self._run([self._bin("pg_ctl"), "stop", "-D", str(self.data_dir), "-m", "fast", "-w", "-s"])
                if result.returncode != 0 and (self.data_dir / "postmaster.pid").exists():
                    raise EmbeddedPostgresError(
                        f"could not stop the server in {self.data_dir}: {result.stderr.strip()}"
                    )
        finally:
            self._remove_temp_dirs()

    def discard(self) -> None:
        """Stop the server and remove the data directory if this start created it (a failed set-up)."""
        try:
            self.stop()
        finally:
            self._remove_created_dirs()

    def conninfo(self, user: str | None = None, password: str | None = None, dbname: str = "postgres") -> str:
        """A libpq keyword/value string; the superuser (with its password) when ``user`` is None."""
        user = user or self.superuser
        if password is None and user == self.superuser:
            password = self.password
        return make_conninfo(host=self.host, port=self.port, user=user, password=password, dbname=dbname)

    @property
    def socket_dir(self) -> Path:
        """Where the server's Unix socket lives: the data directory, or a private temp dir if its path is too long."""
        assert self._socket_dir is not None, "socket_dir is known once start() has run"
        return self._socket_dir

    @property
    def log_file(self) -> Path:
        assert self.data_dir is not None, "log_file is known once start() has run"
        return self.data_dir / LOG_FILE

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- data directory -------------------------------------------------------

    def _prepare_data_dir(self) -> Path:
        if self.throwaway:
            self.data_dir = Path(tempfile.mkdtemp(prefix="anonproxy-pg-"))
            self._temp_dirs.append(self.data_dir)
            self._chown(self.data_dir)
        else:
            assert self.data_dir is not None
            # Innermost first; noted before mkdir, which may fail halfway.
            self._created_dirs = [path for path in (self.data_dir, *self.data_dir.parents) if not path.exists()]
            try:
                self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                raise EmbeddedPostgresError(
                    f"cannot create the data directory {self.data_dir}: {exc.strerror}"
                ) from None
            if not (self.data_dir / "PG_VERSION").exists():
                if any(self.data_dir.iterdir()):
                    raise EmbeddedPostgresError(
                        f"{self.data_dir} is not empty and is not a PostgreSQL data directory"
                    )
                self._fresh_dir = self.data_dir
                self._chown(self.data_dir)
        self._check_server_can_write(self.data_dir)
        return self.data_dir

    def _check_server_can_write(self, path: Path) -> None:
        if self._account is None:
            return
        if self._run(["test", "-w", str(path), "-a", "-x", str(path)]).returncode != 0:
            raise EmbeddedPostgresError(
                f"the {self._account.pw_name!r} OS user, which runs PostgreSQL, cannot write to {path}: "
                "it must own it and be able to search every parent directory (e.g. chmod o+x), "
                "or choose a data directory elsewhere"
            )

    def _initdb(self, data_dir: Path) -> None:
        password = secrets.token_urlsafe(24)
        fd, pwfile = tempfile.mkstemp(prefix="anonproxy-pw-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(password + "\n")
            self._chown(Path(pwfile))
            args = [
                self._bin("initdb"), "-D", str(data_dir), "-U", self.superuser,
                "--auth=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8", "--locale=C",
                "--no-instructions",
            ]  # fmt: skip
            if self.throwaway:
                args.append("--no-sync")  # nothing to keep safe; saves about a second
            result = self._run(args)
        finally:
            os.unlink(pwfile)
        if result.returncode != 0:
            raise EmbeddedPostgresError(f"initdb failed for {data_dir}:\n{result.stderr.strip()}")
        self._write_file(data_dir / PASSWORD_FILE, password + "\n")
        with (data_dir / "postgresql.conf").open("a") as conf:
            conf.write(f"\n# Added by anonproxy: its settings, rewritten at every start.\ninclude '{CONF_FILE}'\n")

    def _read_password(self, data_dir: Path) -> str:
        try:
            return (data_dir / PASSWORD_FILE).read_text().strip()
        except FileNotFoundError:
            raise EmbeddedPostgresError(
                f"{data_dir} was not initialised by anonproxy: {PASSWORD_FILE} is missing"
            ) from None

    def _write_config(self, data_dir: Path) -> None:
        socket_dir = data_dir
        if len(str(data_dir)) > _MAX_SOCKET_DIR_LEN:
            socket_dir = Path(tempfile.mkdtemp(prefix="anonproxy-pg-sock-"))
            self._chown(socket_dir)
            self._temp_dirs.append(socket_dir)
        self._socket_dir = socket_dir
        settings = {
            "listen_addresses": self.host,
            "port": str(self.port),
            "unix_socket_directories": str(socket_dir),
        }
        if self.throwaway:
            # Durability is pointless for a directory removed at stop().
            settings |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        settings |= self._settings
        lines = [f"{name} = {_conf_literal(value)}" for name, value in settings.items()]
        self._write_file(data_dir / CONF_FILE, "# Written by anonproxy at every start.\n" + "\n".join(lines) + "\n")

        hba = [
            *self._hba_extra,
            "host all all 127.0.0.1/32 scram-sha-256",
            "local all all scram-sha-256",
        ]
        self._write_file(data_dir / "pg_hba.conf", "# Written by anonproxy at every start.\n" + "\n".join(hba) + "\n")

    # -- server process -------------------------------------------------------

    @contextmanager
    def _starting(self) -> Iterator[None]:
        """A start: refused while the server runs; if it fails, what it made is removed; if not, the server runs."""
        if self._running:
            raise EmbeddedPostgresError(f"the server in {self.data_dir} is already started")
        try:
            yield
        except BaseException:
            self._remove_temp_dirs()
            self._remove_created_dirs()
            raise
        self._running = True

    def _pg_ctl_start(self, data_dir: Path, timeout: float) -> None:
        pg_ctl = self._bin("pg_ctl")
        if self._run([pg_ctl, "status", "-D", str(data_dir)]).returncode == 0:
            raise EmbeddedPostgresError(
                f"a server is already running on {data_dir}; stop it with: "
                + self.command_line([pg_ctl, "stop", "-D", str(data_dir)])
            )
        wait = ["-w", "-t", str(math.ceil(timeout))]
        args = [pg_ctl, "start", "-D", str(data_dir), "-l", str(self.log_file), *wait, "-s"]
        try:
            result = self._run(args, timeout=timeout + 10)
        except subprocess.TimeoutExpired:
            raise EmbeddedPostgresError(
                f"pg_ctl start did not return within {timeout + 10:.0f} s{self._log_tail()}"
            ) from None
        if result.returncode == 0:
            return
        tail = self._log_tail()
        if "Address already in use" in tail:
            problem = f"port {self.port} on {self.host} is already in use"
        else:
            problem = f"the server in {data_dir} did not start: {result.stderr.strip()}"
        raise EmbeddedPostgresError(problem + tail)

    def _log_tail(self) -> str:
        try:
            lines = self.log_file.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        except OSError:
            return ""
        return "\n--- end of the server log ---\n" + "\n".join(lines)

    # -- helpers --------------------------------------------------------------

    def command_line(self, args: Sequence[str]) -> str:
        """A shell command that runs ``args`` as the server's OS account, for a person to type.

        PostgreSQL's programs refuse to run as root: as root, it runs them as that account from / (root's
        home is closed to it), as ``_run`` does.
        """
        if self._account is None:
            return shlex.join(args)
        return f"cd / && runuser -u {shlex.quote(self._account.pw_name)} -- {shlex.join(args)}"

    def _bin(self, program: str) -> str:
        return str(self._bindir / program)

    def _run(self, args: Sequence[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        """Run a program as the server's OS account, from / (root's cwd is unreadable to it)."""
        account = self._account
        if self._wrapper:  # the wrapper runs as root, and runuser becomes the account inside it
            args = [*self._wrapper, *(["runuser", "-u", account.pw_name, "--"] if account else []), *args]
            account = None
        return subprocess.run(
            args,
            capture_output=True,
            text=True,
            cwd="/",
            timeout=timeout,
            user=account.pw_uid if account else None,
            group=account.pw_gid if account else None,
            extra_groups=[] if account else None,
        )

    def _chown(self, path: Path) -> None:
        if self._account is not None:
            os.chown(path, self._account.pw_uid, self._account.pw_gid)

    def _write_file(self, path: Path, text: str) -> None:
        """Write a file readable only by the server's OS account (it may hold a password)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if self._account is not None:
                os.fchown(f.fileno(), self._account.pw_uid, self._account.pw_gid)
            f.write(text)

    def _remove_created_dirs(self) -> None:
        """Undo what this start did to a persistent data directory: empty it if it was empty, remove what we made."""
        if self._fresh_dir is not None:
            for path in self._fresh_dir.iterdir():
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        for path in self._created_dirs:  # innermost first
            try:
                path.rmdir()
            except FileNotFoundError:  # mkdir failed before making it
                continue
            except OSError:  # someone put something there meanwhile: theirs to keep
                break
        self._fresh_dir = None
        self._created_dirs = []

    def _remove_temp_dirs(self) -> None:
        for path in reversed(self._temp_dirs):
            shutil.rmtree(path, ignore_errors=True)
        self._temp_dirs.clear()
