"""Test fixtures: one real PostgreSQL per session, a fresh database per test, the real proxy.

The server runs as the `postgres` OS user when the suite runs as root (see
anonproxy.embedded). Each test gets a database cloned from a template that
holds the `anonproxy` schema and the `adult` table, through pytest-postgresql's
DatabaseJanitor. The proxy is the real `anonproxy serve` command in a child
process, with two workers so that cancel requests cross workers.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psycopg
import pytest
from pytest_postgresql import factories
from pytest_postgresql.executors.noop import NoopExecutor
from pytest_postgresql.janitor import DatabaseJanitor

from anonproxy import demo, sample_data, schema
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.model import ColumnPolicy, Policy, ProtectedTable
from anonproxy.policy.yaml_policy import apply_policy
from anonproxy.views.hierarchies import load_adult_hierarchies

# Roles that exercise each authentication method the proxy must relay.
AUTH_ROLES = {"scram_user": "scram-sha-256", "md5_user": "md5", "trust_user": "trust"}
TEST_DATABASE = "anonproxy_test"
# The database the gated proxy's policy governs: the demo policy over a copy of the template.
GATED_DATABASE = "anonproxy_gated"
SERVICE_ROLE = "anonproxy_service"


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def dsn(self, dbname: str, user: str = "scram_user", password: str | None = None) -> str:
        password = user if password is None else password
        return f"host={self.host} port={self.port} dbname={dbname} user={user} password={password}"

    def url(self, dbname: str, user: str = "scram_user", password: str | None = None) -> str:
        password = user if password is None else password
        return f"postgresql://{user}:{password}@{self.host}:{self.port}/{dbname}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def pg_server() -> Iterator[EmbeddedPostgres]:
    hba = [f"host all {role} 127.0.0.1/32 {method}" for role, method in AUTH_ROLES.items() if method != "scram-sha-256"]
    with EmbeddedPostgres(hba_extra=hba) as server:
        with psycopg.connect(server.conninfo(), autocommit=True) as conn:
            for role, method in AUTH_ROLES.items():
                encryption = "md5" if method == "md5" else "scram-sha-256"
                conn.execute(f"SET password_encryption = '{encryption}'")
                conn.execute(f"DROP ROLE IF EXISTS {role}")
                conn.execute(f"CREATE ROLE {role} LOGIN SUPERUSER PASSWORD '{role}'")
        yield server


@pytest.fixture(scope="session")
def pg_template(pg_server: EmbeddedPostgres) -> Iterator[NoopExecutor]:
    """The server as pytest-postgresql sees it, with a template database of sample data."""
    executor = NoopExecutor(
        host=pg_server.host, port=pg_server.port, user=pg_server.superuser,
        password=pg_server.password, dbname=TEST_DATABASE, options="",
    )
    janitor = DatabaseJanitor(
        user=executor.user, host=executor.host, port=executor.port, dbname=executor.template_dbname,
        password=executor.password,
    )
    with janitor:
        with psycopg.connect(pg_server.conninfo(dbname=executor.template_dbname)) as conn:
            schema.install(conn)
            sample_data.load_demo(conn)
            load_adult_hierarchies(conn)
            demo.create_demo_roles(conn, executor.template_dbname)
        yield executor


# A fresh database per test, cloned from the template; a superuser connection to it.
postgresql = factories.postgresql("pg_template")


@pytest.fixture
def dbname(postgresql: psycopg.Connection) -> str:
    postgresql.commit()
    return postgresql.info.dbname


@pytest.fixture(scope="session")
def direct(pg_server: EmbeddedPostgres) -> Endpoint:
    return Endpoint(pg_server.host, pg_server.port)


@dataclass
class ProxyProcess:
    endpoint: Endpoint
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_proxy(upstream: str, log_path: Path, *, host: str = "127.0.0.1", port: int = 0,
                command_prefix: Sequence[str] = (), **settings: str) -> ProxyProcess:
    """Run `anonproxy serve` configured through the environment; wait until it accepts clients. ``host`` and
    ``port`` (0: a free one) are where it listens; ``command_prefix`` runs it elsewhere (``ip netns exec NAME``)."""
    port = port or free_port()
    env = {**os.environ, "ANONPROXY_LISTEN_HOST": host, "ANONPROXY_LISTEN_PORT": str(port),
           "ANONPROXY_UPSTREAM": upstream, **{f"ANONPROXY_{k.upper()}": v for k, v in settings.items()}}
    log_file = log_path.open("wb")
    process = subprocess.Popen([*command_prefix, sys.executable, "-m", "anonproxy.cli", "serve"], env=env,
                               stdout=log_file, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90  # a loaded machine takes long to import
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"anonproxy did not start:\n{log_path.read_text()}")
            time.sleep(0.05)
    return ProxyProcess(Endpoint(host, port), process, log_path)


def stop_proxy(proxy: ProxyProcess) -> None:
    proxy.process.send_signal(signal.SIGTERM)
    try:
        proxy.process.wait(15)
    except subprocess.TimeoutExpired:
        proxy.process.kill()
        raise


@pytest.fixture(scope="session")
def proxy_process(pg_server: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    log_path = tmp_path_factory.mktemp("proxy") / "anonproxy.log"
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", log_path, workers="2", log_level="debug")
    yield proxy
    stop_proxy(proxy)
    # Whatever the tests threw at it, the proxy never crashed into a traceback.
    assert "Traceback" not in proxy.log(), proxy.log()
    assert proxy.process.returncode == 0, proxy.log()


@pytest.fixture(scope="session")
def proxy(proxy_process: ProxyProcess) -> Endpoint:
    return proxy_process.endpoint


def govern_by_demo_policy(conn: psycopg.Connection, dbname: str) -> None:
    """The demo roles, the service login (password = its name) and the demo policy, in database ``dbname``."""
    demo.govern_by_demo_policy(conn, dbname, SERVICE_ROLE, SERVICE_ROLE)


def create_database(pg_server: EmbeddedPostgres, pg_template: NoopExecutor, dbname: str) -> None:
    """Database ``dbname`` made anew from the template (the anonproxy schema and the sample data)."""
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
        conn.execute(f"drop database if exists {dbname}")
        conn.execute(f"create database {dbname} template {pg_template.template_dbname}")


def database_of_its_own(dbname: str, prepare: Callable[[psycopg.Connection], Policy]) -> Callable[..., Any]:
    """Fixture ``owner`` for a test module: a database of its own, ``dbname``, made from the template and governed
    by the demo policy, where ``prepare`` (given a connection in a transaction) creates the module's tables and
    returns the policy to apply, usually the demo's with its linked tables; then a superuser connection to it
    (autocommit) for the module, and the database dropped after it. Use: ``owner = database_of_its_own("db", tables)``.
    """

    @pytest.fixture(scope="module", name="owner")
    def owner(pg_server: EmbeddedPostgres, pg_template: NoopExecutor) -> Iterator[psycopg.Connection]:
        create_database(pg_server, pg_template, dbname)
        with psycopg.connect(pg_server.conninfo(dbname=dbname)) as conn:
            govern_by_demo_policy(conn, dbname)
            apply_policy(conn, prepare(conn))
            conn.commit()
        with psycopg.connect(pg_server.conninfo(dbname=dbname), autocommit=True) as conn:
            yield conn
        with psycopg.connect(pg_server.conninfo(), autocommit=True) as conn:
            conn.execute(f"drop database {dbname} with (force)")

    return owner


def unit_of_type(conn: psycopg.Connection, name: str, unit_type: str) -> ProtectedTable:
    """An empty protected table ``name`` whose unit ``id`` is of ``unit_type``, for linked tables whose key is of that
    type: a linked key must compare as its unit does (anonproxy/plan/tables.py), so a test of a unit type links its
    tables to a unit of that type rather than to adult's integer id."""
    conn.execute(f"create table {name} (id {unit_type})")
    return ProtectedTable(name, "id", {"id": ColumnPolicy("id", "identifier")})


