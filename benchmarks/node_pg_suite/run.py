#!/usr/bin/env python3
"""node-postgres's own tests, once directly against PostgreSQL and once through anonproxy: which tests differ.

The integration tests of node-postgres's pg package, and the mocha tests of its pg-cursor, pg-pool and
pg-query-stream packages, come from a checkout of node-postgres's repository given on the command line (it is not
part of this project); what they need besides node-postgres's own packages is installed by ``npm install`` beside
this script. Both runs use the same throwaway PostgreSQL (with TLS, as the proxy in front of it, for the suite's
SSL tests), database and login (``dba``, a direct role of the demo policy, made superuser as node-postgres's tests
expect of their login); the proxy runs with a service login, so the role goes through the policy's decision and is
relayed. See README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(REPO_ROOT))  # this checkout's anonproxy, the one whose proxy runs, not an installed copy
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # driver_suite, shared with the other driver's suite
sys.path.insert(0, str(REPO_ROOT / "tests"))  # the certificates of the tests

import driver_suite  # noqa: E402
from anonproxy.embedded import EmbeddedPostgres  # noqa: E402
from tls_network import Certificates, certificates  # noqa: E402

HOST = driver_suite.HOST
DATABASE = "node_pg_suite"
ROLE = driver_suite.ROLE
DEFAULT_TESTS = ("test/integration",)  # relative to packages/pg, as the Makefile's test-integration
# The checkout's own packages the tests require; pg-protocol is TypeScript and is compiled for the run.
LINKED_PACKAGES = ("pg", "pg-pool", "pg-connection-string", "pg-cursor", "pg-query-stream")
# node-postgres's other packages whose mocha tests talk to a server (the repository's `yarn test` runs them too).
MOCHA_PACKAGES = ("pg-cursor", "pg-pool", "pg-query-stream")
MOCHA_TEST_TIMEOUT_MS = "10000"  # mocha's default of 2 s is short on a loaded 2-core machine
REPORTER = HERE / "report.js"  # records each test's outcome (node --require)
MOCHA = HERE / "node_modules" / "mocha" / "bin" / "mocha.js"
TSC = HERE / "node_modules" / "typescript" / "bin" / "tsc"


@dataclass(frozen=True)
class Unit:
    """One node process of the suite: an integration test file of pg, or one package's mocha tests."""
    name: str  # the file's path relative to packages/pg, or the package's name
    directory: Path  # where the process runs
    mocha: bool


@dataclass(frozen=True)
class Run:
    name: str
    outcomes: dict[str, str]  # id ("file" or "package", "file::test" or "package::test") -> passed | failed | skipped
    messages: dict[str, str]  # test id -> the first line of what the failing file printed about it
    seconds: float


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("node_postgres_source", type=Path, help="a checkout of node-postgres's repository")
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS),
                        help="test files or directories relative to packages/pg (default: test/integration)")
    parser.add_argument("-k", dest="keyword", help="run only the integration test files whose path contains this")
    parser.add_argument("--packages", nargs="*", default=list(MOCHA_PACKAGES), choices=MOCHA_PACKAGES,
                        help="the packages whose mocha tests run too (default: all three; none when given alone)")
    parser.add_argument("--workers", type=int, default=2, help="anonproxy worker processes (default 2)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test file before it counts as failed")
    parser.add_argument("--tls", action="store_true",
                        help="every connection of the suite in TLS (PGSSLMODE=verify-full, the run's CA trusted)")
    parser.add_argument("--json", type=Path, help="also write both runs' outcomes here")
    parser.add_argument("--direct-json", type=Path,
                        help="take the direct run from this earlier --json output instead of running it again")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the server and the proxy are stopped
    package = args.node_postgres_source.resolve() / "packages" / "pg"
    if not (package / "test" / "suite.js").is_file():
        print(f"{args.node_postgres_source} is not a checkout of node-postgres (no packages/pg/test/suite.js)",
              file=sys.stderr)
        return 2
    if not MOCHA.is_file() or not TSC.is_file():
        print(f"the suite's own packages are missing: run `npm install --prefix {HERE}` first", file=sys.stderr)
        return 2
    files = _test_files(package, args.tests, args.keyword)
    print(f"node {_output(['node', '--version'])}, pg {_package_version(package)} from {package.parents[1]} "
          f"({_describe(package)}): {len(files)} test files, mocha tests of {', '.join(args.packages) or 'none'}",
          flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-node-pg-") as tmp, \
            certificates(["localhost"], [HOST], ROLE) as certs, \
            EmbeddedPostgres(settings={"max_connections": "200", "ssl": "on", "ssl_cert_file": str(certs.server_cert),
                                       "ssl_key_file": str(certs.server_key)}) as server:
        workdir = Path(tmp)
        node_path = _node_modules(package.parent, workdir)
        units = [Unit(file, package, mocha=False) for file in files] + \
            [Unit(name, _mocha_directory(package.parent / name, workdir), mocha=True) for name in args.packages]
        driver_suite.prepare(server, DATABASE)
        direct = _load_run(args.direct_json, "direct") if args.direct_json else \
            _run_suite("direct", _suite_env(server.port, node_path, certs if args.tls else None), units, args.timeout)
        proxy, port = driver_suite.start_proxy(server, DATABASE, workdir, args.workers,
                                                  (certs.server_cert, certs.server_key))
        try:
            via = _run_suite("anonproxy", _suite_env(port, node_path, certs if args.tls else None), units,
                             args.timeout)
        finally:
            driver_suite.stop(proxy)
        proxy_log = (workdir / "anonproxy.log").read_text(errors="replace")
    _report(direct, via)
    if "Traceback" in proxy_log:
        print("\nthe proxy's log holds a traceback:\n" + proxy_log[proxy_log.index("Traceback"):][:4000])
    if args.json:
        args.json.write_text(json.dumps({run.name: {"seconds": run.seconds, "outcomes": run.outcomes,
                                                    "messages": run.messages} for run in (direct, via)}, indent=1))
    return 0


