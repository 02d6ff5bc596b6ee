#!/usr/bin/env python3
"""Many proxies behind HAProxy: gated throughput against the physical limit, and the CPU each statement costs.

1, 2 and 4 ``anonproxy serve`` run on hosts of their own (network namespaces joined by veth links, as the tests
make them: tests/netns.py) behind HAProxy (TCP mode, round robin, PROXY protocol v2, health checks), in front of one
throwaway PostgreSQL set up like ``anonproxy up`` and a hot standby streaming from it (made as benchmarks/failover
makes its standbys: tests/replication.py). pgbench is the client: ``--clients`` sessions, each running dashboard
bursts of ``--burst`` statements, for ``--seconds`` per phase. Per number of proxies, two variants in turn:
``primary`` (the proxies know only the primary; the standby streams but nobody reads it) and ``standby`` (the
proxies have it in ``standbys``, so suppress rewrites and dp measurements run there, and the primary's ledger
commits wait for it: synchronous_standby_names '*'). Per variant:

- ``suppress``: the reporter's seen suppress statements (a mix of BI shapes) through the balancer;
- ``service``: the same statements as the proxy rewrites them, sent straight by the service login, at the same
  concurrency, to the server where the proxies run them (the primary, or the standby) — what the database itself
  can do, the physical limit of the gated path;
- ``dp``: the analyst's new questions (a new constant every statement, so each is planned and charged): statements
  per second is ledger charges per second;
- ``relay``: the dba's statements (relayed untouched) through the balancer, for comparison;
- ``policy``: ``--policy-changes`` policy changes, each timed from its commit until every worker of every proxy has
  logged that it loaded it.

It reports statements per second, p50/p99 of a burst, the ratio suppress/service, the CPU the proxies (their whole
process trees), HAProxy and each server (its postmaster's tree, ended backends included) used per statement, and how
long the proxies waited for a core per statement, from /proc. ``--rounds`` repeats the phases; figures are medians.
Run as root (namespaces, PostgreSQL as postgres).
See README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
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
from replication import REPLICATION_HBA, set_synchronous, wait_replayed  # noqa: E402
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
VARIANTS = ("primary", "standby")


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
    parser.add_argument("--warmup", type=int, default=3,
                        help="unmeasured seconds before each phase's first round, a few sessions per proxy (default 3)")
    parser.add_argument("--policy-changes", type=int, default=10, help="policy changes timed (default 10)")
    parser.add_argument("--workers", type=int, default=1, help="workers per proxy (default 1)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of the phases per number of proxies and variant; medians (default 1)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="primary (no standby in the proxies' configuration), standby, or both (default)")
    parser.add_argument("--json", help="write the figures to this file")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = sorted({int(n) for n in args.proxies.split(",")})
    variants = [name for name in VARIANTS if name in args.variants.split(",")]
    report: dict[str, Any] = {"clients": args.clients, "burst": args.burst, "seconds": args.seconds,
                              "workers_per_proxy": args.workers, "rounds": args.rounds, "cores": os.cpu_count(),
                              "runs": []}
    with ExitStack() as stack:
        links = stack.enter_context(hosts(NET, max(counts)))
        primary = stack.enter_context(_database(links, args.clients))
        service_dsn, rewritten = _prepare(primary)
        standby = stack.enter_context(_standby(primary, links, args.clients))  # after _prepare: it has the data
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-scale-")))
        os.chmod(work, 0o755)
        scripts = {"suppress": _script(work / "suppress.sql", _burst(SUPPRESS, args.burst)),
                   "service": _script(work / "service.sql", _burst(rewritten, args.burst)),
                   "dp": _script(work / "dp.sql", _dp_burst(args.burst)),
                   "relay": _script(work / "relay.sql", _burst([RELAY.format(age=age) for age in range(20, 60, 4)],
                                                               args.burst))}
        for count in counts:
            for variant in variants:
                _progress(f"{count} prox{'y' if count == 1 else 'ies'}, {variant}")
                reads = standby if variant == "standby" else None
                set_synchronous(primary, reads is not None)  # the proxy lets dp roles in only if it is synchronous
                wait_replayed(primary, standby)
                run_report = _measure(args, links[:count], primary, reads, service_dsn, scripts, work)
                report["runs"].append({"proxies": count, "variant": variant, **run_report})
    return report


def _measure(args: argparse.Namespace, links: list[Host], primary: EmbeddedPostgres, standby: EmbeddedPostgres | None,
             service_dsn: str, scripts: dict[str, Path], work: Path) -> dict[str, Any]:
    """``--rounds`` rounds of the four phases and the policy changes through ``links``' proxies, reading on
    ``standby`` if there is one; each phase's figures are the medians over the rounds."""
    service_user = psycopg.conninfo.conninfo_to_dict(service_dsn)
    reads = standby or primary
    servers = {"primary": primary} | ({"standby": standby} if standby is not None else {})
    phases = (Phase("suppress", "reporter", _BALANCER, scripts["suppress"]),
              Phase("service", str(service_user["user"]), (reads.host, reads.port), scripts["service"]),
              Phase("dp", "analyst", _BALANCER, scripts["dp"]),
              Phase("relay", "dba", _BALANCER, scripts["relay"]))
    rounds: list[dict[str, dict[str, Any]]] = []
    with _proxies(links, primary, standby, service_dsn, args.workers, work) as pids, \
            _balancer(links, work) as (balancer, balancer_pid):
        for number in range(args.rounds):
            figures = {}
            for phase in phases:
                target = balancer if phase.target == _BALANCER else phase.target
                password = str(service_user["password"]) if phase.name == "service" else phase.user
                if number == 0:  # every worker of every proxy has seen the statements; a few sessions suffice
                    warm = min(args.clients, 2 * len(links) * args.workers)
                    _pgbench(phase, target, password, args, work, args.warmup, warm)
                figures[phase.name] = _phase(phase, target, password, args, work, pids, balancer_pid, primary,
                                             servers)
            rounds.append(figures)
        reach = _policy_reach(primary, work, links, args.policy_changes)
        _progress(f"  policy: every worker within {max(reach):.0f} ms")
    return {"phases": {phase.name: _medians([figures[phase.name] for figures in rounds]) for phase in phases},
            "suppress_over_service": statistics.median(figures["suppress"]["statements_per_second"]
                                                       / figures["service"]["statements_per_second"]
                                                       for figures in rounds),
            "policy_reach_ms": reach, "rounds": rounds}


