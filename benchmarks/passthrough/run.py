#!/usr/bin/env python3
"""Pass-through overhead of anonproxy, next to pgbouncer.

pgbench select-only runs directly against a throwaway PostgreSQL, through
pgbouncer (session pooling) and through anonproxy (one instance per worker
count, and optionally a second source tree side by side), interleaved, in
both query modes. Prints tps, p50/p99 latency and the proxy's CPU per
transaction of each, and the tps ratio anonproxy / pgbouncer per mode. See
README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from targets import (
    HOST,
    PGBOUNCER,
    REPO_ROOT,
    AnonProxy,
    BenchmarkError,
    PgBouncer,
    Service,
)

from anonproxy.config import cores
from anonproxy.embedded import EmbeddedPostgres, find_pg_bindir

SCALE = 10
CLIENTS = 8
THREADS = 2
ROLE = "bench"
DATABASE = "bench"
TARGET_RATIO = 1.1  # issue 23: the relay at 1.1x pgbouncer's tps, with the default worker count
WARMUP_SECONDS = 3
MODES = ("simple", "extended", "prepared")
SERVER_SETTINGS = {"shared_buffers": "512MB"}  # the scale-10 data set (~160 MB) stays in shared buffers


@dataclass(frozen=True)
class Target:
    name: str
    port: int
    service: Service | None = None  # the proxy process, whose CPU use is sampled
    workers: int | None = None  # anonproxy worker processes
    label: str | None = None  # which anonproxy tree: "anonproxy" (this one) or "baseline"


@dataclass(frozen=True)
class Measurement:
    tps: float
    p50_ms: float
    p99_ms: float
    transactions: int
    proxy_cpu_pct: float | None  # CPU of the proxy's processes, 100 = one core busy
    proxy_user_us: float | None  # the proxy's user CPU per transaction, µs
    proxy_system_us: float | None  # the proxy's system (kernel) CPU per transaction, µs
    machine_cpu_pct: float  # CPU of the whole machine, 100 = every core busy


@dataclass(frozen=True)
class Result:
    target: str
    label: str | None
    workers: int | None
    mode: str
    median: Measurement  # of the runs, figure by figure
    runs: list[Measurement]


@dataclass(frozen=True)
class Ratio:
    """One anonproxy tree against pgbouncer in one mode, for each worker count: tps ratio, and proxy CPU per
    transaction ratio; the headline is the default worker count (one per core)."""

    label: str
    mode: str
    by_workers: dict[int, float]
    cpu_by_workers: dict[int, float]
    default_workers: int
    at_default: float | None  # None: the default worker count was not measured
    passed: bool


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the servers on SIGTERM as on Ctrl-C
    try:
        report = run(args)
    except BenchmarkError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=_positive_int, default=20, help="seconds per pgbench run (default 20)")
    parser.add_argument(
        "--repeat",
        type=_positive_int,
        default=1,
        help="rounds over all targets and modes; each figure is the median (default 1)",
    )
    parser.add_argument(
        "--workers",
        type=_int_list,
        default=sorted({1, cores()}),
        help=f"comma-separated anonproxy worker counts, one proxy each (default 1,{cores()}: one, and the default "
        "of one per core)",
    )
    parser.add_argument(
        "--baseline",
        type=_source_tree,
        help="another anonproxy source tree (a checkout of the code before a change) to run side by side",
    )
    parser.add_argument(
        "--modes",
        type=_mode_list,
        default=["simple", "prepared"],
        help="comma-separated pgbench query modes (default simple,prepared)",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _int_list(text: str) -> list[int]:
    return sorted({_positive_int(part) for part in text.split(",")})


def _source_tree(text: str) -> Path:
    tree = Path(text).resolve()
    if not (tree / "anonproxy" / "cli.py").is_file():
        raise argparse.ArgumentTypeError(f"{text} is not an anonproxy source tree (no anonproxy/cli.py)")
    return tree


def _mode_list(text: str) -> list[str]:
    modes = text.split(",")
    for mode in modes:
        if mode not in MODES:
            raise argparse.ArgumentTypeError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    return modes


def run(args: argparse.Namespace) -> dict[str, object]:
    if not os.access(PGBOUNCER, os.X_OK):
        raise BenchmarkError(f"{PGBOUNCER} not found; install it with: apt-get install pgbouncer")
    pgbench = find_pg_bindir() / "pgbench"
    password = secrets.token_urlsafe(18)
    env = _pgbench_env(password)
    with ExitStack() as stack:
        _progress("starting PostgreSQL")
        server = stack.enter_context(EmbeddedPostgres(settings=SERVER_SETTINGS))
        _progress(f"creating role {ROLE} and running pgbench -i -s {SCALE}")
        _prepare_database(server, pgbench, env)
        bouncer = stack.enter_context(PgBouncer(server.port, DATABASE, ROLE, password, pool_size=CLIENTS))
        targets = [Target("direct", server.port), Target("pgbouncer", bouncer.port, bouncer)]
        trees = [("anonproxy", REPO_ROOT)] + ([("baseline", args.baseline)] if args.baseline else [])
        for workers in args.workers:
            for label, tree in trees:
                proxy = stack.enter_context(AnonProxy(server.port, workers, tree, label))
                targets.append(Target(proxy.name, proxy.port, proxy, workers, label))
        machine = _machine(server, pgbench)
        _progress("machine: " + ", ".join(f"{key} {value}" for key, value in machine.items()))

        for target in targets:  # warms caches and checks every target works before the long runs
            _run_pgbench(pgbench, target, "simple", min(WARMUP_SECONDS, args.duration), env)
        runs: dict[tuple[str, str], list[Measurement]] = {}
        for round_ in range(1, args.repeat + 1):
            for mode in args.modes:
                for target in targets:  # interleaved, so machine noise spreads over all targets
                    measurement = _run_pgbench(pgbench, target, mode, args.duration, env)
                    runs.setdefault((target.name, mode), []).append(measurement)
                    _progress(f"round {round_}/{args.repeat} {mode:<8} {target.name:<22} {measurement.tps:9.0f} tps")

    results = [
        Result(target.name, target.label, target.workers, mode, _median(runs[target.name, mode]),
               runs[target.name, mode])
        for mode in args.modes
        for target in targets
    ]
    labels = list(dict.fromkeys(target.label for target in targets if target.label))
    ratios = [_ratio(label, mode, results) for label in labels for mode in args.modes]
    _print_report(results, ratios)
    settings = {
        "scale": SCALE,
        "clients": CLIENTS,
        "threads": THREADS,
        "duration_s": args.duration,
        "repeat": args.repeat,
        "server_settings": SERVER_SETTINGS,
        "target_ratio": TARGET_RATIO,
        "default_workers": cores(),
        "baseline": str(args.baseline) if args.baseline else None,
    }
    return {
        "settings": settings,
        "machine": machine,
        "results": [asdict(result) for result in results],
        "ratios": [asdict(ratio) for ratio in ratios],
    }


def _pgbench_env(password: str) -> dict[str, str]:
    """Our environment without libpq's PG* variables, then the benchmark role's password, no TLS."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PG")}
    return env | {"PGPASSWORD": password, "PGSSLMODE": "disable", "PGGSSENCMODE": "disable"}


