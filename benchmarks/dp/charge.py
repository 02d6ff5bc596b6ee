#!/usr/bin/env python3
"""What a dp question's ledger charge costs, before and after migration 0031, side by side in one run.

One throwaway PostgreSQL with two databases set up as ``anonproxy up`` does
(schema, the adult rows, demo roles, service role, demo policy):

* ``before``: every migration up to 0030 (0031 is recorded as installed but not
  applied, so that this anonproxy serves it: 0031 changes SQL only);
* ``after``: every migration.

In each, dp roles with a budget on public.adult that the run never spends:
``analyst`` under zcdp accounting (ε 1000, δ 1e-5, ε 0.5 per query: the demo's
accounting and δ), ``analyst_basic`` under basic accounting (ε 1000000, δ 0.5),
and ``analyst_delta`` as ``analyst``, for the charges that spend δ.

1. The SQL charge. ``anonproxy.dp.ledger.charge`` (the proxy's call: BEGIN, the
   charge and COMMIT in one round trip) from one connection per database, the
   (database, accounting) series interleaved round by round: one answer's cost
   at ε 0.5 (ρ 0.0625), and under zcdp the same plus partition selection's δ
   (delta_add 1e-9, so the δ left moves with every charge). Reported: p50 of the round trip and the
   backend's CPU time per charge (/proc/PID/stat; the server runs here); then, per series, the time of
   ``charge()`` and of the conversions it calls, from PostgreSQL's function statistics.
2. A dp question's first charge through the proxy: one ``anonproxy serve`` per
   database; before each repetition the answer cache of both roles is emptied
   (as the owner), then each query is asked once per (database, role), in an
   order that rotates, and the same SQL is run directly as the superuser.
   Reported: p50 of first and of exact, and first − exact ("added").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg

from anonproxy import demo, sample_data, schema
from anonproxy.dp import ledger
from anonproxy.embedded import EmbeddedPostgres
from anonproxy.policy.yaml_policy import apply_policy, demo_policy

REPOSITORY = Path(__file__).resolve().parents[2]
STORED_FROM = 31  # the migration that stores each budget's ρ_max
DATABASES = ("before", "after")
ZCDP, BASIC, ZCDP_DELTA = "analyst", "analyst_basic", "analyst_delta"
ROLES = {ZCDP: "zcdp", BASIC: "basic", ZCDP_DELTA: "zcdp"}
# Budgets the run never spends: (ε, δ, ε per query).
BUDGETS = {ZCDP: ("1000", "0.00001", "0.5"), BASIC: ("1000000", "0.5", "0.5"), ZCDP_DELTA: ("1000", "0.00001", "0.5")}
# One answer's ε, δ, ρ, δ_add: a count at ε 0.5 (discrete Gaussian under zcdp: ρ = ε²/4); and the same with
# partition selection's δ.
CHARGE = (Decimal("0.5"), Decimal(0), Decimal("0.0625"), Decimal(0))
CHARGE_WITH_DELTA = (Decimal("0.5"), Decimal("0.000000001"), Decimal("0.0625"), Decimal("0.000000001"))
QUERIES = {
    "count": "SELECT count(*) FROM public.adult",
    "avg": "SELECT avg(age) FROM public.adult",
    "group": "SELECT sex, count(*) FROM public.adult GROUP BY sex",
}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--charges", type=int, default=300, help="SQL charges per series (default 300)")
    parser.add_argument("--repeat", type=int, default=50, help="first charges per query and series (default 50)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    report = run(args.charges, args.repeat)
    print(_report_text(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def run(charges: int, repeat: int) -> dict[str, Any]:
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-charge-") as tmp:
        _progress("starting PostgreSQL")
        server = stack.enter_context(EmbeddedPostgres())
        password = _prepare(server)
        load_start = os.getloadavg()[0]
        _progress(f"SQL charges: {charges} per series")
        sql = asyncio.run(_sql_charges(server, password, charges))
        _progress("where a charge's time goes: PostgreSQL's function statistics")
        functions = _function_times(server)
        proxies = {name: stack.enter_context(_proxy(server, name, password, Path(tmp) / f"{name}.log"))
                   for name in DATABASES}
        _progress(f"first charges through the proxy: {repeat} per query and series")
        first = _first_charges(server, proxies, repeat)
        return {"charges": charges, "repeat": repeat, "load_average": [load_start, os.getloadavg()[0]],
                "postgresql": _server_version(server), "sql": sql, "functions": functions, "proxy": first}


# Set-up ------------------------------------------------------------------------------------------------


def _prepare(server: EmbeddedPostgres) -> str:
    """Both databases as ``anonproxy up`` sets them up, with the benchmark's budgets; the service password."""
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        for name in DATABASES:
            conn.execute(f"create database {name}")
        password = demo.reset_service_role(conn, demo_policy().service_role)
        for role in ROLES:
            conn.execute(f"create role {role} login password '{role}'")
    for name in DATABASES:
        _progress(f"database {name}: schema, adult, demo roles and policy")
        with psycopg.connect(server.conninfo(dbname=name), autocommit=True) as conn:
            _install(conn, stored=name == "after")
            sample_data.load_demo(conn)
            demo.create_demo_roles(conn, name)
            apply_policy(conn, demo_policy())
            for role, accounting in ROLES.items():
                epsilon, delta, per_query = BUDGETS[role]
                conn.execute("select anonproxy.set_role_policy(%s, 'dp')", (role,))
                conn.execute("select anonproxy.set_budget(%s::name, 'public.adult'::regclass, %s::numeric, "
                             "%s::numeric, null, %s::numeric, null, %s)",
                             (role, epsilon, delta, per_query, accounting))
    return password