def _output(command: list[str], cwd: Path | None = None) -> str:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def _describe(package: Path) -> str:
    """The checkout's tag or commit, when it is a git checkout."""
    return _output(["git", "describe", "--tags", "--always"], cwd=package) or "not a git checkout"


def _package_version(package: Path) -> str:
    return str(json.loads((package / "package.json").read_text())["version"])


def _test_files(package: Path, tests: list[str], keyword: str | None) -> list[str]:
    """The ``*-tests.js`` files under the given paths, as the Makefile finds them, relative to packages/pg."""
    found: set[str] = set()
    for test in tests:
        path = package / test
        candidates = [path] if path.is_file() else path.rglob("*-tests.js")
        found.update(str(file.relative_to(package)) for file in candidates)
    return sorted(file for file in found if keyword is None or keyword in file)


def _node_modules(packages: Path, workdir: Path) -> str:
    """NODE_PATH for the run: the checkout's own packages first, then what npm installed beside this script.

    The checkout itself is left as it is: pg-protocol is compiled into the work directory, the plain JavaScript
    packages are linked there.
    """
    modules = workdir / "node_modules"
    protocol, source = modules / "pg-protocol", packages / "pg-protocol"
    protocol.mkdir(parents=True)
    shutil.copy(source / "package.json", protocol / "package.json")
    _compile([source / "src" / "index.ts"], source / "src", protocol / "dist")
    for name in LINKED_PACKAGES:
        (modules / name).symlink_to(packages / name)
    return os.pathsep.join([str(modules), str(HERE / "node_modules")])


def _mocha_directory(package: Path, workdir: Path) -> Path:
    """Where a package's mocha tests run: the package itself, or for pg-query-stream (TypeScript) a compiled copy of
    its source and tests, as the repository's ts-node would run them."""
    if not (package / "src" / "index.ts").is_file():
        return package
    build = workdir / package.name
    _compile([package / "src" / "index.ts", *sorted((package / "test").glob("*.ts"))], package, build)
    return build


def _compile(sources: list[Path], root: Path, out: Path) -> None:
    """TypeScript to JavaScript, without type checks (they need the packages' type declarations, not the run)."""
    subprocess.run(["node", str(TSC), "--ignoreConfig", "--noCheck", *map(str, sources), "--rootDir", str(root),
                    "--outDir", str(out), "--module", "node16", "--moduleResolution", "node16", "--target", "es6",
                    "--esModuleInterop"], check=True)


