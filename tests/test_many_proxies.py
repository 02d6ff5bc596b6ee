"""Several proxies in front of one database, behind HAProxy, each on a host of its own.

Two `anonproxy serve` (two workers each) run in network namespaces made by the test (tests/netns.py: a veth link
each, as if on separate machines); a PostgreSQL of this module's own listens on this machine's side of both links;
HAProxy (TCP mode, round robin, PROXY protocol v2, health checks) is the one address clients know. What must hold
across proxies: the audit trail of every proxy names the real client and misses no statement; a policy change reaches
every worker of every proxy; charges sent through all proxies at once never overspend a budget; a proxy that dies is
taken out of rotation and the others go on.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
from conftest import (
    SERVICE_ROLE,
    Endpoint,
    ProxyProcess,
    free_port,
    govern_by_demo_policy,
    start_proxy,
    stop_proxy,
)
from haproxy import server_states
from netns import Host, hosts

from anonproxy import sample_data, schema
from anonproxy.embedded import EmbeddedPostgres

NET = 210  # the links are 10.210.<i>.0/24
PROXIES = 2
WORKERS = 2
PORT = 6432  # each proxy on its own host, so the same port
DATABASE = "anonproxy_many"
AGG = "select sex, count(*) from adult group by sex order by sex"
POLICY_REACH = 30  # seconds: "every worker of every proxy has it", generous (docs/scale.md states what is measured)


@pytest.fixture(scope="module")
def links() -> Iterator[list[Host]]:
    with hosts(NET, PROXIES) as made:
        yield made


@pytest.fixture(scope="module")
def database(links: list[Host]) -> Iterator[EmbeddedPostgres]:
    listen = ",".join(["127.0.0.1", *sorted({link.outside for link in links})])
    with EmbeddedPostgres(hba_extra=[f"host all all 10.{NET}.0.0/16 scram-sha-256"],
                          settings={"listen_addresses": listen}) as server:
        with psycopg.connect(server.conninfo(), autocommit=True) as conn:
            conn.execute(f"create database {DATABASE}")
            conn.execute("create role scram_user login superuser password 'scram_user'")
        with psycopg.connect(server.conninfo(dbname=DATABASE)) as conn:
            schema.install(conn)
            sample_data.load_demo(conn)
            govern_by_demo_policy(conn, DATABASE)
            conn.commit()
        yield server


@pytest.fixture(scope="module")
def proxies(links: list[Host], database: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[list[ProxyProcess]]:
    started = []
    try:
        for link in links:
            started.append(start_proxy(
                f"host={link.outside} port={database.port}", tmp_path_factory.mktemp(link.namespace) / "anonproxy.log",
                host=link.inside, port=PORT, command_prefix=link.command(), workers=str(WORKERS),
                log_level="debug", trusted_proxies=link.outside,
                peers=",".join(f"{other.inside}:{PORT}" for other in links if other != link),
                service_dsn=f"user={SERVICE_ROLE} password={SERVICE_ROLE} dbname={DATABASE}"))
        yield started
    finally:
        for proxy in started:
            if proxy.process.poll() is None:
                stop_proxy(proxy)
    for proxy in started:
        assert "Traceback" not in proxy.log(), proxy.log()


class Balancer:
    def __init__(self, backends: list[Endpoint], directory: Path) -> None:
        self.endpoint = Endpoint("127.0.0.1", free_port())
        self.stats = directory / "stats.sock"
        servers = "\n".join(f"    server proxy{i} {b.host}:{b.port} send-proxy-v2 check check-send-proxy inter 300 "
                            "fall 2 rise 1" for i, b in enumerate(backends, 1))
        config = directory / "haproxy.cfg"
        config.write_text(f"""
global
    stats socket {self.stats} level admin
defaults
    mode tcp
    timeout connect 5s
    timeout client 120s
    timeout server 120s
frontend postgres
    bind {self.endpoint.host}:{self.endpoint.port}
    default_backend proxies
backend proxies
    balance roundrobin
    option pgsql-check user scram_user
{servers}
""")
        self.process = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT)

    def status(self) -> dict[str, str]:
        """Each proxy's status."""
        return {server: state for (_, server), state in server_states(self.stats).items()}

    def wait_for(self, expected: dict[str, str]) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                if self.status() == expected:
                    return
            except OSError:
                pass
            assert self.process.poll() is None and time.monotonic() < deadline, f"HAProxy: {self.status()}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def balancer(proxies: list[ProxyProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Balancer]:
    made = Balancer([proxy.endpoint for proxy in proxies], tmp_path_factory.mktemp("haproxy"))
    made.wait_for({f"proxy{i}": "UP" for i in range(1, PROXIES + 1)})
    yield made
    made.process.terminate()
    made.process.wait(10)


def owner(database: EmbeddedPostgres) -> psycopg.Connection:
    return psycopg.connect(database.conninfo(dbname=DATABASE), autocommit=True)


def test_sessions_spread_over_the_proxies_and_the_trail_names_each_client(balancer: Balancer,
                                                                           database: EmbeddedPostgres,
                                                                           links: list[Host]) -> None:
    seen_from = set()
    for _ in range(2 * PROXIES):
        with psycopg.connect(balancer.endpoint.dsn(DATABASE)) as conn:  # a direct role: relayed
            seen_from.add(str(conn.execute("select inet_client_addr()").fetchone()[0]))
    assert seen_from == {link.inside for link in links}  # the server sees each proxy's host
    sent = {}
    for number in range(2 * PROXIES):
        statement = f"{AGG} -- client {number}"
        with psycopg.connect(balancer.endpoint.dsn(DATABASE, "reporter")) as conn:
            assert conn.execute(statement).fetchall()
            with socket.socket(fileno=conn.pgconn.socket) as sock:
                sent[statement] = sock.getsockname()[1]
                sock.detach()
    with owner(database) as conn:
        rows = conn.execute("select statement, host(client_addr), client_port, session_id from anonproxy.audit_trail "
                            "where statement like %s", [f"{AGG} -- client %"]).fetchall()
    assert sorted((statement, addr, port) for statement, addr, port, _ in rows) == sorted(
        (statement, "127.0.0.1", port) for statement, port in sent.items())


