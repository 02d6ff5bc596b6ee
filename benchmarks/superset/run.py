#!/usr/bin/env python3
"""A real Apache Superset against the proxy: which chart types work for `reporter` (suppress) and `analyst` (dp).

Installs apache-superset from PyPI into a virtual environment of its own (not
the project's: Superset pins many packages), starts `anonproxy up` on a free
port, gives the demo analyst a budget for the run, and runs charts.py in that
environment: Superset with a SQLite metadata database, the proxy registered
once per role, a dataset on public.adult, and the chart-data requests of
bar, pie, table (with row count), big number, line with series limit, pivot
table, histogram and box plot charts. Prints a markdown table. See README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

SUPERSET = "apache-superset==6.1.0"
# psycopg2: the driver of Superset's PostgreSQL engine spec. Superset 6.1.0's package requirements let pip
# choose versions it does not start with: rich (imported by its CLI, `superset db upgrade`) and cachetools
# (imported by its engine specs; older google-auth releases brought it in) are not required, and flask-caching
# 2.4 and later changed arguments Superset's cache manager passes.
EXTRAS = ("psycopg2-binary", "rich", "cachetools", "flask-caching==2.3.1")
HERE = Path(__file__).resolve().parent
DEFAULT_VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "anonproxy" / "superset-venv"
ROLES = ("reporter", "analyst")


def _load_corpus_runner() -> ModuleType:
    """benchmarks/bi_corpus/run.py, for its `anonproxy up` helpers (its name would clash with ours)."""
    spec = importlib.util.spec_from_file_location("bi_corpus_run", HERE.parent / "bi_corpus" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ensure_superset(venv: Path) -> Path:
    """The environment's python, with SUPERSET and EXTRAS installed (once; later runs reuse it)."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pinned = [requirement.split("==") for requirement in (SUPERSET, *EXTRAS) if "==" in requirement]
    check = ("import psycopg2, rich, cachetools; from importlib.metadata import version; "
             + "; ".join(f"assert version({name!r}) == {wanted!r}" for name, wanted in pinned))
    if subprocess.run([str(python), "-c", check], capture_output=True).returncode != 0:
        started = time.monotonic()
        print(f"installing {SUPERSET} into {venv} ...", file=sys.stderr, flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", SUPERSET, *EXTRAS], check=True)
        print(f"installed in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return python


def sqlalchemy_uri(url: str) -> str:
    """`anonproxy up`'s postgresql:// URL, for SQLAlchemy's psycopg2 dialect."""
    return url.replace("postgresql://", "postgresql+psycopg2://", 1)


def table(results: list[dict[str, object]]) -> str:
    charts = list(dict.fromkeys(str(r["chart"]) for r in results))
    cell = {(r["chart"], r["role"]): r for r in results}
    lines = ["| chart | " + " | ".join(f"{role}" for role in ROLES) + " |", "|---|" + "---|" * len(ROLES)]
    for chart in charts:
        cells = []
        for role in ROLES:
            result = cell.get((chart, role))
            if result is None:
                cells.append("not run")
            elif result["works"]:
                rows = result["rows"]
                cells.append("works" if rows is None else f"works ({rows} rows)" if rows else "answered, no row")
            else:
                cells.append("fails: " + str(result["error"]).replace("|", "\\|"))
        lines.append(f"| {chart} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"Superset's environment ({DEFAULT_VENV})")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--log", type=Path, help="write Superset's and the proxy's logs to this file")
    args = parser.parse_args()

    python = ensure_superset(args.venv)
    corpus_run = _load_corpus_runner()
    process, urls = corpus_run.start_up(corpus_run.free_port())
    try:
        corpus_run.raise_analyst_budget(urls["owner"])
        with tempfile.TemporaryDirectory(prefix="anonproxy-superset-") as home:
            job = {"home": home, "databases": {role: sqlalchemy_uri(urls[role]) for role in ROLES}}
            done = subprocess.run([str(python), str(HERE / "charts.py")], input=json.dumps(job),
                                  capture_output=True, text=True, timeout=1800)
    finally:
        proxy_log = corpus_run.stop_up(process)
    if args.log:
        args.log.write_text(f"--- Superset\n{done.stderr}\n--- anonproxy up\n{proxy_log}")
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not results:
        print(done.stdout[-5000:], done.stderr[-5000:], sep="\n", file=sys.stderr)
        return 1
    version = subprocess.run([str(python), "-c", "from importlib.metadata import version; "
                              "print(version('apache-superset'))"], capture_output=True, text=True).stdout.strip()
    print(f"Apache Superset {version} through anonproxy, per role:\n")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