_BALANCER = ("balancer", 0)  # a phase's target: the balancer, whose port is known once it runs


def _phase(phase: Phase, target: tuple[str, int], password: str, args: argparse.Namespace, work: Path,
           pids: list[int], balancer: int, primary: EmbeddedPostgres, servers: dict[str, EmbeddedPostgres]
           ) -> dict[str, Any]:
    """One measured phase: pgbench's figures, the CPU per statement of the proxies, the balancer and each server,
    and charges/s."""
    charges = _charges(primary)
    cpu = sum(_cpu_seconds(pid) for pid in pids)
    waited = sum(_run_queue_wait_seconds(pid) for pid in pids)
    balancer_cpu = _cpu_seconds(balancer)
    server_cpu = {name: _server_cpu_seconds(server) for name, server in servers.items()}
    figures = _pgbench(phase, target, password, args, work, args.seconds, args.clients)
    statements = figures["statements"] or 1
    figures["proxy_cpu_ms_per_statement"] = (
        1000 * (sum(_cpu_seconds(pid) for pid in pids) - cpu) / statements
        if phase.name != "service" else None)
    figures["proxy_wait_ms_per_statement"] = (
        1000 * (sum(_run_queue_wait_seconds(pid) for pid in pids) - waited) / statements
        if phase.name != "service" else None)
    figures["balancer_cpu_ms_per_statement"] = (
        1000 * (_cpu_seconds(balancer) - balancer_cpu) / statements if phase.name != "service" else None)
    figures["server_cpu_ms_per_statement"] = {
        name: 1000 * (_server_cpu_seconds(server) - server_cpu[name]) / statements for name, server in servers.items()}
    figures["charges_per_second"] = (_charges(primary) - charges) / figures["seconds"]
    _progress(f"  {phase.name}: {figures['statements_per_second']:.0f} statements/s, burst p50 "
              f"{figures['burst_p50_ms']:.0f} ms, p99 {figures['burst_p99_ms']:.0f} ms")
    return figures


