#!/usr/bin/env python3
"""asyncpg's own test suite, once directly against PostgreSQL and once through anonproxy: which tests differ.

The suite comes from a checkout of asyncpg's repository given on the command line (it is not part of this
project); it tests the asyncpg installed here (a test dependency of anonproxy), whose version must be the
checkout's. Both runs use the same throwaway PostgreSQL, database and login (``dba``, a direct role of the demo
policy, made superuser as the suite expects of its login), which the suite reads from PGHOST and the other libpq
variables; the proxy runs with a service login, so the role goes through the policy's decision and is relayed.
See README.md.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import psycopg

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # this checkout's anonproxy, the one whose proxy runs, not an installed copy
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # driver_suite, shared with the other drivers' suites

import driver_suite  # noqa: E402
from anonproxy.embedded import EmbeddedPostgres  # noqa: E402

HOST = driver_suite.HOST
DATABASE = "asyncpg_suite"  # the demo policy's, which the proxy reads
# The suite's own: its pools name it (database='postgres') beside connections made from PGDATABASE, and expect both
# to see the same tables. A direct role's session to it is relayed like one to the policy's database.
SUITE_DATABASE = "postgres"
ROLE = driver_suite.ROLE
SERVER_SETTINGS = {"max_connections": "200"}
# Checks of asyncpg's own source (flake8, mypy over the checkout): no server involved, and mypy would write its
# cache into the checkout.
LEFT_OUT = ("tests/test__sourcecode.py",)
SUMMARY = re.compile(r"\b\d+ (passed|failed|errors?|skipped)\b.* in [\d.]+s")  # pytest's closing line
VERSION = re.compile(r"""__version__[^=]*=\s*['"]([^'"]+)['"]""")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("asyncpg_source", type=Path, help="a checkout of asyncpg's repository (holds tests/)")
    parser.add_argument("--tests", nargs="+",
                        help="test files or directories relative to the checkout (default: all of tests/ but the "
                             "source checks, test__sourcecode.py)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, to run fewer tests")
    parser.add_argument("--workers", type=int, default=2, help="anonproxy worker processes (default 2)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test before it counts as failed")
    parser.add_argument("--again", type=int, default=3,
                        help="run each test that differs this many more times both ways (default 3; 0: none)")
    parser.add_argument("--json", type=Path, help="also write both runs' outcomes here")
    parser.add_argument("--direct-json", type=Path,
                        help="take the direct run from this earlier --json output instead of running it again")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the server and the proxy are stopped
    source = args.asyncpg_source.resolve()
    problem = _source_problem(source)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    print(f"asyncpg {metadata.version('asyncpg')}; suite from {source} ({_describe(source)})", flush=True)
    if args.tests is None:
        args.tests = sorted(str(path.relative_to(source)) for path in (source / "tests").glob("test_*.py")
                            if str(path.relative_to(source)) not in LEFT_OUT)

    with tempfile.TemporaryDirectory(prefix="bench-asyncpg-") as tmp, \
            EmbeddedPostgres(settings=SERVER_SETTINGS) as server:
        workdir = Path(tmp)
        driver_suite.prepare(server, DATABASE)
        server_version = _server_version(server)
        envs = {"direct": _suite_env(server.port, server_version)}
        direct = driver_suite.load_run(args.direct_json, "direct") if args.direct_json else \
            _run_suite("direct", envs["direct"], source, args.tests, args.keyword, args.timeout, workdir)
        proxy, port = driver_suite.start_proxy(server, DATABASE, workdir, args.workers)
        try:
            envs["anonproxy"] = _suite_env(port, server_version)
            via = _run_suite("anonproxy", envs["anonproxy"], source, args.tests, args.keyword, args.timeout, workdir)
            driver_suite.report(direct, via)
            differ = {test: node_id for test in via.outcomes
                      if direct.outcomes.get(test) != via.outcomes[test] and (node_id := _node_id(test)) is not None}
            if differ and args.again:
                _run_again(differ, envs, source, args.again, args.timeout, workdir)
        finally:
            driver_suite.stop(proxy)
        proxy_log = (workdir / "anonproxy.log").read_text(errors="replace")
    if "Traceback" in proxy_log:
        print("\nthe proxy's log holds a traceback:\n" + proxy_log[proxy_log.index("Traceback"):][:4000])
    if args.json:
        driver_suite.save_runs(args.json, (direct, via))
    return 0


def _source_problem(source: Path) -> str | None:
    """Why ``source`` cannot be used: not asyncpg's repository, or not the installed asyncpg's version."""
    version_file = source / "asyncpg" / "_version.py"
    if not (source / "tests").is_dir() or not version_file.is_file():
        return f"{source} is not a checkout of asyncpg's repository (no tests/ or asyncpg/_version.py)"
    found = VERSION.search(version_file.read_text())
    installed = metadata.version("asyncpg")
    if found is None or found.group(1) != installed:
        checkout = found.group(1) if found else "unknown"
        return (f"the checkout is asyncpg {checkout}, the installed asyncpg is {installed}: check out the tag "
                f"v{installed}, or install the checkout's version (`.venv/bin/python -m pip install "
                f"asyncpg=={checkout}`); a release's suite tests that release's behaviour")
    return None


def _describe(source: Path) -> str:
    """The checkout's tag or commit, when it is a git checkout."""
    found = subprocess.run(["git", "-C", str(source), "describe", "--tags", "--always"], capture_output=True,
                           text=True)
    return found.stdout.strip() if found.returncode == 0 else "not a git checkout"


