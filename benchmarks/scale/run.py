#!/usr/bin/env python3
"""Many proxies behind HAProxy: gated throughput against the physical limit, and the CPU each statement costs.

1, 2 and 4 ``anonproxy serve`` run on hosts of their own (network namespaces joined by veth links, as the tests
make them: tests/netns.py) behind HAProxy (TCP mode, round robin, PROXY protocol v2, health checks), in front of one
throwaway PostgreSQL set up like ``anonproxy up``. pgbench is the client: ``--clients`` sessions, each running
dashboard bursts of ``--burst`` statements, for ``--seconds`` per phase. Per number of proxies:

- ``suppress``: the reporter's seen suppress statements (a mix of BI shapes) through the balancer;
- ``service``: the same statements as the proxy rewrites them, sent straight to PostgreSQL by the service login at
  the same concurrency — what the database itself can do, the physical limit of the gated path;
- ``dp``: the analyst's new questions (a new constant every statement, so each is planned and charged): statements
  per second is ledger charges per second;
- ``relay``: the dba's statements (relayed untouched) through the balancer, for comparison;
- ``policy``: ``--policy-changes`` policy changes, each timed from its commit until every worker of every proxy has
  logged that it loaded it.

It reports statements per second, p50/p99 of a burst, the ratio suppress/service, and the CPU seconds the proxies
used per statement (their whole process trees, from /proc). Run as root (namespaces, PostgreSQL as postgres).
See README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the namespaces, made as the tests make them
sys.path.insert(0, str(REPO / "benchmarks" / "passthrough"))

from netns import Host, hosts  # noqa: E402
from targets import free_port, process_tree_cpu_seconds  # noqa: E402

from anonproxy import demo, sample_data, schema  # noqa: E402
from anonproxy.embedded import EmbeddedPostgres  # noqa: E402
from anonproxy.policy.store import load_policy  # noqa: E402
from anonproxy.policy.yaml_policy import apply_policy, demo_policy  # noqa: E402
from anonproxy.route.decide import decide  # noqa: E402
from anonproxy.route.decision import Rewrite

NET = 211  # links 10.211.<i>.0/24 (the tests use 10.210)
PORT = 6432
DATABASE = "postgres"
SUPPRESS = [
    "select education, count(*) from adult group by education",
    "select sex, race, count(*) from adult group by sex, race",
    "select occupation, sum(capital_gain), avg(hours_per_week) from adult group by occupation",
    "select education, count(*) from adult where age between 30 and 49 and sex = 'Female' group by education",
    "select native_country, count(*) from adult group by native_country having count(*) > 100",
    "select occupation, count(*) as n from adult group by occupation order by n desc limit 5",
    "select workclass, count(*), count(*) * 100.0 / sum(count(*)) over () as share from adult group by workclass",
    "select count(*) from adult where age > 30",
    "select education, round(avg(hours_per_week), 1) from adult group by education",
    "select age / 10 * 10 as decade, count(*) from adult group by 1 order by 1",
]
DP = "select education, count(*) from adult where fnlwgt > :n{i} group by education"
RELAY = "select count(*) from adult where age > {age}"


@dataclass(frozen=True)
class Phase:
    name: str
    user: str
    target: tuple[str, int]
    script: str


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if os.geteuid() != 0:
        print("run as root: it makes network namespaces and runs PostgreSQL as the postgres user", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so that the namespaces, proxies and server are removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    report = run(args)
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--proxies", default="1,2,4", help="numbers of proxies, one measurement each (default 1,2,4)")
    parser.add_argument("--clients", type=int, default=200, help="pgbench sessions (default 200)")
    parser.add_argument("--burst", type=int, default=20, help="statements per burst (default 20)")
    parser.add_argument("--seconds", type=int, default=20, help="seconds per phase (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured seconds before each phase (default 3)")
    parser.add_argument("--policy-changes", type=int, default=10, help="policy changes timed (default 10)")
    parser.add_argument("--workers", type=int, default=1, help="workers per proxy (default 1)")
    parser.add_argument("--json", help="write the figures to this file")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = sorted({int(n) for n in args.proxies.split(",")})
    report: dict[str, Any] = {"clients": args.clients, "burst": args.burst, "seconds": args.seconds,
                              "workers_per_proxy": args.workers, "cores": os.cpu_count(), "runs": []}
    with ExitStack() as stack:
        links = stack.enter_context(hosts(NET, max(counts)))
        server = stack.enter_context(_database(links, args.clients))
        service_dsn, rewritten = _prepare(server)
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-scale-")))
        os.chmod(work, 0o755)
        suppress_script = _script(work / "suppress.sql", _burst(SUPPRESS, args.burst))
        service_script = _script(work / "service.sql", _burst(rewritten, args.burst))
        dp_script = _script(work / "dp.sql", _dp_burst(args.burst))
        relay_script = _script(work / "relay.sql", _burst([RELAY.format(age=age) for age in range(20, 60, 4)],
                                                          args.burst))
        service_user = psycopg.conninfo.conninfo_to_dict(service_dsn)
        direct = (server.host, server.port)
        for count in counts:
            _progress(f"{count} prox{'y' if count == 1 else 'ies'}")
            with _proxies(links[:count], server, service_dsn, args.workers, work) as pids, \
                    _balancer(links[:count], work) as balancer:
                run_report: dict[str, Any] = {"proxies": count, "phases": {}}
                for phase in (Phase("suppress", "reporter", balancer, suppress_script),
                              Phase("service", str(service_user["user"]), direct, service_script),
                              Phase("dp", "analyst", balancer, dp_script),
                              Phase("relay", "dba", balancer, relay_script)):
                    password = str(service_user["password"]) if phase.name == "service" else phase.user
                    _pgbench(phase, password, args, work, args.warmup)  # every worker has seen the statements
                    charges = _charges(server)
                    cpu = sum(process_tree_cpu_seconds(pid) for pid in pids)
                    figures = _pgbench(phase, password, args, work, args.seconds)
                    figures["proxy_cpu_ms_per_statement"] = (
                        1000 * (sum(process_tree_cpu_seconds(pid) for pid in pids) - cpu) / figures["statements"]
                        if phase.name != "service" and figures["statements"] else None)
                    figures["charges_per_second"] = (_charges(server) - charges) / figures["seconds"]
                    run_report["phases"][phase.name] = figures
                    _progress(f"  {phase.name}: {figures['statements_per_second']:.0f} statements/s, burst p50 "
                              f"{figures['burst_p50_ms']:.0f} ms, p99 {figures['burst_p99_ms']:.0f} ms")
                run_report["policy_reach_ms"] = _policy_reach(server, work, links[:count], args.policy_changes)
                _progress(f"  policy: every worker within {max(run_report['policy_reach_ms']):.0f} ms")
                phases = run_report["phases"]
                run_report["suppress_over_service"] = (phases["suppress"]["statements_per_second"]
                                                       / phases["service"]["statements_per_second"])
                report["runs"].append(run_report)
    return report


@contextmanager
def _database(links: list[Host], clients: int) -> Iterator[EmbeddedPostgres]:
    listen = ",".join(["127.0.0.1", *sorted({link.outside for link in links})])
    settings = {"listen_addresses": listen, "max_connections": str(3 * clients + 200), "shared_buffers": "256MB"}
    with EmbeddedPostgres(hba_extra=[f"host all all 10.{NET}.0.0/16 scram-sha-256"], settings=settings) as server:
        yield server


def _prepare(server: EmbeddedPostgres) -> tuple[str, list[str]]:
    """As `anonproxy up` does, with an analyst budget that thousands of charges do not exhaust; returns the service
    login's DSN and the reporter's statements as the proxy rewrites them."""
    policy = demo_policy()
    with psycopg.connect(server.conninfo(dbname=DATABASE)) as conn:
        schema.install(conn)
        sample_data.load_demo(conn)
        demo.create_demo_roles(conn, DATABASE)
        password = demo.reset_service_role(conn, policy.service_role)
        apply_policy(conn, policy)
        conn.execute("select anonproxy.set_budget('analyst', 'public.adult'::regclass, 1000000, 0.001, null, 0.5, "
                     "0.0000001)")
        conn.commit()
        loaded = load_policy(conn)
    role = loaded.roles["reporter"]
    rewritten = []
    for statement in SUPPRESS:
        decision = decide(statement, role, loaded)
        if not isinstance(decision, Rewrite):
            raise RuntimeError(f"the reporter's statement is not rewritten: {statement}")
        rewritten.append(decision.runs)
    return psycopg.conninfo.make_conninfo(user=policy.service_role, password=password, dbname=DATABASE), rewritten


@contextmanager
def _proxies(links: list[Host], server: EmbeddedPostgres, service_dsn: str, workers: int, work: Path
             ) -> Iterator[list[int]]:
    """One ``anonproxy serve`` per host; yields their process ids once each has loaded the policy."""
    processes = []
    try:
        for link in links:
            env = {key: value for key, value in os.environ.items() if not key.startswith("ANONPROXY_")}
            env |= {"PYTHONPATH": str(REPO), "ANONPROXY_LISTEN_HOST": link.inside, "ANONPROXY_LISTEN_PORT": str(PORT),
                    "ANONPROXY_UPSTREAM": f"host={link.outside} port={server.port}",
                    "ANONPROXY_SERVICE_DSN": service_dsn, "ANONPROXY_WORKERS": str(workers),
                    "ANONPROXY_LOG_LEVEL": "info", "ANONPROXY_TRUSTED_PROXIES": link.outside}
            log = (work / f"{link.namespace}.log").open("wb")
            processes.append(subprocess.Popen([*link.command(), sys.executable, "-m", "anonproxy.cli", "serve"],
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
        for link in links:
            _wait_for_policy(f"host={link.inside} port={PORT} dbname={DATABASE} user=reporter password=reporter")
        yield [process.pid for process in processes]
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()


def _wait_for_policy(dsn: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(SUPPRESS[0]).fetchall()
                return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@contextmanager
def _balancer(links: list[Host], work: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    servers = "\n".join(f"    server proxy{i} {link.inside}:{PORT} send-proxy-v2 check check-send-proxy inter 1s"
                        for i, link in enumerate(links, 1))
    config = work / "haproxy.cfg"
    config.write_text(f"""