def _loads(log: str, version: int) -> dict[int, datetime]:
    """When each worker (by process id) logged that it loaded policy ``version``."""
    pattern = re.compile(rf"^(\S+ \S+) \w+ \[(\d+)\] anonproxy\.policy: policy version {version} loaded", re.M)
    return {int(pid): datetime.strptime(at, "%Y-%m-%d %H:%M:%S,%f") for at, pid in pattern.findall(log)}


def test_a_policy_change_reaches_every_worker_of_every_proxy(balancer: Balancer, database: EmbeddedPostgres,
                                                            proxies: list[ProxyProcess]) -> None:
    with owner(database) as conn:
        conn.execute("create role policy_probe login password 'policy_probe'")
        conn.execute("select anonproxy.set_role_policy('policy_probe', 'deny')")
        version = conn.execute("select version from anonproxy.policy_version").fetchone()[0]
    deadline = time.monotonic() + POLICY_REACH
    while not all(len(_loads(proxy.log(), version)) == WORKERS for proxy in proxies):
        assert time.monotonic() < deadline, [_loads(proxy.log(), version) for proxy in proxies]
        time.sleep(0.1)
    # And it is in force: the role is denied through every proxy.
    for _ in range(2 * PROXIES):
        with pytest.raises(psycopg.OperationalError, match='role "policy_probe" may not connect through anonproxy'):
            psycopg.connect(balancer.endpoint.dsn(DATABASE, "policy_probe"))


def test_charges_through_every_proxy_at_once_never_overspend(balancer: Balancer, database: EmbeddedPostgres) -> None:
    role = "many_analyst"
    with owner(database) as conn:
        conn.execute(f"create role {role} login password '{role}'")
        conn.execute("select anonproxy.set_role_policy(%s, 'dp')", [role])
        conn.execute("select anonproxy.set_budget(%s, 'public.adult'::regclass, 3, 0.00001, null, 0.5, 0.0000001)",
                     [role])
        version = conn.execute("select version from anonproxy.policy_version").fetchone()[0]
    for _ in range(10 * PROXIES):  # every worker of every proxy knows the role before it asks
        with psycopg.connect(balancer.endpoint.dsn(DATABASE, "reporter")) as conn:
            if int(conn.execute("show anonproxy.policy_version").fetchone()[0]) < version:
                time.sleep(0.5)
    questions = [f"select count(*) from adult where age > {age}" for age in range(20, 80)]

    def ask(question: str) -> str:
        with psycopg.connect(balancer.endpoint.dsn(DATABASE, role)) as conn:
            try:
                conn.execute(question).fetchall()
                return "answered"
            except psycopg.Error as exc:
                return exc.sqlstate or "?"

    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(ask, questions))
    answered = outcomes.count("answered")
    assert set(outcomes) <= {"answered", "53400"}, outcomes
    assert 0 < answered < len(questions)  # the budget ran out part way, through both proxies at once
    with owner(database) as conn:
        budget = conn.execute("select epsilon_budget, epsilon_spent, rho_spent, rho_left from "
                              "anonproxy.remaining_budgets(%s)", [role]).fetchone()
        charges = conn.execute("select count(*) from anonproxy.budget_ledger where role_name = %s and epsilon > 0",
                               [role]).fetchone()[0]
        trail = dict(conn.execute("select decision, count(*) from anonproxy.audit_trail where login = %s "
                                  "and statement = any(%s) group by decision", [role, questions]).fetchall())
    epsilon_budget, epsilon_spent, _, rho_left = budget
    assert epsilon_spent <= epsilon_budget and (rho_left is None or rho_left >= 0)
    assert charges == answered  # no answer without its charge, no charge twice
    assert trail == {"answered": answered, "refused": len(questions) - answered}


def test_a_cancel_reaches_its_session_whichever_proxy_it_reaches(balancer: Balancer,
                                                                  proxies: list[ProxyProcess]) -> None:
    """A cancel request is a new connection: round robin sends it to the other proxy than its session's, which
    passes it to its peers."""
    for _ in range(2 * PROXIES):
        with psycopg.connect(balancer.endpoint.dsn(DATABASE), autocommit=True) as conn:
            conn.execute("set statement_timeout = '30s'")  # a lost cancel fails the test, not hangs it
            timer = threading.Timer(1.0, conn.cancel)
            timer.start()
            with pytest.raises(psycopg.errors.QueryCanceled, match="user request"):
                conn.execute("select pg_sleep(60)")
            timer.join()
    assert any("passed to its peers" in proxy.log() for proxy in proxies)


def test_a_proxy_that_dies_is_taken_out_and_the_others_go_on(balancer: Balancer, links: list[Host],
                                                             proxies: list[ProxyProcess]) -> None:
    pids = subprocess.run(["ip", "netns", "pids", links[0].namespace], capture_output=True, text=True,
                          check=True).stdout.split()
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    proxies[0].process.wait(10)
    balancer.wait_for({"proxy1": "DOWN", **{f"proxy{i}": "UP" for i in range(2, PROXIES + 1)}})
    for _ in range(2 * PROXIES):
        with psycopg.connect(balancer.endpoint.dsn(DATABASE, "reporter")) as conn:
            assert conn.execute(AGG).fetchall()