def _suite_env(port: int, node_path: str, tls: Certificates | None) -> dict[str, str]:
    """The variables the tests read: libpq's for the login, SCRAM_TEST_* for the SCRAM tests (same login); with
    ``tls``, PGSSLMODE for every connection and the CA that signed the server's (and the proxy's) certificate."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PG", "SCRAM_TEST_"))}
    login = {"HOST": HOST, "PORT": str(port), "USER": ROLE, "PASSWORD": ROLE, "DATABASE": DATABASE}
    env.update({f"PG{key}": value for key, value in login.items()})
    env.update({f"SCRAM_TEST_PG{key}": value for key, value in login.items()})
    env["NODE_PATH"] = node_path
    if tls is not None:  # node reads the CA from NODE_EXTRA_CA_CERTS, psql (gh-issues/130) from PGSSLROOTCERT
        env.update(PGSSLMODE="verify-full", NODE_EXTRA_CA_CERTS=str(tls.ca), PGSSLROOTCERT=str(tls.ca))
    return env


def _run_suite(name: str, env: dict[str, str], units: list[Unit], timeout: int) -> Run:
    """Each unit in its own node process, one after the other (each integration file alone, as the Makefile's
    ``xargs -n 1`` runs them)."""
    print(f"\n== {name}: {env['PGHOST']}:{env['PGPORT']}{' in TLS' if 'PGSSLMODE' in env else ''}", flush=True)
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="node-pg-report-") as tmp:
        for number, unit in enumerate(units):
            report = Path(tmp) / f"{number}.json"
            began = time.monotonic()
            code, output = _run_unit(unit, env, report, timeout)
            unit_outcomes, unit_messages = (_read_mocha if unit.mocha else _read_report)(unit.name, code, report)
            outcomes.update(unit_outcomes)
            messages.update(unit_messages)
            if code != 0:
                message = _first_error(output.splitlines()) or f"exit status {code}"
                messages.update({test: message for test, outcome in unit_outcomes.items()
                                 if outcome == "failed" and test not in messages})
            print(f"  {unit.name}: {outcomes[unit.name]} ({time.monotonic() - began:.1f} s)", flush=True)
    seconds = time.monotonic() - start
    print(f"{name}: {dict(Counter(outcomes.values()))} in {seconds:.0f} s", flush=True)
    return Run(name, outcomes, messages, seconds)


def _run_unit(unit: Unit, env: dict[str, str], report: Path, timeout: int) -> tuple[int | None, str]:
    """The process's exit status (None when killed at the timeout) and what it printed; the outcomes go to
    ``report`` (report.js's lines, or mocha's JSON reporter)."""
    if unit.mocha:
        command = ["node", str(MOCHA), "--reporter", "json", "--reporter-option", f"output={report}",
                   "--timeout", MOCHA_TEST_TIMEOUT_MS, "test/*.js"]
    else:
        command = ["node", "--require", str(REPORTER), unit.name]
        env = {**env, "NODE_PG_SUITE_REPORT": str(report)}
    try:
        done = subprocess.run(command, cwd=unit.directory, env=env, capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        return None, _text(expired.stdout) + _text(expired.stderr) + f"\nkilled after {timeout} s"


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _read_report(file: str, code: int | None, report: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The file's outcome (its exit status) and its named tests' outcomes (from report.js's lines); no messages."""
    outcomes: dict[str, str] = {file: "passed" if code == 0 else "failed"}
    started: dict[str, str] = {}  # a test's name -> its id (a file can name two tests alike)
    lines = report.read_text().splitlines() if report.exists() else []
    for event in map(json.loads, lines):
        test = f"{file}::{event['test']}"
        if event["event"] == "start":
            started[event["test"]] = test = _unique(test, outcomes)
            outcomes[test] = "failed" if event["body"] else "skipped"  # until it is done
        elif outcomes[started[event["test"]]] == "failed":
            outcomes[started[event["test"]]] = "passed"
    return outcomes, {}


def _read_mocha(package: str, code: int | None, report: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The package's outcome (mocha's exit status), its tests' outcomes and the failures' messages (mocha's JSON)."""
    outcomes: dict[str, str] = {package: "passed" if code == 0 else "failed"}
    messages: dict[str, str] = {}
    found = json.loads(report.read_text()) if report.exists() else {}
    for key, outcome in (("passes", "passed"), ("failures", "failed"), ("pending", "skipped")):
        for test in found.get(key, []):
            name = _unique(f"{package}::{test['fullTitle']}", outcomes)
            outcomes[name] = outcome
            if outcome == "failed":
                messages[name] = str(test["err"].get("message", "")).split("\n")[0][:200]
    return outcomes, messages


def _unique(test: str, seen: dict[str, str]) -> str:
    """The second test of a file or package named alike is ``name #2``."""
    number, candidate = 1, test
    while candidate in seen:
        number += 1
        candidate = f"{test} #{number}"
    return candidate


def _first_error(lines: list[str]) -> str:
    for line in lines:
        if "Error" in line or "killed after" in line:
            return line.strip()[:200]
    return ""


def _load_run(path: Path, name: str) -> Run:
    saved = json.loads(path.read_text())[name]
    return Run(name, saved["outcomes"], saved["messages"], saved["seconds"])


def _report(direct: Run, via: Run) -> None:
    print("\n| run | processes | passed | failed | tests | passed | failed | skipped | seconds |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for run in (direct, via):
        files = Counter(outcome for test, outcome in run.outcomes.items() if "::" not in test)
        tests = Counter(outcome for test, outcome in run.outcomes.items() if "::" in test)
        print(f"| {run.name} | {sum(files.values())} | {files['passed']} | {files['failed']} | "
              f"{sum(tests.values())} | {tests['passed']} | {tests['failed']} | {tests['skipped']} | "
              f"{run.seconds:.0f} |")
    everything = sorted(set(direct.outcomes) | set(via.outcomes))
    differ = [test for test in everything if direct.outcomes.get(test) != via.outcomes.get(test)]
    print(f"\n{len(differ)} processes or tests differ (direct -> through anonproxy):")
    for test in differ:
        message = via.messages.get(test) or direct.messages.get(test) or ""
        print(f"  {test}: {direct.outcomes.get(test, 'absent')} -> {via.outcomes.get(test, 'absent')}"
              f"{'  | ' + message if message else ''}")


if __name__ == "__main__":
    sys.exit(main())