def lone_person(conn: psycopg.Connection) -> tuple[int, int, int]:
    """In ``conn``'s public.adult: the lowest age only one person has, their id, and a person of age 40 of the other
    sex (the HAVING attacks swap the two people's sexes and compare the answers)."""
    row = conn.execute("SELECT min(age) FROM (SELECT age FROM public.adult GROUP BY 1 HAVING count(*) = 1) AS ages"
                       ).fetchone()
    assert row is not None and row[0] is not None
    person = conn.execute("SELECT id, sex FROM public.adult WHERE age = %s", (row[0],)).fetchone()
    assert person is not None
    other = conn.execute("SELECT min(id) FROM public.adult WHERE age = 40 AND sex <> %s", (person[1],)).fetchone()
    assert other is not None and other[0] is not None
    return int(row[0]), int(person[0]), int(other[0])


def swap_sexes(conn: psycopg.Connection, one: int, other: int) -> None:
    """Give people ``one`` and ``other`` of public.adult each other's sex."""
    conn.execute("UPDATE public.adult a SET sex = b.sex FROM public.adult b WHERE a.id IN (%s, %s) "
                 "AND b.id IN (%s, %s) AND a.id <> b.id", (one, other, one, other))


def reporter_through_own_proxy(dbname: str, name: str = "reporter") -> Callable[..., Any]:
    """Fixture ``name`` for a module whose ``owner`` is :func:`database_of_its_own`: the demo's reporter (k 10,
    dominance (2, 85 %), p 10 %, a rest row) through a proxy of that database's own (one worker), once it reads the
    current policy; the proxy's log must hold no traceback. Use: ``reporter = reporter_through_own_proxy("db")``."""

    @pytest.fixture(scope="module", name=name)
    def reporter(owner: psycopg.Connection, pg_server: EmbeddedPostgres,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[psycopg.Connection]:
        with proxy_of_its_own(owner, pg_server, dbname, tmp_path_factory.mktemp(dbname) / "anonproxy.log") as proxy, \
                psycopg.connect(proxy.endpoint.dsn(dbname, user="reporter"), autocommit=True) as conn:
            yield conn

    return reporter


@contextmanager
def proxy_of_its_own(owner: psycopg.Connection, pg_server: EmbeddedPostgres, dbname: str, log_path: Path,
                     **settings: str) -> Iterator[ProxyProcess]:
    """A proxy (one worker unless ``settings`` say otherwise) of database ``dbname``, its service login in it, once it
    reads ``owner``'s current policy; stopped after, and its log must then hold no traceback."""
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", log_path, **{
        "workers": "1", "service_dsn": f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={dbname}", **settings})
    try:
        wait_for_current_policy(owner, proxy.endpoint, dbname)
        yield proxy
    finally:
        stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()


@pytest.fixture(scope="session")
def gated_database(pg_server: EmbeddedPostgres, pg_template: NoopExecutor) -> str:
    """A database under the demo policy (reporter: suppress, k = 10; analyst: dp; dba: direct)."""
    create_database(pg_server, pg_template, GATED_DATABASE)
    with psycopg.connect(pg_server.conninfo(dbname=GATED_DATABASE)) as conn:
        govern_by_demo_policy(conn, GATED_DATABASE)
        conn.commit()
    return GATED_DATABASE


@pytest.fixture(scope="module")
def truth(pg_server: EmbeddedPostgres, gated_database: str) -> Iterator[psycopg.Connection]:
    """The gated database itself, as its superuser (autocommit): what the data really holds, and PostgreSQL's own
    answers as any role (SET ROLE)."""
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as conn:
        yield conn


@pytest.fixture(scope="session")
def gated_proxy_process(pg_server: EmbeddedPostgres, gated_database: str,
                        tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    log_path = tmp_path_factory.mktemp("gated") / "anonproxy.log"
    proxy = start_proxy(f"host={pg_server.host} port={pg_server.port}", log_path, workers="2", log_level="debug",
                        service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={gated_database}")
    yield proxy
    stop_proxy(proxy)
    assert "Traceback" not in proxy.log(), proxy.log()
    assert proxy.process.returncode == 0, proxy.log()


@pytest.fixture(scope="session")
def gated_proxy(gated_proxy_process: ProxyProcess) -> Endpoint:
    """The proxy with a service login: roles are gated as the policy of `gated_database` says."""
    return gated_proxy_process.endpoint


def wait_for_version(conn: psycopg.Connection, version: int) -> None:
    """Until the worker serving ``conn`` has loaded policy ``version`` (other workers reload on their own)."""
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing: a loaded machine reloads slowly
    while int(conn.execute("show anonproxy.policy_version").fetchone()[0]) < version:
        assert time.monotonic() < deadline, "the proxy did not reload the policy"
        time.sleep(0.05)


def wait_for_policy(proxy: Endpoint, dbname: str, version: int) -> None:
    """Until every worker of the proxy has loaded policy ``version``: a role must not log in before its worker knows
    its mode (fresh connections land on any worker; ten in a row must all know it)."""
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing: a loaded machine reloads slowly
    seen = 0
    while seen < 10:
        with psycopg.connect(proxy.dsn(dbname, user="reporter"), autocommit=True) as conn:
            current = int(conn.execute("show anonproxy.policy_version").fetchone()[0])
        seen = seen + 1 if current >= version else 0
        assert time.monotonic() < deadline, "the proxy did not reload the policy"
        if current < version:
            time.sleep(0.05)


def wait_for_current_policy(owner: psycopg.Connection, proxy: Endpoint, dbname: str) -> None:
    """After a policy change made through ``owner`` (a connection to ``dbname``): until every worker has loaded it."""
    wait_for_policy(proxy, dbname, int(owner.execute("select version from anonproxy.policy_version").fetchone()[0]))


@contextmanager
def fresh_dp_role(owner: psycopg.Connection, proxy: Endpoint, dbname: str, role: str, epsilon: float = 2,
                  delta: float = 0.00001) -> Iterator[str]:
    """A login role in dp mode with a budget of its own on public.adult (``epsilon``/``delta`` in all, 0.5 and 1e-7 per
    query), known to every worker of ``proxy`` before it is used; dropped afterwards. ``owner`` is a superuser
    connection to ``dbname``."""
    owner.execute(f"create role {role} login password '{role}'")
    owner.execute("select anonproxy.set_role_policy(%s, 'dp')", [role])
    owner.execute("select anonproxy.set_budget(%s, 'public.adult'::regclass, %s::numeric, %s::numeric, null, 0.5, "
                  "0.0000001)",
                  [role, epsilon, delta])
    wait_for_policy(proxy, dbname, owner.execute("select version from anonproxy.policy_version").fetchone()[0])
    try:
        yield role
    finally:
        owner.execute("select anonproxy.drop_budget(%s, 'public.adult')", [role])
        owner.execute("select anonproxy.drop_role_policy(%s)", [role])
        owner.execute(f"drop owned by {role}")
        owner.execute(f"drop role {role}")


def corpus_roles(dp_role: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Fixtures ``reporter`` and ``analyst`` for a corpus test module: a connection (autocommit) through the gated
    proxy as ``reporter`` (suppress, k = 10), and one as a dp role of the module's own, named ``dp_role``, with
    budget for the whole corpus (ε 0.5 a question). Use: ``reporter, analyst = corpus_roles("dp_round10")``."""

    @pytest.fixture(scope="module", name="analyst")
    def analyst(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection]:
        with fresh_dp_role(truth, gated_proxy, gated_database, dp_role, epsilon=1000, delta=0.5) as role, \
                psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
            yield conn

    return _reporter("module"), analyst


def attack_roles(dp_role: str, epsilon: float = 20, scope: Literal["function", "module"] = "function",
                 timezone: str | None = None) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Fixtures ``reporter`` and ``analyst`` for an attack test module: a connection (autocommit) through the gated
    proxy as ``reporter`` (the demo's suppress role: k = 10, dominance (2, 85 %), p 10 %, a suppressed-rest row), and
    one as a dp role of the module's own with ``epsilon`` in all (0.5 a question), its session in ``timezone`` if
    given. Made anew for each test (each test then has a dp role of its own, ``dp_role`` and a number), or once for
    the module (``scope``; the role is then ``dp_role``). Use: ``reporter, analyst = attack_roles("dp_round10")``."""
    numbers = itertools.count(1)

    @pytest.fixture(scope=scope, name="analyst")
    def analyst(truth: psycopg.Connection, gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection]:
        name = dp_role if scope == "module" else f"{dp_role}_{next(numbers)}"
        with fresh_dp_role(truth, gated_proxy, gated_database, name, epsilon=epsilon) as role, \
                psycopg.connect(gated_proxy.dsn(gated_database, user=role), autocommit=True) as conn:
            if timezone is not None:
                conn.execute(f"set timezone = '{timezone}'")
            yield conn

    return _reporter(scope), analyst


def _reporter(scope: Literal["function", "module"]) -> Callable[..., Any]:
    """Fixture ``reporter``: a connection (autocommit) through the gated proxy as the demo's suppress role."""

    @pytest.fixture(scope=scope, name="reporter")
    def reporter(gated_proxy: Endpoint, gated_database: str) -> Iterator[psycopg.Connection]:
        with psycopg.connect(gated_proxy.dsn(gated_database, user="reporter"), autocommit=True) as conn:
            yield conn

    return reporter


def answer(conn: psycopg.Connection, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """The output column names and the rows of ``sql`` on ``conn``."""
    cursor = conn.execute(sql)
    return [column.name for column in cursor.description or []], cursor.fetchall()


def released_as_postgresql(got: list[tuple[Any, ...]], expected: list[tuple[Any, ...]], complete: bool) -> None:
    """The released rows are PostgreSQL's: all of them when no group is small; else some groups are withheld (and
    a rest row, its key NULL, may hold them)."""
    if complete:
        assert Counter(got) == Counter(expected)
        return
    released = Counter(row for row in got if row[0] is not None)
    assert released and not released - Counter(expected), (got, expected)
    assert released.total() < len(expected), "some group is withheld: why the statement is marked incomplete"


def suppress_answers_as_postgresql(reporter: psycopg.Connection, truth: psycopg.Connection, sql: str,
                                   complete: bool = True) -> None:
    """A corpus statement as ``reporter`` (suppress): PostgreSQL's column names, and its rows (``complete``) or only
    rows of PostgreSQL's, some groups withheld (:func:`released_as_postgresql`)."""
    names, got = answer(reporter, sql)
    expected_names, expected = answer(truth, sql)
    assert names == expected_names
    released_as_postgresql(got, expected, complete)


def dp_answers(analyst: psycopg.Connection, truth: psycopg.Connection, sql: str) -> None:
    """A corpus statement as a dp role: answered, with PostgreSQL's column names and at least one row."""
    names, got = answer(analyst, sql)
    assert names == answer(truth, sql)[0]
    assert got, "every statement of the corpus has rows in the demo data"


class Up:
    """`anonproxy up` in a child process, read until it prints its connection strings."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "anonproxy", "up", *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        self.urls: dict[str, str] = {}
        deadline = time.monotonic() + 90
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            parts = line.split()
            if len(parts) >= 2 and parts[1].startswith("postgresql://"):
                self.urls[parts[0]] = parts[1]
            if "Press Ctrl-C" in line or time.monotonic() > deadline:
                break
        assert set(self.urls) == {"dba", "reporter", "analyst", "auditor", "owner"}, "".join(self.output)

    @property
    def text(self) -> str:
        return "".join(self.output)

    def stop(self) -> str:
        self.process.send_signal(signal.SIGTERM)
        rest, _ = self.process.communicate(timeout=30)
        assert self.process.returncode == 0, self.text + rest
        return self.text + rest