global
    maxconn 4000
defaults
    mode tcp
    timeout connect 5s
    timeout client 300s
    timeout server 300s
frontend postgres
    bind 127.0.0.1:{port}
    maxconn 4000
    default_backend proxies
backend proxies
    balance roundrobin
    option pgsql-check user dba
{servers}
""")
    log = (work / "haproxy.log").open("wb")
    process = subprocess.Popen([shutil.which("haproxy") or "haproxy", "-db", "-f", str(config)],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_policy(f"host=127.0.0.1 port={port} dbname={DATABASE} user=reporter password=reporter")
        yield ("127.0.0.1", port)
    finally:
        process.terminate()
        process.wait(10)


def _policy_reach(server: EmbeddedPostgres, work: Path, links: list[Host], changes: int) -> list[float]:
    """For each policy change: ms from its commit until the last worker of every proxy logged that it loaded it."""
    logs = [work / f"{link.namespace}.log" for link in links]
    workers = [len(set(LOADED.findall(log.read_text()))) for log in logs]
    reach = []
    with psycopg.connect(server.conninfo(dbname=DATABASE), autocommit=True) as conn:
        if conn.execute("select count(*) from pg_roles where rolname = 'policy_probe'").fetchone()[0] == 0:
            conn.execute("create role policy_probe")  # (the next number of proxies reuses it)
        for change in range(changes):
            conn.execute("select anonproxy.set_role_policy('policy_probe', %s)", ["deny" if change % 2 else "dp"])
            committed = datetime.now()
            version = conn.execute("select version from anonproxy.policy_version").fetchone()[0]
            deadline = time.monotonic() + 60
            while True:
                loads = [_loads(log.read_text(), version) for log in logs]
                if all(len(found) == count for found, count in zip(loads, workers)):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"policy version {version} did not reach every worker in 60 s: {loads}")
                time.sleep(0.02)
            last = max(at for found in loads for at in found.values())
            reach.append(max(0.0, (last - committed).total_seconds() * 1000))
    return reach


LOADED = re.compile(r"^\S+ \S+ \w+ \[(\d+)\] anonproxy\.policy: policy version \d+ loaded", re.M)


def _loads(log: str, version: int) -> dict[int, datetime]:
    pattern = re.compile(rf"^(\S+ \S+) \w+ \[(\d+)\] anonproxy\.policy: policy version {version} loaded", re.M)
    return {int(pid): datetime.strptime(at, "%Y-%m-%d %H:%M:%S,%f") for at, pid in pattern.findall(log)}


def _burst(statements: list[str], size: int) -> str:
    return "".join(f"{statements[i % len(statements)]};\n" for i in range(size))


def _dp_burst(size: int) -> str:
    """New questions: each statement of each burst gets a constant of its own."""
    sets = "".join(f"\\set n{i} random(1, 2000000000)\n" for i in range(size))
    return sets + "".join(DP.format(i=i) + ";\n" for i in range(size))


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o644)
    return path


def _charges(server: EmbeddedPostgres) -> int:
    with psycopg.connect(server.conninfo(dbname=DATABASE)) as conn:
        return int(conn.execute("select count(*) from anonproxy.budget_ledger").fetchone()[0])


def _pgbench(phase: Phase, password: str, args: argparse.Namespace, work: Path, seconds: int) -> dict[str, Any]:
    logs = work / f"log-{phase.name}"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    host, port = phase.target
    command = [_pgbench_binary(), "-n", "-M", "simple", "-c", str(args.clients), "-j", "2", "-T", str(seconds),
               "-f", str(phase.script), "--log", "--log-prefix", str(logs / "burst"), "-h", host, "-p", str(port),
               "-U", phase.user, DATABASE]
    started = time.monotonic()
    done = subprocess.run(command, env={**os.environ, "PGPASSWORD": password}, capture_output=True, text=True,
                          cwd=work)
    elapsed = time.monotonic() - started  # pgbench lets the bursts under way at the end finish: longer than -T
    if done.returncode != 0:
        raise RuntimeError(f"pgbench {phase.name} failed:\n{done.stderr[-3000:]}")
    bursts = sorted(int(line.split()[2]) for path in logs.iterdir() for line in path.read_text().splitlines())
    statements = len(bursts) * args.burst
    return {"bursts": len(bursts), "statements": statements, "seconds": elapsed,
            "statements_per_second": statements / elapsed,
            "burst_p50_ms": _rank(bursts, 0.5) / 1000, "burst_p99_ms": _rank(bursts, 0.99) / 1000}


def _pgbench_binary() -> str:
    found = shutil.which("pgbench")
    if found is None:
        raise RuntimeError("pgbench is not installed (Debian: postgresql-contrib)")
    return found


def _rank(ordered: list[int], fraction: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


def _print(report: dict[str, Any]) -> None:
    print(f"\n{report['clients']} clients, bursts of {report['burst']} statements, {report['seconds']} s per phase, "
          f"{report['workers_per_proxy']} worker(s) per proxy, {report['cores']} cores")
    print("proxies | phase    | statements/s | burst p50 ms | burst p99 ms | proxy CPU ms/statement | charges/s")
    for run_report in report["runs"]:
        for name, figures in run_report["phases"].items():
            cpu = figures["proxy_cpu_ms_per_statement"]
            print(f"{run_report['proxies']:>7} | {name:<8} | {figures['statements_per_second']:>12.0f} | "
                  f"{figures['burst_p50_ms']:>12.0f} | {figures['burst_p99_ms']:>12.0f} | "
                  f"{'' if cpu is None else f'{cpu:.2f}':>22} | {figures['charges_per_second']:>9.0f}")
        reach = sorted(run_report["policy_reach_ms"])
        print(f"{run_report['proxies']:>7} | suppress / service: {run_report['suppress_over_service']:.2f}; a policy "
              f"change reached every worker in {reach[len(reach) // 2]:.0f} ms (median), {reach[-1]:.0f} ms (max)")


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