def _install(conn: psycopg.Connection[Any], stored: bool) -> None:
    """Every migration (``stored``), or all but 0031 and later, which are recorded as installed."""
    if stored:
        schema.install(conn)
        return
    for migration in schema.migrations():
        with conn.transaction():  # as schema.install applies them
            conn.execute("select set_config('search_path', 'pg_catalog, pg_temp', true)")
            if migration.version < STORED_FROM:
                conn.execute(migration.sql.encode())
            conn.execute("insert into anonproxy.schema_migrations (version, name) values (%s, %s)",
                         (migration.version, migration.name))


@contextmanager
def _proxy(server: EmbeddedPostgres, database: str, password: str, log: Path) -> Iterator[int]:
    """``anonproxy serve`` (1 worker) whose service login works in ``database``; yields its port."""
    port = _free_port()
    service = psycopg.conninfo.make_conninfo(user=demo_policy().service_role, password=password, dbname=database)
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY), "ANONPROXY_LISTEN_HOST": "127.0.0.1",
           "ANONPROXY_LISTEN_PORT": str(port), "ANONPROXY_UPSTREAM": f"host={server.host} port={server.port}",
           "ANONPROXY_SERVICE_DSN": service, "ANONPROXY_WORKERS": "1"}
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "anonproxy.cli", "serve"], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, cwd=REPOSITORY)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"anonproxy did not start:\n{log.read_text()}") from None
                time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(30)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# 1. The SQL charge ----------------------------------------------------------------------------------------

SERIES = [(name, role, costs) for name in DATABASES
          for role, costs in ((ZCDP, CHARGE), (BASIC, CHARGE), (ZCDP_DELTA, CHARGE_WITH_DELTA))]


def _series_name(database: str, role: str, costs: tuple[Decimal, ...]) -> str:
    return f"{database} {ROLES[role]}{' δ_add' if costs[3] else ''}"


async def _sql_charges(server: EmbeddedPostgres, password: str, charges: int) -> dict[str, dict[str, float]]:
    """The proxy's charge call, from the service login: p50 ms per round trip and backend CPU ms per charge."""
    service = demo_policy().service_role
    conns = {name: await psycopg.AsyncConnection.connect(
        server.conninfo(user=service, password=password, dbname=name), autocommit=True) for name in DATABASES}
    try:
        pids = {name: conn.info.backend_pid for name, conn in conns.items()}
        wall: dict[str, list[float]] = {_series_name(*s): [] for s in SERIES}
        cpu = dict.fromkeys(wall, 0.0)
        for n in range(charges + 10):  # the first 10 rounds warm up
            for database, role, costs in SERIES[n % len(SERIES):] + SERIES[:n % len(SERIES)]:
                epsilon, delta, rho, delta_add = costs
                cpu_before = _cpu_seconds(pids[database])
                start = time.perf_counter_ns()
                await ledger.charge(conns[database], role, "public.adult", epsilon, delta, f"bench-{n}",
                                    rho=rho, delta_add=delta_add)
                elapsed = (time.perf_counter_ns() - start) / 1e6
                if n >= 10:
                    name = _series_name(database, role, costs)
                    wall[name].append(elapsed)
                    cpu[name] += _cpu_seconds(pids[database]) - cpu_before
    finally:
        for conn in conns.values():
            await conn.close()
    return {name: {"p50_ms": statistics.median(values), "cpu_ms": 1000 * cpu[name] / len(values)}
            for name, values in wall.items()}


FUNCTIONS = ("charge", "zcdp_rho_max", "zcdp_epsilon")
PROFILED = 100