def _server_version(server: EmbeddedPostgres) -> str:
    """The server's version as PostgreSQL itself reports it at login (ParameterStatus), asked directly."""
    with psycopg.connect(server.conninfo()) as conn:
        return conn.info.parameter_status("server_version") or ""


def _suite_env(port: int, server_version: str) -> dict[str, str]:
    """The login in libpq's variables (asyncpg's tests use a running server when PGHOST is set); the versions
    test__environment.py checks the connection's against (the server's, asked directly, and the installed
    asyncpg's); no bytecode written into the checkout."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    env.update(PGHOST=HOST, PGPORT=str(port), PGUSER=ROLE, PGPASSWORD=ROLE, PGDATABASE=SUITE_DATABASE,
               PGVERSION=server_version, ASYNCPG_VERSION=metadata.version("asyncpg"), PYTHONDONTWRITEBYTECODE="1")
    return env


def _run_again(tests: dict[str, str], envs: dict[str, dict[str, str]], source: Path, times: int, timeout: int,
               workdir: Path) -> None:
    """The tests that differ (JUnit id -> pytest's id), ``times`` more times each way (a fresh pytest each time, the
    two ways taking turns so that both see the same load): how often each passed. A test bound by time flips both
    ways."""
    passed = {test: dict.fromkeys(envs, 0) for test in tests}
    for attempt in range(times):
        for name, env in envs.items():
            run = _run_suite(f"{name}-again-{attempt + 1}", env, source, list(tests.values()), None, timeout, workdir)
            for test in tests:
                passed[test][name] += run.outcomes.get(test) == "passed"
    print(f"\nrun {times} more times each way, passed (direct, through anonproxy):")
    for test, counts in passed.items():
        print(f"  {test}: {counts['direct']}/{times}, {counts['anonproxy']}/{times}")


def _node_id(test: str) -> str | None:
    """pytest's id of a test from its JUnit id: ``tests.test_pool.TestPool::test_x`` is
    ``tests/test_pool.py::TestPool::test_x`` (asyncpg's tests are all methods of unittest classes); None for what
    is not a test method (a file that failed to import)."""
    classname, name = test.split("::", 1)
    if "." not in classname:
        return None
    module, cls = classname.rsplit(".", 1)
    return f"{module.replace('.', '/')}.py::{cls}::{name}"


def _run_suite(name: str, env: dict[str, str], source: Path, tests: list[str], keyword: str | None, timeout: int,
               workdir: Path) -> driver_suite.Run:
    report = workdir / f"{name}.xml"
    # -P: the checkout's directory is not put on sys.path, so the tests import the installed (compiled) asyncpg,
    # not the checkout's uncompiled source.
    command = [sys.executable, "-P", "-m", "pytest", *tests, f"--junitxml={report}", "-q",
               "-p", "no:cacheprovider", f"--timeout={timeout}"]
    if keyword:
        command += ["-k", keyword]
    print(f"\n== {name}: {env['PGHOST']}:{env['PGPORT']}", flush=True)
    output = workdir / f"{name}-pytest.log"
    start = time.monotonic()
    with output.open("w") as log:
        subprocess.run(command, cwd=source, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - start
    lines = output.read_text(errors="replace").splitlines()
    counts = [line for line in lines if SUMMARY.search(line)]  # warnings at the interpreter's exit may follow it
    print(counts[-1] if counts else "\n".join(lines[-40:]), flush=True)
    if not report.exists():
        raise RuntimeError(f"pytest wrote no report for the {name} run:\n" + "\n".join(lines[-80:]))
    return driver_suite.read_junit(name, report, seconds)


if __name__ == "__main__":
    sys.exit(main())