def _run_queue_wait_seconds(root: int) -> float:
    """Time the threads of ``root`` and its descendants spent runnable but waiting for a core (the second field of
    /proc/PID/task/TID/schedstat): how long everything else on the machine kept the proxies from running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # the process has just ended
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        pending.extend(children.get(pid, ()))
        for task in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            try:
                total += int(task.read_text().split()[1])
            except OSError:
                continue
    return total / 1e9


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every figure over the rounds (per server for the servers' CPU)."""
    def median(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {key: median([value[key] for value in values]) for key in values[0]}
        return None if values[0] is None else statistics.median(values)

    return {key: median([figures[key] for figures in rounds]) for key in rounds[0]}


def _server_settings(links: list[Host], clients: int) -> dict[str, str]:
    """The same for the primary and the standby (a hot standby needs max_connections at least the primary's)."""
    listen = ",".join(["127.0.0.1", *sorted({link.outside for link in links})])
    return {"listen_addresses": listen, "max_connections": str(3 * clients + 200), "shared_buffers": "256MB",
            "hot_standby_feedback": "on"}


HBA = [f"host all all 10.{NET}.0.0/16 scram-sha-256", REPLICATION_HBA]


@contextmanager
def _database(links: list[Host], clients: int) -> Iterator[EmbeddedPostgres]:
    with EmbeddedPostgres(hba_extra=HBA, settings=_server_settings(links, clients)) as server:
        yield server


@contextmanager
def _standby(primary: EmbeddedPostgres, links: list[Host], clients: int) -> Iterator[EmbeddedPostgres]:
    """A hot standby of ``primary``, streaming, on this machine's side of the links like the primary."""
    standby = EmbeddedPostgres(hba_extra=HBA, settings=_server_settings(links, clients))
    standby.start_standby_of(primary)
    try:
        yield standby
    finally:
        standby.stop()


def _cpu_seconds(root: int) -> float:
    """User and system CPU of ``root``'s living process tree, together."""
    return sum(process_tree_cpu_seconds(root))


def _server_cpu_seconds(server: EmbeddedPostgres) -> float:
    """CPU of the server's postmaster and its processes, the ended ones included (the postmaster reaped them: its
    cutime and cstime)."""
    assert server.data_dir is not None
    postmaster = int((server.data_dir / "postmaster.pid").read_text().split()[0])
    fields = Path(f"/proc/{postmaster}/stat").read_text().rsplit(")", 1)[1].split()
    reaped = (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    return _cpu_seconds(postmaster) + reaped


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
def _proxies(links: list[Host], server: EmbeddedPostgres, standby: EmbeddedPostgres | None, service_dsn: str,
             workers: int, work: Path) -> Iterator[list[int]]:
    """One ``anonproxy serve`` per host, reading on ``standby`` if given; yields their process ids once each has
    loaded the policy."""
    processes = []
    try:
        for link in links:
            env = {key: value for key, value in os.environ.items() if not key.startswith("ANONPROXY_")}
            env |= {"PYTHONPATH": str(REPO), "ANONPROXY_LISTEN_HOST": link.inside, "ANONPROXY_LISTEN_PORT": str(PORT),
                    "ANONPROXY_UPSTREAM": f"host={link.outside} port={server.port}",
                    "ANONPROXY_SERVICE_DSN": service_dsn, "ANONPROXY_WORKERS": str(workers),
                    "ANONPROXY_LOG_LEVEL": "info", "ANONPROXY_TRUSTED_PROXIES": link.outside}
            if standby is not None:
                env["ANONPROXY_STANDBYS"] = f"{link.outside}:{standby.port}"
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
def _balancer(links: list[Host], work: Path) -> Iterator[tuple[tuple[str, int], int]]:
    """HAProxy in front of the proxies of ``links``; yields its address and process id."""
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
        yield ("127.0.0.1", port), process.pid
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


def _pgbench(phase: Phase, target: tuple[str, int], password: str, args: argparse.Namespace, work: Path,
             seconds: int, clients: int) -> dict[str, Any]:
    logs = work / f"log-{phase.name}"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    host, port = target
    command = [_pgbench_binary(), "-n", "-M", "simple", "-c", str(clients), "-j", "2", "-T", str(seconds),
               "-f", str(phase.script), "--log", "--log-prefix", str(logs / "burst"), "-h", host, "-p", str(port),
               "-U", phase.user, DATABASE]
    started = time.monotonic()
    done = subprocess.run(command, env={**os.environ, "PGPASSWORD": password}, capture_output=True, text=True,
                          cwd=work)
    elapsed = time.monotonic() - started  # pgbench lets the bursts under way at the end finish: longer than -T
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if re.search(r"ERROR|FATAL|error|abort", line)]
        raise RuntimeError(f"pgbench {phase.name} failed:\n" + "\n".join(errors[-20:]))
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
          f"{report['workers_per_proxy']} worker(s) per proxy, {report['cores']} cores; medians of "
          f"{report['rounds']} round(s); CPU in ms per statement")
    print("proxies | reads on | phase    | statements/s | burst p50 ms | burst p99 ms | proxies CPU | proxies wait | "
          "balancer CPU | primary CPU | standby CPU | charges/s")
    for run_report in report["runs"]:
        for name, figures in run_report["phases"].items():
            server = figures["server_cpu_ms_per_statement"]
            cpu = [figures["proxy_cpu_ms_per_statement"], figures["proxy_wait_ms_per_statement"],
                   figures["balancer_cpu_ms_per_statement"], server["primary"], server.get("standby")]
            cells = " | ".join(f"{'' if value is None else f'{value:.2f}':>{width}}"
                               for value, width in zip(cpu, (11, 12, 12, 11, 11)))
            print(f"{run_report['proxies']:>7} | {run_report['variant']:<8} | {name:<8} | "
                  f"{figures['statements_per_second']:>12.0f} | {figures['burst_p50_ms']:>12.0f} | "
                  f"{figures['burst_p99_ms']:>12.0f} | {cells} | {figures['charges_per_second']:>9.0f}")
        reach = sorted(run_report["policy_reach_ms"])
        print(f"{run_report['proxies']:>7} | {run_report['variant']:<8} | suppress / service: "
              f"{run_report['suppress_over_service']:.2f}; a policy change reached every worker in "
              f"{reach[len(reach) // 2]:.0f} ms (median), {reach[-1]:.0f} ms (max)")


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