def _function_times(server: EmbeddedPostgres) -> dict[str, dict[str, dict[str, float]]]:
    """Per series: calls and total ms per charge of ``charge()`` and of the two conversions, from
    pg_stat_xact_user_functions (track_functions = 'pl') over PROFILED charges in one transaction, rolled back; a
    new connection per series, so no earlier statistic is counted."""
    times: dict[str, dict[str, dict[str, float]]] = {}
    for database, role, costs in SERIES:
        with psycopg.connect(server.conninfo(dbname=database)) as conn:  # the owner may charge, and set this
            conn.execute("set transaction isolation level read committed")
            conn.execute("set local track_functions = 'pl'")
            for n in range(PROFILED):
                conn.execute("select anonproxy.charge(%s, 'public.adult', %s, %s, %s, %s, %s)",
                             (role, *costs, f"profile-{n}"))
            rows = conn.execute("select funcname, calls, total_time from pg_stat_xact_user_functions "
                                "where schemaname = 'anonproxy' and funcname = any(%s)", (list(FUNCTIONS),))
            times[_series_name(database, role, costs)] = {
                name: {"calls": calls / PROFILED, "ms": total / PROFILED} for name, calls, total in rows}
            conn.rollback()
    return times


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


# 2. First charges through the proxy ---------------------------------------------------------------------


def _first_charges(server: EmbeddedPostgres, proxies: dict[str, int], repeat: int) -> dict[str, dict[str, float]]:
    clients = {(name, role): _client(proxies[name], name, role) for name in DATABASES for role in (ZCDP, BASIC)}
    admins = {name: psycopg.connect(server.conninfo(dbname=name), autocommit=True) for name in DATABASES}
    try:
        for (_, role), conn in clients.items():
            mode = conn.execute("SHOW anonproxy.mode", prepare=False).fetchone()
            if mode is None or mode[0] != "dp":
                raise RuntimeError(f"the proxy puts {role} in mode {mode}, not dp")
        first: dict[tuple[str, str, str], list[float]] = {(*key, q): [] for key in clients for q in QUERIES}
        exact: dict[str, list[float]] = {q: [] for q in QUERIES}
        order = list(clients)
        for n in range(repeat + 2):  # the first 2 repetitions warm up
            for admin in admins.values():
                admin.execute("delete from anonproxy.answer_cache where role_name = any(%s)", (list(ROLES),))
            for position, (query, text) in enumerate(QUERIES.items()):
                shift = (n + position) % len(order)
                for key in order[shift:] + order[:shift]:
                    elapsed = _timed(clients[key], text)
                    if n >= 2:
                        first[(*key, query)].append(elapsed)
                elapsed = _timed(admins["after"], text)
                if n >= 2:
                    exact[query].append(elapsed)
    finally:
        for conn in [*clients.values(), *admins.values()]:
            conn.close()
    return {f"{name} {ROLES[role]} {query}": {"first_p50_ms": statistics.median(values),
                                               "exact_p50_ms": statistics.median(exact[query]),
                                               "added_ms": statistics.median(values) - statistics.median(exact[query])}
            for (name, role, query), values in first.items()}


def _client(port: int, database: str, role: str) -> psycopg.Connection[Any]:
    return psycopg.connect(host="127.0.0.1", port=port, dbname=database, user=role, password=role, sslmode="disable",
                           autocommit=True, prepare_threshold=None)


def _timed(conn: psycopg.Connection[Any], text: str) -> float:
    """ms from sending the Query (simple protocol) to having every row."""
    start = time.perf_counter_ns()
    with conn.cursor() as cur:
        cur.execute(text, prepare=False)
        cur.fetchall()
    return (time.perf_counter_ns() - start) / 1e6


# Report -----------------------------------------------------------------------------------------------------


def _server_version(server: EmbeddedPostgres) -> str:
    with psycopg.connect(server.conninfo()) as conn:
        return str(conn.info.parameter_status("server_version"))


def _report_text(report: dict[str, Any]) -> str:
    lines = [(f"PostgreSQL {report['postgresql']}, load average {report['load_average'][0]:.1f} at the start, "
              f"{report['load_average'][1]:.1f} at the end"),
             f"1. SQL charge (ledger.charge: BEGIN, charge, COMMIT in one round trip), {report['charges']} each",
             f"   {'series':<22} {'p50 ms':>8} {'CPU ms':>8}"]
    lines += [f"   {name:<22} {row['p50_ms']:8.3f} {row['cpu_ms']:8.3f}" for name, row in report["sql"].items()]
    lines += [f"   where the time goes in the server, per charge ({PROFILED} charges, track_functions = 'pl'):",
              f"   {'series':<22} " + " ".join(f"{name + ' ms (calls)':>26}" for name in FUNCTIONS)]
    for name, functions in report["functions"].items():
        cells = [functions.get(f, {"ms": 0.0, "calls": 0.0}) for f in FUNCTIONS]
        lines.append(f"   {name:<22} " + " ".join(f"{c['ms']:>17.3f} ({c['calls']:.0f})".rjust(26) for c in cells))
    lines += [f"2. first charge through the proxy, {report['repeat']} per query and series",
              f"   {'series':<22} {'first p50':>10} {'exact p50':>10} {'added':>8}"]
    lines += [f"   {name:<22} {row['first_p50_ms']:10.2f} {row['exact_p50_ms']:10.2f} {row['added_ms']:8.2f}"
              for name, row in report["proxy"].items()]
    return "\n".join(lines)


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