def _prepare_database(server: EmbeddedPostgres, pgbench: Path, env: dict[str, str]) -> None:
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(ROLE), sql.Literal(env["PGPASSWORD"]))
        )
        conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(DATABASE), sql.Identifier(ROLE)))
    _check_call([str(pgbench), "-i", "-q", "-s", str(SCALE), *_connection_args(server.port)], env)


def _connection_args(port: int) -> list[str]:
    return ["-h", HOST, "-p", str(port), "-U", ROLE, DATABASE]


def _check_call(args: list[str], env: dict[str, str]) -> str:
    result = subprocess.run(args, check=False, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise BenchmarkError(f"{' '.join(args)} exited with code {result.returncode}:\n{result.stderr.strip()}")
    return result.stdout


def _run_pgbench(pgbench: Path, target: Target, mode: str, duration: int, env: dict[str, str]) -> Measurement:
    with tempfile.TemporaryDirectory(prefix="bench-pgbench-") as log_dir:
        args = [
            str(pgbench), "-n", "-S", "-c", str(CLIENTS), "-j", str(THREADS), "-T", str(duration), "-M", mode,
            "-l", "--log-prefix", f"{log_dir}/tx", *_connection_args(target.port),
        ]  # fmt: skip
        proxy_before = target.service.cpu_seconds() if target.service else (0.0, 0.0)
        machine_before = _machine_cpu_ticks()
        started = time.monotonic()
        output = _check_call(args, env)
        elapsed = time.monotonic() - started
        machine_busy, machine_total = (after - before for after, before in zip(_machine_cpu_ticks(), machine_before))
        proxy_after = target.service.cpu_seconds() if target.service else None

        failed = re.search(r"^number of failed transactions: (\d+)", output, re.MULTILINE)
        if failed is not None and int(failed[1]) > 0:
            raise BenchmarkError(f"{failed[1]} failed transactions through {target.name} ({mode}):\n{output}")
        tps = re.search(r"^tps = ([\d.]+) \(without initial connection time\)", output, re.MULTILINE)
        if tps is None:
            raise BenchmarkError(f"no tps figure in the output of pgbench:\n{output}")
        latencies = sorted(_logged_latencies_us(Path(log_dir)))
    if not latencies:
        raise BenchmarkError(f"pgbench logged no transactions through {target.name} ({mode})")
    if proxy_after is None:
        user = system = None
    else:
        user, system = proxy_after[0] - proxy_before[0], proxy_after[1] - proxy_before[1]
    return Measurement(
        tps=float(tps[1]),
        p50_ms=_percentile(latencies, 0.50) / 1000,
        p99_ms=_percentile(latencies, 0.99) / 1000,
        transactions=len(latencies),
        proxy_cpu_pct=None if user is None or system is None else 100 * (user + system) / elapsed,
        proxy_user_us=None if user is None else 1e6 * user / len(latencies),
        proxy_system_us=None if system is None else 1e6 * system / len(latencies),
        machine_cpu_pct=100 * machine_busy / machine_total,
    )


def _logged_latencies_us(log_dir: Path) -> Iterator[int]:
    """Column 3 of pgbench's per-transaction logs (one file per thread): the latency in µs."""
    for log in log_dir.glob("tx.*"):
        with log.open() as lines:
            for line in lines:
                yield int(line.split(maxsplit=3)[2])


def _percentile(ordered: list[int], fraction: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def _machine_cpu_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of all cores since boot, from the first line of /proc/stat."""
    ticks = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return sum(ticks) - idle, sum(ticks)


def _median(runs: list[Measurement]) -> Measurement:
    values: dict[str, Any] = {}
    for field in fields(Measurement):
        column = [getattr(run, field.name) for run in runs]
        values[field.name] = None if None in column else statistics.median(column)
    return Measurement(**values)


def _ratio(label: str, mode: str, results: list[Result]) -> Ratio:
    in_mode = [result for result in results if result.mode == mode]
    bouncer = next(result.median for result in in_mode if result.target == "pgbouncer")
    ours = {result.workers: result.median for result in in_mode if result.label == label and result.workers}
    by_workers = {workers: m.tps / bouncer.tps for workers, m in ours.items()}
    cpu_by_workers = {workers: _cpu_us(m) / _cpu_us(bouncer) for workers, m in ours.items()}
    at_default = by_workers.get(cores())
    return Ratio(label, mode, by_workers, cpu_by_workers, cores(), at_default,
                 at_default is not None and at_default >= TARGET_RATIO)


def _cpu_us(measurement: Measurement) -> float:
    """The proxy's CPU per transaction, µs."""
    return (measurement.proxy_user_us or 0.0) + (measurement.proxy_system_us or 0.0)


def _print_report(results: list[Result], ratios: list[Ratio]) -> None:
    print()
    print(f"{'target':<22} {'mode':<9} {'tps':>9} {'p50 ms':>7} {'p99 ms':>7} {'proxy CPU':>9} "
          f"{'us/tx user+sys':>14} {'machine CPU':>11}")
    for result in results:
        m = result.median
        proxy_cpu = "-" if m.proxy_cpu_pct is None else f"{m.proxy_cpu_pct:.0f}%"
        per_tx = "-" if m.proxy_user_us is None else f"{m.proxy_user_us:.1f}+{m.proxy_system_us:.1f}"
        print(
            f"{result.target:<22} {result.mode:<9} {m.tps:9.0f} {m.p50_ms:7.3f} {m.p99_ms:7.3f} "
            f"{proxy_cpu:>9} {per_tx:>14} {m.machine_cpu_pct:10.0f}%"
        )
    print()
    print(f"tps ratio / pgbouncer with the default {_workers(cores())} (target >= {TARGET_RATIO}), "
          "and [proxy CPU per transaction / pgbouncer's]:")
    for ratio in ratios:
        each = ", ".join(f"{_workers(workers)} {value:.2f} [{ratio.cpu_by_workers[workers]:.2f}]"
                         for workers, value in ratio.by_workers.items())
        headline = "-   " if ratio.at_default is None else f"{ratio.at_default:.2f}"
        print(f"  {ratio.label:<9} {ratio.mode:<9} {headline} {'PASS' if ratio.passed else 'MISS'}  ({each})")


def _workers(count: int) -> str:
    return f"{count} worker{'s' if count > 1 else ''}"


def _machine(server: EmbeddedPostgres, pgbench: Path) -> dict[str, object]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    with psycopg.connect(server.conninfo()) as conn:
        postgres = conn.info.parameter_status("server_version")
    bouncer = _check_call([str(PGBOUNCER), "--version"], dict(os.environ)).splitlines()
    return {
        "cpu": model[1] if model else platform.machine(),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "uvloop": _package_version("uvloop"),
        "postgresql": postgres,
        "pgbench": _check_call([str(pgbench), "--version"], dict(os.environ)).strip(),
        "pgbouncer": bouncer[0],
    }


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
